"""Random parameter initialisation (the reference's default scheme) for training from scratch."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from latim_jax.model.config import MambaConfig, param_shapes
from latim_jax.model.kind import kind_of


def _uniform(key, shape, bound):
    return jax.random.uniform(key, shape, jnp.float32, -bound, bound)


# the generic rules: matrices (fan-in first) and biases U(+-1/sqrt(fan_in)); a kind's own initialisers
# (LayerKind.init: the Mamba mixers' conv, Delta bias, A_log, D, norms) come first
_PROJECTIONS = ("in_proj", "x_proj", "dt_proj", "out_proj", "q_proj", "k_proj", "v_proj", "o_proj", "up_proj",
                "gate_proj", "down_proj", "router", "shared_up", "shared_gate", "shared_down", "latent_in",
                "latent_out", "shared_out")  # fmt: skip
_STACKED = ("experts_up", "experts_gate", "experts_down")  # (E, fan_in, fan_out)
_BIASES = ("in_proj_b", "out_proj_b", "q_b", "k_b", "v_b", "o_b", "up_b", "gate_b", "down_b", "shared_up_b",
           "shared_gate_b", "shared_down_b", "latent_in_b", "latent_out_b")  # fmt: skip


def init_params(config: MambaConfig, seed: int = 0) -> dict:
    """A parameter tree (fp32) for ``config`` with the reference's default random initialisation.

    Linear weights U(+-1/sqrt(fan_in)); conv U(+-1/sqrt(k)); embedding N(0, 0.02); Mamba-1
    A_log = log(1..n) per channel; Mamba-2 A_log = log U(1, 16) per head; D = 1; norms = 1;
    Delta biases give Delta log-uniform in [1e-3, 1e-1].
    """
    shapes = param_shapes(config)
    widest = max(len(layer["mixer"]) for layer in shapes["layers"])
    per_layer = 16 * -(-widest // 16)  # keys per layer: 16 (32 for a shared block's <= 26 parameters)
    keys = iter(jax.random.split(jax.random.PRNGKey(seed), 4 + per_layer * config.n_layers))
    out = {
        "embedding": 0.02 * jax.random.normal(next(keys), shapes["embedding"]),
        "norm_f": jnp.ones(shapes["norm_f"]),
        "layers": [],
    }
    if "lm_head" in shapes:
        out["lm_head"] = 0.02 * jax.random.normal(next(keys), shapes["lm_head"])
    for kind, layer_shapes in zip(config.kinds, shapes["layers"], strict=True):
        own = kind_of(kind).init
        m = {}
        for name, shape in layer_shapes["mixer"].items():
            key = next(keys)
            if name in own:
                m[name] = own[name](key, shape, config)
            elif name in _PROJECTIONS or name in _BIASES:
                m[name] = _uniform(key, shape, 1.0 / math.sqrt(shape[0]))
            elif name in _STACKED:
                m[name] = _uniform(key, shape, 1.0 / math.sqrt(shape[1]))
            elif name == "router_bias":
                m[name] = jnp.zeros(shape)
            elif name in ("attn_norm", "ff_norm"):
                m[name] = jnp.ones(shape)
            else:
                raise ValueError(
                    f"no initialiser for parameter {name!r} of layer kind {kind!r}: give it one in the "
                    "kind's LayerKind.init"
                )
        out["layers"].append({"norm": jnp.ones(layer_shapes["norm"]), "mixer": m})
    return jax.tree.map(np.asarray, out)
