"""Attribution.aggregate over spans (sources summed, rows by a rule), labels, and the notebook view."""

from __future__ import annotations

import dataclasses
import html
import re

import numpy as np
import pytest
from conftest import chromium, dump_dom
from conftest import rel_err as rel
from test_attribution import make, tokens

import latim_jax
from latim_jax.io.spans import Spans, visible

SPANS = [(0, 2), (2, 3), (3, 7), (7, 9)]  # 9 positions in 4 spans


def _by_hand(a, spans, rule):
    """The aggregation written out with loops: (B, n, S, S) from (B, n, L, L)."""
    s = np.asarray(a, np.float64)
    cols = np.stack([s[..., lo:hi].sum(-1) for lo, hi in spans], -1)
    if rule == "last":
        return np.stack([cols[..., hi - 1, :] for lo, hi in spans], -2)
    return np.stack([cols[..., lo:hi, :].mean(-2) for lo, hi in spans], -2)


@pytest.mark.parametrize("rule", ["last", "mean"])
def test_sources_summed_rows_by_the_rule_and_conservation_kept(rule):
    model = make("m2")
    t = tokens(batch=2, length=9)
    alti = latim_jax.attribute(model, t, method="alti")
    agg = alti.aggregate(SPANS, rows=rule)
    assert agg.scores.shape == (2, 2, 4, 4) and agg.mask is None
    assert rel(agg.scores, _by_hand(alti.scores, SPANS, rule)) < 1e-6
    np.testing.assert_allclose(np.asarray(agg.scores).sum(-1), 1.0, rtol=1e-5)  # ALTI rows: still shares
    np.testing.assert_array_equal(agg.extra["spans"][0], SPANS)
    logit = latim_jax.attribute(model, t, method="logit").aggregate(SPANS, rows=rule)
    total = logit.extra["direct"] + logit.scores.sum((1, 3)) + logit.extra["bias"].sum(1)
    assert logit.scores.shape == (2, 2, 4, 4) and rel(total, logit.extra["logit"]) < 1e-5
    assert logit.extra["alti"].shape == (2, 2, 4, 4)
    if rule == "last":  # the span's last token's row: the model's logit there
        full = latim_jax.attribute(model, t, method="logit")
        np.testing.assert_allclose(logit.extra["logit"], np.asarray(full.extra["logit"])[:, [1, 2, 6, 8]])


def test_a_row_subset_keeps_its_rows_and_padding_gives_each_prompt_its_spans():
    model = make("m1")
    t = tokens(batch=2, length=9)
    last = latim_jax.attribute(model, t, method="l2", rows=[-1]).aggregate(SPANS)
    assert last.scores.shape == (2, 2, 1, 4) and last.rows == (8,)
    full = latim_jax.attribute(model, t, method="l2")
    assert rel(last.scores[:, :, 0], np.asarray(full.scores)[:, :, 8, :] @ _membership(SPANS, 9).T) < 1e-6
    mask = np.ones((2, 9), bool)
    mask[1, :3] = False  # prompt 1: left padding, 6 real tokens in 2 spans
    padded = latim_jax.attribute(model, t, method="alti", mask=mask)
    agg = padded.aggregate([Spans(SPANS, ("a", "b", "c", "d")), Spans(((3, 5), (5, 9)), ("e", "f"))])
    np.testing.assert_array_equal(agg.mask, [[1, 1, 1, 1], [1, 1, 0, 0]])
    alone = latim_jax.attribute(model, t[1:, 3:], method="alti").aggregate([(0, 2), (2, 6)])
    np.testing.assert_allclose(agg.scores[1, :, :2, :2], alone.scores[0], rtol=2e-5, atol=2e-6)
    assert (np.asarray(agg.scores)[1, :, 2:] == 0).all() and (np.asarray(agg.scores)[1, :, :, 2:] == 0).all()
    assert agg.labels == (("a", "b", "c", "d"), ("e", "f", "", ""))
    np.testing.assert_array_equal(agg.extra["spans"][1], [[3, 5], [5, 9], [-1, -1], [-1, -1]])


