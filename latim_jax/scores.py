"""Per-layer token-to-token scores, evaluated in blocks so the (l, l, d) tensor never exists.

Row i = target position, column j = source. With T_{ij} = T_i(x_j) (latim_jax.decomposition), the
residual h_i entering the layer and hout_i = h_i + o_i (latim-math.md, section 4):

    l2     c_ij = ||T_ij||_2                 l1  c_ij = ||T_ij||_1
    alti   c_ij = max(0, ||hout_i||_1 - ||hout_i - T'_ij||_1), T'_ij = T_ij + [i=j] h_i, rows sum to 1
           (a row with no positive entry, possible when the bias terms dominate, puts 1 on j = i, so
           every row is a distribution and rollouts stay row-stochastic)
    logit  c_ij = E_w . (g_f * T_ij) / r_i   (w = the target vocabulary entry of row i)
    hidden_attention  c_ij = mean over channels (Mamba-1) / heads (Mamba-2) of M_{i,j} without D

Blocks: target rows in blocks of ``block_rows``; for each, a scan over source blocks of
``block_cols`` columns that skips (writes zeros for) blocks entirely above the diagonal. Peak memory
is O(block_rows * block_cols * max(e, d)) per prompt, never O(l^2 d).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from latim_jax.decomposition import LayerFactors, pair_values
from latim_jax.hidden_attention import hidden_attention_block
from latim_jax.kernels import fused_scores
from latim_jax.kernels.dispatch import use_pallas
from latim_jax.layers import f32

LATIM_METHODS = ("l2", "l1", "alti", "logit")
METHODS = LATIM_METHODS + ("hidden_attention", "grad_input")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Blocks:
    """Block sizes of the blocked score path (rows x source columns per step)."""

    rows: int = 32
    cols: int = 32

    @classmethod
    def for_layer(cls, version: int, length: int) -> Blocks:
        """Defaults: small blocks for Mamba-1 (its per-channel N-sum is the big intermediate)."""
        size = 16 if version == 1 else 64
        size = min(size, max(8, 1 << (max(length, 1) - 1).bit_length()))
        return cls(rows=size, cols=size)


def safe_norm(x, axis):
    """||x||_2 with a finite gradient at 0."""
    sq = jnp.sum(x * x, axis=axis)
    zero = sq == 0  # NaN is not zero: it propagates, so non-finite inputs are reported
    return jnp.where(zero, 0.0, jnp.sqrt(jnp.where(zero, 1.0, sq)))


def pair_score(f: LayerFactors, method: str, rows, j0, width, aux=None):
    """Scores of pairs (i in rows, j in [j0, j0 + width)): (b, r, width), unnormalised."""
    if method == "hidden_attention":
        M = hidden_attention_block(
            f.version, f.A, f.D, f.delta, f.B, f.C, f.decay, rows, j0 + jnp.arange(width), with_D=False
        )
        return jnp.mean(M, axis=-1)
    V = pair_values(f, rows, j0, width)  # (b, r, width, e)
    if method == "logit":
        return jnp.einsum("brje,bre->brj", V, aux[:, rows])
    T = jnp.einsum("brje,ed->brjd", V, f.W_out)
    if method == "l2":
        return safe_norm(T, -1)
    if method == "l1":
        return jnp.sum(jnp.abs(T), axis=-1)
    if method == "alti":
        hout = (f.h + f.output)[:, rows]  # (b, r, d); the bias terms are part of o
        diag = (rows[:, None] == (j0 + jnp.arange(width))[None, :]).astype(f32)  # (r, width)
        Tp = T + diag[None, :, :, None] * f.h[:, rows][:, :, None]
        full = jnp.sum(jnp.abs(hout), -1)[:, :, None]
        return jnp.maximum(0.0, full - jnp.sum(jnp.abs(hout[:, :, None] - Tp), -1))
    raise ValueError(
        f"unknown LaTIM score {method!r}; expected one of {LATIM_METHODS + ('hidden_attention',)}"
    )


def blocked(fn, rows, length, blocks: Blocks, out_tail=()):
    """Evaluate fn(rows_block, j0) -> (b, block_rows, block_cols, *out_tail) over all causal blocks.

    Returns (b, len(rows), length, *out_tail); blocks above the diagonal are not computed.
    """
    n_cb = -(-length // blocks.cols)

    def row_block(rb):
        rmax = jnp.max(rb)

        def col_block(j0):
            def compute(_):
                return fn(rb, j0)

            shape = jax.eval_shape(compute, None)
            return jax.lax.cond(j0 <= rmax, compute, lambda _: jnp.zeros(shape.shape, shape.dtype), None)

        out = jax.lax.map(col_block, jnp.arange(n_cb) * blocks.cols)  # (n_cb, b, br, bc, ...)
        out = jnp.moveaxis(out, 0, 2)  # (b, br, n_cb, bc, ...)
        return out.reshape(out.shape[0], out.shape[1], n_cb * blocks.cols, *out_tail)

    return map_row_blocks(row_block, rows, blocks)[:, :, :length]


def map_row_blocks(row_fn, rows, blocks: Blocks):
    """row_fn(rows_block) -> (b, block_rows, ...) over ``rows`` in blocks of ``blocks.rows`` (the last
    block padded by repeating its final row); returns (b, len(rows), ...)."""
    r = rows.shape[0]
    n_rb = -(-r // blocks.rows)
    rows_p = jnp.concatenate([rows, jnp.full((n_rb * blocks.rows - r,), rows[-1], rows.dtype)])
    res = jax.lax.map(row_fn, rows_p.reshape(n_rb, blocks.rows))  # (n_rb, b, br, ...)
    res = jnp.moveaxis(res, 0, 1)
    return res.reshape(res.shape[0], n_rb * blocks.rows, *res.shape[3:])[:, :r]


def layer_scores(f: LayerFactors, method: str, rows, *, blocks: Blocks | None = None, aux=None, impl="xla"):
    """Scores (b, len(rows), l) of one layer; alti rows are normalised to sum 1.

    ``impl``: "xla" = the blocked pure-JAX path; "pallas" = the fused kernel (kernels/fused_scores.py,
    interpret mode on CPU) for l2/l1/alti/logit; "auto" = the kernel on TPU/GPU, XLA elsewhere.
    """
    if use_pallas(impl) and method in fused_scores.METHODS:
        s = fused_scores.fused_layer_scores(f, method, rows, aux=aux)
    else:
        blocks = blocks or Blocks.for_layer(f.version, f.length)
        s = blocked(lambda rb, j0: pair_score(f, method, rb, j0, blocks.cols, aux), rows, f.length, blocks)
    if method == "alti":
        s = normalise_alti(s, rows)
    return s


def normalise_alti(s, rows):
    """Divide each row by its sum; a row with no positive entry becomes one-hot on j = i."""
    total = jnp.sum(s, -1, keepdims=True)
    self_hot = (jnp.arange(s.shape[-1])[None, :] == rows[:, None]).astype(s.dtype)
    zero = total == 0
    return jnp.where(zero, self_hot, s / jnp.where(zero, 1.0, total))


def token_sum(f: LayerFactors, rows, *, blocks: Blocks | None = None):
    """sum_j T_i(x_j) for i in rows, accumulated block by block: (b, r, d)."""
    blocks = blocks or Blocks.for_layer(f.version, f.length)
    n_cb = -(-f.length // blocks.cols)

    def row_block(rb):
        def add(acc, j0):
            part = jax.lax.cond(
                j0 <= jnp.max(rb),
                lambda: pair_values(f, rb, j0, blocks.cols).sum(2),
                lambda: jnp.zeros_like(acc),
            )
            return acc + part, None

        acc0 = jnp.zeros((f.G.shape[0], blocks.rows, f.G.shape[-1]), f32)
        acc, _ = jax.lax.scan(add, acc0, jnp.arange(n_cb) * blocks.cols)
        return acc  # (b, br, e)

    V = map_row_blocks(row_block, rows, blocks)  # (b, r, e)
    return jnp.einsum("bre,ed->brd", V, f.W_out)
