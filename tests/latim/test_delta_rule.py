"""The Gated DeltaNet kind ("gdn"): the chunked rule against an independent float64 recurrence, M against
its definition as a product of the A_t in float64, the mixer against transformers' Qwen3-Next Gated
DeltaNet, and the decomposition through a hybrid: exact conservation, the paper mode's reported error,
the logit identity, causality, padding, row subsets, generation, vmap and gradients."""

from __future__ import annotations

import jax
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


def _tile64(M, rows, c0, width):
    """M[rows, c0 : c0 + width] of the float64 map M (b, H, l, l), zero past the end."""
    length = M.shape[-1]
    out = np.zeros(M.shape[:2] + (len(rows), width))
    hi = min(length, c0 + width)
    if hi > c0:
        out[..., : hi - c0] = M[:, :, np.asarray(rows), c0:hi]
    return out


@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("chunk", [8, 16])
def test_m_tiles_equal_the_product_of_the_transitions(per_channel, chunk):
    """M's tiles from the per-chunk factors (one scan over chunks per tile) equal M's definition as a
    product of the A_t in float64, for a decay per head (gdn) or per key channel (kda) and beta in (0, 2)
    (OLMo-Hybrid's negative eigenvalues), small decays so that M reaches across many chunks: rows in any
    order spread over chunks, repeated (the padded last row tile), the last row alone, column ranges
    straddling chunk boundaries and running past the end (l = 131 is not a multiple of the chunk),
    a tile above the diagonal; M v is the rule's output."""
    q, k, v, g, beta = _inputs(b=2, length=131, heads=2, dk=16, dv=3, beta_scale=2.0, per_channel=per_channel)
    g = 0.03 * g  # decays ~e^{-1} over the sequence: far pairs carry weight (M[129, 3] ~ 1e-4 .. 2e-3)
    M = _m64(q, k, g, beta)
    assert np.abs(M[..., 129, 3]).max() > 1e-4
    tf = delta_rule.tile_factors(*(jnp.asarray(x, jnp.float32) for x in (q, k, g, beta)), chunk)
    cases = [
        ([129, 3, 70], 0, 140),  # every column, 131..139 past the end
        ([70, 129, 3], 60, 20),  # columns straddling the chunk boundaries at 64 (and 72 with chunk 8)
        ([130], 120, 16),  # the last row alone, columns past the end
        ([128, 129, 130, 130], 125, 6),  # a padded last row tile: its final row repeated
        ([3, 5], 70, 12),  # above the diagonal: zeros
        (list(range(131)), 0, 131),  # the whole map
    ]
    for rows, c0, width in cases:
        tile = np.asarray(delta_rule.m_tile(tf, jnp.array(rows), c0, width))
        want = _tile64(M, rows, c0, width)
        np.testing.assert_allclose(tile, want, rtol=1e-4, atol=1e-6, err_msg=str((rows, c0, width)))
        above = np.asarray(rows)[:, None] < c0 + np.arange(width)[None, :]
        assert np.all(tile[:, :, above] == 0), (rows, c0, width)  # causal, exactly
    o = np.einsum("bhtj,bjhv->bthv", np.asarray(tile, np.float64), v)
    assert rel_err(o, _recurrence64(q, k, v, g, beta)) < 2e-6


