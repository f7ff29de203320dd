"""A readable summary of a loaded model (``latim-jax info MODEL``): config, task, sizes, layers and
vocabulary."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from latim_jax.model.kind import display_name, kind_of
from latim_jax.tasks import vocab
from latim_jax.tasks.registry import TASK_FIELDS


def parameter_counts(params) -> tuple[int, dict[str, int]]:
    """(number of parameters, bytes per dtype name) of a parameter tree."""
    count, nbytes = 0, {}
    for leaf in jax.tree.leaves(params):
        dtype = np.dtype(leaf.dtype)
        count += int(np.prod(leaf.shape))
        nbytes[dtype.name] = nbytes.get(dtype.name, 0) + int(np.prod(leaf.shape)) * dtype.itemsize
    return count, nbytes


def summary(model, path=None) -> str:
    """Several lines describing ``model`` (from :func:`latim_jax.load`); ``path``: its directory."""
    c = model.config
    lines = [f"model: {model.source}" + (f" ({path})" if path else "")]
    family = f"{c.family}: " if c.family else ""
    if any(kind_of(k).version is not None for k in c.kinds):  # a Mamba mixer somewhere: its fields
        arch = f"{family}Mamba-{c.version}, {c.n_layers} layers, d_model {c.d_model}, inner width {c.d_inner}"
        arch += f", state {c.d_state}, conv width {c.d_conv}, activation {c.activation}"
        if c.version == 1:
            arch += f", dt rank {c.dt_rank}"
        else:
            arch += f", {c.n_heads} heads x head dim {c.head_dim}, {c.n_groups} group(s)"
            arch += f", chunk {c.chunk_size}"
    else:
        arch = f"{family}{c.n_layers} sublayers, d_model {c.d_model} (no Mamba mixer)"
    lines.append(f"architecture: {arch}")
    count, nbytes = parameter_counts(model.params())
    sizes = ", ".join(f"{name} {_bytes(n)}" for name, n in sorted(nbytes.items()))
    lines.append(f"parameters: {count:,} ({sizes})")
    if c.is_hybrid:
        arch = ""
        if c.has_attention:
            arch = f"attention {c.attn_heads} heads ({c.attn_kv_heads} key/value) x {c.attn_head_dim}"
            arch += f", rotary theta {c.rope_theta:g}" if c.rope_theta else ", no rotary embedding"
            arch += f", sliding window {c.sliding_window}" if c.sliding_window else ""
        if c.ssm_norm != "gated":
            norm = "RMSNorm(y) * SiLU(z)" if c.ssm_norm == "before_gate" else "y * SiLU(z)"
            arch += f"; SSM output {norm}"
        if "mlp" in c.kinds:
            gated = "gated " if c.mlp_gated else ""
            arch += f"; {gated}MLP width {c.mlp_width}, {c.mlp_activation}"
        for name, section in c.sections:  # a kind's own settings (Gated DeltaNet: heads, dims, conv)
            fields = ", ".join(f"{k} {v}" for k, v in dataclasses.asdict(section).items())
            arch += f"; {display_name(name)} {fields}"
        if c.attn_qk_norm or c.attn_output_gate:
            arch += "; attention" + (" q/k RMSNorm" if c.attn_qk_norm else "")
            arch += " output gate" if c.attn_output_gate else ""
        if "moe" in c.kinds:
            shared = f", shared expert width {c.moe_shared_width}" if c.moe_shared_width else ""
            shared += " (sigmoid-gated)" if c.moe_shared_gate else ""
            experts = f"{c.moe_experts} experts (top {c.moe_top_k}, {c.moe_router})"
            arch += f"; {experts} of width {c.moe_width}{shared}"
        lines.append(f"  sublayers: {arch.lstrip('; ')}")
    all_params = model.params()["layers"]
    for kind in dict.fromkeys(c.kinds):
        at = [i for i, k in enumerate(c.kinds) if k == kind]
        layer = all_params[at[0]]
        shapes = ", ".join(f"{k} {tuple(v.shape)}" for k, v in layer["mixer"].items())
        per_layer, _ = parameter_counts(layer)
        where = "" if len(at) == c.n_layers else f" (layers {_spans(at)})"
        lines.append(
            f"layers: {len(at)} x [RMSNorm, {display_name(kind)}]{where} ({per_layer:,} parameters each)"
        )
        lines.append(f"  {kind} parameters: {shapes}")
    head = "tied to the embedding" if c.tie_embeddings else "separate lm_head"
    padded = "" if c.n_tokens == c.vocab_size else f" ({c.n_tokens} tokens, rows past them are padding)"
    lines.append(f"embedding: ({c.vocab_size}, {c.d_model}){padded}; output head {head}")
    lines.append(f"config: {_config_line(c)}")
    lines.append(f"task: {_task(model.task)}")
    lines.append(_vocabulary(model))
    return "\n".join(lines)


def _spans(indices: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    out, start = [], indices[0]
    for a, b in zip(indices, [*indices[1:], None], strict=True):
        if b != a + 1:
            out.append(f"{start}-{a}" if a > start else f"{a}")
            start = b
    return ", ".join(out)


def _task(task: dict | None) -> str:
    if not task:
        return "none (not a task model)"
    fields = TASK_FIELDS.get(task.get("name"), tuple(task))
    text = ", ".join(f"{k} {task[k]}" for k in fields if k in task and k != "name")
    text = f"{task.get('name')} ({text})"
    if "final_token_accuracy" in task:
        training = task.get("training", {})
        steps = training.get("steps_run", training.get("steps", "?"))
        text += (
            f"; trained {steps} steps ({training.get('init', '?')} init), held-out token accuracy "
            f"{task['final_token_accuracy']:.3f}"
        )
    return text


def _vocabulary(model) -> str:
    n = model.config.n_tokens
    try:
        tok = vocab.load_tokenizer(model)
    except vocab.TokenizerError as err:
        return f"vocabulary: {n} ids; {err}"
    if tok is None:
        return f"vocabulary: {n} ids, no tokenizer (pass ids with --tokens)"
    directory = getattr(model, "tokenizer_dir", "")
    origin = "tokenizer.json" if directory else "the task's words (no tokenizer.json)"
    listing = vocab.describe(vocab.model_words(model) or [])
    text = f"vocabulary: {n} ids, from {origin}: {listing}"
    size = tok.get_vocab_size(with_added_tokens=True)
    if size > n:
        text += (
            f"\nwarning: the tokenizer has {size} tokens but the model only {n} ids: text with tokens "
            f"past id {n - 1} is refused (is this the model's tokenizer?)"
        )
    elif size < n:
        text += (
            f"\nnote: the tokenizer has {size} tokens, the model {n} ids (ids {size}..{n - 1} have no word)"
        )
    return text


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _config_line(c) -> str:
    """The config's fields as key=value, those at their default value left out (they are many for a
    hybrid: every kind's options exist on every config)."""
    defaults = {f.name: f.default for f in dataclasses.fields(c) if f.default is not dataclasses.MISSING}
    if c.version == 2:  # Mamba-1's dt rank (computed from d_model when 0) means nothing for Mamba-2
        defaults["dt_rank"] = c.dt_rank
    shown = {k: v for k, v in c.to_dict().items() if k not in defaults or getattr(c, k) != defaults[k]}
    return ", ".join(f"{k}={v}" for k, v in sorted(shown.items())) + " (other fields at their defaults)"
