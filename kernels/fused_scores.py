"""Fused LaTIM scores: one layer's per-pair scores without ever writing T (docs/method.md, sections 5 and 9).

For target rows i (a subset ``rows`` of positions) and every source j, with the factors of
:class:`latim_jax.latim.mamba.MambaFactors` (its ``ssm``: :class:`latim_jax.kernels.decay.SSM`):

    M_{i,t}   = hidden attention (Mamba-2 per head, Mamba-1 per channel with the n-sum), plus [i=t] D
    V_{i,j}   = G_i * sum_k M_{i,j+k} a_k[j]               (e,)   k < K conv taps
    T_{i,j}   = V_{i,j} @ W_out                             (d,)
    l2: ||T_ij||_2   l1: ||T_ij||_1   alti: max(0, ||hout_i||_1 - ||hout_i - T_ij - [i=j] h_i||_1)
    logit: sum_e V_ij[e] q_i[e]                             (q = aux, (b, l, e))

The kernels tile (target block of ti rows) x (source block of tj columns) x (d tile), rebuild M for
the tile from the compensated segment sums of Delta (S = hi + lo: seg = (hi_i - hi_t) + (lo_i - lo_t),
the reference's own formula, masked before exp), apply the conv taps by reading the source-side
quantities (Delta, S, B) shifted by k (the wrapper stacks the K shifts, so no in-kernel window or
unaligned slice is needed), multiply by G and into W_out, and reduce over d in place: each tile
writes only (ti, tj) partial sums over its d tile. Tiles entirely above the diagonal are skipped and
write zeros. The wrapper sums the d-tile partials, finishes the score (sqrt, alti's max) and zeroes
j > i exactly. logit runs the same kernel with G <- G * q and W_out <- a ones column.

Two variants, both run by interpret mode on CPU:
- "tpu" (Mosaic): sources on lanes, channels on sublanes. Grid (b, i, j, d, e-chunk), the e-chunk axis
  last and "arbitrary" with an fp32 VMEM accumulator (ti, d_tile, tj); per target row a
  (d_tile, e_chunk) @ (e_chunk, tj) matmul with W_out's columns scaled by G_i. The causal-tile bound
  per target block is scalar-prefetched: skipped tiles neither compute nor fetch new source blocks.
- "gpu" (Triton): grid (b, i, j, d), all parallel, no scratch; a fori_loop over heads (Mamba-2) or
  channel chunks (Mamba-1) carries a (ti*tj, d_tile) accumulator; every in-kernel shape is a power of
  two (ti, tj, d_tile, p or the channel chunk, n).

Mamba-1 evaluates exp(A[e, n] seg) for every (pair, channel, n, tap) directly (K*n exponentials per
pair and channel): correct and simple, VPU/SFU-bound; the factorised off-diagonal form in
pallas-notes is not implemented yet.

Glossary: b batch, l length, r target rows, d model width, e inner width, n state size, h heads,
p head dim, g groups, k conv taps (K of them), ti/tj tile rows/columns, dt d tile, ec e chunk.

Order of this file: forward drivers, custom_jvp public function; the kernel bodies (tile math, TPU and
GPU kernels) are in kernels/fused_scores_tiles.py, the elementwise decay entry they share with the XLA
path in kernels/decay.py. The reference is the library's blocked pure-JAX score path
(:func:`latim_jax.latim.scores.blocked_scores`), passed in as ``reference`` (kernels import nothing
above them): the derivative is its JVP (rematerialised; reverse mode transposes it) and the tests
compare the two.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from latim_jax.kernels import f32, vmem
from latim_jax.kernels.block_sizes import (
    Blocks,
    gpu_compiler_params,
    next_pow2,
    pad_axis,
    resolve_target,
    round_up,
)
from latim_jax.kernels.fused_scores_tiles import (
    _m1_kernel_gpu,
    _m1_kernel_tpu,
    _m2_kernel_gpu,
    _m2_kernel_tpu,
)
from latim_jax.parallel.chips import check_chip

METHODS = ("l2", "l1", "alti", "logit")
PRECISIONS = ("float32", "bfloat16")
_sq = pl.squeezed


def _precision(precision: str):
    """The kernel's matmul precision: "float32" -> HIGHEST (fp32 passes; what the tests check),
    "bfloat16" -> DEFAULT (bf16 MXU passes on TPU, TF32 on GPU: faster, ~1e-3 relative error)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, found {precision!r}")
    return lax.Precision.HIGHEST if precision == "float32" else lax.Precision.DEFAULT


