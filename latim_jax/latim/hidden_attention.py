"""The hidden-attention baseline (Ali et al. 2024): the layer's M without D, aggregated over channels
(Mamba-1) / heads (Mamba-2) into one map per layer (docs/method.md, section 6).

:data:`AGGREGATIONS`: "minmax" (default; Ali et al.'s released code) = (mean_c M_ij[c] - m) / (M - m)
with m, M the min and max of the layer's whole per-channel tensor over the prompt's causal entries
between real tokens (all rows, whatever rows are asked, so a row subset equals the full map's rows);
"abs" = mean_c |M_ij[c]|; "signed" = mean_c M_ij[c] (may be negative: no rollout).

M comes from :mod:`latim_jax.kernels.decay` (its one definition) and the tiles from the one block loop
(:func:`latim_jax.latim.blocking.blocked`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from latim_jax.kernels import f32
from latim_jax.kernels.block_sizes import Blocks
from latim_jax.kernels.decay import SSM, decay_tile, far_mean, m1_far_or_near
from latim_jax.latim.blocking import blocked, tiles

AGGREGATIONS = ("minmax", "abs", "signed")
DEFAULT_AGGREGATION = "minmax"


def _tile(ssm: SSM, rows, j0, blocks: Blocks):
    """M without D for target rows ``rows`` and sources [j0, j0 + cols): (b, r, cols, c)."""
    return decay_tile(
        ssm, rows, j0 + jnp.arange(blocks.cols), with_D=False, direct_rows=blocks.m1_direct_rows,
        tangent_rows=blocks.m1_tangent_rows, state_group=blocks.m1_state_group,
    )  # fmt: skip


def _m1_mean(ssm: SSM, rows, j0, blocks: Blocks):
    """Mamba-1's mean over channels of M (without D), (b, r, cols): a far tile is one (r x e n)(e n x q)
    product (:func:`latim_jax.kernels.decay.far_mean`), never the (r, q, e) block; other tiles
    average M."""
    cols = j0 + jnp.arange(blocks.cols)

    def near(M):
        return jnp.mean(M, axis=-1)

    return m1_far_or_near(
        ssm, rows, cols, far_mean, near, with_D=False, direct_rows=blocks.m1_direct_rows,
        tangent_rows=blocks.m1_tangent_rows, state_group=blocks.m1_state_group,
    )  # fmt: skip


def hidden_attention_scores(ssm: SSM, rows, mask, blocks: Blocks, aggregation: str, columns=None):
    """The hidden-attention map (b, len(rows), l) with one of :data:`AGGREGATIONS` (module docstring),
    before the causal and padding mask. minmax needs the per-prompt range of M over the whole causal
    triangle: Mamba-2 takes it from the map's own tiles when ``rows`` reach every position, else (and
    always for Mamba-1, whose far tiles never form M) a range pass that keeps only a running min and
    max (no (l, l) intermediate). ``columns``: (start, width), the sources [start, start + width) only
    (:func:`latim_jax.latim.blocking.blocked`; "abs" and "signed": the range spans other columns)."""
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, found {aggregation!r}")
    if columns is not None and aggregation == "minmax":
        raise ValueError("a column window of the minmax map needs the whole range: take 'signed' and rescale")

    def tile(rb, j0):
        if ssm.version == 1 and aggregation != "abs":
            return _m1_mean(ssm, rb, j0, blocks)
        M = _tile(ssm, rb, j0, blocks)  # (b, r, q, c)
        return jnp.mean(jnp.abs(M) if aggregation == "abs" else M, axis=-1)

    if aggregation == "minmax" and ssm.version == 2:  # the map and its range from the same tiles
        s, lo, hi = _m2_mean_and_range(ssm, rows, mask, blocks)
    else:
        s = blocked(tile, rows, ssm.length, blocks, columns=columns)
        if aggregation != "minmax":
            return s
        lo, hi = hidden_attention_range(ssm, mask, blocks)
    return minmax_normalise(s, lo, hi)


def minmax_normalise(s, lo, hi):
    """(s - m) / (M - m) per prompt for maps s (b, r, l) and the range lo, hi (b,); 1 where M = m."""
    span = (hi - lo)[:, None, None]
    return jnp.where(span > 0, (s - lo[:, None, None]) / jnp.where(span > 0, span, 1.0), 1.0)


def _m2_mean_and_range(ssm: SSM, rows, mask, blocks: Blocks):
    """Mamba-2's mean map (b, r, l) over ``rows`` and the (min, max) (b,) of M without D that minmax
    normalises by, from one pass: each tile's M also gives its min and max over the kept pairs
    (:func:`_kept_range`, as the range pass). When ``rows`` do not reach every position (a row
    subset, or a device's share of the rows), those tiles miss part of the triangle and the range pass
    runs instead (a cond: one of the two executes)."""
    length = ssm.length
    valid = jnp.pad(mask, ((0, 0), (0, blocks.cols)))  # a column tile may run past the end

    def tile(rb, j0):
        M = _tile(ssm, rb, j0, blocks)  # (b, r, q, h); rb are real positions
        return jnp.mean(M, axis=-1), _kept_range(M, rb, j0, valid, length)

    def widen(acc, part, _):
        return jnp.minimum(acc[0], part[0]), jnp.maximum(acc[1], part[1])

    s, (lo, hi) = blocked(tile, rows, length, blocks, init=_empty_range(ssm), combine=widen)
    every_row = jnp.all(jnp.zeros((length,), bool).at[rows].set(True))
    lo, hi = jax.lax.cond(every_row, lambda: (lo, hi), lambda: hidden_attention_range(ssm, mask, blocks))
    return s, lo, hi


def _empty_range(ssm: SSM):
    b = ssm.delta.shape[0]
    return jnp.full((b,), jnp.inf, f32), jnp.full((b,), -jnp.inf, f32)


def hidden_attention_range(ssm: SSM, mask, blocks: Blocks, rows=None):
    """(min, max) (b,) of M without D over every channel and every causal pair of real positions: the
    one block loop over all rows, keeping a running min and max. ``rows``: only those target rows (a
    device's share on a mesh; the shares' min and max then combine into the whole range)."""
    length = ssm.length
    full = tiles(ssm.version, length, None, dataclasses.replace(blocks, rows=None, cols=None))  # square
    valid = jnp.pad(mask, ((0, 0), (0, full.rows + full.cols)))

    def tile(rb, j0):
        return None, _kept_range(_tile(ssm, rb, j0, full), rb, j0, valid, length)

    def widen(acc, part, _):
        return jnp.minimum(acc[0], part[0]), jnp.maximum(acc[1], part[1])

    rows = np.arange(length) if rows is None else rows  # numpy: a static schedule (blocked)
    _, (lo, hi) = blocked(tile, rows, length, full, init=_empty_range(ssm), combine=widen)
    return lo, hi


def _kept_range(M, rb, j0, valid, length: int):
    """(min, max) (b,) of a tile M (b, r, q, c) of target rows ``rb`` and sources j0 .. j0 + q - 1 over
    its kept pairs: causal, both positions inside the sequence and real. ``valid`` (b, l') bool, padded
    with False far enough past the end to index every row and column of the tile."""
    cols = j0 + jnp.arange(M.shape[2])
    keep = (cols[None, :] <= rb[:, None]) & (rb[:, None] < length) & (cols[None, :] < length)
    keep = keep[None] & valid[:, rb, None] & jax.lax.dynamic_slice_in_dim(valid, j0, M.shape[2], 1)[:, None]
    lo = jnp.min(jnp.where(keep[..., None], M, jnp.inf), axis=(1, 2, 3))
    hi = jnp.max(jnp.where(keep[..., None], M, -jnp.inf), axis=(1, 2, 3))
    return lo, hi
