"""``latim-jax attribute-dataset``: the command line of :mod:`latim_jax.latim.dataset`."""

from __future__ import annotations

import sys

from latim_jax.cli.args import (
    DEFAULT_METHOD,
    MODEL_HELP,
    UsageError,
    add_impl_argument,
    load_model,
    parse_ints,
    positive_int,
)
from latim_jax.latim.dataset import DatasetError, attribute_dataset, read_prompts
from latim_jax.latim.hidden_attention import AGGREGATIONS
from latim_jax.latim.kinds import MODES
from latim_jax.latim.scores import METHODS, PRECISIONS
from latim_jax.model.inputs import check_layers
from latim_jax.tasks import vocab


def model_tokenizer(model):
    """``text -> ids`` with the model's tokenizer (tokenizer.json or its task's words), or None when it
    has none (:func:`latim_jax.tasks.vocab.encoder`)."""
    try:
        return vocab.encoder(model)
    except vocab.TokenizerError as err:
        raise UsageError(str(err)) from err


def add_dataset_parser(sub, parents=()) -> None:
    """Register ``latim-jax attribute-dataset`` on the CLI's subparsers."""
    p = sub.add_parser(
        "attribute-dataset",
        parents=list(parents),
        help="attribute every prompt of a file into a directory of shards (resumable)",
        description=(
            'Attribute every prompt of a .jsonl file ({"id": ..., "text"|"tokens": ...} per line; an id '
            'is a string or an int, results are keyed by its text, so 7 and "7" in one file are refused) '
            "or a text file (one prompt per line, id = line number) into OUT: shards written atomically "
            "as batches finish; rerunning the same command resumes where it stopped. Read the results "
            "with latim_jax.open_results(OUT) (with --rows last, each result's rows is its prompt's last "
            "position)."
        ),
    )
    p.add_argument("--model", default=None, help=MODEL_HELP + " (default copy-mamba2)")
    p.add_argument("--input", required=True, help="prompts: .jsonl, or plain text one prompt per line")
    p.add_argument("--out", required=True, help="output directory (created; reused only by the same run)")
    p.add_argument(
        "--method", default=DEFAULT_METHOD, choices=METHODS, help=f"score (default {DEFAULT_METHOD})"
    )
    p.add_argument("--mode", default="exact", choices=MODES, help="decomposition mode (default exact)")
    p.add_argument(
        "--aggregation", default="minmax", choices=AGGREGATIONS, help="hidden attention only (default minmax)"
    )
    p.add_argument("--layers", default=None, help="layer indices, e.g. '0 3' (default: all)")
    p.add_argument(
        "--rows",
        default="all",
        choices=("all", "last"),
        help="every target row or each prompt's last (default all)",
    )
    p.add_argument("--batch-size", type=positive_int, default=8, help="prompts per batch (default 8)")
    p.add_argument("--max-length", type=positive_int, default=None, help="longer prompts are bad lines")
    p.add_argument(
        "--on-bad-line",
        default="fail",
        choices=("skip", "fail"),
        help="bad input lines: fail (default) reads the whole input, then stops before computing with "
        "one error naming every bad line; skip warns about each and leaves it out",
    )
    add_impl_argument(p)
    p.add_argument(
        "--precision",
        default="float32",
        choices=PRECISIONS,
        help="the score path's projection: bfloat16 = bf16 operands, fp32 accumulation (default float32)",
    )
    p.set_defaults(func=_cmd_attribute_dataset)


def _cmd_attribute_dataset(args) -> None:
    layers = parse_ints(args.layers, "--layers") if args.layers else None
    model = load_model(args.model)
    try:
        layers = None if layers is None else list(check_layers(layers, model.config.n_layers))
        prompts = read_prompts(
            args.input,
            vocab_size=model.config.n_tokens,
            tokenize=model_tokenizer(model),
            max_length=args.max_length,
            on_bad_line=args.on_bad_line,
            warn=lambda message: print(f"warning: {message}", file=sys.stderr),
        )
        counts = attribute_dataset(
            model,
            prompts,
            args.out,
            method=args.method,
            mode=args.mode,
            layers=layers,
            rows=args.rows,
            batch_size=args.batch_size,
            aggregation=args.aggregation,
            impl=args.impl,
            precision=args.precision,
        )
    except (DatasetError, ValueError) as err:
        raise UsageError(str(err)) from err
    print(
        f"{args.out}: {counts['computed']} prompts attributed, {counts['done_before']} already there, "
        f"{counts['total']} in all ({counts['shards']} shards)"
    )
