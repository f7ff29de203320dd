"""The delta-rule kinds (Gated DeltaNet "gdn", Kimi Delta Attention "kda"): one layer's output written as a
sum over source tokens (docs/method.md, section 15).

With q, k, the decay g and the rate beta held at their forward values, the delta rule is linear in its
values: o_i = sum_{t <= i} M[i, t] v_t with one scalar M per value head and pair
(:mod:`latim_jax.kernels.delta_rule`). The values come out of the causal conv, whose taps carry earlier
tokens, exactly as Mamba's value path does, so for target i and source j (K taps, w_k = conv_w[K-1-k]
on the value channels, s_t = act(c_t) / c_t the activation's gain from the forward, u_j the token's
value input from in_proj):

    exact:  T_i(x_j) = W_out( G_i * sum_{k=0}^{K-1} M[i, j+k] a_k[j] ),   a_k[j] = w_k * s_{j+k} * u_j
            beta_i   = W_out( G_i * sum_{t<=i} M[i, t] s_t b_conv )   (+ the out_proj input's rounding)
    paper:  a_k[j] = act(w_k u_j + [k = 0] b_conv)   (the published additive approximation of the conv)

with M applied per value head (broadcast over its v channels) and G_i = w_norm * SiLU(z_i) / rms_head(o_i),
the gated norm with its scale held at the forward's value. The query / key path (q, k through their own
conv taps and L2 norm), g and beta are what LaTIM holds fixed, as it holds Mamba's Delta, B and C.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from latim_jax.kernels import delta_rule, dispatch, f32
from latim_jax.kernels.block_sizes import Blocks
from latim_jax.latim.factors import Factors
from latim_jax.latim.mamba import check_mode
from latim_jax.model.layers import activation, activation_gate, linear
from latim_jax.parallel import sequence
from latim_jax.parallel.context import XLA, Context


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DeltaFactors(Factors):
    """One delta-rule sublayer's factors (fp32): q, k (b, l, H, k), g (b, l, H) or per key channel
    (b, l, H, k), beta (b, l, H) held fixed; ``chunks`` M's per-chunk factors built from them once per
    layer (:class:`latim_jax.kernels.delta_rule.TileFactors`: (b, n, H, ...), n = l / C chunks of C
    positions, l (C + 2 k + k^2 / C) floats per head), which every tile of M reads; a (b, K, l, e)
    the per-source tap values (batch first, like every field); G (b, l, e) the output gate; W_out (e, d);
    bias, output, h (b, l, d); token_total (b, l, d) or None; ``ctx`` the execution context the tiles of
    M run in (without its mesh: the score stage runs them per device), which picks the XLA scan or the
    Pallas kernel (:func:`latim_jax.kernels.dispatch.delta_rule_m_tile`)."""

    mode: str = dataclasses.field(metadata=dict(static=True))
    kind: str = dataclasses.field(metadata=dict(static=True))
    q: jax.Array
    k: jax.Array
    g: jax.Array
    beta: jax.Array
    chunks: delta_rule.TileFactors
    a: jax.Array
    G: jax.Array
    W_out: jax.Array
    bias: jax.Array
    output: jax.Array
    h: jax.Array
    token_total: jax.Array | None
    ctx: Context = dataclasses.field(default=XLA, metadata=dict(static=True))
    halo_m: jax.Array | None = None
    window_end: int = dataclasses.field(default=0, metadata=dict(static=True))

    channels_first = False
    positions = {
        "q": (1, "sources"), "k": (1, "sources"), "g": (1, "sources"), "beta": (1, "sources"),
        "a": (2, "sources"), "G": (1, "rows"), "bias": (1, "rows"), "output": (1, "rows"), "h": (1, "rows"),
        "token_total": (1, "rows"), "chunks.local": (1, "chunks"), "chunks.inject": (1, "chunks"),
        "chunks.readout": (1, "chunks"), "chunks.carry": (1, "chunks"),
    }  # fmt: skip

    @property
    def slot_unit(self) -> int:
        """C: M's tile factors are per chunk of C positions."""
        return self.chunks.local.shape[-1]

    def m_tile(self, rows, c0, width: int, blocks: Blocks | None = None):
        """M[rows, c0 : c0 + width] per value head, (b, H, r, width), from ``chunks``
        (:func:`latim_jax.kernels.delta_rule.m_tile`: a few small matmuls per chunk between the tile's
        columns and its last row; with ``ctx.kernels`` the Pallas kernel of kernels/delta_rule_tiles.py,
        ``blocks.vmem_limit_bytes`` its scoped VMEM on TPU)."""
        return dispatch.delta_rule_m_tile(self.chunks, rows, c0, width, ctx=self.ctx, block_sizes=blocks)

    def pair_values(self, rows, j0, width: int, blocks: Blocks, *, channels_first: bool = False):
        """V_{i,j} = G_i * sum_k M[i, j+k] a_k[j] for i in ``rows``, j in [j0, j0 + width): (b, r, width, e),
        so that T_i(x_j) = V_{i,j} @ W_out. Sources past the end give zeros."""
        del channels_first
        b, K, _, e = self.a.shape
        H = self.beta.shape[-1]
        M = self.m_tile(rows, j0, width + K - 1, blocks)  # (b, H, r, width + K - 1)
        if self.halo_m is not None:  # compacted: M at the next shard's first K - 1 columns, per row slot
            at = j0 + jnp.arange(width + K - 1) - self.window_end
            halo = jnp.take(jnp.take(self.halo_m, rows, axis=2), jnp.clip(at, 0, K - 2), axis=3)
            M = M + jnp.where((at >= 0) & (at < K - 1), halo, 0.0)
        cols = j0 + jnp.arange(width)
        a = jnp.take(self.a, cols, axis=2, mode="fill", fill_value=0).reshape(b, K, width, H, e // H)
        acc = sum(jnp.einsum("bhrw,bwhv->brwhv", M[..., k : k + width], a[:, k]) for k in range(K))
        return acc.reshape(b, rows.shape[0], width, e) * self.G[:, rows][:, :, None, :]

    def post_normed(self, r, w):
        """These factors times a post-norm's held scale r (b, l, 1) at the target (into G) and its weight
        w (d,) (into W_out); :func:`latim_jax.latim.kinds.post_normed` scales the rest."""
        return dataclasses.replace(self, G=self.G * r, W_out=self.W_out * w)

    def compacted(self, rows, slots, *, width: int, lead: int, seq: str):
        """M's tile factors for a device's compacted window (:mod:`latim_jax.latim.source_window`; inside
        ``jax.shard_map``, ``chunks`` holding this device's w / C chunks). The compacted chunks are

            one empty chunk (the rows before the window), the window's own chunks, then the asked rows
            after the window C to a chunk: readout rho_t, carry I, no local block or injection,

        where rho_t is what row t reads of the state leaving this window, readout_I[i] carry_{I-1} ...
        carry_{first chunk after the window}, so that M's chunk walk gives rho_t carry ... inject_J[:, a]
        = M[t, j] for every source j in the window. rho comes from the rows' owners: each carries its rows'
        readouts back to its first chunk (a reverse scan over its chunks), and a log-depth suffix over
        the shards' maps X -> own + X P_s (P_s the product of a shard's carries) gives every device
        the next shard's (:func:`latim_jax.parallel.sequence.prefix`, ``reverse``). The conv taps read M
        at the K - 1 columns after the window, which the next shard owns: it computes them for the asked
        rows from its own compacted chunks and passes them back (``halo_m`` (b, H, slots, K - 1), one
        ``ppermute``), and :meth:`pair_values` adds them there."""
        ch = self.chunks
        b, n_w, H, C, dk = ch.readout.shape
        K, g = self.a.shape[1], rows.shape[0]
        if K - 1 > width:
            raise ValueError(f"a conv halo of {K - 1} columns needs {K - 1} positions a shard, found {width}")
        s, eye = jax.lax.axis_index(seq), jnp.eye(dk, dtype=f32)
        owner = rows // width
        chunk, at = (rows - owner * width) // C, (rows - owner * width) % C
        mul = lambda x, P: jnp.einsum("bhrk,bhkm->bhrm", x, P, precision="highest")  # noqa: E731

        def back(Z, x):  # chunk i, last to first: the rows after it take its carry, its own rows start
            i, rd, P = x
            Z = jnp.where((chunk > i)[:, None], mul(Z, P), Z)
            return jnp.where((chunk == i)[:, None], jnp.take(rd, at, axis=2), Z), None

        def through(T, P):  # P_s = carry_last ... carry_first
            return jnp.einsum("bhkm,bhmn->bhkn", P, T, precision="highest"), None

        by_chunk = lambda x: jnp.moveaxis(x, 1, 0)  # noqa: E731
        Z, _ = jax.lax.scan(back, jnp.zeros((b, H, g, dk), f32), (jnp.arange(n_w), by_chunk(ch.readout),
                            by_chunk(ch.carry)), reverse=True)  # fmt: skip
        own = jnp.where((owner == s)[:, None], Z, 0.0)
        P, _ = jax.lax.scan(through, jnp.broadcast_to(eye, (b, H, dk, dk)), by_chunk(ch.carry))

        def combine(earlier, later):  # X -> o1 + X P1 after X -> o2 + X P2
            (P1, o1), (P2, o2) = earlier, later
            return jnp.einsum("bhkm,bhmn->bhkn", P2, P1, precision="highest"), o1 + mul(o2, P1)

        rho = sequence.shift_one(sequence.prefix((P, own), combine, seq, reverse=True), seq, reverse=True)[1]
        n_r = -(-g // C)
        after = slots - (lead + width)  # a row after the window: its slot among the rows' (else < 0)
        at_slot = jnp.where(after >= 0, after, n_r * C)  # the others read nothing of rho (0): dropped
        readout = jnp.zeros((b, H, n_r * C, dk), f32).at[:, :, at_slot].set(rho, mode="drop")
        readout = jnp.moveaxis(readout.reshape(b, H, n_r, C, dk), 2, 1)
        zero = lambda x, n: jnp.zeros((b, n, *x.shape[2:]), x.dtype)  # noqa: E731
        chunks = delta_rule.TileFactors(
            local=jnp.concatenate([zero(ch.local, 1), ch.local, zero(ch.local, n_r)], 1),
            inject=jnp.concatenate([zero(ch.inject, 1), ch.inject, zero(ch.inject, n_r)], 1),
            readout=jnp.concatenate([zero(ch.readout, 1), ch.readout, readout], 1),
            carry=jnp.concatenate([zero(ch.carry, 1), ch.carry, jnp.broadcast_to(eye, (b, n_r, H, dk, dk))],
                                  1),
        )  # fmt: skip
        f = dataclasses.replace(self, chunks=chunks, window_end=lead + width)
        if K == 1:
            return f
        first = f.m_tile(slots, lead, K - 1)  # (b, H, g, K - 1): M at this window's first columns
        n = jax.lax.axis_size(seq)
        mine = jax.lax.ppermute(first, seq, [(i, i - 1) for i in range(1, n)])  # the next shard's
        halo_m = jnp.zeros((b, H, lead + width + n_r * C, K - 1), f32).at[:, :, slots].set(mine)
        return dataclasses.replace(f, halo_m=halo_m)

    def attention_map(self, rows, j0, width: int):
        """The hidden attention for the baseline: M averaged over the value heads, (b, r, width)."""
        return jnp.mean(self.m_tile(rows, j0, width), axis=1)


def tile_chunk(chunk: int, length: int) -> int:
    """The chunk of M's tile factors: the layer's forward chunk, at most the length."""
    return max(1, min(int(chunk), length))


def factors(
    block, h, mask, ctx: Context = XLA, mode: str = "exact", *, hold_fixed=False, with_total=False
) -> DeltaFactors:
    """The factors of one gdn block for the stream h (b, l, d) entering it (see the module docstring).
    Padding (``mask`` False) is an identity step of the rule and its sources get zero tap values.
    ``hold_fixed``: the same values, without gradient through q, k, g, beta, the activation's gain, the
    output gate and the pre-norm scale (the layer differentiated as the linear map of its values)."""
    check_mode(mode)
    mixer = block.mixer
    s = mixer.section
    inter = mixer.intermediates(block.normed(h, hold_fixed=hold_fixed), mask=mask, ctx=ctx)
    held = jax.lax.stop_gradient if hold_fixed else (lambda x: x)
    q, k, g, beta, G = (held(x) for x in (inter.q, inter.k, inter.g, inter.beta, inter.G))
    K, e, lo = s.conv, s.value_width, 2 * s.key_width  # the value channels are the conv's last e
    conv_w = mixer.conv_w[...].astype(f32)[:, lo:]
    w_lag = conv_w[::-1]  # w_k multiplies u_{t-k}
    b_conv = mixer._get("conv_b")
    b_conv = None if b_conv is None else b_conv.astype(f32)[lo:]
    u = inter.u[..., lo:].astype(f32)  # the conv input the forward used, 0 at padding
    c = inter.c[..., lo:]
    valid = mask[..., None].astype(f32)
    W_out = mixer.out_proj[...].astype(f32)
    b, L, _ = h.shape
    H, dv = s.v_heads, s.v_dim
    bias = jnp.zeros((b, L, W_out.shape[1]), f32)

    def run(values):  # the rule over other values (b, l, e) with the forward's q, k, g, beta -> (b, l, e)
        o, _ = delta_rule.chunked(q, k, values.reshape(b, L, H, dv), g, beta, s.chunk)
        return o.reshape(b, L, e)

    if mode == "exact":
        gain = held(activation_gate(s.activation, c))
        gain_pad = jnp.pad(gain, ((0, 0), (0, K - 1), (0, 0)))
        a = jnp.stack([w_lag[t] * gain_pad[:, t : t + L] * u for t in range(K)], axis=1)
        if b_conv is not None:
            bias = bias + linear(run(gain * b_conv) * G, W_out)
        dtype = mixer.out_proj[...].dtype
        if dtype != f32:  # the forward rounds the out_proj input to the weight dtype: no token's
            y = inter.o.reshape(b, L, e) * inter.G
            bias = bias + linear(y.astype(dtype).astype(f32) - y, W_out)
    else:
        f = activation(s.activation)
        first = 0.0 if b_conv is None else b_conv
        a = jnp.stack([f(w_lag[t] * u + (first if t == 0 else 0.0)) * valid for t in range(K)], axis=1)
    total = None
    if with_total:  # sum_j T_i(x_j) in O(l): v_t = sum_k a_k[t - k], then the rule, the gate and W_out
        v = sum(jnp.pad(a[:, t], ((0, 0), (t, 0), (0, 0)))[:, :L] for t in range(K))
        total = linear(run(v) * G, W_out)
    chunks = delta_rule.tile_factors(q, k, g, beta, tile_chunk(s.chunk, L))
    return DeltaFactors(
        mode=mode, kind=block.kind, q=q, k=k, g=g, beta=beta, chunks=chunks, a=a, G=G, W_out=W_out, bias=bias,
        output=mixer.output(inter), h=h.astype(f32), token_total=total, ctx=ctx.local(),
    )  # fmt: skip
