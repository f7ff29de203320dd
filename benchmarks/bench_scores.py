"""Blocked score path vs materialising T, side by side in one run (time and peak memory).

Each variant runs in its own subprocess so its peak resident memory (ru_maxrss) is its own. The model is
one 130m-shaped layer (random weights: speed and memory do not depend on the values).

    python benchmarks/bench_scores.py --version 2 --lengths 128 256 512 [--out benchmarks/results_cpu.md]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

SHAPES = {
    1: dict(version=1, d_model=768, n_layers=1, vocab_size=256, d_state=16, d_conv=4),
    2: dict(
        version=2, d_model=768, n_layers=1, vocab_size=256, d_state=128, d_conv=4, head_dim=64, chunk_size=64
    ),
}


def child(version: int, length: int, variant: str) -> None:
    """Run one variant and print a JSON line with its time (second call) and compile+first-call time."""
    import resource

    import jax
    import jax.numpy as jnp
    import numpy as np

    import latim_jax
    from latim_jax.model.init import init_params

    cfg = latim_jax.MambaConfig(**SHAPES[version])
    model = latim_jax.MambaLM(cfg, init_params(cfg, 0))
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, length))

    if variant == "blocked":
        fn = lambda: latim_jax.attribute(model, tokens, method="l2").scores  # noqa: E731
    elif variant == "last_row":
        fn = lambda: latim_jax.attribute(model, tokens, method="l2", rows=[length - 1]).scores  # noqa: E731
    else:  # materialise T (L, L, d), then the norm

        def fn():
            c = latim_jax.contributions(model, tokens, 0)
            return jnp.linalg.norm(c.T, axis=-1)

    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    second = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # GiB (ru_maxrss is KiB on Linux)
    print(
        json.dumps(
            {"variant": variant, "length": length, "first_s": first, "run_s": second, "peak_gib": peak}
        )
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--version", type=int, default=2)
    p.add_argument("--lengths", type=int, nargs="+", default=[128, 256, 512])
    p.add_argument("--variants", nargs="+", default=["materialise", "blocked", "last_row"])
    p.add_argument("--out", default=None, help="append a markdown table to this file")
    p.add_argument("--child", nargs=3, metavar=("VERSION", "LENGTH", "VARIANT"))
    args = p.parse_args()
    if args.child:
        child(int(args.child[0]), int(args.child[1]), args.child[2])
        return
    rows = []
    for length in args.lengths:
        res = {}
        for variant in args.variants:
            out = subprocess.run(
                [sys.executable, __file__, "--child", str(args.version), str(length), variant],
                capture_output=True,
                text=True,
            )
            if out.returncode != 0:
                res[variant] = None
                print(f"L={length} {variant}: failed ({out.stderr.strip().splitlines()[-1:]})", flush=True)
                continue
            res[variant] = json.loads(out.stdout.strip().splitlines()[-1])
            r = res[variant]
            print(
                f"L={length} {variant}: run {r['run_s']:.2f} s (first {r['first_s']:.1f} s), "
                f"peak {r['peak_gib']:.2f} GiB",
                flush=True,
            )
        rows.append((length, res))
    lines = [
        f"\n### Mamba-{args.version}, one 130m-shaped layer, l2 exact, CPU ({time.strftime('%Y-%m-%d')})\n",
        "| L | variant | run (s) | peak RSS (GiB) | time vs materialise | memory vs materialise |",
        "|---|---|---|---|---|---|",
    ]
    for length, res in rows:
        base = res.get("materialise")
        for variant, r in res.items():
            if r is None:
                lines.append(f"| {length} | {variant} | failed | | | |")
                continue
            tr = f"{r['run_s'] / base['run_s']:.2f}x" if base else "-"
            mr = f"{r['peak_gib'] / base['peak_gib']:.2f}x" if base else "-"
            lines.append(f"| {length} | {variant} | {r['run_s']:.2f} | {r['peak_gib']:.2f} | {tr} | {mr} |")
    table = "\n".join(lines) + "\n"
    print(table)
    if args.out:
        with open(args.out, "a") as fh:
            fh.write(table)


if __name__ == "__main__":
    main()
