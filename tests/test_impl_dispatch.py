"""impl="pallas" (kernels in interpret mode on CPU) equals impl="xla" end to end."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import rel_err as rel

import latim_jax
from latim_jax.config import MambaConfig
from latim_jax.init import init_params

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
    assert rel(model(tokens, impl="pallas"), model(tokens, impl="xla")) < TOL["logits"]
    # every fused-score method in exact mode; paper mode only changes the per-source factors the kernel
    # reads (tests/test_kernels_scores.py covers both modes at kernel level), so one paper-mode method
    cases = [(m, "exact") for m in ("l2", "l1", "alti", "logit")] + [
        ("l2", "paper"),
        ("hidden_attention", "exact"),
    ]
    for method, mode in cases:
        x = latim_jax.attribute(model, tokens, method=method, mode=mode, impl="xla")
        p = latim_jax.attribute(model, tokens, method=method, mode=mode, impl="pallas")
        assert rel(p.scores, x.scores) < TOL["scores"], (method, mode)
