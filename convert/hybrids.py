"""Config readers of the hybrid families (Hugging Face format): each maps its ``config.json`` onto one
:class:`MambaConfig` whose ``layer_kinds`` lists the sublayers in forward order. The weights then read
through the same layout as a plain Mamba checkpoint (:mod:`.layout`, one name table per layer kind).

A family is one function here and one entry in :data:`READERS`; docs/architecture.md says what else a
new family touches.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from latim_jax.model.config import MambaConfig
from latim_jax.model.delta_rule import DeltaRuleConfig
from latim_jax.model.kind import kind_of
from latim_jax.model.mla import MLAConfig

from .config_fields import ConfigFields
from .delta_rule import ba_rows, gated_query_rows, qkvz_rows
from .errors import CheckpointError
from .hf_fields import ACTIVATIONS, GENERIC_IGNORED, build_config

# Nemotron-H's layer names (transformers 5 "layers_block_type", its legacy aliases, and the characters of
# the older "hybrid_override_pattern") -> latim-jax layer kinds
_NEMOTRON_KINDS = {
    "linear_attention": "mamba2",
    "mamba": "mamba2",
    "M": "mamba2",
    "full_attention": "attention",
    "attention": "attention",
    "*": "attention",
    "mlp": "mlp",
    "-": "mlp",
    "moe": "moe",
    "E": "moe",
}
_NEMOTRON_HANDLED = frozenset(
    {
        "model_type", "hidden_size", "vocab_size", "layers_block_type", "layer_types",
        "hybrid_override_pattern", "num_hidden_layers", "layer_norm_epsilon", "ssm_state_size",
        "mamba_num_heads", "mamba_head_dim", "n_groups", "conv_kernel", "use_conv_bias", "use_bias",
        "mamba_hidden_act", "chunk_size", "time_step_min", "num_attention_heads", "num_key_value_heads",
        "head_dim", "intermediate_size", "mlp_hidden_act", "mlp_bias", "tie_word_embeddings",
        "n_routed_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
        "moe_shared_expert_intermediate_size", "moe_latent_size", "n_group", "topk_group", "norm_topk_prob",
        "routed_scaling_factor",
    }
)  # fmt: skip
# What transformers' NemotronH never reads in the forward (it ignores them: no attention bias, no sliding
# window, an lm_head never tied, the mixer width from mamba_num_heads * mamba_head_dim, the dt clamp from
# time_step_min, always one shared expert) or reads only for training, caching, multi-token prediction
# and kernels.
_NEMOTRON_IGNORED = GENERIC_IGNORED | {
    "attention_bias", "attention_dropout", "sliding_window", "max_position_embeddings", "expand",
    "time_step_limit", "time_step_floor", "mamba_proj_bias", "hidden_dropout", "use_mamba_kernels",
    "num_logits_to_keep", "mamba_ssm_cache_dtype", "output_router_logits", "num_nextn_predict_layers",
    "mtp_layers_block_type", "moe_shared_expert_overlap", "n_shared_experts",
}  # fmt: skip
# the legacy names transformers' NemotronHConfig still accepts -> the fields they set
_NEMOTRON_ALIASES = {
    "mamba_n_groups": "n_groups", "mamba_d_conv": "conv_kernel", "mamba_expand": "expand",
    "mamba_dt_min": "time_step_min", "mamba_dt_max": "time_step_max", "mamba_dt_limit": "time_step_limit",
    "mamba_dt_init_floor": "time_step_floor", "mamba_conv_bias": "use_conv_bias",
    "mamba_chunk_size": "chunk_size",
}  # fmt: skip


def _resolve_aliases(data: dict[str, Any], aliases: dict[str, str], file: str) -> dict[str, Any]:
    """``data`` with each legacy key renamed to its field; both present with different values is an
    error naming the legacy key."""
    out = dict(data)
    for old, new in aliases.items():
        if old in out:
            value = out.pop(old)
            if new in out and out[new] != value:
                raise ConfigFields({}, file=file, handled=()).error(
                    old, f"disagrees with {new} (transformers reads it as {new})", out[new], value
                )
            out[new] = value
    return out


def _activation(f: ConfigFields, key: str, default: str) -> str:
    act = f.str(key, default)
    if act not in ACTIVATIONS:
        raise f.error(key, "unsupported activation", sorted(ACTIVATIONS), act)
    return ACTIVATIONS[act]


def _mlp_activation(f: ConfigFields, key: str, default: str) -> str:
    names = {"relu2": "relu2", "silu": "silu", "swish": "silu", "relu": "relu", "gelu": "gelu",
             "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}  # fmt: skip
    act = f.str(key, default)
    if act not in names:
        raise f.error(key, "unsupported MLP activation", sorted(names), act)
    return names[act]


def nemotron_h_kinds(f: ConfigFields) -> tuple[str, ...]:
    """The layer kinds of a Nemotron-H config: ``layers_block_type`` (or ``layer_types``), else the
    legacy ``hybrid_override_pattern`` string, else transformers' default [mamba, moe, attention, mlp]."""
    key = next((k for k in ("layers_block_type", "layer_types") if f.has(k)), None)
    if key is not None:
        names = f.raw(key)
        if not isinstance(names, list) or not names:
            raise f.error(key, "wrong type", "a non-empty list of layer types", names)
    elif f.has("hybrid_override_pattern"):
        key, names = "hybrid_override_pattern", list(f.str("hybrid_override_pattern"))
    else:
        key, names = "layers_block_type", ["linear_attention", "moe", "full_attention", "mlp"]
    kinds = []
    for i, name in enumerate(names):
        if name not in _NEMOTRON_KINDS:
            expected = sorted(k for k in _NEMOTRON_KINDS if len(k) > 1 or key == "hybrid_override_pattern")
            raise f.error(f"{key}[{i}]", "unknown layer type", expected, name)
        kinds.append(_NEMOTRON_KINDS[name])
    if f.has("num_hidden_layers") and f.int("num_hidden_layers") != len(kinds):
        raise f.error("num_hidden_layers", f"disagrees with {key}", len(kinds), f.raw("num_hidden_layers"))
    return tuple(kinds)


def nemotron_h_config(data: dict[str, Any], file: str) -> MambaConfig:
    """A :class:`MambaConfig` from transformers' ``NemotronHConfig`` (``model_type: nemotron_h``):
    each layer one sublayer, RMSNorm + one of Mamba-2 / attention (no rotary, no bias) / relu^2 MLP."""
    data = _resolve_aliases(data, _NEMOTRON_ALIASES, file)
    f = ConfigFields(data, file=file, handled=_NEMOTRON_HANDLED, ignored=_NEMOTRON_IGNORED)
    kinds = nemotron_h_kinds(f)
    d_model = f.int("hidden_size", 4096)
    heads, head_dim = f.int("mamba_num_heads", 128), f.int("mamba_head_dim", 64)
    attn_heads = f.int("num_attention_heads", 32)
    kv = f.raw("num_key_value_heads", 8)
    kv = attn_heads if kv is None else f.int("num_key_value_heads", 8)
    moe = {}
    if "moe" in kinds:
        latent = f.raw("moe_latent_size", None)
        experts_key = "n_routed_experts" if f.has("n_routed_experts") else "num_local_experts"
        moe = dict(
            moe_experts=f.int(experts_key, 8), moe_top_k=f.int("num_experts_per_tok", 2),
            moe_width=f.int("moe_intermediate_size", 7688),
            moe_shared_width=f.int("moe_shared_expert_intermediate_size", 7688), moe_router="sigmoid_groups",
            moe_groups=f.int("n_group", 1), moe_topk_groups=f.int("topk_group", 1),
            moe_latent=0 if latent is None else f.int("moe_latent_size"),
            moe_norm_topk=f.bool("norm_topk_prob", True), moe_scale=f.float("routed_scaling_factor", 1.0),
        )  # fmt: skip
    return build_config(
        file,
        **moe,
        version=2,
        family="nemotron_h",
        d_model=d_model,
        n_layers=len(kinds),
        layer_kinds=kinds,
        vocab_size=f.int("vocab_size", 131072),
        d_state=f.int("ssm_state_size", 128),
        d_conv=f.int("conv_kernel", 4),
        expand=1,
        ssm_inner=heads * head_dim,
        head_dim=head_dim,
        n_groups=f.int("n_groups", 8),
        chunk_size=f.int("chunk_size", 128),
        conv_bias=f.bool("use_conv_bias", True),
        proj_bias=f.bool("use_bias", False),
        rms_eps=f.float("layer_norm_epsilon", 1e-5),
        tie_embeddings=False,  # transformers' NemotronH never ties its lm_head, whatever the config says
        activation=_activation(f, "mamba_hidden_act", "silu"),
        time_step_limit=(f.float("time_step_min", 0.001), math.inf),
        attn_heads=attn_heads,
        attn_kv_heads=kv,
        attn_head_dim=f.int("head_dim", 128),
        mlp_width=f.int("intermediate_size", 21504),
        mlp_activation=_mlp_activation(f, "mlp_hidden_act", "relu2"),
        mlp_bias=f.bool("mlp_bias", False),
    )


