"""The Mamba layer kinds ("mamba1", "mamba2"): one layer's output written as a sum over source tokens
(docs/method.md, sections 2-4).

For target i and source j (shape letters: see latim_jax.model.config; K conv width, w_k the conv taps in
lag order, w_k = conv_w[K-1-k]):

    exact:  T_i(x_j) = W_out( G_i * sum_{k=0}^{K-1} M_{i,j+k} * a_k[j] ),  a_k[j] = w_k * s_{j+k} * u_j
            beta_i   = W_out( G_i * sum_{t<=i} M_{i,t} * s_t * cbias_t ) + b_out
            o_i      = sum_{j<=i} T_i(x_j) + beta_i                       (to float rounding)
    paper:  a_k[j] = f(w_k * u_j + [k=0] b_conv)  (the published additive approximation), beta_i = b_out

s_t = act(c_t) / c_t from the forward (sigma for SiLU), u_j the token's value input (in_proj output
without bias), cbias_t = b_conv + the in_proj bias carried through the conv taps that reach real
tokens. Mamba-2: only the x slice of xBC is a value, M is per head (expanded to its p channels), and
G_i = w_norm * SiLU(z_i) / rms_group(q_i). Everything data-dependent is read from the mixer's own
:class:`~latim_jax.model.mixers.Intermediates`: there is no second copy of the forward. The hidden
attention M is built by :mod:`latim_jax.kernels.decay`, its one definition.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from latim_jax.kernels import dispatch, f32
from latim_jax.kernels.block_sizes import Blocks
from latim_jax.kernels.decay import (
    SSM,
    Decay,
    compensated_cumsum,
    decay_tile,
    far_tapped,
    in_window,
    m1_far_or_near,
    m2_far_or_near,
    two_sum,
)
from latim_jax.kernels.products import bmul
from latim_jax.latim.blocking import tiles
from latim_jax.latim.factors import Factors
from latim_jax.model.layers import activation, activation_gate, causal_conv, linear
from latim_jax.parallel import sequence
from latim_jax.parallel.context import XLA, Context
from latim_jax.parallel.mesh import SEQ

MODES = ("exact", "paper")


def check_mode(mode: str) -> str:
    """Validate a decomposition mode name."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, found {mode!r}")
    return mode


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MambaFactors(Factors):
    """Everything the per-pair contributions of one Mamba layer are built from (fp32).

    ssm: the hidden-attention inputs (:class:`latim_jax.kernels.decay.SSM`); a: (K, b, l, e) per-source
    tap values; G: (b, l, e) the output gate; W_out: (e, d); bias: (b, l, d) the non-token term beta;
    output: (b, l, d) the mixer output o; h: (b, l, d) the residual stream entering the layer;
    token_total: (b, l, d) sum_j T_i(x_j) for every i, from one scan (:func:`token_total`), so
    reconstruction errors cost O(l) rather than O(l^2); None when not asked for (one more scan).
    """

    mode: str = dataclasses.field(metadata=dict(static=True))
    ssm: SSM
    a: jax.Array
    G: jax.Array
    W_out: jax.Array
    bias: jax.Array
    output: jax.Array
    h: jax.Array
    token_total: jax.Array | None

    form = "ssm"
    positions = {  # what the score tiles read at target rows and at source columns (Factors)
        "ssm.delta": (1, "sources"), "ssm.B": (1, "sources"), "ssm.C": (1, "rows"),
        "ssm.decay.hi": (1, "both"), "ssm.decay.lo": (1, "both"), "a": (2, "sources"), "G": (1, "rows"),
        "bias": (1, "rows"), "output": (1, "rows"), "h": (1, "rows"), "token_total": (1, "rows"),
    }  # fmt: skip

    @property
    def halo(self) -> int:
        """K - 1: a source's taps read M at the K - 1 columns after it."""
        return self.a.shape[0] - 1

    @property
    def kind(self) -> str:
        """ "mamba1" or "mamba2"."""
        return f"mamba{self.ssm.version}"

    @property
    def length(self) -> int:
        """Sequence length l."""
        return self.G.shape[1]

    @property
    def channels_first(self) -> bool:
        """The layout :meth:`pair_values` is fastest in: channels first for Mamba-1 (its far tiles'
        per-channel product makes it), channels last for Mamba-2."""
        return self.ssm.version == 1

    def tiles(self, n_rows: int | None, blocks: Blocks | None) -> Blocks:
        """The tiles of this layer's scores for ``n_rows`` target rows (None: all), ``blocks``' fields
        over the defaults (:meth:`latim_jax.kernels.block_sizes.Blocks.for_layer`)."""
        return tiles(self.ssm.version, self.length, n_rows, blocks)

    def pair_values(self, rows, j0, width: int, blocks: Blocks, *, channels_first: bool = False):
        """V_{i,j} = G_i * sum_k M_{i,j+k} a_k[j] for i in rows, j in [j0, j0 + width): (b, r, width, e),
        so that T_i(x_j) = V_{i,j} @ W_out. See :func:`pair_values`."""
        return pair_values(self, rows, j0, width, blocks, channels_first=channels_first)


