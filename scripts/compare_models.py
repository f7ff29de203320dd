"""Compare models trained on one task (activation variants, initialisations) on the same held-out
sequences: accuracy, exact-mode conservation, paper-mode error E, LaTIM AUC in both modes.

Usage: python scripts/compare_models.py SOURCE [SOURCE ...] [--n 128] [--methods l2 alti logit]
       [--markdown OUT.md] [--out OUT.json]

Each SOURCE is anything latim_jax.load accepts: a shipped name ("copy-mamba2") or a directory written
by scripts/train_copy.py (relative to the current directory or absolute), e.g. with
configs/copy-mamba2-{relu,identity,default}.json. The first model's task defines the held-out
sequences. Exit codes as the latim-jax CLI: 0 ok, 2 a bad argument, model or output path.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from latim_jax.cli.args import (
    EXIT_OK,
    EXIT_USAGE,
    UsageError,
    check_outputs,
    load_model,
    nonnegative_int,
    positive_int,
)
from latim_jax.io import progress
from latim_jax.io.atomic import write_bytes_atomic
from latim_jax.tasks.evaluate import LATIM_METHODS, compare_models, format_comparison_table


def main(argv=None) -> int:
    """Run the script on ``argv`` (default: the command line); returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sources", nargs="+", help="models (shipped names or directories)")
    parser.add_argument("--n", type=positive_int, default=128, help="held-out sequences")
    parser.add_argument("--seed", type=nonnegative_int, default=10_000)
    parser.add_argument(
        "--methods", nargs="+", default=None, choices=("l2", "alti", "logit"), help="default: all three"
    )
    parser.add_argument("--markdown", default=None, help="write the table as markdown")
    parser.add_argument("--out", default=None, help="write the reports as JSON")
    parser.add_argument("--force", action="store_true", help="replace existing --markdown/--out files")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    with progress.quiet(args.quiet):  # reset afterwards: tests and notebooks call main() in-process
        return _run(args)


def _run(args) -> int:
    """The script's work on parsed arguments; returns the exit code."""
    try:
        check_outputs({"--markdown": args.markdown, "--out": args.out}, args.force)
        models = {}
        for source in args.sources:
            label = Path(source).name
            if label in models:
                raise UsageError(f"two models are both labelled {label!r}")
            models[label] = load_model(source)
            models[label].source = label
        methods = [m for m in LATIM_METHODS if args.methods is None or m[1] in args.methods]
        reports = compare_models(models, n_sequences=args.n, seed=args.seed, methods=methods)
    except (UsageError, ValueError) as err:
        print(f"error: {' '.join(str(err).split())}", file=sys.stderr)
        return EXIT_USAGE
    table = format_comparison_table(reports)
    print(table)
    if args.markdown:
        write_bytes_atomic(args.markdown, (table + "\n").encode())
    if args.out:
        write_bytes_atomic(args.out, json.dumps(reports, indent=2).encode())
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
