"""Autoregressive generation on the recurrent step (conv cache + fp32 SSM state per layer)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from latim_jax.model.inputs import check_mask
from latim_jax.model.jit import jit_model_fn


def prefill(model, tokens, mask=None, *, max_length: int = 0):
    """Run the prompt (b, l) through the recurrent step: (logits of every position (b, l, v), cache).

    ``mask`` (b, l) bool (None: all valid): padding steps (False) leave the caches as if they were
    absent. ``max_length``: the positions an attention sublayer's cache holds (at least l)."""
    tokens = model.check_tokens(tokens)
    max_length = _cache_length(model, max(max_length, tokens.shape[1]))
    return _prefill(model, tokens, check_mask(mask, *tokens.shape), max_length=max_length)


def _cache_length(model, length: int) -> int:
    """The positions the caches hold: ``length`` with an attention sublayer, else 0 (a Mamba state does
    not grow, and one program then serves every length)."""
    return length if model.config.has_attention else 0


@jit_model_fn(static_argnames=("max_length",))
def _prefill(model, tokens, mask, *, max_length):

    def body(cache, inputs):
        tok, ok = inputs
        logits, cache = model.step(tok, cache, ok)
        return cache, logits

    cache, logits = jax.lax.scan(body, model.init_cache(tokens.shape[0], max_length), (tokens.T, mask.T))
    return jnp.swapaxes(logits, 0, 1), cache


@jit_model_fn(static_argnames=("steps", "temperature", "top_k"))
def _decode(model, last_logits, cache, key, *, steps, temperature, top_k):
    def pick(logits, k):
        if temperature == 0.0:
            return jnp.argmax(logits, -1)
        logits = logits / temperature
        if top_k is not None:
            kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
            logits = jnp.where(logits < kth, -jnp.inf, logits)
        return jax.random.categorical(k, logits, -1)

    def body(carry, k):
        logits, cache = carry
        tok = pick(logits, k)
        logits, cache = model.step(tok, cache, jnp.ones(tok.shape, bool))
        return (logits, cache), tok

    _, toks = jax.lax.scan(body, (last_logits, cache), jax.random.split(key, steps))
    return toks.T


def generate(
    model,
    tokens,
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    seed: int = 0,
    mask=None,
):
    """Continue ``tokens`` (b, l) by ``max_new_tokens`` tokens: greedy when temperature == 0, else
    sampling (optionally top-k). Returns (b, l + max_new_tokens) int32 ids.

    ``mask`` (b, l) bool of valid positions batches prompts of different lengths: they must be
    padded on the LEFT (every row ends with a real token, where generation continues); each row's
    continuation equals generating from that prompt alone.
    """
    tokens = model.check_tokens(tokens)
    mask = check_mask(mask, *tokens.shape)
    if not isinstance(mask, jax.core.Tracer) and not bool(mask[:, -1].all()):
        raise ValueError("generate needs left padding: every mask row must end with a valid position")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, found {max_new_tokens!r}")
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0, found {temperature}")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be a positive int or None, found {top_k!r}")
    if max_new_tokens == 0:
        return tokens.astype(jnp.int32)
    max_length = _cache_length(model, tokens.shape[1] + max_new_tokens)
    logits, cache = _prefill(model, tokens, mask, max_length=max_length)
    new = _decode(
        model,
        logits[:, -1],
        cache,
        jax.random.PRNGKey(seed),
        steps=max_new_tokens,
        temperature=float(temperature),
        top_k=top_k,
    )
    return jnp.concatenate([tokens.astype(jnp.int32), new.astype(jnp.int32)], axis=1)
