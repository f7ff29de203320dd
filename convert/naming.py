"""How each checkpoint family names its tensors: the embedding, the final norm, each sublayer's norm and
module prefix, and each layer kind's parameters (with their orientation). :func:`naming` gives a
family's :class:`Naming`; the plain Mamba layout (Hugging Face, mamba_ssm, Codestral) is the default.

Orientations, torch -> latim-jax (``y = x @ W``): LINEAR (out, in) -> (in, out); CONV (C, 1, k) -> (k, C);
GATE_HALF / UP_HALF: the first / second half of a fused (2 out, in) gate|up weight, as LINEAR; SAME
as stored.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

LINEAR, CONV, SAME = "linear", "conv", "same"
GATE_HALF, UP_HALF = "gate_half", "up_half"
# stacked experts (E, out, in) -> (E, in, out), and the halves of a stacked fused (E, 2 out, in)
STACKED, STACKED_GATE_HALF, STACKED_UP_HALF = "stacked", "stacked_gate_half", "stacked_up_half"

EMBEDDING_NAMES = ("backbone.embeddings.weight", "backbone.embedding.weight")

# param name -> (torch name inside ``backbone.layers.{i}.mixer.``, orientation)
_MIXER_V1 = {
    "in_proj": ("in_proj.weight", LINEAR),
    "in_proj_b": ("in_proj.bias", SAME),
    "conv_w": ("conv1d.weight", CONV),
    "conv_b": ("conv1d.bias", SAME),
    "x_proj": ("x_proj.weight", LINEAR),
    "dt_norm_w": ("dt_layernorm.weight", SAME),
    "B_norm_w": ("b_layernorm.weight", SAME),
    "C_norm_w": ("c_layernorm.weight", SAME),
    "dt_proj": ("dt_proj.weight", LINEAR),
    "dt_bias": ("dt_proj.bias", SAME),
    "A_log": ("A_log", SAME),
    "D": ("D", SAME),
    "out_proj": ("out_proj.weight", LINEAR),
    "out_proj_b": ("out_proj.bias", SAME),
}
_MIXER_V2 = {
    "in_proj": ("in_proj.weight", LINEAR),
    "in_proj_b": ("in_proj.bias", SAME),
    "conv_w": ("conv1d.weight", CONV),
    "conv_b": ("conv1d.bias", SAME),
    "dt_bias": ("dt_bias", SAME),
    "A_log": ("A_log", SAME),
    "D": ("D", SAME),
    "norm_w": ("norm.weight", SAME),
    "out_proj": ("out_proj.weight", LINEAR),
    "out_proj_b": ("out_proj.bias", SAME),
}


_ATTENTION = {
    "q_proj": ("q_proj.weight", LINEAR),
    "q_b": ("q_proj.bias", SAME),
    "k_proj": ("k_proj.weight", LINEAR),
    "k_b": ("k_proj.bias", SAME),
    "v_proj": ("v_proj.weight", LINEAR),
    "v_b": ("v_proj.bias", SAME),
    "o_proj": ("o_proj.weight", LINEAR),
    "o_b": ("o_proj.bias", SAME),
}
_MLP = {
    "up_proj": ("up_proj.weight", LINEAR),
    "up_b": ("up_proj.bias", SAME),
    "gate_proj": ("gate_proj.weight", LINEAR),
    "gate_b": ("gate_proj.bias", SAME),
    "down_proj": ("down_proj.weight", LINEAR),
    "down_b": ("down_proj.bias", SAME),
}
# layer kind -> its mixer's names (inside ``backbone.layers.{i}.mixer.``)
# Nemotron-H's experts (each expert's matrices stacked on reading: convert.hybrids.prepare_tensors)
_MOE = {
    "router": ("gate.weight", LINEAR),
    "router_bias": ("gate.e_score_correction_bias", SAME),
    "experts_up": ("experts.up_proj", STACKED),
    "experts_down": ("experts.down_proj", STACKED),
    "shared_up": ("shared_experts.up_proj.weight", LINEAR),
    "shared_up_b": ("shared_experts.up_proj.bias", SAME),
    "shared_down": ("shared_experts.down_proj.weight", LINEAR),
    "shared_down_b": ("shared_experts.down_proj.bias", SAME),
    "latent_in": ("fc1_latent_proj.weight", LINEAR),
    "latent_in_b": ("fc1_latent_proj.bias", SAME),
    "latent_out": ("fc2_latent_proj.weight", LINEAR),
    "latent_out_b": ("fc2_latent_proj.bias", SAME),
}
MIXER_NAMES = {"mamba1": _MIXER_V1, "mamba2": _MIXER_V2, "attention": _ATTENTION, "mlp": _MLP, "moe": _MOE}


@dataclasses.dataclass(frozen=True)
class Naming:
    """A family's tensor names. ``sublayer(k, kind, kinds)`` -> (the norm's name, the module prefix) of
    sublayer k; ``mixers``: kind -> {latim-jax parameter: (torch name under the prefix, orientation)};
    ``root``: the text every tensor of the model but the head holds (a checkpoint may add a prefix
    before it)."""

    embedding: tuple[str, ...]
    norm_f: str
    sublayer: Callable[[int, str, tuple], tuple[str, str]]
    mixers: dict
    root: str


def _mamba_sublayer(k: int, kind: str, kinds: tuple) -> tuple[str, str]:
    return f"backbone.layers.{k}.norm.weight", f"backbone.layers.{k}.mixer."


MAMBA = Naming(
    embedding=EMBEDDING_NAMES, norm_f="backbone.norm_f.weight", sublayer=_mamba_sublayer,
    mixers=MIXER_NAMES, root="backbone.",
)  # fmt: skip


def _bamba_sublayer(k: int, kind: str, kinds: tuple) -> tuple[str, str]:
    """Bamba writes each layer i as two sublayers: 2i the mixer (Mamba-2 or attention), 2i + 1 the MLP."""
    i = k // 2
    if k % 2:
        return f"model.layers.{i}.pre_ff_layernorm.weight", f"model.layers.{i}.feed_forward."
    module = "mamba." if kind.startswith("mamba") else "self_attn."
    return f"model.layers.{i}.input_layernorm.weight", f"model.layers.{i}." + module


BAMBA = Naming(
    embedding=("model.embed_tokens.weight",), norm_f="model.final_layernorm.weight",
    sublayer=_bamba_sublayer, mixers=MIXER_NAMES, root="model.",
)  # fmt: skip


def _granite_sublayer(k: int, kind: str, kinds: tuple) -> tuple[str, str]:
    """GraniteMoeHybrid: 2i the mixer, 2i + 1 the feed-forward (the shared MLP, with the experts when
    there are some), whose norm transformers names post_attention_layernorm."""
    i = k // 2
    if k % 2:
        return f"model.layers.{i}.post_attention_layernorm.weight", f"model.layers.{i}."
    module = "mamba." if kind.startswith("mamba") else "self_attn."
    return f"model.layers.{i}.input_layernorm.weight", f"model.layers.{i}." + module


_GRANITE_SHARED = {
    "gate": ("shared_mlp.input_linear.weight", GATE_HALF),
    "up": ("shared_mlp.input_linear.weight", UP_HALF),
    "down": ("shared_mlp.output_linear.weight", LINEAR),
}
_GRANITE_MLP = {f"{k}_proj": v for k, v in _GRANITE_SHARED.items()}
_GRANITE_MOE = {f"shared_{k}": v for k, v in _GRANITE_SHARED.items()} | {
    "router": ("block_sparse_moe.router.layer.weight", LINEAR),
    "experts_gate": ("block_sparse_moe.input_linear.weight", STACKED_GATE_HALF),
    "experts_up": ("block_sparse_moe.input_linear.weight", STACKED_UP_HALF),
    "experts_down": ("block_sparse_moe.output_linear.weight", STACKED),
}

GRANITE = Naming(
    embedding=("model.embed_tokens.weight",), norm_f="model.norm.weight", sublayer=_granite_sublayer,
    mixers={**MIXER_NAMES, "mlp": _GRANITE_MLP, "moe": _GRANITE_MOE}, root="model.",
)  # fmt: skip

# Jamba: Bamba's layout (mamba. / self_attn. then feed_forward.), Mamba-1 mixers, its experts stacked on
# reading (convert.hybrids.prepare_tensors)
_JAMBA_MOE = {
    "router": ("router.weight", LINEAR),
    "experts_gate": ("experts.gate_proj", STACKED),
    "experts_up": ("experts.up_proj", STACKED),
    "experts_down": ("experts.down_proj", STACKED),
}
JAMBA = dataclasses.replace(BAMBA, mixers={**MIXER_NAMES, "moe": _JAMBA_MOE})


def _falcon_h1_sublayer(k: int, kind: str, kinds: tuple) -> tuple[str, str]:
    """Falcon-H1: 2i the parallel block (mamba. and self_attn. under one input norm), 2i + 1 the MLP."""
    i = k // 2
    if k % 2:
        return f"model.layers.{i}.pre_ff_layernorm.weight", f"model.layers.{i}.feed_forward."
    return f"model.layers.{i}.input_layernorm.weight", f"model.layers.{i}."


# the parallel block's two halves under their module names
_PARALLEL = {name: ("mamba." + t, o) for name, (t, o) in _MIXER_V2.items()} | {
    name: ("self_attn." + t, o) for name, (t, o) in _ATTENTION.items()
}
FALCON_H1 = Naming(
    embedding=("model.embed_tokens.weight",), norm_f="model.final_layernorm.weight",
    sublayer=_falcon_h1_sublayer, mixers={**MIXER_NAMES, "parallel": _PARALLEL}, root="model.",
)  # fmt: skip


def _zamba2_sublayer(k: int, kind: str, kinds: tuple) -> tuple[str, str]:
    """Zamba2: one sublayer per layer; a hybrid layer's Mamba-2 under mamba_decoder, its shared block's
    tensors under shared_transformer.own. (per-layer copies, adapters folded: convert.hybrids)."""
    if kind == "shared":
        return f"model.layers.{k}.mamba_decoder.input_layernorm.weight", f"model.layers.{k}."
    return f"model.layers.{k}.input_layernorm.weight", f"model.layers.{k}.mamba."


_OWN = "shared_transformer.own."
_SHARED = {name: ("mamba_decoder.mamba." + t, o) for name, (t, o) in _MIXER_V2.items()} | {
    "attn_norm": (_OWN + "input_layernorm.weight", SAME),
    "q_proj": (_OWN + "self_attn.q_proj.weight", LINEAR),
    "k_proj": (_OWN + "self_attn.k_proj.weight", LINEAR),
    "v_proj": (_OWN + "self_attn.v_proj.weight", LINEAR),
    "o_proj": (_OWN + "self_attn.o_proj.weight", LINEAR),
    "ff_norm": (_OWN + "pre_ff_layernorm.weight", SAME),
    "gate_proj": (_OWN + "feed_forward.gate_up_proj.weight", GATE_HALF),
    "up_proj": (_OWN + "feed_forward.gate_up_proj.weight", UP_HALF),
    "gate_b": (_OWN + "feed_forward.gate_up_proj.bias", GATE_HALF),
    "up_b": (_OWN + "feed_forward.gate_up_proj.bias", UP_HALF),
    "down_proj": (_OWN + "feed_forward.down_proj.weight", LINEAR),
    "down_b": (_OWN + "feed_forward.down_proj.bias", SAME),
    "shared_out": ("linear.weight", LINEAR),
}
ZAMBA2 = Naming(
    embedding=("model.embed_tokens.weight",), norm_f="model.final_layernorm.weight",
    sublayer=_zamba2_sublayer, mixers={**MIXER_NAMES, "shared": _SHARED}, root="model.",
)  # fmt: skip


def _qwen3_next_sublayer(k: int, kind: str, kinds: tuple) -> tuple[str, str]:
    """Qwen3-Next: 2i the token mixer (linear_attn. or self_attn.), 2i + 1 the feed-forward (mlp.)."""
    i = k // 2
    if k % 2:
        return f"model.layers.{i}.post_attention_layernorm.weight", f"model.layers.{i}.mlp."
    module = "linear_attn." if kind == "gdn" else "self_attn."
    return f"model.layers.{i}.input_layernorm.weight", f"model.layers.{i}." + module


# the Gated DeltaNet's and the gated attention's interleaved projections are reordered on reading
# (convert.hybrids.qwen3_next_tensors: latim_in_proj, latim_ba_proj, latim_q_proj)
_QWEN3_NEXT_GDN = {
    "in_proj": ("latim_in_proj.weight", LINEAR),
    "ba_proj": ("latim_ba_proj.weight", LINEAR),
    "conv_w": ("conv1d.weight", CONV),
    "conv_b": ("conv1d.bias", SAME),
    "dt_bias": ("dt_bias", SAME),
    "A_log": ("A_log", SAME),
    "norm_w": ("norm.weight", SAME),
    "out_proj": ("out_proj.weight", LINEAR),
}
_QWEN3_NEXT_ATTENTION = {name: v for name, v in _ATTENTION.items() if name != "q_b"} | {
    "q_proj": ("latim_q_proj.weight", GATE_HALF),
    "g_proj": ("latim_q_proj.weight", UP_HALF),
    "q_norm": ("q_norm.weight", SAME),
    "k_norm": ("k_norm.weight", SAME),
}
_QWEN3_NEXT_MOE = {
    "router": ("gate.weight", LINEAR),
    "experts_gate": ("experts.gate_proj", STACKED),
    "experts_up": ("experts.up_proj", STACKED),
    "experts_down": ("experts.down_proj", STACKED),
    "shared_gate": ("shared_expert.gate_proj.weight", LINEAR),
    "shared_up": ("shared_expert.up_proj.weight", LINEAR),
    "shared_down": ("shared_expert.down_proj.weight", LINEAR),
    "shared_expert_gate": ("shared_expert_gate.weight", LINEAR),
}
QWEN3_NEXT = Naming(
    embedding=("model.embed_tokens.weight",), norm_f="model.norm.weight", sublayer=_qwen3_next_sublayer,
    mixers={**MIXER_NAMES, "gdn": _QWEN3_NEXT_GDN, "attention": _QWEN3_NEXT_ATTENTION,
            "moe": _QWEN3_NEXT_MOE},
    root="model.",
)  # fmt: skip


def _kimi_linear_sublayer(k: int, kind: str, kinds: tuple) -> tuple[str, str]:
    """Kimi Linear: 2i the token mixer (self_attn.: KDA or latent attention), 2i + 1 the feed-forward
    (block_sparse_moe.: experts, or the dense MLP under the same name)."""
    i = k // 2
    if k % 2:
        return f"model.layers.{i}.post_attention_layernorm.weight", f"model.layers.{i}.block_sparse_moe."
    return f"model.layers.{i}.input_layernorm.weight", f"model.layers.{i}.self_attn."


# KDA's projections, convs and A_log are stacked / reshaped on reading (convert.hybrids.kimi_linear_tensors)
_KIMI_KDA = {
    "in_proj": ("latim_in_proj.weight", LINEAR),
    "conv_w": ("latim_conv1d.weight", CONV),
    "decay_a": ("f_a_proj.weight", LINEAR),
    "decay_b": ("f_b_proj.weight", LINEAR),
    "dt_bias": ("dt_bias", SAME),
    "A_log": ("latim_A_log", SAME),
    "b_proj": ("b_proj.weight", LINEAR),
    "gate_a": ("g_a_proj.weight", LINEAR),
    "gate_b": ("g_b_proj.weight", LINEAR),
    "norm_w": ("o_norm.weight", SAME),
    "out_proj": ("o_proj.weight", LINEAR),
}
_KIMI_MLA = {
    "q_proj": ("q_proj.weight", LINEAR),
    "q_a": ("q_a_proj.weight", LINEAR),
    "q_a_b": ("q_a_proj.bias", SAME),
    "q_a_norm": ("q_a_layernorm.weight", SAME),
    "q_b": ("q_b_proj.weight", LINEAR),
    "kv_a": ("kv_a_proj_with_mqa.weight", LINEAR),
    "kv_a_b": ("kv_a_proj_with_mqa.bias", SAME),
    "kv_norm": ("kv_a_layernorm.weight", SAME),
    "kv_b": ("kv_b_proj.weight", LINEAR),
    "o_proj": ("o_proj.weight", LINEAR),
    "o_b": ("o_proj.bias", SAME),
}
_KIMI_MOE = {
    "router": ("gate.weight", LINEAR),
    "router_bias": ("gate.e_score_correction_bias", SAME),
    "experts_gate": ("experts.gate", STACKED),
    "experts_up": ("experts.up", STACKED),
    "experts_down": ("experts.down", STACKED),
    "shared_gate": ("shared_experts.gate_proj.weight", LINEAR),
    "shared_up": ("shared_experts.up_proj.weight", LINEAR),
    "shared_down": ("shared_experts.down_proj.weight", LINEAR),
}
KIMI_LINEAR = Naming(
    embedding=("model.embed_tokens.weight",), norm_f="model.norm.weight", sublayer=_kimi_linear_sublayer,
    mixers={**MIXER_NAMES, "kda": _KIMI_KDA, "mla": _KIMI_MLA, "moe": _KIMI_MOE}, root="model.",
)  # fmt: skip


def _olmo_hybrid_sublayer(k: int, kind: str, kinds: tuple) -> tuple[str, str]:
    """OLMo-Hybrid: 2i the token mixer, 2i + 1 the MLP (mlp.). A Gated DeltaNet layer is pre-norm
    (input_layernorm, then post_attention_layernorm before the MLP); an attention layer is post-norm, its
    norms named for what they follow (post_attention_layernorm, post_feedforward_layernorm)."""
    i = k // 2
    attention = kinds[2 * i] == "attention"
    if k % 2:
        norm = "post_feedforward_layernorm" if attention else "post_attention_layernorm"
        return f"model.layers.{i}.{norm}.weight", f"model.layers.{i}.mlp."
    if attention:
        return f"model.layers.{i}.post_attention_layernorm.weight", f"model.layers.{i}.self_attn."
    return f"model.layers.{i}.input_layernorm.weight", f"model.layers.{i}.linear_attn."


# q, k, v and the gate, b and a are stacked on reading (convert.hybrids.olmo_hybrid_tensors)
_OLMO_HYBRID_GDN = {
    "in_proj": ("latim_in_proj.weight", LINEAR),
    "ba_proj": ("latim_ba_proj.weight", LINEAR),
    "conv_w": ("conv1d.weight", CONV),
    "conv_b": ("conv1d.bias", SAME),
    "dt_bias": ("dt_bias", SAME),
    "A_log": ("A_log", SAME),
    "norm_w": ("o_norm.weight", SAME),
    "out_proj": ("o_proj.weight", LINEAR),
}
OLMO_HYBRID = Naming(
    embedding=("model.embed_tokens.weight",), norm_f="model.norm.weight", sublayer=_olmo_hybrid_sublayer,
    mixers={**MIXER_NAMES, "gdn": _OLMO_HYBRID_GDN,
            "attention": _ATTENTION | {"q_norm": ("q_norm.weight", SAME), "k_norm": ("k_norm.weight", SAME)}},
    root="model.",
)  # fmt: skip

NAMINGS = {
    "bamba": BAMBA, "granitemoehybrid": GRANITE, "jamba": JAMBA, "falcon_h1": FALCON_H1, "zamba2": ZAMBA2,
    "qwen3_next": QWEN3_NEXT, "qwen3_5_text": QWEN3_NEXT, "qwen3_5_moe_text": QWEN3_NEXT,
    "kimi_linear": KIMI_LINEAR, "olmo_hybrid": OLMO_HYBRID,
}  # fmt: skip


def naming(family: str) -> Naming:
    """The tensor names of ``family`` (a config's ``family``; "" and the Mamba variants: the default)."""
    return NAMINGS.get(family, MAMBA)
