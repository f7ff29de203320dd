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
transform of each chunk (the algebra of transformers' ``torch_chunk_gated_delta_rule``);
:func:`tile_factors` reads the same algebra with one-hot values as four per-chunk matrices (built once
per layer: l (C + 2 k + k^2 / C) floats per head), from which :func:`m_tile` computes M[rows, c0 : c0 + w]
with a few small matmuls per chunk between the tile's columns and its last row (l / C sequential steps,
not l), never an l x l x k or l x l x k x v tensor.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.scipy.linalg import solve_triangular

from latim_jax.kernels import f32


def l2_normalise(x, eps: float = 1e-6):
    """x * rsqrt(sum(x^2) + eps) over the last axis, in fp32 (the FLA / transformers l2norm)."""
    x = x.astype(f32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def invert_unit_lower(U):
    """U^-1 for unit lower-triangular U (..., C, C), by block doubling in log2(C) batched matmuls.

    The inverse of [[A, 0], [L, B]] is [[A^-1, 0], [-B^-1 L A^-1, B^-1]]: starting from the 1 x 1
    diagonal blocks (each 1), each level joins neighbouring blocks of size s into blocks of size 2 s.
    C is padded to a power of two with an identity block (whose inverse is itself). Only U's strictly
    lower part is read (its diagonal is taken as 1), so the gradient reaches that part alone."""
    U = jnp.asarray(U)
    if U.ndim < 2 or U.shape[-1] != U.shape[-2] or U.shape[-1] == 0:
        raise ValueError(f"invert_unit_lower: U must be (..., C, C) with C >= 1, found shape {U.shape}")
    if not jnp.issubdtype(U.dtype, jnp.floating):
        raise ValueError(f"invert_unit_lower: U must be floating point, found {U.dtype}")
    C = U.shape[-1]
    P = 1 << max(C - 1, 0).bit_length()
    lead = U.shape[:-2]
    if P != C:
        U = jnp.pad(U, [(0, 0)] * len(lead) + [(0, P - C), (0, P - C)])
    X = jnp.ones(lead + (P, 1, 1), U.dtype)  # the diagonal blocks' inverses, (..., P / s, s, s)
    s = 1
    while s < P:
        n = P // (2 * s)
        blocks = U.reshape(lead + (n, 2, s, n, 2, s))[..., :, 1, :, :, 0, :]  # (..., n, s, n, s)
        L = jnp.moveaxis(jnp.diagonal(blocks, axis1=-4, axis2=-2), -1, -3)  # (..., n, s, s)
        A, B = X[..., 0::2, :, :], X[..., 1::2, :, :]
        low = -jnp.matmul(B, jnp.matmul(L, A, precision="highest"), precision="highest")
        top = jnp.concatenate([A, jnp.zeros_like(A)], -1)
        X = jnp.concatenate([top, jnp.concatenate([low, B], -1)], -2)
        s *= 2
    return X[..., 0, :C, :C]


def _inverse_solve(U, B):
    """U^-1 B through :func:`invert_unit_lower` and one matmul (XLA ops only)."""
    return jnp.matmul(invert_unit_lower(U), B, precision="highest")


def solve_unit_lower(U, B):
    """U^-1 B for unit lower-triangular U (..., C, C) and B (..., C, d).

    On CPU this is :func:`invert_unit_lower` and a matmul, not LAPACK: jaxlib's CPU triangular solve (a
    LAPACK trsm custom call) intermittently never completes inside these programs (a deadlock in XLA:CPU's
    runtime, seen in training steps and the tile benchmarks with jax 0.10.2, about one run in three of a
    batch-16 training step). The block inverse replaced a row-by-row forward substitution (a 64-step
    loop) whose gradient stored a copy of the solution per step: a (8, 16, 4, 64, 64) solve's gradient
    took 939 ms that way and 86 ms this way (LAPACK's: 2757 ms, on 2 busy cores). Elsewhere it is the
    backend's triangular solve (cuBLAS on GPU, XLA's own on TPU)."""
    U, B = jnp.asarray(U), jnp.asarray(B)
    if U.ndim < 2 or U.shape[-1] != U.shape[-2] or B.ndim < 2 or B.shape[-2] != U.shape[-1]:
        raise ValueError(
            f"solve_unit_lower: U must be (..., C, C) and B (..., C, d), found {U.shape} and {B.shape}"
        )
    return jax.lax.platform_dependent(
        U, B, cpu=_inverse_solve,
        default=lambda U, B: solve_triangular(U, B, lower=True, unit_diagonal=True),
    )  # fmt: skip


def _chunk_algebra(q, k, g, beta, chunk: int):
    """The per-chunk UT-transform quantities both :func:`chunked` and :func:`tile_factors` build on: q, k
    (b, l, H, k), g (b, l, H) or (b, l, H, k), beta (b, l, H) -> a dict of chunk-major arrays (n, b, H,
    ...): beta (C,), gamma (C, c) (c = k, or 1 for a decay per head), U (C, C), Kd (C, k), intra (C, C),
    q_in, k_out (C, k), with l zero-padded to n C (beta 0, g 0 there: an identity step)."""
    b, length, H, dk = k.shape
    C = int(chunk)
    per_channel = g.ndim == 4
    if not per_channel:
        g = g[..., None]  # one channel, broadcast over k
    pad = (-length) % C
    if pad:  # zero-padded positions: beta 0, g 0, an identity step
        q, k, g = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (q, k, g))
        beta = jnp.pad(beta, ((0, 0), (0, pad), (0, 0)))
    n = (length + pad) // C

    def chunks(x):  # (b, l, H, ...) -> (n, b, H, C, ...)
        x = x.reshape(b, n, C, H, *x.shape[3:])
        return jnp.moveaxis(jnp.moveaxis(x, 3, 2), 1, 0)

    q, k, g, beta = (chunks(x.astype(f32)) for x in (q, k, g, beta))
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
    Kd = solve_unit_lower(U, beta[..., None] * k * jnp.exp(gamma))
    return dict(
        beta=beta, gamma=gamma, U=U, Kd=Kd, intra=intra, q_in=q * jnp.exp(gamma),
        k_out=k * jnp.exp(gamma[..., -1:, :] - gamma),
    )  # fmt: skip


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
    x = _chunk_algebra(q, k, g, beta, C)
    n = x["U"].shape[0]
    v = jnp.pad(v.astype(f32), ((0, 0), (0, n * C - length), (0, 0), (0, 0)))
    v = jnp.moveaxis(jnp.moveaxis(v.reshape(b, n, C, H, dv), 3, 2), 1, 0)  # (n, b, H, C, v)
    W = solve_unit_lower(x["U"], x["beta"][..., None] * v)
    step_decay = jnp.exp(x["gamma"][..., -1, :])[..., :, None]  # (n, b, H, c, 1): rows of the state

    def body(S, xs):
        W_c, Kd_c, intra_c, q_c, k_c, d_c = xs
        u = W_c - jnp.einsum("bhck,bhkv->bhcv", Kd_c, S)
        o = jnp.einsum("bhck,bhkv->bhcv", q_c, S) + jnp.einsum("bhij,bhjv->bhiv", intra_c, u)
        S = S * d_c + jnp.einsum("bhck,bhcv->bhkv", k_c, u)
        return S, o

    S0 = jnp.zeros((b, H, dk, dv), f32) if state is None else state.astype(f32)
    S, o = jax.lax.scan(body, S0, (W, x["Kd"], x["intra"], x["q_in"], x["k_out"], step_decay))
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


