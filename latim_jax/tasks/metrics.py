"""Ranking metrics for attribution rows against gold source positions (numpy only, vectorised).

Inputs, shared by every function: ``scores`` (r, l) float, one attribution row per scored target;
``labels`` (r, l) bool, True on the row's gold source position(s); ``valid`` (r, l) bool, the row's
candidates (default: all; for a causal map row i of target position i the candidates are j <= i, see
:func:`gold_rows`). Entries outside ``valid`` are ignored entirely.

Ties are resolved in expectation over a uniformly random tie-break, which makes every metric a
deterministic function of the scores:

- AUC (per row) = P(s_pos > s_neg) + 0.5 P(s_pos = s_neg) over all (positive, negative) candidate
  pairs of the row: the Mann-Whitney statistic with average ranks. Perfect ranking 1, reversed 0,
  all scores tied 0.5. Undefined (NaN) for rows without a positive or without a negative (a row with a
  single candidate, e.g. target position 0).
- pooled AUC: the same statistic over the union of all rows' candidates (scores compared across rows,
  so it also rewards rows being on a common scale).
- AP (per row) = mean over the row's positives p of precision(s_p) = #{pos: s >= s_p} / #{all: s >= s_p}
  (each tie group is one threshold, as in scikit-learn's average_precision_score). NaN without a positive.
- recall@K (per row) = expected fraction of the row's positives among the K highest-scored candidates;
  a positive whose tie group straddles the cut counts the fraction of that group inside the top K.
  NaN without a positive. A row with a single candidate has AP = recall@K = 1 when it is the positive.

The row means skip NaN rows (:func:`summarize` reports how many rows were scored).
"""

from __future__ import annotations

import numpy as np


def gold_rows(attributions: np.ndarray, gold: np.ndarray):
    """Rows of causal attribution maps at the positions that have a gold source.

    attributions (b, l, l): map[b, i, j] = score of source j for target row i (j <= i meaningful);
    gold (b, l) int, -1 where a row is not scored (see latim_jax.tasks). Returns
    (scores (r, l), labels (r, l) bool, valid (r, l) bool) with valid = j <= i.
    """
    attributions, gold = np.asarray(attributions, float), np.asarray(gold)
    bi, ii = np.nonzero(gold >= 0)
    labels, valid = gold_labels(gold)
    return attributions[bi, ii], labels, valid


def gold_labels(gold: np.ndarray):
    """The (labels, valid) half of :func:`gold_rows` without maps: (r, l) bool each, rows in the
    order of ``np.nonzero(gold >= 0)``."""
    gold = np.asarray(gold)
    bi, ii = np.nonzero(gold >= 0)
    L = gold.shape[-1]
    labels = np.arange(L)[None, :] == gold[bi, ii][:, None]
    valid = np.arange(L)[None, :] <= ii[:, None]
    return labels, valid


def _tie_stats(scores, labels, valid, rows):
    """Per valid entry: counts within its row of candidates (all, positive) scored below it and tied with
    it (itself included). Returns (rows, labels, below_all, below_pos, tied_all, tied_pos) of the valid
    entries, flattened."""
    s, y, r = scores[valid], labels[valid], rows[valid]
    order = np.lexsort((s, r))  # by row, then score ascending
    s, y, r = s[order], y[order].astype(np.int64), r[order]
    n = s.size
    new_group = np.ones(n, bool)
    new_group[1:] = (s[1:] != s[:-1]) | (r[1:] != r[:-1])
    new_row = np.ones(n, bool)
    new_row[1:] = r[1:] != r[:-1]
    group_id = np.cumsum(new_group) - 1
    group_start = np.flatnonzero(new_group)
    row_start = np.flatnonzero(new_row)[np.cumsum(new_row) - 1]  # index where each entry's row starts
    cum_pos = np.concatenate([[0], np.cumsum(y)[:-1]])
    start = group_start[group_id]
    below_all = start - row_start
    below_pos = cum_pos[start] - cum_pos[row_start]
    tied_all = np.bincount(group_id, minlength=group_id[-1] + 1)[group_id] if n else group_id
    tied_pos = np.bincount(group_id, weights=y, minlength=group_id[-1] + 1)[group_id] if n else group_id
    return r, y.astype(bool), below_all, below_pos, tied_all, tied_pos


def _prepare(scores, labels, valid):
    scores = np.asarray(scores, float)
    if scores.ndim == 1:
        scores = scores[None]
    labels = np.broadcast_to(np.asarray(labels, bool).reshape(scores.shape[0], -1), scores.shape)
    valid = (
        np.ones(scores.shape, bool)
        if valid is None
        else np.broadcast_to(np.asarray(valid, bool), scores.shape)
    )
    if np.isnan(scores[valid]).any():
        raise ValueError("scores hold NaN on valid candidates")
    return scores, labels, valid


def _row_counts(labels, valid):
    n_pos = (labels & valid).sum(axis=1)
    return n_pos, valid.sum(axis=1) - n_pos


def _per_row(values, rows, n_rows):
    return np.bincount(rows, weights=values, minlength=n_rows)


