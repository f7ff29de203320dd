"""GPU check of the Pallas kernels: correctness against the references, then kernel vs XLA timings.

    python benchmarks/gpu_check.py                 # on a GPU: verify, then time 130m-shaped layers
    python benchmarks/gpu_check.py --cpu-smoke     # anywhere: tiny shapes, interpret mode, no timings
    python benchmarks/gpu_check.py --sweep         # on a GPU: also time a few Blocks candidates

1. Verify: every kernel on random inputs (odd lengths, groups 1 and 2, bf16 inputs, initial state)
   against its pure-jnp reference; the max |kernel - reference| / max |reference| per output.
2. Time: one 130m-shaped layer, median of several runs after a warm-up, for the kernel
   (impl="pallas") and the XLA reference (impl="xla"), forward and the gradient of every input (the
   Pallas backward against jax's differentiation of the reference): Mamba-1 e=1536, n=16; Mamba-2
   h=24, p=64, n=128, g=1; L = 1024 and 4096, batch 1.

Hooks: each row of either table comes from an entry of ``CHECKS`` / ``TIMINGS`` (``register_check``,
``register_timing``); a later kernel (for example the fused-score kernel) registers its own entries
with a kernel and a reference callable and shows up in both tables.
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import functools
import statistics
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from latim_jax.kernels.block_sizes import Blocks
from latim_jax.kernels.selective_scan import selective_scan_pallas, selective_scan_reference
from latim_jax.kernels.ssd import ssd_pallas, ssd_reference

# --------------------------------------------------------------------------------------------------
# Registry: what the two tables run
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Check:
    """A correctness row: ``kernel(*inputs)`` vs ``reference(*inputs)`` (pytrees of arrays)."""

    name: str
    make_inputs: Callable[[bool], tuple]  # smoke -> positional inputs
    kernel: Callable[..., object]  # (*inputs, block_sizes=..., interpret=...) -> pytree
    reference: Callable[..., object]
    tol: float


@dataclasses.dataclass(frozen=True)
class Timing:
    """A timing row: ``kernel`` and ``reference`` on ``make_inputs(length)``."""

    name: str
    lengths: tuple[int, ...]
    make_inputs: Callable[[int], tuple]
    kernel: Callable[..., object]
    reference: Callable[..., object]


CHECKS: list[Check] = []
TIMINGS: list[Timing] = []


def register_check(check: Check) -> Check:
    CHECKS.append(check)
    return check


def register_timing(timing: Timing) -> Timing:
    TIMINGS.append(timing)
    return timing


# --------------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------------


def _rng_arrays(seed, *shapes):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(np.float32) for s in shapes]


def mamba1_inputs(b, l, e, n, *, dtype=jnp.float32, with_init=False, seed=0):
    """(u, delta, A, B, C, D[, initial_state]) with a realistic delta (softplus) and A < 0."""
    u, dr, ar, B, C, D, h0 = _rng_arrays(
        seed, (b, l, e), (b, l, e), (e, n), (b, l, n), (b, l, n), (e,), (b, e, n)
    )
    delta, A = np.log1p(np.exp(dr - 1.0)), -np.exp(0.5 * ar)
    cast = lambda t: jnp.asarray(t, dtype)
    out = (cast(u), cast(delta), jnp.asarray(A), cast(B), cast(C), jnp.asarray(D))
    return (*out, jnp.asarray(h0)) if with_init else out


def mamba2_inputs(b, l, h, p, n, g, *, dtype=jnp.float32, with_init=False, seed=0):
    """(x, dt, A, B, C, D[, initial_state])."""
    x, dr, ar, B, C, D, h0 = _rng_arrays(
        seed, (b, l, h, p), (b, l, h), (h,), (b, l, g, n), (b, l, g, n), (h,), (b, h, p, n)
    )
    dt, A = np.log1p(np.exp(dr - 1.0)), -np.exp(0.5 * ar)
    cast = lambda t: jnp.asarray(t, dtype)
    out = (cast(x), cast(dt), jnp.asarray(A), cast(B), cast(C), jnp.asarray(D))
    return (*out, jnp.asarray(h0)) if with_init else out


# --------------------------------------------------------------------------------------------------
# The scan kernels' rows
# --------------------------------------------------------------------------------------------------


def _scan_kernel(*args, **kw):
    return selective_scan_pallas(*args[:6], args[6] if len(args) > 6 else None, **kw)


def _scan_reference(*args):
    return selective_scan_reference(*args[:6], args[6] if len(args) > 6 else None)


def _ssd_kernel(*args, **kw):
    return ssd_pallas(*args[:6], 64, args[6] if len(args) > 6 else None, **kw)


def _ssd_reference(*args):
    return ssd_reference(*args[:6], 64, args[6] if len(args) > 6 else None)


def _scan_loss(scan):
    """A scalar of every scan output (for the gradient rows): sum sin(y) + sum final_state."""

    def loss(*args):
        y, final = scan(*args)
        return jnp.sum(jnp.sin(y)) + jnp.sum(final)

    return loss


def _grad_of(scan):
    """``scan``'s gradient of ``_scan_loss`` w.r.t. every input (keywords go to the scan)."""

    def grads(*args, **kw):
        fn = functools.partial(scan, **kw) if kw else scan
        return jax.grad(_scan_loss(fn), argnums=tuple(range(len(args))))(*args)

    return grads


