"""Baseline attributions: gradient x input at a layer's input (the hidden attention baseline:
latim_jax.latim.hidden_attention).

grad_input: for target row i with vocabulary entry w_i, c^l_ij = || (d logit_{i,w_i} / d h^l_j) * h^l_j ||_2,
the l2 norm over d_model of gradient x input at the residual stream h^l entering layer l.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from latim_jax.kernels import f32
from latim_jax.latim.scores import finish_scores, safe_norm
from latim_jax.model.lm import block_forward
from latim_jax.parallel.context import XLA, Context


def logits_from_layer(model, h, layer: int, mask, ctx: Context = XLA):
    """Run layers ``layer..`` and the head on the residual stream h (b, l, d) -> logits (b, l, v)."""
    for block in model.layers[layer:]:
        h = block_forward(block, h, mask, ctx=ctx)
    return model.head(h)


def grad_input_scores(model, h, layer: int, rows, targets, mask, ctx: Context = XLA):
    """Gradient x input scores (b, len(rows), l) of ``layer`` for rows with vocabulary targets (b, l);
    causal and padding pairs are zeroed by :func:`latim_jax.latim.scores.finish_scores`."""
    _, vjp = jax.vjp(lambda x: logits_from_layer(model, x, layer, mask, ctx), h.astype(f32))
    b, length = h.shape[:2]
    vocab = model.config.n_tokens

    def one_row(i):
        onehot = jax.nn.one_hot(targets[:, i], vocab, dtype=f32)  # (b, v)
        cot = jnp.zeros((b, length, vocab), f32).at[:, i].set(onehot)
        (g,) = vjp(cot)
        gx = g * h
        return safe_norm(gx, -1)  # (b, l)

    return finish_scores(jnp.moveaxis(jax.lax.map(one_row, rows), 0, 1), "grad_input", rows, mask)
