"""latim_jax.model.layers.normed_linear: the RMSNorm folded past in_proj (long inputs) against a float64 numpy
RMSNorm-then-product, and against the unfolded form in value and gradient (jax only)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import rel_err

from latim_jax.model.layers import linear, normed_linear, rms_norm

EPS = 1e-5


def _operands(rows=6, d=16, o=24, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((2, rows, d)) * 3, jnp.float32)
    g = jnp.asarray(1 + 0.3 * rng.standard_normal(d), jnp.float32)
    w = jnp.asarray(rng.standard_normal((d, o)) / 4, jnp.float32)
    b = jnp.asarray(rng.standard_normal(o), jnp.float32)
    return x, g, w, b


def _reference(x, g, w, b):
    x, g, w, b = (np.asarray(a, np.float64) for a in (x, g, w, b))
    return (x / np.sqrt((x * x).mean(-1, keepdims=True) + EPS) * g) @ w + b


@pytest.mark.parametrize("fold", [False, True], ids=["operand", "folded"])
def test_normed_linear_equals_float64_norm_then_product(fold):
    x, g, w, b = _operands()
    assert rel_err(normed_linear(x, g, w, EPS, b, fold=fold), _reference(x, g, w, b)) < 2e-6
    assert rel_err(normed_linear(x, g, w, EPS, fold=fold), _reference(x, g, w, np.zeros(w.shape[1]))) < 2e-6


def test_unfolded_it_is_the_fused_form_bitwise():
    x, g, w, b = _operands()
    np.testing.assert_array_equal(normed_linear(x, g, w, EPS, b), linear(rms_norm(x, g, EPS), w, b))


@pytest.mark.parametrize("hold", [False, True], ids=["free", "held"])
def test_folded_gradients_equal_the_fused_form(hold):
    x, g, w, b = _operands()
    r = jnp.asarray(np.random.default_rng(1).standard_normal((2, 6, 24)), jnp.float32)

    def loss(x, g, w, b, fold):
        return jnp.sum(r * normed_linear(x, g, w, EPS, b, fold=fold, hold_scale=hold))

    want = jax.grad(loss, argnums=(0, 1, 2, 3))(x, g, w, b, False)
    got = jax.grad(loss, argnums=(0, 1, 2, 3))(x, g, w, b, True)
    for name, a, e in zip("xgwb", got, want, strict=True):
        assert rel_err(a, e) < 1e-5, name
    if hold:  # the held scale changes d/dx: a folded branch that dropped stop_gradient would fail
        free = jax.grad(lambda x: jnp.sum(r * normed_linear(x, g, w, EPS, b, fold=True)))(x)
        assert rel_err(free, got[0]) > 1e-2


def test_bf16_weights_keep_the_reference_rounding_point():
    x, g, w, b = _operands()
    g16, w16 = g.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    want = linear(rms_norm(x, g16, EPS).astype(jnp.bfloat16), w16, b)  # normalised input rounded first
    np.testing.assert_array_equal(normed_linear(x, g16, w16, EPS, b, fold=True), want)


def _model(version, n_layers=2, seed=3):
    import latim_jax
    from latim_jax.model.init import init_params

    extra = {"head_dim": 4, "chunk_size": 8} if version == 2 else {}
    cfg = latim_jax.MambaConfig(
        version=version, d_model=16, n_layers=n_layers, vocab_size=40, d_state=4, **extra
    )
    return latim_jax.MambaLM(cfg, init_params(cfg, seed))


def test_model_forward_and_conservation_hold_with_the_norm_folded():
    import latim_jax

    for version in (1, 2):
        model = _model(version)
        tokens = np.random.default_rng(0).integers(0, 40, (1, 19))
        fused = model(tokens)  # 19 positions: below Block.fold_from, the norm is not folded
        model = latim_jax.MambaLM(model.config, model.params(), fold_from=1)  # folded from 1 position on
        folded = model(tokens)
        assert rel_err(folded, fused) < 1e-5
        assert not np.array_equal(np.asarray(folded), np.asarray(fused))  # the two branches both ran
        for layer in range(2):
            assert latim_jax.conservation_error(model, tokens, layer) < 1e-5


def test_the_fold_depends_on_the_length_not_the_batch():
    """A prompt alone and inside a batch take the same branch: 8 prompts of 600 positions (4800 rows,
    past the 4096 rows at which the fold used to start) stay unfolded, like one prompt, and both equal
    the unfolded form bitwise."""
    block = _model(2, n_layers=1).layers[0]
    assert block.fold_from > 600
    h = jnp.asarray(np.random.default_rng(0).standard_normal((8, 600, 16)), jnp.float32)
    m = block.mixer
    for x in (h[:1], h):
        unfolded = normed_linear(x, block.norm[...], m.in_proj[...], EPS, fold=False)
        np.testing.assert_array_equal(block.projected(x), unfolded)


def test_mixer_takes_exactly_one_of_input_and_projection():
    import latim_jax
    from latim_jax.model.config import MambaConfig
    from latim_jax.model.init import init_params

    cfg = MambaConfig(version=2, d_model=16, n_layers=1, vocab_size=40, d_state=4, head_dim=4, chunk_size=8)
    block = latim_jax.MambaLM(cfg, init_params(cfg, 0)).layers[0]
    h = jnp.asarray(np.random.default_rng(0).standard_normal((1, 5, 16)), jnp.float32)
    xz, valid = block.projected(h), jnp.ones((1, 5), bool)
    got, want = block.mixer(projected=xz, mask=valid), block.mixer(block.normed(h), mask=valid)
    np.testing.assert_array_equal(got, want)  # short: bitwise
    for kwargs in ({}, {"x": block.normed(h), "projected": xz}):
        with pytest.raises(ValueError, match="exactly one of x"):
            block.mixer(**kwargs, mask=valid)
