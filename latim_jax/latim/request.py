"""What an attribution call asks for, validated once at the API edge: :class:`LayerJob` (what each layer's
scoring computes: one hashable static argument of the per-layer jitted function) and :class:`Request`
(the whole call: the job, which layers and rows, targets, and how the result is returned).

:func:`latim_jax.attribute` keeps its keyword arguments; it hands them to :func:`layer_job` (the checks
that need no input) and :func:`request` (those that need the input's length), then runs the request.
"""

from __future__ import annotations

import dataclasses
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from latim_jax.kernels.block_sizes import Blocks
from latim_jax.latim.kinds import check_mode
from latim_jax.latim.scores import AGGREGATIONS, DEFAULT_AGGREGATION, LATIM_METHODS, METHODS, PRECISIONS
from latim_jax.model.inputs import check_layers, check_rows, is_traced, real_end

OUT_DTYPES = ("float32", "bfloat16", "float16")
MINMAX_SUBSET_WARN_LENGTH = 1024  # from this length on, a Mamba-1 minmax row subset is warned about


@dataclasses.dataclass(frozen=True)
class LayerJob:
    """What one layer's scoring computes (hashable: a static argument under jit).

    method / mode / aggregation / precision / blocks / hold_fixed: as :func:`latim_jax.attribute` takes
    them; with_alti: "logit" also builds the layer's ALTI map in the same pass (its rollout needs it);
    with_next: also return the stream entering the next layer (the single pass over the layers).
    """

    method: str
    mode: str = "exact"
    aggregation: str = "minmax"
    precision: str = "float32"
    blocks: Blocks | None = None
    hold_fixed: bool = False
    with_alti: bool = False
    with_next: bool = False

    @property
    def needs_final(self) -> bool:
        """Whether the call needs the final stream first (targets, the logit direction): a forward
        pass keeping every layer's input, instead of scoring each layer as one pass reaches it."""
        return self.method in ("logit", "grad_input")

    @property
    def with_error(self) -> bool:
        """Whether the layer reports the paper mode's approximation error."""
        return self.mode == "paper" and self.method in LATIM_METHODS


@dataclasses.dataclass(frozen=True)
class Request:
    """One attribution call: the layer job, the layers (in the order asked, each once), the rows
    (distinct positions in the caller's length, or None for all) and how the scores come back."""

    job: LayerJob
    layers: tuple[int, ...]
    rows: tuple[int, ...] | None
    top_k: int | None = None
    out_dtype: str = "float32"
    stream_to: str | os.PathLike | None = None
    progress: bool | None = None


