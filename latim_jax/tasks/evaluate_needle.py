"""Needle retrieval at long lengths: the model's retrieval accuracy and every method's attribution of
the query rows, ranked against the needle's value position (and its key position).

Per length and setting (one needle and one query; several needles and queries), held-out sequences of
:mod:`latim_jax.tasks.needle` are attributed on the query rows only (``attribute(..., rows=query_rows)``:
O(l) memory per row, which is what lets 8192 run on a CPU). Metrics (latim_jax.tasks.metrics): per-row AUC of
the gold position among the candidates j <= i and recall@1, averaged over rows, at every layer and for
the aggregate over layers (the sum of row-normalised |maps|: rollout would need every row).
"""

from __future__ import annotations

import numpy as np

from latim_jax.kernels.block_sizes import Blocks
from latim_jax.tasks import metrics, needle, registry
from latim_jax.tasks.methods import METHODS, layer_aggregate, resolve, run

LENGTHS = (512, 2048, 8192)
SETTINGS = {"single": (1, 1), "multi": (4, 2)}  # name -> (needles, queries)
GOLDS = ("value", "key")


def setting_task(task: dict, length: int, needles: int, queries: int) -> dict:
    """``task`` at another length with a fixed number of needles and queries."""
    new = {**registry.task_fields(task), "length": length, "min_needles": needles, "max_needles": needles}
    return needle.check_task({**new, "num_queries": queries})


def held_out(task: dict, length: int, needles: int, queries: int, n_sequences: int, seed: int):
    """(the setting's task, its held-out batch, its query rows): the sequences every evaluation of a
    setting draws (the same for the same seed, length and needle count)."""
    t = setting_task(task, length, needles, queries)
    batch = needle.make_batch(t, n_sequences, np.random.default_rng([seed, length, needles]))
    return t, batch, needle.query_rows(t)


def retrieval_accuracy(model, batch, rows, chunk: int = 8) -> float:
    """Fraction of query rows whose greedy prediction is the needle's value."""
    ok = []
    for s in range(0, batch.tokens.shape[0], chunk):
        logits = np.asarray(model(batch.tokens[s : s + chunk]))[:, rows]
        ok.append(logits.argmax(-1) == batch.targets[s : s + chunk][:, rows])
    return float(np.concatenate(ok).mean())


def _gold(batch, rows, which):
    key = batch.gold[:, rows]  # (b, r) the needle's key position
    return key + 1 if which == "value" else key


def _score(maps, gold, rows):
    """metrics.summarize of (b, r, l) maps against gold (b, r) positions, candidates j <= row."""
    b, r, L = maps.shape
    labels = np.arange(L)[None, None] == gold[..., None]
    valid = np.broadcast_to(np.arange(L)[None, None] <= np.asarray(rows)[None, :, None], maps.shape)
    return metrics.summarize(
        maps.reshape(b * r, L), labels.reshape(b * r, L), valid.reshape(b * r, L), ks=(1,)
    )


