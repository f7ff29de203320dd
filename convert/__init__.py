"""Checkpoint readers (Hugging Face, mamba_ssm, Codestral-style) and orbax I/O.

Entry points: :func:`read_checkpoint` (any format -> ``(MambaConfig, params)``), :func:`resolve_source`
(hub id or local path -> local directory), :func:`save_checkpoint` / :func:`load_checkpoint` (latim-jax's
own orbax format). Every failure to read faithfully raises :class:`CheckpointError`.
"""

from .errors import CheckpointError, SourceUnavailableError
from .hub import resolve_source
from .orbax_io import load_checkpoint, save_checkpoint
from .reader import detect_format, read_checkpoint

__all__ = [
    "CheckpointError",
    "SourceUnavailableError",
    "detect_format",
    "load_checkpoint",
    "read_checkpoint",
    "resolve_source",
    "save_checkpoint",
]
