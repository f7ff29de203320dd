"""The heatmap figure: bounded size whatever the length, thinned labels, row labels, file formats."""

from __future__ import annotations

import struct

import numpy as np
import pytest

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
    for ax in fig.axes:  # labels thinned to a readable number, each prefixed with its position
        ticks = [t.get_text() for t in ax.get_xticklabels()]
        assert 2 <= len(ticks) <= plotting.LABELS_PER_INCH * plotting.MAX_PANEL_IN
        assert ticks[1].split(":")[1] == labels[int(ticks[1].split(":")[0])]
    if n_layers == 2:
        plotting.save_figure(fig, tmp_path / "m.png")
        w, h = png_size(tmp_path / "m.png")
        assert w <= MAX_PIXELS[0] and h <= MAX_PIXELS[1]  # was 18810 x 9405 for L = 300


def test_short_sequences_keep_every_label():
    fig = plotting.heatmap_figure(np.ones((1, 4, 4)), ["a", "b", "c", "d"])
    (ax,) = fig.axes
    assert [t.get_text() for t in ax.get_xticklabels()] == ["a", "b", "c", "d"]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["a", "b", "c", "d"]


def test_row_subset_gets_its_own_labels_and_positions():
    labels = [f"w{i}" for i in range(200)]
    fig = plotting.heatmap_figure(np.ones((1, 2, 200)), labels, row_labels=["w5", "w150"], rows=[5, 150])
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == ["w5", "w150"]
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
