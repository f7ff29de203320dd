"""The gated delta rule (Gated DeltaNet: Qwen3-Next, Qwen3.5, OLMo-Hybrid) in pure jnp: the chunked forward,
the one-token step, and the hidden attention M of the values, tile by tile.

Shape letters: b batch, l length, H value heads (the key heads already repeated to them), k key dim,
v value dim, C chunk, r target rows, w source columns.

Per head, with q_t, k_t (k,) (L2-normalised; q scaled by k^-1/2), v_t (v,), decay g_t <= 0 and rate beta_t:

    S_t = A_t S_{t-1} + beta_t k_t v_t^T,   A_t = (I - beta_t k_t k_t^T) D_t,   o_t = S_t^T q_t

with D_t = e^{g_t} I for Gated DeltaNet's one decay per head (g (b, l, H)), or Diag(e^{g_t}) for Kimi's
KDA, a decay per key channel (g (b, l, H, k)): every function here takes either.

so with q, k, g, beta held at their forward values the output is linear in the values:

    o_t = sum_{j <= t} M[t, j] v_j,   M[t, j] = beta_j q_t^T A_t A_{t-1} ... A_{j+1} k_j   (0 for j > t)

one scalar per head and pair, as Mamba-2's SSD has. :func:`chunked` computes o with the UT
transform of each chunk (the algebra of transformers' ``torch_chunk_gated_delta_rule``); :func:`m_tile`
computes M[rows, c0 : c0 + w] by running the same recurrence over one-hot values of the w columns,
never an l x l x k or l x l x k x v tensor.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.scipy.linalg import solve_triangular

from latim_jax.kernels import f32


def l2_normalise(x, eps: float = 1e-6):
    """x * rsqrt(sum(x^2) + eps) over the last axis, in fp32 (the FLA / transformers l2norm)."""
    x = x.astype(f32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def chunked(q, k, v, g, beta, chunk: int, state=None):
    """The gated delta rule over a sequence, chunk by chunk: q, k (b, l, H, k), v (b, l, H, v), beta
    (b, l, H), g (b, l, H) (one decay per head) or (b, l, H, k) (one per key channel), all fp32, q
    already scaled; ``state`` (b, H, k, v) or None for zeros. Returns o (b, l, H, v) and the final state.

    Within a chunk of C positions with cumulative decay gamma (gamma_r = sum_{s <= r} g_s, per channel
    c when g has one) and E_ijc = e^{gamma_ic - gamma_jc} for i >= j (0 above):
    U = I + strictly_lower(beta_i sum_c k_ic k_jc E_ijc), W = U^-1 (beta v), Kd = U^-1 (beta k e^gamma);
    then per chunk, from the state S entering it, u = W - Kd S, o = (q e^gamma) S + (sum_c q_ic k_jc
    E_ijc) u, S' = e^{gamma_C} S + (k e^{gamma_C - gamma})^T u. A per-channel decay holds E as (C, C, k)
    per head and chunk (choose a small chunk for it); a per-head one as (C, C).
    """
    b, length, H, dk = k.shape
    dv = v.shape[-1]
    C = int(chunk)
    per_channel = g.ndim == 4
    if not per_channel:
        g = g[..., None]  # one channel, broadcast over k
    pad = (-length) % C
    if pad:  # zero-padded positions: beta 0, g 0, an identity step
        q, k, v, g = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (q, k, v, g))
        beta = jnp.pad(beta, ((0, 0), (0, pad), (0, 0)))
    n = (length + pad) // C

    def chunks(x):  # (b, l, H, ...) -> (n, b, H, C, ...)
        x = x.reshape(b, n, C, H, *x.shape[3:])
        return jnp.moveaxis(jnp.moveaxis(x, 3, 2), 1, 0)

    q, k, v, g, beta = (chunks(x.astype(f32)) for x in (q, k, v, g, beta))
    gamma = jnp.cumsum(g, axis=-2)  # (n, b, H, C, c) with c = k or 1
    lower = jnp.tril(jnp.ones((C, C), bool))
    diff = jnp.where(lower[..., None], gamma[..., :, None, :] - gamma[..., None, :, :], -jnp.inf)
    E = jnp.exp(diff)  # (n, b, H, C, C, c)
    if per_channel:
        kk = jnp.einsum("nbhic,nbhjc,nbhijc->nbhij", k, k, E)
        intra = jnp.einsum("nbhic,nbhjc,nbhijc->nbhij", q, k, E)
    else:
        kk = jnp.einsum("nbhic,nbhjc->nbhij", k, k) * E[..., 0]
        intra = jnp.einsum("nbhic,nbhjc->nbhij", q, k) * E[..., 0]
    U = jnp.eye(C, dtype=f32) + jnp.where(jnp.tril(lower, -1), beta[..., :, None] * kk, 0.0)
    W = solve_triangular(U, beta[..., None] * v, lower=True, unit_diagonal=True)
    Kd = solve_triangular(U, beta[..., None] * k * jnp.exp(gamma), lower=True, unit_diagonal=True)
    q_in = q * jnp.exp(gamma)
    k_out = k * jnp.exp(gamma[..., -1:, :] - gamma)
    step_decay = jnp.exp(gamma[..., -1, :])[..., :, None]  # (n, b, H, c, 1): rows of the state

    def body(S, xs):
        W_c, Kd_c, intra_c, q_c, k_c, d_c = xs
        u = W_c - jnp.einsum("bhck,bhkv->bhcv", Kd_c, S)
        o = jnp.einsum("bhck,bhkv->bhcv", q_c, S) + jnp.einsum("bhij,bhjv->bhiv", intra_c, u)
        S = S * d_c + jnp.einsum("bhck,bhcv->bhkv", k_c, u)
        return S, o

    S0 = jnp.zeros((b, H, dk, dv), f32) if state is None else state.astype(f32)
    S, o = jax.lax.scan(body, S0, (W, Kd, intra, q_in, k_out, step_decay))
    o = jnp.moveaxis(o, 0, 2).reshape(b, H, n * C, dv)[:, :, :length]  # (n, b, H, C, v) -> (b, H, l, v)
    return jnp.moveaxis(o, 1, 2), S


def _row_decay(g_t):
    """e^{g_t} as a multiplier of the state's rows: (b, H, 1, 1) per head, (b, H, k, 1) per channel."""
    d = jnp.exp(g_t)
    return d[..., None] if d.ndim == 3 else d[..., None, None]


