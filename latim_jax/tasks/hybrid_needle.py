"""Where does a hybrid retrieve? The needle task on a model with Mamba-2 or Gated DeltaNet sublayers and
attention (the shipped needle-hybrid and needle-hybrid-gdn, or any hybrid loaded with a needle task): its
retrieval accuracy and, per sublayer, how strongly each LaTIM map points at the needle, next to the
same model with its attention sublayers' output removed (the ablation).

Per length and setting (:data:`latim_jax.tasks.evaluate_needle.SETTINGS`), held-out needle sequences are
attributed on the query rows only. For each sublayer: the AUC of the needle's value position among the
sources j <= i of its l2 and logit maps (latim_jax.tasks.metrics), and the logit contribution c_{i,gold}
of the needle's value token through that sublayer to the answer's logit (the logit identity splits the
answer's logit exactly over sublayers and sources, so these numbers add up with the other sources' and
the bias terms to the logit itself), averaged over query rows.
"""

from __future__ import annotations

import numpy as np

from latim_jax.kernels.block_sizes import Blocks
from latim_jax.latim.attribution import attribute
from latim_jax.model.kind import display_name, kind_of
from latim_jax.model.lm import MambaLM
from latim_jax.tasks import registry
from latim_jax.tasks.evaluate_needle import LENGTHS, SETTINGS, _gold, _score, held_out, retrieval_accuracy


def ablate(model, kinds=("attention",)) -> MambaLM:
    """A copy of ``model`` whose sublayers of ``kinds`` output zero (their output-side parameters are
    zeroed): the residual stream passes them unchanged."""
    params = model.params()
    for kind, layer in zip(model.config.kinds, params["layers"], strict=True):
        if kind in kinds:
            for name in kind_of(kind).output_params:
                if name in layer["mixer"]:
                    layer["mixer"][name] = np.zeros_like(np.asarray(layer["mixer"][name]))
    out = MambaLM(model.config, params)
    out.task, out.source = model.task, f"{model.source} without {'/'.join(kinds)} output"
    return out


def _maps(model, batch, rows, method, batch_size):
    parts = []
    for s in range(0, batch.tokens.shape[0], batch_size):
        res = attribute(
            model, batch.tokens[s : s + batch_size], method=method, rows=rows,
            target=batch.targets[s : s + batch_size], blocks=Blocks(rows=len(rows), cols=512),
        )  # fmt: skip
        parts.append(np.asarray(res.scores))
    return np.concatenate(parts)  # (n, layers, r, L)


def where_retrieved(
    model, *, lengths=LENGTHS, settings=None, n_sequences: int = 32, batch_size: int = 8, seed: int = 10_000
) -> dict:
    """The experiment's JSON-safe report (see the module docstring; :func:`format_report`)."""
    task = registry.task_fields(model.task)
    if task["name"] != "needle":
        raise ValueError(f"where_retrieved needs a needle model, found task {task['name']!r}")
    settings = SETTINGS if settings is None else settings
    variants = {"full": model, "attention removed": ablate(model)}
    results = []
    for length in lengths:
        for sname, (needles, queries) in settings.items():
            _, batch, rows = held_out(task, length, needles, queries, n_sequences, seed)
            gold = _gold(batch, rows, "value")
            entry = {"length": length, "setting": sname, "needles": needles, "queries": queries, "models": {}}
            for vname, m in variants.items():
                out = {"accuracy": retrieval_accuracy(m, batch, rows), "layers": []}
                maps = {method: _maps(m, batch, rows, method, batch_size) for method in ("l2", "logit")}
                at_gold = np.take_along_axis(maps["logit"], gold[:, None, :, None], axis=-1)[..., 0]
                for k in range(model.config.n_layers):
                    out["layers"].append({
                        "kind": model.config.kinds[k],
                        "l2_auc": _score(maps["l2"][:, k], gold, rows)["auc"],
                        "logit_auc": _score(maps["logit"][:, k], gold, rows)["auc"],
                        "gold_logit": float(at_gold[:, k].mean()),
                    })  # fmt: skip
                entry["models"][vname] = out
            results.append(entry)
    return {
        "task": task,
        "model": getattr(model, "source", ""),
        "kinds": list(model.config.kinds),
        "n_sequences": n_sequences,
        "seed": seed,
        "results": results,
        "definitions": __doc__.strip(),
    }


def format_report(report: dict) -> str:
    """Markdown: per setting and length, accuracy with and without the attention output, and per
    sublayer the l2 / logit AUC of the needle's value and its logit contribution."""
    kinds = report["kinds"]
    lines = [
        f"Task needle ({report['n_sequences']} held-out sequences per cell, seed {report['seed']}), hybrid "
        f"model {report['model']!r} ({', '.join(display_name(k) for k in kinds)}), trained at length "
        f"{report['task']['length']}",
    ]
    for e in report["results"]:
        full, abl = e["models"]["full"], e["models"]["attention removed"]
        lines += [
            "",
            f"**{e['setting']}, L = {e['length']}** ({e['needles']} needle(s), {e['queries']} "
            f"query/queries): accuracy {full['accuracy']:.3f}, attention removed {abl['accuracy']:.3f}",
            "",
            "| layer | kind | l2 AUC | logit AUC | needle's logit push | removed: l2 AUC "
            "| removed: logit AUC | removed: needle's logit push |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for k, (a, b) in enumerate(zip(full["layers"], abl["layers"], strict=True)):
            lines.append(
                f"| {k} | {display_name(a['kind'])} | {a['l2_auc']:.3f} | {a['logit_auc']:.3f} | "
                f"{a['gold_logit']:+.2f} | {b['l2_auc']:.3f} | {b['logit_auc']:.3f} | "
                f"{b['gold_logit']:+.2f} |"
            )
    lines += [
        "",
        "AUC: of the needle's value position among the query row's sources j <= i, per row, averaged. "
        "Needle's logit push: the logit contribution c_ij of the needle's value token j through that "
        "sublayer to the answer's logit at the query row i (LaTIM logit, exact mode), averaged over rows.",
    ]
    return "\n".join(lines)
