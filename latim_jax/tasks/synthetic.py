"""The copy and multi-query associative recall (MQAR) tasks: sequences whose gold source positions are
known (translation with gold word alignments: latim_jax.tasks.align; needle retrieval:
latim_jax.tasks.needle; every task by name: latim_jax.tasks.registry).

Every task is a plain JSON-safe dict (``task["name"]`` picks the generator) and every batch is drawn
from a numpy ``Generator``, so a seed fixes the data.

Convention for rows and gold sources (used by the training loss, the accuracy and the attribution
metrics alike): a *row* i is the position whose NEXT-token prediction is scored (``logits[:, i]``
predicts ``tokens[:, i + 1]``), and its gold source j is the earlier position holding the token the
model must retrieve. ``Batch.gold[b, i] = j`` on scored rows and -1 elsewhere, with j <= i always.

copy:  [c_0 .. c_{m-1}, SEP, c_0 .. c_{m-1}, PAD ...], m uniform in [min_len, max_len].
       Rows i = m .. 2m-1 (SEP and the first m-1 copied tokens) predict c_{i-m}; gold j = i - m, the
       position of the original content token. Content ids lie in [0, vocab_size) minus sep_id;
       padding uses sep_id (padding sits after the sequence, so causality keeps it invisible).
mqar:  [k_1 v_1 .. k_P v_P, q_1 a_1 .. q_Q a_Q, PAD ...]: P key-value pairs (P uniform in
       [min_pairs, max_pairs], keys distinct), then Q = min(num_queries, P) distinct keys each followed
       by its value. Rows are the query positions (their next token is the value); gold j = the
       position of the same key in the pair section (its value sits at j + 1; ``value_sources``
       gives that alternative gold). Keys are ids [1, 1 + n_keys), values [1 + n_keys, vocab_size);
       id 0 is padding.
"""

from __future__ import annotations

import numpy as np

from latim_jax.tasks.batch import Batch, finish_batch


def copy_task(*, vocab_size: int = 16, sep_id: int = 0, min_len: int = 4, max_len: int = 24) -> dict:
    """The copy task's metadata dict (validated)."""
    return check_task(
        {"name": "copy", "vocab_size": vocab_size, "sep_id": sep_id, "min_len": min_len, "max_len": max_len}
    )


def mqar_task(
    *, vocab_size: int = 32, n_keys: int = 15, min_pairs: int = 4, max_pairs: int = 8, num_queries: int = 4
) -> dict:
    """The multi-query associative recall task's metadata dict (validated)."""
    return check_task(
        {
            "name": "mqar",
            "vocab_size": vocab_size,
            "n_keys": n_keys,
            "min_pairs": min_pairs,
            "max_pairs": max_pairs,
            "num_queries": num_queries,
            "pad_id": 0,
        }
    )


def check_task(task: dict) -> dict:
    """Validate a copy or mqar task dict; returns it. Errors name the offending field."""
    if task["name"] == "copy":
        if not 0 <= task["sep_id"] < task["vocab_size"]:
            raise ValueError(f"copy task: sep_id {task['sep_id']} outside [0, {task['vocab_size']})")
        if task["vocab_size"] < 3:
            raise ValueError("copy task: vocab_size must be at least 3 (sep + two content ids)")
        if not 1 <= task["min_len"] <= task["max_len"]:
            raise ValueError(
                f"copy task: need 1 <= min_len <= max_len, found {task['min_len']}, {task['max_len']}"
            )
    else:
        n_values = task["vocab_size"] - 1 - task["n_keys"]
        if n_values < 1:
            raise ValueError(
                f"mqar task: vocab_size {task['vocab_size']} leaves no value ids after "
                f"padding and {task['n_keys']} keys"
            )
        if not 1 <= task["min_pairs"] <= task["max_pairs"] <= task["n_keys"]:
            raise ValueError("mqar task: need 1 <= min_pairs <= max_pairs <= n_keys")
        if task["num_queries"] < 1:
            raise ValueError("mqar task: num_queries must be positive")
    return task


def sequence_length(task: dict) -> int:
    """The padded length l of every batch of ``task``."""
    if task["name"] == "copy":
        return 2 * task["max_len"] + 1
    return 2 * task["max_pairs"] + 2 * min(task["num_queries"], task["max_pairs"])


def make_batch(task: dict, batch_size: int, rng: np.random.Generator) -> Batch:
    """A batch of the copy or mqar ``task`` drawn from ``rng``."""
    return copy_batch(task, batch_size, rng) if task["name"] == "copy" else mqar_batch(task, batch_size, rng)


