"""Alignment (AER) and needle evaluations on tiny random models: report structure, chunking equals one
direct computation, references, and `latim-jax evaluate align|needle` end to end."""

from __future__ import annotations

import json

import numpy as np
import pytest

import latim_jax
from latim_jax.cli import main
from latim_jax.model import MambaLM
from latim_jax.model.config import MambaConfig
from latim_jax.model.init import init_params
from latim_jax.tasks import align, needle
from latim_jax.tasks import evaluate_align as ea
from latim_jax.tasks import evaluate_needle as en
from latim_jax.tasks import methods as mt
from latim_jax.tasks import train as tr

ALIGN = align.align_task(max_src=10, max_tgt=12)
NEEDLE = needle.needle_task(length=24, n_distract=6, n_keys=4, n_values=4, max_needles=2, num_queries=2)


def tiny(task, version=2, seed=0):
    cfg = MambaConfig(
        version=version, d_model=16, n_layers=2, vocab_size=task["vocab_size"], d_state=4, d_conv=4,
        head_dim=8, chunk_size=8, conv_bias=True,
    )  # fmt: skip
    model = MambaLM(cfg, init_params(cfg, seed))
    model.task, model.source = task, "tiny"
    return model


def test_alignment_report_matches_a_direct_computation():
    model = tiny(ALIGN)
    l2 = mt.select(["l2"])[:1]
    report = ea.evaluate_alignment(model, n_sentences=16, batch_size=8, methods=l2)
    batch, links = ea.held_out(ALIGN, 16, 10_000)
    scores = np.concatenate(
        [latim_jax.attribute(model, batch.tokens[s : s + 8], "l2", "exact").scores for s in (0, 8)]
    )
    for layer in range(2):
        pred = align.extract(align.source_scores(scores[:, layer], links), links)
        want = align.aer(pred, links.sure, links.possible)
        assert report["rows"]["LaTIM l2 (exact)"]["layers"][layer] == pytest.approx(want)
    assert report["oracle"] == pytest.approx(align.aer(align.oracle(links), links.sure, links.possible))
    assert 0.0 < report["oracle"] < 0.2 < report["random"] < 1.0
    pred = np.asarray(model(batch.tokens)).argmax(-1)  # one forward, not the report's chunks
    assert report["token_accuracy"] == pytest.approx(float((pred == batch.targets)[batch.loss_mask].mean()))
    json.dumps(report)
    table = ea.format_table(report)
    assert "| LaTIM l2 (exact) |" in table and "0.44-0.52" in table and "gold argmax" in table


def test_alignment_takes_method_names_and_the_callers_sentences():
    """methods by name ("l2": its exact and paper rows; a column name: that row) and data=(batch,
    links): the same report as the sentences drawn inside from the same seed."""
    model = tiny(ALIGN)
    drawn = ea.evaluate_alignment(model, n_sentences=8, batch_size=8, methods=mt.select(["l2"]))
    given = ea.evaluate_alignment(model, batch_size=8, methods="l2", data=ea.held_out(ALIGN, 8, 10_000))
    assert list(given["rows"]) == ["LaTIM l2 (exact)", "LaTIM l2 (paper)"] and given["n_sentences"] == 8
    for name, row in drawn["rows"].items():
        assert given["rows"][name]["layers"] == pytest.approx(row["layers"])
    assert mt.resolve(["LaTIM logit (paper)", "grad_input"]) == (mt.METHODS[5], mt.METHODS[9])
    with pytest.raises(ValueError, match="unknown method 'attention'"):
        mt.resolve(["attention"])
    with pytest.raises(ValueError, match=r"data must be \(Batch, Links\)"):
        ea.evaluate_alignment(model, methods="l2", data=(ea.held_out(ALIGN, 8, 0)[0], None))


