"""Training small Mamba LMs from scratch on the synthetic tasks of :mod:`latim_jax.tasks.registry`.

The copy models are what the paper's copying evaluation attributes (docs/method.md, section 10):
train with :func:`train_from_config` (or ``scripts/train_copy.py CONFIG OUT``), read back with
:func:`load_trained`.

Objective: next-token cross-entropy averaged over the task's scored rows only (``Batch.loss_mask``:
for copy, the rows predicting the copied tokens). Optimiser: global-norm clipping, then AdamW with
linear warmup and cosine decay; weight decay applies to the projection matrices and embeddings only
(never to A_log, D, dt biases, conv or norm weights). Everything is fixed by ``seed``: the parameters
(``init_params(config, seed)``), the training batches (numpy stream ``[seed, 1]``) and the held-out
evaluation batch (stream ``[seed, 2]``).

Initialisations: ``"default"`` is :func:`latim_jax.model.init.init_params`; ``"mimetic"`` applies
:func:`mimetic_init` on top of it (Trockman et al. 2024, as the LaTIM authors' code does it).
``init_from`` continues from a model written by :func:`save_trained` instead (a second stage, e.g.
more steps or longer sequences: a length curriculum); ``init`` then records how the first stage began.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from latim_jax.convert import read_checkpoint, save_checkpoint
from latim_jax.io.loading import load
from latim_jax.io.progress import progress, write
from latim_jax.model.config import MambaConfig
from latim_jax.model.init import init_params
from latim_jax.model.lm import MambaLM
from latim_jax.tasks.batch import Batch
from latim_jax.tasks.registry import check_task, make_batch, task_summary
from latim_jax.tasks.vocab import write_task_tokenizer

INITS = ("default", "mimetic")
MIMETIC_DT_BIAS = 0.5413  # softplus(0.5413) = 1.0000: Delta = 1 everywhere at initialisation
MIMETIC_A_LOG_SCALE = -8.0  # A_log <- -8 * A_log: A = -exp(A_log) moves towards 0 (slow decay)
_DECAYED = ("embedding", "lm_head", "in_proj", "x_proj", "dt_proj", "out_proj")  # weight-decayed params


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything one training run depends on (JSON: ``{"model": {...}, "task": {...}, <the rest>}``)."""

    model: MambaConfig
    task: dict
    init: str = "mimetic"
    init_from: str | None = None  # a save_trained directory to continue from (relative to the cwd)
    seed: int = 0
    steps: int = 2000
    batch_size: int = 64
    lr: float = 3e-3
    end_lr_ratio: float = 0.1  # cosine decays to lr * end_lr_ratio
    warmup_steps: int = 100
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.98
    grad_clip: float = 1.0
    eval_every: int = 250
    eval_size: int = 512
    eval_chunk: int = 128

    def __post_init__(self):
        if self.init not in INITS:
            raise ValueError(f"TrainConfig.init must be one of {INITS}, found {self.init!r}")
        check_task(self.task)
        if self.task["vocab_size"] > self.model.vocab_size:
            raise ValueError(
                f"task vocab_size {self.task['vocab_size']} exceeds the model's {self.model.vocab_size}"
            )

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dict (read back by :meth:`from_dict`)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["model"] = self.model.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        """Build from a dict; unknown keys are an error naming them."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"unknown training config field(s) {unknown}; expected a subset of {sorted(known)}"
            )
        return cls(**{**data, "model": MambaConfig.from_dict(data["model"])})

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> TrainConfig:
        """Read a config file (see configs/copy-mamba1.json)."""
        with open(path) as f:
            return cls.from_dict(json.load(f))


@dataclasses.dataclass
class TrainResult:
    """What :func:`train` returns: the trained model, the loss of every step, the periodic evaluations
    (dicts with step, loss, token_accuracy, sequence_accuracy), the wall time and the process CPU time in
    seconds (compilation included; on a shared machine the CPU time is the steadier number)."""

    model: MambaLM
    losses: list[float]
    evals: list[dict]
    wall_time_s: float
    cpu_time_s: float = 0.0

    @property
    def final(self) -> dict:
        """The last evaluation."""
        return self.evals[-1]


# ---------------------------------------------------------------------------------------------------
# Initialisation


def mimetic_init(params: dict, config: MambaConfig, *, a_log_scale: float = MIMETIC_A_LOG_SCALE) -> dict:
    """Mimetic initialisation (docs/method.md, section 10) applied to a parameter tree; returns a
    new tree (numpy), the input is not modified.

    Per layer: A_log <- a_log_scale * A_log (slow decays); the dt projection weight 0 and dt bias
    0.5413, so Delta = softplus(0.5413) = 1; conv identity tap conv_w[k-1] = 1 (the current token),
    other taps and the conv bias 0; the B projection columns <- (B + C) / 2, so that C_i . B_j acts like
    a query-key similarity. Mamba-1: B/C are columns r..r+n / r+n..r+2n of x_proj (e, r+2n), the dt
    projection is dt_proj (r, e). Mamba-2: B/C are the columns 2e..2e+gn / 2e+gn..2e+2gn of in_proj
    (d, 2e+2gn+h) (order z, x, B, C, dt), the dt projection is its last h columns (biases likewise).
    """
    c = config
    out = jax.tree.map(lambda a: np.array(a, copy=True), params)
    for kind, layer in zip(c.kinds, out["layers"], strict=True):
        if not kind.startswith("mamba"):  # a hybrid's attention and MLP layers keep the default init
            continue
        m = layer["mixer"]
        m["A_log"] = a_log_scale * m["A_log"]
        m["dt_bias"] = np.full_like(m["dt_bias"], MIMETIC_DT_BIAS)
        m["conv_w"] = np.zeros_like(m["conv_w"])
        m["conv_w"][-1] = 1.0
        if "conv_b" in m:
            m["conv_b"] = np.zeros_like(m["conv_b"])
        if c.version == 1:
            m["dt_proj"] = np.zeros_like(m["dt_proj"])
            _average_b_with_c(m["x_proj"], c.dt_rank, c.d_state)
        else:
            gn, e = c.n_groups * c.d_state, c.d_inner
            for name in ("in_proj", "in_proj_b"):
                if name in m:
                    m[name][..., 2 * e + 2 * gn :] = 0.0  # dt projection
                    _average_b_with_c(m[name], 2 * e, gn)
    return out


def _average_b_with_c(w, b_start, width):
    """In place: w[..., B] <- (w[..., B] + w[..., C]) / 2 with C right after B, both ``width`` wide."""
    b_cols = slice(b_start, b_start + width)
    c_cols = slice(b_start + width, b_start + 2 * width)
    w[..., b_cols] = 0.5 * (w[..., b_cols] + w[..., c_cols])


def initial_params(config: MambaConfig, init: str = "default", seed: int = 0) -> dict:
    """Parameters for training from scratch: ``init`` is "default" or "mimetic"."""
    if init not in INITS:
        raise ValueError(f"init must be one of {INITS}, found {init!r}")
    params = init_params(config, seed)
    return mimetic_init(params, config) if init == "mimetic" else params


def starting_params(tc: TrainConfig) -> dict:
    """``initial_params(tc.model, tc.init, tc.seed)``, or the parameters of ``tc.init_from`` (whose model
    config must equal ``tc.model``; the error names the differing fields)."""
    if tc.init_from is None:
        return initial_params(tc.model, tc.init, tc.seed)
    config, params = read_checkpoint(Path(tc.init_from).resolve())  # orbax wants absolute paths
    if config != tc.model:
        a, b = config.to_dict(), tc.model.to_dict()
        diff = sorted(k for k in a if a[k] != b.get(k))
        raise ValueError(
            f"init_from {tc.init_from}: its model config differs from the training config in {diff}"
        )
    return params


# ---------------------------------------------------------------------------------------------------
# Objective and optimiser


def masked_cross_entropy(logits, targets, mask):
    """Mean next-token cross-entropy over the rows where ``mask`` is True. logits (b, l, v)."""
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
    mask = mask.astype(jnp.float32)
    return jnp.sum(ce * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def masked_correct(logits, targets, mask):
    """Per-row correctness (b, l) bool: argmax prediction equals the target on a masked row."""
    return (jnp.argmax(logits, axis=-1) == targets) & mask


def make_optimizer(tc: TrainConfig, steps: int | None = None) -> optax.GradientTransformation:
    """Clip by global norm, then AdamW (warmup + cosine schedule) decaying only the matrices in _DECAYED.

    Equal settings return the same object, so the jitted step (which holds the optimiser as static
    structure) compiles once per setting rather than once per run.
    """
    steps = tc.steps if steps is None else steps
    return _optimizer(
        tc.lr, tc.end_lr_ratio, tc.warmup_steps, steps, tc.weight_decay, tc.b1, tc.b2, tc.grad_clip
    )


@functools.lru_cache(maxsize=32)
def _optimizer(lr, end_lr_ratio, warmup_steps, steps, weight_decay, b1, b2, grad_clip):
    warmup = min(warmup_steps, max(steps - 1, 0))
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=lr,
        warmup_steps=warmup,
        decay_steps=max(steps, warmup + 1),
        end_value=lr * end_lr_ratio,
    )
    adamw = optax.adamw(schedule, b1=b1, b2=b2, weight_decay=weight_decay, mask=_decay_mask)
    return optax.chain(optax.clip_by_global_norm(grad_clip), adamw)


def _decay_mask(params):
    def decayed(path, _):
        return any(getattr(k, "key", getattr(k, "name", None)) in _DECAYED for k in path)

    return jax.tree_util.tree_map_with_path(decayed, params)


@nnx.jit
def _train_step(model: MambaLM, optimizer: nnx.Optimizer, tokens, targets, mask):
    def loss_fn(m):
        return masked_cross_entropy(m(tokens), targets, mask)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


@nnx.jit
def _eval_step(model: MambaLM, tokens, targets, mask):
    logits = model(tokens)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    return jnp.sum(ce * mask), masked_correct(logits, targets, mask)


def held_out_scores(model: MambaLM, batch: Batch, chunk: int = 128) -> dict[str, float]:
    """Held-out scores on ``batch``: masked loss, token accuracy (exact match of the argmax prediction
    per scored row) and sequence accuracy (every scored row of a sequence right)."""
    loss_sum, correct = 0.0, []
    for s in range(0, batch.tokens.shape[0], chunk):
        sl = slice(s, s + chunk)
        ls, ok = _eval_step(
            model,
            jnp.asarray(batch.tokens[sl]),
            jnp.asarray(batch.targets[sl]),
            jnp.asarray(batch.loss_mask[sl]),
        )
        loss_sum += float(ls)
        correct.append(np.asarray(ok))
    correct = np.concatenate(correct)
    mask = batch.loss_mask
    n = max(int(mask.sum()), 1)
    seq_ok = (correct | ~mask).all(axis=1)
    return {
        "loss": loss_sum / n,
        "token_accuracy": float(correct.sum() / n),
        "sequence_accuracy": float(seq_ok.mean()),
    }


# ---------------------------------------------------------------------------------------------------
# Training


def train(
    tc: TrainConfig, *, steps: int | None = None, log: Callable[[str], None] | None = print
) -> TrainResult:
    """Train a model of ``tc.model`` on ``tc.task`` for ``steps`` (default ``tc.steps``) steps.

    Deterministic given ``tc.seed``: the same config gives the same loss sequence. Evaluates on a
    held-out batch every ``tc.eval_every`` steps and after the last step, passing a line to ``log``.
    A progress bar runs on stderr when it is a terminal (:mod:`latim_jax.io.progress`).
    """
    steps = tc.steps if steps is None else steps
    log_line = write if log is print else log  # print without breaking the progress bar
    start, cpu_start = time.perf_counter(), time.process_time()
    model = MambaLM(tc.model, starting_params(tc))
    optimizer = nnx.Optimizer(model, make_optimizer(tc, steps), wrt=nnx.Param)
    data_rng = np.random.default_rng([tc.seed, 1])
    eval_batch = make_batch(tc.task, tc.eval_size, np.random.default_rng([tc.seed, 2]))
    losses, evals = [], []
    for step in progress(range(1, steps + 1), total=steps, desc="train", unit="step"):
        b = make_batch(tc.task, tc.batch_size, data_rng)
        loss = _train_step(
            model, optimizer, jnp.asarray(b.tokens), jnp.asarray(b.targets), jnp.asarray(b.loss_mask)
        )
        losses.append(float(loss))
        if not math.isfinite(losses[-1]):
            raise FloatingPointError(f"training loss became {losses[-1]} at step {step}")
        if step % tc.eval_every == 0 or step == steps:
            ev = {
                "step": step,
                "train_loss": losses[-1],
                **held_out_scores(model, eval_batch, tc.eval_chunk),
                "wall_time_s": time.perf_counter() - start,
                "cpu_time_s": time.process_time() - cpu_start,
            }
            evals.append(ev)
            if log is not None:
                log_line(
                    f"step {step:5d}  train loss {ev['train_loss']:.4f}  eval loss {ev['loss']:.4f}  "
                    f"token acc {ev['token_accuracy']:.4f}  seq acc {ev['sequence_accuracy']:.4f}  "
                    f"{ev['wall_time_s']:.0f}s (cpu {ev['cpu_time_s']:.0f}s)"
                )
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    return TrainResult(model=model, losses=losses, evals=evals, wall_time_s=wall, cpu_time_s=cpu)


def save_trained(out_dir: str | os.PathLike, result: TrainResult, tc: TrainConfig) -> Path:
    """Write ``out_dir`` atomically: a latim-jax checkpoint (``latim_jax.convert.save_checkpoint``:
    params/ + latim_config.json) plus task.json (the task dict + final accuracy + training settings
    and history) and tokenizer.json (the task's words, :func:`latim_jax.tasks.vocab.write_task_tokenizer`),
    built in a temporary sibling directory and renamed into place. Returns the path."""
    out = Path(out_dir).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        save_checkpoint(tmp, tc.model, jax.tree.map(np.asarray, result.model.params()))
        (tmp / "task.json").write_text(json.dumps(_task_record(result, tc), indent=2) + "\n")
        write_task_tokenizer(tmp, tc.task, tc.model.vocab_size)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    if out.exists():
        out.rename(old)
    tmp.rename(out)
    if old.exists():
        shutil.rmtree(old)
    return out


def _task_record(result: TrainResult, tc: TrainConfig) -> dict:
    final = result.final
    settings = {k: v for k, v in tc.to_dict().items() if k not in ("model", "task")}
    return {
        **task_summary(tc.task),
        "final_token_accuracy": final["token_accuracy"],
        "final_sequence_accuracy": final["sequence_accuracy"],
        "final_eval_loss": final["loss"],
        "training": {
            **settings,
            "steps_run": len(result.losses),
            "wall_time_s": round(result.wall_time_s, 1),
            "cpu_time_s": round(result.cpu_time_s, 1),
            "cpu_count": os.cpu_count(),
            "jax_backend": jax.default_backend(),
            "history": result.evals,
        },
    }


def load_trained(path: str | os.PathLike) -> MambaLM:
    """Read a directory written by :func:`save_trained` (same as ``latim_jax.load(path)``)."""
    model = load(Path(path).resolve())
    model.source = str(Path(path).resolve())
    return model


def train_from_config(
    path: str | os.PathLike,
    out_dir: str | os.PathLike | None,
    steps: int | None = None,
    log: Callable[[str], None] | None = print,
) -> TrainResult:
    """Train from a JSON config file and (when ``out_dir`` is given) save the result there."""
    tc = TrainConfig.from_json(path)
    result = train(tc, steps=steps, log=log)
    if out_dir is not None:
        save_trained(out_dir, result, tc)
    return result