class TileFactors(NamedTuple):
    """What :func:`m_tile` reads, built once per layer by :func:`tile_factors`: per chunk n of C positions
    and head, batch first (b, n, H, ...) like every factor (the score stage splits the batch axis):

        local    (b, n, H, C, C)  M inside the chunk: intra U^-1 Diag(beta), lower triangular
        inject   (b, n, H, k, C)  the state at the chunk's end from a one-hot value at each position:
                                  k_out^T U^-1 Diag(beta)
        readout  (b, n, H, C, k)  what each position reads of the state entering the chunk:
                                  q_in - intra Kd
        carry    (b, n, H, k, k)  the state across the chunk: Diag(e^{gamma_C}) - k_out^T Kd

    (the notation of :func:`chunked`). Memory: l (C + 2 k + k^2 / C) floats per head and prompt."""

    local: jax.Array
    inject: jax.Array
    readout: jax.Array
    carry: jax.Array


def tile_factors(q, k, g, beta, chunk: int) -> TileFactors:
    """The per-chunk quantities of M (:class:`TileFactors`) for q, k (b, l, H, k), g (b, l, H) or (b, l,
    H, k), beta (b, l, H) fp32, in chunks of ``chunk`` positions (l zero-padded to a multiple: identity
    steps, whose columns of M are 0).

    From :func:`chunked`'s algebra with one-hot values: a chunk's output from the state S entering it and
    its own values V is o = (q_in - intra Kd) S + intra U^-1 Diag(beta) V and the state leaving it S' =
    (Diag(e^{gamma_C}) - k_out^T Kd) S + k_out^T U^-1 Diag(beta) V, which names the four factors. The
    transient memory is :func:`chunked`'s: (C, C) per position and head ((C, C, k) with a decay per
    key channel)."""
    C = int(chunk)
    x = _chunk_algebra(q, k, g, beta, C)
    eye = jnp.broadcast_to(jnp.eye(C, dtype=f32), x["U"].shape)
    U_beta = solve_unit_lower(x["U"], eye) * x["beta"][..., None, :]
    local = jnp.einsum("nbhij,nbhja->nbhia", x["intra"], U_beta)
    inject = jnp.einsum("nbhck,nbhca->nbhka", x["k_out"], U_beta)
    readout = x["q_in"] - jnp.einsum("nbhij,nbhjk->nbhik", x["intra"], x["Kd"])
    decay = jnp.exp(x["gamma"][..., -1, :])[..., :, None]  # (n, b, H, c, 1), c = k or 1
    dk = k.shape[-1]
    carry = decay * jnp.eye(dk, dtype=f32) - jnp.einsum("nbhck,nbhcm->nbhkm", x["k_out"], x["Kd"])
    return TileFactors(*(jnp.moveaxis(y, 0, 1) for y in (local, inject, readout, carry)))