def _rope(f: ConfigFields, default_theta: float, default_fraction: float) -> tuple[float, float]:
    """(theta, rotated fraction of the head) from ``rope_parameters`` (transformers 5) or the legacy
    top-level ``rope_theta`` / ``rope_scaling``; only the default rotary type is supported."""
    theta, fraction = default_theta, default_fraction
    if f.has("rope_theta"):
        theta = f.float("rope_theta")
    params = f.raw("rope_parameters", None)
    if f.raw("rope_scaling", None) is not None:
        raise f.error("rope_scaling", "unsupported rotary scaling", "null (the default rotary embedding)",
                      f.raw("rope_scaling"))  # fmt: skip
    if params is not None:
        inner = ConfigFields(
            params, file=f.file, prefix="rope_parameters.",
            handled={"rope_type", "rope_theta", "partial_rotary_factor"}, ignored=(),
        )  # fmt: skip
        inner.require("rope_type", ("default",), "default", "only the default rotary embedding is supported")
        theta = inner.float("rope_theta", theta)
        fraction = inner.float("partial_rotary_factor", fraction)
    return theta, fraction


def _attention_head_dim(f: ConfigFields, d_model: int, heads: int) -> int:
    if f.has("head_dim") and f.raw("head_dim") is not None:
        return f.int("head_dim")
    if d_model % heads:
        raise f.error("num_attention_heads", "does not divide hidden_size", f"a divisor of {d_model}", heads)
    return d_model // heads


_BAMBA_HANDLED = frozenset(
    {
        "model_type", "hidden_size", "vocab_size", "num_hidden_layers", "attn_layer_indices",
        "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
        "rms_norm_eps", "mamba_n_heads", "mamba_d_head", "mamba_n_groups", "mamba_d_state", "mamba_d_conv",
        "mamba_expand", "mamba_chunk_size", "mamba_conv_bias", "mamba_proj_bias", "time_step_limit",
        "attention_bias", "mlp_bias", "rope_parameters", "rope_theta", "rope_scaling", "tie_word_embeddings",
    }
)  # fmt: skip
# rope positions past max_position_embeddings are computed like any other (the default rotary type);
# z_loss only changes the training loss; num_logits_to_keep only generation
_BAMBA_IGNORED = GENERIC_IGNORED | {
    "attention_dropout", "max_position_embeddings", "num_logits_to_keep", "z_loss_coefficient",
    "partial_rotary_factor",
}  # fmt: skip


def _attention_fields(f: ConfigFields, d_model: int, kv_default: Any) -> dict[str, Any]:
    """Bamba's, Granite's and Jamba's attention fields: heads, key/value heads (None: as many as heads),
    the head dim (``head_dim``, else hidden_size / heads) and the one bias switch of q, k, v and o."""
    heads = f.int("num_attention_heads", 32)
    kv = f.raw("num_key_value_heads", kv_default)
    kv = heads if kv is None else f.int("num_key_value_heads", kv_default)
    bias = f.bool("attention_bias", False) if f.has("attention_bias") else False
    return dict(attn_heads=heads, attn_kv_heads=kv, attn_head_dim=_attention_head_dim(f, d_model, heads),
                attn_bias=bias, attn_out_bias=bias)  # fmt: skip


