"""Delta-rule (Gated DeltaNet) M tiles: the one-hot recurrence over all l positions per tile (the previous
``latim_jax.kernels.delta_rule.m_tile``, kept verbatim below as ``scan_m_tile``) against the chunk tiles
built from per-layer chunk factors (the current ``m_tile``), side by side in one process (issue 42 item 4).

    python benchmarks/bench_delta_rule_tiles.py          # -> benchmarks/results/delta_rule_tiles.{json,md}
    python benchmarks/bench_delta_rule_tiles.py --quick    # small lengths: checks the script

Workloads (random weights, fp32, XLA path, this machine's CPU):

- ``layer``: one gdn layer (d_model 256; 4 key heads, 8 value heads, d_k 64, d_v 32, chunk 64), one
  prompt: ``attribute`` of its full l2 score map and of its hidden attention (M alone, averaged over
  heads) at L = 1024 (both paths, whole maps) and L = 4096 (the chunk path whole; the scan path timed
  on a sample of single tiles and multiplied by the number of causal tiles: the scan's cost per tile
  does not depend on the tile's position, l one-token steps each, so this is an extrapolation of M's
  share, labelled as such).
- ``hybrid``: the last row (``rows=[-1]``) of the whole tiny hybrid of tests/latim/test_delta_rule.py
  (gdn, mlp, attention, gdn; d_model 16) at L = 16384, l2, both paths.
- ``chunk``: the hidden attention of the ``layer`` model at L = 4096 with the tile factors built in
  chunks of 32, 64 (the layer's own) and 128.

The two paths differ only in the DeltaFactors' ``m_tile``: the scan path swaps in a subclass calling the
old scan through the kind registry. Each path of each cell runs in a process of its own (the paths
taking turns, cell by cell): the first call (compile + run), then ``--runs`` timed calls (the median is
reported); peak: the RSS high-water mark of a timed call above the RSS before it (reset through
/proc/self/clear_refs). (An in-process version that switched paths with ``jax.clear_caches()`` hung
twice in XLA:CPU's runtime, every worker idle, and inflated one cell ~13x: one process per path.) The
CPU is shared with another job while this runs: compare the ratios more than the times.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from harness import RESULTS, machine, now, write_atomic

import latim_jax
from latim_jax.kernels import delta_rule as kernel
from latim_jax.kernels import f32
from latim_jax.latim import delta_rule as latim_delta_rule
from latim_jax.latim.delta_rule import DeltaFactors
from latim_jax.latim.kinds import layer_factors
from latim_jax.model.init import init_params
from latim_jax.model.kind import register, registered

LAYER = dict(
    version=2, d_model=256, n_layers=1, vocab_size=256, layer_kinds=("gdn",),
    sections={"gdn": dict(k_heads=4, v_heads=8, k_dim=64, v_dim=32, chunk=64)},
)  # fmt: skip
HYBRID = dict(
    version=2, d_model=16, n_layers=4, vocab_size=40, d_state=4, head_dim=8, chunk_size=8,
    layer_kinds=("gdn", "mlp", "attention", "gdn"), attn_heads=2, attn_kv_heads=1, attn_head_dim=8,
    mlp_width=24, mlp_gated=True,
    sections={"gdn": dict(k_heads=2, v_heads=4, k_dim=8, v_dim=6, chunk=8, conv_bias=True)},
)  # fmt: skip


def _row_decay(g_t):
    d = jnp.exp(g_t)
    return d[..., None] if d.ndim == 3 else d[..., None, None]


def scan_m_tile(q, k, g, beta, rows, c0, width: int):
    """The previous m_tile, verbatim: M[rows, c0 : c0 + width] (b, H, r, width) by the recurrence over
    one-hot values of the columns, X_t = A_t X_{t-1} + beta_t k_t e_{t - c0}^T, one pass over all l
    positions per tile."""
    b, length, H, dk = k.shape
    cols = c0 + jnp.arange(width)
    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, g, beta)) + (jnp.arange(length),)

    def body(carry, x):
        X, out = carry
        q_t, k_t, g_t, beta_t, t = x
        X = X * _row_decay(g_t)
        X = (
            X
            - k_t[..., :, None] * beta_t[..., None, None] * jnp.einsum("bhk,bhkw->bhw", k_t, X)[..., None, :]
        )
        X = X + (beta_t[..., None] * k_t)[..., None] * (cols == t)[None, None, None, :]
        row = jnp.einsum("bhk,bhkw->bhw", q_t, X)
        out = jnp.where((rows == t)[None, None, :, None], row[:, :, None, :], out)
        return (X, out), None

    X0 = jnp.zeros((b, H, dk, width), f32)
    out0 = jnp.zeros((b, H, rows.shape[0], width), f32)
    (_, out), _ = jax.lax.scan(body, (X0, out0), xs)
    return out


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ScanFactors(DeltaFactors):
    """DeltaFactors whose tiles run the previous scan (its chunk factors are built, and not read)."""

    def m_tile(self, rows, c0, width: int):
        return scan_m_tile(self.q, self.k, self.g, self.beta, rows, c0, width)


def _scan_factors(*args, **kwargs):
    f = latim_delta_rule.factors(*args, **kwargs)
    return ScanFactors(**{field.name: getattr(f, field.name) for field in dataclasses.fields(f)})


def use(path: str) -> None:
    """Route the gdn kind's factors to the scan ("scan") or chunk ("chunk") tiles (in this process)."""
    factors = _scan_factors if path == "scan" else latim_delta_rule.factors
    register(registered()["gdn"], factors=factors, replace=True)


