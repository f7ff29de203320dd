"""The parallel layer kind (Falcon-H1: Mamba-2 and attention on one normalised input, outputs added):
exact conservation with padding, the block's contributions equal to the sum of its halves decomposed
as layers of their own kinds, the logit identity, padding and row subsets, hidden attention, the
Pallas path, vmap and gradients."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
    assert_attention_map_and_pallas,
    assert_l2_vmap_and_gradient,
    assert_logit_identity_padding_and_rows,
    rel_err,
)

import latim_jax
from latim_jax.latim.kinds import full_contributions, layer_factors
from latim_jax.model.init import init_params

# Falcon-H1's layout with every option its parallel block reads: GQA with rotary and biases, Mamba-2 with
# groups, RMSNorm(y) * SiLU(z), an out_proj bias without an in_proj one, the multipliers' configuration
# fields (folded weights are plain weights here)
CONFIG = latim_jax.MambaConfig(
    version=2, d_model=16, n_layers=4, vocab_size=40, d_state=4, head_dim=8, n_groups=2, chunk_size=8,
    layer_kinds=("parallel", "mlp", "parallel", "mlp"), attn_heads=4, attn_kv_heads=2, attn_head_dim=6,
    rope_theta=500.0, attn_bias=True, attn_out_bias=True, mlp_width=24, mlp_gated=True, mlp_bias=True,
    ssm_norm="before_gate", out_proj_bias=True, conv_bias=True, embedding_multiplier=3.0,
    logits_scaling=1.5,
)  # fmt: skip
L = 21


@pytest.fixture(scope="module")
def model():
    return latim_jax.MambaLM(CONFIG, init_params(CONFIG, 5))


def _tokens(b=2, length=L, seed=0):
    return np.random.default_rng(seed).integers(0, CONFIG.n_tokens, (b, length))


@pytest.mark.parametrize("norm", ["before_gate", "none", "gated"])
def test_parallel_blocks_conserve_exactly_with_padding(norm):
    config = dataclasses.replace(CONFIG, ssm_norm=norm, proj_bias=norm == "gated")
    model = latim_jax.MambaLM(config, init_params(config, 5))
    tokens = _tokens()
    mask = np.ones(tokens.shape, bool)
    mask[1, :5] = False
    exact = latim_jax.conservation_error(model, tokens, 2, "exact", mask=mask)
    paper = latim_jax.conservation_error(model, tokens, 2, "paper", mask=mask)
    assert exact < 2e-6 and paper > 1e-3, (exact, paper)  # the SSM half's paper mode is approximate
    C = latim_jax.contributions(model, tokens, 0, mask=mask)
    T = np.asarray(C.T)
    i, j = np.triu_indices(L, 1)
    assert np.all(T[:, i, j] == 0)  # causal
    assert np.all(T[1, :, :5] == 0)  # padding sources contribute nothing
    assert rel_err((T.sum(2) + np.asarray(C.bias))[mask], np.asarray(C.output)[mask]) < 2e-6


def test_a_parallel_block_is_the_sum_of_its_halves(model):
    """The block's T and beta equal those of its Mamba-2 half and its attention half, each decomposed as a
    layer of its own kind (same norm, same weights, same input stream)."""
    tokens = _tokens()
    h = model.forward(tokens).residuals[2]
    layer = model.params()["layers"][2]
    got = layer_factors(model, h, 2)
    T = np.asarray(full_contributions(got))
    parts = []
    for kind in ("mamba2", "attention"):
        config = dataclasses.replace(CONFIG, n_layers=1, layer_kinds=(kind,))
        names = latim_jax.model.config.param_shapes(config)["layers"][0]["mixer"]
        params = model.params()
        params["layers"] = [{"norm": layer["norm"], "mixer": {k: layer["mixer"][k] for k in names}}]
        half = latim_jax.MambaLM(config, params)
        parts.append(layer_factors(half, h, 0))
    want_T = sum(np.asarray(full_contributions(f)) for f in parts)
    assert rel_err(T, want_T) < 1e-6
    assert rel_err(got.bias, sum(f.bias for f in parts)) < 1e-6
    assert rel_err(got.output, sum(f.output for f in parts)) < 1e-6
    assert rel_err(h + got.output, model.forward(tokens).residuals[3]) < 1e-6
    for f in parts:  # both halves carry a share of the block's contributions
        assert np.abs(np.asarray(full_contributions(f))).max() > 0.05 * np.abs(T).max()
    assert rel_err(got.token_total, sum(f.token_total for f in parts)) < 1e-6


def test_logit_identity_and_padding_and_rows(model):
    assert_logit_identity_padding_and_rows(model, _tokens())


def test_hidden_attention_is_the_attention_halfs_weights_and_pallas_equals_xla(model):
    assert_attention_map_and_pallas(model, _tokens(), 0)


def test_vmap_equals_the_loop_and_grad_equals_finite_differences(model):
    tokens = _tokens(3, 12)
    embeds = 20.0 * model.embed(jnp.asarray(tokens))
    # eps 3e-3: at 1e-3 the fp32 difference quotient's rounding is ~5e-3 of the value here
    assert_l2_vmap_and_gradient(model, embeds, [0, 2], eps=3e-3)
