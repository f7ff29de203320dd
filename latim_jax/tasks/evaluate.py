"""Attribution quality on tasks with known gold sources (the paper's copying evaluation, and MQAR).

For every scored row i of held-out sequences (latim_jax.tasks.registry: the position whose next-token
prediction retrieves an earlier token; gold source j = that token's earlier position), each method's
attribution row over candidates j' <= i is ranked against the gold position: AUC (per row, averaged),
pooled AUC, AP and recall@K (latim_jax.tasks.metrics states the definitions).

Per method the table reports every layer, the best single layer, and an aggregate over layers:
rollout for alti / hidden_attention (Ali et al.'s (A + I) normalisation; the minmax and abs
aggregations, which are non-negative) / logit (input attribution through the ALTI rollout); for l2,
l1 and grad_input the sum over layers of row-normalised maps; for the signed hidden attention (which
has negative entries, so no rollout) the plain sum over layers.
"""

from __future__ import annotations

import math

import numpy as np

from latim_jax.io.progress import progress
from latim_jax.latim.attribution import attribute, conservation_error
from latim_jax.tasks import metrics, registry
from latim_jax.tasks.methods import METHODS, aggregate, method_entry
from latim_jax.tasks.synthetic import value_sources

# docs/method.md section 11: the paper's AUC on the copying task
PAPER_AUC = {
    (2, "LaTIM l2"): 0.98,
    (1, "LaTIM alti"): 0.86,
    (1, "hidden attention"): 0.84,
    (2, "hidden attention"): 0.79,
    (1, "MambaLRP"): 0.40,
    (2, "MambaLRP"): 0.40,
}


def held_out(task: dict, n_sequences: int, seed: int):
    """Held-out sequences of ``task`` (a seed disjoint from training's by convention: pass a new one)."""
    return registry.make_batch(task, n_sequences, np.random.default_rng(seed))


def task_accuracy(model, batch) -> float:
    """Exact-match accuracy of the model's greedy prediction on the scored rows (the copied tokens for
    copy, the answers for MQAR)."""
    pred = np.asarray(model(batch.tokens)).argmax(-1)
    rows = batch.loss_mask
    return float((pred[rows] == batch.targets[rows]).mean())


