"""Mamba-2 SSD (state-space duality) scan, chunked.

    state_t[h] = exp(dt_t[h] A[h]) state_{t-1}[h] + dt_t[h] x_t[h] (outer) B_t[g(h)]   (p, n)
    y_t[h]     = state_t[h] . C_t[g(h)] + D[h] x_t[h]

Head h reads group g(h) = h // (h_total / g) (contiguous blocks of heads). dt is the final Delta
(softplus and clamp already applied). Shapes: x (b, l, h, p); dt (b, l, h); A (h,); B, C (b, l, g, n);
D (h,); state (b, h, p, n). All math in fp32; any l >= 1 (padded to the chunk internally).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def expand_groups(BC, n_heads):
    """(b, l, g, n) -> (b, l, h, n): head h gets group h // (h / g)."""
    return jnp.repeat(BC, n_heads // BC.shape[2], axis=2)


def ssd_reference(x, dt, A, B, C, D, chunk_size=64, initial_state=None):
    """Pure-jnp chunked SSD. Returns (y (b, l, h, p), final_state (b, h, p, n))."""
    b, l, h, p = x.shape
    x, dt, A, D = (t.astype(jnp.float32) for t in (x, dt, A, D))
    B = expand_groups(B.astype(jnp.float32), h)
    C = expand_groups(C.astype(jnp.float32), h)
    q = min(chunk_size, l)
    pad = (-l) % q
    if pad:  # dt = 0 on padding: no decay, no input
        x, dt, B, C = (jnp.pad(t, [(0, 0), (0, pad)] + [(0, 0)] * (t.ndim - 2)) for t in (x, dt, B, C))
    nc = (l + pad) // q
    xs = x.reshape(b, nc, q, h, p)
    Bs = B.reshape(b, nc, q, h, -1)
    Cs = C.reshape(b, nc, q, h, -1)
    a = (dt * A).reshape(b, nc, q, h)
    S = jnp.cumsum(a, axis=2)  # within-chunk cumulative log-decay (b, c, q, h)
    dtx = (dt[..., None] * x).reshape(b, nc, q, h, p)

    # 1. intra-chunk (diagonal blocks): decay exp(S_i - S_j) for j <= i, masked before exp
    causal = jnp.tril(jnp.ones((q, q), bool))
    seg = S[:, :, :, None, :] - S[:, :, None, :, :]  # (b, c, i, j, h)
    decay = jnp.exp(jnp.where(causal[None, None, :, :, None], seg, -jnp.inf))
    scores = jnp.einsum("bcihn,bcjhn->bcijh", Cs, Bs) * decay
    y_diag = jnp.einsum("bcijh,bcjhp->bcihp", scores, dtx)

    # 2. each chunk's own contribution to the state at its end
    to_end = jnp.exp(S[:, :, -1:, :] - S)  # (b, c, q, h)
    chunk_states = jnp.einsum("bcjh,bcjhn,bcjhp->bchpn", to_end, Bs, dtx)

    # 3. carry states across chunks (sequential over the few chunks)
    init = (jnp.zeros((b, h, p, Bs.shape[-1]), jnp.float32) if initial_state is None
            else initial_state.astype(jnp.float32))
    chunk_decay = jnp.exp(S[:, :, -1, :])  # (b, c, h)

    def carry(state, inputs):
        decay_c, new_c = inputs
        return decay_c[:, :, None, None] * state + new_c, state  # emit the state entering the chunk

    final, entering = jax.lax.scan(carry, init, (chunk_decay.swapaxes(0, 1), chunk_states.swapaxes(0, 1)))
    entering = entering.swapaxes(0, 1)  # (b, c, h, p, n)

    # 4. contribution of the entering state to each position
    y_off = jnp.einsum("bcihn,bchpn,bcih->bcihp", Cs, entering, jnp.exp(S))
    y = (y_diag + y_off).reshape(b, nc * q, h, p)[:, :l] + D[:, None] * x[:, :l]
    return y, final


def ssd_step_reference(state, x, dt, A, B, C, D):
    """One recurrent step. state (b, h, p, n); x (b, h, p); dt (b, h); B, C (b, g, n)."""
    h = x.shape[1]
    B = jnp.repeat(B, h // B.shape[1], axis=1)
    C = jnp.repeat(C, h // C.shape[1], axis=1)
    dA = jnp.exp(dt * A)[..., None, None]
    state = dA * state + (dt[..., None] * x)[..., None] * B[:, :, None, :]
    y = jnp.einsum("bhpn,bhn->bhp", state, C) + D[:, None] * x
    return y, state
