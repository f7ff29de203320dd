"""Tiny random transformers models of the hybrid families and Mamba variants, built from transformers'
own classes (never a hub download), with their norms, D, A_log and biases perturbed so that a skipped
term shows. Each builder takes the options a family's configurations vary in."""

from __future__ import annotations


def _perturb(model, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("norm_f.weight") or "layernorm" in name:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith("dt_bias") or name.endswith(".D") or "bias" in name:
                p.add_(0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith("A_log"):
                p.copy_(torch.rand(p.shape, generator=g) * 2 - 1)
    return model.eval()


def falcon_mamba(*, seed=0, vocab=48, d_model=16, n_layers=2, d_state=4, use_bias=False, tied=True, eps=1e-6):
    """transformers' FalconMambaForCausalLM (Mamba-1 with RMS-normalised dt input, B and C)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.FalconMambaConfig(
        vocab_size=vocab, hidden_size=d_model, state_size=d_state, num_hidden_layers=n_layers, expand=2,
        conv_kernel=4, use_bias=use_bias, tie_word_embeddings=tied, mixer_rms_eps=eps,
    )  # fmt: skip
    return _perturb(transformers.FalconMambaForCausalLM(cfg), seed)


def nemotron_h(
    *, seed=0, vocab=48, d_model=32, pattern="M*-M", heads=4, kv_heads=2, head_dim=8, mamba_heads=4,
    mamba_head_dim=8, n_groups=2, d_state=8, chunk_size=4, mlp_width=40, use_bias=False, mlp_bias=False,
    act="relu2", small_dt=True, experts=8, top_k=2, n_group=2, topk_group=1, scale=2.5, norm_topk=True,
    latent=None,
):  # fmt: skip
    """transformers' NemotronHForCausalLM with the layer pattern ``pattern`` (M Mamba-2, * attention, -
    MLP), grouped-query attention and grouped B/C by default. ``small_dt``: the first head of every Mamba
    layer gets softplus(dt + dt_bias) far below time_step_min, so the family's dt floor is exercised."""
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.NemotronHConfig(
        vocab_size=vocab, hidden_size=d_model, hybrid_override_pattern=pattern, num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=head_dim, intermediate_size=mlp_width,
        mamba_num_heads=mamba_heads, mamba_head_dim=mamba_head_dim, n_groups=n_groups,
        ssm_state_size=d_state, conv_kernel=4, chunk_size=chunk_size, use_bias=use_bias, mlp_bias=mlp_bias,
        mlp_hidden_act=act, n_routed_experts=experts, num_experts_per_tok=top_k, n_group=n_group,
        topk_group=topk_group, moe_intermediate_size=24, moe_shared_expert_intermediate_size=36,
        routed_scaling_factor=scale, norm_topk_prob=norm_topk, moe_latent_size=latent,
    )  # fmt: skip
    model = _perturb(transformers.NemotronHForCausalLM(cfg), seed)
    with torch.no_grad():  # the choice-only correction bias (a buffer, zero at init)
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(0.1 * torch.randn(b.shape, generator=torch.Generator().manual_seed(seed)))
    if small_dt:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("dt_bias"):
                    p[0] = -12.0
    return model


def bamba(
    *, seed=0, vocab=48, d_model=32, n_layers=3, attn=(1,), heads=4, kv_heads=2, mamba_heads=8,
    n_groups=2, d_state=8, chunk_size=8, mlp_width=40, attention_bias=False, mlp_bias=False,
    proj_bias=False, tied=False, rope_fraction=None,
):  # fmt: skip
    """transformers' BambaForCausalLM: Mamba-2 layers, attention at ``attn``, a SwiGLU MLP in every layer,
    rotary on half of each head unless ``rope_fraction`` says otherwise."""
    import torch
    import transformers

    torch.manual_seed(seed)
    rope = {"rope_type": "default", "rope_theta": 1000.0}
    if rope_fraction is not None:
        rope["partial_rotary_factor"] = rope_fraction
    cfg = transformers.BambaConfig(
        vocab_size=vocab, hidden_size=d_model, num_hidden_layers=n_layers, attn_layer_indices=list(attn),
        num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=mlp_width,
        mamba_n_heads=mamba_heads, mamba_d_head=2 * d_model // mamba_heads, mamba_n_groups=n_groups,
        mamba_d_state=d_state, mamba_chunk_size=chunk_size, attention_bias=attention_bias, mlp_bias=mlp_bias,
        mamba_proj_bias=proj_bias, tie_word_embeddings=tied, rope_parameters=rope,
    )  # fmt: skip
    return _perturb(transformers.BambaForCausalLM(cfg), seed)


def granite(
    *, seed=0, vocab=48, d_model=32, layer_types=("mamba", "attention", "mamba"), heads=4, kv_heads=2,
    mamba_heads=8, n_groups=2, d_state=8, chunk_size=8, experts=4, top_k=2, rope=True, tied=True,
    embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=1.5, logits_scaling=6.0,
):  # fmt: skip
    """transformers' GraniteMoeHybridForCausalLM (Granite-4.0-H): Mamba-2 / attention mixers, each
    followed by routed experts plus a shared SwiGLU MLP (``experts=0``: the shared MLP alone), with the
    family's four multipliers."""
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.GraniteMoeHybridConfig(
        vocab_size=vocab, hidden_size=d_model, num_hidden_layers=len(layer_types),
        layer_types=list(layer_types),
        num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=24,
        shared_intermediate_size=40, num_local_experts=experts, num_experts_per_tok=top_k,
        mamba_n_heads=mamba_heads, mamba_d_head=2 * d_model // mamba_heads, mamba_n_groups=n_groups,
        mamba_d_state=d_state, mamba_chunk_size=chunk_size,
        position_embedding_type="rope" if rope else "nope",
        tie_word_embeddings=tied, embedding_multiplier=embedding_multiplier,
        residual_multiplier=residual_multiplier, attention_multiplier=attention_multiplier,
        logits_scaling=logits_scaling,
    )  # fmt: skip
    return _perturb(transformers.GraniteMoeHybridForCausalLM(cfg), seed)


def jamba(
    *, seed=0, vocab=48, d_model=32, n_layers=4, attn=(2, 0), experts=(2, 1), n_experts=4, top_k=2,
    heads=4, kv_heads=2, d_state=8, proj_bias=False, tied=False,
):  # fmt: skip
    """transformers' JambaForCausalLM: Mamba-1 with weighted dt/B/C norms, attention every ``attn`` =
    (period, offset) layers, experts every ``experts`` layers (a SwiGLU MLP elsewhere)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.JambaConfig(
        vocab_size=vocab, hidden_size=d_model, num_hidden_layers=n_layers, attn_layer_period=attn[0],
        attn_layer_offset=attn[1], expert_layer_period=experts[0], expert_layer_offset=experts[1],
        num_experts=n_experts, num_experts_per_tok=top_k, num_attention_heads=heads,
        num_key_value_heads=kv_heads, intermediate_size=40, mamba_d_state=d_state, mamba_proj_bias=proj_bias,
        tie_word_embeddings=tied,
    )  # fmt: skip
    return _perturb(transformers.JambaForCausalLM(cfg), seed)


def falcon_h1(
    *, seed=0, vocab=48, d_model=32, n_layers=2, heads=4, kv_heads=2, mamba_heads=4, d_ssm=48, n_groups=2,
    d_state=8, chunk_size=8, rms_norm=True, norm_before_gate=True, mamba_proj_bias=False,
    projectors_bias=False, attention_bias=False, mlp_bias=False, tied=False, multipliers=True, head_dim=None,
):  # fmt: skip
    """transformers' FalconH1ForCausalLM: every layer a parallel block (Mamba-2 of width ``d_ssm`` beside
    GQA attention with rotary embeddings) then a SwiGLU MLP; ``multipliers``: every mu-P multiplier set
    to a distinct value other than 1 (else all 1). ``d_ssm`` None: the SSM width is mamba_expand * d;
    ``head_dim``: the attention's, when not d / heads."""
    import torch
    import transformers

    torch.manual_seed(seed)
    m = {}
    if multipliers:
        m = dict(
            lm_head_multiplier=0.7, embedding_multiplier=3.0, mlp_multipliers=[1.3, 0.6], key_multiplier=4.0,
            attention_out_multiplier=0.9, attention_in_multiplier=1.2,
            ssm_multipliers=[0.5, 1.5, 0.75, 1.25, 2.0], ssm_in_multiplier=1.1, ssm_out_multiplier=0.85,
        )  # fmt: skip
    cfg = transformers.FalconH1Config(
        vocab_size=vocab, hidden_size=d_model, num_hidden_layers=n_layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, intermediate_size=40, mamba_d_ssm=d_ssm, mamba_n_heads=mamba_heads,
        mamba_n_groups=n_groups, mamba_d_state=d_state, mamba_chunk_size=chunk_size,
        mamba_rms_norm=rms_norm, mamba_norm_before_gate=norm_before_gate, mamba_proj_bias=mamba_proj_bias,
        projectors_bias=projectors_bias, attention_bias=attention_bias, mlp_bias=mlp_bias,
        tie_word_embeddings=tied, rope_parameters={"rope_type": "default", "rope_theta": 1000.0}, **m,
        **({} if head_dim is None else {"head_dim": head_dim}),
    )  # fmt: skip
    model = _perturb(transformers.FalconH1ForCausalLM(cfg), seed)
    with torch.no_grad():  # in_proj at std 0.02 leaves the SSM's output second order (x * SiLU(z)) beside
        for name, p in model.named_parameters():  # the attention's: raise it so that both halves count
            if name.endswith("mamba.in_proj.weight"):
                p.mul_(20.0)
    return model