def evaluate(
    model,
    task: dict | None = None,
    *,
    n_sequences: int = 64,
    batch_size: int = 16,
    seed: int = 10_000,
    methods=METHODS,
    ks=(1, 5),
    gold: str = "key",
) -> dict:
    """Metrics of every method (per layer, best layer, aggregate) plus a random baseline.

    ``methods``: entries (column name, method, mode) or (column name, method, mode, options), the
    options a dict of keyword arguments for :func:`latim_jax.attribute` (e.g. ``{"aggregation":
    "abs"}``); the default is :data:`METHODS`.

    ``gold`` (MQAR only): "key" ranks the queried key's earlier position (the task's gold), "value"
    the position of the answer token itself (key + 1, :func:`latim_jax.tasks.synthetic.value_sources`).
    Copy has one gold (the original position of the copied token) and accepts only the default.

    Returns a JSON-safe dict: {"task", "model", "version", "activation", "n_sequences", "seed",
    "accuracy", "rows": {column: {...}}, "approximation_error", "definitions"}. "approximation_error" is
    the paper mode's relative error E per layer, averaged over every real (non-padding) token of the
    held-out sequences (None when no paper-mode method ran). Batches are padded on the right and
    attributed with their padding mask, so each sequence's maps equal the sequence alone.
    """
    task = task or model.task
    if not task or task.get("name") not in registry.TASK_FIELDS:
        raise ValueError(f"evaluate needs a copy or mqar task: the model has {task!r} (pass task=...)")
    task = registry.task_fields(task)
    if n_sequences < 1 or batch_size < 1:
        raise ValueError(f"n_sequences and batch_size must be >= 1, found {n_sequences}, {batch_size}")
    if gold not in ("key", "value") or (gold == "value" and task["name"] != "mqar"):
        raise ValueError(f"gold must be 'key' (or 'value' for mqar), found {gold!r} for {task['name']}")
    batch = held_out(task, n_sequences, seed)
    gold_pos = value_sources(batch.gold) if gold == "value" else batch.gold
    n_layers = model.config.n_layers
    methods = [method_entry(m) for m in methods]
    maps = {name: {"layers": [[] for _ in range(n_layers)], "aggregate": []} for name, *_ in methods}
    approx = []  # per batch: (n_layers,) paper-mode E summed over the batch's real tokens
    real = np.arange(batch.tokens.shape[1])[None, :] < batch.lengths[:, None]  # right padding
    for start in progress(range(0, n_sequences, batch_size), desc=f"evaluate {task['name']}", unit="batch"):
        toks = batch.tokens[start : start + batch_size]
        targets = batch.targets[start : start + batch_size]
        mask = real[start : start + batch_size]
        batch_approx = None
        for name, method, mode, options in methods:
            res = attribute(
                model, toks, method=method, mode=mode or "exact", target=targets, mask=mask, **options
            )
            s = np.asarray(res.scores)
            for layer in range(n_layers):
                maps[name]["layers"][layer].append(s[:, layer])
            maps[name]["aggregate"].append(aggregate(res))
            if "approximation_error" in res.extra:  # the same for every paper-mode method
                per_prompt = np.asarray(res.extra["approximation_error"])  # (b, n_layers), real tokens
                batch_approx = (per_prompt * mask.sum(1)[:, None]).sum(0)
        if batch_approx is not None:
            approx.append(batch_approx)
    rows = {}
    for name, *_ in methods:
        per_layer = [_score(np.concatenate(m), gold_pos, ks) for m in maps[name]["layers"]]
        best = max(range(n_layers), key=lambda k: _nan_to(per_layer[k]["auc"], -1.0))
        rows[name] = {
            "layers": per_layer,
            "best_layer": best,
            "best": per_layer[best],
            "aggregate": _score(np.concatenate(maps[name]["aggregate"]), gold_pos, ks),
        }
    labels, valid = metrics.gold_labels(gold_pos)
    rows["random"] = {"aggregate": metrics.random_baseline(labels, valid, ks, seed=seed)}
    return {
        "task": task,
        "model": getattr(model, "source", ""),
        "version": model.config.version,
        "activation": model.config.activation,
        "n_sequences": n_sequences,
        "seed": seed,
        "gold": gold if task["name"] == "mqar" else "copy source",
        "accuracy": task_accuracy(model, batch),
        "rows": rows,
        "approximation_error": (np.sum(approx, 0) / real.sum()).tolist() if approx else None,
        "definitions": __doc__.strip(),
    }


def _score(maps, gold, ks):
    scores, labels, valid = metrics.gold_rows(maps, gold)
    return metrics.summarize(scores, labels, valid, ks)


def _nan_to(x, value):
    return value if x is None or (isinstance(x, float) and math.isnan(x)) else x


def format_table(report: dict) -> str:
    """A markdown table of the report, with the paper's AUC beside each row where it reports one."""
    v = report["version"]
    lines = [
        f"Task {report['task']['name']} ({report['n_sequences']} held-out sequences, seed {report['seed']}), "
        f"Mamba-{v} model {report['model']!r} ({report.get('activation', 'silu')}): {report['task']['name']} "
        f"accuracy {report['accuracy']:.3f}"
        + (f"; gold source: the {report['gold']} position" if report["task"]["name"] == "mqar" else ""),
        "",
        "| method | AUC best layer (layer) | AUC aggregate | AP aggregate | R@1 aggregate | R@5 aggregate "
        "| AUC pooled (agg.) | paper AUC |",
        "|---|---|---|---|---|---|---|---|",
    ]
    nan = float("nan")
    for name, row in report["rows"].items():
        agg = row["aggregate"]
        best = f"{row['best']['auc']:.3f} ({row['best_layer']})" if "best" in row else "-"
        paper = PAPER_AUC.get((v, name.split(" (")[0])) if report["task"]["name"] == "copy" else None
        lines.append(
            f"| {name} | {best} | {agg['auc']:.3f} | {agg['ap']:.3f} | {agg.get('recall@1', nan):.3f} "
            f"| {agg.get('recall@5', nan):.3f} | {agg['auc_pooled']:.3f} | "
            f"{'-' if paper is None else f'{paper:.2f}'} |"
        )
    lines += [
        "",
        "AUC: per-row Mann-Whitney AUC of the gold source among candidates j <= i, averaged over rows; "
        "pooled AUC: over all rows' candidates together. Aggregate: rollout for alti/logit/hidden attention "
        "(minmax, abs), sum of row-normalised maps for l2/grad x input, plain sum for signed hidden "
        "attention (docs/method.md section 10). "
        "Paper AUC: docs/method.md section 11 (copy only).",
    ]
    if report.get("approximation_error"):
        errs = ", ".join(f"{e:.3f}" for e in report["approximation_error"])
        lines.append(f"Paper-mode approximation error E per layer (docs/method.md section 4): {errs}.")
    return "\n".join(lines)


