"""latim-jax against golden files of the independent float64 PyTorch reference, with no torch needed:
the newest-jax leg (Python 3.12, what TPU users run) checks parity, conservation, every score, the
rollouts and a gradient against an independent implementation too. The goldens and their tiny
transformers checkpoints are written by tests/goldens/make_goldens.py (see there)."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import rel_err

import latim_jax

GOLDENS = Path(__file__).resolve().parents[1] / "goldens"
TOL = {"logits": 1e-5, "T": 2e-5, "score": 2e-5, "rollout": 5e-5, "grad": 1e-4}


@pytest.fixture(scope="module", params=["m1", "m2"])
def golden(request):
    model = latim_jax.load(GOLDENS / request.param)  # safetensors: no torch
    return request.param, model, dict(np.load(GOLDENS / f"{request.param}.npz"))


def test_logits_and_contributions_match_the_reference(golden):
    name, model, g = golden
    assert rel_err(model(g["tokens"]), g["logits"]) < TOL["logits"], name
    for mode in ("exact", "paper"):
        c = latim_jax.contributions(model, g["tokens"][:1], 0, mode=mode)
        assert rel_err(c.T[0], g[f"T_{mode}"]) < TOL["T"], (name, mode)
        assert rel_err(c.bias[0], g[f"bias_{mode}"]) < TOL["T"], (name, mode)
        assert rel_err(c.output[0], g[f"output_{mode}"]) < TOL["T"], (name, mode)
    exact = latim_jax.contributions(model, g["tokens"][:1], 0)
    assert rel_err(exact.T.sum(2)[0] + exact.bias[0], g["output_exact"]) < TOL["T"]  # conservation


@pytest.mark.parametrize(
    "method, mode", [("l2", "exact"), ("alti", "exact"), ("logit", "exact"), ("l2", "paper")]
)
def test_scores_and_rollouts_match_the_reference(golden, method, mode):
    name, model, g = golden
    result = latim_jax.attribute(model, g["tokens"], method=method, mode=mode)
    assert rel_err(result.scores, g[f"scores_{method}_{mode}"]) < TOL["score"], (name, method, mode)
    if f"rollout_{method}" in g and mode == "exact":
        assert rel_err(result.rollout(), g[f"rollout_{method}"]) < TOL["rollout"], (name, method)


def test_gradient_matches_the_reference_finite_difference(golden):
    """d/d(embeddings) of a weighted sum of layer 0's l2 scores, along the golden's direction: jax.grad
    against central differences of the float64 reference's forward."""
    name, model, g = golden
    embeds = model.embed(jnp.asarray(g["tokens"][:1]))
    w = jnp.asarray(g["grad_w"], jnp.float32)

    def f(x):
        return (w * latim_jax.attribute(model, inputs_embeds=x, method="l2", layers=[0]).scores[0, 0]).sum()

    got = float((jax.grad(f)(embeds)[0] * jnp.asarray(g["grad_v"], jnp.float32)).sum())
    want = float(g["grad_dir"])
    assert abs(got - want) <= TOL["grad"] * max(abs(want), 1.0), (name, got, want)
