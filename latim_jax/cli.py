"""The ``latim-jax`` command line: convert, check, attribute, generate (and evaluate, when present)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np


def _parse_ints(text: str, what: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(",", " ").split()]
    except ValueError as err:
        raise SystemExit(f"error: {what} must be integers separated by spaces or commas: {text!r}") from err


def tokenize(model, text: str) -> tuple[list[int], list[str]]:
    """Token ids and labels for ``text`` with the checkpoint's own tokenizer.json."""
    path = Path(model.tokenizer_dir or "") / "tokenizer.json"
    if not model.tokenizer_dir or not path.is_file():
        raise SystemExit(
            f"error: the checkpoint {model.source!r} has no tokenizer.json; pass --tokens instead"
        )
    from tokenizers import Tokenizer

    enc = Tokenizer.from_file(str(path)).encode(text)
    return list(enc.ids), list(enc.tokens)


def token_labels(model, ids) -> list[str]:
    """Readable labels: the tokenizer's pieces when there is one, the task's names for shipped models."""
    task = model.task
    if task and "sep_id" in task:
        return ["SEP" if i == task["sep_id"] else str(i) for i in ids]
    if model.tokenizer_dir and (Path(model.tokenizer_dir) / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(Path(model.tokenizer_dir) / "tokenizer.json"))
        return [tok.id_to_token(int(i)) or str(i) for i in ids]
    return [str(i) for i in ids]


def default_prompt(model, seed: int = 0) -> list[int]:
    """A prompt of the model's task for shipped models. copy: 10 content tokens, SEP, then the copy;
    mqar: one MQAR sequence (key-value pairs, then queries with their answers) drawn with ``seed``."""
    task = model.task
    if not task or task.get("name") not in ("copy", "mqar"):
        raise SystemExit("error: this model has no task; pass --tokens or --text")
    rng = np.random.default_rng(seed)
    if task["name"] == "mqar":
        from latim_jax import tasks

        batch = tasks.make_batch(tasks.task_fields(task), 1, rng)
        return [int(t) for t in batch.tokens[0, : batch.lengths[0]]]
    n = int(min(task["max_len"], max(task["min_len"], 10)))
    content = [t for t in range(task["vocab_size"]) if t != task["sep_id"]]
    seq = list(rng.choice(content, size=n))
    return [int(t) for t in seq + [task["sep_id"]] + seq]


def cmd_convert(args):
    """`latim-jax convert`: read any supported checkpoint, write latim-jax's orbax format."""
    from latim_jax.convert import read_checkpoint, save_checkpoint
    from latim_jax.loading import resolve

    path = resolve(args.source)
    config, params = read_checkpoint(path, dtype=args.dtype)
    dest = save_checkpoint(args.dest, config, params, tokenizer_dir=path, overwrite=args.overwrite)
    print(f"wrote {dest} (Mamba-{config.version}, {config.n_layers} layers, d_model {config.d_model})")


