"""The shared layer kind ("shared", Zamba2): a Mamba-2 sublayer whose input also receives a transformer
block's output, o = Mamba2(RMSNorm(h + t)), t the block's output for [h; h^0] (docs/method.md,
section 14). t reaches the stream only through the Mamba-2's input, so a source token j reaches target
i in two hops: into the Mamba-2's input at every position k in [j, i] (its own stream at k = j, and
through the shared attention), then through the Mamba-2 from k to i.

With everything data-dependent held at its forward value (the attention weights, the norms' scales,
the MLP's activated gate act(g_k), the conv activation's gate s_t, Delta, B, C and the output gate G):

    S_kj = [k = j] h_j + P_k(T^attn_k(x_j))           source j's part of the Mamba-2's input stream at k
    P_k(z) = ((act(g_k) * ((w_ff * z / rms_ff,k) W_up)) W_down) W_s          the block's MLP, linear in z
    U_kj = (w_m * S_kj / rms_m,k) W_x                 its part of the value input (in_proj's x columns)
    exact:  V_ij = G_i * y^(j)_i,  y^(j) = the layer's own scan over v^(j)_t = s_t * sum_k w_k U_{t-k, j}
            T_i(x_j) = V_ij W_out;  beta_i = the Mamba-2's own beta + the same path run on the block's
            bias part (its MLP biases and the attention's value bias), which belongs to no token
    paper:  v^(j)_t = sum_k f(w_k U'_{t-k, j} + [k = 0][t = j] b_conv) (the published additive form per
            source share; U' adds the in_proj bias and the block's bias part at the source's own
            position, so with t = 0 it is the Mamba-2 kind's paper mode), beta_i = b_out

T^attn_k(x_j) is the attention kind's exact term (its values read [h_j; h^0_j]: token j's stream and
embedding). In exact mode sum_j T_i(x_j) + beta_i = o_i to float rounding. One source block costs one
scan over every position for its ``width`` sources: O(l^2) scans' work for a whole map, and memory
(b, l, width, max(e, f)) per block, never (l, l, d).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from latim_jax.kernels import dispatch, f32
from latim_jax.kernels.block_sizes import Blocks
from latim_jax.latim import attention, mamba
from latim_jax.latim.factors import Factors
from latim_jax.model.layers import activation, activation_gate, causal_conv, linear
from latim_jax.model.mlp import MLP_ACTIVATIONS
from latim_jax.parallel.context import XLA, Context


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SharedFactors(Factors):
    """A shared sublayer's factors (fp32; shape letters: latim_jax.model.config, f the MLP width).

    attn_part: the shared attention's :class:`~latim_jax.latim.attention.AttentionFactors` (its W_out is
    o_proj: T^attn in d channels); ff_scale (b, l, d) w_ff / rms_ff,k; act_gate (b, l, f) act(g_k);
    W_up (d, f); W_chain (f, d) = W_down W_s; m_scale (b, l, d) w_m / rms_m,k; W_x (d, e); ubias (b, l, e)
    the value input's part that belongs to no token (in_proj's bias and the block's bias part); w_lag
    (K, e) the conv taps in lag order; b_conv (e,); s_gate (b, l, e); delta (b, l, h), B, C (b, l, g, n),
    A, D (h,) the scan's inputs; G (b, l, e); W_out (e, d); valid (b, l) real positions; bias, output,
    h (b, l, d); token_total (b, l, d) or None."""

    mode: str = dataclasses.field(metadata=dict(static=True))
    chunk: int = dataclasses.field(metadata=dict(static=True))
    act: str = dataclasses.field(metadata=dict(static=True))
    attn_part: attention.AttentionFactors
    ff_scale: jax.Array
    act_gate: jax.Array
    W_up: jax.Array
    W_chain: jax.Array
    m_scale: jax.Array
    W_x: jax.Array
    ubias: jax.Array
    w_lag: jax.Array
    b_conv: jax.Array
    s_gate: jax.Array
    delta: jax.Array
    B: jax.Array
    C: jax.Array
    A: jax.Array
    D: jax.Array
    G: jax.Array
    W_out: jax.Array
    valid: jax.Array
    bias: jax.Array
    output: jax.Array
    h: jax.Array
    token_total: jax.Array | None

    kind = "shared"
    channels_first = False
    parts = ("attn_part",)
    replicated = ("W_up", "W_chain", "W_x", "w_lag", "b_conv", "A", "D")

    def tiles(self, n_rows: int | None, blocks: Blocks | None) -> Blocks:
        """One row tile of every asked row (a source block's scan serves all rows at once) and 32 source
        columns, ``blocks``' fields over these."""
        rows = n_rows or self.length
        return (blocks or Blocks()).over(super().tiles(n_rows, Blocks(rows=rows, cols=min(32, self.length))))

    def source_values(self, j0, width: int):
        """V_{kj} for every target k and sources [j0, j0 + width) (zeros past the end): (b, l, width, e)."""
        b, l, d = self.h.shape
        cols = j0 + jnp.arange(width)
        src_ok = (cols < l)[None, None, :, None]
        Ta = self.attn_part.pair_values(jnp.arange(l), j0, width, None)
        Ta = jnp.einsum("bkwc,cd->bkwd", Ta, self.attn_part.W_out)  # T^attn_k(x_j) (b, l, w, d)
        up = jnp.einsum("bkwd,df->bkwf", Ta * self.ff_scale[:, :, None], self.W_up)
        up = up * self.act_gate[:, :, None]
        S = jnp.einsum("bkwf,fd->bkwd", up, self.W_chain)
        own = (jnp.arange(l)[:, None] == cols[None, :]).astype(f32)  # [k = j] (l, w)
        h_cols = jnp.take(self.h, cols, axis=1, mode="fill", fill_value=0)  # (b, w, d)
        S = S + own[None, :, :, None] * h_cols[:, None]
        U = jnp.einsum("bkwd,de->bkwe", S * self.m_scale[:, :, None], self.W_x)
        U = U * (self.valid[:, :, None, None] * src_ok)
        K = self.w_lag.shape[0]
        if self.mode == "exact":
            conv = sum(self.w_lag[k] * _shift(U, k) for k in range(K))
            v = self.s_gate[:, :, None] * conv
        else:
            f = activation(self.act)
            U = U + own[None, :, :, None] * self.ubias[:, :, None] * src_ok
            first = own[None, :, :, None] * self.b_conv  # [t = j] b_conv, on the k = 0 tap
            v = sum(
                f(self.w_lag[k] * _shift(U, k) + (first if k == 0 else 0.0))
                * _shift(self.valid[:, :, None, None].astype(f32), k) * src_ok
                for k in range(K)
            )  # fmt: skip
        return self.G[:, :, None] * self.scan(v)

    def scan(self, v):
        """The layer's own scan (Delta, B, C, A, D held) over each source's value sequence, v (b, l, w, e)."""
        b, l, w, e = v.shape
        h = self.delta.shape[-1]
        x = jnp.moveaxis(v, 2, 1).reshape(b * w, l, h, e // h)
        rep = lambda a: jnp.repeat(a, w, axis=0)  # noqa: E731
        y, _ = dispatch.ssd(x, rep(self.delta), self.A, rep(self.B), rep(self.C), self.D, self.chunk, ctx=XLA)
        return jnp.moveaxis(y.reshape(b, w, l, e), 1, 2)

    def pair_values(self, rows, j0, width: int, blocks: Blocks, *, channels_first: bool = False):
        """V_{ij} for i in rows, j in [j0, j0 + width): (b, r, width, e), T_i(x_j) = V_{ij} @ W_out."""
        del blocks, channels_first
        return self.source_values(j0, width)[:, rows]

    def attention_map(self, rows, j0, width: int):
        """The shared attention's weights averaged over heads, (b, r, width): the block's hidden attention
        (the Mamba-2's own runs over its input positions, which hold the block's mix: not mixed in)."""
        return self.attn_part.attention_map(rows, j0, width)


def _shift(a, k: int):
    """a (b, l, ...) moved k positions later along axis 1 (zeros in front): a_{t-k} at t."""
    if k == 0:
        return a
    pad = [(0, 0), (k, 0)] + [(0, 0)] * (a.ndim - 2)
    return jnp.pad(a, pad)[:, : a.shape[1]]


@dataclasses.dataclass(frozen=True)
class _Attention:
    """The shared attention seen as an attention block: its input is RMSNorm_attn([h; h^0])."""

    block: object
    embeddings: object

    @property
    def config(self):
        return self.block.config

    @property
    def mixer(self):
        return self.block.mixer.attn

    def normed(self, h, *, hold_fixed=False):
        return self.block.mixer.attn_input(h, self.embeddings, hold_fixed=hold_fixed)


def _held(x, hold_fixed):
    return jax.lax.stop_gradient(x) if hold_fixed else x


def _rms(x, eps, hold_fixed):
    """rms(x) over the last axis, (b, l, 1) (without gradient when ``hold_fixed``)."""
    x = x.astype(f32)
    return _held(jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps), hold_fixed)


def factors(
    block, h, mask, ctx: Context = XLA, mode: str = "exact", *, hold_fixed=False, with_total=False,
    embeddings=None,
) -> SharedFactors:  # fmt: skip
    """The factors of one shared block (a :class:`latim_jax.model.lm.Block` of kind "shared") for its
    input stream h (b, l, d) and the embeddings h^0 (``embeddings``, b, l, d)."""
    mamba.check_mode(mode)
    if embeddings is None:
        raise ValueError("a 'shared' layer reads the embeddings h^0: pass embeddings (b, l, d)")
    mixer, cfg = block.mixer, block.config
    a = attention.factors(_Attention(block, embeddings), h, mask, ctx, hold_fixed=hold_fixed)
    # the block's MLP at each position, linear in its input with act(g_k) and the norms' scales held
    y = mixer.ff_input(a.output, hold_fixed=hold_fixed)
    ff_scale = mixer.ff_norm[...].astype(f32) / _rms(a.output, cfg.rms_eps, hold_fixed)
    g = mixer.mlp._get
    act_gate = _held(MLP_ACTIVATIONS[cfg.mlp_activation](linear(y, g("gate_proj"), g("gate_b"))), hold_fixed)
    W_up = g("up_proj").astype(f32)
    W_s = mixer.shared_out[...].astype(f32)
    W_chain = g("down_proj").astype(f32) @ W_s
    # the tokens' part of t, and the part that belongs to no token: the attention's beta through the MLP,
    # the MLP's biases and the forward's roundings (t_bias = t - t_tokens, held under hold_fixed), so
    # that s = h + t_tokens + t_bias is the forward's h + t and, held, linear in the tokens' values
    t_tokens = linear(((a.output - a.bias) * ff_scale) @ W_up * act_gate, W_chain)
    t = mixer.feed_forward(a.output)  # the forward's t: the attention's output is the factors' own
    t_bias = _held(t - t_tokens, hold_fixed)
    s = h.astype(f32) + t_tokens + t_bias  # the Mamba-2's input stream
    m = mamba.factors(block, s, mask, ctx, mode, hold_fixed=hold_fixed, with_total=with_total)
    ssm, e = mixer.ssm, cfg.d_inner
    m_scale = block.norm[...].astype(f32) / _rms(s, cfg.rms_eps, hold_fixed)
    W_x, b_in = ssm.value_in_proj()
    W_x = W_x.astype(f32)
    valid = mask.astype(f32)[..., None]
    b_in = jnp.zeros((e,), f32) if b_in is None else b_in.astype(f32)
    _, u, _ = ssm.split_projection(block.projected(s, hold_fixed=hold_fixed))
    u = ssm.conv_input(u, mask)  # the conv input as the forward used it (rounded to the weight dtype)
    conv = ssm.value_channels(causal_conv(u, ssm.conv_w[...], ssm._get("conv_b")))
    u = ssm.value_channels(u)
    # the value input that belongs to no token: the forward's, less its bias, less the tokens' shares
    # (h + t_tokens): the block's bias part t_bias, and the roundings of a bf16 model's normalised input
    shares = linear((h.astype(f32) + t_tokens) * m_scale, W_x) * valid
    u_tbias = _held(u - b_in * valid - shares, hold_fixed)
    ubias = u_tbias + b_in * valid
    conv_w, b_conv = ssm.value_conv()
    b_conv = jnp.zeros((e,), f32) if b_conv is None else b_conv.astype(f32)
    w_lag = conv_w.astype(f32)[::-1]
    s_gate = _held(activation_gate(cfg.activation, conv), hold_fixed)
    bias, total = m.bias, m.token_total
    if mode == "exact":  # the block's bias part runs the Mamba-2's value path too: beta, not any token's
        v = s_gate * sum(w_lag[k] * _shift(u_tbias, k) for k in range(w_lag.shape[0]))
        from_bias = linear(mamba.value_scan(ssm, m.ssm, v, ctx) * m.G, m.W_out)
        bias = bias + from_bias
        total = None if total is None else total - from_bias
    f = SharedFactors(
        mode=mode, chunk=cfg.chunk_size, act=cfg.activation, attn_part=a, ff_scale=ff_scale,
        act_gate=act_gate, W_up=W_up, W_chain=W_chain, m_scale=m_scale, W_x=W_x, ubias=ubias,
        w_lag=w_lag, b_conv=b_conv, s_gate=s_gate, delta=m.ssm.delta,
        B=m.ssm.B, C=m.ssm.C, A=m.ssm.A, D=m.ssm.D, G=m.G, W_out=m.W_out, valid=mask.astype(f32),
        bias=bias, output=m.output, h=h.astype(f32), token_total=None,
    )  # fmt: skip
    if with_total and mode == "paper":  # no O(l) form through two hops: every source block's sum
        total = linear(_source_sum(f), m.W_out)
    return dataclasses.replace(f, token_total=total)


def _source_sum(f: SharedFactors, width: int = 32):
    """sum_j V_{ij} for every target i, (b, l, e), one source block at a time."""
    b, l, _ = f.h.shape
    n = -(-l // width)

    def body(k, acc):
        return acc + jnp.sum(f.source_values(k * width, width), axis=2)

    return jax.lax.fori_loop(0, n, body, jnp.zeros((b, l, f.W_out.shape[0]), f32))
