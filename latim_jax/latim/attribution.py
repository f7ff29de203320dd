"""The public attribution API: contributions, conservation_error, attribute.

Each call resolves where it runs once (:func:`latim_jax.model.sharding.context`), validates its inputs
once (:meth:`latim_jax.model.lm.MambaLM.prepare_inputs`) and what it asks once
(:mod:`latim_jax.latim.request`). Each layer is then scored by one jitted function of (block, stream,
mask, rows, direction) with two static arguments, the :class:`~latim_jax.latim.request.LayerJob` and
the execution context, so all layers of a kind share one program whatever the depth; the layer's
factors come from its kind (:mod:`latim_jax.latim.kinds`).
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from latim_jax.io.progress import progress as progress_bar
from latim_jax.io.results import Attribution
from latim_jax.io.stream import StreamWriter
from latim_jax.kernels import f32
from latim_jax.latim import memory
from latim_jax.latim.baselines import grad_input_scores
from latim_jax.latim.kinds import check_mode, factors, full_contributions
from latim_jax.latim.request import (
    LayerJob,
    Request,
    check_foil,
    check_targets,
    layer_job,
    output_precision,
    request,
)
from latim_jax.latim.scores import kept_pairs, layer_scores, token_sum
from latim_jax.model.inputs import check_layers, is_traced
from latim_jax.model.jit import bound_compiled_programs, jit_model_fn
from latim_jax.model.kind import kind_of
from latim_jax.model.lm import side_input
from latim_jax.model.sharding import context
from latim_jax.parallel.context import Context, resolve
from latim_jax.parallel.mesh import DATA, P, gather, pad_batch, put


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Contributions:
    """One layer's decomposition: T (b, l, l, d) with T[:, i, j] = T_i(x_j) (zero for j > i and for pad
    sources), bias (b, l, d) the non-token term beta, output (b, l, d) the mixer output o (no residual)."""

    T: jax.Array
    bias: jax.Array
    output: jax.Array


def _layer_input(model, tokens, layer, impl, mask=None, inputs_embeds=None, fits=None):
    """(validated layer index, the residual stream entering it, the mask, the context, what the layer
    reads besides: h^0 for a shared block, else None). ``fits``: called as ``fits(batch, length,
    layer)`` once the inputs are validated and before any layer runs (concrete inputs only): the
    memory check of :func:`contributions`."""
    if isinstance(layer, bool) or not isinstance(layer, int | np.integer):
        raise ValueError(f"layer must be an int in [0, {model.config.n_layers}), found {layer!r}")
    layer = check_layers(int(layer), model.config.n_layers)[0]
    ctx = context(model, impl)
    x = model.prepare_inputs(tokens, mask, inputs_embeds, ctx)
    if fits is not None and not is_traced(x.h):
        fits(x.batch, x.length, layer)
    side = side_input(model.layers[layer], x.h)
    return layer, model.run_layers(x.h, x.mask, ctx, stop=layer)[layer], x.mask, ctx, side


def contributions(
    model,
    tokens=None,
    layer: int = 0,
    mode: str = "exact",
    *,
    mask=None,
    inputs_embeds=None,
    impl="auto",
    memory_limit="auto",
) -> Contributions:
    """Materialise layer ``layer``'s token-to-token contributions (for small inputs and tests).

    ``sum_j T[:, i, j] + bias[:, i] == output[:, i]`` holds to float rounding in ``mode="exact"``;
    ``mode="paper"`` is the published additive approximation (bias = out_proj bias only). ``mask``
    (b, l) of valid positions (padding contributes nothing; see :func:`attribute`), ``inputs_embeds``
    (b, l, d) instead of token ids.

    T is (b, l, l, d) fp32: it grows as l^2 (one prompt of 20,000 tokens at d = 768 is ~1.2 TB).
    ``memory_limit``: "auto" (the free host or device memory divided by ``memory.AUTO_MARGIN``, as
    :func:`attribute` takes it), a number of bytes, or None (no check). The call's peak is estimated
    first (:func:`contributions_estimate`) and a call that would not fit is refused, before any layer
    runs, with :class:`latim_jax.latim.memory.InsufficientMemoryError` naming the size of T, the
    longest prompt that fits, and the tile-by-tile alternatives (:func:`attribute` for scores,
    :func:`conservation_error`). Under a transformation (traced inputs) the check is skipped.
    """
    check_mode(mode)
    limit = _memory_limit(memory_limit)

    def fits(batch, length, index):
        if limit is not None:
            check_contributions_fit(model, batch, length, index, limit=limit)

    with forward_mode_needs_xla(resolve(impl).kernels):
        layer, h, mask, ctx, side = _layer_input(model, tokens, layer, impl, mask, inputs_embeds, fits=fits)
        return _layer_contributions(model.layers[layer], h, mask, side, mode=mode, ctx=ctx)


def _memory_limit(memory_limit) -> int | None:
    """``memory_limit`` ("auto", bytes, or None) -> bytes or None; anything else is a ValueError."""
    if memory_limit is None:
        return None
    if isinstance(memory_limit, str) and memory_limit == "auto":
        return int(memory.available() / memory.AUTO_MARGIN)
    if isinstance(memory_limit, bool) or not isinstance(memory_limit, int | float | np.integer | np.floating):
        raise ValueError(f'memory_limit must be "auto", a number of bytes or None, found {memory_limit!r}')
    return int(memory_limit)


# JAX's message when forward-mode differentiation reaches a custom_vjp (the Pallas scans are ones)
_JVP_OF_CUSTOM_VJP = ("forward-mode", "custom_vjp")


@contextlib.contextmanager
def forward_mode_needs_xla(kernels: bool):
    """Re-raise JAX's TypeError for forward-mode differentiation (``jax.jvp``, ``jax.jacfwd``,
    ``jax.linearize``) through a ``custom_vjp`` as one that names the way out, ``impl="xla"``, when the
    call runs the Pallas kernels (``kernels``): their scans are ``custom_vjp`` functions with Pallas
    backward kernels and no JVP (docs/kernels.md). Any other error passes through unchanged."""
    try:
        yield
    except TypeError as err:
        if not kernels or not all(word in str(err) for word in _JVP_OF_CUSTOM_VJP):
            raise
        raise TypeError(
            "forward-mode differentiation (jax.jvp, jax.jacfwd, jax.linearize) cannot go through the "
            "Pallas scan kernels that this call runs (impl='pallas', or 'auto' on TPU/GPU): they are "
            "custom_vjp functions with Pallas backward kernels and no JVP. Pass impl='xla' for forward "
            "mode; reverse mode (jax.grad, jax.vjp, jacrev) works with either (docs/kernels.md). "
            f"JAX said: {str(err).splitlines()[0]}"
        ) from err


def contributions_estimate(model, batch: int, length: int, layer: int) -> memory.MemoryEstimate:
    """Estimated bytes of :func:`contributions` of ``layer`` on ``batch`` prompts of ``length``
    positions (fp32):

        parameters   the loaded model
        streams      the residual streams entering layers 0..layer, (layer + 1) b l d (kept until the
                     layer is reached)
        layer        the layer's working set with the whole l x l matrix as one tile: its kind's
                     ``LayerKind.memory`` with rows = cols = l (the factors, the scan, the pair values
                     V and T before the mask)
        output       T (b, l, l, d), bias and output (b, l, d) each

    A safe bound, like :func:`latim_jax.latim.memory.estimate`: 1.5-2x XLA's own account of the
    compiled program for Mamba layers (tests/latim/test_memory.py)."""
    c = model.config
    b, L, d, f4 = int(batch), int(length), c.d_model, 4
    params = sum(
        int(np.prod(np.shape(x))) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(model.params())
    )
    streams = (layer + 1) * b * L * d * f4
    work = kind_of(c.kinds[layer]).memory(c, b, L, L, L)
    output = b * L * L * d * f4 + 2 * b * L * d * f4
    return memory.MemoryEstimate(parameters=params, streams=streams, layer=work, output=output)


def check_contributions_fit(
    model, batch: int, length: int, layer: int, *, limit: int
) -> memory.MemoryEstimate:
    """:func:`contributions_estimate` of the call, or :class:`latim_jax.latim.memory.
    InsufficientMemoryError` when it exceeds ``limit`` bytes, naming the size of T, the longest prompt
    that fits (T grows as l^2), one prompt at a time when that fits (``options["batch"] = 1``), and
    the tile-by-tile alternatives."""
    est = contributions_estimate(model, batch, length, layer)
    if est.total <= limit:
        return est
    lo, hi = 0, length  # the longest length that fits, in [0, length)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if contributions_estimate(model, batch, mid, layer).total <= limit else (lo, mid)
    one = batch > 1 and contributions_estimate(model, 1, length, layer).total <= limit
    T = batch * length * length * model.config.d_model * 4
    fit = [("one prompt at a time fits" if one else "")]
    fit.append(f"at most {lo} tokens per prompt fit" if lo else "no prompt length fits")
    raise memory.InsufficientMemoryError(
        f"contributions of layer {layer} for {batch} x {length} tokens materialise T (b, l, l, d) = "
        f"{memory.human(T)} and need about {est.describe()}, more than the {memory.human(limit)} "
        f"available. T grows as l^2: {'; '.join(f for f in fit if f)}. latim_jax.attribute computes the "
        "scores tile by tile without T (rows=[-1]: O(l)), and conservation_error checks conservation tile "
        "by tile. (memory_limit=None skips this check.)",
        options={"batch": 1} if one else {}, needed=est.total, limit=limit, batch=batch, length=length,
    )  # fmt: skip


@jit_model_fn(static_argnames=("mode", "ctx"))
def _layer_contributions(block, h, mask, embeddings, *, mode, ctx):
    f = factors(block, h, mask, ctx, mode, embeddings=embeddings)
    T = full_contributions(f) * kept_pairs(jnp.arange(f.length), f.length, mask)[..., None]
    return Contributions(T=T, bias=f.bias, output=f.output)


def conservation_error(
    model, tokens=None, layer: int = 0, mode: str = "exact", *, mask=None, inputs_embeds=None, impl="auto"
) -> float:
    """max_i ||sum_j T_i(x_j) + beta_i - o_i||_2 / max_i ||o_i||_2 for one layer, over real positions.

    Evaluated tile by tile (O(l) memory per row), independently of the O(l) scan that
    :func:`attribute` uses for the paper-mode error. In exact mode this is float rounding (about 1e-6
    in fp32); in paper mode it is the approximation.
    """
    check_mode(mode)
    with forward_mode_needs_xla(resolve(impl).kernels):
        layer, h, mask, ctx, side = _layer_input(model, tokens, layer, impl, mask, inputs_embeds)
        return float(_layer_conservation(model.layers[layer], h, mask, side, mode=mode, ctx=ctx))


@jit_model_fn(static_argnames=("mode", "ctx"))
def _layer_conservation(block, h, mask, embeddings, *, mode, ctx):
    f = factors(block, h, mask, ctx, mode, embeddings=embeddings)
    rec = token_sum(f, np.arange(f.length)) + f.bias
    valid = mask.astype(f32)
    num = jnp.linalg.norm(rec - f.output, axis=-1) * valid
    den = jnp.linalg.norm(f.output, axis=-1) * valid
    return num.max() / den.max()


def attribute(
    model,
    tokens=None,
    method: str = "alti",
    mode: str = "exact",
    layers=None,
    rows=None,
    mask=None,
    *,
    target=None,
    foil=None,
    impl: str = "auto",
    blocks=None,
    aggregation: str | None = None,
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
      model: a :class:`latim_jax.model.lm.MambaLM` (from :func:`latim_jax.load`).
      tokens: int ids (B, L) (validated before any cast: ids must lie in the vocabulary).
      method: "l2", "l1", "alti", "logit" (LaTIM scores), "hidden_attention" or "grad_input" (baselines).
      mode: "exact" (contributions sum to the layer output) or "paper" (the published approximation).
      layers: layer indices, or one int (default: all).
      rows: target positions to score, or one int (default: all L; negative counts back from the last
        real token: -1 is each prompt's last token, and with a mask whose prompts end at different
        positions a negative row is refused, since one index cannot name each one's end); a
        subset costs O(L) per row, except Mamba-1 hidden_attention with aggregation "minmax", whose
        range needs the whole map (a warning says so from L = 1024 on; "signed" ranks alike).
      mask: optional (B, L) bool of valid positions, one contiguous run per row (left and/or right
        padding; holes are refused). Padding is skipped by the model (zero conv input and Delta), so
        every real row equals the prompt alone to float rounding (other shapes round fp32 sums
        differently: ~1e-7-1e-6 relative); rows and columns of padding are exactly 0, and so are
        the logit extras there; the paper-mode error averages real positions only.
      target: vocabulary entries for "logit"/"grad_input": None (the model's own prediction at each
        position), an int, or ints (B, L).
      foil: a contrastive target for "logit"/"grad_input" (an int or ints (B, L), like ``target``): the
        scores then explain logit(target) - logit(foil) ("why this token rather than that one"); for
        "logit" the identity stays exact, logit(target) - logit(foil) = direct + sum of the layers'
        contributions + their bias terms, and ``extra["logit"]`` holds the difference, ``extra["foil"]``
        the foil ids. Any other method refuses it.
      impl: "auto" (Pallas kernels on TPU/GPU, XLA on CPU), "xla", or "pallas" (the scan kernels and the
        fused score kernel; interpret mode on CPU).
      blocks: a :class:`latim_jax.Blocks` of tile sizes (None fields: the running path's defaults).
      aggregation: method "hidden_attention" only, how its map is aggregated over channels/heads:
        "minmax" (None: the default), "abs" or "signed" (see :mod:`latim_jax.latim.hidden_attention`);
        given with another method it is refused (ValueError), since no other method reads it.
      inputs_embeds: (B, L, d) embeddings instead of ``tokens`` (then ``result.tokens`` is None).
      mesh: a ``jax.sharding.Mesh`` with axes among "data", "model" and "seq" (see :mod:`latim_jax.
        parallel.mesh`): prompts are split over "data", the layers run model-parallel over "model" and
        each layer's target rows are split over "model"; "seq" splits each prompt's length in the
        forward and each layer's source columns in the scores (every kind that declares
        ``LayerKind.splits_sequence``); the model is laid out on the mesh first (in place) unless it
        already is. The result is the same as without a mesh, to float rounding.
      top_k: keep only the k strongest sources of each target row (scores (B, n_layers, R, k) in
        decreasing order, positions in ``extra["sources"]``); the full matrix of one layer at a time
        is still computed, but the output is O(R k) per layer.
      out_dtype: "float32" (default), "bfloat16" or "float16" for the returned scores (each layer is
        computed in fp32 and rounded once: bf16 keeps ~3 significant digits).
      stream_to: a directory (new or empty): each layer's scores are written there as soon as they are
        computed (:mod:`latim_jax.io.stream`), and the result's scores are a read-only memmap of it.
      memory_limit: "auto" (the free host or device memory divided by ``memory.AUTO_MARGIN`` = 1.2, as
        the estimate can fall ~10% short of the peak), a number of bytes, or None (no check).
        The call's peak is estimated first (:mod:`latim_jax.latim.memory`; on a mesh, per device)
        and a call that would not fit is refused with an error naming the options that do
        (rows=[-1], fewer layers, top_k, bf16 output, streaming, a smaller batch).
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
        accumulation stay fp32; docs/guide.md "Reduced precision" has the measurements). l2, l1, alti
        and logit's ALTI maps use it; logit's own scores, hidden_attention and grad_input have no
        projection and do not change. Recorded in ``Attribution.precision``.
      rollout_maps: "logit" only (other methods roll out their own maps and ignore it): also compute
        every layer's ALTI maps (``extra["alti"]``, (B, n_layers, L, L)) in the same pass, which
        :meth:`Attribution.rollout` needs for the logit input attribution. None (default): when every
        layer and every row is asked; False: never (the logit scores alone cost a fraction of the
        alti maps: no projection onto W_out); True: required, so a layer or row subset is refused.
      bucket: compute at the length rounded up to a bucket (:func:`latim_jax.model.inputs.
        bucket_length`), the extra positions masked as padding (exact by construction) and cut from the
        result, so prompts of nearby lengths share one compiled program (concrete inputs only).

    Returns an :class:`Attribution` whose ``scores`` are (B, n_layers, R, L) (or top_k) in
    ``out_dtype``, exactly 0 above the diagonal. Pure JAX: works under ``jax.jit``, ``jax.vmap`` and
    ``jax.grad`` (value checks, the memory check and streaming need concrete inputs: under a
    transformation a prompt with an id outside the vocabulary or a mask with a hole gets NaN scores).
    """
    job = layer_job(method=method, mode=mode, aggregation=aggregation, precision=precision, blocks=blocks,
                    hold_fixed=hold_fixed)  # fmt: skip
    limit = _memory_limit(memory_limit)  # validated before any work
    ctx = context(model, impl, mesh, sequence=True)
    x = model.prepare_inputs(tokens, mask, inputs_embeds, ctx, bucket=bucket)
    req = request(
        model, job, x.length, is_traced(x.h), layers=layers, rows=rows, top_k=top_k, out_dtype=out_dtype,
        stream_to=stream_to, progress=progress, rollout_maps=rollout_maps, mask=x.mask[: x.batch],
        given_mask=x.given_mask,
    )  # fmt: skip
    if limit is not None and not is_traced(x.h):
        memory.check_fits(
            model, x.batch, x.h.shape[1], limit=limit, prompt_length=x.length, method=method,
            rows=None if req.rows is None else len(req.rows),
            layers=None if req.layers == tuple(range(model.config.n_layers)) else len(req.layers),
            top_k=top_k, out_dtype=out_dtype, stream=stream_to is not None, blocks=blocks,
            split={name: ctx.axis_size(name) for name in memory.SPLIT_AXES},
        )  # fmt: skip
    targets = check_targets(target, x.batch, x.length, model.config.n_tokens, padded=x.h.shape[1])
    foil = check_foil(foil, method, x.batch, x.length, model.config.n_tokens, padded=x.h.shape[1])
    with forward_mode_needs_xla(ctx.kernels):
        result = _run(model, x, req, ctx, targets, foil)
    if not is_traced(x.h):  # never inside a user's transformation
        bound_compiled_programs()
    return result