# --------------------------------------------------------------------------------------------------
# Forward drivers: fp32 casts, padding, the K source shifts, per-variant layouts, pallas_call.
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Prepared:
    """Variant-independent inputs (natural layouts, fp32, padded): see `_prepare`."""

    rows: jax.Array  # (rp,) int32, -1 on padding rows
    a: jax.Array  # (b, K, lp, e)
    W: jax.Array  # (e, dp)
    G: jax.Array  # (b, rp, e) at the target rows (times q for logit)
    src: jax.Array  # (b, 3, K, lp, c) shifted [Delta, hi, lo]; c = h (Mamba-2) or e (Mamba-1)
    tgt: jax.Array  # (b, 2, rp, c) [hi, lo] at the target rows
    A: jax.Array  # (h,) or (e, n)
    D: jax.Array  # (h,) or (e,)
    C: jax.Array  # (b, rp, g, n) or (b, rp, n) at the target rows
    B: jax.Array  # (b, K, lp, g, n) or (b, K, lp, n) shifted
    hout: jax.Array | None  # (b, 2, rp, dp) [h + o, h] at the target rows (alti)


def _spec(block_shape, index_map):
    """A BlockSpec whose index map returns int32 (Python 0s would be int64 under jax_enable_x64)."""

    def int32_map(*idx):
        return tuple(jnp.asarray(v, jnp.int32) for v in index_map(*idx))

    return pl.BlockSpec(block_shape, int32_map)


def _shift_stack(x, K: int, lp: int):
    """x (b, l, ...) -> (b, K, lp, ...) with [:, k, j] = x[:, j + k], zero past the end."""
    pad = lp + K - 1 - x.shape[1]
    x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    return jnp.stack([x[:, k : k + lp] for k in range(K)], axis=1)


def _prepare(f, method, rows, aux, rp: int, lp: int, dp: int) -> _Prepared:
    K, _, l, e = f.a.shape
    rows_p = jnp.full((rp,), -1, jnp.int32).at[: rows.shape[0]].set(rows.astype(jnp.int32))
    at = jnp.clip(rows_p, 0, l - 1)
    take = lambda x: x.astype(f32)[:, at]  # noqa: E731  (b, rp, ...)
    G, W = take(f.G), f.W_out.astype(f32)
    if method == "logit":
        G, W = G * take(aux), jnp.ones((e, 1), f32)
    W = jnp.pad(W, ((0, 0), (0, dp - W.shape[1])))
    a = jnp.pad(jnp.moveaxis(f.a.astype(f32), 0, 1), ((0, 0), (0, 0), (0, lp - l), (0, 0)))
    dec = (f.ssm.delta, f.ssm.decay.hi, f.ssm.decay.lo)
    src = jnp.stack([_shift_stack(x.astype(f32), K, lp) for x in dec], axis=1)
    tgt = jnp.stack([take(f.ssm.decay.hi), take(f.ssm.decay.lo)], axis=1)
    hout = None
    if method == "alti":
        h = f.h.astype(f32)
        hout = jnp.stack([take(h + f.output.astype(f32)), take(h)], axis=1)
        hout = jnp.pad(hout, ((0, 0), (0, 0), (0, 0), (0, dp - hout.shape[-1])))
    return _Prepared(
        rows=rows_p,
        a=a,
        W=W,
        G=G,
        src=src,
        tgt=tgt,
        A=f.ssm.A.astype(f32),
        D=f.ssm.D.astype(f32),
        C=take(f.ssm.C),
        B=_shift_stack(f.ssm.B.astype(f32), K, lp),
        hout=hout,
    )


