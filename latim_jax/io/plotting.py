"""Pictures of attribution maps: a per-layer heatmap grid (PNG, JPEG, SVG, PDF, ...) and a standalone
HTML view.

The heatmap grid's size is bounded whatever the sequence length: each panel is at most
``MAX_PANEL_IN`` inches and the whole figure at most ``MAX_FIGURE_IN`` (width, height), so its memory
is the O(L^2) scores plus a bounded canvas. Long sequences get fewer pixels per cell (matplotlib
antialiases the downsampling) and every n-th token label only; pick layers with ``layer_names`` /
the CLI's ``--plot-layers`` when there are many.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import os
import re
from pathlib import Path

import numpy as np

from latim_jax.io.atomic import write_bytes_atomic

DPI = 110
MAX_PANEL_IN = 8.0  # one layer's panel, inches (square)
MIN_PANEL_IN = 1.5
MAX_FIGURE_IN = (16.0, 24.0)  # width, height of the whole grid, inches
COLORBAR_IN = 1.2  # the colour bar's strip beside the panels, inches
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
    side = min(natural, MAX_PANEL_IN, (MAX_FIGURE_IN[0] - COLORBAR_IN) / cols, MAX_FIGURE_IN[1] / rows)
    return rows, cols, max(side, MIN_PANEL_IN)


def _ticks(n: int, inches: float) -> tuple[list[int], float]:
    """Tick positions (every ``step``-th of ``n``) and a font size that fits ``inches`` of axis."""
    fit = max(2, int(LABELS_PER_INCH * inches))
    step = max(1, math.ceil(n / fit))
    shown = -(-n // step)
    fontsize = float(min(9.0, max(4.0, 0.8 * 72.0 * inches / max(shown, 1))))
    return list(range(0, n, step)), fontsize


SCALES = ("linear", "log", "quantile")
MASKED_COLOR = "#d9d9d9"  # cells with no score: source after target (j > i), padding
LOG_FLOOR = 1e-3  # the log scale's linear range, a fraction of the largest |value|


def colour_values(scores, scale: str = "linear") -> tuple[np.ndarray, bool, float]:
    """(values in [-1, 1] or [0, 1] to colour, signed, the largest |score|) for ``scores`` with NaN
    where there is no score. ``scale``: "linear" (value / max |value|), "log" (sign x log1p(|v| / f) /
    log1p(1 / f), f = :data:`LOG_FLOOR` of the max: small values become visible) or "quantile" (the
    rank of |v| among the finite cells: every colour used equally often). Signed when any score is
    negative: then colours diverge from white at 0."""
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {SCALES}, found {scale!r}")
    s = np.asarray(scores, dtype=np.float64)
    finite = np.isfinite(s)
    top, signed = _value_range(s)
    if top == 0.0:
        return np.where(finite, 0.0, np.nan), signed, top
    a = np.abs(s) / top
    if scale == "log":
        a = np.log1p(a / LOG_FLOOR) / np.log1p(1.0 / LOG_FLOOR)
    elif scale == "quantile":
        order = np.sort(a[finite])
        a = np.where(finite, np.searchsorted(order, np.where(finite, a, 0.0), side="right") / order.size, 0.0)
    out = np.sign(s) * a if signed else a
    return np.where(finite, out, np.nan), signed, top


def _value_range(values) -> tuple[float, bool]:
    """(the largest |value|, whether any value is negative) over the finite entries (NaN: no score)."""
    v = np.asarray(values)
    finite = v[np.isfinite(v)]
    return (float(np.abs(finite).max()) if finite.size else 0.0), bool((finite < 0).any())


def causal_nan(scores, rows=None) -> np.ndarray:
    """``scores`` (n, R, L) with NaN where no score exists: source j after target row position
    (``rows``: the R rows' positions, default 0 .. R-1)."""
    s = np.array(scores, dtype=np.float32)
    n, R, L = s.shape
    positions = np.arange(R) if rows is None else np.asarray(rows)
    s[:, np.arange(L)[None, :] > positions[:, None]] = np.nan
    return s


def heatmap_figure(
    scores, labels, *, row_labels=None, rows=None, title="", layer_names=None, max_cols=4,
    value_label="score", scale="linear",
):  # fmt: skip
    """A matplotlib Figure: one panel per map of ``scores`` (n_layers, R, L), source labels
    ``labels`` (L) on the x axis and ``row_labels`` (R; default ``labels``, which needs R == L) on
    the y axis; ``rows`` (R) the positions of the rows (a subset is labelled "position:token").

    One colour scale for every panel, with a colour bar saying what it shows (``value_label``):
    diverging (blue < 0, white 0, red > 0) when any score is negative, sequential (white 0 to dark)
    otherwise; cells after the target (j > i) are grey, not a colour of the scale. ``scale``:
    "linear", "log" or "quantile" (:func:`colour_values`; the bar's ticks then name the scores at the
    50th, 90th and 100th percentile). Bounded size (module docstring). The panels' axes are
    ``fig.panels``, the colour bar ``fig.bar``."""
    from matplotlib import colormaps
    from matplotlib.colors import ListedColormap, Normalize
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
    subset = rows is not None and list(rows) != list(range(R))
    positions = list(range(R)) if rows is None else [int(r) for r in rows]
    values, signed, top = colour_values(causal_nan(scores, positions), scale)
    cmap = ListedColormap(colormaps["RdBu_r" if signed else "Blues"](np.linspace(0, 1, 256)))
    cmap = cmap.with_extremes(bad=MASKED_COLOR)
    norm = Normalize(-1.0 if signed else 0.0, 1.0)
    grid_rows, cols, side = panel_size(L, n, max_cols)
    fig = Figure(figsize=(side * cols + COLORBAR_IN, side * grid_rows + (0.5 if title else 0.0)), dpi=DPI,
                 layout="constrained")  # fmt: skip
    axes = fig.subplots(grid_rows, cols, squeeze=False)
    x_ticks, x_font = _ticks(L, side)
    y_ticks, y_font = _ticks(R, side)
    panels, image = [], None
    for k, ax in enumerate(axes.flat):
        if k >= n:
            ax.axis("off")
            continue
        image = ax.imshow(values[k], cmap=cmap, norm=norm, interpolation="nearest", aspect="auto")
        ax.set_title(layer_names[k] if layer_names else f"layer {k}", fontsize=10)
        ax.set_xticks(x_ticks)
        ax.set_xticklabels(_tick_labels(labels, x_ticks, range(L)), rotation=90, fontsize=x_font)
        ax.set_yticks(y_ticks)
        ax.set_yticklabels(_tick_labels(row_labels, y_ticks, positions, always=subset), fontsize=y_font)
        ax.set_xlabel("source token j" + _thinned(x_ticks, L), fontsize=8)
        y_name = "target token i (position:token)" if subset else "target token i"
        ax.set_ylabel(y_name + _thinned(y_ticks, R), fontsize=8)
        panels.append(ax)
    bar = fig.colorbar(image, ax=panels, shrink=0.8)
    # the label runs along the bar (0.8 of the figure's height): wrapped to fit it, so a small figure
    # shows all of it (one line of 8 pt text holds ~13 characters per inch)
    fits = max(16, int(0.8 * fig.get_figheight() * 13))
    bar.set_label(_wrap_phrases(_legend_text(value_label, scale, signed), fits), fontsize=8)
    ticks, names = _bar_ticks(scale, signed, top, values_of=np.abs(scores[np.isfinite(values)]))
    bar.set_ticks(ticks)
    bar.set_ticklabels(names)
    if title:
        fig.suptitle(title)
    fig.panels, fig.bar = panels, bar
    return fig


def _wrap_phrases(text: str, width: int) -> str:
    """``text`` in lines of at most ``width`` characters, broken only between its phrases (after "; " or
    ", " and before "("), so that no phrase ("blue < 0 < red") is split; a longer phrase keeps its own
    line."""
    phrases = re.split(r"(?<=[;,]) | (?=\()", text)
    lines = [phrases[0]]
    for phrase in phrases[1:]:
        if len(lines[-1]) + 1 + len(phrase) <= width:
            lines[-1] += " " + phrase
        else:
            lines.append(phrase)
    return "\n".join(lines)


def _legend_text(value_label: str, scale: str, signed: bool) -> str:
    colours = "blue < 0 < red" if signed else "white 0 to dark"
    how = {"linear": "linear", "log": "log scale", "quantile": "quantile of |value|"}[scale]
    return f"{value_label} ({how}; {colours}; grey: no score, source after target)"


def _bar_ticks(scale: str, signed: bool, top: float, values_of=None) -> tuple[list[float], list[str]]:
    """(tick positions on the colour scale, their labels): the score values they stand for. Linear and
    log: 0 and the largest |score|. Quantile: the |score| at the 0, 50th, 90th and 100th percentile of
    the scored cells (``values_of``), as "value (q50)", mirrored for a signed map."""
    if scale != "quantile":
        return (
            ([-1.0, 0.0, 1.0], [f"{-top:.3g}", "0", f"{top:.3g}"])
            if signed
            else ([0.0, 1.0], ["0", f"{top:.3g}"])
        )
    levels = (0.5, 0.9, 1.0)
    v = np.asarray(values_of, np.float64).ravel()
    at = np.quantile(v, levels) if v.size else np.zeros(len(levels))
    names = [f"{x:.3g} (q{round(100 * p)})" for p, x in zip(levels, at, strict=True)]
    if signed:
        return [-p for p in levels[::-1]] + [0.0] + list(levels), [f"-{n}" for n in names[::-1]] + [
            "0"
        ] + names
    return [0.0, *levels], ["0", *names]


def _tick_labels(labels, ticks: list[int], positions, always: bool = False) -> list[str]:
    """The labels at ``ticks``; prefixed with the position ("40:t7") when only every n-th is shown
    or ``always`` (a row subset)."""
    if len(ticks) == len(labels) and not always:
        return [str(labels[k]) for k in ticks]
    return [f"{positions[k]}:{labels[k]}" for k in ticks]


def _thinned(ticks: list[int], n: int) -> str:
    return "" if len(ticks) == n else f" (every {ticks[1] - ticks[0]}th labelled)"


def save_figure(fig, path) -> None:
    """Write ``fig`` atomically in the format of ``path``'s extension (:func:`figure_format`)."""
    buf = io.BytesIO()
    fig.savefig(buf, format=figure_format(path), dpi=DPI)
    write_bytes_atomic(path, buf.getvalue())


def heatmap_grid(
    scores, labels, path, *, row_labels=None, rows=None, title="", layer_names=None, max_cols=4,
    value_label="score", scale="linear",
):  # fmt: skip
    """Write a grid of (n_layers, R, L) score maps with token labels on both axes to ``path`` (its
    extension picks the format: .png, .jpg, .svg, .pdf, ...). ``row_labels``: the R target rows'
    labels (default ``labels``, for R == L); ``rows``: their positions; ``value_label``, ``scale``:
    what the colour bar says and the colour scale (see :func:`heatmap_figure`)."""
    figure_format(path)  # refuse an unknown extension before drawing
    fig = heatmap_figure(
        scores, labels, row_labels=row_labels, rows=rows, title=title, layer_names=layer_names,
        max_cols=max_cols, value_label=value_label, scale=scale,
    )  # fmt: skip
    save_figure(fig, path)


HTML_CELL_BUDGET = 4_000_000  # map cells one HTML page holds (about 2.7 bytes each): ~11 MB at most
NOTEBOOK_CELL_BUDGET = 250_000  # the notebook view's (Attribution._repr_html_): ~0.7 MB per output
NOTEBOOK_HEIGHT_PX = 640  # the notebook view's iframe height
VALUE_LABELS = {  # what a map's colour shows, per method (the figure's legend)
    "l2": "l2: ||T_i(x_j)||, how much source j moves into target i",
    "l1": "l1: ||T_i(x_j)||_1, how much source j moves into target i",
    "alti": "alti: source j's share of target i",
    "logit": "logit: source j's push on target i's next-token logit",
    "hidden_attention": "hidden attention of target i on source j",
    "grad_input": "gradient x input: source j's effect on target i's next-token logit",
}


def value_label(method: str) -> str:
    """What a map of ``method`` shows (the colour legend's text)."""
    return VALUE_LABELS.get(method, f"{method} score")


VIEWER = Path(__file__).with_name("viewer.html")  # the page; __NAME__ placeholders filled in below


def _pool(scores: np.ndarray, factor: int) -> np.ndarray:
    """(n, R, L) -> (n, ceil(R / f), ceil(L / f)): per f x f block the value of largest |value| (sign
    kept), NaN where the block holds no score."""
    n, R, L = scores.shape
    r, c = -(-R // factor), -(-L // factor)
    padded = np.full((n, r * factor, c * factor), np.nan, np.float32)
    padded[:, :R, :L] = scores
    blocks = padded.reshape(n, r, factor, c, factor).transpose(0, 1, 3, 2, 4).reshape(n, r, c, -1)
    mag = np.where(np.isnan(blocks), -1.0, np.abs(blocks))
    pick = np.take_along_axis(blocks, mag.argmax(-1)[..., None], -1)[..., 0]
    return np.where((mag >= 0).any(-1), pick, np.nan)


def html_view(
    scores, labels, path, *, title="latim-jax attribution", layer_names=None, row_labels=None, rows=None,
    value_label="score", scale="linear",
):  # fmt: skip
    """Write :func:`html_page` of (n_layers, R, L) maps to ``path`` (atomically), with the page's
    default cell budget :data:`HTML_CELL_BUDGET`."""
    page = html_page(
        scores, labels, title=title, layer_names=layer_names, row_labels=row_labels, rows=rows,
        value_label=value_label, scale=scale,
    )  # fmt: skip
    write_page(path, page)


def write_page(path, page: str) -> None:
    """Write an HTML page (str) to ``path`` atomically."""
    write_bytes_atomic(path, page.encode())


def iframe(page: str, height: int = NOTEBOOK_HEIGHT_PX) -> str:
    """``page`` inside an ``<iframe srcdoc>``: a notebook output that keeps the viewer's element ids and
    script to itself (several views in one notebook do not collide)."""
    return (
        f'<iframe srcdoc="{html.escape(page, quote=True)}" style="width: 100%; height: {int(height)}px; '
        'border: 1px solid #ddd" sandbox="allow-scripts"></iframe>'
    )


def html_page(
    scores, labels, *, title="latim-jax attribution", layer_names=None, row_labels=None, rows=None,
    value_label="score", scale="linear", budget: int = HTML_CELL_BUDGET,
):  # fmt: skip
    """A standalone HTML page (str) of (n_layers, R, L) maps: a canvas per map drawn from the data
    (stored once, as float16 relative to the largest |value|), a layer switch, a colour-scale switch
    (linear / log / quantile; ``scale`` the initial one), a colour legend saying what the colour
    means, and hover text naming the target's and source's positions and tokens and the value.

    Bounded size: past ``budget`` cells (default :data:`HTML_CELL_BUDGET`) the maps are pooled (each cell
    then a square block of positions, showing its largest |value|; the page says so). ``rows``: the R rows'
    positions (default 0 .. R-1); cells after the target are grey. ``#layer=K&scale=log&hover=I,J`` in
    the address opens that view."""
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {SCALES}, found {scale!r}")
    scores = np.asarray(scores, dtype=np.float32)
    n, R, L = scores.shape
    positions = list(range(R)) if rows is None else [int(r) for r in rows]
    row_labels = list(labels) if row_labels is None else list(row_labels)
    values = causal_nan(scores, positions)
    top, signed = _value_range(values)
    factor = max(1, math.ceil(math.sqrt(n * R * L / budget)))
    if factor > 1:
        values = _pool(values, factor)
    rel = (values / top if top > 0 else np.where(np.isfinite(values), 0.0, np.nan)).astype(np.float16)
    sources = (list(labels), list(range(L)))
    data = {
        "maps": [base64.b64encode(m.astype("<f2").tobytes()).decode() for m in rel],
        "shape": list(rel.shape[1:]),
        "rows": [_span_label(row_labels, positions, k, factor) for k in range(rel.shape[1])],
        "cols": [_span_label(*sources, k, factor) for k in range(rel.shape[2])],
        "names": list(layer_names or [f"layer {k}" for k in range(n)]),
        "signed": signed,
        "top": top,
        "pool": factor,
        "value_label": value_label,
    }
    pooled = (
        f"each cell is a block of {factor} x {factor} positions showing its largest |value| (ask for "
        "fewer rows or layers to see single tokens)"
        if factor > 1
        else "one cell per token pair"
    )
    fill = {
        "__TITLE__": html.escape(title), "__LAST__": str(n - 1), "__POOLED__": pooled,
        "__FLOOR__": repr(LOG_FLOOR), "__DATA__": json.dumps(data).replace("</", "<\\/"),
    }  # fmt: skip
    page = VIEWER.read_text(encoding="utf-8")
    for key, value in fill.items():  # the data last: nothing inside it is replaced
        page = page.replace(key, value)
    return page.replace("<option>" + scale + "</option>", "<option selected>" + scale + "</option>")


def _span_label(names, positions, k: int, factor: int) -> str:
    """The hover/axis label of pooled index k: "position:token", or "first-last" positions of a block."""
    if factor == 1:
        return f"{positions[k]}:{html.escape(str(names[k]))}"
    lo, hi = k * factor, min(len(names), (k + 1) * factor) - 1
    return f"{positions[lo]}-{positions[hi]}"
