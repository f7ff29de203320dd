"""The parallel layer kind ("parallel", Falcon-H1): Mamba-2 and attention read the same normalised input
and their outputs add, so the sublayer's contributions are the sum of the halves' (docs/method.md,
section 13):

    T_i(x_j) = T^ssm_i(x_j) + T^attn_i(x_j) = [V^ssm_ij | V^attn_ij] @ [W_out^ssm ; W_o]
    beta_i   = beta^ssm_i + beta^attn_i

each half exact on its own (the Mamba-2 kind's exact or paper mode, the attention's value path), the
multipliers already folded into the weights. One value block per tile holds both halves side by side
(e + H a channels), so the score path projects once.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from latim_jax.kernels.block_sizes import Blocks
from latim_jax.latim import attention, mamba
from latim_jax.latim.factors import Factors
from latim_jax.parallel.context import XLA, Context


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ParallelFactors(Factors):
    """A parallel sublayer's factors: ``ssm_part`` (:class:`latim_jax.latim.mamba.MambaFactors`) and
    ``attn_part`` (:class:`latim_jax.latim.attention.AttentionFactors`) of the two halves; W_out
    (e + H a, d) their output matrices stacked; bias, output, h (b, l, d) and token_total the sums.
    It has no ``ssm`` of its own: the fused Pallas kernel (one Mamba tile per block) does not apply,
    and its hidden attention is the attention half's weights (:meth:`attention_map`)."""

    ssm_part: mamba.MambaFactors
    attn_part: attention.AttentionFactors
    W_out: jax.Array
    bias: jax.Array
    output: jax.Array
    h: jax.Array
    token_total: jax.Array | None

    kind = "parallel"
    channels_first = False
    parts = ("ssm_part", "attn_part")
    positions = {"bias": (1, "rows"), "output": (1, "rows"), "h": (1, "rows"), "token_total": (1, "rows")}

    def pair_values(self, rows, j0, width: int, blocks: Blocks, *, channels_first: bool = False):
        """V_{ij} = [V^ssm_ij | V^attn_ij]: (b, r, width, e + H a), so that T_i(x_j) = V_{ij} @ W_out."""
        del channels_first
        halves = (self.ssm_part, self.attn_part)
        return jnp.concatenate([f.pair_values(rows, j0, width, blocks) for f in halves], axis=-1)

    def attention_map(self, rows, j0, width: int):
        """The attention half's weights averaged over heads, (b, r, width): the block's hidden attention
        (the SSM half's is a different, unnormalised quantity and is not mixed in)."""
        return self.attn_part.attention_map(rows, j0, width)


@dataclasses.dataclass(frozen=True)
class _Half:
    """One half of a parallel block seen as a block of its own kind: the shared pre-norm, its own mixer."""

    block: object
    mixer: object

    @property
    def config(self):
        return self.block.config

    @property
    def ssm_mixer(self):
        return self.mixer

    def normed(self, h, *, hold_fixed=False):
        return self.block.normed(h, hold_fixed=hold_fixed)

    def projected(self, h, *, hold_fixed=False):
        return self.mixer.in_projection(self.normed(h, hold_fixed=hold_fixed))


def factors(
    block, h, mask, ctx: Context = XLA, mode: str = "exact", *, hold_fixed=False, with_total=False
) -> ParallelFactors:
    """The factors of one parallel block for its input stream h (b, l, d): the Mamba-2 kind's factors of
    the SSM half (in ``mode``) and the attention kind's of the other, summed."""
    common = dict(ctx=ctx, mode=mode, hold_fixed=hold_fixed, with_total=with_total)
    s = mamba.factors(_Half(block, block.mixer.ssm), h, mask, **common)
    a = attention.factors(_Half(block, block.mixer.attn), h, mask, **common)
    total = None if s.token_total is None else s.token_total + a.token_total
    return ParallelFactors(
        ssm_part=dataclasses.replace(s, W_out=None, token_total=None),
        attn_part=dataclasses.replace(a, W_out=None, token_total=None),
        W_out=jnp.concatenate([s.W_out, a.W_out], axis=0),
        bias=s.bias + a.bias,
        output=s.output + a.output,
        h=s.h,
        token_total=total,
    )