# the kernels' gradients (their Pallas backwards) and jax's differentiation of the references
_scan_grad_kernel, _scan_grad_reference = _grad_of(_scan_kernel), _grad_of(_scan_reference)
_ssd_grad_kernel, _ssd_grad_reference = _grad_of(_ssd_kernel), _grad_of(_ssd_reference)


# Relative-error bounds (max |err| / max |ref|). Both paths compute in fp32 from the same inputs; the
# bound leaves room for sequential-vs-associative rounding at L = 4096 and approximate GPU exp.
TOL = {"float32": 1e-4, "bfloat16": 2e-4}

# (label, inputs builder, full-size shape, smoke shape): one-step, odd/prime and long sequences.
SCAN_CASES = [
    ("mamba1 l=1", mamba1_inputs, (2, 1, 1536, 16), (1, 1, 16, 8)),
    ("mamba1 prime l", mamba1_inputs, (2, 1031, 1536, 16), (2, 13, 16, 8)),
    ("mamba1 long l", mamba1_inputs, (1, 4096, 768, 16), (1, 40, 16, 8)),
    ("mamba2 l=1 g=1", mamba2_inputs, (2, 1, 24, 64, 128, 1), (1, 1, 4, 16, 16, 1)),
    ("mamba2 prime l g=2", mamba2_inputs, (2, 1031, 24, 64, 128, 2), (2, 13, 4, 16, 16, 2)),
    ("mamba2 long l g=1", mamba2_inputs, (1, 4096, 24, 64, 128, 1), (1, 40, 4, 16, 16, 1)),
]


def _register_scan_rows():
    for label, make, shape, smoke in SCAN_CASES:
        kernel, reference = (
            (_scan_kernel, _scan_reference) if make is mamba1_inputs else (_ssd_kernel, _ssd_reference)
        )
        for dtype, init in ((jnp.float32, False), (jnp.bfloat16, True)):
            name = jnp.dtype(dtype).name
            build = functools.partial(_case_inputs, make, shape, smoke, dtype, init)
            register_check(
                Check(f"{label} {name}{' init' if init else ''}", build, kernel, reference, TOL[name])
            )
    for label, make, shape, smoke, kernel, reference in (
        ("mamba1 grad prime l", mamba1_inputs, (2, 1031, 1536, 16), (2, 13, 16, 8),
         _scan_grad_kernel, _scan_grad_reference),
        ("mamba2 grad prime l g=2", mamba2_inputs, (2, 1031, 24, 64, 128, 2), (2, 13, 4, 16, 16, 2),
         _ssd_grad_kernel, _ssd_grad_reference),
    ):  # fmt: skip
        build = functools.partial(_case_inputs, make, shape, smoke, jnp.float32, True)
        register_check(Check(label, build, kernel, reference, TOL["float32"]))
    m1 = lambda l: mamba1_inputs(1, l, 1536, 16)  # noqa: E731
    m2 = lambda l: mamba2_inputs(1, l, 24, 64, 128, 1)  # noqa: E731
    for name, make, kernel, reference in (
        ("mamba1 scan e=1536 n=16", m1, _scan_kernel, _scan_reference),
        ("mamba1 scan grad e=1536 n=16", m1, _scan_grad_kernel, _scan_grad_reference),
        ("mamba2 ssd h=24 p=64 n=128 g=1", m2, _ssd_kernel, _ssd_reference),
        ("mamba2 ssd grad h=24 p=64 n=128 g=1", m2, _ssd_grad_kernel, _ssd_grad_reference),
    ):
        register_timing(Timing(name, (1024, 4096), make, kernel, reference))


