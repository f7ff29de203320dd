"""The ``latim-jax`` command line: convert, check, info, attribute, generate, evaluate.

Every path is taken relative to the current directory. A user error (bad argument, unknown model,
unwritable output) prints one ``error: ...`` line on stderr and exits with 2, before any long
computation; ``check`` exits with 1 when it prints FAIL. Progress bars go to stderr when it is a
terminal (``--quiet`` turns them off).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import warnings
from argparse import RawDescriptionHelpFormatter
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import numpy as np

from latim_jax.cli import check, info, tpu_check
from latim_jax.cli.args import (
    DEFAULT_METHOD,
    EXIT_CODES_HELP,
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    MODEL_HELP,
    Parser,
    RunFailed,
    UsageError,
    add_impl_argument,
    check_outputs,
    check_suffix,
    load_model,
    nonnegative_float,
    nonnegative_int,
    parse_ints,
    positive_float,
    positive_int,
)
from latim_jax.cli.dataset import add_dataset_parser
from latim_jax.cli.evaluate import add_evaluate_parser
from latim_jax.convert import CheckpointError, read_checkpoint, save_checkpoint
from latim_jax.convert.orbax_io import check_destination
from latim_jax.io import plotting, progress
from latim_jax.io.atomic import write_bytes_atomic
from latim_jax.io.loading import resolve
from latim_jax.io.results import ROLLOUT_METHODS
from latim_jax.io.spans import ROW_RULES
from latim_jax.latim import attribution
from latim_jax.latim.generated import attribute_generated
from latim_jax.latim.hidden_attention import AGGREGATIONS
from latim_jax.latim.kinds import MODES
from latim_jax.latim.memory import InsufficientMemoryError, human
from latim_jax.latim.request import TARGET_METHODS
from latim_jax.latim.scores import LATIM_METHODS, METHODS, PRECISIONS
from latim_jax.model import generate as generation
from latim_jax.model.kind import display_name
from latim_jax.tasks import registry, vocab
from latim_jax.tasks.words import word_spans

__all__ = [
    "EXIT_FAILED",
    "EXIT_OK",
    "EXIT_USAGE",
    "RunFailed",
    "UsageError",
    "build_parser",
    "load_model",
    "main",
]

DESCRIPTION = """LaTIM token-to-token attribution for Mamba models.

commands: attribute (one prompt: scores, a figure, an HTML view), attribute-dataset (every prompt of
a file, resumable), info, generate, evaluate (the task experiments), convert, check (logits and hidden
states against transformers, needs torch), tpu-check (compile a model's programs for a TPU generation
from this host, needs libtpu). Run 'latim-jax COMMAND --help' for each one's options."""
DTYPES = ("float32", "bfloat16", "float16")  # parameter dtypes `convert` casts to
CHECK_TOLERANCE = 1e-4


def tokenize(model, text: str) -> tuple[list[int], list[str]]:
    """Token ids and labels for ``text``: the checkpoint's tokenizer.json, or its task's words. Words
    the tokenizer encoded as its unknown token are named in a note on standard error."""
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", vocab.UnknownWordsWarning)
            encoded = vocab.encode(model, text)
    except ValueError as err:
        raise UsageError(str(err)) from err
    for w in caught:
        if issubclass(w.category, vocab.UnknownWordsWarning):
            print(f"note: {w.message}", file=sys.stderr)
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return encoded


def token_labels(model, ids) -> list[str]:
    """A readable label per id: the tokenizer's (or the task's) word, else the id (with a warning when
    the tokenizer cannot be read: the ids themselves need none)."""
    try:
        return vocab.labels(model, ids)
    except vocab.TokenizerError as err:
        print(f"warning: {err}; labels show ids", file=sys.stderr)
        return [str(int(i)) for i in ids]


