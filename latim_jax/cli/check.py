"""``latim-jax check``: cross-check a converted model against the PyTorch reference (transformers), layer by
layer (torch and transformers are imported inside the functions that need them: they are optional)."""

from __future__ import annotations

import numpy as np

from latim_jax.convert import detect_format
from latim_jax.io.loading import load, resolve
from latim_jax.io.progress import bars_enabled


def reference_model(path, config, params):
    """A transformers model of the same checkpoint, in fp32.

    Hugging Face directories load with ``from_pretrained`` (independent of latim-jax's reader); other
    formats are rebuilt from the converted parameters (which then checks the forward, not the reader).
    """
    import torch  # torch and transformers only here: the library never needs them
    import transformers
    from transformers.utils import logging as hf_logging

    if detect_format(path) == "hf":
        was_on = hf_logging.is_progress_bar_enabled()
        if not bars_enabled():  # transformers' own "Loading weights" bar follows latim-jax's switch
            hf_logging.disable_progress_bar()
        try:
            model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
        finally:
            if was_on:
                hf_logging.enable_progress_bar()
        return model.eval(), "from_pretrained"
    if config.family:
        raise ValueError(
            f"a converted {config.family} checkpoint cannot be rebuilt as a transformers model here: run "
            "check on the original Hugging Face directory (config.json + safetensors) instead"
        )
    hf_config = transformers_config(config)
    cls = transformers.MambaForCausalLM if config.version == 1 else transformers.Mamba2ForCausalLM
    model = cls(hf_config).eval()
    state = torch_state_dict(config, params)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or [k for k in missing if not k.startswith("lm_head")]:
        raise RuntimeError(f"cannot rebuild the reference: missing {missing}, unexpected {unexpected}")
    if config.tie_embeddings:
        model.tie_weights()
    return model.float(), "rebuilt from converted parameters"


# the families whose transformers model lists the embeddings first in hidden_states -> the latim-jax
# sublayers per transformers layer
HYBRID_STRIDE = {"nemotron_h": 1, "bamba": 2, "granitemoehybrid": 2, "jamba": 2, "falcon_h1": 2, "zamba2": 1}


def transformers_config(config):
    """The transformers MambaConfig / Mamba2Config of a latim-jax config."""
    import transformers

    act = {"silu": "silu", "relu": "relu", "identity": "linear"}[config.activation]
    common = dict(
        vocab_size=config.vocab_size,
        hidden_size=config.d_model,
        state_size=config.d_state,
        num_hidden_layers=config.n_layers,
        layer_norm_epsilon=config.rms_eps,
        expand=config.expand,
        conv_kernel=config.d_conv,
        use_bias=config.proj_bias,
        use_conv_bias=config.conv_bias,
        hidden_act=act,
        tie_word_embeddings=config.tie_embeddings,
    )
    if config.version == 1:
        return transformers.MambaConfig(time_step_rank=config.dt_rank, **common)
    return transformers.Mamba2Config(
        num_heads=config.n_heads,
        head_dim=config.head_dim,
        n_groups=config.n_groups,
        chunk_size=config.chunk_size,
        time_step_limit=config.time_step_limit,
        **common,
    )