def _case_inputs(make, shape, smoke_shape, dtype, with_init, smoke: bool):
    return make(*(smoke_shape if smoke else shape), dtype=dtype, with_init=with_init)


_register_scan_rows()


# --------------------------------------------------------------------------------------------------
# The fused-score kernel's rows (kernels/fused_scores.py): one layer's unnormalised scores for every
# target row, from the exact factors of a random 130m-shaped layer, against the blocked XLA path
# (latim_jax.latim.scores). "fp32" rows run both sides at matmul precision "highest"; the "tf32" row lets
# both use tensor cores. The scan sweep's Blocks set no score tile: the score kernel keeps its
# defaults. Peak memory (each compiled program's temp + output bytes, and the
# process peak) prints as a last table when the script exits.
# --------------------------------------------------------------------------------------------------

SCORE_LAYERS = {  # name: (full-size layer, smoke layer)
    "mamba2 d=768 e=1536 h=24 n=128 g=1": (
        dict(version=2, d_model=768, d_state=128, head_dim=64, n_groups=1),
        dict(version=2, d_model=16, d_state=16, head_dim=16, n_groups=2),
    ),
    "mamba1 d=768 e=1536 n=16": (
        dict(version=1, d_model=768, d_state=16),
        dict(version=1, d_model=16, d_state=16),
    ),
}
SCORE_MEMORY: list[tuple[str, int, dict]] = []


def score_inputs(layer: str, length: int, smoke: bool = False, seed: int = 0):
    """(rows, f): every target row, and the exact MambaFactors of a random 1-layer model on random
    tokens (rows first: the check table prints the first input's shape)."""
    import latim_jax
    import latim_jax.model.init
    from latim_jax.latim.kinds import layer_factors

    full, tiny = SCORE_LAYERS[layer]
    cfg = latim_jax.MambaConfig(n_layers=1, vocab_size=256, d_conv=4, **(tiny if smoke else full))
    model = latim_jax.MambaLM(cfg, latim_jax.model.init.init_params(cfg, seed))
    tokens = np.random.default_rng(seed).integers(0, cfg.vocab_size, (1, length))
    f = jax.jit(lambda t: layer_factors(model, model.forward(t).residuals[0], 0, "exact"))(tokens)
    return jnp.arange(length), f


def _score_kernel(
    rows, f, *, method="l2", precision="highest", block_sizes=None, platform=None, interpret=None
):
    from latim_jax.kernels.fused_scores import fused_layer_scores

    # "highest": fp32 matmul passes; "default": bf16 passes on TPU, TF32 on GPU (the kernel's "bfloat16")
    kernel_precision = "float32" if precision == "highest" else "bfloat16"
    return fused_layer_scores(
        f, method, rows, block_sizes=block_sizes, precision=kernel_precision, platform=platform,
        interpret=interpret,
    )  # fmt: skip


def _score_reference(rows, f, *, method="l2", precision="highest"):
    from latim_jax.latim.scores import blocked_scores

    with jax.default_matmul_precision(precision):  # read when the einsums are traced
        return blocked_scores(f, method, rows)


def _score_timing_inputs(layer: str, precision: str, length: int):
    inputs = score_inputs(layer, length)
    kernel = functools.partial(_score_kernel, precision=precision, platform="gpu")
    reference = functools.partial(_score_reference, precision=precision)
    mem = {}
    for side, fn in (("xla", reference), ("pallas", kernel)):
        analysis = jax.jit(fn).lower(*inputs).compile().memory_analysis()
        mem[side] = None if analysis is None else analysis.temp_size_in_bytes + analysis.output_size_in_bytes
    SCORE_MEMORY.append((f"{layer} l2 {precision}", length, mem))
    return inputs


def print_score_memory() -> None:
    if not SCORE_MEMORY:
        return
    gib = lambda x: "n/a" if x is None else f"{x / 2**30:.3f}"  # noqa: E731
    header = f"{'fused scores: compiled temp + output':<44} {'L':>6} {'xla GiB':>9} {'pallas GiB':>11}"
    print(f"\n{header} {'ratio':>7}")
    for name, length, mem in SCORE_MEMORY:
        ratio = f"{mem['xla'] / mem['pallas']:.1f}x" if mem["xla"] and mem["pallas"] else "n/a"
        print(f"{name:<44} {length:>6} {gib(mem['xla']):>9} {gib(mem['pallas']):>11} {ratio:>7}")
    stats = getattr(jax.devices()[0], "memory_stats", lambda: None)()
    if stats and "peak_bytes_in_use" in stats:
        print(f"process peak device memory: {stats['peak_bytes_in_use'] / 2**30:.3f} GiB")


