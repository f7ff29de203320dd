"""Pictures of attribution maps: a per-layer heatmap grid (PNG, JPEG, SVG, PDF, ...) and a standalone
HTML view.

The heatmap grid's size is bounded whatever the sequence length: each panel is at most
``MAX_PANEL_IN`` inches and the whole figure at most ``MAX_FIGURE_IN`` (width, height), so its memory
is the O(L^2) scores plus a bounded canvas. Long sequences get fewer pixels per cell (matplotlib
antialiases the downsampling) and every n-th token label only; pick layers with ``layer_names`` /
the CLI's ``--plot-layers`` when there are many.
"""

from __future__ import annotations

import html
import io
import json
import math
import os

import numpy as np

from latim_jax.io.atomic import write_bytes_atomic

DPI = 110
MAX_PANEL_IN = 8.0  # one layer's panel, inches (square)
MIN_PANEL_IN = 1.5
MAX_FIGURE_IN = (16.0, 24.0)  # width, height of the whole grid, inches
LABELS_PER_INCH = 8  # token labels drawn per inch of axis; more tokens than that are thinned
# the figure formats --plot accepts (matplotlib writes each from the file's extension)
FIGURE_FORMATS = ("png", "jpg", "jpeg", "gif", "tif", "tiff", "webp", "svg", "svgz", "pdf", "eps", "ps")


def figure_format(path) -> str:
    """The image format of ``path`` from its extension (one of ``FIGURE_FORMATS``); ValueError naming
    the supported extensions otherwise."""
    ext = os.path.splitext(os.fspath(path))[1].lower().lstrip(".")
    if ext not in FIGURE_FORMATS:
        found = f"'.{ext}'" if ext else "no extension"
        raise ValueError(
            f"cannot tell the image format of {os.fspath(path)!r} ({found}); use one of the extensions "
            + ", ".join("." + f for f in FIGURE_FORMATS)
        )
    return ext


