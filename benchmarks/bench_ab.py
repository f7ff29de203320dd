"""Two checkouts of latim-jax side by side on the same workloads: did a change keep speed and memory?

    python benchmarks/bench_ab.py --a /path/to/old/checkout --b . --out benchmarks/results/ab.json
    python benchmarks/bench_ab.py --a OLD --b NEW --workloads model512 --versions 2 --methods l2   # a part

Each measurement is its own process (its peak RSS is its own), run with the current interpreter (so
both checkouts must import with this environment's packages) on a shadow package of the checkout (a
temporary latim_jax/ of links to its latim_jax/*, kernels/ and convert/, first on PYTHONPATH, so that
an editable install of either checkout cannot mix the two), and the two
checkouts alternate cell by cell so that a drift of the machine's speed hits both alike. Workloads,
random weights of the real 130m shapes (24 layers), fp32, XLA path (this machine's CPU):

- ``model512``: ``attribute`` of the whole model at L = 512, one prompt, per method (l2, alti, logit
  with ``rollout_maps=False``, hidden_attention).
- ``lastrow16k``: ``rows=[-1]`` of all 24 layers at L = 16384 (Mamba-2 alti, Mamba-1 l2, as
  benchmarks/bench_scale_out.py and bench_scaling.py's row experiment measure them).

Per cell: the first call (compile + run) and the median of ``--runs`` calls after it; the peak RSS of
the calls after the first, above the RSS before them (the high-water mark is reset after the first
call, through /proc/self/clear_refs, so the compiler's own memory is not counted), and the first call's
peak (compile included) above the process after building its inputs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORKER = r"""
import json, sys, time
import jax, numpy as np
import latim_jax
try:
    from latim_jax.model.init import init_params  # the layout of the redesign (issue 24)
except ImportError:
    from latim_jax.init import init_params
import latim_jax.kernels
import os

version, L, method, rows = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
runs = int(sys.argv[5])
if version == 1:
    cfg = latim_jax.MambaConfig(version=1, d_model=768, n_layers=24, vocab_size=50280, d_state=16)
else:
    cfg = latim_jax.MambaConfig(version=2, d_model=768, n_layers=24, vocab_size=50288, d_state=128,
                                head_dim=64, chunk_size=256)
model = latim_jax.MambaLM(cfg, init_params(cfg, 0))
tokens = np.random.default_rng(0).integers(0, 50000, (1, L))

def rss(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024

kw = {"rollout_maps": False} if method == "logit" else {}
if rows == "last":
    kw["rows"] = [-1]
kw.update(memory_limit=None, progress=False)
call = lambda: latim_jax.attribute(model, tokens, method=method, **kw).scores
base = rss("VmRSS:")
t0 = time.perf_counter(); jax.block_until_ready(call()); first = time.perf_counter() - t0
first_peak = rss("VmHWM:") - base
with open("/proc/self/clear_refs", "w") as fh:  # reset the high-water mark: the calls after the compile
    fh.write("5")
base_run = rss("VmRSS:")
times = []
for _ in range(runs):
    t0 = time.perf_counter(); jax.block_until_ready(call()); times.append(time.perf_counter() - t0)
median = float(np.median(times)) if times else None
print(json.dumps({"code": os.path.realpath(latim_jax.kernels.__file__), "first_s": first, "median_s": median,
                  "times_s": times, "first_peak_gib": first_peak / 2**30,
                  "peak_gib": (rss("VmHWM:") - base_run) / 2**30}))
"""

WORKLOADS = {
    "model512": {"L": 512, "rows": "all", "methods": {1: ("l2", "alti", "logit", "hidden_attention"),
                                                      2: ("l2", "alti", "logit", "hidden_attention")}},
    "lastrow16k": {"L": 16384, "rows": "last", "methods": {1: ("l2",), 2: ("alti",)}},
}  # fmt: skip


def git_head(path: Path) -> str:
    out = subprocess.run(
        ["git", "-C", str(path), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    return out.stdout.strip() or "?"


def shadow(checkout: Path, where: Path) -> Path:
    """A directory whose latim_jax/ is the checkout's package as installed: links to its latim_jax/*
    entries, and kernels/ and convert/ (top-level in the repository) inside it."""
    pkg = where / "latim_jax"
    pkg.mkdir(parents=True)
    for entry in (checkout / "latim_jax").iterdir():
        if entry.name != "__pycache__":
            (pkg / entry.name).symlink_to(entry)
    for name in ("kernels", "convert"):
        (pkg / name).symlink_to(checkout / name)
    return where


def measure(tree: Path, version: int, length: int, method: str, rows: str, runs: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    args = [sys.executable, "-c", WORKER, str(version), str(length), method, rows, str(runs)]
    proc = subprocess.run(args, capture_output=True, text=True, env=env, cwd=tree)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "failed"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def table(result: dict) -> str:
    a, b = result["a"], result["b"]
    lines = [
        f"A = {a['path']} ({a['head']}), B = {b['path']} ({b['head']}); "
        f"{result['created']} to {result['finished']}",
        "",
        "| workload | version | method | A s | B s | B / A time | A peak GiB | B peak GiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in result["cells"]:
        ra, rb = c["a"], c["b"]
        if "error" in ra or "error" in rb:
            lines.append(f"| {c['workload']} | {c['version']} | {c['method']} | {ra.get('error', '')} | "
                         f"{rb.get('error', '')} | - | - | - |")  # fmt: skip
            continue
        ta, tb = ra["median_s"] or ra["first_s"], rb["median_s"] or rb["first_s"]
        lines.append(
            f"| {c['workload']} | {c['version']} | {c['method']} | {ta:.2f} | {tb:.2f} | {tb / ta:.2f} | "
            f"{ra['peak_gib']:.2f} | {rb['peak_gib']:.2f} |"
        )
    lines += [
        "",
        "Time: the median of the calls after the first (the first compiles); peak: the RSS high-water mark "
        "of those calls above the RSS before them. One process per cell, A and B alternating.",
    ]
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--a", type=Path, required=True, help="the first checkout (e.g. the old code)")
    p.add_argument("--b", type=Path, required=True, help="the second checkout (e.g. the new code)")
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    p.add_argument("--versions", nargs="+", type=int, default=[1, 2], choices=(1, 2))
    p.add_argument("--methods", nargs="+", default=None, help="only these methods")
    p.add_argument("--runs", type=int, default=1, help="calls timed after the first (default 1)")
    p.add_argument("--out", type=Path, default=None, help="write the result as JSON (+ .md beside it)")
    args = p.parse_args(argv)
    result = {
        "command": "python benchmarks/bench_ab.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "a": {"path": str(args.a), "head": git_head(args.a)},
        "b": {"path": str(args.b), "head": git_head(args.b)},
        "cells": [],
    }
    tmp = Path(tempfile.mkdtemp(prefix="bench-ab-"))
    trees = {side: shadow(getattr(args, side).resolve(), tmp / side) for side in ("a", "b")}
    for name in args.workloads:
        w = WORKLOADS[name]
        for version in args.versions:
            for method in w["methods"][version]:
                if args.methods and method not in args.methods:
                    continue
                cell = {"workload": name, "version": version, "method": method}
                for side in ("a", "b"):
                    cell[side] = measure(trees[side], version, w["L"], method, w["rows"], args.runs)
                print(json.dumps(cell), flush=True)
                result["cells"].append(cell)
    result["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    print(table(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
        args.out.with_suffix(".md").write_text(table(result) + "\n")


if __name__ == "__main__":
    main()