def _mamba2_fields(f: ConfigFields, d_model: int, eps_default: float) -> dict[str, Any]:
    """Bamba's and Granite's Mamba-2 fields (``mamba_*``, the time-step limit, the norm eps, the conv
    activation ``hidden_act``)."""
    expand, m_heads = f.int("mamba_expand", 2), f.int("mamba_n_heads", 128)
    m_head = f.raw("mamba_d_head", "auto")
    m_head = expand * d_model // m_heads if m_head == "auto" else f.int("mamba_d_head")
    if m_head * m_heads != expand * d_model:
        raise f.error("mamba_d_head", "mamba_n_heads * mamba_d_head must equal mamba_expand * hidden_size",
                      expand * d_model // m_heads, m_head)  # fmt: skip
    return dict(
        d_state=f.int("mamba_d_state", 256), d_conv=f.int("mamba_d_conv", 4), expand=expand, head_dim=m_head,
        n_groups=f.int("mamba_n_groups", 1), chunk_size=f.int("mamba_chunk_size", 256),
        conv_bias=f.bool("mamba_conv_bias", True), proj_bias=f.bool("mamba_proj_bias", False),
        rms_eps=f.float("rms_norm_eps", eps_default), activation=_activation(f, "hidden_act", "silu"),
        time_step_limit=f.float_pair("time_step_limit", (0.0, math.inf)),
    )  # fmt: skip


def bamba_config(data: dict[str, Any], file: str) -> MambaConfig:
    """A :class:`MambaConfig` from transformers' ``BambaConfig`` (``model_type: bamba``): each layer i is
    two sublayers, 2i its mixer (Mamba-2, or attention when i is in ``attn_layer_indices``: GQA, rotary
    on half of each head) and 2i + 1 a SwiGLU MLP. transformers forces partial_rotary_factor 0.5 unless
    ``rope_parameters`` sets it (a top-level ``partial_rotary_factor`` is overwritten, so ignored)."""
    f = ConfigFields(data, file=file, handled=_BAMBA_HANDLED, ignored=_BAMBA_IGNORED)
    n = f.int("num_hidden_layers", 32)
    attn = f.raw("attn_layer_indices", None) or []
    if not isinstance(attn, list) or not all(isinstance(i, int) and 0 <= i < n for i in attn):
        raise f.error("attn_layer_indices", "wrong value", f"a list of layer indices in [0, {n})", attn)
    kinds = []
    for i in range(n):
        kinds += ["attention" if i in attn else "mamba2", "mlp"]
    d_model = f.int("hidden_size", 4096)
    attention = _attention_fields(f, d_model, 8)
    theta, fraction = _rope(f, 10000.0, 0.5)
    return build_config(
        file, version=2, family="bamba", d_model=d_model, n_layers=len(kinds), layer_kinds=tuple(kinds),
        vocab_size=f.int("vocab_size", 128000), tie_embeddings=f.bool("tie_word_embeddings", False),
        **_mamba2_fields(f, d_model, 1e-5), **attention, rope_theta=theta,
        rope_dim=_rope_dim(attention["attn_head_dim"], fraction), mlp_width=f.int("intermediate_size", 14336),
        mlp_activation=_mlp_activation(f, "hidden_act", "silu"), mlp_gated=True,
        mlp_bias=f.bool("mlp_bias", False),
    )  # fmt: skip


def _rope_dim(head_dim: int, fraction: float) -> int:
    """transformers' rotary width int(head_dim * fraction) (even); the whole head as 0."""
    dim = int(head_dim * fraction)
    return 0 if dim >= head_dim else dim - dim % 2


_GRANITE_KINDS = {"mamba": "mamba2", "linear_attention": "mamba2", "attention": "attention",
                  "full_attention": "attention"}  # fmt: skip
_GRANITE_HANDLED = (_BAMBA_HANDLED - {"attn_layer_indices", "mlp_bias"}) | {
    "layer_types", "layers_block_type", "embedding_multiplier", "logits_scaling", "residual_multiplier",
    "attention_multiplier", "num_local_experts", "num_experts_per_tok", "shared_intermediate_size",
    "position_embedding_type",
}  # fmt: skip
# the router's auxiliary loss is training only; normalization_function is written by the released
# checkpoints ("rmsnorm", the only one transformers implements)
_GRANITE_IGNORED = _BAMBA_IGNORED | {"output_router_logits", "router_aux_loss_coef", "normalization_function"}


def granite_config(data: dict[str, Any], file: str) -> MambaConfig:
    """A :class:`MambaConfig` from transformers' ``GraniteMoeHybridConfig`` (Granite-4.0-H): each layer
    i is 2i its mixer (Mamba-2 or attention, from ``layer_types``) and 2i + 1 the feed-forward: routed
    experts (softmax over the top-k logits) plus a shared SwiGLU MLP, or the shared MLP alone
    (``num_local_experts: 0``). The softmax scale is ``attention_multiplier``; rotary only with
    ``position_embedding_type: "rope"``; the embedding and logit multipliers are config fields, the
    residual multiplier is folded into the weights (:func:`granite_finish`)."""
    f = ConfigFields(data, file=file, handled=_GRANITE_HANDLED, ignored=_GRANITE_IGNORED)
    n = f.int("num_hidden_layers", 32)
    key = next((k for k in ("layer_types", "layers_block_type") if f.has(k)), None)
    names = f.raw(key) if key else ["mamba"] * n
    if not isinstance(names, list) or len(names) != n:
        raise f.error(key or "layer_types", "wrong value", f"a list of {n} layer types", names)
    kinds = []
    for i, name in enumerate(names):
        if name not in _GRANITE_KINDS:
            raise f.error(f"{key}[{i}]", "unknown layer type", sorted(_GRANITE_KINDS), name)
        kinds += [_GRANITE_KINDS[name], "mlp"]
    experts = f.int("num_local_experts", 8)
    if experts:
        kinds = [k if k != "mlp" else "moe" for k in kinds]
    d_model = f.int("hidden_size", 4096)
    rope = f.raw("position_embedding_type", None) == "rope"
    theta, _ = _rope(f, 10000.0, 1.0)
    shared = f.int("shared_intermediate_size", 1024)
    moe = {}
    if experts:
        moe = dict(moe_experts=experts, moe_top_k=f.int("num_experts_per_tok", 2),
                   moe_width=f.int("intermediate_size", 11008), moe_shared_width=shared)  # fmt: skip
    return build_config(
        file, version=2, family="granitemoehybrid", d_model=d_model, n_layers=len(kinds),
        layer_kinds=tuple(kinds), vocab_size=f.int("vocab_size", 32000),
        tie_embeddings=f.bool("tie_word_embeddings", False), **_mamba2_fields(f, d_model, 1e-6),
        **_attention_fields(f, d_model, None), attn_scale=f.float("attention_multiplier", 1.0),
        rope_theta=theta if rope else 0.0, mlp_width=shared,
        mlp_activation=_mlp_activation(f, "hidden_act", "silu"), mlp_gated=True,
        embedding_multiplier=f.float("embedding_multiplier", 1.0),
        logits_scaling=f.float("logits_scaling", 1.0), **moe,
    )  # fmt: skip


def granite_finish(data: dict[str, Any], config: MambaConfig, params: dict) -> dict:
    """Fold ``residual_multiplier`` into every sublayer's output projection: h + m o(x) with o linear
    in its output weights is h + o'(x), the same function, and the decomposition's T and beta carry m."""
    m = float(data.get("residual_multiplier", 1.0))
    if m != 1.0:
        fold_output_scale(config, params, m)
    return params


def fold_output_scale(config: MambaConfig, params: dict, m: float) -> None:
    """Scale every sublayer's output-side parameters by m, in place (their dtype kept)."""
    for kind, layer in zip(config.kinds, params["layers"], strict=True):
        names = kind_of(kind).output_params
        if "latent_out" in layer["mixer"]:  # the experts' sum passes latent_out: scale it, not experts_down
            names = tuple(n for n in names if n != "experts_down") + ("latent_out", "latent_out_b")
        for name in names:
            _scale(layer["mixer"], name, m)


def _scale(mixer: dict, name: str, m) -> None:
    """mixer[name] times m (a scalar or an array broadcasting over it), in fp32, its dtype kept; absent
    parameters are left alone."""
    if name in mixer:
        w = mixer[name]
        mixer[name] = (np.asarray(w, np.float32) * m).astype(w.dtype)


_JAMBA_HANDLED = frozenset(
    {
        "model_type", "vocab_size", "tie_word_embeddings", "hidden_size", "intermediate_size",
        "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
        "rms_norm_eps", "num_experts", "num_local_experts", "num_experts_per_tok", "expert_layer_period",
        "expert_layer_offset", "attn_layer_period", "attn_layer_offset", "mamba_d_state", "mamba_d_conv",
        "mamba_expand", "mamba_dt_rank", "mamba_conv_bias", "mamba_proj_bias",
    }
)  # fmt: skip
# no positional encoding anywhere (max_position_embeddings unread); the kernel switches compute the same
# scan; the router's logits feed only the training loss
_JAMBA_IGNORED = GENERIC_IGNORED | {
    "max_position_embeddings", "attention_dropout", "use_mamba_kernels", "use_mambapy",
    "use_associative_scan", "output_router_logits", "router_aux_loss_coef", "num_logits_to_keep",
}  # fmt: skip


def jamba_config(data: dict[str, Any], file: str) -> MambaConfig:
    """A :class:`MambaConfig` from transformers' ``JambaConfig``: each layer i is 2i its mixer (attention
    when i % attn_layer_period == attn_layer_offset, no positional encoding; else Mamba-1 with weighted
    RMS norms of dt's input, B and C) and 2i + 1 its feed-forward (experts when i % expert_layer_period
    == expert_layer_offset: a softmax over all experts, the top-k probabilities unrenormalised; else a
    SwiGLU MLP of the same width)."""
    f = ConfigFields(data, file=file, handled=_JAMBA_HANDLED, ignored=_JAMBA_IGNORED)
    n = f.int("num_hidden_layers", 32)
    periods = {}
    for name, default in (("attn_layer", (8, 4)), ("expert_layer", (2, 1))):
        period, offset = f.int(f"{name}_period", default[0]), f.int(f"{name}_offset", default[1])
        if not 0 <= offset < period:
            raise f.error(f"{name}_offset", f"not below {name}_period", f"0 <= offset < {period}", offset)
        periods[name] = (period, offset)
    experts = f.int("num_experts" if f.has("num_experts") else "num_local_experts", 16)
    kinds = []
    for i in range(n):
        ap, ao = periods["attn_layer"]
        ep, eo = periods["expert_layer"]
        kinds += ["attention" if i % ap == ao else "mamba1", "moe" if experts > 1 and i % ep == eo else "mlp"]
    d_model = f.int("hidden_size", 4096)
    rank = f.raw("mamba_dt_rank", "auto")
    rank = math.ceil(d_model / 16) if rank == "auto" else f.int("mamba_dt_rank")
    width = f.int("intermediate_size", 14336)
    eps = f.float("rms_norm_eps", 1e-6)
    moe = {}
    if "moe" in kinds:
        moe = dict(moe_experts=experts, moe_top_k=f.int("num_experts_per_tok", 2), moe_width=width,
                   moe_router="softmax_all")  # fmt: skip
    attention = _attention_fields(f, d_model, 8)
    return build_config(
        file, version=1, family="jamba", d_model=d_model, n_layers=len(kinds), layer_kinds=tuple(kinds),
        vocab_size=f.int("vocab_size", 65536), tie_embeddings=f.bool("tie_word_embeddings", False),
        d_state=f.int("mamba_d_state", 16), d_conv=f.int("mamba_d_conv", 4), expand=f.int("mamba_expand", 2),
        dt_rank=rank, conv_bias=f.bool("mamba_conv_bias", True), proj_bias=f.bool("mamba_proj_bias", False),
        rms_eps=eps, activation=_activation(f, "hidden_act", "silu"), bcdt_norm=True, bcdt_eps=eps,
        bcdt_norm_weight=True, **{**attention, "attn_bias": False, "attn_out_bias": False},
        mlp_width=width, mlp_activation=_mlp_activation(f, "hidden_act", "silu"), mlp_gated=True, **moe,
    )  # fmt: skip


_FALCON_H1_HANDLED = frozenset(
    {
        "model_type", "vocab_size", "tie_word_embeddings", "hidden_size", "intermediate_size",
        "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
        "rms_norm_eps", "mamba_d_ssm", "mamba_n_heads", "mamba_d_head", "mamba_n_groups", "mamba_d_state",
        "mamba_d_conv", "mamba_expand", "mamba_chunk_size", "mamba_conv_bias", "mamba_proj_bias",
        "mamba_norm_before_gate", "mamba_rms_norm", "time_step_limit", "projectors_bias", "attention_bias",
        "mlp_bias", "rope_parameters", "rope_theta", "rope_scaling", "lm_head_multiplier",
        "embedding_multiplier", "mlp_multipliers", "key_multiplier", "attention_out_multiplier",
        "attention_in_multiplier", "ssm_multipliers", "ssm_in_multiplier", "ssm_out_multiplier",
        "layers_block_type", "layer_types",
    }
)  # fmt: skip
# rotary positions past max_position_embeddings are computed like any other (default rotary type)
_FALCON_H1_IGNORED = GENERIC_IGNORED | {"max_position_embeddings", "attention_dropout", "num_logits_to_keep"}
# Falcon-H1's multipliers: folded into the weights on reading (:func:`falcon_h1_finish`); the embedding's
# and the head's become config fields
_FALCON_H1_SCALARS = (
    "key_multiplier", "attention_out_multiplier", "attention_in_multiplier", "ssm_in_multiplier",
    "ssm_out_multiplier", "lm_head_multiplier", "embedding_multiplier",
)  # fmt: skip


def _multipliers(f: ConfigFields, key: str, n: int) -> list[float]:
    """A list of n numbers (Falcon-H1's ``mlp_multipliers`` / ``ssm_multipliers``; null: all 1)."""
    value = f.raw(key, None)
    if value is None:
        return [1.0] * n
    if (
        not isinstance(value, list)
        or len(value) != n
        or not all(isinstance(v, int | float) and not isinstance(v, bool) for v in value)
    ):
        raise f.error(key, "wrong value", f"a list of {n} numbers", value)
    return [float(v) for v in value]


def falcon_h1_config(data: dict[str, Any], file: str) -> MambaConfig:
    """A :class:`MambaConfig` from transformers' ``FalconH1Config``: each layer i is 2i a parallel block
    (Mamba-2 and attention on the same normalised input, outputs added: GQA, rotary on the whole head;
    the SSM's width ``mamba_d_ssm``, its output norm per ``mamba_rms_norm`` / ``mamba_norm_before_gate``)
    and 2i + 1 a SwiGLU MLP. The multipliers are folded into the weights (:func:`falcon_h1_finish`)
    except the embedding's (``embedding_multiplier``) and the head's (``logits_scaling`` = 1 / it)."""
    f = ConfigFields(data, file=file, handled=_FALCON_H1_HANDLED, ignored=_FALCON_H1_IGNORED)
    n = f.int("num_hidden_layers", 32)
    key = next((k for k in ("layers_block_type", "layer_types") if f.has(k)), None)
    if key is not None:
        names = f.raw(key)
        if names != ["hybrid"] * n:
            raise f.error(key, "unsupported layer types", f"{n} x 'hybrid' (every layer parallel)", names)
    d_model = f.int("hidden_size", 4096)
    expand = f.int("mamba_expand", 2)
    d_ssm = f.raw("mamba_d_ssm", 1024)
    inner = expand * d_model if d_ssm is None else f.int("mamba_d_ssm")
    m_heads = f.int("mamba_n_heads", 128)
    m_head = f.raw("mamba_d_head", "auto")
    m_head = inner // m_heads if m_head == "auto" else f.int("mamba_d_head")
    if m_head * m_heads != inner:
        raise f.error("mamba_d_head", "mamba_n_heads * mamba_d_head must equal the SSM width (mamba_d_ssm)",
                      inner // m_heads, m_head)  # fmt: skip
    for name in _FALCON_H1_SCALARS:
        f.float(name, 1.0)  # type-checked here, used by falcon_h1_finish
    _multipliers(f, "mlp_multipliers", 2)
    _multipliers(f, "ssm_multipliers", 5)
    head = f.float("lm_head_multiplier", 1.0)
    if head == 0:
        raise f.error("lm_head_multiplier", "zero makes every logit 0", "a non-zero number", head)
    attention = _attention_fields(f, d_model, 8)
    theta, _ = _rope(f, 10000.0, 1.0)
    norm = "none"
    if f.bool("mamba_rms_norm", False):
        norm = "before_gate" if f.bool("mamba_norm_before_gate", True) else "gated"
    else:
        f.bool("mamba_norm_before_gate", True)
    kinds = ("parallel", "mlp") * n
    return build_config(
        file, version=2, family="falcon_h1", d_model=d_model, n_layers=len(kinds), layer_kinds=kinds,
        vocab_size=f.int("vocab_size", 128000), tie_embeddings=f.bool("tie_word_embeddings", False),
        d_state=f.int("mamba_d_state", 256), d_conv=f.int("mamba_d_conv", 4), expand=expand, ssm_inner=inner,
        head_dim=m_head, n_groups=f.int("mamba_n_groups", 1), chunk_size=f.int("mamba_chunk_size", 256),
        conv_bias=f.bool("mamba_conv_bias", True), proj_bias=f.bool("mamba_proj_bias", False),
        out_proj_bias=f.bool("projectors_bias", False), ssm_norm=norm,
        rms_eps=f.float("rms_norm_eps", 1e-5), activation=_activation(f, "hidden_act", "silu"),
        time_step_limit=f.float_pair("time_step_limit", (0.0, math.inf)),
        **attention, rope_theta=theta, mlp_width=f.int("intermediate_size", 14336),
        mlp_activation=_mlp_activation(f, "hidden_act", "silu"), mlp_gated=True,
        mlp_bias=f.bool("mlp_bias", False), embedding_multiplier=f.float("embedding_multiplier", 1.0),
        logits_scaling=1.0 / head,
    )  # fmt: skip


def falcon_h1_finish(data: dict[str, Any], config: MambaConfig, params: dict) -> dict:
    """Fold Falcon-H1's multipliers into the weights (each a constant on a linear map's input or output,
    so the folded model computes the same function, and its T and beta carry them):

    - SSM: in_proj(m_in x) * mup = x (m_in W_in mup) + b_in mup, mup the per-segment ``ssm_multipliers``
      over in_proj's z | x | B | C | dt columns; its output times ``ssm_out_multiplier``.
    - attention: q, k, v read m_in x (``attention_in_multiplier``, weights only); k times
      ``key_multiplier`` (weight and bias); its output times ``attention_out_multiplier``.
    - MLP: act(m_gate x W_gate) (``mlp_multipliers[0]``), the output times ``mlp_multipliers[1]``.
    """
    # read as falcon_h1_config read (and checked) them: one definition of each field's default
    f = ConfigFields(data, file="config.json", handled=_FALCON_H1_HANDLED, ignored=_FALCON_H1_IGNORED)
    get = lambda key: f.float(key, 1.0)  # noqa: E731
    gate_m, down_m = _multipliers(f, "mlp_multipliers", 2)
    c = config
    e, gn = c.d_inner, c.n_groups * c.d_state
    mup = np.concatenate(
        [np.full(w, m, np.float32) for w, m in
         zip((e, e, gn, gn, c.n_heads), _multipliers(f, "ssm_multipliers", 5), strict=True)]
    )  # fmt: skip
    m_in, k_m = get("attention_in_multiplier"), get("key_multiplier")
    scales = {
        "parallel": {
            "in_proj": get("ssm_in_multiplier") * mup[None, :], "in_proj_b": mup,
            "out_proj": get("ssm_out_multiplier"), "out_proj_b": get("ssm_out_multiplier"),
            "q_proj": m_in, "k_proj": m_in * k_m, "k_b": k_m, "v_proj": m_in,
            "o_proj": get("attention_out_multiplier"), "o_b": get("attention_out_multiplier"),
        },
        "mlp": {"gate_proj": gate_m, "gate_b": gate_m, "down_proj": down_m, "down_b": down_m},
    }  # fmt: skip
    for kind, layer in zip(c.kinds, params["layers"], strict=True):
        for name, m in scales[kind].items():
            if not (np.ndim(m) == 0 and m == 1.0):
                _scale(layer["mixer"], name, m)
    return params


_ZAMBA2_HANDLED = frozenset(
    {
        "model_type", "hidden_size", "vocab_size", "num_hidden_layers", "layers_block_type", "layer_types",
        "mamba_d_state", "mamba_d_conv", "mamba_expand", "mamba_ngroups", "n_mamba_heads", "chunk_size",
        "add_bias_linear", "intermediate_size", "hidden_act", "num_attention_heads",
        "num_key_value_heads", "num_mem_blocks", "use_shared_attention_adapter", "adapter_rank",
        "use_mem_rope", "rope_parameters", "rope_theta", "rope_scaling", "rms_norm_eps",
        "tie_word_embeddings", "time_step_min",
    }
)  # fmt: skip
# transformers recomputes the derived fields from the others whatever the file says (attention width 2d,
# head dim 2d / H, the Mamba head dim, the hybrid layers' indices); use_long_context only raises
# max_position_embeddings; the kernels switches choose an implementation, not a function; the conv has a
# bias whatever use_conv_bias says (transformers builds it with bias=True)
_ZAMBA2_IGNORED = (GENERIC_IGNORED - {"time_step_min"}) | {
    "use_conv_bias",
    "attention_hidden_size", "attention_head_dim", "mamba_headdim", "kv_channels", "num_query_groups",
    "hybrid_layer_ids", "use_long_context", "max_position_embeddings", "attention_dropout",
    "num_logits_to_keep", "use_mamba_kernels", "use_mem_eff_path",
}  # fmt: skip
# Zamba2's layer names -> latim-jax kinds ("mamba" is the legacy name of "linear_attention")
_ZAMBA2_KINDS = {"linear_attention": "mamba2", "mamba": "mamba2", "hybrid": "shared"}
# the Mamba-2 mixer's gated norm: Zamba2 builds it with this eps whatever rms_norm_eps says
ZAMBA2_SSM_NORM_EPS = 1e-5


def zamba2_layer_kinds(f: ConfigFields) -> tuple[str, ...]:
    """Each layer's kind from ``layers_block_type``: "shared" for a hybrid layer (the shared transformer
    block feeding the layer's Mamba-2), "mamba2" otherwise; transformers' default pattern when absent."""
    n = f.int("num_hidden_layers", 54)
    key = next((k for k in ("layers_block_type", "layer_types") if f.has(k)), None)
    names = None if key is None else f.raw(key)
    if names is None:  # transformers' default pattern (54 layers)
        names = ["mamba"] + (["mamba"] * 5 + ["hybrid"]) * 7 + ["mamba"] * 4 + ["hybrid"] + ["mamba"] * 3
        names += ["hybrid"] + ["mamba"] * 2
        key = "layers_block_type"
    if not isinstance(names, list) or len(names) != n or any(x not in _ZAMBA2_KINDS for x in names):
        raise f.error(key, "wrong layer types", f"{n} entries of {sorted(_ZAMBA2_KINDS)}", names)
    return tuple(_ZAMBA2_KINDS[x] for x in names)


def zamba2_config(data: dict[str, Any], file: str) -> MambaConfig:
    """A :class:`MambaConfig` from transformers' ``Zamba2Config``: one sublayer per layer, "mamba2" or
    "shared" (a hybrid layer: h + Mamba2(RMSNorm(h + t)), t the shared transformer block's output for
    [h; embeddings]: attention over 2d channels with head dim 2d / H and scale (a / 2)^-1/2, rotary on the
    whole head when ``use_mem_rope``, then a gated MLP and a d x d linear map). The blocks' weights are
    tied every ``num_mem_blocks`` hybrid layers and each layer's adapters are folded into its own copy
    (:func:`zamba2_tensors`). The Mamba-2's Delta is clamped below at ``time_step_min``."""
    f = ConfigFields(data, file=file, handled=_ZAMBA2_HANDLED, ignored=_ZAMBA2_IGNORED)
    kinds = zamba2_layer_kinds(f)
    d_model = f.int("hidden_size", 2560)
    heads = f.int("num_attention_heads", 32)
    kv = f.raw("num_key_value_heads", None)
    kv = heads if kv is None else f.int("num_key_value_heads")
    if (2 * d_model) % heads:
        raise f.error("num_attention_heads", "does not divide the attention width 2 * hidden_size",
                      f"a divisor of {2 * d_model}", heads)  # fmt: skip
    if f.bool("use_shared_attention_adapter", False) and kv != heads:
        why = "the q/k/v adapters output 2 * hidden_size channels: transformers runs them only if kv = heads"
        raise f.error("num_key_value_heads", why, heads, kv)
    f.int("adapter_rank", 128)
    if f.int("num_mem_blocks", 1) < 1:
        raise f.error("num_mem_blocks", "wrong value", "a positive int", f.raw("num_mem_blocks"))
    expand, m_heads = f.int("mamba_expand", 2), f.int("n_mamba_heads", 8)
    if (expand * d_model) % m_heads:
        raise f.error("n_mamba_heads", "does not divide mamba_expand * hidden_size",
                      f"a divisor of {expand * d_model}", m_heads)  # fmt: skip
    eps = f.float("rms_norm_eps", 1e-5)
    if eps != ZAMBA2_SSM_NORM_EPS:
        why = f"Zamba2's Mamba-2 gated norm uses eps {ZAMBA2_SSM_NORM_EPS} whatever rms_norm_eps says, and "
        raise f.error("rms_norm_eps", why + "latim-jax has one eps for both", ZAMBA2_SSM_NORM_EPS, eps)
    theta = 0.0
    if f.bool("use_mem_rope", False):
        theta, _ = _rope(f, 10000.0, 1.0)
    else:
        _rope(f, 10000.0, 1.0)  # checked either way
    a = 2 * d_model // heads
    bias = f.bool("add_bias_linear", False)
    return build_config(
        file, version=2, family="zamba2", d_model=d_model, n_layers=len(kinds), layer_kinds=kinds,
        vocab_size=f.int("vocab_size", 32000), tie_embeddings=f.bool("tie_word_embeddings", True),
        d_state=f.int("mamba_d_state", 64), d_conv=f.int("mamba_d_conv", 4), expand=expand,
        head_dim=expand * d_model // m_heads, n_groups=f.int("mamba_ngroups", 1),
        chunk_size=f.int("chunk_size", 256), conv_bias=True, proj_bias=bias,
        rms_eps=eps, time_step_limit=(f.float("time_step_min", 0.001), math.inf),
        attn_heads=heads, attn_kv_heads=kv, attn_head_dim=a, attn_scale=(a / 2) ** -0.5, rope_theta=theta,
        mlp_width=f.raw("intermediate_size", None) and f.int("intermediate_size") or 4 * d_model,
        mlp_activation=_mlp_activation(f, "hidden_act", "gelu"), mlp_gated=True, mlp_bias=bias,
    )  # fmt: skip


def _check_adapter(tensors, parts: list[str]) -> None:
    """A low-rank adapter (down (r, in), up (out, r)) must match its weight (out, in) (all present:
    :meth:`TensorFiles.derive` checked)."""
    weight, down, up = parts
    out, inp = tensors.shape(weight)
    r = tensors.shape(down)[0]
    for name, want in ((down, (r, inp)), (up, (out, r))):
        if tensors.shape(name) != want:
            raise CheckpointError("adapter shape does not match its weight", file=tensors.file_of(name),
                                  key=name, expected=want, found=tensors.shape(name))  # fmt: skip


def zamba2_tensors(config: MambaConfig, tensors, data: dict[str, Any]) -> None:
    """Give each hybrid layer its own shared-block tensors, in place: Zamba2 stores the block of hybrid
    layer k (block k % num_mem_blocks) once, under the first hybrid layer using it, with every layer's
    adapters inside it (adapter slot k); transformers ties the blocks only when ``tie_word_embeddings``
    (untied, every hybrid layer reads its own stored block, with its adapter in the same slot k); layer
    k's q, k, v (with ``use_shared_attention_adapter``) and gate|up weights are the block's plus its
    adapter's product B_k A_k (a LoRA that is always on), and its norms, o_proj and down_proj the
    block's. The stored originals are consumed; the slots of an untied block that other layers would use
    are dropped, as transformers never runs them."""
    f = ConfigFields(data, file="config.json", handled=_ZAMBA2_HANDLED, ignored=_ZAMBA2_IGNORED)
    n_blocks = f.int("num_mem_blocks", 1)
    qkv_adapters = f.bool("use_shared_attention_adapter", False)
    hybrid = [i for i, kind in enumerate(config.kinds) if kind == "shared"]
    tied = config.tie_embeddings
    prefix = next((k[: k.index("model.")] for k in tensors.keys() if "model." in k), "")
    consumed = set()
    for k, layer in enumerate(hybrid):
        mine = f"{prefix}model.layers.{layer}.shared_transformer."
        # transformers ties the blocks only with tie_word_embeddings (untied, each layer keeps its own)
        owner = f"{prefix}model.layers.{hybrid[k % n_blocks]}.shared_transformer." if tied else mine
        plain = ["input_layernorm.weight", "pre_ff_layernorm.weight", "self_attn.o_proj.weight",
                 "feed_forward.down_proj.weight"]  # fmt: skip
        if config.mlp_bias:  # add_bias_linear
            plain += ["feed_forward.down_proj.bias", "feed_forward.gate_up_proj.bias"]
        adapted = [("feed_forward.gate_up_proj", "feed_forward.gate_up_proj_adapter_list")]
        if qkv_adapters:
            adapted += [(f"self_attn.{p}_proj", f"self_attn.linear_{p}_adapter_list") for p in "qkv"]
        else:
            plain += [f"self_attn.{p}_proj.weight" for p in "qkv"]
        for name in plain:  # a missing one is reported by derive, naming the stored key
            tensors.derive(mine + "own." + name, [owner + name], lambda x: x)
            consumed.add(owner + name)
        for weight, adapters in adapted:
            slot = f"{owner}{adapters}.{k}."
            parts = [owner + weight + ".weight", slot + "0.weight", slot + "1.weight"]
            tensors.derive(mine + "own." + weight + ".weight", parts, lambda w, down, up: w + up @ down)
            _check_adapter(tensors, parts)
            consumed.update(parts)
    owners = {f"{prefix}model.layers.{layer}." for layer in (hybrid[:n_blocks] if tied else hybrid)}
    for name in tensors.keys():
        if ".shared_transformer." not in name or ".own." in name:
            continue
        if not any(name.startswith(o) for o in owners):  # a tied block stored again: transformers ties it
            consumed.add(name)
        elif not tied and "_adapter_list." in name:  # an untied block's other layers' slots: never run
            consumed.add(name)
    tensors.consume(sorted(consumed))


_QWEN3_NEXT_HANDLED = frozenset(
    {
        "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "hidden_act", "rms_norm_eps", "tie_word_embeddings",
        "rope_parameters", "rope_theta", "rope_scaling", "partial_rotary_factor", "attention_bias",
        "head_dim",
        "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
        "linear_num_value_heads", "decoder_sparse_step", "moe_intermediate_size",
        "shared_expert_intermediate_size", "num_experts_per_tok", "num_experts", "norm_topk_prob",
        "mlp_only_layers", "layer_types", "full_attention_interval",
    }
)  # fmt: skip
# the router's auxiliary loss is training only; positions past max_position_embeddings rotate like any other
_QWEN3_NEXT_IGNORED = GENERIC_IGNORED | {
    "attention_dropout", "max_position_embeddings", "output_router_logits", "router_aux_loss_coef",
}  # fmt: skip


def qwen3_next_config(data: dict[str, Any], file: str) -> MambaConfig:
    """A :class:`MambaConfig` from transformers' ``Qwen3NextConfig`` (``model_type: qwen3_next``) or the
    text models of Qwen3.5 (``qwen3_5_text``: a SwiGLU MLP in every layer; ``qwen3_5_moe_text``: experts
    in every layer, the top k always renormalised): each layer i is two sublayers, 2i its token mixer (a
    Gated DeltaNet, kind "gdn", where ``layer_types`` says "linear_attention"; else gated attention with
    per-head q/k RMSNorm and partial rotary) and 2i + 1 its feed-forward (Qwen3-Next: routed experts
    with a sigmoid-gated shared expert where i is not in ``mlp_only_layers`` and (i + 1) %
    ``decoder_sparse_step`` == 0, else a SwiGLU MLP). Its RMSNorms scale by 1 + w (folded into the
    weights by :func:`qwen3_next_finish`). Qwen3.5's multimodal rotary (``mrope_section``) rotates text
    positions exactly as the default rotary does (its three position axes are equal for text), so those
    keys are read as the default rotary."""
    family = data.get("model_type", "qwen3_next")
    if isinstance(data.get("rope_parameters"), dict):  # Qwen3.5: the multimodal sections, text = default
        data = {**data, "rope_parameters": {k: v for k, v in data["rope_parameters"].items()
                                            if k not in ("mrope_section", "mrope_interleaved")}}  # fmt: skip
    f = ConfigFields(data, file=file, handled=_QWEN3_NEXT_HANDLED, ignored=_QWEN3_NEXT_IGNORED)
    n = f.int("num_hidden_layers", 48)
    types = f.raw("layer_types", None)
    if types is None:
        interval = f.int("full_attention_interval", 4)
        types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)]
    if not isinstance(types, list) or len(types) != n or set(types) - {"linear_attention", "full_attention"}:
        raise f.error("layer_types", "wrong value", f'{n} of "linear_attention" / "full_attention"', types)
    only = f.raw("mlp_only_layers", None) or []
    if not isinstance(only, list) or not all(isinstance(i, int) for i in only):
        raise f.error("mlp_only_layers", "wrong value", "a list of layer indices", only)
    experts = 0 if family == "qwen3_5_text" else f.int("num_experts", 512 if family == "qwen3_next" else 256)
    step = f.int("decoder_sparse_step", 1)
    kinds = []
    for i, t in enumerate(types):
        sparse = i not in only and experts > 0 and (i + 1) % step == 0
        kinds += ["gdn" if t == "linear_attention" else "attention", "moe" if sparse else "mlp"]
    d_model = f.int("hidden_size", 2048)
    if f.bool("attention_bias", False):
        raise f.error("attention_bias", "unsupported (a gated query projection with a bias)", False, True)
    heads = f.int("num_attention_heads", 16)
    head_dim = _attention_head_dim(f, d_model, heads)
    if f.has("partial_rotary_factor") and f.raw("rope_parameters", None) is None:
        theta, fraction = _rope(f, 10000.0, f.float("partial_rotary_factor"))
    else:
        theta, fraction = _rope(f, 10000.0, 0.25)
    act = _activation(f, "hidden_act", "silu")
    eps = f.float("rms_norm_eps", 1e-6)
    gdn = DeltaRuleConfig(
        k_heads=f.int("linear_num_key_heads", 16), v_heads=f.int("linear_num_value_heads", 32),
        k_dim=f.int("linear_key_head_dim", 128), v_dim=f.int("linear_value_head_dim", 128),
        conv=f.int("linear_conv_kernel_dim", 4), norm_eps=eps, activation=act,
    )  # fmt: skip
    moe = {}
    if "moe" in kinds:
        moe = dict(
            moe_experts=experts, moe_top_k=f.int("num_experts_per_tok", 10 if family == "qwen3_next" else 8),
            moe_width=f.int("moe_intermediate_size", 512),
            moe_shared_width=f.int("shared_expert_intermediate_size", 512), moe_shared_gate=True,
            # softmax over all experts, the best k renormalised = softmax over the best k's logits
            moe_router="softmax_topk" if f.bool("norm_topk_prob", True) else "softmax_all",
        )  # fmt: skip
    return build_config(
        file, version=2, family=family, d_model=d_model, n_layers=len(kinds), layer_kinds=tuple(kinds),
        vocab_size=f.int("vocab_size", 151936), tie_embeddings=f.bool("tie_word_embeddings", False),
        rms_eps=eps, attn_heads=heads, attn_kv_heads=f.int("num_key_value_heads", 2), attn_head_dim=head_dim,
        rope_theta=theta, rope_dim=_rope_dim(head_dim, fraction), attn_qk_norm=True, attn_output_gate=True,
        mlp_width=f.int("intermediate_size", 5632), mlp_activation=_mlp_activation(f, "hidden_act", "silu"),
        mlp_gated=True, sections={"gdn": gdn}, **moe,
    )  # fmt: skip


