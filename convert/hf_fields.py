"""What every Hugging Face-format reader shares: the config fields that never change the forward pass,
the activation names, and building a :class:`MambaConfig` whose validation errors name the file."""

from __future__ import annotations

from typing import Any

from latim_jax.model.config import MambaConfig

from .errors import CheckpointError

# transformers.PretrainedConfig bookkeeping, token ids, generation/caching and initialisation: none of
# these changes what a forward pass computes from the stored weights.
GENERIC_IGNORED = frozenset(
    {
        "_name_or_path",
        "architectures",
        "transformers_version",
        "torch_dtype",
        "dtype",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "use_cache",
        "initializer_range",
        "rescale_prenorm_residual",
        "_from_model_config",
        "return_dict",
        "output_hidden_states",
        "output_attentions",
        "torchscript",
        "tokenizer_class",
        "id2label",
        "label2id",
        "problem_type",
        "is_encoder_decoder",
        "is_decoder",
        "add_cross_attention",
        "chunk_size_feed_forward",
        "task_specific_params",
        "prefix",
        "sep_token_id",
        "decoder_start_token_id",
        "time_step_min",
        "time_step_max",
        "time_step_floor",
        "time_step_init_scheme",
        "time_step_scale",
        # residual_in_fp32: latim-jax always keeps the residual stream in fp32.
        "residual_in_fp32",
        # mamba_ssm-style leftovers of early ports that transformers never reads.
        "fused_add_norm",
        "pad_vocab_size_multiple",
        "ssm_cfg",
    }
)

ACTIVATIONS = {"silu": "silu", "swish": "silu", "relu": "relu", "identity": "identity", "linear": "identity"}


def build_config(file: str, **kwargs: Any) -> MambaConfig:
    """``MambaConfig(**kwargs)``, its validation errors raised as :class:`CheckpointError` on ``file``."""
    try:
        return MambaConfig(**kwargs)
    except (ValueError, ArithmeticError) as err:  # ArithmeticError: a zero head_dim or n_groups
        raise CheckpointError(f"inconsistent config: {err}", file=file) from err
