"""Tile sizes: ONE frozen dataclass for every blocked computation of the library.

Glossary: b batch, l length, e inner width (Mamba-1 channels), n state size, h heads, p head dim,
g groups, q chunk length, d model width.

A field left None takes the default of the path that runs: :meth:`Blocks.for_platform` for the Pallas
kernels, :meth:`Blocks.for_layer` for the XLA score path (:meth:`Blocks.over` fills the Nones).

The score tiles (the XLA blocked path, :mod:`latim_jax.latim.blocking`, and the fused score kernel,
kernels/fused_scores.py):
- ``rows`` / ``cols``: target rows x source columns per tile. Fused kernel: TPU rows a multiple of 8
  and cols of 128 (or the whole padded axis); GPU powers of two >= 16.
- ``d``: the fused kernel's d tile (None: all of d up to 1024 on TPU, all of d on GPU).
- ``e``: the fused kernel's channels per step (TPU: the "arbitrary" e-chunk axis; GPU Mamba-1: the
  channel chunk of the in-kernel loop).
- ``m1_tangent_rows``: the same passes' rows under differentiation (at most ``m1_direct_rows``).
- ``m1_state_group``: states per step of the direct form's backward (:func:`latim_jax.kernels.decay.
  m1_state_sum`: the backward holds one group's exponential blocks; 2 for a 130m layer's gradient at
  L = 1024: 230 -> 217 MiB of temporaries against 4, where 1 gains nothing more).
- ``m1_direct_rows``: target rows per pass of the XLA path's Mamba-1 direct form (bounds its backward's
  temporaries); ``m1_few_rows``: a row tile of at most this many rows takes the direct form on every
  tile (a few rows: cheaper than transposing the far tiles' factored operand).
- ``tangent_rows``: target rows per score tile of the XLA path under differentiation (forward and
  reverse mode; None or >= ``rows``: the same tiles as the value). A gradient's backward holds a few
  copies of one tile's (r, q, e) values, so smaller rows there bound it without slowing the forward.
The scan kernels (kernels/selective_scan.py, kernels/ssd.py):
- ``scan_block_l`` (Mamba-1): the chunk whose entering state the forward saves for the backward (which
  recomputes the chunk's states from it). TPU: time steps per grid step; a lane dimension of the
  transposed B/C blocks, so a multiple of 128 (or the whole 8-padded sequence). GPU: the checkpoint
  spacing, a power of two of at most 64 (the backward unrolls one chunk).
- ``scan_block_e`` (Mamba-1): channels per program. TPU: multiple of 128 (or all of e); GPU: a power of
  two (e is zero-padded to a multiple of it).
- ``ssd_chunk`` (Mamba-2): chunk length of the chunked SSD kernel; None in the resolved blocks means the
  caller's ``chunk_size``. TPU: multiple of 8. GPU: power of two >= 16.
- ``ssd_block_p`` (Mamba-2, GPU): head-dim rows per program (None: the whole head).
Triton and Mosaic settings: ``num_warps_scan`` / ``num_warps_ssd`` / ``num_warps_scores`` (GPU),
``vmem_limit_bytes`` (every TPU kernel's scoped-VMEM limit; None: the chip's, from the table in
:mod:`latim_jax.parallel.chips`, refused above the chip's VMEM).

On TPU, tiles whose buffers overflow the chip's scoped VMEM are refused before compiling, naming the
largest tile that fits (:mod:`latim_jax.kernels.vmem`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

from latim_jax.parallel.chips import PLATFORMS as PLATFORMS  # re-exported: the platform names
from latim_jax.parallel.chips import normalize_platform

_FIELDS = (
    "rows", "cols", "d", "e", "m1_direct_rows", "m1_tangent_rows", "m1_state_group", "m1_few_rows",
    "tangent_rows",
    "scan_block_l", "scan_block_e", "ssd_chunk", "ssd_block_p", "num_warps_scan", "num_warps_ssd",
    "num_warps_scores", "vmem_limit_bytes",
)  # fmt: skip


@dataclasses.dataclass(frozen=True, kw_only=True)
class Blocks:
    """Tile sizes (module docstring); every field a positive int or None (the running path's default)."""

    rows: int | None = None
    cols: int | None = None
    d: int | None = None
    e: int | None = None
    m1_direct_rows: int | None = None
    m1_tangent_rows: int | None = None
    m1_state_group: int | None = None
    m1_few_rows: int | None = None
    tangent_rows: int | None = None
    scan_block_l: int | None = None
    scan_block_e: int | None = None
    ssd_chunk: int | None = None
    ssd_block_p: int | None = None
    num_warps_scan: int | None = None
    num_warps_ssd: int | None = None
    num_warps_scores: int | None = None
    vmem_limit_bytes: int | None = None

    def __post_init__(self):
        for name in _FIELDS:
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"Blocks.{name} must be a positive int or None, found {value!r}")

    def over(self, defaults: Blocks) -> Blocks:
        """These blocks with every None field taken from ``defaults``."""
        return Blocks(
            **{k: v if (v := getattr(self, k)) is not None else getattr(defaults, k) for k in _FIELDS}
        )

    @classmethod
    def for_platform(cls, platform: str) -> Blocks:
        """The Pallas kernels' defaults: "tpu", "gpu" (also "cuda"/"rocm"), or "cpu" (interpret mode:
        few, large blocks, since each grid step costs a full-array copy)."""
        platform = normalize_platform(platform)
        if platform == "tpu":
            return cls(rows=8, cols=128, e=256, scan_block_l=256, scan_block_e=512, ssd_chunk=128,
                       num_warps_scan=1, num_warps_ssd=4, num_warps_scores=4)  # fmt: skip
        if platform == "gpu":
            return cls(rows=16, cols=16, d=64, e=32, scan_block_l=16, scan_block_e=32, ssd_chunk=64,
                       ssd_block_p=32, num_warps_scan=1, num_warps_ssd=8, num_warps_scores=4)  # fmt: skip
        return cls(rows=8, cols=64, e=1024, scan_block_l=512, scan_block_e=1024, num_warps_scan=1,
                   num_warps_ssd=4, num_warps_scores=4)  # fmt: skip

    @classmethod
    def for_layer(cls, version: int, length: int, n_rows: int | None = None) -> Blocks:
        """The XLA score path's defaults: 64 x 64 tiles for Mamba-2, 32 x 32 for Mamba-1 (its per-tile
        values are (r, q, e), not Mamba-2's (r, q, h); at 130m shapes and L = 512, 32 x 32 is ~25% faster
        than 16 x 16 and as fast as 64 x 64). At long L, where nearly every tile is a far tile, 64 x 32
        costs ~14% less CPU per pair (one layer at 4096: 217-219 s against 233-246 s wall), but the
        gradient at L = 1024 then peaks at 3.2x the forward (0.917 / 0.286 GiB; 2.7x with 32 x 32), so it
        is not the default; pass ``Blocks(rows=64, cols=32)`` for a forward-only run (the near tiles'
        direct form runs in ``m1_direct_rows`` = 32-row passes either way). With few target rows
        (``n_rows`` below the square tile's side) the row tile shrinks to them and the column tile grows
        to keep the tile's size: ``rows=[-1]`` does not pay for a whole row tile. Mamba-1 row tiles of at
        most ``m1_few_rows`` = 4 rows take the direct form on every tile (1.58 -> 0.21 s for rows=[-1]
        of one 130m layer at L = 4096; with 8 rows the factored form is faster, 0.64 against 1.01 s).
        Differentiated, Mamba-2's tiles take ``tangent_rows`` = 16 rows (one 130m layer's l2 gradient at
        L = 1024: compiled temporaries 332 -> 260 MiB, 21 -> 19 s; d 128: within noise). Mamba-1 keeps
        its tiles (16 rows: 206 -> 182 MiB and 34 -> 31 s at 130m, but ~15% slower at d 128); pass
        ``Blocks(tangent_rows=16)`` for the memory."""
        size = 64 if version == 2 else 32
        cap = max(8, 1 << (max(length, 1) - 1).bit_length())
        size = min(size, cap)
        fixed = dict(
            m1_direct_rows=32, m1_tangent_rows=16, m1_state_group=2, m1_few_rows=4,
            tangent_rows=16 if version == 2 else None,
        )  # fmt: skip
        if n_rows is None or n_rows >= size:
            return cls(rows=size, cols=size, **fixed)
        rows = 1 << (max(n_rows, 1) - 1).bit_length()
        return cls(rows=rows, cols=min(cap, 1024, size * size // rows), **fixed)


def resolve_target(platform: str | None, interpret: bool | None) -> tuple[str, bool]:
    """(kernel variant "tpu" | "gpu", interpret flag) for a Pallas call.

    ``platform=None`` follows ``jax.default_backend()``; on CPU that is the TPU variant in interpret
    mode (interpret mode runs either variant; the TPU one exercises the scratch-carried state). The
    library's own calls name both, from the execution context (``Context.kernel_target()``), so the
    default backend is read here only for a kernel called directly without them.
    """
    backend = normalize_platform(jax.default_backend())
    if interpret is None:
        interpret = backend == "cpu"
    target = normalize_platform(platform) if platform is not None else backend
    return ("tpu" if target == "cpu" else target), bool(interpret)


def tpu_compiler_params(dimension_semantics: tuple[str, ...], vmem_limit_bytes: int | None = None):
    """Mosaic compiler params across jax versions (``CompilerParams``, formerly ``TPUCompilerParams``)."""
    params_cls = pltpu.CompilerParams if hasattr(pltpu, "CompilerParams") else pltpu.TPUCompilerParams
    return params_cls(dimension_semantics=dimension_semantics, vmem_limit_bytes=vmem_limit_bytes)


def gpu_compiler_params(num_warps: int):
    """Triton compiler params across jax versions (``CompilerParams``, formerly ``TritonCompilerParams``)."""
    params_cls = (
        pltriton.CompilerParams if hasattr(pltriton, "CompilerParams") else pltriton.TritonCompilerParams
    )
    return params_cls(num_warps=num_warps, num_stages=1)


def round_up(x: int, m: int) -> int:
    """The smallest multiple of m that is >= x (x >= 0, m >= 1)."""
    return -(-x // m) * m


def next_pow2(x: int) -> int:
    """The smallest power of two >= x (1 for x <= 1)."""
    return 1 << max(0, (x - 1).bit_length())


def pad_axis(x, axis: int, size: int):
    """Zero-pad axis ``axis`` of x up to ``size`` (a tile multiple); x itself when it already has it."""
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths)