def layer_job(
    *, method, mode, aggregation=None, precision, blocks, hold_fixed, with_alti=False, with_next=False
) -> LayerJob:
    """A validated :class:`LayerJob` (every check that needs no input).

    ``aggregation``: None (the default, ``DEFAULT_AGGREGATION``, for "hidden_attention") or one of
    ``AGGREGATIONS``, which only "hidden_attention" reads: given with another method it is refused
    rather than silently ignored."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; expected one of {METHODS}")
    if aggregation is not None and aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, found {aggregation!r}")
    if aggregation is not None and method != "hidden_attention":
        raise ValueError(
            f"aggregation={aggregation!r} applies to method='hidden_attention' only (how its map is "
            f"aggregated over channels / heads); method={method!r} does not read it: leave aggregation "
            "unset (None)"
        )
    aggregation = DEFAULT_AGGREGATION if aggregation is None else aggregation
    check_mode(mode)
    if blocks is not None and not isinstance(blocks, Blocks):
        raise ValueError(f"blocks must be a latim_jax.Blocks, found {type(blocks).__name__}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, found {precision!r}")
    return LayerJob(
        method=method, mode=mode, aggregation=aggregation, precision=precision, blocks=blocks,
        hold_fixed=bool(hold_fixed), with_alti=with_alti, with_next=with_next,
    )  # fmt: skip


def request(
    model, job: LayerJob, length: int, traced: bool, *, layers, rows, top_k, out_dtype, stream_to, progress,
    rollout_maps, mask=None, given_mask: bool = False,
) -> Request:  # fmt: skip
    """The validated :class:`Request` of a call on prompts of ``length`` positions (``traced``: the
    inputs are abstract, under a jax transformation; ``mask`` the call's valid positions and
    ``given_mask`` whether the caller passed them: negative rows count back from the real tokens'
    end, :func:`latim_jax.model.inputs.real_end`)."""
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype must be one of {OUT_DTYPES}, found {out_dtype!r}")
    n = model.config.n_layers
    layer_list = check_layers(layers, n)
    row_list = check_rows(rows, length, real_end(rows, mask, given_mask, length))
    if top_k is not None and (
        isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= length
    ):
        raise ValueError(f"top_k must be an int in [1, {length}] (the length), found {top_k!r}")
    if stream_to is not None and (top_k is not None or traced or out_dtype == "bfloat16"):
        raise ValueError(
            "stream_to needs concrete inputs, whole score matrices (not top_k) and float32 or float16"
        )
    if rollout_maps is not None and not isinstance(rollout_maps, bool):
        raise ValueError(f"rollout_maps must be None, True or False, found {rollout_maps!r}")
    whole = row_list is None and layer_list == tuple(range(n))
    if rollout_maps and job.method == "logit" and not whole:
        raise ValueError(
            "rollout_maps=True needs every layer and every row (the logit rollout multiplies whole "
            "ALTI maps): call attribute with layers=None, rows=None"
        )
    _warn_minmax_subset(model, job, row_list, length)
    job = dataclasses.replace(
        job,
        with_alti=job.method == "logit" and whole and rollout_maps is not False,
        with_next=not job.needs_final,
    )
    return Request(
        job=job, layers=layer_list, rows=row_list, top_k=top_k, out_dtype=out_dtype, stream_to=stream_to,
        progress=progress,
    )  # fmt: skip


TARGET_METHODS = ("logit", "grad_input")  # the methods that read a vocabulary target (and a foil)


def check_targets(target, batch: int, length: int, vocab: int, padded: int | None = None, name="target"):
    """Target vocabulary entries (b, l) int32, validated before any cast (concrete values only), or None.

    ``padded``: the computed length (>= ``length``, with bucket padding): the targets are right-padded
    to it (any id serves at padding positions; 0 is used). Concrete targets are built and padded on the
    host and placed with ``jax.device_put``, so that no program is compiled for the caller's length.
    ``name``: the argument's name in messages ("target" or "foil")."""
    if target is None:
        return None
    padded = length if padded is None else padded
    if is_traced(target):
        t = target
    else:
        t = np.asarray(target)
        if t.dtype == object or not np.issubdtype(t.dtype, np.integer):
            raise ValueError(
                f"{name} must be an int or int ids of shape {(batch, length)}, found dtype {t.dtype}"
            )
        if t.size and (int(t.min()) < 0 or int(t.max()) >= vocab):
            raise ValueError(f"{name} ids must lie in [0, {vocab}), found min {t.min()} max {t.max()}")
    if t.ndim == 0:
        t = jnp.full((batch, length), t, jnp.int32) if is_traced(t) else np.full((batch, length), t, np.int32)
    if tuple(t.shape) != (batch, length) or not jnp.issubdtype(t.dtype, jnp.integer):
        raise ValueError(
            f"{name} must be an int or int ids of shape {(batch, length)}, found {t.dtype} {tuple(t.shape)}"
        )
    if is_traced(t):
        return jnp.pad(t.astype(jnp.int32), ((0, 0), (0, padded - length)))
    return jax.device_put(np.pad(t.astype(np.int32), ((0, 0), (0, padded - length))))


def check_foil(foil, method: str, batch: int, length: int, vocab: int, padded: int | None = None):
    """The contrastive foil (b, l) int32 (as :func:`check_targets`), or None. A foil asks for target minus
    foil, which only the methods that read a target score (``TARGET_METHODS``): any other method
    refuses it rather than ignore it."""
    if foil is None:
        return None
    if method not in TARGET_METHODS:
        raise ValueError(
            f"foil= contrasts two vocabulary targets, which method={method!r} does not read: use "
            f"method='logit' (exact: logit(target) - logit(foil) = direct + contributions + bias) or "
            "'grad_input'"
        )
    return check_targets(foil, batch, length, vocab, padded, name="foil")


def _warn_minmax_subset(model, job: LayerJob, row_list, length: int) -> None:
    """Warn when Mamba-1 minmax hidden attention is asked for a row subset of a long prompt: its
    range covers every causal entry of the per-channel map whatever rows are asked (so that a subset
    equals the same rows of the full map), which costs the whole map, O(L^2 e n) per layer (one 130m
    layer at L = 4096: ~37 s for rows=[-1], against 0.25 s for "signed"). Mamba-2's range is over
    heads, (L^2 h), and cheap."""
    if job.method != "hidden_attention" or job.aggregation != "minmax" or model.config.version != 1:
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
        stacklevel=4,
    )


def output_precision(job: LayerJob) -> str:
    """The precision a result records: only the LaTIM scores project onto W_out."""
    return job.precision if job.method in LATIM_METHODS else "float32"
