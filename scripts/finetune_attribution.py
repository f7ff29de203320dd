"""Fine-tune a task model with an attribution term in the loss, and report accuracy and attribution AUC
before and after (latim_jax.tasks.finetune: gradients flow through latim_jax.attribute).

Usage: python scripts/finetune_attribution.py SOURCE OUT [--steps 300] [--lam 1.0] [--method l2]
       [--layer -1] [--lr 1e-3] [--batch-size 32] [--n 128] [--json REPORT.json]

SOURCE: a shipped name or a directory written by scripts/train_copy.py, e.g. a copy model trained
with the plain initialisation (configs/copy-mamba1-default.json), whose maps are poor. OUT: the
fine-tuned model (a latim-jax checkpoint, written atomically). Exit codes as the latim-jax CLI.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import jax
import numpy as np

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
from latim_jax.tasks.finetune import FinetuneConfig, attribution_quality, finetune


def main(argv=None) -> int:
    """Run the script on ``argv`` (default: the command line); returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", help="model to fine-tune (shipped name or directory)")
    parser.add_argument("out", help="output directory for the fine-tuned model")
    parser.add_argument("--steps", type=nonnegative_int, default=300)
    parser.add_argument("--lam", type=float, default=1.0, help="weight of the attribution term")
    parser.add_argument("--method", default="l2", choices=("l2", "l1", "alti"))
    parser.add_argument("--layer", type=int, default=-1, help="the attribution layer (default the last)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--batch-size", type=positive_int, default=32)
    parser.add_argument("--n", type=positive_int, default=128, help="held-out sequences for the report")
    parser.add_argument("--seed", type=nonnegative_int, default=0)
    parser.add_argument("--json", default=None, help="write the before/after report as JSON")
    parser.add_argument("--force", action="store_true", help="replace OUT / --json")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    with progress.quiet(args.quiet):  # reset afterwards: tests and notebooks call main() in-process
        return _run(args)


def _run(args) -> int:
    """The script's work on parsed arguments; returns the exit code."""
    try:
        check_outputs({"--json": args.json}, args.force)
        if Path(args.out).exists() and not args.force:
            raise UsageError(f"{args.out} exists; pass --force to replace it")
        model = load_model(args.source)
        if not model.task:
            raise UsageError(f"{args.source}: the model has no task to fine-tune on")
        cfg = FinetuneConfig(
            steps=args.steps, batch_size=args.batch_size, lr=args.lr, lam=args.lam, method=args.method,
            layer=args.layer, seed=args.seed, eval_sequences=args.n,
        )  # fmt: skip
    except (UsageError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE
    report = run(model, cfg, args.out, log=None if args.quiet else print)
    print(json.dumps({k: report[k] for k in ("before", "after", "seconds")}, indent=2))
    if args.json:
        write_bytes_atomic(args.json, json.dumps(report, indent=2).encode())
    return EXIT_OK


def run(model, cfg: FinetuneConfig, out_dir, log=print) -> dict:
    """Quality before, fine-tune, quality after, save (atomically: checkpoint, task and tokenizer in a
    temporary sibling directory renamed into place); returns the report."""
    import shutil
    import uuid

    from latim_jax.convert import save_checkpoint

    before = attribution_quality(model, cfg)
    start = time.perf_counter()
    history = finetune(model, cfg, log=log)
    seconds = time.perf_counter() - start
    after = attribution_quality(model, cfg)
    out = Path(out_dir).absolute()
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        params = jax.tree.map(np.asarray, model.params())
        save_checkpoint(tmp, model.config, params, tokenizer_dir=model.tokenizer_dir or None)
        (tmp / "task.json").write_text(json.dumps(model.task, indent=2) + "\n")
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {
        "source": model.source,
        "settings": dataclasses.asdict(cfg),
        "before": before,
        "after": after,
        "history": history,
        "seconds": round(seconds, 1),
    }


if __name__ == "__main__":
    sys.exit(main())
