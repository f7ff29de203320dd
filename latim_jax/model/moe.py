"""Mixture-of-experts sublayers (Granite-4 / GraniteMoeHybrid, Nemotron-H) as a Flax NNX module (shape
letters: see latim_jax.model.config; E experts, k of them per token, f an expert's width, s the shared
expert's width).

    router logits r = xhat W_router (fp32)
    "softmax_topk" (Granite):   the k largest r, weights softmax over those k
    "softmax_all" (Jamba):      softmax over all E, the k largest probabilities as they are
    "sigmoid_groups" (Nemotron-H): s = sigmoid(r); choice by s + b_corr within the ``moe_topk_groups``
                                groups (of E / moe_groups) whose two best sum highest; weights s of the
                                chosen, / their sum (+1e-20) when moe_norm_topk, times moe_scale
    o = sum_{chosen e} w_e expert_e(xhat) + shared(xhat)          expert / shared: the MLP form of the
                                                                 config (gated or not, mlp_activation)
    latent (Nemotron-H's moe_latent_size): the experts read z = xhat W_in + b_in instead,
                                o = (sum_e w_e expert_e(z)) W_out + b_out + shared(xhat)

Each position's output depends on that position alone: a token-wise kind (latim_jax.latim.tokenwise).
The experts run densely, one at a time over every position (a scan: memory O(l f), compute E / k times
the routed minimum), weighted by zero where not chosen.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from latim_jax.kernels import f32
from latim_jax.model.kind import LayerKind
from latim_jax.model.layers import linear
from latim_jax.model.mlp import MLP_ACTIVATIONS, TokenwiseModule, mlp, tokenwise_memory
from latim_jax.parallel.context import XLA, Context

ROUTERS = ("softmax_topk", "sigmoid_groups")


class MoEMixer(TokenwiseModule):
    """Routed experts plus an optional shared expert, applied to each position alone."""

    kind = "moe"
    NAMES = (
        "router", "router_bias", "experts_gate", "experts_up", "experts_down",
        "shared_gate", "shared_gate_b", "shared_up", "shared_up_b", "shared_down", "shared_down_b",
        "latent_in", "latent_in_b", "latent_out", "latent_out_b", "shared_expert_gate",
    )  # fmt: skip

    def routing(self, x):
        """Dense routing weights (..., E) fp32 for the normalised input x (..., d): zero off the chosen."""
        c = self.config
        logits = jnp.matmul(x.astype(f32), self.router[...].astype(f32))
        E, k = c.moe_experts, c.moe_top_k
        if c.moe_router == "softmax_topk":
            values, index = jax.lax.top_k(logits, k)
            weights = jax.nn.softmax(values, axis=-1)
        elif c.moe_router == "softmax_all":
            weights, index = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), k)
        else:
            scores = jax.nn.sigmoid(logits)
            choice = scores + self.router_bias[...].astype(f32)
            grouped = choice.reshape(*choice.shape[:-1], c.moe_groups, E // c.moe_groups)
            group_score = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # (..., groups)
            _, kept = jax.lax.top_k(group_score, c.moe_topk_groups)
            keep = jnp.sum(jax.nn.one_hot(kept, c.moe_groups, dtype=bool), axis=-2) > 0  # (..., groups)
            keep = jnp.repeat(keep, E // c.moe_groups, axis=-1)
            _, index = jax.lax.top_k(jnp.where(keep, choice, -jnp.inf), k)
            weights = jnp.take_along_axis(scores, index, axis=-1)
            if c.moe_norm_topk:
                weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
            weights = weights * c.moe_scale
        return jnp.sum(jax.nn.one_hot(index, E, dtype=f32) * weights[..., None], axis=-2)

    def __call__(self, x, *, mask=None, ctx: Context = XLA):
        """The sublayer output o (b, l, d) fp32 for the normalised input x (b, l, d)."""
        del mask, ctx
        weights = self.routing(x)  # (b, l, E)
        gate, act = self._get("experts_gate"), self.config.mlp_activation
        latent = self._get("latent_in") is not None
        z = linear(x, self.latent_in[...], self._get("latent_in_b")) if latent else x

        def expert(acc, e):
            g = None if gate is None else gate[e]
            y = mlp(z, act, self.experts_up[...][e], self.experts_down[...][e], g)
            return acc + weights[..., e, None] * y, None

        out, _ = jax.lax.scan(expert, jnp.zeros(z.shape, f32), jnp.arange(self.config.moe_experts))
        if latent:
            out = linear(out, self.latent_out[...], self._get("latent_out_b"))
        if self._get("shared_up") is not None:
            g = self._get
            shared = mlp(x, act, g("shared_up"), g("shared_down"), g("shared_gate"), g("shared_up_b"),
                         g("shared_down_b"), g("shared_gate_b"))  # fmt: skip
            if g("shared_expert_gate") is not None:  # Qwen3-Next: sigmoid(x W_sg) scales the shared expert
                shared = shared * jax.nn.sigmoid(linear(x, g("shared_expert_gate")))
            out = out + shared
        return out


def moe_shapes(c) -> dict[str, tuple[int, ...]]:
    """A mixture-of-experts sublayer's parameters: router (d, E) (router_bias (E,) for sigmoid_groups:
    the correction added for the choice only), experts_up (E, d', f), experts_gate (E, d', f) when gated,
    experts_down (E, f, d') with d' = d, or d' = moe_latent with latent_in (d, d') before the experts and
    latent_out (d', d) after their weighted sum (biases latent_in_b, latent_out_b when ``mlp_bias``); the
    shared expert shared_up (d, s), shared_gate, shared_down (s, d) and their biases when ``mlp_bias``,
    and its sigmoid gate shared_expert_gate (d, 1) when ``moe_shared_gate``."""
    d, E, f, s = c.d_model, c.moe_experts, c.moe_width, c.moe_shared_width
    lat = c.moe_latent or d
    out = {"router": (d, E), "experts_up": (E, lat, f), "experts_down": (E, f, lat)}
    if c.moe_latent:
        out.update(latent_in=(d, lat), latent_out=(lat, d))
        if c.mlp_bias:
            out.update(latent_in_b=(lat,), latent_out_b=(d,))
    if c.moe_router == "sigmoid_groups":
        out["router_bias"] = (E,)
    if c.mlp_gated:
        out["experts_gate"] = (E, lat, f)
    if s:
        out.update(shared_up=(d, s), shared_down=(s, d))
        if c.moe_shared_gate:
            out["shared_expert_gate"] = (d, 1)
        if c.mlp_gated:
            out["shared_gate"] = (d, s)
        if c.mlp_bias:
            out.update(shared_up_b=(s,), shared_down_b=(d,))
            if c.mlp_gated:
                out["shared_gate_b"] = (s,)
    return out


def check_moe(c) -> None:
    """The config fields a mixture-of-experts sublayer reads: positive expert count, top k and width, a
    latent width >= 0, a known router (sigmoid_groups: experts in groups of at least 2, 1 <= kept
    groups <= groups) and MLP activation."""
    for name in ("moe_experts", "moe_top_k", "moe_width"):
        value = getattr(c, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"MambaConfig.{name} must be a positive int for MoE layers, found {value!r}")
    latent = c.moe_latent
    if isinstance(latent, bool) or not isinstance(latent, int) or latent < 0:
        raise ValueError(f"MambaConfig.moe_latent must be an int >= 0 (0: none), found {latent!r}")
    routers = ("softmax_topk", "softmax_all", "sigmoid_groups")
    if c.moe_top_k > c.moe_experts or c.moe_router not in routers:
        raise ValueError(
            f"MambaConfig: moe_top_k {c.moe_top_k} of {c.moe_experts} experts, router {c.moe_router!r} "
            f"(one of {routers})"
        )
    if c.moe_router == "sigmoid_groups" and (
        c.moe_experts % c.moe_groups or c.moe_experts // c.moe_groups < 2
        or not 1 <= c.moe_topk_groups <= c.moe_groups
    ):  # fmt: skip
        raise ValueError(
            f"MambaConfig: {c.moe_experts} experts in {c.moe_groups} groups (at least 2 each), "
            f"{c.moe_topk_groups} groups kept"
        )
    if c.mlp_activation not in MLP_ACTIVATIONS:
        raise ValueError(f"MambaConfig.mlp_activation must be one of {tuple(MLP_ACTIVATIONS)}")


def _fan_in(key, shape, c):
    del c
    bound = shape[0] ** -0.5
    return jax.random.uniform(key, shape, f32, -bound, bound)


MOE = LayerKind(
    name="moe", display="MoE", module=MoEMixer, shapes=moe_shapes,
    output_params=("experts_down", "shared_down", "shared_down_b"),  # latent MoE: latent_out(_b) instead
    check=check_moe, memory=tokenwise_memory(lambda c: c.moe_width + c.moe_shared_width + c.moe_experts),
    init={"shared_expert_gate": _fan_in}, splits_sequence=True,  # token-wise
)  # fmt: skip