def m_tile(factors: TileFactors, rows, c0, width: int):
    """M[rows, c0 : c0 + width] per head, (b, H, r, width), from the layer's :class:`TileFactors`:
    ``rows`` (r,) int target positions in any order (repeats allowed), ``c0`` the first source column
    (a traced int is fine; columns past the end are 0).

    For a target t in chunk I (local index i) and a source j in chunk J (local index a):

        M[t, j] = local_I[i, a]                                            (I = J)
                = readout_I[i] carry_{I-1} ... carry_{J+1} inject_J[:, a]  (J < I),  0 for J > I

    One fixed-length scan over the n chunks carries Y (b, H, k, width), the state that the tile's
    columns have put in: chunk I's rows read readout_I[rows] Y (plus their local block), then Y <-
    carry_I Y + inject_I[:, the columns in chunk I]. Chunks before the first column's or after the last
    row's are skipped (a ``lax.cond``, so the scan stays reverse-differentiable), as is the read of a
    chunk holding none of the rows: a tile costs O((k^2 + r k) width) per head and chunk between its
    columns and its last row, and holds Y, the tile and one chunk's factors: O(b H (k + r) width), not
    the l sequential one-token steps of running the recurrence over one-hot values. Differentiated, the
    scan keeps its per-chunk residuals for the backward pass (Y and the chunk's factors of each step:
    O(n b H k (k + width)) for the one tile being differentiated)."""
    b, n, H, C, _ = factors.local.shape
    dk = factors.carry.shape[-1]
    rows = jnp.asarray(rows, jnp.int32)
    cols = c0 + jnp.arange(width)
    col_chunk, col_at = cols // C, cols % C
    row_chunk, row_at = rows // C, rows % C
    first, last = c0 // C, jnp.max(row_chunk)
    xs = (jnp.arange(n),) + tuple(jnp.moveaxis(x, 1, 0) for x in factors)  # chunk-major: (n, b, H, ...)

    def read(i, loc, rd, Y, out):  # the rows in chunk i: what they read of Y, plus their local block
        got = jnp.einsum("bhrk,bhkw->bhrw", jnp.take(rd, row_at, axis=2), Y)
        block = jnp.take(jnp.take(loc, row_at, axis=2), col_at, axis=3)  # (b, H, r, width)
        got = got + jnp.where((col_chunk == i)[None, :], block, 0.0)
        return jnp.where((row_chunk == i)[:, None], got, out)

    def active(Y, out, x):
        i, loc, inj, rd, P = x
        out = jax.lax.cond(jnp.any(row_chunk == i), read, lambda i, loc, rd, Y, out: out, i, loc, rd, Y, out)
        put = jnp.where((col_chunk == i)[None, None, None, :], jnp.take(inj, col_at, axis=3), 0.0)
        return jnp.einsum("bhkm,bhmw->bhkw", P, Y) + put, out

    def body(carry, x):
        i = x[0]
        on = (i >= first) & (i <= last)
        return jax.lax.cond(on, active, lambda Y, out, x: (Y, out), *carry, x), None

    Y0 = jnp.zeros((b, H, dk, width), f32)
    out0 = jnp.zeros((b, H, rows.shape[0], width), f32)
    (_, out), _ = jax.lax.scan(body, (Y0, out0), xs)
    return out
