"""Named tensors out of checkpoint files, as numpy arrays: safetensors (single or sharded) without torch,
PyTorch pickles (``pytorch_model.bin``) through a lazily imported ``torch.load(weights_only=True)``.

:class:`TensorFiles` opens every file up front (so a truncated or corrupt file fails before any work),
answers shapes from the headers, and reads a tensor's data only when asked, so a converter can check
every key and shape before it reads gigabytes. bfloat16 comes back as ``ml_dtypes.bfloat16``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy, which safetensors' numpy API needs)
import numpy as np

from .errors import CheckpointError

INDEX_SUFFIX = ".index.json"


class TensorFiles:
    """Lazy, read-only access to the tensors of one checkpoint, possibly spread over several files.

    Use as a context manager (or call :meth:`close`) to release the open files.
    """

    def __init__(self) -> None:
        self._sources: dict[str, _Source] = {}
        self._opened: list[_Source] = []
        self.files: list[str] = []

    def keys(self) -> list[str]:
        """Every tensor name, in file order."""
        return list(self._sources)

    def __contains__(self, key: object) -> bool:
        return key in self._sources

    def __iter__(self) -> Iterator[str]:
        return iter(self._sources)

    def __len__(self) -> int:
        return len(self._sources)

    def shape(self, key: str) -> tuple[int, ...]:
        """The stored shape of ``key``, read from the file header (no data is read)."""
        return self._sources[key].shape(key)

    def file_of(self, key: str) -> str:
        """The name of the file that holds ``key``."""
        return self._sources[key].name

    def read(self, key: str) -> np.ndarray:
        """The data of ``key`` as a numpy array in its stored dtype (a derived tensor: in fp32, its exact
        value; :meth:`stored_dtype` says the dtype of its parts)."""
        return self._sources[key].read(key)

    def stored_dtype(self, key: str) -> np.dtype | None:
        """The dtype a derived tensor's parts are stored in (None for a stored tensor: its array's)."""
        return getattr(self._sources[key], "stored_dtype", None)

    @property
    def label(self) -> str:
        """The file names, comma-separated (for messages about the checkpoint as a whole)."""
        return ", ".join(self.files)

    def close(self) -> None:
        """Release the open files."""
        for source in self._opened:
            source.close()
        self._opened = []

    def __enter__(self) -> TensorFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stack(self, key: str, parts: Sequence[str]) -> None:
        """Replace the tensors ``parts`` (one shape and dtype) by one tensor ``key`` that stacks them along
        a new first axis, read when asked for. A missing part or a mismatch raises CheckpointError."""
        for name in parts:
            if name not in self._sources:
                raise CheckpointError(
                    "missing tensor of a stacked group", file=self.label, key=name,
                    expected=f"{len(parts)} tensors {parts[0]} ... {parts[-1]}", found="no such key",
                )  # fmt: skip
            if self.shape(name) != self.shape(parts[0]):
                raise CheckpointError(
                    "tensors of one stacked group differ in shape", file=self.file_of(name), key=name,
                    expected=self.shape(parts[0]), found=self.shape(name),
                )  # fmt: skip
        source = _Stacked(self, key, list(parts))
        for name in parts:
            del self._sources[name]
        self._sources[key] = source

    def derive(
        self,
        key: str,
        parts: Sequence[str],
        combine: Callable[..., np.ndarray],
        shape: Sequence[int] | None = None,
    ) -> None:
        """Add a tensor ``key`` = ``combine(*arrays of parts)`` of the first part's shape (or ``shape``: a
        concatenation, say), computed in fp32 when read (the caller casts it once: :meth:`stored_dtype`);
        the parts stay (several derived tensors may read one: :meth:`consume` removes them). A missing
        part raises CheckpointError."""
        for name in parts:
            if name not in self._sources:
                raise CheckpointError(
                    f"missing tensor (needed for {key})", file=self.label, key=name,
                    expected=f"shape as {parts[0]}" if name != parts[0] else "a tensor", found="no such key",
                )  # fmt: skip
        self._sources[key] = _Derived(self, list(parts), combine, shape)

    def consume(self, names: Sequence[str]) -> None:
        """Drop the tensors ``names`` (what derived tensors were built from) from the keys."""
        for name in names:
            self._sources.pop(name, None)

    def _add(self, source: _Source, keys: Sequence[str]) -> None:
        self._opened.append(source)
        self.files.append(source.name)
        for key in keys:
            if key in self._sources:
                raise CheckpointError(
                    "tensor stored twice",
                    file=source.name,
                    key=key,
                    expected=f"one copy (already in {self._sources[key].name})",
                    found="a second copy",
                )
            self._sources[key] = source


class _Stacked:
    """A virtual tensor: ``parts`` of ``files`` stacked along a new first axis (read lazily)."""

    def __init__(self, files: TensorFiles, key: str, parts: list[str]):
        self._parts = [(name, files._sources[name]) for name in parts]
        self.name = files.file_of(parts[0])
        self._shape = (len(parts), *files.shape(parts[0]))

    def shape(self, key: str) -> tuple[int, ...]:
        return self._shape

    def read(self, key: str) -> np.ndarray:
        arrays = [source.read(name) for name, source in self._parts]
        if len({a.dtype for a in arrays}) > 1:
            found = sorted({str(a.dtype) for a in arrays})
            raise CheckpointError(
                "tensors of one stacked group differ in dtype", file=self.name, key=key,
                expected=arrays[0].dtype, found=found,
            )  # fmt: skip
        return np.stack(arrays)

    def close(self) -> None:
        pass


class _Derived:
    """A virtual tensor computed from ``parts`` of ``files`` by ``combine`` (read lazily)."""

    def __init__(self, files: TensorFiles, parts: list[str], combine: Callable[..., np.ndarray], shape=None):
        self._parts = [(name, files._sources[name]) for name in parts]
        self.name = files.file_of(parts[0])
        self._shape = files.shape(parts[0]) if shape is None else tuple(int(n) for n in shape)
        self._combine = combine
        self.stored_dtype = None  # known once read

    def shape(self, key: str) -> tuple[int, ...]:
        return self._shape

    def read(self, key: str) -> np.ndarray:
        arrays = [source.read(name) for name, source in self._parts]
        self.stored_dtype = arrays[0].dtype
        return self._combine(*(a.astype(np.float32) for a in arrays))

    def close(self) -> None:
        pass


def open_tensors(paths: Sequence[str | Path]) -> TensorFiles:
    """Open checkpoint files: ``*.safetensors``, ``*.bin``, or a shard index ``*.index.json``.

    A shard index names its shards (beside it); every key of every shard must be listed in the index
    under that shard and vice versa. Raises :class:`CheckpointError` naming the file for a missing,
    truncated or corrupt file, or for a key stored twice.
    """
    tensors = TensorFiles()
    try:
        for path in map(Path, paths):
            if path.name.endswith(INDEX_SUFFIX):
                _open_index(tensors, path)
            else:
                source = _open_file(path)
                tensors._add(source, source.keys())
    except BaseException:
        tensors.close()
        raise
    return tensors


def find_weight_files(directory: str | Path, choices: Sequence[Sequence[str]]) -> list[Path]:
    """The first group of ``choices`` (file names, in preference order) whose files all exist.

    Raises :class:`CheckpointError` listing every name looked for when none is there.
    """
    directory = Path(directory)
    for group in choices:
        paths = [directory / name for name in group]
        if all(p.is_file() for p in paths):
            return paths
    looked_for = [name for group in choices for name in group]
    raise CheckpointError(
        "no weight files in the checkpoint directory",
        file=directory,
        expected=f"one of {looked_for}",
        found=sorted(p.name for p in directory.iterdir()) if directory.is_dir() else "no such directory",
    )


def read_safetensors(path: str | Path) -> dict[str, np.ndarray]:
    """Every tensor of one safetensors file, read eagerly into numpy arrays (no torch needed)."""
    with open_tensors([path]) as tensors:
        return {key: tensors.read(key) for key in tensors}


def read_torch_bin(path: str | Path) -> dict[str, np.ndarray]:
    """Every tensor of one PyTorch pickle (a state dict), read eagerly; needs torch."""
    with open_tensors([path]) as tensors:
        return {key: tensors.read(key) for key in tensors}


def torch_to_numpy(tensor: Any) -> np.ndarray:
    """A torch tensor's data as a numpy array with the same dtype (bfloat16 -> ml_dtypes.bfloat16)."""
    import torch

    tensor = tensor.detach().cpu().contiguous()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16).copy()
    return tensor.numpy().copy()


