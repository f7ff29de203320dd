"""Gradients of attributions: finite differences for every method and both modes (Mamba-1 with biases,
Mamba-2 with 2 groups), w.r.t. the embeddings and a parameter; Pallas = XLA; vmap = per prompt;
masked = unpadded; hold_fixed differentiates the decomposition's linear map (jax only)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import rel_err as rel
from flax import nnx

import latim_jax
from latim_jax.model.config import MambaConfig
from latim_jax.model.init import init_params

# fp32 central differences (the library computes in fp32 by design, so there is no float64 path) along
# a random direction scaled like the input, with a step of EPS times that scale: measured agreement
# ~5e-4 relative for every method. l1 and alti are piecewise smooth (|.| and max(0, .)): a much larger
# step crosses their kinks (at 1e-1 alti even changes sign), a much smaller one drowns in rounding.
# logit and grad_input use fixed targets: the default (the model's own argmax) is piecewise constant.
TOL = {"fd": 1e-2, "same": 5e-5, "euler": 1e-4}
EPS = 1e-3

CONFIGS = {
    1: MambaConfig(version=1, d_model=8, n_layers=2, vocab_size=16, d_state=4, d_conv=3, proj_bias=True),
    2: MambaConfig(
        version=2, d_model=8, n_layers=2, vocab_size=16, d_state=4, d_conv=3, head_dim=4, n_groups=2,
        chunk_size=4,
    ),
}  # fmt: skip
L = 6
METHODS = {
    "exact": ("l2", "l1", "alti", "logit", "hidden_attention", "grad_input"),
    "paper": ("l2", "alti", "logit"),
}


def model(version):
    return latim_jax.MambaLM(CONFIGS[version], init_params(CONFIGS[version], seed=7))


def tokens(batch=1, seed=0):
    return np.random.default_rng(seed).integers(0, 16, (batch, L))


def method_scores(m, x, mode, methods, **kw):
    """(n_methods,): <w_method, scores_method> per method, with fixed random weights."""
    out = []
    target = np.random.default_rng(9).integers(0, 16, x.shape[:2])
    for k, method in enumerate(methods):
        kw_m = {**kw, "target": target} if method in ("logit", "grad_input") else kw
        s = latim_jax.attribute(
            m, inputs_embeds=x, method=method, mode=mode, memory_limit=None, **kw_m
        ).scores
        w = np.random.default_rng(k).normal(size=s.shape).astype(np.float32)
        out.append(jnp.sum(w * s))
    return jnp.stack(out)


def directional(fn, x, seed):
    """(grad . v, central difference along v, the scale of the difference) for a random direction v of
    the scale of x; ``fn`` returns one term per method, the gradient is that of their sum, and the
    scale is the sum of the terms' |central differences|: the terms of different methods can cancel
    (measured: methods of 3-5 each summing to 0.5), and each term's fp32 difference carries its own
    rounding and kink error, so the error of the sum is bounded relative to the terms, not their sum."""
    v = jnp.asarray(np.random.default_rng(seed).normal(size=x.shape), jnp.float32) * jnp.std(x)
    g = jax.jit(jax.grad(lambda x: jnp.sum(fn(x))))(x)
    f = jax.jit(fn)
    terms = (f(x + EPS * v) - f(x - EPS * v)) / (2 * EPS)
    return float(jnp.vdot(g, v)), float(jnp.sum(terms)), float(jnp.sum(jnp.abs(terms)))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["exact", "paper"])
@pytest.mark.parametrize("version", [1, 2])
def test_every_method_matches_finite_differences(version, mode):
    m = model(version)
    x0 = m.embed(jnp.asarray(tokens()))
    methods = METHODS[mode]
    analytic, numeric, scale = directional(lambda x: method_scores(m, x, mode, methods), x0, seed=1)
    assert abs(analytic - numeric) <= TOL["fd"] * scale, (analytic, numeric, scale)
    if mode == "paper":  # its factors' derivative is checked along x above; the parameter's path below
        return  # runs the same score tiles as exact mode's (CI time: one direction for paper mode)
    # w.r.t. a parameter (the first layer's out_proj), through the model as a pure function of it; the
    # methods that read it (hidden attention does not; l1 runs l2's tiles)
    methods = ("l2", "alti", "logit", "grad_input")
    graphdef, state = nnx.split(m)

    def with_param(w):
        st = jax.tree.map(lambda a: a, state)
        st["layers"][0]["mixer"]["out_proj"] = nnx.Param(w)
        return method_scores(nnx.merge(graphdef, st), x0, mode, methods)

    analytic, numeric, scale = directional(with_param, m.layers[0].mixer.out_proj[...], seed=2)
    assert abs(analytic - numeric) <= TOL["fd"] * scale, (analytic, numeric, scale)


def _alti_loss(version):
    """A model, two prompts' embeddings and sum(sin(alti scores)) as a function of them."""
    m = model(version)
    x = m.embed(jnp.asarray(tokens(batch=2, seed=3)))

    def score(x, method="alti", **kw):
        return latim_jax.attribute(m, inputs_embeds=x, method=method, memory_limit=None, **kw).scores

    def loss(x, **kw):
        return jnp.sum(jnp.sin(score(x, **kw)))

    return x, score, loss


