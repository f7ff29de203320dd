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


def hidden_attention_block(version, A, D, delta, B, C, decay, rows, cols, *, with_D=True):
    """M_{i,t} for i in ``rows``, t in ``cols`` (index arrays; cols may run past the end: zero there).

    Mamba-1: A (e, n), D (e,), delta (b, l, e), B, C (b, l, n) -> (b, r, q, e).
    Mamba-2: A (h,), D (h,), delta (b, l, h), B, C (b, l, g, n) -> (b, r, q, h).
    """
    length = delta.shape[1]
    mask = causal_mask(rows, cols, length)  # (r, q)
    safe = jnp.minimum(cols, length - 1)
    seg = segment_sum(decay, rows, safe)  # (b, r, q, c)
    dt_t = delta[:, safe].astype(f32)  # (b, q, c)
    if version == 1:
        expo = jnp.where(mask[None, :, :, None, None], A[None, None, None] * seg[..., None], -jnp.inf)
        cb = C[:, rows][:, :, None, :] * B[:, safe][:, None, :, :]  # (b, r, q, n)
        M = jnp.einsum("brqn,brqen->brqe", cb, jnp.exp(expo)) * dt_t[:, None]
    else:
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


def full_hidden_attention(version, A, D, delta, B, C, *, with_D=True):
    """The whole (b, l, l, c) hidden attention (small inputs only)."""
    length = delta.shape[1]
    idx = jnp.arange(length)
    return hidden_attention_block(
        version, A, D, delta, B, C, compensated_cumsum(delta), idx, idx, with_D=with_D
    )