def qwen3_next_finish(data: dict[str, Any], config: MambaConfig, params: dict) -> dict:
    """Fold Qwen3-Next's zero-centred RMSNorms (x / rms(x) * (1 + w)) into weights 1 + w, in fp32: every
    sublayer's pre-norm, the final norm and the attention's q / k norms (not the Gated DeltaNet's gated
    norm, which scales by w)."""
    del data, config

    def plus_one(w):
        return np.asarray(w, np.float32) + 1.0

    params["norm_f"] = plus_one(params["norm_f"])
    for layer in params["layers"]:
        layer["norm"] = plus_one(layer["norm"])
        for name in ("q_norm", "k_norm"):
            if name in layer["mixer"]:
                layer["mixer"][name] = plus_one(layer["mixer"][name])
    return params


def _concat_rows(*arrays):
    return np.concatenate(arrays, axis=0)


def _stacked_rows(tensors, names: list[str], d_model: int) -> tuple[int, int]:
    """The shape of ``names`` (each (rows, d_model)) stacked along their rows; a missing tensor or a wrong
    width is a CheckpointError naming it."""
    rows = 0
    for name in names:
        if name not in tensors:
            raise CheckpointError("missing tensor", file=tensors.label, key=name,
                                  expected=f"(rows, {d_model})", found="no such key")  # fmt: skip
        shape = tensors.shape(name)
        if len(shape) != 2 or shape[1] != d_model:
            raise CheckpointError("wrong shape", file=tensors.file_of(name), key=name,
                                  expected=f"(rows, {d_model})", found=shape)  # fmt: skip
        rows += shape[0]
    return rows, d_model