def _run(model, x, req: Request, ctx: Context, targets, foil=None) -> Attribution:
    """Score the request's layers in one pass over the model (see :func:`attribute`).

    Every array a program sees has the computed length ``x.h.shape[1]`` (the bucket's, with bucket
    padding), never the caller's ``x.length``: with every row asked, all rows of the bucket are scored
    (the padding rows are exactly 0) and the result is cut to the caller's length on the host at the
    end (:func:`_cut`), so that the lengths of one bucket share every compiled program."""
    job, n_real, computed = req.job, x.length, x.h.shape[1]  # x may carry bucket padding past n_real
    if req.rows is None:  # every row of the computed length, known when tracing (a static schedule)
        row_idx, score_rows = np.arange(computed), None
    else:
        row_idx = score_rows = jax.device_put(np.asarray(req.rows, np.int32))
    if ctx.mesh is not None:
        size = ctx.axis_size(DATA)
        targets, foil = (
            None if t is None else put(pad_batch(t, size), ctx.mesh, P(DATA if size > 1 else None))
            for t in (targets, foil)
        )
    keep = (lambda a: a) if ctx.mesh is None else (lambda a: jax.tree.map(lambda v: v[: x.batch], gather(a)))
    extra, direction, streams, logit = {}, None, None, None
    if job.needs_final:  # a forward first, keeping every layer's input
        streams = model.run_layers(x.h, x.mask, ctx)
        targets, logit = _head_targets(model, streams[-1], targets)
        extra["targets"] = targets
        if foil is not None:  # the contrast: every logit below is logit(target) - logit(foil)
            logit = logit - _head_targets(model, streams[-1], foil)[1]
            extra["foil"] = foil
        if job.method == "logit":
            direction = _logit_direction(model, streams[-1], targets, foil, hold_fixed=job.hold_fixed)
    n_rows = n_real if req.rows is None else len(req.rows)  # the result's rows
    shape = (x.batch, len(req.layers), n_rows, n_real if req.top_k is None else req.top_k)
    sink = StreamWriter(req.stream_to, shape, req.out_dtype) if req.stream_to is not None else None
    # None: a bar when stderr is a terminal and quiet mode is off (io.progress decides), for long work
    show = (
        req.progress
        if req.progress is not None
        else (None if computed >= 1024 and len(req.layers) > 1 else False)
    )
    top_mask = keep(x.mask)  # the computed length: padding columns are never among a row's sources
    done = {}  # layer -> (scores, extras), computed in increasing layer order, at the computed length
    h, at = x.h, 0  # the stream entering layer `at` (single pass)
    try:
        for layer in progress_bar(sorted(set(req.layers)), desc=f"{job.method} layers", enabled=show):
            if job.needs_final:
                h_in = streams[layer]
            else:
                h_in = model.run_layers(h, x.mask, ctx, start=at, stop=layer, embeddings=x.h)[-1]
            if job.method == "grad_input":
                scores = grad_input_scores(
                    model, h_in, layer, row_idx, targets, x.mask, ctx, embeddings=x.h, foil=foil
                )
                out = {"scores": scores}
            else:
                block = model.layers[layer]
                side = side_input(block, x.h)
                out = score_layer(block, h_in, x.mask, score_rows, direction, side, job=job, ctx=ctx)
            if job.with_next:
                h, at = out.pop("next"), layer + 1
            out = keep(out)
            s = out.pop("scores")  # (b, rows, computed): padding rows and columns are exactly 0
            _check_finite(s, job.method, layer)
            if req.top_k is not None:
                s, out["sources"] = _top_k(s, req.top_k, row_idx, top_mask)
            s = s.astype(req.out_dtype)
            if sink is not None:
                cut = np.asarray(s)[:, :n_rows, : shape[-1]]
                for k in (k for k, x_ in enumerate(req.layers) if x_ == layer):
                    sink.write(k, cut)
                s = None
            done[layer] = (s, out)
        result = _result(model, x, req, done, extra, streams, direction, logit, row_idx, keep)
        if sink is not None:
            sink.finish(result.meta(), result.arrays())
            return Attribution.load(req.stream_to)
        return result
    except BaseException:
        if sink is not None:
            sink.abort()
        raise


