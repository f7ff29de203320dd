"""The Mamba variants and hybrid families against transformers, from checkpoints written by transformers'
own save_pretrained: logits and every layer's stream, padded batches, generation, and the failing-first
checks (drop a family feature from the Flax model: the parity test must fail)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from conftest import rel_err
from families import BUILDERS

import latim_jax
from latim_jax.cli.check import begins_with_embeddings
from latim_jax.model.config import param_shapes
from latim_jax.model.generate import generate, prefill
from latim_jax.model.lm import MambaLM

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch

TOL = 1e-5
VARIANTS = {
    "falcon_mamba": ("falcon_mamba", {}),
    "falcon_mamba_bias_untied": ("falcon_mamba", dict(use_bias=True, tied=False, d_state=8, eps=1e-3)),
    "nemotron_h": ("nemotron_h", {}),
    # MHA, one group, a bias on the Mamba projections and the MLP, attention first, plain relu
    "nemotron_h_mha": (
        "nemotron_h",
        dict(pattern="*M-M*", kv_heads=4, n_groups=1, use_bias=True, mlp_bias=True, act="relu", chunk_size=8),
    ),
    # multi-query attention, groups = heads
    "nemotron_h_mqa": ("nemotron_h", dict(pattern="M-*", kv_heads=1, n_groups=4, head_dim=16)),
    # every layer kind, mixture-of-experts with group-limited sigmoid routing and a correction bias
    "nemotron_h_moe": ("nemotron_h", dict(pattern="M*E-ME", chunk_size=8)),
    # the experts in a latent width (projections in and out, biased), a biased MLP and shared expert
    "nemotron_h_latent": ("nemotron_h", dict(pattern="ME-*E", chunk_size=8, latent=12, mlp_bias=True)),
    # softmax over all experts' best two, no renormalisation, one group
    "nemotron_h_moe_flat": (
        "nemotron_h",
        dict(pattern="EM*", n_group=1, norm_topk=False, scale=1.0, top_k=3),
    ),
    "granitemoehybrid": ("granitemoehybrid", {}),
    # the shared MLP alone, no rotary, untied, attention first
    "granitemoehybrid_dense": (
        "granitemoehybrid",
        dict(experts=0, rope=False, tied=False, layer_types=("attention", "mamba", "mamba")),
    ),
    "jamba": ("jamba", {}),
    # attention at layers 1 and 4, experts at 0 and 3 (top 3 of 4), tied, biased projections, MHA
    "jamba_tied_bias": (
        "jamba",
        dict(n_layers=5, attn=(3, 1), experts=(3, 0), top_k=3, tied=True, proj_bias=True, kv_heads=4),
    ),
    # every mu-P multiplier, RMSNorm(y) * SiLU(z) after the scan, GQA, two groups
    "falcon_h1": ("falcon_h1", {}),
    # no SSM norm (so no multiplier of in_proj's segments is normalised away), out_proj biased alone; the
    # SSM as wide as mamba_expand * d (no mamba_d_ssm), 8 heads; attention heads of 12 (not d / heads)
    "falcon_h1_nonorm": (
        "falcon_h1",
        dict(rms_norm=False, projectors_bias=True, n_layers=3, d_ssm=None, mamba_heads=8, head_dim=12),
    ),
    # no multipliers, the gated norm of mamba_ssm (norm after the gate), biases everywhere (in_proj's
    # and out_proj's apart), tied, MHA, one group
    "falcon_h1_plain": (
        "falcon_h1",
        dict(
            norm_before_gate=False,
            multipliers=False,
            mamba_proj_bias=True,
            projectors_bias=True,
            attention_bias=True,
            mlp_bias=True,
            tied=True,
            kv_heads=4,
            n_groups=1,
        ),
    ),  # fmt: skip
    # two tied blocks over three hybrid layers (the third reuses the first's weights with its own adapters),
    # q/k/v adapters, rotary, GELU
    "zamba2": ("zamba2", {}),
    # one block for all, no q/k/v adapters (the MLP's stay), GQA, no rotary, biased projections and MLP,
    # SiLU, untied, a hybrid layer first
    "zamba2_plain": (
        "zamba2",
        dict(
            adapters=False,
            kv_heads=2,
            rope=False,
            mem_blocks=1,
            bias=True,
            act="silu",
            tied=False,
            types="SMSS",
        ),
    ),  # fmt: skip
    # Gated DeltaNet (grouped key heads) and gated, q/k-normed attention with a quarter of each head
    # rotated; routed experts with a sigmoid-gated shared expert, and a dense MLP layer
    "qwen3_next": ("qwen3_next", {}),
    # no experts, attention every third layer rotating the whole head, MHA, tied, no renormalised top-k
    "qwen3_next_dense": (
        "qwen3_next",
        dict(experts=0, interval=3, n_layers=3, tied=True, mlp_only=(), kv_heads=2, rope_fraction=1.0),
    ),
    # Qwen3.5's text models: the Gated DeltaNet's projections stored apart; dense, and with experts
    "qwen3_5": ("qwen3_5", {}),
    "qwen3_5_moe": ("qwen3_5", dict(moe=True, interval=3, n_layers=3, tied=True)),
    # Kimi Delta Attention, latent attention with a query latent, a dense MLP then grouped sigmoid experts
    "kimi_linear": ("kimi_linear", {}),
    # no query latent, every projection biased, one group, latent attention first
    "kimi_linear_plain": (
        "kimi_linear",
        dict(
            q_rank=None,
            bias=True,
            groups=1,
            layer_types=("full_attention", "linear_attention"),
            mlp_types=("sparse", "dense"),
        ),
    ),  # fmt: skip
    "kimi_linear_bias": ("kimi_linear", dict(bias=True)),  # the query latent's bias too
    # pre-norm Gated DeltaNet layers (beta in (0, 2)) and post-norm attention layers with full-width q/k
    # norms and rotary; a SwiGLU MLP after each (post-norm after an attention)
    "olmo_hybrid": ("olmo_hybrid", {}),
    # NoPE (rope_theta null), beta in (0, 1), attention first, MHA, as many key as value heads, tied
    "olmo_hybrid_nope": (
        "olmo_hybrid",
        dict(
            rope=False,
            neg_eigval=False,
            layer_types=("full_attention", "linear_attention"),
            kv_heads=2,
            k_heads=4,
            tied=True,
        ),
    ),  # fmt: skip
    "bamba": ("bamba", {}),
    # attention first and last, biases everywhere, tied, the whole head rotated, one group
    "bamba_bias_tied": (
        "bamba",
        dict(
            attn=(0, 2),
            attention_bias=True,
            mlp_bias=True,
            proj_bias=True,
            tied=True,
            rope_fraction=1.0,
            n_groups=1,
            kv_heads=4,
        ),
    ),  # fmt: skip
}


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory):
    cache = {}

    def make(name):
        if name not in cache:
            family, kw = VARIANTS[name]
            model = BUILDERS[family](**kw)
            path = tmp_path_factory.mktemp(name)
            model.save_pretrained(path)
            cache[name] = (path, model)
        return cache[name]

    return make


def reference(model, tokens, mask=None):
    with torch.no_grad():
        kw = {} if mask is None else {"attention_mask": torch.from_numpy(np.asarray(mask, np.int64))}
        out = model(torch.from_numpy(np.asarray(tokens)), output_hidden_states=True, **kw)
    return out.logits.float().numpy(), [h.float().numpy() for h in out.hidden_states]


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_logits_and_streams_match_transformers(family_dir, name):
    path, ref = family_dir(name)
    model = latim_jax.load(path)
    assert model.config.family == {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}.get(
        name, VARIANTS[name][0]
    )
    rng = np.random.default_rng(0)
    for length in (1, 11, 19):  # past the Mamba-2 chunk
        tokens = rng.integers(0, model.config.n_tokens, (2, length))
        logits, hidden = reference(ref, tokens)
        out = model.forward(tokens)
        assert rel_err(out.logits, logits) < TOL, (name, length)
        # transformers' hidden_states: one per transformers layer (a hybrid's may hold several sublayers),
        # beginning with the embeddings (the hybrids; Mamba-2 from transformers 5.25) or after layer 0 (the
        # Mamba models up to 5.24), as latim-jax check detects; all end with the final norm's output
        stride = model.config.n_layers // (len(hidden) - 1)
        skip = 0 if begins_with_embeddings(hidden[0], out.residuals[0]) else 1
        for i in range(len(hidden) - 1):
            assert rel_err(out.residuals[(i + skip) * stride], hidden[i]) < TOL, (name, length, i)
        assert rel_err(model.final_hidden(out.residuals[-1]), hidden[-1]) < TOL


@pytest.mark.parametrize(
    "name",
    ["nemotron_h_moe", "nemotron_h_mha", "falcon_mamba", "bamba_bias_tied", "granitemoehybrid", "jamba",
     "falcon_h1_plain", "zamba2_plain", "qwen3_next", "qwen3_5_moe", "kimi_linear"],
)  # fmt: skip
def test_padded_batch_equals_each_prompt_alone_and_transformers(family_dir, name):
    path, ref = family_dir(name)
    model = latim_jax.load(path)
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, model.config.n_tokens, (2, 15))
    mask = np.ones((2, 15), bool)
    mask[1, :6] = False  # left padding
    logits = np.asarray(model(tokens, mask=mask))
    alone = np.asarray(model(tokens[1:, 6:]))
    assert rel_err(logits[1, 6:], alone[0]) < TOL
    assert rel_err(logits[0], np.asarray(model(tokens[:1]))[0]) < TOL
    want, _ = reference(ref, tokens[1:, 6:])  # transformers on the prompt alone (its own padded run feeds
    assert rel_err(logits[1, 6:], want[0]) < TOL  # an in_proj bias at pad positions into the conv window)


@pytest.mark.parametrize(
    "name",
    [
        "nemotron_h_moe",
        "falcon_mamba",
        "bamba",
        "granitemoehybrid",
        "jamba",
        "falcon_h1",
        "zamba2",
        "qwen3_next",
        "kimi_linear",
    ],
)
def test_generation_equals_the_full_forward(family_dir, name):
    path, _ = family_dir(name)
    model = latim_jax.load(path)
    tokens = np.random.default_rng(2).integers(0, model.config.n_tokens, (2, 9))
    stepped, _ = prefill(model, tokens)
    assert rel_err(stepped, model(tokens)) < TOL
    out = np.asarray(generate(model, tokens, 6))
    # greedy: each new token is the argmax of the full forward over what came before, read from one
    # forward over the whole output (causal: position p's logits see only tokens <= p; one program, not
    # one per prefix length)
    full = np.asarray(model(out[:, :-1]))
    assert (full[:, 8:].argmax(-1) == out[:, 9:]).all()


def _without(model, **changes):
    """The same weights under a config with ``changes``: a model missing one family feature (parameters
    the changed config has no place for, an MLP gate say, are dropped)."""
    config = dataclasses.replace(model.config, **changes)
    params = model.params()
    for layer, shapes in zip(params["layers"], param_shapes(config)["layers"], strict=True):
        layer["mixer"] = {k: v for k, v in layer["mixer"].items() if k in shapes["mixer"]}
    return MambaLM(config, params)


@pytest.mark.parametrize(
    "name, changes",
    [
        ("falcon_mamba", dict(bcdt_norm=False)),  # skip the dt / B / C norms
        ("nemotron_h", dict(attn_kv_heads=4, attn_heads=8, attn_head_dim=4)),  # wrong head split
        ("nemotron_h", dict(attn_scale=1.0)),  # no softmax scale
        ("nemotron_h", dict(mlp_activation="relu")),  # relu instead of relu^2
        ("nemotron_h", dict(time_step_limit=(0.0, float("inf")))),  # no dt floor (time_step_min)
        ("nemotron_h", dict(rope_theta=10000.0)),  # a rotary embedding the family does not have
        ("nemotron_h", dict(sliding_window=4)),
        ("bamba", dict(rope_dim=0)),  # rotate the whole head instead of half
        ("bamba", dict(rope_theta=10.0)),  # another theta than the config's (1000)
        ("bamba", dict(mlp_gated=False)),  # the MLP's gate skipped
        ("granitemoehybrid", dict(embedding_multiplier=1.0)),
        ("granitemoehybrid", dict(logits_scaling=1.0)),
        ("granitemoehybrid", dict(attn_scale=0.0)),  # 1 / sqrt(head dim) instead of attention_multiplier
        ("granitemoehybrid", dict(moe_top_k=1)),  # the routing: one expert instead of two
        ("granitemoehybrid_dense", dict(mlp_activation="relu")),  # not SiLU
        ("nemotron_h_moe", dict(moe_scale=1.0)),  # routed_scaling_factor dropped
        ("nemotron_h_moe", dict(moe_norm_topk=False)),
        ("nemotron_h_moe", dict(moe_groups=1)),  # group-limited choice dropped
        ("jamba", dict(bcdt_norm_weight=False)),  # the dt / B / C norms' weights dropped
        ("jamba", dict(bcdt_norm=False)),  # no dt / B / C norms
        ("jamba", dict(moe_router="softmax_topk")),  # the top-k renormalised
        ("falcon_h1", dict(ssm_norm="gated")),  # the norm after the gate instead of before
        ("falcon_h1", dict(ssm_norm="none")),  # the SSM's norm skipped
        ("falcon_h1_plain", dict(ssm_norm="before_gate")),
        ("falcon_h1", dict(embedding_multiplier=1.0)),
        ("falcon_h1", dict(logits_scaling=1.0)),  # lm_head_multiplier dropped
        ("falcon_h1", dict(rope_theta=0.0)),  # no rotary embedding
        ("zamba2", dict(attn_scale=0.0)),  # 1 / sqrt(a) instead of (a / 2)^-1/2
        ("zamba2", dict(rope_theta=0.0)),  # the shared attention's rotary skipped
        ("zamba2", dict(mlp_activation="silu")),  # not GELU
        ("qwen3_next", dict(attn_output_gate=False)),  # the attention's sigmoid output gate dropped
        ("qwen3_next", dict(attn_qk_norm=False)),  # no per-head q / k norms
        ("qwen3_next", dict(moe_shared_gate=False)),  # the shared expert ungated
        ("qwen3_next", dict(rope_dim=0)),  # the whole head rotated instead of a quarter
        ("qwen3_next", dict(moe_router="softmax_all")),  # the top-k not renormalised
        ("kimi_linear", dict(moe_scale=1.0)),  # routed_scaling_factor dropped
        ("kimi_linear", dict(moe_groups=1)),  # the group-limited choice dropped
        ("olmo_hybrid", dict(post_norm_layers=())),  # the attention layers read as pre-norm
        ("olmo_hybrid", dict(rope_theta=0.0)),  # the rotary skipped
        # beta = sigmoid(b) instead of 2 sigmoid(b) (linear_allow_neg_eigval)
        ("olmo_hybrid", dict(sections={"gdn": dict(k_heads=2, v_heads=4, k_dim=8, v_dim=6, norm_eps=1e-5)})),
    ],
)
def test_parity_fails_without_a_family_feature(family_dir, name, changes):
    model, tokens, logits = _with_parity(family_dir, name)
    assert rel_err(_without(model, **changes)(tokens), logits) > 10 * TOL, changes  # parity (TOL) fails


_PARITY = {}


def _with_parity(family_dir, name):
    """The loaded family model, a prompt and transformers' logits, with parity checked: once per family
    for all its controls (CI time)."""
    if name not in _PARITY:
        path, ref = family_dir(name)
        model = latim_jax.load(path)
        tokens = np.random.default_rng(3).integers(0, model.config.n_tokens, (1, 19))
        logits, _ = reference(ref, tokens)
        assert rel_err(model(tokens), logits) < TOL
        _PARITY[name] = model, tokens, logits
    return _PARITY[name]


def test_gqa_groups_are_read_in_transformers_order(family_dir):
    """Query head h reads key/value group h // (H / G): swapping the two groups breaks parity."""
    path, ref = family_dir("nemotron_h")
    model = latim_jax.load(path)
    params = model.params()
    c = model.config
    layer = c.kinds.index("attention")
    a = c.attn_head_dim
    for name in ("k_proj", "v_proj"):
        w = np.asarray(params["layers"][layer]["mixer"][name])
        params["layers"][layer]["mixer"][name] = np.concatenate([w[:, a:], w[:, :a]], axis=1)
    tokens = np.random.default_rng(4).integers(0, c.n_tokens, (1, 13))
    logits, _ = reference(ref, tokens)
    assert rel_err(MambaLM(c, params)(tokens), logits) > 100 * TOL


