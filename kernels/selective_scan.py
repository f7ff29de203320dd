"""Mamba-1 selective scan: Pallas forward and backward kernels (TPU and GPU variants), custom_vjp
wrapper, pure-jnp reference.

    state_t[e, n] = exp(delta_t[e] A[e, n]) state_{t-1}[e, n] + delta_t[e] B_t[n] u_t[e]
    y_t[e]        = sum_n C_t[n] state_t[e, n] + D[e] u_t[e]

Shapes (glossary: b batch, l length, e inner width, n state size): u, delta (b, l, e); A (e, n);
B, C (b, l, n); D (e,); state (b, e, n). All math in fp32; y and the final state come back in fp32
whatever the input dtype (every implementation returns the same pytree).

Order of this file: kernels, drivers, custom_vjp public function, references (last).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from latim_jax.kernels import vmem
from latim_jax.kernels.block_sizes import (
    Blocks,
    gpu_compiler_params,
    next_pow2,
    pad_axis,
    resolve_target,
    round_up,
    tpu_compiler_params,
)
from latim_jax.parallel.chips import check_chip

# --------------------------------------------------------------------------------------------------
# Kernels. All receive the recurrence inputs prepared by the driver, all fp32:
#   delta (l, e), du = delta * u (l, e), At = A^T (n, e), B/C, h0 = initial state^T (n, e).
# The forward kernels write y_ssm = sum_n C_t state_t (l, e) (the D u skip is added by the driver), the
# final state^T (n, e) and, when differentiating, the state entering every chunk of the sequence (the
# checkpoints the backward restarts from). The state is kept transposed, (n, e): channels on lanes, the
# n-sum over sublanes.
#
# Backward of one step (a_t = exp(delta_t A), state_t = a_t state_{t-1} + B_t du_t, y_t = C_t . state_t),
# with g the cotangent of state_t gathered from every later step:
#   g         += C_t dy_t                    (the read of state_t by y_t)
#   dC_t[n]    = sum_e dy_t[e] state_t[n, e]
#   ddu_t[e]   = sum_n g[n, e] B_t[n]         dB_t[n] = sum_e g[n, e] du_t[e]
#   ga         = g state_{t-1} a_t            (the cotangent of delta_t A, elementwise)
#   ddelta_t[e] = sum_n ga[n, e] A[e, n]      dA[e, n] += ga[n, e] delta_t[e]
#   g          <- g a_t                       (the cotangent of state_{t-1})
# --------------------------------------------------------------------------------------------------


def _scan_kernel_tpu(delta_ref, du_ref, At_ref, Bt_ref, Ct_ref, h0_ref, y_ref, hT_ref, *rest):
    """TPU tile: grid (b, e-blocks, l-chunks), l-chunks last and "arbitrary".

    Blocks: delta/du/y (tl, te); At/h0/hT (n, te); Bt/Ct = B^T/C^T (n, tl); ``rest`` = ([hs_ref,] h_scr):
    the optional checkpoint block hs (n, te) (the state entering this chunk) and the scratch h_scr
    (n, te) carrying the state from one chunk to the next. Inside a chunk a fori_loop over the tl time
    steps reads row t of delta/du and column t of B^T/C^T (selected by a lane mask and a lane sum: no
    dynamic lane indexing), and writes row t of y. The final state is written on the last chunk.
    """
    *hs_ref, h_scr = rest
    chunk = pl.program_id(2)

    @pl.when(chunk == 0)
    def _():
        h_scr[...] = h0_ref[...]

    if hs_ref:
        hs_ref[0][...] = h_scr[...]
    At, Bt, Ct = At_ref[...], Bt_ref[...], Ct_ref[...]
    lane = lax.broadcasted_iota(jnp.int32, Bt.shape, 1)  # (n, tl)

    def step(t, h):  # h (n, te)
        d = delta_ref[pl.ds(t, 1), :]  # (1, te)
        x = du_ref[pl.ds(t, 1), :]  # (1, te)
        b = jnp.sum(jnp.where(lane == t, Bt, 0.0), axis=1, keepdims=True)  # B_t (n, 1)
        c = jnp.sum(jnp.where(lane == t, Ct, 0.0), axis=1, keepdims=True)  # C_t (n, 1)
        h = jnp.exp(d * At) * h + b * x
        y_ref[pl.ds(t, 1), :] = jnp.sum(c * h, axis=0, keepdims=True)
        return h

    h = lax.fori_loop(0, y_ref.shape[0], step, h_scr[...])
    h_scr[...] = h

    @pl.when(chunk == pl.num_programs(2) - 1)
    def _():
        hT_ref[...] = h


def _scan_kernel_gpu(delta_ref, du_ref, At_ref, B_ref, C_ref, h0_ref, y_ref, hT_ref, *hs_ref, q):
    """GPU (Triton) tile: grid (b, e-blocks), all parallel; the whole sequence per program.

    Blocks: delta/du/y (l, te) with l a multiple of ``q``; B/C (l, n) in their natural layout;
    At/h0/hT (n, te); the optional checkpoints hs (l / q, n, te). A fori_loop over chunks of q steps (an
    inner fori_loop over the steps) carries the state as a loop value (no scratch, no sequential grid
    axis); every in-kernel array is (te,), (n,) or (n, te), powers of two.
    """
    At = At_ref[...]

    def step(t, h):  # h (n, te)
        d, x = delta_ref[t, :], du_ref[t, :]  # (te,)
        b, c = B_ref[t, :], C_ref[t, :]  # (n,)
        h = jnp.exp(d[None, :] * At) * h + b[:, None] * x[None, :]
        y_ref[t, :] = jnp.sum(c[:, None] * h, axis=0)
        return h

    def chunk(k, h):
        if hs_ref:
            hs_ref[0][k, :, :] = h
        return lax.fori_loop(k * q, (k + 1) * q, step, h)

    hT_ref[...] = lax.fori_loop(0, y_ref.shape[0] // q, chunk, h0_ref[...])


def _reverse_step(g, h, h_prev, At, d, x, b, c, dy, keepdims):
    """One step of the backward (the section comment's formulas), shared by both variants.

    g, h = state_t, h_prev = state_{t-1}, At: (n, te); d = delta_t, x = du_t, dy: broadcastable rows
    (1, te); b = B_t, c = C_t: columns (n, 1). Returns (g for state_{t-1}, dA term (n, te), ddelta_t,
    ddu_t, dB_t, dC_t), the per-step vectors reduced with ``keepdims`` (TPU: 2-D; GPU: 1-D).
    """
    g = g + c * dy
    a = jnp.exp(d * At)
    ga = g * h_prev * a
    sum_n = lambda v: jnp.sum(v, axis=0, keepdims=keepdims)  # noqa: E731
    sum_e = lambda v: jnp.sum(v, axis=1, keepdims=keepdims)  # noqa: E731
    grads = (sum_n(ga * At), sum_n(g * b), sum_e(g * x), sum_e(h * dy))
    return (g * a, ga * d, *grads)


def _scan_bwd_kernel_tpu(
    delta_ref, du_ref, At_ref, Bt_ref, Ct_ref, hs_ref, dy_ref, dhT_ref,
    dd_ref, ddu_ref, dBt_ref, dCt_ref, dAt_ref, dh0_ref, g_scr, st_scr,
):  # fmt: skip
    """TPU backward tile: grid (b, e-blocks, l-chunks from the last), chunks "arbitrary".

    Blocks as the forward's, for the chunk the reversed grid index names; hs (n, te) its checkpoint; dy
    (tl, te); dhT (n, te) the final state's cotangent. Writes ddelta (decay part) and ddu (tl, te), this
    channel block's share of dB^T and dC^T (n, tl), and accumulates dA^T (n, te) over the chunks (its
    block index does not move with them); dh0 on the last grid step. The chunk's states are recomputed
    forward from hs into the scratch st_scr (tl, n, te), then walked backwards with the state's cotangent
    carried across chunks in g_scr (n, te).
    """
    step_id = pl.program_id(2)
    tl = dy_ref.shape[0]

    @pl.when(step_id == 0)
    def _():
        g_scr[...] = dhT_ref[...]
        dAt_ref[...] = jnp.zeros_like(dAt_ref)

    At, Bt, Ct = At_ref[...], Bt_ref[...], Ct_ref[...]
    lane = lax.broadcasted_iota(jnp.int32, Bt.shape, 1)  # (n, tl)
    column = lambda m, t: jnp.sum(jnp.where(lane == t, m, 0.0), axis=1, keepdims=True)  # noqa: E731

    def forward(t, h):
        d, x = delta_ref[pl.ds(t, 1), :], du_ref[pl.ds(t, 1), :]
        h = jnp.exp(d * At) * h + column(Bt, t) * x
        st_scr[t] = h
        return h

    lax.fori_loop(0, tl, forward, hs_ref[...])

    def backward(s, carry):
        g, dA, dBt, dCt = carry
        t = tl - 1 - s
        h_prev = jnp.where(t > 0, st_scr[jnp.maximum(t - 1, 0)], hs_ref[...])
        d, x, dy = (r[pl.ds(t, 1), :] for r in (delta_ref, du_ref, dy_ref))
        g, dA_t, dd, ddu, dB, dC = _reverse_step(
            g, st_scr[t], h_prev, At, d, x, column(Bt, t), column(Ct, t), dy, keepdims=True
        )
        dd_ref[pl.ds(t, 1), :] = dd
        ddu_ref[pl.ds(t, 1), :] = ddu
        dBt = dBt + jnp.where(lane == t, dB, 0.0)
        dCt = dCt + jnp.where(lane == t, dC, 0.0)
        return g, dA + dA_t, dBt, dCt

    zeros = jnp.zeros_like(At)
    g, dA, dBt, dCt = lax.fori_loop(
        0, tl, backward, (g_scr[...], zeros, jnp.zeros_like(Bt), jnp.zeros_like(Ct))
    )
    g_scr[...] = g
    dAt_ref[...] += dA
    dBt_ref[...] = dBt
    dCt_ref[...] = dCt

    @pl.when(step_id == pl.num_programs(2) - 1)
    def _():
        dh0_ref[...] = g


def _scan_bwd_kernel_gpu(
    delta_ref, du_ref, At_ref, B_ref, C_ref, hs_ref, dy_ref, dhT_ref,
    dd_ref, ddu_ref, dB_ref, dC_ref, dAt_ref, dh0_ref, *, q,
):  # fmt: skip
    """GPU backward tile: grid (b, e-blocks), all parallel; the whole sequence per program.

    Blocks as the forward's (hs (l / q, n, te) the checkpoints), dy (l, te), dhT (n, te); writes ddelta
    (decay part) and ddu (l, te), this channel block's share of dB and dC (l, n), dA^T and dh0 (n, te).
    A fori_loop walks the chunks from the last; each chunk's q states are recomputed from its checkpoint
    as q loop-unrolled values (Triton has no indexable scratch), then walked backwards.
    """
    At = At_ref[...]

    def rows(t):
        return delta_ref[t, :][None, :], du_ref[t, :][None, :], B_ref[t, :][:, None]

    def chunk(i, carry):
        g, dA = carry
        k = dy_ref.shape[0] // q - 1 - i
        states = [hs_ref[k, :, :]]
        for j in range(q):  # recompute the chunk's states (unrolled: q static)
            d, x, b = rows(k * q + j)
            states.append(jnp.exp(d * At) * states[-1] + b * x)
        for j in reversed(range(q)):
            t = k * q + j
            d, x, b = rows(t)
            g, dA_t, dd, ddu, dB, dC = _reverse_step(
                g, states[j + 1], states[j], At, d, x, b, C_ref[t, :][:, None],
                dy_ref[t, :][None, :], keepdims=False,
            )  # fmt: skip
            dd_ref[t, :], ddu_ref[t, :], dB_ref[t, :], dC_ref[t, :] = dd, ddu, dB, dC
            dA = dA + dA_t
        return g, dA

    g, dA = lax.fori_loop(0, dy_ref.shape[0] // q, chunk, (dhT_ref[...], jnp.zeros_like(At)))
    dAt_ref[...] = dA
    dh0_ref[...] = g


# --------------------------------------------------------------------------------------------------
# Drivers: fp32 casts, padding, layout, pallas_call (forward, then backward).
# --------------------------------------------------------------------------------------------------


def _scan_tpu_blocks(tl: int, te: int, n: int, backward: bool):
    """(block shapes, scratch shapes) of the TPU forward (with its checkpoints) or backward kernel for
    tiles of tl steps x te channels: what its VMEM holds."""
    seq, state, bc = (tl, te), (n, te), (n, tl)
    if backward:  # ins: delta, du, At, B^T, C^T, checkpoint, dy, dhT; outs: dd, ddu, dB^T, dC^T, dA^T, dh0
        blocks = [seq, seq, state, bc, bc, state, seq, state, seq, seq, bc, bc, state, state]
        return blocks, [state, (tl, n, te)]
    return [seq, seq, state, bc, bc, state, seq, state, state], [state]  # ..., h0; outs: y, hT, hs


def _scan_tiles_tpu(l: int, e: int, n: int, bs: Blocks, interpret: bool, chip, backward: bool):
    """(tl, te, vmem_limit_bytes or None) for the TPU variant; unless interpreting, checks the Mosaic
    (8, 128) block rule and that the kernel's buffers fit the chip's scoped VMEM."""
    l8 = round_up(l, 8)
    tl = l8 if l8 <= bs.scan_block_l else bs.scan_block_l
    te = e if e <= bs.scan_block_e else bs.scan_block_e
    if interpret:
        return tl, te, None
    if tl != l8 and tl % 128:
        raise ValueError(f"TPU scan_block_l must be a multiple of 128 (lanes of B^T), found {tl}")
    if te != e and te % 128:
        raise ValueError(f"TPU scan_block_e must be a multiple of 128, found {te}")
    chip, known = vmem.target_chip(chip)
    limit = vmem.scoped_limit(chip, bs.vmem_limit_bytes)
    need = lambda t: vmem.need(*_scan_tpu_blocks(*t, n, backward))  # noqa: E731

    def fits():
        ok = lambda t: vmem.fits_limit(need(t), limit)  # noqa: E731
        best = vmem.largest([(a, c) for a in vmem.steps(tl, 128) for c in vmem.steps(te, 128)], ok)
        if best is None:
            return f"no tile fits (state size n={n})"
        return f"the largest tile that fits: Blocks(scan_block_l={best[0]}, scan_block_e={best[1]})"

    kernel = f"selective scan {'backward' if backward else 'forward'} kernel"
    tile = f"scan_block_l={tl} x scan_block_e={te} (n={n})"
    vmem.check(kernel, tile, need((tl, te)), chip, known, limit, fits)
    return tl, te, limit


GPU_MAX_CHUNK = 64  # the GPU backward unrolls one checkpoint chunk: its spacing is capped here


def _tiles_gpu(l: int, e: int, n: int, bs: Blocks) -> tuple[int, int]:
    """(q, te) for the GPU variant: checkpoint spacing and channel block, both powers of two."""
    if n & (n - 1):
        raise ValueError(f"the GPU scan needs a power-of-two state size n, found {n}")
    q = min(next_pow2(bs.scan_block_l), GPU_MAX_CHUNK, next_pow2(l))
    return q, min(next_pow2(bs.scan_block_e), next_pow2(e))


def _scan_forward_tpu(delta, du, A, B, C, h0, bs: Blocks, interpret: bool, keep: bool, chip=None):
    """pallas_call of the TPU variant. Returns (y_ssm (b, l, e), final state (b, e, n), checkpoints):
    the checkpoints (b, l-chunks, n, ep), the state^T entering each chunk, only with ``keep``."""
    b, l, e = delta.shape
    n = A.shape[1]
    tl, te, limit = _scan_tiles_tpu(l, e, n, bs, interpret, chip, backward=False)
    lp, ep = round_up(l, tl), round_up(e, te)  # padding: delta = du = 0 keeps the state unchanged
    delta, du = (pad_axis(pad_axis(t, 1, lp), 2, ep) for t in (delta, du))
    At = pad_axis(A.T, 1, ep)  # (n, ep)
    Bt, Ct = (pad_axis(t, 1, lp).swapaxes(1, 2) for t in (B, C))  # (b, n, lp)
    h0t = pad_axis(h0.swapaxes(1, 2), 2, ep)  # (b, n, ep)

    seq = pl.BlockSpec((pl.squeezed, tl, te), lambda i, j, k: (i, k, j))
    state = pl.BlockSpec((pl.squeezed, n, te), lambda i, j, k: (i, 0, j))
    bc = pl.BlockSpec((pl.squeezed, n, tl), lambda i, j, k: (i, 0, k))
    out_shape = [
        jax.ShapeDtypeStruct((b, lp, ep), jnp.float32),
        jax.ShapeDtypeStruct((b, n, ep), jnp.float32),
    ]
    out_specs = [seq, state]
    if keep:
        out_shape.append(jax.ShapeDtypeStruct((b, lp // tl, n, ep), jnp.float32))
        out_specs.append(pl.BlockSpec((pl.squeezed, pl.squeezed, n, te), lambda i, j, k: (i, k, 0, j)))
    y, hT, *hs = pl.pallas_call(
        _scan_kernel_tpu,
        out_shape=tuple(out_shape),
        grid=(b, ep // te, lp // tl),
        in_specs=[seq, seq, pl.BlockSpec((n, te), lambda i, j, k: (0, j)), bc, bc, state],
        out_specs=tuple(out_specs),
        scratch_shapes=[pltpu.VMEM((n, te), jnp.float32)],
        compiler_params=tpu_compiler_params(("parallel", "parallel", "arbitrary"), limit),
        interpret=interpret,
    )(delta, du, At, Bt, Ct, h0t)
    return y[:, :l, :e], hT[:, :, :e].swapaxes(1, 2), (hs[0] if keep else None)


def _scan_forward_gpu(delta, du, A, B, C, h0, bs: Blocks, interpret: bool, keep: bool):
    """pallas_call of the GPU variant. Returns (y_ssm (b, l, e), final state (b, e, n), checkpoints):
    the checkpoints (b, l-chunks, n, ep), the state^T entering each chunk, only with ``keep``."""
    b, l, e = delta.shape
    n = A.shape[1]
    q, te = _tiles_gpu(l, e, n, bs)
    lp, ep = round_up(l, q), round_up(e, te)
    delta, du = (pad_axis(pad_axis(t, 1, lp), 2, ep) for t in (delta, du))
    B, C = (pad_axis(t, 1, lp) for t in (B, C))
    At = pad_axis(A.T, 1, ep)  # (n, ep)
    h0t = pad_axis(h0.swapaxes(1, 2), 2, ep)  # (b, n, ep)

    seq = pl.BlockSpec((pl.squeezed, lp, te), lambda i, j: (i, 0, j))
    state = pl.BlockSpec((pl.squeezed, n, te), lambda i, j: (i, 0, j))
    bc = pl.BlockSpec((pl.squeezed, lp, n), lambda i, j: (i, 0, 0))
    out_shape = [
        jax.ShapeDtypeStruct((b, lp, ep), jnp.float32),
        jax.ShapeDtypeStruct((b, n, ep), jnp.float32),
    ]
    out_specs = [seq, state]
    if keep:
        out_shape.append(jax.ShapeDtypeStruct((b, lp // q, n, ep), jnp.float32))
        out_specs.append(pl.BlockSpec((pl.squeezed, lp // q, n, te), lambda i, j: (i, 0, 0, j)))
    y, hT, *hs = pl.pallas_call(
        functools.partial(_scan_kernel_gpu, q=q),
        out_shape=tuple(out_shape),
        grid=(b, ep // te),
        in_specs=[seq, seq, pl.BlockSpec((n, te), lambda i, j: (0, j)), bc, bc, state],
        out_specs=tuple(out_specs),
        compiler_params=gpu_compiler_params(bs.num_warps_scan),
        interpret=interpret,
    )(delta, du, At, B, C, h0t)
    return y[:, :l, :e], hT[:, :, :e].swapaxes(1, 2), (hs[0] if keep else None)


def _backward_shapes(b: int, lp: int, ep: int, n: int, share: tuple[int, ...]):
    """Output shapes of a backward kernel: ddelta, ddu (b, lp, ep); each channel block's share of dB
    and dC (``share``: the variant's layout); dA^T and dh0^T (b, n, ep)."""
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
    return (f32(b, lp, ep), f32(b, lp, ep), f32(*share), f32(*share), f32(b, n, ep), f32(b, n, ep))


def _unpad_backward(dd, ddu, dB, dC, dAt, dh0, l: int, e: int):
    """The backward kernels' padded outputs cut to (b, l, e) / (e, n) / (b, e, n); dA summed over b."""
    return dd[:, :l, :e], ddu[:, :l, :e], dB, dC, dAt.sum(0)[:, :e].T, dh0[:, :, :e].swapaxes(1, 2)


def _scan_backward_tpu(delta, du, A, B, C, hs, dy, dhT, bs: Blocks, interpret: bool, chip=None):
    """pallas_call of the TPU backward. Inputs as the forward's plus the checkpoints hs, dy (b, l, e) and
    dhT (b, e, n). Returns (ddelta decay part, ddu (b, l, e), dB, dC (b, l, n), dA (e, n), dh0 (b, e, n))."""
    b, l, e = delta.shape
    n = A.shape[1]
    tl, te, limit = _scan_tiles_tpu(l, e, n, bs, interpret, chip, backward=True)
    lp, ep = round_up(l, tl), round_up(e, te)
    nk, ne = lp // tl, ep // te
    delta, du, dy = (pad_axis(pad_axis(t, 1, lp), 2, ep) for t in (delta, du, dy))
    At = pad_axis(A.T, 1, ep)
    Bt, Ct = (pad_axis(t, 1, lp).swapaxes(1, 2) for t in (B, C))
    dhTt = pad_axis(dhT.swapaxes(1, 2), 2, ep)

    rev = lambda k: nk - 1 - k  # noqa: E731  (grid step k visits chunk nk - 1 - k)
    seq = pl.BlockSpec((pl.squeezed, tl, te), lambda i, j, k: (i, rev(k), j))
    state = pl.BlockSpec((pl.squeezed, n, te), lambda i, j, k: (i, 0, j))
    bc = pl.BlockSpec((pl.squeezed, n, tl), lambda i, j, k: (i, 0, rev(k)))
    checkpoint = pl.BlockSpec((pl.squeezed, pl.squeezed, n, te), lambda i, j, k: (i, rev(k), 0, j))
    bc_share = pl.BlockSpec((pl.squeezed, pl.squeezed, n, tl), lambda i, j, k: (i, j, 0, rev(k)))
    dd, ddu, dBt, dCt, dAt, dh0 = pl.pallas_call(
        _scan_bwd_kernel_tpu,
        out_shape=_backward_shapes(b, lp, ep, n, (b, ne, n, lp)),
        grid=(b, ne, nk),
        in_specs=[seq, seq, pl.BlockSpec((n, te), lambda i, j, k: (0, j)), bc, bc, checkpoint, seq, state],
        out_specs=(seq, seq, bc_share, bc_share, state, state),
        scratch_shapes=[pltpu.VMEM((n, te), jnp.float32), pltpu.VMEM((tl, n, te), jnp.float32)],
        compiler_params=tpu_compiler_params(("parallel", "parallel", "arbitrary"), limit),
        interpret=interpret,
    )(delta, du, At, Bt, Ct, hs, dy, dhTt)
    dB, dC = (t.sum(1)[:, :, :l].swapaxes(1, 2) for t in (dBt, dCt))
    return _unpad_backward(dd, ddu, dB, dC, dAt, dh0, l, e)


def _scan_backward_gpu(delta, du, A, B, C, hs, dy, dhT, bs: Blocks, interpret: bool):
    """pallas_call of the GPU backward; arguments and results as :func:`_scan_backward_tpu`'s."""
    b, l, e = delta.shape
    n = A.shape[1]
    q, te = _tiles_gpu(l, e, n, bs)
    lp, ep = round_up(l, q), round_up(e, te)
    ne = ep // te
    delta, du, dy = (pad_axis(pad_axis(t, 1, lp), 2, ep) for t in (delta, du, dy))
    B, C = (pad_axis(t, 1, lp) for t in (B, C))
    At = pad_axis(A.T, 1, ep)
    dhTt = pad_axis(dhT.swapaxes(1, 2), 2, ep)

    seq = pl.BlockSpec((pl.squeezed, lp, te), lambda i, j: (i, 0, j))
    state = pl.BlockSpec((pl.squeezed, n, te), lambda i, j: (i, 0, j))
    bc = pl.BlockSpec((pl.squeezed, lp, n), lambda i, j: (i, 0, 0))
    checkpoint = pl.BlockSpec((pl.squeezed, lp // q, n, te), lambda i, j: (i, 0, 0, j))
    bc_share = pl.BlockSpec((pl.squeezed, pl.squeezed, lp, n), lambda i, j: (i, j, 0, 0))
    dd, ddu, dB, dC, dAt, dh0 = pl.pallas_call(
        functools.partial(_scan_bwd_kernel_gpu, q=q),
        out_shape=_backward_shapes(b, lp, ep, n, (b, ne, lp, n)),
        grid=(b, ne),
        in_specs=[seq, seq, pl.BlockSpec((n, te), lambda i, j: (0, j)), bc, bc, checkpoint, seq, state],
        out_specs=(seq, seq, bc_share, bc_share, state, state),
        compiler_params=gpu_compiler_params(bs.num_warps_scan),
        interpret=interpret,
    )(delta, du, At, B, C, hs, dy, dhTt)
    dB, dC = (t.sum(1)[:, :l] for t in (dB, dC))
    return _unpad_backward(dd, ddu, dB, dC, dAt, dh0, l, e)


def _prepare(u, delta, A, B, C, D, h0):
    """fp32 copies of the inputs (h0 is always an array: selective_scan_pallas fills in zeros)."""
    return tuple(t.astype(jnp.float32) for t in (u, delta, A, B, C, D, h0))


def _scan_forward(u, delta, A, B, C, D, initial_state, config, keep=False):
    """Kernel forward: (y (b, l, e), final_state (b, e, n), checkpoints or None), all fp32."""
    block_sizes, target, interpret, chip = config
    u, delta, A, B, C, D, h0 = _prepare(u, delta, A, B, C, D, initial_state)
    args = (delta, delta * u, A, B, C, h0, block_sizes, interpret, keep)
    if target == "tpu":
        y, final, hs = _scan_forward_tpu(*args, chip)
    else:
        y, final, hs = _scan_forward_gpu(*args)
    return y + D * u, final, hs


def _scan_backward(u, delta, A, B, C, D, h0, hs, dy, dfinal, config):
    """Kernel backward: the cotangents of (u, delta, A, B, C, D, h0), fp32, from the checkpoints hs."""
    block_sizes, target, interpret, chip = config
    u, delta, A, B, C, D, h0 = _prepare(u, delta, A, B, C, D, h0)
    dy, dfinal = dy.astype(jnp.float32), dfinal.astype(jnp.float32)
    args = (delta, delta * u, A, B, C, hs, dy, dfinal, block_sizes, interpret)
    if target == "tpu":
        dd, ddu, dB, dC, dA, dh0 = _scan_backward_tpu(*args, chip)
    else:
        dd, ddu, dB, dC, dA, dh0 = _scan_backward_gpu(*args)
    du = ddu * delta + dy * D
    dd = dd + ddu * u
    dD = jnp.sum(dy * u, axis=(0, 1))
    return du, dd, dA, dB, dC, dD, dh0


# --------------------------------------------------------------------------------------------------
# Public function: a custom_vjp whose backward is the Pallas backward kernel. Its forward saves the
# inputs and one state per chunk (the checkpoints); the backward recomputes each chunk's states from
# its checkpoint. Both kernel calls are custom_jvps with the reference's derivative, so the gradient
# itself can be differentiated (grad x input scores, Hessian-vector products); forward mode of the
# scan (jax.jvp, jacfwd) stops at the custom_vjp with JAX's TypeError: use the XLA path for it.
# --------------------------------------------------------------------------------------------------


@functools.partial(jax.custom_jvp, nondiff_argnums=(7,))
def _forward_checkpointed(u, delta, A, B, C, D, h0, config):
    y, final, hs = _scan_forward(u, delta, A, B, C, D, h0, config, keep=True)
    return y, final, hs


@_forward_checkpointed.defjvp
def _forward_checkpointed_jvp(config, primals, tangents):
    y, final, hs = _forward_checkpointed(*primals, config)
    _, (dy, dfinal) = jax.jvp(selective_scan_reference, primals, tangents)
    return (y, final, hs), (dy, dfinal, jnp.zeros_like(hs))  # hs: read only by _backward_kernel


@functools.partial(jax.custom_jvp, nondiff_argnums=(10,))
def _backward_kernel(u, delta, A, B, C, D, h0, hs, dy, dfinal, config):
    return _scan_backward(u, delta, A, B, C, D, h0, hs, dy, dfinal, config)


def _reference_vjp(u, delta, A, B, C, D, h0, dy, dfinal):
    _, pullback = jax.vjp(selective_scan_reference, u, delta, A, B, C, D, h0)
    return tuple(g.astype(jnp.float32) for g in pullback((dy, dfinal)))


@_backward_kernel.defjvp
def _backward_kernel_jvp(config, primals, tangents):
    """The backward's derivative is the reference VJP's (hs, a function of the inputs, is not read)."""
    out = _backward_kernel(*primals, config)
    keep = lambda xs: xs[:7] + xs[8:]  # noqa: E731
    _, tangent = jax.jvp(_reference_vjp, keep(primals), keep(tangents))
    return out, tangent


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _scan_custom(u, delta, A, B, C, D, initial_state, config):
    y, final, _ = _scan_forward(u, delta, A, B, C, D, initial_state, config)
    return y, final


def _scan_fwd(u, delta, A, B, C, D, initial_state, config):
    y, final, hs = _forward_checkpointed(u, delta, A, B, C, D, initial_state, config)
    return (y, final), (u, delta, A, B, C, D, initial_state, hs)


def _scan_bwd(config, saved, cotangents):
    *inputs, hs = saved
    grads = _backward_kernel(*inputs, hs, *cotangents, config)
    return tuple(g.astype(x.dtype) for g, x in zip(grads, inputs, strict=True))


_scan_custom.defvjp(_scan_fwd, _scan_bwd)


def selective_scan_pallas(
    u, delta, A, B, C, D, initial_state=None, *, block_sizes=None, platform=None, interpret=None, chip=None
):
    """Pallas selective scan -> (y (b, l, e), final_state (b, e, n)), fp32, any l >= 1.

    platform: "tpu" | "gpu" kernel variant (None: ``jax.default_backend()``; on CPU the TPU variant).
    interpret: None runs interpret mode exactly when the default backend is CPU. chip: the TPU
    generation compiled for (None: the running TPU's, else budgeted as the smallest): its scoped-VMEM
    limit; tiles whose buffers overflow it are refused before compiling, naming the largest that
    fits (:mod:`latim_jax.kernels.vmem`). ``initial_state``
    (b, e, n) is supported in the kernel (it seeds the carried state). Reverse-mode differentiable
    through a Pallas backward kernel that restarts from one saved state per chunk (``scan_block_l``
    steps: the TPU grid's chunk, the GPU variant's checkpoint spacing), so the backward keeps
    b * (l / chunk) * e * n states, never all of them; the gradient is differentiable again. Forward
    mode (jax.jvp, jacfwd) raises JAX's custom_vjp TypeError: take ``impl="xla"`` for it.
    """
    target, interpret = resolve_target(platform, interpret)
    block_sizes = (block_sizes or Blocks()).over(Blocks.for_platform("cpu" if interpret else target))
    if initial_state is None:  # the kernel always takes one: a custom_vjp needs array arguments
        initial_state = jnp.zeros((u.shape[0], u.shape[2], A.shape[1]), jnp.float32)
    chip = None if chip is None else check_chip(chip)
    return _scan_custom(u, delta, A, B, C, D, initial_state, (block_sizes, target, interpret, chip))


# --------------------------------------------------------------------------------------------------
# Pure-jnp references.
# --------------------------------------------------------------------------------------------------


SCAN_CHUNK = 128  # time steps per chunk of the reference scan


def selective_scan_reference(u, delta, A, B, C, D, initial_state=None, *, chunk: int = SCAN_CHUNK):
    """Pure-jnp selective scan. Returns (y (b, l, e), final_state (b, e, n)).

    A lax.scan over chunks of ``chunk`` steps carries the state; inside a chunk a sequential lax.scan
    over its steps updates the state laid out (b, n, e), so each step is one vectorised pass over the
    e channels (on CPU 4-5x faster than an associative scan over (b, chunk, e, n), which moves
    log2(chunk) copies of the states through memory: one 130m layer, L = 1024 and 4096). Each chunk
    is rematerialised under differentiation (jax.checkpoint), so the backward keeps one state per
    chunk plus one chunk's steps, never the (b, l, e, n) states. Padding past l has delta = 0 (decay
    1, no input), which leaves the state unchanged.
    """
    u, delta, B, C = (x.astype(jnp.float32) for x in (u, delta, B, C))
    A, D = A.astype(jnp.float32), D.astype(jnp.float32)
    b, l, e = u.shape
    At = A.T  # (n, e)
    q = min(chunk, l)
    pad = -l % q

    def chunks(x):  # (b, l, ...) -> (l / q, q, b, ...), zero-padded
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return jnp.moveaxis(x.reshape(b, -1, q, *x.shape[2:]), (1, 2), (0, 1))

    def one_step(h, xs):  # h (b, n, e)
        u_t, d_t, B_t, C_t = xs  # (b, e), (b, e), (b, n), (b, n)
        h = jnp.exp(d_t[:, None, :] * At) * h + (d_t * u_t)[:, None, :] * B_t[..., None]
        return h, jnp.einsum("bne,bn->be", h, C_t)

    @jax.checkpoint
    def one_chunk(h, xs):
        return jax.lax.scan(one_step, h, xs)

    h0 = (
        jnp.zeros((b, A.shape[1], e), jnp.float32)
        if initial_state is None
        else jnp.swapaxes(initial_state.astype(jnp.float32), 1, 2)
    )
    final, ys = jax.lax.scan(one_chunk, h0, tuple(chunks(x) for x in (u, delta, B, C)))
    y = jnp.moveaxis(ys, (0, 1), (1, 2)).reshape(b, -1, e)[:, :l]
    final = jnp.swapaxes(final, 1, 2)
    return y + D * u, final


def selective_scan_step_reference(state, u, delta, A, B, C, D):
    """One recurrent step. state (b, e, n); u, delta (b, e); B, C (b, n). Returns (y (b, e), state)."""
    state = jnp.exp(delta[..., None] * A) * state + (delta * u)[..., None] * B[:, None, :]
    y = jnp.einsum("ben,bn->be", state, C) + D * u
    return y, state
