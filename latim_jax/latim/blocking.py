"""The one block loop: every score, hidden-attention range and token sum of the library visits the causal
(row tile, column tile) pairs of a layer through :func:`blocked`.

A tile is ``rows.tile`` target rows x ``cols`` source columns (:class:`latim_jax.kernels.block_sizes.
Blocks`; :func:`tiles` fills the defaults). Tiles entirely above the diagonal are not computed (zeros).
Peak memory is O(tile rows x tile columns x max(e, d)) per prompt plus the output, never O(l^2 d).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from latim_jax.kernels.block_sizes import Blocks


def tiles(version: int, length: int, n_rows: int | None, blocks: Blocks | None) -> Blocks:
    """``blocks`` (None fields, or None) completed with the XLA path's defaults
    (:meth:`~latim_jax.kernels.block_sizes.Blocks.for_layer`) for ``n_rows`` target rows of ``length``."""
    return (blocks or Blocks()).over(Blocks.for_layer(version, length, n_rows))


def as_rows(rows):
    """Target rows as int32, numpy kept as numpy (a schedule known when tracing: see :func:`blocked`)."""
    if isinstance(rows, np.ndarray):
        return rows.astype(np.int32, copy=False)
    return jnp.asarray(rows, jnp.int32)


def row_tiles(rows, tile_rows: int):
    """``rows`` (r,) as (n_tiles, tile_rows), the last tile padded by repeating its final row (numpy in,
    numpy out)."""
    xp = np if isinstance(rows, np.ndarray) else jnp
    r = rows.shape[0]
    n = -(-r // tile_rows)
    padded = xp.concatenate([rows, xp.full((n * tile_rows - r,), rows[-1], rows.dtype)])
    return padded.reshape(n, tile_rows)


def blocked(tile, rows, length: int, blocks: Blocks, *, init=None, combine=None, columns=None):
    """Run ``tile(row_tile, j0)`` on every causal (row tile, column tile) pair, in one flat loop.

    ``tile`` returns the tile's block (b, tile_rows, blocks.cols, ...) or None; with ``init`` (a pytree)
    it returns (block, part) and ``combine(acc, part, ri)`` folds each computed tile's part into the
    accumulator (``ri``: the row tile's index), so reductions over tiles (a running min and max, a sum
    per row) need no stacked per-tile output. Returns the blocks stitched to (b, len(rows), length,
    ...), or None, and with ``init`` the (blocks, accumulator) pair.

    ``columns``: (start, width), the sources [start, start + width) only (a device's share of the
    columns when a mesh's "seq" axis splits the length; ``start`` may be traced, ``width`` is static):
    the tiles' ``j0`` run from ``start`` and the blocks are stitched to (b, len(rows), width, ...). The
    static schedule then visits the pairs causal for start = 0, a superset of the causal ones (the
    extra tiles hold zeros, and every score masks them again).

    ``rows`` as a numpy array (known when the program is traced: every row, the usual case) gives a
    static schedule: the loop visits only the causal pairs, with no branch. A traced ``rows`` visits
    every pair and skips the non-causal ones with a ``lax.cond``. The two give the same values; they
    differ under ``jax.grad``: the transpose of a cond returns each tile's cotangent of the closed-over
    factors as a full-size array added outside the branch (O(l e) per tile: the gradient grows as
    L^3), where a branch-free step's gathers transpose to scatter-adds that XLA accumulates in place.

    Each step is rematerialised under differentiation (jax.checkpoint around the step; a checkpoint
    inside a cond's branch is not honoured), so a gradient holds O(output + one tile), like the
    forward. Flat rather than nested (rows outer, columns inner): the cotangents of the closed-over
    factors are then accumulated at one loop level, not two (a nested loop kept both levels' full-size
    accumulators alive: compiled temporaries of one 130m Mamba-1 layer's gradient at L = 4096, 1.08 ->
    0.89 GiB).
    """
    start, width = (0, length) if columns is None else columns
    n_cb = -(-width // blocks.cols)
    static = isinstance(rows, np.ndarray)
    rows_t = row_tiles(rows, blocks.rows)  # (n_rb, br)
    n_rb = rows_t.shape[0]
    folding = init is not None

    def compute(acc, ri, j0):  # j0: the tile's first column relative to start
        out = tile(jnp.asarray(rows_t)[ri], start + j0)
        if not folding:
            return out, acc
        out, part = out
        return out, combine(acc, part, ri)

    if static:  # the causal pairs only, no branch
        ri, cj = np.nonzero(np.arange(n_cb)[None, :] * blocks.cols <= rows_t.max(1)[:, None])
        xs = (jnp.asarray(ri, jnp.int32), jnp.asarray(cj * blocks.cols, jnp.int32))

        @jax.checkpoint
        def step(acc, args):
            out, acc = compute(acc, *args)
            return acc, out

    else:
        ri = jnp.repeat(jnp.arange(n_rb), n_cb)
        xs = (ri, jnp.tile(jnp.arange(n_cb) * blocks.cols, n_rb))

        @jax.checkpoint
        def step(acc, args):
            ri, j0 = args
            shape = jax.eval_shape(compute, acc, ri, j0)[0]

            def skip(acc, ri, j0):
                return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shape), acc

            out, acc = jax.lax.cond(start + j0 <= jnp.max(rows_t[ri]), compute, skip, acc, ri, j0)
            return acc, out

    acc, out = jax.lax.scan(step, init, xs)  # out (n_steps, b, br, bc, ...) or None
    if out is not None:
        if static:  # every pair: the computed tiles, zeros above the diagonal
            at = np.full(n_rb * n_cb, len(ri))
            at[ri * n_cb + cj] = np.arange(len(ri))
            out = jnp.concatenate([out, jnp.zeros_like(out[:1])])[at]
        out = out.reshape(n_rb, n_cb, *out.shape[1:])
        out = jnp.moveaxis(out, 2, 0)  # (b, n_rb, n_cb, br, bc, ...)
        tail = out.shape[5:]
        out = jnp.swapaxes(out, 2, 3).reshape(out.shape[0], n_rb * blocks.rows, n_cb * blocks.cols, *tail)
        out = out[:, : rows.shape[0], :width]
    return (out, acc) if folding else out
