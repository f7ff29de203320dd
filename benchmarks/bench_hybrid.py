"""A hybrid beside plain Mamba-2 of the same width: time and peak memory of ``attribute`` on a
Nemotron-H-shaped model (130m width: 24 sublayers, 12 Mamba-2, 3 attention, 9 relu^2 MLP) and on a
24-layer Mamba-2 130m, random weights, one prompt: the last row at L = 4096 and the full map at L = 1024.

Usage: python benchmarks/bench_hybrid.py [--quick] [--method alti]
Writes benchmarks/results/hybrid.{json,md}. Each measurement runs in its own guarded subprocess
(benchmarks/harness.py), so its peak memory is its own.
"""

from __future__ import annotations

import argparse

from harness import RESULTS, fmt, log, machine, markdown_table, now, run_worker, write_atomic, write_json

PATTERN = "M-M*-M-M-M*-M-M-M*-M-M-M"  # 12 Mamba-2, 3 attention, 9 MLP: Nemotron-H's mix at 24 sublayers
KINDS = {"M": "mamba2", "*": "attention", "-": "mlp"}
MAMBA2 = dict(version=2, d_model=768, vocab_size=50288, d_state=128, d_conv=4, expand=2, head_dim=64,
              n_groups=1, chunk_size=256)  # fmt: skip
HYBRID = dict(MAMBA2, layer_kinds=[KINDS[c] for c in PATTERN], attn_heads=12, attn_kv_heads=4,
              attn_head_dim=64, mlp_width=3072, mlp_activation="relu2", family="nemotron_h")  # fmt: skip
CASES = (("last row", 4096, [-1]), ("full map", 1024, None))


def _ratio(a: dict, b: dict, key: str) -> str:
    return fmt(a[key] / b[key]) if a.get(key) and b.get(key) else "-"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny widths and lengths (checks the script)")
    parser.add_argument("--method", default="alti")
    parser.add_argument("--cap-gib", type=float, default=16.0)
    args = parser.parse_args(argv)
    models = {"Mamba-2 (24 layers)": {**MAMBA2, "n_layers": 24},
              "Nemotron-H-shaped hybrid (24 sublayers)": {**HYBRID, "n_layers": len(PATTERN)}}  # fmt: skip
    cases = CASES
    if args.quick:
        small = dict(d_model=64, vocab_size=64, d_state=16, head_dim=16, attn_heads=4, attn_kv_heads=2,
                     attn_head_dim=16, mlp_width=128)  # fmt: skip
        models = {k: {**v, **{f: x for f, x in small.items() if f in v}} for k, v in models.items()}
        cases = (("last row", 256, [-1]), ("full map", 64, None))
    records = []
    for case, length, rows in cases:
        for name, config in models.items():
            spec = dict(
                task="built",
                config=config,
                method=args.method,
                length=length,
                rows=rows,
                runs=2 if args.quick else 1,
            )
            rec = run_worker(spec, cap_gib=args.cap_gib, timeout_s=3600)
            log(
                f"{case} L={length} {name}: {rec.get('median_s')} s, "
                f"peak {rec.get('peak_gib')} GiB ({rec['status']})"
            )
            records.append({"case": case, "length": length, "model": name, **rec})
    result = {"when": now(), "machine": machine(), "method": args.method, "records": records}
    stem = "hybrid_quick" if args.quick else "hybrid"
    write_json(RESULTS / f"{stem}.json", result)
    rows_md = []
    for case, length, _ in cases:
        base, hyb = (r for r in records if r["case"] == case)
        for r in (base, hyb):
            ratios = (
                [_ratio(hyb, base, "median_s"), _ratio(hyb, base, "peak_gib")] if r is hyb else ["1", "1"]
            )
            cells = [
                fmt(r.get("median_s"), ".2f"),
                fmt(r.get("compile_s"), ".1f"),
                fmt(r.get("peak_gib"), ".2f"),
            ]
            rows_md.append([case, str(length), r["model"], *cells, *ratios])
    table = markdown_table(
        ["case", "L", "model", "time s", "compile s", "peak GiB", "time / Mamba-2", "peak / Mamba-2"], rows_md
    )
    write_atomic(
        RESULTS / f"{stem}.md", f"{args.method}, one prompt, random weights ({result['when']})\n\n{table}\n"
    )
    print(table)


if __name__ == "__main__":
    main()
