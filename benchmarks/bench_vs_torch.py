"""latim-jax vs the PyTorch way (benchmarks/torch_baseline.py), side by side in one job.

Both implementations run on the same random-weight models of real shape (built with transformers from
a config, save_pretrained to a temporary directory, loaded by latim_jax.load: the converter) and the
same prompts. Every measurement is a subprocess of its own under a memory guard (benchmarks/harness.py):
per (shape, version, scope in {layer: a 1-layer model of the shape, model: all layers}, method, L,
implementation in {latim-jax, torch-fair, torch-plain}) the first call, the median of up to --runs calls
after it (stopping once they took --budget-s), compile time (first - median), peak and working memory
(peak - RSS after loading), and the ratios; an implementation that runs out of memory at some L is not
tried at larger L. Also: the model forward alone vs transformers' CPU forward, the machine's matmul
rates (fp32/bf16, jax and torch) and exp rates measured in the same job, the floor (benchmarks/floor.py)
and the fraction of it reached, and max |latim-jax - torch| / max |torch| of the scores (where small).

    python benchmarks/bench_vs_torch.py --quick     # tiny shapes, end-to-end check: 3-9 min (load)
    nice -n 10 python benchmarks/bench_vs_torch.py        # the full run: about 10-14 hours here
    nice -n 10 python benchmarks/bench_vs_torch.py --shapes 130m --scopes layer --lengths 512 \\
        --methods l2 --forward-lengths --out benchmarks/results/vs_torch_l2_512.json   # one row: ~6 min

Duration of the full run (2 shared cores; the issue's one-layer L = 512 times: torch fair 4 s (Mamba-2)
/ 14 s (Mamba-1), plain 13 / 30 s, latim-jax 2 / 6.5 s; all O(L^2)): 130m one layer, L = 128..2048,
4 methods, 2 versions ~4-5 h (latim-jax at L = 2048 dominates: ~30 s / ~100 s a call; torch stops at
its OOM); 130m all 24 layers at L = 128 and 512 ~3-4 h (torch Mamba-1 plain: ~12 min a call); 370m
(48 layers, d = 1024) at L = 512 ~3-5 h. --plain-max-length and --methods trim it. --jax-precision
bfloat16 measures latim-jax's bf16 projection (fp32 accumulation) instead of fp32.

Output: --out (default benchmarks/results/vs_torch.json; --quick: vs_torch_quick.json) and the same
tables as markdown beside it (.md); the table is printed last. `python benchmarks/report.py` folds the
JSON into BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import floor  # noqa: E402
import harness as H  # noqa: E402
from shapes import shape as make_shape  # noqa: E402

IMPLS = ("latim-jax", "torch-fair", "torch-plain")
TARGETS = {1: 6.0, 2: 2.5}  # the issue's full-model time targets at L = 512 (torch fair / latim-jax)
MEMORY_TARGET = 10.0  # working memory torch / latim-jax


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny shapes and lengths: validates the script")
    p.add_argument("--shapes", nargs="+", default=["130m", "370m"])
    p.add_argument("--model-scope-only", nargs="*", default=["370m"], help="shapes measured only whole")
    p.add_argument("--versions", nargs="+", type=int, default=[1, 2])
    p.add_argument("--methods", nargs="+", default=["l2", "alti", "logit", "hidden_attention"])
    p.add_argument("--mode", default="exact", choices=["exact", "paper"])
    p.add_argument("--aggregation", default="minmax", choices=["minmax", "abs", "signed"])
    p.add_argument("--scopes", nargs="+", default=["layer", "model"], choices=["layer", "model"])
    p.add_argument("--lengths", nargs="+", type=int, default=[128, 256, 512, 1024, 2048], help="layer scope")
    p.add_argument("--model-lengths", nargs="+", type=int, default=[128, 512], help="model scope")
    p.add_argument("--forward-lengths", nargs="*", type=int, default=[256, 1024])
    p.add_argument("--plain-max-length", type=int, default=512, help="torch-plain only up to this L")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument(
        "--torch-runs",
        type=int,
        default=None,
        help="timed torch calls after the first (default --runs); 0: time the first (torch compiles nothing)",
    )
    p.add_argument("--budget-s", type=float, default=60.0, help="stop timed runs once they took this long")
    p.add_argument("--cap-gib", type=float, default=20.0, help="kill a measurement above this RSS")
    p.add_argument("--timeout-s", type=float, default=3600.0)
    p.add_argument("--check-max-mib", type=float, default=64.0, help="compare scores up to this size")
    p.add_argument("--matmul-n", type=int, default=2048)
    p.add_argument("--torch-threads", type=int, default=None, help="default: torch's own (= cores)")
    p.add_argument(
        "--jax-precision",
        default="float32",
        choices=["float32", "bfloat16"],
        help="latim-jax's W_out projection (bfloat16: bf16 operands, fp32 accumulation)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--keep-models", type=Path, default=None, help="build the models in this directory")
    args = p.parse_args(argv)
    if args.quick:
        quick = dict(shapes=["quick"], model_scope_only=[], methods=["l2", "hidden_attention"])
        quick.update(lengths=[64, 128], model_lengths=[64], forward_lengths=[128], plain_max_length=64)
        quick.update(runs=2, budget_s=10.0, cap_gib=4.0, timeout_s=600.0, matmul_n=512)
        H.quick_defaults(p, args, quick)
    if args.out is None:
        args.out = H.RESULTS / ("vs_torch_quick.json" if args.quick else "vs_torch.json")
    return args


def measure_rates(args) -> dict:
    """fp32/bf16 matmul GFLOP/s and exp G/s, jax and torch, each in its own process."""
    rates = {}
    for impl in ("jax", "torch"):
        for dtype in ("float32", "bfloat16"):
            r = H.run_worker(
                {"task": "matmul", "impl": impl, "dtype": dtype, "n": args.matmul_n},
                cap_gib=max(args.cap_gib, 4.0),
                timeout_s=600,
            )
            rates[f"matmul_{impl}_{dtype}_gflops"] = r.get("gflops")
        r = H.run_worker(
            {"task": "exp", "impl": impl, "size": 1 << (20 if args.quick else 24)},
            cap_gib=max(args.cap_gib, 4.0),
            timeout_s=600,
        )
        rates[f"exp_{impl}_gexp_per_s"] = r.get("gexp_per_s")
    H.log("rates: " + ", ".join(f"{k} {H.fmt(v, '.1f')}" for k, v in rates.items()))
    return rates


def prepare(args, workdir: Path, shape_name: str, version: int, scope: str) -> tuple[dict, Path]:
    """Build and save the random transformers model of (shape, version, scope) once."""
    layers = {"layer": 1}.get(scope)
    s = make_shape(shape_name, version, **({"n_layers": layers} if layers else {}))
    path = workdir / f"{shape_name}-m{version}-{scope}"
    if not (path / "config.json").is_file():
        r = H.run_worker(
            {"task": "prepare", "shape": s, "model_dir": str(path), "seed": args.seed},
            cap_gib=max(args.cap_gib, 8.0),
            timeout_s=args.timeout_s,
        )
        if r["status"] != "ok":
            raise SystemExit(f"could not build {path.name}: {r}")
        H.log(f"built {path.name}: {r['params'] / 1e6:.1f}M parameters in {r['seconds']:.0f} s")
    return s, path


def attribute_spec(args, impl, s, path, method, length, save):
    """The worker spec of one attribution measurement."""
    return {
        "task": "attribute",
        "impl": "jax" if impl == "latim-jax" else "torch",
        "fair": impl == "torch-fair",
        "model_dir": str(path),
        "vocab": s["vocab_size"],
        "method": method,
        "mode": args.mode,
        "aggregation": args.aggregation,
        "aggregation_supported": args.aggregation_supported,
        "length": length,
        "batch": args.batch,
        "seed": args.seed,
        "runs": args.runs if impl == "latim-jax" or args.torch_runs is None else args.torch_runs,
        "budget_s": args.budget_s,
        "save": save,
        "torch_threads": args.torch_threads,
        "precision": args.jax_precision,
    }


def compare(saved: dict) -> dict:
    """max |a - b| / max |b| between latim-jax and torch-fair (and torch-plain vs torch-fair)."""
    out = {}
    ref = saved.get("torch-fair")
    if ref is None or not ref.is_file():
        return out
    b = np.load(ref)
    scale = max(float(np.abs(b).max()), 1e-30)
    pairs = (("latim-jax", "max_rel_diff_jax_vs_torch"), ("torch-plain", "max_rel_diff_plain_vs_fair"))
    for impl, key in pairs:
        p = saved.get(impl)
        if p is not None and p.is_file():
            out[key] = float(np.abs(np.load(p) - b).max() / scale)
    return out


def run_configs(args, rates, workdir: Path, result: dict) -> None:
    """Every (shape, version, scope, method, L, implementation) measurement, appended to ``result``."""
    for shape_name in args.shapes:
        for version in args.versions:
            scopes = ["model"] if shape_name in args.model_scope_only else args.scopes
            for length in args.forward_lengths:
                s, path = prepare(args, workdir, shape_name, version, "model")
                result["forward"].append(run_forward(args, s, path, shape_name, version, length))
                H.write_json(args.out, result)
            for scope in scopes:
                s, path = prepare(args, workdir, shape_name, version, scope)
                lengths = args.model_lengths if scope == "model" else args.lengths
                for method in args.methods:
                    failed: dict[str, int] = {}
                    for length in lengths:
                        recs = run_one(
                            args, rates, workdir, s, path, (shape_name, scope, method, length), failed
                        )
                        result["records"].extend(recs)
                        H.write_json(args.out, result)


def run_one(args, rates, workdir, s, path, config, failed) -> list[dict]:
    """All implementations of one configuration (shape, scope, method, L), back to back; returns their
    records. ``failed`` maps an implementation to the L it failed at (it is skipped from then on)."""
    shape_name, scope, method, length = config
    size_mib = 4 * args.batch * s["n_layers"] * length * length / 2**20
    saved, recs = {}, []
    w = floor.work(s, method, length, batch=args.batch)
    for impl in IMPLS:
        base = dict(
            shape=shape_name, version=s["version"], scope=scope, layers=s["n_layers"], method=method,
            mode=args.mode, length=length, batch=args.batch, impl=impl,
        )  # fmt: skip
        if impl == "torch-plain" and length > args.plain_max_length:
            continue
        if impl in failed:
            recs.append({**base, "status": "skipped", "reason": f"failed at L={failed[impl]}"})
            continue
        save = workdir / f"scores-{impl}.npy" if size_mib <= args.check_max_mib else None
        if save is not None:
            save.unlink(missing_ok=True)
            saved[impl] = save
        spec = attribute_spec(args, impl, s, path, method, length, None if save is None else str(save))
        r = H.run_worker(spec, cap_gib=args.cap_gib, timeout_s=args.timeout_s)
        rec = {**base, **r}
        if r["status"] == "ok":
            lib = "jax" if impl == "latim-jax" else "torch"
            mm, ex = rates.get(f"matmul_{lib}_float32_gflops"), rates.get(f"exp_{lib}_gexp_per_s")
            rec.update(work=w, **floor.fractions(w, r.get("median_s"), mm, ex))
        else:
            failed[impl] = length
        recs.append(rec)
        H.log(
            f"{shape_name} m{s['version']} {scope} {method} L={length} {impl}: "
            + (
                f"{H.fmt(r.get('median_s'))} s (first {H.fmt(r.get('first_s'))} s), "
                f"working {H.fmt(r.get('working_gib'))} GiB"
                if r["status"] == "ok"
                else H.describe_failure(rec) + " " + r.get("error", "")
            )
        )
    diffs = compare(saved)
    for rec in recs:
        if rec["impl"] == "latim-jax":
            rec.update(diffs)
    for p in saved.values():
        p.unlink(missing_ok=True)
    return recs


def run_forward(args, s, path, shape_name, version, length) -> dict:
    """latim-jax model(tokens) vs transformers model(ids).logits on the whole model."""
    out = {"shape": shape_name, "version": version, "length": length, "batch": args.batch}
    for impl in ("jax", "torch"):
        spec = {
            "task": "forward",
            "impl": impl,
            "model_dir": str(path),
            "vocab": s["vocab_size"],
            "length": length,
            "batch": args.batch,
            "seed": args.seed,
            "runs": args.runs,
            "budget_s": args.budget_s,
        }
        out[impl] = H.run_worker(spec, cap_gib=args.cap_gib, timeout_s=args.timeout_s)
    j, t = out["jax"].get("median_s"), out["torch"].get("median_s")
    out["speedup"] = t / j if j and t else None
    H.log(f"forward {shape_name} m{version} L={length}: jax {H.fmt(j, '.3f')} s, torch {H.fmt(t, '.3f')} s")
    return out


def tables(result: dict) -> str:
    """The markdown tables of a result: attribution, targets, forward, rates."""
    recs = result["records"]
    by = {}
    for r in recs:
        by.setdefault((r["shape"], r["version"], r["scope"], r["method"], r["length"]), {})[r["impl"]] = r
    rows = []
    for key, impls in by.items():
        shape_name, version, scope, method, length = key
        j, f, p = (impls.get(i, {}) for i in IMPLS)

        def t(r):
            return (
                H.fmt(r.get("median_s")) if r.get("status") == "ok" else H.describe_failure(r) if r else "-"
            )

        def ratio(a, b, key="median_s"):
            ok = a.get("status") == "ok" and b.get("status") == "ok" and a.get(key) and b.get(key)
            return H.fmt(a[key] / b[key], ".1f") + "x" if ok else "-"

        rows.append(
            [
                shape_name, f"Mamba-{version}", scope, method, length, t(j), t(f), t(p),
                ratio(f, j), ratio(p, j), H.fmt(j.get("working_gib")), H.fmt(f.get("working_gib")),
                ratio(f, j, "working_gib"), H.fmt(j.get("compile_s")), H.fmt(j.get("floor_fraction"), ".0%"),
                H.fmt(j.get("matmul_fraction"), ".0%"), H.fmt(j.get("max_rel_diff_jax_vs_torch"), ".0e"),
            ]
        )  # fmt: skip
    header = [
        "shape", "version", "scope", "method", "L", "latim-jax s", "torch fair s", "torch plain s",
        "fair/jax", "plain/jax", "jax work GiB", "torch work GiB", "mem torch/jax", "jax compile s",
        "jax floor frac", "jax matmul frac", "max rel diff",
    ]  # fmt: skip
    parts = ["### Attribution: latim-jax vs PyTorch (median of runs after the first call)\n"]
    parts.append(H.markdown_table(header, rows))
    parts.append("\n\n### Targets (whole model, L = 512)\n")
    parts.append(targets_table(by))
    fwd = [
        [
            f["shape"], f"Mamba-{f['version']}", f["length"], H.fmt(f["jax"].get("median_s"), ".3f"),
            H.fmt(f["torch"].get("median_s"), ".3f"), H.fmt(f.get("speedup"), ".1f") + "x",
            H.fmt(f["jax"].get("compile_s")),
        ]
        for f in result["forward"]
    ]  # fmt: skip
    parts.append("\n\n### Model forward: latim-jax vs transformers (CPU path)\n")
    head = ["shape", "version", "L", "latim-jax s", "transformers s", "speedup", "jax compile s"]
    parts.append(H.markdown_table(head, fwd))
    parts.append("\n\n" + H.rates_heading(result))
    rates = [[k, H.fmt(v, ".1f")] for k, v in result["rates"].items()]
    parts.append(H.markdown_table(["rate", "value"], rates))
    return "\n".join(parts) + "\n"


def targets_table(by: dict) -> str:
    """Full-model L = 512 ratios against the issue's targets (the first shape measured whole)."""
    rows = []
    for (shape_name, version, scope, method, length), impls in by.items():
        if scope != "model" or length != 512 or shape_name != "130m":
            continue
        j, f, p = (impls.get(i, {}) for i in IMPLS)
        if j.get("status") != "ok" or f.get("status") != "ok":
            rows.append([f"Mamba-{version}", method, "-", "-", "-", "incomplete"])
            continue
        speed = f["median_s"] / j["median_s"]
        plain = p["median_s"] / j["median_s"] if p.get("status") == "ok" else None
        mem = f["working_gib"] / j["working_gib"] if j.get("working_gib") and f.get("working_gib") else None
        ok = speed >= TARGETS[version] and (mem or 0) >= MEMORY_TARGET
        rows.append(
            [
                f"Mamba-{version}", method, f"{speed:.1f}x (target {TARGETS[version]:g}x)",
                H.fmt(plain, ".1f") + "x", H.fmt(mem, ".1f") + f"x (target {MEMORY_TARGET:g}x)",
                "met" if ok else "missed",
            ]
        )  # fmt: skip
    if not rows:
        return "(no 130m whole-model L = 512 measurement in this run)"
    return H.markdown_table(
        ["version", "method", "torch fair / jax", "plain / jax", "memory", "targets"], rows
    )


def main(argv=None) -> None:
    args = parse(argv)
    probe = H.run_worker({"task": "probe"}, cap_gib=args.cap_gib, timeout_s=600)
    if probe["status"] != "ok":
        raise SystemExit(f"probe failed: {probe}")
    args.aggregation_supported = probe["aggregation_supported"]
    if not args.aggregation_supported:
        H.log("latim_jax.attribute has no aggregation=: hidden_attention compared with aggregation='signed'")
    result = {
        "kind": "vs_torch",
        "created": H.now(),
        "command": "python " + " ".join(sys.argv),
        "machine": H.machine(),
        "versions": probe["versions"],
        "torch_threads": probe["torch_threads"],
        "aggregation_supported": args.aggregation_supported,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "rates": {},
        "forward": [],
        "records": [],
    }
    result["rates"] = measure_rates(args)
    workdir = args.keep_models or Path(tempfile.mkdtemp(prefix="latim-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        run_configs(args, result["rates"], workdir, result)
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
