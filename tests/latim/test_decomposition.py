"""LaTIM decomposition and scores against an independent float64 PyTorch implementation
(tests/latim/torch_latim.py, fed by forward hooks on transformers): two prompts, a length past the
Mamba-2 chunk, both modes, every score, every hidden-attention aggregation and every rollout."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import rel_err

import latim_jax

torch = pytest.importorskip("torch")
import torch_latim  # noqa: E402

pytestmark = pytest.mark.torch

# against the float64 torch reference, relative to the tensor's max magnitude
TOL = {"T": 2e-5, "score": 2e-5, "conservation": 1e-5, "rollout": 5e-5}

VARIANTS = {
    "m1": dict(version=1, d_state=4, d_conv=4, use_bias=True, tied=False),
    "m2g2": dict(version=2, d_state=4, d_conv=3, head_dim=4, n_groups=2),
    # the ReLU route of the paper (s_t = [c_t > 0]): transformers applies hidden_act after the conv
    "m1relu": dict(version=1, d_state=4, d_conv=4, act="relu"),
    "m2relu": dict(version=2, d_state=4, d_conv=3, head_dim=4, n_groups=1, act="relu"),
}
B, L = 2, 11  # L > the Mamba-2 chunk (8): the SSD crosses a chunk boundary


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def case(request, hf_dir):
    name = request.param
    path, ref = hf_dir("dec_" + name, **VARIANTS[name])
    model = latim_jax.load(path)
    tokens = np.random.default_rng(0).integers(0, model.config.vocab_size, (B, L))
    seen, h_final, logits = torch_latim.capture(ref, torch.from_numpy(tokens))
    return name, ref, model, tokens, seen, h_final, logits


def test_contributions_match_torch_reference(case):
    name, ref, model, tokens, seen, _, _ = case
    for layer, rec in enumerate(seen):
        for mode in ("exact", "paper"):
            got = latim_jax.contributions(model, tokens, layer, mode=mode)
            for b in range(B):
                T, bias, out = torch_latim.decompose_layer(
                    ref.backbone.layers[layer].mixer, rec["xhat"][b], mode=mode
                )
                assert rel_err(got.T[b], T.numpy()) < TOL["T"], (name, layer, mode, b)
                assert rel_err(got.bias[b], bias.numpy()) < TOL["T"], (name, layer, mode, b)
                assert rel_err(got.output[b], out.numpy()) < TOL["T"], (name, layer, mode, b)
            # transformers' own mixer output, read through the hook
            assert rel_err(got.output, rec["o"].numpy()) < TOL["conservation"]


def test_exact_mode_conserves_transformers_mixer_output(case):
    name, _, model, tokens, seen, _, _ = case
    for layer, rec in enumerate(seen):
        c = latim_jax.contributions(model, tokens, layer)
        rebuilt = np.asarray(c.T.sum(2) + c.bias)
        assert rel_err(rebuilt, rec["o"].numpy()) < TOL["conservation"], (name, layer)
        T = np.asarray(c.T)
        upper = np.triu(np.ones((L, L), bool), 1)
        assert (T[:, upper] == 0).all()  # exactly zero above the diagonal
        assert latim_jax.conservation_error(model, tokens, layer) < TOL["conservation"]
        assert latim_jax.conservation_error(model, tokens, layer, mode="paper") > 1e-3


def test_folded_norm_keeps_torch_parity(case):
    """Long inputs fold the pre-norm past in_proj (latim_jax.model.layers.normed_linear): forced here at
    L = 11 (a copy of the shared model built with ``fold_from=1``), the contributions still match the
    float64 reference and conserve transformers' mixer output."""
    name, ref, shared, tokens, seen, _, logits = case
    model = latim_jax.MambaLM(shared.config, shared.params(), fold_from=1)
    assert all(block.fold_from == 1 for block in model.layers)
    assert rel_err(model(tokens), logits.numpy()) < TOL["conservation"]
    for layer, rec in enumerate(seen):
        got = latim_jax.contributions(model, tokens, layer)
        for b in range(B):
            T, bias, _ = torch_latim.decompose_layer(ref.backbone.layers[layer].mixer, rec["xhat"][b])
            assert rel_err(got.T[b], T.numpy()) < TOL["T"], (name, layer, b)
            assert rel_err(got.bias[b], bias.numpy()) < TOL["T"], (name, layer, b)
        assert rel_err(got.T.sum(2) + got.bias, rec["o"].numpy()) < TOL["conservation"], (name, layer)