def default_prompt(model, seed: int = 0) -> list[int]:
    """A prompt of the model's task for shipped models. copy: 10 content tokens, SEP, then the copy;
    mqar: one MQAR sequence (key-value pairs, then queries with their answers) drawn with ``seed``."""
    task = model.task
    if not task:
        raise UsageError("this model has no task to draw a default prompt from; pass --tokens or --text")
    if task.get("name") not in ("copy", "mqar"):
        raise UsageError(
            f"the {task.get('name')!r} task has no default prompt (the copy and mqar models have one); "
            "pass --tokens or --text"
        )
    rng = np.random.default_rng(seed)
    if task["name"] == "mqar":
        batch = registry.make_batch(registry.task_fields(task), 1, rng)
        return [int(t) for t in batch.tokens[0, : batch.lengths[0]]]
    n = int(min(task["max_len"], max(task["min_len"], 10)))
    content = [t for t in range(task["vocab_size"]) if t != task["sep_id"]]
    seq = list(rng.choice(content, size=n))
    return [int(t) for t in seq + [task["sep_id"]] + seq]


def _read_text(path: str, flag: str) -> str:
    """The contents of a --text-file / --tokens-file (``-``: standard input)."""
    if path == "-":
        return sys.stdin.read()
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise UsageError(f"{flag} {path}: cannot read it ({err.strerror or err})") from None


def _prompt_flags(args) -> list[str]:
    """The prompt options given among --text, --tokens, --text-file, --tokens-file (generate has
    only the first two)."""
    return [f for f in ("text", "tokens", "text_file", "tokens_file") if getattr(args, f, None) is not None]


def _prompt(model, args, default=None) -> tuple[list[int], list[str]]:
    """The prompt of --text / --tokens / --text-file / --tokens-file (else ``default(model)``) with its
    labels; never empty, every id in the vocabulary (checked before any label is looked up)."""
    given = _prompt_flags(args)
    if len(given) > 1:
        raise UsageError(f"pass one of --text, --tokens, --text-file, --tokens-file, found {len(given)}")
    if args.text is not None or getattr(args, "text_file", None) is not None:
        text = args.text if args.text is not None else _read_text(args.text_file, "--text-file")
        ids, labels = tokenize(model, text)
    elif args.tokens is not None or getattr(args, "tokens_file", None) is not None:
        flag = "--tokens" if args.tokens is not None else "--tokens-file"
        ids = parse_ints(args.tokens if args.tokens is not None else _read_text(args.tokens_file, flag), flag)
        n = model.config.n_tokens
        bad = [i for i in ids if not 0 <= i < n]
        if bad:
            raise UsageError(f"{flag}: token ids must lie in [0, {n}) (the vocabulary), found {bad[:5]}")
        labels = token_labels(model, ids)
    else:
        ids = default(model)
        labels = token_labels(model, ids)
    if not ids:
        raise UsageError("the prompt is empty: give at least one token with --tokens or --text")
    return ids, labels


def _api_call(fn, *args, **kwargs):
    """Call the library; its ValueError (bad ids, rows, layers ...) is a UsageError, its
    FloatingPointError (non-finite results) a failed run, its InsufficientMemoryError a UsageError
    naming this command's options."""
    try:
        return fn(*args, **kwargs)
    except FloatingPointError as err:
        raise RunFailed(str(err)) from err
    except ValueError as err:
        raise UsageError(str(err)) from err
    except InsufficientMemoryError as err:
        raise UsageError(_memory_message(err)) from err


def _memory_message(err: InsufficientMemoryError) -> str:
    """The memory refusal in this command line's terms (the library's names Python arguments)."""
    spelled = {
        "rows": "--rows -1 (only the last target)",
        "layers": f"--layers with at most {err.options.get('layers')} layers per run",
    }
    options = [spelled[k] for k in err.options if k in spelled]
    api = [k for k in err.options if k in ("top_k", "out_dtype", "stream_to")]
    if api:
        options.append(f"the Python API's latim_jax.attribute({', '.join(f'{k}=...' for k in api)})")
    return (
        f"attribution of {err.length} tokens needs about {human(err.needed)}, more than the "
        f"{human(err.limit)} available; options that fit: {'; '.join(options) or 'none'}"
    )