LATIM_METHODS = tuple(m for m in METHODS if m[2] is not None)


def compare_models(
    models: dict,
    task: dict | None = None,
    *,
    n_sequences: int = 64,
    batch_size: int = 16,
    seed: int = 10_000,
    conservation_sequences: int = 16,
    methods=LATIM_METHODS,
) -> dict:
    """Models trained on one task side by side, on the same held-out sequences, LaTIM methods in both
    modes: e.g. the SiLU model beside its ReLU / identity retrainings (the paper's exact-by-retraining
    route, against exact mode without retraining) or mimetic vs default initialisation. ``models``
    maps a label to a model; ``task`` defaults to the first model's task.

    Per model: the :func:`evaluate` report (accuracy, per-method AUCs, paper-mode approximation error E
    per layer) plus "conservation": the exact mode's worst relative reconstruction error over layers
    (:func:`latim_jax.latim.attribution.conservation_error` on the first ``conservation_sequences``).
    """
    if not models:
        raise ValueError("compare_models needs at least one model")
    task = task or next(iter(models.values())).task  # one task for all: the same held-out sequences
    out = {}
    for label, model in progress(models.items(), total=len(models), desc="models", unit="model"):
        report = evaluate(
            model, task, n_sequences=n_sequences, batch_size=batch_size, seed=seed, methods=methods
        )
        toks = held_out(report["task"], n_sequences, seed).tokens[:conservation_sequences]
        report["conservation"] = max(
            conservation_error(model, toks, layer, "exact") for layer in range(model.config.n_layers)
        )
        report["init"] = (getattr(model, "task", None) or {}).get("training", {}).get("init", "-")
        out[label] = report
    return out


def format_comparison_table(reports: dict) -> str:
    """Markdown table of :func:`compare_models`: one row per model (activation, training init), its
    accuracy, best-layer AUC per method and mode, exact-mode conservation and paper-mode error E."""
    first = next(iter(reports.values()))
    methods = [name for name in first["rows"] if name.endswith("(exact)")]
    head = " | ".join(f"{m.split(' (')[0]} AUC exact / paper" for m in methods)
    lines = [
        f"| model | activation | init | accuracy | exact conservation | paper E per layer | {head} |",
        "|---" * (6 + len(methods)) + "|",
    ]
    for label, r in reports.items():
        cells = []
        for m in methods:
            paper = m.replace("(exact)", "(paper)")
            cells.append(f"{_best(r, m)} / {_best(r, paper) if paper in r['rows'] else '-'}")
        errs = ", ".join(f"{e:.3f}" for e in r["approximation_error"] or [])
        lines.append(
            f"| {label} | {r['activation']} | {r['init']} | {r['accuracy']:.3f} | "
            f"{r['conservation']:.1e} | {errs} | " + " | ".join(cells) + " |"
        )
    lines += [
        "",
        f"Task {first['task']['name']}, {first['n_sequences']} held-out sequences (seed {first['seed']}). "
        "AUC: per-row AUC of the gold source at the best single layer (layer in brackets). Exact "
        "conservation: max over layers of max_i ||sum_j T_i(x_j) + beta_i - o_i|| / max_i ||o_i||. Paper E: "
        "mean_i ||o_i - b_out - sum_j T_i(x_j)|| / ||o_i|| (docs/method.md section 4).",
    ]
    return "\n".join(lines)


def _best(report, column):
    row = report["rows"][column]
    return f"{row['best']['auc']:.3f} ({row['best_layer']})"
