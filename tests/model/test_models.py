"""Flax Mamba-1/Mamba-2 against the PyTorch reference (transformers), from real saved checkpoints."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import rel_err

import latim_jax
from latim_jax.model.generate import generate, prefill

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch

# relative to the tensor's max magnitude
TOL = {"float32": 1e-5, "bfloat16": 3e-2}

VARIANTS = {
    "m1_n4_k4": dict(version=1, d_state=4, d_conv=4),
    "m1_n8_k3_bias": dict(version=1, d_state=8, d_conv=3, use_bias=True, tied=False),
    "m2_g1_p8_k4": dict(version=2, d_state=4, d_conv=4, head_dim=8, n_groups=1),
    "m2_g2_p4_k2": dict(version=2, d_state=8, d_conv=2, head_dim=4, n_groups=2, tied=False),
}
LENGTHS = (1, 13, 21)  # 1, a prime, longer than the Mamba-2 chunk (8)


def reference(model, tokens):
    with torch.no_grad():
        out = model(torch.from_numpy(np.asarray(tokens)), output_hidden_states=True)
    return out.logits.float().numpy(), [h.float().numpy() for h in out.hidden_states]


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_logits_and_hidden_states_match_transformers(hf_dir, name):
    path, ref = hf_dir(name, **VARIANTS[name])
    model = latim_jax.load(path)
    rng = np.random.default_rng(0)
    for length in LENGTHS:
        tokens = rng.integers(0, model.config.vocab_size, (2, length))
        logits, hidden = reference(ref, tokens)
        out = model.forward(tokens)
        assert rel_err(out.logits, logits) < TOL["float32"], (name, length)
        for i in range(model.config.n_layers):
            assert rel_err(out.residuals[i + 1], hidden[i]) < TOL["float32"], (name, length, i)
        final = model.final_hidden(out.residuals[-1])
        assert rel_err(final, hidden[-1]) < TOL["float32"]


@pytest.mark.parametrize("version", [1, 2])
def test_bf16_and_sharded_checkpoints(hf_dir, version):
    kw = dict(version=version, n_groups=2) if version == 2 else dict(version=version)
    path, ref = hf_dir(f"bf16_{version}", dtype="bfloat16", max_shard_size="8KB", **kw)
    assert any(p.name.endswith(".index.json") for p in path.iterdir())
    model = latim_jax.load(path)
    assert str(model.embedding[...].dtype) == "bfloat16"
    tokens = np.random.default_rng(1).integers(0, model.config.vocab_size, (1, 13))
    logits, _ = reference(ref, tokens)
    assert rel_err(model(tokens), logits) < TOL["bfloat16"]
    # the same weights cast to fp32 on load agree with the fp32 transformers model to fp32 tolerance
    model32 = latim_jax.load(path, dtype="float32")
    logits32, _ = reference(ref.float(), tokens)
    assert rel_err(model32(tokens), logits32) < TOL["float32"]


@pytest.mark.parametrize("name", ["m1_n4_k4", "m2_g2_p4_k2"])
def test_recurrent_step_equals_full_forward(hf_dir, name):
    path, _ = hf_dir(name, **VARIANTS[name])
    model = latim_jax.load(path)
    tokens = np.random.default_rng(2).integers(0, model.config.vocab_size, (2, 11))
    full = np.asarray(model(tokens))
    stepped, _ = prefill(model, tokens)
    assert rel_err(stepped, full) < TOL["float32"]
    # generate: greedy continuation == argmax of the full forward on the growing sequence
    out = np.asarray(generate(model, tokens[:, :5], 4))
    for k in range(5, 9):
        assert (out[:, k] == np.asarray(model(out[:, :k]))[:, -1].argmax(-1)).all()
    sampled = generate(model, tokens[:, :5], 4, temperature=1.0, top_k=5, seed=3)
    assert sampled.shape == (2, 9) and (np.asarray(sampled[:, :5]) == tokens[:, :5]).all()


def test_mamba_ssm_format_gives_same_logits(hf_dir, tmp_path):
    import json

    path, ref = hf_dir("m2_g1_p8_k4", **VARIANTS["m2_g1_p8_k4"])
    model = latim_jax.load(path)
    sd = {k.replace("backbone.embeddings.", "backbone.embedding."): v for k, v in ref.state_dict().items()}
    if "lm_head.weight" not in sd:
        sd["lm_head.weight"] = sd["backbone.embedding.weight"]
    torch.save(sd, tmp_path / "pytorch_model.bin")
    cfg = ref.config
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "d_model": cfg.hidden_size,
                "n_layer": cfg.num_hidden_layers,
                "vocab_size": cfg.vocab_size - 5,
                "pad_vocab_size_multiple": 16,
                "rms_norm": True,
                "residual_in_fp32": True,
                "fused_add_norm": True,
                "tie_embeddings": True,
                "ssm_cfg": {
                    "layer": "Mamba2",
                    "d_state": cfg.state_size,
                    "d_conv": cfg.conv_kernel,
                    "headdim": cfg.head_dim,
                    "ngroups": cfg.n_groups,
                    "chunk_size": cfg.chunk_size,
                },
            }
        )
    )
    other = latim_jax.load(tmp_path)
    n = cfg.vocab_size - 5  # the real vocabulary: ids past it are refused, and they make no logit
    assert other.config.n_tokens == n and other.config.vocab_size >= n
    tokens = np.random.default_rng(3).integers(0, 40, (1, 9))
    np.testing.assert_array_equal(np.asarray(other(tokens)), np.asarray(model(tokens))[..., :n])
    with pytest.raises(ValueError, match=f"must lie in \\[0, {n}\\)"):
        other(np.array([[1, n]]))


def test_convert_cli_round_trip_is_bit_exact(hf_dir, tmp_path):
    from latim_jax.cli import main

    path, _ = hf_dir("m1_n4_k4", **VARIANTS["m1_n4_k4"])
    dest = tmp_path / "converted"
    assert main(["convert", str(path), str(dest)]) == 0
    a, b = latim_jax.load(path), latim_jax.load(dest)
    import jax

    flat_a, flat_b = jax.tree.leaves(a.params()), jax.tree.leaves(b.params())
    assert len(flat_a) == len(flat_b)
    for x, y in zip(flat_a, flat_b, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert main(["convert", str(path), str(dest)]) == 2  # refuses to overwrite


def test_check_cli_reports_small_errors(hf_dir, tmp_path, capsys):
    from latim_jax.cli.check import check_model

    path, _ = hf_dir("m2_g1_p8_k4", **VARIANTS["m2_g1_p8_k4"])
    report = check_model(path, length=12)
    assert report["reference"] == "from_pretrained"
    assert report["max_logit_error_relative"] < TOL["float32"]
    assert max(report["hidden_error_relative"]) < TOL["float32"]
    from latim_jax.cli import main

    assert main(["check", "--model", str(path), "--length", "5"]) == 0
    assert "hidden-state relative error" in capsys.readouterr().out


def test_token_validation(hf_dir):
    path, _ = hf_dir("m1_n4_k4", **VARIANTS["m1_n4_k4"])
    model = latim_jax.load(path)
    with pytest.raises(ValueError, match="must lie in"):
        model(np.array([[0, model.config.vocab_size]]))
    with pytest.raises(ValueError, match="at least one position"):
        model(np.zeros((1, 0), np.int32))
    with pytest.raises(ValueError, match="shape"):
        model(np.zeros((3,), np.int32))
