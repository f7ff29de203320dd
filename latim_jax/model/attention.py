"""Softmax attention sublayers of hybrid models (Nemotron-H, Bamba, Granite-4, Jamba, ...) as a Flax NNX
module (shape letters: see latim_jax.model.config; H query heads, G key/value heads, a head dim).

    q = xhat W_q (+ b_q), k = xhat W_k (+ b_k), v = xhat W_v (+ b_v)        rotary on q, k when rope_theta
    (attn_qk_norm: q and k RMS-normalised per head, weights q_norm / k_norm, before the rotary;
    with attn_qk_norm_full, over all heads at once: OLMo-Hybrid)
    alpha^h_{ij} = softmax_j(scale * q^h_i . k^{g(h)}_j) over the allowed sources j of i
    o_i = (concat_h(sum_j alpha^h_{ij} v^{g(h)}_j) * gate_i) W_o (+ b_o)      g(h) = h // (H / G)
    gate_i = sigmoid(xhat_i W_g) with attn_output_gate (Qwen3-Next), else 1

Allowed sources (:func:`allowed`, the one definition that the forward and the decomposition share):
j <= i, within the sliding window when there is one, and real (``mask``); a padding target, which
may have no real source, attends to itself so that every row is a distribution. Positions count
from 0 at the first column: rotary scores depend only on i - j, so a left-padded prompt equals the
prompt alone.

The forward runs over tiles of target rows (:data:`ROW_TILE`), so no (l, l) array per head is held
beyond one tile; each row's log-sum-exp is kept (``lse``), from which the decomposition rebuilds
alpha tile by tile. With the length split over the mesh's "seq" axis each device keeps its own rows'
queries and all_gathers the keys, values and mask of the whole length (every device then holds the
whole K/V: 2 b l G a floats), masking with global positions.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from latim_jax.kernels import f32
from latim_jax.model.kind import LayerKind
from latim_jax.model.layers import linear, rms_norm
from latim_jax.model.params import ParamModule
from latim_jax.parallel import sequence
from latim_jax.parallel.context import XLA, Context
from latim_jax.parallel.mesh import SEQ, P

ROW_TILE = 256


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionIntermediates:
    """What one attention sublayer computed for one input (fp32).

    q: (b, l, H, a) queries after the rotary embedding, scaled by the softmax scale
    k: (b, l, G, a) keys after the rotary embedding
    v: (b, l, G, a) values WITHOUT their bias (the bias belongs to no token: sum_j alpha_ij = 1)
    lse: (b, H, l) each row's log-sum-exp of its allowed logits
    attn: (b, l, H a) the heads' outputs before the gate and W_o (value bias included)
    gate: (b, l, H a) the output gate sigmoid(xhat W_g), or None without one
    """

    q: jax.Array
    k: jax.Array
    v: jax.Array
    lse: jax.Array
    attn: jax.Array
    gate: jax.Array | None = None


def allowed(rows, cols, mask, window: int):
    """(b, r, w) bool: may target i (``rows``) read source j (``cols``)? j <= i, i - j < window (when
    window > 0), j real (``mask`` (b, l); columns past l are not), or j = i."""
    length = mask.shape[1]
    i, j = rows[:, None], cols[None, :]
    ok = j <= i
    if window:
        ok = ok & (i - j < window)
    real = jnp.take(mask, jnp.minimum(cols, length - 1), axis=1) & (cols < length)[None]  # (b, w)
    return (ok[None] & real[:, None, :]) | (i == j)[None]


def logits(q, k, rows, cols, mask, window: int):
    """Masked logits (b, H, r, w): q (b, r, H, a) the rows' scaled queries, k (b, w, G, a) the columns'
    keys; -inf where :func:`allowed` says no."""
    b, r, H, a = q.shape
    G = k.shape[2]
    qg = q.reshape(b, r, G, H // G, a)
    s = jnp.einsum("brgqa,bwga->bgqrw", qg, k, preferred_element_type=f32).reshape(b, H, r, k.shape[1])
    return jnp.where(allowed(rows, cols, mask, window)[:, None], s, -jnp.inf)


def rotary(x, positions, theta: float, dim: int):
    """The rotary embedding (rotate-half form) on the first ``dim`` channels of x (b, l, heads, a) at
    ``positions`` (l,); the rest pass unchanged."""
    half = dim // 2
    inv_freq = 1.0 / (theta ** (jnp.arange(0, dim, 2, dtype=f32) / dim))
    angles = positions.astype(f32)[:, None] * inv_freq[None]  # (l, dim / 2)
    cos, sin = jnp.cos(angles)[None, :, None], jnp.sin(angles)[None, :, None]
    x1, x2, rest = x[..., :half], x[..., half:dim], x[..., dim:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)


def attend(q, k, v, mask, vb, row0, window: int):
    """Each row's log-sum-exp (b, H, r) and the heads' outputs (b, r, H a) (value bias ``vb`` (H, a)
    included) for the rows' scaled queries q (b, r, H, a) at global positions row0 + [0, r) against
    keys and values k, v (b, w, G, a) at positions [0, w) (``mask`` (b, w) real columns), over tiles
    of :data:`ROW_TILE` target rows."""
    b, r, H, _ = q.shape
    w, G, av = k.shape[1], k.shape[2], v.shape[3]
    tile = min(ROW_TILE, r)
    n = -(-r // tile)
    cols = jnp.arange(w)

    def rows_tile(t):
        local = t * tile + jnp.arange(tile)
        qr = jnp.take(q, local, axis=1, mode="clip")
        s = logits(qr, k, row0 + local, cols, mask, window)  # (b, H, tile, w)
        lse = jax.nn.logsumexp(s, axis=-1)  # (b, H, tile)
        alpha = jnp.exp(s - lse[..., None]).reshape(b, G, H // G, tile, w)
        out = jnp.einsum("bgqrw,bwga->brgqa", alpha, v).reshape(b, tile, H, av)
        return lse, out + vb

    # each tile rematerialised under differentiation: the backward holds one tile's (b, H, tile, w)
    # logits and weights at a time, not every tile's (the (b, H, l, l) a gradient through the layer
    # kept: a grad_input at L = 32k through 2 heads went past 24 GiB)
    tiles = jax.checkpoint(rows_tile, prevent_cse=False)
    lse, out = jax.lax.map(tiles, jnp.arange(n))  # (n, b, H, tile), (n, b, tile, H, a)
    lse = jnp.moveaxis(lse, 0, 2).reshape(b, H, n * tile)[..., :r]
    out = jnp.moveaxis(out, 0, 1).reshape(b, n * tile, -1)[:, :r]
    return lse, out


class AttentionMixer(ParamModule):
    """Causal softmax attention with grouped key/value heads, optional rotary embedding and sliding
    window (transformers' eager attention semantics)."""

    kind = "attention"
    NAMES = ("q_proj", "q_b", "k_proj", "k_b", "v_proj", "v_b", "o_proj", "o_b", "q_norm", "k_norm", "g_proj")

    @property
    def scale(self) -> float:
        """The softmax scale (config.attn_scale, or 1 / sqrt(head dim))."""
        c = self.config
        return c.attn_scale or 1.0 / math.sqrt(c.attn_head_dim)

    def project(self, x, positions):
        """q (scaled), k, v without bias, and v's bias per head: x (b, l, d) -> (b, l, H|G, a) fp32."""
        c = self.config
        b, l, _ = x.shape
        a = c.attn_head_dim
        q = linear(x, self.q_proj[...], self._get("q_b")).reshape(b, l, c.attn_heads, a)
        k = linear(x, self.k_proj[...], self._get("k_b")).reshape(b, l, c.attn_kv_heads, a)
        v = linear(x, self.v_proj[...]).reshape(b, l, c.attn_kv_heads, a)
        if self._get("q_norm") is not None:
            span = (b, l, -1) if c.attn_qk_norm_full else q.shape  # every head at once, or each head
            q = rms_norm(q.reshape(span), self.q_norm[...], c.rms_eps).reshape(q.shape)
            span = (b, l, -1) if c.attn_qk_norm_full else k.shape
            k = rms_norm(k.reshape(span), self.k_norm[...], c.rms_eps).reshape(k.shape)
        if c.rope_theta:
            dim = c.rope_dim or a
            q, k = rotary(q, positions, c.rope_theta, dim), rotary(k, positions, c.rope_theta, dim)
        return q * self.scale, k, v

    def gate(self, x):
        """The output gate sigmoid(x W_g) (..., H a) fp32 for the normalised input x, or None."""
        g = self._get("g_proj")
        return None if g is None else jax.nn.sigmoid(linear(x, g))

    def value_bias(self):
        """(H a,) the value bias of every query head's group (zeros without a bias)."""
        c = self.config
        vb = self._get("v_b")
        if vb is None:
            return jnp.zeros((c.attn_heads * c.attn_head_dim,), f32)
        vb = vb.astype(f32).reshape(c.attn_kv_heads, 1, c.attn_head_dim)
        return jnp.broadcast_to(
            vb, (c.attn_kv_heads, c.attn_heads // c.attn_kv_heads, c.attn_head_dim)
        ).reshape(-1)

    def intermediates(self, x, *, mask, ctx: Context = XLA, hold_fixed=False) -> AttentionIntermediates:
        """q, k, v, each row's log-sum-exp and the heads' outputs for the normalised input x (b, l, d);
        ``mask`` (b, l) bool of real positions. ``hold_fixed``: no gradient through the attention
        weights (q, k and the log-sum-exp): the sublayer is then linear in its values."""
        b, l, _ = x.shape
        q, k, v = self.project(x, jnp.arange(l))  # global positions also when "seq" splits the length
        if hold_fixed:
            q, k = jax.lax.stop_gradient(q), jax.lax.stop_gradient(k)
        vb = self.value_bias().reshape(q.shape[2], v.shape[3])
        seq = ctx.axis(SEQ)  # attention runs on XLA everywhere; a split length gathers K/V
        if seq is None:
            lse, out = attend(q, k, v, mask, vb, 0, self.window)
        else:

            def local(q, k, v, mask, vb):
                k, v, full = (sequence.gather_rows(t, seq) for t in (k, v, mask))
                return attend(q, k, v, full, vb, sequence.offset(q.shape[1], seq), self.window)

            rows = sequence.rows_spec(ctx, b)
            specs = (rows, rows, rows, rows, P())
            outs = (P(rows[0], None, SEQ), rows)
            lse, out = sequence.split(local, ctx, specs, outs)(q, k, v, mask, vb)
        gate = self.gate(x)
        if hold_fixed:
            lse = jax.lax.stop_gradient(lse)
            gate = None if gate is None else jax.lax.stop_gradient(gate)
        return AttentionIntermediates(q=q, k=k, v=v, lse=lse, attn=out, gate=gate)

    def output(self, inter: AttentionIntermediates):
        """o = (attn * gate) W_o (+ b_o), (b, l, d) fp32."""
        attn = inter.attn if inter.gate is None else inter.attn * inter.gate
        return linear(attn, self.o_proj[...], self._get("o_b"))

    def __call__(self, x, *, mask, ctx: Context = XLA):
        """The sublayer output o (b, l, d) fp32 for the normalised input x (b, l, d)."""
        return self.output(self.intermediates(x, mask=mask, ctx=ctx))

    @property
    def window(self) -> int:
        """The sliding window (0: none)."""
        return self.config.sliding_window

    @property
    def cache_dims(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """((key heads, key dim), (value heads, value dim)) of the generation cache."""
        c = self.config
        return (c.attn_kv_heads, c.attn_head_dim), (c.attn_kv_heads, c.attn_head_dim)

    def init_cache(self, batch: int, max_length: int):
        """An empty key/value cache for ``max_length`` positions: (k (b, max_length, G, a), v (b,
        max_length, G, a_v), real (b, max_length) bool, the next position (int32 scalar))."""
        kd, vd = self.cache_dims
        return (
            jnp.zeros((batch, max_length, *kd), f32),
            jnp.zeros((batch, max_length, *vd), f32),
            jnp.zeros((batch, max_length), bool),
            jnp.int32(0),
        )

    def step(self, x_t, cache, valid):
        """One token x_t (b, d) at the cache's next position -> (o_t (b, d), cache); ``valid`` (b,)
        bool: False marks padding, which no later token reads."""
        keys, values, real, t = cache
        q, k, v = self.project(x_t[:, None], t[None])
        keys = jax.lax.dynamic_update_slice_in_dim(keys, k, t, 1)
        values = jax.lax.dynamic_update_slice_in_dim(values, v, t, 1)
        real = jax.lax.dynamic_update_slice_in_dim(real, valid[:, None], t, 1)
        cols = jnp.arange(keys.shape[1])
        s = logits(q, keys, t[None], cols, real, self.window)  # (b, H, 1, L)
        alpha = jax.nn.softmax(s, axis=-1).reshape(x_t.shape[0], keys.shape[2], -1, keys.shape[1])
        out = jnp.einsum("bgqw,bwga->bgqa", alpha, values).reshape(x_t.shape[0], -1) + self.value_bias()
        gate = self.gate(x_t)
        out = out if gate is None else out * gate
        return linear(out, self.o_proj[...], self._get("o_b")), (keys, values, real, t + 1)


def attention_shapes(c) -> dict[str, tuple[int, ...]]:
    """An attention sublayer's parameters: q_proj (d, H a), k_proj and v_proj (d, G a), o_proj (H a, d);
    q_b, k_b, v_b when ``attn_bias``, o_b (d,) when ``attn_out_bias``; q_norm, k_norm (a,) when
    ``attn_qk_norm`` ((H a,) and (G a,) with ``attn_qk_norm_full``); g_proj (d, H a) when
    ``attn_output_gate``."""
    d, a = c.d_model, c.attn_head_dim
    out = {
        "q_proj": (d, c.attn_heads * a),
        "k_proj": (d, c.attn_kv_heads * a),
        "v_proj": (d, c.attn_kv_heads * a),
        "o_proj": (c.attn_heads * a, d),
    }
    if c.attn_bias:
        out.update(q_b=(c.attn_heads * a,), k_b=(c.attn_kv_heads * a,), v_b=(c.attn_kv_heads * a,))
    if c.attn_out_bias:
        out["o_b"] = (d,)
    if c.attn_qk_norm and c.attn_qk_norm_full:
        out.update(q_norm=(c.attn_heads * a,), k_norm=(c.attn_kv_heads * a,))
    elif c.attn_qk_norm:
        out.update(q_norm=(a,), k_norm=(a,))
    if c.attn_output_gate:
        out["g_proj"] = (d, c.attn_heads * a)
    return out


def check_attention(c) -> None:
    """The config fields an attention sublayer reads: positive head counts and head dim, query heads a
    multiple of key/value heads, an even rope_dim within the head, a window >= 0."""
    for name in ("attn_heads", "attn_kv_heads", "attn_head_dim"):
        value = getattr(c, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"MambaConfig.{name} must be a positive int for attention, found {value!r}")
    if c.attn_heads % c.attn_kv_heads:
        raise ValueError(
            f"MambaConfig.attn_heads {c.attn_heads} is not a multiple of attn_kv_heads {c.attn_kv_heads}"
        )
    if c.rope_dim < 0 or c.rope_dim > c.attn_head_dim or c.rope_dim % 2:
        raise ValueError(
            f"MambaConfig.rope_dim must be even and within [0, {c.attn_head_dim}], found {c.rope_dim}"
        )
    if c.sliding_window < 0:
        raise ValueError(f"MambaConfig.sliding_window must be >= 0, found {c.sliding_window}")
    if c.attn_qk_norm_full and not c.attn_qk_norm:
        raise ValueError(
            "MambaConfig.attn_qk_norm_full spans the q / k norms over every head: set attn_qk_norm"
        )


def attention_memory(c, b: int, length: int, rows: int, cols: int) -> int:
    """Bytes of one attention layer while decomposed (fp32): q, k, v, the rows' log-sum-exp, the
    forward's row tile, and per score tile the weights alpha, the values V and T."""
    H, G, a, d, L = c.attn_heads, c.attn_kv_heads, c.attn_head_dim, c.d_model, length
    attn = (b * L * (H + 2 * G) * a + b * H * L + 5 * b * L * d + 2 * b * H * min(L, 256) * L) * 4
    return attn + b * rows * cols * (H * a + 2 * H + d) * 4


def _ones(key, shape, c):
    del key, c
    return jnp.ones(shape)


def _fan_in(key, shape, c):
    del c
    bound = 1.0 / math.sqrt(shape[0])
    return jax.random.uniform(key, shape, f32, -bound, bound)


ATTENTION = LayerKind(
    name="attention", display="attention", module=AttentionMixer, shapes=attention_shapes,
    output_params=("o_proj", "o_b"), check=check_attention, memory=attention_memory, holds_attention=True,
    splits_sequence=True,  # keys, values and the mask gathered along the length
    init={"q_norm": _ones, "k_norm": _ones, "g_proj": _fan_in},
)  # fmt: skip
