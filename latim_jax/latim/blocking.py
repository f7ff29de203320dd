"""The one block loop: every score, hidden-attention range and token sum of the library visits the causal
(row tile, column tile) pairs of a layer through :func:`blocked`.

A tile is ``rows.tile`` target rows x ``cols`` source columns (:class:`latim_jax.kernels.block_sizes.
Blocks`; :func:`tiles` fills the defaults). Tiles entirely above the diagonal are not computed (zeros).
Peak memory is O(tile rows x tile columns x max(e, d)) per prompt plus the output, never O(l^2 d).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from latim_jax.kernels.block_sizes import Blocks


def tiles(version: int, length: int, n_rows: int | None, blocks: Blocks | None) -> Blocks:
    """``blocks`` (None fields, or None) completed with the XLA path's defaults
    (:meth:`~latim_jax.kernels.block_sizes.Blocks.for_layer`) for ``n_rows`` target rows of ``length``."""
    return (blocks or Blocks()).over(Blocks.for_layer(version, length, n_rows))


class DefaultTiles:
    """``length`` and ``tiles`` of a layer kind whose factors hold the stream ``h`` (b, l, d) and score
    in Mamba-2's default tiles (attention, token-wise and parallel kinds): one definition they share."""

    @property
    def length(self) -> int:
        """Sequence length l."""
        return self.h.shape[1]

    def tiles(self, n_rows: int | None, blocks: Blocks | None) -> Blocks:
        """The score tiles for ``n_rows`` target rows (None: all), Mamba-2's defaults completed with
        ``blocks``."""
        return tiles(2, self.length, n_rows, blocks)


def row_tiles(rows, tile_rows: int):
    """``rows`` (r,) as (n_tiles, tile_rows), the last tile padded by repeating its final row."""
    r = rows.shape[0]
    n = -(-r // tile_rows)
    padded = jnp.concatenate([rows, jnp.full((n * tile_rows - r,), rows[-1], rows.dtype)])
    return padded.reshape(n, tile_rows)


def blocked(tile, rows, length: int, blocks: Blocks, *, init=None, combine=None):
    """Run ``tile(row_tile, j0)`` on every causal (row tile, column tile) pair, in one flat loop.

    ``tile`` returns the tile's block (b, tile_rows, blocks.cols, ...) or None; with ``init`` (a pytree)
    it returns (block, part) and ``combine(acc, part, ri)`` folds each computed tile's part into the
    accumulator (``ri``: the row tile's index), so reductions over tiles (a running min and max, a sum
    per row) need no stacked per-tile output. Returns the blocks stitched to (b, len(rows), length,
    ...), or None, and with ``init`` the (blocks, accumulator) pair.

    Each step is rematerialised under differentiation (jax.checkpoint around the cond: a checkpoint
    inside a cond's branch is not honoured), so a gradient holds O(output + one tile), like the
    forward. Flat rather than nested (rows outer, columns inner): the cotangents of the closed-over
    factors are then accumulated at one loop level, not two (a nested loop kept both levels' full-size
    accumulators alive: compiled temporaries of one 130m Mamba-1 layer's gradient at L = 4096, 1.08 ->
    0.89 GiB).
    """
    n_cb = -(-length // blocks.cols)
    rows_t = row_tiles(rows, blocks.rows)  # (n_rb, br)
    n_rb = rows_t.shape[0]
    folding = init is not None

    @jax.checkpoint
    def step(acc, args):
        ri, j0 = args
        rb = rows_t[ri]

        def compute(acc):
            out = tile(rb, j0)
            if not folding:
                return out, acc
            out, part = out
            return out, combine(acc, part, ri)

        shape = jax.eval_shape(compute, acc)[0]

        def skip(acc):
            return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shape), acc

        out, acc = jax.lax.cond(j0 <= jnp.max(rb), compute, skip, acc)
        return acc, out

    ri = jnp.repeat(jnp.arange(n_rb), n_cb)
    j0 = jnp.tile(jnp.arange(n_cb) * blocks.cols, n_rb)
    acc, out = jax.lax.scan(step, init, (ri, j0))  # out (n_rb * n_cb, b, br, bc, ...) or None
    if out is not None:
        out = out.reshape(n_rb, n_cb, *out.shape[1:])
        out = jnp.moveaxis(out, 2, 0)  # (b, n_rb, n_cb, br, bc, ...)
        tail = out.shape[5:]
        out = jnp.swapaxes(out, 2, 3).reshape(out.shape[0], n_rb * blocks.rows, n_cb * blocks.cols, *tail)
        out = out[:, : rows.shape[0], :length]
    return (out, acc) if folding else out
