"""Synthetic tasks with known gold sources (copy, MQAR, translation with alignments, needles), ranking
metrics, the evaluations that score attribution methods on them, and training; uses the public API.

``latim_jax.tasks.make_batch(task, ...)`` and the other names below are the task registry's
(:mod:`latim_jax.tasks.registry`) and the copy / MQAR generators' (:mod:`latim_jax.tasks.synthetic`).
"""

from latim_jax.tasks.batch import Batch
from latim_jax.tasks.registry import (
    TASK_FIELDS,
    TASK_NAMES,
    check_task,
    make_batch,
    sequence_length,
    task_fields,
    task_summary,
    vocabulary,
)
from latim_jax.tasks.synthetic import (
    copy_batch,
    copy_gold_sources,
    copy_task,
    mqar_batch,
    mqar_gold_sources,
    mqar_task,
    value_sources,
)

__all__ = [
    "TASK_FIELDS",
    "TASK_NAMES",
    "Batch",
    "check_task",
    "copy_batch",
    "copy_gold_sources",
    "copy_task",
    "make_batch",
    "mqar_batch",
    "mqar_gold_sources",
    "mqar_task",
    "sequence_length",
    "task_fields",
    "task_summary",
    "value_sources",
    "vocabulary",
]