def _reference_maps(case, method, mode, aggregation):
    """Per prompt, per layer: the torch reference's (L, L) map; plus the logit direct terms."""
    _, ref, _, _, seen, h_final, logits = case
    return torch_latim.reference_maps(ref, seen, h_final, logits, method, mode, aggregation)


CASES = [
    ("l2", "exact", None),
    ("l1", "paper", None),
    ("alti", "exact", None),
    ("alti", "paper", None),
    ("logit", "exact", None),
    ("logit", "paper", None),
    ("hidden_attention", "exact", "minmax"),
    ("hidden_attention", "exact", "abs"),
    ("hidden_attention", "exact", "signed"),
]


# the ReLU route changes s_t only: its variants take a score of each kind in each mode (CI time)
RELU_CASES = [c for c in CASES if c[:2] in {("l2", "exact"), ("alti", "paper"), ("logit", "exact")}]
SCORE_CASES = [(v, *c) for v in ("m1", "m2g2") for c in CASES]
SCORE_CASES += [(v, *c) for v in ("m1relu", "m2relu") for c in RELU_CASES]


@pytest.mark.parametrize(
    "case, method, mode, aggregation", SCORE_CASES, indirect=["case"],
    ids=[f"{v}-{m}-{o}-{a}" for v, m, o, a in SCORE_CASES],
)  # fmt: skip
def test_scores_and_rollouts_match_torch_reference(case, method, mode, aggregation):
    name, _, model, tokens, seen, _, _ = case
    options = {"aggregation": aggregation} if aggregation else {}
    result = latim_jax.attribute(model, tokens, method=method, mode=mode, **options)
    assert result.scores.shape == (B, model.config.n_layers, L, L)
    maps, direct = _reference_maps(case, method, mode, aggregation)
    for b in range(B):
        for layer in range(len(seen)):
            got = result.scores[b, layer]
            assert rel_err(got, maps[b][layer].numpy()) < TOL["score"], (name, method, mode, b, layer)
    if method in ("l2", "l1") or aggregation == "signed":
        return
    alti = None
    if method == "logit":
        alti = _reference_maps(case, "alti", mode, None)[0]
    R = np.asarray(result.rollout())
    for b in range(B):
        want = torch_latim.rollout(maps[b], method, direct=direct[b], alti=None if alti is None else alti[b])
        assert rel_err(R[b], want.numpy()) < TOL["rollout"], (name, method, mode, b)


# the tile paths do not depend on the activation: the ReLU variants run the whole-map test above only
@pytest.mark.parametrize("case", ["m1", "m2g2"], indirect=True)
@pytest.mark.parametrize("method, mode, aggregation", CASES, ids=[f"{m}-{o}-{a}" for m, o, a in CASES])
def test_far_tiles_match_torch_reference(case, method, mode, aggregation):
    """At L = 11 the default tiles cover the whole map in one; with 4 x 4 tiles the far tiles (every
    source before every target: rows 8-10 x columns 0-3, ...) take the factorised path, and Mamba-1's
    few-row and direct-form branches run on a row subset: each against the float64 reference."""
    name, _, model, tokens, seen, _, _ = case
    options = {"aggregation": aggregation} if aggregation else {}
    maps, _ = _reference_maps(case, method, mode, aggregation)
    tiles = latim_jax.Blocks(rows=4, cols=4, m1_direct_rows=2, m1_few_rows=2)
    for rows in (None, [10, 9, 3]):
        result = latim_jax.attribute(
            model, tokens, method=method, mode=mode, rows=rows, blocks=tiles, **options
        )
        for b in range(B):
            for layer in range(len(seen)):
                want = maps[b][layer].numpy()[slice(None) if rows is None else rows]
                got = result.scores[b, layer]
                assert rel_err(got, want) < TOL["score"], (name, method, mode, b, layer, rows)