def test_unsupported_layer_kinds_and_fields_name_the_key(tmp_path):
    from latim_jax.convert.errors import CheckpointError
    from latim_jax.convert.hf import config_from_hf

    base = {"model_type": "nemotron_h", "hidden_size": 32, "vocab_size": 48}
    with pytest.raises(CheckpointError, match=r"moe_latent_size.*wrong type"):
        config_from_hf({**base, "layers_block_type": ["mamba", "moe"], "moe_latent_size": "16"})
    with pytest.raises(CheckpointError, match=r"hybrid_override_pattern\[2\].*unknown layer type"):
        config_from_hf({**base, "hybrid_override_pattern": "M*X"})
    with pytest.raises(CheckpointError, match="mystery_field"):
        config_from_hf({**base, "hybrid_override_pattern": "M*", "mystery_field": 1})
    with pytest.raises(CheckpointError, match="num_hidden_layers"):
        config_from_hf({**base, "hybrid_override_pattern": "M*", "num_hidden_layers": 3})
    # a legacy alias is read as its field, never ignored; both given and different is an error
    legacy = config_from_hf({**base, "hybrid_override_pattern": "M*", "mamba_n_groups": 1, "mamba_d_conv": 3})
    assert (legacy.n_groups, legacy.d_conv) == (1, 3)
    with pytest.raises(CheckpointError, match="mamba_chunk_size.*disagrees with chunk_size"):
        config_from_hf({**base, "hybrid_override_pattern": "M", "mamba_chunk_size": 64, "chunk_size": 128})


