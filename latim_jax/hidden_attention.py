"""The hidden attention M of a Mamba layer, built block by block (shape letters: see latim_jax.config).

    Mamba-1, per channel e:  M_{i,t}[e] = sum_n C_i[n] B_t[n] Delta_t[e] exp(A[e,n] (S_i[e] - S_t[e]))
    Mamba-2, per head h:     M_{i,t}[h] = (C_i[g(h)] . B_t[g(h)]) Delta_t[h] exp(A[h] (S_i[h] - S_t[h]))
    plus [i = t] D on the diagonal, and M_{i,t} = 0 for t > i,

with S_i = sum_{k<=i} Delta_k. S is held as a compensated (double-float) cumulative sum, so the
segment sums S_i - S_t keep fp32 relative accuracy at any length, and the exponent is masked to -inf
above the diagonal before exponentiating.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

f32 = jnp.float32


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Decay:
    """Compensated cumulative sums of Delta: S = hi + lo, each (b, l, c) with c = e or h."""

    hi: jax.Array
    lo: jax.Array


def compensated_cumsum(delta) -> Decay:
    """S_t = sum_{k<=t} delta_k along axis 1 as an unevaluated sum hi + lo (TwoSum per step)."""

    def step(carry, x):
        hi, lo = carry
        s = hi + x
        bb = s - hi
        err = (hi - (s - bb)) + (x - bb)
        lo = lo + err
        return (s, lo), (s, lo)

    zero = jnp.zeros_like(delta[:, 0])
    _, (hi, lo) = jax.lax.scan(step, (zero, zero), jnp.swapaxes(delta.astype(f32), 0, 1))
    return Decay(jnp.swapaxes(hi, 0, 1), jnp.swapaxes(lo, 0, 1))


def segment_sum(decay: Decay, rows, cols):
    """S_i - S_t for target positions ``rows`` (r,) and source positions ``cols`` (q,): (b, r, q, c)."""
    hi_i, lo_i = decay.hi[:, rows], decay.lo[:, rows]
    hi_t, lo_t = decay.hi[:, cols], decay.lo[:, cols]
    return (hi_i[:, :, None] - hi_t[:, None]) + (lo_i[:, :, None] - lo_t[:, None])


def causal_mask(rows, cols, length):
    """(r, q) bool: source t <= target i and t inside the sequence."""
    return (cols[None, :] <= rows[:, None]) & (cols[None, :] < length)


def hidden_attention_block(
    version, A, D, delta, B, C, decay, rows, cols, *, with_D=True, factors=None, direct=False
):
    """M_{i,t} for i in ``rows``, t in ``cols`` (index arrays; cols may run past the end: zero there).

    Mamba-1: A (e, n), D (e,), delta (b, l, e), B, C (b, l, n) -> (b, r, q, e); ``factors``: the
    (P, Q) of :func:`m1_far_factors` for these rows and cols when the caller already has them;
    ``direct``: the direct form on this block without the far-tile test and without P and Q (for a
    few rows, where the factored product's operand costs more than the r q e n exponentials).
    Mamba-2: A (h,), D (h,), delta (b, l, h), B, C (b, l, g, n) -> (b, r, q, h).
    """
    length = delta.shape[1]
    mask = causal_mask(rows, cols, length)  # (r, q)
    safe = jnp.minimum(cols, length - 1)
    dt_t = delta[:, safe].astype(f32)  # (b, q, c)
    if version == 1:
        # a tile whose sources all precede its targets factors the decay through its first target:
        # M = sum_n P Q (m1_far_factors), P and Q formed outside the cond (inside, XLA fuses their
        # exponentials into the product); the near tile rematerialised under differentiation (its
        # r q e n exponentials, n times the block's size, are recomputed rather than kept)
        direct_form = jax.checkpoint(
            lambda *_: _m1_direct_chunked(A, delta, B, C, decay, rows, safe, mask) * dt_t[:, None]
        )
        if direct:
            M = direct_form()
        else:
            far = jnp.max(cols) <= jnp.min(rows)
            P, Q = m1_far_factors(A, delta, B, C, decay, rows, safe) if factors is None else factors
            M = jax.lax.cond(far, _m1_product, direct_form, P, Q)
    else:
        seg = segment_sum(decay, rows, safe)  # (b, r, q, c)
        heads = A.shape[0]
        g = C.shape[2]
        cb = jnp.einsum("brgn,bqgn->brqg", C[:, rows].astype(f32), B[:, safe].astype(f32))  # (b, r, q, g)
        cb = jnp.repeat(cb, heads // g, axis=-1)  # (b, r, q, h): head h reads group h // (h/g)
        expo = jnp.where(mask[None, :, :, None], A * seg, -jnp.inf)
        M = cb * jnp.exp(expo) * dt_t[:, None]
    if with_D:
        diag = (rows[:, None] == cols[None, :]).astype(f32)  # (r, q)
        M = M + diag[None, :, :, None] * D.astype(f32)
    return M


M1_DIRECT_ROWS = 32  # target rows per pass of the Mamba-1 direct form (bounds its backward's temporaries)


def _m1_direct_chunked(A, delta, B, C, decay, rows, cols, mask):
    """:func:`_m1_direct` over chunks of :data:`M1_DIRECT_ROWS` target rows, one after another, each
    rematerialised under differentiation: the backward of one pass holds a (chunk, q, e, n) block of
    exponentials, so a 64-row tile costs the backward what a 32-row tile did."""
    r = rows.shape[0]
    if r <= M1_DIRECT_ROWS or r % M1_DIRECT_ROWS:
        return _m1_direct(A, delta, B, C, decay, rows, cols, mask)
    n_chunks = r // M1_DIRECT_ROWS

    @jax.checkpoint
    def chunk(args):
        rows_c, mask_c = args
        return _m1_direct(A, delta, B, C, decay, rows_c, cols, mask_c)

    parts = jax.lax.map(chunk, (rows.reshape(n_chunks, -1), mask.reshape(n_chunks, -1, mask.shape[1])))
    parts = jnp.moveaxis(parts, 0, 1)  # (b, n_chunks, chunk, q, e)
    return parts.reshape(parts.shape[0], r, *parts.shape[3:])


def _m1_direct(A, delta, B, C, decay, rows, cols, mask):
    """Mamba-1 sum_n C_i[n] B_t[n] exp(A[e, n] (S_i - S_t)[e]), exactly 0 above the diagonal (the
    segment is zeroed there before exp, so nothing overflows and gradients stay finite): (b, r, q, e),
    r q e n exponentials in n fused passes over the (b, r, q, e) block (no (.., e, n) tensor)."""
    keep = mask[None, :, :, None]
    seg = jnp.where(keep, segment_sum(decay, rows, cols), 0.0)  # (b, r, q, e)
    cb = C[:, rows][:, :, None, :] * B[:, cols][:, None, :, :]  # (b, r, q, n)
    acc = 0.0
    for q in range(A.shape[1]):
        acc = acc + cb[..., q, None] * jnp.exp(A[:, q] * seg)
    return jnp.where(keep, acc, 0.0)


def m1_far_factors(A, delta, B, C, decay, rows, cols):
    """The two factors of the Mamba-1 hidden attention through the reference r = min(rows):

        P[i, e, n] = C_i[n] exp(A[e, n] (S_i - S_r)[e])                (b, r, e, n)
        Q[t, e, n] = B_t[n] Delta_t[e] exp(A[e, n] (S_r - S_t)[e])     (b, q, e, n)

    so that sum_n P[i, e, n] Q[t, e, n] = M_{i,t}[e] without D for every source t <= r (both
    exponentials <= 1); ``cols`` must lie inside the sequence. Both exponents are clamped at 0: a
    source after r gets a finite factor that no caller uses (its tile takes the direct form), never
    an overflow whose gradient would be NaN."""
    ref = jnp.min(rows)[None]
    to_i = jnp.maximum(segment_sum(decay, rows, ref)[:, :, 0], 0.0)  # (b, r, e): S_i - S_r
    from_t = jnp.maximum(segment_sum(decay, ref, cols)[:, 0], 0.0)  # (b, q, e): S_r - S_t
    P = C[:, rows].astype(f32)[:, :, None, :] * jnp.exp(A[None, None] * to_i[..., None])
    B_dt = B[:, cols].astype(f32)[:, :, None, :] * delta[:, cols].astype(f32)[..., None]  # (b, q, e, n)
    Q = B_dt * jnp.exp(A[None, None] * from_t[..., None])
    return P, Q


def _m1_product(P, Q):
    """M[i, t, e] = sum_n P[i, e, n] Q[t, e, n]: a (r x n)(n x q) product per channel, from (r + q) e n
    exponentials instead of the direct form's r q e n."""
    return jnp.einsum("bren,bqen->brqe", P, Q)


def full_hidden_attention(version, A, D, delta, B, C, *, with_D=True):
    """The whole (b, l, l, c) hidden attention (small inputs only)."""
    length = delta.shape[1]
    idx = jnp.arange(length)
    return hidden_attention_block(
        version, A, D, delta, B, C, compensated_cumsum(delta), idx, idx, with_D=with_D
    )
