"""attribute_generated: generate a continuation and attribute each generated token's row."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import rel_err as rel
from test_attribution import make, tokens

import latim_jax


@pytest.mark.parametrize("name", ["m1", "m2"])
def test_rows_explain_the_generated_tokens_and_equal_attributing_the_sequence_afterwards(name):
    model = make(name)
    prompt = tokens(batch=1, length=7)
    a = latim_jax.attribute_generated(model, prompt, 5)
    full = np.asarray(a.tokens)
    assert full.shape == (1, 12) and (full[:, :7] == prompt).all()
    assert a.rows == tuple(range(6, 11)) and a.scores.shape == (1, 2, 5, 12)
    # greedy: each generated token is the argmax of the forward's logits at the row before it, and the
    # row's logit extra is that token's logit (an off-by-one in rows or targets fails here)
    logits = np.asarray(model(full))[0]
    np.testing.assert_array_equal(full[0, 7:], logits[6:11].argmax(-1))
    np.testing.assert_array_equal(np.asarray(a.extra["targets"])[0, 6:11], full[0, 7:])
    assert rel(a.extra["logit"][0], logits[np.arange(6, 11), full[0, 7:]]) < 1e-5
    total = a.extra["direct"] + a.scores.sum((1, 3)) + a.extra["bias"].sum(1)
    assert rel(total, a.extra["logit"]) < 1e-5
    # the same as generating first, then attributing the concatenated sequence
    after = latim_jax.attribute(
        model, full, "logit", rows=list(range(6, 11)), target=np.asarray(a.extra["targets"])
    )
    np.testing.assert_allclose(a.scores, after.scores, rtol=1e-6, atol=1e-7)
    # another method scores the same rows
    l2 = latim_jax.attribute_generated(model, prompt, 5, "l2", layers=[1])
    ref = latim_jax.attribute(model, full, "l2", rows=list(range(6, 11)), layers=[1])
    np.testing.assert_allclose(l2.scores, ref.scores, rtol=1e-6, atol=1e-7)


def test_a_left_padded_batch_equals_each_prompt_alone():
    model = make("m2")
    prompts = tokens(batch=2, length=8, seed=3)
    mask = np.ones(prompts.shape, bool)
    mask[1, :3] = False
    both = latim_jax.attribute_generated(model, prompts, 4, mask=mask, foil=0)
    assert both.mask is not None and np.asarray(both.mask)[1, :3].sum() == 0
    alone = latim_jax.attribute_generated(model, prompts[1:, 3:], 4, foil=0)
    np.testing.assert_array_equal(np.asarray(both.tokens)[1, 3:], np.asarray(alone.tokens)[0])
    np.testing.assert_allclose(both.scores[1, :, :, 3:], alone.scores[0], rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(both.extra["logit"][1], alone.extra["logit"][0], rtol=2e-5, atol=2e-6)


def test_bad_calls_are_refused_with_the_reason():
    model = make("m1")
    prompt = tokens(batch=1, length=5)
    with pytest.raises(ValueError, match="sets rows, target itself"):
        latim_jax.attribute_generated(model, prompt, 3, rows=[-1], target=2)
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 1"):
        latim_jax.attribute_generated(model, prompt, 0)
    right = np.ones((1, 5), bool)
    right[0, -1] = False
    with pytest.raises(ValueError, match="left padding"):
        latim_jax.attribute_generated(model, prompt, 2, mask=right)
