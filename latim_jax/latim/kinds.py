"""The layer-kind seam: how each kind of residual sublayer writes its output as a sum over source tokens.

Every block of a model names its kind (``block.kind``, from its mixer: "mamba1", "mamba2"). :data:`KINDS`
maps a kind to the function that builds its factors,

    factors(block, h, mask, ctx, mode, *, hold_fixed, with_total) -> factors of the layer

for the residual stream h (b, l, d) entering it, ``mask`` (b, l) bool of valid positions, the execution
context and the decomposition mode (a kind that reads the embeddings h^0 beside its stream, Zamba2's
"shared", also gets ``embeddings=``). The scores, the attribution loop and the conservation checks use
only this interface of the factors:

    kind                       the kind's name
    length                     l
    h, output, bias            (b, l, d): the stream entering the layer, the sublayer's output o, and
                               beta, the part of o that belongs to no token
    W_out                      (e, d): T_i(x_j) = V_{i,j} @ W_out; None: V_{i,j} is T_i(x_j) (e = d)
    token_total                (b, l, d) sum_j T_i(x_j) in O(l) (when built with with_total), or None
    pair_values(rows, j0, width, blocks, channels_first=False)
                               V (b, r, width, e) for target rows ``rows`` and sources [j0, j0 + width)
    channels_first             the layout pair_values is fastest in ((b, e, r, width) when True)
    tiles(n_rows, blocks)      the kind's default tiles completed with the caller's ``blocks``

and, where the kind has one, ``ssm`` (:class:`latim_jax.kernels.decay.SSM`): the hidden-attention
inputs, which the hidden-attention baseline and the fused Pallas score kernel read; a kind without
one gives its own map as ``attention_map(rows, j0, width)`` (b, r, width) (attention: the forward's
weights averaged over heads; token-wise: the identity).

A new kind (an attention sublayer, a token-wise MLP, a parallel block) plugs in here: a mixer module in
:mod:`latim_jax.model` whose ``kind`` names it, a module beside this one that builds its factors, and
one entry in :data:`KINDS`. docs/architecture.md walks through it.
"""

from __future__ import annotations

import jax.numpy as jnp

from latim_jax.kernels import f32
from latim_jax.kernels.block_sizes import Blocks
from latim_jax.latim import attention, mamba, parallel_mixer, shared_block, tokenwise
from latim_jax.model.inputs import check_mask
from latim_jax.parallel.context import XLA, Context, resolve

KINDS = {
    "mamba1": mamba.factors,
    "mamba2": mamba.factors,
    "attention": attention.factors,
    "mlp": tokenwise.factors,
    "moe": tokenwise.factors,
    "parallel": parallel_mixer.factors,
    "shared": shared_block.factors,
}
MODES = mamba.MODES
check_mode = mamba.check_mode


def factors(
    block, h, mask, ctx: Context = XLA, mode: str = "exact", *, hold_fixed=False, with_total=False,
    embeddings=None,
):  # fmt: skip
    """The factors of ``block`` (its kind's builder from :data:`KINDS`) for the stream h entering it;
    ``embeddings``: h^0, passed to a kind that reads it (``block.reads_embeddings``: a shared block)."""
    build = KINDS.get(block.kind)
    if build is None:
        raise ValueError(f"no decomposition for layer kind {block.kind!r}; known kinds: {sorted(KINDS)}")
    extra = {"embeddings": embeddings} if block.reads_embeddings else {}
    return build(block, h, mask, ctx, mode, hold_fixed=hold_fixed, with_total=with_total, **extra)


def layer_factors(model, h, layer: int, mode: str = "exact", *, mask=None, impl="auto", embeddings=None):
    """The factors of ``model.layers[layer]`` for the residual stream h (b, l, d) entering it: a helper for
    tests, benchmarks and exploration (``mask`` (b, l) bool or None for all valid; ``impl`` as
    :func:`latim_jax.attribute` takes it; ``embeddings`` h^0 for a shared block); ``token_total``
    included."""
    mask = check_mask(mask, *h.shape[:2])
    return factors(model.layers[layer], h, mask, resolve(impl), mode, with_total=True, embeddings=embeddings)


def full_contributions(f, blocks: Blocks | None = None):
    """T (b, l, l, d): T[:, i, j] = T_i(x_j), exactly zero for j > i (small inputs only)."""
    idx = jnp.arange(f.length)
    blocks = f.tiles(None, blocks)
    return project(f.pair_values(idx, 0, f.length, blocks), f.W_out)


def project(V, W_out, precision: str = "float32", channels_first: bool = False):
    """T = V @ W_out over e: (b, r, q, e) x (e, d) -> (b, r, q, d), the score path's dominant matrix
    product (``W_out`` None: V is T already); "bfloat16" rounds both operands to bf16 and accumulates
    in fp32 (matrix units). ``channels_first``: V is (b, e, r, q)."""
    if W_out is None:
        return jnp.moveaxis(V, 1, 3) if channels_first else V
    if precision == "bfloat16":
        V, W_out = V.astype(jnp.bfloat16), W_out.astype(jnp.bfloat16)
    spec = "berj,ed->brjd" if channels_first else "brje,ed->brjd"
    return jnp.einsum(spec, V, W_out, preferred_element_type=f32)


def has_ssm(f) -> bool:
    """Whether the factors carry a hidden attention M (the Mamba kinds): the fused Pallas kernel and
    the hidden-attention baseline's tiles read it."""
    return getattr(f, "ssm", None) is not None
