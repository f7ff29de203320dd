"""latim-jax: LaTIM token-to-token interactions for Mamba-1 and Mamba-2 in JAX.

Public API: :func:`load`, :func:`attribute`, :func:`attribute_generated` (what the model generates),
:func:`word_spans` and :func:`token_labels` (words and labels from a tokenizer; :class:`Spans`),
:func:`contributions`, :func:`conservation_error`, :class:`Attribution`, :class:`MambaConfig`,
:class:`MambaLM`, :class:`Blocks` (tile sizes), :func:`shard` (lay a model out on a device mesh; see
:mod:`latim_jax.model.sharding`), :func:`open_results` (read an attribute-dataset run).
docs/architecture.md says where each concern lives.
"""

from latim_jax.io.loading import load
from latim_jax.io.results import Attribution
from latim_jax.io.spans import Spans
from latim_jax.latim import (
    Blocks,
    attribute,
    attribute_generated,
    conservation_error,
    contributions,
    open_results,
)
from latim_jax.model import MambaConfig, MambaLM, shard
from latim_jax.tasks.words import token_labels, word_spans
from latim_jax.version import __version__

__all__ = [
    "Attribution",
    "Blocks",
    "MambaConfig",
    "MambaLM",
    "attribute",
    "attribute_generated",
    "conservation_error",
    "contributions",
    "load",
    "open_results",
    "shard",
    "Spans",
    "token_labels",
    "word_spans",
    "__version__",
]
