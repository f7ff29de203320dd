"""Gated DeltaNet sublayers (the "gdn" kind: Qwen3-Next, Qwen3.5, OLMo-Hybrid) and Kimi Delta Attention
(the "kda" kind: Kimi Linear, a decay per key channel; :class:`KimiDeltaMixer`) as Flax NNX modules.

Shape letters (beyond latim_jax.model.config's): Hk key heads, H value heads (a multiple of Hk), k key
dim, v value dim, K conv taps; e = H v the value width, m = 2 Hk k + H v the conv's channels.

    [q | k | v | z] = xhat W_in,   [b | a] = xhat W_ba           (xhat the pre-normed input, zero at padding)
    [q | k | v]     = act(conv([q | k | v]))                      (depthwise, causal, K taps)
    q, k            = l2norm per key head (q also * k^-1/2), repeated to the H value heads
    beta            = beta_scale * sigmoid(b),   g = -exp(A_log) softplus(a + dt_bias)
    o               = the gated delta rule over v (latim_jax.kernels.delta_rule)
    y               = w_norm * o / rms_head(o) * SiLU(z)              (a gated RMSNorm per value head)
    out             = y W_out

Padding positions take beta = 0 and g = 0 (an identity step: the state passes them unchanged), so a
padded prompt equals the prompt alone. With one prompt's length split over a mesh's "seq" axis the
conv reads the previous shard's last K-1 inputs and the rule's state is carried across shards
(:func:`split_rule`, :mod:`latim_jax.parallel.sequence`). Parameters (the checkpoint readers map each
family's names onto these): in_proj (d, 2 Hk k + 2 e) [order q, k, v, z], ba_proj (d, 2 H) [b, a],
conv_w (K, m), conv_b (m,) when ``conv_bias``, dt_bias (H,), A_log (H,), norm_w (v,), out_proj (e, d).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from latim_jax.kernels import delta_rule, f32
from latim_jax.model.kind import LayerKind
from latim_jax.model.layers import activation, causal_conv_step, linear
from latim_jax.model.mixers import split_causal_conv
from latim_jax.model.params import ParamModule
from latim_jax.parallel import sequence
from latim_jax.parallel.context import XLA, Context
from latim_jax.parallel.mesh import SEQ

ACTIVATIONS = ("silu", "identity")


@dataclasses.dataclass(frozen=True)
class DeltaRuleConfig:
    """The "gdn" kind's config section (``MambaConfig.sections["gdn"]``): key / value heads and head
    dims, the conv's taps and bias, the chunk of the forward (rounding only), ``beta_scale`` (1: beta in
    (0, 1); 2: OLMo-Hybrid's (0, 2), negative eigenvalues allowed), the gated norm's eps, the post-conv
    activation ("silu" or "identity")."""

    k_heads: int
    v_heads: int
    k_dim: int
    v_dim: int
    conv: int = 4
    conv_bias: bool = False
    chunk: int = 64
    beta_scale: float = 1.0
    norm_eps: float = 1e-6
    activation: str = "silu"

    def __post_init__(self):
        for name in ("k_heads", "v_heads", "k_dim", "v_dim", "conv", "chunk"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"MambaConfig.sections['gdn'].{name} must be a positive int, found {value!r}"
                )
        if self.v_heads % self.k_heads:
            raise ValueError(
                f"MambaConfig.sections['gdn']: v_heads {self.v_heads} is not a multiple of k_heads "
                f"{self.k_heads}"
            )
        if self.activation not in ACTIVATIONS:
            raise ValueError(
                f"MambaConfig.sections['gdn'].activation must be one of {ACTIVATIONS}, found "
                f"{self.activation!r}"
            )
        if not 0 < float(self.beta_scale) <= 2:
            raise ValueError(
                f"MambaConfig.sections['gdn'].beta_scale must be in (0, 2], found {self.beta_scale!r}"
            )

    @classmethod
    def from_dict(cls, data: dict) -> DeltaRuleConfig:
        """Build from a dict (a config.json section); unknown keys are an error naming them."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"unknown field(s) {unknown} in sections['gdn']; expected a subset of {sorted(known)}"
            )
        return cls(**data)

    @property
    def key_width(self) -> int:
        """Hk k: the q (and the k) channels."""
        return self.k_heads * self.k_dim

    @property
    def value_width(self) -> int:
        """e = H v: the value (and the gate z) channels."""
        return self.v_heads * self.v_dim

    @property
    def conv_width(self) -> int:
        """m = 2 Hk k + H v: the channels through the conv."""
        return 2 * self.key_width + self.value_width