def _result(model, x, req, done, extra, streams, direction, logit, row_idx, keep) -> Attribution:
    """The Attribution of a finished pass: scores stacked in the asked layer order, extras gathered, then
    cut from the computed length to the caller's (on the host: no program per caller's length)."""
    job, n_real = req.job, x.length
    n_rows = n_real if req.rows is None else len(req.rows)
    per_layer = [done[layer][1] for layer in req.layers]
    rows_valid = x.mask[:, row_idx]
    if job.method == "logit":
        extra["direct"] = jnp.where(
            rows_valid, jnp.einsum("bld,bld->bl", streams[0], direction)[:, row_idx], 0.0
        )
        extra["bias"] = jnp.stack([p["bias"] for p in per_layer], 1)
        extra["logit"] = jnp.where(rows_valid, logit[:, row_idx], 0.0)
        if job.with_alti:
            extra["alti"] = jnp.stack([p["alti"] for p in per_layer], 1)
    if job.with_error:
        extra["approximation_error"] = jnp.stack([p["error"] for p in per_layer], 1)
    if req.top_k is not None:
        extra["sources"] = jnp.stack([p["sources"] for p in per_layer], 1)
    extra = {k: (keep(v) if k in ("targets", "foil", "direct", "logit") else v) for k, v in extra.items()}
    # the caller's lengths of each extra's last axes: positions (targets, foil), rows (direct, logit,
    # bias), rows x sources (sources), positions x positions (alti)
    lengths = {"targets": (n_real,), "foil": (n_real,), "direct": (n_rows,), "logit": (n_rows,),
               "bias": (n_rows,), "sources": (n_rows, req.top_k), "alti": (n_real, n_real)}  # fmt: skip
    extra = {k: _cut(v, lengths.get(k, ())) for k, v in extra.items()}
    scores = None
    if req.stream_to is None:
        scores = _cut(
            jnp.stack([done[layer][0] for layer in req.layers], 1),
            (n_rows, n_real if req.top_k is None else req.top_k),
        )
    return Attribution(
        scores=scores,
        tokens=None if x.tokens is None else _cut(keep(x.tokens), (n_real,)),
        extra=extra,
        method=job.method,
        mode=job.mode,
        layers=req.layers,
        rows=req.rows,
        model=getattr(model, "source", None) or "",
        mask=_cut(keep(x.mask), (n_real,)) if _keeps_mask(x) else None,
        aggregation=job.aggregation if job.method == "hidden_attention" else None,
        top_k=req.top_k,
        precision=output_precision(job),
        n_layers=model.config.n_layers,
        layer_kinds=tuple(model.config.kinds[layer] for layer in req.layers),
    )