def _membership(spans, length):
    G = np.zeros((len(spans), length))
    for k, (lo, hi) in enumerate(spans):
        G[k, lo:hi] = 1
    return G


def test_bad_spans_and_what_cannot_be_aggregated_are_refused(tmp_path):
    model = make("m1")
    t = tokens(batch=1, length=9)
    a = latim_jax.attribute(model, t, method="alti")
    with pytest.raises(ValueError, match="span 1 starts at 3 but span 0 ends at 2"):
        a.aggregate([(0, 2), (3, 9)])
    with pytest.raises(ValueError, match=r"cover positions \[0, 8\) but its real positions are \[0, 9\)"):
        a.aggregate([(0, 2), (2, 8)])
    with pytest.raises(ValueError, match="each span needs start < end"):
        a.aggregate([(0, 0), (0, 9)])
    with pytest.raises(ValueError, match="rows must be one of"):
        a.aggregate(SPANS, rows="first")
    with pytest.raises(ValueError, match="roll out the token-level result"):
        a.aggregate(SPANS).rollout()
    with pytest.raises(ValueError, match="already aggregated"):
        a.aggregate(SPANS).aggregate([(0, 4)])
    with pytest.raises(ValueError, match="top_k"):
        latim_jax.attribute(model, t, method="alti", top_k=2).aggregate(SPANS)
    # the rollout carried in extra is aggregated along with the maps, and saved with the labels
    r = dataclasses.replace(a, extra={**a.extra, "rollout": a.rollout()}).aggregate(Spans(SPANS, "wxyz"))
    assert rel(r.extra["rollout"], _by_hand(np.asarray(a.rollout())[:, None], SPANS, "last")[:, 0]) < 1e-6
    r.save(tmp_path / "r.npz")
    back = latim_jax.Attribution.load(tmp_path / "r.npz")
    assert back.labels == (("w", "x", "y", "z"),) and np.array_equal(back.extra["spans"], r.extra["spans"])


def test_visible_labels():
    assert [visible(x) for x in (" ", "  ", "\n", " cat", "a\tb", "")] == ["␣", "␣␣", "↵", " cat", "a⇥b", "∅"]


def test_the_notebook_view_is_the_viewer_in_an_iframe_and_bounded(tmp_path):
    model = make("m2")
    t = tokens(batch=2, length=9)
    a = latim_jax.attribute(model, t, method="logit").with_labels([f"w{i}" for i in range(9)])
    out = a._repr_html_()
    assert out.startswith("<iframe srcdoc=") and "<script" not in out  # the page is escaped inside
    page = html.unescape(re.search(r'srcdoc="([^"]*)"', out).group(1))
    assert "one cell per token pair" in page and "prompt 0 of 2" in page and '"8:w8"' in page
    assert "layer 1 (mamba2)" in page
    assert latim_jax.attribute(model, t, method="l2", top_k=2)._repr_html_() is None
    # a long prompt stays a small output: pooled past the notebook's budget
    L, n = 1500, 4
    big = dataclasses.replace(
        a, scores=np.random.default_rng(0).random((1, n, L, L), dtype=np.float32), tokens=None, labels=None,
        layers=tuple(range(n)), layer_kinds=None, extra={},
    )  # fmt: skip
    view = big._repr_html_()
    assert len(view) < 2e6 and "block of 6 x 6 positions" in html.unescape(view)
    (tmp_path / "host.html").write_text(f"<html><body>{out}</body></html>")
    (tmp_path / "page.html").write_text(page)
    browser = chromium()
    dom, log = dump_dom(browser, (tmp_path / "page.html").as_uri())
    assert 'id="errors" style="color:#b00"></div>' in dom and "Uncaught" not in log
    _, log = dump_dom(browser, (tmp_path / "host.html").as_uri())
    assert "Uncaught" not in log
