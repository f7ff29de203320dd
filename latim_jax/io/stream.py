"""Score matrices streamed to disk layer by layer, for runs whose output exceeds host memory.

``attribute(..., stream_to=DIR)`` writes DIR atomically: everything goes into a hidden temporary
directory beside DIR, renamed into place when the last layer is done, so an interrupted run leaves no
DIR that looks complete. Layout:

    DIR/scores.npy    (B, n_layers, R, L or top_k) in the output dtype, a plain .npy (memory-mappable)
    DIR/arrays.npz    tokens, mask and the extras
    DIR/meta.json     the :class:`~latim_jax.io.results.Attribution` metadata

``Attribution.load(DIR)`` returns an Attribution whose ``scores`` is a read-only ``numpy.memmap``:
pages are read from disk only when touched.
"""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path

import numpy as np

SCORES, ARRAYS, META = "scores.npy", "arrays.npz", "meta.json"


class StreamWriter:
    """Write one layer's scores at a time into DIR/scores.npy (see the module docstring)."""

    def __init__(self, path, shape: tuple[int, ...], dtype):
        self.path = Path(path).absolute()
        if self.path.exists() and (not self.path.is_dir() or any(self.path.iterdir())):
            raise FileExistsError(f"stream_to={path}: exists and is not an empty directory")
        if not self.path.parent.is_dir():
            raise FileNotFoundError(f"stream_to={path}: the parent directory does not exist")
        self.tmp = self.path.parent / f".tmp-{self.path.name}-{uuid.uuid4().hex[:8]}"
        self.tmp.mkdir()
        file = self.tmp / SCORES
        self.scores = np.lib.format.open_memmap(file, mode="w+", dtype=np.dtype(dtype), shape=shape)

    def write(self, layer: int, scores) -> None:
        """Store layer ``layer``'s (B, R, L) scores."""
        self.scores[:, layer] = np.asarray(scores)

    def finish(self, meta: dict, arrays: dict) -> Path:
        """Flush, write the arrays and metadata, publish DIR; returns it."""
        self.scores.flush()
        del self.scores
        np.savez(self.tmp / ARRAYS, **{k: np.asarray(v) for k, v in arrays.items()})
        (self.tmp / META).write_text(json.dumps(meta, indent=2))
        if self.path.exists():
            self.path.rmdir()  # empty, checked at the start
        self.tmp.rename(self.path)
        return self.path

    def abort(self) -> None:
        """Remove the temporary directory (after an error)."""
        shutil.rmtree(self.tmp, ignore_errors=True)


def read_parts(path) -> tuple[dict, np.memmap, dict]:
    """(metadata, scores as a read-only memmap, the other arrays) of a directory written by
    :class:`StreamWriter`; :meth:`latim_jax.io.results.Attribution.load` builds the result from them."""
    path = Path(path)
    try:
        meta = json.loads((path / META).read_text())
        scores = np.load(path / SCORES, mmap_mode="r")
        with np.load(path / ARRAYS, allow_pickle=False) as z:
            return meta, scores, {k: z[k] for k in z.files}
    except (OSError, ValueError, KeyError) as err:
        raise ValueError(f"{path}: cannot read a streamed latim-jax attribution ({err})") from err
