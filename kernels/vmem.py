"""VMEM budgets of the Pallas TPU kernels, checked before Mosaic compiles.

A TPU kernel holds in VMEM its scratch and, for every input and output, two copies of the block
(Pallas double-buffers each BlockSpec'd operand: one block computes while the next is fetched). A tile
too large for the chip fails inside the XLA/Mosaic compile ("CompileTimeScopedVmemOom" or "would
exceed memory") only once the program is compiled on, or for, a TPU. Each kernel here lists its block
and scratch shapes for given tiles, and :func:`check` refuses, before the pallas_call, tiles whose
buffers exceed the chip's scoped-VMEM limit, naming the tile, the bytes, the chip and the largest tile
that fits. The chip table (VMEM per generation, the scoped limit passed as ``vmem_limit_bytes``) is
:mod:`latim_jax.parallel.chips`.

Bytes are counted as Mosaic lays 32-bit arrays out: the last two dimensions padded to (8, 128) tiles.
The budget leaves out values a kernel body keeps live between statements (register spills, Mosaic's
internal scratch): the scoped limit leaves 1/8 of the VMEM for them, and the compile-only check
(:mod:`latim_jax.parallel.tpu_check`) measures the rest. The SSD counts its (q, q) chunk matrices too,
which dominate at long chunks.
"""

from __future__ import annotations

import dataclasses
import math

from latim_jax.parallel.chips import MiB, TpuChip, running_chip, tpu_chip


def padded_bytes(shape, itemsize: int = 4) -> int:
    """VMEM bytes of one buffer of ``shape`` (a squeezed / None dimension counts 1): the last two
    dimensions padded to Mosaic's (8, 128) tile of 32-bit values."""
    dims = [d if isinstance(d, int) else 1 for d in shape] or [1]
    if len(dims) == 1:
        dims = [1, *dims]
    *lead, rows, cols = dims
    return math.prod(lead) * (-(-rows // 8) * 8) * (-(-cols // 128) * 128) * itemsize


@dataclasses.dataclass(frozen=True)
class Need:
    """A kernel's VMEM: its scratch (and counted in-body temporaries) and its double-buffered blocks."""

    scratch: int
    blocks: int

    @property
    def total(self) -> int:
        """All of it, in bytes."""
        return self.scratch + self.blocks

    def describe(self) -> str:
        """``40.2 MiB (scratch 32.0 MiB + double-buffered blocks 8.2 MiB)``."""
        parts = f"scratch {_mib(self.scratch)} + double-buffered blocks {_mib(self.blocks)}"
        return f"{_mib(self.total)} ({parts})"


def need(blocks, scratch, temporaries: int = 0) -> Need:
    """The :class:`Need` of a kernel with these block shapes (each double-buffered), scratch shapes
    and ``temporaries`` bytes of in-body values."""
    return Need(
        scratch=sum(padded_bytes(s) for s in scratch) + temporaries,
        blocks=2 * sum(padded_bytes(b) for b in blocks),
    )


class VmemOverflow(ValueError):
    """A Pallas TPU kernel's tiles need more VMEM than the chip's scoped limit."""


def target_chip(chip: str | None) -> tuple[TpuChip, bool]:
    """(the chip a TPU kernel is built for, whether it was known). None: the running TPU's generation,
    else (an unknown generation, e.g. lowering on a CPU host without naming one) the smallest VMEM of
    the table, so that what passes fits every generation."""
    if chip is None:
        chip = running_chip()
    return tpu_chip(chip), chip is not None


def scoped_limit(chip: TpuChip, asked: int | None) -> int:
    """The ``vmem_limit_bytes`` a kernel passes: ``Blocks.vmem_limit_bytes`` when set (refused above
    the chip's VMEM), else the chip's."""
    if asked is None:
        return chip.vmem_limit_bytes
    if asked > chip.vmem_bytes:
        raise VmemOverflow(
            f"Blocks.vmem_limit_bytes={asked} ({_mib(asked)}) exceeds the VMEM of {chip.describe()}"
        )
    return asked


# Kept free under the scoped limit for Mosaic's own scratch: compiling the scans for v4 and v5p, the
# compiler's "Used X of Y vmem" exceeded these buffer counts by 0.4-0.8 MiB.
RESERVE = 1 * MiB


def fits_limit(need_: Need, limit: int) -> bool:
    """Whether ``need_`` and :data:`RESERVE` fit under ``limit``."""
    return need_.total + RESERVE <= limit


def check(kernel: str, tile: str, need_: Need, chip: TpuChip, known: bool, limit: int, fits) -> None:
    """Refuse ``need_`` (plus :data:`RESERVE`) over ``limit``: a :class:`VmemOverflow` naming the
    kernel, its tile, the bytes, the chip and ``fits()`` (the largest tile that fits, called only on
    refusal)."""
    if fits_limit(need_, limit):
        return
    where, hint = chip.describe(), ""
    if not known:
        where = f"an unknown TPU generation (budgeted as {chip.describe()}, the smallest)"
        hint = "; name the generation (resolve(..., chip='v5e') or the kernel's chip=) for its own budget"
    raise VmemOverflow(
        f"{kernel}: tile {tile} needs {need_.describe()} of VMEM, over the {_mib(limit)} scoped-VMEM "
        f"limit (less {_mib(RESERVE)} for Mosaic's own scratch) for {where}; {fits()}{hint}"
    )


def largest(candidates, fits_tile) -> tuple | None:
    """The largest (by product, then by last entry) tuple of ``candidates`` for which ``fits_tile``
    holds, or None."""
    best = None
    for tile in candidates:
        key = (math.prod(tile), tile[-1])
        if (best is None or key > best[0]) and fits_tile(tile):
            best = (key, tile)
    return None if best is None else best[1]


def steps(top: int, unit: int) -> list[int]:
    """Multiples of ``unit`` up to ``top`` (and ``top`` itself)."""
    return sorted({*range(unit, top + 1, unit), top})


def _mib(n: int) -> str:
    return f"{n / MiB:.1f} MiB"