def test_method_rows_and_their_layer_aggregates():
    chosen = mt.select(["hidden_attention"])  # one row per aggregation: rollout, and the signed sum
    assert [m[3]["aggregation"] for m in chosen] == ["minmax", "abs", "signed"]
    report = ea.evaluate_alignment(tiny(ALIGN), n_sentences=8, batch_size=8, methods=chosen)
    assert list(report["rows"]) == [m[0] for m in chosen]
    batch8, links8 = ea.held_out(ALIGN, 8, 10_000)  # the abs row's rollout, scored directly
    res = mt.run(
        tiny(ALIGN),
        batch8.tokens,
        chosen[1],
        mask=np.arange(batch8.tokens.shape[1])[None] < batch8.lengths[:, None],
    )
    pred = align.extract(align.source_scores(np.asarray(res.rollout()), links8), links8)
    assert report["rows"][chosen[1][0]]["aggregate"] == pytest.approx(
        align.aer(pred, links8.sure, links8.possible)
    )
    # the rows-only aggregate (long inputs): row-normalised |maps| summed, signed maps summed as they are
    batch, _ = ea.held_out(ALIGN, 2, 0)
    for row in chosen[1:]:
        res = mt.run(tiny(ALIGN), batch.tokens, row, rows=[5, 9])
        s = np.asarray(res.scores)
        normalised = (np.abs(s) / np.abs(s).sum(-1, keepdims=True)).sum(1)
        want = s.sum(1) if row[3]["aggregation"] == "signed" else normalised
        np.testing.assert_allclose(mt.layer_aggregate(res), want, rtol=1e-6)
    assert len(mt.select()) == len(mt.METHODS)
    with pytest.raises(ValueError, match="unknown method"):
        mt.select(["attention"])


def test_needle_report_on_query_rows():
    model = tiny(NEEDLE)
    l2 = mt.select(["l2"])[:1]
    report = en.evaluate_needle(
        model, lengths=(40,), settings={"multi": (2, 2)}, n_sequences=4, batch_size=4, methods=l2
    )
    (e,) = report["results"]
    assert (e["length"], e["setting"]) == (40, "multi")
    t = en.setting_task(NEEDLE, 40, 2, 2)
    b = needle.make_batch(t, 4, np.random.default_rng([10_000, 40, 2]))
    rows = needle.query_rows(t)
    pred = np.asarray(model(b.tokens)).argmax(-1)[:, rows]  # the answers at the query rows, directly
    assert e["accuracy"] == pytest.approx(float((pred == b.targets[:, rows]).mean()))
    direct = np.asarray(latim_jax.attribute(model, b.tokens, "l2", rows=rows, target=b.targets).scores)
    for gold in en.GOLDS:
        row = e["rows"]["LaTIM l2 (exact)"][gold]
        assert len(row["layers"]) == 2 and row["layers"][0]["n_rows"] == 4 * 2
        want = en._score(direct[:, 0], en._gold(b, rows, gold), rows)
        assert row["layers"][0]["auc"] == pytest.approx(want["auc"])
    # the value gold is the key gold + 1: R@1 of a map that is one-hot on key + 1
    onehot = np.arange(40)[None, None] == (b.gold[:, rows] + 1)[..., None]
    assert en._score(onehot.astype(float), en._gold(b, rows, "value"), rows)["recall@1"] == 1.0
    assert en._score(onehot.astype(float), en._gold(b, rows, "key"), rows)["recall@1"] == 0.0
    table = en.format_table(report)
    assert "Setting multi (2 needle(s)" in table and "| random |" in table


@pytest.mark.parametrize("task", [ALIGN, NEEDLE], ids=["align", "needle"])
def test_cli_evaluate_align_and_needle(task, tmp_path, capsys):
    model = tiny(task)  # saved untrained, as train.save_trained writes a trained one
    tc = tr.TrainConfig(model=model.config, task=task, steps=1)
    done = tr.TrainResult(model=model, losses=[1.0], evals=[{"loss": 1.0, "token_accuracy": 0.0,
                          "sequence_accuracy": 0.0}], wall_time_s=0.0)  # fmt: skip
    ckpt = tr.save_trained(tmp_path / task["name"], done, tc)
    md, js = tmp_path / "t.md", tmp_path / "t.json"
    argv = [
        "evaluate",
        task["name"],
        "--model",
        str(ckpt),
        "--n",
        "4",
        "--markdown",
        str(md),
        "--out",
        str(js),
    ]
    argv += ["--methods", "l2", "--lengths", "40"]
    assert main(argv) == 0
    report = json.loads(js.read_text())
    assert report["task"]["name"] == task["name"] and f"Task {task['name']}" in md.read_text()
    assert main(["evaluate", "copy", "--model", str(ckpt), "--n", "4"]) == 2
    assert f"trained on the '{task['name']}' task, not 'copy'" in capsys.readouterr().err
    assert main(argv[:4] + ["--n", "4", "--methods", "attention"]) == 2  # argparse refuses it
