"""A Pallas kernel for the delta rule's hidden attention tiles: M[rows, c0 : c0 + w] per head from the
layer's per-chunk factors (docs/method.md, section 15), what :func:`latim_jax.kernels.delta_rule.m_tile`
computes with an XLA scan.

Shape letters: b batch, H value heads, n chunks of C positions, k key dim, r target rows, w source
columns (the tile's width), wt the width tile of one program; a trailing p marks a padded size
(Cp, kp, rp, wp). Paper symbols (kernels/delta_rule.py, :class:`~latim_jax.kernels.delta_rule.
TileFactors`): per chunk I the local block L_I (C, C), the injection B_I (k, C), the readout R_I (C, k)
and the carry P_I (k, k); for a target t = I C + i and a source j = J C + a,

    M[t, j] = L_I[i, a] (J = I),   R_I[i] P_{I-1} ... P_{J+1} B_J[:, a] (J < I),   0 (J > I).

The kernel walks the chunks in order carrying Y (k, wt), the state that the tile's columns have put
in, and reads and writes with one-hot selections built from iota compares, so no gather runs inside:

    Sc[a, w] = [c0 + w = I C + a]      (Cp, wt)  the tile's columns that lie in chunk I
    Sr[t, a] = [rows_t = I C + a]      (rp, Cp)  the tile's rows that lie in chunk I
    out     += Sr (R_I Y + L_I Sc)     (rp, wt)  (each row lies in one chunk: written once)
    Y       <- P_I Y + B_I Sc          (kp, wt)

Chunks before the first column's or after the last row's are skipped (first = c0 // C, last = the
last row's chunk), as is (on TPU) the read of a chunk holding none of the rows. Rows may be any positions in
any order, repeated; columns past the end are 0 (they match no position). The one-hot products are
exact at HIGHEST precision, so the kernel equals the scan to fp32 rounding of the same products.

Two variants, both run by interpret mode on CPU:
- "tpu" (Mosaic): grid (b, H, width tiles, n), the chunk axis last and "arbitrary"; Y in a VMEM
  scratch (kp, wt) and the output block (rp, wt) resident across the chunk axis (an accumulator).
  Scalar-prefetched [c0, first, last, lo, hi, rows-in-chunk flags]: steps outside [first, last]
  compute nothing and their index maps clamp to [lo, hi], so they fetch no new factor blocks. The
  factor blocks are whole (C, C), (k, C), (C, k), (k, k) matrices (a block equal to the array's last
  two dims is legal at any size), C, k and the rows zero-padded to multiples of 8 only, the width tile
  a multiple of 128: padding C and k to 128 would copy every chunk's factors at up to (128 / C)^2 times
  their size for each tile (256x for the tiny hybrid's C = k = 8: 128 MiB of temporaries for its last
  row at L = 1024, docs/performance.md); chunk-sized matmuls with fewer than 128 lanes are
  left to Mosaic's masking (compiled with real Mosaic for v4, v5e, v5p and v6e by
  benchmarks/tpu_compile.py, unchanged; not run on a TPU).
- "gpu" (Triton): grid (b, H, width tiles), all parallel, no scratch; each program holds its head's
  factors for every chunk in global memory and loops over chunks first..last with ``fori_loop``,
  carrying (Y, out) as loop values. Every in-kernel size is a power of two >= 16 (padded: a chunk or
  key dim that is not one is copied padded for each tile, 4x the factors at C = k = 8).
Zero padding is harmless: a padded local index a >= C of chunk I names position (I + 1) C + a - C,
but the factor rows and columns it selects (L_I, B_I columns; L_I, R_I rows) are zero.

VMEM (TPU), double-buffered blocks: one chunk's four factors (Cp^2 + 2 Cp kp + kp^2), the rows
(rp, 1) and the output (rp, wt); scratch Y (kp, wt); in-body temporaries counted as (Cp, wt) x 3,
(rp, Cp) and (kp, wt) (:func:`tpu_blocks`). Tiles over the chip's scoped limit are refused before
the pallas_call, naming the chip, the limit and the largest rows x width tile that fits
(:mod:`latim_jax.kernels.vmem`).

Differentiation: no backward kernel. The kernel is a ``custom_jvp`` whose tangent is the JVP of the
XLA reference (:func:`latim_jax.kernels.delta_rule.m_tile`) under ``jax.checkpoint``, as the fused
score kernel's: reverse mode (grad, vjp) runs the reference's VJP, recomputing the reference in the
backward (its residuals: Y and one chunk's factors per step for the tile being differentiated),
and forward mode (jvp, jacfwd) its JVP, so the kernel differentiates wherever the XLA path does.
vmap adds a parallel grid axis (a batched c0 or batch of rows runs the kernel once per batch entry).

Order of this file: kernel bodies, block shapes and the VMEM check, the two drivers, the public
function with its custom_jvp.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from latim_jax.kernels import delta_rule, f32, vmem
from latim_jax.kernels.block_sizes import (
    gpu_compiler_params,
    next_pow2,
    pad_axis,
    resolve_target,
    round_up,
    tpu_compiler_params,
)
from latim_jax.parallel.chips import check_chip

_sq = pl.squeezed
TPU_WIDTH_TILE = 512  # columns per TPU program (a multiple of 128)
GPU_WIDTH_TILE = 32  # columns per GPU program: Y (kp, wt) and out (rp, wt) live in registers
GPU_NUM_WARPS = 4
_HEAD = 5  # scalar slots before the per-chunk row flags: c0, first, last, lo, hi


def _dot(a, b):  # (m, k) (k, n) -> (m, n), fp32 passes: exact on one-hot operands
    return jnp.dot(a, b, precision=lax.Precision.HIGHEST, preferred_element_type=f32)


def _selections(c0, w0, rows_col, chunk, C: int, Cp: int, wt: int):
    """(Sc (Cp, wt), Sr (rp, Cp)) of chunk ``chunk`` (module docstring) for the columns c0 + w0 + [0,
    wt) and the target rows ``rows_col`` (rp, 1). A padded local index a >= C names a position of the
    next chunk, but selects only zeros: the padded rows and columns of the chunk's factors."""
    base = chunk * C
    col = c0 + w0 + lax.broadcasted_iota(jnp.int32, (Cp, wt), 1)
    Sc = jnp.where(col == base + lax.broadcasted_iota(jnp.int32, (Cp, wt), 0), 1.0, 0.0).astype(f32)
    at = base + lax.broadcasted_iota(jnp.int32, (rows_col.shape[0], Cp), 1)
    Sr = jnp.where(rows_col == at, 1.0, 0.0).astype(f32)
    return Sc, Sr


