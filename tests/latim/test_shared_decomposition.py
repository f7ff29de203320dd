"""The shared layer kind (Zamba2: a Mamba-2 sublayer whose input adds a transformer block's output for
[h; h^0]): exact conservation with padding, the two-hop contributions against an independent
linearisation (forward-mode derivative of the held layer along each source token's own inputs), causality,
the logit identity, padding and row subsets, hidden attention, vmap and gradients (grad_input's padding
and rows: the generic tests; at layer 0, through both reads of h^0: here)."""

from __future__ import annotations

import dataclasses

import jax
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
from latim_jax.latim.kinds import factors, full_contributions
from latim_jax.model.init import init_params

# Zamba2's layout with every option its shared layer reads: attention over [h; h^0] (head dim 2d / H,
# scale (a / 2)^-1/2) with GQA and rotary, a biased GELU-gated MLP, biased Mamba-2 projections with
# groups, a Delta floor
CONFIG = latim_jax.MambaConfig(
    version=2, d_model=16, n_layers=3, vocab_size=40, d_state=4, head_dim=8, n_groups=2, chunk_size=8,
    layer_kinds=("shared", "mamba2", "shared"), attn_heads=4, attn_kv_heads=2, attn_head_dim=8,
    attn_scale=0.5, rope_theta=500.0, mlp_width=24, mlp_gated=True, mlp_bias=True, mlp_activation="gelu",
    proj_bias=True, conv_bias=True, time_step_limit=(1e-3, float("inf")),
)  # fmt: skip
L = 17


def _model(config=CONFIG, seed=5):
    params = init_params(config, seed)
    for layer in params["layers"]:  # the shared block's output big enough to count beside h
        if "shared_out" in layer["mixer"]:
            layer["mixer"]["shared_out"] = 8.0 * layer["mixer"]["shared_out"]
    return latim_jax.MambaLM(config, params)


@pytest.fixture(scope="module")
def model():
    return _model()


def _tokens(b=2, length=L, seed=0):
    return np.random.default_rng(seed).integers(0, CONFIG.n_tokens, (b, length))


def test_shared_layers_conserve_exactly_with_padding(model):
    tokens = _tokens()
    mask = np.ones(tokens.shape, bool)
    mask[1, :5] = False
    for layer in (0, 2):
        exact = latim_jax.conservation_error(model, tokens, layer, "exact", mask=mask)
        paper = latim_jax.conservation_error(model, tokens, layer, "paper", mask=mask)
        assert exact < 2e-6 and paper > 1e-3, (layer, exact, paper)
    C = latim_jax.contributions(model, tokens, 2, mask=mask)
    T = np.asarray(C.T)
    i, j = np.triu_indices(L, 1)
    assert np.all(T[:, i, j] == 0)  # causal
    assert np.all(T[1, :, :5] == 0)  # padding sources contribute nothing
    assert rel_err((T.sum(2) + np.asarray(C.bias))[mask], np.asarray(C.output)[mask]) < 2e-6
    # the layer's output is the forward's update of the stream
    out = model.forward(tokens, mask=mask)
    update = np.asarray(out.residuals[3] - out.residuals[2])
    assert rel_err(np.asarray(C.output)[mask], update[mask]) < 1e-6


def test_bf16_shared_layers_conserve_what_the_forward_computed(model):
    """bf16 weights: the Mamba-2 reads its normalised input rounded to bf16, the tokens' shares are not;
    that rounding belongs to no token and goes to beta, so exact mode conserves as in fp32 (measured
    ~2e-7; 2.8e-3 before the rounding went to beta)."""
    params = jax.tree.map(lambda a: jnp.asarray(a).astype(jnp.bfloat16), model.params())
    half = latim_jax.MambaLM(CONFIG, params)
    tokens = _tokens()
    for layer in (0, 2):
        assert latim_jax.conservation_error(half, tokens, layer) < 1e-5, layer


def test_two_hop_contributions_equal_the_held_layers_derivative_along_each_token(model):
    """With the quantities LaTIM holds fixed held (hold_fixed), the layer's output is linear in the tokens'
    own inputs (h_j, h^0_j), so T_i(x_j) is its forward-mode derivative along (h_j, h^0_j) for that j
    alone: autodiff through the forward's own intermediates, not the two-hop code. A one-hop split
    (the Mamba-2 decomposed over its input positions) differs from it."""
    tokens = _tokens(1)
    out = model.forward(tokens)
    h, e = out.residuals[2], out.residuals[0]
    mask = jnp.ones(tokens.shape, bool)
    block = model.layers[2]
    # compiled (eager, every primitive of the factors runs and compiles on its own: CI time)
    T = np.asarray(jax.jit(lambda h, e: full_contributions(factors(block, h, mask, embeddings=e)))(h, e))

    def held(h, e):
        return factors(block, h, mask, hold_fixed=True, embeddings=e).output

    along = jax.jit(lambda onehot: jax.jvp(held, (h, e), (h * onehot, e * onehot))[1])
    for j in (0, 5, L - 1):
        onehot = (jnp.arange(L) == j)[None, :, None].astype(jnp.float32)
        tangent = along(onehot)
        assert rel_err(T[0, :, j], np.asarray(tangent)[0]) < 1e-5, j
    # the t-part of the Mamba-2's input at k is not token k's: a one-hop split misplaces it
    one_hop = dataclasses.replace(model.config, layer_kinds=("mamba2",) * 3)
    assert one_hop.kinds != model.config.kinds
    s = h + block.mixer.transformer(h, e, mask=mask)
    from latim_jax.latim import mamba

    one_hop_T = jax.jit(lambda s: full_contributions(mamba.factors(block, s, mask)))(s)
    assert rel_err(np.asarray(one_hop_T), T) > 0.05


@pytest.mark.slow  # (the Python 3.11 run only: CI time)
def test_logit_identity_rollout_and_padding_and_rows(model):
    tokens = _tokens()
    assert_logit_identity_padding_and_rows(model, tokens)
    roll = np.asarray(latim_jax.attribute(model, tokens, method="alti").rollout())
    assert np.all(roll[:, np.triu_indices(L, 1)[0], np.triu_indices(L, 1)[1]] == 0)  # causal through all


def test_grad_input_at_layer_0_reads_the_embeddings_both_ways(model):
    """At layer 0 the stream is h^0, which a shared block also reads beside it: gradient x input there
    is jax.grad of the target logit through both reads."""
    tokens = _tokens(1)
    a = latim_jax.attribute(model, tokens, method="grad_input", layers=[0], rows=[-1])
    e = model.embed(jnp.asarray(tokens))
    target = int(np.asarray(model(tokens))[0, -1].argmax())
    g = jax.grad(lambda x: model.forward(inputs_embeds=x).logits[0, -1, target])(e)
    np.testing.assert_allclose(a.scores[0, 0, 0], np.linalg.norm(np.asarray(g * e)[0], axis=-1), rtol=1e-4)


def test_hidden_attention_is_the_shared_attentions_weights_and_pallas_equals_xla(model):
    assert_attention_map_and_pallas(model, _tokens(), 0)


@pytest.mark.slow  # (the Python 3.11 run only: CI time)
def test_vmap_equals_the_loop_and_grad_equals_finite_differences(model):
    tokens = _tokens(3, 10)
    embeds = 20.0 * model.embed(jnp.asarray(tokens))
    assert_l2_vmap_and_gradient(model, embeds, [0, 2], eps=3e-3)
