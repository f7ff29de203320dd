"""A layer kind as one declared thing: :class:`LayerKind`, and the registry every generic place reads.

A model is a stack of residual sublayers h + Sublayer(RMSNorm(h)), each of a *kind*. Everything the
library knows of a kind is one :class:`LayerKind`, declared beside its module (``MAMBA1`` in
:mod:`latim_jax.model.mixers`, ``ATTENTION`` in :mod:`latim_jax.model.attention`, ...):

    name, display        the key in ``MambaConfig.layer_kinds`` and how plots, tables and the CLI name it
    module               the sublayer's ``ParamModule`` (``__call__``, ``init_cache`` / ``step``)
    shapes(config)       its parameters: name -> shape (``config.param_shapes`` puts them in the tree)
    check(config)        validates the config fields (or the section) it reads; raises ValueError
    section              its config section, a frozen dataclass with ``from_dict`` (None: the kind reads
                         MambaConfig's own fields); ``config.section(name)`` returns it
    output_params        the output-side parameters, scaled to fold a residual multiplier into them
    init                 parameter name -> initialiser(key, shape, config), over the generic rules of
                         :mod:`latim_jax.model.init` (fan-in uniform matrices and biases, unit norms)
    channel_axis         parameter name -> the axis a mesh's "model" axis splits (absent: replicated)
    memory(config, b, l, rows, cols)
                         bytes one layer of the kind holds while it is decomposed (the score tiles of
                         rows x cols), read by :mod:`latim_jax.latim.memory`
    version              the Mamba version the kind needs (None: any)
    holds_attention      a softmax attention inside (generation keeps a K/V cache)
    reads_embeddings     the block reads h^0 beside its stream (Zamba2's shared block)
    folds_norm           the pre-norm feeds the module's ``in_proj`` (the Mamba mixers: ``Block.projected``)
    splits_sequence      its forward takes a mesh's "seq" axis (one prompt's length split over devices:
                         :mod:`latim_jax.parallel.sequence`); a model with a kind that does not is refused
                         such a mesh (:func:`latim_jax.model.sharding.check_sequence`)
    halo(config)         how many positions before a "seq" shard's first one its forward reads from the
                         previous shard (a causal conv of width K: K - 1; 0 for token-wise kinds and for
                         attention, which gathers); a "seq" shard holds at least the largest halo of
                         the model's kinds (``MambaLM.split_length``)
    factors              its decomposition: factors(block, h, mask, ctx, mode, *, hold_fixed, with_total)
                         (:mod:`latim_jax.latim.kinds` documents the interface its result implements)
    window_scores(config, width)
                         whether, over a "seq" axis of shards of ``width`` positions, its score stage
                         runs on each device's own window (its factors are ``sequence_local`` and
                         ``width`` is whole ``slot_unit``s: :mod:`latim_jax.latim.source_window`), not
                         on the layer gathered whole (the default); registered with ``factors``, read by
                         the memory estimate, and checked against the factors for every kind by
                         tests/latim/test_kinds.py

The registry is filled in one place, :mod:`latim_jax.latim.kinds` (the floor that can see both a kind's
module and its decomposition), which imports with the package: ``register(MAMBA2, factors=...)``.
A test registers a kind of its own the same way (tests/latim/test_kinds.py), and everything that reads
kinds (config validation, parameter shapes, initialisation, the blocks, the mesh layout, the memory
estimate, the readers' output folding, info, the scores) takes it unchanged.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Mapping
from typing import Any


def _accept(config) -> None:
    del config


def _no_halo(config) -> int:
    return 0


def _no_memory(config, b: int, length: int, rows: int, cols: int) -> int:
    del config, b, length, rows, cols
    return 0


def _gathered(config, width: int) -> bool:
    del config, width
    return False


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerKind:
    """Everything the library knows of one layer kind (the module docstring lists the fields)."""

    name: str
    display: str
    module: type
    shapes: Callable[[Any], dict[str, tuple[int, ...]]]
    output_params: tuple[str, ...]
    check: Callable[[Any], None] | None = _accept
    section: type | None = None
    init: Mapping[str, Callable] = dataclasses.field(default_factory=dict)
    channel_axis: Mapping[str, int] = dataclasses.field(default_factory=dict)
    memory: Callable[[Any, int, int, int, int], int] = _no_memory
    version: int | None = None
    holds_attention: bool = False
    reads_embeddings: bool = False
    folds_norm: bool = False
    splits_sequence: bool = False
    halo: Callable[[Any], int] = _no_halo
    factors: Callable | None = None
    window_scores: Callable[[Any, int], bool] = _gathered

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise ValueError(f"LayerKind.name must be an identifier string, found {self.name!r}")
        if getattr(self.module, "kind", None) != self.name:
            raise ValueError(
                f"LayerKind {self.name!r}: its module {getattr(self.module, '__name__', self.module)!r} "
                f"names kind {getattr(self.module, 'kind', None)!r}"
            )
        if self.section is not None and not callable(getattr(self.section, "from_dict", None)):
            raise ValueError(f"LayerKind {self.name!r}: its config section needs a from_dict classmethod")
        if self.check is None:
            object.__setattr__(self, "check", _accept)
        object.__setattr__(self, "init", types.MappingProxyType(dict(self.init)))
        object.__setattr__(self, "channel_axis", types.MappingProxyType(dict(self.channel_axis)))
        object.__setattr__(self, "output_params", tuple(self.output_params))

    def __hash__(self):
        return hash(self.name)

    def __eq__(self, other):
        return isinstance(other, LayerKind) and other.name == self.name and other.module is self.module


_REGISTRY: dict[str, LayerKind] = {}


def register(
    kind: LayerKind, *, factors: Callable | None = None, window_scores: Callable | None = None,
    replace: bool = False,
) -> LayerKind:  # fmt: skip
    """Add ``kind`` to the registry (with its decomposition ``factors`` and ``window_scores`` when given)
    and return it as registered. A name already registered is an error unless ``replace``."""
    if not isinstance(kind, LayerKind):
        raise TypeError(f"register takes a LayerKind, found {type(kind).__name__}")
    if factors is not None:
        kind = dataclasses.replace(kind, factors=factors)
    if window_scores is not None:
        kind = dataclasses.replace(kind, window_scores=window_scores)
    if kind.factors is None:
        raise ValueError(f"layer kind {kind.name!r} is registered without its decomposition (factors=)")
    if kind.name in _REGISTRY and not replace:
        raise ValueError(f"layer kind {kind.name!r} is registered already")
    _REGISTRY[kind.name] = kind
    return kind


def unregister(name: str) -> None:
    """Remove a kind from the registry (a test's own kind, after the test)."""
    _REGISTRY.pop(name, None)


def registered() -> Mapping[str, LayerKind]:
    """Every registered kind, by name (a read-only view)."""
    return types.MappingProxyType(_REGISTRY)


def kind_of(name: str) -> LayerKind:
    """The registered kind called ``name``; an unknown name is a ValueError listing the known ones."""
    kind = _REGISTRY.get(name)
    if kind is None:
        raise ValueError(
            f"unknown layer kind {name!r}; registered kinds: {sorted(_REGISTRY)} (kinds register when "
            "latim_jax is imported: latim_jax.latim.kinds)"
        )
    return kind


def sequence_kinds() -> tuple[str, ...]:
    """The registered kinds whose forward takes a mesh's "seq" axis (``splits_sequence``), sorted."""
    return tuple(sorted(name for name, kind in _REGISTRY.items() if kind.splits_sequence))


def display_name(name: str) -> str:
    """How plots, tables and the CLI name the kind ``name`` ("Mamba-2", "attention", ...)."""
    return kind_of(name).display
