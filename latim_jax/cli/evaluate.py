"""``latim-jax evaluate TASK``: the command line of the task evaluations (:mod:`latim_jax.tasks.evaluate`,
:mod:`latim_jax.tasks.evaluate_align`, :mod:`latim_jax.tasks.evaluate_needle`)."""

from __future__ import annotations

import json

from latim_jax.cli.args import UsageError, check_outputs, load_model, nonnegative_int, positive_int
from latim_jax.io.atomic import write_bytes_atomic
from latim_jax.tasks import evaluate as ev
from latim_jax.tasks import evaluate_align as ea
from latim_jax.tasks import evaluate_needle as en
from latim_jax.tasks import methods as mt
from latim_jax.tasks.methods import METHODS


def add_evaluate_parser(sub, parents=()) -> None:
    """Register ``latim-jax evaluate TASK`` on the CLI's subparsers."""
    p = sub.add_parser(
        "evaluate", parents=list(parents), help="attribution quality on a task with known gold sources"
    )
    p.add_argument("task", choices=("copy", "mqar", "align", "needle"))
    p.add_argument("--model", default=None, help="a model trained on TASK (default: the shipped one)")
    p.add_argument(
        "--version",
        type=int,
        default=None,
        choices=(1, 2),
        help="pick the shipped model TASK-mamba1 or TASK-mamba2 (default 2; not with --model)",
    )
    p.add_argument(
        "--n", type=positive_int, default=64, help="held-out sequences (align: sentences; default 64)"
    )
    p.add_argument(
        "--lengths",
        type=positive_int,
        nargs="+",
        default=None,
        help="needle: sequence lengths (default 512 2048 8192)",
    )
    p.add_argument("--batch-size", type=positive_int, default=16, help="sequences per batch (default 16)")
    p.add_argument("--seed", type=nonnegative_int, default=10_000, help="seed of the held-out sequences")
    p.add_argument(
        "--gold",
        default="key",
        choices=("key", "value"),
        help="mqar: rank the queried key's position (default) or the answer token's position (key + 1)",
    )
    p.add_argument(
        "--methods",
        nargs="+",
        default=None,
        choices=sorted({m[1] for m in METHODS}),
        help="only these methods (default: all, both modes)",
    )
    p.add_argument("--out", default=None, help="write the full report as JSON")
    p.add_argument("--markdown", default=None, help="write the table as markdown")
    p.add_argument("--force", action="store_true", help="replace existing --out/--markdown files")
    p.set_defaults(func=_cmd_evaluate)


def _cmd_evaluate(args) -> None:
    if args.model is not None and args.version is not None:
        raise UsageError("--version picks a shipped model; it cannot be combined with --model")
    if args.gold == "value" and args.task != "mqar":
        raise UsageError("--gold value applies to the mqar task only")
    check_outputs({"--out": args.out, "--markdown": args.markdown}, args.force)
    model = load_model(args.model or f"{args.task}-mamba{args.version or 2}")
    task = model.task
    if not task or task.get("name") != args.task:
        trained = f"the {task.get('name')!r} task" if task else "no task"
        raise UsageError(f"model {model.source!r} was trained on {trained}, not {args.task!r}")
    if args.task in ("align", "needle"):
        return _cmd_task_eval(args, model)
    try:
        methods = METHODS if args.methods is None else [m for m in METHODS if m[1] in args.methods]
        report = ev.evaluate(
            model,
            task,
            n_sequences=args.n,
            batch_size=args.batch_size,
            seed=args.seed,
            gold=args.gold,
            methods=methods,
        )
    except ValueError as err:
        raise UsageError(str(err)) from err
    table = ev.format_table(report)
    print(table)
    if args.out:
        write_bytes_atomic(args.out, json.dumps(report, indent=2).encode())
    if args.markdown:
        write_bytes_atomic(args.markdown, (table + "\n").encode())


def _cmd_task_eval(args, model) -> None:
    """`latim-jax evaluate align|needle`: AER (latim_jax.tasks.evaluate_align) or needle
    retrieval (latim_jax.tasks.evaluate_needle) of every method, or of --methods."""
    try:
        chosen = mt.select(args.methods)
        if args.task == "align":
            report = ea.evaluate_alignment(
                model, n_sentences=args.n, batch_size=args.batch_size, seed=args.seed, methods=chosen
            )
            table = ea.format_table(report)
        else:
            report = en.evaluate_needle(
                model,
                lengths=tuple(args.lengths or en.LENGTHS),
                n_sequences=args.n,
                batch_size=min(args.batch_size, args.n),
                seed=args.seed,
                methods=chosen,
            )
            table = en.format_table(report)
    except ValueError as err:
        raise UsageError(str(err)) from err
    print(table)
    if args.out:
        write_bytes_atomic(args.out, json.dumps(report, indent=2).encode())
    if args.markdown:
        write_bytes_atomic(args.markdown, (table + "\n").encode())
