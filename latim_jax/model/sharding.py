"""The model's parameter layout on a device mesh, and the execution context of a call on it.

:func:`shard` splits each mixer parameter over the mesh's "model" axis along its inner-channel / head
axis (its kind's ``LayerKind.channel_axis`` table; a dimension the axis size does not divide stays whole), a
Mamba layer's in_proj and conv first reordered so that each shard's column block holds the matching
slice of every part (:mod:`latim_jax.model.channel_layout`: the layer's channels stay on their shard
from in_proj to out_proj, whose sums are the forward's one all-reduce per layer), the
embedding and head over "model" along the vocabulary when it divides, and replicates the norms;
everything is replicated over "data" and "seq". :func:`context` is what every public entry point calls once:
it validates the mesh, lays the model out on it unless it already is, and resolves ``impl``.
"""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from latim_jax.model.channel_layout import fits
from latim_jax.model.kind import kind_of, sequence_kinds
from latim_jax.model.mixers import Mamba1Mixer, Mamba2Mixer
from latim_jax.parallel.context import Context, resolve
from latim_jax.parallel.mesh import MODEL, SEQ, P, check_mesh

MAMBA_MIXERS = (Mamba1Mixer, Mamba2Mixer)


def param_spec(axis: int | None, shape: tuple[int, ...], model_size: int) -> P:
    """The PartitionSpec of one mixer parameter whose channel axis is ``axis`` (None: none, from its
    kind's ``channel_axis``): that axis on "model" when divisible, else replicated (a model axis that
    does not divide a dimension leaves that parameter whole)."""
    if axis is None or model_size <= 1 or shape[axis] % model_size:
        return P()
    spec = [None] * len(shape)
    spec[axis] = MODEL
    return P(*spec)


def _mamba(block):
    """The block's Mamba mixer, alone or the part of a composed one, or None."""
    ssm = getattr(block.mixer, "ssm", block.mixer)
    return ssm if isinstance(ssm, MAMBA_MIXERS) else None


def _shards(model, ssm, m: int) -> int:
    """The shards a Mamba mixer is laid out for on a "model" axis of m: m when it fits, else 1."""
    return m if fits(model.config, ssm.kind, m) else 1


def shard(model, mesh: Mesh):
    """Lay ``model``'s parameters out on ``mesh`` (in place; returns the model). See the module
    docstring for the layout."""
    mesh = check_mesh(mesh)
    m = Context(mesh=mesh).axis_size(MODEL)

    def put(param, spec):
        param.set_value(jax.device_put(param[...], NamedSharding(mesh, spec)))

    for block in model.layers:
        mixer, ssm = block.mixer, _mamba(block)
        if ssm is not None:  # in_proj and the conv in shard-matched column blocks
            ssm.lay_out(_shards(model, ssm, m))
        axes = kind_of(block.kind).channel_axis
        for name in mixer.param_names():  # the held values: no read-back to the checkpoint's order
            param = mixer.param(name)
            put(param, param_spec(axes.get(name), param[...].shape, m))
        put(block.norm, P())
    for name in ("embedding", "lm_head"):
        param = getattr(model, name, None)
        if param is not None:
            vocab = param[...].shape[0]
            put(param, P(MODEL, None) if m > 1 and vocab % m == 0 else P())
    put(model.norm_f, P())
    return model


def on_mesh(model, mesh: Mesh) -> bool:
    """Whether every parameter of ``model`` lives on exactly ``mesh``'s devices, each Mamba layer laid
    out for the mesh's "model" axis."""
    want = set(mesh.devices.flat)
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    m = Context(mesh=mesh).axis_size(MODEL)
    for block in model.layers:
        ssm = _mamba(block)
        if ssm is not None and ssm.layout.shards != _shards(model, ssm, m):
            return False
    return all(set(x.sharding.device_set) == want for x in leaves if hasattr(x, "sharding"))


def check_sequence(model, mesh: Mesh, *, sequence: bool) -> None:
    """Refuse a mesh whose "seq" axis splits the length where the call or a layer kind cannot: the
    forward (logits: ``MambaLM.forward`` / ``__call__``) and :func:`latim_jax.attribute` split it
    (``sequence`` True), and only over the kinds that declare it (``LayerKind.splits_sequence``:
    :func:`latim_jax.model.kind.sequence_kinds`)."""
    d = Context(mesh=mesh).axis_size(SEQ)
    if d <= 1:
        return
    if not sequence:
        raise ValueError(
            f'the mesh\'s "seq" axis (size {d}) splits the forward (logits) and attribute only; this call '
            'runs on meshes over "data" and "model"'
        )
    for i, block in enumerate(model.layers):
        if not kind_of(block.kind).splits_sequence:
            raise ValueError(
                f"layer {i} is a {block.kind!r} layer, whose forward cannot split the length over the "
                f'mesh\'s "seq" axis yet (kinds that can: {", ".join(sequence_kinds())}); use a mesh over '
                '"data" and "model"'
            )


def context(model, impl="auto", mesh: Mesh | None = None, *, sequence: bool = False) -> Context:
    """The execution context of a call on ``model``: ``impl`` resolved (:func:`latim_jax.parallel.
    context.resolve`) and, with a mesh, the model laid out on it first (in place) unless it already is.
    ``sequence``: the call can split the length over a "seq" axis (the forward, attribute); else such a
    mesh is refused (:func:`check_sequence`)."""
    if mesh is None:
        return resolve(impl)
    mesh = check_mesh(mesh)
    check_sequence(model, mesh, sequence=sequence)
    if not on_mesh(model, mesh):
        shard(model, mesh)
    return resolve(impl, mesh)
