"""The public attribution API: contributions, attribute, conservation_error and the Attribution result.

Each layer is scored by one jitted per-layer function (all layers of a model share its graph
structure, so it compiles once whatever the depth), called in a Python loop over the requested
layers after one forward pass for the residual streams.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from latim_jax.baselines import grad_input_scores
from latim_jax.decomposition import block_factors, check_mode, full_contributions
from latim_jax.inputs import check_layers, check_rows, is_traced, pad_to_bucket
from latim_jax.jit import jit_model_fn
from latim_jax.kernels.dispatch import check_impl
from latim_jax.layers import f32
from latim_jax.memory import AUTO_MARGIN, HEAD_CHUNK, check_fits
from latim_jax.memory import available as available_memory
from latim_jax.model import block_forward
from latim_jax.progress import progress as progress_bar
from latim_jax.results import Attribution
from latim_jax.scores import (
    AGGREGATIONS,
    DEFAULT_AGGREGATION,
    LATIM_METHODS,
    METHODS,
    PRECISIONS,
    Blocks,
    kept_pairs,
    layer_scores,
    logit_and_alti,
    token_sum,
)
from latim_jax.sharding import DATA, P, Runtime, gather, pad_batch, put
from latim_jax.stream import StreamWriter, load_streamed


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
    f = block_factors(block, h, mode, mask=mask, impl=impl, with_total=False)
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
    f = block_factors(block, h, mode, mask=mask, impl=impl, with_total=False)
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
    top_k: int | None = None,
    out_dtype: str = "float32",
    stream_to=None,
    memory_limit="auto",
    progress: bool | None = None,
    hold_fixed: bool = False,
    rollout_maps: bool | None = None,
    bucket: bool = True,
    precision: str = "float32",
) -> Attribution:
    """Token-to-token attribution scores for every (or the selected) layer of a Mamba model.

    Args:
      model: a :class:`latim_jax.model.MambaLM` (from :func:`latim_jax.load`).
      tokens: int ids (B, L) (validated before any cast: ids must lie in the vocabulary).
      method: "l2", "l1", "alti", "logit" (LaTIM scores), "hidden_attention" or "grad_input" (baselines).
      mode: "exact" (contributions sum to the layer output) or "paper" (the published approximation).
      layers: layer indices, or one int (default: all).
      rows: target positions to score, or one int (default: all L; negative counts from the end); a
        subset costs O(L) per row, except Mamba-1 hidden_attention with aggregation "minmax", whose
        range needs the whole map (a warning says so from L = 1024 on; "signed" ranks alike).
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
      top_k: keep only the k strongest sources of each target row (scores (B, n_layers, R, k) in
        decreasing order, positions in ``extra["sources"]``); the full matrix of one layer at a time
        is still computed, but the output is O(R k) per layer.
      out_dtype: "float32" (default), "bfloat16" or "float16" for the returned scores (each layer is
        computed in fp32 and rounded once: bf16 keeps ~3 significant digits).
      stream_to: a directory (new or empty): each layer's scores are written there as soon as they are
        computed (:mod:`latim_jax.stream`), and the result's scores are a read-only memmap of it.
      memory_limit: "auto" (the free host or device memory divided by ``memory.AUTO_MARGIN`` = 1.2, as
        the estimate can fall ~10% short of the peak), a number of bytes, or None (no check).
        The call's peak is estimated first (:mod:`latim_jax.memory`) and a call that would not fit is
        refused with an error naming the options that do (rows=[-1], fewer layers, top_k, bf16
        output, streaming, a smaller batch).
      progress: a progress bar over layers on stderr (None: when stderr is a terminal and L >= 1024).
      hold_fixed: gradients only. False (default): ``jax.grad`` of a score is the true gradient,
        through everything the score depends on. True: no gradient through the quantities LaTIM
        holds fixed in the scored layer (Delta, B, C, the activation gate, the output gate / group
        norm, the pre-norm scale, and for "logit" the final norm's scale), i.e. the gradient of the
        decomposition's linear map; the values are the same either way. grad_input ignores it.
      precision: "float32" (default) or "bfloat16": the score path's projection onto W_out (its
        dominant matrix product) with bf16 operands and fp32 accumulation - faster where there are
        bf16 matrix units (TPU, GPU, AMX CPUs; on CPUs without them no faster); the scores then carry
        ~2e-3 error relative to their maximum (the factors, the hidden attention and every
        accumulation stay fp32; README "Reduced precision" has the measurements). l2, l1, alti and
        logit's ALTI maps use it; logit's own scores, hidden_attention and grad_input have no
        projection and do not change. Recorded in ``Attribution.precision``.
      rollout_maps: "logit" only (other methods roll out their own maps and ignore it): also compute
        every layer's ALTI maps (``extra["alti"]``, (B, n_layers, L, L)) in the same pass, which
        :meth:`Attribution.rollout` needs for the logit input attribution. None (default): when every
        layer and every row is asked; False: never (the logit scores alone cost a fraction of the
        alti maps: no projection onto W_out); True: required, so a layer or row subset is refused.
      bucket: compute at the length rounded up to a bucket (:func:`latim_jax.inputs.bucket_length`),
        the extra positions masked as padding (exact by construction) and cut from the result, so
        prompts of nearby lengths share one compiled program (concrete inputs only).

    Returns an :class:`Attribution` whose ``scores`` are (B, n_layers, R, L) (or top_k) in
    ``out_dtype``, exactly 0 above the diagonal. Pure JAX: works under ``jax.jit``, ``jax.vmap`` and
    ``jax.grad`` (value checks, the memory check and streaming need concrete inputs).
    """
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; expected one of {METHODS}")
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, found {aggregation!r}")
    check_mode(mode)
    check_impl(impl)
    if blocks is not None and not isinstance(blocks, Blocks):
        raise ValueError(f"blocks must be a latim_jax.scores.Blocks, found {type(blocks).__name__}")
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype must be one of {OUT_DTYPES}, found {out_dtype!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, found {precision!r}")
    user_mask = mask
    length = None
    if bucket:
        if tokens is not None and inputs_embeds is None:
            tokens = model.check_tokens(tokens)  # before padding: errors name the caller's ids
        tokens, mask, inputs_embeds, length = pad_to_bucket(tokens, mask, inputs_embeds)
    x = model.prepare_inputs(tokens, mask, inputs_embeds, mesh=mesh)
    runtime = impl if mesh is None else Runtime(impl=impl, mesh=x.mesh)
    mask = x.mask
    B, L = x.h.shape[:2]
    true_L = L if length is None else length  # the caller's length; L - true_L bucket padding
    n = model.config.n_layers
    layer_list = check_layers(layers, n)
    row_list = check_rows(rows, true_L)
    row_idx = jnp.arange(true_L) if row_list is None else jnp.asarray(row_list, jnp.int32)
    _warn_minmax_subset(model, method, aggregation, row_list, true_L)
    if top_k is not None and (
        isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= true_L
    ):
        raise ValueError(f"top_k must be an int in [1, {true_L}] (the length), found {top_k!r}")
    if stream_to is not None and (top_k is not None or is_traced(x.h) or out_dtype == "bfloat16"):
        raise ValueError(
            "stream_to needs concrete inputs, whole score matrices (not top_k) and float32 or float16"
        )
    whole = row_list is None and layer_list == tuple(range(n))
    if rollout_maps is not None and not isinstance(rollout_maps, bool):
        raise ValueError(f"rollout_maps must be None, True or False, found {rollout_maps!r}")
    if rollout_maps and method == "logit" and not whole:
        raise ValueError(
            "rollout_maps=True needs every layer and every row (the logit rollout multiplies whole "
            "ALTI maps): call attribute with layers=None, rows=None"
        )
    if memory_limit is not None and not is_traced(x.h):
        limit = int(available_memory() / AUTO_MARGIN) if memory_limit == "auto" else int(memory_limit)
        n_rows = None if row_list is None else len(row_list)
        n_layers = None if layer_list == tuple(range(n)) else len(layer_list)
        check_fits(
            model, x.batch, L, limit=limit, method=method, rows=n_rows, layers=n_layers, top_k=top_k,
            out_dtype=out_dtype, stream=stream_to is not None, blocks=blocks,
        )  # fmt: skip
    targets = _targets(target, x.batch, true_L, model.config.vocab_size)
    if targets is not None and L > true_L:  # bucket padding: any id at the (masked) extra positions
        targets = jnp.pad(targets, ((0, 0), (0, L - true_L)))
    if targets is not None and mesh is not None:
        size = runtime.axis_size(DATA)
        targets = put(pad_batch(targets, size), x.mesh, P(DATA if size > 1 else None))

    # logit and grad_input need the final stream first (targets, the logit direction): a forward pass,
    # keeping every layer's input. The other methods score each layer as the pass reaches it, and the
    # layer's own factors give the next stream (no second scan per layer).
    needs_final = method in ("logit", "grad_input")
    extra, direction, streams = {}, None, None
    if needs_final:
        streams = run_layers(model, x.h, mask, runtime)
        targets, logit = _head_targets(model, streams[-1], targets)
        extra["targets"] = targets
        if method == "logit":
            direction = _logit_direction(model, streams[-1], targets, hold_fixed=bool(hold_fixed))
    keep = (lambda a: a) if mesh is None else (lambda a: jax.tree.map(lambda v: v[: x.batch], gather(a)))
    shape = (x.batch, len(layer_list), len(row_idx), true_L if top_k is None else top_k)
    sink = StreamWriter(stream_to, shape, out_dtype) if stream_to is not None else None
    show = progress if progress is not None else (L >= 1024 and len(layer_list) > 1)
    top_mask = None if top_k is None or mask is None else keep(mask)[:, :true_L]  # the caller's length
    done = {}  # layer -> (scores, extras), computed in increasing layer order
    with_alti = method == "logit" and whole and rollout_maps is not False
    h, at = x.h, 0  # the stream entering layer `at` (single pass)
    try:
        for layer in progress_bar(sorted(set(layer_list)), desc=f"{method} layers", enabled=show):
            if needs_final:
                h_in = streams[layer]
            else:
                while at < layer:
                    h = block_forward(model.layers[at], h, mask, impl=runtime)
                    at += 1
                h_in = h
            if method == "grad_input":
                out = {"scores": grad_input_scores(model, h_in, layer, row_idx, targets, mask=mask,
                                                   impl=runtime)}  # fmt: skip
            else:
                out = _layer_attribution(
                    model.layers[layer], h_in, mask, row_idx, direction, method=method, mode=mode,
                    impl=runtime, blocks=blocks, aggregation=aggregation, with_alti=with_alti,
                    hold_fixed=bool(hold_fixed), with_next=not needs_final, precision=precision,
                )  # fmt: skip
            if not needs_final:
                h, at = out.pop("next"), layer + 1
            out = keep(out)
            s = out.pop("scores")[..., :true_L]
            if "alti" in out:
                out["alti"] = out["alti"][..., :true_L, :true_L]
            _check_finite(s, method, layer)
            if top_k is not None:
                s, sources = _top_k(s, top_k, row_idx, top_mask)
                out["sources"] = sources
            s = s.astype(out_dtype)
            if sink is not None:
                for k in (k for k, x_ in enumerate(layer_list) if x_ == layer):
                    sink.write(k, s)
                s = None
            done[layer] = (s, out)
        scores = [done[layer][0] for layer in layer_list]
        per_layer = [done[layer][1] for layer in layer_list]
        rows_valid = None if mask is None else mask[:, row_idx]
        if method == "logit":
            extra["direct"] = _masked(
                jnp.einsum("bld,bld->bl", streams[0], direction)[:, row_idx], rows_valid
            )
            extra["bias"] = jnp.stack([p["bias"] for p in per_layer], 1)
            extra["logit"] = _masked(logit[:, row_idx], rows_valid)
            if with_alti:
                extra["alti"] = jnp.stack([p["alti"] for p in per_layer], 1)
        if mode == "paper" and method not in ("hidden_attention", "grad_input"):
            extra["approximation_error"] = jnp.stack([p["error"] for p in per_layer], 1)
        if top_k is not None:
            extra["sources"] = jnp.stack([p["sources"] for p in per_layer], 1)
        extra = {k: (keep(v) if k in ("targets", "direct", "logit") else v) for k, v in extra.items()}
        if "targets" in extra:
            extra["targets"] = extra["targets"][:, :true_L]
        cut = (lambda a: None if a is None else a[:, :true_L]) if true_L < L else (lambda a: a)
        result = Attribution(
            scores=None if sink is not None else jnp.stack(scores, 1),
            tokens=cut(keep(x.tokens)),
            extra=extra,
            method=method,
            mode=mode,
            layers=layer_list,
            rows=row_list,
            model=getattr(model, "source", None) or "",
            mask=None if user_mask is None and true_L < L else cut(keep(mask)),
            aggregation=aggregation if method == "hidden_attention" else None,
            top_k=top_k,
            precision=precision if method in LATIM_METHODS else "float32",  # the others never project
        )
        if sink is not None:
            sink.finish(result.meta(), result.arrays())
            return load_streamed(stream_to)
        return result
    except BaseException:
        if sink is not None:
            sink.abort()
        raise


OUT_DTYPES = ("float32", "bfloat16", "float16")
MINMAX_SUBSET_WARN_LENGTH = 1024  # from this length on, a Mamba-1 minmax row subset is warned about


def _warn_minmax_subset(model, method: str, aggregation: str, row_list, length: int) -> None:
    """Warn when Mamba-1 minmax hidden attention is asked for a row subset of a long prompt: its
    range covers every causal entry of the per-channel map whatever rows are asked (so that a subset
    equals the same rows of the full map), which costs the whole map, O(L^2 e n) per layer (one 130m
    layer at L = 4096: ~37 s for rows=[-1], against 0.25 s for "signed"). Mamba-2's range is over
    heads, (L^2 h), and cheap."""
    if method != "hidden_attention" or aggregation != "minmax" or model.config.version != 1:
        return
    n_rows = None if row_list is None else len(set(row_list))
    if n_rows is None or n_rows == length or length < MINMAX_SUBSET_WARN_LENGTH:
        return
    warnings.warn(
        f"hidden_attention with aggregation='minmax' normalises each layer by the range of the whole "
        f"per-channel map, so these {n_rows} of {length} rows cost as much as the full "
        "Mamba-1 map (O(L^2) per layer); aggregation='signed' ranks every row's sources in the same "
        "order up to float rounding (minmax is an increasing affine map of it, per layer and prompt) "
        "at O(L) per row",
        stacklevel=3,
    )


def _check_finite(s, method, layer) -> None:
    """FloatingPointError naming the layer when its scores hold NaN/inf (concrete values only; one
    boolean crosses to the host)."""
    if not is_traced(s) and not bool(jnp.isfinite(s).all()):
        raise FloatingPointError(f"non-finite {method} scores at layer(s) [{layer}]")


def _top_k(s, k: int, rows, mask):
    """The k largest scores per row (b, r, k) among its sources (j <= i, real) and their positions;
    past a row's sources (and on padding rows) the score is 0 and the position -1."""
    keep = kept_pairs(rows, s.shape[-1], mask)
    values, sources = jax.lax.top_k(jnp.where(keep, s, -jnp.inf), k)
    valid = jnp.arange(k)[None, None, :] < jnp.sum(keep, axis=-1, keepdims=True)
    return jnp.where(valid, values, 0.0), jnp.where(valid, sources, -1).astype(jnp.int32)