def _cut(a, last: tuple[int, ...]):
    """``a`` with its last ``len(last)`` axes cut to the lengths ``last`` (from the bucket's length to
    the caller's). An array that already has them is returned as it is; a concrete one is cut on the
    host and placed back with ``jax.device_put``, because an eager slice compiles one program per result
    shape, i.e. per caller's length; a traced one (concrete tokens under the caller's ``jax.grad`` of
    the parameters are still bucketed) is sliced in the caller's program."""
    if not last or tuple(a.shape[a.ndim - len(last) :]) == tuple(last):
        return a
    index = (slice(None),) * (a.ndim - len(last)) + tuple(slice(0, n) for n in last)
    return a[index] if is_traced(a) else jax.device_put(np.asarray(a)[index])


def _keeps_mask(x) -> bool:
    """Whether the result records a mask: the caller passed one that marks padding (a mask of all-valid
    positions, like no mask, is not recorded; under a transformation it is kept as given)."""
    if not x.given_mask:
        return False
    # gathered first: on a mesh over several processes the mask is not fully addressable from one host
    return is_traced(x.mask) or not np.asarray(gather(x.mask))[: x.batch, : x.length].all()


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
    q = min(memory.HEAD_CHUNK, L)
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


@jit_model_fn(static_argnames=("hold_fixed",))
def _logit_direction(model, h_final, targets, foil=None, hold_fixed=False):
    """v_i = g_f * E_{w_i} / (r_i s) (b, l, d), r_i from the stream entering the final norm (held fixed:
    no gradient through r_i), s the logits' scaling (1 but for Granite). With a foil f_i the row is
    E_{w_i} - E_{f_i}: the logit is linear in the row, so the difference's identity is as exact."""
    r_inv = jax.lax.rsqrt(jnp.mean(h_final * h_final, -1, keepdims=True) + model.config.rms_eps)
    r_inv = jax.lax.stop_gradient(r_inv) if hold_fixed else r_inv
    row = jnp.take(model.unembedding, targets, axis=0).astype(f32)
    if foil is not None:
        row = row - jnp.take(model.unembedding, foil, axis=0).astype(f32)
    return model.norm_f[...].astype(f32) * row * r_inv / model.config.logits_scaling


