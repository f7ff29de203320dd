"""LaTIM decomposition and scores against an independent PyTorch implementation and as properties."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import rel_err

import latim_jax

torch = pytest.importorskip("torch")
import torch_latim  # noqa: E402

pytestmark = pytest.mark.torch

# against the float64 torch reference, relative to the tensor's max magnitude
TOL = {"T": 2e-5, "score": 2e-5, "conservation": 1e-5}

VARIANTS = {
    "m1": dict(version=1, d_state=4, d_conv=4, use_bias=True, tied=False),
    "m2g2": dict(version=2, d_state=4, d_conv=3, head_dim=4, n_groups=2),
    # the ReLU route of the paper (s_t = [c_t > 0]): transformers applies hidden_act after the conv
    "m1relu": dict(version=1, d_state=4, d_conv=4, act="relu"),
    "m2relu": dict(version=2, d_state=4, d_conv=3, head_dim=4, n_groups=1, act="relu"),
}
L = 7


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def case(request, hf_dir):
    name = request.param
    path, ref = hf_dir("dec_" + name, **VARIANTS[name])
    model = latim_jax.load(path)
    tokens = np.random.default_rng(0).integers(0, model.config.vocab_size, (1, L))
    seen, h_final, logits = torch_latim.capture(ref, torch.from_numpy(tokens))
    return name, ref, model, tokens, seen, h_final, logits


def test_contributions_match_torch_reference(case):
    name, ref, model, tokens, seen, _, _ = case
    for layer, rec in enumerate(seen):
        for mode in ("exact", "paper"):
            T, bias, out = torch_latim.decompose_layer(
                ref.backbone.layers[layer].mixer, rec["xhat"][0], mode=mode
            )
            got = latim_jax.contributions(model, tokens, layer, mode=mode)
            assert rel_err(got.T[0], T.numpy()) < TOL["T"], (name, layer, mode)
            assert rel_err(got.bias[0], bias.numpy()) < TOL["T"], (name, layer, mode)
            assert rel_err(got.output[0], out.numpy()) < TOL["T"], (name, layer, mode)
            # transformers' own mixer output, read through the hook
            assert rel_err(got.output[0], rec["o"][0].numpy()) < TOL["conservation"]


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


@pytest.mark.parametrize("method", ["l2", "alti", "logit", "hidden_attention"])
def test_scores_match_torch_reference(case, method):
    name, ref, model, tokens, seen, h_final, logits = case
    result = latim_jax.attribute(model, tokens, method=method)
    assert result.scores.shape == (1, model.config.n_layers, L, L)
    target = logits[0].argmax(-1)
    r = torch.rsqrt(h_final[0].double().pow(2).mean(-1, keepdim=True) + ref.config.layer_norm_epsilon)
    head = ref.lm_head.weight.detach().double()
    direction = ref.backbone.norm_f.weight.detach().double() * head[target] * r
    for layer, rec in enumerate(seen):
        mixer = ref.backbone.layers[layer].mixer
        if method == "hidden_attention":
            want = torch_latim.hidden_attention(mixer, rec["xhat"][0])
        else:
            T, _, o = torch_latim.decompose_layer(mixer, rec["xhat"][0])
            want = torch_latim.scores(T, rec["h"][0].double(), o, method, direction)
        assert rel_err(result.scores[0, layer], want.numpy()) < TOL["score"], (name, method, layer)
