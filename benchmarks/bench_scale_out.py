"""Scale-out measurements (issue "pods, batches and long inputs"): throughput vs batch size, last-row
attribution of a whole 24-layer model at long lengths, and a 2.8b-shaped model sharded over 8 simulated
devices. Every measurement runs in its own process (peak RSS is its own).

    python benchmarks/bench_scale_out.py throughput   # prompts/s vs batch, 130m-shaped Mamba-2, L = 128
    python benchmarks/bench_scale_out.py last-row     # rows=[-1], all 24 layers, L = 1k, 4k, 16k
    python benchmarks/bench_scale_out.py sharded      # 2.8b-shaped layers over 8 devices, per-device peak
    python benchmarks/bench_scale_out.py all --out benchmarks/results/scale_out.json

Random weights, fp32, XLA path; times are the median of the calls after the first (compile + run).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

COMMON = r"""
import json, os, sys, time
import jax, jax.numpy as jnp, numpy as np
import latim_jax
from latim_jax.model.config import MambaConfig
from latim_jax.model.init import init_params

def rss(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024

def shape_130m(version, n_layers=24):
    if version == 1:
        return MambaConfig(version=1, d_model=768, n_layers=n_layers, vocab_size=50280, d_state=16)
    return MambaConfig(version=2, d_model=768, n_layers=n_layers, vocab_size=50288, d_state=128,
                       head_dim=64, chunk_size=256)

def timed(fn, repeats):
    t0 = time.perf_counter(); jax.block_until_ready(fn()); first = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter(); jax.block_until_ready(fn()); times.append(time.perf_counter() - t0)
    return first, float(np.median(times)) if times else first
"""

THROUGHPUT = (
    COMMON
    + r"""
version, L, batch, repeats = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
cfg = shape_130m(version)
model = latim_jax.MambaLM(cfg, init_params(cfg, 0))
tokens = np.random.default_rng(0).integers(0, 50000, (batch, L))
base = rss("VmRSS:")
fn = lambda: latim_jax.attribute(model, tokens, method="l2", memory_limit=None).scores
first, median = timed(fn, repeats)
peak = rss("VmHWM:") - base
print(json.dumps({"experiment": "throughput", "version": version, "L": L, "batch": batch, "first_s": first,
                  "median_s": median, "prompts_per_s": batch / median, "peak_rss_above_model": peak}))
"""
)

LAST_ROW = (
    COMMON
    + r"""
version, L, repeats = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
cfg = shape_130m(version)
model = latim_jax.MambaLM(cfg, init_params(cfg, 0))
tokens = np.random.default_rng(0).integers(0, 50000, (1, L))
base = rss("VmRSS:")
est = latim_jax.latim.memory.estimate(model, 1, L, method="alti", rows=1)
fn = lambda: latim_jax.attribute(model, tokens, method="alti", rows=[-1], memory_limit=None).scores
first, median = timed(fn, repeats)
peak = rss("VmHWM:") - base  # before the forward below, whose (L, vocab) logits would dominate it
t0 = time.perf_counter(); jax.block_until_ready(model(tokens)); forward = time.perf_counter() - t0
print(json.dumps({"experiment": "last-row", "version": version, "L": L, "first_s": first, "median_s": median,
                  "forward_s": forward, "peak_rss_above_model": peak,
                  "estimate_bytes": est.total - est.parameters}))
"""
)

SHARDED = (
    r"""
import os, sys
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
"""
    + COMMON
    + r"""
import latim_jax.latim.memory
from latim_jax.latim.attribution import score_layer
from latim_jax.latim.request import LayerJob
from latim_jax.parallel import Context, P, check_mesh, put
n_layers, L, model_axis = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
# 2.8b-shaped layers (d 2560, e 5120, N 16; mamba-2.8b), a few of them, random weights
cfg = MambaConfig(version=1, d_model=2560, n_layers=n_layers, vocab_size=50280, d_state=16)
model = latim_jax.MambaLM(cfg, init_params(cfg, 0))
tokens = np.random.default_rng(0).integers(0, 50000, (1, L))
mesh = check_mesh(jax.make_mesh((1, model_axis), ("data", "model")))  # Auto axes
latim_jax.shard(model, mesh)
per_device = {}
for x in jax.tree.leaves(model.params()):
    for s in x.addressable_shards:
        per_device[s.device.id] = per_device.get(s.device.id, 0) + s.data.nbytes
t0 = time.perf_counter()
res = latim_jax.attribute(model, tokens, method="l2", layers=[n_layers - 1], rows=[-1], mesh=mesh,
                          memory_limit=None)
seconds = time.perf_counter() - t0
# the scored layer's program, per device, from XLA's compiled memory analysis (SPMD: one device's share)
h = put(np.zeros((1, L, cfg.d_model), np.float32), mesh, P())
valid = put(np.ones((1, L), bool), mesh, P())
rows = put(np.asarray([L - 1], np.int32), mesh, P())
lowered = score_layer.lower(model.layers[n_layers - 1], h, valid, rows, None,
                            job=LayerJob(method="l2", with_next=True), ctx=Context(mesh=mesh))
mem = lowered.compile().memory_analysis()
est = latim_jax.latim.memory.estimate(model, 1, L, method="l2", rows=1, layers=1)
print(json.dumps({"experiment": "sharded", "n_layers": n_layers, "L": L, "model_axis": model_axis,
                  "param_bytes_per_device_max": max(per_device.values()),
                  "param_bytes_total": sum(per_device.values()), "seconds": seconds,
                  "peak_rss_process": rss("VmHWM:"), "estimate_one_device_bytes": est.total,
                  "layer_program_per_device": {"argument": mem.argument_size_in_bytes,
                                               "output": mem.output_size_in_bytes,
                                               "temp": mem.temp_size_in_bytes},
                  "scores_finite": bool(np.isfinite(np.asarray(res.scores)).all())}))
"""
)


def child(script: str, *args) -> dict:
    """Run one measurement in its own process; its last stdout line is JSON."""
    out = subprocess.run([sys.executable, "-c", script, *map(str, args)], capture_output=True, text=True,
                         env=dict(os.environ))  # fmt: skip
    if out.returncode != 0:
        return {"error": (out.stderr.strip().splitlines() or ["?"])[-1], "args": list(map(str, args))}
    return json.loads(out.stdout.strip().splitlines()[-1])


def table(rows: list[dict]) -> str:
    """Markdown tables of whichever experiments the rows hold."""
    gib, lines = 1024**3, []
    tp = [r for r in rows if r.get("experiment") == "throughput"]
    if tp:
        lines += [
            "Throughput (130m-shaped, 24 layers, l2 full matrices, L = 128, one call per batch):",
            "",
            "| version | batch | s per call | prompts/s | peak GiB above the model |",
            "|---|---|---|---|---|",
        ]
        lines += [
            f"| Mamba-{r['version']} | {r['batch']} | {r['median_s']:.2f} | {r['prompts_per_s']:.2f} "
            f"| {r['peak_rss_above_model'] / gib:.2f} |"
            for r in tp
        ]
        lines.append("")
    lr = [r for r in rows if r.get("experiment") == "last-row"]
    if lr:
        lines += [
            "Last-row attribution (rows=[-1], alti, all 24 layers of a 130m-shaped model):",
            "",
            "| version | L | s (median) | first call s | forward alone s | peak GiB above the model "
            "| estimate GiB |",
            "|---|---|---|---|---|---|---|",
        ]
        lines += [
            f"| Mamba-{r['version']} | {r['L']} | {r['median_s']:.1f} | {r['first_s']:.1f} "
            f"| {r['forward_s']:.1f} | {r['peak_rss_above_model'] / gib:.2f} "
            f"| {r['estimate_bytes'] / gib:.2f} |"
            for r in lr
        ]
        lines.append("")
    sh = [r for r in rows if r.get("experiment") == "sharded"]
    if sh:
        lines += [
            "2.8b-shaped Mamba-1 (d 2560; 4 of its 64 layers built) over simulated CPU devices, "
            "l2 of the last row of one layer, L = 512:",
            "",
            "| model axis | parameter GiB per device | layer program per device: arguments / temporaries GiB "
            "| one-device estimate GiB |",
            "|---|---|---|---|",
        ]
        for r in sh:
            p = r["layer_program_per_device"]
            lines.append(
                f"| {r['model_axis']} | {r['param_bytes_per_device_max'] / gib:.3f} "
                f"| {p['argument'] / gib:.3f} / {p['temp'] / gib:.3f} "
                f"| {r['estimate_one_device_bytes'] / gib:.2f} |"
            )
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    """Run the chosen experiments, print each result as it comes, write JSON."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("experiment", choices=("throughput", "last-row", "sharded", "all"))
    p.add_argument("--version", type=int, default=2, choices=(1, 2))
    p.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default="benchmarks/results/scale_out.json")
    args = p.parse_args(argv)
    rows = []
    start = time.perf_counter()
    todo = ("throughput", "last-row", "sharded") if args.experiment == "all" else (args.experiment,)
    if "throughput" in todo:
        for batch in args.batches:
            rows.append(child(THROUGHPUT, args.version, 128, batch, args.repeats))
            print(json.dumps(rows[-1]), flush=True)
    if "last-row" in todo:
        for length in args.lengths:
            rows.append(child(LAST_ROW, args.version, length, args.repeats if length <= 4096 else 1))
            print(json.dumps(rows[-1]), flush=True)
    if "sharded" in todo:
        for model_axis in (8, 1):
            rows.append(child(SHARDED, 4, 512, model_axis))
            print(json.dumps(rows[-1]), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    previous = json.loads(out.read_text())["rows"] if out.exists() else []
    keep = [r for r in previous if r.get("experiment") not in todo]
    out.write_text(json.dumps({"rows": keep + rows, "seconds": time.perf_counter() - start}, indent=2))
    out.with_suffix(".md").write_text(table(keep + rows) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
