"""The multi-head latent attention kind ("mla"): the attention kind's decomposition (docs/method.md, section
13) over the mla's own queries, keys and values. Each value v_j = (RMSNorm(xhat_j W_kva)_c W_kvb)_v is
computed from token j alone, so with the softmax weights held fixed T_i(x_j) = W_O concat_h(alpha^h_ij
v^h_j) and beta_i = b_O: exact in both modes."""

from __future__ import annotations

import dataclasses

import jax

from latim_jax.latim import attention
from latim_jax.parallel.context import XLA, Context


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MLAFactors(attention.AttentionFactors):
    """An mla sublayer's factors: the attention kind's, every head with its own keys and values."""

    kind = "mla"


def factors(
    block, h, mask, ctx: Context = XLA, mode: str = "exact", *, hold_fixed=False, with_total=False
) -> MLAFactors:
    """The factors of one mla block for its input stream h (b, l, d): :func:`latim_jax.latim.attention.
    factors` over the mla's projections (``mode`` changes nothing)."""
    f = attention.factors(block, h, mask, ctx, mode, hold_fixed=hold_fixed, with_total=with_total)
    return MLAFactors(**{field.name: getattr(f, field.name) for field in dataclasses.fields(f)})