def _register_score_rows():
    for layer in SCORE_LAYERS:
        for method in ("l2", "alti"):
            register_check(
                Check(
                    f"scores {method} {layer.split()[0]} prime l",
                    functools.partial(
                        lambda layer, smoke: score_inputs(layer, 13 if smoke else 1031, smoke), layer
                    ),
                    functools.partial(_score_kernel, method=method),
                    functools.partial(_score_reference, method=method),
                    TOL["float32"],
                )
            )
    for layer, precisions in zip(SCORE_LAYERS, (("highest", "default"), ("highest",)), strict=True):
        for precision in precisions:
            label = "fp32" if precision == "highest" else "tf32"
            register_timing(
                Timing(
                    f"fused l2 {layer.split()[0]} {label}",
                    (1024, 4096),
                    functools.partial(_score_timing_inputs, layer, precision),
                    functools.partial(_score_kernel, precision=precision),
                    functools.partial(_score_reference, precision=precision),
                )
            )
    atexit.register(print_score_memory)


_register_score_rows()

# --------------------------------------------------------------------------------------------------
# The delta-rule M-tile kernel's rows (kernels/delta_rule_tiles.py): M[last 64 rows, every column] per
# head from the TileFactors of random Qwen3-Next-shaped Gated DeltaNet (scalar decay per head) and KDA
# (decay per key channel) inputs, against the XLA scan over chunks (kernels.delta_rule.m_tile).
# --------------------------------------------------------------------------------------------------

DELTA_SHAPES = {"full": dict(H=8, dk=128, C=64), "smoke": dict(H=2, dk=8, C=8)}
DELTA_ROWS = 64  # target rows per tile (the last ones: every chunk is crossed)


def delta_inputs(length: int, per_channel: bool, smoke: bool = False, seed: int = 0):
    """(rows, factors): the last :data:`DELTA_ROWS` rows and the TileFactors of random unit q, k, a
    log-decay g < 0 ((b, l, H) or, per_channel, (b, l, H, d_k)) and beta in (0, 1), batch 1."""
    from latim_jax.kernels import delta_rule

    s = DELTA_SHAPES["smoke" if smoke else "full"]
    H, dk, C = s["H"], s["dk"], s["C"]
    keys = jax.random.split(jax.random.key(seed), 4)
    q = delta_rule.l2_normalise(jax.random.normal(keys[0], (1, length, H, dk))) * dk**-0.5
    k = delta_rule.l2_normalise(jax.random.normal(keys[1], (1, length, H, dk)))
    g_shape = (1, length, H, dk) if per_channel else (1, length, H)
    g = -jax.nn.softplus(jax.random.normal(keys[2], g_shape) - 3.0)  # e^g in ~(0.6, 1): long memory
    beta = jax.nn.sigmoid(jax.random.normal(keys[3], (1, length, H)))
    factors = jax.jit(delta_rule.tile_factors, static_argnums=4)(q, k, g, beta, C)
    return jnp.arange(max(length - DELTA_ROWS, 0), length), factors


def _delta_width(factors) -> int:
    return factors.local.shape[1] * factors.local.shape[3]  # n chunks x C: every column (past l: 0)


def _delta_kernel(rows, factors, *, block_sizes=None, platform=None, interpret=None):
    from latim_jax.kernels.delta_rule_tiles import m_tile_pallas

    limit = None if block_sizes is None else block_sizes.vmem_limit_bytes
    return m_tile_pallas(
        factors,
        rows,
        0,
        _delta_width(factors),
        platform=platform,
        interpret=interpret,
        vmem_limit_bytes=limit,
    )


def _delta_reference(rows, factors):
    from latim_jax.kernels import delta_rule

    return delta_rule.m_tile(factors, rows, 0, _delta_width(factors))


