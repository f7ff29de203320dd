"""Regenerate the task-evaluation tables recorded in benchmarks/ (and quoted in the README).

Usage: python benchmarks/task_evals.py [--only copy mqar variants] [--versions 1 2] [--n 128]
                                       [--variants DIR]

copy:        the shipped copy models, every method -> copy_eval_mamba{1,2}.{md,json}
mqar:        the shipped MQAR models, gold = the key position and the value position
             -> mqar_eval_mamba{v}_{key,value}.{md,json}
variants:    the shipped SiLU mimetic copy model beside the ReLU / identity / default-init models
             trained from configs/copy-mamba{v}-{relu,identity,default}.json into DIR/<config name>
             (python scripts/train_copy.py CONFIG DIR/NAME) -> variants_mamba{v}.{md,json}

All on the same held-out sequences (seed 10000); each file is written atomically.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import latim_jax
from latim_jax import evaluate as ev
from latim_jax.loading import SHIPPED
from latim_jax.results import write_bytes_atomic

HERE = Path(__file__).resolve().parent


def _write(stem: str, table: str, report) -> None:
    write_bytes_atomic(HERE / f"{stem}.md", (table + "\n").encode())
    write_bytes_atomic(HERE / f"{stem}.json", json.dumps(report, indent=2).encode())
    print(table, "\n", flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", default=["copy", "mqar", "variants"])
    parser.add_argument("--n", type=int, default=128, help="held-out sequences")
    parser.add_argument("--versions", type=int, nargs="+", default=[1, 2], choices=(1, 2))
    parser.add_argument("--variants", default=None, help="directory holding the variant models")
    args = parser.parse_args(argv)
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


if __name__ == "__main__":
    main()