def _tile_t(x, ti: int):
    """(b, rp, ...c) -> (b, rp / ti, ...c, ti): each target tile transposed, rows on lanes."""
    b, rp = x.shape[:2]
    x = x.reshape(b, rp // ti, ti, *x.shape[2:])
    return jnp.moveaxis(x, 2, -1)


def _tpu_channel_chunk(version: int, e: int, p: int, heads: int, want: int, interpret: bool):
    """Channels per e-step: whole heads for Mamba-2 (any groups: the kernel looks each head's up);
    lane-aligned (a multiple of 128 or all of e) unless interpret."""
    unit = p if version == 2 else 1
    n_units = heads if version == 2 else e
    for count in range(max(1, min(n_units, want // unit)), 0, -1):
        if n_units % count:
            continue
        if interpret or (count * unit) % 128 == 0 or count == n_units:
            return count * unit
    return e


_TPU_MAX_D = 1024


def _tpu_d_tile(d: int) -> int:
    """Whole d up to _TPU_MAX_D (the accumulator is ti x dt x tj fp32 in VMEM), else the largest
    multiple of 128 dividing d below it (hout's d is a lane dimension), else d split evenly."""
    if d <= _TPU_MAX_D:
        return round_up(d, 8)
    for dt in range(_TPU_MAX_D, 127, -128):
        if d % dt == 0:
            return dt
    return round_up(-(-d // -(-d // _TPU_MAX_D)), 128)


def _tpu_blocks(version: int, method: str, K: int, n: int, g: int, p: int, ti: int, tj: int, dt: int, *, ec):
    """(input block shapes in the pallas_call's order, output block shape, scratch shapes) of the TPU
    variant for tiles (ti rows, tj columns, dt of d, ec channels per step): what its VMEM holds."""
    sq = _sq
    if version == 2:
        hc = ec // p
        own = [(sq, hc, 3, K, tj), (sq, sq, hc, 2, ti), (hc, 2, 1), (sq, g, ti, n), (sq, g, K, n, tj)]
    else:
        own = [(sq, 3, K, ec, tj), (sq, sq, 2, ec, ti), (ec, n + 1), (sq, sq, n, ti), (sq, K, n, tj)]
    ins = [(sq, 1, ti), (sq, K, ec, tj), (dt, ec), (sq, ti, ec), *own]
    if method == "alti":
        ins.append((sq, 2, ti, dt))
    return ins, (sq, sq, ti, tj), [(ti, dt, tj)]


def _tpu_vmem(shape_of, ti: int, tj: int, dt: int) -> vmem.Need:
    """The TPU variant's VMEM for tiles (ti, tj, dt); ``shape_of(ti, tj, dt)`` = :func:`_tpu_blocks`."""
    ins, out, scratch = shape_of(ti, tj, dt)
    return vmem.need([*ins, out], scratch)


def _check_tpu_vmem(shape_of, tiles, chip, known: bool, limit: int) -> None:
    """Refuse tiles (ti, tj, dt) whose buffers overflow ``limit``, naming the largest (rows, cols) at
    this d tile, no larger than the asked ones, that fits."""
    ti, tj, dt = tiles

    def fits():
        ok = lambda t: vmem.fits_limit(_tpu_vmem(shape_of, *t, dt), limit)  # noqa: E731
        best = vmem.largest([(r, c) for r in vmem.steps(ti, 8) for c in vmem.steps(tj, 128)], ok)
        if best is not None:
            return f"the largest tile that fits: Blocks(rows={best[0]}, cols={best[1]}) (d tile {dt})"
        small = [d for d in vmem.steps(dt, 128) if vmem.fits_limit(_tpu_vmem(shape_of, 8, 128, d), limit)]
        if small:
            return f"no tile fits at d tile {dt}: pass Blocks(rows=8, cols=128, d={max(small)})"
        return "no tile fits this layer's widths (e chunk too wide: pass a smaller Blocks(e=...))"

    tile = f"rows={ti} x cols={tj} (d tile {dt})"
    vmem.check("fused score kernel", tile, _tpu_vmem(shape_of, ti, tj, dt), chip, known, limit, fits)


def _forward_tpu(f, method, rows, aux, bs: Blocks, precision: str, interpret: bool, chip):
    K, b, l, e = f.a.shape
    d = f.W_out.shape[1] if method != "logit" else 1
    r = rows.shape[0]
    ti = min(bs.rows, round_up(r, 8))
    tj = min(bs.cols, round_up(l, 8))
    dt = _tpu_d_tile(d) if bs.d is None else min(bs.d, round_up(d, 8))
    rp, lp, dp = round_up(r, ti), round_up(l, tj), round_up(d, dt)
    heads = f.ssm.heads
    p, n, g = e // heads, f.ssm.B.shape[-1], (f.ssm.B.shape[2] if f.ssm.version == 2 else 1)
    if f.ssm.version == 2:
        ec = _tpu_channel_chunk(2, e, p, heads, bs.e, interpret)
    else:
        ec = _tpu_channel_chunk(1, e, 1, e, bs.e, interpret)
    shape_of = functools.partial(_tpu_blocks, f.ssm.version, method, K, n, g, p, ec=ec)
    limit = None
    if not interpret:
        for name, v, m, full in (("rows", ti, 8, rp), ("cols", tj, 128, lp), ("d", dt, 128, dp)):
            if v % m and v != full:
                raise ValueError(
                    f"TPU fused-score block {name}={v} must be a multiple of {m} or the whole axis"
                )
        chip, known = vmem.target_chip(chip)
        limit = vmem.scoped_limit(chip, bs.vmem_limit_bytes)
        _check_tpu_vmem(shape_of, (ti, tj, dt), chip, known, limit)
    x = _prepare(f, method, rows, aux, rp, lp, dp)
    ni, nj, nd = rp // ti, lp // tj, dp // dt
    prec = _precision(precision)
    ne = e // ec
    block_in, block_out, scratch = shape_of(ti, tj, dt)

    # The last causal tile per target block is scalar-prefetched (tm). Tiles past it skip their work,
    # and their index maps repeat the last live step's block indices, so they fetch nothing new.
    tmax = jnp.max(x.rows.reshape(ni, ti), axis=1)

    def live(i, j, tm):
        return j * tj <= tm[i]

    def src_j(i, j, tm):  # source block
        return jnp.minimum(j, jnp.maximum(lax.div(tm[i], jnp.int32(tj)), 0))

    def e_of(i, j, c, tm):  # e-chunk
        return jnp.where(live(i, j, tm), c, ne - 1)

    def d_of(i, j, dd, tm):  # d tile
        return jnp.where(live(i, j, tm), dd, nd - 1)

    rows_t = x.rows.astype(f32).reshape(ni, 1, ti)
    a_t = jnp.swapaxes(x.a, 2, 3)  # (b, K, e, lp)
    W_t = x.W.T  # (dp, e)
    if f.ssm.version == 2:
        hc, rep = ec // p, heads // x.C.shape[2]
        src = jnp.moveaxis(jnp.swapaxes(x.src, 3, 4), 3, 1)  # (b, h, 3, K, lp)
        tgt = _tile_t(x.tgt.transpose(0, 2, 3, 1), ti)  # (b, ni, h, 2, ti)
        ad = jnp.stack([x.A, x.D], axis=1)[..., None]  # (h, 2, 1)
        C = jnp.swapaxes(x.C, 1, 2)  # (b, g, rp, n)
        B = jnp.moveaxis(x.B, 3, 1).swapaxes(3, 4)  # (b, g, K, n, lp)
        kernel = functools.partial(_m2_kernel_tpu, cfg=(method, K, hc, p, rep, prec))
        maps = [
            lambda bi, i, j, dd, c, tm: (bi, e_of(i, j, c, tm), 0, 0, src_j(i, j, tm)),
            lambda bi, i, j, dd, c, tm: (bi, i, e_of(i, j, c, tm), 0, 0),
            lambda bi, i, j, dd, c, tm: (e_of(i, j, c, tm), 0, 0),
            lambda bi, i, j, dd, c, tm: (bi, 0, i, 0),
            lambda bi, i, j, dd, c, tm: (bi, 0, 0, 0, src_j(i, j, tm)),
        ]
    else:
        src = jnp.swapaxes(x.src, 3, 4)  # (b, 3, K, e, lp)
        tgt = _tile_t(jnp.moveaxis(x.tgt, 1, 2), ti)  # (b, ni, 2, e, ti)
        ad = jnp.concatenate([x.A, x.D[:, None]], axis=1)  # (e, n + 1)
        C = _tile_t(x.C, ti)  # (b, ni, n, ti)
        B = jnp.swapaxes(x.B, 2, 3)  # (b, K, n, lp)
        kernel = functools.partial(_m1_kernel_tpu, cfg=(method, K, n, prec))
        maps = [
            lambda bi, i, j, dd, c, tm: (bi, 0, 0, e_of(i, j, c, tm), src_j(i, j, tm)),
            lambda bi, i, j, dd, c, tm: (bi, i, 0, e_of(i, j, c, tm), 0),
            lambda bi, i, j, dd, c, tm: (e_of(i, j, c, tm), 0),
            lambda bi, i, j, dd, c, tm: (bi, i, 0, 0),
            lambda bi, i, j, dd, c, tm: (bi, 0, 0, src_j(i, j, tm)),
        ]
    maps = [
        lambda bi, i, j, dd, c, tm: (i, 0, 0),
        lambda bi, i, j, dd, c, tm: (bi, 0, e_of(i, j, c, tm), src_j(i, j, tm)),
        lambda bi, i, j, dd, c, tm: (d_of(i, j, dd, tm), e_of(i, j, c, tm)),
        lambda bi, i, j, dd, c, tm: (bi, i, e_of(i, j, c, tm)),
        *maps,
    ]
    arrays = [rows_t, a_t, W_t, x.G, src, tgt, ad, C, B]
    if method == "alti":
        maps.append(lambda bi, i, j, dd, c, tm: (bi, 0, i, d_of(i, j, dd, tm)))
        arrays.append(x.hout)
    params_cls = pltpu.CompilerParams if hasattr(pltpu, "CompilerParams") else pltpu.TPUCompilerParams
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((b, nd, rp, lp), f32),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(b, ni, nj, nd, ne),
            in_specs=[_spec(shape, imap) for shape, imap in zip(block_in, maps, strict=True)],
            out_specs=_spec(block_out, lambda bi, i, j, dd, c, tm: (bi, dd, i, j)),
            scratch_shapes=[pltpu.VMEM(shape, f32) for shape in scratch],
        ),
        compiler_params=params_cls(
            dimension_semantics=("parallel", "parallel", "parallel", "parallel", "arbitrary"),
            vmem_limit_bytes=limit,
        ),
        interpret=interpret,
    )(tmax, *arrays)
    return out, x


def _forward_gpu(f, method, rows, aux, bs: Blocks, precision: str, interpret: bool):
    K, b, l, e = f.a.shape
    d = f.W_out.shape[1] if method != "logit" else 1
    r = rows.shape[0]
    floor = 1 if interpret else 16
    ti = min(bs.rows, max(next_pow2(r), floor))
    tj = min(bs.cols, max(next_pow2(l), floor))
    dt = min(next_pow2(d) if bs.d is None else bs.d, max(next_pow2(d), floor))
    heads, n = f.ssm.heads, f.ssm.B.shape[-1]
    p = e // heads
    ec = p if f.ssm.version == 2 else min(bs.e, next_pow2(e))
    if not interpret:
        for name, v in (("rows", ti), ("cols", tj), ("d", dt), ("head dim / e chunk", ec), ("n", n)):
            if v & (v - 1) or v < (16 if name != "head dim / e chunk" else 1):
                raise ValueError(f"the GPU fused-score kernel needs {name} a power of two (>= 16), found {v}")
    rp, lp, dp = round_up(r, ti), round_up(l, tj), round_up(d, dt)
    x = _prepare(f, method, rows, aux, rp, lp, dp)
    ni, nj, nd = rp // ti, lp // tj, dp // dt
    prec = _precision(precision)
    a, W, G = x.a, x.W, x.G
    if f.ssm.version == 2:
        rep = heads // x.C.shape[2]
        g = x.C.shape[2]
        src = jnp.swapaxes(x.src, 3, 4)  # (b, 3, K, h, lp)
        ad = jnp.stack([x.A, x.D])  # (2, h)
        C = jnp.swapaxes(x.C, 1, 2)  # (b, g, rp, n)
        B = jnp.moveaxis(x.B, 3, 1)  # (b, g, K, lp, n)
        kernel = functools.partial(_m2_kernel_gpu, cfg=(method, K, heads, p, rep, prec))
        specs = [
            _spec((_sq, 3, K, heads, tj), lambda bi, i, j, dd: (bi, 0, 0, 0, j)),
            _spec((_sq, 2, ti, heads), lambda bi, i, j, dd: (bi, 0, i, 0)),
            _spec((2, heads), lambda bi, i, j, dd: (0, 0)),
            _spec((_sq, g, ti, n), lambda bi, i, j, dd: (bi, 0, i, 0)),
            _spec((_sq, g, K, tj, n), lambda bi, i, j, dd: (bi, 0, 0, j, 0)),
        ]
        arrays = [src, x.tgt, ad, C, B]
        ep = e
    else:
        ep = round_up(e, ec)  # zero channels contribute nothing (a = G = W = 0)
        a, W, G = pad_axis(a, -1, ep), pad_axis(W, 0, ep), pad_axis(G, -1, ep)
        src, tgt = pad_axis(x.src, -1, ep), pad_axis(x.tgt, -1, ep)
        ad = pad_axis(jnp.concatenate([x.A.T, x.D[None]], axis=0), -1, ep)  # (n + 1, ep)
        B = jnp.swapaxes(x.B, 2, 3)  # (b, K, n, lp)
        kernel = functools.partial(_m1_kernel_gpu, cfg=(method, K, n, ec, ep // ec, prec))
        specs = [
            _spec((_sq, 3, K, tj, ep), lambda bi, i, j, dd: (bi, 0, 0, j, 0)),
            _spec((_sq, 2, ti, ep), lambda bi, i, j, dd: (bi, 0, i, 0)),
            _spec((n + 1, ep), lambda bi, i, j, dd: (0, 0)),
            _spec((_sq, ti, n), lambda bi, i, j, dd: (bi, i, 0)),
            _spec((_sq, K, n, tj), lambda bi, i, j, dd: (bi, 0, 0, j)),
        ]
        arrays = [src, tgt, ad, x.C, B]
    in_specs = [
        _spec((ti,), lambda bi, i, j, dd: (i,)),
        _spec((_sq, K, tj, ep), lambda bi, i, j, dd: (bi, 0, j, 0)),
        _spec((ep, dt), lambda bi, i, j, dd: (0, dd)),
        _spec((_sq, ti, ep), lambda bi, i, j, dd: (bi, i, 0)),
        *specs,
    ]
    arrays = [x.rows, a, W, G, *arrays]
    if method == "alti":
        in_specs.append(_spec((_sq, 2, ti, dt), lambda bi, i, j, dd: (bi, 0, i, dd)))
        arrays.append(x.hout)
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((b, nd, rp, lp), f32),
        grid=(b, ni, nj, nd),
        in_specs=in_specs,
        out_specs=_spec((_sq, _sq, ti, tj), lambda bi, i, j, dd: (bi, dd, i, j)),
        compiler_params=gpu_compiler_params(bs.num_warps_scores),
        interpret=interpret,
    )(*arrays)
    return out, x


def _finish(method, partial, x: _Prepared, rows, length: int):
    """Sum the d-tile partials, finish the score and zero j > i exactly: (b, r, l)."""
    r = rows.shape[0]
    s = jnp.sum(partial, axis=1)[:, :r, :length]
    if method == "l2":
        s = jnp.sqrt(s)
    elif method == "alti":
        s = jnp.maximum(0.0, s)  # the partials are sums of alti_gain
    causal = jnp.arange(length)[None, :] <= rows[:, None]
    return jnp.where(causal[None], s, 0.0)


def _fused_forward(f, method, rows, aux, config):
    block_sizes, precision, target, interpret, chip, _ = config
    if target == "tpu":
        partial, prepared = _forward_tpu(f, method, rows, aux, block_sizes, precision, interpret, chip)
    else:
        partial, prepared = _forward_gpu(f, method, rows, aux, block_sizes, precision, interpret)
    return _finish(method, partial, prepared, rows, f.ssm.length)


# --------------------------------------------------------------------------------------------------
# Public function: custom_jvp whose tangent is the JVP of the given pure-JAX reference, rematerialised.
# --------------------------------------------------------------------------------------------------


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 4))
def _fused_custom(f, method, rows, aux, config):
    return _fused_forward(f, method, rows, aux, config)


@_fused_custom.defjvp
def _fused_jvp(method, config, primals, tangents):
    """The kernel's value; the tangent is the reference's JVP under ``jax.checkpoint``: reverse mode
    (linearise, then transpose) keeps only the inputs and recomputes the reference in the backward, as
    a VJP of it would, and forward mode (jvp, jacfwd) runs the reference's JVP. A custom_vjp had the
    same backward but refused forward mode."""
    reference = config[-1]
    if reference is None:
        raise ValueError(
            "fused_layer_scores was called without reference=: its derivative is the pure-JAX "
            "reference's (latim_jax.latim.scores.blocked_scores), so pass one to differentiate"
        )
    f, rows, aux = primals
    df, _, daux = tangents
    out = _fused_custom(f, method, rows, aux, config)
    ref = jax.checkpoint(lambda f_, aux_: reference(f_, method, rows, aux_))
    _, tangent = jax.jvp(ref, (f, aux), (df, daux))
    return out, tangent


def fused_layer_scores(
    f,
    method: str,
    rows,
    *,
    aux=None,
    block_sizes: Blocks | None = None,
    precision: str = "float32",
    reference=None,
    platform=None,
    interpret=None,
    chip=None,
):
    """Unnormalised scores (b, len(rows), l) of one layer, fp32, T never materialised.

    f: a :class:`latim_jax.latim.mamba.MambaFactors`; method: "l2" | "l1" | "alti" | "logit" (alti
    before row normalisation: the caller normalises; logit needs aux (b, l, e), the per-target
    readout q). rows: (r,) int target positions. block_sizes: :class:`~latim_jax.kernels.block_sizes.
    Blocks` (None fields: ``Blocks.for_platform``'s). precision: "float32" (HIGHEST matmuls) or
    "bfloat16" (DEFAULT). reference: ``reference(f, method, rows, aux) -> (b, r, l)``, the pure-JAX
    path this kernel equals to fp32 rounding; the derivative is its (rematerialised) JVP, in either
    mode (None: not differentiable).
    platform: "tpu" | "gpu" kernel variant (None: the default backend; on CPU the TPU variant);
    interpret: None runs interpret mode exactly on CPU; chip: the TPU generation compiled for ("v4",
    "v5e", "v5p", "v6e"; None: the running TPU's, else budgeted as the smallest): its scoped-VMEM
    limit, and tiles whose buffers overflow it are refused before compiling (a ValueError naming
    the largest tile that fits; :mod:`latim_jax.kernels.vmem`). The library passes all three from
    its execution context. vmappable.
    """
    if method not in METHODS:
        raise ValueError(f"fused scores support {METHODS}, found {method!r}")
    if method == "logit" and aux is None:
        raise ValueError("method 'logit' needs aux (b, l, e)")
    _precision(precision)
    rows = jnp.asarray(rows, jnp.int32)
    if rows.ndim != 1 or rows.shape[0] < 1:
        raise ValueError(f"rows must be a non-empty 1-D index array, found shape {rows.shape}")
    target, interpret = resolve_target(platform, interpret)
    block_sizes = (block_sizes or Blocks()).over(Blocks.for_platform("cpu" if interpret else target))
    if f.ssm.version == 2 and f.ssm.heads % f.ssm.B.shape[2]:
        raise ValueError(f"heads h={f.ssm.heads} must be a multiple of groups g={f.ssm.B.shape[2]}")
    aux = None if method != "logit" else aux
    chip = None if chip is None else check_chip(chip)
    config = (block_sizes, precision, target, interpret, chip, reference)
    return _fused_custom(f, method, rows, aux, config)
