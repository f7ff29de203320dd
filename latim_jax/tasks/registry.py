"""Every synthetic task by name: validation, batches, lengths and vocabularies dispatch on ``task["name"]``
to the module that defines the task (copy and mqar: latim_jax.tasks.synthetic; align:
latim_jax.tasks.align; needle: latim_jax.tasks.needle).

Every task is a plain JSON-safe dict (``task["name"]`` picks the generator) and every batch is drawn
from a numpy ``Generator``, so a seed fixes the data. Convention for rows and gold sources (used by the
training loss, the accuracy and the attribution metrics alike): a *row* i is the position whose NEXT-token
prediction is scored (``logits[:, i]`` predicts ``tokens[:, i + 1]``), and its gold source j is the
earlier position holding the token the model must retrieve. ``Batch.gold[b, i] = j`` on scored rows and
-1 elsewhere, with j <= i always.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from latim_jax.tasks import align, needle, synthetic
from latim_jax.tasks.batch import Batch

TASK_NAMES = ("copy", "mqar", "align", "needle")
MODULES = {"copy": synthetic, "mqar": synthetic, "align": align, "needle": needle}
# the fields that define each task (records such as a model's task.json add results and history)
TASK_FIELDS = {
    "copy": ("name", "vocab_size", "sep_id", "min_len", "max_len"),
    "mqar": ("name", "vocab_size", "n_keys", "min_pairs", "max_pairs", "num_queries"),
    "align": ("name", "vocab_size", "min_src", "max_src", "max_tgt"),
    "needle": (
        "name", "vocab_size", "n_distract", "n_keys", "n_values", "length", "min_needles", "max_needles",
        "num_queries",
    ),
}  # fmt: skip


def task_fields(record: dict | None) -> dict:
    """The task inside ``record`` (e.g. a model's ``task``, read from task.json): only the fields in
    ``TASK_FIELDS``, validated. Errors name a missing task, an unknown name or a missing field."""
    name = (record or {}).get("name")
    if name not in TASK_FIELDS:
        raise ValueError(f"not a task record ({', '.join(TASK_NAMES)}): {record!r}")
    missing = [k for k in TASK_FIELDS[name] if k not in record]
    if missing:
        raise ValueError(f"{name} task record lacks field(s) {missing}")
    return check_task({k: record[k] for k in TASK_FIELDS[name]})


def check_task(task: dict) -> dict:
    """Validate a task dict; returns it. Errors name the offending field."""
    name = task.get("name")
    if name not in TASK_NAMES:
        raise ValueError(f"task name must be one of {TASK_NAMES}, found {name!r}")
    return MODULES[name].check_task(task)


def sequence_length(task: dict) -> int:
    """The padded length l of every batch of ``task``."""
    return MODULES[task["name"]].sequence_length(task)


def make_batch(task: dict, batch_size: int, rng: np.random.Generator) -> Batch:
    """A batch of ``task`` drawn from ``rng`` (dispatches on ``task["name"]``)."""
    check_task(task)
    return MODULES[task["name"]].make_batch(task, batch_size, rng)


def vocabulary(task: dict) -> list[str]:
    """The task's words, one per token id (``vocabulary(task)[id]``), for labels and tokenizers: each
    task module's ``vocabulary``. Every word is distinct and holds no whitespace, so a space-separated
    string of words is a prompt (``latim-jax attribute --text``)."""
    task = task_fields(task)
    return MODULES[task["name"]].vocabulary(task)


def task_summary(task: dict) -> dict[str, Any]:
    """The task dict plus its padded sequence length (what task.json records)."""
    return {**task, "sequence_length": sequence_length(task)}
