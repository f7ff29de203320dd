"""Per-layer token-to-token scores, evaluated in tiles so the (l, l, d) tensor never exists.

Row i = target position, column j = source. With T_{ij} = T_i(x_j) (the layer kind's factors,
:mod:`latim_jax.latim.kinds`), the residual h_i entering the layer and hout_i = h_i + o_i
(docs/method.md, section 5):

    l2     c_ij = ||T_ij||_2                 l1  c_ij = ||T_ij||_1
    alti   c_ij = max(0, ||hout_i||_1 - ||hout_i - T'_ij||_1), T'_ij = T_ij + [i=j] h_i, rows sum to 1
           (a row with no positive entry, possible when the bias terms dominate, puts 1 on j = i, so
           every row is a distribution and rollouts stay row-stochastic)
    logit  c_ij = E_w . (g_f * T_ij) / r_i   (w = the target vocabulary entry of row i)
    hidden_attention  see :mod:`latim_jax.latim.hidden_attention`

Every score is exactly 0 above the diagonal (j > i) and on the rows and columns of padding
(:func:`finish_scores` masks explicitly, before and after alti's normalisation).

Where a layer's scores run is decided by the execution context (:class:`latim_jax.parallel.context.
Context`), in :func:`layer_scores` alone: split over a mesh (:func:`_split_layer_scores`: prompts, rows
and, over "seq", source columns), the fused Pallas kernel (``ctx.kernels``, l2 / l1 / alti / logit of
the Mamba kinds), or the tiled XLA path (:func:`blocked_scores`, also the kernel's reference and
backward).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from latim_jax.kernels import f32, fused_scores
from latim_jax.kernels.block_sizes import Blocks
from latim_jax.kernels.fused_scores_tiles import alti_gain_signed
from latim_jax.latim import source_window
from latim_jax.latim.blocking import as_rows, blocked, row_tiles
from latim_jax.latim.hidden_attention import (
    AGGREGATIONS,
    DEFAULT_AGGREGATION,
    hidden_attention_range,
    hidden_attention_scores,
    minmax_normalise,
)
from latim_jax.latim.kinds import has_ssm, project
from latim_jax.parallel.context import XLA, Context
from latim_jax.parallel.mesh import DATA, MODEL, SEQ, P

LATIM_METHODS = ("l2", "l1", "alti", "logit")
METHODS = LATIM_METHODS + ("hidden_attention", "grad_input")
PRECISIONS = fused_scores.PRECISIONS
__all__ = ["AGGREGATIONS", "DEFAULT_AGGREGATION", "LATIM_METHODS", "METHODS", "PRECISIONS"]


def safe_norm(x, axis):
    """||x||_2 with a finite gradient at 0."""
    sq = jnp.sum(x * x, axis=axis)
    zero = sq == 0  # NaN is not zero: it propagates, so non-finite inputs are reported
    return jnp.where(zero, 0.0, jnp.sqrt(jnp.where(zero, 1.0, sq)))


def pair_score(f, method: str, rows, j0, blocks: Blocks, aux=None, precision: str = "float32"):
    """Scores of pairs (i in rows, j in [j0, j0 + blocks.cols)): (b, r, cols), unnormalised;
    "logit+alti": both, (b, r, cols, 2), from the same pair values."""
    cf = f.channels_first  # the kind's own layout of V (Mamba-1: channels first, ~4% faster per layer)
    V = f.pair_values(rows, j0, blocks.cols, blocks, channels_first=cf)  # (b, r, q, e) or (b, e, r, q)
    lg = "berj,bre->brj" if cf else "brje,bre->brj"
    if method == "logit":
        return jnp.einsum(lg, V, aux[:, rows])
    if method == "logit+alti":
        logit = jnp.einsum(lg, V, aux[:, rows])
        return jnp.stack([logit, _alti_raw(f, project(V, f.W_out, precision, cf), rows, j0)], -1)
    T = project(V, f.W_out, precision, cf)
    if method == "l2":
        return safe_norm(T, -1)
    if method == "l1":
        return jnp.sum(jnp.abs(T), axis=-1)
    if method == "alti":
        return _alti_raw(f, T, rows, j0)
    raise ValueError(f"unknown LaTIM score {method!r}; expected one of {LATIM_METHODS}")


def _alti_raw(f, T, rows, j0):
    """max(0, ||hout_i||_1 - ||hout_i - T'_ij||_1) for T (b, r, q, d), before normalisation."""
    hout = (f.h + f.output)[:, rows]  # (b, r, d); the bias terms are part of o
    sign, two_abs = jnp.where(hout >= 0, 1.0, -1.0), 2.0 * jnp.abs(hout)  # per row, not per pair
    diag = (rows[:, None] == (j0 + jnp.arange(T.shape[2]))[None, :]).astype(f32)  # (r, q)
    Tp = T + diag[None, :, :, None] * f.h[:, rows][:, :, None]
    gain = alti_gain_signed(sign[:, :, None], two_abs[:, :, None], Tp)
    return jnp.maximum(0.0, jnp.sum(gain, -1))


def blocked_scores(
    f, method: str, rows, aux=None, *, blocks: Blocks | None = None, precision="float32", columns=None
):
    """The tiled XLA path: unnormalised scores (b, len(rows), l) (alti before its row normalisation;
    "logit+alti": (b, r, l, 2)). The fused kernel's reference: its tests compare the two, and its
    backward is this function's VJP.

    Differentiated (either mode), the tiles take ``blocks.tangent_rows`` target rows
    (:class:`~latim_jax.kernels.block_sizes.Blocks`): the same values, in one loop of smaller tiles, so
    the backward holds a smaller tile's copies while the plain forward keeps its faster tiles. Smaller
    tiles in the one loop, not passes inside each tile: a loop of passes would accumulate its own
    full-size cotangents of the closed-over factors (see :func:`~latim_jax.latim.blocking.blocked`).
    ``columns``: (start, width), the sources [start, start + width) only: (b, len(rows), width)."""
    rows = as_rows(rows)
    blocks = f.tiles(rows.shape[0], blocks)

    def scores(f, aux, blocks):
        def tile(rb, j0):
            return pair_score(f, method, rb, j0, blocks, aux, precision)

        return blocked(tile, rows, f.length, blocks, columns=columns)

    t = blocks.tangent_rows
    if t is None or t >= blocks.rows:
        return scores(f, aux, blocks)
    tangent_blocks = dataclasses.replace(blocks, rows=t)

    @jax.custom_jvp
    def value(f, aux):
        return scores(f, aux, blocks)

    @value.defjvp
    def _tangent(primals, tangents):
        return jax.jvp(lambda f, aux: scores(f, aux, tangent_blocks), primals, tangents)

    return value(f, aux)


def _kernel_reference(f, method, rows, aux):
    return blocked_scores(f, method, rows, aux)


def layer_scores(
    f,
    method: str,
    rows,
    *,
    mask,
    ctx: Context = XLA,
    blocks: Blocks | None = None,
    aux=None,
    aggregation: str = DEFAULT_AGGREGATION,
    precision: str = "float32",
):
    """Scores (b, len(rows), l) of one layer, finished by :func:`finish_scores` (causal, padding
    masked, alti rows normalised to sum 1); "logit+alti": the pair (logit, alti), from one pass over
    the tiles on the XLA path (the logit rollout needs both). ``mask`` (b, l) bool of valid positions;
    ``aggregation``: hidden attention only; ``precision``: the projection onto W_out in fp32 or bf16
    with fp32 accumulation (:func:`project`; the fused kernel: DEFAULT matmul precision).
    """
    if ctx.split:
        return _split_layer_scores(f, method, rows, mask, blocks, aux, ctx, aggregation, precision)
    if method == "hidden_attention":
        blocks = f.tiles(rows.shape[0], blocks)
        if has_ssm(f):
            s = hidden_attention_scores(f.ssm, rows, mask, blocks, aggregation)
        else:  # attention: its own weights; token-wise: the identity (no range to rescale)
            s = blocked(lambda rb, j0: f.attention_map(rb, j0, blocks.cols), rows, f.length, blocks)
        return finish_scores(s, method, rows, mask)
    kernels = ctx.kernels and has_ssm(f)  # the fused kernel builds the Mamba kinds' tiles
    if kernels and method == "logit+alti":
        common = dict(mask=mask, ctx=ctx, blocks=blocks, precision=precision)
        return layer_scores(f, "logit", rows, aux=aux, **common), layer_scores(f, "alti", rows, **common)
    if f.form == "diagonal":  # a token-wise kind: only (i, i) pairs, no tiles
        s = f.diagonal_scores(method, rows, aux)
    elif kernels:
        s = fused_scores.fused_layer_scores(
            f, method, rows, aux=aux, block_sizes=blocks, precision=precision, reference=_kernel_reference,
            **ctx.kernel_target(),
        )  # fmt: skip
    else:
        s = blocked_scores(f, method, rows, aux, blocks=blocks, precision=precision)
    if method == "logit+alti":
        return finish_scores(s[..., 0], "logit", rows, mask), finish_scores(s[..., 1], "alti", rows, mask)
    return finish_scores(s, method, rows, mask)


def _split_layer_scores(f, method, rows, mask, blocks, aux, ctx: Context, aggregation, precision):
    """:func:`layer_scores` inside ``jax.shard_map``: prompts over "data", target rows over "model"
    (rows padded to a multiple of the axis by repeating the last one) and, when the mesh has a "seq"
    axis that splits the length, the source columns over "seq": the device at seq index s scores its
    rows against the sources [s w, (s + 1) w), w = l / D (the layer's length is a multiple of D: the
    forward pads it), so the score work and the output are split D ways.

    Over "seq" a device keeps the factors where the split forward built them: a kind that scores its
    own window (``sequence_local``, :mod:`latim_jax.latim.source_window`) holds its w sources, their
    halo and a group of the asked rows' row fields, compacted into one short sequence; any other (the
    shared block, attention with a sliding window, the minmax hidden attention, whose range spans every
    pair) has the layer's factors gathered whole (O(l e) per device). What crosses devices besides:
    alti's row sums (a psum over "seq" before the normalisation) and the minmax hidden attention's
    range, which spans every row: each device takes the range over its share of all rows, the shares
    combine by a min and a max over "model" and "seq", and each device's asked rows (the plain channel
    mean) are rescaled by it: the whole range computed once across the mesh, not once per device.
    Without "seq" a device runs the one-device path (:func:`layer_scores`, the fused kernel included);
    with it a compacted window of the Mamba kinds runs the fused kernel over all its slots (the kernel
    takes no column window: the few columns past the window, its halo and the asked rows' slots, are
    scored and cut off), any other the XLA tiles with the column window.

    Returns the scores (b, r, l) (and the pair for "logit+alti"), split over "seq" on their last axis."""
    b, r, length = f.h.shape[0], rows.shape[0], f.length
    m, d = ctx.axis_size(MODEL), ctx.axis_size(SEQ)
    if length % d:
        raise ValueError(f'the "seq" axis ({d} devices) must divide the layer\'s length {length}')
    width, seq = length // d, ctx.axis(SEQ)
    data = ctx.axis(DATA) if b % ctx.axis_size(DATA) == 0 else None
    rows_p = row_tiles(rows, m).reshape(-1)
    batch = P(data)
    minmax = method == "hidden_attention" and aggregation == "minmax" and has_ssm(f)
    local = seq is not None and not minmax and f.sequence_local and width % f.slot_unit == 0  # else gathered
    # the fused Pallas kernel (Mamba kinds, LaTIM scores) on a compacted window: it scores all of its
    # slots, the 1 + (K - 1) + g past the window's w too, and those columns are cut off
    kernels = local and ctx.kernels and has_ssm(f) and method in LATIM_METHODS + ("logit+alti",)
    axes = tuple(a for a in (ctx.axis(MODEL), seq) if a is not None)
    all_rows = row_tiles(jnp.arange(length), m * d).reshape(m * d, -1)  # each device's share of every row
    tiles_ = f.tiles(rows_p.shape[0] // m, blocks)
    if tiles_.cols > width:  # a tile no wider than a device's share of the columns
        tiles_ = dataclasses.replace(tiles_, cols=width)

    def window(f, rows, aux, mask, start):
        """The unnormalised scores of ``rows`` against the sources [start, start + width)."""
        columns = (start, width)
        if kernels:  # the fused kernel scores every slot of the compacted window; the window is cut out
            def fused(method):
                return fused_scores.fused_layer_scores(
                    f, method, rows, aux=aux, block_sizes=blocks, precision=precision,
                    reference=_kernel_reference, **ctx.kernel_target(),
                )[:, :, start : start + width]  # fmt: skip

            return jnp.stack([fused("logit"), fused("alti")], -1) if method == "logit+alti" else fused(method)
        if method == "hidden_attention":
            signed = "signed" if minmax else aggregation
            if has_ssm(f):
                return hidden_attention_scores(f.ssm, rows, mask, tiles_, signed, columns=columns)
            return blocked(lambda rb, j0: f.attention_map(rb, j0, tiles_.cols), rows, f.length, tiles_,
                           columns=columns)  # fmt: skip
        if f.form == "diagonal":
            return jax.lax.dynamic_slice_in_dim(f.diagonal_scores(method, rows, aux), start, width, axis=2)
        return blocked_scores(f, method, rows, aux, blocks=tiles_, precision=precision, columns=columns)

    def scores(f, rows, aux, mask):
        if seq is None and not minmax:
            return layer_scores(
                f, method, rows, mask=mask, ctx=ctx.local(), blocks=blocks, aux=aux, aggregation=aggregation,
                precision=precision,
            )  # fmt: skip
        start = jax.lax.axis_index(seq) * width if seq else 0
        if local:  # this device's sources, their halo and the asked rows only, a group of rows at a time
            def group(rows):
                fc, slots, auxc = source_window.compact(f, rows, aux, width=width, seq=seq)
                return finish(window(fc, slots, auxc, mask, f.slot_unit), rows, mask, start)

            return source_window.by_groups(group, rows)
        if seq is None:  # minmax without "seq": the one-device path's signed map, rescaled below
            s = layer_scores(f, method, rows, mask=mask, ctx=ctx.local(), blocks=blocks, aggregation="signed")
        else:
            s = window(f, rows, aux, mask, start)
        if minmax:
            share = all_rows[jax.lax.axis_index(axes)] if axes else all_rows[0]
            lo, hi = hidden_attention_range(f.ssm, mask, tiles_, share)
            if axes:
                lo, hi = jax.lax.pmin(lo, axes), jax.lax.pmax(hi, axes)
            s = minmax_normalise(s, lo, hi)
        return finish(s, rows, mask, start)

    def finish(s, rows, mask, start):
        if method == "logit+alti":
            return (finish_scores(s[..., 0], "logit", rows, mask, start, seq),
                    finish_scores(s[..., 1], "alti", rows, mask, start, seq))  # fmt: skip
        return finish_scores(s, method, rows, mask, start, seq)

    specs, aux_spec = factor_specs(f, batch, data), None if aux is None else batch
    if local:  # the per-position arrays stay split as the forward built them
        specs, aux_spec = source_window.split_specs(f, specs, seq), None if aux is None else P(data, seq)
    out_spec = P(data, ctx.axis(MODEL), seq)
    out = jax.shard_map(
        scores, mesh=ctx.mesh, in_specs=(specs, P(ctx.axis(MODEL)), aux_spec, batch),
        out_specs=(out_spec, out_spec) if method == "logit+alti" else out_spec, check_vma=False,
    )(f, rows_p, aux, mask)  # fmt: skip
    return jax.tree.map(lambda s: s[:, :r], out)


def factor_specs(f, batch, data):
    """The PartitionSpecs of the factors ``f`` inside the score stage's shard_map: every per-prompt array
    split over "data" (``batch``), the output matrix and the SSM's A, D replicated, the Mamba tap values
    (K, b, l, e) split on their batch axis; a kind made of parts (``parts``: a parallel block) applies
    this to each part; a kind's arrays without a batch axis (``replicated``: weights) are replicated."""
    specs = jax.tree.map(lambda _: batch, f)
    if f.W_out is not None:
        specs = dataclasses.replace(specs, W_out=P())
    specs = dataclasses.replace(specs, **{name: P() for name in f.replicated})
    if has_ssm(f):
        specs = dataclasses.replace(specs, a=P(None, data), ssm=dataclasses.replace(specs.ssm, A=P(), D=P()))
    for name in f.parts:
        specs = dataclasses.replace(specs, **{name: factor_specs(getattr(f, name), batch, data)})
    return specs


def kept_pairs(rows, length: int, mask, start=0):
    """(b, r, length) bool: source j <= target i, both real positions (``mask`` (b, l) bool). ``start``:
    the first source column when ``length`` is a window of the l columns (a device's share of them on
    a mesh's "seq" axis; may be traced)."""
    cols = start + jnp.arange(length)
    causal = (cols[None, :] <= rows[:, None])[None]
    whole = isinstance(start, int) and start == 0 and length == mask.shape[1]
    valid = mask if whole else jax.lax.dynamic_slice_in_dim(mask, start, length, axis=1)
    return causal & mask[:, rows, None] & valid[:, None, :]


def finish_scores(s, method: str, rows, mask, start=0, seq=None):
    """Zero every pair above the diagonal or touching padding, explicitly (float noise of two reductions
    is not zero); alti rows are then normalised over their kept entries and masked again. ``start``,
    ``seq``: s holds the source columns [start, start + w) of rows split over the mesh axis ``seq``
    (alti's row sums then add over it)."""
    keep = kept_pairs(rows, s.shape[-1], mask, start)
    s = jnp.where(keep, s, 0.0)
    if method == "alti":
        s = jnp.where(keep, normalise_alti(s, rows, start, seq), 0.0)
    return s


def normalise_alti(s, rows, start=0, seq=None):
    """Divide each row by its sum; a row with no positive entry becomes one-hot on j = i. ``start``,
    ``seq``: as :func:`finish_scores`."""
    total = jnp.sum(s, -1, keepdims=True)
    if seq is not None:
        total = jax.lax.psum(total, seq)
    self_hot = ((start + jnp.arange(s.shape[-1]))[None, :] == rows[:, None]).astype(s.dtype)
    zero = total == 0
    return jnp.where(zero, self_hot, s / jnp.where(zero, 1.0, total))


def token_sum(f, rows, *, blocks: Blocks | None = None):
    """sum_j T_i(x_j) for i in rows, accumulated tile by tile in the one block loop: (b, r, d)."""
    blocks = f.tiles(None, blocks)
    br = blocks.rows

    def tile(rb, j0):
        return None, f.pair_values(rb, j0, blocks.cols, blocks).sum(2)  # (b, br, e)

    def add(acc, part, ri):
        return jax.lax.dynamic_update_slice_in_dim(
            acc, jax.lax.dynamic_slice_in_dim(acc, ri * br, br, 1) + part, ri * br, 1
        )

    n_rb = -(-rows.shape[0] // br)
    e = f.h.shape[-1] if f.W_out is None else f.W_out.shape[0]
    init = jnp.zeros((f.h.shape[0], n_rb * br, e), f32)
    _, V = blocked(tile, rows, f.length, blocks, init=init, combine=add)
    return project(V[:, : rows.shape[0], None], f.W_out)[:, :, 0]
