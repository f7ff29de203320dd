"""Mamba-1 selective scan.

    state_t[e, n] = exp(delta_t[e] A[e, n]) state_{t-1}[e, n] + delta_t[e] B_t[n] u_t[e]
    y_t[e]        = sum_n C_t[n] state_t[e, n] + D[e] u_t[e]

Shapes: u, delta (b, l, e); A (e, n); B, C (b, l, n); D (e,); state (b, e, n). All math in fp32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def selective_scan_reference(u, delta, A, B, C, D, initial_state=None):
    """Pure-jnp selective scan (associative scan over l). Returns (y (b, l, e), final_state (b, e, n))."""
    u, delta, B, C = (x.astype(jnp.float32) for x in (u, delta, B, C))
    A, D = A.astype(jnp.float32), D.astype(jnp.float32)
    dA = jnp.exp(delta[..., None] * A)  # (b, l, e, n)
    dBu = (delta * u)[..., None] * B[:, :, None, :]  # (b, l, e, n)
    if initial_state is not None:
        dBu = dBu.at[:, 0].add(dA[:, 0] * initial_state.astype(jnp.float32))

    def combine(left, right):
        a_l, b_l = left
        a_r, b_r = right
        return a_l * a_r, a_r * b_l + b_r

    _, states = jax.lax.associative_scan(combine, (dA, dBu), axis=1)  # (b, l, e, n)
    y = jnp.einsum("blen,bln->ble", states, C) + D * u
    return y, states[:, -1]


def selective_scan_step_reference(state, u, delta, A, B, C, D):
    """One recurrent step. state (b, e, n); u, delta (b, e); B, C (b, n). Returns (y (b, e), state)."""
    state = jnp.exp(delta[..., None] * A) * state + (delta * u)[..., None] * B[:, None, :]
    y = jnp.einsum("ben,bn->be", state, C) + D * u
    return y, state