def cmd_check(args):
    """`latim-jax check`: compare logits and hidden states with transformers."""
    from latim_jax.check import check_model

    try:
        report = check_model(args.model, length=args.length, batch=args.batch, seed=args.seed)
    except ImportError as err:
        hint = "pip install 'latim-jax[torch]'"
        raise SystemExit(f"error: check needs torch and transformers ({hint}): {err}") from err
    print(
        f"reference: transformers ({report['reference']}), "
        f"{report['batch']} x {report['length']} random tokens"
    )
    print(
        f"logits: max abs error {report['max_logit_error']:.3e} "
        f"(relative {report['max_logit_error_relative']:.3e}),"
        f" mean abs error {report['mean_logit_error']:.3e}"
    )
    for i, e in enumerate(report["hidden_error_relative"]):
        print(f"layer {i:3d}: hidden-state relative error {e:.3e}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


def cmd_attribute(args):
    """`latim-jax attribute`: scores for one prompt, saved as .npz (+ PNG / HTML)."""
    import latim_jax
    from latim_jax.plotting import heatmap_grid, html_view

    model = latim_jax.load(args.model)
    if args.text is not None and args.tokens is not None:
        raise SystemExit("error: pass either --text or --tokens, not both")
    if args.text is not None:
        ids, labels = tokenize(model, args.text)
    else:
        ids = (
            _parse_ints(args.tokens, "--tokens")
            if args.tokens is not None
            else default_prompt(model, args.seed)
        )
        labels = token_labels(model, ids)
    if not ids:
        raise SystemExit("error: the prompt is empty")
    layers = _parse_ints(args.layers, "--layers") if args.layers else None
    rows = _parse_ints(args.rows, "--rows") if args.rows else None
    try:
        result = latim_jax.attribute(
            model, np.asarray([ids]), method=args.method, mode=args.mode, layers=layers, rows=rows
        )
    except ValueError as err:
        raise SystemExit(f"error: {err}") from err
    result.save(args.out)
    print(f"wrote {args.out}: {args.method} scores ({args.mode} mode), shape {tuple(result.scores.shape)}")
    names = [f"layer {k}" for k in result.layers]
    scores = np.asarray(result.scores[0])
    row_labels = [labels[r] for r in result.rows] if result.rows else labels
    title = f"{model.source}: {args.method} ({args.mode})"
    if args.plot:
        heatmap_grid(scores, labels, args.plot, title=title, layer_names=names)
        print(f"wrote {args.plot}")
    if args.html:
        html_view(scores, labels, args.html, title=title, layer_names=names, row_labels=row_labels)
        print(f"wrote {args.html}")
    if "approximation_error" in result.extra:
        err = ", ".join(f"{e:.3f}" for e in np.asarray(result.extra["approximation_error"])[0])
        print(f"paper-mode approximation error per layer: {err}")


def cmd_generate(args):
    """`latim-jax generate`: print a greedy or sampled continuation's ids."""
    import latim_jax
    from latim_jax.generate import generate

    model = latim_jax.load(args.model)
    if args.text is not None:
        ids, _ = tokenize(model, args.text)
    else:
        ids = _parse_ints(args.tokens, "--tokens")
    out = generate(
        model, np.asarray([ids]), args.max_new_tokens, temperature=args.temperature, seed=args.seed
    )
    print(" ".join(str(int(t)) for t in np.asarray(out[0])))


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``latim-jax``."""
    p = argparse.ArgumentParser(prog="latim-jax", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("convert", help="convert a checkpoint into latim-jax's orbax format")
    c.add_argument("source", help="local directory (HF, mamba_ssm, Codestral) or hub id")
    c.add_argument("dest", help="output directory (must not exist unless --overwrite)")
    c.add_argument("--dtype", default=None, help="cast parameters (float32, bfloat16)")
    c.add_argument("--overwrite", action="store_true")
    c.set_defaults(func=cmd_convert)

    k = sub.add_parser("check", help="compare against transformers (needs torch)")
    k.add_argument("--model", required=True)
    k.add_argument("--length", type=int, default=16)
    k.add_argument("--batch", type=int, default=1)
    k.add_argument("--seed", type=int, default=0)
    k.add_argument("--json", default=None, help="also write the report as JSON")
    k.set_defaults(func=cmd_check)

    a = sub.add_parser("attribute", help="token-to-token scores for one prompt")
    a.add_argument("--model", default=None, help="checkpoint (default: the shipped Mamba-2 copy model)")
    a.add_argument("--text", default=None)
    a.add_argument("--tokens", default=None, help="token ids, e.g. '3 5 7'")
    a.add_argument("--method", default="l2")
    a.add_argument("--mode", default="exact")
    a.add_argument("--layers", default=None)
    a.add_argument("--rows", default=None)
    a.add_argument("--seed", type=int, default=0, help="seed of the default prompt")
    a.add_argument("--out", default="attribution.npz")
    a.add_argument("--plot", default=None, help="PNG heatmap grid")
    a.add_argument("--html", default=None, help="standalone HTML view with a layer slider")
    a.set_defaults(func=cmd_attribute)

    g = sub.add_parser("generate", help="greedy or sampled continuation")
    g.add_argument("--model", default=None)
    g.add_argument("--text", default=None)
    g.add_argument("--tokens", default="0")
    g.add_argument("--max-new-tokens", type=int, default=16)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=0)
    g.set_defaults(func=cmd_generate)

    try:
        from latim_jax.evaluate import add_evaluate_parser
    except ImportError:
        pass
    else:
        add_evaluate_parser(sub)
    from latim_jax.dataset_cli import add_dataset_parser

    add_dataset_parser(sub)
    return p


def main(argv=None) -> int:
    """Entry point of the ``latim-jax`` console script."""
    args = build_parser().parse_args(argv)
    from latim_jax.convert import CheckpointError

    try:
        args.func(args)
    except (CheckpointError, FileNotFoundError, FileExistsError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
