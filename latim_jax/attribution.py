"""The public attribution API: contributions, attribute, conservation_error and the Attribution result."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from latim_jax.baselines import grad_input_scores
from latim_jax.decomposition import check_mode, full_contributions, layer_factors
from latim_jax.jit import jit_model_fn
from latim_jax.kernels.dispatch import check_impl
from latim_jax.layers import f32
from latim_jax.results import Attribution
from latim_jax.scores import METHODS, Blocks, layer_scores, normalise_alti, token_sum


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Contributions:
    """One layer's decomposition: T (b, l, l, d) with T[:, i, j] = T_i(x_j) (zero for j > i),
    bias (b, l, d) the non-token term beta, output (b, l, d) the mixer output o (no residual)."""

    T: jax.Array
    bias: jax.Array
    output: jax.Array


def _layer_input(model, tokens, layer, impl):
    """The residual stream entering ``layer`` (already validated by :func:`_check_layer`)."""
    model.check_tokens(tokens)
    return model.forward(tokens, impl=impl).residuals[layer]


def _check_layer(model, layer):
    n = model.config.n_layers
    if not isinstance(layer, int | np.integer) or not -n <= layer < n:
        raise ValueError(f"layer must be an int in [0, {n}), found {layer!r}")
    return int(layer) % n


def contributions(model, tokens, layer: int, mode: str = "exact", *, impl: str = "auto") -> Contributions:
    """Materialise layer ``layer``'s token-to-token contributions (for small inputs and tests).

    ``sum_j T[:, i, j] + bias[:, i] == output[:, i]`` holds to float rounding in ``mode="exact"``;
    ``mode="paper"`` is the published additive approximation (bias = out_proj bias only).
    """
    check_mode(mode)
    tokens = jnp.asarray(tokens)
    layer = _check_layer(model, layer)
    h = _layer_input(model, tokens, layer, impl)
    f = layer_factors(model, h, layer, mode, impl=impl)
    return Contributions(T=full_contributions(f), bias=f.bias, output=f.output)


def conservation_error(model, tokens, layer: int, mode: str = "exact", *, impl: str = "auto") -> float:
    """max_i ||sum_j T_i(x_j) + beta_i - o_i||_2 / max_i ||o_i||_2 for one layer.

    Evaluated block by block (O(l) memory per row).

    In exact mode this is float rounding (about 1e-6 in fp32); in paper mode it is the approximation.
    """
    check_mode(mode)
    tokens = jnp.asarray(tokens)
    layer = _check_layer(model, layer)
    h = _layer_input(model, tokens, layer, impl)
    f = layer_factors(model, h, layer, mode, impl=impl)
    rec = token_sum(f, jnp.arange(f.length)) + f.bias
    err = jnp.linalg.norm(rec - f.output, axis=-1).max() / jnp.linalg.norm(f.output, axis=-1).max()
    return float(err)


def attribute(
    model,
    tokens,
    method: str = "alti",
    mode: str = "exact",
    layers: Sequence[int] | None = None,
    rows: Sequence[int] | None = None,
    mask=None,
    *,
    target=None,
    impl: str = "auto",
    blocks: Blocks | None = None,
) -> Attribution:
    """Token-to-token attribution scores for every (or the selected) layer of a Mamba model.

    Args:
      model: a :class:`latim_jax.model.MambaLM` (from :func:`latim_jax.load`).
      tokens: int ids (B, L).
      method: "l2", "l1", "alti", "logit" (LaTIM scores), "hidden_attention" or "grad_input" (baselines).
      mode: "exact" (contributions sum to the layer output) or "paper" (the published approximation).
      layers: layer indices (default: all).
      rows: target positions to score (default: all L); a subset costs O(L) per row.
      mask: optional (B, L) bool of valid positions (padding on the right); masked rows/columns are 0.
      target: vocabulary entries for "logit"/"grad_input": None (the model's own prediction at each
        position), an int, or ints (B, L).
      impl: "auto" (Pallas kernels on TPU/GPU, XLA on CPU), "xla", or "pallas" (the scan kernels and the
        fused score kernel; interpret mode on CPU).
      blocks: block sizes of the memory-bounded path.

    Returns an :class:`Attribution` whose ``scores`` are (B, n_layers, R, L) float32. Pure JAX: works
    under ``jax.jit`` and ``jax.vmap`` (NaN checks and id range checks run only on concrete inputs).
    """
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; expected one of {METHODS}")
    check_mode(mode)
    check_impl(impl)
    tokens = jnp.asarray(tokens)
    model.check_tokens(tokens)
    B, L = tokens.shape
    n = model.config.n_layers
    layer_list = tuple(range(n)) if layers is None else tuple(_check_layer(model, x) for x in layers)
    if not layer_list:
        raise ValueError("layers must name at least one layer")
    row_list = None if rows is None else tuple(_check_row(r, L) for r in rows)
    if row_list is not None and not row_list:
        raise ValueError("rows must name at least one position")
    if mask is not None:
        mask = jnp.asarray(mask)
        if mask.shape != (B, L):
            raise ValueError(f"mask must have shape (batch, length) = {(B, L)}, found {tuple(mask.shape)}")
        mask = mask.astype(bool)
    targets = _targets(target, B, L, model.config.vocab_size)
    row_idx = jnp.arange(L) if row_list is None else jnp.asarray(row_list, jnp.int32)
    scores, extra = _attribute(
        model,
        tokens,
        row_idx,
        targets,
        method=method,
        mode=mode,
        layers=layer_list,
        impl=impl,
        blocks=blocks,
        whole=row_list is None and layer_list == tuple(range(n)),
    )
    if mask is not None:
        scores, extra = _apply_mask(scores, extra, mask, row_idx, method)
    result = Attribution(
        scores=scores,
        tokens=tokens,
        extra=extra,
        method=method,
        mode=mode,
        layers=layer_list,
        rows=row_list,
        model=getattr(model, "source", None) or "",
    )
    result.check_finite()
    return result


def _check_row(r, L):
    if not isinstance(r, int | np.integer) or not -L <= r < L:
        raise ValueError(f"rows must be ints in [0, {L}), found {r!r}")
    return int(r) % L


def _targets(target, B, L, vocab):
    if target is None:
        return None
    t = jnp.asarray(target)
    if t.ndim == 0:
        t = jnp.full((B, L), t)
    if t.shape != (B, L) or not jnp.issubdtype(t.dtype, jnp.integer):
        raise ValueError(
            f"target must be an int or int ids of shape {(B, L)}, found {t.dtype} {tuple(t.shape)}"
        )
    if not isinstance(t, jax.core.Tracer) and (int(t.min()) < 0 or int(t.max()) >= vocab):
        raise ValueError(f"target ids must lie in [0, {vocab})")
    return t


@jit_model_fn(static_argnames=("method", "mode", "layers", "impl", "blocks", "whole"))
def _attribute(model, tokens, rows, targets, method, mode, layers, impl, blocks, whole):
    out = model.forward(tokens, impl=impl)
    if targets is None:
        targets = jnp.argmax(out.logits, -1)
    extra = {"targets": targets}
    # logit direction v_i = g_f * E_{w_i} / r_i, r_i from the stream entering the final norm
    h_final = out.residuals[-1]
    r_inv = jax.lax.rsqrt(jnp.mean(h_final * h_final, -1, keepdims=True) + model.config.rms_eps)
    direction = (
        model.norm_f[...].astype(f32) * jnp.take(model.unembedding, targets, axis=0).astype(f32) * r_inv
    )
    scores, approx, alti, bias_terms = [], [], [], []
    for layer in layers:
        h = out.residuals[layer]
        if method == "grad_input":
            scores.append(grad_input_scores(model, h, layer, rows, targets, impl=impl))
            continue
        f = layer_factors(model, h, layer, mode, impl=impl)
        aux = jnp.einsum("bld,ed->ble", direction, f.W_out) if method == "logit" else None
        scores.append(layer_scores(f, method, rows, blocks=blocks, aux=aux, impl=impl))
        if method == "logit":
            bias_terms.append(jnp.einsum("bld,bld->bl", f.bias, direction)[:, rows])
            if whole:
                alti.append(layer_scores(f, "alti", rows, blocks=blocks, impl=impl))
        if mode == "paper" and method != "hidden_attention":
            rec = f.token_total + f.bias  # O(l): one scan (test_attribution checks it == token_sum)
            rel = jnp.linalg.norm(rec - f.output, axis=-1) / jnp.linalg.norm(f.output, axis=-1)
            approx.append(jnp.mean(rel))
    if method == "logit":
        extra["direct"] = jnp.einsum("bld,bld->bl", out.residuals[0], direction)[:, rows]
        extra["bias"] = jnp.stack(bias_terms, 1)
        extra["logit"] = jnp.take_along_axis(out.logits, targets[..., None], -1)[..., 0][:, rows]
        if whole:
            extra["alti"] = jnp.stack(alti, 1)
    if approx:
        extra["approximation_error"] = jnp.stack(approx)
    return jnp.stack(scores, 1), extra


def _apply_mask(scores, extra, mask, rows, method):
    keep = mask[:, None, rows, None] & mask[:, None, None, :]
    scores = jnp.where(keep, scores, 0.0)
    if method == "alti":
        scores = jnp.where(keep, normalise_alti(scores, rows), 0.0)
    if "alti" in extra:
        full = mask[:, None, :, None] & mask[:, None, None, :]
        a = jnp.where(full, extra["alti"], 0.0)
        extra = {**extra, "alti": jnp.where(full, normalise_alti(a, jnp.arange(a.shape[-1])), 0.0)}
    return scores, extra
