"""Padding is correct by construction: a padded batch (left, right, both sides) equals each prompt alone,
for the model's logits, every attribution method and mode, the extras and the paper-mode error; pad
rows/columns are exactly zero; masks with holes are refused (jax only)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import rel_err as rel
from conftest import tiny_config

import latim_jax
from latim_jax.model.generate import generate
from latim_jax.model.init import init_params

TOL = {"fp32": 2e-5, "alti": 5e-5}

CONFIGS = {
    # biases everywhere: the in_proj / conv bias must not leak from padding either
    1: tiny_config(1, proj_bias=True),
    2: tiny_config(2, proj_bias=True),
}
L, N = 11, 6  # padded length, prompt length


def model(version):
    params = jax.tree.map(np.array, init_params(CONFIGS[version], seed=5))
    rng = np.random.default_rng(9)
    for layer in params["layers"]:  # non-zero biases (the default init draws them, make sure)
        for name in ("in_proj_b", "out_proj_b", "conv_b"):
            layer["mixer"][name] = 0.3 * rng.normal(size=layer["mixer"][name].shape).astype(np.float32)
    return latim_jax.MambaLM(CONFIGS[version], params)


def padded_batch():
    """Two prompts of length N placed right-padded, left-padded and in the middle of length L."""
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, 32, (2, N))
    tokens = rng.integers(0, 32, (3, L))  # pad ids are random: they must not matter
    mask = np.zeros((3, L), bool)
    starts = (0, L - N, 2)  # right padding, left padding, both sides
    which = (0, 1, 0)
    for b, (s, w) in enumerate(zip(starts, which, strict=True)):
        tokens[b, s : s + N] = prompts[w]
        mask[b, s : s + N] = True
    return prompts, tokens, mask, starts, which


@pytest.fixture(scope="module", params=[1, 2])
def case(request):
    return request.param, model(request.param), *padded_batch()


def test_logits_equal_each_prompt_alone(case):
    _, m, prompts, tokens, mask, starts, which = case
    alone = np.asarray(m(prompts))
    logits = np.asarray(m(tokens, mask=mask))
    for b, (s, w) in enumerate(zip(starts, which, strict=True)):
        assert rel(logits[b, s : s + N], alone[w]) < TOL["fp32"], b
    # without the mask, left padding changes the result (the test can tell)
    unmasked = np.asarray(m(tokens))
    assert rel(unmasked[1, L - N :], alone[1]) > 1e-3


METHODS = [
    ("l2", "exact", {}),
    ("l1", "exact", {}),
    ("alti", "exact", {}),
    ("alti", "paper", {}),
    ("logit", "exact", {}),
    ("logit", "paper", {}),
    ("hidden_attention", "exact", {"aggregation": "minmax"}),
    ("hidden_attention", "exact", {"aggregation": "abs"}),
    ("grad_input", "exact", {}),
]


@pytest.mark.parametrize("method, mode, options", METHODS, ids=[f"{m}-{o}-{k}" for m, o, k in METHODS])
def test_scores_and_extras_equal_each_prompt_alone(case, method, mode, options):
    _, m, prompts, tokens, mask, starts, which = case
    alone = latim_jax.attribute(m, prompts, method=method, mode=mode, **options)
    got = latim_jax.attribute(m, tokens, method=method, mode=mode, mask=mask, **options)
    s, want = np.asarray(got.scores), np.asarray(alone.scores)
    tol = TOL["alti"] if method in ("alti", "grad_input") else TOL["fp32"]
    for b, (st, w) in enumerate(zip(starts, which, strict=True)):
        real = slice(st, st + N)
        assert rel(s[b][:, real, real], want[w]) < tol, b
        pad = ~mask[b]
        assert (s[b][:, pad, :] == 0).all() and (s[b][:, :, pad] == 0).all()  # exactly zero
        for key in ("direct", "logit"):
            if key in got.extra:
                e = np.asarray(got.extra[key][b])
                assert rel(e[real], alone.extra[key][w]) < TOL["fp32"] and (e[pad] == 0).all()
        if "bias" in got.extra:
            e = np.asarray(got.extra["bias"][b])
            assert rel(e[:, real], alone.extra["bias"][w]) < TOL["fp32"] and (e[:, pad] == 0).all()
        if "approximation_error" in got.extra:
            assert rel(got.extra["approximation_error"][b], alone.extra["approximation_error"][w]) < 1e-4
    assert (np.triu(s, 1) == 0).all()
    if method in ("alti", "logit", "hidden_attention"):
        R = np.asarray(got.rollout())
        for b, (st, w) in enumerate(zip(starts, which, strict=True)):
            real = slice(st, st + N)
            assert rel(R[b][real, real], np.asarray(alone.rollout())[w]) < TOL["alti"]
            assert (R[b][~mask[b]] == 0).all() and (R[b][:, ~mask[b]] == 0).all()


@pytest.mark.parametrize("blocks", [(4, 4), (8, 3)], ids=["4x4", "8x3"])
def test_minmax_range_over_many_blocks_with_padding(case, blocks):
    """minmax normalises by the range of M over the whole causal triangle of real positions: with
    several blocks and pads on either side, every row asked in any order (Mamba-2 takes the range
    from the map's own blocks) and a row subset (the separate range pass) equal each prompt alone."""
    from latim_jax import Blocks

    _, m, prompts, tokens, mask, starts, which = case
    alone = np.asarray(latim_jax.attribute(m, prompts, method="hidden_attention").scores)
    opts = dict(method="hidden_attention", mask=mask, blocks=Blocks(rows=blocks[0], cols=blocks[1]))
    full = np.asarray(latim_jax.attribute(m, tokens, **opts).scores)
    backwards = np.asarray(latim_jax.attribute(m, tokens, rows=list(range(L))[::-1], **opts).scores)
    subset = np.asarray(latim_jax.attribute(m, tokens, rows=[L - 1, 4], **opts).scores)
    for b, (st, w) in enumerate(zip(starts, which, strict=True)):
        real = slice(st, st + N)
        assert rel(full[b][:, real, real], alone[w]) < TOL["fp32"], b
        assert rel(backwards[b][:, ::-1][:, real, real], alone[w]) < TOL["fp32"], b
        assert rel(subset[b], full[b][:, [L - 1, 4]]) < TOL["fp32"], b


def test_contributions_and_conservation_with_mask(case):
    _, m, prompts, tokens, mask, starts, which = case
    c = latim_jax.contributions(m, tokens, 1, mask=mask)
    alone = latim_jax.contributions(m, prompts, 1)
    for b, (st, w) in enumerate(zip(starts, which, strict=True)):
        real = slice(st, st + N)
        assert rel(c.T[b][real, real], alone.T[w]) < TOL["fp32"]
        assert (np.asarray(c.T[b])[~mask[b]] == 0).all() and (np.asarray(c.T[b])[:, ~mask[b]] == 0).all()
        assert rel(c.bias[b][real], alone.bias[w]) < TOL["fp32"]
    assert latim_jax.conservation_error(m, tokens, 1, mask=mask) < 1e-5


def test_vmap_with_masks_equals_loop(case):
    _, m, _, tokens, mask, _, _ = case

    def one(t, k):
        return latim_jax.attribute(m, t[None], method="alti", mask=k[None]).scores[0]

    loop = np.stack([np.asarray(one(tokens[b], mask[b])) for b in range(3)])
    vm = jax.vmap(one)(jnp.asarray(tokens), jnp.asarray(mask))
    assert rel(vm, loop) < TOL["alti"]


def test_generate_with_left_padding_equals_each_prompt(case):
    _, m, prompts, tokens, mask, _, _ = case
    left = mask[1:2]
    out = np.asarray(generate(m, tokens[1:2], 3, mask=left))
    alone = np.asarray(generate(m, prompts[1:2], 3))
    assert (out[0, L:] == alone[0, N:]).all()
    with pytest.raises(ValueError, match="left padding"):
        generate(m, tokens[:1], 2, mask=mask[:1])


def test_bad_masks_are_refused():
    m = model(1)
    t = np.zeros((2, 5), np.int32)
    hole = np.array([[1, 1, 0, 1, 1], [1, 1, 1, 1, 1]], bool)
    with pytest.raises(ValueError, match=r"row 0 has a hole at position\(s\) \[2\]"):
        latim_jax.attribute(m, t, mask=hole)
    with pytest.raises(ValueError, match="row 1 has no valid position"):
        m(t, mask=np.array([[1, 1, 1, 1, 1], [0, 0, 0, 0, 0]], bool))
    with pytest.raises(ValueError, match="mask must have shape"):
        latim_jax.contributions(m, t, 0, mask=np.ones((2, 4), bool))
    with pytest.raises(ValueError, match="boolean"):
        generate(m, t, 1, mask=np.full((2, 5), 2))


def test_masking_is_the_only_difference_a_pad_token_makes():
    """Changing the ids under padding changes nothing (bitwise on scores of a fixed shape)."""
    mm = model(2)
    _, tokens, mask, _, _ = padded_batch()
    other = np.where(mask, tokens, (tokens + 7) % 32)
    a = np.asarray(latim_jax.attribute(mm, tokens, method="l2", mask=mask).scores)
    b = np.asarray(latim_jax.attribute(mm, other, method="l2", mask=mask).scores)
    np.testing.assert_array_equal(a, b)


def test_negative_rows_count_back_from_the_real_tokens(case):
    """rows=[-1] is each prompt's last real token (not a pad position) whatever side the padding is on;
    prompts that end at different positions, and a traced mask, are refused rather than guessed."""
    _, m, prompts, tokens, mask, starts, which = case
    alone = latim_jax.attribute(m, prompts[:1], method="l2", rows=[-1, -3])
    right = latim_jax.attribute(m, tokens[:1], method="l2", rows=[-1, -3], mask=mask[:1])
    assert right.rows == (N - 1, N - 3)
    assert rel(right.scores[..., :N], alone.scores) < TOL["fp32"] and float(abs(right.scores).sum()) > 0
    left = latim_jax.attribute(m, tokens[1:2], method="l2", rows=[-1], mask=mask[1:2])  # ends at L - 1
    assert left.rows == (L - 1,)
    with pytest.raises(ValueError, match=r"end at different positions \(\[5, 7, 10\]\)"):
        latim_jax.attribute(m, tokens, method="l2", rows=[-1], mask=mask)
    with pytest.raises(ValueError, match=r"in \[-6, 0\): from the end of the real tokens"):
        latim_jax.attribute(m, tokens[:1], method="l2", rows=[-7], mask=mask[:1])
    same = latim_jax.attribute(m, tokens, method="l2", rows=[N - 1], mask=mask)  # from the start: fine
    assert same.rows == (N - 1,)

    def traced(t, k):
        return latim_jax.attribute(m, t, method="l2", rows=[-1], mask=k).scores

    with pytest.raises(ValueError, match="traced mask"):
        jax.jit(traced)(jnp.asarray(tokens[:1]), jnp.asarray(mask[:1]))


def test_traced_inputs_that_fail_the_checks_give_nan_not_numbers():
    """Under jax.jit the value checks cannot raise: a prompt with an id outside the vocabulary (above
    it or negative) or a mask with a hole comes out NaN (logits and scores), the other prompts equal
    the eager call."""
    m = model(2)
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 32, (4, 7))
    mask = np.ones((4, 7), bool)
    eager = latim_jax.attribute(m, tokens, method="l2", mask=mask)
    bad_tokens, bad_mask = tokens.copy(), mask.copy()
    bad_tokens[1, 3], bad_tokens[2, 0] = 32, -1
    bad_mask[3, 2] = False

    @jax.jit
    def scores(t, k):
        return latim_jax.attribute(m, t, method="l2", mask=k).scores, m(t, mask=k)

    s, logits = scores(jnp.asarray(bad_tokens), jnp.asarray(bad_mask))
    for b in (1, 2, 3):
        assert np.isnan(np.asarray(s[b])).any() and np.isnan(np.asarray(logits[b])).all(), b
    assert rel(s[0], eager.scores[0]) < TOL["fp32"] and np.isfinite(np.asarray(logits[0])).all()
    with pytest.raises(ValueError, match="token ids must lie in"):
        latim_jax.attribute(m, bad_tokens, method="l2")  # eager: an error, as before
