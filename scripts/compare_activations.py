"""Exact mode vs the paper's exact-by-retraining route: evaluate copy models that differ only in their
post-conv activation (SiLU, ReLU, identity) on the same held-out sequences.

Usage: python scripts/compare_activations.py --silu copy-mamba2 --relu DIR --identity DIR \
           [--n 128] [--markdown OUT.md] [--out OUT.json]

Each model argument is anything latim_jax.load accepts (a shipped name or a directory written by
scripts/train_copy.py with configs/copy-mamba{1,2}-{relu,identity}.json).
"""

from __future__ import annotations

import argparse
import json

import latim_jax
from latim_jax.evaluate import compare_activations, format_activation_table
from latim_jax.results import write_bytes_atomic


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for act in ("silu", "relu", "identity"):
        parser.add_argument(f"--{act}", default=None, help=f"the {act} model (name or directory)")
    parser.add_argument("--n", type=int, default=128, help="held-out sequences")
    parser.add_argument("--seed", type=int, default=10_000)
    parser.add_argument("--markdown", default=None, help="write the table as markdown")
    parser.add_argument("--out", default=None, help="write the reports as JSON")
    args = parser.parse_args(argv)
    sources = {act: getattr(args, act) for act in ("silu", "relu", "identity") if getattr(args, act)}
    if not sources:
        parser.error("name at least one of --silu, --relu, --identity")
    models = {}
    for act, source in sources.items():
        model = latim_jax.load(source)
        if model.config.activation != act:
            parser.error(f"--{act} {source}: that model's activation is {model.config.activation!r}")
        models[f"{source}"] = model
    reports = compare_activations(models, n_sequences=args.n, seed=args.seed)
    table = format_activation_table(reports)
    print(table)
    if args.markdown:
        write_bytes_atomic(args.markdown, (table + "\n").encode())
    if args.out:
        write_bytes_atomic(args.out, json.dumps(reports, indent=2).encode())


if __name__ == "__main__":
    main()
