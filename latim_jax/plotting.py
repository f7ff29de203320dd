"""Pictures of attribution maps: a per-layer heatmap grid (PNG) and a standalone HTML view."""

from __future__ import annotations

import html
import json

import numpy as np

from latim_jax.results import write_bytes_atomic


def heatmap_grid(scores, labels, path, *, title="", layer_names=None, max_cols=4):
    """Write a PNG grid of (n_layers, R, L) score maps with token labels on both axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scores = np.asarray(scores, dtype=np.float32)
    n = scores.shape[0]
    cols = min(max_cols, n)
    rows = -(-n // cols)
    L = scores.shape[-1]
    size = max(3.0, 0.28 * L + 1.5)
    fig, axes = plt.subplots(rows, cols, figsize=(size * cols, size * rows), squeeze=False)
    fontsize = max(4, min(9, int(220 / max(L, 1))))
    for k, ax in enumerate(axes.flat):
        if k >= n:
            ax.axis("off")
            continue
        ax.imshow(scores[k], cmap="viridis", interpolation="nearest", aspect="auto")
        ax.set_title(layer_names[k] if layer_names else f"layer {k}", fontsize=10)
        ax.set_xticks(range(L))
        ax.set_xticklabels(labels, rotation=90, fontsize=fontsize)
        ax.set_yticks(range(scores.shape[1]))
        ax.set_yticklabels(labels[-scores.shape[1] :] if scores.shape[1] != L else labels, fontsize=fontsize)
        ax.set_xlabel("source token j", fontsize=8)
        ax.set_ylabel("target position i", fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    write_bytes_atomic(path, buf.getvalue())


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
