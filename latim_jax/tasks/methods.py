"""The attribution methods the task evaluations compare (:data:`METHODS`), how each is run, and how its
maps are aggregated over layers.

A method row is ``(name, method, mode, options)``: every LaTIM score in both modes, hidden attention
once per aggregation ("minmax", "abs", "signed"), gradient x input (mode None for the baselines).
Aggregate over layers: rollout for alti / hidden_attention (Ali et al.'s (A + I) normalisation; the
minmax and abs aggregations, which are non-negative) / logit (input attribution through the ALTI
rollout); for l2, l1 and grad_input the sum over layers of row-normalised maps; for the signed hidden
attention (which has negative entries, so no rollout) the plain sum over layers.
"""

from __future__ import annotations

import numpy as np

from latim_jax.latim.attribution import attribute

# (column name, method, mode, extra attribute() keywords): mode None for baselines without a mode
METHODS = (
    ("LaTIM l2 (exact)", "l2", "exact", {}),
    ("LaTIM l2 (paper)", "l2", "paper", {}),
    ("LaTIM alti (exact)", "alti", "exact", {}),
    ("LaTIM alti (paper)", "alti", "paper", {}),
    ("LaTIM logit (exact)", "logit", "exact", {}),
    ("LaTIM logit (paper)", "logit", "paper", {}),
    ("hidden attention (minmax)", "hidden_attention", None, {"aggregation": "minmax"}),
    ("hidden attention (abs)", "hidden_attention", None, {"aggregation": "abs"}),
    ("hidden attention (signed)", "hidden_attention", None, {"aggregation": "signed"}),
    ("grad x input", "grad_input", None, {}),
)


def aggregate(result) -> np.ndarray:
    """(B, L, L) aggregate over layers of an Attribution (see the module docstring)."""
    if result.method == "hidden_attention" and result.aggregation == "signed":
        return np.asarray(result.scores).sum(1)
    if result.method in ("alti", "hidden_attention", "logit"):
        return np.asarray(result.rollout())
    s = np.abs(np.asarray(result.scores))
    total = s.sum(-1, keepdims=True)
    return (s / np.where(total > 0, total, 1.0)).sum(1)


def method_entry(entry) -> tuple:
    """(column name, method, mode, options) from a 3- or 4-tuple (options default to none)."""
    if not isinstance(entry, (tuple, list)) or len(entry) not in (3, 4):
        raise ValueError(
            f"each methods entry must be (column name, method, mode[, options dict]), found {entry!r}"
        )
    name, method, mode, *rest = entry
    options = rest[0] if rest else {}
    if not isinstance(options, dict):
        raise ValueError(f"the options of methods entry {name!r} must be a dict, found {options!r}")
    return name, method, mode, options


def resolve(methods) -> tuple:
    """Method rows from what a caller passes: rows ``(name, method, mode[, options])``, an
    ``attribute`` method name (``"l2"``: every row of :data:`METHODS` with that method) or a column
    name (``"LaTIM l2 (exact)"``), mixed freely; errors name what is unknown."""
    if isinstance(methods, str):
        methods = [methods]
    out = []
    columns = {m[0]: m for m in METHODS}
    for entry in methods:
        if isinstance(entry, str):
            if entry in columns:
                out.append(columns[entry])
            elif any(m[1] == entry for m in METHODS):
                out.extend(m for m in METHODS if m[1] == entry)
            else:
                known = sorted({m[1] for m in METHODS})
                raise ValueError(f"unknown method {entry!r}; expected a method of {known} or a column name")
        else:
            out.append(method_entry(entry))
    if not out:
        raise ValueError("methods names no method")
    return tuple(out)


def select(names=None, methods=METHODS) -> tuple:
    """The rows whose ``attribute`` method is in ``names`` (None: all); errors name unknown methods."""
    if names is None:
        return tuple(methods)
    known = sorted({m[1] for m in methods})
    unknown = sorted(set(names) - set(known))
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}; expected some of {known}")
    return tuple(m for m in methods if m[1] in names)


def run(model, tokens, row, **kwargs):
    """``latim_jax.attribute`` for one method row (its options, e.g. ``aggregation``, passed on), at the
    tokens' own length (``bucket=False``: each evaluation uses one fixed length per call, so a bucket
    would only add padded work) and without progress bars (many calls)."""
    _, method, mode, options = row
    kwargs = {"bucket": False, "progress": False, **kwargs}
    return attribute(model, tokens, method, mode or "exact", **options, **kwargs)


def layer_aggregate(result) -> np.ndarray:
    """(B, R, L) aggregate over layers: :func:`aggregate` (rollout for alti, logit
    and the non-negative hidden attentions; the sum of row-normalised |maps| for l2, l1, grad x input;
    the plain sum for signed hidden attention) when every row was computed. With a subset of rows
    (long inputs: rollout needs every row) the sum of row-normalised |maps| for every method but signed
    hidden attention, which keeps its plain sum."""
    if result.rows is None:
        return np.asarray(aggregate(result))
    s = np.asarray(result.scores)
    if result.method == "hidden_attention" and result.aggregation == "signed":
        return s.sum(1)
    s = np.abs(s)
    total = s.sum(-1, keepdims=True)
    return (s / np.where(total > 0, total, 1.0)).sum(1)
