"""Mamba-1 and Mamba-2 mixers as Flax NNX modules (shape letters: see latim_jax.model.config).

Each mixer computes its per-layer intermediates once (:meth:`intermediates`): the value path u, the
conv pre-activation c, Delta, B, C, the scan output y and the output multiplier G. The forward is
``o = (y * G) @ W_out (+ b_out)``, and the LaTIM decomposition reads the very same intermediates, so
there is one copy of the forward math.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from latim_jax.kernels import dispatch, f32
from latim_jax.model.channel_layout import CONV_ORDER, IN_ORDER, channel_layout
from latim_jax.model.kind import LayerKind
from latim_jax.model.layers import (
    activation,
    activation_gate,
    causal_conv,
    causal_conv_step,
    group_rms,
    linear,
    rms_norm,
)
from latim_jax.model.params import ParamModule
from latim_jax.parallel import sequence
from latim_jax.parallel.context import XLA, Context
from latim_jax.parallel.mesh import SEQ, P

_PARAM_NAMES = (
    "in_proj",
    "in_proj_b",
    "conv_w",
    "conv_b",
    "x_proj",
    "dt_norm_w",
    "B_norm_w",
    "C_norm_w",
    "dt_proj",
    "dt_bias",
    "A_log",
    "D",
    "norm_w",
    "out_proj",
    "out_proj_b",
)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Intermediates:
    """What one mixer computed for one input (fp32).

    u: (b, l, c) conv input exactly as the forward convolved it (rounded to the weight dtype, zero at
       padding; Mamba-1: c = e; Mamba-2: the x, B, C channels in the mixer's ``layout``, c = e + 2gn
       in the checkpoint's order; only x is a value: :meth:`_Mixer.value_channels`)
    c: (b, l, c) conv pre-activation (bias included, same layout); v = act(c)
    delta: (b, l, e) Mamba-1 / (b, l, h) Mamba-2 (zero at padding: the state skips pad positions)
    B, C: (b, l, n) Mamba-1 / (b, l, g', n) Mamba-2 (g' = ``layout.groups``: g unless a mesh layout
       repeats groups per shard)
    y: (b, l, e) scan output including the D skip term
    G: (b, l, e) output multiplier: SiLU(z) (Mamba-1), w_norm * SiLU(z) / rms_group(y * SiLU(z)) (Mamba-2;
       see :meth:`Mamba2Mixer.gate` for its norm variants)
    """

    u: jax.Array
    c: jax.Array
    delta: jax.Array
    B: jax.Array
    C: jax.Array
    y: jax.Array
    G: jax.Array


# parameter name -> its inner-channel / head axis (laid out over the mesh's "model" axis by
# latim_jax.model.sharding: the Mamba kinds' LayerKind.channel_axis); parameters not named here are
# replicated
CHANNEL_AXIS = {
    "in_proj": 1,
    "in_proj_b": 0,
    "conv_w": 1,
    "conv_b": 0,
    "x_proj": 0,
    "dt_proj": 1,
    "dt_bias": 0,
    "A_log": 0,
    "D": 0,
    "norm_w": 0,
    "out_proj": 0,
}


class _Mixer(ParamModule):
    """What both Mamba mixers share. ``kind`` names the layer kind ("mamba1" / "mamba2")."""

    NAMES = _PARAM_NAMES

    def __init__(self, config, params: dict):
        super().__init__(config, params)
        self.layout = channel_layout(config, self.kind)  # the checkpoint's order until a mesh lays it out

    def param_dict(self) -> dict:
        """The parameters as a plain dict in the checkpoint's order (config.param_shapes), whatever
        the layout they are held in."""
        return {n: self.layout.restore(n, v) for n, v in super().param_dict().items()}

    def lay_out(self, shards: int) -> None:
        """Hold in_proj and the conv in the layout over ``shards`` "model" shards (in place; the layer
        computes the same values). See :mod:`latim_jax.model.channel_layout`."""
        new = channel_layout(self.config, self.kind, shards)
        if new == self.layout:
            return
        for name, value in self.param_dict().items():  # the checkpoint's order
            if name in IN_ORDER + CONV_ORDER:
                self.param(name).set_value(new.lay_out(name, value))
        self.layout = new

    def value_channels(self, t):
        """The value (x) channels (..., e) of an array t (..., c) in the conv's channel order."""
        return self.layout.split(t, "conv", ("x",))[0]

    def value_conv(self):
        """The conv's weight (k, e) and bias (e,) or None on the value channels."""
        b = self._get("conv_b")
        return self.value_channels(self.conv_w[...]), None if b is None else self.value_channels(b)

    def value_in_proj(self):
        """in_proj's columns (d, e) and bias (e,) or None that make the value input x."""
        b = self._get("in_proj_b")
        (w,) = self.layout.split(self.in_proj[...], "in", ("x",))
        return w, None if b is None else self.layout.split(b, "in", ("x",))[0]

    @property
    def A(self):
        """A = -exp(A_log) in fp32: (e, n) Mamba-1, (h,) Mamba-2."""
        return -jnp.exp(self.A_log[...].astype(f32))

    def __call__(self, x=None, *, mask, ctx: Context = XLA, projected=None):
        """Mixer output o (b, l, d) fp32 for the normalised input x (b, l, d) (or ``projected``, its
        in_proj output, see :meth:`intermediates`); ``mask`` (b, l) bool of valid positions."""
        return self.output(self.intermediates(x, mask=mask, ctx=ctx, projected=projected))

    def in_projection(self, x):
        """in_proj's output (b, l, in_width) fp32 for the normalised input x (b, l, d)."""
        return linear(x, self.in_proj[...], self._get("in_proj_b"))

    def split_in_proj(self, x):
        """The in_proj output of x split into its parts (see :meth:`split_projection`)."""
        return self.split_projection(self.in_projection(x))

    def _projection(self, x, projected):
        """in_proj's output: ``projected`` when given (the caller computed it, e.g. a Block with its
        norm folded in: :func:`latim_jax.model.layers.normed_linear`), else that of x."""
        if (x is None) == (projected is None):
            raise ValueError("pass exactly one of x (the normalised input) and projected (in_proj(x))")
        return self.in_projection(x) if projected is None else projected

    def output(self, inter: Intermediates):
        """o = (y * G) @ W_out (+ b_out)."""
        return linear(inter.y * inter.G, self.out_proj[...], self._get("out_proj_b"))

    def conv_input(self, u, mask):
        """The conv input as the forward uses it: zero at padding (``mask`` (b, l) or (b,) bool), rounded
        to the weight dtype (the reference convolves in the weight dtype), returned in fp32."""
        u = u * mask[..., None].astype(u.dtype)
        return u.astype(self.in_proj[...].dtype).astype(f32)


class Mamba1Mixer(_Mixer):
    """The Mamba-1 selective-scan mixer (reference semantics of transformers' MambaMixer)."""

    kind = "mamba1"

    def split_projection(self, xz):
        """in_proj output (b, l, 2e) -> u, z (b, l, e) fp32."""
        u, z = self.layout.split(xz, "in", ("x",), ("z",))
        return u, z

    def ssm_params(self, v, mask):
        """v (b, l, e) -> Delta (b, l, e), B, C (b, l, n), all fp32; Delta = 0 where ``mask`` ((b, l) or
        (b,) bool) is False (see :func:`_skip_padding`): its pre-activation is set to -inf there, and
        softplus(-inf) = 0 exactly (with zero gradient). Masked after the softplus instead (a product
        or a select), XLA:CPU's program for one 130m layer's last row at L = 16384 needed 1.69 instead of
        1.51 GiB of temporaries: one more (b, l, e) buffer."""
        c = self.config
        dbc = linear(v, self.x_proj[...])
        dt_low, B, C = jnp.split(dbc, [c.dt_rank, c.dt_rank + c.d_state], axis=-1)
        if c.bcdt_norm:  # FalconMamba (no weight) / Jamba (weighted): RMS-normalise dt's input, B and C
            dtype = self.x_proj[...].dtype
            weights = (self._get("dt_norm_w"), self._get("B_norm_w"), self._get("C_norm_w"))
            dt_low, B, C = (
                _unit_rms(t, c.bcdt_eps, dtype, w) for t, w in zip((dt_low, B, C), weights, strict=True)
            )
        pre = linear(dt_low, self.dt_proj[...]) + self.dt_bias[...].astype(f32)
        delta = jax.nn.softplus(jnp.where(mask[..., None], pre, -jnp.inf))
        return delta, B, C

    def intermediates(
        self, x=None, *, mask, ctx: Context = XLA, hold_fixed=False, projected=None
    ) -> Intermediates:
        """All per-layer quantities for the input x (b, l, d), or for ``projected``, x's in_proj output
        (b, l, 2e) when the caller has it; padding (``mask`` False) is skipped. ``hold_fixed``: the
        same values, but no gradient through Delta, B, C, the activation's gate and the output gate
        (the quantities LaTIM holds fixed): the layer is then linear in u."""
        u, z = self.split_projection(self._projection(x, projected))
        u = self.conv_input(u, mask)
        c = split_causal_conv(u, self.conv_w[...], self._get("conv_b"), ctx=ctx)
        v = _value_activation(self.config.activation, c, hold_fixed)
        delta, B, C = _held(self.ssm_params(v, mask), hold_fixed)  # Delta = 0 at padding
        y, _ = dispatch.selective_scan(v, delta, self.A, B, C, self.D[...], ctx=ctx)
        (G,) = _held((jax.nn.silu(z),), hold_fixed)
        return Intermediates(u=u, c=c, delta=delta, B=B, C=C, y=y, G=G)

    def init_cache(self, batch: int, max_length: int = 0):
        """Zero recurrent cache: (conv (b, k-1, e), ssm (b, e, n)) (not growing with length)."""
        c = self.config
        return (
            jnp.zeros((batch, c.d_conv - 1, self.layout.total_width("conv")), f32),
            jnp.zeros((batch, c.d_inner, c.d_state), f32),
        )

    def step(self, x_t, cache, valid):
        """One token x_t (b, d) -> (o_t (b, d), cache); ``valid`` (b,) bool: False leaves the cache as a
        padding position would (zero conv input, no state update)."""
        conv_cache, state = cache
        u, z = self.split_in_proj(x_t)
        u = self.conv_input(u, valid)
        c_t, conv_cache = causal_conv_step(conv_cache, u, self.conv_w[...], self._get("conv_b"))
        v = activation(self.config.activation)(c_t)
        delta, B, C = self.ssm_params(v, valid)
        y, state = dispatch.selective_scan_step(state, v, delta, self.A, B, C, self.D[...])
        o = linear(y * jax.nn.silu(z), self.out_proj[...], self._get("out_proj_b"))
        return o, (conv_cache, state)


class Mamba2Mixer(_Mixer):
    """The Mamba-2 SSD mixer with grouped gated RMSNorm (transformers' Mamba2Mixer semantics)."""

    kind = "mamba2"

    def split_projection(self, zxbcdt):
        """in_proj output (b, l, 2e+2gn+h in the checkpoint's order) -> z (b, l, e), xBC (b, l, c: the
        conv's channels in the mixer's layout), dt (b, l, h), fp32."""
        z, xbc, dt = self.layout.split(zxbcdt, "in", ("z",), ("x", "B", "C"), ("dt",))
        return z, xbc, dt

    def split_xbc(self, v):
        """Post-activation xBC (..., c) -> x (..., h, p), B, C (..., g', n): g' = ``layout.groups`` (the
        checkpoint's g unless a mesh layout repeats groups per shard)."""
        c = self.config
        lead = v.shape[:-1]
        x, B, C = self.layout.split(v, "conv", ("x",), ("B",), ("C",))
        g = self.layout.groups
        return (
            x.reshape(*lead, c.n_heads, c.head_dim),
            B.reshape(*lead, g, c.d_state),
            C.reshape(*lead, g, c.d_state),
        )

    def delta(self, dt):
        """Delta = clamp(softplus(dt + dt_bias), time_step_limit), (..., h) fp32."""
        lo, hi = self.config.time_step_limit
        return jnp.clip(jax.nn.softplus(dt + self.dt_bias[...].astype(f32)), lo, hi)

    def gate(self, y, z):
        """The output multiplier G (y * G is out_proj's input); y, z (..., e). By ``config.ssm_norm``:
        "gated" w_norm * SiLU(z) / rms_group(y * SiLU(z)), "before_gate" w_norm * SiLU(z) / rms_group(y),
        "none" SiLU(z)."""
        c = self.config
        g = jax.nn.silu(z)
        if c.ssm_norm == "none":
            return g
        normed = y * g if c.ssm_norm == "gated" else y
        return self.norm_w[...].astype(f32) * g / group_rms(normed, c.n_groups, c.rms_eps)

    def intermediates(
        self, x=None, *, mask, ctx: Context = XLA, hold_fixed=False, projected=None
    ) -> Intermediates:
        """All per-layer quantities for the input x (b, l, d), or for ``projected``, its in_proj output
        (see Mamba-1); padding (``mask`` False) is skipped. ``hold_fixed``: no gradient through
        Delta, B, C, the activation's gate and G (see Mamba-1)."""
        c = self.config
        z, u, dt = self.split_projection(self._projection(x, projected))
        u = self.conv_input(u, mask)
        conv = split_causal_conv(u, self.conv_w[...], self._get("conv_b"), ctx=ctx)
        v = _value_activation(c.activation, conv, hold_fixed)
        xs, B, C = self.split_xbc(v)
        B, C, delta = _held((B, C, self.delta(dt)), hold_fixed)
        delta = _skip_padding(delta, mask)
        y, _ = dispatch.ssd(xs, delta, self.A, B, C, self.D[...], c.chunk_size, ctx=ctx)
        y = y.reshape(*y.shape[:-2], c.d_inner)
        (G,) = _held((self.gate(y, z),), hold_fixed)
        return Intermediates(u=u, c=conv, delta=delta, B=B, C=C, y=y, G=G)

    def init_cache(self, batch: int, max_length: int = 0):
        """Zero recurrent cache: (conv (b, k-1, e+2gn), ssm (b, h, p, n)) (not growing with length)."""
        c = self.config
        return (
            jnp.zeros((batch, c.d_conv - 1, self.layout.total_width("conv")), f32),
            jnp.zeros((batch, c.n_heads, c.head_dim, c.d_state), f32),
        )

    def step(self, x_t, cache, valid):
        """One token x_t (b, d) -> (o_t (b, d), cache); ``valid`` (b,) bool: False leaves the cache as a
        padding position would (zero conv input, no state update)."""
        c = self.config
        conv_cache, state = cache
        z, u, dt = self.split_in_proj(x_t)
        u = self.conv_input(u, valid)
        c_t, conv_cache = causal_conv_step(conv_cache, u, self.conv_w[...], self._get("conv_b"))
        xs, B, C = self.split_xbc(activation(c.activation)(c_t))
        delta = _skip_padding(self.delta(dt), valid)
        y, state = dispatch.ssd_step(state, xs, delta, self.A, B, C, self.D[...])
        y = y.reshape(y.shape[0], c.d_inner)
        o = linear(y * self.gate(y, z), self.out_proj[...], self._get("out_proj_b"))
        return o, (conv_cache, state)


def split_causal_conv(u, conv_w, conv_b=None, *, ctx: Context = XLA):
    """:func:`latim_jax.model.layers.causal_conv`, with the length split over the mesh's "seq" axis
    when the context has one: each shard convolves its rows after the previous shard's last k-1
    inputs (one ppermute; zeros before shard 0), so the values equal the unsplit conv's exactly."""
    seq = ctx.axis(SEQ)
    width = conv_w.shape[0] - 1
    if seq is None or width == 0:
        return causal_conv(u, conv_w, conv_b)

    def local(u, w, b=None):
        halo = sequence.previous_rows(u, width, seq)
        return causal_conv(jnp.concatenate([halo, u], axis=1), w, b)[:, width:]

    rows = sequence.rows_spec(ctx, u.shape[0], None)
    args, specs = (u, conv_w), (rows, P())
    if conv_b is not None:
        args, specs = args + (conv_b,), specs + (P(),)
    return sequence.split(local, ctx, specs, rows)(*args)


def _value_activation(name, c, hold_fixed):
    """act(c); held fixed, s(c) c with the gate s = act(c) / c frozen (the same value, linear in c)."""
    if not hold_fixed:
        return activation(name)(c)
    return jax.lax.stop_gradient(activation_gate(name, c)) * c


def _held(values, hold_fixed):
    """``values`` with stop_gradient when ``hold_fixed``."""
    return tuple(jax.lax.stop_gradient(v) for v in values) if hold_fixed else tuple(values)


def _skip_padding(delta, mask):
    """Delta = 0 at padding (``mask`` (b, l) or (b,) bool): exp(Delta A) = 1 and Delta B x = 0, so the
    state passes pad positions unchanged and a pad source gets zero hidden attention."""
    return delta * mask[..., None].astype(delta.dtype)


def _unit_rms(x, eps, dtype, weight=None):
    """x / rms(x) over the last axis, rounded to ``dtype`` as the reference returns it in the input's
    dtype, then times ``weight`` when there is one (Jamba applies it after the cast), in fp32."""
    y = rms_norm(x, jnp.ones((), f32), eps).astype(dtype).astype(f32)
    return y if weight is None else y * weight.astype(f32)


def mamba_shapes(c) -> dict[str, tuple[int, ...]]:
    """A Mamba mixer's parameters for ``c.version`` (math orientation, ``y = x @ W``).

    Mamba-1: in_proj (d, 2e), conv_w (k, e) [conv_w[k-1] multiplies the current token], conv_b (e,),
        x_proj (e, r+2n), dt_proj (r, e), dt_bias (e,), A_log (e, n), D (e,), out_proj (e, d);
        dt_norm_w (r,), B_norm_w, C_norm_w (n,) with weighted B/C/Delta norms (Jamba).
    Mamba-2: in_proj (d, 2e+2gn+h) [order z, x, B, C, dt], conv_w (k, e+2gn), conv_b (e+2gn,),
        dt_bias (h,), A_log (h,), D (h,), norm_w (e,) (none when ``ssm_norm`` is "none"), out_proj (e, d).
    Both: in_proj_b and out_proj_b when ``proj_bias`` (out_proj_b follows ``out_proj_bias`` when set),
        conv_b when ``conv_bias``.
    """
    e, n, k, d = c.d_inner, c.d_state, c.d_conv, c.d_model
    if c.version == 1:
        mixer = {
            "in_proj": (d, 2 * e),
            "conv_w": (k, e),
            "x_proj": (e, c.dt_rank + 2 * n),
            "dt_proj": (c.dt_rank, e),
            "dt_bias": (e,),
            "A_log": (e, n),
            "D": (e,),
            "out_proj": (e, d),
        }
        if c.bcdt_norm and c.bcdt_norm_weight:
            mixer.update(dt_norm_w=(c.dt_rank,), B_norm_w=(n,), C_norm_w=(n,))
        in_width = 2 * e
    else:
        h = c.n_heads
        in_width = 2 * e + 2 * c.n_groups * n + h
        mixer = {
            "in_proj": (d, in_width),
            "conv_w": (k, c.conv_dim),
            "dt_bias": (h,),
            "A_log": (h,),
            "D": (h,),
            "norm_w": (e,),
            "out_proj": (e, d),
        }
    if c.conv_bias:
        mixer["conv_b"] = (c.conv_dim,)
    if c.version == 2 and c.ssm_norm == "none":
        del mixer["norm_w"]
    if c.proj_bias:
        mixer["in_proj_b"] = (in_width,)
    if c.proj_bias if c.out_proj_bias is None else c.out_proj_bias:
        mixer["out_proj_b"] = (d,)
    return mixer


def _conv_uniform(key, shape, c):
    """The conv's weights and bias: U(+-1/sqrt(k))."""
    bound = 1.0 / math.sqrt(c.d_conv)
    return jax.random.uniform(key, shape, jnp.float32, -bound, bound)


def _dt_bias(key, shape, c, dt_min=1e-3, dt_max=1e-1, floor=1e-4):
    """softplus^{-1} of Delta drawn log-uniformly in [dt_min, dt_max]."""
    del c
    lo, hi = math.log(dt_min), math.log(dt_max)
    dt = jnp.exp(jax.random.uniform(key, (shape[0],)) * (hi - lo) + lo)
    dt = jnp.maximum(dt, floor)
    return dt + jnp.log(-jnp.expm1(-dt))


def _a_log(key, shape, c):
    """Mamba-1: log(1..n) per channel; Mamba-2: log U(1, 16) per head."""
    if c.version == 1:
        return jnp.log(jnp.broadcast_to(jnp.arange(1, c.d_state + 1, dtype=jnp.float32), shape))
    return jnp.log(jax.random.uniform(key, shape, minval=1.0, maxval=16.0))


def _ones(key, shape, c):
    del key, c
    return jnp.ones(shape)


# the Mamba mixers' initialisers beyond the generic fan-in rules (latim_jax.model.init)
MAMBA_INIT = {
    "conv_w": _conv_uniform, "conv_b": _conv_uniform, "dt_bias": _dt_bias, "A_log": _a_log, "D": _ones,
    "norm_w": _ones, "dt_norm_w": _ones, "B_norm_w": _ones, "C_norm_w": _ones,
}  # fmt: skip


def mamba_memory(c, b: int, length: int, rows: int, cols: int) -> int:
    """Bytes of one Mamba layer while decomposed (fp32): its factors (K + 3) b l e + 3 b l c + 2 b l g n
    + 5 b l d (c = e for Mamba-1, heads for Mamba-2) and in_proj's output, the scan's working set
    (Mamba-1: chunk x e x n per prompt; Mamba-2: its chunked SSD) and a score tile's working set
    (rows x cols x (e + d); Mamba-1 also its decay factors, (rows + cols) x e x n)."""
    e, d, n, K, L = c.d_inner, c.d_model, c.d_state, c.d_conv, length
    chans = e if c.version == 1 else c.n_heads
    groups = 1 if c.version == 1 else c.n_groups
    in_width = 2 * e if c.version == 1 else 2 * e + 2 * groups * n + c.n_heads
    factors = ((K + 3) * b * L * e + 3 * b * L * chans + 2 * b * L * groups * n + 5 * b * L * d) * 4
    factors += b * L * in_width * 4
    if c.version == 1:
        scan = 3 * b * min(L, 256) * e * n * 4
        work = b * (rows * cols * (4 * e + d) + (rows + cols) * e * n) * 4
    else:
        q = min(c.chunk_size, L)
        scan = b * (L // max(q, 1) + 1) * (c.n_heads * c.head_dim * n + q * q * c.n_heads) * 4
        work = b * rows * cols * (2 * e + d + chans) * 4
    return factors + scan + work


def check_mamba2(c) -> None:
    """Mamba-2's heads: the inner width a multiple of head_dim, the heads a multiple of n_groups."""
    if c.d_inner % c.head_dim:
        raise ValueError(
            f"Mamba-2 inner width {c.d_inner} (expand*d_model) is not a multiple of head_dim {c.head_dim}"
        )
    if c.n_heads % c.n_groups:
        raise ValueError(f"Mamba-2 n_heads {c.n_heads} is not a multiple of n_groups {c.n_groups}")


def _mamba_kind(module, version: int) -> LayerKind:
    return LayerKind(
        name=module.kind, display=f"Mamba-{version}", module=module, shapes=mamba_shapes,
        output_params=("out_proj", "out_proj_b"), init=MAMBA_INIT, channel_axis=CHANNEL_AXIS,
        memory=mamba_memory, version=version, folds_norm=True, check=check_mamba2 if version == 2 else None,
        splits_sequence=True, halo=lambda c: c.d_conv - 1,  # the conv's halo, the scan's state carried
    )  # fmt: skip


MAMBA1 = _mamba_kind(Mamba1Mixer, 1)
MAMBA2 = _mamba_kind(Mamba2Mixer, 2)