# ---------------------------------------------------------------------------------------------------
# Sources: one open file each.


class _Source:
    name: str

    def keys(self) -> list[str]:
        raise NotImplementedError

    def shape(self, key: str) -> tuple[int, ...]:
        raise NotImplementedError

    def read(self, key: str) -> np.ndarray:
        raise NotImplementedError

    def close(self) -> None:
        pass


class _SafetensorsSource(_Source):
    def __init__(self, path: Path):
        from safetensors import SafetensorError, safe_open

        self.name = path.name
        try:
            self._handle = safe_open(str(path), framework="np")
            self._keys = list(self._handle.keys())
        except SafetensorError as err:
            raise _diagnose_safetensors(path, err) from err

    def keys(self) -> list[str]:
        return self._keys

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._handle.get_slice(key).get_shape())

    def read(self, key: str) -> np.ndarray:
        try:
            return self._handle.get_tensor(key)
        except Exception as err:
            raise CheckpointError(f"could not read tensor ({err})", file=self.name, key=key) from err

    def close(self) -> None:
        self._handle.__exit__(None, None, None)


class _TorchSource(_Source):
    def __init__(self, path: Path):
        self.name = path.name
        self._state = _torch_load(path)

    def keys(self) -> list[str]:
        return list(self._state)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._state[key].shape)

    def read(self, key: str) -> np.ndarray:
        return torch_to_numpy(self._state[key])

    def close(self) -> None:
        self._state = {}


