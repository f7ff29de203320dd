"""Synthetic tasks: gold sources on hand-made sequences, determinism, loss masks."""

import numpy as np
import pytest

from latim_jax import tasks


def test_copy_gold_sources_hand_made():
    # content [3 5 7] (m = 3), SEP = 0 at position 3, copy at 4..6, padding after
    tokens = np.array([[3, 5, 7, 0, 3, 5, 7, 0, 0], [2, 0, 2, 0, 0, 0, 0, 0, 0]])
    gold = tasks.copy_gold_sources(tokens, sep_id=0)
    np.testing.assert_array_equal(gold[0], [-1, -1, -1, 0, 1, 2, -1, -1, -1])
    np.testing.assert_array_equal(gold[1], [-1, 0, -1, -1, -1, -1, -1, -1, -1])


def test_mqar_gold_sources_hand_made():
    # pairs (4, 9) (6, 11) (5, 10), then queries 6 -> 11 and 4 -> 9; rows at the query keys 6 and 8
    tokens = np.array([[4, 9, 6, 11, 5, 10, 6, 11, 4, 9]])
    rows = np.zeros_like(tokens, bool)
    rows[0, [6, 8]] = True
    gold = tasks.mqar_gold_sources(tokens, rows)
    np.testing.assert_array_equal(gold[0], [-1, -1, -1, -1, -1, -1, 2, -1, 0, -1])


@pytest.mark.parametrize(
    "task",
    [
        tasks.copy_task(vocab_size=9, sep_id=4, min_len=2, max_len=7),
        tasks.mqar_task(vocab_size=20, n_keys=9, min_pairs=2, max_pairs=6, num_queries=3),
    ],
)
def test_gold_source_holds_the_predicted_token(task):
    batch = tasks.make_batch(task, 64, np.random.default_rng(0))
    b, i = np.nonzero(batch.gold >= 0)
    j = batch.gold[b, i]
    assert np.all(j <= i)
    if task["name"] == "copy":  # the source token is the very token predicted
        np.testing.assert_array_equal(batch.tokens[b, j], batch.targets[b, i])
    else:  # the source is the query's key; its value follows it
        np.testing.assert_array_equal(batch.tokens[b, j], batch.tokens[b, i])
        np.testing.assert_array_equal(batch.tokens[b, j + 1], batch.targets[b, i])


def test_copy_batch_layout_and_mask():
    task = tasks.copy_task(vocab_size=9, sep_id=4, min_len=2, max_len=7)
    batch = tasks.make_batch(task, 128, np.random.default_rng(1))
    L = tasks.sequence_length(task)
    assert batch.tokens.shape == batch.loss_mask.shape == (128, L)
    for tok, mask, n in zip(batch.tokens, batch.loss_mask, batch.lengths, strict=True):
        m = (n - 1) // 2
        assert task["min_len"] <= m <= task["max_len"]
        content = tok[:m]
        assert np.all(content != task["sep_id"]) and content.min() >= 0 and content.max() < task["vocab_size"]
        assert tok[m] == task["sep_id"]
        np.testing.assert_array_equal(tok[m + 1 : 2 * m + 1], content)
        assert np.all(tok[2 * m + 1 :] == task["sep_id"])
        # scored rows: exactly SEP .. the second-to-last copied token (their next tokens are the copy)
        np.testing.assert_array_equal(np.flatnonzero(mask), np.arange(m, 2 * m))
    np.testing.assert_array_equal(batch.targets[:, :-1], batch.tokens[:, 1:])


def test_mqar_mask_covers_only_queries():
    task = tasks.mqar_task(vocab_size=20, n_keys=9, min_pairs=2, max_pairs=6, num_queries=3)
    batch = tasks.make_batch(task, 64, np.random.default_rng(2))
    keys = (batch.tokens >= 1) & (batch.tokens <= task["n_keys"])
    values = batch.tokens > task["n_keys"]
    assert np.all(keys[batch.loss_mask])
    assert np.all(values[:, 1:][batch.loss_mask[:, :-1]])
    for tok, mask, n in zip(batch.tokens, batch.loss_mask, batch.lengths, strict=True):
        P = (n - 2 * mask.sum()) // 2
        assert not mask[: 2 * P].any() and not mask[n:].any()
        assert len(set(tok[: 2 * P : 2])) == P  # keys distinct


@pytest.mark.parametrize("task", [tasks.copy_task(), tasks.mqar_task()])
def test_batches_are_deterministic_given_a_seed(task):
    a = tasks.make_batch(task, 16, np.random.default_rng(5))
    b = tasks.make_batch(task, 16, np.random.default_rng(5))
    c = tasks.make_batch(task, 16, np.random.default_rng(6))
    for name in ("tokens", "targets", "loss_mask", "gold", "lengths"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    assert not np.array_equal(a.tokens, c.tokens)


def test_task_fields_strips_a_record_to_its_task():
    record = {**tasks.mqar_task(), "final_token_accuracy": 0.9, "training": {"steps": 3}}
    assert tasks.task_fields(record) == {k: record[k] for k in tasks.TASK_FIELDS["mqar"]}
    assert tasks.task_fields({**tasks.copy_task(), "sequence_length": 49}) == tasks.copy_task()
    with pytest.raises(ValueError, match="not a task record"):
        tasks.task_fields(None)
    with pytest.raises(ValueError, match=r"lacks field\(s\) \['sep_id'\]"):
        tasks.task_fields({k: v for k, v in tasks.copy_task().items() if k != "sep_id"})


def test_invalid_tasks_are_rejected():
    with pytest.raises(ValueError, match="sep_id"):
        tasks.copy_task(vocab_size=4, sep_id=4)
    with pytest.raises(ValueError, match="min_len"):
        tasks.copy_task(min_len=5, max_len=3)
    with pytest.raises(ValueError, match="name"):
        tasks.check_task({"name": "sort"})
    with pytest.raises(ValueError, match="max_pairs"):
        tasks.mqar_task(n_keys=3, max_pairs=5)
