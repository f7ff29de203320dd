"""Stateless building blocks shared by both Mamba versions (shape letters: see latim_jax.model.config).

Every function keeps the math that the reference keeps in fp32 in fp32 and returns fp32 unless said.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from latim_jax.kernels import f32


def rms_norm(x, w, eps, *, hold_scale=False):
    """RMSNorm over the last axis: x * rsqrt(mean(x^2) + eps) * w, in fp32 (``hold_scale``: the
    rsqrt factor without gradient)."""
    x = x.astype(f32)
    scale = jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    if hold_scale:
        scale = jax.lax.stop_gradient(scale)
    return x * scale * w.astype(f32)


def normed_linear(x, g, w, eps, b=None, *, fold: bool = False, hold_scale=False):
    """linear(RMSNorm(x) with gain g, w, b): x (..., d), g (d,), w (d, o); returns fp32 (..., o).

    ``fold`` (fp32 weights only): the gain is folded into w and the row scale rsqrt(mean(x^2) + eps)
    multiplies the product's output, (x * s * g) @ w = s * (x @ (g w)), the same value to fp32
    rounding (~1e-6 relative). XLA:CPU fuses the norm into the product's operand otherwise, which runs
    ~1.5x slower than a plain product once the operand outgrows the cache (480 vs 310 ms at 16384 x
    768 @ 768 x 3352; faster below ~4k rows): :class:`latim_jax.model.lm.Block` folds from a prompt
    length on. Other weight dtypes keep the reference's rounding point whatever ``fold`` says: the
    normalised input is rounded to g's dtype before the product. ``hold_scale``: the row scale
    without gradient (as in :func:`rms_norm`)."""
    if not fold or g.dtype != f32 or w.dtype != f32:
        return linear(rms_norm(x, g, eps, hold_scale=hold_scale).astype(g.dtype), w, b)
    x = x.astype(f32)
    scale = jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    if hold_scale:
        scale = jax.lax.stop_gradient(scale)
    y = jnp.matmul(x, g[:, None] * w, preferred_element_type=f32) * scale
    return y if b is None else y + b.astype(f32)


def group_rms(q, n_groups, eps):
    """rms of each of ``n_groups`` contiguous channel blocks of q (b, l, e), broadcast back to (b, l, e)."""
    *lead, e = q.shape
    qg = q.astype(f32).reshape(*lead, n_groups, e // n_groups)
    rms = jnp.sqrt(jnp.mean(qg * qg, axis=-1, keepdims=True) + eps)
    return jnp.broadcast_to(rms, qg.shape).reshape(*lead, e)


def activation(name):
    """The post-conv activation by name ('silu', 'relu', 'identity')."""
    return {"silu": jax.nn.silu, "relu": jax.nn.relu, "identity": lambda a: a}[name]


def activation_gate(name, c):
    """s = act(c) / c, the exact decomposition's gate: sigma(c) (SiLU), [c > 0] (ReLU), 1 (identity)."""
    c = c.astype(f32)
    if name == "silu":
        return jax.nn.sigmoid(c)
    if name == "relu":
        return (c > 0).astype(f32)
    return jnp.ones_like(c)


def causal_conv(u, conv_w, conv_b=None):
    """Depthwise causal cross-correlation: c[t] = b + sum_k conv_w[k] * u[t - (K-1) + k] (zeros before 0).

    u (b, l, c); conv_w (k, c) with conv_w[k-1] on the current token; returns fp32 (b, l, c).
    """
    K = conv_w.shape[0]
    L = u.shape[1]
    u_pad = jnp.pad(u.astype(f32), ((0, 0), (K - 1, 0), (0, 0)))
    w = conv_w.astype(f32)
    c = sum(w[k] * u_pad[:, k : k + L] for k in range(K))
    if conv_b is not None:
        c = c + conv_b.astype(f32)
    return c


def causal_conv_step(conv_cache, u_t, conv_w, conv_b=None):
    """One conv step. conv_cache (b, k-1, c) holds the previous k-1 inputs; u_t (b, c).

    Returns (c_t (b, c) fp32, new_cache).
    """
    window = jnp.concatenate([conv_cache.astype(f32), u_t.astype(f32)[:, None]], axis=1)  # (b, k, c)
    c_t = jnp.einsum("bkc,kc->bc", window, conv_w.astype(f32))
    if conv_b is not None:
        c_t = c_t + conv_b.astype(f32)
    return c_t, window[:, 1:].astype(conv_cache.dtype)


def linear(x, w, b=None):
    """x @ w (+ b) in the weight's dtype with fp32 accumulation; returns fp32."""
    y = jnp.matmul(x.astype(w.dtype), w, preferred_element_type=f32)
    if b is not None:
        y = y + b.astype(f32)
    return y