def _open_file(path: Path) -> _Source:
    if not path.is_file():
        raise CheckpointError("weight file not found", file=path, expected="a file", found="nothing")
    if path.suffix == ".safetensors":
        return _SafetensorsSource(path)
    if path.suffix in (".bin", ".pt", ".pth"):
        return _TorchSource(path)
    raise CheckpointError(
        "unknown weight file type",
        file=path.name,
        expected=".safetensors, .bin or .index.json",
        found=path.suffix,
    )


def _open_index(tensors: TensorFiles, index: Path) -> None:
    weight_map = _read_weight_map(index)
    for shard in sorted(set(weight_map.values())):
        source = _open_file(index.parent / shard)
        keys = source.keys()
        tensors._add(source, keys)
        for key in keys:
            if weight_map.get(key) != shard:
                raise CheckpointError(
                    "tensor in a shard but not listed under it in the index",
                    file=shard,
                    key=key,
                    expected=f"{index.name} to map it to {shard}",
                    found=weight_map.get(key, "no entry"),
                )
    missing = sorted(key for key in weight_map if key not in tensors)
    if missing:
        raise CheckpointError(
            f"tensor listed in {index.name} is absent from its shard ({len(missing)} such keys)",
            file=weight_map[missing[0]],
            key=missing[0],
            expected="the tensor",
            found="nothing",
        )


def _read_weight_map(index: Path) -> dict[str, str]:
    try:
        data = json.loads(index.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"unreadable shard index ({err})", file=index.name) from err
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(
            "malformed shard index",
            file=index.name,
            key="weight_map",
            expected="{key: shard file}",
            found=data,
        )
    return weight_map


def _torch_load(path: Path) -> dict[str, Any]:
    try:
        import torch
    except ImportError as err:
        raise CheckpointError(
            "reading a PyTorch pickle needs torch (pip install 'latim-jax[torch]'), or give the "
            "checkpoint as safetensors",
            file=path.name,
        ) from err
    try:
        state = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
    except Exception:
        try:  # legacy (non-zip) pickles cannot be memory-mapped
            state = torch.load(str(path), map_location="cpu", weights_only=True)
        except Exception as err:
            raise CheckpointError(
                f"truncated or corrupt PyTorch checkpoint ({type(err).__name__}: {err})", file=path.name
            ) from err
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        found = type(state).__name__
        if isinstance(state, dict):
            found = f"dict with keys {sorted(map(str, state))[:5]}"
        raise CheckpointError("not a flat state dict", file=path.name, expected="{name: tensor}", found=found)
    return state


def _diagnose_safetensors(path: Path, err: Exception) -> CheckpointError:
    """Say why safetensors refused a file, naming it: truncated (shorter than its header says, with the
    first tensor cut off) or corrupt (an unreadable header), with safetensors' own words last. The
    sentence says what was expected and found; the error's attributes hold them too."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n < 0:
            return _truncated(
                path, f"{size} bytes, shorter than the 8-byte header length that opens a safetensors file",
                expected="at least 8 bytes", size=size,
            )  # fmt: skip
        if n > size - 8:
            return _truncated(
                path, f"its first 8 bytes announce a {n}-byte header, which does not fit in the file's "
                f"{size} bytes", expected=f"at least {8 + n} bytes", size=size,
            )  # fmt: skip
        try:
            header = json.loads(f.read(n))
            ends = {k: int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"}
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            return CheckpointError(
                f"corrupt safetensors file: its {n}-byte header is not the JSON table of tensors "
                f"(safetensors: {err})",
                file=path.name,
            )
    needed = 8 + n + max(ends.values(), default=0)
    if needed > size:
        cut = min((k for k, end in ends.items() if 8 + n + end > size), key=lambda k: ends[k])
        return _truncated(
            path, f"its header describes {needed} bytes, the file has {size}, so tensor {cut!r} and "
            "those stored after it are cut off", expected=f"{needed} bytes", size=size, key=cut,
        )  # fmt: skip
    return CheckpointError(f"corrupt safetensors file (safetensors: {err})", file=path.name)


def _truncated(path: Path, why: str, *, expected: str, size: int, key: str | None = None) -> CheckpointError:
    """A truncated (or corrupt) safetensors file: one sentence, the parts kept as attributes."""
    error = CheckpointError(
        f"truncated or corrupt safetensors file: {why} (copy or download it again)", file=path.name
    )
    error.key, error.expected, error.found = key, expected, f"{size} bytes"
    return error