def factors(
    block, h, mask, ctx: Context = XLA, mode: str = "exact", *, hold_fixed=False, with_total=False
) -> MambaFactors:
    """The factors of one Mamba block (a :class:`latim_jax.model.lm.Block`, or a block holding a Mamba
    mixer beside other parts: its ``ssm_mixer`` and ``projected``) for the stream h its norm reads.

    Padding (``mask`` (b, l) False) is skipped by the mixer (zero conv input and Delta), and its
    sources get zero tap values a, so a pad position contributes exactly nothing to any target.
    ``hold_fixed``: the same values, but gradients do not flow through the quantities LaTIM holds fixed
    (Delta, B, C, the activation gate s, the output gate G, the pre-norm scale): the layer is
    differentiated as the linear map of the token values that the decomposition describes.
    ``with_total``: also build ``token_total`` (one more scan; what the paper-mode error needs).
    """
    check_mode(mode)
    mixer, cfg = block.ssm_mixer, block.config
    xz = block.projected(h, hold_fixed=hold_fixed)
    inter = mixer.intermediates(mask=mask, ctx=ctx, hold_fixed=hold_fixed, projected=xz)
    K = cfg.d_conv
    valid = mask[..., None].astype(f32)
    conv_w, b_conv = mixer.value_conv()  # the value channels' taps (K, e) and bias
    w_lag = conv_w.astype(f32)[::-1]  # (K, e): w_k multiplies u_{t-k}
    c = mixer.value_channels(inter.c)
    _, b_in = mixer.value_in_proj()
    b_in = None if b_in is None else b_in.astype(f32) * valid  # the bias reaches real positions only
    b_conv = None if b_conv is None else b_conv.astype(f32)
    u_full = mixer.value_channels(inter.u)  # the conv input the forward used: weight dtype, 0 at padding
    W_out = mixer.out_proj[...].astype(f32)
    b_out = mixer._get("out_proj_b")
    bias = jnp.zeros_like(h, dtype=f32) if b_out is None else jnp.broadcast_to(b_out.astype(f32), h.shape)

    if mode == "exact":
        s = activation_gate(cfg.activation, c)
        s = jax.lax.stop_gradient(s) if hold_fixed else s
        u_tok = u_full if b_in is None else u_full - b_in
        s_pad = jnp.pad(s, ((0, 0), (0, K - 1), (0, 0)))
        a = jnp.stack([w_lag[k] * s_pad[:, k : k + s.shape[1]] * u_tok for k in range(K)])
        if b_in is not None or b_conv is not None:
            ones_in = jnp.zeros_like(u_tok) if b_in is None else jnp.broadcast_to(b_in, u_tok.shape)
            cbias = causal_conv(ones_in, conv_w, b_conv)  # b_conv + taps of b_in
            y_bias = value_scan(mixer, inter, s * cbias, ctx)
            bias = bias + linear(y_bias * inter.G, W_out)
        bias = bias + out_proj_rounding(mixer, inter, W_out)
    else:
        f = activation(cfg.activation)
        a = jnp.stack(
            [
                f(w_lag[k] * u_full + (b_conv if (k == 0 and b_conv is not None) else 0.0)) * valid
                for k in range(K)
            ]
        )
    return MambaFactors(
        mode=mode,
        ssm=SSM.build(cfg.version, mixer.A, mixer.D[...].astype(f32), inter.delta, inter.B, inter.C,
                      cumulative_decay(inter.delta, ctx)),  # fmt: skip
        a=a,
        G=inter.G,
        W_out=W_out,
        bias=bias,
        output=mixer.output(inter),
        h=h.astype(f32),
        token_total=token_total(mixer, inter, a, W_out, ctx) if with_total else None,
    )