def auc_per_row(scores, labels, valid=None) -> np.ndarray:
    """AUC of each row (r,), NaN where the row lacks a positive or a negative (see module docstring)."""
    scores, labels, valid = _prepare(scores, labels, valid)
    R = scores.shape[0]
    rows = np.broadcast_to(np.arange(R)[:, None], scores.shape)
    r, y, below_all, below_pos, tied_all, tied_pos = _tie_stats(scores, labels, valid, rows)
    below_neg, tied_neg = below_all - below_pos, tied_all - tied_pos
    wins = np.where(y, below_neg + 0.5 * tied_neg, 0.0)  # per positive: negatives beaten
    n_pos, n_neg = _row_counts(labels, valid)
    with np.errstate(invalid="ignore", divide="ignore"):
        out = _per_row(wins, r, R) / (n_pos * n_neg)
    return np.where((n_pos > 0) & (n_neg > 0), out, np.nan)


def auc_pooled(scores, labels, valid=None) -> float:
    """AUC over the union of all rows' valid candidates (NaN without both classes)."""
    scores, labels, valid = _prepare(scores, labels, valid)
    m = valid.ravel()
    return float(auc_per_row(scores.ravel()[m][None], labels.ravel()[m][None])[0])


def average_precision_per_row(scores, labels, valid=None) -> np.ndarray:
    """Average precision of each row (r,), NaN where the row has no positive."""
    scores, labels, valid = _prepare(scores, labels, valid)
    R = scores.shape[0]
    rows = np.broadcast_to(np.arange(R)[:, None], scores.shape)
    r, y, below_all, below_pos, tied_all, tied_pos = _tie_stats(scores, labels, valid, rows)
    n_pos, _ = _row_counts(labels, valid)
    n_all = valid.sum(axis=1)
    at_or_above_pos = n_pos[r] - below_pos
    at_or_above_all = n_all[r] - below_all
    precision = np.where(y, at_or_above_pos / np.maximum(at_or_above_all, 1), 0.0)
    with np.errstate(invalid="ignore", divide="ignore"):
        out = _per_row(precision, r, R) / n_pos
    return np.where(n_pos > 0, out, np.nan)


def recall_at_k_per_row(scores, labels, k: int, valid=None) -> np.ndarray:
    """Expected recall@k of each row (r,), NaN where the row has no positive."""
    if k < 1:
        raise ValueError(f"recall@k needs k >= 1, found {k}")
    scores, labels, valid = _prepare(scores, labels, valid)
    R = scores.shape[0]
    rows = np.broadcast_to(np.arange(R)[:, None], scores.shape)
    r, y, below_all, _, tied_all, _ = _tie_stats(scores, labels, valid, rows)
    n_all = valid.sum(axis=1)
    above = n_all[r] - below_all - tied_all  # strictly higher scores
    p_in_top = np.clip((k - above) / tied_all, 0.0, 1.0)
    n_pos, _ = _row_counts(labels, valid)
    with np.errstate(invalid="ignore", divide="ignore"):
        out = _per_row(np.where(y, p_in_top, 0.0), r, R) / n_pos
    return np.where(n_pos > 0, out, np.nan)


def summarize(scores, labels, valid=None, ks=(1, 5)) -> dict[str, float]:
    """Row means (NaN rows skipped) of AUC, AP and recall@k for each k, plus the pooled AUC and the
    numbers of rows with a defined AUC / with a positive."""
    scores, labels, valid = _prepare(scores, labels, valid)
    auc = auc_per_row(scores, labels, valid)
    ap = average_precision_per_row(scores, labels, valid)
    out = {"auc": _nanmean(auc), "auc_pooled": auc_pooled(scores, labels, valid), "ap": _nanmean(ap)}
    for k in ks:
        out[f"recall@{k}"] = _nanmean(recall_at_k_per_row(scores, labels, k, valid))
    out["n_rows_auc"] = int(np.isfinite(auc).sum())
    out["n_rows"] = int(np.isfinite(ap).sum())
    return out


def random_baseline(labels, valid=None, ks=(1, 5), *, seed: int = 0, n_draws: int = 10) -> dict[str, float]:
    """:func:`summarize` for i.i.d. uniform scores on the same rows, averaged over ``n_draws`` draws
    (expected AUC 0.5, recall@k = mean over rows of min(k, n_candidates) / n_candidates for one gold)."""
    labels = np.asarray(labels, bool)
    if labels.ndim == 1:
        labels = labels[None]
    rng = np.random.default_rng(seed)
    draws = [summarize(rng.random(labels.shape), labels, valid, ks) for _ in range(n_draws)]
    out = {key: float(np.mean([d[key] for d in draws])) for key in draws[0]}
    out["n_rows_auc"], out["n_rows"] = draws[0]["n_rows_auc"], draws[0]["n_rows"]
    return out


def _nanmean(x) -> float:
    x = np.asarray(x, float)
    finite = np.isfinite(x)
    return float(x[finite].mean()) if finite.any() else float("nan")
