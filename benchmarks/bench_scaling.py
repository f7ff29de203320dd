"""How latim-jax scales: time and memory vs L and vs batch (fitted exponents), the largest L each
implementation completes under a memory cap, last-row attribution vs L, and compile time vs depth.

Experiments (``--experiments``, all by default; each measurement a guarded subprocess, harness.py):

  length   one layer of the shape, ``--method``, L in --lengths: median time, working memory, the floor
           fraction; least-squares exponents of time and memory on log-log (expected ~2 and <= ~1).
  batch    one layer at --batch-length, batch in --batches: time and memory vs batch (expected ~1).
  largest  the largest L latim-jax and torch-fair complete (one call) under --cap-gib: doubling from
           --largest-start, then bisection to --largest-resolution; a trial past --timeout-s counts as
           "not completed" and is reported as such (plus the L predicted from the memory fit).
  rows     the whole model (all layers), rows=[-1] (last target only) for L in --rows-lengths, and
           --rows-counts rows at --rows-length: a row subset costs O(rows * L) (rows are computed in
           blocks of 32 (Mamba-1) / 64 (Mamba-2); fewer rows get a row block of their own size).
  depth    compile time (first call - steady state) of attribute() and of the forward for random
           models of --depths layers (d = --depth-d, the shape's other sizes, L = --depth-length):
           a Python loop over layers makes it grow with depth.

    python benchmarks/bench_scaling.py --quick                   # tiny shapes, end-to-end: 5-15 min
    nice -n 10 python benchmarks/bench_scaling.py                # full: about 6-9 hours here
    nice -n 10 python benchmarks/bench_scaling.py --experiments depth     # ~10 min

Duration of the full run (130m shapes, both versions, 2 shared cores): length to L = 4096 ~40 min;
batch ~15 min; largest ~3-5 h (latim-jax doubles to 16k-32k: ~20-40 min a trial at 16k for Mamba-2,
longer for Mamba-1, bounded by --timeout-s; torch stops near L ~ 1-1.5k); rows to L = 16k ~20 min;
depth ~10 min.

Output: --out (default benchmarks/results/scaling.json; --quick: scaling_quick.json) and a markdown
file beside it; the tables are printed last.
"""

from __future__ import annotations

import argparse
import math
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import floor  # noqa: E402
import harness as H  # noqa: E402
from bench_vs_torch import prepare  # noqa: E402
from shapes import shape as make_shape  # noqa: E402