def cmd_convert(args):
    """`latim-jax convert`: read any supported checkpoint, write latim-jax's orbax format."""
    try:
        path = resolve(args.source)
        check_destination(Path(args.dest), args.overwrite, source=path)  # before reading any weights
        config, params = read_checkpoint(path, dtype=args.dtype)
        dest = save_checkpoint(
            args.dest, config, params, tokenizer_dir=path, overwrite=args.overwrite, source=path
        )
    except (ValueError, FileExistsError) as err:
        raise UsageError(str(err)) from err
    print(f"wrote {dest} ({config.describe()}, {config.n_layers} layers, d_model {config.d_model})")


CHECK_HELP = (
    "compare logits and hidden states with transformers (needs torch): a Hugging Face directory loads "
    "with transformers' from_pretrained; a latim-jax checkpoint is rebuilt as transformers' Mamba, "
    "FalconMamba, Mamba2 or NemotronH; other converted families are refused (exit code 2: check the "
    "original Hugging Face directory)"
)


def hidden_state_labels(count: int, begin: str) -> list[str]:
    """What each of transformers' ``count`` hidden states is, from check's ``hidden_states_begin``:
    "embeddings" then "after layer i - 1" when the list begins with the embeddings, else "after layer i"
    (transformers' layers)."""
    if begin == "embeddings":
        return ["embeddings"] + [f"after layer {i:3d}" for i in range(count - 1)]
    if begin == "after layer 0":
        return [f"after layer {i:3d}" for i in range(count)]
    raise ValueError(f"hidden_states_begin must be 'embeddings' or 'after layer 0', found {begin!r}")


def _check_source(args) -> str:
    """check's model: the positional DIR or --model (both only when they name the same one)."""
    if args.model is not None and args.model_option is not None and args.model != args.model_option:
        both = f"{args.model!r} and --model {args.model_option!r}"
        raise UsageError(f"check: the model given twice ({both})")
    source = args.model if args.model is not None else args.model_option
    if source is None:
        raise UsageError("check: name the model to check, as 'check DIR' or 'check --model DIR'")
    return source


def cmd_check(args):
    """`latim-jax check`: compare logits and hidden states with transformers; PASS or FAIL."""
    args.model = _check_source(args)
    check_outputs({"--json": args.json}, args.force)
    try:
        resolve(args.model)
    except ValueError as err:
        raise UsageError(str(err)) from err
    try:
        report = check.check_model(args.model, length=args.length, batch=args.batch, seed=args.seed)
    except ImportError as err:
        hint = "pip install 'latim-jax[torch]'"
        raise UsageError(f"check needs torch and transformers ({hint}): {err}") from err
    report.update(check.verdict(report, args.tolerance))
    print(
        f"reference: transformers ({report['reference']}), "
        f"{report['batch']} x {report['length']} random tokens"
    )
    print(
        f"logits: max abs error {report['max_logit_error']:.3e} "
        f"(relative {report['max_logit_error_relative']:.3e}),"
        f" mean abs error {report['mean_logit_error']:.3e}"
    )
    errors = report["hidden_error_relative"]
    for label, e in zip(hidden_state_labels(len(errors), report["hidden_states_begin"]), errors, strict=True):
        print(f"{label}: hidden-state relative error {e:.3e}")
    if args.json:
        write_bytes_atomic(args.json, json.dumps(report, indent=2).encode())
    print(report["summary"])
    if not report["passed"]:
        raise RunFailed(f"check failed: {report['summary']}")


def cmd_info(args):
    """`latim-jax info`: config, task, sizes, layers and vocabulary of a model."""
    if args.model_option is not None:
        if args.model is not None:
            both = f"{args.model!r} and --model {args.model_option!r}"
            raise UsageError(f"info: the model given twice ({both})")
        args.model = args.model_option
    model = load_model(args.model)
    print(info.summary(model, resolve(args.model)))


