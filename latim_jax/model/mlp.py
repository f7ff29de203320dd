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

from latim_jax.model.kind import LayerKind
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


def mlp_shapes(c) -> dict[str, tuple[int, ...]]:
    """A token-wise MLP sublayer's parameters: up_proj (d, f), gate_proj (d, f) when gated, down_proj
    (f, d); up_b (and gate_b), down_b when ``mlp_bias``."""
    d, f = c.d_model, c.mlp_width
    out = {"up_proj": (d, f), "down_proj": (f, d)}
    if c.mlp_gated:
        out["gate_proj"] = (d, f)
    if c.mlp_bias:
        out.update(up_b=(f,), down_b=(d,))
        if c.mlp_gated:
            out["gate_b"] = (f,)
    return out


def check_mlp(c) -> None:
    """The config fields an MLP reads: a positive ``mlp_width`` and a known ``mlp_activation``."""
    if isinstance(c.mlp_width, bool) or not isinstance(c.mlp_width, int) or c.mlp_width < 1:
        raise ValueError(
            f"MambaConfig.mlp_width must be a positive int for MLP layers, found {c.mlp_width!r}"
        )
    if c.mlp_activation not in MLP_ACTIVATIONS:
        raise ValueError(
            f"MambaConfig.mlp_activation must be one of {tuple(MLP_ACTIVATIONS)}, found {c.mlp_activation!r}"
        )


def tokenwise_memory(width: int):
    """The memory of a token-wise kind of hidden ``width`` (a function of the config): its hidden
    activations 2 b l f, 5 b l d of streams, and per score tile the (diagonal) contributions."""

    def memory(c, b: int, length: int, rows: int, cols: int) -> int:
        f = width(c)
        return (b * length * f * 2 + 5 * b * length * c.d_model) * 4 + b * rows * cols * 2 * c.d_model * 4

    return memory


MLP = LayerKind(
    name="mlp", display="MLP", module=MLPMixer, shapes=mlp_shapes, output_params=("down_proj", "down_b"),
    check=check_mlp, memory=tokenwise_memory(lambda c: c.mlp_width), splits_sequence=True,  # token-wise
)  # fmt: skip
