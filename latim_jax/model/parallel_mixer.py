"""Parallel sublayers (Falcon-H1): the Mamba-2 mixer and softmax attention read the same normalised
input, and their outputs are added (shape letters: see latim_jax.model.config):

    o_i = Mamba2(xhat)_i + Attention(xhat)_i

The family's multipliers (on the SSM's input, its in_proj segments and output; on the attention's
input, keys and output) are constants folded into the two halves' weights when the checkpoint is read
(convert.hybrids), so the module computes the plain sum. The decomposition is the sum of the halves'
(latim_jax.latim.parallel_mixer).
"""

from __future__ import annotations

from latim_jax.model.attention import ATTENTION, AttentionMixer
from latim_jax.model.kind import LayerKind
from latim_jax.model.mixers import MAMBA2, Mamba2Mixer
from latim_jax.model.params import ComposedModule
from latim_jax.parallel.context import XLA, Context


class ParallelMixer(ComposedModule):
    """Mamba-2 and attention side by side on one input: ``ssm`` and ``attn`` are the two halves, built
    from one parameter dict (their parameter names differ: in_proj, conv_w, ... and q_proj, k_proj, ...)."""

    kind = "parallel"
    PARTS = ("ssm", "attn")

    def __init__(self, config, params: dict):
        self.config = config
        self.ssm = Mamba2Mixer(config, params)
        self.attn = AttentionMixer(config, params)

    def __call__(self, x, *, mask, ctx: Context = XLA):
        """o (b, l, d) fp32 = the Mamba-2 output plus the attention output for the normalised input x."""
        return self.ssm(x, mask=mask, ctx=ctx) + self.attn(x, mask=mask, ctx=ctx)

    def init_cache(self, batch: int, max_length: int):
        """The two halves' caches: (Mamba-2's (conv, ssm), attention's keys and values)."""
        return self.ssm.init_cache(batch, max_length), self.attn.init_cache(batch, max_length)

    def step(self, x_t, cache, valid):
        """One token x_t (b, d) -> (o_t (b, d), cache), both halves stepped."""
        o_s, c_s = self.ssm.step(x_t, cache[0], valid)
        o_a, c_a = self.attn.step(x_t, cache[1], valid)
        return o_s + o_a, (c_s, c_a)


def parallel_memory(c, b: int, length: int, rows: int, cols: int) -> int:
    """Both halves' factors are held at once: the Mamba-2 layer's bytes plus the attention's."""
    return MAMBA2.memory(c, b, length, rows, cols) + ATTENTION.memory(c, b, length, rows, cols)


def _check_parallel(c) -> None:
    """A parallel block reads Mamba-2's and the attention's config fields."""
    MAMBA2.check(c)
    ATTENTION.check(c)


PARALLEL = LayerKind(
    name="parallel", display="Mamba-2 + attention", module=ParallelMixer,
    shapes=lambda c: {**MAMBA2.shapes(c), **ATTENTION.shapes(c)},
    output_params=MAMBA2.output_params + ATTENTION.output_params, check=_check_parallel,
    init=MAMBA2.init, channel_axis=MAMBA2.channel_axis, memory=parallel_memory, version=2,
    holds_attention=True, splits_sequence=True, halo=MAMBA2.halo,  # both halves take "seq"
)  # fmt: skip
