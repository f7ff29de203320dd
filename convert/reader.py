"""One entry point for every checkpoint format: detect it from the directory's files and read it.

Formats, by the file that marks them:
    latim_config.json                          latim-jax's own orbax checkpoint (:mod:`.orbax_io`)
    config.json with model_type in MODEL_TYPES Hugging Face (:mod:`.hf`: mamba, mamba2, falcon_mamba
                                               and the families of :mod:`.hybrids`)
    config.json with d_model and n_layer       original mamba_ssm (:mod:`.mamba_ssm`)
    params.json                                Codestral-style / mistral-inference (:mod:`.codestral`)
:func:`expected_contents` spells this out (with the weight files) for a directory that holds none.
A directory holding both a Hugging Face and a Codestral layout (as the Codestral hub repository does)
is read as Hugging Face when its weights are there, else as Codestral.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from latim_jax.model.config import MambaConfig

from . import codestral, hf, mamba_ssm, orbax_io
from .errors import CheckpointError
from .layout import as_dtype

FORMATS = ("latim", "hf", "mamba_ssm", "codestral")

_READERS: dict[str, Callable[..., tuple[MambaConfig, dict[str, Any]]]] = {
    "hf": hf.read_hf,
    "mamba_ssm": mamba_ssm.read_mamba_ssm,
    "codestral": codestral.read_codestral,
}
_WEIGHTS = {
    "hf": hf.WEIGHT_CHOICES,
    "mamba_ssm": mamba_ssm.WEIGHT_CHOICES,
    "codestral": codestral.WEIGHT_CHOICES,
}


def read_checkpoint(path: str | Path, dtype: Any = None) -> tuple[MambaConfig, dict[str, Any]]:
    """``(config, params)`` from a checkpoint directory of any supported format (see :func:`detect_format`).

    ``params`` is the nested-dict tree of ``latim_jax.model.config.param_shapes(config)`` holding numpy
    arrays in their stored dtype, or cast to ``dtype`` ("float32", "bfloat16", ...) when given.
    Raises :class:`CheckpointError` naming file, key and expected vs found on anything it cannot
    read faithfully.
    """
    path = Path(path)
    fmt = detect_format(path)
    if fmt == "latim":
        config, params = orbax_io.load_checkpoint(path)
        return config, _cast_tree(params, as_dtype(dtype))
    return _READERS[fmt](path, dtype=dtype)


def detect_format(path: str | Path) -> str:
    """Which of :data:`FORMATS` the directory ``path`` holds, from its config files.

    Raises :class:`CheckpointError` listing what was looked for when no format matches.
    """
    path = Path(path)
    if not path.is_dir():
        found = "a file" if path.exists() else "nothing"
        raise CheckpointError("not a checkpoint directory", file=path, expected="a directory", found=found)
    if orbax_io.is_latim_checkpoint(path):
        return "latim"
    candidates = _candidates(path)
    if not candidates:
        raise CheckpointError(
            "no checkpoint config found", file=path, expected=expected_contents(),
            found=sorted(p.name for p in path.iterdir()) or "an empty directory",
        )  # fmt: skip
    for fmt in candidates:
        if any(all((path / name).is_file() for name in group) for group in _WEIGHTS[fmt]):
            return fmt
    return candidates[0]  # its reader reports the missing weight files


def expected_contents() -> str:
    """What a model directory must hold, one entry per format and every Hugging Face model_type read
    (for the message of a directory that holds none of them)."""

    def weights(fmt: str) -> str:
        return " or ".join(" + ".join(group) for group in _WEIGHTS[fmt])

    return (
        f"one of: {orbax_io.CONFIG_FILE} (a latim-jax checkpoint: a shipped model or `latim-jax convert` "
        f"output); {hf.CONFIG_FILE} with model_type one of {', '.join(sorted(hf.MODEL_TYPES))} (Hugging "
        f"Face) and its weights, {weights('hf')}; {mamba_ssm.CONFIG_FILE} with d_model and n_layer "
        f"(mamba_ssm) and {weights('mamba_ssm')}; {codestral.CONFIG_FILE} (Codestral / mistral-inference) "
        f"and {weights('codestral')}"
    )


def _candidates(path: Path) -> list[str]:
    out = []
    config_file = path / hf.CONFIG_FILE
    if config_file.is_file():
        data = _peek_json(config_file)
        if "model_type" in data:
            if data["model_type"] not in hf.MODEL_TYPES and not (path / codestral.CONFIG_FILE).is_file():
                raise CheckpointError(
                    "unsupported model type",
                    file=config_file.name,
                    key="model_type",
                    expected=sorted(hf.MODEL_TYPES),
                    found=data["model_type"],
                )
            if data["model_type"] in hf.MODEL_TYPES:
                out.append("hf")
        elif "d_model" in data and "n_layer" in data:
            out.append("mamba_ssm")
    if (path / codestral.CONFIG_FILE).is_file():
        out.append("codestral")
    return out


def _peek_json(file: Path) -> dict[str, Any]:
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"unreadable JSON ({err})", file=file.name) from err
    return data if isinstance(data, dict) else {}


def _cast_tree(tree: Any, dtype: Any) -> Any:
    if dtype is None:
        return tree
    if isinstance(tree, dict):
        return {k: _cast_tree(v, dtype) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_cast_tree(v, dtype) for v in tree]
    return tree if tree.dtype == dtype else tree.astype(dtype)
