"""Word alignment from attribution maps: the paper's MT experiment on the synthetic language pair.

For held-out sentences of :mod:`latim_jax.tasks.align`, every method's map (per layer, and aggregated over
layers as :func:`latim_jax.tasks.methods.layer_aggregate` does) gives one link per target word, to the source
word with the largest attribution in the row that predicts the target word (``align.source_scores``;
the word's own row is reported beside it); the links are scored with AER against the gold sure and
possible links, summed over all sentences. Two reference rows: "random" (a uniformly random word of
the sentence's source per target word, mean of 10 draws; padding slots are never drawn) and "gold
argmax" (the best any one-link-per-word extraction can do, above 0 because a plural noun has two sure
links).
"""

from __future__ import annotations

import numpy as np

from latim_jax.tasks import align, registry
from latim_jax.tasks.methods import METHODS, layer_aggregate, resolve, run

# the paper's IWSLT17 de-en AER ranges (docs/method.md section 11): method -> text
PAPER_AER = {
    "LaTIM l2": "0.44-0.52",
    "LaTIM logit": "0.63-0.69 (ALTI-logit)",
    "hidden attention": "about 0.84",
}


def held_out(task: dict, n_sentences: int, seed: int):
    """Held-out (Batch, Links) of the translation task (pass a seed unlike training's)."""
    return align.sample(task, n_sentences, np.random.default_rng(seed))


def model_accuracy(model, batch, chunk: int = 128) -> dict:
    """Greedy next-word accuracy on the target side (every target word and EOS, teacher forced) and the
    fraction of sentences translated entirely right."""
    correct = []
    for s in range(0, batch.tokens.shape[0], chunk):
        pred = np.asarray(model(batch.tokens[s : s + chunk])).argmax(-1)
        correct.append(pred == batch.targets[s : s + chunk])
    correct = np.concatenate(correct)
    rows = batch.loss_mask
    return {
        "token_accuracy": float(correct[rows].mean()),
        "sentence_accuracy": float((correct | ~rows).all(1).mean()),
    }


def evaluate_alignment(
    model,
    task: dict | None = None,
    *,
    n_sentences: int = 256,
    batch_size: int = 64,
    seed: int = 10_000,
    methods=METHODS,
    data=None,
) -> dict:
    """AER of every method per layer and aggregated (rows: predicting and own), plus the random and the
    gold-argmax references. Returns a JSON-safe report (see :func:`format_table`).

    ``methods``: rows of :data:`latim_jax.tasks.methods.METHODS`, method names ("l2", "logit", ...)
    or column names (:func:`latim_jax.tasks.methods.resolve`). ``data``: your own ``(Batch, Links)``
    (from :func:`latim_jax.tasks.align.sample`) instead of ``n_sentences`` drawn with ``seed``, so that
    several models or methods are compared on the same sentences."""
    task = registry.task_fields(task or model.task)
    if task["name"] != "align":
        raise ValueError(f"evaluate_alignment needs an align task, found {task['name']!r}")
    methods = resolve(methods)
    if data is None:
        batch, links = held_out(task, n_sentences, seed)
    else:
        batch, links = data
        if not isinstance(links, align.Links) or links.sure.shape[0] != batch.tokens.shape[0]:
            raise ValueError("data must be (Batch, Links) of one set of sentences (align.sample returns it)")
        n_sentences = batch.tokens.shape[0]
    n_layers = model.config.n_layers
    preds = {m[0]: {row: [[] for _ in range(n_layers + 1)] for row in align.ROWS} for m in methods}
    for start in range(0, n_sentences, batch_size):
        sl = slice(start, start + batch_size)
        part = align.Links(links.sure[sl], links.possible[sl], links.n_src[sl], links.n_tgt[sl])
        for m in methods:
            mask = np.arange(batch.tokens.shape[1])[None] < batch.lengths[sl, None]  # padding after EOS
            res = run(model, batch.tokens[sl], m, mask=mask, target=batch.targets[sl])
            scores = np.asarray(res.scores)
            maps = [scores[:, k] for k in range(n_layers)] + [layer_aggregate(res)]
            for row in align.ROWS:
                for k, mp in enumerate(maps):
                    preds[m[0]][row][k].append(align.extract(align.source_scores(mp, part, row), part))
    rows = {}
    for m in methods:
        out = {}
        for row in align.ROWS:
            aers = [_aer(p, links) for p in preds[m[0]][row]]
            out[row] = {"layers": aers[:n_layers], "aggregate": aers[n_layers]}
        best = int(np.argmin(out["predicting"]["layers"]))
        rows[m[0]] = {**out["predicting"], "best_layer": best, "own": out["own"]}
    rng = np.random.default_rng(seed)
    random_aer = np.mean(
        [_aer(align.extract(align.random_scores(links, rng), links), links) for _ in range(10)]
    )
    return {
        "task": task,
        "model": getattr(model, "source", ""),
        "version": model.config.version,
        "n_sentences": n_sentences,
        "seed": seed,
        "n_target_words": int(links.n_tgt.sum()),
        "n_sure": int(links.sure.sum()),
        "n_possible_only": int((links.possible & ~links.sure).sum()),
        **model_accuracy(model, batch),
        "rows": rows,
        "random": float(random_aer),
        "oracle": _aer(align.oracle(links), links),
        "definitions": __doc__.strip(),
    }