@jit_model_fn
def _head_targets(model, h, targets):
    """(targets (b, l), the logit of each target (b, l)) without the (b, l, v) logits: the head runs
    over chunks of positions (memory.HEAD_CHUNK); targets None -> the model's own argmax."""
    b, L, d = h.shape
    q = min(HEAD_CHUNK, L)
    pad = -L % q
    hp = jnp.pad(h, ((0, 0), (0, pad), (0, 0))).reshape(b, -1, q, d).swapaxes(0, 1)  # (chunks, b, q, d)
    given = targets is not None
    tp = jnp.zeros((b, L + pad), jnp.int32) if not given else jnp.pad(targets, ((0, 0), (0, pad)))
    tp = tp.reshape(b, -1, q).swapaxes(0, 1)

    def chunk(args):
        hc, tc = args
        logits = model.head(hc)  # (b, q, v)
        tc = tc if given else jnp.argmax(logits, -1).astype(jnp.int32)
        return tc, jnp.take_along_axis(logits, tc[..., None], -1)[..., 0]

    t, v = jax.lax.map(chunk, (hp, tp))
    return t.swapaxes(0, 1).reshape(b, -1)[:, :L], v.swapaxes(0, 1).reshape(b, -1)[:, :L]


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


@jit_model_fn(static_argnames=("hold_fixed",))
def _logit_direction(model, h_final, targets, hold_fixed=False):
    """v_i = g_f * E_{w_i} / r_i (b, l, d), r_i from the stream entering the final norm (held fixed:
    no gradient through r_i)."""
    r_inv = jax.lax.rsqrt(jnp.mean(h_final * h_final, -1, keepdims=True) + model.config.rms_eps)
    r_inv = jax.lax.stop_gradient(r_inv) if hold_fixed else r_inv
    row = jnp.take(model.unembedding, targets, axis=0).astype(f32)
    return model.norm_f[...].astype(f32) * row * r_inv


