"""Regenerate the task-evaluation tables recorded in benchmarks/ (and quoted in the README).

Usage: python benchmarks/task_evals.py [--only copy mqar variants align needle hybrid gdn-hybrid]
                                       [--versions 1 2] [--n 128]
                                       [--variants DIR] [--align-n 512] [--needle-n 32]
                                       [--lengths 512 2048 8192]

copy:        the shipped copy models, every method -> copy_eval_mamba{1,2}.{md,json}
mqar:        the shipped MQAR models, gold = the key position and the value position
             -> mqar_eval_mamba{v}_{key,value}.{md,json}
variants:    the shipped SiLU mimetic copy model beside the ReLU / identity / default-init models
             trained from configs/copy-mamba{v}-{relu,identity,default}.json into DIR/<config name>
             (python scripts/train_copy.py CONFIG DIR/NAME) -> variants_mamba{v}.{md,json}
align:       the shipped translation models, AER of every method (latim_jax.tasks.evaluate_align)
             -> align_eval_mamba{v}.{md,json}
needle:      the shipped needle models at each length, retrieval accuracy and attribution AUC / R@1
             of the query rows (latim_jax.tasks.evaluate_needle) -> needle_eval_mamba{v}.{md,json}
hybrid:      the shipped hybrid needle model (Mamba-2 + attention), with and without its attention
             output: accuracy and per-sublayer maps (latim_jax.tasks.hybrid_needle) -> hybrid_needle.{md,json}
gdn-hybrid:  the same for the shipped Gated DeltaNet hybrid (GDN + attention) -> hybrid_needle_gdn.{md,json}

All on the same held-out sequences (seed 10000); each file is written atomically. Without --only,
every table except variants (which needs --variants) is regenerated.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import latim_jax
from latim_jax.io.atomic import write_bytes_atomic
from latim_jax.io.loading import SHIPPED
from latim_jax.tasks import evaluate as ev
from latim_jax.tasks import evaluate_align as ea
from latim_jax.tasks import evaluate_needle as en
from latim_jax.tasks import hybrid_needle as hn

HERE = Path(__file__).resolve().parent
OUT = HERE / "results" / "tasks"  # task evaluations, apart from the speed and memory results


def _write(stem: str, table: str, report) -> None:
    write_bytes_atomic(OUT / f"{stem}.md", (table + "\n").encode())
    write_bytes_atomic(OUT / f"{stem}.json", json.dumps(report, indent=2).encode())
    print(table, "\n", flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    tables = ("copy", "mqar", "variants", "align", "needle", "hybrid", "gdn-hybrid")
    parser.add_argument("--only", nargs="+", default=None, choices=tables)
    parser.add_argument("--n", type=int, default=128, help="held-out sequences")
    parser.add_argument("--versions", type=int, nargs="+", default=[1, 2], choices=(1, 2))
    parser.add_argument("--variants", default=None, help="directory holding the variant models")
    parser.add_argument("--align-n", type=int, default=512, help="held-out sentences (align)")
    parser.add_argument("--needle-n", type=int, default=32, help="held-out sequences per cell (needle)")
    parser.add_argument("--lengths", type=int, nargs="+", default=list(en.LENGTHS), help="needle lengths")
    args = parser.parse_args(argv)
    if args.only is None:
        args.only = [t for t in tables if t != "variants" or args.variants]
    for v in args.versions:
        if "copy" in args.only:
            model = latim_jax.load(f"copy-mamba{v}")
            report = ev.evaluate(model, n_sequences=args.n)
            _write(f"copy_eval_mamba{v}", ev.format_table(report), report)
        if "mqar" in args.only and f"mqar-mamba{v}" in SHIPPED:
            model = latim_jax.load(f"mqar-mamba{v}")
            for gold in ("key", "value"):
                report = ev.evaluate(model, n_sequences=args.n, gold=gold)
                _write(f"mqar_eval_mamba{v}_{gold}", ev.format_table(report), report)
        if "align" in args.only and f"align-mamba{v}" in SHIPPED:
            report = ea.evaluate_alignment(latim_jax.load(f"align-mamba{v}"), n_sentences=args.align_n)
            _write(f"align_eval_mamba{v}", ea.format_table(report), report)
        if "needle" in args.only and f"needle-mamba{v}" in SHIPPED:
            model = latim_jax.load(f"needle-mamba{v}")
            report = en.evaluate_needle(model, lengths=tuple(args.lengths), n_sequences=args.needle_n)
            _write(f"needle_eval_mamba{v}", en.format_table(report), report)
        if "variants" in args.only:
            if args.variants is None:
                parser.error("variants needs --variants DIR (the trained variant models)")
            models = {f"copy-mamba{v}": latim_jax.load(f"copy-mamba{v}")}
            for variant in ("relu", "identity", "default"):
                path = Path(args.variants) / f"copy-mamba{v}-{variant}"
                models[path.name] = latim_jax.load(path)
                models[path.name].source = path.name
            reports = ev.compare_models(models, n_sequences=args.n)
            _write(f"variants_mamba{v}", ev.format_comparison_table(reports), reports)
    for name, model_name, stem in (("hybrid", "needle-hybrid", "hybrid_needle"),
                                   ("gdn-hybrid", "needle-hybrid-gdn", "hybrid_needle_gdn")):  # fmt: skip
        if name in args.only:
            report = hn.where_retrieved(
                latim_jax.load(model_name), lengths=tuple(args.lengths), n_sequences=args.needle_n
            )
            _write(stem, hn.format_report(report), report)


if __name__ == "__main__":
    main()
