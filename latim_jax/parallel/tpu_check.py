"""Compile a program for a named TPU generation from any host, and report the memory it needs.

``jax.jit(fn).lower(...)`` for TPU runs the Pallas (Mosaic) lowering only; the XLA:TPU compile that
checks VMEM, lays vectors out and sizes HBM buffers needs libtpu. With libtpu installed (``pip install
"jax[tpu]==<this jax>"``, about 210 MB; a CPU host needs no TPU), ``jax.experimental.topologies``
gives a compile-only device of each generation, and :func:`compile_for_tpu` compiles for it:

    JAX_PLATFORMS=cpu ALLOW_MULTIPLE_LIBTPU_LOAD=1 python -c '...compile_for_tpu(fn, *args, chip="v5e")'

(``JAX_PLATFORMS=cpu`` keeps jax's running backend on the CPU; ``ALLOW_MULTIPLE_LIBTPU_LOAD`` lets
libtpu load in a process that may not own a TPU.) The program must be built for that TPU: pass the
library a context resolved for it, ``latim_jax.parallel.resolve("pallas", platform="tpu", chip=...)``,
so that its kernels take the TPU variant with interpret mode off and the generation's VMEM budget.
The CLI's ``latim-jax tpu-check`` compiles a model's programs this way (``latim_jax.cli.tpu_check``).
Imports nothing of latim_jax but the chip table.
"""

from __future__ import annotations

import dataclasses

import jax
from jax.sharding import SingleDeviceSharding

from latim_jax.parallel.chips import TPU_CHIPS, MiB, check_chip


class NoLibtpu(RuntimeError):
    """A compile-only TPU device cannot be made here (libtpu missing, or it lacks the generation)."""


@dataclasses.dataclass(frozen=True)
class Compiled:
    """What compiling one program for a TPU generation gave: ``ok``, or the compiler's ``error``, and
    the memory XLA reports (bytes per device; None where the compile failed)."""

    name: str
    chip: str
    ok: bool
    error: str | None = None
    argument_bytes: int | None = None
    output_bytes: int | None = None
    temp_bytes: int | None = None
    code_bytes: int | None = None

    @property
    def total_bytes(self) -> int | None:
        """Arguments + outputs + temporaries: the HBM the program needs on one device."""
        if not self.ok:
            return None
        return self.argument_bytes + self.output_bytes + self.temp_bytes

    def line(self) -> str:
        """One line for a report: the program, the chip, and its memory or the error."""
        if not self.ok:
            return f"{self.chip:<4} {self.name:<40} FAILED {self.error}"
        mib = lambda n: f"{n / MiB:9.1f}"  # noqa: E731
        return (
            f"{self.chip:<4} {self.name:<40} total {mib(self.total_bytes)} MiB = arguments "
            f"{mib(self.argument_bytes)} + outputs {mib(self.output_bytes)} "
            f"+ temporaries {mib(self.temp_bytes)}"
        )


def compile_only_device(chip: str):
    """One device of a compile-only topology standing for one chip of generation ``chip`` (its table
    entry's topology in :mod:`latim_jax.parallel.chips`). Raises :class:`NoLibtpu` where it cannot."""
    entry = TPU_CHIPS[check_chip(chip)]
    try:
        from jax.experimental import topologies

        desc = topologies.get_topology_desc(
            platform="tpu", topology_name=entry.topology, **dict(entry.topology_kw)
        )
    except (
        Exception
    ) as err:  # no libtpu (jax raises a RuntimeError naming the missing plugin) or no such topology
        raise NoLibtpu(
            f"no compile-only TPU {entry.name} device ({type(err).__name__}: {str(err)[:300]}); install "
            f'libtpu with `pip install "jax[tpu]=={jax.__version__}"` and run with JAX_PLATFORMS=cpu '
            "ALLOW_MULTIPLE_LIBTPU_LOAD=1"
        ) from err
    return desc.devices[0]


def abstract_on(device, tree):
    """``tree``'s arrays (or ShapeDtypeStructs) as ShapeDtypeStructs placed on ``device``."""
    sharding = SingleDeviceSharding(device)
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)


def compile_for_tpu(fn, *args, chip: str, name: str | None = None, device=None) -> Compiled:
    """Compile ``fn(*args)`` (args: arrays, ShapeDtypeStructs or pytrees of them; only their shapes and
    dtypes are read) for one chip of generation ``chip``, on a compile-only device (or ``device``),
    and return its :class:`Compiled`: the memory analysis, or the compiler's error (a VMEM overflow
    among them). The library's own refusals (ValueError, e.g. a tile over the VMEM budget) are
    reported as failures too. Needs libtpu (:func:`compile_only_device`)."""
    chip = check_chip(chip)
    device = compile_only_device(chip) if device is None else device
    name = name or getattr(fn, "__name__", "program")
    jitted = fn if hasattr(fn, "trace") else jax.jit(fn)
    try:
        compiled = jitted.trace(*abstract_on(device, args)).lower().compile()
    except Exception as err:  # the compiler's errors are what this reports
        text = " ".join(str(err).split())
        return Compiled(name=name, chip=chip, ok=False, error=f"{type(err).__name__}: {text[:600]}")
    stats = compiled.memory_analysis()
    return Compiled(
        name=name,
        chip=chip,
        ok=True,
        argument_bytes=int(stats.argument_size_in_bytes),
        output_bytes=int(stats.output_size_in_bytes),
        temp_bytes=int(stats.temp_size_in_bytes),
        code_bytes=int(stats.generated_code_size_in_bytes),
    )