@pytest.mark.parametrize("version", [1, 2])
def test_pallas_gradient_equals_xla(version):
    x, _, loss = _alti_loss(version)
    g = jax.grad(loss)(x)
    # the Pallas path (interpret-mode kernels: scans and the fused score kernel) gives the same gradient
    assert rel(jax.grad(lambda x: loss(x, impl="pallas"))(x), g) < TOL["same"]
    # ... forward mode: the scans have Pallas backwards (custom_vjps), so it stops there with JAX's
    # TypeError (the fused score kernel alone keeps forward mode: tests/kernels/test_kernels_scores.py)
    v = jnp.asarray(np.random.default_rng(4).normal(size=x.shape), jnp.float32)
    with pytest.raises(TypeError, match="custom_vjp"):
        jax.jvp(lambda x: loss(x, impl="pallas"), (x,), (v,))


@pytest.mark.slow  # the 3.12 run keeps the first-order Pallas gradient above (CI time)
@pytest.mark.parametrize("version", [1, 2])
def test_pallas_second_order_vmap_and_masked_gradients(version):
    x, score, loss = _alti_loss(version)
    g = jax.grad(loss)(x)
    # grad x input through the Pallas scans (a second-order derivative of the kernels)
    gi = jax.grad(lambda x: jnp.sum(score(x, "grad_input", impl="pallas")))(x)
    assert rel(gi, jax.grad(lambda x: jnp.sum(score(x, "grad_input", impl="xla")))(x)) < TOL["same"]
    # vmap over prompts = one prompt at a time
    per_prompt = jax.vmap(jax.grad(lambda xi: loss(xi[None])))(x)
    assert rel(per_prompt, g) < TOL["same"]
    # a left-padded copy of prompt 1 has the unpadded prompt's gradient on its real positions, 0 on pads
    pad = 3
    xp = jnp.concatenate([jnp.zeros((1, pad, x.shape[-1])), x[1:]], axis=1)
    mask = np.arange(L + pad)[None, :] >= pad
    gp = jax.grad(lambda xp: loss(xp, mask=mask))(xp)
    assert rel(gp[0, pad:], g[1]) < TOL["same"] and float(jnp.abs(gp[0, :pad]).max()) == 0.0


@pytest.mark.slow
@pytest.mark.parametrize("version", [1, 2])
def test_hold_fixed_differentiates_the_linear_decomposition(version):
    """With Delta, B, C, the gates and the norm scales held fixed, layer 0's contributions are linear
    in its input h^0 = the embeddings, so l2 (1-homogeneous) and logit (linear) scores satisfy Euler's
    identity <d score / d x, x> = score; the true gradient (the default) does not."""
    m = model(version)
    x = m.embed(jnp.asarray(tokens(seed=5)))
    i, j = L - 1, L - 3
    for method in ("l2", "logit"):

        def pair(x, hold_fixed, method=method):
            s = latim_jax.attribute(
                m, inputs_embeds=x, method=method, layers=[0], hold_fixed=hold_fixed, memory_limit=None
            ).scores
            return s[0, 0, i, j]

        held = latim_jax.attribute(m, inputs_embeds=x, method=method, layers=[0], hold_fixed=True).scores
        plain = latim_jax.attribute(m, inputs_embeds=x, method=method, layers=[0]).scores
        np.testing.assert_array_equal(np.asarray(held), np.asarray(plain))  # the same values
        value = float(pair(x, True))
        euler = float(jnp.vdot(jax.grad(pair)(x, True), x))
        assert abs(euler - value) <= TOL["euler"] * abs(value), (method, euler, value)
        true = float(jnp.vdot(jax.grad(pair)(x, False), x))
        assert abs(true - value) > 1e-2 * abs(value), (method, true, value)  # the default differs


@pytest.mark.parametrize("version", [1, 2])
def test_tiled_gradients_match_finite_differences(version):
    """The tiles' own differentiation rules on far and near tiles: with 5 x 2 tiles at L = 6 the last row
    tile has far tiles (Mamba-1's factored product, Mamba-2's unmasked branch of m2_far_or_near) and
    near ones (Mamba-1's direct form, whose backward runs m1_state_sum's state groups), where the
    default single tile has only a near one. l2 and hidden attention, exact mode, w.r.t. the embeddings."""
    m = model(version)
    x0 = m.embed(jnp.asarray(tokens(seed=4)))
    blocks = latim_jax.Blocks(rows=5, cols=2)
    methods = ("l2", "hidden_attention")
    analytic, numeric, scale = directional(
        lambda x: method_scores(m, x, "exact", methods, blocks=blocks), x0, seed=3
    )
    assert abs(analytic - numeric) <= TOL["fd"] * scale, (analytic, numeric, scale)
