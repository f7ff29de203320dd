"""Token-wise MLP sublayers of hybrid models as a Flax NNX module (shape letters: see
latim_jax.model.config; f the hidden width).

    plain:  o = act(xhat W_up (+ b_up)) W_down (+ b_down)                       (Nemotron-H: relu^2)
    gated:  o = (act(xhat W_gate (+ b_gate)) * (xhat W_up (+ b_up))) W_down (+ b_down)   (SwiGLU)

Each position's output depends on that position alone: the decomposition writes it as
T_i(x_j) = [i = j] o_i (latim_jax.latim.tokenwise).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from latim_jax.model.layers import linear
from latim_jax.model.params import ParamModule
from latim_jax.parallel.context import XLA, Context

MLP_ACTIVATIONS = {
    "silu": jax.nn.silu,
    "relu": jax.nn.relu,
    "relu2": lambda x: jnp.square(jax.nn.relu(x)),
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
}


def mlp(x, activation: str, up, down, gate=None, up_b=None, down_b=None, gate_b=None):
    """act(x W_gate + b) * (x W_up + b) W_down + b, or act(x W_up + b) W_down + b without a gate; fp32."""
    act = MLP_ACTIVATIONS[activation]
    u = linear(x, up, up_b)
    hidden = act(linear(x, gate, gate_b)) * u if gate is not None else act(u)
    return linear(hidden, down, down_b)


class TokenwiseModule(ParamModule):
    """A sublayer applied to each position alone: generation keeps no state for it."""

    def init_cache(self, batch: int, max_length: int):
        """No state: the sublayer remembers nothing between tokens."""
        del batch, max_length
        return ()

    def step(self, x_t, cache, valid):
        """One token x_t (b, d) -> (o_t (b, d), cache)."""
        del valid
        return self(x_t[:, None])[:, 0], cache


class MLPMixer(TokenwiseModule):
    """A (gated) two-layer MLP applied to each position alone."""

    kind = "mlp"
    NAMES = ("gate_proj", "gate_b", "up_proj", "up_b", "down_proj", "down_b")

    def __call__(self, x, *, mask=None, ctx: Context = XLA):
        """The sublayer output o (b, l, d) fp32 (``mask`` and ``ctx`` are unused: nothing mixes tokens)."""
        del mask, ctx
        g = self._get
        return mlp(x, self.config.mlp_activation, g("up_proj"), g("down_proj"), g("gate_proj"), g("up_b"),
                   g("down_b"), g("gate_b"))  # fmt: skip
