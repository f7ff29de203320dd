"""Running the rows of ``latim_jax.evaluate.METHODS`` for the alignment and needle evaluations.

A method row is ``(name, method, mode, options)``: every LaTIM score in both modes, hidden attention
once per aggregation ("minmax", "abs", "signed"), gradient x input (mode None for the baselines).
"""

from __future__ import annotations

import numpy as np

from latim_jax.evaluate import METHODS, aggregate


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
    import latim_jax

    _, method, mode, options = row
    kwargs = {"bucket": False, "progress": False, **kwargs}
    return latim_jax.attribute(model, tokens, method, mode or "exact", **options, **kwargs)


def layer_aggregate(result) -> np.ndarray:
    """(B, R, L) aggregate over layers: :func:`latim_jax.evaluate.aggregate` (rollout for alti, logit
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