def qwen3_next_tensors(config: MambaConfig, tensors) -> None:
    """Present Qwen3-Next's (and Qwen3.5's) projections in the layout's form, in place: each Gated
    DeltaNet's in_proj_qkvz / in_proj_ba rows reordered to [q | k | v | z] / [b | a] (``latim_in_proj``,
    ``latim_ba_proj``; Qwen3.5's in_proj_qkv, in_proj_z, in_proj_b, in_proj_a stacked in that order),
    each attention's q_proj rows (per head: query, gate) to [queries | gates] (``latim_q_proj``, read as
    two halves: q_proj and the output gate g_proj), and each expert's matrices stacked
    (``mlp.experts.gate_proj`` ...: (E, out, in))."""
    prefix = next((k[: k.index("model.")] for k in tensors.keys() if "model." in k), "")
    section = config.section("gdn") if "gdn" in config.kinds else None
    for k, kind in enumerate(config.kinds):
        base = f"{prefix}model.layers.{k // 2}."
        if kind == "gdn" and f"{base}linear_attn.in_proj_qkv.weight" in tensors:  # Qwen3.5: apart
            _stack_projections(tensors, f"{base}linear_attn.", config, (
                ("latim_in_proj", ("in_proj_qkv", "in_proj_z")),
                ("latim_ba_proj", ("in_proj_b", "in_proj_a")),
            ))  # fmt: skip
        elif kind == "gdn":  # Qwen3-Next: interleaved per key head
            qkvz, ba = qkvz_rows(section), ba_rows(section)
            for stored, derived, rows in (
                ("in_proj_qkvz", "latim_in_proj", qkvz),
                ("in_proj_ba", "latim_ba_proj", ba),
            ):
                name = f"{base}linear_attn.{stored}.weight"
                if name in tensors and tensors.shape(name)[0] != rows.size:
                    raise CheckpointError(
                        "wrong shape", file=tensors.file_of(name), key=name,
                        expected=(rows.size, config.d_model), found=tensors.shape(name),
                    )  # fmt: skip
                tensors.derive(f"{base}linear_attn.{derived}.weight", [name], lambda w, rows=rows: w[rows])
                tensors.consume([name])
        elif kind == "attention":
            name = f"{base}self_attn.q_proj.weight"
            rows = gated_query_rows(config.attn_heads, config.attn_head_dim)
            if name in tensors and tensors.shape(name)[0] != rows.size:
                raise CheckpointError(
                    "wrong shape (a gated q_proj holds each head's query and gate)",
                    file=tensors.file_of(name), key=name, expected=(rows.size, config.d_model),
                    found=tensors.shape(name),
                )  # fmt: skip
            tensors.derive(f"{base}self_attn.latim_q_proj.weight", [name], lambda w, rows=rows: w[rows])
            tensors.consume([name])
        elif kind == "moe":  # each expert's matrices stored apart: stacked into (E, out, in)
            for part in ("gate_proj", "up_proj", "down_proj"):
                names = [f"{base}mlp.experts.{e}.{part}.weight" for e in range(config.moe_experts)]
                tensors.stack(f"{base}mlp.experts.{part}", names)