def torch_state_dict(config, params):
    """Our parameter tree as a transformers state dict (torch tensors, fp32)."""
    import torch

    t = lambda a: torch.from_numpy(np.asarray(a, dtype=np.float32).copy())  # noqa: E731
    sd = {"backbone.embeddings.weight": t(params["embedding"]), "backbone.norm_f.weight": t(params["norm_f"])}
    if "lm_head" in params:
        sd["lm_head.weight"] = t(params["lm_head"])
    for i, layer in enumerate(params["layers"]):
        p, m = f"backbone.layers.{i}.", layer["mixer"]
        sd[p + "norm.weight"] = t(layer["norm"])
        sd[p + "mixer.in_proj.weight"] = t(m["in_proj"]).T.contiguous()
        sd[p + "mixer.conv1d.weight"] = t(m["conv_w"]).T.contiguous()[:, None, :]
        sd[p + "mixer.out_proj.weight"] = t(m["out_proj"]).T.contiguous()
        for ours, theirs in (
            ("conv_b", "conv1d.bias"),
            ("in_proj_b", "in_proj.bias"),
            ("out_proj_b", "out_proj.bias"),
            ("A_log", "A_log"),
            ("D", "D"),
        ):
            if ours in m:
                sd[p + "mixer." + theirs] = t(m[ours])
        if config.version == 1:
            sd[p + "mixer.x_proj.weight"] = t(m["x_proj"]).T.contiguous()
            sd[p + "mixer.dt_proj.weight"] = t(m["dt_proj"]).T.contiguous()
            sd[p + "mixer.dt_proj.bias"] = t(m["dt_bias"])
        else:
            sd[p + "mixer.dt_bias"] = t(m["dt_bias"])
            sd[p + "mixer.norm.weight"] = t(m["norm_w"])
    return sd


def check_model(source, *, length: int = 16, batch: int = 1, seed: int = 0) -> dict:
    """Compare latim-jax and transformers on random tokens: max/mean logit error and per-layer
    hidden-state error (relative to each tensor's max magnitude). :func:`verdict` turns the report
    into PASS / FAIL against a tolerance (``latim-jax check --tolerance``, default 1e-4)."""
    import torch

    path = resolve(source)
    model = load(source, dtype="float32")
    ref, how = reference_model(path, model.config, model.params())
    vocab = model.config.vocab_size_unpadded or model.config.vocab_size
    tokens = np.random.default_rng(seed).integers(0, vocab, (batch, length))
    with torch.no_grad():
        out = ref(torch.from_numpy(tokens), output_hidden_states=True)
    ours = model.forward(tokens)
    ref_logits = out.logits.float().numpy()
    err = np.abs(np.asarray(ours.logits) - ref_logits)
    scale = np.abs(ref_logits).max()
    hidden = []
    # transformers' hidden_states: the Mamba models' begin after layer 0, the hybrids' at the embeddings
    # (one per transformers layer, which may hold several sublayers); the last is the final norm's output
    stride = HYBRID_STRIDE.get(model.config.family)
    skip, stride = (1, 1) if stride is None else (0, stride)
    for i in range(len(out.hidden_states) - 1):
        r = out.hidden_states[i].float().numpy()
        ours_i = np.asarray(ours.residuals[(i + skip) * stride])
        hidden.append(float(np.abs(ours_i - r).max() / max(np.abs(r).max(), 1e-30)))
    return {
        "reference": how,
        "max_logit_error": float(err.max()),
        "mean_logit_error": float(err.mean()),
        "max_logit_error_relative": float(err.max() / max(scale, 1e-30)),
        "hidden_error_relative": hidden,
        "length": length,
        "batch": batch,
    }


def verdict(report: dict, tolerance: float) -> dict:
    """PASS when the logits' relative error and every layer's hidden-state relative error are at most
    ``tolerance`` (NaN or inf anywhere is a FAIL). Returns {"passed", "tolerance", "summary"}."""
    errors = [report["max_logit_error_relative"], *report["hidden_error_relative"]]
    worst = max(errors, key=lambda e: np.inf if not np.isfinite(e) else e)
    passed = bool(all(np.isfinite(e) and e <= tolerance for e in errors))
    if passed:
        summary = f"PASS: largest relative error {worst:.3e} <= tolerance {tolerance:.1e}"
    elif not np.isfinite(worst):
        summary = (
            f"FAIL: non-finite error ({worst}) - the outputs hold NaN or inf (tolerance {tolerance:.1e})"
        )
    else:
        where = "logits" if worst == errors[0] else f"layer {errors.index(worst) - 1}"
        summary = f"FAIL: relative error {worst:.3e} at {where} > tolerance {tolerance:.1e}"
    return {"passed": passed, "tolerance": tolerance, "summary": summary}
