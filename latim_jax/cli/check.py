"""``latim-jax check``: cross-check a model against the PyTorch reference (transformers), logits and the
stream layer by layer (torch and transformers are imported inside the functions that need them: they are
optional).

What the reference is:

* a Hugging Face directory (config.json + safetensors) loads with transformers' own ``from_pretrained``:
  this checks latim-jax's reader and its forward, for every family latim-jax reads;
* a latim-jax checkpoint (a shipped model such as ``needle-hybrid``, or the output of ``latim-jax
  convert``) is rebuilt as the transformers model that computes the same function, from the converted
  parameters: Mamba (Mamba-1), FalconMamba (Mamba-1 with RMS-normalised dt input, B and C), Mamba2, or
  NemotronH (hybrids of Mamba-2, attention without rotary embedding, and MLP sublayers). This checks the
  forward, not the reader;
* a converted checkpoint of another family (bamba, granitemoehybrid, jamba, falcon_h1, zamba2, or a
  Nemotron-H with experts) is refused with a :class:`CheckpointError` naming the field (``latim-jax
  check`` prints one ``error:`` line and exits with 2): no transformers model is rebuilt from it here
  (some conversions fold multipliers or adapters into the weights), so check the original Hugging Face
  directory instead, which tests the reader as well.

transformers' ``hidden_states`` begin with the embeddings in some models and versions (the hybrids;
Mamba-2 from transformers 5.25) and after the first layer in others (Mamba, Mamba-2 up to 5.24): which
one is detected per run (:func:`begins_with_embeddings`), not looked up by family or version.
"""

from __future__ import annotations

import math

import numpy as np

from latim_jax.cli.args import UsageError
from latim_jax.convert import CheckpointError, detect_format
from latim_jax.io.loading import load, resolve
from latim_jax.io.progress import bars_enabled

CONFIG_FILE = "latim_config.json"
# the layer kinds transformers' NemotronH runs as latim-jax does (its layers_block_type names)
NEMOTRON_BLOCKS = {"mamba2": "linear_attention", "attention": "full_attention", "mlp": "mlp"}
# latim-jax's MLP activations -> transformers' ACT2FN names
MLP_ACTS = {
    "relu2": "relu2",
    "silu": "silu",
    "relu": "relu",
    "gelu": "gelu",
    "gelu_tanh": "gelu_pytorch_tanh",
}
# the relative difference under which transformers' first hidden state is the stream entering its first
# layer (it is that very tensor when the embeddings come first: the difference is then exactly 0)
SAME_TENSOR = 1e-6


def rebuild_target(config, file=CONFIG_FILE) -> str:
    """The transformers class a latim-jax checkpoint of ``config`` is rebuilt as: "MambaForCausalLM",
    "FalconMambaForCausalLM", "Mamba2ForCausalLM" or "NemotronHForCausalLM".

    Raises :class:`CheckpointError` naming ``file``, the config field and what the rebuild needs when no
    transformers model computes the same function from these parameters (a converted family checkpoint
    other than falcon_mamba / nemotron_h, or a field that transformers' class does not express).
    Needs neither torch nor transformers.
    """
    c = config

    def need(key, expected, found=None):
        found = getattr(c, key) if found is None else found
        if found != expected:
            raise CheckpointError(
                "transformers' model that check rebuilds cannot express this value", file=file, key=key,
                expected=expected, found=found,
            )  # fmt: skip

    if c.family not in ("", "falcon_mamba", "nemotron_h"):
        raise CheckpointError(
            f"check cannot rebuild a transformers {c.family} model from latim-jax parameters (it rebuilds "
            "Mamba, FalconMamba, Mamba2 and NemotronH models only): run check on this checkpoint's original "
            "Hugging Face directory (config.json + safetensors), which transformers loads itself",
            file=file, key="family", expected="'', 'falcon_mamba' or 'nemotron_h'", found=repr(c.family),
        )  # fmt: skip
    need("embedding_multiplier", 1.0)
    need("logits_scaling", 1.0)
    if c.out_proj_bias is not None:
        need("out_proj_bias", c.proj_bias)
    if c.version == 2:
        need("ssm_norm", "gated")
    if c.layer_kinds and (c.is_hybrid or c.family == "nemotron_h"):
        need("version", 2)
        for i, kind in enumerate(c.layer_kinds):
            if kind not in NEMOTRON_BLOCKS:
                raise CheckpointError(
                    "no transformers model is rebuilt with this layer kind (NemotronH, the one rebuilt for "
                    "hybrids, runs Mamba-2, attention and MLP sublayers as latim-jax does)",
                    file=file, key=f"layer_kinds[{i}]", expected=sorted(NEMOTRON_BLOCKS), found=kind,
                )  # fmt: skip
        need("time_step_limit", math.inf, c.time_step_limit[1])  # NemotronH clamps Delta to (min, inf)
        if c.has_attention:
            need("rope_theta", 0.0)
            need("attn_bias", False)
            need("attn_out_bias", False)
            need("sliding_window", 0)
            if c.attn_scale:
                need("attn_scale", c.attn_head_dim**-0.5)
        if "mlp" in c.kinds:
            need("mlp_gated", False)
            if c.mlp_activation not in MLP_ACTS:
                need("mlp_activation", sorted(MLP_ACTS))
        return "NemotronHForCausalLM"
    need("ssm_inner", c.expand * c.d_model, c.d_inner)  # transformers' Mamba models: e = expand * d
    if c.version == 1 and c.bcdt_norm:
        need("bcdt_norm_weight", False)  # Jamba's weighted dt/B/C norms: no plain transformers model
        return "FalconMambaForCausalLM"
    need("family", "", c.family)
    return "MambaForCausalLM" if c.version == 1 else "Mamba2ForCausalLM"