def _stack_projections(tensors, base: str, config: MambaConfig, stacks) -> None:
    """Each (derived name, stored names) of ``stacks``: the stored (rows, d) matrices under ``base``
    stacked along their rows into ``base + derived + ".weight"``, and the stored ones consumed."""
    for derived, stored in stacks:
        names = [f"{base}{n}.weight" for n in stored]
        shape = _stacked_rows(tensors, names, config.d_model)
        tensors.derive(f"{base}{derived}.weight", names, _concat_rows, shape=shape)
        tensors.consume(names)


_OLMO_HYBRID_HANDLED = frozenset(
    {
        "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps",
        "tie_word_embeddings", "rope_parameters", "rope_theta", "rope_scaling", "attention_bias",
        "layer_types", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
        "linear_value_head_dim", "linear_conv_kernel_dim", "linear_allow_neg_eigval",
    }
)  # fmt: skip
# the a_log / dt ranges only initialise A_log and dt_bias, which the checkpoint holds; positions past
# max_position_embeddings rotate like any other
_OLMO_HYBRID_IGNORED = GENERIC_IGNORED | {
    "attention_dropout", "max_position_embeddings", "linear_a_log_min", "linear_a_log_max", "linear_dt_min",
    "linear_dt_max", "linear_dt_init_floor",
}  # fmt: skip


