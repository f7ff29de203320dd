"""Platforms and TPU generations: what a program is built for, named once at the API edge.

A TPU generation ("chip") fixes the VMEM a Pallas kernel may use. The table holds, per generation and
per TensorCore (the unit a kernel runs on; v4 and v5p megacore chips have two):

- ``vmem_bytes``: the physical VMEM. Sources: jax's own table (``jax/_src/pallas/mosaic/tpu_info.py``
  in jax 0.10.2, rendered at docs.jax.dev "Pallas: TPU Hardware Reference": v4 16 MiB, v5e 128 MiB,
  v5p 64 MiB, v6e 128 MiB per core; Google's Cloud TPU pages give HBM, not VMEM, and the "95" often
  quoted for v5p is its HBM in GB). Confirmed by compiling a kernel with a growing VMEM scratch for a
  compile-only device of each generation (libtpu 0.0.42.1, 2026-12-03): v4 refuses any allocation
  over 16 MiB ("would exceed memory (size=16777216)") whatever ``vmem_limit_bytes`` says, v5p over
  64 MiB, and v5e and v6e compile a 127 MiB scratch under a 128 MiB limit.
- ``default_scoped_bytes``: XLA's scoped-VMEM limit when a kernel passes no ``vmem_limit_bytes``,
  measured the same way: 16 MiB on v4, v5e and v5p, 32 MiB on v6e (a 20 MiB scratch fails there
  with ``CompileTimeScopedVmemOom``).
- ``vmem_limit_bytes``: the scoped limit the library's kernels pass: 7/8 of the physical VMEM (v4:
  all 16 MiB, which is also its default; the compiler ignores a larger value there), leaving the rest
  for Mosaic's internal scratch and register spills, which the kernels' own budgets
  (:mod:`latim_jax.kernels.vmem`) do not count.

``topology``: the compile-only topology that stands for one chip of the generation
(``jax.experimental.topologies.get_topology_desc``; :mod:`latim_jax.parallel.tpu_check`).
Imports nothing of latim_jax.
"""

from __future__ import annotations

import dataclasses

import jax

PLATFORMS = ("tpu", "gpu", "cpu")
MiB = 1 << 20


@dataclasses.dataclass(frozen=True)
class TpuChip:
    """One TPU generation (module docstring): VMEM per TensorCore and how to compile for it."""

    name: str
    device_kinds: tuple[str, ...]  # jax's ``device.device_kind`` strings for this generation
    vmem_bytes: int
    default_scoped_bytes: int
    vmem_limit_bytes: int
    topology: str
    topology_kw: tuple[tuple[str, object], ...] = ()

    def describe(self) -> str:
        """``TPU v5e (128 MiB VMEM per core)``."""
        return f"TPU {self.name} ({self.vmem_bytes // MiB} MiB VMEM per core)"


TPU_CHIPS = {
    chip.name: chip
    for chip in (
        TpuChip("v4", ("TPU v4",), 16 * MiB, 16 * MiB, 16 * MiB, "v4:2x2x1",
                (("chip_config_name", "megacore"),)),
        TpuChip("v5e", ("TPU v5 lite", "TPU v5e"), 128 * MiB, 16 * MiB, 112 * MiB, "v5e:1x1",
                (("chips_per_host_bounds", (1, 1, 1)),)),
        TpuChip("v5p", ("TPU v5", "TPU v5p"), 64 * MiB, 16 * MiB, 56 * MiB, "v5p:2x2x1"),
        TpuChip("v6e", ("TPU v6 lite", "TPU v6e"), 128 * MiB, 32 * MiB, 112 * MiB, "v6e:1x1",
                (("chips_per_host_bounds", (1, 1, 1)),)),
    )
}  # fmt: skip
# Aliases users type for a generation (Cloud TPU's accelerator names).
_ALIASES = {"v5litepod": "v5e", "v5lite": "v5e", "v6lite": "v6e", "trillium": "v6e", "v5": "v5p"}


def normalize_platform(platform: str) -> str:
    """Map a jax backend name to "tpu", "gpu" or "cpu"."""
    platform = {"cuda": "gpu", "rocm": "gpu"}.get(platform, platform)
    if platform not in PLATFORMS:
        raise ValueError(f"platform must be one of {PLATFORMS} (or cuda/rocm), found {platform!r}")
    return platform


def check_chip(chip: str) -> str:
    """A TPU generation's name ("v4", "v5e", "v5p", "v6e") from it, an alias ("v5litepod", "trillium")
    or a device kind ("TPU v5 lite"); a ValueError naming the known ones otherwise."""
    text = str(chip).strip()
    for known in TPU_CHIPS.values():
        if text in known.device_kinds:
            return known.name
    key = text.lower().removeprefix("tpu").strip().replace(" ", "").replace("-", "")
    key = _ALIASES.get(key, key)
    if key in TPU_CHIPS:
        return key
    known = sorted(TPU_CHIPS)
    raise ValueError(f"unknown TPU generation {chip!r}: expected one of {known} (or a device kind)")


def chip_of_device_kind(device_kind: str) -> str | None:
    """The generation of a jax ``device_kind`` ("TPU v5 lite" -> "v5e"), None for one not in the table."""
    try:
        return check_chip(device_kind)
    except ValueError:
        return None


def running_chip() -> str | None:
    """The generation of this process's first device when the default backend is a TPU, else None."""
    if jax.default_backend() != "tpu":
        return None
    return chip_of_device_kind(jax.devices()[0].device_kind)


def smallest_chip() -> TpuChip:
    """The generation with the least VMEM: the budget of a TPU program whose generation is unknown."""
    return min(TPU_CHIPS.values(), key=lambda c: c.vmem_limit_bytes)


def tpu_chip(chip: str | None) -> TpuChip:
    """The table entry of ``chip`` (a name, alias or device kind), or :func:`smallest_chip` for None."""
    return smallest_chip() if chip is None else TPU_CHIPS[check_chip(chip)]