EXPERIMENTS = ("length", "batch", "largest", "rows", "depth")


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--experiments", nargs="+", default=list(EXPERIMENTS), choices=EXPERIMENTS)
    p.add_argument("--shape", default="130m")
    p.add_argument("--versions", nargs="+", type=int, default=[1, 2])
    p.add_argument("--method", default="l2")
    p.add_argument("--mode", default="exact", choices=["exact", "paper"])
    p.add_argument("--lengths", nargs="+", type=int, default=[256, 512, 1024, 2048, 4096])
    p.add_argument("--batch-length", type=int, default=512)
    p.add_argument("--batches", nargs="+", type=int, default=[1, 2, 4, 8])
    p.add_argument("--largest-impls", nargs="+", default=["latim-jax", "torch-fair"])
    p.add_argument("--largest-start", type=int, default=512)
    p.add_argument("--largest-max", type=int, default=65536)
    p.add_argument("--largest-resolution", type=float, default=0.1, help="stop when fail/ok <= 1 + this")
    p.add_argument("--rows-lengths", nargs="+", type=int, default=[1024, 4096, 16384])
    p.add_argument("--rows-length", type=int, default=4096)
    p.add_argument("--rows-counts", nargs="+", type=int, default=[1, 64, 512], help="> one row block")
    p.add_argument("--depths", nargs="+", type=int, default=[24, 64])
    p.add_argument("--depth-d", type=int, default=128)
    p.add_argument("--depth-length", type=int, default=64)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--budget-s", type=float, default=60.0)
    p.add_argument("--cap-gib", type=float, default=20.0)
    p.add_argument("--timeout-s", type=float, default=3600.0)
    p.add_argument("--matmul-n", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--keep-models", type=Path, default=None)
    args = p.parse_args(argv)
    if args.quick:
        quick = dict(shape="quick", lengths=[64, 128, 256], batch_length=128, batches=[1, 2, 4])
        quick.update(largest_start=256, largest_max=2048, cap_gib=1.5, timeout_s=600.0)
        quick.update(rows_lengths=[256, 1024, 4096], rows_length=1024, rows_counts=[1, 64])
        quick.update(depths=[2, 6], depth_d=32, runs=2, budget_s=10.0, matmul_n=512)
        H.quick_defaults(p, args, quick)
    if args.out is None:
        args.out = H.RESULTS / ("scaling_quick.json" if args.quick else "scaling.json")
    return args


def spec(args, impl, s, path, length, *, batch=1, runs=None, rows=None):
    """Worker spec of one attribution measurement."""
    return {
        "task": "attribute",
        "impl": "jax" if impl == "latim-jax" else "torch",
        "fair": impl == "torch-fair",
        "model_dir": str(path),
        "vocab": s["vocab_size"],
        "method": args.method,
        "mode": args.mode,
        "aggregation": "minmax",
        "aggregation_supported": args.aggregation_supported,
        "length": length,
        "batch": batch,
        "seed": args.seed,
        "runs": args.runs if runs is None else runs,
        "budget_s": args.budget_s,
        "rows": rows,
    }


def measure(args, impl, s, path, length, rates, **kw) -> dict:
    """One guarded measurement with its floor fraction."""
    r = H.run_worker(spec(args, impl, s, path, length, **kw), cap_gib=args.cap_gib, timeout_s=args.timeout_s)
    rec = {"impl": impl, "version": s["version"], "length": length, "batch": kw.get("batch", 1), **r}
    rows = kw.get("rows")
    t = r.get("median_s") or r.get("first_s")
    if r["status"] == "ok":
        w = floor.work(s, args.method, length, batch=rec["batch"], rows=rows)
        lib = "jax" if impl == "latim-jax" else "torch"
        mm, ex = rates.get(f"matmul_{lib}_float32_gflops"), rates.get(f"exp_{lib}_gexp_per_s")
        rec.update(work=w, **floor.fractions(w, t, mm, ex))
        what = f"{H.fmt(t)} s, working {H.fmt(r.get('working_gib'))} GiB"
    else:
        what = H.describe_failure(rec) + " " + r.get("error", "")
    tag = f"m{s['version']} {impl} L={length} batch={rec['batch']}" + (f" rows={len(rows)}" if rows else "")
    H.log(f"{tag}: {what}")
    return rec


def fits(recs, x_key) -> dict:
    """Exponents of time and working memory against ``x_key`` (all points, and the last two)."""
    ok = [r for r in recs if r["status"] == "ok"]
    xs = [r[x_key] for r in ok]
    out = {}
    for key in ("median_s", "working_gib"):
        ys = [r.get(key) for r in ok]
        out[f"{key}_exponent"] = H.fit_exponent(xs, ys)
        out[f"{key}_exponent_last2"] = H.fit_exponent(xs[-2:], ys[-2:]) if len(xs) >= 2 else None
    return out


def largest(args, impl, s, path, rates) -> dict:
    """Doubling, then bisection between the last L that completed and the first that did not."""
    trials, ok, bad = [], None, None
    L = args.largest_start
    while L <= args.largest_max:
        rec = measure(args, impl, s, path, L, rates, runs=0)
        trials.append(rec)
        if rec["status"] != "ok":
            bad = L
            break
        ok = L
        L *= 2
    while ok and bad and bad / ok > 1 + args.largest_resolution:
        mid = int(round(math.sqrt(ok * bad) / 64) * 64)
        if mid <= ok or mid >= bad:
            break
        rec = measure(args, impl, s, path, mid, rates, runs=0)
        trials.append(rec)
        ok, bad = (mid, bad) if rec["status"] == "ok" else (ok, mid)
    first_fail = next((t for t in trials if t["length"] == bad), None)
    if first_fail is not None:
        failure = H.describe_failure(first_fail)
    else:
        failure = f"none: completed every L up to --largest-max {args.largest_max}" if ok else None
    return {
        "impl": impl,
        "version": s["version"],
        "largest_completed": ok,
        "first_failed": bad,
        "failure": failure,
        "trials": trials,
    }


def predicted_largest(length_recs, cap_gib) -> int | None:
    """L at which the peak RSS reaches the cap, from a least-squares fit of working memory
    c0 + c1 L + c2 L^2 (factors O(L), scores O(L^2)) plus the RSS after loading; None if it cannot."""
    import numpy as np

    ok = [r for r in length_recs if r["status"] == "ok" and r.get("working_gib") is not None]
    if len(ok) < 3:
        return None
    L = np.array([r["length"] for r in ok], float)
    c0, c1, c2 = np.linalg.lstsq(np.stack([L**0, L, L**2], 1), [r["working_gib"] for r in ok], rcond=None)[0]
    room = cap_gib - max(r["rss_load_gib"] for r in ok) - c0
    if room <= 0 or (c1 <= 0 and c2 <= 0):
        return None
    if c2 <= 0:
        return int(room / c1)
    return int((-c1 + math.sqrt(c1 * c1 + 4 * c2 * room)) / (2 * c2))


def depth(args, version, rates) -> list[dict]:
    """Compile time of attribute() and forward() vs the number of layers."""
    out = []
    for n in args.depths:
        cfg = make_shape(args.shape, version, n_layers=n, d_model=args.depth_d, vocab_size=1024)
        if version == 2:
            cfg["head_dim"] = min(cfg["head_dim"], 2 * args.depth_d)
        task = {"task": "compile", "config": cfg, "length": args.depth_length, "method": args.method}
        r = H.run_worker(
            {**task, "runs": args.runs}, cap_gib=max(args.cap_gib, 4.0), timeout_s=args.timeout_s
        )
        out.append(
            {"version": version, "n_layers": n, "d_model": args.depth_d, "length": args.depth_length, **r}
        )
        H.log(f"depth m{version} {n} layers: attribute compile {H.fmt(r.get('attribute_compile_s'))} s")
    return out


def rows_experiment(args, workdir, version, rates) -> dict:
    """Whole model: the last row vs L, and row subsets of growing size at one L."""
    s, path = prepare(args, workdir, args.shape, version, "model")
    recs = [measure(args, "latim-jax", s, path, L, rates, rows=[L - 1]) for L in args.rows_lengths]
    L = args.rows_length
    counts = [
        measure(args, "latim-jax", s, path, L, rates, rows=list(range(L - c, L))) for c in args.rows_counts
    ]
    for r, c in zip(counts, args.rows_counts, strict=True):
        r["rows"] = c
    count_fit = {"count_" + k: v for k, v in fits(counts, "rows").items()}
    return {"records": recs, **fits(recs, "length"), "counts": counts, **count_fit}


def run(args, result, workdir) -> None:
    """Every selected experiment for every version, the JSON rewritten after each."""
    rates = result["rates"]
    for version in args.versions:
        exp = result["experiments"].setdefault(f"mamba{version}", {})
        if {"length", "batch", "largest"} & set(args.experiments):
            s, path = prepare(args, workdir, args.shape, version, "layer")
        if "length" in args.experiments:
            recs = [measure(args, "latim-jax", s, path, L, rates) for L in args.lengths]
            exp["length"] = {"records": recs, **fits(recs, "length")}
            H.write_json(args.out, result)
        if "batch" in args.experiments:
            recs = [
                measure(args, "latim-jax", s, path, args.batch_length, rates, batch=b) for b in args.batches
            ]
            exp["batch"] = {"records": recs, **fits(recs, "batch")}
            H.write_json(args.out, result)
        if "largest" in args.experiments:
            exp["largest"] = [largest(args, impl, s, path, rates) for impl in args.largest_impls]
            jax_recs = [t for x in exp["largest"] if x["impl"] == "latim-jax" for t in x["trials"]]
            jax_recs += exp.get("length", {}).get("records", [])
            exp["largest_predicted_latim_jax"] = predicted_largest(jax_recs, args.cap_gib)
            H.write_json(args.out, result)
        if "rows" in args.experiments:
            exp["rows"] = rows_experiment(args, workdir, version, rates)
            H.write_json(args.out, result)
        if "depth" in args.experiments:
            recs = depth(args, version, rates)
            ok = [r for r in recs if r["status"] == "ok"]
            ratio = ok[-1]["attribute_compile_s"] / ok[0]["attribute_compile_s"] if len(ok) >= 2 else None
            exp["depth"] = {"records": recs, "attribute_compile_ratio": ratio}
            H.write_json(args.out, result)


def _ok_row(r, x, cells):
    """A table row: ``cells`` for a completed record, the failure otherwise."""
    if r["status"] == "ok":
        return [x, *cells]
    return [x, H.describe_failure(r)] + [""] * (len(cells) - 1)


def _length_table(exp) -> list[str]:
    e = exp["length"]
    keys = (("median_s", ".2f"), ("working_gib", ".2f"), ("peak_gib", ".2f"), ("compile_s", ".2f"))
    keys += (("floor_fraction", ".0%"), ("matmul_fraction", ".0%"))
    rows = [_ok_row(r, r["length"], [H.fmt(r.get(k), f) for k, f in keys]) for r in e["records"]]
    head = ["L", "time s", "working GiB", "peak GiB", "compile s", "floor frac", "matmul frac"]
    return [
        "One layer, time and memory vs L (latim-jax):\n",
        H.markdown_table(head, rows),
        f"\nFitted exponents: time {H.fmt(e['median_s_exponent'])} (last two points "
        f"{H.fmt(e['median_s_exponent_last2'])}), working memory {H.fmt(e['working_gib_exponent'])}.\n",
    ]


def _batch_table(exp, settings) -> list[str]:
    e = exp["batch"]
    rows = [
        _ok_row(r, r["batch"], [H.fmt(r.get("median_s")), H.fmt(r.get("working_gib"))]) for r in e["records"]
    ]
    return [
        f"One layer at L = {settings['batch_length']}, time and memory vs batch:\n",
        H.markdown_table(["batch", "time s", "working GiB"], rows),
        f"\nFitted exponents: time {H.fmt(e['median_s_exponent'])}, "
        f"memory {H.fmt(e['working_gib_exponent'])}.\n",
    ]


def _largest_table(exp, settings) -> list[str]:
    found = {x["impl"]: x for x in exp["largest"]}
    rows = [
        [
            x["impl"],
            x["largest_completed"] or "-",
            x["first_failed"] or "-",
            x["failure"] or "-",
            len(x["trials"]),
        ]
        for x in exp["largest"]
    ]
    jl = found.get("latim-jax", {}).get("largest_completed")
    tl = found.get("torch-fair", {}).get("largest_completed")
    ratio = f"{jl / tl:.1f}x" if jl and tl else "-"
    pred = exp.get("largest_predicted_latim_jax") or "-"
    head = ["implementation", "largest L", "first failed L", "why", "trials"]
    return [
        f"Largest L completed (one layer, one call) under {settings['cap_gib']:g} GiB:\n",
        H.markdown_table(head, rows),
        f"\nlatim-jax / torch-fair largest L: {ratio}; "
        f"latim-jax L where the memory fit reaches the cap: {pred}.\n",
    ]


def _rows_table(exp, settings) -> list[str]:
    e = exp["rows"]
    rows = [
        _ok_row(r, r["length"], [H.fmt(r.get("median_s"), ".3f"), H.fmt(r.get("working_gib"))])
        for r in e["records"]
    ]
    counts = [_ok_row(r, r["rows"], [H.fmt(r.get("median_s"), ".3f")]) for r in e["counts"]]
    return [
        "Whole model, last row only (rows=[-1]), vs L:\n",
        H.markdown_table(["L", "time s", "working GiB"], rows),
        f"\nFitted exponent vs L: {H.fmt(e['median_s_exponent'])}. "
        f"Row subsets at L = {settings['rows_length']}:\n",
        H.markdown_table(["rows", "time s"], counts),
        f"\nFitted exponent vs rows: {H.fmt(e.get('count_median_s_exponent'))}.\n",
    ]


def _depth_table(exp, settings) -> list[str]:
    e = exp["depth"]
    rows = [
        _ok_row(r, r["n_layers"], [H.fmt(r.get("attribute_compile_s")), H.fmt(r.get("forward_compile_s")),
                                    H.fmt(r.get("attribute_median_s"), ".3f")])
        for r in e["records"]
    ]  # fmt: skip
    head = ["layers", "attribute compile s", "forward compile s", "attribute run s"]
    return [
        f"Compile time vs depth (d = {settings['depth_d']}, L = {settings['depth_length']}, "
        "random weights):\n",
        H.markdown_table(head, rows),
        f"\nattribute compile time, deepest / shallowest: {H.fmt(e['attribute_compile_ratio'])} "
        "(target <= 1.5).\n",
    ]


def tables(result) -> str:
    """Markdown tables of a scaling result."""
    settings = result["settings"]
    parts = []
    for name, exp in result["experiments"].items():
        parts.append(f"### {name}: {settings['shape']} shape, method {settings['method']}\n")
        if "length" in exp:
            parts += _length_table(exp)
        if "batch" in exp:
            parts += _batch_table(exp, settings)
        if "largest" in exp:
            parts += _largest_table(exp, settings)
        if "rows" in exp:
            parts += _rows_table(exp, settings)
        if "depth" in exp:
            parts += _depth_table(exp, settings)
    parts.append(H.rates_heading(result))
    parts.append(
        H.markdown_table(["rate", "value"], [[k, H.fmt(v, ".1f")] for k, v in result["rates"].items()])
    )
    return "\n".join(parts) + "\n"


def main(argv=None) -> None:
    from bench_vs_torch import measure_rates

    args = parse(argv)
    probe = H.run_worker({"task": "probe"}, cap_gib=max(args.cap_gib, 4.0), timeout_s=600)
    if probe["status"] != "ok":
        raise SystemExit(f"probe failed: {probe}")
    args.aggregation_supported = probe["aggregation_supported"]
    result = {
        "kind": "scaling",
        "created": H.now(),
        "command": "python " + " ".join(sys.argv),
        "machine": H.machine(),
        "versions": probe["versions"],
        "torch_threads": probe["torch_threads"],
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "rates": {},
        "experiments": {},
    }
    result["rates"] = measure_rates(args)
    workdir = args.keep_models or Path(tempfile.mkdtemp(prefix="latim-scaling-"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        run(args, result, workdir)
    finally:
        if args.keep_models is None:
            shutil.rmtree(workdir, ignore_errors=True)
    result["rates_start"] = result["rates"]
    result["rates_end"] = measure_rates(args)
    result["rates"] = floor.best_rates(result["rates_start"], result["rates_end"])
    floor.refloor(result, result["rates"])
    result["finished"] = H.now()
    H.write_json(args.out, result)
    text = tables(result)
    H.write_atomic(args.out.with_suffix(".md"), text)
    print(text)


if __name__ == "__main__":
    main()
