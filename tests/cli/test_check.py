"""``latim-jax check`` on what a user hands it: a shipped latim-jax hybrid (rebuilt as transformers'
NemotronH), converted family checkpoints (rebuilt, or refused in one ``error:`` line with exit code 2),
and transformers' two orders of ``hidden_states`` (embeddings first, or the first layer's output first),
told apart per run rather than by family or transformers version."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from latim_jax.cli import main
from latim_jax.cli.args import EXIT_OK, EXIT_USAGE, UsageError
from latim_jax.cli.check import begins_with_embeddings, hidden_errors, rebuild_target
from latim_jax.convert import CheckpointError, save_checkpoint
from latim_jax.io.loading import load
from latim_jax.model.config import MambaConfig
from latim_jax.model.init import init_params

V1 = MambaConfig(version=1, d_model=8, n_layers=2, vocab_size=12, d_state=2, d_conv=2)
V2 = MambaConfig(version=2, d_model=16, n_layers=2, vocab_size=16, d_state=4, head_dim=8, chunk_size=8)


def one_error_line(capsys) -> str:
    """stderr, checked to be exactly one ``error:`` line (no traceback)."""
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_rebuild_target_names_the_transformers_class_or_the_field_it_cannot_express():
    """Plain Mamba models, FalconMamba's normalised dt/B/C and the shipped hybrid map to the transformers
    class that computes them; anything else is refused naming the file, the field, expected and found."""
    hybrid = load("needle-hybrid").config
    assert hybrid.family == "" and set(hybrid.kinds) == {"mamba2", "attention"}
    assert rebuild_target(V1) == "MambaForCausalLM"
    assert rebuild_target(dataclasses.replace(V1, bcdt_norm=True, family="falcon_mamba")) == (
        "FalconMambaForCausalLM"
    )
    assert rebuild_target(V2) == "Mamba2ForCausalLM"
    assert rebuild_target(hybrid) == "NemotronHForCausalLM"
    assert rebuild_target(dataclasses.replace(hybrid, family="nemotron_h")) == "NemotronHForCausalLM"
    refused = {
        "family": dataclasses.replace(V1, family="zamba2"),
        "bcdt_norm_weight": dataclasses.replace(V1, bcdt_norm=True, bcdt_norm_weight=True),
        "rope_theta": dataclasses.replace(hybrid, rope_theta=10000.0),
        "attn_bias": dataclasses.replace(hybrid, attn_bias=True),
        "ssm_norm": dataclasses.replace(V2, ssm_norm="none"),
        "logits_scaling": dataclasses.replace(V2, logits_scaling=2.0),
    }
    for key, config in refused.items():
        with pytest.raises(CheckpointError) as info:
            rebuild_target(config, file="ck/latim_config.json")
        assert info.value.key == key and str(info.value).startswith("ck/latim_config.json: key"), info.value
        assert info.value.expected is not None and info.value.found is not None
    with pytest.raises(CheckpointError, match=r"layer_kinds\[1\].*found moe"):
        moe = dict(moe_experts=4, moe_top_k=2, moe_width=8)
        rebuild_target(dataclasses.replace(hybrid, layer_kinds=("mamba2", "moe", "mamba2"), **moe))


def test_check_refuses_a_converted_family_checkpoint_in_one_line(tmp_path, monkeypatch, capsys):
    """A latim-jax checkpoint of a family check cannot rebuild (here a jamba one) is one error line naming
    the config file, the field and the way out, exit code 2 (it was a ValueError traceback, exit 1)."""
    save_checkpoint(tmp_path / "ck", dataclasses.replace(V1, family="jamba"), init_params(V1, 0))
    monkeypatch.chdir(tmp_path)
    assert main(["check", "--model", "ck", "--length", "4"]) == EXIT_USAGE
    err = one_error_line(capsys)
    assert "ck/latim_config.json" in err and "'family'" in err and "jamba" in err
    assert "original Hugging Face directory" in err


def test_begins_with_embeddings_is_the_same_tensor_test():
    x = np.random.default_rng(0).normal(size=(1, 5, 8)).astype(np.float32)
    assert begins_with_embeddings(x, x.copy())
    assert not begins_with_embeddings(x + 1e-3, x)
    assert not begins_with_embeddings(x[:, :4], x)


def test_hidden_errors_refuses_counts_it_cannot_align():
    residuals = np.zeros((5, 1, 3, 4), np.float32)  # 4 sublayers
    with pytest.raises(UsageError, match="3 layers for latim-jax's 4 sublayers"):
        hidden_errors([residuals[0]] * 4, residuals, residuals[0], 3)
    with pytest.raises(UsageError, match="returned 5 hidden states for 2 layers"):
        hidden_errors([residuals[0] + 1] * 5, residuals, residuals[0], 2)


@pytest.mark.torch
def test_hidden_state_order_is_detected_in_both_transformers_conventions(tmp_path):
    """One transformers Mamba-2 run, its hidden states listed as transformers 5.24 does (the first layer's
    output first) and as 5.25 does (the embeddings first, with or without the last layer's output before
    the final norm's): every reading agrees with latim-jax to fp32 rounding. Read in the other order (as
    the per-version table did) the 5.25 list misses by far more than the tolerance."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from conftest import build_hf

    ref = build_hf(2, n_layers=3, vocab=16).eval()
    ref.save_pretrained(tmp_path)
    tokens = np.random.default_rng(0).integers(0, 16, (2, 7))
    residuals = np.asarray(load(tmp_path, dtype="float32").forward(tokens).residuals)
    # the streams themselves, by hooks (whatever order this transformers lists hidden_states in): the
    # embeddings entering layer 0, each layer's output, and the final norm's output
    entering, outs = [], []
    first = lambda t: (t[0] if isinstance(t, tuple) else t).numpy().copy()  # noqa: E731
    hooks = [ref.backbone.layers[0].register_forward_pre_hook(lambda m, a: entering.append(first(a)))]
    hooks += [
        layer.register_forward_hook(lambda m, a, o: outs.append(first(o))) for layer in ref.backbone.layers
    ]
    hooks.append(ref.backbone.norm_f.register_forward_hook(lambda m, a, o: outs.append(first(o))))
    with torch.no_grad():
        ref(torch.from_numpy(tokens))
    for hook in hooks:
        hook.remove()
    emb, hs = entering[0], outs  # hs as 5.24 lists them: 3 layer outputs, then the final norm's
    assert len(hs) == 4 and not begins_with_embeddings(hs[0], emb)
    conventions = {
        "5.24: after layer 0": (hs, False, 3),
        "5.25: embeddings first": ([emb, hs[0], hs[1], hs[3]], True, 3),
        "embeddings first, every layer output": ([emb, *hs], True, 4),
    }
    for name, (listed, first, count) in conventions.items():
        errors, detected = hidden_errors(listed, residuals, emb, 3)
        assert detected is first and len(errors) == count, name
        assert max(errors) < 1e-5, (name, errors)
    # read as beginning after layer 0 (the old table's reading of any Mamba-2), 5.25's list compares the
    # embeddings with layer 0's output: the tracker's "6.9 at layer 0"
    misread, detected = hidden_errors([emb, hs[0], hs[1], hs[3]], residuals, emb + 1.0, 3)
    assert detected is False and misread[0] > 1e-2