def cumulative_decay(delta, ctx: Context) -> Decay:
    """S, the compensated cumulative sum of Delta (b, l, c) that M reads (:class:`~latim_jax.kernels.decay.
    Decay`); with the length split over a mesh's "seq" axis, each shard sums its own Delta and adds the
    earlier shards' totals, summed in double-float arithmetic (hi + lo) by the log-depth
    :func:`latim_jax.parallel.sequence.prefix` and made exclusive, so no device gathers Delta (the
    whole-length scan over a split array did: 2 e l fp32 per device for Mamba-1). The tangent rides on
    hi alone, as :func:`~latim_jax.kernels.decay.compensated_cumsum` holds lo fixed."""
    seq = ctx.axis(SEQ)
    if seq is None:
        return compensated_cumsum(delta)

    def add(x, y):  # two double-float sums
        s, err = two_sum(x[0], y[0])
        return s, x[1] + y[1] + err

    def local(delta):
        S = compensated_cumsum(delta)
        before_hi, before_lo = sequence.shift_one(sequence.prefix((S.hi[:, -1], S.lo[:, -1]), add, seq), seq)
        hi, err = two_sum(S.hi, before_hi[:, None])
        return hi, jax.lax.stop_gradient(S.lo + before_lo[:, None] + err)

    spec = sequence.rows_spec(ctx, delta.shape[0], None)
    return Decay(*sequence.split(local, ctx, (spec,), (spec, spec))(delta))


def out_proj_rounding(mixer, inter, W_out):
    """(round(q) - q) @ W_out for q = y * G: the forward feeds out_proj the value path rounded to the
    weight dtype (bf16 models); that rounding belongs to no token, so exact mode puts it into beta and
    the contributions still sum to the forward's own output. Zero for fp32 weights."""
    dtype = mixer.out_proj[...].dtype
    if dtype == f32:
        return 0.0
    q = inter.y * inter.G
    return linear(q.astype(dtype).astype(f32) - q, W_out)


def token_total(mixer, inter, a, W_out, ctx: Context):
    """sum_j T_i(x_j) for every target i, (b, l, d), in O(l): the pair sum regrouped by t = j + k,

        sum_j sum_k M_{i,j+k} a_k[j] = sum_{t<=i} M_{i,t} v_t,   v_t = sum_k a_k[t-k]  (t - k >= 0),

    is the layer's own scan over v (M includes the D term), then the gate and W_out. In exact mode it
    equals o_i - beta_i; in paper mode the gap to o_i - beta_i is the approximation error.
    """
    K, _, length, _ = a.shape
    v = sum(jnp.pad(a[k], ((0, 0), (k, 0), (0, 0)))[:, :length] for k in range(K))
    return linear(value_scan(mixer, inter, v, ctx) * inter.G, W_out)


def value_scan(mixer, inter, v, ctx: Context):
    """Run the layer's own SSM (its Delta, B, C, A, D) over the value sequence v (b, l, e)."""
    cfg = mixer.config
    if cfg.version == 1:
        y, _ = dispatch.selective_scan(v, inter.delta, mixer.A, inter.B, inter.C, mixer.D[...], ctx=ctx)
        return y
    b, l, e = v.shape
    x = v.reshape(b, l, cfg.n_heads, cfg.head_dim)
    y, _ = dispatch.ssd(x, inter.delta, mixer.A, inter.B, inter.C, mixer.D[...], cfg.chunk_size, ctx=ctx)
    return y.reshape(b, l, e)


