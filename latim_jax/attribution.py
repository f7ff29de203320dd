"""The public attribution API: contributions, attribute, conservation_error and the Attribution result.

Each layer is scored by one jitted per-layer function (all layers of a model share its graph
structure, so it compiles once whatever the depth), called in a Python loop over the requested
layers after one forward pass for the residual streams.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from latim_jax.baselines import grad_input_scores
from latim_jax.decomposition import block_factors, check_mode, full_contributions
from latim_jax.inputs import check_layers, check_rows, is_traced
from latim_jax.jit import jit_model_fn
from latim_jax.kernels.dispatch import check_impl
from latim_jax.layers import f32
from latim_jax.results import Attribution
from latim_jax.scores import AGGREGATIONS, DEFAULT_AGGREGATION, METHODS, Blocks, layer_scores, token_sum
from latim_jax.sharding import DATA, P, Runtime, gather, pad_batch, put


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Contributions:
    """One layer's decomposition: T (b, l, l, d) with T[:, i, j] = T_i(x_j) (zero for j > i and for pad
    sources), bias (b, l, d) the non-token term beta, output (b, l, d) the mixer output o (no residual)."""

    T: jax.Array
    bias: jax.Array
    output: jax.Array


def _check_layer(model, layer):
    if isinstance(layer, bool) or not isinstance(layer, int | np.integer):
        raise ValueError(f"layer must be an int in [0, {model.config.n_layers}), found {layer!r}")
    return check_layers(int(layer), model.config.n_layers)[0]


def _layer_input(model, tokens, layer, impl, *, mask=None, inputs_embeds=None):
    """(residual stream entering ``layer``, validated mask)."""
    x = model.prepare_inputs(tokens, mask, inputs_embeds)
    return run_layers(model, x.h, x.mask, impl, stop=layer)[layer], x.mask


def run_layers(model, h, mask, impl, stop=None):
    """[h^0, h^1, ..] the residual streams entering layers 0..stop (all, and the final stream, when
    stop is None), one jitted block call per layer."""
    from latim_jax.model import block_forward

    streams = [h]
    for block in model.layers[: stop if stop is not None else len(model.layers)]:
        h = block_forward(block, h, mask, impl=impl)
        streams.append(h)
    return streams


def contributions(
    model, tokens=None, layer: int = 0, mode: str = "exact", *, mask=None, inputs_embeds=None, impl="auto"
) -> Contributions:
    """Materialise layer ``layer``'s token-to-token contributions (for small inputs and tests).

    ``sum_j T[:, i, j] + bias[:, i] == output[:, i]`` holds to float rounding in ``mode="exact"``;
    ``mode="paper"`` is the published additive approximation (bias = out_proj bias only). ``mask``
    (b, l) of valid positions (padding contributes nothing; see :func:`attribute`), ``inputs_embeds``
    (b, l, d) instead of token ids.
    """
    check_mode(mode)
    layer = _check_layer(model, layer)
    h, mask = _layer_input(model, tokens, layer, impl, mask=mask, inputs_embeds=inputs_embeds)
    return _layer_contributions(model.layers[layer], h, mask, mode=mode, impl=impl)


@jit_model_fn(static_argnames=("mode", "impl"))
def _layer_contributions(block, h, mask, *, mode, impl):
    f = block_factors(block, h, mode, mask=mask, impl=impl)
    T = full_contributions(f)
    if mask is not None:
        T = T * (mask[:, :, None, None] & mask[:, None, :, None])
    return Contributions(T=T, bias=f.bias, output=f.output)


def conservation_error(
    model, tokens=None, layer: int = 0, mode: str = "exact", *, mask=None, inputs_embeds=None, impl="auto"
) -> float:
    """max_i ||sum_j T_i(x_j) + beta_i - o_i||_2 / max_i ||o_i||_2 for one layer, over real positions.

    Evaluated block by block (O(l) memory per row), independently of the O(l) scan that
    :func:`attribute` uses for the paper-mode error. In exact mode this is float rounding (about 1e-6
    in fp32); in paper mode it is the approximation.
    """
    check_mode(mode)
    layer = _check_layer(model, layer)
    h, mask = _layer_input(model, tokens, layer, impl, mask=mask, inputs_embeds=inputs_embeds)
    return float(_layer_conservation(model.layers[layer], h, mask, mode=mode, impl=impl))


@jit_model_fn(static_argnames=("mode", "impl"))
def _layer_conservation(block, h, mask, *, mode, impl):
    f = block_factors(block, h, mode, mask=mask, impl=impl)
    rec = token_sum(f, jnp.arange(f.length)) + f.bias
    valid = 1.0 if mask is None else mask.astype(f32)
    num = jnp.linalg.norm(rec - f.output, axis=-1) * valid
    den = jnp.linalg.norm(f.output, axis=-1) * valid
    return num.max() / den.max()


def attribute(
    model,
    tokens=None,
    method: str = "alti",
    mode: str = "exact",
    layers: Sequence[int] | int | None = None,
    rows: Sequence[int] | int | None = None,
    mask=None,
    *,
    target=None,
    impl: str = "auto",
    blocks: Blocks | None = None,
    aggregation: str = DEFAULT_AGGREGATION,
    inputs_embeds=None,
    mesh=None,
) -> Attribution:
    """Token-to-token attribution scores for every (or the selected) layer of a Mamba model.

    Args:
      model: a :class:`latim_jax.model.MambaLM` (from :func:`latim_jax.load`).
      tokens: int ids (B, L) (validated before any cast: ids must lie in the vocabulary).
      method: "l2", "l1", "alti", "logit" (LaTIM scores), "hidden_attention" or "grad_input" (baselines).
      mode: "exact" (contributions sum to the layer output) or "paper" (the published approximation).
      layers: layer indices, or one int (default: all).
      rows: target positions to score, or one int (default: all L; negative counts from the end); a
        subset costs O(L) per row.
      mask: optional (B, L) bool of valid positions, one contiguous run per row (left and/or right
        padding; holes are refused). Padding is skipped by the model (zero conv input and Delta), so
        every real row equals the prompt alone; rows and columns of padding are exactly 0, and so are
        the logit extras there; the paper-mode error averages real positions only.
      target: vocabulary entries for "logit"/"grad_input": None (the model's own prediction at each
        position), an int, or ints (B, L).
      impl: "auto" (Pallas kernels on TPU/GPU, XLA on CPU), "xla", or "pallas" (the scan kernels and the
        fused score kernel; interpret mode on CPU).
      blocks: block sizes of the memory-bounded path.
      aggregation: hidden attention over channels/heads: "minmax" (default), "abs" or "signed" (see
        :mod:`latim_jax.scores`); other methods ignore it.
      inputs_embeds: (B, L, d) embeddings instead of ``tokens`` (then ``result.tokens`` is None).
      mesh: a ``jax.sharding.Mesh`` with axes "data" and/or "model" (see :mod:`latim_jax.sharding`):
        prompts are split over "data", the layers run model-parallel over "model" and each layer's
        target rows are split over "model"; the model is laid out on the mesh first (in place) unless
        it already is. The result is the same as without a mesh, to float rounding.

    Returns an :class:`Attribution` whose ``scores`` are (B, n_layers, R, L) float32, exactly 0 above
    the diagonal. Pure JAX: works under ``jax.jit``, ``jax.vmap`` and ``jax.grad`` (value checks run
    only on concrete inputs).
    """
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; expected one of {METHODS}")
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, found {aggregation!r}")
    check_mode(mode)
    check_impl(impl)
    if blocks is not None and not isinstance(blocks, Blocks):
        raise ValueError(f"blocks must be a latim_jax.scores.Blocks, found {type(blocks).__name__}")
    x = model.prepare_inputs(tokens, mask, inputs_embeds, mesh=mesh)
    runtime = impl if mesh is None else Runtime(impl=impl, mesh=x.mesh)
    mask = x.mask
    B, L = x.h.shape[:2]
    n = model.config.n_layers
    layer_list = check_layers(layers, n)
    row_list = check_rows(rows, L)
    row_idx = jnp.arange(L) if row_list is None else jnp.asarray(row_list, jnp.int32)
    targets = _targets(target, x.batch, L, model.config.vocab_size)
    if targets is not None and mesh is not None:
        size = runtime.axis_size(DATA)
        targets = put(pad_batch(targets, size), x.mesh, P(DATA if size > 1 else None))

    streams = run_layers(model, x.h, mask, runtime)
    logits = _head(model, streams[-1])
    if targets is None:
        targets = jnp.argmax(logits, -1).astype(jnp.int32)
    extra = {"targets": targets}
    direction = _logit_direction(model, streams[-1], targets) if method == "logit" else None
    whole = row_list is None and layer_list == tuple(range(n))
    per_layer = []
    for layer in layer_list:
        if method == "grad_input":
            s = grad_input_scores(model, streams[layer], layer, row_idx, targets, mask=mask, impl=runtime)
            per_layer.append({"scores": s})
            continue
        per_layer.append(
            _layer_attribution(
                model.layers[layer],
                streams[layer],
                mask,
                row_idx,
                direction,
                method=method,
                mode=mode,
                impl=runtime,
                blocks=blocks,
                aggregation=aggregation,
                with_alti=method == "logit" and whole,
            )
        )
    scores = jnp.stack([p["scores"] for p in per_layer], 1)
    rows_valid = None if mask is None else mask[:, row_idx]
    if method == "logit":
        extra["direct"] = _masked(jnp.einsum("bld,bld->bl", streams[0], direction)[:, row_idx], rows_valid)
        extra["bias"] = jnp.stack([p["bias"] for p in per_layer], 1)
        logit = jnp.take_along_axis(logits, targets[..., None], -1)[..., 0][:, row_idx]
        extra["logit"] = _masked(logit, rows_valid)
        if whole:
            extra["alti"] = jnp.stack([p["alti"] for p in per_layer], 1)
    if mode == "paper" and method not in ("hidden_attention", "grad_input"):
        extra["approximation_error"] = jnp.stack([p["error"] for p in per_layer], 1)
    token_ids = x.tokens
    if mesh is not None:  # one host-complete copy, without the prompts that padded the "data" axis
        scores, extra, token_ids, mask = jax.tree.map(
            lambda a: a[: x.batch], gather((scores, extra, token_ids, mask))
        )
    result = Attribution(
        scores=scores,
        tokens=token_ids,
        extra=extra,
        method=method,
        mode=mode,
        layers=layer_list,
        rows=row_list,
        model=getattr(model, "source", None) or "",
        mask=mask,
        aggregation=aggregation if method == "hidden_attention" else None,
    )
    result.check_finite()
    return result


def _masked(x, valid):
    return x if valid is None else jnp.where(valid, x, 0.0)


def _targets(target, B, L, vocab):
    """Target vocabulary entries (B, L) int32, validated before any cast (concrete values only)."""
    if target is None:
        return None
    if is_traced(target):
        t = target
    else:
        t = np.asarray(target)
        if t.dtype == object or not np.issubdtype(t.dtype, np.integer):
            raise ValueError(f"target must be an int or int ids of shape {(B, L)}, found dtype {t.dtype}")
        if t.size and (int(t.min()) < 0 or int(t.max()) >= vocab):
            raise ValueError(f"target ids must lie in [0, {vocab}), found min {t.min()} max {t.max()}")
    if t.ndim == 0:
        t = jnp.full((B, L), t, jnp.int32)
    if tuple(t.shape) != (B, L) or not jnp.issubdtype(t.dtype, jnp.integer):
        raise ValueError(
            f"target must be an int or int ids of shape {(B, L)}, found {t.dtype} {tuple(t.shape)}"
        )
    return jnp.asarray(t).astype(jnp.int32)


@jit_model_fn
def _head(model, h):
    return model.head(h)


@jit_model_fn
def _logit_direction(model, h_final, targets):
    """v_i = g_f * E_{w_i} / r_i (b, l, d), r_i from the stream entering the final norm."""
    r_inv = jax.lax.rsqrt(jnp.mean(h_final * h_final, -1, keepdims=True) + model.config.rms_eps)
    row = jnp.take(model.unembedding, targets, axis=0).astype(f32)
    return model.norm_f[...].astype(f32) * row * r_inv


@jit_model_fn(static_argnames=("method", "mode", "impl", "blocks", "aggregation", "with_alti"))
def _layer_attribution(
    block, h, mask, rows, direction, *, method, mode, impl, blocks, aggregation, with_alti
):
    """One layer: {"scores" (b, r, l)} plus, for logit, "bias" (b, r) [and "alti" (b, l, l)], and for
    the paper mode "error" (b,): mean over real positions of ||o_i - beta_i - sum_j T_i(x_j)|| / ||o_i||
    (O(l): one scan, LayerFactors.token_total)."""
    f = block_factors(block, h, mode, mask=mask, impl=impl)
    aux = jnp.einsum("bld,ed->ble", direction, f.W_out) if method == "logit" else None
    common = dict(mask=mask, blocks=blocks, impl=impl)
    out = {"scores": layer_scores(f, method, rows, aux=aux, aggregation=aggregation, **common)}
    valid = jnp.ones(h.shape[:2], bool) if mask is None else mask
    if method == "logit":
        out["bias"] = jnp.where(valid, jnp.einsum("bld,bld->bl", f.bias, direction), 0.0)[:, rows]
        if with_alti:
            out["alti"] = layer_scores(f, "alti", jnp.arange(f.length), **common)
    if mode == "paper" and method != "hidden_attention":
        rel = jnp.linalg.norm(f.token_total + f.bias - f.output, axis=-1) / jnp.linalg.norm(f.output, axis=-1)
        out["error"] = jnp.sum(jnp.where(valid, rel, 0.0), -1) / jnp.sum(valid, -1)
    return out