def _aer(parts, links):
    parts = parts if isinstance(parts, list) else [parts]
    return align.aer(np.concatenate(parts), links.sure, links.possible)


def _fmt(x):
    return "-" if x is None else f"{x:.3f}"


def format_table(report: dict) -> str:
    """Markdown: AER per layer, best layer, aggregate (predicting row), aggregate with the own row, and
    the paper's IWSLT17 range where it reports one."""
    n_layers = len(next(iter(report["rows"].values()))["layers"]) if report["rows"] else 0
    layer_cols = " | ".join(f"AER layer {k}" for k in range(n_layers))
    lines = [
        f"Task align ({report['n_sentences']} held-out sentences, seed {report['seed']}, "
        f"{report['n_target_words']} target words, {report['n_sure']} sure links, "
        f"{report['n_possible_only']} possible-only), Mamba-{report['version']} model {report['model']!r}: "
        f"target token accuracy {report['token_accuracy']:.3f}, sentence accuracy "
        f"{report['sentence_accuracy']:.3f}",
        "",
        f"| method | {layer_cols} | AER aggregate | AER best layer (own row) | AER aggregate (own row) "
        "| paper AER (IWSLT17 de-en) |",
        "|---" * (n_layers + 5) + "|",
    ]
    for name, r in report["rows"].items():
        own_best = min((x for x in r["own"]["layers"] if x is not None), default=None)
        paper = PAPER_AER.get(name.split(" (")[0], "-")
        cells = " | ".join(_fmt(x) for x in r["layers"])
        lines.append(
            f"| {name} | {cells} | {_fmt(r['aggregate'])} | {_fmt(own_best)} | {_fmt(r['own']['aggregate'])} "
            f"| {paper} |"
        )
    blank = " | ".join("-" for _ in range(n_layers))
    lines.append(f"| random | {blank} | {report['random']:.3f} | - | - | - |")
    lines.append(f"| gold argmax (best possible) | {blank} | {report['oracle']:.3f} | - | - | - |")
    lines += [
        "",
        "AER = 1 - (|A & S| + |A & P|) / (|A| + |S|) over all held-out sentences; A links each target word "
        "to the source word with the largest attribution in the row that predicts it (own row: the word's "
        "own position). Aggregate: rollout for alti/logit/hidden attention (minmax, abs), sum of "
        "row-normalised maps for l2/grad x input, plain sum for signed hidden attention.",
    ]
    return "\n".join(lines)