def one_token(model, value: str | None, flag: str) -> int | None:
    """The vocabulary id of ``--target`` / ``--foil``: an integer id, or a text that the model's tokenizer
    makes exactly one token (with byte-level BPE, " cat" and "cat" are different tokens)."""
    if value is None:
        return None
    n = model.config.n_tokens
    if value.strip().lstrip("-").isdigit():
        i = int(value)
        if not 0 <= i < n:
            raise UsageError(f"{flag} {i}: a token id must lie in [0, {n}) (the vocabulary)")
        return i
    ids, labels = tokenize(model, value)
    if len(ids) != 1:
        raise UsageError(
            f"{flag} {value!r} is {len(ids)} tokens ({', '.join(repr(x) for x in labels)}), not one: give "
            "one token's text (with its leading space where the tokenizer has one, e.g. ' cat') or its id"
        )
    return ids[0]


def _check_attribute_options(args) -> None:
    """The option combinations attribute refuses before loading anything."""
    if args.aggregation is not None and args.method != "hidden_attention":
        raise UsageError("--aggregation applies to --method hidden_attention only")
    if (args.target is not None or args.foil is not None) and args.method not in TARGET_METHODS:
        raise UsageError(
            f"--target and --foil apply to --method {' / '.join(TARGET_METHODS)} (they name logits)"
        )
    if args.generate is not None and (args.rows or args.target is not None or args.rollout):
        raise UsageError(
            "--generate scores the generated tokens' rows, each with its token as target: it takes neither "
            "--rows, --target nor --rollout (--foil contrasts each generated token with one foil)"
        )


def cmd_attribute(args):
    """`latim-jax attribute`: scores for one prompt, saved as .npz (+ a figure / HTML)."""
    _check_attribute_options(args)
    if args.plot is not None:
        try:
            plotting.figure_format(args.plot)
        except ValueError as err:
            raise UsageError(f"--plot: {err}") from err
    check_outputs({"--out": args.out, "--plot": args.plot, "--html": args.html}, args.force)
    check_suffix("--out", args.out, (".npz",))
    check_suffix("--html", args.html, (".html", ".htm"))
    layers = parse_ints(args.layers, "--layers") if args.layers else None
    rows = None
    if args.rows:
        rows = [-1] if args.rows.strip() == "last" else parse_ints(args.rows, "--rows")
        repeated = sorted({r for r in rows if rows.count(r) > 1})
        if repeated:
            raise UsageError(f"--rows names position(s) {repeated} more than once")
    plot_layers = parse_ints(args.plot_layers, "--plot-layers") if args.plot_layers else None
    if args.rollout and (args.method not in ROLLOUT_METHODS or layers or rows or plot_layers):
        raise UsageError(
            f"--rollout composes every layer of every row: it takes --method {' / '.join(ROLLOUT_METHODS)} "
            "and neither --layers, --rows nor --plot-layers"
        )
    model = load_model(args.model)
    n = model.config.n_layers
    computed = sorted({k % n for k in layers if -n <= k < n}) if layers else list(range(n))
    if plot_layers is not None and any(not -n <= k < n or k % n not in computed for k in plot_layers):
        raise UsageError(f"--plot-layers {plot_layers} must be among the scored layers {computed}")
    ids, labels = _prompt(model, args, default=lambda m: default_prompt(m, args.seed))
    if not _prompt_flags(args):
        print(f"prompt (the task's default, --seed {args.seed}): {' '.join(labels)}")
    target, foil = one_token(model, args.target, "--target"), one_token(model, args.foil, "--foil")
    extra = {} if args.aggregation is None else {"aggregation": args.aggregation}
    if foil is not None:
        extra["foil"] = foil
    options = dict(
        method=args.method, mode=args.mode, layers=layers, precision=args.precision, impl=args.impl
    )
    if args.generate is not None:
        result = _api_call(attribute_generated, model, np.asarray([ids]), args.generate, **options, **extra)
        ids = [int(t) for t in np.asarray(result.tokens[0])]
        new = token_labels(model, ids[len(labels) :])
        print(f"generated {args.generate} token(s): {' '.join(new)}")
        labels = labels + new
    else:
        result = _api_call(
            attribution.attribute, model, np.asarray([ids]), rows=rows, target=target, **options, **extra
        )
    result = result.with_labels(labels)
    if args.rollout:  # saved beside the per-layer scores; the pictures show it alone
        result = dataclasses.replace(result, extra={**result.extra, "rollout": result.rollout()})
    if args.words is not None:
        spans = _api_call(word_spans, model, np.asarray(ids))
        result = result.aggregate(spans, rows=args.words)
    result.save(args.out)
    mode = f" ({args.mode} mode)" if args.method in LATIM_METHODS else ""  # baselines have no mode
    what = " over words" if args.words is not None else ""
    print(f"wrote {args.out}: {args.method} scores{mode}{what}, shape {tuple(result.scores.shape)}")
    _pictures(args, model, result, labels, plot_layers)
    if "approximation_error" in result.extra:
        err = ", ".join(f"{e:.3f}" for e in np.asarray(result.extra["approximation_error"])[0])
        print(f"paper-mode approximation error per layer: {err}")


