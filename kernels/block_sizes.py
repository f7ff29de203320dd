"""Tunable tile sizes of the scan kernels, one frozen dataclass shared by Mamba-1 and Mamba-2.

Glossary: b batch, l length, e inner width (Mamba-1 channels), n state size, h heads, p head dim,
g groups, q chunk length.

What each field tiles:
- ``scan_block_l`` (Mamba-1, TPU): time steps per grid step. It is a lane dimension of the transposed
  B/C blocks, so on TPU it must be a multiple of 128 (or cover the whole, 8-padded, sequence). The GPU
  variant keeps the whole sequence per program and ignores it.
- ``scan_block_e`` (Mamba-1): channels per program. TPU: multiple of 128 (or all of e). GPU: a power of
  two (e is zero-padded to a multiple of it).
- ``ssd_chunk`` (Mamba-2): chunk length q of the chunked SSD; ``None`` uses the caller's ``chunk_size``.
  TPU: multiple of 8. GPU: power of two >= 16 (Triton matmul tiles).
- ``ssd_block_p`` (Mamba-2, GPU): head-dim rows per program (the state rows are independent); ``None``
  keeps the whole head. TPU always keeps the whole head (p is a lane dimension there).
- ``num_warps_scan`` / ``num_warps_ssd``: Triton warps per program (GPU only).
"""

from __future__ import annotations

import dataclasses

PLATFORMS = ("tpu", "gpu", "cpu")


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockSizes:
    """Tile sizes for the Pallas scans; build one with ``BlockSizes.for_platform(platform)``."""

    scan_block_l: int = 256
    scan_block_e: int = 512
    ssd_chunk: int | None = 128
    ssd_block_p: int | None = None
    num_warps_scan: int = 1
    num_warps_ssd: int = 4

    def __post_init__(self):
        for name in ("scan_block_l", "scan_block_e", "num_warps_scan", "num_warps_ssd"):
            if getattr(self, name) < 1:
                raise ValueError(f"BlockSizes.{name} must be >= 1, found {getattr(self, name)}")
        for name in ("ssd_chunk", "ssd_block_p"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"BlockSizes.{name} must be >= 1 or None, found {value}")

    @classmethod
    def for_platform(cls, platform: str) -> BlockSizes:
        """Defaults per platform: "tpu", "gpu" (also "cuda"/"rocm"), or "cpu" (interpret mode)."""
        platform = normalize_platform(platform)
        if platform == "tpu":
            return cls(scan_block_l=256, scan_block_e=512, ssd_chunk=128)
        if platform == "gpu":
            return cls(
                scan_block_l=256,
                scan_block_e=32,
                ssd_chunk=64,
                ssd_block_p=32,
                num_warps_scan=1,
                num_warps_ssd=8,
            )
        # interpret mode: few, large blocks (each grid step costs a full-array copy)
        return cls(scan_block_l=512, scan_block_e=1024, ssd_chunk=None)


def normalize_platform(platform: str) -> str:
    """Map a jax backend name to "tpu", "gpu" or "cpu"."""
    platform = {"cuda": "gpu", "rocm": "gpu"}.get(platform, platform)
    if platform not in PLATFORMS:
        raise ValueError(f"platform must be one of {PLATFORMS} (or cuda/rocm), found {platform!r}")
    return platform


def resolve_target(platform: str | None, interpret: bool | None) -> tuple[str, bool]:
    """(kernel variant "tpu" | "gpu", interpret flag) for a Pallas call.

    ``platform=None`` follows ``jax.default_backend()``; on CPU that is the TPU variant in interpret
    mode (interpret mode runs either variant; the TPU one exercises the scratch-carried state).
    """
    import jax

    backend = normalize_platform(jax.default_backend())
    if interpret is None:
        interpret = backend == "cpu"
    target = normalize_platform(platform) if platform is not None else backend
    return ("tpu" if target == "cpu" else target), bool(interpret)


def tpu_compiler_params(dimension_semantics: tuple[str, ...]):
    """Mosaic compiler params across jax versions (``CompilerParams``, formerly ``TPUCompilerParams``)."""
    from jax.experimental.pallas import tpu as pltpu

    params_cls = pltpu.CompilerParams if hasattr(pltpu, "CompilerParams") else pltpu.TPUCompilerParams
    return params_cls(dimension_semantics=dimension_semantics)


def gpu_compiler_params(num_warps: int):
    """Triton compiler params across jax versions (``CompilerParams``, formerly ``TritonCompilerParams``)."""
    from jax.experimental.pallas import triton as pltriton

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