def test_qwen3_configs_read_their_layers_and_name_a_bad_key():
    """Qwen3-Next / Qwen3.5 configs: layer_types and the sparse step give the kinds; Qwen3.5's multimodal
    rotary keys read as the default rotary; a gated q_proj with a bias, a wrong layer type and an unknown
    field are refused naming the key."""
    from latim_jax.convert.errors import CheckpointError
    from latim_jax.convert.hf import config_from_hf

    base = {"hidden_size": 16, "vocab_size": 48, "num_hidden_layers": 3, "num_attention_heads": 2,
            "num_key_value_heads": 1, "head_dim": 8, "linear_num_key_heads": 1, "linear_num_value_heads": 2,
            "linear_key_head_dim": 4, "linear_value_head_dim": 4}  # fmt: skip
    c = config_from_hf({**base, "model_type": "qwen3_next", "full_attention_interval": 3, "num_experts": 4,
                        "decoder_sparse_step": 2, "num_experts_per_tok": 2})  # fmt: skip
    assert c.kinds == ("gdn", "mlp", "gdn", "moe", "attention", "mlp")
    rope = {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25,
            "mrope_section": [1, 1, 0], "mrope_interleaved": True}  # fmt: skip
    c = config_from_hf({**base, "model_type": "qwen3_5_text", "rope_parameters": rope})
    assert c.kinds == ("gdn", "mlp", "gdn", "mlp", "gdn", "mlp") and (c.rope_theta, c.rope_dim) == (1e6, 2)
    with pytest.raises(CheckpointError, match="attention_bias"):
        config_from_hf({**base, "model_type": "qwen3_next", "attention_bias": True})
    with pytest.raises(CheckpointError, match="layer_types"):
        config_from_hf(
            {**base, "model_type": "qwen3_next", "layer_types": ["linear_attention", "mamba", "x"]}
        )
    with pytest.raises(CheckpointError, match="mystery_field"):
        config_from_hf({**base, "model_type": "qwen3_5_moe_text", "mystery_field": 1})


