"""Contrastive targets (``foil=``): the scores explain logit(target) - logit(foil), exactly for "logit"."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import rel_err as rel
from test_attribution import make, tokens

import latim_jax


def _logit_difference(model, t, target, foil):
    """logit(target) - logit(foil) at every position, from the model's own (b, l, v) logits."""
    lg = np.asarray(model(t))
    pick = lambda ids: np.take_along_axis(lg, ids[..., None], -1)[..., 0]  # noqa: E731
    return pick(target) - pick(foil)


@pytest.mark.parametrize("name", ["m1", "m2"])
def test_logit_of_target_minus_foil_is_direct_plus_contributions_plus_bias(name):
    model = make(name)
    t = tokens()
    rng = np.random.default_rng(5)
    target, foil = rng.integers(0, 32, t.shape), rng.integers(0, 32, t.shape)
    a = latim_jax.attribute(model, t, method="logit", target=target, foil=foil)
    want = _logit_difference(model, t, target, foil)
    assert rel(a.extra["logit"], want) < 1e-5
    total = a.extra["direct"] + a.scores.sum((1, 3)) + a.extra["bias"].sum(1)
    assert rel(total, want) < 1e-5
    np.testing.assert_array_equal(a.extra["foil"], foil)
    np.testing.assert_array_equal(a.extra["targets"], target)
    # through the rollout as well: rows sum to the difference minus the layers' bias terms
    assert rel(np.asarray(a.rollout()).sum(-1) + a.extra["bias"].sum(1), want) < 1e-5
    # the contrast is the difference of the two single-target attributions, score by score
    one = latim_jax.attribute(model, t, method="logit", target=target)
    other = latim_jax.attribute(model, t, method="logit", target=foil)
    for key in ("direct", "bias", "logit"):
        assert rel(a.extra[key], one.extra[key] - other.extra[key]) < 1e-5, key
    assert rel(a.scores, one.scores - other.scores) < 1e-5


def test_foil_with_padding_and_a_row_subset():
    """A left-padded prompt's contrast equals the prompt alone; rows=[-1] equals that row of the map."""
    model = make("m2")
    t = tokens(batch=2, length=9)
    mask = np.ones(t.shape, bool)
    mask[1, :3] = False
    target, foil = np.full(t.shape, 4), np.full(t.shape, 9)
    full = latim_jax.attribute(model, t, method="logit", mask=mask, target=target, foil=foil)
    alone = latim_jax.attribute(model, t[1:, 3:], method="logit", target=4, foil=9)
    np.testing.assert_allclose(full.scores[1, :, 3:, 3:], alone.scores[0], rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(full.extra["logit"][1, 3:], alone.extra["logit"][0], rtol=2e-5, atol=2e-6)
    last = latim_jax.attribute(model, t, method="logit", mask=mask, target=target, foil=foil, rows=[-1])
    np.testing.assert_allclose(last.scores[:, :, 0], full.scores[:, :, -1], rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(last.extra["logit"][:, 0], full.extra["logit"][:, -1], rtol=2e-5, atol=2e-6)


def test_grad_input_of_a_foil_is_the_jacobian_of_the_logit_difference():
    model = make("m2")
    t = tokens(batch=1, length=6)
    target, foil = np.full(t.shape, 3), np.full(t.shape, 11)
    res = latim_jax.attribute(model, t, method="grad_input", layers=[1], target=target, foil=foil)
    h = model.forward(t).residuals[1]

    def difference(x, i):
        lg = model.head(model.layers[1](x, mask=jnp.ones(x.shape[:2], bool)))
        return lg[0, i, 3] - lg[0, i, 11]

    for i in (0, 5):
        g = jax.grad(difference)(h, i)
        assert rel(res.scores[0, 0, i], np.linalg.norm(np.asarray(g * h)[0], axis=-1)) < 1e-4


def test_a_foil_is_refused_where_no_target_is_read_and_checked_like_a_target():
    model = make("m1")
    t = tokens(batch=1, length=5)
    with pytest.raises(ValueError, match="foil= contrasts two vocabulary targets.*method='alti'"):
        latim_jax.attribute(model, t, method="alti", foil=3)
    with pytest.raises(ValueError, match=r"foil ids must lie in \[0, 32\)"):
        latim_jax.attribute(model, t, method="logit", foil=32)
    with pytest.raises(ValueError, match=r"foil must be an int or int ids of shape \(1, 5\)"):
        latim_jax.attribute(model, t, method="logit", foil=np.zeros((1, 4), int))
