"""The Attribution result: scores, rollout across layers, and atomic save/load to one .npz file."""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from latim_jax.io import plotting
from latim_jax.io import spans as spans_
from latim_jax.io.atomic import write_npz_atomic
from latim_jax.io.stream import read_parts
from latim_jax.version import __version__

FORMAT = "latim-jax-attribution/1"
ROLLOUT_METHODS = ("alti", "hidden_attention", "logit")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Attribution:
    """Scores of one attribution call.

    scores: (B, n_layers, R, L) float32 (R = L, or the requested rows), exactly 0 above the diagonal
    and on padding; tokens (B, L) (None when the call passed embeddings); mask (B, L) bool of valid
    positions, or None when every position is real; aggregation: the hidden-attention aggregation
    (None for other methods);
    extra: method-specific arrays - "targets" (B, L) vocabulary entries for logit/grad_input, and
    "foil" (B, L) the contrastive foil when one was given (then every logit below is the difference
    logit(target) - logit(foil));
    for "logit": "direct" (B, R) embedding term, "bias" (B, n_layers, R) bias terms, "logit" (B, R) the
    model's logit (all 0 on pad rows), "alti" (B, n_layers, L, L) for the rollout; for mode "paper":
    "approximation_error" (B, n_layers) = per prompt, the mean over its real positions i of
    ||o_i - beta_i - sum_j T_i(x_j)|| / ||o_i|| (beta_i = the out_proj bias).
    top_k: when set, ``scores`` are (B, n_layers, R, top_k), the strongest sources of each target row in
    decreasing order, and ``extra["sources"]`` (same shape, int32) their positions (-1 where a row has
    fewer sources than top_k, with score 0).
    precision: the score path's projection as computed, "float32" or "bfloat16" (bf16 operands, fp32
    accumulation; see :func:`latim_jax.attribute`).
    n_layers: the model's depth (``layers`` may be a subset; None in files written before the field).
    layer_kinds: the kind of each scored layer, in the order of ``scores``' layer axis ("mamba1",
    "mamba2", "attention", "mlp"; None in files written before the field).
    labels: per prompt, a label per position of the last axis (tokens' or, after :meth:`aggregate`,
    spans' words), which pictures and the notebook view show; None: positions show their ids
    (:meth:`with_labels` sets them).
    After :meth:`aggregate`, the last axis (and the rows, when every row was held) are spans, and
    ``extra["spans"]`` (B, S, 2) holds each span's [start, end) token positions (-1 past a prompt's
    spans, which ``mask`` marks as not real).
    In a notebook the result shows itself as the HTML viewer (:meth:`_repr_html_`).
    """

    scores: jax.Array
    tokens: jax.Array | None
    extra: dict
    method: str = dataclasses.field(metadata=dict(static=True))
    mode: str = dataclasses.field(metadata=dict(static=True))
    layers: tuple = dataclasses.field(metadata=dict(static=True))
    rows: tuple | None = dataclasses.field(metadata=dict(static=True))
    model: str = dataclasses.field(metadata=dict(static=True))
    mask: jax.Array | None = None
    aggregation: str | None = dataclasses.field(default=None, metadata=dict(static=True))
    top_k: int | None = dataclasses.field(default=None, metadata=dict(static=True))
    precision: str = dataclasses.field(default="float32", metadata=dict(static=True))
    n_layers: int | None = dataclasses.field(default=None, metadata=dict(static=True))
    layer_kinds: tuple | None = dataclasses.field(default=None, metadata=dict(static=True))
    labels: tuple | None = dataclasses.field(default=None, metadata=dict(static=True))

    def check_finite(self) -> None:
        """Raise FloatingPointError naming the layers whose scores hold NaN/inf (concrete inputs only;
        one boolean per layer crosses to the host, not the scores)."""
        if isinstance(self.scores, jax.core.Tracer):
            return
        finite = np.asarray(jnp.isfinite(self.scores).all(axis=(0, 2, 3)))
        if not finite.all():
            layers = [self.layers[i] for i in np.flatnonzero(~finite)]
            raise FloatingPointError(f"non-finite {self.method} scores at layer(s) {layers}")

    def rollout(self, per_layer: bool = False):
        """Aggregate across layers (needs all layers and all rows).

        alti: R^1 = C^1, R^l = C^l R^{l-1} (row-stochastic). hidden_attention: the same product of
        (A + I) / rowsum. logit: input attribution sum_l sum_j c^l_ij R^{l-1}_jk (R^0 = I) plus the
        embedding term at k = i, so that rows sum to the logit minus the layers' bias terms
        (``extra["bias"].sum(1)``). Returns (B, L, L), or (B, n_layers, L, L) with ``per_layer``.
        """
        if self.method not in ROLLOUT_METHODS:
            raise ValueError(f"rollout is defined for {ROLLOUT_METHODS}, not {self.method!r}")
        if "spans" in self.extra:
            raise ValueError(
                "rollout multiplies token-level maps, and this result is aggregated over spans: roll out "
                "the token-level result and aggregate that (aggregate carries extra['rollout'] along: "
                "r = dataclasses.replace(res, extra={**res.extra, 'rollout': res.rollout()}); "
                "r.aggregate(spans))"
            )
        if self.top_k is not None:
            raise ValueError("rollout needs whole score matrices, not top_k sources (call without top_k)")
        if self.method == "hidden_attention" and self.aggregation == "signed":
            raise ValueError(
                "rollout needs non-negative maps: the 'signed' hidden-attention aggregation has negative "
                "entries; use aggregation='minmax' (default) or 'abs'"
            )
        depth = len(self.layers) if self.n_layers is None else self.n_layers
        if self.rows is not None or self.layers != tuple(range(depth)):
            raise ValueError(
                f"rollout needs every layer and every row, and this result holds layers {list(self.layers)} "
                f"of {depth}{'' if self.rows is None else f' and rows {list(self.rows)}'} (call attribute "
                "with layers=None, rows=None; per_layer=True gives the rollout up to each layer)"
            )
        L = self.scores.shape[-1]
        eye = jnp.eye(L, dtype=jnp.float32)
        if self.method == "logit":
            if "alti" not in self.extra:
                raise ValueError(
                    "the logit rollout needs every layer's ALTI maps, which this result does not hold: "
                    "call attribute(..., method='logit') without rollout_maps=False"
                )
            mats = self.extra["alti"]
            R = jnp.broadcast_to(self._valid_eye(eye)[:, 0], mats[:, 0].shape)
            total = self.extra["direct"][..., None] * eye
            steps = []
            for layer in range(mats.shape[1]):
                total = total + jnp.einsum("bij,bjk->bik", self.scores[:, layer], R)
                R = jnp.einsum("bij,bjk->bik", mats[:, layer], R)
                steps.append(total)
        else:
            mats = self.scores
            if self.method == "hidden_attention":
                mats = mats + self._valid_eye(eye)
                total = mats.sum(-1, keepdims=True)
                mats = mats / jnp.where(total > 0, total, 1.0)
            R = mats[:, 0]
            steps = [R]
            for layer in range(1, mats.shape[1]):
                R = jnp.einsum("bij,bjk->bik", mats[:, layer], R)
                steps.append(R)
        return jnp.stack(steps, 1) if per_layer else steps[-1]

    def aggregate(self, spans, rows: str = "last") -> Attribution:
        """The scores over spans of positions (words, phrases) instead of tokens.

        ``spans``: a :class:`latim_jax.io.spans.Spans` (e.g. from :func:`latim_jax.word_spans`), a list
        of (start, end) pairs, or one of those per prompt; each prompt's spans must cover its real
        positions (padding excluded) consecutively, each position once. Sources are summed over each
        span, so every row keeps its total (ALTI rows still sum to 1; for "logit", direct + scores +
        bias still equal the logit). Target rows, when the result holds every row, follow ``rows``:
        "last" (default: the row of the span's last token, where a causal model has read all of it) or
        "mean" (the span's rows averaged; the logit extras alike); a row subset keeps its rows. The
        extras "alti" and "rollout" are aggregated on both axes, "direct", "logit" and "bias" on rows;
        "targets" / "foil" stay per token. Labels come from the spans' labels.

        Returns an Attribution whose last axis is S spans (the most any prompt has; ``mask`` marks a
        prompt's real spans when they differ in count) and ``extra["spans"]`` their bounds."""
        if self.top_k is not None:
            raise ValueError("aggregate needs whole score matrices, not top_k sources (call without top_k)")
        if "spans" in self.extra:
            raise ValueError("this result is already aggregated over spans: aggregate the token-level result")
        if isinstance(self.scores, jax.core.Tracer):
            raise ValueError("aggregate works on concrete results (outside jax transformations)")
        B, L = self.scores.shape[0], self.scores.shape[-1]
        parts = spans_.per_prompt(spans, B)
        mask = np.ones((B, L), bool) if self.mask is None else np.asarray(self.mask, bool)
        spans_.check_cover(parts, mask)
        G, W = spans_.matrices(parts, L, rows)
        all_rows = self.rows is None
        dtype = self.scores.dtype

        def cols(a):  # (B, ..., L) -> (B, ..., S): sources summed
            return jnp.einsum("b...l,bsl->b...s", jnp.asarray(a, jnp.float32), G)

        def row_rule(a, axis):  # the row axis ``axis`` of (B, ...) from L positions to S spans
            a = jnp.moveaxis(jnp.asarray(a, jnp.float32), axis, -1)
            return jnp.moveaxis(jnp.einsum("b...l,bsl->b...s", a, W), -1, axis)

        scores = cols(self.scores)
        if all_rows:
            scores = row_rule(scores, 2)
        extra = dict(self.extra)
        for key, axis in (("direct", 1), ("logit", 1), ("bias", 2)):
            if key in extra and all_rows:
                extra[key] = row_rule(extra[key], axis)
        for key, axis in (("alti", 2), ("rollout", 1)):
            if key in extra:
                extra[key] = row_rule(cols(extra[key]), axis)
        S = G.shape[1]
        bounds = np.full((B, S, 2), -1, np.int32)
        for b, p in enumerate(parts):
            bounds[b, : len(p)] = p.bounds
        extra["spans"] = jnp.asarray(bounds)
        real = G.sum(-1) > 0  # (B, S)
        labels = None
        if any(p.labels is not None for p in parts):
            labels = tuple(
                tuple(p.labels or [f"{a}-{e - 1}" for a, e in p.bounds]) + ("",) * (S - len(p)) for p in parts
            )
        return dataclasses.replace(
            self, scores=scores.astype(dtype), extra=extra, mask=None if real.all() else jnp.asarray(real),
            labels=labels,
        )  # fmt: skip

    def with_labels(self, labels) -> Attribution:
        """This result with a label per position of the last axis: one list of str for every prompt, or
        one list per prompt (e.g. from :func:`latim_jax.token_labels`)."""
        B, L = self.scores.shape[0], self.scores.shape[-1]
        items = list(labels)
        per = [items] * B if items and isinstance(items[0], str) else items
        if len(per) != B or any(len(x) != L for x in per):
            raise ValueError(
                f"labels must be {L} strings (one per position), or one such list per prompt ({B})"
            )
        return dataclasses.replace(self, labels=tuple(tuple(str(x) for x in p) for p in per))

    def _repr_html_(self) -> str | None:
        """The notebook view: the first prompt's maps in the HTML viewer (the page :meth:`save_html`
        writes), inside an iframe and pooled past ``plotting.NOTEBOOK_CELL_BUDGET`` cells so a long
        prompt stays a small output; None (the plain repr) for top_k results, which hold no maps."""
        if self.top_k is not None or isinstance(self.scores, jax.core.Tracer):
            return None
        return plotting.iframe(self._page(plotting.NOTEBOOK_CELL_BUDGET))

    def save_html(self, path, prompt: int = 0) -> None:
        """Write prompt ``prompt``'s maps as a standalone HTML page (atomically)."""
        plotting.write_page(path, self._page(plotting.HTML_CELL_BUDGET, prompt))

    def _page(self, budget: int, prompt: int = 0) -> str:
        """The viewer page of one prompt's maps, pooled past ``budget`` cells."""
        if self.top_k is not None:
            raise ValueError("a top_k result holds the strongest sources, not maps: call without top_k")
        B, L = self.scores.shape[0], self.scores.shape[-1]
        if not 0 <= prompt < B:
            raise ValueError(f"prompt must be in [0, {B}), found {prompt}")
        if self.labels is not None:
            labels = list(self.labels[prompt])
        elif self.tokens is not None and "spans" not in self.extra:
            labels = [str(int(t)) for t in np.asarray(self.tokens[prompt])]
        else:
            labels = [str(k) for k in range(L)]
        kinds = self.layer_kinds or (None,) * len(self.layers)
        names = [f"layer {k}" + (f" ({t})" if t else "") for k, t in zip(self.layers, kinds, strict=True)]
        rows = self.picture_rows(prompt)
        row_labels = [labels[r] for r in rows] if self.rows is None or "spans" not in self.extra else None
        if row_labels is None:  # a row subset over spans: the rows are token positions
            row_labels = [f"token {r}" for r in self.rows]
        mode = f" ({self.mode} mode)" if self.method in ("l2", "l1", "alti", "logit") else ""
        title = f"{self.model or 'latim-jax'}: {self.method}{mode}"
        title += f", prompt {prompt} of {B}" if B > 1 else ""
        return plotting.html_page(
            np.asarray(self.scores[prompt], np.float32), labels, title=title, layer_names=names,
            row_labels=row_labels, rows=rows, value_label=plotting.value_label(self.method), budget=budget,
        )  # fmt: skip

    def picture_rows(self, prompt: int = 0) -> list[int]:
        """Each row's index on the last axis, which pictures grey the sources after: positions (all rows:
        0 .. R-1), or for a row subset of a result aggregated over spans, the span holding each row."""
        if self.rows is None:
            return list(range(self.scores.shape[2]))
        if "spans" not in self.extra:
            return list(self.rows)
        bounds = np.asarray(self.extra["spans"][prompt])
        return [int(np.flatnonzero((bounds[:, 0] <= r) & (r < bounds[:, 1]))[0]) for r in self.rows]

    def _valid_eye(self, eye):
        """I restricted to real positions (B or 1, 1, L, L): padding stays exactly 0 in rollouts."""
        if self.mask is None:
            return eye[None, None]
        return (eye * self.mask[:, None, :].astype(eye.dtype))[:, None]

    def meta(self) -> dict:
        """The JSON-safe metadata written beside the arrays."""
        return {
            "format": FORMAT,
            "method": self.method,
            "mode": self.mode,
            "layers": list(self.layers),
            "rows": None if self.rows is None else list(self.rows),
            "model": self.model,
            "library_version": __version__,
            "extra_keys": sorted(self.extra),
            "aggregation": self.aggregation,
            "top_k": self.top_k,
            "precision": self.precision,
            "n_layers": self.n_layers,
            "layer_kinds": None if self.layer_kinds is None else list(self.layer_kinds),
            "has_tokens": self.tokens is not None,
            "has_mask": self.mask is not None,
            "labels": None if self.labels is None else [list(p) for p in self.labels],
        }

    def arrays(self) -> dict:
        """Tokens, mask and extras as named host arrays (everything but the scores)."""
        out = {}
        if self.tokens is not None:
            out["tokens"] = np.asarray(self.tokens)
        if self.mask is not None:
            out["mask"] = np.asarray(self.mask)
        out.update({f"extra__{k}": np.asarray(v) for k, v in self.extra.items()})
        return out

    def save(self, path) -> None:
        """Write one self-describing .npz (arrays + JSON metadata) atomically."""
        arrays = {"scores": np.asarray(self.scores), **self.arrays()}
        arrays["meta"] = np.frombuffer(json.dumps(self.meta()).encode(), dtype=np.uint8)
        write_npz_atomic(path, arrays)

    @classmethod
    def load(cls, path) -> Attribution:
        """Read a file written by :meth:`save` (or a directory written by ``attribute(stream_to=...)``)."""
        path = os.fspath(path)
        if os.path.isdir(path):
            return cls.from_directory(path)
        try:
            with np.load(path, allow_pickle=False) as z:
                meta = json.loads(bytes(z["meta"]).decode())
                if meta.get("format") != FORMAT:
                    raise KeyError(f"format {meta.get('format')!r}")
                arrays = {k: z[k] for k in z.files if k not in ("meta", "scores")}
                return cls.from_parts(meta, jnp.asarray(z["scores"]), arrays)
        except (KeyError, OSError, EOFError, ValueError, json.JSONDecodeError) as err:
            raise ValueError(f"{path}: cannot read a latim-jax attribution file ({err})") from err

    @classmethod
    def from_directory(cls, path) -> Attribution:
        """Read a directory written by ``attribute(stream_to=...)``: its scores are a read-only memmap."""
        meta, scores, arrays = read_parts(path)
        return cls.from_parts(meta, scores, arrays)

    @classmethod
    def from_parts(cls, meta: dict, scores, arrays: dict) -> Attribution:
        """Rebuild from :meth:`meta`, the scores and :meth:`arrays` (tokens, mask, ``extra__*``)."""
        return cls(
            scores=scores,
            tokens=jnp.asarray(arrays["tokens"]) if "tokens" in arrays else None,
            mask=jnp.asarray(arrays["mask"]) if "mask" in arrays else None,
            extra={k: jnp.asarray(arrays[f"extra__{k}"]) for k in meta["extra_keys"]},
            method=meta["method"],
            mode=meta["mode"],
            layers=tuple(meta["layers"]),
            rows=None if meta["rows"] is None else tuple(meta["rows"]),
            model=meta["model"],
            aggregation=meta.get("aggregation"),
            top_k=meta.get("top_k"),
            precision=meta.get("precision", "float32"),  # files written before the field: fp32
            n_layers=meta.get("n_layers"),
            layer_kinds=None if meta.get("layer_kinds") is None else tuple(meta["layer_kinds"]),
            labels=None if meta.get("labels") is None else tuple(tuple(p) for p in meta["labels"]),
        )