def reference_model(path, config, params):
    """A transformers model of the same checkpoint, in fp32, and how it was made.

    Hugging Face directories load with ``from_pretrained`` (independent of latim-jax's reader); latim-jax
    checkpoints are rebuilt from their parameters as :func:`rebuild_target` says (which then checks the
    forward, not the reader), or refused with a :class:`CheckpointError` naming the field.
    """
    if detect_format(path) == "hf":
        import torch  # torch and transformers only here: the library never needs them
        import transformers
        from transformers.utils import logging as hf_logging

        was_on = hf_logging.is_progress_bar_enabled()
        if not bars_enabled():  # transformers' own "Loading weights" bar follows latim-jax's switch
            hf_logging.disable_progress_bar()
        try:
            # use_kernels=False: transformers' own torch code is the reference (5.25 defaults to hub
            # kernels and refuses to load without the `kernels` package; 5.24 defaults to False)
            model = transformers.AutoModelForCausalLM.from_pretrained(
                str(path), dtype=torch.float32, use_kernels=False
            )
        finally:
            if was_on:
                hf_logging.enable_progress_bar()
        return model.eval(), "from_pretrained"
    target = rebuild_target(config, file=f"{path}/{CONFIG_FILE}")  # before importing torch
    import transformers

    model = getattr(transformers, target)(transformers_config(config)).eval()
    if target == "NemotronHForCausalLM":  # built with a positive time_step_min (its initialiser takes the
        # log), then given the checkpoint's lower clamp of Delta, which may be 0
        model.config.time_step_min = config.time_step_limit[0]
        for layer in model.model.layers:
            if hasattr(layer.mixer, "time_step_limit"):
                layer.mixer.time_step_limit = (config.time_step_limit[0], math.inf)
    state = torch_state_dict(config, params)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or [k for k in missing if not k.startswith("lm_head")]:
        raise RuntimeError(f"cannot rebuild the reference: missing {missing}, unexpected {unexpected}")
    if config.tie_embeddings and target != "NemotronHForCausalLM":
        model.tie_weights()
    return model.float(), f"{target} rebuilt from the latim-jax parameters"


