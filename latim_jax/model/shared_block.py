"""Shared-block sublayers (Zamba2): a Mamba-2 sublayer whose input also receives the output of a
transformer block that reads the stream beside the embeddings (shape letters: see
latim_jax.model.config; h^0 the embeddings entering layer 0):

    t   = MLP(RMSNorm_ff(Attention(RMSNorm_attn([h; h^0])))) W_s          (no residual inside)
    out = h + Mamba2(RMSNorm(h + t))                                       (the residual is h, not h + t)

so t reaches the stream only through the Mamba-2's input. The attention reads 2 d channels (head dim
2 d / H, softmax scale (a / 2)^-1/2, config.attn_scale); its MLP is gated. Zamba2 ties the block's
weights every ``num_mem_blocks`` hybrid layers and gives each layer its own low-rank adapters on q, k,
v and the MLP's gate|up projection; the checkpoint reader folds a layer's adapters into its own copy
of the weights (convert.hybrids), so each sublayer holds plain matrices. The decomposition follows
a source token through both hops (latim_jax.latim.shared_block).
"""

from __future__ import annotations

import jax.numpy as jnp

from latim_jax.kernels import f32
from latim_jax.model.attention import ATTENTION, AttentionMixer
from latim_jax.model.kind import LayerKind
from latim_jax.model.layers import linear, rms_norm
from latim_jax.model.mixers import MAMBA2, Mamba2Mixer
from latim_jax.model.mlp import MLP, MLPMixer
from latim_jax.model.params import ComposedModule
from latim_jax.parallel.context import XLA, Context


class SharedBlockMixer(ComposedModule):
    """A shared transformer block feeding a Mamba-2 mixer: ``ssm`` (the Mamba-2 mixer), ``attn`` (the
    attention on [h; h^0]), ``mlp`` (the gated MLP) and its own attn_norm, ff_norm and shared_out, all
    built from one flat parameter dict (their names differ). The Mamba-2's pre-norm is the block's
    norm (:class:`latim_jax.model.lm.Block`), which also runs the residual."""

    kind = "shared"
    NAMES = ("attn_norm", "ff_norm", "shared_out")
    PARTS = ("ssm", "attn", "mlp")

    def __init__(self, config, params: dict):
        super().__init__(config, params)
        self.ssm = Mamba2Mixer(config, params)
        self.attn = AttentionMixer(config, params)
        self.mlp = MLPMixer(config, params)

    def attn_input(self, h, embeddings, *, hold_fixed=False):
        """RMSNorm_attn([h; h^0]) (b, l, 2d), cast to the weight dtype; ``hold_fixed``: the norm's scale
        without gradient."""
        w = self.attn_norm[...]
        x = jnp.concatenate([h.astype(f32), embeddings.astype(f32)], axis=-1)
        return rms_norm(x, w, self.config.rms_eps, hold_scale=hold_fixed).astype(w.dtype)

    def ff_input(self, a, *, hold_fixed=False):
        """RMSNorm_ff of the attention output a (b, l, d), cast to the weight dtype."""
        w = self.ff_norm[...]
        return rms_norm(a, w, self.config.rms_eps, hold_scale=hold_fixed).astype(w.dtype)

    def feed_forward(self, a):
        """t = MLP(RMSNorm_ff(a)) W_s (..., l, d) fp32 for the attention output a (..., l, d)."""
        return linear(self.mlp(self.ff_input(a)), self.shared_out[...])

    def transformer(self, h, embeddings, *, mask, ctx: Context = XLA):
        """t (b, l, d) fp32: the block's output, which the Mamba-2 reads added to its input stream h."""
        return self.feed_forward(self.attn(self.attn_input(h, embeddings), mask=mask, ctx=ctx))

    def init_cache(self, batch: int, max_length: int):
        """(the attention's keys and values, the Mamba-2's (conv, ssm))."""
        return self.attn.init_cache(batch, max_length), self.ssm.init_cache(batch, max_length)

    def transformer_step(self, h_t, e_t, cache, valid):
        """One token: (t_t (b, d), the attention's cache) for the stream h_t and embedding e_t (b, d)."""
        x = self.attn_input(h_t[:, None], e_t[:, None])[:, 0]
        a, cache = self.attn.step(x, cache, valid)
        return self.feed_forward(a[:, None])[:, 0], cache


def shared_block_shapes(c) -> dict[str, tuple[int, ...]]:
    """A shared transformer block's parameters (Zamba2; one copy per sublayer, each with its own adapters
    folded in): attn_norm (2d,) over [h; h^0], the attention's q_proj (2d, H a), k_proj and v_proj
    (2d, G a), o_proj (H a, d), ff_norm (d,), the gated MLP's gate_proj, up_proj (d, f), down_proj (f, d),
    and shared_out (d, d), the linear map into the Mamba-2's input; gate_b, up_b (f,), down_b (d,) when
    ``mlp_bias``."""
    d, a = c.d_model, c.attn_head_dim
    out = {
        "attn_norm": (2 * d,),
        "q_proj": (2 * d, c.attn_heads * a),
        "k_proj": (2 * d, c.attn_kv_heads * a),
        "v_proj": (2 * d, c.attn_kv_heads * a),
        "o_proj": (c.attn_heads * a, d),
        "ff_norm": (d,),
        "gate_proj": (d, c.mlp_width),
        "up_proj": (d, c.mlp_width),
        "down_proj": (c.mlp_width, d),
        "shared_out": (d, d),
    }
    if c.mlp_bias:
        out.update(gate_b=(c.mlp_width,), up_b=(c.mlp_width,), down_b=(d,))
    return out


def _check_shared(c) -> None:
    """A shared block reads Mamba-2's, the attention's and the MLP's config fields."""
    MAMBA2.check(c)
    ATTENTION.check(c)
    MLP.check(c)


def shared_memory(c, b: int, length: int, rows: int, cols: int) -> int:
    """The Mamba-2's and the attention's factors, the MLP's hidden activations, and a source block's two
    hops: its share of every position's input, (l, 32 sources, .)."""
    L, d, e = length, c.d_model, c.d_inner
    hops = b * L * min(32, L) * (3 * d + c.mlp_width + 5 * e + 2 * c.attn_heads * c.attn_head_dim) * 4
    own = MAMBA2.memory(c, b, L, rows, cols) + ATTENTION.memory(c, b, L, rows, cols)
    return own + b * L * c.mlp_width * 2 * 4 + hops


SHARED = LayerKind(
    name="shared", display="shared block + Mamba-2", module=SharedBlockMixer,
    shapes=lambda c: {**MAMBA2.shapes(c), **shared_block_shapes(c)},
    output_params=MAMBA2.output_params,  # the block's output reaches the stream only through the SSM
    check=_check_shared, init=MAMBA2.init, channel_axis=MAMBA2.channel_axis, memory=shared_memory,
    version=2, holds_attention=True, reads_embeddings=True,
    splits_sequence=True, halo=MAMBA2.halo,  # its attention gathers, its Mamba-2 splits; h^0 is per token
)  # fmt: skip
