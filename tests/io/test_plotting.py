"""The heatmap figure and the HTML view: colour scales and legends, bounded size whatever the length,
thinned labels, row labels, file formats, and the page in a real browser (headless Chromium)."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from conftest import chromium, dump_dom

from latim_jax.io import plotting

# bounds the figure must respect (plotting.MAX_FIGURE_IN at plotting.DPI, plus the title strip)
MAX_PIXELS = (int(16 * plotting.DPI) + 2, int(24.4 * plotting.DPI) + 2)


def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


@pytest.mark.parametrize("n_layers, length", [(2, 300), (24, 300), (1, 1000)])
def test_figure_size_is_bounded(tmp_path, n_layers, length):
    scores = np.random.default_rng(0).random((n_layers, length, length), dtype=np.float32)
    labels = [f"t{i % 31}" for i in range(length)]
    fig = plotting.heatmap_figure(scores, labels, title="long")
    width, height = fig.get_size_inches()
    assert width <= 16 + 1e-6 and height <= 24.4 + 1e-6
    for ax in fig.panels:  # labels thinned to a readable number, each prefixed with its position
        ticks = [t.get_text() for t in ax.get_xticklabels()]
        assert 2 <= len(ticks) <= plotting.LABELS_PER_INCH * plotting.MAX_PANEL_IN
        assert ticks[1].split(":")[1] == labels[int(ticks[1].split(":")[0])]
    if n_layers == 2:
        plotting.save_figure(fig, tmp_path / "m.png")
        w, h = png_size(tmp_path / "m.png")
        assert w <= MAX_PIXELS[0] and h <= MAX_PIXELS[1]  # was 18810 x 9405 for L = 300


def test_short_sequences_keep_every_label():
    fig = plotting.heatmap_figure(np.ones((1, 4, 4)), ["a", "b", "c", "d"])
    (ax,) = fig.panels
    assert [t.get_text() for t in ax.get_xticklabels()] == ["a", "b", "c", "d"]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["a", "b", "c", "d"]


def test_row_subset_gets_its_own_labels_and_positions():
    labels = [f"w{i}" for i in range(200)]
    fig = plotting.heatmap_figure(np.ones((1, 2, 200)), labels, row_labels=["w5", "w150"], rows=[5, 150])
    assert [t.get_text() for t in fig.panels[0].get_yticklabels()] == ["5:w5", "150:w150"]  # positions named
    assert "position" in fig.panels[0].get_ylabel()
    with pytest.raises(ValueError, match="row labels"):
        plotting.heatmap_figure(np.ones((1, 2, 200)), labels)


@pytest.mark.parametrize(
    "name, magic",
    [("m.jpg", b"\xff\xd8\xff"), ("m.pdf", b"%PDF"), ("m.svg", b"<?xml"), ("m.PNG", b"\x89PNG")],
)
def test_extension_picks_the_format(tmp_path, name, magic):
    plotting.heatmap_grid(np.ones((1, 3, 3)), ["a", "b", "c"], tmp_path / name)
    assert (tmp_path / name).read_bytes().startswith(magic)


@pytest.mark.parametrize("name", ["m.bmp", "m", "m.html"])
def test_unknown_extension_is_refused_before_drawing(tmp_path, name):
    with pytest.raises(ValueError, match="image format"):
        plotting.heatmap_grid(np.ones((1, 3, 3)), ["a", "b", "c"], tmp_path / name)
    assert list(tmp_path.iterdir()) == []


def _image(ax):
    return ax.get_images()[0]


def test_signed_maps_diverge_from_white_and_share_one_scale():
    """A signed map (logit) gets a diverging scale with 0 at white and equal reach both ways; the
    panels share it (the larger layer sets it); cells after the target are masked, not coloured; the
    colour bar says what the colour means."""
    s = np.zeros((2, 3, 3), np.float32)
    s[0, 1, 0], s[0, 2, 1] = -1.5, 1.0  # layer 0: -1.5 .. 1
    s[1, 2, 0] = 3.0  # layer 1 sets the scale
    s[:, 0, 2] = 7.0  # above the diagonal: no score, whatever is stored there
    fig = plotting.heatmap_figure(s, ["a", "b", "c"], value_label="logit score")
    images = [_image(ax) for ax in fig.panels]
    for im in images:
        assert (im.norm.vmin, im.norm.vmax) == (-1.0, 1.0)
        data = np.ma.getdata(im.get_array())
        assert np.isnan(data[0, 2]) and np.isnan(data[1, 2])  # the masked triangle
    # one scale: layer 0's -1.5 is half of layer 1's 3.0
    assert np.ma.getdata(images[0].get_array())[1, 0] == pytest.approx(-0.5)
    assert np.ma.getdata(images[1].get_array())[2, 0] == pytest.approx(1.0)
    white, bad = images[0].cmap(0.5), images[0].cmap(np.ma.masked_invalid([np.nan]))[0]
    assert min(white[:3]) > 0.9 and bad[:3] == pytest.approx(
        tuple(int(plotting.MASKED_COLOR[k : k + 2], 16) / 255 for k in (1, 3, 5)), abs=0.01
    )
    bar = [ax for ax in fig.axes if ax not in fig.panels]
    assert len(bar) == 1 and "logit score" in bar[0].get_ylabel() and "blue < 0 < red" in bar[0].get_ylabel()


def test_non_negative_maps_are_sequential_from_white_and_scales_are_offered():
    s = np.tril(np.random.default_rng(0).random((1, 6, 6), dtype=np.float32))
    s[0, 5, 0] = 100.0  # one large value: linear hides the rest, log and quantile show them
    values, signed, top = plotting.colour_values(plotting.causal_nan(s), "linear")
    assert not signed and top == 100.0 and np.nanmin(values) >= 0
    fig = plotting.heatmap_figure(s, list("abcdef"), value_label="l2 score")
    im = _image(fig.panels[0])
    assert (im.norm.vmin, im.norm.vmax) == (0.0, 1.0) and min(im.cmap(0.0)[:3]) > 0.95  # 0 is white
    small = s[0, 1, 0] / 100.0
    log, _, _ = plotting.colour_values(plotting.causal_nan(s), "log")
    assert log[0, 1, 0] > 10 * small  # log lifts small values
    q, _, _ = plotting.colour_values(plotting.causal_nan(s), "quantile")
    finite = q[np.isfinite(q)]
    assert finite.max() == 1.0 and len(np.unique(finite)) == finite.size  # ranks: evenly spread
    with pytest.raises(ValueError, match="scale must be one of"):
        plotting.colour_values(s, "sqrt")


def test_html_is_bounded_and_pooled_past_its_budget(tmp_path):
    rng = np.random.default_rng(0)
    L = 800
    labels = [f"t{i % 31}" for i in range(L)]
    plotting.html_view(rng.random((2, L, L), dtype=np.float32), labels, tmp_path / "a.html")
    size = (tmp_path / "a.html").stat().st_size
    assert size < 4e6, size  # 16.8 MB as a table of floats
    assert "one cell per token pair" in (tmp_path / "a.html").read_text()
    L = 3000
    big = rng.random((2, L, L), dtype=np.float32)
    plotting.html_view(big, [str(i) for i in range(L)], tmp_path / "b.html")
    text = (tmp_path / "b.html").read_text()
    assert (tmp_path / "b.html").stat().st_size < 12e6 and "block of 3 x 3 positions" in text
    pooled = plotting._pool(plotting.causal_nan(big[:1, :6, :6]), 3)
    block = plotting.causal_nan(big[:1, :6, :6])[0, 3:6, 0:3]
    assert pooled[0, 1, 0] == block.flat[np.nanargmax(np.abs(block))] and np.isnan(pooled[0, 0, 1])


def test_html_view_in_a_real_browser(tmp_path):
    """Headless Chromium opens the page: no script error, the legend says what the colour means, the
    layer switch and the scale switch apply, and hover text names positions and tokens."""
    import re

    browser = chromium()
    s = np.tril(np.random.default_rng(0).normal(size=(2, 5, 5))).astype(np.float32)
    labels = ["the", " cat", " sat", " on", " cat"]  # a repeated token: only the position tells them apart
    path = tmp_path / "v.html"
    plotting.html_view(s, labels, path, layer_names=["layer 3", "layer 7"], value_label="logit score")
    dom, log = dump_dom(browser, path.as_uri() + "#layer=0&scale=log&hover=4,1")
    assert 'id="errors" style="color:#b00"></div>' in dom, re.findall(r'id="errors"[^<]*<', dom)
    assert "Uncaught" not in log
    assert '<b id="name">layer 3</b>' in dom  # the switch to the first layer applied
    assert "target 4: cat &lt;- source 1: cat:" in dom  # hover: positions and tokens
    assert "logit score (log scale; red &gt; 0, white 0, blue &lt; 0" in dom  # the legend
    dom, _ = dump_dom(browser, path.as_uri())
    assert '<b id="name">layer 7</b>' in dom and "(linear scale;" in dom  # the default: the last layer


def test_the_colour_bar_label_fits_a_small_figure():
    """The README's own small plot (a few tokens, one layer): the colour bar's label, wrapped to the bar's
    height, lies inside the figure (its long one-line form ran past the top and bottom edges)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    s = np.tril(np.random.default_rng(1).random((1, 4, 4), dtype=np.float32))
    fig = plotting.heatmap_figure(s, list("abcd"), value_label="alti score")
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    label = fig.bar.ax.yaxis.label
    box, frame = label.get_window_extent(canvas.get_renderer()), fig.bbox
    assert box.y0 >= frame.y0 - 1 and box.y1 <= frame.y1 + 1 and box.x1 <= frame.x1 + 1, (box, frame)
    assert "grey: no score" in label.get_text().replace("\n", " ")


@pytest.mark.parametrize("signed", [False, True])
def test_the_quantile_colour_bar_names_score_values(signed):
    """Under the quantile scale the bar's ticks name the |score| at the 50th, 90th and 100th percentile of
    the scored cells (mirrored for a signed map), not bare percentages."""
    rng = np.random.default_rng(2)
    s = np.tril(rng.random((2, 7, 7), dtype=np.float32)) * (rng.choice([-1, 1], (2, 7, 7)) if signed else 1)
    fig = plotting.heatmap_figure(s, list("abcdefg"), scale="quantile")
    scored = np.abs(s[:, np.tril_indices(7)[0], np.tril_indices(7)[1]]).astype(np.float64)
    want = [
        f"{x:.3g} (q{q})" for q, x in zip((50, 90, 100), np.quantile(scored, (0.5, 0.9, 1.0)), strict=True)
    ]
    names = [t.get_text() for t in fig.bar.ax.get_yticklabels()]
    expect = ([f"-{n}" for n in want[::-1]] + ["0"] + want) if signed else ["0", *want]
    assert names == expect, names