def _kernel_tpu(sc_ref, rows_ref, loc_ref, inj_ref, rd_ref, car_ref, out_ref, y_ref, *, C: int):
    """One (prompt, head, width tile, chunk) step. Blocks: rows (rp, 1) int32; local (Cp, Cp); inject
    (kp, Cp); readout (Cp, kp); carry (kp, kp); out (rp, wt), resident over the chunk axis; scratch
    Y (kp, wt)."""
    i, wi = pl.program_id(3), pl.program_id(2)
    Cp, wt = loc_ref.shape[0], out_ref.shape[1]

    @pl.when(i == 0)
    def _():
        y_ref[...] = jnp.zeros(y_ref.shape, f32)
        out_ref[...] = jnp.zeros(out_ref.shape, f32)

    @pl.when((i >= sc_ref[1]) & (i <= sc_ref[2]))
    def _():
        Sc, Sr = _selections(sc_ref[0], wi * wt, rows_ref[...], i, C, Cp, wt)
        Y = y_ref[...]

        @pl.when(sc_ref[_HEAD + i] > 0)
        def _():
            Z = _dot(rd_ref[...], Y) + _dot(loc_ref[...], Sc)  # (Cp, wt): what chunk i's positions read
            out_ref[...] += _dot(Sr, Z)

        y_ref[...] = _dot(car_ref[...], Y) + _dot(inj_ref[...], Sc)


