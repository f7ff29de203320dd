"""The needle task: gold key/value positions, query rows, layout; the evaluation on a tiny model."""

from __future__ import annotations

import numpy as np
import pytest

from latim_jax import tasks
from latim_jax.tasks import needle


def test_query_rows_and_gold_positions():
    task = needle.needle_task(length=40, n_distract=8, n_keys=6, n_values=5, min_needles=2, max_needles=4)
    assert needle.query_rows(task) == [36, 38]  # l - 2Q + 2m
    batch = tasks.make_batch(task, 200, np.random.default_rng(0))
    key0, value0 = 1 + 8, 1 + 8 + 6
    for tok, gold, mask in zip(batch.tokens, batch.gold, batch.loss_mask, strict=True):
        np.testing.assert_array_equal(np.flatnonzero(mask), [36, 38])
        hay = tok[:36]
        starts = np.flatnonzero((hay >= key0) & (hay < value0))  # needle keys in the haystack
        assert 2 <= starts.size <= 4 and len(set(hay[starts])) == starts.size  # distinct keys
        assert np.all((hay[starts + 1] >= value0) & (hay[starts + 1] < task["vocab_size"]))  # value follows
        other = np.setdiff1d(np.arange(36), np.concatenate([starts, starts + 1]))
        assert np.all((hay[other] >= 1) & (hay[other] < key0))  # the rest is distractors
        for row in (36, 38):
            j = gold[row]
            assert j in starts and tok[j] == tok[row] and tok[j + 1] == tok[row + 1]  # key, value
        assert tok[36] != tok[38]  # distinct needles queried when there are enough
    assert np.all(batch.targets[:, :-1] == batch.tokens[:, 1:])
    value_gold = tasks.value_sources(batch.gold)
    rows = batch.gold >= 0
    np.testing.assert_array_equal(np.take_along_axis(batch.tokens, np.maximum(value_gold, 0), 1)[rows],
                                  batch.targets[rows])  # fmt: skip


def test_single_needle_with_more_queries_repeats_it():
    task = needle.needle_task(length=20, n_distract=4, n_keys=3, n_values=3, min_needles=1, max_needles=1)
    batch = tasks.make_batch(task, 16, np.random.default_rng(1))
    g = batch.gold[:, needle.query_rows(task)]
    np.testing.assert_array_equal(g[:, 0], g[:, 1])


def test_needle_task_validation_and_vocabulary():
    task = needle.needle_task()
    assert tasks.sequence_length(task) == 256 and tasks.task_fields({**task, "x": 1}) == task
    vocab = needle.vocabulary(task)
    assert len(vocab) == task["vocab_size"] and vocab[1] == "w0" and vocab[33] == "K0" and vocab[49] == "V0"
    with pytest.raises(ValueError, match="vocab_size"):
        tasks.check_task({**task, "vocab_size": 3})
    with pytest.raises(ValueError, match="no haystack"):
        needle.needle_task(length=8, max_needles=4)
    with pytest.raises(ValueError, match="max_needles <= n_keys"):
        needle.needle_task(n_keys=2, max_needles=3)
