"""Compile the Pallas scan kernels with the real Mosaic compiler for TPU generations, from a CPU machine.

    python3 -m venv /tmp/tpuvenv && /tmp/tpuvenv/bin/pip install "jax[tpu]==<this jax>" flax
    /tmp/tpuvenv/bin/pip install --no-deps -e .
    JAX_PLATFORMS=cpu ALLOW_MULTIPLE_LIBTPU_LOAD=1 /tmp/tpuvenv/bin/python benchmarks/tpu_compile.py

``kernels.lowering`` (what CI runs) stops at the Mosaic custom call; this script runs Mosaic's layout
passes and its scoped-VMEM check too, by compiling for a compile-only TPU device
(``jax.experimental.topologies``): for each generation, the forward and ``value_and_grad`` of the
Mamba-1 selective scan (forward and backward kernels) and of the Mamba-2 SSD at 130m-like shapes
(ragged length, bf16 B, the default TPU ``Blocks``). Prints one line per (generation, case) and exits 1
if any compile fails. Needs libtpu (``jax[tpu]``); numerics and speed still need a TPU.
"""

from __future__ import annotations

import functools
import sys

import jax
import jax.numpy as jnp

from latim_jax.kernels.selective_scan import selective_scan_pallas
from latim_jax.kernels.ssd import ssd_pallas

# generation: (topology name, get_topology_desc keywords) for a one-chip compile-only device
TOPOLOGIES = {
    "v4": ("v4:2x2x1", dict(chip_config_name="megacore")),
    "v5e": ("v5e:1x1", dict(chips_per_host_bounds=(1, 1, 1))),
    "v5p": ("v5p:2x2x1", {}),
    "v6e": ("v6e:1x1", dict(chips_per_host_bounds=(1, 1, 1))),
}


def cases():
    """(name, function, [(shape, dtype)]): forward and value_and_grad of each scan."""
    f32, bf16 = jnp.float32, jnp.bfloat16
    b, l, e, n = 2, 1031, 1536, 16
    scan_args = [((b, l, e), f32), ((b, l, e), f32), ((e, n), f32), ((b, l, n), bf16), ((b, l, n), f32),
                 ((e,), f32)]  # fmt: skip
    h, p, g, n2 = 24, 64, 1, 128
    ssd_args = [((b, l, h, p), f32), ((b, l, h), f32), ((h,), f32), ((b, l, g, n2), bf16),
                ((b, l, g, n2), f32), ((h,), f32)]  # fmt: skip
    scan = functools.partial(selective_scan_pallas, platform="tpu", interpret=False)
    ssd = functools.partial(ssd_pallas, chunk_size=128, platform="tpu", interpret=False)
    out = []
    for name, fn, args in (("mamba1 scan", scan, scan_args), ("mamba2 ssd", ssd, ssd_args)):

        def loss(*a, fn=fn):
            y, state = fn(*a)
            return jnp.sum(jnp.sin(y)) + jnp.sum(state)

        out.append((f"{name} forward", fn, args))
        out.append((f"{name} value_and_grad", jax.value_and_grad(loss, argnums=tuple(range(6))), args))
    return out


def main() -> int:
    from jax.experimental import topologies
    from jax.sharding import SingleDeviceSharding

    print(f"jax {jax.__version__}")
    failed = 0
    for generation, (topology, kw) in TOPOLOGIES.items():
        try:
            device = topologies.get_topology_desc(platform="tpu", topology_name=topology, **kw).devices[0]
        except Exception as err:  # no libtpu, or this libtpu lacks the generation
            print(f"{generation:<4} no compile-only device: {type(err).__name__}: {str(err)[:200]}")
            failed += 1
            continue
        sharding = SingleDeviceSharding(device)
        for name, fn, shapes in cases():
            args = [jax.ShapeDtypeStruct(s, d, sharding=sharding) for s, d in shapes]
            try:
                jax.jit(fn).trace(*args).lower().compile()
                print(f"{generation:<4} {name:<28} compiled")
            except Exception as err:
                failed += 1
                print(f"{generation:<4} {name:<28} FAILED {type(err).__name__}: {str(err)[:800]}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
