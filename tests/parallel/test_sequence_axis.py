"""The forward with one prompt's length split over the mesh's "seq" axis equals one device's: 8
simulated CPU devices in a subprocess (the device count must be set before jax starts). Mamba-1,
Mamba-2 (chunks shorter than a shard, so chunk and shard boundaries both cross), a hybrid with
attention, MLP and experts, parallel blocks (Falcon-H1: Mamba-2 beside attention) and shared blocks
(Zamba2: a transformer block over [h; h^0] feeding Mamba-2), left padding across a shard boundary, a
length that "seq" does not divide. The delta-rule kinds and MLA, and the refusal of a kind without a
split: tests/parallel/test_sequence_delta.py; attribution over "seq": test_sequence_attribution.py."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

TOL = 2e-6  # max |split - one device| / max |one device| over real positions' logits (fp32)

SCRIPT = textwrap.dedent(
    """
    import os
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    import jax, numpy as np
    from jax.sharding import Mesh
    import latim_jax
    from latim_jax.model.config import MambaConfig
    from latim_jax.model.init import init_params

    TOL = %(tol)r
    CFG = {
        1: MambaConfig(version=1, d_model=16, n_layers=2, vocab_size=32, d_state=4, d_conv=4, proj_bias=True),
        # chunks of 10: shards of 24 (seq=8) and 48 (seq=4) both end inside a chunk
        2: MambaConfig(version=2, d_model=16, n_layers=2, vocab_size=32, d_state=4, d_conv=4, head_dim=4,
                       n_groups=2, chunk_size=10),
        "h": MambaConfig(version=2, d_model=16, n_layers=4, vocab_size=32, d_state=4, head_dim=4, n_groups=2,
                         chunk_size=10, layer_kinds=("mamba2", "attention", "mlp", "moe"), attn_heads=4,
                         attn_kv_heads=2, attn_head_dim=4, rope_theta=100.0, mlp_width=24, mlp_gated=True,
                         moe_experts=4, moe_top_k=2, moe_width=8, moe_shared_width=8),
    }
    blocks = dict(version=2, d_model=16, vocab_size=32, d_state=4, head_dim=4, n_groups=2, chunk_size=10,
                  attn_heads=2, attn_kv_heads=1, attn_head_dim=8, mlp_width=24, mlp_gated=True)
    CFG["parallel"] = MambaConfig(n_layers=3, layer_kinds=("parallel", "mlp", "parallel"), **blocks)
    CFG["shared"] = MambaConfig(n_layers=3, layer_kinds=("mamba2", "shared", "shared"), **blocks)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 32, (3, 190))  # 190: padded to 192 = 8 x 24 inside; 3 prompts on data=2
    mask = np.ones(tokens.shape, bool)
    mask[1, :30] = False  # left padding across the first shard boundary (24)
    devices = np.array(jax.devices())
    MESHES = {"seq=8": ((8,), ("seq",)), "data=2 x seq=4": ((2, 4), ("data", "seq")),
              "data=2 x seq=2 x model=2": ((2, 2, 2), ("data", "seq", "model"))}
    RUNS = [(1, "seq=8", "xla"), (1, "data=2 x seq=4", "pallas"), (2, "seq=8", "pallas"),
            (2, "data=2 x seq=4", "xla"), ("h", "seq=8", "xla"), ("h", "data=2 x seq=4", "xla"),
            ("h", "data=2 x seq=2 x model=2", "xla"), ("parallel", "data=2 x seq=2 x model=2", "xla"),
            ("shared", "seq=8", "xla")]
    real = mask[..., None]
    for name, mesh_name, impl in RUNS:
        params = init_params(CFG[name], 1)
        want = np.asarray(latim_jax.MambaLM(CFG[name], params)(tokens, mask=mask, impl="xla"), np.float64)
        shape, axes = MESHES[mesh_name]
        model = latim_jax.MambaLM(CFG[name], params)
        got = np.asarray(model(tokens, mask=mask, impl=impl, mesh=Mesh(devices.reshape(shape), axes)))
        assert got.shape == want.shape, (got.shape, want.shape)
        err = float(np.abs(np.where(real, got - want, 0)).max() / np.abs(np.where(real, want, 0)).max())
        print(f"REL {name} {mesh_name} {impl} {err:.2e}")
        assert err < TOL, (name, mesh_name, impl, err)

    print("OK")
    """
) % {"tol": TOL}


@pytest.mark.slow
def test_forward_split_over_sequence_axis_equals_one_device():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "OK" in out.stdout, out.stdout[-2000:]