def _pictures(args, model, result, token_labels_, plot_layers):
    """The --plot figure and the --html page of an attribute result (its labels: tokens', or words'
    after --words; ``token_labels_`` name a row subset's positions)."""
    scores = np.asarray(result.scores[0])
    labels = list(result.labels[0])
    n = model.config.n_layers
    picked = list(range(len(result.layers)))
    if plot_layers is not None:  # checked against the scored layers before the computation
        picked = [result.layers.index(k % n) for k in plot_layers]
    kinds = model.config.kinds if model.config.is_hybrid else None  # a hybrid's panels name their kind
    names = [
        f"layer {result.layers[k]}" + (f" ({display_name(kinds[result.layers[k]])})" if kinds else "")
        for k in picked
    ]
    rows = result.picture_rows()  # a row subset over words: the word holding each row
    row_labels = labels if result.rows is None else [token_labels_[r] for r in result.rows]
    if args.rollout:
        scores, picked = np.asarray(result.extra["rollout"]), [0]  # (B = 1, L, L): one panel
        names = [f"rollout of layers 0-{n - 1}"]
    title = f"{model.source}: {args.method}" + (
        f" ({args.mode} mode)" if args.method in LATIM_METHODS else ""
    )
    title += ", over words" if args.words is not None else ""
    what = plotting.value_label(args.method)
    if args.rollout:
        what = f"{args.method} rollout: source j's share of target i through every layer"
        if args.method == "logit":
            what = "logit rollout: input token j's push on target i's next-token logit"
    options = dict(row_labels=row_labels, rows=rows, title=title, layer_names=names, value_label=what,
                   scale=args.scale)  # fmt: skip
    if args.plot:
        plotting.heatmap_grid(scores[picked], labels, args.plot, **options)
        print(f"wrote {args.plot}")
    if args.html:
        plotting.html_view(scores[picked], labels, args.html, **options)
        print(f"wrote {args.html}")


def generation_prompt(model) -> list[int]:
    """The default prompt of ``generate`` for a task model: a copy prompt up to and including its
    separator (the model should then copy), or MQAR pairs and the first query key."""
    ids = default_prompt(model)
    task = model.task
    if task["name"] == "copy":
        return ids[: ids.index(task["sep_id"]) + 1]
    seen = set()
    for i, t in enumerate(ids):
        if i % 2 == 0 and t in seen:  # the first query key
            return ids[: i + 1]
        seen.add(t)
    return ids


def cmd_generate(args):
    """`latim-jax generate`: print a greedy or sampled continuation (ids, or words with --words)."""
    if args.text is not None and args.tokens is not None:
        raise UsageError("pass either --text or --tokens, not both")
    model = load_model(args.model)
    ids, _ = _prompt(model, args, default=generation_prompt)
    out = _api_call(
        generation.generate,
        model,
        np.asarray([ids]),
        args.max_new_tokens,
        temperature=args.temperature,
        seed=args.seed,
    )
    out = [int(t) for t in np.asarray(out[0])]
    print(" ".join(token_labels(model, out)) if args.words else " ".join(str(t) for t in out))


def _common():
    """Options every subcommand takes."""
    c = Parser(add_help=False)
    c.add_argument("--quiet", action="store_true", help="no progress bars")
    return c