def _kernel_gpu(sc_ref, rows_ref, loc_ref, inj_ref, rd_ref, car_ref, out_ref, *, C: int):
    """One (prompt, head, width tile) program. Blocks: scalars (S,) int32; rows (rp,) int32; local
    (n, Cp, Cp); inject (n, kp, Cp); readout (n, Cp, kp); carry (n, kp, kp); out (rp, wt). A
    fori_loop over chunks first..last carries (Y (kp, wt), out (rp, wt))."""
    Cp, kp = loc_ref.shape[1], car_ref.shape[1]
    rp, wt = out_ref.shape
    c0, w0 = sc_ref[0], pl.program_id(2) * wt
    rows_col = rows_ref[...][:, None]

    def body(i, carry):
        Y, out = carry
        Sc, Sr = _selections(c0, w0, rows_col, i, C, Cp, wt)
        Z = _dot(rd_ref[i], Y) + _dot(loc_ref[i], Sc)
        return _dot(car_ref[i], Y) + _dot(inj_ref[i], Sc), out + _dot(Sr, Z)

    init = (jnp.zeros((kp, wt), f32), jnp.zeros((rp, wt), f32))
    _, out = lax.fori_loop(sc_ref[3], sc_ref[4] + 1, body, init)
    out_ref[...] = out


# --------------------------------------------------------------------------------------------------
# Block shapes, padding and the VMEM budget
# --------------------------------------------------------------------------------------------------


def tpu_blocks(Cp: int, kp: int, rp: int, wt: int):
    """(input block shapes in the pallas_call's order, output block, scratch shapes, in-body
    temporaries in bytes) of the TPU variant: what its VMEM holds."""
    ins = [(rp, 1), (Cp, Cp), (kp, Cp), (Cp, kp), (kp, kp)]
    temporaries = 3 * vmem.padded_bytes((Cp, wt)) + vmem.padded_bytes((rp, Cp)) + vmem.padded_bytes((kp, wt))
    return ins, (rp, wt), [(kp, wt)], temporaries


def tpu_need(Cp: int, kp: int, rp: int, wt: int) -> vmem.Need:
    """The TPU variant's VMEM for these padded sizes."""
    ins, out, scratch, temporaries = tpu_blocks(Cp, kp, rp, wt)
    return vmem.need([*ins, out], scratch, temporaries)


def _check_tpu_vmem(Cp: int, kp: int, rp: int, wt: int, chip, limit_asked) -> int:
    """The scoped-VMEM limit to pass; refuses (:class:`~latim_jax.kernels.vmem.VmemOverflow`) tiles whose
    buffers overflow it, naming the largest rows x width tile that fits."""
    chip, known = vmem.target_chip(chip)
    limit = vmem.scoped_limit(chip, limit_asked)

    def fits():
        ok = lambda t: vmem.fits_limit(tpu_need(Cp, kp, *t), limit)  # noqa: E731
        best = vmem.largest([(r, w) for r in vmem.steps(rp, 8) for w in vmem.steps(wt, 128)], ok)
        if best is None:
            return f"no tile fits at chunk {Cp} and key dim {kp} (padded): take a smaller chunk"
        return f"the largest tile that fits: {best[0]} rows x {best[1]} columns (smaller score tiles)"

    tile = f"{rp} rows x {wt} columns (chunk {Cp}, key dim {kp}, padded)"
    vmem.check("delta-rule M tile kernel", tile, tpu_need(Cp, kp, rp, wt), chip, known, limit, fits)
    return limit


def _pad(x, rows: int, cols: int):
    """Zero-pad the last two axes of x up to (rows, cols) (no copy where nothing changes)."""
    return pad_axis(pad_axis(x, -2, rows), -1, cols)