@dataclasses.dataclass(frozen=True)
class DeltaIntermediates:
    """What one forward of a gdn sublayer computes (fp32), read again by the decomposition:
    u (b, l, m) the conv input (zero at padding), c (b, l, m) the conv's pre-activation, q, k (b, l, H, k)
    normalised (q scaled), v (b, l, H, v), g, beta (b, l, H), z (b, l, e), o (b, l, H, v) the rule's
    output, G (b, l, e) the output gate w_norm * SiLU(z) / rms_head(o)."""

    u: jax.Array
    c: jax.Array
    q: jax.Array
    k: jax.Array
    v: jax.Array
    g: jax.Array
    beta: jax.Array
    z: jax.Array
    o: jax.Array
    G: jax.Array


class GatedDeltaNetMixer(ParamModule):
    """A Gated DeltaNet sublayer on the normalised input (see the module docstring)."""

    kind = "gdn"
    NAMES = ("in_proj", "ba_proj", "conv_w", "conv_b", "dt_bias", "A_log", "norm_w", "out_proj")

    @property
    def section(self) -> DeltaRuleConfig:
        """This kind's config section."""
        return self.config.section(self.kind)

    def project(self, x):
        """The normalised input x (..., d) -> ([q | k | v] (..., m) the conv's input, z (..., e) the output
        gate's pre-activation): in_proj's output split."""
        y = linear(x, self.in_proj[...])
        m = self.section.conv_width
        return y[..., :m], y[..., m:]

    def heads(self, c):
        """The conv's output (..., m) -> q, k (..., H, k) normalised and repeated, v (..., H, v)."""
        s = self.section
        kw = s.key_width
        q = c[..., :kw].reshape(*c.shape[:-1], s.k_heads, s.k_dim)
        k = c[..., kw : 2 * kw].reshape(*c.shape[:-1], s.k_heads, s.k_dim)
        v = c[..., 2 * kw :].reshape(*c.shape[:-1], s.v_heads, s.v_dim)
        rep = s.v_heads // s.k_heads
        q = jnp.repeat(delta_rule.l2_normalise(q), rep, axis=-2) / math.sqrt(s.k_dim)
        k = jnp.repeat(delta_rule.l2_normalise(k), rep, axis=-2)
        return q, k, v

    def rates(self, x, valid):
        """(g, beta) (..., H) for the normalised input x (..., d), from ba_proj; 0 and 0 at padding (an
        identity step)."""
        s = self.section
        ba = linear(x, self.ba_proj[...])
        b, a = ba[..., : s.v_heads].astype(f32), ba[..., s.v_heads :].astype(f32)
        beta = s.beta_scale * jax.nn.sigmoid(b)
        g = -jnp.exp(self.A_log[...].astype(f32)) * jax.nn.softplus(a + self.dt_bias[...].astype(f32))
        return jnp.where(valid, g, 0.0), jnp.where(valid, beta, 0.0)

    GATE = staticmethod(jax.nn.silu)  # the gated norm's activation of z

    def gate(self, o, z):
        """G (..., e) = w_norm * act(z) / rms_head(o) (act: SiLU; KDA: sigmoid): y = o * G is the gated
        RMSNorm of each head."""
        s = self.section
        rms = jnp.sqrt(jnp.mean(o * o, axis=-1, keepdims=True) + s.norm_eps)  # (..., H, 1)
        w = self.norm_w[...].astype(f32)
        zh = z.astype(f32).reshape(o.shape)
        return (w * self.GATE(zh) / rms).reshape(z.shape)

    def intermediates(self, x, *, mask, ctx: Context = XLA, values=None) -> DeltaIntermediates:
        """The forward's intermediates for the normalised input x (b, l, d); ``values`` (b, l, H, v):
        run the rule over these values instead of the layer's own (the decomposition's token sums)."""
        s = self.section
        valid = mask[..., None]
        x = jnp.where(valid, x, jnp.zeros((), x.dtype))
        qkv, z = self.project(x)
        u = qkv.astype(self.conv_w[...].dtype)
        c = split_causal_conv(u, self.conv_w[...], self._get("conv_b"), ctx=ctx)
        q, k, v = self.heads(activation(s.activation)(c))
        g, beta = self.rates(x, valid)
        o = split_rule(q, k, v if values is None else values, g, beta, s.chunk, ctx)
        return DeltaIntermediates(u=u, c=c, q=q, k=k, v=v, g=g, beta=beta, z=z, o=o, G=self.gate(o, z))

    def output(self, inter: DeltaIntermediates):
        """out (b, l, d) fp32 = (o * G) W_out, the value path rounded to the weight dtype as the reference
        feeds out_proj."""
        y = inter.o.reshape(inter.G.shape) * inter.G
        return linear(y, self.out_proj[...])

    def __call__(self, x, *, mask, ctx: Context = XLA):
        """out (b, l, d) fp32 for the normalised input x (b, l, d); ``mask`` (b, l) bool of valid
        positions."""
        return self.output(self.intermediates(x, mask=mask, ctx=ctx))

    def init_cache(self, batch: int, max_length: int):
        """(conv window (b, K-1, m), state (b, H, k, v)) for generation."""
        del max_length
        s = self.section
        conv = jnp.zeros((batch, s.conv - 1, s.conv_width), self.conv_w[...].dtype)
        return conv, jnp.zeros((batch, s.v_heads, s.k_dim, s.v_dim), f32)

    def step(self, x_t, cache, valid):
        """One token x_t (b, d) -> (out_t (b, d), cache): the recurrent form of the rule. A position with
        ``valid`` False leaves the cache unchanged."""
        s = self.section
        conv, S = cache
        x_t = jnp.where(valid[:, None], x_t, jnp.zeros((), x_t.dtype))
        qkv, z = self.project(x_t)
        c, new_conv = causal_conv_step(conv, qkv.astype(conv.dtype), self.conv_w[...], self._get("conv_b"))
        q, k, v = self.heads(activation(s.activation)(c))
        g, beta = self.rates(x_t, valid[:, None])
        o, new_S = delta_rule.step(S, q, k, v, g, beta)
        out = linear((o.reshape(z.shape) * self.gate(o, z)), self.out_proj[...])
        keep = valid[:, None, None]
        return out, (jnp.where(keep, new_conv, conv), jnp.where(keep[..., None], new_S, S))