def olmo_hybrid_config(data: dict[str, Any], file: str) -> MambaConfig:
    """A :class:`MambaConfig` from transformers' ``OlmoHybridConfig`` (``model_type: olmo_hybrid``): each
    layer i is two sublayers, 2i its token mixer and 2i + 1 its SwiGLU MLP. A "linear_attention" layer is
    pre-norm, h + GDN(RMSNorm(h)) then h + MLP(RMSNorm(h)), its Gated DeltaNet with q, k, v, the gate, b
    and a projected apart (stacked by :func:`olmo_hybrid_tensors`), beta = 2 sigmoid(b) while
    ``linear_allow_neg_eigval`` (the default), and its gated norm's eps 1e-5 whatever rms_norm_eps says
    (transformers fixes it, as FLA does). A "full_attention" layer is post-norm (both sublayers in
    ``post_norm_layers``: h + RMSNorm(Attn(h)) then h + RMSNorm(MLP(h))), its q and k RMS-normalised over
    all heads at once (``attn_qk_norm_full``), rotary over the whole head (transformers' OLMo rotary
    reads no partial_rotary_factor), none when rope_parameters' rope_theta is null (NoPE)."""
    params = data.get("rope_parameters")
    nope = isinstance(params, dict) and "rope_theta" in params and params["rope_theta"] is None
    if isinstance(params, dict):  # the rotary's width is always the whole head (see above)
        drop = {"partial_rotary_factor"} | ({"rope_theta"} if nope else set())
        data = {**data, "rope_parameters": {k: v for k, v in params.items() if k not in drop}}
    f = ConfigFields(data, file=file, handled=_OLMO_HYBRID_HANDLED, ignored=_OLMO_HYBRID_IGNORED)
    n = f.int("num_hidden_layers", 32)
    types = f.raw("layer_types", None)
    if types is None:  # transformers' default: every fourth layer attention, at least the last one
        types = ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(n)]
        types[-1] = types[-1] if "full_attention" in types else "full_attention"
    if not isinstance(types, list) or len(types) != n or set(types) - {"linear_attention", "full_attention"}:
        raise f.error("layer_types", "wrong value", f'{n} of "linear_attention" / "full_attention"', types)
    kinds, post = [], []
    for i, t in enumerate(types):
        kinds += ["gdn" if t == "linear_attention" else "attention", "mlp"]
        post += [2 * i, 2 * i + 1] if t == "full_attention" else []
    d_model = f.int("hidden_size", 3840)
    heads = f.int("num_attention_heads", 30)
    kv = f.raw("num_key_value_heads", None)
    kv = heads if kv is None else f.int("num_key_value_heads")
    head_dim = _attention_head_dim(f, d_model, heads)
    theta, _ = _rope(f, 10000.0, 1.0)
    k_heads = f.raw("linear_num_key_heads", None)
    k_heads = heads if k_heads is None else f.int("linear_num_key_heads")
    v_heads = f.raw("linear_num_value_heads", None)
    v_heads = heads if v_heads is None else f.int("linear_num_value_heads")
    k_dim = f.raw("linear_key_head_dim", None)
    k_dim = int(0.75 * d_model / k_heads) if k_dim is None else f.int("linear_key_head_dim")
    v_dim = f.raw("linear_value_head_dim", None)
    v_dim = 2 * k_dim if v_dim is None else f.int("linear_value_head_dim")
    gdn = DeltaRuleConfig(
        k_heads=k_heads, v_heads=v_heads, k_dim=k_dim, v_dim=v_dim, conv=f.int("linear_conv_kernel_dim", 4),
        norm_eps=1e-5, activation=_activation(f, "hidden_act", "silu"),
        beta_scale=2.0 if f.bool("linear_allow_neg_eigval", True) else 1.0,
    )  # fmt: skip
    bias = f.bool("attention_bias", False)
    return build_config(
        file, version=2, family="olmo_hybrid", d_model=d_model, n_layers=len(kinds), layer_kinds=tuple(kinds),
        post_norm_layers=tuple(post), vocab_size=f.int("vocab_size", 100352),
        tie_embeddings=f.bool("tie_word_embeddings", False), rms_eps=f.float("rms_norm_eps", 1e-6),
        attn_heads=heads, attn_kv_heads=kv, attn_head_dim=head_dim, attn_bias=bias, attn_out_bias=bias,
        rope_theta=0.0 if nope else theta, attn_qk_norm=True, attn_qk_norm_full=True,
        mlp_width=f.int("intermediate_size", 11008), mlp_activation=_mlp_activation(f, "hidden_act", "silu"),
        mlp_gated=True, sections={"gdn": gdn},
    )  # fmt: skip


# the names OLMo-Hybrid's checkpoints store (OLMo-core's, which save_pretrained writes back) -> the module's
# (transformers' conversion_mapping): the norms, per layer; q_conv1d | k_conv1d | v_conv1d -> conv1d
_OLMO_HYBRID_STORED_NORMS = {
    "attention_layer_norm": "input_layernorm", "feedforward_layer_norm": "post_attention_layernorm",
}  # fmt: skip


def olmo_hybrid_tensors(config: MambaConfig, tensors) -> None:
    """Present OLMo-Hybrid's stored tensors in the layout's form, in place: the norms' stored names read
    as the module's (``_OLMO_HYBRID_STORED_NORMS``: an attention layer's feedforward_layer_norm is its
    post_attention_layernorm, which follows the attention), the three stored convs concatenated in the
    order q, k, v into conv1d (transformers' save_pretrained splits conv1d into thirds whatever the q, k
    and v widths are; the concatenation restores it either way), q_proj, k_proj, v_proj and the gate's
    g_proj stacked into [q | k | v | z] (``latim_in_proj``), b_proj and a_proj into [b | a]
    (``latim_ba_proj``)."""
    prefix = next((k[: k.index("model.")] for k in tensors.keys() if "model." in k), "")
    for k, kind in enumerate(config.kinds):
        base = f"{prefix}model.layers.{k // 2}."
        if k % 2 == 0:
            for stored, name in _OLMO_HYBRID_STORED_NORMS.items():
                if f"{base}{stored}.weight" in tensors and f"{base}{name}.weight" not in tensors:
                    tensors.derive(f"{base}{name}.weight", [f"{base}{stored}.weight"], lambda w: w)
                    tensors.consume([f"{base}{stored}.weight"])
        if kind != "gdn":
            continue
        attn = base + "linear_attn."
        convs = [f"{attn}{p}_conv1d.weight" for p in "qkv"]
        if convs[0] in tensors:
            s = config.section("gdn")
            tensors.derive(attn + "conv1d.weight", convs, _concat_rows, shape=(s.conv_width, 1, s.conv))
            tensors.consume(convs)
        _stack_projections(tensors, attn, config, (
            ("latim_in_proj", ("q_proj", "k_proj", "v_proj", "g_proj")),
            ("latim_ba_proj", ("b_proj", "a_proj")),
        ))  # fmt: skip


# transformers' KimiLinearConfig attribute names -> the keys its config.json is written with
_KIMI_ALIASES = {
    "num_local_experts": "num_experts", "num_experts_per_tok": "num_experts_per_token",
    "n_shared_experts": "num_shared_experts", "n_group": "num_expert_group",
    "norm_topk_prob": "moe_renormalize",
}  # fmt: skip
_KIMI_HANDLED = frozenset(
    {
        "model_type", "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
        "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "num_shared_experts",
        "routed_scaling_factor", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim",
        "qk_nope_head_dim", "num_expert_group", "topk_group", "num_experts_per_token", "moe_renormalize",
        "hidden_act", "rms_norm_eps", "tie_word_embeddings", "attention_bias", "num_experts",
        "mlp_layer_types",
        "layer_types", "linear_head_dim", "linear_num_heads", "linear_conv_kernel_dim", "linear_attn_config",
        "first_k_dense_replace", "head_dim", "qk_head_dim", "moe_router_activation_func",
    }
)  # fmt: skip
# training-only and generation-only fields; head_dim / qk_head_dim are written as derived values
_KIMI_IGNORED = GENERIC_IGNORED | {
    "attention_dropout", "max_position_embeddings", "model_max_length", "output_router_logits",
    "pretraining_tp", "router_aux_loss_coef", "moe_layer_freq", "use_grouped_topk",
}  # fmt: skip


