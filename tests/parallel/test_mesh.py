"""Attribution on a device mesh equals the single-device run: 8 simulated CPU devices in a subprocess
(the device count must be set before jax starts). Data-parallel, model-parallel and row-split runs,
with impl="xla" (XLA's SPMD partitioner) and impl="pallas" (interpret-mode kernels under shard_map)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import os
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    import jax, numpy as np
    import latim_jax
    from latim_jax.model.config import MambaConfig
    from latim_jax.model.init import init_params

    assert len(jax.devices()) == 8
    CFG = {
        # e = 32 channels and 8 heads of 4 (groups 2): both divide every model axis below
        1: MambaConfig(version=1, d_model=16, n_layers=2, vocab_size=32, d_state=4, d_conv=4, proj_bias=True),
        2: MambaConfig(version=2, d_model=16, n_layers=2, vocab_size=32, d_state=4, d_conv=3, head_dim=4,
                       n_groups=2, chunk_size=4),
        # a hybrid: Mamba-2, attention (GQA, rotary), MLP, experts
        "h": MambaConfig(version=2, d_model=16, n_layers=4, vocab_size=32, d_state=4, head_dim=4, n_groups=2,
                         chunk_size=4, layer_kinds=("mamba2", "attention", "mlp", "moe"), attn_heads=4,
                         attn_kv_heads=2, attn_head_dim=4, rope_theta=100.0, mlp_width=24, mlp_gated=True,
                         moe_experts=4, moe_top_k=2, moe_width=8, moe_shared_width=8),
        # Falcon-H1's parallel block (Mamba-2 beside attention) and an MLP
        "p": MambaConfig(version=2, d_model=16, n_layers=2, vocab_size=32, d_state=4, head_dim=4, n_groups=2,
                         chunk_size=4, layer_kinds=("parallel", "mlp"), attn_heads=4, attn_kv_heads=2,
                         attn_head_dim=4, rope_theta=100.0, mlp_width=24, mlp_gated=True,
                         ssm_norm="before_gate"),
        # Zamba2's shared layer (a transformer block on [h; h^0] feeding a Mamba-2's input) and a Mamba-2
        "s": MambaConfig(version=2, d_model=16, n_layers=2, vocab_size=32, d_state=4, head_dim=4, n_groups=2,
                         chunk_size=4, layer_kinds=("shared", "mamba2"), attn_heads=4, attn_kv_heads=2,
                         attn_head_dim=8, rope_theta=100.0, mlp_width=24, mlp_gated=True, mlp_bias=True),
        # Qwen3-Next's kinds: a Gated DeltaNet (a conv bias), gated q/k-normed attention, experts with a
        # gated shared expert
        "g": MambaConfig(version=2, d_model=16, n_layers=3, vocab_size=32,
                         layer_kinds=("gdn", "attention", "moe"), attn_heads=4, attn_kv_heads=2,
                         attn_head_dim=4, rope_theta=100.0, rope_dim=2,
                         attn_qk_norm=True, attn_output_gate=True, mlp_gated=True, moe_experts=4, moe_top_k=2,
                         moe_width=8, moe_shared_width=8, moe_shared_gate=True,
                         sections={"gdn": dict(k_heads=2, v_heads=4, k_dim=4, v_dim=4, chunk=4,
                                               conv_bias=True)}),
    }
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 32, (3, 10))  # 3 prompts: not a multiple of the data axis
    mask = np.ones((3, 10), bool)
    mask[1, :3] = False  # one left-padded prompt

    def rel(a, b):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))

    # (version, method, mesh (data, model), impl, batch): what each run exercises
    RUNS = [
        (2, "alti", (2, 4), "xla", "full"),      # data + model parallel, rows split, GSPMD forward
        (2, "l2", (2, 4), "pallas", "full"),     # the SSD kernel (groups gathered per head) + fused scores
        (1, "logit", (1, 8), "pallas", "long"),  # one long prompt: rows over 8 devices, scan channels split
        (1, "hidden_attention", (1, 8), "xla", "full"),  # minmax's range once, rows over 8 devices
        ("h", "alti", (2, 4), "xla", "full"),    # every hybrid kind, rows split
        ("h", "logit", (1, 8), "pallas", "long"),  # the kernel for the SSM, the tile loop for the rest
        ("p", "alti", (2, 4), "pallas", "full"),  # a parallel block's two halves, the Pallas scan inside
        ("s", "logit", (2, 4), "xla", "full"),   # a shared layer's two hops (h^0 beside the stream)
        ("g", "logit", (2, 4), "xla", "full"),   # the delta rule's M tiles and the gated attention, split
    ]
    for version, method, shape, impl, batch in RUNS:
        params = init_params(CFG[version], 1)
        if batch == "long":
            t, m = rng.integers(0, 32, (1, 24)), None
        else:
            t, m = tokens, mask
        alone = latim_jax.MambaLM(CFG[version], params)
        want = latim_jax.attribute(alone, t, method=method, mask=m, impl="xla")
        model = latim_jax.MambaLM(CFG[version], params)
        mesh = jax.make_mesh(shape, ("data", "model"))
        got = latim_jax.attribute(model, t, method=method, mask=m, impl=impl, mesh=mesh)
        assert got.scores.shape == want.scores.shape, (got.scores.shape, want.scores.shape)
        err = rel(got.scores, want.scores)
        assert err < 2e-5, (version, method, shape, impl, err)
        for key in want.extra:
            assert rel(got.extra[key], want.extra[key]) < 2e-5, key
        # the parameters read back in the checkpoint's order whatever the layout, bit for bit
        for a, b in zip(jax.tree.leaves(alone.params()), jax.tree.leaves(model.params()), strict=True):
            assert np.array_equal(np.asarray(a), np.asarray(b)), version
        w = model.layers[0].mixer.param("in_proj")[...]
        assert len(w.sharding.device_set) == 8
        if version == "g":  # a gdn layer declares no channel axis: replicated over "model"
            assert w.addressable_shards[0].data.shape == w.shape
        else:
            ssm = getattr(model.layers[0].mixer, "ssm", model.layers[0].mixer)  # alone or a composed part
            assert ssm.layout.shards == shape[1], (version, ssm.layout.shards)  # laid out for the model axis
            if shape[1] > 1:  # model-parallel: each device holds 1/model of in_proj's columns
                assert w.addressable_shards[0].data.shape[1] == w.shape[1] // shape[1]
        print(version, method, shape, impl, err, flush=True)
    # the model forward on a mesh
    model = latim_jax.MambaLM(CFG[2], init_params(CFG[2], 1))
    want = np.asarray(model(tokens, mask=mask))
    got = model(tokens, mask=mask, mesh=jax.make_mesh((2, 4), ("data", "model")))
    assert rel(np.asarray(got)[mask], want[mask]) < 1e-5
    # ... and inside jax.jit, the parameters passed as arguments with their shardings (what a pod user's
    # own jitted step does); the compiled program's collectives as benchmarks/bench_collectives.py reads them
    import sys
    from flax import nnx
    sys.path.insert(0, "benchmarks")
    from bench_collectives import collectives
    mesh = jax.make_mesh((1, 8), ("data", "model"))
    model = latim_jax.MambaLM(CFG[2], init_params(CFG[2], 1))
    latim_jax.model.sharding.shard(model, mesh)
    graphdef, state = nnx.split(model)
    step = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t, mesh=mesh))
    alone = latim_jax.MambaLM(CFG[2], init_params(CFG[2], 1))
    assert rel(step(state, tokens), np.asarray(alone(tokens))) < 1e-5
    found = collectives(step.lower(state, tokens).compile().as_text())
    assert found["all-reduce"]["count"] >= 2 and found["all-reduce"]["bytes"] > 0, found  # out_proj's sums
    # the channel-matched layout: model-parallel over 8, the compiled forward and attribute move no
    # activation between devices (no collective-permute / all-to-all: with in_proj cut in contiguous
    # column blocks they held 4-59 of them), and the forward sums about one residual stream per layer
    # (out_proj's partial sums; Mamba-1's x_proj and Mamba-2's group rms add (b, l, r+2n) / (b, l, g))
    from latim_jax.model.generate import prefill
    wide = {1: MambaConfig(version=1, d_model=32, n_layers=2, vocab_size=32, d_state=4),
            2: MambaConfig(version=2, d_model=32, n_layers=2, vocab_size=32, d_state=8, head_dim=8,
                           n_groups=2, chunk_size=8)}  # g 2 < 8 shards: each shard's group repeated
    x = np.random.default_rng(2).normal(size=(1, 48, 32)).astype(np.float32)
    for version, cfg in wide.items():
        params = init_params(cfg, 3)
        model = latim_jax.model.sharding.shard(latim_jax.MambaLM(cfg, params), mesh)
        assert model.layers[0].mixer.layout.shards == 8
        graphdef, state = nnx.split(model)
        programs = {
            "forward": lambda s, e: nnx.merge(graphdef, s).forward(inputs_embeds=e, mesh=mesh).residuals,
            "attribute": lambda s, e: latim_jax.attribute(
                nnx.merge(graphdef, s), inputs_embeds=e, method="alti", mesh=mesh, memory_limit=None).scores,
        }
        for what, fn in programs.items():
            found = collectives(jax.jit(fn).lower(state, x).compile().as_text())
            moved = found["collective-permute"]["count"] + found["all-to-all"]["count"]
            assert moved == 0, (version, what, found)
            if what == "forward":
                streams = found["all-reduce"]["bytes"] / (x.size * 4) / cfg.n_layers
                assert 1.0 <= streams < 1.4, (version, streams, found)
        alone = latim_jax.MambaLM(cfg, params)
        want = latim_jax.attribute(alone, inputs_embeds=x, method="alti")
        got = latim_jax.attribute(model, inputs_embeds=x, method="alti", mesh=mesh)
        assert rel(got.scores, want.scores) < 2e-5, version
        # generation on the laid-out model (its conv cache in the layout) equals the plain model's
        got, _ = prefill(model, tokens[:1])
        want, _ = prefill(alone, tokens[:1])
        assert rel(got, want) < 1e-5, version
        # on a mesh with another "model" axis the model is laid out again for it (same devices)
        other = jax.make_mesh((2, 4), ("data", "model"))
        latim_jax.attribute(model, tokens[:1], method="l2", mesh=other)
        assert model.layers[0].mixer.layout.shards == 4, version
        print("layout", version, "ok", flush=True)
    print("OK")
    """
)


def test_attribution_on_a_mesh_equals_one_device():
    env = dict(os.environ)
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=900, env=env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert "OK" in out.stdout