@jit_model_fn(static_argnames=("job", "ctx"))
def score_layer(block, h, mask, rows, direction, embeddings=None, *, job: LayerJob, ctx: Context):
    """One layer: {"scores" (b, r, l)} plus, for logit, "bias" (b, r) [and "alti" (b, l, l)], and for
    the paper mode "error" (b,): mean over real positions of ||o_i - beta_i - sum_j T_i(x_j)|| / ||o_i||
    (O(l): one scan, the factors' token_total); with_next: "next" = h + o, the stream entering the next
    layer (from this layer's own intermediates: no second scan). ``rows`` None: every row, known when
    the program is traced, so the block loop visits only the causal tiles with no branch (see
    :func:`latim_jax.latim.blocking.blocked`: under ``jax.grad`` that keeps the backward O(L^2))."""
    rows = np.arange(h.shape[1]) if rows is None else rows
    f = factors(
        block, h, mask, ctx, job.mode, hold_fixed=job.hold_fixed, with_total=job.with_error,
        embeddings=embeddings,
    )  # fmt: skip
    aux = None
    if job.method == "logit":
        aux = direction if f.W_out is None else jnp.einsum("bld,ed->ble", direction, f.W_out)
    common = dict(mask=mask, ctx=ctx, blocks=job.blocks, precision=job.precision)
    if job.with_alti:  # every row: the logit scores and the alti maps of the rollout, in one pass
        out = dict(
            zip(("scores", "alti"), layer_scores(f, "logit+alti", rows, aux=aux, **common), strict=True)
        )
    else:
        out = {"scores": layer_scores(f, job.method, rows, aux=aux, aggregation=job.aggregation, **common)}
    if job.method == "logit":
        out["bias"] = jnp.where(mask, jnp.einsum("bld,bld->bl", f.bias, direction), 0.0)[:, rows]
    if job.with_error:
        rel = jnp.linalg.norm(f.token_total + f.bias - f.output, axis=-1) / jnp.linalg.norm(f.output, axis=-1)
        out["error"] = jnp.sum(jnp.where(mask, rel, 0.0), -1) / jnp.sum(mask, -1)
    if job.with_next:
        out["next"] = h.astype(f32) + f.output
    return out