def _register_delta_rows():
    for kind, per_channel in (("gdn", False), ("kda", True)):
        register_check(
            Check(
                f"delta M tile {kind} prime l",
                functools.partial(
                    lambda pc, smoke: delta_inputs(37 if smoke else 1031, pc, smoke), per_channel
                ),
                _delta_kernel,
                _delta_reference,
                TOL["float32"],
            )
        )
        register_timing(
            Timing(
                f"delta M tile {kind} last {DELTA_ROWS} rows",
                (1024, 4096),
                functools.partial(lambda pc, length: delta_inputs(length, pc), per_channel),
                _delta_kernel,
                _delta_reference,
            )
        )


_register_delta_rows()

# --------------------------------------------------------------------------------------------------
# Running the tables
# --------------------------------------------------------------------------------------------------


def rel_err(x, ref) -> float:
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(x - ref)) / max(np.max(np.abs(ref)), 1e-30))


def run_checks(smoke: bool, block_sizes: Blocks | None) -> bool:
    print(f"{'check':<34} {'input 0 shape':<20} {'output':<7} {'rel err':>9} {'tol':>7}  ok")
    all_ok = True
    for check in CHECKS:
        inputs = check.make_inputs(smoke)
        kernel = functools.partial(check.kernel, block_sizes=block_sizes, platform="gpu", interpret=smoke)
        kernel = jax.jit(kernel)
        outs = jax.tree.leaves(kernel(*inputs))
        refs = jax.tree.leaves(jax.jit(check.reference)(*inputs))
        for i, (out, ref) in enumerate(zip(outs, refs, strict=True)):
            err = rel_err(out, ref)
            ok = bool(np.isfinite(err) and err <= check.tol and out.shape == ref.shape)
            all_ok &= ok
            shape, verdict = str(tuple(inputs[0].shape)), "ok" if ok else "FAIL"
            print(f"{check.name:<34} {shape:<20} {'out' + str(i):<7} {err:9.2e} {check.tol:7.0e}  {verdict}")
    return all_ok


def time_ms(fn, inputs, repeats: int) -> float:
    jax.block_until_ready(fn(*inputs))  # compile + warm-up
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*inputs))
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def run_timings(block_sizes_list: list[Blocks | None], repeats: int) -> None:
    print(f"\n{'layer':<34} {'L':>6} {'xla ms':>9} {'pallas ms':>10} {'speed-up':>9}  block sizes")
    for timing in TIMINGS:
        for length in timing.lengths:
            inputs = timing.make_inputs(length)
            xla = time_ms(jax.jit(timing.reference), inputs, repeats)
            for bs in block_sizes_list:
                kernel = jax.jit(functools.partial(timing.kernel, block_sizes=bs, platform="gpu"))
                ms = time_ms(kernel, inputs, repeats)
                print(f"{timing.name:<34} {length:>6} {xla:9.3f} {ms:10.3f} {xla / ms:8.2f}x  {describe(bs)}")


def describe(bs: Blocks | None) -> str:
    if bs is None:
        return "default"
    return " ".join(f"{f.name}={getattr(bs, f.name)}" for f in dataclasses.fields(bs))


SWEEP = [  # GPU candidates for --sweep (None = Blocks.for_platform("gpu"))
    None,
    Blocks(scan_block_e=16, ssd_chunk=32, ssd_block_p=16, num_warps_scan=1, num_warps_ssd=4),
    Blocks(scan_block_e=64, ssd_chunk=64, ssd_block_p=64, num_warps_scan=2, num_warps_ssd=8),
    Blocks(scan_block_e=128, ssd_chunk=128, ssd_block_p=32, num_warps_scan=4, num_warps_ssd=8),
]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny shapes in interpret mode, no timings")
    parser.add_argument("--sweep", action="store_true", help="time a few GPU Blocks candidates")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--skip-checks", action="store_true")
    args = parser.parse_args(argv)

    backend = jax.default_backend()
    print(f"jax {jax.__version__}, backend {backend}, devices {jax.devices()}")
    if args.cpu_smoke:
        smoke_blocks = Blocks(scan_block_l=8, scan_block_e=8, ssd_chunk=16, ssd_block_p=8)
        return 0 if run_checks(smoke=True, block_sizes=smoke_blocks) else 1
    if backend != "gpu":
        print(
            f"gpu_check needs a GPU (the default backend is {backend!r}); use --cpu-smoke for an "
            "interpret-mode run on tiny shapes."
        )
        return 2
    ok = True if args.skip_checks else run_checks(smoke=False, block_sizes=None)
    run_timings(SWEEP if args.sweep else [None], args.repeats)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