def step(S, q_t, k_t, v_t, g_t, beta_t):
    """One token of the recurrence: S (b, H, k, v), q_t, k_t (b, H, k), v_t (b, H, v), g_t (b, H) or
    (b, H, k), beta_t (b, H) -> (o_t (b, H, v), S_t): S_t = D_t S + beta_t k_t (v_t - (D_t S)^T k_t)^T,
    o_t = S_t^T q_t."""
    S = S * _row_decay(g_t)
    delta = (v_t - jnp.einsum("bhkv,bhk->bhv", S, k_t)) * beta_t[..., None]
    S = S + k_t[..., :, None] * delta[..., None, :]
    return jnp.einsum("bhkv,bhk->bhv", S, q_t), S


def m_tile(q, k, g, beta, rows, c0, width: int):
    """M[rows, c0 : c0 + width] per head, (b, H, r, width): q, k (b, l, H, k), beta (b, l, H), g (b, l, H)
    or (b, l, H, k) fp32;
    ``rows`` (r,) int target positions, ``c0`` the first source column (columns past the end are 0).

    The recurrence runs over one-hot values of the ``width`` columns: X_t = A_t X_{t-1} + beta_t k_t
    e_{t - c0}^T (k, width) from X = 0, and row t of the tile is q_t^T X_t, so M[t, j] is exactly
    beta_j q_t^T A_t ... A_{j+1} k_j and 0 above the diagonal. One pass over the l positions: O(l k
    width) per head, with the state and the tile as its only memory."""
    b, length, H, dk = k.shape
    cols = c0 + jnp.arange(width)
    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, g, beta)) + (jnp.arange(length),)

    def body(carry, x):
        X, out = carry
        q_t, k_t, g_t, beta_t, t = x
        X = X * _row_decay(g_t)  # A_t X = (I - beta_t k_t k_t^T) D_t X
        X = (
            X
            - k_t[..., :, None] * beta_t[..., None, None] * jnp.einsum("bhk,bhkw->bhw", k_t, X)[..., None, :]
        )
        X = X + (beta_t[..., None] * k_t)[..., None] * (cols == t)[None, None, None, :]
        row = jnp.einsum("bhk,bhkw->bhw", q_t, X)
        out = jnp.where((rows == t)[None, None, :, None], row[:, :, None, :], out)
        return (X, out), None

    X0 = jnp.zeros((b, H, dk, width), f32)
    out0 = jnp.zeros((b, H, rows.shape[0], width), f32)
    (_, out), _ = jax.lax.scan(body, (X0, out0), xs)
    return out