def test_the_residual_multiplier_is_folded(family_dir, monkeypatch):
    """Granite's residual_multiplier scales every sublayer's output: read without the fold, parity fails."""
    from latim_jax.convert import hybrids

    path, ref = family_dir("granitemoehybrid")
    tokens = np.random.default_rng(5).integers(0, 48, (1, 13))
    logits, _ = reference(ref, tokens)
    assert rel_err(latim_jax.load(path)(tokens), logits) < TOL
    monkeypatch.setitem(hybrids.FINISH, "granitemoehybrid", lambda data, config, params: params)
    assert rel_err(latim_jax.load(path)(tokens), logits) > 10 * TOL


def test_qwen3_next_zero_centred_norms_are_folded_and_long_prompts_cross_the_chunk(family_dir, monkeypatch):
    """Qwen3-Next's RMSNorms scale by 1 + w: read without the fold, parity fails. A prompt of 77 tokens
    (past the Gated DeltaNet's chunk of 64, not a multiple of it), left-padded in a batch, matches
    transformers' logits on the prompt alone."""
    from latim_jax.convert import hybrids

    path, ref = family_dir("qwen3_next")
    tokens = np.random.default_rng(8).integers(0, 48, (2, 77))
    mask = np.ones(tokens.shape, bool)
    mask[1, :6] = False
    model = latim_jax.load(path)
    logits, _ = reference(ref, tokens)
    assert rel_err(model(tokens), logits) < TOL
    alone, _ = reference(ref, tokens[1:, 6:])
    assert rel_err(np.asarray(model(tokens, mask=mask))[1, 6:], alone[0]) < TOL
    monkeypatch.setitem(hybrids.FINISH, "qwen3_next", lambda data, config, params: params)
    assert rel_err(latim_jax.load(path)(tokens), logits) > 10 * TOL