def pair_values(f: MambaFactors, rows, j0, width: int, blocks: Blocks, *, channels_first: bool = False):
    """V_{i,j} = G_i * sum_k M_{i,j+k} a_k[j] for i in rows, j in [j0, j0 + width): (b, r, width, e).

    T_i(x_j) = V_{i,j} @ W_out. Sources past the end give zeros. Mamba-2's M stays per head and is
    broadcast over each head's p channels (never repeated into an (.., e) copy). ``blocks``: the
    resolved tiles (Mamba-1 reads ``m1_few_rows`` and ``m1_direct_rows``).
    ``channels_first``: Mamba-1 only, V as (b, e, r, width), the layout its far tiles' per-channel
    (r x n)(n x q) product makes, for a projection that contracts e where it lies (:func:`latim_jax.
    latim.kinds.project`). Returning (b, r, width, e) from the far/near cond made XLA:CPU write V twice
    per far tile (a transpose, then a copy into the cond's layout); now it transposes once, and the
    gate and the bf16 cast ride on the second pass (one 130m layer at L = 1024: 3.7-4.5% faster).
    """
    K, b, _, e = f.a.shape
    cols = j0 + jnp.arange(width + K - 1)
    # the block's tap values, zeros past the end (a gather that fills, not a padded copy of all of a:
    # the copy cost ~0.4 GB and ~0.25 s per layer at l = 16k with the 1024-wide last-row blocks)
    a = jnp.take(f.a, j0 + jnp.arange(width), axis=2, mode="fill", fill_value=0)  # (K, b, width, e)
    src_ok = (j0 + jnp.arange(width)) < f.length
    if f.ssm.version == 1:
        acc = _m1_tapped(f, rows, cols, a, blocks)  # (b, e, r, width)
        if channels_first:
            return bmul(jnp.moveaxis(f.G[:, rows], 2, 1)[..., None], acc) * src_ok  # G (b, e, r, 1)
        acc = jnp.moveaxis(acc, 1, 3)
    else:
        h = f.ssm.heads  # the taps inside the tile's cond: M and the sum are written out there
        acc = m2_far_or_near(f.ssm, rows, cols, tap_sum, a.reshape(K, b, width, h, e // h), with_D=True)
        acc = acc.reshape(*acc.shape[:3], e)
    return gated(f.G[:, rows], acc) * src_ok[None, None, :, None]


# The tile's two products, with tangents written as einsums. Their values are the plain broadcast
# products; only differentiation changes: the transpose of a broadcast product is a multiply and a
# reduction over a non-minor axis (the rows for a, the columns for G), which XLA:CPU's YNNPACK reduce
# fusion (jax 0.10) runs ~8x slower than the same contraction as a dot_general (a (1, 64, 64, 8, 32)
# tile: 8.3 vs 1.0 ms); written as einsums the tangents transpose to dot_generals. Forward mode and
# higher orders work as for any custom_jvp whose rule is differentiable.


@jax.custom_jvp
def tap_sum(M, a):
    """sum_k M_{i,j+k} a_k[j]: M (b, r, q + K - 1, h) per head, a (K, b, q, h, p) -> (b, r, q, h, p)."""
    q = a.shape[2]
    return sum(M[:, :, k : k + q, :, None] * a[k][:, None] for k in range(a.shape[0]))


@tap_sum.defjvp
def _tap_sum_jvp(primals, tangents):
    M, a = primals
    dM, da = tangents
    K, q = a.shape[0], a.shape[2]
    if a.shape[-1] > 1:  # Mamba-2: M per head, p times smaller than each term: K shifted slices of M
        # (the window and scan below doubled its gradient time at d 128, for no memory)
        terms = [
            jnp.einsum("brqh,bqhp->brqhp", dM[:, :, k : k + q], a[k])
            + jnp.einsum("brqh,bqhp->brqhp", M[:, :, k : k + q], da[k])
            for k in range(K)
        ]
        return tap_sum(M, a), sum(terms)
    # Mamba-1 (p = 1): M is per channel, as large as the terms. Each term multiplies the whole window
    # and is sliced after (in_window): linearised, the tangent keeps M once as its residual, not K
    # shifted (r, q, e) slices of it (130m Mamba-1 l2 gradient at L = 1024: compiled temporaries 263 ->
    # 256 MiB; 247 with the far tiles' Q treated alike). The K terms run as a scan, one tap per step:
    # transposed, each term's dot_generals read a transposed copy of its window of the cotangent, and
    # written as K terms of one sum XLA held all K copies at once (4 x (32, 35, e) for a 130m near
    # tile); the scan's step holds one (same layer: 241 -> 230 MiB, 217 with Blocks.m1_state_group = 2).
    wa = jnp.stack([in_window(a[k], k, K) for k in range(K)])
    wda = jnp.stack([in_window(da[k], k, K) for k in range(K)])

    def term(acc, xs):
        k, wa_k, wda_k = xs
        full = jnp.einsum("brth,bthp->brthp", dM, wa_k) + jnp.einsum("brth,bthp->brthp", M, wda_k)
        return acc + jax.lax.dynamic_slice_in_dim(full, k, q, axis=2), None

    zero = jnp.zeros((*M.shape[:2], q, *a.shape[3:]), jnp.result_type(M, a))
    tangent, _ = jax.lax.scan(term, zero, (jnp.arange(K), wa, wda))
    return tap_sum(M, a), tangent


@jax.custom_jvp
def gated(G, acc):
    """G_i * acc_{i,j}: G (b, r, e) broadcast over acc's sources (b, r, q, e)."""
    return G[:, :, None] * acc


@gated.defjvp
def _gated_jvp(primals, tangents):
    G, acc = primals
    dG, dacc = tangents
    return gated(G, acc), jnp.einsum("bre,brqe->brqe", dG, acc) + G[:, :, None] * dacc


def _m1_tapped(f: MambaFactors, rows, cols, a, blocks: Blocks):
    """Mamba-1's sum_k M_{i,j+k} a_k[j] for the q = width + K - 1 source columns ``cols``: (b, e, r, width),
    channels first: the layout of the far tiles' batched product (see :func:`pair_values`).

    A far tile applies the taps to the small decay factor (:func:`latim_jax.kernels.decay.far_tapped`),
    so neither M nor the tap products touch an (r, q, e) block before the one product; other tiles
    build M (from the same P and Q where they can) and tap it. P and Q are formed outside the cond on
    purpose: inside one computation XLA fuses Q's exponentials into each of the K tap products (K times
    the exponentials; a far tile of one 130m layer took ~25% longer).

    A row tile of at most ``blocks.m1_few_rows`` rows (``rows=[-1]`` and other small subsets, whose
    column tiles grow to 1024) takes the direct form on every tile: its r q e n exponentials are few,
    while the factored product's operand, a (q, e, n) block, would be transposed into the per-channel
    layout (XLA:CPU's strided copy of it cost one 130m layer at L = 4096 ~1.4 s for the one row)."""
    ssm = f.ssm

    def tapped(M, a):  # M (b, r, q, e) -> sum_k M_{i,j+k} a_k[j], channels first (e as heads of 1 channel)
        return jnp.moveaxis(tap_sum(M, a[..., None])[..., 0], 3, 1)

    passes = dict(
        direct_rows=blocks.m1_direct_rows,
        tangent_rows=blocks.m1_tangent_rows,
        state_group=blocks.m1_state_group,
    )
    if rows.shape[0] <= blocks.m1_few_rows:
        return tapped(decay_tile(ssm, rows, cols, direct=True, **passes), a)
    return m1_far_or_near(ssm, rows, cols, far_tapped, tapped, a, with_D=True, **passes)