def test_m_tiles_take_traced_columns_and_rows_and_a_gradient():
    """Under jit with a traced first column and rows (as the block loop calls it), and differentiated
    through the factors: the tile and the gradient of a weighted sum of it wrt q, k, g and beta equal
    central differences (float32, eps 1e-3) in a random direction."""
    q, k, _, g, beta = _inputs(b=1, length=21, heads=2, dk=4, beta_scale=2.0)
    args = [jnp.asarray(x, jnp.float32) for x in (q, k, 0.3 * g, beta)]
    rows, c0 = jnp.array([20, 9, 14]), 5
    weights = jnp.asarray(np.random.default_rng(1).normal(size=(1, 2, 3, 10)), jnp.float32)

    @jax.jit
    def f(args, rows, c0):
        return jnp.sum(weights * delta_rule.m_tile(delta_rule.tile_factors(*args, 8), rows, c0, 10))

    M = _m64(*(np.asarray(x, np.float64) for x in args))
    tile = jax.jit(lambda a, r, c: delta_rule.m_tile(delta_rule.tile_factors(*a, 8), r, c, 10))(
        args, rows, c0
    )
    np.testing.assert_allclose(tile, _tile64(M, [20, 9, 14], 5, 10), rtol=1e-4, atol=1e-6)
    grad = jax.grad(f)(args, rows, c0)
    rng = np.random.default_rng(2)
    direction = [jnp.asarray(rng.normal(size=x.shape), jnp.float32) for x in args]
    eps = 1e-3
    plus = f([x + eps * d for x, d in zip(args, direction, strict=True)], rows, c0)
    minus = f([x - eps * d for x, d in zip(args, direction, strict=True)], rows, c0)
    fd = (plus - minus) / (2 * eps)
    ad = sum(jnp.sum(gr * d) for gr, d in zip(grad, direction, strict=True))
    assert abs(float(ad) - float(fd)) < 2e-3 * max(1.0, abs(float(fd))), (ad, fd)


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


@pytest.mark.parametrize("C", [6, 64])
def test_the_unit_lower_solve_equals_float64_and_calls_no_lapack_on_cpu(C):
    """The chunk algebra's U^-1 B: equal to numpy's float64 solve, with its gradient, reading only U's
    strictly lower part (a unit diagonal, as the solve it replaces), at a chunk that is a power of two
    and one that is padded to one; and on CPU no LAPACK custom call in the compiled program (jaxlib's
    CPU trsm intermittently deadlocked training steps)."""
    rng = np.random.default_rng(3)
    U = np.eye(C) + np.tril(rng.normal(size=(2, 3, C, C)), -1) * (0.5 if C < 16 else 0.15)
    B = rng.normal(size=(2, 3, C, 5))
    U32, B32 = U.astype(np.float32), B.astype(np.float32)
    assert rel_err(delta_rule.solve_unit_lower(U32, B32), np.linalg.solve(U, B)) < 1e-5
    junk = U32 + np.triu(rng.normal(size=U.shape), 0).astype(np.float32)  # diagonal and above: unread
    assert np.array_equal(delta_rule.solve_unit_lower(junk, B32), delta_rule.solve_unit_lower(U32, B32))
    # d X[5, 1] / d U = -(U^-T e_5) X[:, 1]^T on the strictly lower part, 0 on the unread part
    grad = np.asarray(jax.grad(lambda u: delta_rule.solve_unit_lower(u, B32)[0, 0, 5, 1])(U32))
    X = np.linalg.solve(U[0, 0], B[0, 0])
    ref = -np.outer(np.linalg.solve(U[0, 0].T, np.eye(C)[5]), X[:, 1])
    assert rel_err(np.tril(grad[0, 0], -1), np.tril(ref, -1)) < 1e-4
    assert not np.triu(grad, 0).any()
    text = jax.jit(delta_rule.solve_unit_lower).lower(U32, B32).compile().as_text()
    assert "custom-call" not in text and "custom_call_target" not in text  # the LAPACK solve is one


def test_the_unit_lower_solve_refuses_shapes_it_cannot_solve():
    """A non-square or empty U, an integer U, or a B whose rows are not U's are refused by name, not
    broadcast into a wrong answer."""
    U, B = np.eye(4, dtype=np.float32), np.ones((4, 2), np.float32)
    for bad_u, bad_b, words in (
        (np.ones((4, 3), np.float32), B, "U must be"),
        (U, np.ones((3, 2), np.float32), "B"),
        (np.ones(4, np.float32), B, "U must be"),
    ):
        with pytest.raises(ValueError, match=words):
            delta_rule.solve_unit_lower(bad_u, bad_b)
    for bad, words in ((np.ones((2, 0, 0), np.float32), "C >= 1"), (np.eye(4, dtype=np.int32), "floating")):
        with pytest.raises(ValueError, match=words):
            delta_rule.invert_unit_lower(bad)
