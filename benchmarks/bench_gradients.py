"""Memory and time of the gradient of one layer's l2 score matrix, side by side with its forward.

One 130m-shaped layer (Mamba-1: d 768, e 1536, N 16; Mamba-2: d 768, 24 heads of 64, N 128; ``--d-model``
for another width, the rest kept), random weights, one prompt; loss = sum of the layer's full (L, L) l2
matrix, exact mode, XLA path, every row as ``attribute`` passes it (a numpy range: the block loop's
static schedule, :func:`latim_jax.latim.blocking.blocked`). Each
measurement runs in its own process: XLA's compiled temporary buffer size (``memory_analysis``), the
calls' peak RSS above the RSS just before them (compilation done; VmHWM reset through
/proc/self/clear_refs: the "peak" the ratio target reads), the process's peak RSS above the RSS after
building the inputs (compilation included: the gradient's larger program costs the compiler up to
~0.2 GiB more, whatever L), the compile time, the first call and the median of ``--repeats`` further
calls (by default the first alone above L = 2048). ``--tangent-rows 64`` measures Mamba-2 with its
tiles unsplit under differentiation (the baseline of :attr:`Blocks.tangent_rows`).

    python benchmarks/bench_gradients.py --lengths 256 1024 4096 --out benchmarks/results/gradients.json

(L = 4096 at d 768 dominates: tens of minutes per gradient call on 2 CPU cores.) With --compile-only
only the compiled programs' temporaries are measured (seconds per cell, any L). The workers inherit
the environment: ``XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type=dot`` measures without XLA:CPU's
YNNPACK reduce fusions (see docs/gradients.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

WORKER = r"""
import json, os, sys, time
import jax, jax.numpy as jnp, numpy as np
import latim_jax
from latim_jax.model.config import MambaConfig
from latim_jax.latim.kinds import layer_factors
from latim_jax.model.init import init_params
from latim_jax.latim.scores import layer_scores

version, L, kind, repeats, d = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), \
    int(sys.argv[5])
tangent_rows = int(sys.argv[6]) or None
if version == 1:
    cfg = MambaConfig(version=1, d_model=d, n_layers=1, vocab_size=256, d_state=16)
else:
    cfg = MambaConfig(version=2, d_model=d, n_layers=1, vocab_size=256, d_state=128, head_dim=64,
                      chunk_size=256)
model = latim_jax.MambaLM(cfg, init_params(cfg, 0))
tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (1, L)))
h = model.forward(tokens, impl="xla").residuals[0]

def loss(h):
    f = layer_factors(model, h, 0, "exact", impl="xla")
    blocks = latim_jax.Blocks(tangent_rows=tangent_rows)  # None: the default tiles
    return jnp.sum(layer_scores(f, "l2", np.arange(L), mask=jnp.ones((1, L), bool), blocks=blocks))

