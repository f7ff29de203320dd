"""Tile bodies of the fused LaTIM score kernel (kernels/fused_scores.py holds the block sizes, the
drivers that call these through pallas_call, the custom_jvp and the reference; its docstring states
the maths and the two layouts).

Every function here runs inside a kernel on one (target block ti) x (source block tj) x (d tile) tile.
Glossary: ti/tj tile rows/columns, dt d tile, ec e chunk, n state size, p head dim, k conv taps (K).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from latim_jax.kernels import f32
from latim_jax.kernels.decay import m1_entry, m2_entry, with_skip


def _dot(a, b, precision):  # (m, k) (k, n) -> (m, n)
    return jnp.dot(a, b, precision=precision, preferred_element_type=f32)


def _dot_nt(a, b, precision):  # (m, k) (n, k) -> (m, n)
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=f32)


# --------------------------------------------------------------------------------------------------
# Shared tile math
# --------------------------------------------------------------------------------------------------


def alti_gain(a, t):
    """|a| - |a - t| elementwise, without cancellation: where a and a - t share a sign it is exactly
    sign(a) * t (so t = 0 gives exactly 0); elsewhere |a| <= |t| and the result is accurate to
    rounding relative to |t|. ALTI's raw score is max(0, sum_d alti_gain(hout_i, T'_ij))
    = max(0, ||hout_i||_1 - ||hout_i - T'_ij||_1), accurate relative to ||T'_ij||_1 rather than to
    ||hout_i||_1. Computed as :func:`alti_gain_signed` (sign(a), 2|a|, t)."""
    return alti_gain_signed(jnp.where(a >= 0, 1.0, -1.0), 2.0 * jnp.abs(a), t)


def alti_gain_signed(s, two_abs_a, t):
    """:func:`alti_gain` from s = sign(a) (1 at a = 0) and 2|a|: with u = s t,

        |a| - |a - t| = min(u, 2|a| - u)

    (a >= 0: t when t <= a, else 2a - t; a < 0 mirrored). Where a and a - t share a sign, u <=
    2|a| - u holds exactly, so the min returns u = s t exactly. No compare or select touches t: XLA:CPU
    fuses this form (products, a difference, a min) into the projection's epilogue like the l1 norm,
    while the select form made it materialise the (rows, cols, e) values first (one 130m Mamba-2
    tile: ~100 -> ~65 ms). The scores pass s and 2|a| per target row, computed once."""
    u = s * t
    return jnp.minimum(u, two_abs_a - u)


def _reduce_d(method, T, x, axis):
    """Partial score over a d tile: T the contributions; alti: x = (hout_i, [i=j] h_i) and the partial
    sum of alti_gain(hout_i, T + [i=j] h_i)."""
    if method == "l2":
        return jnp.sum(T * T, axis=axis)
    if method == "l1":
        return jnp.sum(jnp.abs(T), axis=axis)
    if method == "alti":
        hout, diag_h = x
        return jnp.sum(alti_gain(hout, T + diag_h), axis=axis)
    return jnp.sum(T, axis=axis)  # logit: W_out is a ones column, G carries q


def _pick_lane(x, i):
    """Column i of x (m, c) as (m, 1), by a one-hot lane reduction (no unaligned or dynamic slice)."""
    lane = lax.broadcasted_iota(jnp.int32, x.shape, 1)
    return jnp.sum(jnp.where(lane == i, x, 0), axis=1, keepdims=True)


def _pick_sublane(x, i):
    """Row i of x (c, m) as (1, m), by a one-hot sublane reduction."""
    sub = lax.broadcasted_iota(jnp.int32, x.shape, 0)
    return jnp.sum(jnp.where(sub == i, x, 0), axis=0, keepdims=True)


def _loop(n: int, body, init):
    """fori_loop over range(n) with an int32 index (also under jax_enable_x64: Mosaic has no int64)."""
    return lax.fori_loop(jnp.int32(0), jnp.int32(n), body, init)


# --------------------------------------------------------------------------------------------------
# TPU kernels: grid (b, i-blocks, j-blocks, d-tiles, e-chunks); e-chunks "arbitrary", acc in VMEM.
# Per row i (fori_loop): X (ec, tj) = sum_k M_k * a_k^T and acc[i] += (W^T * G_i) @ X; at the last
# e-chunk each row is reduced over d (sublanes) into a (1, tj) lane row of the (ti, tj) output.
# --------------------------------------------------------------------------------------------------


def _tpu_epilogue(method, acc_ref, hout_ref, rows, jpos, out_ref):
    """Reduce acc (ti, dt, tj) over d into out (ti, tj), one row per fori_loop step."""
    ti, tj = out_ref.shape
    sub = lax.broadcasted_iota(jnp.int32, (ti, tj), 0)

    if method == "alti":
        hout_t, h_t = hout_ref[0].T, hout_ref[1].T  # (dt, ti): rows to lanes, once per tile

    def row(i, out):
        x = None
        if method == "alti":
            h_i = _pick_lane(h_t, i)  # (dt, 1)
            x = (_pick_lane(hout_t, i), jnp.where(jpos == _pick_lane(rows, i), h_i, 0.0))  # (dt, 1), (dt, tj)
        part = _reduce_d(method, acc_ref[i], x, axis=0)[None, :]  # (1, tj)
        return jnp.where(sub == i, part, out)

    out_ref[...] = _loop(ti, row, jnp.zeros((ti, tj), f32))


def _tpu_tile(method, tmax_ref, rows_ref, rest, accumulate):
    """The frame of a TPU tile: zero the accumulator at the first e-chunk, run
    ``accumulate(rows, jpos, acc_ref)`` unless the tile lies above the diagonal (the bound is
    scalar-prefetched per target block), reduce over d at the last e-chunk."""
    out_ref, acc_ref = rest[-2], rest[-1]
    hout_ref = rest[0] if method == "alti" else None
    tj = out_ref.shape[1]
    ic, jc, ec = pl.program_id(1), pl.program_id(2), pl.program_id(4)
    j0 = jc * tj
    jpos = (j0 + lax.broadcasted_iota(jnp.int32, (1, tj), 1)).astype(f32)  # float positions: exact < 2^24
    rows = rows_ref[...]  # (1, ti)

    @pl.when(ec == 0)
    def _():
        acc_ref[...] = jnp.zeros(acc_ref.shape, f32)

    @pl.when(j0 <= tmax_ref[ic])
    def _():
        accumulate(rows, jpos, acc_ref)

    @pl.when(ec == pl.num_programs(4) - 1)
    def _():
        _tpu_epilogue(method, acc_ref, hout_ref, rows, jpos, out_ref)


def _m2_kernel_tpu(
    tmax_ref, rows_ref, a_ref, w_ref, g_ref, src_ref, tgt_ref, ad_ref, c_ref, b_ref, *rest, cfg
):
    """Mamba-2 TPU tile. Blocks: rows (1, ti) positions (f32); a (K, ec, tj); w = W_out^T (dt, ec);
    g (ti, ec); src (hc, 3, K, tj) = shifted [Delta, hi, lo] per head; tgt (hc, 2, ti) = [hi, lo] of
    the targets; ad (hc, 2, 1) = [A, D]; c (g, ti, n); b (g, K, n, tj) shifted B; [hout (2, ti, dt)];
    out (ti, tj); scratch acc (ti, dt, tj)."""
    method, K, hc, p, rep, prec = cfg
    ti, tj = rest[-2].shape
    ec = pl.program_id(4)

    def accumulate(rows, jpos, acc_ref):
        heads = []
        for hh in range(hc):
            grp = lax.div(ec * hc + hh, jnp.int32(rep))
            C = c_ref[grp]  # (ti, n)
            cb = [_dot(C, b_ref[grp, k], prec) for k in range(K)]  # (ti, tj): C_i . B_{j+k}
            heads.append((cb, ad_ref[hh, 0:1, :], ad_ref[hh, 1:2, :], tgt_ref[hh]))
        g = g_ref[...]

        def row(i, carry):
            r_i = _pick_lane(rows, i)  # (1, 1)
            X = jnp.zeros(a_ref.shape[1:], f32)  # (ec, tj)
            for k in range(K):
                mask, diag = jpos + k <= r_i, jpos + k == r_i  # (1, tj)
                pieces = []
                for hh, (cb, A, D, tgt) in enumerate(heads):
                    hl = _pick_lane(tgt, i)  # (2, 1)
                    seg = (hl[0:1] - src_ref[hh, 1, k : k + 1, :]) + (hl[1:2] - src_ref[hh, 2, k : k + 1, :])
                    m = m2_entry(_pick_sublane(cb[k], i), A, seg, src_ref[hh, 0, k : k + 1, :], mask)
                    m = with_skip(m, diag, D)  # (1, tj)
                    pieces.append(jnp.broadcast_to(m, (p, tj)))
                M = pieces[0] if hc == 1 else jnp.concatenate(pieces, axis=0)  # (ec, tj), per channel
                X = X + M * a_ref[k]
            acc_ref[i] += _dot(w_ref[...] * _pick_sublane(g, i), X, prec)  # (dt, tj): W^T scaled by G_i
            return carry

        _loop(ti, row, 0)

    _tpu_tile(method, tmax_ref, rows_ref, rest, accumulate)


def _m1_kernel_tpu(
    tmax_ref, rows_ref, a_ref, w_ref, g_ref, src_ref, tgt_ref, ad_ref, c_ref, b_ref, *rest, cfg
):
    """Mamba-1 TPU tile. Blocks: rows (1, ti); a (K, ec, tj); w (dt, ec); g (ti, ec); src (3, K, ec, tj)
    = shifted [Delta, hi, lo] per channel; tgt (2, ec, ti); ad (ec, n + 1) = [A | D]; c (n, ti);
    b (K, n, tj) shifted B; [hout (2, ti, dt)]; out (ti, tj); scratch acc (ti, dt, tj)."""
    method, K, n, prec = cfg
    ti = rest[-2].shape[0]

    def accumulate(rows, jpos, acc_ref):
        ad = ad_ref[...]
        A_cols = [_pick_lane(ad, q) for q in range(n)]  # n x (ec, 1)
        D = _pick_lane(ad, n)
        g, c, tgt_hi, tgt_lo = g_ref[...], c_ref[...], tgt_ref[0], tgt_ref[1]

        def row(i, carry):
            r_i = _pick_lane(rows, i)
            hi, lo, C = _pick_lane(tgt_hi, i), _pick_lane(tgt_lo, i), _pick_lane(c, i)  # (ec,1),(ec,1),(n,1)
            X = jnp.zeros(a_ref.shape[1:], f32)
            for k in range(K):
                mask, diag = jpos + k <= r_i, jpos + k == r_i
                seg = (hi - src_ref[1, k]) + (lo - src_ref[2, k])  # (ec, tj)
                cb = C * b_ref[k]  # (n, tj): C_i[n] B_{j+k}[n]
                M = m1_entry([cb[q : q + 1] for q in range(n)], A_cols, seg, src_ref[0, k], mask)
                M = with_skip(M, diag, D)
                X = X + M * a_ref[k]
            acc_ref[i] += _dot(w_ref[...] * _pick_sublane(g, i), X, prec)
            return carry

        _loop(ti, row, 0)

    _tpu_tile(method, tmax_ref, rows_ref, rest, accumulate)


# --------------------------------------------------------------------------------------------------
# GPU (Triton) kernels: grid (b, i-blocks, j-blocks, d-tiles), all parallel, no scratch. A fori_loop
# over heads / channel chunks: X (ti, tj, c) = sum_k M_k a_k, acc (ti*tj, dt) += (G X) @ W_out.
# --------------------------------------------------------------------------------------------------


def _gpu_store(method, acc, hout_ref, rcol, jpos, out_ref):
    ti, tj = out_ref.shape
    T = acc.reshape(ti, tj, acc.shape[-1])
    x = None
    if method == "alti":
        diag = (jpos == rcol)[:, :, None]
        x = (
            hout_ref[0][:, None, :],
            jnp.where(diag, hout_ref[1][:, None, :], 0.0),
        )  # (ti, 1, dt), (ti, tj, dt)
    out_ref[...] = _reduce_d(method, T, x, axis=-1)


def _gpu_tile(method, rows_ref, rest, accumulate):
    """The frame of a GPU tile: target rows rcol (ti, 1) and source positions jpos (1, tj) of this
    program; a tile entirely above the diagonal writes zeros, any other stores the d-reduction of
    ``accumulate(rcol, jpos)`` -> (ti * tj, dt) contributions."""
    out_ref = rest[-1]
    hout_ref = rest[0] if method == "alti" else None
    tj = out_ref.shape[1]
    j0 = pl.program_id(2) * tj
    rows = rows_ref[...]
    rcol = rows[:, None]  # (ti, 1)
    jpos = j0 + lax.broadcasted_iota(jnp.int32, (1, tj), 1)
    live = j0 <= jnp.max(rows)

    @pl.when(live)
    def _():
        _gpu_store(method, accumulate(rcol, jpos), hout_ref, rcol, jpos, out_ref)

    @pl.when(jnp.logical_not(live))
    def _():
        out_ref[...] = jnp.zeros(out_ref.shape, f32)


def _m2_kernel_gpu(rows_ref, a_ref, w_ref, g_ref, src_ref, tgt_ref, ad_ref, c_ref, b_ref, *rest, cfg):
    """Mamba-2 GPU tile. Blocks: rows (ti,) int32; a (K, tj, e); w = W_out (e, dt); g (ti, e);
    src (3, K, h, tj) shifted [Delta, hi, lo]; tgt (2, ti, h); ad (2, h) = [A; D]; c (g, ti, n);
    b (g, K, tj, n) shifted B; [hout (2, ti, dt)]; out (ti, tj)."""
    method, K, heads, p, rep, prec = cfg
    ti, tj = rest[-1].shape
    dt = w_ref.shape[-1]

    def accumulate(rcol, jpos):
        def head(hd, acc):
            grp = lax.div(hd, jnp.int32(rep))
            C = c_ref[grp]  # (ti, n)
            one = pl.ds(hd, 1)
            A, D = ad_ref[0:1, one], ad_ref[1:2, one]  # (1, 1)
            hi, lo = tgt_ref[0, :, one], tgt_ref[1, :, one]  # (ti, 1)
            ch = pl.ds(pl.multiple_of(hd * p, p), p)
            X = jnp.zeros((ti, tj, p), f32)
            for k in range(K):
                mask, diag = jpos + k <= rcol, jpos + k == rcol  # (ti, tj)
                seg = (hi - src_ref[1, k, one, :]) + (lo - src_ref[2, k, one, :])  # (ti, tj)
                m = m2_entry(_dot_nt(C, b_ref[grp, k], prec), A, seg, src_ref[0, k, one, :], mask)
                m = with_skip(m, diag, D)
                X = X + m[:, :, None] * a_ref[k, :, ch][None]
            V = X * g_ref[:, ch][:, None, :]  # (ti, tj, p)
            return acc + _dot(V.reshape(ti * tj, p), w_ref[ch, :], prec)

        return _loop(heads, head, jnp.zeros((ti * tj, dt), f32))

    _gpu_tile(method, rows_ref, rest, accumulate)


def _m1_kernel_gpu(rows_ref, a_ref, w_ref, g_ref, src_ref, tgt_ref, ad_ref, c_ref, b_ref, *rest, cfg):
    """Mamba-1 GPU tile. Blocks: rows (ti,); a (K, tj, e); w (e, dt); g (ti, e); src (3, K, tj, e)
    shifted [Delta, hi, lo]; tgt (2, ti, e); ad (n + 1, e) = [A^T; D]; c (ti, n); b (K, n, tj) shifted
    B; [hout (2, ti, dt)]; out (ti, tj). Channel chunks of ec (a power of two)."""
    method, K, n, ec, n_chunks, prec = cfg
    ti, tj = rest[-1].shape
    dt = w_ref.shape[-1]

    def accumulate(rcol, jpos):
        def chunk(cc, acc):
            ch = pl.ds(pl.multiple_of(cc * ec, ec), ec)
            hi, lo = tgt_ref[0, :, ch][:, None, :], tgt_ref[1, :, ch][:, None, :]  # (ti, 1, ec)
            D = ad_ref[pl.ds(n, 1), ch][None]  # (1, 1, ec)
            X = jnp.zeros((ti, tj, ec), f32)
            for k in range(K):
                mask = (jpos + k <= rcol)[:, :, None]  # (ti, tj, 1)
                diag = (jpos + k == rcol)[:, :, None]
                seg = (hi - src_ref[1, k, :, ch][None]) + (lo - src_ref[2, k, :, ch][None])  # (ti, tj, ec)
                cbs = [(c_ref[:, pl.ds(q, 1)] * b_ref[k, pl.ds(q, 1), :])[:, :, None] for q in range(n)]
                As = [ad_ref[pl.ds(q, 1), ch][None] for q in range(n)]  # n x (1, 1, ec)
                M = with_skip(m1_entry(cbs, As, seg, src_ref[0, k, :, ch][None], mask), diag, D)
                X = X + M * a_ref[k, :, ch][None]
            V = X * g_ref[:, ch][:, None, :]
            return acc + _dot(V.reshape(ti * tj, ec), w_ref[ch, :], prec)

        return _loop(n_chunks, chunk, jnp.zeros((ti * tj, dt), f32))

    _gpu_tile(method, rows_ref, rest, accumulate)