def _scalars(rows, c0, n: int, C: int):
    """[c0, first, last, lo, hi, has_0 .. has_{n-1}] int32: the first column's chunk, the last row's,
    both clamped into [0, n) as lo <= hi (the chunks the index maps visit), and whether each chunk
    holds a row."""
    c0 = jnp.asarray(c0, jnp.int32)
    row_chunk = lax.div(rows, jnp.int32(C))
    first = lax.div(jnp.maximum(c0, 0), jnp.int32(C))
    last = jnp.max(jnp.where(rows >= 0, row_chunk, -1))
    lo = jnp.clip(first, 0, n - 1)
    hi = jnp.clip(last, lo, n - 1)
    has = jnp.any((row_chunk[None, :] == jnp.arange(n)[:, None]) & (rows >= 0)[None, :], axis=1)
    return jnp.concatenate([jnp.stack([c0, first, last, lo, hi]), has.astype(jnp.int32)])


def _sizes(target: str, C: int, k: int, r: int, width: int, width_tile):
    """(Cp, kp, rp, wt, wp): the padded sizes of a variant."""
    if target == "tpu":
        wt = min(width_tile or TPU_WIDTH_TILE, round_up(width, 128))
        if wt % 128:
            raise ValueError(f"the TPU M-tile kernel needs a width tile multiple of 128, found {wt}")
        Cp, kp, rp = round_up(C, 8), round_up(k, 8), round_up(r, 8)
    else:
        wt = min(width_tile or GPU_WIDTH_TILE, max(next_pow2(width), 16))
        if wt & (wt - 1) or wt < 16:
            raise ValueError(f"the GPU M-tile kernel needs a width tile a power of two >= 16, found {wt}")
        Cp, kp, rp = (max(next_pow2(x), 16) for x in (C, k, r))
    return Cp, kp, rp, wt, round_up(width, wt)


# --------------------------------------------------------------------------------------------------
# Drivers
# --------------------------------------------------------------------------------------------------


def _forward(factors: delta_rule.TileFactors, rows, c0, width: int, config):
    target, interpret, chip, limit_asked, width_tile = config
    b, n, H, C, _ = factors.local.shape
    k, r = factors.carry.shape[-1], rows.shape[0]
    Cp, kp, rp, wt, wp = _sizes(target, C, k, r, width, width_tile)
    sc = _scalars(rows, c0, n, C)
    rows_p = jnp.full((rp,), -1, jnp.int32).at[:r].set(rows)  # padding rows: sliced off below
    loc, inj = _pad(factors.local, Cp, Cp), _pad(factors.inject, kp, Cp)
    rd, car = _pad(factors.readout, Cp, kp), _pad(factors.carry, kp, kp)
    out_shape = jax.ShapeDtypeStruct((b, H, rp, wp), f32)
    nw = wp // wt
    if target == "tpu":
        limit = None if interpret else _check_tpu_vmem(Cp, kp, rp, wt, chip, limit_asked)
        ins, out_block, scratch, _ = tpu_blocks(Cp, kp, rp, wt)

        def chunk_of(bi, h, w, i, s):  # skipped steps repeat a visited chunk's blocks: no new fetch
            return (bi, jnp.minimum(jnp.maximum(i, s[3]), s[4]), h, 0, 0)

        specs = [pl.BlockSpec(ins[0], lambda bi, h, w, i, s: (0, 0))]
        specs += [pl.BlockSpec((_sq, _sq, _sq, *shape), chunk_of) for shape in ins[1:]]
        out = pl.pallas_call(
            functools.partial(_kernel_tpu, C=C),
            out_shape=out_shape,
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=1,
                grid=(b, H, nw, n),
                in_specs=specs,
                out_specs=pl.BlockSpec((_sq, _sq, *out_block), lambda bi, h, w, i, s: (bi, h, 0, w)),
                scratch_shapes=[pltpu.VMEM(shape, f32) for shape in scratch],
            ),
            compiler_params=tpu_compiler_params(("parallel", "parallel", "parallel", "arbitrary"), limit),
            interpret=interpret,
        )(sc, rows_p[:, None], loc, inj, rd, car)
    else:
        sc = pad_axis(sc, 0, next_pow2(sc.shape[0]))  # every Triton block a power of two
        whole = lambda *shape: pl.BlockSpec((_sq, n, _sq, *shape), lambda bi, h, w: (bi, 0, h, 0, 0))  # noqa: E731
        specs = [
            pl.BlockSpec(sc.shape, lambda bi, h, w: (0,)),
            pl.BlockSpec((rp,), lambda bi, h, w: (0,)),
            whole(Cp, Cp),
            whole(kp, Cp),
            whole(Cp, kp),
            whole(kp, kp),
        ]
        out = pl.pallas_call(
            functools.partial(_kernel_gpu, C=C),
            out_shape=out_shape,
            grid=(b, H, nw),
            in_specs=specs,
            out_specs=pl.BlockSpec((_sq, _sq, rp, wt), lambda bi, h, w: (bi, h, 0, w)),
            compiler_params=gpu_compiler_params(GPU_NUM_WARPS),
            interpret=interpret,
        )(sc, rows_p, loc, inj, rd, car)
    return out[:, :, :r, :width]