def evaluate_needle(
    model,
    task: dict | None = None,
    *,
    lengths=LENGTHS,
    settings=None,
    n_sequences: int = 32,
    batch_size: int = 8,
    seed: int = 10_000,
    methods=METHODS,
) -> dict:
    """Retrieval accuracy and attribution AUC / R@1 (value and key gold) of every method, per layer and
    aggregated, for each length and setting. JSON-safe report (see :func:`format_table`).

    ``methods``: rows of :data:`latim_jax.tasks.methods.METHODS`, method names ("l2", "logit", ...)
    or column names (:func:`latim_jax.tasks.methods.resolve`)."""
    task = registry.task_fields(task or model.task)
    if task["name"] != "needle":
        raise ValueError(f"evaluate_needle needs a needle task, found {task['name']!r}")
    methods = resolve(methods)
    settings = SETTINGS if settings is None else settings
    n_layers = model.config.n_layers
    results = []
    for length in lengths:
        for sname, (needles, queries) in settings.items():
            _, batch, rows = held_out(task, length, needles, queries, n_sequences, seed)
            entry = {
                "length": length,
                "setting": sname,
                "needles": needles,
                "queries": queries,
                "accuracy": retrieval_accuracy(model, batch, rows),
                "rows": {},
            }
            cols = 64 if model.config.version == 1 else 512
            for m in methods:
                per_layer, agg = [[] for _ in range(n_layers)], []
                for s in range(0, n_sequences, batch_size):
                    sl = slice(s, s + batch_size)
                    res = run(
                        model, batch.tokens[sl], m, rows=rows, target=batch.targets[sl],
                        blocks=Blocks(rows=len(rows), cols=cols),
                    )  # fmt: skip
                    sc = np.asarray(res.scores)
                    for k in range(n_layers):
                        per_layer[k].append(sc[:, k])
                    agg.append(layer_aggregate(res))
                out = {}
                for which in GOLDS:
                    gold = _gold(batch, rows, which)
                    layers = [_score(np.concatenate(p), gold, rows) for p in per_layer]
                    best = int(np.nanargmax([x["auc"] for x in layers]))
                    out[which] = {
                        "layers": layers,
                        "best_layer": best,
                        "best": layers[best],
                        "aggregate": _score(np.concatenate(agg), gold, rows),
                    }
                entry["rows"][m[0]] = out
            gold = _gold(batch, rows, "value")
            labels = np.arange(length)[None, None] == gold[..., None]
            valid = np.broadcast_to(
                np.arange(length)[None, None] <= np.asarray(rows)[None, :, None], labels.shape
            )
            flat = labels.reshape(-1, length), valid.reshape(-1, length)
            entry["random"] = metrics.random_baseline(*flat, ks=(1,), seed=seed)
            results.append(entry)
    return {
        "task": task,
        "model": getattr(model, "source", ""),
        "version": model.config.version,
        "n_sequences": n_sequences,
        "seed": seed,
        "results": results,
        "definitions": __doc__.strip(),
    }


def format_table(report: dict) -> str:
    """Markdown: per setting, accuracy per length, then per method and length the best layer's AUC and
    R@1 and the aggregate AUC (value gold), then the key gold's best-layer AUC."""
    lines = [
        f"Task needle ({report['n_sequences']} held-out sequences per cell, seed {report['seed']}), "
        f"Mamba-{report['version']} model {report['model']!r}, trained at length {report['task']['length']}",
    ]
    by = {}
    for e in report["results"]:
        by.setdefault(e["setting"], []).append(e)
    for sname, entries in by.items():
        lens = [e["length"] for e in entries]
        e0 = entries[0]
        lines += [
            "",
            f"Setting {sname} ({e0['needles']} needle(s), {e0['queries']} query/queries): retrieval accuracy "
            + ", ".join(f"{e['accuracy']:.3f} at {e['length']}" for e in entries),
            "",
            "| method | "
            + " | ".join(f"{L}: AUC best layer (layer) | {L}: R@1 best layer | {L}: AUC agg." for L in lens)
            + " | key gold: AUC best layer per length |",
            "|---" * (3 * len(lens) + 2) + "|",
        ]
        for name in e0["rows"]:
            cells = []
            for e in entries:
                v = e["rows"][name]["value"]
                cells += [
                    f"{v['best']['auc']:.3f} ({v['best_layer']})",
                    f"{v['best']['recall@1']:.3f}",
                    f"{v['aggregate']['auc']:.3f}",
                ]
            key = ", ".join(f"{e['rows'][name]['key']['best']['auc']:.3f}" for e in entries)
            lines.append(f"| {name} | " + " | ".join(cells) + f" | {key} |")
        cells = []
        for e in entries:
            cells += ["-", f"{e['random']['recall@1']:.3f}", f"{e['random']['auc']:.3f}"]
        lines.append("| random | " + " | ".join(cells) + " | - |")
    lines += [
        "",
        "Gold: the needle's value position (the key position in the last column). AUC: per-row AUC of the "
        "gold among candidates j <= i (the query row), averaged over rows; R@1: the gold ranked first. "
        "Best layer by AUC. Aggregate: sum over layers of row-normalised |maps| (rollout needs every row; "
        "signed hidden attention: the plain sum).",
    ]
    return "\n".join(lines)
