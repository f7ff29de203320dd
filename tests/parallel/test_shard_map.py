"""Kernels and attribution inside jax.shard_map over 4 fake CPU devices (own process: the device count
must be set before jax starts)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from latim_jax.kernels import dispatch
    from latim_jax.parallel.context import resolve

    mesh = jax.make_mesh((4,), ("b",))
    rng = np.random.default_rng(0)
    b, l, h, p, g, n = 4, 13, 2, 8, 1, 8
    x = jnp.asarray(rng.normal(size=(b, l, h, p)), jnp.float32)
    dt = jnp.asarray(rng.uniform(0.01, 0.2, size=(b, l, h)), jnp.float32)
    A = -jnp.asarray(rng.uniform(0.5, 2, size=(h,)), jnp.float32)
    B = jnp.asarray(rng.normal(size=(b, l, g, n)), jnp.float32)
    C = jnp.asarray(rng.normal(size=(b, l, g, n)), jnp.float32)
    D = jnp.ones((h,), jnp.float32)
    want = dispatch.ssd(x, dt, A, B, C, D, 8, ctx=resolve("xla"))[0]

    def local(x, dt, B, C):
        return dispatch.ssd(x, dt, A, B, C, D, 8, ctx=resolve("pallas"))[0]

    spec = P("b")
    f = jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, spec, spec), out_specs=spec, check_vma=False)
    args = [jax.device_put(a, NamedSharding(mesh, spec)) for a in (x, dt, B, C)]
    got = jax.jit(f)(*args)
    assert len(got.sharding.device_set) == 4
    err = float(jnp.abs(got - want).max() / jnp.abs(want).max())
    assert err < 1e-5, err

    import latim_jax
    from latim_jax.model.init import init_params
    cfg = latim_jax.MambaConfig(version=1, d_model=16, n_layers=2, vocab_size=32, d_state=4)
    model = latim_jax.MambaLM(cfg, init_params(cfg, 0))
    toks = jax.device_put(jnp.asarray(rng.integers(0, 32, (4, 7))), NamedSharding(mesh, P("b")))
    assert resolve("pallas").kernels and not resolve("auto").kernels  # CPU: "auto" would be XLA
    for method in ("l2", "alti"):  # the selective-scan kernel and the fused score kernel (interpret mode)
        ref = latim_jax.attribute(model, toks, method=method, impl="xla").scores
        g = jax.shard_map(lambda t: latim_jax.attribute(model, t, method=method, impl="pallas").scores,
                          mesh=mesh, in_specs=P("b"), out_specs=P("b"), check_vma=False)
        jaxpr = str(jax.make_jaxpr(g)(toks))
        assert "pallas_call" in jaxpr and "shard_map" in jaxpr
        got = jax.jit(g)(toks)
        err = float(jnp.abs(got - ref).max() / jnp.abs(ref).max())
        assert err < 2e-5, (method, err)
    print("OK")
    """
)


def test_kernel_and_attribution_under_shard_map():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "OK" in out.stdout