def build_parser() -> Parser:
    """The argument parser of ``latim-jax``."""
    p = Parser(prog="latim-jax", description=DESCRIPTION, epilog=EXIT_CODES_HELP)
    p.formatter_class = RawDescriptionHelpFormatter
    p.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    common = [_common()]
    model_help = MODEL_HELP

    c = sub.add_parser("convert", parents=common, help="convert a checkpoint into latim-jax's orbax format")
    c.add_argument(
        "source", help="local directory (HF, mamba_ssm, Codestral, latim-jax), shipped name or hub id"
    )
    c.add_argument("dest", help="output directory (must not exist or be empty, unless --overwrite)")
    c.add_argument("--dtype", default=None, choices=DTYPES, help="cast the parameters (default: as stored)")
    c.add_argument(
        "--overwrite", action="store_true", help="replace an existing latim-jax checkpoint at DEST"
    )
    c.set_defaults(func=cmd_convert)

    k = sub.add_parser(
        "check",
        parents=common,
        help="logits and hidden states vs transformers (needs torch): HF directories via "
        "from_pretrained, latim-jax checkpoints rebuilt as Mamba/FalconMamba/Mamba2/NemotronH, "
        "other converted families refused",
        description=CHECK_HELP + ".",
    )
    k.add_argument("model", nargs="?", default=None, help=model_help)
    # as the other commands take it (a positional and a different --model together is an error)
    k.add_argument(
        "--model",
        dest="model_option",
        default=None,
        metavar="MODEL",
        help="the same, as other commands take it",
    )
    k.add_argument("--length", type=positive_int, default=16, help="tokens per sequence (default 16)")
    k.add_argument("--batch", type=positive_int, default=1, help="random sequences (default 1)")
    k.add_argument("--seed", type=nonnegative_int, default=0)
    k.add_argument(
        "--tolerance",
        type=positive_float,
        default=CHECK_TOLERANCE,
        help=f"PASS when logits' and each layer's relative error is <= this (default {CHECK_TOLERANCE:g})",
    )
    k.add_argument("--json", default=None, help="also write the report as JSON")
    k.add_argument("--force", action="store_true", help="replace an existing --json file")
    k.set_defaults(func=cmd_check)

    i = sub.add_parser("info", parents=common, help="config, task, sizes, layers and vocabulary of a model")
    i.add_argument("model", nargs="?", default=None, help=model_help + " (default copy-mamba2)")
    # the other commands take --model: accepted here too (a positional and --model together is an error)
    i.add_argument(
        "--model",
        dest="model_option",
        default=None,
        metavar="MODEL",
        help="the same, as other commands take it",
    )
    i.set_defaults(func=cmd_info)

    a = sub.add_parser("attribute", parents=common, help="token-to-token scores for one prompt")
    a.add_argument("--model", default=None, help=model_help + " (default copy-mamba2)")
    a.add_argument("--text", default=None, help="prompt text, split by the model's tokenizer (see `info`)")
    a.add_argument("--tokens", default=None, help="token ids, e.g. '3 5 7' (default: a prompt of the task)")
    a.add_argument("--text-file", default=None, help="read the prompt text from a file ('-': stdin)")
    a.add_argument("--tokens-file", default=None, help="read the token ids from a file ('-': stdin)")
    a.add_argument(
        "--method", default=DEFAULT_METHOD, choices=METHODS, help=f"score (default {DEFAULT_METHOD})"
    )
    a.add_argument("--mode", default="exact", choices=MODES, help="decomposition mode (default exact)")
    a.add_argument(
        "--aggregation",
        default=None,
        choices=AGGREGATIONS,
        help="hidden_attention: how channels are reduced (default: the library's, minmax)",
    )
    a.add_argument(
        "--precision",
        default="float32",
        choices=PRECISIONS,
        help="the score path's projection: bfloat16 = bf16 operands, fp32 accumulation (default float32)",
    )
    a.add_argument("--layers", default=None, help="layers to score, e.g. '0 3' (default all)")
    a.add_argument(
        "--rows",
        default=None,
        help="target positions to score, e.g. '0 5' or '-1' (from the end), or 'last' (default all)",
    )
    add_impl_argument(a)
    a.add_argument("--seed", type=nonnegative_int, default=0, help="seed of the default prompt")
    a.add_argument("--out", default="attribution.npz", help="scores file (.npz, default attribution.npz)")
    a.add_argument(
        "--plot", default=None, help="heatmap grid; the extension picks the format (.png, .jpg, .svg, .pdf)"
    )
    a.add_argument("--plot-layers", default=None, help="layers drawn in --plot / --html (default all scored)")
    a.add_argument("--html", default=None, help="standalone HTML view with a layer slider")
    a.add_argument(
        "--rollout",
        action="store_true",
        help="also compose the layers (alti, logit, hidden_attention): saved as extra 'rollout' in --out, "
        "and the picture --plot / --html draws",
    )
    a.add_argument(
        "--scale",
        default="linear",
        choices=plotting.SCALES,
        help="colour scale of --plot / --html: linear (default), log (small values visible), quantile",
    )
    a.add_argument(
        "--generate",
        type=positive_int,
        default=None,
        metavar="N",
        help="generate N tokens greedily after the prompt and score each generated token's row (its "
        "token as the target of logit / grad_input); the file holds the prompt and the continuation",
    )
    a.add_argument(
        "--target",
        default=None,
        help="logit / grad_input: the token each row explains, as one token's text or an id (default: the "
        "model's own prediction at each position)",
    )
    a.add_argument(
        "--foil",
        default=None,
        help="logit / grad_input: a contrastive token (text or id): the scores explain logit(target) - "
        "logit(foil)",
    )
    a.add_argument(
        "--words",
        nargs="?",
        const="last",
        default=None,
        choices=ROW_RULES,
        help="aggregate over words (the tokenizer's): sources summed per word; a word's row is its last "
        "token's (default) or, with '--words mean', the mean of its tokens' rows",
    )
    a.add_argument("--force", action="store_true", help="replace existing --out/--plot/--html files")
    a.set_defaults(func=cmd_attribute)

    g = sub.add_parser("generate", parents=common, help="greedy or sampled continuation")
    g.add_argument("--model", default=None, help=model_help + " (default copy-mamba2)")
    g.add_argument("--text", default=None, help="prompt text, split by the model's tokenizer")
    g.add_argument("--tokens", default=None, help="prompt ids (default: a prompt of the model's task)")
    g.add_argument("--max-new-tokens", type=nonnegative_int, default=16, help="tokens to add (default 16)")
    g.add_argument(
        "--temperature", type=nonnegative_float, default=0.0, help="0 = greedy (default); > 0 samples"
    )
    g.add_argument("--seed", type=nonnegative_int, default=0, help="sampling seed")
    g.add_argument("--words", action="store_true", help="print words instead of ids")
    g.set_defaults(func=cmd_generate)

    add_evaluate_parser(sub, parents=common)

    add_dataset_parser(sub, parents=common)
    tpu_check.add_parser(sub, common)
    return p


def _version() -> str:
    try:
        return version("latim-jax")
    except PackageNotFoundError:
        return "unknown"


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or type(err).__name__


def _silence_stdout() -> None:
    """Point stdout at /dev/null so that Python's flush at exit does not fail on the closed pipe."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # no real file descriptor (captured in tests)
        pass


def main(argv=None) -> int:
    """Entry point of the ``latim-jax`` console script; returns the exit code (see ``EXIT_*``)."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as stop:  # argparse: --help, --version (0) or a bad argument (2)
        return stop.code if isinstance(stop.code, int) else EXIT_USAGE

    progress.set_quiet(args.quiet)
    try:
        args.func(args)
    except RunFailed as err:
        print(f"error: {_one_line(err)}", file=sys.stderr)
        return EXIT_FAILED
    except BrokenPipeError:  # `latim-jax info | head -1`: the reader left, nothing went wrong here
        _silence_stdout()
        return EXIT_OK
    except (UsageError, CheckpointError, OSError) as err:
        print(f"error: {_one_line(err)}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    finally:
        progress.set_quiet(False)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
