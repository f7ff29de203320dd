"""Compare models trained on one task (activation variants, initialisations) on the same held-out
sequences: accuracy, exact-mode conservation, paper-mode error E, LaTIM AUC in both modes.

Usage: python scripts/compare_models.py SOURCE [SOURCE ...] [--n 128] [--markdown OUT.md] [--out OUT.json]

Each SOURCE is anything latim_jax.load accepts: a shipped name ("copy-mamba2") or a directory written
by scripts/train_copy.py, e.g. with configs/copy-mamba2-{relu,identity,default}.json. The first
model's task defines the held-out sequences.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import latim_jax
from latim_jax.evaluate import compare_models, format_comparison_table
from latim_jax.results import write_bytes_atomic


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sources", nargs="+", help="models (shipped names or directories)")
    parser.add_argument("--n", type=int, default=128, help="held-out sequences")
    parser.add_argument("--seed", type=int, default=10_000)
    parser.add_argument("--markdown", default=None, help="write the table as markdown")
    parser.add_argument("--out", default=None, help="write the reports as JSON")
    args = parser.parse_args(argv)
    models = {}
    for source in args.sources:
        label = Path(source).name
        if label in models:
            parser.error(f"two models are both labelled {label!r}")
        models[label] = latim_jax.load(source)
        models[label].source = label
    reports = compare_models(models, n_sequences=args.n, seed=args.seed)
    table = format_comparison_table(reports)
    print(table)
    if args.markdown:
        write_bytes_atomic(args.markdown, (table + "\n").encode())
    if args.out:
        write_bytes_atomic(args.out, json.dumps(reports, indent=2).encode())


if __name__ == "__main__":
    main()
