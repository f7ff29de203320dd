"""The layer-kind seam (latim_jax.latim.kinds): every mixer kind of the model package has a decomposition,
an unknown kind is refused by name, and the factors a kind builds honour the interface the scores read."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import rel_err

import latim_jax
from latim_jax.latim.kinds import KINDS, factors, layer_factors
from latim_jax.model import attention, mixers, mlp, moe, parallel_mixer, shared_block
from latim_jax.model.config import LAYER_KINDS
from latim_jax.model.init import init_params
from latim_jax.model.lm import MIXERS
from latim_jax.model.params import ParamModule


def test_every_layer_kind_has_a_module_and_a_decomposition():
    assert set(MIXERS) == set(LAYER_KINDS) == set(KINDS)
    assert all(cls.kind == kind for kind, cls in MIXERS.items())
    # every module class of the model package that names a kind is registered
    named = {
        cls.kind
        for module in (mixers, attention, mlp, moe, parallel_mixer, shared_block)
        for cls in vars(module).values()
        if isinstance(cls, type) and issubclass(cls, ParamModule) and cls.kind
    }
    assert named == set(KINDS)


def test_an_unknown_kind_is_refused_by_name():
    class DeltaNet:
        kind = "gated_deltanet"

    h, mask = jnp.zeros((1, 3, 8)), jnp.ones((1, 3), bool)
    with pytest.raises(
        ValueError, match=r"no decomposition for layer kind 'gated_deltanet'; known kinds: \['attention'"
    ):
        factors(DeltaNet(), h, mask)


@pytest.mark.parametrize("version", [1, 2])
def test_the_factors_honour_the_interface(version):
    """What the scores read of a kind: the pair values projected onto W_out, summed over sources, plus
    beta, give the output (exact mode); token_total is the same sum from one scan; the tiles are a
    complete Blocks; channels_first only changes the layout of the values."""
    extra = {"head_dim": 4, "chunk_size": 8} if version == 2 else {}
    cfg = latim_jax.MambaConfig(version=version, d_model=8, n_layers=1, vocab_size=16, d_state=4, **extra)
    model = latim_jax.MambaLM(cfg, init_params(cfg, 1))
    tokens = np.random.default_rng(0).integers(0, 16, (2, 7))
    h = model.forward(tokens).residuals[0]
    f = layer_factors(model, h, 0)
    assert f.kind == f"mamba{version}" and f.length == 7
    blocks = f.tiles(None, None)
    assert None not in (blocks.rows, blocks.cols, blocks.m1_direct_rows, blocks.m1_few_rows)
    rows = jnp.arange(7)
    V = f.pair_values(rows, 0, 7, blocks)  # (b, r, q, e)
    rebuilt = jnp.einsum("brje,ed->brd", V, f.W_out) + f.bias
    assert rel_err(rebuilt, f.output) < 1e-5
    assert rel_err(f.token_total + f.bias, f.output) < 1e-5
    cf = f.pair_values(rows, 0, 7, blocks, channels_first=True) if version == 1 else None
    if cf is not None:
        np.testing.assert_allclose(jnp.moveaxis(cf, 1, 3), V, rtol=1e-6, atol=1e-7)
