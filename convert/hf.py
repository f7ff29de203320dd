"""Reader for Hugging Face-format checkpoints: ``config.json`` with ``model_type`` ``mamba``, ``mamba2``,
``falcon_mamba`` or a hybrid (:mod:`.hybrids`), and ``model.safetensors`` (possibly sharded) or
``pytorch_model.bin``.

Config fields follow transformers' ``MambaConfig`` / ``Mamba2Config`` (defaults included, which differ:
Mamba2Config's are Codestral's). Fields that only matter for training or generation are ignored, by
name; early ports (state-spaces/mamba-*-hf) also carry mamba_ssm-style duplicates (``d_model``,
``n_layer``, ``d_inner``), which are checked against the transformers fields.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from latim_jax.model.config import MambaConfig

from . import hybrids
from .config_fields import ConfigFields, read_json
from .errors import CheckpointError
from .hf_fields import ACTIVATIONS, GENERIC_IGNORED, build_config
from .layout import params_from_tensors
from .tensors import find_weight_files, open_tensors

CONFIG_FILE = "config.json"
# model_type -> the Mamba version of its SSM sublayers (falcon_mamba: Mamba-1 with RMS-normalised dt, B,
# C); the hybrids (None here) have their own readers in convert/hybrids.py
MODEL_TYPES = {"mamba": 1, "mamba2": 2, "falcon_mamba": 1} | dict.fromkeys(hybrids.READERS)
WEIGHT_CHOICES = (
    ("model.safetensors.index.json",),
    ("model.safetensors",),
    ("pytorch_model.bin.index.json",),
    ("pytorch_model.bin",),
)

_COMMON = frozenset(
    {
        "model_type",
        "hidden_size",
        "num_hidden_layers",
        "vocab_size",
        "state_size",
        "conv_kernel",
        "expand",
        "use_conv_bias",
        "use_bias",
        "layer_norm_epsilon",
        "tie_word_embeddings",
        "hidden_act",
        "intermediate_size",
        "rms_norm",
        "d_model",
        "n_layer",
    }
)
_V1_HANDLED = _COMMON | {"time_step_rank", "d_inner"}
_V1_IGNORED = GENERIC_IGNORED | {"use_mambapy", "use_associative_scan"}
_FALCON_HANDLED = _V1_HANDLED | {"mixer_rms_eps"}
_V2_HANDLED = _COMMON | {"head_dim", "num_heads", "n_groups", "chunk_size", "time_step_limit"}
# Mamba-2 has no dt_proj, so transformers' Mamba2Config.time_step_rank is unused. norm_before_gate is
# stored by the Codestral port (as true) but transformers' Mamba-2 never reads it: its gated RMSNorm
# always gates first (y * SiLU(z), then normalise), which is mamba_ssm's default and what latim-jax does.
_V2_IGNORED = GENERIC_IGNORED | {"time_step_rank", "norm_before_gate"}


# SSM families a researcher may bring that latim-jax does not read yet, and why (the error says so)
NOT_YET = {
    "zamba": "Zamba (version 1: Mamba-1 layers, one shared block without adapters) is not read; Zamba2 is",
}


def config_from_hf(data: dict[str, Any], *, file: str = CONFIG_FILE) -> MambaConfig:
    """A :class:`MambaConfig` from a Hugging Face ``config.json`` (already parsed).

    Unknown fields, unsupported values (``rms_norm: false``, an activation other than
    silu/swish/relu/identity/linear) and inconsistent duplicates raise :class:`CheckpointError`.
    """
    model_type = data.get("model_type")
    if model_type in NOT_YET:
        raise CheckpointError(
            f"{model_type} checkpoints are not read yet: {NOT_YET[model_type]}", file=file, key="model_type",
            expected=sorted(MODEL_TYPES), found=model_type,
        )  # fmt: skip
    if model_type not in MODEL_TYPES:
        raise CheckpointError(
            "not a Mamba config", file=file, key="model_type", expected=sorted(MODEL_TYPES), found=model_type
        )
    if model_type in hybrids.READERS:
        return hybrids.READERS[model_type](data, file)
    version = MODEL_TYPES[model_type]
    handled, ignored = (_V1_HANDLED, _V1_IGNORED) if version == 1 else (_V2_HANDLED, _V2_IGNORED)
    if model_type == "falcon_mamba":
        handled = _FALCON_HANDLED
    f = ConfigFields(data, file=file, handled=handled, ignored=ignored)
    kwargs = _common_fields(f, version)
    kwargs.update(_v1_fields(f, kwargs) if version == 1 else _v2_fields(f, kwargs))
    if model_type == "falcon_mamba":  # transformers' FalconMambaMixer: rms(dt_low), rms(B), rms(C), no weight
        kwargs.update(bcdt_norm=True, bcdt_eps=f.float("mixer_rms_eps", 1e-6), family=model_type)
    return build_config(file, version=version, **kwargs)


def read_hf(directory: str | Path, dtype: Any = None) -> tuple[MambaConfig, dict[str, Any]]:
    """``(config, params)`` from a Hugging Face-format checkpoint directory.

    Weights keep their stored dtype (fp32/bf16/fp16) unless ``dtype`` is given. Every tensor is
    checked against the config's shapes and every tensor must be used.
    """
    directory = Path(directory)
    data = read_json(directory / CONFIG_FILE)
    config = config_from_hf(data)
    files = find_weight_files(directory, WEIGHT_CHOICES)
    with open_tensors(files) as tensors:
        hybrids.prepare_tensors(config, tensors, data)
        params = params_from_tensors(config, tensors, dtype=dtype)
    finish = hybrids.FINISH.get(config.family)
    return config, (params if finish is None else finish(data, config, params))


def _common_fields(f: ConfigFields, version: int) -> dict[str, Any]:
    d_model, n_layers = f.int("hidden_size"), f.int("num_hidden_layers")
    expand = f.int("expand", 2)
    f.same("d_model", d_model, "hidden_size")
    f.same("n_layer", n_layers, "num_hidden_layers")
    f.same("intermediate_size", expand * d_model, "expand * hidden_size")
    f.require("rms_norm", (True,), True, "latim-jax implements RMSNorm models only")
    act = f.str("hidden_act", "silu")
    if act not in ACTIVATIONS:
        raise f.error("hidden_act", "unsupported activation", sorted(ACTIVATIONS), act)
    return dict(
        d_model=d_model,
        n_layers=n_layers,
        vocab_size=f.int("vocab_size"),
        d_state=f.int("state_size", 16 if version == 1 else 128),
        d_conv=f.int("conv_kernel", 4),
        expand=expand,
        conv_bias=f.bool("use_conv_bias", True),
        proj_bias=f.bool("use_bias", False),
        rms_eps=f.float("layer_norm_epsilon", 1e-5),
        tie_embeddings=f.bool("tie_word_embeddings", version == 1),
        activation=ACTIVATIONS[act],
    )


def _v1_fields(f: ConfigFields, common: dict[str, Any]) -> dict[str, Any]:
    d_model = common["d_model"]
    f.same("d_inner", common["expand"] * d_model, "expand * hidden_size")
    rank = f.raw("time_step_rank", "auto")
    if rank == "auto":
        rank = math.ceil(d_model / 16)
    elif isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise f.error("time_step_rank", "wrong value", '"auto" or a positive integer', rank)
    return dict(dt_rank=rank)


def _v2_fields(f: ConfigFields, common: dict[str, Any]) -> dict[str, Any]:
    head_dim, n_heads = f.int("head_dim", 64), f.int("num_heads", 128)
    d_inner = common["expand"] * common["d_model"]
    if n_heads * head_dim != d_inner:
        raise f.error(
            "num_heads",
            "num_heads * head_dim must equal expand * hidden_size",
            f"{d_inner} // {head_dim} = {d_inner / head_dim:g}",
            n_heads,
        )
    return dict(
        head_dim=head_dim,
        n_groups=f.int("n_groups", 8),
        chunk_size=f.int("chunk_size", 256),
        time_step_limit=f.float_pair("time_step_limit", (0.0, math.inf)),
    )