fn = jax.jit(loss if kind == "forward" else jax.grad(loss))
def rss(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024
base = rss("VmRSS:")
t0 = time.perf_counter(); compiled = fn.lower(h).compile(); compile_s = time.perf_counter() - t0
temp = compiled.memory_analysis().temp_size_in_bytes
if repeats < 0:  # --compile-only: the compiled program's temporaries, nothing run
    print(json.dumps({"version": version, "L": L, "d": d, "kind": kind, "temp_bytes": temp,
                      "compile_only": True}))
    sys.exit(0)
compile_peak = rss("VmHWM:") - base
open("/proc/self/clear_refs", "w").write("5")  # VmHWM := VmRSS: the calls' own peak from here
before = rss("VmRSS:")
t0 = time.perf_counter(); jax.block_until_ready(compiled(h)); first = time.perf_counter() - t0
times = []
for _ in range(repeats):
    t0 = time.perf_counter(); jax.block_until_ready(compiled(h)); times.append(time.perf_counter() - t0)
call_peak = rss("VmHWM:") - before
print(json.dumps({"version": version, "L": L, "d": d, "kind": kind, "temp_bytes": temp,
                  "peak_rss_above_inputs": max(compile_peak, before - base + call_peak),
                  "call_peak_rss": call_peak, "compile_s": compile_s, "first_s": first,
                  "median_s": float(np.median(times)) if times else first}))
"""


def measure(version: int, length: int, kind: str, repeats: int, d_model=768, tangent_rows=None) -> dict:
    """One measurement in a fresh process (so peak RSS is its own)."""
    out = subprocess.run(
        [sys.executable, "-c", WORKER, str(version), str(length), kind, str(repeats), str(d_model),
         str(tangent_rows or 0)],
        capture_output=True, text=True, env=dict(os.environ),
    )  # fmt: skip
    if out.returncode != 0:
        return {"version": version, "L": length, "d": d_model, "kind": kind,
                "error": out.stderr.strip().splitlines()[-1]}  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def table(rows: list[dict]) -> str:
    """Markdown: per version, width and length, forward vs gradient (time, XLA temp, the calls' peak
    RSS) and the gradient/forward ratios (the targets: time <= 4x, peak <= 3x), and the ratio of the
    processes' peaks with compilation included. Rows measured before the calls' own peak was recorded
    show the process peak in its place (and "-" for the second ratio)."""
    gib = 1024**3
    by = {(r["version"], r.get("d", 768), r["L"], r["kind"]): r for r in rows}
    lines = [
        "| model | L | forward s | gradient s | time ratio | forward temp GiB | gradient temp GiB "
        "| temp ratio | forward peak GiB | gradient peak GiB | peak ratio | peak ratio with compilation |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for version, d, length in sorted({(r["version"], r.get("d", 768), r["L"]) for r in rows}):
        f, g = by.get((version, d, length, "forward")), by.get((version, d, length, "grad"))
        name = f"Mamba-{version} d {d} layer"
        if not f or not g or "error" in f or "error" in g:
            lines.append(f"| {name} | {length} | {f} | {g} |")
            continue
        if f.get("compile_only") or g.get("compile_only"):
            lines.append(
                f"| {name} | {length} | - | - | - | {f['temp_bytes'] / gib:.3f} "
                f"| {g['temp_bytes'] / gib:.3f} | {g['temp_bytes'] / f['temp_bytes']:.2f}x | - | - | - | - |"
            )
            continue
        fp, gp = (r.get("call_peak_rss", r.get("peak_rss_above_inputs", 0)) for r in (f, g))
        with_compile = (
            f"{g['peak_rss_above_inputs'] / max(f['peak_rss_above_inputs'], 1):.2f}x"
            if "call_peak_rss" in g
            else "-"
        )
        unfinished = "unfinished_after_s" in g  # a call stopped past that many seconds
        g_s = f"> {g['unfinished_after_s']:.0f}" if unfinished else f"{g['median_s']:.2f}"
        ratio = (
            f"> {g['unfinished_after_s'] / f['median_s']:.1f}x"
            if unfinished
            else f"{g['median_s'] / f['median_s']:.1f}x"
        )
        lines.append(
            f"| {name} | {length} | {f['median_s']:.2f} | {g_s} | {ratio} "
            f"| {f['temp_bytes'] / gib:.3f} | {g['temp_bytes'] / gib:.3f} "
            f"| {g['temp_bytes'] / f['temp_bytes']:.2f}x "
            f"| {fp / gib:.3f} | {gp / gib:.3f} | {gp / max(fp, 1):.2f}x | {with_compile} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    """Run the measurements; print the table last, write JSON (and markdown beside it)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096])
    p.add_argument("--versions", type=int, nargs="+", default=[1, 2], choices=(1, 2))
    p.add_argument("--d-model", type=int, default=768, help="the layer's width (768: 130m)")
    p.add_argument(
        "--repeats", type=int, default=None, help="timed calls after the first (default 2; 0 above L = 2048)"
    )
    p.add_argument(
        "--tangent-rows", type=int, default=None,
        help="Blocks.tangent_rows (the score tiles' rows under differentiation; default: the layer's)",
    )  # fmt: skip
    p.add_argument(
        "--compile-only", action="store_true", help="only XLA's compiled temporaries (no run: long L)"
    )
    p.add_argument("--out", default="benchmarks/results/gradients.json")
    args = p.parse_args(argv)
    rows = []
    start = time.perf_counter()
    for version in args.versions:
        for length in args.lengths:
            for kind in ("forward", "grad"):
                default = 2 if length <= 2048 else 0
                repeats = -1 if args.compile_only else (default if args.repeats is None else args.repeats)
                r = measure(version, length, kind, repeats, args.d_model, args.tangent_rows)
                rows.append(r)
                print(json.dumps(r), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": rows, "seconds": time.perf_counter() - start}, indent=2))
    md = table(rows)
    out.with_suffix(".md").write_text(md + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
