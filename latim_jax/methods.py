"""The attribution methods the alignment and needle evaluations compare, as data: one table row each.

Every LaTIM score in both modes, hidden attention once per aggregation over channels/heads ("minmax":
Ali et al.'s released code, "abs": mean of |M|, "signed": the plain mean), and gradient x input. Rows
whose options the installed :func:`latim_jax.attribute` does not accept (``aggregation=`` before it
landed) are reported as unavailable rather than silently run with other settings; before
``aggregation=`` existed, ``attribute``'s hidden attention was the signed channel mean, so that row is
run without the keyword.
"""

from __future__ import annotations

import dataclasses
import inspect

import numpy as np


@dataclasses.dataclass(frozen=True)
class Method:
    """One row: a display name, the ``attribute`` method and mode, and the hidden-attention aggregation."""

    name: str
    method: str
    mode: str = "exact"
    aggregation: str | None = None


METHODS = (
    Method("LaTIM l2 (exact)", "l2", "exact"),
    Method("LaTIM l2 (paper)", "l2", "paper"),
    Method("LaTIM alti (exact)", "alti", "exact"),
    Method("LaTIM alti (paper)", "alti", "paper"),
    Method("LaTIM logit (exact)", "logit", "exact"),
    Method("LaTIM logit (paper)", "logit", "paper"),
    Method("hidden attention (minmax)", "hidden_attention", aggregation="minmax"),
    Method("hidden attention (abs)", "hidden_attention", aggregation="abs"),
    Method("hidden attention (signed)", "hidden_attention", aggregation="signed"),
    Method("grad x input", "grad_input"),
)


def has_aggregation() -> bool:
    """Whether the installed ``latim_jax.attribute`` takes ``aggregation=``."""
    import latim_jax

    return "aggregation" in inspect.signature(latim_jax.attribute).parameters


def available(method: Method) -> bool:
    """Whether ``method`` can run as specified with the installed ``latim_jax.attribute``."""
    return method.aggregation in (None, "signed") or has_aggregation()


def select(names=None, methods=METHODS) -> tuple[Method, ...]:
    """The rows whose ``attribute`` method is in ``names`` (None: all)."""
    if names is None:
        return tuple(methods)
    unknown = sorted(set(names) - {m.method for m in methods})
    if unknown:
        raise ValueError(
            f"unknown method(s) {unknown}; expected some of {sorted({m.method for m in methods})}"
        )
    return tuple(m for m in methods if m.method in names)


def run(model, tokens, method: Method, **kwargs):
    """``latim_jax.attribute(model, tokens, method.method, method.mode, aggregation=..., **kwargs)``."""
    import latim_jax

    if not available(method):
        raise ValueError(f"{method.name}: this latim_jax.attribute has no aggregation= keyword")
    if method.aggregation is not None and has_aggregation():
        kwargs["aggregation"] = method.aggregation
    return latim_jax.attribute(model, tokens, method.method, method.mode, **kwargs)


def layer_aggregate(result, method: Method):
    """(B, R, L) aggregate over layers: ``latim_jax.evaluate.aggregate`` (rollout for alti / logit /
    hidden attention, the sum of row-normalised |maps| for l2 and grad x input) when every row was
    computed; with a subset of rows (long inputs) the sum of row-normalised |maps| for every method.
    None for signed hidden attention, whose signed maps admit no rollout."""
    from latim_jax.evaluate import aggregate

    if method.aggregation == "signed":
        return None
    if result.rows is None:
        return np.asarray(aggregate(result))
    s = np.abs(np.asarray(result.scores))
    total = s.sum(-1, keepdims=True)
    return (s / np.where(total > 0, total, 1.0)).sum(1)
