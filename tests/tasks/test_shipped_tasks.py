"""The shipped translation and needle models: they load with their task, reach their accuracy floors,
and LaTIM's AER / AUC floors hold on held-out data (floors = measured values minus a margin; the full
measurements are in benchmarks/results/tasks/align_eval_*.md and needle_eval_*.md)."""

from __future__ import annotations

import numpy as np
import pytest

import latim_jax
from latim_jax import tasks
from latim_jax.tasks import align, needle
from latim_jax.tasks import evaluate_align as ea
from latim_jax.tasks import evaluate_needle as en

# name -> (target token accuracy floor, method, layer, AER ceiling); measured on these 64 sentences
# (seed 123): accuracy 1.000 for both; l2 (exact) AER at layer 1 0.175 (Mamba-1), 0.148 (Mamba-2)
ALIGN_FLOORS = {
    "align-mamba1": (0.99, "l2", 1, 0.23),
    "align-mamba2": (0.99, "l2", 1, 0.20),
}
# name -> (test length, retrieval accuracy floor, method, AUC floor at the best layer, value gold);
# measured on these 8 sequences (4 needles, 2 queries, seed 123): needle-mamba2 at 1024 accuracy 1.000,
# l2 (exact) AUC 1.000 and R@1 1.000 at layer 0; needle-mamba1 accuracy 1.000, l2 (exact) AUC 1.000 and
# R@1 1.000 at layer 1 (layer 0: AUC 0.998, R@1 0.44)
NEEDLE_FLOORS = {
    "needle-mamba1": (1024, 0.9, "l2", 0.95),
    "needle-mamba2": (1024, 0.9, "l2", 0.95),
}


@pytest.mark.parametrize("name", sorted(ALIGN_FLOORS))
def test_shipped_alignment_model_translates_and_latim_aligns(name):
    model = latim_jax.load(name)
    assert model.config.version == int(name[-1]) and model.task["name"] == "align"
    acc_floor, method, layer, aer_ceiling = ALIGN_FLOORS[name]
    m = (f"LaTIM {method} (exact)", method, "exact", {})
    report = ea.evaluate_alignment(model, n_sentences=64, batch_size=64, methods=(m,), seed=123)
    assert report["token_accuracy"] >= acc_floor
    assert report["rows"][m[0]]["layers"][layer] <= aer_ceiling
    assert report["rows"][m[0]]["layers"][layer] < report["random"] - 0.5


@pytest.mark.parametrize("name", sorted(NEEDLE_FLOORS))
def test_shipped_needle_model_retrieves_and_latim_finds_the_needle(name):
    model = latim_jax.load(name)
    assert model.config.version == int(name[-1]) and model.task["name"] == "needle"
    length, acc_floor, method, auc_floor = NEEDLE_FLOORS[name]
    m = (f"LaTIM {method} (exact)", method, "exact", {})
    report = en.evaluate_needle(
        model,
        lengths=(length,),
        settings={"multi": (4, 2)},
        n_sequences=8,
        batch_size=8,
        methods=(m,),
        seed=123,
    )
    (entry,) = report["results"]
    assert entry["accuracy"] >= acc_floor
    assert entry["rows"][m[0]]["value"]["best"]["auc"] >= auc_floor


@pytest.mark.parametrize("name", ["align-mamba2", "needle-mamba1", "needle-mamba2"])
def test_shipped_task_records_are_complete(name):
    model = latim_jax.load(name)
    task = tasks.task_fields(model.task)
    vocab = (align.vocabulary if task["name"] == "align" else needle.vocabulary)(task)
    assert len(vocab) == task["vocab_size"] <= model.config.vocab_size
    assert model.task["training"]["init"] == "mimetic" and model.task["final_token_accuracy"] > 0.9
    batch = tasks.make_batch(task, 4, np.random.default_rng(0))
    model.check_tokens(batch.tokens)


@pytest.mark.parametrize(
    "name, kinds, length",
    [
        ("needle-hybrid", ("mamba2", "attention", "mamba2"), 1024),
        ("needle-hybrid-gdn", ("gdn", "attention", "gdn"), 512),
    ],
)
def test_shipped_hybrid_retrieves_and_its_maps_add_up(name, kinds, length):
    """The shipped hybrids retrieve with and without their attention output (needle-hybrid at 1024,
    needle-hybrid-gdn at 512; measured on these 8 sequences, seed 123: accuracy 1.000 both for each),
    and per sublayer the report holds the kinds, AUCs in [0, 1] and the needle's logit push; the
    attention sublayer's maps of the ablated model are all zero, so its AUC is exactly the tie value
    0.5 and its push 0."""
    from latim_jax.tasks.hybrid_needle import where_retrieved

    model = latim_jax.load(name)
    assert model.config.kinds == kinds and model.task["name"] == "needle"
    report = where_retrieved(model, lengths=(length,), settings={"multi": (4, 2)}, n_sequences=8, seed=123)
    (entry,) = report["results"]
    full, removed = entry["models"]["full"], entry["models"]["attention removed"]
    assert full["accuracy"] >= 0.9 and removed["accuracy"] >= 0.5
    assert [x["kind"] for x in full["layers"]] == list(model.config.kinds)
    assert removed["layers"][1]["l2_auc"] == 0.5 and removed["layers"][1]["gold_logit"] == 0.0
    best = max(x["logit_auc"] for x in full["layers"])
    assert best > 0.95  # some sublayer's logit map finds the needle
