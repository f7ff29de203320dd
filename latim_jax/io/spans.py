"""Spans of positions (words, phrases, segments) and the aggregation of token maps over them.

Glossary: B prompts, n layers, R target rows, L positions, S spans (the most any prompt has).

A :class:`Spans` partitions one prompt's real positions into consecutive half-open ranges
[start, end), each with a label. Aggregating a map over spans (:func:`aggregate`):

- sources (columns) are SUMMED over each span: a row's total is unchanged, so every conservation
  identity survives (ALTI rows still sum to 1; logit rows still add up, with the direct and bias terms,
  to the logit);
- target rows, when the map holds every row, follow the ``rows`` rule: "last" (default) takes the row
  of the span's last token, the first position at which a causal model has read the whole span (for
  "logit", the row that predicts the token after the span), and "mean" averages the span's rows (its
  extras, the logit, direct and bias terms, are averaged alike, so the identity holds for the mean).
  A result of a row subset keeps its rows (positions) and aggregates only the sources.
"""

from __future__ import annotations

import dataclasses

import numpy as np

ROW_RULES = ("last", "mean")
VISIBLE = {" ": "␣", "\n": "↵", "\t": "⇥", "\r": "␍"}  # how whitespace shows in a label


def visible(label: str) -> str:
    """``label`` as a reader can see it on an axis: line breaks, tabs and carriage returns become
    ↵ ⇥ ␍, and a label of spaces only (a byte-level BPE space token) shows them as ␣; an empty label is
    ∅. Other labels keep their spaces (" cat" stays " cat")."""
    if label == "":
        return "∅"
    out = "".join(VISIBLE.get(c, c) if c != " " else c for c in label)
    return out.replace(" ", VISIBLE[" "]) if not label.strip(" ") else out


@dataclasses.dataclass(frozen=True)
class Spans:
    """One prompt's positions split into consecutive spans [start, end), with a label per span.

    bounds: ((start, end), ...) increasing, contiguous, non-empty; labels: one str per span, or None;
    tokens: the ids the spans were read from (None when built by hand)."""

    bounds: tuple[tuple[int, int], ...]
    labels: tuple[str, ...] | None = None
    tokens: tuple[int, ...] | None = None

    def __post_init__(self):
        bounds = tuple((int(a), int(b)) for a, b in self.bounds)
        object.__setattr__(self, "bounds", bounds)
        if not bounds:
            raise ValueError("Spans needs at least one span")
        for k, (a, b) in enumerate(bounds):
            if b <= a:
                raise ValueError(f"span {k} is ({a}, {b}): each span needs start < end (half-open)")
            if k and a != bounds[k - 1][1]:
                raise ValueError(
                    f"span {k} starts at {a} but span {k - 1} ends at {bounds[k - 1][1]}: spans must be "
                    "consecutive, each starting where the previous one ends (a partition: every source "
                    "counted once)"
                )
        if self.labels is not None:
            labels = tuple(str(x) for x in self.labels)
            if len(labels) != len(bounds):
                raise ValueError(f"{len(labels)} labels for {len(bounds)} spans")
            object.__setattr__(self, "labels", labels)

    @property
    def start(self) -> int:
        """The first position covered."""
        return self.bounds[0][0]

    @property
    def end(self) -> int:
        """One past the last position covered."""
        return self.bounds[-1][1]

    def __len__(self) -> int:
        return len(self.bounds)


def as_spans(spans) -> Spans:
    """A :class:`Spans`, or a sequence of (start, end) pairs made into one."""
    if isinstance(spans, Spans):
        return spans
    try:
        pairs = [tuple(p) for p in spans]
    except TypeError:
        found = type(spans).__name__
        raise ValueError(f"spans must be a Spans or (start, end) pairs, found {found}") from None
    if any(len(p) != 2 for p in pairs):
        raise ValueError("spans must be (start, end) pairs")
    return Spans(tuple(pairs))


def per_prompt(spans, batch: int) -> list[Spans]:
    """One :class:`Spans` per prompt: a list of ``batch`` of them, or one partition for every prompt."""
    if isinstance(spans, Spans):
        return [spans] * batch
    items = list(spans)
    if items and (isinstance(items[0], Spans) or _is_pair_list(items[0])):
        if len(items) != batch:
            raise ValueError(
                f"{len(items)} span lists for {batch} prompts: give one per prompt, or one for all"
            )
        return [as_spans(s) for s in items]
    return [as_spans(items)] * batch


def _is_pair_list(x) -> bool:
    """Whether ``x`` is a list of (start, end) pairs (not a pair itself)."""
    try:
        return len(x) > 0 and all(len(p) == 2 for p in x) and not np.isscalar(x[0])
    except TypeError:
        return False


def check_cover(spans: list[Spans], mask: np.ndarray) -> None:
    """Each prompt's spans cover exactly its real positions (``mask`` (B, L) bool): the first span starts
    at the first real position and the last ends after the last one; ValueError naming the prompt."""
    for b, (s, m) in enumerate(zip(spans, mask, strict=True)):
        real = np.flatnonzero(m)
        want = (int(real[0]), int(real[-1]) + 1) if real.size else (0, 0)
        if (s.start, s.end) != want:
            raise ValueError(
                f"prompt {b}: the spans cover positions [{s.start}, {s.end}) but its real positions are "
                f"[{want[0]}, {want[1]}): spans must cover every real position (padding excluded) once"
            )


def matrices(spans: list[Spans], length: int, rows: str) -> tuple[np.ndarray, np.ndarray]:
    """(G (B, S, L): 1 where position l lies in span s, the sum over sources; W (B, S, L): the row weights
    of the ``rows`` rule, one-hot at the span's last position ("last") or 1/len over it ("mean")); spans
    past a prompt's count are all-zero rows."""
    if rows not in ROW_RULES:
        raise ValueError(f"rows must be one of {ROW_RULES}, found {rows!r}")
    S = max(len(s) for s in spans)
    G = np.zeros((len(spans), S, length), np.float32)
    W = np.zeros_like(G)
    for b, s in enumerate(spans):
        for k, (a, e) in enumerate(s.bounds):
            G[b, k, a:e] = 1.0
            if rows == "last":
                W[b, k, e - 1] = 1.0
            else:
                W[b, k, a:e] = 1.0 / (e - a)
    return G, W
