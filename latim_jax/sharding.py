"""Device meshes: where parameters live, how a call is split, and the runtime passed down to the kernels.

A mesh has two named axes (either may be absent or of size 1):

- "data": prompts. The batch is split over it (padded with dummy masked prompts to a multiple).
- "model": the layer computation. Parameters are laid out model-parallel over the inner channels
  (Mamba-1) / heads (Mamba-2) - in_proj by columns, out_proj by rows, conv, A, D, dt, norms by channel
  - so a model too big for one device fits; the residual stream stays replicated over "model". The
  score stage then splits the target rows over "model" (rows are independent given the layer's
  factors), which is what lets one long prompt use every device.

Under jit, XLA's SPMD partitioner places the pure-JAX (XLA) path from these shardings. Pallas kernels
are custom calls it cannot partition, so the dispatcher wraps each in ``jax.shard_map``: the scans
over (batch on "data", channels / heads on "model"), the fused score kernel over (batch on "data",
target rows on "model"). Channel-parallel scans need no cross-shard carry (each channel or head is an
independent recurrence); Mamba-2 heads of one B/C group may land on different devices, so each shard
gathers the groups of its own heads.

:class:`Runtime` bundles the kernel choice (``impl``) with the mesh; it is hashable, so it travels as
a static argument wherever ``impl`` did.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

DATA, MODEL = "data", "model"
AXES = (DATA, MODEL)
__all__ = ["AXES", "DATA", "MODEL", "P", "Runtime", "gather", "pad_batch", "put", "shard"]


@dataclasses.dataclass(frozen=True)
class Runtime:
    """How to run: ``impl`` ("auto" | "xla" | "pallas") and an optional mesh (axes "data", "model")."""

    impl: str = "auto"
    mesh: Mesh | None = None

    def axis_size(self, name: str) -> int:
        """Size of mesh axis ``name`` (1 without a mesh or without that axis)."""
        if self.mesh is None or name not in self.mesh.axis_names:
            return 1
        return int(self.mesh.shape[name])

    def axis(self, name: str) -> str | None:
        """``name`` when the mesh has that axis with size > 1, else None (a replicated dimension)."""
        return name if self.axis_size(name) > 1 else None


def as_runtime(impl) -> Runtime:
    """A :class:`Runtime` from an ``impl`` string or a Runtime."""
    return impl if isinstance(impl, Runtime) else Runtime(impl=impl)


def impl_name(impl) -> str:
    """The kernel choice of an ``impl`` string or :class:`Runtime`."""
    return impl.impl if isinstance(impl, Runtime) else impl


def check_mesh(mesh: Mesh) -> Mesh:
    """Validate a user mesh and return it with Auto axis types (XLA propagates the shardings).

    Its axis names must be a subset of ("data", "model"); ``jax.make_mesh`` meshes (Explicit axes by
    default) are accepted and converted.
    """
    if not isinstance(mesh, Mesh):
        raise ValueError(f"mesh must be a jax.sharding.Mesh, found {type(mesh).__name__}")
    unknown = [n for n in mesh.axis_names if n not in AXES]
    if unknown:
        raise ValueError(f"mesh axes must be named from {AXES}, found {mesh.axis_names}")
    auto = getattr(jax.sharding, "AxisType", None)
    if auto is None:
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(auto.Auto,) * len(mesh.axis_names))


# --------------------------------------------------------------------------------------------------
# Parameter layout
# --------------------------------------------------------------------------------------------------

# parameter name -> the axis that holds inner channels / heads ("model"-parallel); others replicate
_CHANNEL_AXIS = {
    "in_proj": 1,
    "in_proj_b": 0,
    "conv_w": 1,
    "conv_b": 0,
    "x_proj": 0,
    "dt_proj": 1,
    "dt_bias": 0,
    "A_log": 0,
    "D": 0,
    "norm_w": 0,
    "out_proj": 0,
}


def param_spec(name: str, shape: tuple[int, ...], model_size: int) -> P:
    """The PartitionSpec of one mixer parameter: its channel axis on "model" when divisible, else
    replicated (a model axis that does not divide a dimension leaves that parameter whole)."""
    axis = _CHANNEL_AXIS.get(name)
    if axis is None or model_size <= 1 or shape[axis] % model_size:
        return P()
    spec = [None] * len(shape)
    spec[axis] = MODEL
    return P(*spec)


def shard(model, mesh: Mesh):
    """Lay ``model``'s parameters out on ``mesh`` (in place; returns the model).

    Mixer parameters are split over "model" along their inner-channel / head axis (see
    :data:`_CHANNEL_AXIS`; dimensions the axis size does not divide stay whole), the embedding and
    head over "model" along the vocabulary when it divides, norms replicated; everything is
    replicated over "data".
    """
    mesh = check_mesh(mesh)
    m = Runtime(mesh=mesh).axis_size(MODEL)
    for block in model.layers:
        for name in list(_CHANNEL_AXIS) + ["in_proj_b", "out_proj_b"]:
            param = getattr(block.mixer, name, None)
            if param is None:
                continue
            spec = param_spec(name, param[...].shape, m) if name != "out_proj_b" else P()
            param.set_value(jax.device_put(param[...], NamedSharding(mesh, spec)))
        block.norm.set_value(jax.device_put(block.norm[...], NamedSharding(mesh, P())))
    for name in ("embedding", "lm_head"):
        param = getattr(model, name, None)
        if param is None:
            continue
        vocab = param[...].shape[0]
        spec = P(MODEL, None) if m > 1 and vocab % m == 0 else P()
        param.set_value(jax.device_put(param[...], NamedSharding(mesh, spec)))
    model.norm_f.set_value(jax.device_put(model.norm_f[...], NamedSharding(mesh, P())))
    return model


def on_mesh(model, mesh: Mesh) -> bool:
    """Whether every parameter of ``model`` lives on exactly ``mesh``'s devices."""
    want = set(mesh.devices.flat)
    leaves = jax.tree.leaves(model.params())
    return all(set(x.sharding.device_set) == want for x in leaves if hasattr(x, "sharding"))


# --------------------------------------------------------------------------------------------------
# Inputs and outputs of a sharded call
# --------------------------------------------------------------------------------------------------


def pad_batch(x, multiple: int, *, edge: bool = True):
    """Pad axis 0 of an array to a multiple of ``multiple``, repeating the last entry (``edge``: a
    real prompt, so padding prompts never hold degenerate all-padding rows)."""
    if x is None:
        return None
    extra = (-x.shape[0]) % multiple
    if not extra:
        return x
    pad = [(0, extra)] + [(0, 0)] * (x.ndim - 1)
    return jnp.pad(jnp.asarray(x), pad, mode="edge" if edge else "constant")


def put(x, mesh: Mesh, spec: P):
    """Place a host-global array on ``mesh`` (every process passes the same full array; under several
    processes each contributes the shards of its own devices)."""
    if x is None:
        return None
    sharding = NamedSharding(mesh, spec)
    if jax.process_count() == 1:
        return jax.device_put(x, sharding)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def gather(tree: Any):
    """Every array of ``tree`` fully on this host (process_allgather where a multi-process array is
    not fully addressable)."""

    def one(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            from jax.experimental import multihost_utils

            return jnp.asarray(multihost_utils.process_allgather(x, tiled=True))
        return x

    return jax.tree.map(one, tree)


def constrain(x, runtime, spec: P):
    """with_sharding_constraint(x, spec) on the runtime's mesh; a no-op without a mesh."""
    runtime = as_runtime(runtime)
    if runtime.mesh is None:
        return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(runtime.mesh, spec))
