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
from latim_jax.model.lm import block_forward, side_input
from latim_jax.parallel.context import XLA, Context


def target_logits(
    model, h, layer: int, rows, targets, mask, ctx: Context = XLA, embeddings=None, foil=None
):  # fmt: skip
    """Run layers ``layer..`` on the residual stream h (b, l, d) and return only the asked rows' target
    logits (b, r): logit_{i, w_i} = final_hidden(h_i) . E[w_i] / logits_scaling, the head's own
    rounding (the weight dtype, fp32 accumulation) on r rows instead of the (b, l, v) logits.
    ``embeddings``: h^0, which a shared block reads (held: the gradient is the stream's at ``layer``).
    ``foil`` (b, l) ids: logit_{i, w_i} - logit_{i, f_i} instead (each rounded as the head rounds it)."""
    for block in model.layers[layer:]:
        h = block_forward(block, h, mask, ctx=ctx, embeddings=side_input(block, embeddings))
    w = model.unembedding
    final = model.final_hidden(h[:, rows]).astype(w.dtype)  # (b, r, d)

    def logit(ids):
        rows_w = jnp.take(w, ids[:, rows], axis=0)  # (b, r, d)
        logits = jnp.einsum("brd,brd->br", final, rows_w, preferred_element_type=f32)
        return logits / model.config.logits_scaling

    return logit(targets) if foil is None else logit(targets) - logit(foil)


def grad_input_scores(
    model, h, layer: int, rows, targets, mask, ctx: Context = XLA, embeddings=None, foil=None
):  # fmt: skip
    """Gradient x input scores (b, len(rows), l) of ``layer`` for rows with vocabulary targets (b, l)
    (with a ``foil`` (b, l): of the logit difference target - foil);
    causal and padding pairs are zeroed by :func:`latim_jax.latim.scores.finish_scores`. One
    linearisation of the gathered target logits, then one backward pass per row whose cotangent is a
    one-hot over the r rows (not over (l, v) logits: the head's backward is O(r d) per row)."""
    h = h.astype(f32)

    # at layer 0 the stream is h^0 itself: a shared block's read of it is differentiated too
    def logits(x):
        return target_logits(model, x, layer, rows, targets, mask, ctx, x if layer == 0 else embeddings, foil)

    _, vjp = jax.vjp(logits, h)
    b, r = h.shape[0], rows.shape[0]

    def one_row(k):
        (g,) = vjp(jnp.broadcast_to(jax.nn.one_hot(k, r, dtype=f32), (b, r)))
        return safe_norm(g * h, -1)  # (b, l)

    return finish_scores(jnp.moveaxis(jax.lax.map(one_row, jnp.arange(r)), 0, 1), "grad_input", rows, mask)
