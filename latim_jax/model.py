"""The Mamba language model (both versions) as a Flax NNX module.

h^0 = E[ids];  h^{l+1} = h^l + Mixer_l(RMSNorm_l(h^l))   (residual stream in fp32)
logits = RMSNorm_f(h^L) @ E_out^T                          (E_out = E when tied)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from latim_jax.config import MambaConfig, param_shapes
from latim_jax.jit import jit_model_fn
from latim_jax.layers import f32, rms_norm
from latim_jax.mixers import make_mixer


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ModelOutput:
    """logits (b, l, v) fp32; residuals (n_layers + 1, b, l, d) fp32: residuals[l] is the stream entering
    layer l (residuals[0] = embeddings, residuals[-1] = the stream entering the final norm)."""

    logits: jax.Array
    residuals: jax.Array


class Block(nnx.Module):
    """Pre-norm residual block: h + Mixer(RMSNorm(h))."""

    def __init__(self, config: MambaConfig, params: dict):
        self.config = config
        self.norm = nnx.Param(jnp.asarray(params["norm"]))
        self.mixer = make_mixer(config, params["mixer"])

    def normed(self, h):
        """The mixer input xhat = RMSNorm(h), cast to the weight dtype as the reference does."""
        w = self.norm[...]
        return rms_norm(h, w, self.config.rms_eps).astype(w.dtype)

    def __call__(self, h, *, impl="auto"):
        """h (b, l, d) fp32 -> h + o."""
        return h.astype(f32) + self.mixer(self.normed(h), impl=impl)


class MambaLM(nnx.Module):
    """A Mamba-1 or Mamba-2 causal language model.

    Build one with :func:`latim_jax.load` (from a checkpoint) or :meth:`MambaLM.from_params`;
    ``MambaLM.init(config, seed)`` gives a randomly initialised model (for training from scratch).
    ``model(tokens)`` maps int ids (b, l) to fp32 logits (b, l, v).
    """

    def __init__(self, config: MambaConfig, params: dict):
        check_params(config, params)
        self.config = config
        self.embedding = nnx.Param(jnp.asarray(params["embedding"]))
        self.layers = nnx.List([Block(config, p) for p in params["layers"]])
        self.norm_f = nnx.Param(jnp.asarray(params["norm_f"]))
        self.lm_head = nnx.Param(jnp.asarray(params["lm_head"])) if "lm_head" in params else None
        self._task_json = ""  # plain strings keep the module's graph hashable
        self.source = ""
        self.tokenizer_dir = ""

    @property
    def task(self) -> dict | None:
        """The synthetic task a shipped model was trained on (a dict), or None."""
        import json

        return json.loads(self._task_json) if self._task_json else None

    @task.setter
    def task(self, value: dict | None) -> None:
        import json

        self._task_json = json.dumps(value, sort_keys=True) if value else ""

    @classmethod
    def from_params(cls, config: MambaConfig, params: dict) -> MambaLM:
        """A model holding ``params`` (the tree of :func:`latim_jax.config.param_shapes`)."""
        return cls(config, params)

    def params(self) -> dict:
        """The parameter tree (plain arrays) in the layout of :func:`latim_jax.config.param_shapes`."""
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
        """The (v, d) output matrix (the embedding when tied)."""
        return (self.lm_head if self.lm_head is not None else self.embedding)[...]

    def check_tokens(self, tokens):
        """Validate token ids (b, l): 2-D ints, l >= 1, and (when concrete) inside the vocabulary."""
        if tokens.ndim != 2:
            raise ValueError(f"tokens must have shape (batch, length), found shape {tuple(tokens.shape)}")
        if tokens.shape[1] < 1:
            raise ValueError("tokens must hold at least one position (found length 0)")
        if not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise ValueError(f"tokens must be integer ids, found dtype {tokens.dtype}")
        if not isinstance(tokens, jax.core.Tracer):
            t = np.asarray(tokens)
            if t.size and (t.min() < 0 or t.max() >= self.config.vocab_size):
                raise ValueError(
                    f"token ids must lie in [0, {self.config.vocab_size}), found min {t.min()} max {t.max()}"
                )

    def embed(self, tokens):
        """h^0 (b, l, d) fp32."""
        return jnp.take(self.embedding[...], tokens, axis=0).astype(f32)

    def final_hidden(self, h):
        """RMSNorm_f(h) in fp32 (the reference casts to the weight dtype before the head)."""
        return rms_norm(h, self.norm_f[...], self.config.rms_eps).astype(self.norm_f[...].dtype)

    def head(self, h):
        """Logits (b, l, v) fp32 from the stream h entering the final norm."""
        w = self.unembedding
        return jnp.matmul(self.final_hidden(h).astype(w.dtype), w.T, preferred_element_type=f32)

    def forward(self, tokens, *, impl="auto") -> ModelOutput:
        """Logits and every layer's residual stream (see :class:`ModelOutput`)."""
        self.check_tokens(tokens)
        return _forward(self, jnp.asarray(tokens), impl=impl)

    def __call__(self, tokens, *, impl="auto"):
        """Logits (b, l, v) fp32 for int token ids (b, l)."""
        return self.forward(tokens, impl=impl).logits

    def init_cache(self, batch: int):
        """Zero recurrent caches, one (conv, ssm) pair per layer."""
        return [b.mixer.init_cache(batch) for b in self.layers]

    def step(self, token, cache):
        """One decoding step: token ids (b,) -> (logits (b, v), new cache)."""
        h = self.embed(token[:, None])[:, 0]
        new_cache = []
        for block, c in zip(self.layers, cache, strict=True):
            o, c = block.mixer.step(block.normed(h), c)
            h = h + o
            new_cache.append(c)
        return self.head(h[:, None])[:, 0], new_cache


@jit_model_fn(static_argnames=("impl",))
def _forward(model: MambaLM, tokens, impl):
    h = model.embed(tokens)
    residuals = [h]
    for block in model.layers:
        h = block(h, impl=impl)
        residuals.append(h)
    return ModelOutput(logits=model.head(h), residuals=jnp.stack(residuals))


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
