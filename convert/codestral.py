"""Reader for Codestral-style (mistral-inference) Mamba-2 checkpoints, e.g. Mamba-Codestral-7B-v0.1:
``params.json`` and ``consolidated.safetensors`` whose keys are mamba_ssm's with a ``model.`` prefix.

``params.json`` holds mistral-inference's ``MambaArgs``: ``dim``, ``n_layers``, ``vocab_size``,
``n_groups``, ``rms_norm``, ``residual_in_fp32``, ``fused_add_norm``, ``pad_vocab_size_multiple``,
``tie_embeddings`` and ``model_type`` ("mamba"). mistral-inference builds a mamba_ssm Mamba-2 from
``ngroups`` alone, so every other mixer setting is mamba_ssm's default (d_state 128, headdim 64,
expand 2, d_conv 4, chunk_size 256, no dt limit). Codestral-7B: dim 4096, 64 layers, 8 groups,
vocab 32768, untied.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from latim_jax.model.config import MambaConfig

from .config_fields import ConfigFields, read_json
from .hf import build_config
from .layout import params_from_tensors
from .mamba_ssm import mixer_fields, padded_vocab
from .tensors import find_weight_files, open_tensors

CONFIG_FILE = "params.json"
KEY_PREFIX = "model."
WEIGHT_CHOICES = (
    ("consolidated.safetensors",),
    ("model.safetensors",),
    ("consolidated.safetensors.index.json",),
    ("model.safetensors.index.json",),
)

_HANDLED = frozenset(
    {
        "dim",
        "n_layers",
        "vocab_size",
        "n_groups",
        "rms_norm",
        "pad_vocab_size_multiple",
        "tie_embeddings",
        "model_type",
    }
)
# residual_in_fp32: latim-jax always keeps the residual in fp32; fused_add_norm: a kernel choice.
_IGNORED = frozenset({"residual_in_fp32", "fused_add_norm"})


def config_from_codestral(data: dict[str, Any], *, file: str = CONFIG_FILE) -> MambaConfig:
    """A Mamba-2 :class:`MambaConfig` from a Codestral-style ``params.json`` (already parsed)."""
    f = ConfigFields(data, file=file, handled=_HANDLED, ignored=_IGNORED)
    f.require("model_type", ("mamba",), "mamba", "params.json describes another architecture")
    f.require("rms_norm", (True,), True, "latim-jax implements RMSNorm models only")
    d_model, vocab = f.int("dim"), f.int("vocab_size")
    return build_config(
        file,
        version=2,
        d_model=d_model,
        n_layers=f.int("n_layers"),
        vocab_size=padded_vocab(vocab, f.int("pad_vocab_size_multiple", 1)),
        vocab_size_unpadded=vocab,
        tie_embeddings=f.bool("tie_embeddings", False),
        **mixer_fields(2, {"ngroups": f.int("n_groups", 1)}, d_model=d_model, file=file),
    )


def read_codestral(directory: str | Path, dtype: Any = None) -> tuple[MambaConfig, dict[str, Any]]:
    """``(config, params)`` from a Codestral-style checkpoint directory (no torch needed).

    Weights keep their stored dtype (bf16 for Codestral-7B) unless ``dtype`` is given.
    """
    directory = Path(directory)
    config = config_from_codestral(read_json(directory / CONFIG_FILE))
    with open_tensors(find_weight_files(directory, WEIGHT_CHOICES)) as tensors:
        return config, params_from_tensors(config, tensors, prefix=KEY_PREFIX, dtype=dtype)
