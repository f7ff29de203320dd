"""The shipped copy-task models: they load, reach their recorded accuracy, and LaTIM finds the copy."""

from __future__ import annotations

import numpy as np
import pytest

import latim_jax
from latim_jax import tasks
from latim_jax.evaluate import PAPER_AUC, evaluate, task_accuracy

# name -> (version, the method the paper reports best for it)
SHIPPED = {"copy-mamba1": (1, "alti"), "copy-mamba2": (2, "l2")}
TASK_KEYS = ("name", "vocab_size", "sep_id", "min_len", "max_len")


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_model_loads_and_copies(name):
    model = latim_jax.load(name)
    version, method = SHIPPED[name]
    assert model.config.version == version
    task = model.task
    assert task["name"] == "copy" and {"vocab_size", "sep_id", "min_len", "max_len"} <= set(task)
    batch = tasks.make_batch({k: task[k] for k in TASK_KEYS}, 128, np.random.default_rng(123))
    assert task_accuracy(model, batch) >= task["final_token_accuracy"] - 0.03
    # exact-mode LaTIM ranks the gold source at least as well as the paper's best AUC for this version
    column = f"LaTIM {method} (exact)"
    report = evaluate(model, n_sequences=16, batch_size=16, methods=[(column, method, "exact")])
    paper = PAPER_AUC[(version, f"LaTIM {method}")]
    row = report["rows"][column]
    assert max(row["best"]["auc"], row["aggregate"]["auc"]) >= paper


def test_default_model_is_mamba2():
    assert latim_jax.load().config.version == 2
    with pytest.raises(ValueError, match="unknown shipped model"):
        from latim_jax.loading import shipped_path

        shipped_path("copy-mamba3")
