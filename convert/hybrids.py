"""Config readers of the hybrid families (Hugging Face format): each maps its ``config.json`` onto one
:class:`MambaConfig` whose ``layer_kinds`` lists the sublayers in forward order. The weights then read
through the same layout as a plain Mamba checkpoint (:mod:`.layout`, one name table per layer kind).

A family is one function here and one entry in :data:`READERS`; docs/architecture.md says what else a
new family touches.
"""

from __future__ import annotations

import math
from typing import Any

from latim_jax.model.config import MambaConfig

from .config_fields import ConfigFields
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
    }
)  # fmt: skip
# What transformers' NemotronH never reads in the forward (it ignores them: no attention bias, no sliding
# window, an lm_head never tied, the mixer width from mamba_num_heads * mamba_head_dim, the dt clamp from
# time_step_min) or reads only for training, caching, multi-token prediction and kernels; and the MoE
# fields, which matter only with an "moe" layer (refused below until that kind exists).
_NEMOTRON_IGNORED = GENERIC_IGNORED | {
    "attention_bias", "attention_dropout", "sliding_window", "max_position_embeddings", "expand",
    "time_step_limit", "time_step_floor", "mamba_proj_bias", "hidden_dropout", "use_mamba_kernels",
    "num_logits_to_keep", "mamba_ssm_cache_dtype", "output_router_logits", "num_nextn_predict_layers",
    "mtp_layers_block_type", "moe_shared_expert_overlap", "n_routed_experts", "num_local_experts",
    "num_experts_per_tok", "moe_intermediate_size", "moe_shared_expert_intermediate_size",
    "n_shared_experts", "moe_latent_size", "n_group", "topk_group", "norm_topk_prob",
    "routed_scaling_factor", "mamba_n_groups", "mamba_d_conv", "mamba_expand", "mamba_dt_min",
    "mamba_dt_max", "mamba_dt_limit", "mamba_dt_init_floor", "mamba_conv_bias", "mamba_chunk_size",
}  # fmt: skip


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
    if "moe" in kinds:
        raise f.error(
            f"{key}[{kinds.index('moe')}]",
            "mixture-of-experts layers are not supported yet (latim-jax reads Nemotron-H's Mamba-2, "
            "attention and MLP layers)",
            "linear_attention, full_attention or mlp",
            names[kinds.index("moe")],
        )
    if f.has("num_hidden_layers") and f.int("num_hidden_layers") != len(kinds):
        raise f.error("num_hidden_layers", f"disagrees with {key}", len(kinds), f.raw("num_hidden_layers"))
    return tuple(kinds)


def nemotron_h_config(data: dict[str, Any], file: str) -> MambaConfig:
    """A :class:`MambaConfig` from transformers' ``NemotronHConfig`` (``model_type: nemotron_h``):
    each layer one sublayer, RMSNorm + one of Mamba-2 / attention (no rotary, no bias) / relu^2 MLP."""
    f = ConfigFields(data, file=file, handled=_NEMOTRON_HANDLED, ignored=_NEMOTRON_IGNORED)
    kinds = nemotron_h_kinds(f)
    d_model = f.int("hidden_size", 4096)
    heads, head_dim = f.int("mamba_num_heads", 128), f.int("mamba_head_dim", 64)
    attn_heads = f.int("num_attention_heads", 32)
    kv = f.raw("num_key_value_heads", 8)
    kv = attn_heads if kv is None else f.int("num_key_value_heads")
    return build_config(
        file,
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


READERS = {"nemotron_h": nemotron_h_config}