def test_an_output_scale_folds_into_a_latent_moe_once():
    """fold_output_scale on a latent MoE scales its output by m (latent_out, not experts_down too)."""
    from latim_jax.convert.hybrids import fold_output_scale
    from latim_jax.model.config import MambaConfig
    from latim_jax.model.init import init_params

    config = MambaConfig(
        version=2, d_model=16, n_layers=1, vocab_size=8, head_dim=8, layer_kinds=("moe",), moe_experts=4,
        moe_top_k=2, moe_width=8, moe_latent=6, moe_shared_width=8, mlp_bias=True, mlp_activation="relu2",
    )  # fmt: skip
    params = init_params(config, 0)
    layer = MambaLM(config, params).layers[0]
    x = np.random.default_rng(0).standard_normal((1, 5, 16)).astype(np.float32)
    before = np.asarray(layer.mixer(x))
    fold_output_scale(config, params, 0.3)
    after = np.asarray(MambaLM(config, params).layers[0].mixer(x))
    np.testing.assert_allclose(after, 0.3 * before, rtol=1e-5, atol=1e-6)


def test_every_falcon_h1_multiplier_is_folded(family_dir, monkeypatch):
    """Each of Falcon-H1's multipliers folded into the weights matters: read with that one multiplier left
    at 1 by the fold, the first layer's update of the stream (transformers' hidden_states[1] - [0]) no
    longer matches; read as stored, it does."""
    from latim_jax.convert import hybrids

    path, ref = family_dir("falcon_h1_nonorm")
    tokens = np.random.default_rng(5).integers(0, 48, (1, 13))
    _, hidden = reference(ref, tokens)
    want = hidden[1] - hidden[0]

    def update():
        res = latim_jax.load(path).forward(tokens).residuals
        return rel_err(res[2] - res[0], want)

    assert update() < TOL
    fold = hybrids.falcon_h1_finish
    for key in ("key_multiplier", "attention_out_multiplier", "attention_in_multiplier", "ssm_in_multiplier",
                "ssm_out_multiplier", "mlp_multipliers"):  # fmt: skip
        monkeypatch.setitem(
            hybrids.FINISH, "falcon_h1", lambda data, config, params, key=key: fold(
                {k: v for k, v in data.items() if k != key}, config, params)
        )  # fmt: skip
        assert update() > 10 * TOL, key
    for i in range(5):  # each segment of in_proj's columns (z, x, B, C, dt) has its own multiplier

        def one_segment(data, config, params, i=i):
            m = list(data["ssm_multipliers"])
            m[i] = 1.0
            return fold({**data, "ssm_multipliers": m}, config, params)

        monkeypatch.setitem(hybrids.FINISH, "falcon_h1", one_segment)
        assert update() > 10 * TOL, ("ssm_multipliers", i)


