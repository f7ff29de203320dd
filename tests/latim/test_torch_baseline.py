"""The PyTorch baseline of the benchmarks (benchmarks/torch_baseline.py) computes the library's scores.

Every method, both modes, Mamba-1 with projection biases and Mamba-2 with two groups, at lengths 9
and 21 (> the Mamba-2 chunk of 8 and > one score block), fair and plain: baseline (fp32, transformers
weights through hooks) vs ``latim_jax.attribute`` on the converted checkpoint. A benchmark ratio means
something only if both sides compute the same thing.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import rel_err

import latim_jax

torch = pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import torch_baseline as tb  # noqa: E402

pytestmark = pytest.mark.torch

# max |baseline - library| / max |library|, both fp32. alti: c_ij is a difference of two l1 norms of
# size ||hout_i||_1, then divided by the row total, so its rounding error scales with the row's
# condition kappa_i = ||hout_i||_1 / sum_j c_ij (up to ~1e4 on random models): the bound per entry is
# alti_abs + alti_kappa * kappa_i.
TOL = {"l2": 1e-5, "logit": 1e-5, "hidden_attention": 1e-5, "alti_abs": 1e-5, "alti_kappa": 1e-6}
TOL["fair_vs_plain"] = 1e-6

VARIANTS = {
    "m1bias": dict(version=1, d_state=4, d_conv=4, use_bias=True, tied=False),
    "m2g2": dict(version=2, d_state=4, d_conv=3, head_dim=4, n_groups=2),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def case(request, hf_dir):
    path, ref = hf_dir("tb_" + request.param, **VARIANTS[request.param])
    return request.param, ref, latim_jax.load(path)


def prompts(model, length, batch=2):
    return np.random.default_rng(length).integers(0, model.config.vocab_size, (batch, length))


def library(model, ids, method, mode, aggregation="minmax"):
    """latim_jax scores (B, n_layers, L, L) as numpy."""
    kw = {"aggregation": aggregation} if method == "hidden_attention" else {"mode": mode}
    return np.asarray(latim_jax.attribute(model, ids, method=method, **kw).scores)


def alti_bound(ref, ids, mode):
    """Per-entry error bound (b, n_layers, l, 1) for alti (rows without a positive entry: one-hot)."""
    cap = tb.capture(ref, torch.from_numpy(ids))
    kappa = []
    with torch.inference_mode():
        for i, block in enumerate(ref.backbone.layers):
            raw = tb.layer_scores(
                block.mixer, cap.h[i], cap.xhat[i], cap.o[i], "alti", tb.Options(mode), normalise=False
            )
            size = (cap.h[i] + cap.o[i]).abs().sum(-1)  # ||hout_i||_1
            kappa.append(size / raw.sum(-1))  # inf where the row has no positive entry
    kappa = torch.stack(kappa, 1).numpy()[..., None]
    return np.where(np.isinf(kappa), TOL["alti_abs"], TOL["alti_abs"] + TOL["alti_kappa"] * kappa)


# every method and mode at l = 21 (> the Mamba-2 chunk 8 and > one Mamba-1 score block 16); l = 9 (one
# block) once: each case is one jit compile of the library (~2.5 s)
CASES = [(m, mode, 21) for m in ("l2", "alti", "logit") for mode in ("exact", "paper")]
CASES += [("hidden_attention", "exact", 21), ("l2", "exact", 9)]


@pytest.mark.parametrize("method,mode,length", CASES)
def test_baseline_equals_library(case, method, mode, length):
    name, ref, model = case
    ids = prompts(model, length)
    want = library(model, ids, method, mode, "signed")
    got = tb.attribute(ref, torch.from_numpy(ids), method, mode, aggregation="signed").numpy()
    assert got.shape == want.shape == (2, model.config.n_layers, length, length)
    assert (np.triu(got, 1) == 0).all() and (np.triu(want, 1) == 0).all(), "j > i must be exactly 0"
    if method != "alti":
        assert rel_err(got, want) < TOL[method], (name, method, mode, length)
        return
    err = np.abs(got - want)
    assert (err <= alti_bound(ref, ids, mode)).all(), (name, mode, length, err.max())


@pytest.mark.parametrize("aggregation", ["minmax", "abs"])
def test_hidden_attention_aggregations(case, aggregation):
    name, ref, model = case
    ids = prompts(model, 21)
    want = library(model, ids, "hidden_attention", "exact", aggregation)
    got = tb.attribute(ref, torch.from_numpy(ids), "hidden_attention", aggregation=aggregation).numpy()
    assert (got >= 0).all() and (np.triu(got, 1) == 0).all()
    assert rel_err(got, want) < TOL["hidden_attention"], (name, aggregation)


def test_fair_equals_plain_and_layer_subset(case):
    """The fair variant's clamp and denormal flush change no score; one layer = that layer of all."""
    name, ref, _ = case
    ids = torch.from_numpy(np.arange(42).reshape(2, 21) % 40)
    for method in ("l2", "hidden_attention"):
        fair = tb.attribute(ref, ids, method, fair=True)
        plain = tb.attribute(ref, ids, method, fair=False)
        assert rel_err(fair.numpy(), plain.numpy()) < TOL["fair_vs_plain"], (name, method)
        one = tb.attribute(ref, ids, method, layers=[1])
        assert torch.equal(one[:, 0], fair[:, 1]), (name, method)