def transformers_config(config):
    """The transformers config of a latim-jax config: MambaConfig, FalconMambaConfig, Mamba2Config or
    NemotronHConfig, as :func:`rebuild_target` picks (which raises when none fits)."""
    import transformers

    target = rebuild_target(config)
    act = {"silu": "silu", "relu": "relu", "identity": "linear"}[config.activation]
    if target == "NemotronHForCausalLM":
        c = config
        return transformers.NemotronHConfig(
            vocab_size=c.vocab_size,
            hidden_size=c.d_model,
            layers_block_type=[NEMOTRON_BLOCKS[k] for k in c.kinds],
            tie_word_embeddings=False,  # NemotronH never ties: its lm_head gets a copy of the embedding
            layer_norm_epsilon=c.rms_eps,
            ssm_state_size=c.d_state,
            mamba_num_heads=c.n_heads,
            mamba_head_dim=c.head_dim,
            n_groups=c.n_groups,
            conv_kernel=c.d_conv,
            use_conv_bias=c.conv_bias,
            use_bias=c.proj_bias,
            mamba_hidden_act=act,
            chunk_size=c.chunk_size,
            time_step_min=c.time_step_limit[0] if c.time_step_limit[0] > 0 else 1e-3,  # see reference_model
            num_attention_heads=max(c.attn_heads, 1),
            num_key_value_heads=max(c.attn_kv_heads, 1),
            head_dim=max(c.attn_head_dim, 1),
            intermediate_size=max(c.mlp_width, 1),
            mlp_hidden_act=MLP_ACTS.get(c.mlp_activation, "relu2"),
            mlp_bias=c.mlp_bias,
        )
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
    if target == "MambaForCausalLM":
        return transformers.MambaConfig(time_step_rank=config.dt_rank, **common)
    if target == "FalconMambaForCausalLM":
        return transformers.FalconMambaConfig(
            time_step_rank=config.dt_rank, mixer_rms_eps=config.bcdt_eps, **common
        )
    return transformers.Mamba2Config(
        num_heads=config.n_heads,
        head_dim=config.head_dim,
        n_groups=config.n_groups,
        chunk_size=config.chunk_size,
        time_step_limit=config.time_step_limit,
        **common,
    )


def torch_state_dict(config, params):
    """Our parameter tree as the state dict of :func:`rebuild_target`'s transformers model (torch
    tensors, fp32)."""
    import torch

    t = lambda a: torch.from_numpy(np.asarray(a, dtype=np.float32).copy())  # noqa: E731
    nemotron = rebuild_target(config) == "NemotronHForCausalLM"
    base = "model." if nemotron else "backbone."
    sd = {base + "embeddings.weight": t(params["embedding"]), base + "norm_f.weight": t(params["norm_f"])}
    if "lm_head" in params:
        sd["lm_head.weight"] = t(params["lm_head"])
    elif nemotron:
        sd["lm_head.weight"] = t(params["embedding"])
    renames = {
        "mamba": (("conv_b", "conv1d.bias"), ("in_proj_b", "in_proj.bias"), ("out_proj_b", "out_proj.bias"),
                  ("A_log", "A_log"), ("D", "D")),
        "attention": (("q_proj", "q_proj.weight"), ("k_proj", "k_proj.weight"), ("v_proj", "v_proj.weight"),
                      ("o_proj", "o_proj.weight")),
        "mlp": (("up_proj", "up_proj.weight"), ("down_proj", "down_proj.weight"), ("up_b", "up_proj.bias"),
                ("down_b", "down_proj.bias")),
    }  # fmt: skip
    for i, (kind, layer) in enumerate(zip(config.kinds, params["layers"], strict=True)):
        p, m = f"{base}layers.{i}.", layer["mixer"]
        sd[p + "norm.weight"] = t(layer["norm"])
        p += "mixer."
        if kind in ("attention", "mlp"):
            for ours, theirs in renames[kind]:
                if ours in m:
                    sd[p + theirs] = t(m[ours]).T.contiguous() if m[ours].ndim == 2 else t(m[ours])
            continue
        sd[p + "in_proj.weight"] = t(m["in_proj"]).T.contiguous()
        sd[p + "conv1d.weight"] = t(m["conv_w"]).T.contiguous()[:, None, :]
        sd[p + "out_proj.weight"] = t(m["out_proj"]).T.contiguous()
        for ours, theirs in renames["mamba"]:
            if ours in m:
                sd[p + theirs] = t(m[ours])
        if config.version == 1:
            sd[p + "x_proj.weight"] = t(m["x_proj"]).T.contiguous()
            sd[p + "dt_proj.weight"] = t(m["dt_proj"]).T.contiguous()
            sd[p + "dt_proj.bias"] = t(m["dt_bias"])
        else:
            sd[p + "dt_bias"] = t(m["dt_bias"])
            sd[p + "norm.weight"] = t(m["norm_w"])
    return sd


def begins_with_embeddings(first_hidden, first_input) -> bool:
    """Whether transformers' first hidden state is the stream entering its first layer (the embeddings,
    multipliers applied) rather than that layer's output: they agree to :data:`SAME_TENSOR` (relative to
    the larger magnitude) only in the first case (a layer that changes nothing aside)."""
    a, b = np.asarray(first_hidden, np.float64), np.asarray(first_input, np.float64)
    if a.shape != b.shape:
        return False
    scale = max(np.abs(a).max(initial=0.0), np.abs(b).max(initial=0.0), 1e-30)
    return bool(np.abs(a - b).max(initial=0.0) <= SAME_TENSOR * scale)