def split_rule(q, k, v, g, beta, chunk: int, ctx: Context = XLA):
    """The rule's output o (b, l, H, v) (:func:`latim_jax.kernels.delta_rule.chunked` from a zero state),
    with the length split over the mesh's "seq" axis when the context has one: each shard runs the rule
    from zero over its values and, beside them, k zero value columns from the identity state, one call
    giving its final state F, its transition P = A_end ... A_start (S_out = P S_in + F) and, per position,
    (A_t ... A_start)^T q_t; the state entering it from the previous shards' summaries
    (:func:`latim_jax.parallel.sequence.delta_carry_in`) then adds S_in^T (A_t ... A_start)^T q_t to its
    outputs (exact: the rule is linear in its state)."""
    seq = ctx.axis(SEQ)
    if seq is None:
        return delta_rule.chunked(q, k, v, g, beta, chunk)[0]

    def local(q, k, v, g, beta):
        b, _, H, dk = k.shape
        dv = v.shape[-1]
        values = jnp.concatenate([v.astype(f32), jnp.zeros(k.shape, f32)], axis=-1)
        eye = jnp.broadcast_to(jnp.eye(dk, dtype=f32), (b, H, dk, dk))
        state = jnp.concatenate([jnp.zeros((b, H, dk, dv), f32), eye], axis=-1)
        o, S = delta_rule.chunked(q, k, values, g, beta, chunk, state=state)
        S_in = sequence.delta_carry_in(S[..., :dv], S[..., dv:], seq)
        return o[..., :dv] + jnp.einsum("bmhk,bhkv->bmhv", o[..., dv:], S_in, precision="highest")

    heads = sequence.rows_spec(ctx, q.shape[0], None, None)  # (b, l, H, k|v)
    rates = sequence.rows_spec(ctx, q.shape[0], *(None,) * (g.ndim - 2))  # g (b, l, H[, k])
    specs = (heads, heads, heads, rates, sequence.rows_spec(ctx, q.shape[0], None))
    return sequence.split(local, ctx, specs, heads)(q, k, v, g, beta)