def test_nemotron_h_experts_are_stacked_in_order(family_dir, tmp_path):
    """Each expert's matrices are stored apart; a missing expert is an error naming its tensor."""
    from safetensors.numpy import load_file, save_file

    from latim_jax.convert.errors import CheckpointError

    path, _ = family_dir("nemotron_h_moe")
    tensors = load_file(str(path / "model.safetensors"))
    missing = [k for k in tensors if ".experts.5.up_proj" in k][0]
    del tensors[missing]
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=missing.replace(".", r"\.")):
        latim_jax.load(tmp_path)


@pytest.mark.parametrize("family", ["nemotron_h", "granitemoehybrid", "falcon_h1", "zamba2", "qwen3_next"])
def test_bf16_sharded_hybrid_checkpoints(tmp_path, family):
    """bf16 weights in several safetensors shards (experts split across files): transformers' bf16
    logits to bf16 tolerance, and the same weights read as fp32 match the fp32 model to 1e-5."""
    # Zamba2 without rotary: its bf16 copy rounds the rotary's inv_freq buffer to bf16 and .float() keeps
    # that (5e-4 off the fp32 model through the shared attention; 1e-6 without rotary)
    # Qwen3-Next without experts: torch's bf16 grouped matmul refuses the tiny experts' strides
    kw = {"nemotron_h": dict(pattern="M*E-"), "zamba2": dict(rope=False), "qwen3_next": dict(experts=0)}
    kw = kw.get(family, {})
    ref = BUILDERS[family](**kw)
    ref16 = ref.to(torch.bfloat16)
    ref16.save_pretrained(tmp_path, max_shard_size="20KB")
    assert any(p.name.endswith(".index.json") for p in tmp_path.iterdir())
    model = latim_jax.load(tmp_path)
    assert str(model.embedding[...].dtype) == "bfloat16"
    tokens = np.random.default_rng(6).integers(0, model.config.n_tokens, (1, 13))
    logits, _ = reference(ref16, tokens)
    logits32, _ = reference(ref16.float(), tokens)
    if family == "zamba2":  # the adapters are folded into the weights (one bf16 rounding of W + B A where
        # transformers rounds x W, x A and (x A) B apart): measured 0.8% from the fp32 run of the same
        # weights where transformers' bf16 run is 4.0% from it (and so 4.9% from ours)
        assert rel_err(model(tokens), logits32) < 3e-2
    else:
        assert rel_err(model(tokens), logits) < 3e-2
    assert rel_err(latim_jax.load(tmp_path, dtype="float32")(tokens), logits32) < TOL


