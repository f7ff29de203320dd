"""What an attribution call will hold in memory, stated before it runs, and a clear refusal when it does
not fit (naming the options that do).

The estimate adds, in bytes (b prompts, l positions, R target rows, d width, e inner width, n state,
c = e (Mamba-1) or heads (Mamba-2), K conv taps, g groups, v vocabulary):

    parameters   the loaded model
    streams      logit and grad_input (a forward pass first): the residual streams entering every
                 layer, (layers + 1) b l d fp32, plus the head's logits for one chunk of positions at a
                 time (targets and logits are gathered chunkwise); the other methods score each layer as
                 one pass reaches it: two streams, 2 b l d fp32
    layer        one layer at a time: the largest of its kinds' working sets (``LayerKind.memory``; a
                 Mamba layer: its factors (K + 3) b l e + 3 b l c + 2 b l g n + 5 b l d fp32, the
                 in_proj output, the scan's working set and the score path's block working set,
                 :func:`latim_jax.model.mixers.mamba_memory`), plus the layer's (b, R, l) fp32 score
                 matrix before any reduction
    output       what the result keeps: layers x b x R x l scores in the output dtype, or x top_k
                 (values and int32 sources), nothing with streaming; the logit rollout's alti maps
                 (layers x b x l x l fp32) when every row of every layer is asked

It is an estimate of the arrays the library allocates (XLA adds a little on top); the benchmarks record
it next to measured peaks.

On a mesh (``split``: the sizes of its "data", "model" and "seq" axes) the estimate is per device: the
prompts divide over "data" everywhere; the score matrix and the output divide over "model" (rows) and
"seq" (source columns); the streams divide over "seq" (the split forward holds l / D positions of each);
the layer's working set is that of a device's compacted window (its l / D sources, their halo and up to
512 asked rows: :mod:`latim_jax.latim.source_window`) for a kind that scores its own window
(``LayerKind.window_scores``), and keeps the whole length for one whose factors are gathered whole
(the shared block; attention with a sliding window); the parameters are counted whole.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import numpy as np

from latim_jax.latim.blocking import tiles
from latim_jax.latim.source_window import GROUP_ROWS
from latim_jax.model.kind import kind_of
from latim_jax.parallel.mesh import AXES

GIB = 1024**3
HEAD_CHUNK = 512  # positions per chunk when the head's logits are reduced to targets


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Bytes each part of an attribution call holds (see the module docstring)."""

    parameters: int
    streams: int
    layer: int
    output: int

    @property
    def total(self) -> int:
        """The estimated peak: every part at once."""
        return self.parameters + self.streams + self.layer + self.output

    def describe(self) -> str:
        """One line: total and parts, in readable units."""
        parts = ", ".join(
            f"{k} {human(getattr(self, k))}" for k in ("parameters", "streams", "layer", "output")
        )
        return f"{human(self.total)} ({parts})"