def _rss(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024
    return 0


def timed(call) -> tuple[float, float]:
    """(seconds, peak GiB above the RSS before the call) of one blocking call."""
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")
    base = _rss("VmRSS:")
    t0 = time.perf_counter()
    jax.block_until_ready(call())
    return time.perf_counter() - t0, (_rss("VmHWM:") - base) / 2**30


def worker(spec: dict) -> dict:
    """One path of one cell in this process: the first call (compile + run), then ``runs`` timed calls."""
    if spec["workload"] == "tiles":
        cfg = latim_jax.MambaConfig(**LAYER)
        model = latim_jax.MambaLM(cfg, init_params(cfg, 0))
        tokens = np.random.default_rng(0).integers(0, 256, (1, spec["L"]))
        return sampled_tiles(model, tokens, spec["n_sample"])
    config = HYBRID if spec["workload"] == "hybrid" else LAYER
    cfg = latim_jax.MambaConfig(**config)
    model = latim_jax.MambaLM(cfg, init_params(cfg, 7 if spec["workload"] == "hybrid" else 0))
    tokens = np.random.default_rng(0).integers(0, cfg.n_tokens, (1, spec["L"]))
    path = spec["path"]
    if isinstance(path, int):  # a tile chunk of the chunk path
        latim_delta_rule.tile_chunk = lambda chunk, length, c=path: min(c, length)
        path = "chunk"
    use(path)
    kw = {} if spec.get("rows") is None else {"rows": spec["rows"]}

    def call():
        return latim_jax.attribute(
            model, tokens, method=spec["method"], progress=False, memory_limit=None, **kw
        ).scores

    first = timed(call)[0]
    runs = [timed(call) for _ in range(spec["runs"])]
    times = [t for t, _ in runs]
    return {"first_s": first, "times_s": times, "median_s": statistics.median(times),
            "peak_gib": max(p for _, p in runs)}  # fmt: skip


def measure(spec: dict, timeout_s: float) -> dict:
    """:func:`worker` in a subprocess of its own (its memory its own; a stuck run is killed)."""
    args = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)]
    for attempt in range(3):  # stalls (every thread idle) came from jaxlib's CPU LAPACK solve, since replaced
        try:
            proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout_s)
            break
        except subprocess.TimeoutExpired:
            print(f"timeout after {timeout_s:.0f} s (attempt {attempt + 1}): {spec}", flush=True)
    else:
        return {"error": f"timeout after {timeout_s:.0f} s, 3 attempts"}
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def side_by_side(spec: dict, paths, timeout_s: float) -> dict:
    """Each path of the cell in its own process, the paths taking turns."""
    return {str(p): measure({**spec, "path": p}, timeout_s) for p in paths}


