"""latim_jax.tasks.evaluate on tiny random models: report structure, the batched paper-mode error equals the
direct one, the activation comparison's exactness numbers, and `latim-jax evaluate` end to end."""

from __future__ import annotations

import json

import numpy as np
import pytest

import latim_jax
from latim_jax import tasks
from latim_jax.cli import main
from latim_jax.model import MambaLM
from latim_jax.model.config import MambaConfig
from latim_jax.model.init import init_params
from latim_jax.tasks import evaluate as ev
from latim_jax.tasks import metrics
from latim_jax.tasks import train as tr

MQAR = tasks.mqar_task(vocab_size=24, n_keys=8, min_pairs=2, max_pairs=4, num_queries=2)
COPY = tasks.copy_task(vocab_size=24, sep_id=0, min_len=2, max_len=5)


def tiny(version=2, activation="silu", seed=0, task=COPY):
    cfg = MambaConfig(
        version=version, d_model=16, n_layers=2, vocab_size=24, d_state=4, d_conv=4, head_dim=8,
        chunk_size=8, activation=activation, conv_bias=True,
    )  # fmt: skip
    model = MambaLM(cfg, init_params(cfg, seed))
    model.task = task
    model.source = f"tiny-{activation}"
    return model


@pytest.mark.slow
@pytest.mark.parametrize("task", [COPY, MQAR], ids=["copy", "mqar"])
def test_report_structure_and_random_baseline(task):
    model = tiny(task=task)
    methods = [("LaTIM l2 (exact)", "l2", "exact", {}), ("LaTIM l2 (paper)", "l2", "paper", {})]
    report = ev.evaluate(model, n_sequences=12, batch_size=5, methods=methods)
    assert set(report["rows"]) == {"LaTIM l2 (exact)", "LaTIM l2 (paper)", "random"}
    batch = ev.held_out(report["task"], 12, 10_000)
    real = np.arange(batch.tokens.shape[1])[None, :] < batch.lengths[:, None]
    for name, method, mode, _ in methods:
        row = report["rows"][name]
        assert len(row["layers"]) == 2 and row["best"] == row["layers"][row["best_layer"]]
        # evaluate's batches of 5 equal one batch of 12 scored directly (padding masked, each prompt's
        # rows equal the prompt alone: tests/model/test_padding.py)
        maps = np.asarray(latim_jax.attribute(model, batch.tokens, method, mode, mask=real).scores)
        for layer in range(2):
            want = metrics.summarize(*metrics.gold_rows(maps[:, layer], batch.gold))
            assert abs(row["layers"][layer]["auc"] - want["auc"]) < 1e-6, (name, layer)
            assert abs(row["layers"][layer]["ap"] - want["ap"]) < 1e-6, (name, layer)
    pred = np.asarray(model(batch.tokens)).argmax(-1)  # accuracy on the scored rows only
    assert report["accuracy"] == pytest.approx(float((pred == batch.targets)[batch.loss_mask].mean()))
    assert report["activation"] == "silu"
    json.dumps(report)  # JSON-safe
    table = ev.format_table(report)
    assert f"Task {task['name']}" in table and "approximation error E per layer" in table
    if task["name"] == "mqar":  # the paper reports copy numbers only
        assert all(line.endswith("| - |") for line in table.splitlines() if line.startswith("| LaTIM"))


def test_mqar_value_gold_is_the_key_position_plus_one():
    # a hand-made map that puts all weight on j = key + 1: perfect under gold="value", not under "key"
    batch = ev.held_out(MQAR, 8, 10_000)
    value = tasks.value_sources(batch.gold)
    assert ((value == batch.gold + 1) | (batch.gold < 0)).all() and (value[batch.gold < 0] == -1).all()
    assert (np.take_along_axis(batch.tokens, np.maximum(value, 0), 1) == batch.targets)[batch.gold >= 0].all()
    onehot = np.arange(batch.tokens.shape[1])[None, None, :] == np.maximum(value, 0)[..., None]
    s, lab, val = metrics.gold_rows(onehot.astype(float), value)
    assert metrics.summarize(s, lab, val)["auc"] == 1.0
    s, lab, val = metrics.gold_rows(onehot.astype(float), batch.gold)
    assert metrics.summarize(s, lab, val)["recall@1"] == 0.0
    with pytest.raises(ValueError, match="gold must be"):
        ev.evaluate(tiny(), n_sequences=2, gold="value")  # copy has one gold


