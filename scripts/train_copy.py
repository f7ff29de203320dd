"""Train a small Mamba model on a synthetic task (copy, MQAR) from a JSON config and save it.

Usage: python scripts/train_copy.py CONFIG OUT_DIR [--steps N] [--quiet]

CONFIG: e.g. configs/copy-mamba1.json. OUT_DIR (relative to the current directory or absolute)
receives params/ (orbax), latim_config.json, task.json and tokenizer.json (written atomically); see
latim_jax.tasks.train.save_trained. Exit codes as the latim-jax CLI: 0 ok, 2 a bad config or path.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from latim_jax.cli.args import EXIT_OK, EXIT_USAGE, positive_int
from latim_jax.io import progress
from latim_jax.tasks.train import train_from_config


def main(argv=None) -> int:
    """Run the script on ``argv`` (default: the command line); returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", help="training config JSON (configs/*.json)")
    parser.add_argument("out", help="output directory (replaced atomically)")
    parser.add_argument("--steps", type=positive_int, default=None, help="override the config's steps")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    with progress.quiet(args.quiet):  # reset afterwards: tests and notebooks call main() in-process
        return _run(args)


def _run(args) -> int:
    """The script's work on parsed arguments; returns the exit code."""
    if not Path(args.config).is_file():
        print(f"error: no such config file {args.config!r}", file=sys.stderr)
        return EXIT_USAGE
    try:
        result = train_from_config(args.config, args.out, steps=args.steps)
    except (ValueError, KeyError, TypeError) as err:  # a config that does not describe a run
        print(f"error: {args.config}: {' '.join(str(err).split())}", file=sys.stderr)
        return EXIT_USAGE
    final = result.final
    print(
        f"done: {len(result.losses)} steps in {result.wall_time_s:.0f}s; token accuracy "
        f"{final['token_accuracy']:.4f}, sequence accuracy {final['sequence_accuracy']:.4f} -> {args.out}"
    )
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
