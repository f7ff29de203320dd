"""``latim_jax.load``: any supported checkpoint (or a shipped model name, or a hub id) -> MambaLM."""

from __future__ import annotations

import difflib
import json
import os
from pathlib import Path

import jax.numpy as jnp

from latim_jax.convert import SourceUnavailableError, read_checkpoint, resolve_source
from latim_jax.convert.orbax_io import TASK_FILE, TOKENIZER_FILES
from latim_jax.model.lm import MambaLM

ASSETS = Path(__file__).resolve().parents[1] / "assets"
SHIPPED = (
    "copy-mamba1", "copy-mamba2", "mqar-mamba1", "mqar-mamba2", "align-mamba1", "align-mamba2",
    "needle-mamba1", "needle-mamba2", "needle-hybrid", "needle-hybrid-gdn",
)  # fmt: skip
DEFAULT_MODEL = "copy-mamba2"


def shipped_path(name: str) -> Path:
    """The directory of a model shipped inside the package (one of ``SHIPPED``)."""
    if name not in SHIPPED:
        raise ValueError(f"unknown shipped model {name!r}; shipped models are {SHIPPED}")
    path = ASSETS / name
    if not path.is_dir():
        raise FileNotFoundError(f"the shipped model {name!r} is missing from this installation ({path})")
    return path


def resolve(source: str | os.PathLike | None) -> Path:
    """An absolute local directory for ``source``: None (the default shipped model), a shipped name, a
    local directory (relative paths are relative to the current directory), or a Hugging Face hub id
    "owner/name" (downloaded with huggingface_hub; a clear error at once when offline).

    A string that is neither an existing path nor a hub id (no "/"), or that is close to a shipped
    name, fails at once with :class:`~latim_jax.convert.SourceUnavailableError` suggesting the shipped
    names, without contacting the hub; so does "a/b" when a local directory "a" exists (a mistyped
    local path, not a hub id).
    """
    if source is None:
        return shipped_path(DEFAULT_MODEL)
    if isinstance(source, str) and source in SHIPPED:
        return shipped_path(source)
    path = Path(source).expanduser()
    if path.exists():
        if not path.is_dir():
            raise SourceUnavailableError(
                "expected a checkpoint directory, found a file", file=source, expected="a directory"
            )
        return path.resolve()
    text = os.fspath(source)
    if _looks_like_path(text):  # "/abs/x", "./x", "~/x", or "runs/x" with a local runs/
        raise SourceUnavailableError(
            f"no such checkpoint directory: {str(path.absolute())!r} does not exist (relative paths are "
            f"relative to the current directory, {os.getcwd()!r})",
            file=source,
        )
    close = difflib.get_close_matches(text, SHIPPED, n=2, cutoff=0.75)
    if close or "/" not in text:
        hint = f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""
        raise SourceUnavailableError(
            f"no such checkpoint directory, and not a shipped model; {hint}shipped models: "
            f"{', '.join(SHIPPED)}; a Hugging Face hub id looks like 'owner/name'",
            file=source,
        )
    return Path(resolve_source(text)).resolve()


def _looks_like_path(text: str) -> bool:
    """Whether a source that does not exist was meant as a local path, not a hub id "owner/name": it is
    absolute, starts with "~" or ".", names the platform's separator where it is not "/", or its first
    component is an existing local directory (a mistyped "runs/x")."""
    if os.path.isabs(text) or text.startswith(("~", ".")) or (os.sep != "/" and os.sep in text):
        return True
    return "/" in text and Path(text.split("/")[0]).expanduser().is_dir()


def load(source: str | os.PathLike | None = None, dtype=None) -> MambaLM:
    """Load a Mamba-1, Mamba-2 or hybrid model as a :class:`~latim_jax.model.lm.MambaLM`.

    Args:
      source: None (the shipped Mamba-2 copy-task model), a shipped name ("copy-mamba1",
        "copy-mamba2": the copy task; "mqar-mamba1", "mqar-mamba2": multi-query associative
        recall; "align-mamba1", "align-mamba2": translation with gold word alignments;
        "needle-mamba1", "needle-mamba2", "needle-hybrid" (Mamba-2 + attention): needle retrieval), a
        local directory (absolute or relative to the current directory) in Hugging Face (Mamba,
        Mamba-2, Falcon-Mamba, Nemotron-H, Bamba, Granite-4.0-H, Jamba), mamba_ssm or Codestral format or
        written by ``latim-jax convert``, or a hub id such as "state-spaces/mamba-130m-hf" (needs network
        access). See :func:`resolve`.
      dtype: parameter dtype ("float32", "bfloat16", or a jnp dtype); default: as stored.

    The model exposes ``config``, ``source``, ``task`` (shipped models: the task it was trained on)
    and ``tokenizer_dir`` (the directory holding tokenizer files, or None).
    """
    path = resolve(source)
    config, params = read_checkpoint(path, dtype=None if dtype is None else jnp.dtype(dtype))
    model = MambaLM(config, params)
    model.source = str(source) if source is not None else DEFAULT_MODEL
    task_file = path / TASK_FILE
    if task_file.is_file():
        model.task = json.loads(task_file.read_text())
    model.tokenizer_dir = str(path) if any((path / f).is_file() for f in TOKENIZER_FILES) else ""
    return model
