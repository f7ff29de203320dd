"""Per-layer token-to-token scores, evaluated in blocks so the (l, l, d) tensor never exists.

Row i = target position, column j = source. With T_{ij} = T_i(x_j) (latim_jax.decomposition), the
residual h_i entering the layer and hout_i = h_i + o_i (docs/method.md, section 5):

    l2     c_ij = ||T_ij||_2                 l1  c_ij = ||T_ij||_1
    alti   c_ij = max(0, ||hout_i||_1 - ||hout_i - T'_ij||_1), T'_ij = T_ij + [i=j] h_i, rows sum to 1
           (a row with no positive entry, possible when the bias terms dominate, puts 1 on j = i, so
           every row is a distribution and rollouts stay row-stochastic)
    logit  c_ij = E_w . (g_f * T_ij) / r_i   (w = the target vocabulary entry of row i)
    hidden_attention  c_ij = an aggregation over channels (Mamba-1) / heads (Mamba-2) of M_{i,j}
           without D (:data:`AGGREGATIONS`): "minmax" (default; Ali et al.'s released code) =
           (mean_c M_ij[c] - m) / (M - m) with m, M the min and max of the layer's whole per-channel
           tensor over the prompt's causal entries between real tokens (all rows, whatever rows are
           asked, so a row subset equals the full map's rows); "abs" = mean_c |M_ij[c]|; "signed" =
           mean_c M_ij[c] (may be negative: no rollout)

Every score is exactly 0 above the diagonal (j > i) and on the rows and columns of padding
(:func:`finish_scores` masks explicitly, before and after alti's normalisation).

Blocks: target rows in blocks of ``block_rows``; for each, a scan over source blocks of
``block_cols`` columns that skips (writes zeros for) blocks entirely above the diagonal. Peak memory
is O(block_rows * block_cols * max(e, d)) per prompt, never O(l^2 d).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from latim_jax.decomposition import LayerFactors, pair_values
from latim_jax.hidden_attention import hidden_attention_block, m1_far_factors
from latim_jax.kernels import fused_scores
from latim_jax.kernels.dispatch import use_pallas
from latim_jax.kernels.fused_scores_tiles import alti_gain_signed
from latim_jax.layers import f32
from latim_jax.sharding import DATA, MODEL, Runtime, as_runtime

LATIM_METHODS = ("l2", "l1", "alti", "logit")
METHODS = LATIM_METHODS + ("hidden_attention", "grad_input")
AGGREGATIONS = ("minmax", "abs", "signed")
DEFAULT_AGGREGATION = "minmax"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Blocks:
    """Block sizes of the blocked score path (rows x source columns per step), positive ints."""

    rows: int = 32
    cols: int = 32

    def __post_init__(self):
        for name in ("rows", "cols"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Blocks.{name} must be a positive int, found {value!r}")

    @classmethod
    def for_layer(cls, version: int, length: int, n_rows: int | None = None) -> Blocks:
        """Defaults: 64 x 64 for Mamba-2, 32 x 32 for Mamba-1 (its per-block values are (r, q, e), not
        Mamba-2's (r, q, h); at 130m shapes and L = 512, 32 x 32 is ~25% faster than 16 x 16 and as
        fast as 64 x 64). At long L, where nearly every tile is a far tile, 64 x 32 costs ~14% less CPU
        per pair (one layer at 4096: 217-219 s against 233-246 s wall), but the gradient at L = 1024
        then peaks at 3.2x the forward (0.917 / 0.286 GiB; 2.7x with 32 x 32), so it is not the
        default; pass ``Blocks(rows=64, cols=32)`` for a forward-only run (the near tiles' direct form
        runs in 32-row passes either way, hidden_attention.M1_DIRECT_ROWS). With few target rows
        (``n_rows`` below the square block's side) the row block shrinks to them and the column block
        grows to keep the block's size: ``rows=[-1]`` does not pay for a whole row block."""
        size = 64 if version == 2 else 32
        cap = max(8, 1 << (max(length, 1) - 1).bit_length())
        size = min(size, cap)
        if n_rows is None or n_rows >= size:
            return cls(rows=size, cols=size)
        rows = 1 << (max(n_rows, 1) - 1).bit_length()
        return cls(rows=rows, cols=min(cap, 1024, size * size // rows))


def safe_norm(x, axis):
    """||x||_2 with a finite gradient at 0."""
    sq = jnp.sum(x * x, axis=axis)
    zero = sq == 0  # NaN is not zero: it propagates, so non-finite inputs are reported
    return jnp.where(zero, 0.0, jnp.sqrt(jnp.where(zero, 1.0, sq)))


PRECISIONS = ("float32", "bfloat16")


def project(V, W_out, precision: str = "float32", channels_first: bool = False):
    """T = V @ W_out over e: (b, r, q, e) x (e, d) -> (b, r, q, d), the score path's dominant matrix
    product; "bfloat16" rounds both operands to bf16 and accumulates in fp32 (matrix units).
    ``channels_first``: V is (b, e, r, q)."""
    if precision == "bfloat16":
        V, W_out = V.astype(jnp.bfloat16), W_out.astype(jnp.bfloat16)
    spec = "berj,ed->brjd" if channels_first else "brje,ed->brjd"
    return jnp.einsum(spec, V, W_out, preferred_element_type=f32)


def pair_score(f: LayerFactors, method: str, rows, j0, width, aux=None, precision: str = "float32"):
    """Scores of pairs (i in rows, j in [j0, j0 + width)): (b, r, width), unnormalised."""
    cf = f.version == 1  # Mamba-1's V channels first (see pair_values): ~4% faster per layer
    V = pair_values(f, rows, j0, width, channels_first=cf)  # (b, r, width, e), or (b, e, r, width)
    lg = "berj,bre->brj" if cf else "brje,bre->brj"
    if method == "logit":
        return jnp.einsum(lg, V, aux[:, rows])
    if method == "logit+alti":  # both from the same V: (b, r, width, 2)
        logit = jnp.einsum(lg, V, aux[:, rows])
        return jnp.stack([logit, _alti_raw(f, project(V, f.W_out, precision, cf), rows, j0, width)], -1)
    T = project(V, f.W_out, precision, cf)
    if method == "l2":
        return safe_norm(T, -1)
    if method == "l1":
        return jnp.sum(jnp.abs(T), axis=-1)
    if method == "alti":
        return _alti_raw(f, T, rows, j0, width)
    raise ValueError(f"unknown LaTIM score {method!r}; expected one of {LATIM_METHODS}")


def _alti_raw(f: LayerFactors, T, rows, j0, width):
    """max(0, ||hout_i||_1 - ||hout_i - T'_ij||_1) for T (b, r, width, d), before normalisation."""
    hout = (f.h + f.output)[:, rows]  # (b, r, d); the bias terms are part of o
    sign, two_abs = jnp.where(hout >= 0, 1.0, -1.0), 2.0 * jnp.abs(hout)  # per row, not per pair
    diag = (rows[:, None] == (j0 + jnp.arange(width))[None, :]).astype(f32)  # (r, width)
    Tp = T + diag[None, :, :, None] * f.h[:, rows][:, :, None]
    gain = alti_gain_signed(sign[:, :, None], two_abs[:, :, None], Tp)
    return jnp.maximum(0.0, jnp.sum(gain, -1))


def blocked(fn, rows, length, blocks: Blocks, out_tail=(), *, neutral=None):
    """Evaluate fn(rows_block, j0) -> (b, block_rows, block_cols, *out_tail) over all causal blocks.

    Returns (b, len(rows), length, *out_tail); blocks above the diagonal are not computed. With
    ``neutral`` (a pytree of small arrays), fn returns (block, extras) with extras shaped like
    neutral, a skipped block gives ``neutral``, and the result is (out, extras stacked over the
    (n_row_blocks * n_col_blocks) blocks) for the caller to reduce. One flat
    loop over (row block, column block) pairs, each rematerialised under differentiation
    (jax.checkpoint): the backward pass recomputes a block's intermediates instead of saving every
    block's, so a gradient holds O(output + one block), like the forward. Flat rather than nested
    (rows outer, columns inner): the cotangents of the closed-over factors are then accumulated at
    one loop level, not two (a nested loop kept both levels' full-size accumulators alive: compiled
    temporaries of one 130m Mamba-1 layer's gradient at L = 4096, 1.08 -> 0.89 GiB).
    """
    n_cb = -(-length // blocks.cols)
    rows_p = padded_row_blocks(rows, blocks)  # (n_rb, br)
    n_rb = rows_p.shape[0]

    @jax.checkpoint  # around the cond: a checkpoint inside a cond's branch is not honoured
    def pair(args):
        ri, j0 = args
        rb = rows_p[ri]

        def compute(_):
            return fn(rb, j0)

        shape = jax.eval_shape(compute, None)

        def skip(_):
            if neutral is None:
                return jnp.zeros(shape.shape, shape.dtype)
            return jnp.zeros(shape[0].shape, shape[0].dtype), neutral

        return jax.lax.cond(j0 <= jnp.max(rb), compute, skip, None)

    ri = jnp.repeat(jnp.arange(n_rb), n_cb)
    j0 = jnp.tile(jnp.arange(n_cb) * blocks.cols, n_rb)
    out = jax.lax.map(pair, (ri, j0))  # (n_rb * n_cb, b, br, bc, ...)
    out, extras = (out, None) if neutral is None else out
    out = out.reshape(n_rb, n_cb, *out.shape[1:])
    out = jnp.moveaxis(out, 2, 0)  # (b, n_rb, n_cb, br, bc, ...)
    out = jnp.swapaxes(out, 2, 3).reshape(out.shape[0], n_rb * blocks.rows, n_cb * blocks.cols, *out_tail)
    out = out[:, : rows.shape[0], :length]
    return out if neutral is None else (out, extras)


def padded_row_blocks(rows, blocks: Blocks):
    """``rows`` (r,) as (n_rb, block_rows), the last block padded by repeating its final row."""
    r = rows.shape[0]
    n_rb = -(-r // blocks.rows)
    rows_p = jnp.concatenate([rows, jnp.full((n_rb * blocks.rows - r,), rows[-1], rows.dtype)])
    return rows_p.reshape(n_rb, blocks.rows)


def map_row_blocks(row_fn, rows, blocks: Blocks):
    """row_fn(rows_block) -> (b, block_rows, ...) over ``rows`` in blocks of ``blocks.rows`` (the last
    block padded by repeating its final row); returns (b, len(rows), ...)."""
    rows_p = padded_row_blocks(rows, blocks)
    res = jax.lax.map(row_fn, rows_p)  # (n_rb, b, br, ...)
    res = jnp.moveaxis(res, 0, 1)
    return res.reshape(res.shape[0], -1, *res.shape[3:])[:, : rows.shape[0]]


def layer_scores(
    f: LayerFactors,
    method: str,
    rows,
    *,
    mask=None,
    blocks: Blocks | None = None,
    aux=None,
    impl="xla",
    aggregation: str = DEFAULT_AGGREGATION,
    precision: str = "float32",
):
    """Scores (b, len(rows), l) of one layer, finished by :func:`finish_scores` (causal, padding
    masked, alti rows normalised to sum 1). ``precision``: the projection onto W_out in fp32 or
    bf16 with fp32 accumulation (:func:`project`; the fused kernel: ScoreBlockSizes.precision).

    ``impl``: "xla" = the blocked pure-JAX path; "pallas" = the fused kernel (kernels/fused_scores.py,
    interpret mode on CPU) for l2/l1/alti/logit; "auto" = the kernel on TPU/GPU, XLA elsewhere.
    ``mask`` (b, l) bool of valid positions or None; ``aggregation``: hidden attention only.
    """
    blocks = blocks or Blocks.for_layer(f.version, f.length, rows.shape[0])
    runtime = as_runtime(impl)
    if runtime.axis_size(DATA) > 1 or runtime.axis_size(MODEL) > 1:
        return _split_layer_scores(f, method, rows, mask, blocks, aux, runtime, aggregation, precision)
    if method == "hidden_attention":
        s = hidden_attention_scores(f, rows, mask=mask, blocks=blocks, aggregation=aggregation)
    elif use_pallas(impl) and method in fused_scores.METHODS:
        s = fused_scores.fused_layer_scores(f, method, rows, aux=aux, block_sizes=_kernel_blocks(precision))
    else:

        def fn(rb, j0):
            return pair_score(f, method, rb, j0, blocks.cols, aux, precision)

        s = blocked(fn, rows, f.length, blocks)
    return finish_scores(s, method, rows, mask)


def _kernel_blocks(precision: str):
    """The fused kernel's default block sizes with ``precision`` (None: all defaults)."""
    if precision == "float32":
        return None
    from latim_jax.kernels.block_sizes import resolve_target

    target, interpret = resolve_target(None, None)
    base = fused_scores.ScoreBlockSizes.for_platform("cpu" if interpret else target)
    return dataclasses.replace(base, precision="default")


def logit_and_alti(
    f: LayerFactors, rows, aux, *, mask=None, blocks: Blocks | None = None, impl="xla", precision="float32"
):
    """(logit scores, alti scores) of one layer, both finished, from ONE pass over the blocks when the
    XLA path runs (the pair values V and contributions T are shared: the logit rollout needs both)."""
    runtime = as_runtime(impl)
    if use_pallas(impl) or runtime.axis_size(DATA) > 1 or runtime.axis_size(MODEL) > 1:
        common = dict(mask=mask, blocks=blocks, impl=impl, precision=precision)
        return layer_scores(f, "logit", rows, aux=aux, **common), layer_scores(f, "alti", rows, **common)
    blocks = blocks or Blocks.for_layer(f.version, f.length, rows.shape[0])

    def fn(rb, j0):
        return pair_score(f, "logit+alti", rb, j0, blocks.cols, aux, precision)

    s = blocked(fn, rows, f.length, blocks, (2,))
    return finish_scores(s[..., 0], "logit", rows, mask), finish_scores(s[..., 1], "alti", rows, mask)


def _split_layer_scores(f, method, rows, mask, blocks, aux, runtime, aggregation, precision="float32"):
    """:func:`layer_scores` inside ``jax.shard_map``: prompts over "data", target rows over "model"
    (rows padded to a multiple of the axis by repeating the last one). Each device holds the whole
    layer's factors for its prompts: rows are independent given them."""
    b, r = f.G.shape[0], rows.shape[0]
    m = runtime.axis_size(MODEL)
    data = runtime.axis(DATA) if b % runtime.axis_size(DATA) == 0 else None
    model = runtime.axis(MODEL)
    rp = -(-r // m) * m
    rows_p = jnp.concatenate([rows, jnp.full((rp - r,), rows[-1], rows.dtype)])
    local = Runtime(impl=runtime.impl)
    batch = P(data)
    specs = dataclasses.replace(
        f, a=P(None, data), G=batch, W_out=P(), A=P(), D=P(), delta=batch, B=batch, C=batch,
        decay=type(f.decay)(batch, batch), bias=batch, output=batch, h=batch,
        token_total=None if f.token_total is None else batch,
    )  # fmt: skip
    args, in_specs = [f, rows_p], [specs, P(model)]
    for extra in (aux, mask):
        if extra is not None:
            args.append(extra)
            in_specs.append(batch)

    def scores(f, rows, *extra):
        extra = list(extra)
        aux_ = extra.pop(0) if aux is not None else None
        mask_ = extra.pop(0) if mask is not None else None
        return layer_scores(
            f, method, rows, mask=mask_, blocks=blocks, aux=aux_, impl=local, aggregation=aggregation,
            precision=precision,
        )  # fmt: skip

    out = jax.shard_map(
        scores, mesh=runtime.mesh, in_specs=tuple(in_specs), out_specs=P(data, model), check_vma=False
    )(*args)
    return out[:, :r]


def kept_pairs(rows, length: int, mask=None):
    """(b or 1, r, l) bool: source j <= target i, both real positions."""
    keep = (jnp.arange(length)[None, :] <= rows[:, None])[None]
    if mask is not None:
        keep = keep & mask[:, rows, None] & mask[:, None, :]
    return keep


def finish_scores(s, method: str, rows, mask=None):
    """Zero every pair above the diagonal or touching padding, explicitly (float noise of two reductions
    is not zero); alti rows are then normalised over their kept entries and masked again."""
    keep = kept_pairs(rows, s.shape[-1], mask)
    s = jnp.where(keep, s, 0.0)
    if method == "alti":
        s = jnp.where(keep, normalise_alti(s, rows), 0.0)
    return s


def normalise_alti(s, rows):
    """Divide each row by its sum; a row with no positive entry becomes one-hot on j = i."""
    total = jnp.sum(s, -1, keepdims=True)
    self_hot = (jnp.arange(s.shape[-1])[None, :] == rows[:, None]).astype(s.dtype)
    zero = total == 0
    return jnp.where(zero, self_hot, s / jnp.where(zero, 1.0, total))


def _hidden_attention(f: LayerFactors, rows, j0, width):
    """M_{i,t} without D for i in rows, t in [j0, j0 + width): (b, r, width, c)."""
    cols = j0 + jnp.arange(width)
    return hidden_attention_block(f.version, f.A, f.D, f.delta, f.B, f.C, f.decay, rows, cols, with_D=False)


def _m1_mean_hidden_attention(f: LayerFactors, rows, j0, width):
    """Mamba-1's mean over channels of M (without D), (b, r, width): on a far tile (every source at or
    before every target) one (r x e n)(e n x q) matrix product, (1/e) sum_{e,n} P[i, e, n] Q[t, e, n]
    (hidden_attention.m1_far_factors), never the (r, q, e) block; other tiles average M."""
    cols = j0 + jnp.arange(width)
    # outside the cond, as in pair_values; the near tiles reuse them
    P, Q = m1_far_factors(f.A, f.delta, f.B, f.C, f.decay, rows, jnp.minimum(cols, f.length - 1))
    e = f.A.shape[0]

    def far(P, Q):
        return jnp.einsum("bren,bqen->brq", P, Q) / e

    def near(P, Q):
        M = hidden_attention_block(
            1, f.A, f.D, f.delta, f.B, f.C, f.decay, rows, cols, with_D=False, factors=(P, Q)
        )
        return jnp.mean(M, axis=-1)

    return jax.lax.cond(jnp.max(cols) <= jnp.min(rows), far, near, P, Q)


def hidden_attention_scores(f: LayerFactors, rows, *, mask=None, blocks: Blocks, aggregation: str):
    """The hidden-attention baseline (b, len(rows), l) with one of :data:`AGGREGATIONS` (module
    docstring). minmax needs the per-prompt range of M over the whole causal triangle: one extra
    blocked pass that keeps only a running min and max (no (l, l) intermediate)."""
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, found {aggregation!r}")

    def pair(rb, j0):
        if f.version == 1 and aggregation != "abs":
            return _m1_mean_hidden_attention(f, rb, j0, blocks.cols)
        M = _hidden_attention(f, rb, j0, blocks.cols)  # (b, r, q, c)
        return jnp.mean(jnp.abs(M) if aggregation == "abs" else M, axis=-1)

    if aggregation == "minmax" and f.version == 2:  # the map and its range from the same blocks
        s, lo, hi = _m2_mean_and_range(f, rows, mask, blocks)
    else:
        s = blocked(pair, rows, f.length, blocks)
        if aggregation != "minmax":
            return s
        lo, hi = hidden_attention_range(f, mask=mask, blocks=Blocks.for_layer(f.version, f.length))
    span = (hi - lo)[:, None, None]
    return jnp.where(span > 0, (s - lo[:, None, None]) / jnp.where(span > 0, span, 1.0), 1.0)


def _m2_mean_and_range(f: LayerFactors, rows, mask, blocks: Blocks):
    """Mamba-2's mean map (b, r, l) over ``rows`` and the (min, max) (b,) of M without D that minmax
    normalises by, from one blocked pass: each block's M also gives its min and max over the kept
    pairs (:func:`_kept_range`, as the range pass). When ``rows`` do not reach every position
    (a row subset, or a device's share of the rows), those blocks miss part of the triangle and the
    separate range pass runs instead (a cond: one of the two executes)."""
    length, b = f.length, f.delta.shape[0]
    valid = jnp.ones((b, length), bool) if mask is None else mask
    valid = jnp.pad(valid, ((0, 0), (0, blocks.cols)))  # a column block may run past the end

    def pair(rb, j0):
        M = _hidden_attention(f, rb, j0, blocks.cols)  # (b, r, q, h); rb are real positions
        return jnp.mean(M, axis=-1), _kept_range(M, rb, j0, valid, length)

    neutral = (jnp.full((b,), jnp.inf, f32), jnp.full((b,), -jnp.inf, f32))
    s, (lo, hi) = blocked(pair, rows, length, blocks, neutral=neutral)
    every_row = jnp.all(jnp.zeros((length,), bool).at[rows].set(True))
    lo, hi = jax.lax.cond(
        every_row,
        lambda: (jnp.min(lo, axis=0), jnp.max(hi, axis=0)),
        lambda: hidden_attention_range(f, mask=mask, blocks=Blocks.for_layer(f.version, length)),
    )
    return s, lo, hi


def hidden_attention_range(f: LayerFactors, *, mask=None, blocks: Blocks):
    """(min, max) (b,) of M without D over every channel and every causal pair of real positions."""
    length, b = f.length, f.delta.shape[0]
    n_rb, n_cb = -(-length // blocks.rows), -(-length // blocks.cols)
    valid = jnp.ones((b, length), bool) if mask is None else mask
    valid = jnp.pad(valid, ((0, 0), (0, n_rb * blocks.rows + n_cb * blocks.cols)))

    def row_block(carry, i0):
        rb = i0 + jnp.arange(blocks.rows)

        @jax.checkpoint
        def col_block(carry, j0):
            def update(carry):
                M = _hidden_attention(f, jnp.minimum(rb, length - 1), j0, blocks.cols)  # (b, r, q, c)
                lo, hi = _kept_range(M, rb, j0, valid, length)
                return jnp.minimum(carry[0], lo), jnp.maximum(carry[1], hi)

            return jax.lax.cond(j0 <= i0 + blocks.rows - 1, update, lambda c: c, carry), None

        carry, _ = jax.lax.scan(col_block, carry, jnp.arange(n_cb) * blocks.cols)
        return carry, None

    init = (jnp.full((b,), jnp.inf, f32), jnp.full((b,), -jnp.inf, f32))
    (lo, hi), _ = jax.lax.scan(row_block, init, jnp.arange(n_rb) * blocks.rows)
    return lo, hi


def _kept_range(M, rb, j0, valid, length: int):
    """(min, max) (b,) of a block M (b, r, q, c) of target rows ``rb`` and sources j0 .. j0 + q - 1
    over its kept pairs: causal, both positions inside the sequence and real. ``valid`` (b, l') bool,
    padded with False far enough past the end to index every row and column of the block."""
    cols = j0 + jnp.arange(M.shape[2])
    keep = (cols[None, :] <= rb[:, None]) & (rb[:, None] < length) & (cols[None, :] < length)
    keep = keep[None] & valid[:, rb, None] & jax.lax.dynamic_slice_in_dim(valid, j0, M.shape[2], 1)[:, None]
    lo = jnp.min(jnp.where(keep[..., None], M, jnp.inf), axis=(1, 2, 3))
    hi = jnp.max(jnp.where(keep[..., None], M, -jnp.inf), axis=(1, 2, 3))
    return lo, hi


def token_sum(f: LayerFactors, rows, *, blocks: Blocks | None = None):
    """sum_j T_i(x_j) for i in rows, accumulated block by block: (b, r, d)."""
    blocks = blocks or Blocks.for_layer(f.version, f.length)
    n_cb = -(-f.length // blocks.cols)

    def row_block(rb):
        @jax.checkpoint
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