def gdn_shapes(c) -> dict[str, tuple[int, ...]]:
    """A gdn sublayer's parameters (see the module docstring)."""
    s, d = c.section("gdn"), c.d_model
    out = {
        "in_proj": (d, s.conv_width + s.value_width),
        "ba_proj": (d, 2 * s.v_heads),
        "conv_w": (s.conv, s.conv_width),
        "dt_bias": (s.v_heads,),
        "A_log": (s.v_heads,),
        "norm_w": (s.v_dim,),
        "out_proj": (s.value_width, d),
    }
    if s.conv_bias:
        out["conv_b"] = (s.conv_width,)
    return out


def _uniform(bound):
    def init(key, shape, c):
        del c
        return jax.random.uniform(key, shape, f32, -bound(shape), bound(shape))

    return init


def _conv(key, shape, c):
    bound = 1.0 / math.sqrt(shape[0])  # conv_w (K, m): U(+-1/sqrt(K)); conv_b: U(+-1/sqrt(m))
    return jax.random.uniform(key, shape, f32, -bound, bound)


def _dt_bias(key, shape, c, dt_min=1e-3, dt_max=1e-1):
    """softplus^{-1} of a rate drawn log-uniformly in [dt_min, dt_max]."""
    del c
    lo, hi = math.log(dt_min), math.log(dt_max)
    dt = jnp.exp(jax.random.uniform(key, shape) * (hi - lo) + lo)
    return dt + jnp.log(-jnp.expm1(-dt))


def _a_log(key, shape, c):
    del c
    return jnp.log(jax.random.uniform(key, shape, minval=1.0, maxval=16.0))


def _ones(key, shape, c):
    del key, c
    return jnp.ones(shape)


def delta_memory(name: str, per_channel: bool = False):
    """The memory function of a delta-rule kind whose section is ``sections[name]`` (``per_channel``: a
    decay per key channel, whose chunks hold (C, C, k) decays per head)."""

    def memory(c, b: int, length: int, rows: int, cols: int) -> int:
        s = c.section(name)
        extra = b * length * s.v_heads * min(s.chunk, length) * s.k_dim * 4 if per_channel else 0
        return _delta_memory(s, c, b, length, rows, cols) + extra

    return memory


def _delta_memory(s, c, b: int, length: int, rows: int, cols: int) -> int:
    """Bytes of one gdn layer while decomposed (fp32): its factors (K + 3) b l e tap values, gate and
    output, q, k (b l H k each), g, beta, the conv's b l m twice, the chunked rule's per-chunk UT
    systems (b l H C), 5 b l d of streams; per score tile M with its one-hot state (b H (k + r)
    (cols + K)) and the pair values and contributions (b r cols (e + d))."""
    d, L = c.d_model, length
    e, H = s.value_width, s.v_heads
    factors = (s.conv + 3) * b * L * e + 2 * b * L * H * s.k_dim + 2 * b * L * H + 2 * b * L * s.conv_width
    factors += b * L * H * min(s.chunk, L) * 3 + 5 * b * L * d
    tile = b * H * (s.k_dim + rows) * (cols + s.conv) + b * rows * cols * (e + d)
    return (factors + tile) * 4


GDN = LayerKind(
    name="gdn", display="Gated DeltaNet", module=GatedDeltaNetMixer, shapes=gdn_shapes,
    section=DeltaRuleConfig, output_params=("out_proj",), memory=delta_memory("gdn"),
    init={"conv_w": _conv, "conv_b": _conv, "dt_bias": _dt_bias, "A_log": _a_log, "norm_w": _ones,
          "ba_proj": _uniform(lambda shape: 1.0 / math.sqrt(shape[0]))},
    channel_axis={},  # replicated over "model" for now: a head-matched layout is future work
    splits_sequence=True,  # the conv's halo and the rule's state carried across "seq" shards: split_rule
    halo=lambda c: c.section("gdn").conv - 1,
)  # fmt: skip


