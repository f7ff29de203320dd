"""The token-wise layer kinds ("mlp", "moe", and any other per-position sublayer): a sublayer whose
output at i reads position i alone mixes no tokens (docs/method.md, section 8):

    T_i(x_j) = [i = j] o_i,   beta_i = 0

so its l2 / l1 maps are diagonal, its ALTI rows one-hot, and in a rollout it is the identity map (the
residual and the sublayer's output both belong to token i). ``W_out`` is None: V_{ij} is already
T_i(x_j) (the score path skips the projection).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from latim_jax.kernels import f32
from latim_jax.kernels.block_sizes import Blocks
from latim_jax.latim.factors import Factors
from latim_jax.parallel.context import XLA, Context


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TokenwiseFactors(Factors):
    """One token-wise sublayer's factors: output o, h (b, l, d); bias zeros; token_total = o."""

    kind: str = dataclasses.field(metadata=dict(static=True))
    bias: jax.Array
    output: jax.Array
    h: jax.Array
    token_total: jax.Array | None

    form = "diagonal"
    channels_first = False
    W_out = None
    positions = {"bias": (1, "rows"), "output": (1, "rows"), "h": (1, "rows"), "token_total": (1, "rows")}

    def pair_values(self, rows, j0, width: int, blocks: Blocks, *, channels_first: bool = False):
        """V_{ij} = T_i(x_j) = [i = j] o_i: (b, r, width, d)."""
        del blocks, channels_first
        diag = (rows[:, None] == (j0 + jnp.arange(width))[None, :]).astype(f32)  # (r, width)
        return diag[None, :, :, None] * self.output[:, rows][:, :, None, :]

    def diagonal_scores(self, method: str, rows, aux=None):
        """The unnormalised scores (b, r, l) of target ``rows`` without the tile loop: every pair but
        (i, i) is 0, and c_ii is ||o_i||_2 (l2), ||o_i||_1 (l1), the ALTI gain ||hout_i||_1 - ||hout_i -
        (o_i + h_i)||_1 = ||hout_i||_1 (alti), aux_i . o_i (logit); "logit+alti": both, (b, r, l, 2)."""
        o = self.output[:, rows]  # (b, r, d)
        if method == "logit+alti":
            return jnp.stack([self.diagonal_scores(m, rows, aux) for m in ("logit", "alti")], -1)
        if method == "l2":
            sq = jnp.sum(o * o, -1)  # a zero norm gets gradient 0, not NaN
            c = jnp.where(sq == 0, 0.0, jnp.sqrt(jnp.where(sq == 0, 1.0, sq)))
        elif method == "l1":
            c = jnp.sum(jnp.abs(o), -1)
        elif method == "alti":
            c = jnp.sum(jnp.abs(o + self.h[:, rows]), -1)
        elif method == "logit":
            c = jnp.sum(aux[:, rows] * o, -1)
        else:
            raise ValueError(f"unknown LaTIM score {method!r}")
        diag = rows[:, None] == jnp.arange(self.length)[None, :]  # (r, l)
        return jnp.where(diag[None], c[..., None], 0.0)

    def attention_map(self, rows, j0, width: int):
        """This kind's hidden attention: the identity (each position reads itself), (b, r, width)."""
        diag = (rows[:, None] == (j0 + jnp.arange(width))[None, :]).astype(f32)
        return jnp.broadcast_to(diag, (self.h.shape[0], *diag.shape))


def factors(
    block, h, mask, ctx: Context = XLA, mode: str = "exact", *, hold_fixed=False, with_total=False
) -> TokenwiseFactors:
    """The factors of one token-wise block for its input stream h (b, l, d) (``mode``, ``mask`` and
    ``hold_fixed`` change nothing: no token is mixed, nothing is held)."""
    del mode, hold_fixed
    o = block.mixer(block.normed(h), mask=mask, ctx=ctx)
    return TokenwiseFactors(
        kind=block.kind,
        bias=jnp.zeros_like(o),
        output=o,
        h=h.astype(f32),
        token_total=o if with_total else None,
    )