def sampled_tiles(model, tokens, n_sample: int) -> dict:
    """One tile of each path (64 rows x 67 columns, as the l2 loop asks for: 64 + K - 1), jitted with
    traced rows and first column, timed on ``n_sample`` row tiles against column tile 0."""
    use("chunk")
    h = model.forward(tokens).residuals[0]
    f = layer_factors(model, h, 0)
    length = tokens.shape[1]
    scan = jax.jit(lambda q, k, g, beta, rows, c0: scan_m_tile(q, k, g, beta, rows, c0, 67))
    chunk = jax.jit(lambda c, rows, c0: kernel.m_tile(c, rows, c0, 67))
    picks = np.linspace(0, length // 64 - 1, n_sample).astype(int)
    res = {"scan": [], "chunk": []}
    jax.block_until_ready(scan(f.q, f.k, f.g, f.beta, jnp.arange(64), 0))
    jax.block_until_ready(chunk(f.chunks, jnp.arange(64), 0))
    for ri in picks:  # row tile ri against column tile 0 (the farthest: the chunk path's dearest)
        rows = jnp.arange(64) + 64 * int(ri)
        res["scan"].append(timed(lambda rows=rows: scan(f.q, f.k, f.g, f.beta, rows, 0))[0])
        res["chunk"].append(timed(lambda rows=rows: chunk(f.chunks, rows, 0))[0])
    n_tiles = (length // 64) * (length // 64 + 1) // 2
    return {
        "picked_row_tiles": picks.tolist(), "times_s": res, "n_causal_tiles": n_tiles,
        "scan_per_tile_s": statistics.median(res["scan"]),
        "scan_m_extrapolated_s": statistics.median(res["scan"]) * n_tiles,
    }  # fmt: skip


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small lengths (checks the script)")
    p.add_argument("--runs", type=int, default=1, help="timed calls after the first, per process")
    p.add_argument("--workloads", nargs="+", default=["layer", "hybrid", "chunk"])
    p.add_argument("--out", default="delta_rule_tiles")
    p.add_argument("--timeout-s", type=float, default=900)
    p.add_argument(
        "--no-scan-long",
        dest="scan_long",
        action="store_false",
        help="skip the scan path's whole maps at the long length (single tiles only)",
    )
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    short, long, hybrid_len = (128, 256, 1024) if args.quick else (1024, 4096, 16384)
    result = {"created": now(), "machine": machine(), "quick": args.quick,
              "command": "python benchmarks/bench_delta_rule_tiles.py " + " ".join(argv or sys.argv[1:]),
              "cells": []}  # fmt: skip
    path = RESULTS / f"{args.out}.json"

    def record(cell):  # written after every cell, so an interrupted run keeps what it measured
        print(json.dumps(cell), flush=True)
        result["cells"].append(cell)
        write_atomic(path, json.dumps(result, indent=2) + "\n")
        write_atomic(path.with_suffix(".md"), table(result) + "\n")

    both = ("scan", "chunk")
    if "layer" in args.workloads:
        for L in (short, long):
            for method in ("l2", "hidden_attention"):
                spec = {"workload": "layer", "L": L, "method": method, "runs": args.runs}
                paths = both if (L == short or args.scan_long) else ("chunk",)
                record({"workload": "one gdn layer, full map", "L": L, "method": method,
                        **side_by_side(spec, paths, args.timeout_s)})  # fmt: skip
        spec = {"workload": "tiles", "L": long, "n_sample": 3}
        record({"workload": "one gdn layer, single tiles", "L": long, **measure(spec, args.timeout_s)})
    if "hybrid" in args.workloads:
        spec = {"workload": "hybrid", "L": hybrid_len, "method": "l2", "rows": [-1], "runs": args.runs}
        record({"workload": "tiny gdn hybrid, last row", "L": hybrid_len, "method": "l2",
                **side_by_side(spec, both, args.timeout_s)})  # fmt: skip
    if "chunk" in args.workloads:
        spec = {"workload": "layer", "L": long, "method": "hidden_attention", "runs": args.runs}
        r = side_by_side(spec, (32, 64, 128), args.timeout_s)
        record({"workload": "one gdn layer, tile chunk", "L": long, "method": "hidden_attention",
                **{f"chunk {c}": v for c, v in r.items()}})  # fmt: skip
    result["finished"] = now()
    write_atomic(path, json.dumps(result, indent=2) + "\n")
    write_atomic(path.with_suffix(".md"), table(result) + "\n")
    print(table(result))


def _s(x):
    return "-" if x is None else f"{x:.2f}"


def table(result: dict) -> str:
    lines = [
        f"Delta-rule M tiles: scan (l one-token steps per tile) vs chunk (per-layer chunk factors); "
        f"{result['created']} to {result.get('finished', '?')}, {result['machine'].get('cpu', '')} "
        "(CPU shared with another job while measured: read the ratios).",
        "",
        "| workload | L | method | scan s | chunk s | scan / chunk | scan peak GiB | chunk peak GiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    tiles = {}
    for c in result["cells"]:
        if "n_causal_tiles" in c:
            tiles[c["L"]] = c
    for c in result["cells"]:
        if "chunk" in c:
            s, ch = c.get("scan", {}), c.get("chunk", {})
            ts, tc = s.get("median_s"), ch.get("median_s")
            note = ""
            if ts is None and c["L"] in tiles and c["method"] == "hidden_attention":
                ts = tiles[c["L"]]["scan_m_extrapolated_s"]
                note = " (extrapolated from single tiles)"
            ratio = "-" if not (ts and tc) else f"{ts / tc:.1f}"
            lines.append(
                f"| {c['workload']} | {c['L']} | {c['method']} | {_s(ts)}{note} | {_s(tc)} | {ratio} | "
                f"{_s(s.get('peak_gib'))} | {_s(ch.get('peak_gib'))} |"
            )
    for L, c in tiles.items():
        lines += [
            "",
            f"Single 64 x 67 tiles at L = {L} (row tiles {c['picked_row_tiles']} against column tile 0): "
            f"scan {', '.join(f'{t:.3f}' for t in c['times_s']['scan'])} s, chunk "
            f"{', '.join(f'{t:.4f}' for t in c['times_s']['chunk'])} s; {c['n_causal_tiles']} causal tiles x "
            f"{c['scan_per_tile_s']:.3f} s = {c['scan_m_extrapolated_s']:.0f} s extrapolated for the scan "
            "path's M alone (every scan tile runs all l steps).",
        ]
    for c in result["cells"]:
        if c["workload"] == "one gdn layer, tile chunk":
            parts = [f"{k}: {_s(v.get('median_s'))} s, peak {_s(v.get('peak_gib'))} GiB" for k, v in c.items()
                     if k.startswith("chunk ")]  # fmt: skip
            lines += ["", f"Tile chunk, hidden attention at L = {c['L']}: " + "; ".join(parts) + "."]
    lines += [
        "",
        "Time: the median of the calls after the first (the first compiles); peak: the RSS high-water mark "
        "of a timed call above the RSS before it. Each path in a process of its own, taking turns.",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