class KimiDeltaMixer(GatedDeltaNetMixer):
    """Kimi Delta Attention (the "kda" kind: Kimi Linear): the gated delta rule with a decay per key
    channel, D_t = Diag(e^{g_t}) with g_t = -exp(A_log) softplus(xhat W_fa W_fb + dt_bias) (one A per
    head), beta = sigmoid(xhat W_b), and the gated norm's gate sigmoid(xhat W_ga W_gb) (low-rank
    projections). Heads: k_heads = v_heads, k_dim = v_dim. Parameters: in_proj (d, 3 H k) [q, k, v],
    conv_w (K, 3 H k), decay_a (d, k), decay_b (k, H k), dt_bias (H k,), A_log (H,), b_proj (d, H),
    gate_a (d, k), gate_b (k, H v), norm_w (v,), out_proj (H v, d)."""

    kind = "kda"
    NAMES = ("in_proj", "conv_w", "conv_b", "decay_a", "decay_b", "dt_bias", "A_log", "b_proj", "gate_a",
             "gate_b", "norm_w", "out_proj")  # fmt: skip
    GATE = staticmethod(jax.nn.sigmoid)

    def project(self, x):
        """([q | k | v] (..., 3 H k), the gate's pre-activation (..., H v) from its low-rank pair)."""
        return linear(x, self.in_proj[...]), linear(linear(x, self.gate_a[...]), self.gate_b[...])

    def rates(self, x, valid):
        """(g (..., H, k), beta (..., H)); 0 and 0 at padding (an identity step)."""
        s = self.section
        f = linear(linear(x, self.decay_a[...]), self.decay_b[...]) + self.dt_bias[...].astype(f32)
        f = f.reshape(*f.shape[:-1], s.k_heads, s.k_dim)
        g = -jnp.exp(self.A_log[...].astype(f32))[:, None] * jax.nn.softplus(f)
        beta = s.beta_scale * jax.nn.sigmoid(linear(x, self.b_proj[...]))
        return jnp.where(valid[..., None], g, 0.0), jnp.where(valid, beta, 0.0)


def check_kda(c) -> None:
    """KDA's heads: as many key as value heads, of one dim."""
    s = c.section("kda")
    if s.k_heads != s.v_heads or s.k_dim != s.v_dim:
        raise ValueError(
            f"MambaConfig.sections['kda']: Kimi Delta Attention has k_heads == v_heads and k_dim == v_dim, "
            f"found {s.k_heads}, {s.v_heads} heads of {s.k_dim}, {s.v_dim}"
        )


def kda_shapes(c) -> dict[str, tuple[int, ...]]:
    """A kda sublayer's parameters (see :class:`KimiDeltaMixer`)."""
    s, d = c.section("kda"), c.d_model
    H, k = s.k_heads, s.k_dim
    out = {
        "in_proj": (d, s.conv_width),
        "conv_w": (s.conv, s.conv_width),
        "decay_a": (d, k),
        "decay_b": (k, H * k),
        "dt_bias": (H * k,),
        "A_log": (H,),
        "b_proj": (d, H),
        "gate_a": (d, k),
        "gate_b": (k, s.value_width),
        "norm_w": (s.v_dim,),
        "out_proj": (s.value_width, d),
    }
    if s.conv_bias:
        out["conv_b"] = (s.conv_width,)
    return out


_FAN_IN = _uniform(lambda shape: 1.0 / math.sqrt(shape[0]))

KDA = LayerKind(
    name="kda", display="Kimi Delta Attention", module=KimiDeltaMixer, shapes=kda_shapes, check=check_kda,
    section=DeltaRuleConfig, output_params=("out_proj",), memory=delta_memory("kda", per_channel=True),
    init={"conv_w": _conv, "conv_b": _conv, "dt_bias": _dt_bias, "A_log": _a_log, "norm_w": _ones,
          "decay_a": _FAN_IN, "decay_b": _FAN_IN, "b_proj": _FAN_IN, "gate_a": _FAN_IN, "gate_b": _FAN_IN},
    splits_sequence=True, halo=lambda c: c.section("kda").conv - 1,
)  # fmt: skip