def test_batched_approximation_error_is_the_mean_over_real_tokens():
    model = tiny()
    report = ev.evaluate(model, n_sequences=10, batch_size=4, methods=[("p", "alti", "paper", {})])
    batch = ev.held_out(COPY, 10, 10_000)
    real = np.arange(batch.tokens.shape[1])[None, :] < batch.lengths[:, None]
    assert not real.all()  # some sequences are padded
    per_prompt = np.asarray(
        latim_jax.attribute(model, batch.tokens, "alti", "paper", mask=real).extra["approximation_error"]
    )
    pooled = (per_prompt * real.sum(1)[:, None]).sum(0) / real.sum()  # every real token weighs the same
    np.testing.assert_allclose(report["approximation_error"], pooled, rtol=1e-5)
    # and the padded positions would have changed it
    unmasked = np.asarray(
        latim_jax.attribute(model, batch.tokens, "alti", "paper").extra["approximation_error"]
    )
    assert np.abs(unmasked.mean(0) - pooled).max() > 1e-3
    assert min(report["approximation_error"]) > 1e-3  # SiLU: the paper mode is approximate


@pytest.mark.parametrize("version", [1, 2])
def test_compare_models_identity_makes_paper_mode_exact(version):
    models = {"silu": tiny(version, "silu"), "identity": tiny(version, "identity", seed=1)}
    l2 = [("LaTIM l2 (exact)", "l2", "exact", {}), ("LaTIM l2 (paper)", "l2", "paper", {})]
    reports = ev.compare_models(models, n_sequences=6, batch_size=6, conservation_sequences=3, methods=l2)
    assert reports["silu"]["conservation"] < 1e-5 and reports["identity"]["conservation"] < 1e-5
    assert max(reports["identity"]["approximation_error"]) < 1e-5
    assert min(reports["silu"]["approximation_error"]) > 1e-3
    table = ev.format_comparison_table(reports)
    assert table.count("\n| silu | silu | - |") == 1 and "| identity | identity | - |" in table
    with pytest.raises(ValueError, match="at least one model"):
        ev.compare_models({})


@pytest.mark.slow
def test_cli_evaluate_mqar_model(tmp_path, capsys):
    tc = tr.TrainConfig(
        model=tiny().config, task=MQAR, steps=2, batch_size=4, eval_every=2, eval_size=8, warmup_steps=1
    )
    ckpt = tr.save_trained(tmp_path / "mqar", tr.train(tc, log=None), tc)
    md, js = tmp_path / "t.md", tmp_path / "t.json"
    argv = ["evaluate", "mqar", "--model", str(ckpt), "--n", "4", "--markdown", str(md), "--out", str(js)]
    argv += ["--methods", "l2", "hidden_attention"]
    assert main(argv) == 0
    assert "Task mqar (4 held-out sequences" in md.read_text()
    report = json.loads(js.read_text())
    assert report["task"]["name"] == "mqar"
    ha = {f"hidden attention ({a})" for a in ("minmax", "abs", "signed")}
    assert set(report["rows"]) == {"LaTIM l2 (exact)", "LaTIM l2 (paper)", "random"} | ha
    assert main(argv + ["--gold", "value", "--force"]) == 0  # replaces the files
    report = json.loads(js.read_text())
    assert report["gold"] == "value" and "the value position" in md.read_text()
    assert main(["evaluate", "copy", "--model", str(ckpt), "--n", "4"]) == 2
    assert "trained on the 'mqar' task, not 'copy'" in capsys.readouterr().err
