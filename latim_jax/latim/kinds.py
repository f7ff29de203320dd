"""The layer-kind registry, filled here: every kind's declaration (:class:`latim_jax.model.kind.LayerKind`,
beside its module) registered with its decomposition, and :func:`factors`, which builds a block's.

Every block of a model names its kind (``block.kind``, from its mixer: "mamba1", "mamba2", ...). A
kind's decomposition

    factors(block, h, mask, ctx, mode, *, hold_fixed, with_total) -> Factors

takes the residual stream h (b, l, d) entering it, ``mask`` (b, l) bool of valid positions, the
execution context and the decomposition mode (a kind that reads the embeddings h^0 beside its stream,
Zamba2's "shared", also gets ``embeddings=``), and returns an instance of a subclass of
:class:`latim_jax.latim.factors.Factors`, whose docstring is the interface the scores read.

A post-norm block (``block.post_norm``: h + RMSNorm(Sublayer(h)), OLMo-Hybrid) is decomposed here for
every kind at once (:func:`post_normed`): its norm's scale held, the norm is a linear map of o.

This module is the one place kinds are registered: it is the lowest floor that sees both a kind's
module (:mod:`latim_jax.model`) and its decomposition (:mod:`latim_jax.latim`), and it imports with the
package, so the model floor's registry is full before any model is built. A new kind is a module with
its ``LayerKind`` (model/<name>.py), a decomposition (latim/<name>.py) and one line below;
docs/architecture.md walks through it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from latim_jax.kernels import f32
from latim_jax.kernels.block_sizes import Blocks
from latim_jax.latim import attention, delta_rule, mamba, mla, parallel_mixer, shared_block, tokenwise
from latim_jax.model.attention import ATTENTION
from latim_jax.model.delta_rule import GDN, KDA
from latim_jax.model.inputs import check_mask
from latim_jax.model.kind import kind_of, register, registered
from latim_jax.model.mixers import MAMBA1, MAMBA2
from latim_jax.model.mla import MLA
from latim_jax.model.mlp import MLP
from latim_jax.model.moe import MOE
from latim_jax.model.parallel_mixer import PARALLEL
from latim_jax.model.shared_block import SHARED
from latim_jax.parallel.context import XLA, Context, resolve


def _own_window(config, width: int) -> bool:  # sequence-local factors without chunks
    del config, width
    return True


def _unwindowed(config, width: int) -> bool:  # attention reads distances under a sliding window
    del width
    return config.sliding_window == 0


def _whole_chunks(name: str):  # the delta rule: a shard of whole chunks of M's tile factors
    return lambda config, width: width % config.section(name).chunk == 0


# the registration: each kind's declaration with its decomposition and where its scores run over "seq"
for _kind, _factors, _window in (
    (MAMBA1, mamba.factors, _own_window),
    (MAMBA2, mamba.factors, _own_window),
    (ATTENTION, attention.factors, _unwindowed),
    (MLP, tokenwise.factors, _own_window),
    (MOE, tokenwise.factors, _own_window),
    (PARALLEL, parallel_mixer.factors, _unwindowed),
    (SHARED, shared_block.factors, None),  # gathered: its source values read every target
    (GDN, delta_rule.factors, _whole_chunks("gdn")),
    (KDA, delta_rule.factors, _whole_chunks("kda")),
    (MLA, mla.factors, _own_window),
):
    register(_kind, factors=_factors, window_scores=_window, replace=True)

KINDS = registered()  # name -> LayerKind, a live read-only view of the registry
MODES = mamba.MODES
check_mode = mamba.check_mode


def factors(
    block, h, mask, ctx: Context = XLA, mode: str = "exact", *, hold_fixed=False, with_total=False,
    embeddings=None,
):  # fmt: skip
    """The factors of ``block`` (its registered kind's decomposition) for the stream h entering it;
    ``embeddings``: h^0, passed to a kind that reads it (``LayerKind.reads_embeddings``: a shared
    block)."""
    if block.kind not in KINDS:
        raise ValueError(f"no decomposition for layer kind {block.kind!r}; registered kinds: {sorted(KINDS)}")
    kind = kind_of(block.kind)
    extra = {"embeddings": embeddings} if kind.reads_embeddings else {}
    f = kind.factors(block, h, mask, ctx, mode, hold_fixed=hold_fixed, with_total=with_total, **extra)
    return post_normed(f, block, hold_fixed=hold_fixed) if block.post_norm else f


def post_normed(f, block, *, hold_fixed=False):
    """The factors of a post-norm block, h + RMSNorm(o), from the factors ``f`` of its sublayer's output
    o (docs/method.md, section 13). With the scale r_i = 1 / rms(o_i) held at its forward value, the norm
    is linear in o: w * r_i * o_i = sum_j w * r_i * T_i(x_j) + w * r_i * beta_i, so every contribution
    and the bias are scaled by r_i at the target and by the norm's weight w on each output channel
    (folded into W_out). A token-wise kind keeps T_i(x_j) = [i = j] out_i; a kind that mixes tokens takes
    r_i into its target-side gate (its factors' ``post_normed(r, w)``)."""
    o = f.output
    r = jax.lax.rsqrt(jnp.mean(o * o, axis=-1, keepdims=True) + block.config.rms_eps)  # (b, l, 1)
    r = jax.lax.stop_gradient(r) if hold_fixed else r
    w = block.norm[...].astype(f32)
    total = None if f.token_total is None else f.token_total * r * w
    changes = dict(output=block.finish(o, hold_fixed=hold_fixed), bias=f.bias * r * w, token_total=total)
    if f.form == "diagonal":  # T_i(x_j) = [i = j] out_i: the normed output still belongs to token i
        return dataclasses.replace(f, **changes)
    scaled = getattr(f, "post_normed", None)
    if scaled is None:
        raise ValueError(f"the decomposition of layer kind {f.kind!r} has no post-norm (post_normed)")
    return dataclasses.replace(scaled(r, w), **changes)


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
    """Whether the factors carry a hidden attention M (their class declares ``form = "ssm"``: the Mamba
    kinds): the fused Pallas kernel and the hidden-attention baseline's tiles read it."""
    return f.form == "ssm"
