"""How a PyTorch Mamba checkpoint names its tensors, and how each lands in the latim-jax parameter tree.

The three torch layouts (Hugging Face, mamba_ssm, Codestral) share the block and mixer names; they
differ only in the embedding's name (``backbone.embeddings.weight`` in Hugging Face,
``backbone.embedding.weight`` in mamba_ssm; both are accepted everywhere), in a ``model.`` prefix
(Codestral), and in whether a tied ``lm_head.weight`` is stored (mamba_ssm stores it; it must then
equal the embedding). Orientation, torch -> latim-jax (see ``latim_jax.model.config.param_shapes``):

    Linear weight (out, in)            -> (in, out)        y = x @ W
    depthwise Conv1d weight (C, 1, k)  -> (k, C)           conv_w[k-1] multiplies the current token
    everything else                    -> as stored        (A_log, D, biases, norm weights)

:func:`params_from_tensors` checks every key and shape before it reads any data, consumes every key,
and fails naming the file, the key and expected vs found on any mismatch. Where each family keeps its
tensors (the hybrids' sublayer norms and module prefixes, fused weights) is :mod:`.naming`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import ml_dtypes
import numpy as np

from latim_jax.model.config import MambaConfig, param_shapes

from .errors import CheckpointError
from .naming import (
    CONV,
    GATE_HALF,
    LINEAR,
    SAME,
    STACKED,
    STACKED_GATE_HALF,
    STACKED_UP_HALF,
    UP_HALF,
    naming,
)
from .tensors import TensorFiles


@dataclasses.dataclass(frozen=True)
class TorchTensor:
    """One expected checkpoint tensor: its accepted names, where it goes, and its orientation."""

    names: tuple[str, ...]  # accepted names; the first is the canonical one
    path: tuple[str | int, ...]  # location in the param tree
    orientation: str  # LINEAR, CONV or SAME
    shape: tuple[int, ...]  # shape in the param tree (latim-jax orientation)

    @property
    def torch_shape(self) -> tuple[int, ...]:
        """The shape the checkpoint must store."""
        if self.orientation == LINEAR:
            return tuple(reversed(self.shape))
        if self.orientation in (GATE_HALF, UP_HALF):  # half of a fused (2 out, in) weight or (2 out,) bias
            return (2 * self.shape[0],) if len(self.shape) == 1 else (2 * self.shape[1], self.shape[0])
        if self.orientation == STACKED:
            return (self.shape[0], self.shape[2], self.shape[1])
        if self.orientation in (STACKED_GATE_HALF, STACKED_UP_HALF):
            return (self.shape[0], 2 * self.shape[2], self.shape[1])
        if self.orientation == CONV:
            k, c = self.shape
            return (c, 1, k)
        return self.shape

    def to_param(self, array: np.ndarray) -> np.ndarray:
        """The stored array in latim-jax orientation (C-contiguous)."""
        if self.orientation == LINEAR:
            array = array.T
        elif self.orientation in (GATE_HALF, UP_HALF):
            half = array.shape[0] // 2
            array = (array[:half] if self.orientation == GATE_HALF else array[half:]).T
        elif self.orientation == STACKED:
            array = array.transpose(0, 2, 1)
        elif self.orientation in (STACKED_GATE_HALF, STACKED_UP_HALF):
            half = array.shape[1] // 2
            part = array[:, :half] if self.orientation == STACKED_GATE_HALF else array[:, half:]
            array = part.transpose(0, 2, 1)
        elif self.orientation == CONV:
            array = array[:, 0, :].T
        return np.ascontiguousarray(array)


def torch_layout(config: MambaConfig, *, prefix: str = "") -> list[TorchTensor]:
    """Every tensor a torch checkpoint of ``config`` must hold, in order (tied lm_head excluded)."""
    shapes = param_shapes(config)
    names = naming(config.family)
    out = [TorchTensor(tuple(prefix + n for n in names.embedding), ("embedding",), SAME, shapes["embedding"])]
    for i, layer in enumerate(shapes["layers"]):
        kind = config.kinds[i]
        norm, base = names.sublayer(i, kind, config.kinds)
        out.append(TorchTensor((prefix + norm,), ("layers", i, "norm"), SAME, layer["norm"]))
        table = names.mixers[kind]
        for name, shape in layer["mixer"].items():
            torch_name, orientation = table[name]
            path = ("layers", i, "mixer", name)
            out.append(TorchTensor((prefix + base + torch_name,), path, orientation, shape))
    out.append(TorchTensor((prefix + names.norm_f,), ("norm_f",), SAME, shapes["norm_f"]))
    if "lm_head" in shapes:
        out.append(TorchTensor((prefix + "lm_head.weight",), ("lm_head",), SAME, shapes["lm_head"]))
    return out


def params_from_tensors(
    config: MambaConfig, tensors: TensorFiles, *, prefix: str = "", dtype: Any = None
) -> dict[str, Any]:
    """The latim-jax parameter tree of ``config`` from a torch-layout checkpoint.

    Every expected tensor must be present with its exact shape, and every stored tensor must be used
    (a tied ``lm_head.weight`` is used by checking it equals the embedding). All names and shapes are
    checked before any data is read. Arrays keep their stored dtype unless ``dtype`` is given.
    """
    target = as_dtype(dtype)
    layout = torch_layout(config, prefix=prefix)
    found = {spec.path: _find_and_check(config, tensors, spec) for spec in layout}
    tied_head = _tied_head(config, tensors, prefix, found[("embedding",)])
    _check_all_used(config, tensors, set(found.values()) | ({tied_head} if tied_head else set()))
    params = _empty_tree(config)
    for spec in layout:
        name = found[spec.path]
        array = _checked_float(tensors, name)  # a derived tensor comes exact (fp32): cast once, here
        _put(params, spec.path, _cast(spec.to_param(array), target or tensors.stored_dtype(name)))
    if tied_head:
        _check_tied_head(tensors, tied_head, found[("embedding",)])
    return params


def as_dtype(dtype: Any) -> np.dtype | None:
    """``None`` or a numpy dtype from a dtype-like ("float32", "bfloat16", jnp.bfloat16, ...)."""
    if dtype is None:
        return None
    try:
        target = np.dtype(dtype)
    except TypeError as err:
        raise ValueError(f"unknown dtype {dtype!r}") from err
    if not _is_float(target):
        raise ValueError(f"parameters can only be cast to a floating dtype, not {target}")
    return target


def path_str(path: tuple[str | int, ...]) -> str:
    """A param-tree path as text: ``layers[0].mixer.in_proj``."""
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else part)
    return text


def _find_and_check(config: MambaConfig, tensors: TensorFiles, spec: TorchTensor) -> str:
    present = [n for n in spec.names if n in tensors]
    if not present:
        alias = f" (or {list(spec.names[1:])})" if len(spec.names) > 1 else ""
        unused = sorted(set(tensors.keys()) - _all_names(config, tensors))
        hint = f"; stored keys not used by this config: {unused[:5]}" if unused else ""
        raise CheckpointError(
            f"missing tensor{alias} for {path_str(spec.path)}{hint}",
            file=tensors.label,
            key=spec.names[0],
            expected=f"shape {spec.torch_shape}",
            found="no such key",
        )
    if len(present) > 1:
        raise CheckpointError(
            f"two names for {path_str(spec.path)}",
            file=tensors.file_of(present[1]),
            key=present[1],
            expected=f"only {present[0]}",
            found=f"both {present}",
        )
    name = present[0]
    shape = tensors.shape(name)
    if shape != spec.torch_shape:
        raise CheckpointError(
            f"wrong shape for {path_str(spec.path)} {_size_hint(config)}",
            file=tensors.file_of(name),
            key=name,
            expected=spec.torch_shape,
            found=shape,
        )
    return name


def _tied_head(config: MambaConfig, tensors: TensorFiles, prefix: str, embedding: str) -> str | None:
    name = prefix + "lm_head.weight"
    if not config.tie_embeddings or name not in tensors:
        return None
    if tensors.shape(name) != tensors.shape(embedding):
        raise CheckpointError(
            "tied embeddings, but the stored lm_head has another shape than the embedding",
            file=tensors.file_of(name),
            key=name,
            expected=tensors.shape(embedding),
            found=tensors.shape(name),
        )
    return name


def _check_tied_head(tensors: TensorFiles, head: str, embedding: str) -> None:
    a, b = tensors.read(head), tensors.read(embedding)
    if a.dtype != b.dtype or not np.array_equal(a.view(np.uint8), b.view(np.uint8)):
        raise CheckpointError(
            "the config ties embeddings, but the stored lm_head differs from the embedding",
            file=tensors.file_of(head),
            key=head,
            expected=f"a copy of {embedding}",
            found="different values",
        )


def _check_all_used(config: MambaConfig, tensors: TensorFiles, used: set[str]) -> None:
    extra = [k for k in tensors.keys() if k not in used]
    if extra:
        raise CheckpointError(
            f"tensor not used by the configured model {_size_hint(config)}; {len(extra)} unused: {extra[:5]}",
            file=tensors.file_of(extra[0]),
            key=extra[0],
            expected="no such key",
            found=f"shape {tensors.shape(extra[0])}",
        )


def _all_names(config: MambaConfig, tensors: TensorFiles) -> set[str]:
    root = naming(config.family).root
    prefixes = {""} | {k[: k.index(root)] for k in tensors.keys() if root in k}
    names = set()
    for prefix in prefixes:
        for spec in torch_layout(config, prefix=prefix):
            names.update(spec.names)
        names.add(prefix + "lm_head.weight")
    return names


def _checked_float(tensors: TensorFiles, name: str) -> np.ndarray:
    array = tensors.read(name)
    if not _is_float(array.dtype):
        raise CheckpointError(
            "not a floating-point tensor",
            file=tensors.file_of(name),
            key=name,
            expected="float",
            found=array.dtype,
        )
    return array


def _is_float(dtype: np.dtype) -> bool:
    return dtype.kind == "f" or dtype == np.dtype(ml_dtypes.bfloat16)


def _cast(array: np.ndarray, dtype: np.dtype | None) -> np.ndarray:
    return array if dtype is None or array.dtype == dtype else array.astype(dtype)


def _empty_tree(config: MambaConfig) -> dict[str, Any]:
    shapes = param_shapes(config)
    tree: dict[str, Any] = {k: None for k in shapes if k != "layers"}
    tree["layers"] = [{"norm": None, "mixer": {}} for _ in shapes["layers"]]
    return tree


def _put(tree: Any, path: tuple[str | int, ...], value: np.ndarray) -> None:
    for part in path[:-1]:
        tree = tree[part]
    tree[path[-1]] = value


def _size_hint(config: MambaConfig) -> str:
    c = config
    family = f"{c.family}, " if c.family else ""
    text = f"({family}Mamba-{c.version}: d_model={c.d_model}, n_layers={c.n_layers}, vocab={c.vocab_size}"
    text += f", d_state={c.d_state}"
    if c.version == 2:
        text += f", head_dim={c.head_dim}, n_groups={c.n_groups}"
    return text + ")"
