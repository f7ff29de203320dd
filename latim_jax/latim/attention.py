"""The attention layer kind ("attention"): a softmax attention sublayer's output written exactly as a sum
over source tokens, its attention weights held at their forward values (docs/method.md, section 8;
the value-path decomposition of Kobayashi et al. 2020, which ALTI builds on).

With alpha^h_{ij} the forward's weights (after softmax, over the allowed sources of i: causal, the
sliding window, real tokens), v^g_j = xhat_j W_v the value of token j without its bias, and g(h) the
key/value group of head h:

    T_i(x_j) = concat_h(alpha^h_{ij} v^{g(h)}_j) W_o              (V_{ij} = concat_h(...), W_out = W_o)
    beta_i   = concat_h(b_v^{g(h)}) W_o + b_o                      (sum_j alpha^h_{ij} = 1)
    o_i      = sum_{j<=i} T_i(x_j) + beta_i                         exactly, in both modes

alpha is rebuilt per tile from the forward's queries, keys and each row's log-sum-exp
(:func:`latim_jax.model.attention.logits`, the forward's own masked logits), so no (l, l) array per
head exists.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from latim_jax.kernels import f32
from latim_jax.kernels.block_sizes import Blocks
from latim_jax.latim.factors import Factors
from latim_jax.model.attention import logits
from latim_jax.model.layers import linear
from latim_jax.parallel.context import XLA, Context


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionFactors(Factors):
    """One attention sublayer's factors (fp32; see :mod:`latim_jax.latim.kinds` for the interface).

    q (b, l, H, a) scaled queries, k and v (b, l, G, a) keys and bias-free values, lse (b, H, l) the
    rows' log-sum-exp, mask (b, l) real positions, window the sliding window (0: none); W_out (H a, d),
    bias, output, h (b, l, d); token_total (b, l, d) or None."""

    window: int = dataclasses.field(metadata=dict(static=True))
    q: jax.Array
    k: jax.Array
    v: jax.Array
    lse: jax.Array
    mask: jax.Array
    gate: jax.Array | None
    W_out: jax.Array
    bias: jax.Array
    output: jax.Array
    h: jax.Array
    token_total: jax.Array | None

    kind = "attention"
    channels_first = False
    positions = {
        "q": (1, "rows"), "k": (1, "sources"), "v": (1, "sources"), "lse": (2, "rows"),
        "mask": (1, "sources"), "gate": (1, "rows"), "bias": (1, "rows"), "output": (1, "rows"),
        "h": (1, "rows"), "token_total": (1, "rows"),
    }  # fmt: skip

    @property
    def sequence_local(self) -> bool:
        """Without a sliding window the weights read positions by order only (causality); a window
        reads their distance, which a compacted sequence does not keep."""
        return self.window == 0

    def weights(self, rows, j0, width: int):
        """alpha (b, H, r, width) for targets ``rows`` and sources [j0, j0 + width) (0 past the end)."""
        cols = j0 + jnp.arange(width)
        k = jnp.take(self.k, cols, axis=1, mode="fill", fill_value=0)
        s = logits(self.q[:, rows], k, rows, cols, self.mask, self.window)
        return jnp.exp(s - self.lse[:, :, rows][..., None])

    def pair_values(self, rows, j0, width: int, blocks: Blocks, *, channels_first: bool = False):
        """V_{ij} = concat_h(alpha^h_{ij} v^{g(h)}_j) (* gate_i with an output gate): (b, r, width, H a)."""
        del blocks, channels_first
        alpha = self.weights(rows, j0, width)
        b, H, r, w = alpha.shape
        G, a = self.v.shape[2:]
        v = jnp.take(self.v, j0 + jnp.arange(width), axis=1, mode="fill", fill_value=0)
        V = jnp.einsum("bgqrw,bwga->brwgqa", alpha.reshape(b, G, H // G, r, w), v).reshape(b, r, w, H * a)
        return V if self.gate is None else V * self.gate[:, rows][:, :, None, :]

    def post_normed(self, r, w):
        """These factors times a post-norm's held scale r (b, l, 1) at the target (into the output gate)
        and its weight w (d,) (into W_out); :func:`latim_jax.latim.kinds.post_normed` scales the rest."""
        gate = r if self.gate is None else self.gate * r
        gate = jnp.broadcast_to(gate, (*r.shape[:2], self.W_out.shape[0]))
        return dataclasses.replace(self, gate=gate, W_out=self.W_out * w)

    def attention_map(self, rows, j0, width: int):
        """The forward's attention weights averaged over heads, (b, r, width): this kind's hidden
        attention (it is the attention itself)."""
        return jnp.mean(self.weights(rows, j0, width), axis=1)


def factors(
    block, h, mask, ctx: Context = XLA, mode: str = "exact", *, hold_fixed=False, with_total=False
) -> AttentionFactors:
    """The factors of one attention block for its input stream h (b, l, d); ``mode`` changes nothing
    (the decomposition is exact in both); ``hold_fixed``: no gradient through alpha or the pre-norm
    scale (the sublayer is differentiated as the linear map of its values)."""
    mixer = block.mixer
    inter = mixer.intermediates(
        block.normed(h, hold_fixed=hold_fixed), mask=mask, ctx=ctx, hold_fixed=hold_fixed
    )
    W_out = mixer.o_proj[...].astype(f32)
    vb = mixer.value_bias()
    gate = inter.gate  # held at the target: o_i = (sum_j alpha_ij v_j + vb) * gate_i W_o
    gated = (lambda x: x) if gate is None else (lambda x: x * gate)
    bias = linear(gated(jnp.broadcast_to(vb, inter.attn.shape)), W_out, mixer._get("o_b"))
    dtype = mixer.o_proj[...].dtype
    if dtype != f32:  # the forward rounds the heads' output to the weight dtype before W_o: no token's
        y = gated(inter.attn)
        bias = bias + linear(y.astype(dtype).astype(f32) - y, W_out)
    bias = jnp.broadcast_to(bias, h.shape)
    return AttentionFactors(
        window=mixer.window,
        q=inter.q,
        k=inter.k,
        v=inter.v,
        lse=inter.lse,
        mask=mask,
        gate=gate,
        W_out=W_out,
        bias=bias,
        output=mixer.output(inter),
        h=h.astype(f32),
        token_total=linear(gated(inter.attn - vb), W_out) if with_total else None,
    )
