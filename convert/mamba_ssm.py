"""Reader for original mamba_ssm checkpoints (state-spaces/mamba-130m ... mamba2-2.7b): ``config.json``
with ``d_model``, ``n_layer``, the *unpadded* ``vocab_size``, ``pad_vocab_size_multiple`` and an
``ssm_cfg`` (``{"layer": "Mamba2", ...}`` for Mamba-2), weights in ``pytorch_model.bin``.

Differences from the Hugging Face layout: the embedding is ``backbone.embedding.weight`` (singular),
``lm_head.weight`` is stored even when tied, and unset mixer fields take mamba_ssm's defaults
(Mamba-1: d_state 16, d_conv 4, expand 2; Mamba-2: d_state 128, headdim 64, ngroups 1, chunk_size 256).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from latim_jax.model.config import MambaConfig

from .config_fields import ConfigFields, read_json
from .hf import build_config
from .layout import params_from_tensors
from .tensors import find_weight_files, open_tensors

CONFIG_FILE = "config.json"
WEIGHT_CHOICES = (
    ("pytorch_model.bin",),
    ("model.safetensors",),
    ("model.safetensors.index.json",),
    ("pytorch_model.bin.index.json",),
)

_TOP_HANDLED = frozenset(
    {
        "d_model",
        "n_layer",
        "vocab_size",
        "ssm_cfg",
        "rms_norm",
        "pad_vocab_size_multiple",
        "tie_embeddings",
        "d_intermediate",
        "attn_layer_idx",
    }
)
# residual_in_fp32: latim-jax always keeps the residual in fp32; fused_add_norm: a kernel choice;
# attn_cfg: only read for attention layers, which attn_layer_idx == [] rules out.
_TOP_IGNORED = frozenset({"residual_in_fp32", "fused_add_norm", "attn_cfg"})

_V1_HANDLED = frozenset({"layer", "d_state", "d_conv", "expand", "dt_rank", "conv_bias", "bias"})
# initialisation and kernel choices only
_V1_IGNORED = frozenset({"dt_min", "dt_max", "dt_init", "dt_scale", "dt_init_floor", "use_fast_path"})
_V2_HANDLED = frozenset(
    {
        "layer",
        "d_state",
        "d_conv",
        "expand",
        "headdim",
        "d_ssm",
        "ngroups",
        "D_has_hdim",
        "rmsnorm",
        "norm_before_gate",
        "dt_limit",
        "bias",
        "conv_bias",
        "chunk_size",
    }
)
_V2_IGNORED = frozenset(
    {"conv_init", "A_init_range", "dt_min", "dt_max", "dt_init_floor", "use_mem_eff_path"}
)

_LAYERS = {"Mamba1": 1, "Mamba2": 2}


def config_from_mamba_ssm(data: dict[str, Any], *, file: str = CONFIG_FILE) -> MambaConfig:
    """A :class:`MambaConfig` from a mamba_ssm ``config.json`` (already parsed).

    ``vocab_size`` of the result is the padded row count; ``vocab_size_unpadded`` keeps the config's.
    Unknown fields and unsupported values (``rms_norm: false``, ``d_intermediate != 0``, attention
    layers, ``norm_before_gate: true``, ``D_has_hdim: true``, ``rmsnorm: false``, partial ``d_ssm``)
    raise :class:`CheckpointError`.
    """
    f = ConfigFields(data, file=file, handled=_TOP_HANDLED, ignored=_TOP_IGNORED)
    f.require("rms_norm", (True,), True, "latim-jax implements RMSNorm models only")
    f.require("d_intermediate", (0,), 0, "an MLP after each mixer is not implemented")
    f.require("attn_layer_idx", ([],), [], "attention layers are not implemented")
    ssm_cfg = f.raw("ssm_cfg", {})
    if not isinstance(ssm_cfg, dict):
        raise f.error("ssm_cfg", "wrong type", "a JSON object", ssm_cfg)
    layer = ssm_cfg.get("layer", "Mamba1")
    if layer not in _LAYERS:
        raise f.error("ssm_cfg.layer", "unknown mixer", sorted(_LAYERS), layer)
    d_model = f.int("d_model")
    vocab = f.int("vocab_size")
    return build_config(
        file,
        version=_LAYERS[layer],
        d_model=d_model,
        n_layers=f.int("n_layer"),
        vocab_size=padded_vocab(vocab, f.int("pad_vocab_size_multiple", 8)),
        vocab_size_unpadded=vocab,
        tie_embeddings=f.bool("tie_embeddings", True),
        **mixer_fields(_LAYERS[layer], ssm_cfg, d_model=d_model, file=file),
    )


def read_mamba_ssm(directory: str | Path, dtype: Any = None) -> tuple[MambaConfig, dict[str, Any]]:
    """``(config, params)`` from a mamba_ssm checkpoint directory (needs torch for ``pytorch_model.bin``).

    The stored ``lm_head.weight`` of a tied model must equal the embedding. Weights keep their stored
    dtype unless ``dtype`` is given.
    """
    directory = Path(directory)
    config = config_from_mamba_ssm(read_json(directory / CONFIG_FILE))
    with open_tensors(find_weight_files(directory, WEIGHT_CHOICES)) as tensors:
        return config, params_from_tensors(config, tensors, dtype=dtype)


def padded_vocab(vocab_size: int, multiple: int) -> int:
    """mamba_ssm's embedding rows: ``vocab_size`` rounded up to a multiple of ``multiple``."""
    return math.ceil(vocab_size / max(multiple, 1)) * max(multiple, 1)


def mixer_fields(version: int, ssm_cfg: Any, *, d_model: int, file: str) -> dict[str, Any]:
    """MambaConfig fields from a mamba_ssm ``ssm_cfg`` (the mixer's keyword arguments), strictly."""
    if version == 1:
        s = ConfigFields(ssm_cfg, file=file, handled=_V1_HANDLED, ignored=_V1_IGNORED, prefix="ssm_cfg.")
        rank = s.raw("dt_rank", "auto")
        if rank != "auto" and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 1):
            raise s.error("dt_rank", "wrong value", '"auto" or a positive integer', rank)
        return dict(
            d_state=s.int("d_state", 16),
            d_conv=s.int("d_conv", 4),
            expand=s.int("expand", 2),
            dt_rank=math.ceil(d_model / 16) if rank == "auto" else rank,
            conv_bias=s.bool("conv_bias", True),
            proj_bias=s.bool("bias", False),
        )
    s = ConfigFields(ssm_cfg, file=file, handled=_V2_HANDLED, ignored=_V2_IGNORED, prefix="ssm_cfg.")
    expand = s.int("expand", 2)
    s.require("D_has_hdim", (False,), False, "a per-channel D is not implemented (D is per head)")
    s.require("rmsnorm", (True,), True, "latim-jax implements the gated-RMSNorm Mamba-2 only")
    s.require("norm_before_gate", (False,), False, "latim-jax gates before the norm: RMSNorm(y * SiLU(z))")
    s.require(
        "d_ssm",
        (None, expand * d_model),
        None,
        "a partial-width SSM (with an MLP beside it) is not implemented",
    )
    return dict(
        d_state=s.int("d_state", 128),
        d_conv=s.int("d_conv", 4),
        expand=expand,
        head_dim=s.int("headdim", 64),
        n_groups=s.int("ngroups", 1),
        chunk_size=s.int("chunk_size", 256),
        conv_bias=s.bool("conv_bias", True),
        proj_bias=s.bool("bias", False),
        time_step_limit=s.float_pair("dt_limit", (0.0, math.inf)),
    )
