"""attribute with one prompt's length split over the mesh's "seq" axis equals one device's: 8 simulated
CPU devices in a subprocess (the device count must be set before jax starts).

Every layer kind that splits the forward (Mamba-1; Mamba-2 beside attention, MLP and experts; parallel
and shared blocks; Gated DeltaNet with attention; KDA with latent attention), every method (l2, l1,
alti, logit with its rollout maps, hidden attention minmax and abs, grad_input), a row subset and every
row, top_k, the gradient through the split score stage, the fused Pallas kernel (interpreted) on each
device's window, left padding across shard boundaries, a length that "seq" does not divide, and meshes
that mix "seq" with "data" and "model". Each layer's score tiles are split by source columns: the test
records the column window every scored layer ran on (l / D per device), so a path that quietly scored
every column on every device fails, and alti's row sums cross the shards (a psum), so dropping that sum
fails the equality. It also records the length of the factors the tiles read: the sequence-local kinds
(all but the shared block) score from the compacted window of latim_jax.latim.source_window (their own
sources, the halo, the asked rows), so a path that gathered them whole fails; rows before, inside and
after each window, in its halo and in the padding are all compared.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

TOL = 1e-5  # max |split - one device| / max |one device| of the scores and extras (fp32)

SCRIPT = textwrap.dedent(
    """
    import os
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    import jax, numpy as np
    from jax.sharding import Mesh
    import latim_jax
    from latim_jax.latim import scores as scores_mod
    from latim_jax.model.config import MambaConfig
    from latim_jax.model.init import init_params

    TOL = %(tol)r
    small = dict(version=2, d_model=16, vocab_size=32, d_state=4, head_dim=4, n_groups=2, chunk_size=10)
    attn = dict(attn_heads=2, attn_kv_heads=1, attn_head_dim=8, mlp_width=24, mlp_gated=True)
    CFG = {
        "mamba1": MambaConfig(version=1, d_model=16, n_layers=2, vocab_size=32, d_state=4, proj_bias=True),
        "hybrid": MambaConfig(n_layers=4, layer_kinds=("mamba2", "attention", "mlp", "moe"), rope_theta=100.0,
                              moe_experts=4, moe_top_k=2, moe_width=8, moe_shared_width=8, **small, **attn),
        "blocks": MambaConfig(n_layers=3, layer_kinds=("parallel", "shared", "mamba2"), **small, **attn),
        "gdn": MambaConfig(version=2, d_model=16, n_layers=3, vocab_size=32,
                           layer_kinds=("gdn", "attention", "gdn"), **attn,
                           sections={"gdn": dict(k_heads=2, v_heads=4, k_dim=8, v_dim=6, chunk=4,
                                                 conv_bias=True)}),
        "kda": MambaConfig(version=2, d_model=16, n_layers=2, vocab_size=32, layer_kinds=("kda", "mla"),
                           sections={"kda": dict(k_heads=2, v_heads=2, k_dim=8, v_dim=8, chunk=4),
                                     "mla": dict(heads=2, kv_rank=4, nope_dim=4, shared_dim=2, v_dim=3)}),
    }
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 32, (2, 93))  # 93: padded to 96 = 8 x 12 = 4 x 24 inside
    mask = np.ones(tokens.shape, bool)
    mask[1, :30] = False  # left padding across the shard boundaries at 12 and 24
    devices = np.array(jax.devices())
    MESHES = {"seq=8": ((8,), ("seq",)), "data=2 x seq=4": ((2, 4), ("data", "seq")),
              "data=2 x seq=2 x model=2": ((2, 2, 2), ("data", "seq", "model"))}
    ROWS = [5, 40, 92]  # in the first shard, across the padding, the last token
    RUNS = [  # (model, mesh, method, options): each kind and each method at least once (CI time: not all)
        ("mamba1", "seq=8", "alti", {}), ("mamba1", "data=2 x seq=4", "hidden_attention", {}),
        ("hybrid", "data=2 x seq=2 x model=2", "alti", {"rows": None}),
        ("hybrid", "data=2 x seq=4", "grad_input", {}), ("hybrid", "seq=8", "l1", {"top_k": 4}),
        ("hybrid", "seq=8", "hidden_attention", {"aggregation": "abs"}),
        ("blocks", "data=2 x seq=2 x model=2", "logit", {}),
        ("gdn", "seq=8", "logit", {"rows": None}), ("gdn", "data=2 x seq=2 x model=2", "l2", {}),
        ("kda", "data=2 x seq=4", "alti", {}),
        ("mamba1", "seq=8", "logit", {"impl": "pallas", "rows": [40, 92]}),  # the fused kernel, interpreted
    ]

    windows, lengths = [], []  # the column windows the score stage ran on, and its factors' lengths
    blocked_scores = scores_mod.blocked_scores
    def spy(f, *args, columns=None, **kw):
        windows.append(None if columns is None else columns[1])
        lengths.append(f.length)
        return blocked_scores(f, *args, columns=columns, **kw)
    scores_mod.blocked_scores = spy
    from latim_jax.kernels import fused_scores
    kernel_lengths, fused = [], fused_scores.fused_layer_scores
    def kernel_spy(f, *args, **kw):
        kernel_lengths.append(f.length)
        return fused(f, *args, **kw)
    fused_scores.fused_layer_scores = kernel_spy

    def rel(a, b):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert a.shape == b.shape, (a.shape, b.shape)
        return float(np.abs(a - b).max() / max(np.abs(a).max(), 1e-30))

    params = {name: init_params(cfg, 1) for name, cfg in CFG.items()}
    for name, mesh_name, method, options in RUNS:
        options = {"rows": ROWS, "impl": "xla", **options}
        run = lambda **kw: latim_jax.attribute(latim_jax.MambaLM(CFG[name], params[name]), tokens,
                                               method=method, mask=mask, **options, **kw)
        want = run()
        shape, axes = MESHES[mesh_name]
        del windows[:], lengths[:], kernel_lengths[:]
        got = run(mesh=Mesh(devices.reshape(shape), axes))
        errs = {"scores": rel(want.scores, got.scores)}
        for key, value in want.extra.items():
            if np.asarray(value).dtype.kind == "f":
                errs[key] = rel(value, got.extra[key])
            else:
                assert np.array_equal(value, got.extra[key]), (name, method, key)
        if method == "logit" and options["rows"] is None:  # the rollout of the split maps
            errs["rollout"] = rel(want.rollout(), got.rollout())
        d = dict(zip(axes, shape))["seq"]
        print(f"REL {name} {mesh_name} {method} {options} {errs} windows {sorted(set(windows))}", flush=True)
        assert max(errs.values()) < TOL, (name, mesh_name, method, errs)
        if options["impl"] == "pallas":  # the fused kernel on each compacted window, no XLA tiles
            assert kernel_lengths and max(kernel_lengths) < 96 and not windows, (kernel_lengths, windows)
        elif method in ("l2", "l1", "alti", "logit"):  # scored by source columns, l / D per device
            assert windows and set(windows) == {96 // d}, (name, method, windows)
            # the sequence-local kinds score from their own sources, halo and asked rows (compacted to
            # 1 + w + halo + rows slots, or whole chunks of them for the delta rule, never the
            # layer's 96 here); shared blocks are gathered whole (96)
            compact = [n for n in lengths if n != 96]
            assert compact and (96 in lengths) == (name == "blocks"), (name, lengths)

    # differentiated through the split score stage (the compacted windows' psums and ppermutes
    # transpose): the gradient of a loss on the alti scores equals one device's
    import jax.numpy as jnp
    from latim_jax.model.sharding import shard
    hybrid = latim_jax.MambaLM(CFG["hybrid"], params["hybrid"])
    embeds = jax.random.normal(jax.random.key(0), (1, 96, 16))
    def loss(e, mesh):
        s = latim_jax.attribute(hybrid, inputs_embeds=e, method="alti", rows=[5, 40, 95], impl="xla",
                                layers=[0, 1], mesh=mesh, memory_limit=None).scores
        return jnp.sum(s * s)
    want = jax.grad(loss)(embeds, None)
    seq8 = Mesh(devices, ("seq",))
    shard(hybrid, seq8)  # laid out before the trace (attribute would lay it out in place)
    err = rel(want, jax.grad(loss)(embeds, seq8))
    print("REL grad", err, flush=True)
    assert err < TOL, err

    # the memory check is per device on a mesh: a limit between the per-device and the one-device
    # estimates refuses the call on one device and lets the seq-split call run
    from latim_jax.latim import memory
    m1 = latim_jax.MambaLM(CFG["mamba1"], params["mamba1"])
    whole = memory.estimate(m1, 2, 93, method="l2").total
    per = memory.estimate(m1, 2, 96, method="l2", split={"seq": 8}).total
    limit = (per + whole) // 2
    assert per < limit < whole, (per, whole)
    try:
        latim_jax.attribute(m1, tokens, method="l2", mask=mask, impl="xla", memory_limit=limit)
        raise AssertionError("one device was not refused")
    except memory.InsufficientMemoryError:
        pass
    latim_jax.attribute(m1, tokens, method="l2", mask=mask, impl="xla", memory_limit=limit,
                        mesh=Mesh(devices, ("seq",)))
    print("OK")
    """
) % {"tol": TOL}


@pytest.mark.slow
def test_attribution_split_over_sequence_axis_equals_one_device():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:] + out.stdout[-2000:]
    assert "OK" in out.stdout, out.stdout[-2000:]
