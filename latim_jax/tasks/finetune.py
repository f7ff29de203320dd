"""Fine-tuning a task model with an attribution term in the loss: gradients of attributions put to use.

The loss on a batch of a task with gold sources (latim_jax.tasks: copy, MQAR) is

    loss = CE(next-token predictions on the scored rows)
           + lam * mean over scored rows i of -log(p_i[gold_i] + floor)

where p_i is row i of the chosen attribution map as a distribution over sources (``method="alti"``:
rows already sum to 1; "l2" / "l1": each row divided by its sum), at layer ``layer`` or (alti, with
``layer=None``) the rollout across layers. The second term rewards the model for making its copied
tokens' attribution rows point at their true sources. alti clips negative gains to 0, so a gold
source clipped to 0 gives no gradient; l2 rows are positive wherever a contribution is non-zero.
The whole map is differentiated through :func:`latim_jax.attribute` (true gradients: Delta, B, C and
the gates move too), with the memory-bounded backward of the blocked score path.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from latim_jax.io.progress import progress
from latim_jax.latim.attribution import attribute
from latim_jax.tasks import evaluate, registry
from latim_jax.tasks.train import masked_cross_entropy

FLOOR = 1e-6  # keeps log finite where an attribution row gives its gold source no mass


@dataclasses.dataclass(frozen=True, kw_only=True)
class FinetuneConfig:
    """Settings of :func:`finetune` (JSON-safe)."""

    steps: int = 200
    batch_size: int = 32
    lr: float = 1e-3
    lam: float = 1.0
    method: str = "alti"
    layer: int | None = -1  # None: the rollout across layers
    seed: int = 0
    eval_sequences: int = 64

    def __post_init__(self):
        if self.method not in ("alti", "l2", "l1"):
            raise ValueError(f"the attribution term takes alti, l2 or l1, found {self.method!r}")
        if self.layer is None and self.method != "alti":
            raise ValueError("layer=None (the rollout) needs method='alti'")
        if self.steps < 0 or self.batch_size < 1 or self.lam < 0 or not math.isfinite(self.lr):
            raise ValueError(f"invalid fine-tuning settings: {self}")


def attribution_rows(model, tokens, mask, method: str, layer: int | None):
    """(b, l, l) maps whose rows are distributions over sources: one layer's, or the rollout."""
    layers = None if layer is None else [layer]
    res = attribute(model, tokens, method=method, layers=layers, mask=mask, memory_limit=None)
    if layer is None:
        return res.rollout()
    s = res.scores[:, 0]
    if method == "alti":
        return s
    total = jnp.sum(s, -1, keepdims=True)
    return s / jnp.where(total > 0, total, 1.0)


def attribution_loss(model, tokens, gold, mask, method: str = "alti", layer: int | None = -1):
    """mean over scored rows (gold >= 0) of -log(p_i[gold_i] + FLOOR)."""
    p = attribution_rows(model, tokens, mask, method, layer)
    g = jnp.maximum(gold, 0)
    picked = jnp.take_along_axis(p, g[..., None], -1)[..., 0]  # (b, l)
    rows = (gold >= 0).astype(jnp.float32)
    return jnp.sum(-jnp.log(picked + FLOOR) * rows) / jnp.maximum(jnp.sum(rows), 1.0)


def _mask(batch):
    return jnp.asarray(np.arange(batch.tokens.shape[1])[None, :] < batch.lengths[:, None])


def finetune(
    model, cfg: FinetuneConfig, *, task: dict | None = None, log: Callable[[str], None] | None = print
):
    """Fine-tune ``model`` (in place) on its task with the combined loss; returns the history: a list
    of dicts (step, loss, ce, attribution) every ``max(1, steps // 10)`` steps."""
    task = registry.task_fields(task or model.task)
    rng = np.random.default_rng([cfg.seed, 3])
    optimizer = nnx.Optimizer(model, optax.adamw(cfg.lr, weight_decay=0.0), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, tokens, targets, loss_mask, gold, mask):
        def loss_fn(m):
            ce = masked_cross_entropy(m(tokens, mask=mask), targets, loss_mask)
            attr = attribution_loss(m, tokens, gold, mask, cfg.method, cfg.layer)
            return ce + cfg.lam * attr, (ce, attr)

        (loss, (ce, attr)), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
        optimizer.update(model, grads)
        return loss, ce, attr

    history = []
    every = max(1, cfg.steps // 10)
    for k in progress(range(1, cfg.steps + 1), desc="finetune", unit="step"):
        b = registry.make_batch(task, cfg.batch_size, rng)
        arrays = [jnp.asarray(x) for x in (b.tokens, b.targets, b.loss_mask, b.gold)]
        loss, ce, attr = step(model, optimizer, *arrays, _mask(b))
        if k % every == 0 or k == cfg.steps:
            history.append({"step": k, "loss": float(loss), "ce": float(ce), "attribution": float(attr)})
            if log is not None:
                log(f"step {k:4d}  loss {float(loss):.4f}  ce {float(ce):.4f}  attribution {float(attr):.4f}")
        if not math.isfinite(float(loss)):
            raise FloatingPointError(f"fine-tuning loss became {float(loss)} at step {k}")
    return history


def attribution_quality(model, cfg: FinetuneConfig, *, task: dict | None = None, seed: int = 10_000) -> dict:
    """Accuracy and the attribution AUC of ``cfg.method`` (exact mode) on held-out sequences: the
    evaluation of latim_jax.tasks.evaluate restricted to that method, at the fine-tuned layer and
    aggregate."""
    name = f"LaTIM {cfg.method} (exact)"
    methods = [(name, cfg.method, "exact", {})]
    report = evaluate.evaluate(
        model, task or model.task, n_sequences=cfg.eval_sequences, seed=seed, methods=methods
    )
    row = report["rows"][name]
    layer = None if cfg.layer is None else cfg.layer % model.config.n_layers
    return {
        "accuracy": report["accuracy"],
        "auc_layer": None if layer is None else row["layers"][layer]["auc"],
        "auc_aggregate": row["aggregate"]["auc"],
        "layer": layer,
    }
