"""A long-context retrieval task in the spirit of RULER's needle-in-a-haystack tests.

Sequences of a fixed length l: a haystack of distractor words with key-value "needles" hidden in it,
then queries at the very end:

    [w w w k_1 v_1 w w ... w k_N v_N w w ... w | q_1 a_1 ... q_Q a_Q]

N needles (N uniform in [min_needles, max_needles]; keys distinct) sit at uniformly random,
non-overlapping places in the haystack of l - 2Q words; each query q_m is the key of a needle (distinct
needles when N >= Q, drawn with replacement otherwise) and is followed by that needle's value a_m. So
every sequence of a task has its query rows at the same positions, l - 2Q + 2m (m = 0 .. Q-1), and
attribution can be asked for those rows only (``latim_jax.attribute(..., rows=query_rows(task))``).

Rows and gold (the convention of :mod:`latim_jax.tasks`): row i = a query key position, predicting the
value; ``Batch.gold`` = the needle's key position; :func:`latim_jax.tasks.value_sources` (key + 1) gives
the needle's value position, the other gold convention.

Ids: 0 padding (unused: every sequence fills l), distractor words [1, 1 + n_distract), keys, then values.
"""

from __future__ import annotations

import numpy as np

from latim_jax.tasks.batch import Batch, finish_batch


def needle_task(
    *,
    length: int = 256,
    n_distract: int = 32,
    n_keys: int = 16,
    n_values: int = 16,
    min_needles: int = 1,
    max_needles: int = 4,
    num_queries: int = 2,
) -> dict:
    """The needle task's metadata dict (validated); vocab_size = 1 + n_distract + n_keys + n_values."""
    task = {
        "name": "needle",
        "vocab_size": 1 + n_distract + n_keys + n_values,
        "n_distract": n_distract,
        "n_keys": n_keys,
        "n_values": n_values,
        "length": length,
        "min_needles": min_needles,
        "max_needles": max_needles,
        "num_queries": num_queries,
    }
    return check_task(task)


def check_task(task: dict) -> dict:
    """Validate a needle task dict; errors name the field."""
    want = 1 + task["n_distract"] + task["n_keys"] + task["n_values"]
    if task["vocab_size"] != want:
        raise ValueError(f"needle task: vocab_size must be 1 + n_distract + n_keys + n_values = {want}")
    if min(task["n_distract"], task["n_keys"], task["n_values"], task["num_queries"]) < 1:
        raise ValueError("needle task: n_distract, n_keys, n_values and num_queries must be positive")
    if not 1 <= task["min_needles"] <= task["max_needles"] <= task["n_keys"]:
        raise ValueError("needle task: need 1 <= min_needles <= max_needles <= n_keys")
    if task["length"] < 2 * task["num_queries"] + 3 * task["max_needles"]:
        raise ValueError(
            f"needle task: length {task['length']} leaves no haystack for {task['max_needles']} needles "
            f"and {task['num_queries']} queries"
        )
    return task


def sequence_length(task: dict) -> int:
    """The fixed length l."""
    return task["length"]


def query_rows(task: dict) -> list[int]:
    """The scored rows (query key positions) shared by every sequence of ``task``."""
    h = task["length"] - 2 * task["num_queries"]
    return [h + 2 * m for m in range(task["num_queries"])]


def vocabulary(task: dict) -> list[str]:
    """Token names, index = id: <pad>, distractors w0.., keys K0.., values V0.."""
    return (
        ["<pad>"]
        + [f"w{k}" for k in range(task["n_distract"])]
        + [f"K{k}" for k in range(task["n_keys"])]
        + [f"V{k}" for k in range(task["n_values"])]
    )


def make_batch(task: dict, batch_size: int, rng: np.random.Generator) -> Batch:
    """Needle sequences (see the module docstring); gold = the queried needle's key position."""
    check_task(task)
    L, Q = task["length"], task["num_queries"]
    H = L - 2 * Q
    key0 = 1 + task["n_distract"]
    value0 = key0 + task["n_keys"]
    tokens = rng.integers(1, key0, size=(batch_size, L)).astype(np.int32)  # distractors everywhere
    gold = np.full((batch_size, L), -1, np.int32)
    for b in range(batch_size):
        n = int(rng.integers(task["min_needles"], task["max_needles"] + 1))
        starts = np.sort(rng.choice(H - n, size=n, replace=False)) + np.arange(n)  # non-overlapping pairs
        keys = key0 + rng.permutation(task["n_keys"])[:n]
        values = value0 + rng.integers(0, task["n_values"], size=n)
        tokens[b, starts], tokens[b, starts + 1] = keys, values
        asked = rng.permutation(n)[:Q] if n >= Q else rng.integers(0, n, size=Q)
        rows = np.asarray(query_rows(task))
        tokens[b, rows], tokens[b, rows + 1] = keys[asked], values[asked]
        gold[b, rows] = starts[asked]
    return finish_batch(tokens, gold, lengths=np.full(batch_size, L))