def kimi_linear_config(data: dict[str, Any], file: str) -> MambaConfig:
    """A :class:`MambaConfig` from transformers' ``KimiLinearConfig`` (``model_type: kimi_linear``): each
    layer i is two sublayers, 2i its token mixer (Kimi Delta Attention, kind "kda", or multi-head latent
    attention without a rotary embedding, kind "mla", from ``layer_types`` or the checkpoint's
    ``linear_attn_config``) and 2i + 1 its feed-forward (a SwiGLU MLP for the first
    ``first_k_dense_replace`` layers or where ``mlp_layer_types`` says "dense", else sigmoid-routed
    experts in groups with a correction bias, renormalised and scaled, plus shared experts)."""
    data = _resolve_aliases(data, _KIMI_ALIASES, file)
    f = ConfigFields(data, file=file, handled=_KIMI_HANDLED, ignored=_KIMI_IGNORED)
    n = f.int("num_hidden_layers", 27)
    linear = f.raw("linear_attn_config", None) or {}
    if not isinstance(linear, dict):
        raise f.error("linear_attn_config", "wrong type", "a dict", linear)
    types = f.raw("layer_types", None)
    if types is None and "full_attn_layers" in linear and "kda_layers" in linear:  # 1-indexed layers
        types = [None] * n
        for key, name in (("full_attn_layers", "full_attention"), ("kda_layers", "linear_attention")):
            for i in linear[key]:
                if not isinstance(i, int) or not 1 <= i <= n:
                    raise f.error("linear_attn_config", f"{key} lists layer {i!r}", f"1..{n}", linear[key])
                types[i - 1] = name
    if types is None:
        types = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n)]
    if not isinstance(types, list) or len(types) != n or set(types) - {"linear_attention", "full_attention"}:
        raise f.error("layer_types", "wrong value", f'{n} of "linear_attention" / "full_attention"', types)
    mlp_types = f.raw("mlp_layer_types", None)
    if mlp_types is None:
        dense = f.int("first_k_dense_replace", 1) if f.has("first_k_dense_replace") else 1
        mlp_types = ["dense" if i < dense else "sparse" for i in range(n)]
    if not isinstance(mlp_types, list) or len(mlp_types) != n or set(mlp_types) - {"dense", "sparse"}:
        raise f.error("mlp_layer_types", "wrong value", f'{n} of "dense" / "sparse"', mlp_types)
    if f.has("moe_router_activation_func"):
        f.require("moe_router_activation_func", ("sigmoid",), "sigmoid", "only the sigmoid router is read")
    kinds = []
    for t, m in zip(types, mlp_types, strict=True):
        kinds += ["kda" if t == "linear_attention" else "mla", "moe" if m == "sparse" else "mlp"]
    heads = f.int("num_attention_heads", 32)
    kv = f.raw("num_key_value_heads", None)
    if kv is not None and f.int("num_key_value_heads") != heads:
        raise f.error("num_key_value_heads", "latent attention expands a key and a value per head", heads, kv)
    eps = f.float("rms_norm_eps", 1e-5)
    head = int(linear.get("head_dim", f.int("linear_head_dim", 128)))
    kda_heads = int(linear.get("num_heads", f.int("linear_num_heads", 32)))
    conv = int(linear.get("short_conv_kernel_size", f.int("linear_conv_kernel_dim", 4)))
    kda = DeltaRuleConfig(k_heads=kda_heads, v_heads=kda_heads, k_dim=head, v_dim=head, conv=conv, chunk=16,
                          norm_eps=eps, activation=_activation(f, "hidden_act", "silu"))  # fmt: skip
    q_rank = f.raw("q_lora_rank", None)
    mla = MLAConfig(
        heads=heads, kv_rank=f.int("kv_lora_rank", 512), nope_dim=f.int("qk_nope_head_dim", 128),
        shared_dim=f.int("qk_rope_head_dim", 64), v_dim=f.int("v_head_dim", 128),
        q_rank=0 if q_rank is None else f.int("q_lora_rank"), bias=f.bool("attention_bias", False),
    )  # fmt: skip
    sections = {name: sec for name, sec in (("kda", kda), ("mla", mla)) if name in kinds}
    moe = {}
    if "moe" in kinds:
        width = f.int("moe_intermediate_size", 1024)
        groups = f.int("num_expert_group", 1)
        moe = dict(
            moe_experts=f.int("num_experts", 256), moe_top_k=f.int("num_experts_per_token", 8),
            moe_width=width, moe_shared_width=width * f.int("num_shared_experts", 1),
            moe_router="sigmoid_groups",
            moe_groups=groups, moe_topk_groups=f.int("topk_group", 1),
            moe_norm_topk=f.bool("moe_renormalize", True),
            moe_scale=f.float("routed_scaling_factor", 2.446),
        )  # fmt: skip
    return build_config(
        file, version=2, family="kimi_linear", d_model=f.int("hidden_size", 2304), n_layers=len(kinds),
        layer_kinds=tuple(kinds), vocab_size=f.int("vocab_size", 163840),
        tie_embeddings=f.bool("tie_word_embeddings", False), rms_eps=eps,
        mlp_width=f.int("intermediate_size", 9216),
        mlp_activation=_mlp_activation(f, "hidden_act", "silu"), mlp_gated=True, sections=sections, **moe,
    )  # fmt: skip


def kimi_linear_tensors(config: MambaConfig, tensors) -> None:
    """Present Kimi Linear's stored tensors in the layout's form, in place: each KDA's q, k, v projections
    and their three convs stacked into one (``latim_in_proj``, ``latim_conv1d``), its A_log (1, 1, H, 1)
    as (H,) (``latim_A_log``), and each expert's w1 / w3 / w2 (gate, up, down) stacked into (E, out, in)."""
    prefix = next((k[: k.index("model.")] for k in tensors.keys() if "model." in k), "")
    for k, kind in enumerate(config.kinds):
        base = f"{prefix}model.layers.{k // 2}."
        if kind == "kda":
            s = config.section("kda")
            names = [f"{base}self_attn.{p}_proj.weight" for p in "qkv"]
            shape = _stacked_rows(tensors, names, config.d_model)
            tensors.derive(f"{base}self_attn.latim_in_proj.weight", names, _concat_rows, shape=shape)
            convs = [f"{base}self_attn.{p}_conv1d.weight" for p in "qkv"]
            tensors.derive(f"{base}self_attn.latim_conv1d.weight", convs, _concat_rows,
                           shape=(s.conv_width, 1, s.conv))  # fmt: skip
            a_log = f"{base}self_attn.A_log"
            tensors.derive(
                f"{base}self_attn.latim_A_log", [a_log], lambda a: a.reshape(-1), shape=(s.k_heads,)
            )
            tensors.consume(names + convs + [a_log])
        elif kind == "moe":
            for part, w in (("gate", "w1"), ("up", "w3"), ("down", "w2")):
                parts = [f"{base}block_sparse_moe.experts.{e}.{w}.weight" for e in range(config.moe_experts)]
                tensors.stack(f"{base}block_sparse_moe.experts.{part}", parts)


READERS = {
    "nemotron_h": nemotron_h_config,
    "bamba": bamba_config,
    "granitemoehybrid": granite_config,
    "jamba": jamba_config,
    "falcon_h1": falcon_h1_config,
    "zamba2": zamba2_config,
    "qwen3_next": qwen3_next_config,
    "qwen3_5_text": qwen3_next_config,
    "qwen3_5_moe_text": qwen3_next_config,
    "kimi_linear": kimi_linear_config,
    "olmo_hybrid": olmo_hybrid_config,
}
# after the weights are read: what a family folds into them
FINISH = {"granitemoehybrid": granite_finish, "falcon_h1": falcon_h1_finish} | dict.fromkeys(
    ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"), qwen3_next_finish
)


def prepare_tensors(config: MambaConfig, tensors, data: dict[str, Any]) -> None:
    """Present a family's stored tensors in the layout's form, in place (Nemotron-H and Jamba store each
    expert's matrices apart: they are stacked into one (E, out, in) tensor per layer and matrix; Zamba2's
    tied blocks and adapters: :func:`zamba2_tensors`). ``data``: the parsed config.json."""
    if config.family == "zamba2":
        zamba2_tensors(config, tensors, data)
        return
    if config.family in ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"):
        qwen3_next_tensors(config, tensors)
        return
    if config.family == "kimi_linear":
        kimi_linear_tensors(config, tensors)
        return
    if config.family == "olmo_hybrid":
        olmo_hybrid_tensors(config, tensors)
        return
    if config.family not in ("nemotron_h", "jamba") or "moe" not in config.kinds:
        return
    for k, kind in enumerate(config.kinds):
        if kind != "moe":
            continue
        if config.family == "nemotron_h":
            base, parts = f"backbone.layers.{k}.mixer.experts", ("up_proj", "down_proj")
        else:  # Jamba: sublayer k is the feed-forward of layer k // 2
            base, parts = f"model.layers.{k // 2}.feed_forward.experts", ("gate_proj", "up_proj", "down_proj")
        for part in parts:
            names = [f"{base}.{e}.{part}.weight" for e in range(config.moe_experts)]
            tensors.stack(f"{base}.{part}", names)