def copy_batch(task: dict, batch_size: int, rng: np.random.Generator) -> Batch:
    """Copy sequences [content, SEP, content] padded with sep_id to 2 * max_len + 1."""
    L, sep = sequence_length(task), task["sep_id"]
    m = rng.integers(task["min_len"], task["max_len"] + 1, size=batch_size)
    content = rng.integers(0, task["vocab_size"] - 1, size=(batch_size, task["max_len"]))
    content = content + (content >= sep)  # skip the separator id
    pos = np.arange(L)[None, :]
    mm = m[:, None]
    src = np.where(pos < mm, pos, pos - mm - 1)  # which content index each position shows
    src = np.clip(src, 0, task["max_len"] - 1)
    tokens = np.take_along_axis(content, src, axis=1)
    is_content = (pos < mm) | ((pos > mm) & (pos <= 2 * mm))
    tokens = np.where(is_content, tokens, sep).astype(np.int32)
    return finish_batch(tokens, copy_gold_sources(tokens, sep), lengths=2 * m + 1)


def copy_gold_sources(tokens: np.ndarray, sep_id: int) -> np.ndarray:
    """Gold source per row of copy sequences (b, l) -> (b, l) int32, -1 off the copy rows.

    The content length m is the position of the first separator; rows i = m .. 2m-1 get j = i - m.
    """
    tokens = np.asarray(tokens)
    L = tokens.shape[1]
    m = np.argmax(tokens == sep_id, axis=1)[:, None]  # first separator
    i = np.arange(L)[None, :]
    rows = (i >= m) & (i < 2 * m)
    return np.where(rows, i - m, -1).astype(np.int32)


def mqar_batch(task: dict, batch_size: int, rng: np.random.Generator) -> Batch:
    """MQAR sequences [k v ... | q a ...] padded with id 0 (see the module docstring)."""
    L, n_keys = sequence_length(task), task["n_keys"]
    n_values = task["vocab_size"] - 1 - n_keys
    tokens = np.zeros((batch_size, L), np.int32)
    mask = np.zeros((batch_size, L), bool)
    lengths = np.zeros(batch_size, np.int32)
    for b in range(batch_size):  # ragged per sequence; batches are small
        P = int(rng.integers(task["min_pairs"], task["max_pairs"] + 1))
        Q = min(task["num_queries"], P)
        keys = 1 + rng.permutation(n_keys)[:P]
        values = 1 + n_keys + rng.integers(0, n_values, size=P)
        asked = rng.permutation(P)[:Q]
        seq = np.concatenate(
            [np.stack([keys, values], 1).ravel(), np.stack([keys[asked], values[asked]], 1).ravel()]
        )
        tokens[b, : seq.size] = seq
        mask[b, 2 * P : 2 * P + 2 * Q : 2] = True
        lengths[b] = seq.size
    return finish_batch(tokens, mqar_gold_sources(tokens, mask), lengths=lengths)


def mqar_gold_sources(tokens: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Gold source per row of MQAR sequences: on each row i (a query key), the first position j < i
    holding the same token (its occurrence in the pair section); -1 off the rows."""
    tokens = np.asarray(tokens)
    L = tokens.shape[1]
    same = tokens[:, :, None] == tokens[:, None, :]  # (b, i, j)
    earlier = np.arange(L)[None, None, :] < np.arange(L)[None, :, None]
    j = np.argmax(same & earlier, axis=2)
    found = (same & earlier).any(axis=2)
    return np.where(np.asarray(rows) & found, j, -1).astype(np.int32)


def value_sources(gold: np.ndarray) -> np.ndarray:
    """MQAR's alternative gold: the position of the answer token itself (key position + 1), -1 kept.

    The key position is the task's gold (where the queried key occurred); a model that solves MQAR with
    its short convolution typically reads the answer at the value position, whose conv window holds
    both the key and the value (measured on the trained models: see README, "MQAR").
    """
    gold = np.asarray(gold)
    return np.where(gold >= 0, gold + 1, -1).astype(np.int32)


def vocabulary(task: dict) -> list[str]:
    """The task's words, one per token id (``vocabulary(task)[id]``), for labels and tokenizers.

    copy: ``"<sep>"`` for sep_id and ``"t<id>"`` for every content id (so ``t5`` is id 5). mqar:
    ``"<pad>"`` for id 0, ``"k1" .. "k<n_keys>"`` for the keys (ids 1 .. n_keys), ``"v1" .. "v<M>"``
    for the M = vocab_size - 1 - n_keys values (ids n_keys + 1 ..). Every word is distinct and holds
    no whitespace, so a space-separated string of words is a prompt (``latim-jax attribute --text``).
    """
    if task["name"] == "copy":
        return ["<sep>" if i == task["sep_id"] else f"t{i}" for i in range(task["vocab_size"])]
    n_keys = task["n_keys"]
    keys = [f"k{i}" for i in range(1, n_keys + 1)]
    values = [f"v{i}" for i in range(1, task["vocab_size"] - n_keys)]
    return ["<pad>", *keys, *values]
