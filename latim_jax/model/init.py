"""Random parameter initialisation (the reference's default scheme) for training from scratch."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from latim_jax.model.config import MambaConfig, param_shapes


def _uniform(key, shape, bound):
    return jax.random.uniform(key, shape, jnp.float32, -bound, bound)


def _dt_bias(key, size, dt_min=1e-3, dt_max=1e-1, floor=1e-4):
    """softplus^{-1} of Delta drawn log-uniformly in [dt_min, dt_max]."""
    dt = jnp.exp(jax.random.uniform(key, (size,)) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
    dt = jnp.maximum(dt, floor)
    return dt + jnp.log(-jnp.expm1(-dt))


# attention and MLP sublayers' matrices (fan-in first) and biases
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "gate_proj", "down_proj", "router",
                "shared_up", "shared_gate", "shared_down", "latent_in", "latent_out",
                "shared_out")  # fmt: skip
_STACKED = ("experts_up", "experts_gate", "experts_down")  # (E, fan_in, fan_out)
_BIASES = ("q_b", "k_b", "v_b", "o_b", "up_b", "gate_b", "down_b", "shared_up_b", "shared_gate_b",
           "shared_down_b", "latent_in_b", "latent_out_b")  # fmt: skip


def init_params(config: MambaConfig, seed: int = 0) -> dict:
    """A parameter tree (fp32) for ``config`` with the reference's default random initialisation.

    Linear weights U(+-1/sqrt(fan_in)); conv U(+-1/sqrt(k)); embedding N(0, 0.02); Mamba-1
    A_log = log(1..n) per channel; Mamba-2 A_log = log U(1, 16) per head; D = 1; norms = 1;
    Delta biases give Delta log-uniform in [1e-3, 1e-1].
    """
    shapes = param_shapes(config)
    per_layer = 32 if "shared" in config.kinds else 16  # <= 26 keys for a shared layer, <= 12 for the rest
    keys = iter(jax.random.split(jax.random.PRNGKey(seed), 4 + per_layer * config.n_layers))
    c = config
    out = {
        "embedding": 0.02 * jax.random.normal(next(keys), shapes["embedding"]),
        "norm_f": jnp.ones(shapes["norm_f"]),
        "layers": [],
    }
    if "lm_head" in shapes:
        out["lm_head"] = 0.02 * jax.random.normal(next(keys), shapes["lm_head"])
    for layer_shapes in shapes["layers"]:
        m = {}
        for name, shape in layer_shapes["mixer"].items():
            key = next(keys)
            if name in ("in_proj", "x_proj", "dt_proj", "out_proj") or name in _PROJECTIONS:
                m[name] = _uniform(key, shape, 1.0 / math.sqrt(shape[0]))
            elif name == "conv_w":
                m[name] = _uniform(key, shape, 1.0 / math.sqrt(c.d_conv))
            elif name in _STACKED:
                m[name] = _uniform(key, shape, 1.0 / math.sqrt(shape[1]))
            elif name == "router_bias":
                m[name] = jnp.zeros(shape)
            elif name in ("conv_b", "in_proj_b", "out_proj_b") or name in _BIASES:
                m[name] = _uniform(key, shape, 1.0 / math.sqrt(c.d_conv if name == "conv_b" else shape[0]))
            elif name == "dt_bias":
                m[name] = _dt_bias(key, shape[0])
            elif name == "A_log":
                if c.version == 1:
                    m[name] = jnp.log(
                        jnp.broadcast_to(jnp.arange(1, c.d_state + 1, dtype=jnp.float32), shape)
                    )
                else:
                    m[name] = jnp.log(jax.random.uniform(key, shape, minval=1.0, maxval=16.0))
            elif name in ("D", "norm_w", "attn_norm", "ff_norm"):
                m[name] = jnp.ones(shape)
            else:  # pragma: no cover - param_shapes and this table must agree
                raise AssertionError(f"no initialiser for {name}")
        out["layers"].append({"norm": jnp.ones(layer_shapes["norm"]), "mixer": m})
    return jax.tree.map(np.asarray, out)