def hidden_errors(hidden_states, residuals, first_input, n_ref_layers: int) -> tuple[list[float], bool]:
    """Each of transformers' hidden states against latim-jax's stream at the same depth, as relative
    errors (max abs difference over the reference's max magnitude), and whether the list began with the
    embeddings.

    ``hidden_states``: transformers' ``hidden_states`` (the last, the final norm's output, is skipped);
    ``residuals``: latim-jax's streams, (n_layers + 1, ...), residuals[i] entering sublayer i;
    ``first_input``: the stream entering the reference's first layer; ``n_ref_layers``: the reference's
    layers, each holding ``n_layers / n_ref_layers`` latim-jax sublayers (Bamba, Jamba: a mixer and a
    feed-forward). Whether the list begins with the embeddings or after the first layer is detected from
    ``first_input`` (:func:`begins_with_embeddings`); a count that fits neither is a ``UsageError``.
    """
    n_layers = len(residuals) - 1
    if n_ref_layers < 1 or n_layers % n_ref_layers:
        raise UsageError(
            f"check: transformers' model has {n_ref_layers} layers for latim-jax's {n_layers} sublayers "
            "(expected a divisor): cannot align their hidden states"
        )
    stride = n_layers // n_ref_layers
    first = begins_with_embeddings(hidden_states[0], first_input)
    skip = 0 if first else 1
    depths = [i + skip for i in range(len(hidden_states) - 1)]
    if depths and depths[-1] > n_ref_layers:
        raise UsageError(
            f"check: transformers returned {len(hidden_states)} hidden states for {n_ref_layers} layers "
            f"(expected at most {n_ref_layers + 2 - skip}, the final norm's output last, "
            f"{'the embeddings' if first else 'the first layer output'} first): cannot align them"
        )
    errors = []
    for r, depth in zip(hidden_states, depths, strict=False):
        r = np.asarray(r, np.float32)
        ours = np.asarray(residuals[depth * stride], np.float32)
        errors.append(float(np.abs(ours - r).max() / max(np.abs(r).max(), 1e-30)))
    return errors, first


def layer_list(ref):
    """The reference transformers model's list of decoder layers (``base_model.layers``)."""
    layers = getattr(ref.base_model, "layers", None)
    if layers is None or len(layers) == 0:
        raise UsageError(
            f"check: {type(ref).__name__} has no list of layers (base_model.layers) to align with"
        )
    return layers


def check_model(source, *, length: int = 16, batch: int = 1, seed: int = 0) -> dict:
    """Compare latim-jax and transformers on random tokens: max/mean logit error and per-layer
    hidden-state error (relative to each tensor's max magnitude). :func:`verdict` turns the report
    into PASS / FAIL against a tolerance (``latim-jax check --tolerance``, default 1e-4).

    The reference is made by :func:`reference_model` (a converted family checkpoint it cannot rebuild is
    a :class:`CheckpointError`); the report's ``hidden_states_begin`` says where transformers' list began
    ("embeddings" or "after layer 0", detected in this run)."""
    path = resolve(source)
    model = load(source, dtype="float32")
    ref, how = reference_model(path, model.config, model.params())  # refuses before importing torch
    import torch

    vocab = model.config.vocab_size_unpadded or model.config.vocab_size
    tokens = np.random.default_rng(seed).integers(0, vocab, (batch, length))
    layers = layer_list(ref)
    entering = []

    def grab(module, args, kwargs):
        entering.append((args[0] if args else kwargs["hidden_states"]).detach().float().numpy().copy())

    hook = layers[0].register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with torch.no_grad():
            out = ref(torch.from_numpy(tokens), output_hidden_states=True)
    finally:
        hook.remove()
    ours = model.forward(tokens)
    ref_logits = out.logits.float().numpy()
    err = np.abs(np.asarray(ours.logits) - ref_logits)
    scale = np.abs(ref_logits).max()
    hidden_states = [h.float().numpy() for h in out.hidden_states]
    hidden, first = hidden_errors(hidden_states, np.asarray(ours.residuals), entering[0], len(layers))
    return {
        "reference": how,
        "max_logit_error": float(err.max()),
        "mean_logit_error": float(err.mean()),
        "max_logit_error_relative": float(err.max() / max(scale, 1e-30)),
        "hidden_error_relative": hidden,
        "hidden_states_begin": "embeddings" if first else "after layer 0",
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