@pytest.mark.torch
def test_check_passes_the_shipped_hybrid(tmp_path, monkeypatch, capsys):
    """needle-hybrid (Mamba-2, attention, Mamba-2; no transformers checkpoint exists) is rebuilt as
    transformers' NemotronH from its parameters and passes; it was a KeyError('in_proj') traceback."""
    pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)
    assert main(["check", "--model", "needle-hybrid", "--length", "8", "--json", "r.json"]) == EXIT_OK
    out = capsys.readouterr().out
    assert "NemotronHForCausalLM rebuilt" in out and "PASS" in out
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["passed"] and report["hidden_states_begin"] == "embeddings"
    assert len(report["hidden_error_relative"]) == 3 and max(report["hidden_error_relative"]) < 1e-5


@pytest.mark.torch
@pytest.mark.parametrize(
    "family, rebuilt",
    [("falcon_mamba", True), ("nemotron_h", True), ("granitemoehybrid", False), ("zamba2", False),
     ("jamba", False), ("falcon_h1", False), ("bamba", False)],
)  # fmt: skip
def test_check_on_converted_family_checkpoints(tmp_path, monkeypatch, capsys, family, rebuilt):
    """`latim-jax convert` of each family's tiny transformers model, then `check` on the result: the
    families transformers can rebuild from latim-jax parameters pass, the others are one error line
    (exit 2) pointing at the original directory, where check passes (it was a traceback, exit 1)."""
    pytest.importorskip("transformers")
    from families import BUILDERS

    BUILDERS[family]().save_pretrained(tmp_path / "hf")
    monkeypatch.chdir(tmp_path)
    assert main(["convert", "hf", "conv"]) == EXIT_OK
    capsys.readouterr()
    rc = main(["check", "--model", "conv", "--length", "9"])
    if rebuilt:
        assert rc == EXIT_OK and "PASS" in capsys.readouterr().out
    else:
        assert rc == EXIT_USAGE
        err = one_error_line(capsys)
        assert f"found '{family}'" in err and "conv/latim_config.json" in err
        assert main(["check", "--model", "hf", "--length", "9"]) == EXIT_OK


@pytest.mark.torch
@pytest.mark.parametrize(
    "family, begins",
    [("falcon_mamba", "after layer 0"), ("nemotron_h", "embeddings"), ("bamba", "embeddings"),
     ("granitemoehybrid", "embeddings"), ("jamba", "embeddings"), ("falcon_h1", "embeddings"),
     ("zamba2", "embeddings")],
)  # fmt: skip
def test_check_detects_each_family_order_and_fails_when_misread(tmp_path, monkeypatch, family, begins):
    """Each family's Hugging Face directory passes with the order detected in the run (transformers 5.24:
    the Mamba models after layer 0, the hybrids with the embeddings); forced to the other order, it fails."""
    pytest.importorskip("transformers")
    from families import BUILDERS

    from latim_jax.cli import check

    BUILDERS[family]().save_pretrained(tmp_path)
    report = check.check_model(str(tmp_path), length=9)
    assert report["hidden_states_begin"] == begins and check.verdict(report, 1e-4)["passed"], report
    detect = check.begins_with_embeddings
    monkeypatch.setattr(check, "begins_with_embeddings", lambda a, b: not detect(a, b))
    misread = check.check_model(str(tmp_path), length=9)
    assert misread["hidden_states_begin"] != begins and not check.verdict(misread, 1e-4)["passed"]