@jit_model_fn(
    static_argnames=(
        "method",
        "mode",
        "impl",
        "blocks",
        "aggregation",
        "with_alti",
        "hold_fixed",
        "with_next",
        "precision",
    )
)
def _layer_attribution(
    block,
    h,
    mask,
    rows,
    direction,
    *,
    method,
    mode,
    impl,
    blocks,
    aggregation,
    with_alti,
    hold_fixed=False,
    with_next=False,
    precision="float32",
):
    """One layer: {"scores" (b, r, l)} plus, for logit, "bias" (b, r) [and "alti" (b, l, l)], and for
    the paper mode "error" (b,): mean over real positions of ||o_i - beta_i - sum_j T_i(x_j)|| / ||o_i||
    (O(l): one scan, LayerFactors.token_total); with_next: "next" = h + o, the stream entering the next
    layer (from this layer's own intermediates: no second scan)."""
    want_error = mode == "paper" and method != "hidden_attention"
    f = block_factors(block, h, mode, mask=mask, impl=impl, hold_fixed=hold_fixed, with_total=want_error)
    aux = jnp.einsum("bld,ed->ble", direction, f.W_out) if method == "logit" else None
    common = dict(mask=mask, blocks=blocks, impl=impl, precision=precision)
    if with_alti:  # every row: the logit scores and the alti maps of the rollout, in one pass
        out = dict(zip(("scores", "alti"), logit_and_alti(f, rows, aux, **common), strict=True))
    else:
        out = {"scores": layer_scores(f, method, rows, aux=aux, aggregation=aggregation, **common)}
    valid = jnp.ones(h.shape[:2], bool) if mask is None else mask
    if method == "logit":
        out["bias"] = jnp.where(valid, jnp.einsum("bld,bld->bl", f.bias, direction), 0.0)[:, rows]
    if want_error:
        rel = jnp.linalg.norm(f.token_total + f.bias - f.output, axis=-1) / jnp.linalg.norm(f.output, axis=-1)
        out["error"] = jnp.sum(jnp.where(valid, rel, 0.0), -1) / jnp.sum(valid, -1)
    if with_next:
        out["next"] = h.astype(f32) + f.output
    return out