def panel_size(length: int, n_panels: int, max_cols: int = 4) -> tuple[int, int, float]:
    """(grid rows, grid columns, panel side in inches) for ``n_panels`` maps of ``length`` tokens."""
    cols = max(1, min(max_cols, n_panels))
    rows = -(-n_panels // cols)
    natural = max(3.0, 0.28 * length + 1.5)
    side = min(natural, MAX_PANEL_IN, MAX_FIGURE_IN[0] / cols, MAX_FIGURE_IN[1] / rows)
    return rows, cols, max(side, MIN_PANEL_IN)


def _ticks(n: int, inches: float) -> tuple[list[int], float]:
    """Tick positions (every ``step``-th of ``n``) and a font size that fits ``inches`` of axis."""
    fit = max(2, int(LABELS_PER_INCH * inches))
    step = max(1, math.ceil(n / fit))
    shown = -(-n // step)
    fontsize = float(min(9.0, max(4.0, 0.8 * 72.0 * inches / max(shown, 1))))
    return list(range(0, n, step)), fontsize


def heatmap_figure(scores, labels, *, row_labels=None, rows=None, title="", layer_names=None, max_cols=4):
    """A matplotlib Figure: one panel per map of ``scores`` (n_layers, R, L), source labels
    ``labels`` (L) on the x axis and ``row_labels`` (R; default ``labels``, which needs R == L) on
    the y axis; ``rows`` (R) the positions of the rows (default 0 .. R-1), shown beside thinned
    labels. Bounded size (see the module docstring)."""
    from matplotlib.figure import Figure  # no pyplot: no global figure state, no backend switch

    scores = np.asarray(scores, dtype=np.float32)
    if scores.ndim != 3:
        raise ValueError(f"scores must be (n_layers, rows, length), found shape {scores.shape}")
    n, R, L = scores.shape
    row_labels = list(labels) if row_labels is None else list(row_labels)
    if len(labels) != L or len(row_labels) != R:
        raise ValueError(
            f"{len(labels)} source labels and {len(row_labels)} row labels for maps of shape {(R, L)}"
        )
    positions = list(range(R)) if rows is None else [int(r) for r in rows]
    rows, cols, side = panel_size(L, n, max_cols)
    fig = Figure(figsize=(side * cols, side * rows + (0.4 if title else 0.0)), dpi=DPI)
    axes = fig.subplots(rows, cols, squeeze=False)
    x_ticks, x_font = _ticks(L, side)
    y_ticks, y_font = _ticks(R, side)
    for k, ax in enumerate(axes.flat):
        if k >= n:
            ax.axis("off")
            continue
        ax.imshow(scores[k], cmap="viridis", interpolation="antialiased", aspect="auto")
        ax.set_title(layer_names[k] if layer_names else f"layer {k}", fontsize=10)
        ax.set_xticks(x_ticks)
        ax.set_xticklabels(_tick_labels(labels, x_ticks, range(L)), rotation=90, fontsize=x_font)
        ax.set_yticks(y_ticks)
        ax.set_yticklabels(_tick_labels(row_labels, y_ticks, positions), fontsize=y_font)
        ax.set_xlabel("source token j" + _thinned(x_ticks, L), fontsize=8)
        ax.set_ylabel("target position i" + _thinned(y_ticks, R), fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def _tick_labels(labels, ticks: list[int], positions) -> list[str]:
    """The labels at ``ticks``; when only every n-th is shown, prefixed with the position ("40:t7")."""
    if len(ticks) == len(labels):
        return [str(labels[k]) for k in ticks]
    return [f"{positions[k]}:{labels[k]}" for k in ticks]


def _thinned(ticks: list[int], n: int) -> str:
    return "" if len(ticks) == n else f" (every {ticks[1] - ticks[0]}th labelled)"


def save_figure(fig, path) -> None:
    """Write ``fig`` atomically in the format of ``path``'s extension (:func:`figure_format`)."""
    buf = io.BytesIO()
    fig.savefig(buf, format=figure_format(path), dpi=DPI)
    write_bytes_atomic(path, buf.getvalue())


def heatmap_grid(scores, labels, path, *, row_labels=None, rows=None, title="", layer_names=None, max_cols=4):
    """Write a grid of (n_layers, R, L) score maps with token labels on both axes to ``path`` (its
    extension picks the format: .png, .jpg, .svg, .pdf, ...). ``row_labels``: the R target rows'
    labels (default ``labels``, for R == L); ``rows``: their positions (see :func:`heatmap_figure`)."""
    figure_format(path)  # refuse an unknown extension before drawing
    fig = heatmap_figure(
        scores,
        labels,
        row_labels=row_labels,
        rows=rows,
        title=title,
        layer_names=layer_names,
        max_cols=max_cols,
    )
    save_figure(fig, path)


_HTML = """<!doctype html><html><head><meta charset="utf-8"><title>{title}</title>
<style>body{{font-family:sans-serif;margin:16px}} table{{border-collapse:collapse}}
td{{width:22px;height:22px;padding:0}} th{{font-size:11px;font-weight:normal;padding:2px}}
th.col{{writing-mode:vertical-rl;transform:rotate(180deg)}}</style></head><body>
<h3>{title}</h3><label>layer <input id="layer" type="range" min="0" max="{last}" value="{last}">
<span id="name"></span></label><div id="map"></div>
<script>
const data = {data};
function draw() {{
  const k = +document.getElementById('layer').value;
  document.getElementById('name').textContent = data.names[k];
  const m = data.scores[k], lab = data.labels, rows = data.row_labels;
  let mx = 0; for (const r of m) for (const v of r) mx = Math.max(mx, Math.abs(v));
  let h = '<table><tr><th></th>' + lab.map(t => '<th class="col">' + t + '</th>').join('') + '</tr>';
  m.forEach((r, i) => {{
    h += '<tr><th>' + rows[i] + '</th>' + r.map((v, j) => {{
      const a = mx > 0 ? Math.abs(v) / mx : 0;
      return '<td title="' + rows[i] + ' <- ' + lab[j] + ': ' + v.toPrecision(3) +
             '" style="background:rgba(40,80,200,' + a.toFixed(3) + ')"></td>';
    }}).join('') + '</tr>';
  }});
  document.getElementById('map').innerHTML = h + '</table>';
}}
document.getElementById('layer').oninput = draw; draw();
</script></body></html>
"""


def html_view(scores, labels, path, *, title="latim-jax attribution", layer_names=None, row_labels=None):
    """Write a standalone HTML page: one map per layer, a slider to pick the layer, token labels."""
    scores = np.asarray(scores, dtype=np.float32)
    n = scores.shape[0]
    data = {
        "scores": np.round(scores, 6).tolist(),
        "labels": [html.escape(str(t)) for t in labels],
        "row_labels": [html.escape(str(t)) for t in (row_labels or labels)],
        "names": list(layer_names or [f"layer {k}" for k in range(n)]),
    }
    page = _HTML.format(title=html.escape(title), last=n - 1, data=json.dumps(data))
    write_bytes_atomic(path, page.encode())
