"""The multi-head latent attention kind ("mla", Kimi Linear's full attention): the mixer against
transformers' KimiLinearAttention (a query latent or not), and its decomposition through a hybrid with
the delta-rule kinds: exact conservation, the logit identity, padding, row subsets and generation."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_logit_identity_padding_and_rows, rel_err

import latim_jax
from latim_jax.model.generate import generate
from latim_jax.model.init import init_params
from latim_jax.model.mla import MLAConfig

CONFIG = latim_jax.MambaConfig(
    version=2, d_model=16, n_layers=3, vocab_size=40, layer_kinds=("kda", "mla", "mlp"), mlp_width=24,
    sections={"kda": dict(k_heads=2, v_heads=2, k_dim=8, v_dim=8, chunk=8),
              "mla": dict(heads=2, kv_rank=8, nope_dim=6, shared_dim=4, v_dim=5, q_rank=12, bias=True)},
)  # fmt: skip


@pytest.mark.slow
def test_mla_layers_conserve_with_padding_rows_and_generation():
    model = latim_jax.MambaLM(CONFIG, init_params(CONFIG, 2))
    tokens = np.random.default_rng(0).integers(0, 40, (2, 21))
    mask = np.ones(tokens.shape, bool)
    mask[1, :5] = False
    for mode in ("exact", "paper"):  # attention is exact in both modes
        assert latim_jax.conservation_error(model, tokens, 1, mode, mask=mask) < 2e-6
    a = latim_jax.attribute(model, tokens[:1], method="hidden_attention", layers=[1])
    np.testing.assert_allclose(a.scores.sum(-1), 1.0, rtol=1e-5)  # its softmax rows
    assert_logit_identity_padding_and_rows(model, tokens)
    out = np.asarray(generate(model, tokens[:, :6], max_new_tokens=3))
    np.testing.assert_array_equal(out[:, 6:], np.asarray(model(out[:, :-1])).argmax(-1)[:, 5:])
    with pytest.raises(ValueError, match=r"sections\['mla'\].kv_rank must be a positive int"):
        MLAConfig(heads=2, kv_rank=0, nope_dim=4, shared_dim=2, v_dim=4)


@pytest.mark.torch
@pytest.mark.parametrize("q_rank", [None, 12])
def test_the_mla_mixer_equals_transformers_kimi_linear_attention(q_rank):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.models.kimi_linear import modeling_kimi_linear as km

    hf = transformers.KimiLinearConfig(
        hidden_size=16, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=q_rank, kv_lora_rank=8,
        qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5, num_hidden_layers=1, vocab_size=40,
        pad_token_id=None, bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    hf._attn_implementation = "eager"
    torch.manual_seed(0)
    layer = km.KimiLinearAttention(hf, 0).eval()
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if "layernorm" in name:
                p.uniform_(0.5, 1.5)
    t = {k: v.detach().numpy() for k, v in layer.state_dict().items()}
    params = {"kv_a": t["kv_a_proj_with_mqa.weight"].T, "kv_norm": t["kv_a_layernorm.weight"],
              "kv_b": t["kv_b_proj.weight"].T, "o_proj": t["o_proj.weight"].T}  # fmt: skip
    if q_rank:
        params.update(
            q_a=t["q_a_proj.weight"].T, q_a_norm=t["q_a_layernorm.weight"], q_b=t["q_b_proj.weight"].T
        )
    else:
        params["q_proj"] = t["q_proj.weight"].T
    section = MLAConfig(
        heads=2, kv_rank=8, nope_dim=6, shared_dim=4, v_dim=5, q_rank=q_rank or 0, norm_eps=1e-6
    )
    cfg = latim_jax.MambaConfig(
        version=2, d_model=16, n_layers=1, vocab_size=40, layer_kinds=("mla",), sections={"mla": section}
    )
    model = latim_jax.MambaLM(
        cfg, {**init_params(cfg, 0), "layers": [{"norm": np.ones(16, np.float32), "mixer": params}]}
    )
    x = np.random.default_rng(0).normal(size=(2, 13, 16)).astype(np.float32)
    causal = torch.full((13, 13), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        want = layer(torch.from_numpy(x), attention_mask=causal)[0].numpy()
    assert rel_err(model.layers[0].mixer(jnp.asarray(x), mask=jnp.ones((2, 13), bool)), want) < 1e-5


@pytest.mark.torch
def test_a_kimi_linear_checkpoint_decomposes_exactly(tmp_path):
    """A tiny Kimi Linear written by transformers' save_pretrained (KDA, latent attention with a query
    latent, a dense MLP, grouped sigmoid experts): every sublayer conserves in exact mode, and the logit
    identity, padding and row subsets hold through the whole model."""
    pytest.importorskip("torch")
    from families import kimi_linear

    kimi_linear().save_pretrained(tmp_path)
    model = latim_jax.load(tmp_path)
    assert set(model.config.kinds) == {"kda", "mla", "mlp", "moe"}
    tokens = np.random.default_rng(4).integers(0, model.config.n_tokens, (2, 21))
    mask = np.ones(tokens.shape, bool)
    mask[1, :4] = False
    for kind in dict.fromkeys(model.config.kinds):  # the first sublayer of each kind
        layer = model.config.kinds.index(kind)
        assert latim_jax.conservation_error(model, tokens, layer, mask=mask) < 2e-6, layer
    assert_logit_identity_padding_and_rows(model, tokens)