def human(n: int) -> str:
    """Bytes in B / KiB / MiB / GiB."""
    for unit, size in (("GiB", GIB), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


class InsufficientMemoryError(MemoryError):
    """The estimated peak of a call exceeds the memory available; the message names options that fit.

    ``options``: {option: value} of each alternative that fits, keys among "rows" (1: the last row),
    "layers" (the most layers per call), "top_k", "out_dtype", "stream_to", "batch" (1), so that a
    front end (the CLI) can name them in its own spelling; ``needed`` / ``limit`` bytes; ``batch`` and
    ``length`` the caller's."""

    def __init__(self, message: str, *, options=None, needed=0, limit=0, batch=0, length=0):
        super().__init__(message)
        self.options = dict(options or {})
        self.needed, self.limit, self.batch, self.length = needed, limit, batch, length


def estimate(
    model,
    batch: int,
    length: int,
    *,
    method: str = "alti",
    rows: int | None = None,
    layers: int | None = None,
    top_k: int | None = None,
    out_dtype="float32",
    stream: bool = False,
    blocks=None,
    split=None,
) -> MemoryEstimate:
    """Estimated bytes of ``attribute`` on ``batch`` prompts of ``length`` positions, scoring ``rows``
    target rows (None: all) of ``layers`` layers (None: all); ``split``: {"data", "model", "seq": axis
    size} of a mesh (None: one device), which makes it the estimate per device (module docstring)."""
    c = model.config
    split = check_split(split)
    b, L = -(-int(batch) // split["data"]), int(length)
    R = L if rows is None else int(rows)
    R_dev, L_dev = -(-R // split["model"]), -(-L // split["seq"])  # a device's rows and source columns
    n_layers = c.n_layers if layers is None else int(layers)
    d, f4 = c.d_model, 4
    params = sum(int(np.prod(np.shape(x))) * np.dtype(x.dtype).itemsize for x in _leaves(model))
    if method in ("logit", "grad_input"):  # a forward first: every layer's input stream, and the head
        streams = (c.n_layers + 1) * b * L_dev * d * f4 + b * min(L_dev, HEAD_CHUNK) * c.n_tokens * f4
    else:  # one pass over the layers: the stream entering the layer and the next one
        streams = 2 * b * L_dev * d * f4
    blk = tiles(c.version, L, None, blocks)
    # one layer at a time: the largest of the kinds' working sets (LayerKind.memory), at the length of a
    # device's compacted window over "seq" where the kind scores its own (LayerKind.window_scores)
    layer = max(
        kind.memory(c, b, _scored_length(kind, c, L, L_dev, R_dev, split["seq"]), blk.rows, blk.cols)
        for kind in map(kind_of, dict.fromkeys(c.kinds))
    )
    layer_scores = b * R_dev * L_dev * f4
    itemsize = np.dtype(out_dtype).itemsize if out_dtype != "bfloat16" else 2
    if stream:
        output = 0
    elif top_k is not None:
        output = n_layers * b * R_dev * int(top_k) * (itemsize + 4)
    else:
        output = n_layers * b * R_dev * L_dev * itemsize
    if method == "logit" and rows is None and layers is None and not stream:
        output += c.n_layers * b * R_dev * L_dev * f4
    return MemoryEstimate(parameters=params, streams=streams, layer=layer + layer_scores, output=output)


def _scored_length(kind, config, length: int, width: int, rows: int, seq: int) -> int:
    """The positions a device's score stage holds of one layer: the whole ``length``, or over ``seq`` > 1
    shards of ``width`` the compacted window of a kind that scores its own (:mod:`latim_jax.latim.
    source_window`: an empty chunk, the window, its halo and a group of the asked rows, at most one
    delta-rule chunk of padding each side counted as 64)."""
    if seq == 1 or not kind.window_scores(config, width):
        return length
    return min(length, width + kind.halo(config) + min(rows, GROUP_ROWS) + 2 * 64)


SPLIT_AXES = AXES  # the mesh axes a call can be split over


def check_split(split) -> dict:
    """{"data", "model", "seq": size} with the missing axes 1; a size that is not a positive integer or
    an axis of another name is refused by name."""
    split = dict(split or {})
    unknown = set(split) - set(SPLIT_AXES)
    if unknown:
        raise ValueError(f"split: unknown mesh axes {sorted(unknown)}; expected among {SPLIT_AXES}")
    for name, size in split.items():
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
            raise ValueError(f"split: the {name!r} axis size must be a positive integer, found {size!r}")
    return {name: int(split.get(name, 1)) for name in SPLIT_AXES}


def _leaves(model):
    return jax.tree.leaves(model.params())


# memory_limit="auto" keeps this share of the free memory for what the estimate misses (measured on a
# 24-layer 130m-shaped Mamba-2, last row: 0.78 / 1.01 / 0.95 x the peak above the model at L = 1k / 4k
# / 16k, the 1k peak itself varying 0.15-0.22 GiB between runs; benchmarks/results/scale_out.json)
AUTO_MARGIN = 1.2


def available() -> int:
    """Bytes this call can use: free device memory on an accelerator (``memory_stats``), else the
    host's MemAvailable (Linux) or, failing that, total RAM."""
    device = jax.local_devices()[0]
    if device.platform != "cpu":
        stats = getattr(device, "memory_stats", lambda: None)() or {}
        if "bytes_limit" in stats:
            return int(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_fits(
    model, batch: int, length: int, *, limit: int, prompt_length: int | None = None, **call
) -> MemoryEstimate:
    """The estimate of the call, or :class:`InsufficientMemoryError` when it exceeds ``limit`` bytes,
    naming each alternative that fits: the last row only, fewer layers, top_k, bfloat16 output,
    streaming to disk, a smaller batch. ``length``: the length computed (with bucket padding);
    ``prompt_length``: the caller's, for the message (default ``length``); ``split`` (in ``call``): a
    mesh's axis sizes, the estimate and ``limit`` then per device."""
    est = estimate(model, batch, length, **call)
    if est.total <= limit:
        return est
    fits = {}
    if call.get("rows") != 1 and estimate(model, batch, length, **{**call, "rows": 1}).total <= limit:
        fits["rows"] = 1
    n = model.config.n_layers if call.get("layers") is None else call["layers"]
    fit = [
        k
        for k in range(n - 1, 0, -1)
        if estimate(model, batch, length, **{**call, "layers": k}).total <= limit
    ]
    if fit:
        fits["layers"] = fit[0]
    k = min(32, length)
    if estimate(model, batch, length, **{**call, "top_k": k, "stream": False}).total <= limit:
        fits["top_k"] = k
    if estimate(model, batch, length, **{**call, "out_dtype": "bfloat16"}).total <= limit:
        fits["out_dtype"] = "bfloat16"
    if estimate(model, batch, length, **{**call, "stream": True}).total <= limit:
        fits["stream_to"] = "DIR"
    if batch > 1 and estimate(model, 1, length, **call).total <= limit:
        fits["batch"] = 1
    spelled = {
        "rows": "rows=[-1] (only the last target; a row subset costs O(rows x L))",
        "layers": f"layers=<at most {fits.get('layers')} layers> (one call per group of layers)",
        "top_k": f"top_k={k} (keep the {k} strongest sources per target)",
        "out_dtype": "out_dtype='bfloat16' (half the output)",
        "stream_to": "stream_to=DIR (write each layer's scores to disk as it is computed)",
        "batch": "a smaller batch (one prompt fits)",
    }
    hint = (
        "; ".join(spelled[key] for key in fits)
        if fits
        else "none of rows=[-1], fewer layers, top_k, bf16 output or streaming fits"
    )
    shown = length if prompt_length is None else prompt_length
    split = check_split(call.get("split"))
    where = "" if split == check_split(None) else " per device (mesh " + ", ".join(
        f"{name}={size}" for name, size in split.items() if size > 1) + ")"  # fmt: skip
    raise InsufficientMemoryError(
        f"attribution of {batch} x {shown} tokens needs about {est.describe()}{where}, more than the "
        f"{human(limit)} available. Options that fit: {hint}. (memory_limit=None skips this check.)",
        options=fits, needed=est.total, limit=limit, batch=batch, length=shown,
    )  # fmt: skip
