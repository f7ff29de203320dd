"""impl="pallas" (kernels in interpret mode on CPU) equals impl="xla" end to end."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import rel_err as rel

import latim_jax
from latim_jax.model.config import MambaConfig
from latim_jax.model.init import init_params

TOL = {"scores": 2e-5, "logits": 1e-5}
CONFIGS = {
    "m1": MambaConfig(version=1, d_model=16, n_layers=2, vocab_size=32, d_state=4, d_conv=4),
    "m2": MambaConfig(
        version=2,
        d_model=16,
        n_layers=2,
        vocab_size=32,
        d_state=16,
        d_conv=4,
        head_dim=16,
        n_groups=2,
        chunk_size=8,
    ),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_pallas_equals_xla_for_every_method_and_mode(name):
    model = latim_jax.MambaLM(CONFIGS[name], init_params(CONFIGS[name], 1))
    tokens = np.random.default_rng(0).integers(0, 32, (2, 9))
    mask = np.arange(9)[None, :] >= np.array([[0], [2]])  # the second prompt is left-padded by 2
    assert rel(model(tokens, impl="pallas"), model(tokens, impl="xla")) < TOL["logits"]
    assert rel(model(tokens, mask=mask, impl="pallas"), model(tokens, mask=mask, impl="xla")) < TOL["logits"]
    # every fused-score method in exact mode; paper mode only changes the per-source factors the kernel
    # reads (tests/kernels/test_kernels_scores.py covers both modes at kernel level), so one paper-mode method
    cases = [(m, "exact") for m in ("l2", "l1", "alti", "logit")] + [
        ("l2", "paper"),
        ("hidden_attention", "exact"),
    ]
    for method, mode in cases:
        x = latim_jax.attribute(model, tokens, method=method, mode=mode, impl="xla", mask=mask)
        p = latim_jax.attribute(model, tokens, method=method, mode=mode, impl="pallas", mask=mask)
        assert rel(p.scores, x.scores) < TOL["scores"], (method, mode)
        for scores in (np.asarray(p.scores), np.asarray(x.scores)):  # exactly zero above the diagonal
            assert (np.triu(scores, 1) == 0).all() and (scores[1, :, :2] == 0).all(), (method, mode)
            assert (scores[1, :, :, :2] == 0).all(), (method, mode)


def test_finish_scores_masks_noise_before_normalising():
    """A row whose causal entries are all clipped to 0 becomes one-hot on j = i, never mass on j > i,
    however much float noise sits above the diagonal (the raw scores come from two reductions)."""
    import jax.numpy as jnp

    from latim_jax.latim.scores import finish_scores

    raw = np.full((1, 3, 4), 1e-7, np.float32)  # noise everywhere
    raw[0, 1, :2] = 0.0  # row 1: every causal entry clipped
    raw[0, 2, :3] = [0.2, 0.0, 0.6]
    valid = jnp.ones((1, 4), bool)
    got = np.asarray(finish_scores(jnp.asarray(raw), "alti", jnp.asarray([0, 1, 2]), valid))
    np.testing.assert_array_equal(got[0, 1], [0, 1, 0, 0])
    np.testing.assert_allclose(got[0, 2], [0.25, 0, 0.75, 0], rtol=1e-6)
    assert got[0, 0, 0] == 1 and (got[0, 0, 1:] == 0).all()
