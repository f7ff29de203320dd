"""The delta-rule kinds over the mesh's "seq" axis, and the seam that declares which kinds take it.

The forward of a Gated DeltaNet hybrid (gdn, MLP, attention) and of a KDA model with latent attention
(kda, mla) with one prompt's length split over "seq" equals one device's (8 simulated CPU devices in a
subprocess: the device count must be set before jax starts): chunks of 4, so each shard of 13 or 26
positions crosses several chunk boundaries, a length of 101 that neither 4 nor 8 divides (padded to 104
inside), left padding across shard boundaries; and the same run with the carried state dropped
(``sequence.delta_carry_in`` returning zeros) is far off, so the test sees the carry. The seam
(``LayerKind.splits_sequence``, read by ``check_sequence``) runs in process on an abstract mesh.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from jax.sharding import AbstractMesh

import latim_jax
from latim_jax.model.init import init_params
from latim_jax.model.kind import kind_of, register, registered, sequence_kinds
from latim_jax.model.sharding import check_sequence

TOL = 1e-5  # max |split - one device| / max |one device| over real positions' logits (fp32)

SCRIPT = textwrap.dedent(
    """
    import os
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    import jax, numpy as np
    from jax.sharding import Mesh
    import latim_jax
    from latim_jax.model.config import MambaConfig
    from latim_jax.model.init import init_params
    from latim_jax.parallel import sequence

    TOL = %(tol)r
    CFG = {
        "gdn": MambaConfig(
            version=2, d_model=16, n_layers=4, vocab_size=40, layer_kinds=("gdn", "mlp", "attention", "gdn"),
            attn_heads=2, attn_kv_heads=1, attn_head_dim=8, mlp_width=24, mlp_gated=True,
            sections={"gdn": dict(k_heads=2, v_heads=4, k_dim=8, v_dim=6, chunk=4, conv_bias=True)}),
        "kda": MambaConfig(
            version=2, d_model=16, n_layers=3, vocab_size=40, layer_kinds=("kda", "mla", "kda"),
            sections={"kda": dict(k_heads=2, v_heads=2, k_dim=8, v_dim=8, chunk=4, conv_bias=True),
                      "mla": dict(heads=2, kv_rank=4, nope_dim=4, shared_dim=2, v_dim=3)}),
    }
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 40, (3, 101))  # 101: padded to 104 = 8 x 13 = 4 x 26 inside
    mask = np.ones(tokens.shape, bool)
    mask[1, :30] = False  # left padding across the shard boundaries at 13 and 26
    real = mask[..., None]
    devices = np.array(jax.devices())
    MESHES = {"seq=8": ((8,), ("seq",)), "data=2 x seq=4": ((2, 4), ("data", "seq")),
              "seq=4 x model=2": ((4, 2), ("seq", "model"))}
    PARAMS = {name: init_params(cfg, 1) for name, cfg in CFG.items()}
    WANT = {name: np.asarray(latim_jax.MambaLM(CFG[name], PARAMS[name])(tokens, mask=mask, impl="xla"),
                             np.float64) for name in CFG}

    def rel(name, mesh_name):
        shape, axes = MESHES[mesh_name]
        model = latim_jax.MambaLM(CFG[name], PARAMS[name])
        got = np.asarray(model(tokens, mask=mask, impl="xla", mesh=Mesh(devices.reshape(shape), axes)))
        want = WANT[name]
        assert got.shape == want.shape, (got.shape, want.shape)
        return float(np.abs(np.where(real, got - want, 0)).max() / np.abs(np.where(real, want, 0)).max())

    for name in CFG:
        for mesh_name in MESHES:
            err = rel(name, mesh_name)
            print(f"REL {name} {mesh_name} {err:.2e}")
            assert err < TOL, (name, mesh_name, err)

    # the carried state matters: dropped, the split forward is far from one device's
    sequence.delta_carry_in = lambda final, transition, axis: jax.numpy.zeros_like(final)
    jax.clear_caches()
    for name in CFG:
        err = rel(name, "seq=8")
        print(f"REL without the carry {name} seq=8 {err:.2e}")
        assert err > 1e-2, (name, err)
    print("OK")
    """
) % {"tol": TOL}


@pytest.mark.slow
def test_delta_rule_kinds_split_over_sequence_axis_equal_one_device():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "OK" in out.stdout, out.stdout[-2000:]


def _model(*kinds, **fields):
    cfg = latim_jax.MambaConfig(
        version=2, d_model=8, n_layers=len(kinds), vocab_size=16, d_state=4, head_dim=4, layer_kinds=kinds,
        **fields,
    )  # fmt: skip
    return latim_jax.MambaLM(cfg, init_params(cfg, 3))


SEQ_MESH = AbstractMesh((8,), ("seq",))
DELTA = dict(
    sections={
        "gdn": dict(k_heads=1, v_heads=2, k_dim=4, v_dim=4, chunk=4),
        "kda": dict(k_heads=2, v_heads=2, k_dim=4, v_dim=4, chunk=4),
        "mla": dict(heads=2, kv_rank=4, nope_dim=4, shared_dim=2, v_dim=3),
    }
)


def test_the_kinds_that_take_the_seq_axis_are_declared_on_the_kind():
    declared = {name for name, kind in registered().items() if kind.splits_sequence}
    assert set(sequence_kinds()) == declared
    assert {
        "mamba1",
        "mamba2",
        "attention",
        "mlp",
        "moe",
        "gdn",
        "kda",
        "mla",
        "parallel",
        "shared",
    } <= declared
    check_sequence(_model("gdn", "kda", "mla", **DELTA), SEQ_MESH, sequence=True)  # accepted


def test_a_kind_that_does_not_declare_the_seq_axis_is_refused_by_name():
    shared = dict(attn_heads=2, attn_kv_heads=1, attn_head_dim=8, mlp_width=12, mlp_gated=True)
    model, kind = _model("mamba2", "shared", **shared), kind_of("shared")
    register(dataclasses.replace(kind, splits_sequence=False), replace=True)  # a kind without a split
    try:
        with pytest.raises(ValueError, match=r"layer 1 is a 'shared' layer, whose forward cannot split") as e:
            check_sequence(model, SEQ_MESH, sequence=True)
    finally:
        register(kind, replace=True)
    message = str(e.value)
    assert "kinds that can: " in message and "gdn, kda" in message and "shared," not in message
    check_sequence(model, SEQ_MESH, sequence=True)  # declared again: accepted
    with pytest.raises(ValueError, match="splits the forward"):  # a call that cannot split: refused
        check_sequence(_model("gdn", **DELTA), SEQ_MESH, sequence=False)
    check_sequence(model, AbstractMesh((1, 8), ("seq", "data")), sequence=True)  # a "seq" of 1: no split


def test_the_refusal_reads_the_registry():
    model, mlp = _model("mlp", mlp_width=12), kind_of("mlp")
    check_sequence(model, SEQ_MESH, sequence=True)
    register(dataclasses.replace(mlp, splits_sequence=False), replace=True)
    try:
        with pytest.raises(ValueError, match=r"'mlp' layer.*kinds that can: attention, gdn"):
            check_sequence(model, SEQ_MESH, sequence=True)
    finally:
        register(mlp, replace=True)
    assert kind_of("mlp").splits_sequence and np.isin("mlp", sequence_kinds())


class _Seq:
    """A stand-in execution context with a "seq" axis of ``size`` (split_length reads only its size)."""

    def __init__(self, size: int = 8):
        self.size = size

    def axis_size(self, axis):
        return self.size if axis == "seq" else 1


def test_each_shard_holds_the_largest_conv_halo_of_the_model_kinds():
    """split_length gives every "seq" shard at least K - 1 positions for the widest conv among the
    model's kinds (LayerKind.halo): a gdn conv of 7 taps in a model whose Mamba d_conv is 4 needs 6
    per shard, not 3 (the halo is read from one neighbour only)."""
    wide = {**DELTA["sections"], "gdn": {**DELTA["sections"]["gdn"], "conv": 7}}
    gdn_wide, gdn = (_model("gdn", "mlp", mlp_width=12, **f) for f in (dict(sections=wide), DELTA))
    assert gdn_wide.split_length(5, _Seq()) == 8 * 6
    assert gdn.split_length(5, _Seq()) == 8 * 3  # conv 4 (the default)
    assert _model("mamba2", d_conv=4).split_length(5, _Seq()) == 8 * 3
    assert _model("mamba2", d_conv=4).split_length(101, _Seq()) == 104  # long enough: next multiple
    assert _model("mlp", mlp_width=12).split_length(5, _Seq()) == 8  # no halo: one position per shard
    assert gdn_wide.split_length(5, _Seq(1)) == 5  # no split
