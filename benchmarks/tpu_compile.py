"""Compile the Pallas kernels with the real Mosaic compiler for TPU generations, from a CPU machine.

    python3 -m venv /tmp/tpuvenv && /tmp/tpuvenv/bin/pip install "jax[tpu]==<this jax>" flax
    /tmp/tpuvenv/bin/pip install --no-deps -e .
    JAX_PLATFORMS=cpu ALLOW_MULTIPLE_LIBTPU_LOAD=1 /tmp/tpuvenv/bin/python benchmarks/tpu_compile.py

``kernels.lowering`` (what CI runs) stops at the Mosaic custom call; this script runs Mosaic's layout
passes and its scoped-VMEM check too, by compiling for a compile-only TPU device
(``jax.experimental.topologies``): for each generation,
- the forward and ``value_and_grad`` of the Mamba-1 selective scan (forward and backward kernels) and of
  the Mamba-2 SSD at 130m-like shapes (ragged length, bf16 B, the default TPU ``Blocks``);
- the delta rule's M-tile kernel (kernels/delta_rule_tiles.py, TPU variant, the generation's VMEM
  budget): its forward at Qwen3-Next-like sizes (chunk C 64, key dim k 128, 4 heads, L 4096 = 64
  chunks, 64 target rows, a 512-column tile) and its ``value_and_grad`` (the XLA reference's
  rematerialised JVP around the kernel); at the tiny hybrid's C = k = 8 (512 chunks) with 5 rows and
  300 columns (rows and width padded); at C 4, k 6 (factors zero-padded to 8); and the score program
  that calls it (``layer_scores``, l2, of a one-layer gdn model at L 4096 with the tiles in the TPU
  context) for both sizes. Kimi Delta Attention ("kda") hands the kernel the same factor shapes (its
  per-channel decay is folded into them), so it compiles the same kernel: no case of its own.
Prints one line per (generation, case): compiled, with the compile time and XLA's memory analysis of
the program (HBM arguments, outputs, temporaries), or the error; exits 1 if any compile fails. Needs
libtpu (``jax[tpu]``); numerics and speed still need a TPU.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from latim_jax.kernels.delta_rule import TileFactors
from latim_jax.kernels.delta_rule_tiles import m_tile_pallas
from latim_jax.kernels.selective_scan import selective_scan_pallas
from latim_jax.kernels.ssd import ssd_pallas
from latim_jax.parallel.tpu_check import abstract_on

# generation: (topology name, get_topology_desc keywords) for a one-chip compile-only device
TOPOLOGIES = {
    "v4": ("v4:2x2x1", dict(chip_config_name="megacore")),
    "v5e": ("v5e:1x1", dict(chips_per_host_bounds=(1, 1, 1))),
    "v5p": ("v5p:2x2x1", {}),
    "v6e": ("v6e:1x1", dict(chips_per_host_bounds=(1, 1, 1))),
}
f32, bf16, i32 = jnp.float32, jnp.bfloat16, jnp.int32
MiB = 1 << 20

# Delta-rule M tiles: (name, chunk C, key dim k, heads H, length L, target rows r, width w)
DELTA_TILES = [
    ("C64 k128", 64, 128, 4, 4096, 64, 512),  # Qwen3-Next-like: n = 64 chunks, one 512-column tile
    ("C8 k8", 8, 8, 4, 4096, 5, 300),  # the tiny hybrid's: rows 5 -> 8, width 300 -> a 384 tile
    ("C4 k6", 4, 6, 2, 4096, 5, 300),  # chunk and key dim zero-padded to 8
]
# Delta-rule score programs: (name, gdn section, target rows: the last r positions); one layer, L 4096
DELTA_SCORES = [
    ("C64 k128", dict(k_heads=2, v_heads=4, k_dim=128, v_dim=128, chunk=64), 64),
    ("C8 k8", dict(k_heads=2, v_heads=4, k_dim=8, v_dim=6, chunk=8, conv_bias=True), 1),
]
SCORE_LENGTH = 4096


def _abstract(shapes):
    return [jax.ShapeDtypeStruct(s, d) for s, d in shapes]


def scan_cases():
    """(name, function, args): forward and value_and_grad of each scan."""
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

        out.append((f"{name} forward", fn, _abstract(args)))
        out.append(
            (f"{name} value_and_grad", jax.value_and_grad(loss, argnums=tuple(range(6))), _abstract(args))
        )
    return out


def delta_tile_cases(generation: str):
    """The M-tile kernel on one prompt's factors (b 1): forward per size, value_and_grad at the first."""
    out = []
    for i, (name, C, k, H, length, r, width) in enumerate(DELTA_TILES):
        n = -(-length // C)
        shapes = TileFactors((1, n, H, C, C), (1, n, H, k, C), (1, n, H, C, k), (1, n, H, k, k))
        factors = TileFactors(*(jax.ShapeDtypeStruct(s, f32) for s in shapes))
        args = [factors, jax.ShapeDtypeStruct((r,), i32), jax.ShapeDtypeStruct((), i32)]
        tile = functools.partial(m_tile_pallas, width=width, platform="tpu", interpret=False, chip=generation)
        out.append((f"delta tile {name} forward", tile, args))
        if i == 0:

            def loss(factors, rows, c0, tile=tile):
                return jnp.sum(jnp.sin(tile(factors, rows, c0)))

            out.append((f"delta tile {name} value_and_grad", jax.value_and_grad(loss), args))
    return out


@functools.cache
def _delta_score_factors(section: tuple):
    """The abstract DeltaFactors (XLA context) of a one-layer gdn model with this section at L 4096."""
    import latim_jax
    from latim_jax.latim.kinds import layer_factors
    from latim_jax.model.init import init_params
    from latim_jax.parallel.context import XLA

    cfg = latim_jax.MambaConfig(
        version=2,
        d_model=256,
        n_layers=1,
        vocab_size=256,
        layer_kinds=("gdn",),
        sections={"gdn": dict(section)},
    )
    model = latim_jax.MambaLM(cfg, init_params(cfg, 0))
    h = jax.ShapeDtypeStruct((1, SCORE_LENGTH, cfg.d_model), f32)
    return jax.eval_shape(lambda h: layer_factors(model, h, 0, impl=XLA), h)


def delta_score_cases(generation: str):
    """The l2 score program of one gdn layer with its M tiles from the kernel (TPU context)."""
    from latim_jax.latim.scores import layer_scores
    from latim_jax.parallel.context import Context

    ctx = Context(kernels=True, platform="tpu", chip=generation)
    out = []
    for name, section, r in DELTA_SCORES:
        f = dataclasses.replace(_delta_score_factors(tuple(sorted(section.items()))), ctx=ctx)
        rows = np.arange(SCORE_LENGTH - r, SCORE_LENGTH, dtype=np.int32)
        program = functools.partial(lambda f, mask, rows: layer_scores(f, "l2", rows, mask=mask), rows=rows)
        out.append(
            (f"delta score {name} l2 {r} rows", program, [f, jax.ShapeDtypeStruct((1, SCORE_LENGTH), bool)])
        )
    return out


def cases(generation: str):
    """(name, function, args: a pytree of ShapeDtypeStructs) for one generation."""
    return scan_cases() + delta_tile_cases(generation) + delta_score_cases(generation)


def main() -> int:
    from jax.experimental import topologies

    print(f"jax {jax.__version__}")
    failed = 0
    for generation, (topology, kw) in TOPOLOGIES.items():
        try:
            device = topologies.get_topology_desc(platform="tpu", topology_name=topology, **kw).devices[0]
        except Exception as err:  # no libtpu, or this libtpu lacks the generation
            print(f"{generation:<4} no compile-only device: {type(err).__name__}: {str(err)[:200]}")
            failed += 1
            continue
        for name, fn, abstract in cases(generation):
            args = abstract_on(device, abstract)
            start = time.perf_counter()
            try:
                stats = jax.jit(fn).trace(*args).lower().compile().memory_analysis()
            except Exception as err:
                failed += 1
                print(f"{generation:<4} {name:<36} FAILED {type(err).__name__}: {str(err)[:800]}")
                continue
            seconds = time.perf_counter() - start
            mib = lambda n: f"{n / MiB:.1f}"  # noqa: E731
            print(
                f"{generation:<4} {name:<36} compiled {seconds:5.1f} s  HBM MiB: arguments "
                f"{mib(stats.argument_size_in_bytes)}, outputs {mib(stats.output_size_in_bytes)}, "
                f"temporaries {mib(stats.temp_size_in_bytes)}",
                flush=True,
            )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
