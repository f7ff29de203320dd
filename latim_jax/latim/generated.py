"""Attribute what the model generates: generate a continuation, then score each generated token's row.

Row i of a causal model predicts token i + 1, so the generated token t_{l+k} (k = 0 .. N-1, after a
prompt of l positions) is explained by row l - 1 + k, with the generated token as its vocabulary target:
for ``method="logit"`` the row's sources j <= l - 1 + k (prompt and earlier generated tokens) add up,
with the embedding and bias terms, to that token's logit. One call generates (greedy, or sampled with a
temperature) and attributes the whole sequence once, which is the same as attributing the concatenated
sequence afterwards with ``rows`` those positions and ``target`` the next tokens.
"""

from __future__ import annotations

import numpy as np

from latim_jax.latim.attribution import attribute
from latim_jax.model.generate import generate
from latim_jax.model.inputs import check_mask, is_traced

_SET_HERE = ("rows", "target", "inputs_embeds")  # attribute's arguments this call decides


def attribute_generated(
    model, tokens, max_new_tokens: int, method: str = "logit", *, mask=None, temperature: float = 0.0,
    seed: int = 0, **options,
):  # fmt: skip
    """Generate ``max_new_tokens`` tokens after ``tokens`` and attribute each generated token's row.

    Args:
      model: a :class:`latim_jax.model.lm.MambaLM`.
      tokens: the prompts, int ids (B, l) (concrete: generation runs on the host's loop).
      max_new_tokens: N >= 1 tokens to generate.
      method: any :func:`latim_jax.attribute` method (default "logit": each row's sources add up to the
        generated token's logit; "grad_input" also targets the generated token; the other methods score
        the rows that produced the generated tokens).
      mask: (B, l) bool of valid prompt positions for a batch of different lengths, padded on the LEFT
        (every prompt ends at the last column, where generation continues): each prompt's rows equal
        generating and attributing that prompt alone.
      temperature / seed: 0 (default) generates greedily, else samples (see
        :func:`latim_jax.model.generate.generate`).
      options: any other keyword of :func:`latim_jax.attribute` (layers, mode, impl, blocks, top_k, foil,
        out_dtype, precision, memory_limit, ...); ``rows``, ``target`` and ``inputs_embeds`` are set by
        this call and refused.

    Returns the :class:`~latim_jax.io.results.Attribution` of the whole sequence (B, l + N): ``tokens``
    the prompt and its continuation (``result.tokens[:, l:]`` the generated ids), ``rows`` the N
    positions l - 1 .. l + N - 2 (row k explains generated token k), ``extra["targets"]`` the next
    token at every position (the generated ones at those rows), and ``mask`` the prompt's padding.
    """
    given = sorted(k for k in options if k in _SET_HERE)
    if given:
        raise ValueError(
            f"attribute_generated sets {', '.join(given)} itself (the rows of the generated tokens, their "
            "ids as targets, token ids as input); pass them to latim_jax.attribute instead"
        )
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(
            f"max_new_tokens must be an int >= 1 (tokens to attribute), found {max_new_tokens!r}"
        )
    if is_traced(tokens) or is_traced(mask):
        raise ValueError("attribute_generated needs concrete tokens and mask (generation runs step by step)")
    prompt = model.check_tokens(tokens)
    batch, length = prompt.shape
    mask = None if mask is None else np.asarray(check_mask(mask, batch, length))
    full = np.asarray(
        generate(model, prompt, max_new_tokens, temperature=temperature, seed=seed, mask=mask)
    ).astype(np.int32)
    total = length + max_new_tokens
    next_tokens = np.zeros((batch, total), np.int32)  # position i's target: token i + 1 (0 at the end)
    next_tokens[:, :-1] = full[:, 1:]
    full_mask = None if mask is None else np.concatenate([mask, np.ones((batch, max_new_tokens), bool)], 1)
    rows = list(range(length - 1, total - 1))
    return attribute(model, full, method, rows=rows, mask=full_mask, target=next_tokens, **options)
