"""benchmarks/pod_estimate.py: the arithmetic's invariants (pure arithmetic, no jax)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import pod_estimate as pe  # noqa: E402

M7, NH = pe.MAMBA2_7B, pe.NEMOTRON_H_8B
L = 128 * 1024


@pytest.fixture(scope="module")
def cal():
    return pe.calibrate()


def test_shapes_match_their_published_counts():
    """Codestral Mamba's published size is 7,285,403,648 parameters (untied head); the hybrid's pattern
    is 24 Mamba-2, 4 attention and 24 MLP layers."""
    assert pe.params(M7)["total"] == 7_285_403_648
    assert (NH.count("M"), NH.count("*"), NH.count("-"), len(NH.pattern)) == (24, 4, 24, 52)
    assert 7.9e9 < pe.params(NH)["total"] < 8.3e9


@pytest.mark.parametrize("shape,kind", [(M7, "M"), (NH, "M"), (NH, "*"), (NH, "-")])
def test_per_token_memory_falls_as_one_over_seq(cal, shape, kind):
    """Doubling seq halves the per-token part of a layer's working set; attention's whole-length part
    (row tile over every key, gathered K/V) does not move."""
    a, b = (pe.layer_memory(shape, kind, L, q, 1, cal) for q in (16, 32))
    assert b["per_token"] == pytest.approx(a["per_token"] / 2)
    if kind == "*":
        assert b["whole"] == a["whole"]
    for m in (a, b):
        assert m["total"] == pytest.approx(m["per_token"] + sum(m["whole"].values()))


def test_summaries_cross_in_log_depth(cal):
    """The prefix over (Delta sums, final state) moves ceil(log2 seq) + 1 summaries (the rounds and the
    shift), each one shard's state split over model; a device holds a fixed few whatever seq."""
    one = M7.heads * (1 + M7.head_dim * M7.state) * 4
    assert pe.summary_bytes(M7, 1) == one and pe.summary_bytes(M7, 4) == one // 4
    assert [pe.prefix_rounds(q) for q in (1, 2, 8, 9, 256)] == [0, 1, 3, 4, 8]
    for q in (8, 16, 256):
        comm = pe.layer_comm(M7, "M", L, q, 1)["summaries_prefix_permute"]
        assert comm["bytes"] == (pe.prefix_rounds(q) + 1) * one
    held = {pe.layer_memory(M7, "M", L, q, 1, cal)["whole"]["summaries_prefix"] for q in (8, 64, 256)}
    assert held == {pe.PREFIX_HELD * one}


def test_kv_gather_is_two_l_g_a_fp32():
    for length in (L, 1024 * 1024):
        kv = pe.layer_comm(NH, "*", length, 32, 1)["kv_all_gather"]["bytes"]
        assert kv == 2 * length * NH.kv_heads * NH.attn_head_dim * 4
        assert pe.attention_whole_length(NH, length, 32)["kv_gathered"] == kv


def test_totals_add_up(cal):
    r = pe.estimate(NH, L, 32, 16, 2, cal)
    mem = r["memory"]
    peak = max(v["total"] for v in mem["layers"].values())
    assert mem["layers"][mem["peak_kind"]]["total"] == peak
    assert mem["total"] == pytest.approx(mem["params"] + mem["logits"] + peak)
    layers = sum(v["layers"] * v["time"]["s"] for v in r["per_layer"].values())
    assert r["forward_s"] == pytest.approx(layers + r["head_s"])
    for v in r["per_layer"].values():
        assert v["comm_bytes"] == sum(c["bytes"] for c in v["comm"].values())
        t = v["time"]
        assert t["s"] == pytest.approx(max(t["compute_s"], t["hbm_s"]) + t["comm_s"])
    assert sum(v["layers"] for v in r["per_layer"].values()) == len(NH.pattern)
    # one device, one shard: nothing crosses over seq, model 1: no all-reduce
    assert pe.layer_comm(M7, "M", L, 1, 1) == {} and pe.layer_comm(NH, "*", L, 1, 1) == {}


def test_model_axis_splits_mamba_and_vocabulary_only():
    p = pe.params(NH)
    whole = (p["per_kind"]["*"] + p["per_kind"]["-"] + NH.d) * 2
    for m in (1, 2, 8):
        split = (p["per_kind"]["M"] + p["embedding_and_head"]) * 2 / m
        assert pe.params_per_device(NH, m) == pytest.approx(split + whole)


def test_reproduces_the_measured_collectives_and_results_file(cal):
    """At the measured 130m-wide shape the bytes equal what bench_sequence_axis.py read from the HLO;
    the committed results are this script's output."""
    chk = pe.check_against_measurement()
    measured = json.loads((ROOT / "benchmarks" / "results" / "sequence_axis.json").read_text())["forward"]
    per_layer = {r["model"]: r["collectives_per_layer"] for r in measured}
    assert chk["mamba2_permute_streams"] == pytest.approx(
        per_layer["mamba2"]["collective-permute"]["streams"], rel=0.01
    )
    assert "all-gather" not in per_layer["mamba2"]  # the state prefix is permutes only
    assert chk["hybrid_all_gather_streams_per_layer"] == pytest.approx(
        per_layer["hybrid"]["all-gather"]["streams"], rel=0.01
    )
    assert 1.0 < cal["mamba2_copies"] < 2.0 and 1.0 < cal["attention_copies"] < 2.0
    committed = json.loads((ROOT / "benchmarks" / "results" / "pod_estimate.json").read_text())
    # to float rounding, not bit for bit: Python 3.12's sum() of floats is compensated (3.11's is not),
    # so the last digits of a total move with the interpreter
    _assert_close(committed, json.loads(json.dumps(pe.run(cal))), "pod_estimate.json")


def _assert_close(a, b, where: str) -> None:
    """Equal structure and strings, numbers to 1e-12 relative."""
    assert type(a) is type(b) or {type(a), type(b)} <= {int, float}, where
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_close(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_close(x, y, f"{where}[{i}]")
    elif isinstance(a, float) or isinstance(b, float):
        assert a == pytest.approx(b, rel=1e-12, abs=0), where
    else:
        assert a == b, where