def zamba2(
    *, seed=0, vocab=48, d_model=32, types="MSMSS", heads=4, kv_heads=4, mamba_heads=4, n_groups=2, d_state=8,
    chunk_size=8, mem_blocks=2, adapters=True, rope=True, bias=False, act="gelu", tied=True, mlp_width=40,
):  # fmt: skip
    """transformers' Zamba2ForCausalLM with the layer types ``types`` (M a Mamba-2 layer, S a hybrid layer:
    the shared transformer block feeding that layer's Mamba-2), ``mem_blocks`` tied blocks, per-layer
    adapters on q, k, v (``adapters``) and always on the MLP's gate|up (perturbed away from zero so that
    they count), rotary on the shared attention (``rope``)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    names = {"M": "mamba", "S": "hybrid"}
    cfg = transformers.Zamba2Config(
        vocab_size=vocab, hidden_size=d_model, num_hidden_layers=len(types),
        layers_block_type=[names[t] for t in types], mamba_d_state=d_state, n_mamba_heads=mamba_heads,
        mamba_ngroups=n_groups, chunk_size=chunk_size, num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=mlp_width, num_mem_blocks=mem_blocks, use_shared_attention_adapter=adapters,
        adapter_rank=4, use_mem_rope=rope, rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
        hidden_act=act, add_bias_linear=bias, tie_word_embeddings=tied,
    )  # fmt: skip
    model = _perturb(transformers.Zamba2ForCausalLM(cfg), seed)
    g = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():  # adapters and the shared linear start near zero: raise them so that they count
        for name, p in model.named_parameters():
            if "adapter_list" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith(".linear.weight"):
                p.mul_(10.0)
    return model


def qwen3_next(
    *, seed=0, vocab=48, d_model=16, n_layers=4, interval=2, k_heads=2, v_heads=4, k_dim=8, v_dim=6,
    heads=2, kv_heads=1, head_dim=8, experts=4, top_k=2, mlp_only=(1,), norm_topk=True, tied=False,
    rope_fraction=0.25,
):  # fmt: skip
    """transformers' Qwen3NextForCausalLM: Gated DeltaNet layers with a full (gated, q/k-normed, partially
    rotary) attention every ``interval``, routed experts with a sigmoid-gated shared expert, a SwiGLU MLP
    at ``mlp_only``; the zero-centred norms, the gated norm, dt_bias and the router perturbed."""
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.Qwen3NextConfig(
        vocab_size=vocab, hidden_size=d_model, num_hidden_layers=n_layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=head_dim, intermediate_size=24, linear_num_key_heads=k_heads,
        linear_num_value_heads=v_heads, linear_key_head_dim=k_dim, linear_value_head_dim=v_dim,
        num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=12,
        shared_expert_intermediate_size=10, mlp_only_layers=list(mlp_only), norm_topk_prob=norm_topk,
        tie_word_embeddings=tied, full_attention_interval=interval,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": rope_fraction},
    )  # fmt: skip
    model = transformers.Qwen3NextForCausalLM(cfg)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                offset = 1.0 if "linear_attn.norm" in name else 0.0  # the gated norm scales by w, not 1 + w
                p.copy_(offset + 0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith("dt_bias"):
                p.add_(0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith(("mlp.gate.weight", "experts.gate_up_proj", "experts.down_proj")):
                p.normal_(0, 0.3, generator=g)
    return model.eval()


def qwen3_5(
    *, seed=0, moe=False, vocab=48, d_model=16, n_layers=4, interval=2, k_heads=2, v_heads=4, k_dim=8,
    v_dim=6, heads=2, kv_heads=1, head_dim=8, tied=False,
):  # fmt: skip
    """transformers' Qwen3.5 text model (Qwen3_5ForCausalLM; ``moe``: Qwen3_5MoeForCausalLM): Qwen3-Next's
    layers with the Gated DeltaNet's projections stored apart (in_proj_qkv, in_proj_z, in_proj_b,
    in_proj_a); the norms, dt_bias and the router perturbed."""
    import torch
    import transformers

    torch.manual_seed(seed)
    kw = dict(
        vocab_size=vocab, hidden_size=d_model, num_hidden_layers=n_layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=head_dim, intermediate_size=24, linear_num_key_heads=k_heads,
        linear_num_value_heads=v_heads, linear_key_head_dim=k_dim, linear_value_head_dim=v_dim,
        tie_word_embeddings=tied,
        layer_types=["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n_layers)],
    )  # fmt: skip
    if moe:
        cfg = transformers.Qwen3_5MoeTextConfig(
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=12,
            shared_expert_intermediate_size=10, **kw,
        )  # fmt: skip
        model = transformers.Qwen3_5MoeForCausalLM(cfg)
    else:
        model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**kw))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                offset = 1.0 if "linear_attn.norm" in name else 0.0
                p.copy_(offset + 0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith("dt_bias"):
                p.add_(0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith(("mlp.gate.weight", "experts.gate_up_proj", "experts.down_proj")):
                p.normal_(0, 0.3, generator=g)
    return model.eval()


def kimi_linear(
    *, seed=0, vocab=48, d_model=16, layer_types=("linear_attention", "full_attention", "linear_attention"),
    mlp_types=("dense", "sparse", "sparse"), heads=2, head_dim=8, q_rank=12, experts=4, top_k=2, groups=2,
    topk_group=1, tied=False, bias=False,
):  # fmt: skip
    """transformers' KimiLinearForCausalLM: Kimi Delta Attention layers and latent attention (a query
    latent unless ``q_rank`` is None), a dense MLP then sigmoid-routed experts in groups with a correction
    bias and a shared expert; the norms, dt_bias, A_log, the router and its bias perturbed."""
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.KimiLinearConfig(
        vocab_size=vocab, hidden_size=d_model, num_hidden_layers=len(layer_types), num_attention_heads=heads,
        num_key_value_heads=heads, q_lora_rank=q_rank, kv_lora_rank=8, qk_nope_head_dim=6, qk_rope_head_dim=4,
        v_head_dim=5, linear_num_heads=2, linear_head_dim=head_dim, intermediate_size=24,
        moe_intermediate_size=12,
        num_local_experts=experts, num_experts_per_tok=top_k, n_group=groups, topk_group=topk_group,
        layer_types=list(layer_types), mlp_layer_types=list(mlp_types), tie_word_embeddings=tied,
        attention_bias=bias, pad_token_id=None, bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    model = transformers.KimiLinearForCausalLM(cfg)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith(("dt_bias", "A_log")):
                p.add_(0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith(("gate.weight", "experts.gate_up_proj", "experts.down_proj")):
                p.normal_(0, 0.3, generator=g)
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
    return model.eval()


def olmo_hybrid(
    *, seed=0, vocab=48, d_model=16, layer_types=("linear_attention", "full_attention", "linear_attention"),
    k_heads=2, v_heads=4, k_dim=8, v_dim=6, heads=2, kv_heads=1, neg_eigval=True, rope=True, tied=False,
):  # fmt: skip
    """transformers' OlmoHybridForCausalLM: pre-norm Gated DeltaNet layers (q, k, v, gate, a, b projected
    apart; beta in (0, 2) with ``neg_eigval``) and post-norm attention layers (full-width q/k norms,
    rotary unless ``rope`` is False: NoPE), a SwiGLU MLP in every layer; every norm, dt_bias and the
    gated norm perturbed."""
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.OlmoHybridConfig(
        vocab_size=vocab, hidden_size=d_model, intermediate_size=24, num_hidden_layers=len(layer_types),
        num_attention_heads=heads, num_key_value_heads=kv_heads, layer_types=list(layer_types),
        linear_num_key_heads=k_heads, linear_num_value_heads=v_heads, linear_key_head_dim=k_dim,
        linear_value_head_dim=v_dim, linear_allow_neg_eigval=neg_eigval, tie_word_embeddings=tied,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4 if rope else None},
        pad_token_id=None, bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    model = transformers.OlmoHybridForCausalLM(cfg)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith("dt_bias"):
                p.add_(0.3 * torch.randn(p.shape, generator=g))
    return model.eval()


BUILDERS = {
    "zamba2": zamba2,
    "falcon_h1": falcon_h1,
    "jamba": jamba,
    "granitemoehybrid": granite,
    "bamba": bamba,
    "falcon_mamba": falcon_mamba,
    "nemotron_h": nemotron_h,
    "qwen3_next": qwen3_next,
    "qwen3_5": qwen3_5,
    "kimi_linear": kimi_linear,
    "olmo_hybrid": olmo_hybrid,
}
