"""Ranking metrics on hand-made rows with known answers, and the random baseline."""

import numpy as np
import pytest

from latim_jax.tasks import metrics

TOL = 1e-12


def test_perfect_reversed_and_tied_rows():
    labels = np.array([[False, True, False, False]] * 3)
    scores = np.array(
        [
            [0.1, 0.9, 0.2, 0.3],  # gold ranked first
            [0.5, 0.0, 0.2, 0.3],  # gold ranked last
            [1.0, 1.0, 1.0, 1.0],
        ]
    )  # all tied
    np.testing.assert_allclose(metrics.auc_per_row(scores, labels), [1.0, 0.0, 0.5], atol=TOL)
    np.testing.assert_allclose(metrics.average_precision_per_row(scores, labels), [1.0, 0.25, 0.25], atol=TOL)
    np.testing.assert_allclose(metrics.recall_at_k_per_row(scores, labels, 1), [1.0, 0.0, 0.25], atol=TOL)
    np.testing.assert_allclose(metrics.recall_at_k_per_row(scores, labels, 2), [1.0, 0.0, 0.5], atol=TOL)
    np.testing.assert_allclose(metrics.recall_at_k_per_row(scores, labels, 4), [1.0, 1.0, 1.0], atol=TOL)


def test_hand_computed_two_positive_row():
    # ranking: 0.8 (+), 0.4 (-), 0.35 (+), 0.1 (-)
    scores = np.array([[0.1, 0.4, 0.35, 0.8]])
    labels = np.array([[False, False, True, True]])
    assert metrics.auc_per_row(scores, labels)[0] == pytest.approx(3 / 4)  # pairs won: 3 of 4
    assert metrics.average_precision_per_row(scores, labels)[0] == pytest.approx((1 / 1 + 2 / 3) / 2)
    assert metrics.recall_at_k_per_row(scores, labels, 1)[0] == pytest.approx(1 / 2)
    assert metrics.recall_at_k_per_row(scores, labels, 3)[0] == pytest.approx(1.0)


def test_partial_tie_with_the_gold():
    # gold tied with one negative at the top, one negative below: AUC = (0.5 + 1) / 2
    scores = np.array([[0.7, 0.7, 0.1]])
    labels = np.array([[True, False, False]])
    assert metrics.auc_per_row(scores, labels)[0] == pytest.approx(0.75)
    assert metrics.average_precision_per_row(scores, labels)[0] == pytest.approx(0.5)
    assert metrics.recall_at_k_per_row(scores, labels, 1)[0] == pytest.approx(0.5)


def test_valid_mask_ignores_entries_and_single_candidate_rows():
    scores = np.array([[0.3, 9.0, 9.0], [0.2, 0.9, 5.0]])
    labels = np.array([[True, False, False], [False, True, False]])
    valid = np.array([[True, False, False], [True, True, False]])  # causal rows i = 0, 1
    auc = metrics.auc_per_row(scores, labels, valid)
    assert np.isnan(auc[0]) and auc[1] == 1.0  # a single candidate has no negative
    np.testing.assert_allclose(metrics.average_precision_per_row(scores, labels, valid), [1.0, 1.0])
    np.testing.assert_allclose(metrics.recall_at_k_per_row(scores, labels, 1, valid), [1.0, 1.0])
    summary = metrics.summarize(scores, labels, valid, ks=(1,))
    assert summary["n_rows_auc"] == 1 and summary["n_rows"] == 2 and summary["auc"] == 1.0


def test_rows_without_a_positive_are_nan():
    scores, labels = np.array([[0.1, 0.2]]), np.zeros((1, 2), bool)
    for value in (
        metrics.auc_per_row(scores, labels),
        metrics.average_precision_per_row(scores, labels),
        metrics.recall_at_k_per_row(scores, labels, 1),
    ):
        assert np.isnan(value[0])


def test_pooled_auc_compares_across_rows():
    scores = np.array([[0.9, 0.1], [0.5, 0.8]])
    labels = np.array([[True, False], [False, True]])
    np.testing.assert_allclose(metrics.auc_per_row(scores, labels), [1.0, 1.0])
    # pooled: positives {0.9, 0.8} vs negatives {0.1, 0.5}: all 4 pairs won
    assert metrics.auc_pooled(scores, labels) == 1.0
    assert metrics.auc_pooled(np.array([[0.9, 0.1], [0.95, 0.8]]), labels) == pytest.approx(
        2 / 4
    )  # 0.95 beats both


def test_metrics_match_a_pairwise_loop_on_random_rows_with_ties():
    rng = np.random.default_rng(0)
    scores = rng.integers(0, 4, size=(40, 9)).astype(float)  # many ties
    labels = rng.random((40, 9)) < 0.3
    valid = rng.random((40, 9)) < 0.8
    auc = metrics.auc_per_row(scores, labels, valid)
    ap = metrics.average_precision_per_row(scores, labels, valid)
    for r in range(40):
        s, y = scores[r][valid[r]], labels[r][valid[r]]
        pos, neg = s[y], s[~y]
        if len(pos) and len(neg):
            expected = np.mean([(p > q) + 0.5 * (p == q) for p in pos for q in neg])
            assert auc[r] == pytest.approx(expected)
        else:
            assert np.isnan(auc[r])
        if len(pos):
            expected_ap = np.mean([np.sum(pos >= p) / np.sum(s >= p) for p in pos])
            assert ap[r] == pytest.approx(expected_ap)


def test_gold_rows_extracts_causal_rows():
    attributions = np.arange(2 * 4 * 4, dtype=float).reshape(2, 4, 4)
    gold = np.array([[-1, -1, 0, 1], [-1, 0, -1, -1]])
    scores, labels, valid = metrics.gold_rows(attributions, gold)
    np.testing.assert_array_equal(scores, attributions[[0, 0, 1], [2, 3, 1]])
    np.testing.assert_array_equal(labels.argmax(1), [0, 1, 0])
    np.testing.assert_array_equal(valid.sum(1), [3, 4, 2])


def test_random_baseline_is_near_chance():
    L = 40
    valid = np.tril(np.ones((L, L), bool))[1:]  # causal rows 1..L-1
    labels = np.zeros_like(valid)
    labels[np.arange(L - 1), np.arange(L - 1) // 2] = True  # one gold per row, always a candidate
    base = metrics.random_baseline(labels, valid, ks=(1, 5), seed=0, n_draws=20)
    assert abs(base["auc"] - 0.5) < 0.02
    assert abs(base["auc_pooled"] - 0.5) < 0.02
    n = valid.sum(1)
    assert abs(base["recall@5"] - np.mean(np.minimum(5, n) / n)) < 0.03