# --------------------------------------------------------------------------------------------------
# Public function: custom_jvp whose tangent is the XLA reference's JVP, rematerialised
# --------------------------------------------------------------------------------------------------


@functools.partial(jax.custom_jvp, nondiff_argnums=(3, 4))
def _m_tile_custom(factors, rows, c0, width, config):
    return _forward(factors, rows, c0, width, config)


@_m_tile_custom.defjvp
def _m_tile_jvp(width, config, primals, tangents):
    """The kernel's tile; the tangent is the reference's JVP under ``jax.checkpoint`` (reverse mode keeps
    only the factors and recomputes the reference in the backward, as its VJP would)."""
    factors, rows, c0 = primals
    out = _m_tile_custom(factors, rows, c0, width, config)
    ref = jax.checkpoint(lambda f: delta_rule.m_tile(f, rows, c0, width))
    _, tangent = jax.jvp(ref, (factors,), (tangents[0],))
    return out, tangent


def m_tile_pallas(
    factors: delta_rule.TileFactors,
    rows,
    c0,
    width: int,
    *,
    platform=None,
    interpret=None,
    chip=None,
    vmem_limit_bytes=None,
    width_tile=None,
):
    """M[rows, c0 : c0 + width] per head, (b, H, r, width) fp32, from the layer's
    :class:`~latim_jax.kernels.delta_rule.TileFactors`: the value of
    :func:`latim_jax.kernels.delta_rule.m_tile` (same arguments: ``rows`` (r,) int positions in any
    order, repeats allowed; ``c0`` a traced int is fine; columns past the end are 0), computed by the
    Pallas kernel of the module docstring.

    platform: "tpu" | "gpu" kernel variant (None: the default backend; on CPU the TPU variant);
    interpret: None runs interpret mode exactly on CPU; chip: the TPU generation compiled for (None:
    the running TPU's, else budgeted as the smallest), whose scoped-VMEM limit (or
    ``vmem_limit_bytes``) a tile must fit, else it is refused before compiling; width_tile: columns
    per program (TPU a multiple of 128, GPU a power of two; None: 512 / 32). The library passes the
    target from its execution context (:func:`latim_jax.kernels.dispatch.delta_rule_m_tile`).
    Differentiable in both modes through the reference's rematerialised JVP; vmappable."""
    rows = jnp.asarray(rows, jnp.int32)
    if rows.ndim != 1 or rows.shape[0] < 1:
        raise ValueError(f"rows must be a non-empty 1-D index array, found shape {rows.shape}")
    if int(width) < 1:
        raise ValueError(f"width must be a positive int, found {width!r}")
    target, interpret = resolve_target(platform, interpret)
    chip = None if chip is None else check_chip(chip)
    config = (target, interpret, chip, vmem_limit_bytes, width_tile)
    return _m_tile_custom(factors, rows, jnp.asarray(c0, jnp.int32), int(width), config)