@pytest.mark.parametrize(
    "name",
    [
        "falcon_mamba",
        "nemotron_h_moe",
        "bamba",
        "granitemoehybrid",
        "jamba",
        "falcon_h1",
        "zamba2",
        "qwen3_next",
    ],
)
def test_check_compares_every_family_in_transformers_order(family_dir, name, monkeypatch):
    """`latim-jax check` passes on each family; read in the wrong hidden-state order it fails."""
    from latim_jax.cli import check

    path, _ = family_dir(name)
    report = check.check_model(str(path), length=9)
    assert check.verdict(report, 1e-4)["passed"], report
    # the other order than the one detected: a hybrid read as a Mamba model (offset by one transformers
    # layer), a Mamba model read as a hybrid
    monkeypatch.setattr(check, "begins_with_embeddings", lambda a, b: not begins_with_embeddings(a, b))
    assert not check.verdict(check.check_model(str(path), length=9), 1e-4)["passed"]


def test_zamba2_adapters_count_and_bad_configs_name_the_key(family_dir):
    """Each hybrid layer's adapters change its block (zeroed in transformers, our logits miss theirs by
    far more than the tolerance); configs transformers cannot run, or latim-jax cannot read faithfully,
    fail naming the field."""
    from latim_jax.convert.errors import CheckpointError
    from latim_jax.convert.hf import config_from_hf

    path, ref = family_dir("zamba2")
    model = latim_jax.load(path)
    tokens = np.random.default_rng(7).integers(0, model.config.n_tokens, (1, 13))
    with torch.no_grad():
        saved = {n: p.clone() for n, p in ref.named_parameters() if "adapter_list" in n}
        for n, p in ref.named_parameters():
            if n in saved:
                p.zero_()
        without, _ = reference(ref, tokens)
        for n, p in ref.named_parameters():
            if n in saved:
                p.copy_(saved[n])
    assert rel_err(model(tokens), without) > 10 * TOL
    base = {"model_type": "zamba2", "hidden_size": 32, "vocab_size": 48, "num_hidden_layers": 2,
            "layers_block_type": ["mamba", "hybrid"], "num_attention_heads": 4,
            "n_mamba_heads": 4}  # fmt: skip
    assert config_from_hf(base).kinds == ("mamba2", "shared")
    with pytest.raises(CheckpointError, match="num_key_value_heads"):
        config_from_hf({**base, "use_shared_attention_adapter": True, "num_key_value_heads": 2})
    with pytest.raises(CheckpointError, match="rms_norm_eps"):
        config_from_hf({**base, "rms_norm_eps": 1e-6})
    with pytest.raises(CheckpointError, match="layers_block_type"):
        config_from_hf({**base, "layers_block_type": ["mamba", "attention"]})
    with pytest.raises(CheckpointError, match="rope_type"):
        yarn = {"rope_type": "yarn", "factor": 2.0}
        config_from_hf({**base, "use_mem_rope": True, "rope_parameters": yarn})


