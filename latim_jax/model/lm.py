"""The Mamba language model (both versions, and hybrids) as a Flax NNX module.

h^0 = E[ids];  h^{l+1} = h^l + Mixer_l(RMSNorm_l(h^l))   (residual stream in fp32)
               (h^l + RMSNorm_l(Mixer_l(h^l)) for the sublayers in ``config.post_norm_layers``)
logits = RMSNorm_f(h^L) @ E_out^T                          (E_out = E when tied)

Mixer_l is the sublayer of kind ``config.kinds[l]`` (its registered ``LayerKind.module``:
:mod:`latim_jax.model.kind`): a Mamba mixer, attention, a token-wise MLP, ...
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from latim_jax.kernels import f32
from latim_jax.model.config import MambaConfig, param_shapes
from latim_jax.model.inputs import (
    bucket_pad,
    check_embeds,
    check_mask,
    check_tokens,
    is_traced,
    traced_invalid,
)
from latim_jax.model.jit import bound_compiled_programs, jit_model_fn
from latim_jax.model.kind import kind_of
from latim_jax.model.layers import normed_linear, rms_norm
from latim_jax.model.sharding import context
from latim_jax.parallel.context import XLA, Context
from latim_jax.parallel.mesh import DATA, SEQ, P, gather, pad_batch, pad_length, put


@dataclasses.dataclass(frozen=True)
class Inputs:
    """What :meth:`MambaLM.prepare_inputs` returns: h (b', l', d) fp32 the stream entering layer 0,
    mask (b', l') bool of valid positions (always an array: all-valid and padded calls trace alike),
    tokens (b', l') int32 or None (embeddings were given), batch = b the caller's batch size (b' > b
    only on a mesh, whose "data" axis needs a multiple: the extra prompts repeat the last one and are
    dropped from results), length = l the caller's length (l' > l only with bucket padding: the extra
    positions are padding, cut from results), given_mask: whether the caller passed a mask."""

    h: jax.Array
    mask: jax.Array
    tokens: jax.Array | None
    batch: int
    length: int
    given_mask: bool = True


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ModelOutput:
    """logits (b, l, v) fp32; residuals (n_layers + 1, b, l, d) fp32: residuals[l] is the stream entering
    layer l (residuals[0] = embeddings, residuals[-1] = the stream entering the final norm)."""

    logits: jax.Array
    residuals: jax.Array


# a prompt of at least this many positions runs in_proj with its pre-norm folded past the product
FOLD_FROM_LENGTH = 4096


class Block(nnx.Module):
    """Pre-norm residual block: h + Mixer(RMSNorm(h)); ``kind`` is its mixer's layer kind (the Mamba
    mixer of ``config.version`` unless given). A "shared" block (Zamba2) is h + Mamba2(RMSNorm(h + t))
    with t its transformer block's output for h and the embeddings h^0
    (:class:`latim_jax.model.shared_block.SharedBlockMixer`): the norm here is the Mamba-2's.

    ``fold_from``: from this prompt length on, in_proj runs with the pre-norm folded past the product
    (:func:`latim_jax.model.layers.normed_linear`; the same value to fp32 rounding, faster on long
    inputs). The choice depends on the length alone, so a prompt alone and inside a batch take the
    same branch; a plain attribute of the module, so changing it retraces.

    ``post_norm``: the norm follows the mixer, h + RMSNorm(Mixer(h)) (OLMo-Hybrid; the config's
    ``post_norm_layers``): :meth:`normed` passes h unchanged and :meth:`finish` normalises the output."""

    def __init__(
        self,
        config: MambaConfig,
        params: dict,
        *,
        kind: str | None = None,
        fold_from: int = FOLD_FROM_LENGTH,
        post_norm: bool = False,
    ):
        self.config = config
        self.norm = nnx.Param(jnp.asarray(params["norm"]))
        self.mixer = kind_of(kind or f"mamba{config.version}").module(config, params["mixer"])
        self.fold_from = fold_from
        self.post_norm = post_norm

    @property
    def kind(self) -> str:
        """The layer kind (a registered :class:`latim_jax.model.kind.LayerKind`'s name): "mamba1",
        "mamba2", "attention", "mlp", "moe", "parallel", "shared", ..."""
        return self.mixer.kind

    @property
    def is_ssm(self) -> bool:
        """Whether the pre-norm feeds the mixer's in_proj (the kind's ``folds_norm``: a Mamba mixer)."""
        return kind_of(self.kind).folds_norm

    @property
    def reads_embeddings(self) -> bool:
        """Whether the block reads the embeddings h^0 beside its input stream (the kind's
        ``reads_embeddings``: a "shared" block)."""
        return kind_of(self.kind).reads_embeddings

    @property
    def ssm_mixer(self):
        """The Mamba mixer whose in_proj the pre-norm feeds (a shared block's ``ssm``)."""
        return self.mixer.ssm if self.reads_embeddings else self.mixer

    def normed(self, h, *, hold_fixed=False):
        """The mixer input xhat = RMSNorm(h), cast to the weight dtype as the reference does;
        ``hold_fixed``: the norm's scale 1 / rms(h) gets no gradient (xhat linear in h). A post-norm
        block's mixer reads h itself."""
        w = self.norm[...]
        if self.post_norm:
            return h.astype(w.dtype)
        return rms_norm(h, w, self.config.rms_eps, hold_scale=hold_fixed).astype(w.dtype)

    def finish(self, o, *, hold_fixed=False):
        """What the mixer's output o adds to the stream: o, or RMSNorm(o) in a post-norm block (fp32;
        ``hold_fixed``: its scale 1 / rms(o) without gradient, so the output is linear in o)."""
        if not self.post_norm:
            return o
        return rms_norm(o, self.norm[...], self.config.rms_eps, hold_scale=hold_fixed)

    def projected(self, h, *, hold_fixed=False):
        """The mixer's in_proj output for xhat = RMSNorm(h), (b, l, in_width) fp32: equal to
        ``mixer.in_projection(self.normed(h))`` (bitwise below ``fold_from`` positions or for non-fp32
        weights, to fp32 rounding from there on: :func:`latim_jax.model.layers.normed_linear`)."""
        m = self.ssm_mixer
        return normed_linear(
            h, self.norm[...], m.in_proj[...], self.config.rms_eps, m._get("in_proj_b"),
            fold=h.shape[1] >= self.fold_from, hold_scale=hold_fixed,
        )  # fmt: skip

    def mixer_input(self, h, embeddings, *, mask, ctx: Context = XLA):
        """The stream the pre-norm reads: h, or h + t for a shared block (t its transformer's output)."""
        if not self.reads_embeddings:
            return h
        if embeddings is None:
            raise ValueError(f"a {self.kind!r} block reads the embeddings h^0: pass embeddings (b, l, d)")
        return h.astype(f32) + self.mixer.transformer(h, embeddings, mask=mask, ctx=ctx)

    def __call__(self, h, *, mask, ctx: Context = XLA, embeddings=None):
        """h (b, l, d) fp32 -> h + o; ``mask`` (b, l) bool of valid positions; ``embeddings`` (b, l, d)
        h^0, read by a shared block only."""
        if self.reads_embeddings:
            x = self.mixer_input(h, embeddings, mask=mask, ctx=ctx)
            return h.astype(f32) + self.mixer.ssm(mask=mask, ctx=ctx, projected=self.projected(x))
        if self.is_ssm:
            return h.astype(f32) + self.mixer(mask=mask, ctx=ctx, projected=self.projected(h))
        return h.astype(f32) + self.finish(self.mixer(self.normed(h), mask=mask, ctx=ctx))

    def step(self, h_t, cache, valid, embeddings=None):
        """One decoding step of the block: h_t (b, d) -> (h_t + o_t, cache); ``embeddings`` (b, d) the
        token's h^0 (a shared block reads it)."""
        if self.reads_embeddings:
            t, c_attn = self.mixer.transformer_step(h_t, embeddings, cache[0], valid)
            o, c_ssm = self.mixer.ssm.step(self.normed(h_t + t), cache[1], valid)
            return h_t + o, (c_attn, c_ssm)
        o, cache = self.mixer.step(self.normed(h_t), cache, valid)
        return h_t + self.finish(o), cache


class MambaLM(nnx.Module):
    """A Mamba-1 or Mamba-2 causal language model, or a hybrid of Mamba, attention and MLP sublayers.

    Build one with :func:`latim_jax.load` (from a checkpoint) or ``MambaLM(config, params)``
    (``latim_jax.model.init.init_params(config, seed)`` gives random parameters for training from
    scratch). ``model(tokens)`` maps int ids (b, l) to fp32 logits (b, l, v). ``fold_from``: the prompt
    length from which the blocks fold their pre-norm past in_proj (:class:`Block`; the same logits to
    float rounding, at lower memory on long inputs).
    """

    def __init__(self, config: MambaConfig, params: dict, *, fold_from: int = FOLD_FROM_LENGTH):
        check_params(config, params)
        self.config = config
        self.embedding = nnx.Param(jnp.asarray(params["embedding"]))
        self.layers = nnx.List(
            [
                Block(config, p, kind=k, post_norm=i in config.post_norm_layers, fold_from=fold_from)
                for i, (p, k) in enumerate(zip(params["layers"], config.kinds, strict=True))
            ]
        )
        self.norm_f = nnx.Param(jnp.asarray(params["norm_f"]))
        self.lm_head = nnx.Param(jnp.asarray(params["lm_head"])) if "lm_head" in params else None
        self._task_json = ""  # plain strings keep the module's graph hashable
        self.source = ""
        self.tokenizer_dir = ""

    @property
    def task(self) -> dict | None:
        """The synthetic task a shipped model was trained on (a dict), or None."""
        return json.loads(self._task_json) if self._task_json else None

    @task.setter
    def task(self, value: dict | None) -> None:
        self._task_json = json.dumps(value, sort_keys=True) if value else ""

    @classmethod
    def from_params(cls, config: MambaConfig, params: dict) -> MambaLM:
        """A model holding ``params`` (the tree of :func:`latim_jax.model.config.param_shapes`)."""
        return cls(config, params)

    def params(self) -> dict:
        """The parameter tree (plain arrays) in the layout of :func:`latim_jax.model.config.param_shapes`."""
        out: dict[str, Any] = {
            "embedding": self.embedding[...],
            "layers": [{"norm": b.norm[...], "mixer": b.mixer.param_dict()} for b in self.layers],
            "norm_f": self.norm_f[...],
        }
        if self.lm_head is not None:
            out["lm_head"] = self.lm_head[...]
        return out

    @property
    def unembedding(self):
        """The (n_tokens, d) output matrix (the embedding when tied): the rows of real tokens only
        (:attr:`MambaConfig.n_tokens`; a padded embedding's extra rows make no logit)."""
        w = (self.lm_head if self.lm_head is not None else self.embedding)[...]
        return w if self.config.n_tokens == w.shape[0] else w[: self.config.n_tokens]

    def check_tokens(self, tokens):
        """Validate token ids (b, l) before any cast (see :func:`latim_jax.model.inputs.check_tokens`)
        and return them as an int32 array."""
        return check_tokens(tokens, self.config.n_tokens)

    def prepare_inputs(
        self, tokens=None, mask=None, inputs_embeds=None, ctx: Context = XLA, *, bucket: bool = False
    ) -> Inputs:
        """Validated inputs from token ids or embeddings (see :class:`Inputs`), each check made once.

        ``bucket``: right-pad to :func:`latim_jax.model.inputs.bucket_length` (concrete inputs), the
        extra positions masked as padding, so that nearby lengths share one compiled program. With a
        mesh in ``ctx`` (the model already laid out on it: :func:`latim_jax.model.sharding.context`),
        the batch is padded to a multiple of the "data" axis by repeating the last prompt, and the
        inputs are placed over "data".
        """
        if (tokens is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of tokens (b, l) and inputs_embeds (b, l, d)")
        if inputs_embeds is not None:
            x, ids = check_embeds(inputs_embeds, self.config.d_model), None
        else:
            x = ids = self.check_tokens(tokens)
        batch, length = x.shape[:2]
        valid = check_mask(mask, batch, length)
        if bucket:
            x, valid = bucket_pad(x, valid)
            ids = None if ids is None else x
        if ctx.mesh is not None:
            size, split = ctx.axis_size(DATA), self.split_length(x.shape[1], ctx)
            spec = P(DATA if size > 1 else None, ctx.axis(SEQ))
            x, valid = (pad_length(a, split) for a in (x, valid))
            x, valid = (put(pad_batch(a, size, edge=True), ctx.mesh, spec) for a in (x, valid))
            ids = None if ids is None else x
        if ids is None:
            h = x
        else:  # eager off a mesh: the jitted form splits the whole model, ~10 ms per call for 24 layers
            h = self.embed(ids) if ctx.mesh is None else _embed(self, ids)
        invalid = traced_invalid(ids, valid, self.config.n_tokens)
        if invalid is not None:  # values unknown at trace time: such a prompt's outputs become NaN
            h = jnp.where(invalid[:, None, None], jnp.nan, h)
        return Inputs(h=h, mask=valid, tokens=ids, batch=batch, length=length, given_mask=mask is not None)

    def split_length(self, length: int, ctx: Context) -> int:
        """The length a call runs at on ``ctx``'s mesh: ``length`` itself, or with a "seq" axis of D
        the next multiple of D with at least as many positions per shard as the largest halo of its
        layers' kinds (:attr:`LayerKind.halo`: a conv of K taps reads K - 1 positions of one neighbour);
        the extra positions are padding (masked, cut from results)."""
        d = ctx.axis_size(SEQ)
        if d <= 1:
            return length
        halo = max(kind_of(name).halo(self.config) for name in set(self.config.kinds))
        return d * max(-(-length // d), halo, 1)

    def embed(self, tokens):
        """h^0 (b, l, d) fp32 (times ``config.embedding_multiplier`` when it is not 1)."""
        h = jnp.take(self.embedding[...], tokens, axis=0).astype(f32)
        m = self.config.embedding_multiplier
        return h if m == 1.0 else h * m

    def final_hidden(self, h):
        """RMSNorm_f(h) in fp32 (the reference casts to the weight dtype before the head)."""
        return rms_norm(h, self.norm_f[...], self.config.rms_eps).astype(self.norm_f[...].dtype)

    def head(self, h):
        """Logits (b, l, v) fp32 from the stream h entering the final norm (divided by
        ``config.logits_scaling``)."""
        w = self.unembedding
        logits = jnp.matmul(self.final_hidden(h).astype(w.dtype), w.T, preferred_element_type=f32)
        scale = self.config.logits_scaling
        return logits if scale == 1.0 else logits / scale

    def run_layers(
        self, h, mask, ctx: Context = XLA, *, start: int = 0, stop: int | None = None, embeddings=None
    ) -> list:
        """[h^start, .., h^stop] the residual streams entering layers start..stop, from h = h^start (all
        layers, and the final stream, when stop is None), one jitted block call per layer (every layer
        of a kind shares one program). ``embeddings``: h^0, which a shared block reads (h itself when
        start is 0; needed from a later start when the model has such blocks)."""
        if embeddings is None and start == 0:
            embeddings = h
        streams = [h]
        for block in self.layers[start : len(self.layers) if stop is None else stop]:
            h = block_forward(block, h, mask, ctx=ctx, embeddings=side_input(block, embeddings))
            streams.append(h)
        return streams

    def forward(self, tokens=None, *, mask=None, inputs_embeds=None, impl="auto", mesh=None) -> ModelOutput:
        """Logits and every layer's residual stream (see :class:`ModelOutput`).

        tokens: int ids (b, l), or ``inputs_embeds`` (b, l, d) instead (the HF convention; h^0 is then
        the given embeddings). mask: optional (b, l) bool of valid positions, one contiguous run per
        row (left and/or right padding): padding is skipped, so real positions' logits equal each
        prompt alone; pad positions' logits are not meaningful. Every layer runs through one jitted
        block function, so compile time does not grow with depth. impl: "auto" | "xla" | "pallas"
        (:mod:`latim_jax.parallel.context`). mesh: a device mesh (see :mod:`latim_jax.parallel.mesh`):
        prompts split over "data", the layers model-parallel over "model", each prompt's length over
        "seq" (:mod:`latim_jax.parallel.sequence`; the kinds that declare ``LayerKind.splits_sequence``).
        """
        ctx = context(self, impl, mesh, sequence=True)
        x = self.prepare_inputs(tokens, mask, inputs_embeds, ctx)
        residuals = self.run_layers(x.h, x.mask, ctx)
        out = ModelOutput(logits=_head(self, residuals[-1]), residuals=jnp.stack(residuals))
        if not is_traced(x.h):
            bound_compiled_programs()
        if ctx.mesh is None:
            return out
        out = gather(out)
        b, l = x.batch, x.length  # the "data" axis' extra prompts, the "seq" axis' extra positions
        return ModelOutput(logits=out.logits[:b, :l], residuals=out.residuals[:, :b, :l])

    def __call__(self, tokens=None, *, mask=None, inputs_embeds=None, impl="auto", mesh=None):
        """Logits (b, l, v) fp32 for int token ids (b, l) (or ``inputs_embeds``; see :meth:`forward`)."""
        return self.forward(tokens, mask=mask, inputs_embeds=inputs_embeds, impl=impl, mesh=mesh).logits

    def init_cache(self, batch: int, max_length: int = 0):
        """Empty caches, one per layer: (conv, ssm) for a Mamba mixer, keys and values for attention
        (room for ``max_length`` positions: the prompt and what is generated), nothing for an MLP."""
        return [b.mixer.init_cache(batch, max_length) for b in self.layers]

    def step(self, token, cache, valid):
        """One decoding step: token ids (b,) -> (logits (b, v), new cache); ``valid`` (b,) bool: False
        marks a padding step, which leaves every cache as the padding would (see mixers)."""
        h = e = self.embed(token[:, None])[:, 0]
        new_cache = []
        for block, c in zip(self.layers, cache, strict=True):
            h, c = block.step(h, c, valid, e)
            new_cache.append(c)
        return self.head(h[:, None])[:, 0], new_cache


@jit_model_fn(static_argnames=("ctx",))
def block_forward(block: Block, h, mask, ctx: Context = XLA, embeddings=None):
    """One residual block, jitted once per layer kind (the blocks of a kind share one graph structure);
    ``embeddings``: h^0 for a block that reads it (:func:`side_input`)."""
    return block(h, mask=mask, ctx=ctx, embeddings=embeddings)


def side_input(block: Block, embeddings):
    """What ``block`` receives besides its stream: the embeddings h^0 when it reads them (a shared block;
    an error naming the block kind when they are missing), else None (so other kinds' jitted programs
    do not depend on h^0)."""
    if not block.reads_embeddings:
        return None
    if embeddings is None:
        raise ValueError(
            f"a {block.kind!r} block reads the embeddings h^0: pass embeddings (b, l, d) when starting "
            "past layer 0"
        )
    return embeddings


@jit_model_fn
def _head(model: MambaLM, h):
    return model.head(h)


@jit_model_fn
def _embed(model: MambaLM, tokens):
    return model.embed(tokens)


def check_params(config: MambaConfig, params: dict) -> None:
    """Raise ValueError naming the first key whose presence or shape disagrees with ``config``."""
    expected = param_shapes(config)

    def walk(exp, got, path):
        if isinstance(exp, dict):
            if not isinstance(got, dict):
                raise ValueError(f"parameter {path or '<root>'}: expected a dict, found {type(got).__name__}")
            missing, extra = sorted(set(exp) - set(got)), sorted(set(got) - set(exp))
            if missing or extra:
                raise ValueError(f"parameters at {path or '<root>'}: missing {missing}, unexpected {extra}")
            for k in exp:
                walk(exp[k], got[k], f"{path}.{k}" if path else k)
        elif isinstance(exp, list):
            if len(exp) != len(got):
                raise ValueError(f"parameter {path}: expected {len(exp)} layers, found {len(got)}")
            for i, (e, g) in enumerate(zip(exp, got, strict=True)):
                walk(e, g, f"{path}.{i}")
        elif tuple(np.shape(got)) != tuple(exp):
            raise ValueError(f"parameter {path}: expected shape {tuple(exp)}, found {tuple(np.shape(got))}")

    walk(expected, params, "")
