"""The Gated DeltaNet kind ("gdn"): the chunked rule against an independent float64 recurrence, M against
its definition as a product of the A_t in float64, the mixer against transformers' Qwen3-Next Gated
DeltaNet, and the decomposition through a hybrid: exact conservation, the paper mode's reported error,
the logit identity, causality, padding, row subsets, generation, vmap and gradients."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_l2_vmap_and_gradient, assert_logit_identity_padding_and_rows, rel_err

import latim_jax
from latim_jax.cli.info import summary
from latim_jax.convert.delta_rule import kimi_kda, qwen3_next_gdn
from latim_jax.kernels import delta_rule
from latim_jax.latim.kinds import layer_factors
from latim_jax.model.delta_rule import DeltaRuleConfig
from latim_jax.model.generate import generate
from latim_jax.model.init import init_params

SECTION = dict(k_heads=2, v_heads=4, k_dim=8, v_dim=6, chunk=8, conv_bias=True)
CONFIG = latim_jax.MambaConfig(
    version=2, d_model=16, n_layers=4, vocab_size=40, d_state=4, head_dim=8, chunk_size=8,
    layer_kinds=("gdn", "mlp", "attention", "gdn"), attn_heads=2, attn_kv_heads=1, attn_head_dim=8,
    mlp_width=24, mlp_gated=True, sections={"gdn": SECTION},
)  # fmt: skip


def _inputs(b=2, length=19, heads=4, dk=5, dv=3, seed=0, beta_scale=1.0, per_channel=False):
    """q, k normalised (q scaled), v, g <= 0 (per head, or per key channel), beta, in float64."""
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(b, length, heads, dk))
    k = rng.normal(size=(b, length, heads, dk))
    q = q / np.linalg.norm(q, axis=-1, keepdims=True) / np.sqrt(dk)
    k = k / np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.normal(size=(b, length, heads, dv))
    g = -rng.uniform(0.01, 0.7, size=(b, length, heads, dk) if per_channel else (b, length, heads))
    beta = beta_scale * rng.uniform(0.05, 0.95, size=(b, length, heads))
    return q, k, v, g, beta


def _transition(g_t, k_t, beta_t, dk):
    """A_t = (I - beta_t k_t k_t^T) D_t, D_t = e^{g_t} I or Diag(e^{g_t}) (b, H, k, k), float64."""
    D = np.exp(g_t)[..., None, None] * np.eye(dk) if g_t.ndim == 2 else np.exp(g_t)[..., None] * np.eye(dk)
    return (np.eye(dk) - beta_t[..., None, None] * k_t[..., :, None] * k_t[..., None, :]) @ D


def _recurrence64(q, k, v, g, beta):
    """o_t = S_t^T q_t, S_t = A_t S_{t-1} + beta_t k_t v_t^T, in float64."""
    b, length, H, dk = k.shape
    S = np.zeros((b, H, dk, v.shape[-1]))
    out = np.zeros(v.shape)
    for t in range(length):
        kt, bt = k[:, t], beta[:, t][..., None, None]
        S = _transition(g[:, t], kt, beta[:, t], dk) @ S + bt * kt[..., :, None] * v[:, t][..., None, :]
        out[:, t] = np.einsum("bhkv,bhk->bhv", S, q[:, t])
    return out


def _m64(q, k, g, beta):
    """M[t, j] = beta_j q_t^T A_t ... A_{j+1} k_j (b, H, l, l) from the product of the A_t, float64."""
    b, length, H, dk = k.shape
    M = np.zeros((b, H, length, length))
    for j in range(length):
        P = np.broadcast_to(np.eye(dk), (b, H, dk, dk)).copy()
        for t in range(j, length):
            if t > j:
                P = _transition(g[:, t], k[:, t], beta[:, t], dk) @ P
            M[:, :, t, j] = beta[:, j] * np.einsum("bhk,bhkl,bhl->bh", q[:, t], P, k[:, j])
    return M


@pytest.mark.parametrize(
    "length, chunk, per_channel", [(19, 8, False), (16, 16, False), (5, 8, False), (19, 8, True)]
)
def test_the_chunked_rule_equals_the_recurrence(length, chunk, per_channel):
    """Gated DeltaNet's decay per head and KDA's per key channel."""
    q, k, v, g, beta = _inputs(length=length, per_channel=per_channel)
    f32 = [jnp.asarray(x, jnp.float32) for x in (q, k, v, g, beta)]
    o, S = delta_rule.chunked(*f32, chunk)
    assert rel_err(o, _recurrence64(q, k, v, g, beta)) < 2e-6
    Sr = jnp.zeros_like(S)
    for t in range(length):  # the one-token step carries the same state
        _, Sr = delta_rule.step(Sr, *(x[:, t] for x in f32))
    assert rel_err(S, Sr) < 2e-6


@pytest.mark.parametrize("per_channel", [False, True])
def test_m_tiles_equal_the_product_of_the_transitions(per_channel):
    """Rows in any order, a column tile starting mid-sequence and running past the end, beta in (0, 2)
    (OLMo-Hybrid's negative eigenvalues), a decay per head or per key channel (KDA): M from the one-hot
    recurrence equals its definition; M v is the rule's output."""
    q, k, v, g, beta = _inputs(length=13, beta_scale=2.0, per_channel=per_channel)
    M = _m64(q, k, g, beta)
    f32 = [jnp.asarray(x, jnp.float32) for x in (q, k, g, beta)]
    rows = jnp.array([12, 3, 7, 0])
    tile = delta_rule.m_tile(*f32, rows, 5, 11)  # columns 5..15: 13..15 past the end
    want = np.zeros((2, 4, 4, 11))
    want[..., :8] = M[:, :, np.asarray(rows), 5:13]
    np.testing.assert_allclose(tile, want, rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(tile)[:, :, 1, 0:] == 0) and np.all(np.asarray(tile)[:, :, 3] == 0)  # causal
    full = delta_rule.m_tile(*f32, jnp.arange(13), 0, 13)
    o = np.einsum("bhtj,bjhv->bthv", np.asarray(full, np.float64), v)
    assert rel_err(o, _recurrence64(q, k, v, g, beta)) < 2e-6


def test_the_config_section_is_checked():
    with pytest.raises(ValueError, match=r"v_heads 3 is not a multiple of k_heads 2"):
        DeltaRuleConfig(k_heads=2, v_heads=3, k_dim=4, v_dim=4)
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['heads'\] in sections\['gdn'\]"):
        DeltaRuleConfig.from_dict({"heads": 2})
    with pytest.raises(ValueError, match=r"layer kind 'gdn' needs its config section"):
        latim_jax.MambaConfig(version=2, d_model=16, n_layers=1, vocab_size=40, layer_kinds=("gdn",))
    assert latim_jax.MambaConfig.from_dict(CONFIG.to_dict()) == CONFIG


def test_info_names_the_kind_and_its_section():
    """`latim-jax info` on a model without a Mamba mixer prints no Mamba fields, and prints the gdn
    section and the attention's options."""
    cfg = latim_jax.MambaConfig(
        version=2, d_model=16, n_layers=2, vocab_size=40, layer_kinds=("gdn", "attention"), attn_heads=2,
        attn_kv_heads=1, attn_head_dim=8, attn_output_gate=True, sections={"gdn": SECTION},
    )  # fmt: skip
    text = summary(latim_jax.MambaLM(cfg, init_params(cfg, 0)))
    assert "no Mamba mixer" in text and "state" not in text.splitlines()[1], text
    assert "Gated DeltaNet k_heads 2, v_heads 4, k_dim 8, v_dim 6" in text and "output gate" in text, text


@pytest.fixture(scope="module")
def hybrid():
    return latim_jax.MambaLM(CONFIG, init_params(CONFIG, 7))


def _tokens(b=2, length=21, seed=0):
    return np.random.default_rng(seed).integers(0, CONFIG.n_tokens, (b, length))


@pytest.mark.slow
@pytest.mark.parametrize("layer", [0, 3])
def test_gdn_layers_conserve_exactly_and_paper_mode_reports_its_error(hybrid, layer):
    tokens = _tokens()
    mask = np.ones(tokens.shape, bool)
    mask[1, :5] = False
    assert latim_jax.conservation_error(hybrid, tokens, layer, "exact", mask=mask) < 2e-6
    assert latim_jax.conservation_error(hybrid, tokens, layer, "paper", mask=mask) > 1e-3
    C = latim_jax.contributions(hybrid, tokens, layer, mask=mask)
    T = np.asarray(C.T)
    iu = np.triu_indices(21, 1)
    assert np.all(T[:, iu[0], iu[1]] == 0)  # causal
    assert np.all(T[1, :, :5] == 0)  # padding sources contribute nothing
    assert rel_err((T.sum(2) + np.asarray(C.bias))[mask], np.asarray(C.output)[mask]) < 2e-6


@pytest.mark.slow
def test_gdn_contributions_equal_the_float64_map(hybrid):
    """T_i(x_j) from the factors equals W_out(G_i * sum_k M64[i, j+k] a_k[j]) with M64 from the product
    of the A_t (the test's own float64 definition, not the one-hot recurrence under test)."""
    tokens = _tokens(b=1, length=15)
    h = hybrid.forward(tokens).residuals[0]
    f = layer_factors(hybrid, h, 0)
    M = _m64(*(np.asarray(x, np.float64) for x in (f.q, f.k, f.g, f.beta)))  # (1, H, l, l)
    a = np.asarray(f.a, np.float64)  # (1, K, l, e)
    _, K, L, e = a.shape
    H = M.shape[1]
    V = np.zeros((1, L, L, H, e // H))
    for t in range(K):
        shifted = np.zeros((1, H, L, L))
        shifted[..., : L - t] = M[..., t:]  # M[i, j + t]
        V += np.einsum("bhij,bjhv->bijhv", shifted, a[:, t].reshape(1, L, H, e // H))
    T = (V.reshape(1, L, L, e) * np.asarray(f.G)[:, :, None]) @ np.asarray(f.W_out, np.float64)
    got = latim_jax.contributions(hybrid, tokens, 0).T
    assert rel_err(got, T) < 1e-5


@pytest.mark.slow
def test_logit_identity_padding_and_rows_through_the_hybrid(hybrid):
    assert_logit_identity_padding_and_rows(hybrid, _tokens())


@pytest.mark.slow
def test_right_padding_and_generation_equal_the_forward(hybrid):
    tokens = _tokens(length=12)
    mask = np.ones(tokens.shape, bool)
    mask[0, 9:] = False
    padded = hybrid(tokens, mask=mask)
    alone = hybrid(tokens[:1, :9])
    np.testing.assert_allclose(np.asarray(padded)[0, :9], alone[0], rtol=1e-5, atol=1e-5)
    out = np.asarray(generate(hybrid, tokens[:, :6], max_new_tokens=4))
    greedy = np.asarray(hybrid(out[:, :-1])).argmax(-1)[:, 5:]
    np.testing.assert_array_equal(out[:, 6:], greedy)


@pytest.mark.slow
def test_vmap_and_gradient(hybrid):
    embeds = jnp.asarray(np.random.default_rng(3).normal(size=(2, 11, 16)), jnp.float32)
    # the last gdn layer: its scores' gradient runs back through every layer below it. (Layers [0, 3]
    # summed cancel, -3.29 + 2.57, which amplifies the central difference's fp32 error past 2e-3; each
    # alone converges to jax.grad as eps shrinks: layer 0 -3.2849 at 1e-3 vs -3.2890, layer 3 2.5721 vs
    # 2.5722, and jax.jvp agrees with jax.grad to 2e-6.)
    assert_l2_vmap_and_gradient(hybrid, embeds, [3])


@pytest.mark.torch
def test_the_mixer_equals_transformers_qwen3_next_gated_deltanet():
    """One Qwen3-Next Gated DeltaNet (grouped heads, interleaved in_proj_qkvz / in_proj_ba) read into the
    gdn layout: the same output as transformers' module (its chunked torch path) at a length that crosses
    the chunk (64) and is not a multiple of it."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3_next import modeling_qwen3_next as qn

    hf = transformers.Qwen3NextConfig(
        hidden_size=16, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8,
        linear_value_head_dim=6, linear_conv_kernel_dim=4, num_hidden_layers=1,
        layer_types=["linear_attention"], rms_norm_eps=1e-6, vocab_size=40, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8,
    )  # fmt: skip
    torch.manual_seed(0)
    layer = qn.Qwen3NextGatedDeltaNet(hf, 0).eval()
    with torch.no_grad():
        layer.dt_bias.normal_()
        layer.norm.weight.uniform_(0.5, 1.5)
    section = DeltaRuleConfig(k_heads=2, v_heads=4, k_dim=8, v_dim=6, chunk=64)
    cfg = latim_jax.MambaConfig(
        version=2, d_model=16, n_layers=1, vocab_size=40, layer_kinds=("gdn",), sections={"gdn": section}
    )
    tensors = {k: v.detach().numpy() for k, v in layer.state_dict().items()}
    params = qwen3_next_gdn(tensors, section, 16)
    mixer = (
        latim_jax.MambaLM(
            cfg, {**init_params(cfg, 0), "layers": [{"norm": np.ones(16, np.float32), "mixer": params}]}
        )
        .layers[0]
        .mixer
    )
    x = np.random.default_rng(0).normal(size=(2, 77, 16)).astype(np.float32)
    with torch.no_grad():
        want = layer(torch.from_numpy(x)).numpy()
    got = mixer(jnp.asarray(x), mask=jnp.ones((2, 77), bool))
    assert rel_err(got, want) < 1e-5


@pytest.mark.torch
def test_a_qwen3_next_checkpoint_decomposes_exactly(tmp_path):
    """A tiny Qwen3-Next written by transformers' save_pretrained: every sublayer (Gated DeltaNet, gated
    attention with q/k norms, experts with a gated shared expert, MLP) conserves in exact mode, and the
    logit identity, padding and row subsets hold through the whole model."""
    pytest.importorskip("torch")
    from families import qwen3_next

    qwen3_next().save_pretrained(tmp_path)
    model = latim_jax.load(tmp_path)
    assert set(model.config.kinds) == {"gdn", "attention", "moe", "mlp"}
    tokens = np.random.default_rng(4).integers(0, model.config.n_tokens, (2, 21))
    mask = np.ones(tokens.shape, bool)
    mask[1, :4] = False
    for kind in dict.fromkeys(model.config.kinds):  # the first sublayer of each kind
        layer = model.config.kinds.index(kind)
        assert latim_jax.conservation_error(model, tokens, layer, mask=mask) < 2e-6, layer
    assert_logit_identity_padding_and_rows(model, tokens)


@pytest.mark.torch
def test_an_olmo_hybrid_checkpoint_decomposes_exactly(tmp_path):
    """A tiny OLMo-Hybrid written by transformers' save_pretrained: its pre-norm Gated DeltaNet (beta in
    (0, 2)), its post-norm attention and the post-norm MLP after it (h + RMSNorm(o), the norm's scale
    held) conserve in exact mode with padding, and the logit identity, padding and row subsets hold
    through the whole model."""
    pytest.importorskip("torch")
    from families import olmo_hybrid

    olmo_hybrid().save_pretrained(tmp_path)
    model = latim_jax.load(tmp_path)
    c = model.config
    assert c.kinds[:4] == ("gdn", "mlp", "attention", "mlp") and c.post_norm_layers == (2, 3)
    assert c.section("gdn").beta_scale == 2.0
    tokens = np.random.default_rng(4).integers(0, c.n_tokens, (2, 21))
    mask = np.ones(tokens.shape, bool)
    mask[1, :4] = False
    for layer in (0, 2, 3):
        assert latim_jax.conservation_error(model, tokens, layer, mask=mask) < 2e-6, layer
    assert_logit_identity_padding_and_rows(model, tokens)


KDA_CONFIG = latim_jax.MambaConfig(
    version=2, d_model=16, n_layers=2, vocab_size=40, layer_kinds=("kda", "mlp"), mlp_width=24,
    sections={"kda": dict(k_heads=2, v_heads=2, k_dim=8, v_dim=8, chunk=8, conv_bias=True)},
)  # fmt: skip


@pytest.mark.slow
def test_kda_layers_conserve_with_padding_rows_and_generation():
    """Kimi Delta Attention (a decay per key channel, sigmoid-gated norm): exact conservation with
    padding, the paper mode's error reported, the logit identity, padding and rows through the model,
    generation = the forward, and its heads checked."""
    model = latim_jax.MambaLM(KDA_CONFIG, init_params(KDA_CONFIG, 5))
    tokens = _tokens()
    mask = np.ones(tokens.shape, bool)
    mask[1, :5] = False
    assert latim_jax.conservation_error(model, tokens, 0, "exact", mask=mask) < 2e-6
    assert latim_jax.conservation_error(model, tokens, 0, "paper", mask=mask) > 1e-3
    assert_logit_identity_padding_and_rows(model, tokens)
    out = np.asarray(generate(model, tokens[:, :6], max_new_tokens=3))
    np.testing.assert_array_equal(out[:, 6:], np.asarray(model(out[:, :-1])).argmax(-1)[:, 5:])
    with pytest.raises(ValueError, match="k_heads == v_heads"):
        latim_jax.MambaConfig(
            version=2, d_model=16, n_layers=1, vocab_size=40, layer_kinds=("kda",),
            sections={"kda": dict(k_heads=1, v_heads=2, k_dim=8, v_dim=8)},
        )  # fmt: skip


@pytest.mark.torch
def test_the_kda_mixer_equals_transformers_kimi_delta_attention():
    """One Kimi Linear delta attention (low-rank forget and output gates, a decay per key channel) read
    into the kda layout: transformers' module's output (its chunked torch path, chunk 64) to 1e-5 at a
    length past our chunk of 16."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.models.kimi_linear import modeling_kimi_linear as km

    hf = transformers.KimiLinearConfig(
        hidden_size=16, linear_num_heads=2, linear_head_dim=8, linear_conv_kernel_dim=4, num_hidden_layers=1,
        vocab_size=40, rms_norm_eps=1e-6, pad_token_id=None, bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    layer = km.KimiLinearDeltaAttention(hf, 0).eval()
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if "dt_bias" in name or "A_log" in name:
                p.normal_(0, 0.5)
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
    section = DeltaRuleConfig(k_heads=2, v_heads=2, k_dim=8, v_dim=8, chunk=16)
    cfg = latim_jax.MambaConfig(
        version=2, d_model=16, n_layers=1, vocab_size=40, layer_kinds=("kda",), sections={"kda": section}
    )
    params = kimi_kda({k: v.detach().numpy() for k, v in layer.state_dict().items()}, section, 16)
    mixer = (
        latim_jax.MambaLM(
            cfg, {**init_params(cfg, 0), "layers": [{"norm": np.ones(16, np.float32), "mixer": params}]}
        )
        .layers[0]
        .mixer
    )
    x = np.random.default_rng(0).normal(size=(2, 37, 16)).astype(np.float32)
    with torch.no_grad():
        want = layer(torch.from_numpy(x)).numpy()
    assert rel_err(mixer(jnp.asarray(x), mask=jnp.ones((2, 37), bool)), want) < 1e-5