def test_olmo_hybrid_long_prompts_padded_on_either_side_match_transformers(family_dir):
    """OLMo-Hybrid at 70 tokens (past the Gated DeltaNet's chunk of 64, not a multiple of it): one prompt
    whole, one left-padded by 5 and one right-padded by 4 in the same batch, each matching transformers'
    logits on the prompt alone. A config that reads the attention's q/k norms per head does not load."""
    from latim_jax.convert import hybrids

    path, ref = family_dir("olmo_hybrid")
    model = latim_jax.load(path)
    tokens = np.random.default_rng(9).integers(0, model.config.n_tokens, (3, 70))
    mask = np.ones(tokens.shape, bool)
    mask[1, :5] = False
    mask[2, 66:] = False
    got = np.asarray(model(tokens, mask=mask))
    for b, real in enumerate(mask):
        want, _ = reference(ref, tokens[b : b + 1, real])
        assert rel_err(got[b, real], want[0]) < TOL, b
    config = hybrids.olmo_hybrid_config(json.loads((path / "config.json").read_text()), "config.json")
    assert config == model.config
    per_head = dataclasses.replace(config, attn_qk_norm_full=False)
    with pytest.raises(ValueError, match="q_norm"):
        MambaLM(per_head, model.params())


def test_olmo_hybrid_generation_equals_transformers_greedy(family_dir):
    """Greedy decoding of a tiny OLMo-Hybrid (its cache: the conv windows and delta-rule states, the
    post-norm attention's keys and values) gives transformers' tokens."""
    path, ref = family_dir("olmo_hybrid")
    model = latim_jax.load(path)
    tokens = np.random.default_rng(10).integers(0, model.config.n_tokens, (2, 9))
    with torch.no_grad():
        ids = torch.from_numpy(tokens)  # an explicit mask: no token id is read as padding
        want = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                            pad_token_id=0, eos_token_id=None).numpy()  # fmt: skip
    np.testing.assert_array_equal(np.asarray(generate(model, tokens, 8)), want)
