"""Attribution quality on tasks with known gold sources (the paper's copying evaluation, and MQAR).

For every scored row i of held-out sequences (latim_jax.tasks: the position whose next-token
prediction retrieves an earlier token; gold source j = that token's earlier position), each method's
attribution row over candidates j' <= i is ranked against the gold position: AUC (per row, averaged),
pooled AUC, AP and recall@K (latim_jax.metrics states the definitions).

Per method the table reports every layer, the best single layer, and an aggregate over layers:
rollout for alti / hidden_attention (Ali et al.'s (A + I) normalisation) / logit (input attribution
through the ALTI rollout); for l2, l1 and grad_input the sum over layers of row-normalised maps.
"""

from __future__ import annotations

import json
import math

import numpy as np

from latim_jax import metrics, tasks

# (column name, method, mode): mode None for baselines that have no decomposition mode
METHODS = (
    ("LaTIM l2 (exact)", "l2", "exact"),
    ("LaTIM l2 (paper)", "l2", "paper"),
    ("LaTIM alti (exact)", "alti", "exact"),
    ("LaTIM alti (paper)", "alti", "paper"),
    ("LaTIM logit (exact)", "logit", "exact"),
    ("LaTIM logit (paper)", "logit", "paper"),
    ("hidden attention", "hidden_attention", None),
    ("grad x input", "grad_input", None),
)

# latim-math.md section 7: AUC on the copying task
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
    return tasks.make_batch(task, n_sequences, np.random.default_rng(seed))


def aggregate(result) -> np.ndarray:
    """(B, L, L) aggregate over layers of an Attribution (see the module docstring)."""
    if result.method in ("alti", "hidden_attention", "logit"):
        return np.asarray(result.rollout())
    s = np.abs(np.asarray(result.scores))
    total = s.sum(-1, keepdims=True)
    return (s / np.where(total > 0, total, 1.0)).sum(1)


def copy_accuracy(model, batch) -> float:
    """Exact-match accuracy of the model's greedy prediction on the scored rows."""
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
) -> dict:
    """Metrics of every method (per layer, best layer, aggregate) plus a random baseline.

    Returns a JSON-safe dict: {"task", "n_sequences", "accuracy", "rows": {column: {...}}, "definitions"}.
    """
    import latim_jax

    task = task or model.task
    if not task or task.get("name") not in _TASK_KEYS:
        raise ValueError(f"evaluate needs a copy or mqar task: the model has {task!r} (pass task=...)")
    task = tasks.check_task({k: v for k, v in task.items() if k in _TASK_KEYS[task["name"]]})
    batch = held_out(task, n_sequences, seed)
    n_layers = model.config.n_layers
    maps = {name: {"layers": [[] for _ in range(n_layers)], "aggregate": []} for name, _, _ in methods}
    for start in range(0, n_sequences, batch_size):
        toks = batch.tokens[start : start + batch_size]
        targets = batch.targets[start : start + batch_size]
        for name, method, mode in methods:
            res = latim_jax.attribute(model, toks, method=method, mode=mode or "exact", target=targets)
            s = np.asarray(res.scores)
            for layer in range(n_layers):
                maps[name]["layers"][layer].append(s[:, layer])
            maps[name]["aggregate"].append(aggregate(res))
    rows = {}
    for name, _, _ in methods:
        per_layer = [_score(np.concatenate(m), batch.gold, ks) for m in maps[name]["layers"]]
        best = max(range(n_layers), key=lambda k: _nan_to(per_layer[k]["auc"], -1.0))
        rows[name] = {
            "layers": per_layer,
            "best_layer": best,
            "best": per_layer[best],
            "aggregate": _score(np.concatenate(maps[name]["aggregate"]), batch.gold, ks),
        }
    _, labels, valid = metrics.gold_rows(np.zeros(batch.gold.shape + (batch.gold.shape[1],)), batch.gold)
    rows["random"] = {"aggregate": metrics.random_baseline(labels, valid, ks, seed=seed)}
    return {
        "task": task,
        "model": getattr(model, "source", ""),
        "version": model.config.version,
        "n_sequences": n_sequences,
        "seed": seed,
        "accuracy": copy_accuracy(model, batch),
        "rows": rows,
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
        f"Mamba-{v} model {report['model']!r}: copy accuracy {report['accuracy']:.3f}",
        "",
        "| method | AUC best layer (layer) | AUC aggregate | AP aggregate | R@1 aggregate | R@5 aggregate "
        "| AUC pooled (agg.) | paper AUC |",
        "|---|---|---|---|---|---|---|---|",
    ]
    nan = float("nan")
    for name, row in report["rows"].items():
        agg = row["aggregate"]
        best = f"{row['best']['auc']:.3f} ({row['best_layer']})" if "best" in row else "-"
        paper = PAPER_AUC.get((v, name.split(" (")[0]))
        lines.append(
            f"| {name} | {best} | {agg['auc']:.3f} | {agg['ap']:.3f} | {agg.get('recall@1', nan):.3f} "
            f"| {agg.get('recall@5', nan):.3f} | {agg['auc_pooled']:.3f} | "
            f"{'-' if paper is None else f'{paper:.2f}'} |"
        )
    lines += [
        "",
        "AUC: per-row Mann-Whitney AUC of the gold source among candidates j <= i, averaged over rows; "
        "pooled AUC: over all rows' candidates together. Aggregate: rollout for alti/hidden attention/logit, "
        "sum of row-normalised maps for l2/grad x input. Paper AUC: latim-math.md section 7.",
    ]
    return "\n".join(lines)


def add_evaluate_parser(sub) -> None:
    """Register ``latim-jax evaluate TASK`` on the CLI's subparsers."""
    p = sub.add_parser("evaluate", help="attribution quality on a task with known gold sources")
    p.add_argument("task", choices=("copy", "mqar"))
    p.add_argument("--model", default=None, help="default: the shipped copy model of --version")
    p.add_argument("--version", type=int, default=2, choices=(1, 2))
    p.add_argument("--n", type=int, default=64, help="held-out sequences")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=10_000)
    p.add_argument("--out", default=None, help="write the full report as JSON")
    p.add_argument("--markdown", default=None, help="write the table as markdown")
    p.set_defaults(func=_cmd_evaluate)


def _cmd_evaluate(args) -> None:
    import latim_jax
    from latim_jax.results import write_bytes_atomic

    model = latim_jax.load(args.model or f"copy-mamba{args.version}")
    task = model.task
    if not task or task.get("name") != args.task:
        raise SystemExit(
            f"error: model {model.source!r} was not trained on the {args.task} task (task: {task})"
        )
    report = evaluate(model, task, n_sequences=args.n, batch_size=args.batch_size, seed=args.seed)
    table = format_table(report)
    print(table)
    if args.out:
        write_bytes_atomic(args.out, json.dumps(report, indent=2).encode())
    if args.markdown:
        write_bytes_atomic(args.markdown, (table + "\n").encode())


_TASK_KEYS = {
    "copy": ("name", "vocab_size", "sep_id", "min_len", "max_len"),
    "mqar": ("name", "vocab_size", "n_keys", "min_pairs", "max_pairs", "num_queries"),
}
