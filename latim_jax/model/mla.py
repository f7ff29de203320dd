"""Multi-head latent attention sublayers (the "mla" kind: Kimi Linear's full-attention layers, DeepSeek-V2's
form without a rotary embedding) as a Flax NNX module.

Shape letters (beyond latim_jax.model.config's): H heads, n the per-head key part from the latent
("nope"), p the shared key part (one per position, every head reads it), v the value dim, r_q / r_kv
the query / key-value latent ranks.

    q_i     = xhat_i W_q                (or RMSNorm(xhat_i W_qa) W_qb with a query latent)    (H, n + p)
    [c | s] = xhat_j W_kva (+ b)        c_j = RMSNorm(c) the key-value latent (r_kv), s_j (p) shared
    [k_nope | v_j] = c_j W_kvb          per head; k_j = [k_nope | s_j]
    o_i     = concat_h(sum_j alpha^h_ij v^h_j) W_o (+ b_o),   alpha = softmax(q k^T / sqrt(n + p))

Each value v_j is computed from token j alone (its latent), so the attention kind's decomposition applies
unchanged with alpha held fixed (latim_jax.latim.mla). Parameters: q_proj (d, H (n + p)) or q_a (d, r_q),
q_a_norm (r_q,), q_b (r_q, H (n + p)); kv_a (d, r_kv + p), kv_norm (r_kv,), kv_b (r_kv, H (n + v)),
o_proj (H v, d); with a bias: q_a_b (r_q,), kv_a_b (r_kv + p,), o_b (d,).
"""

from __future__ import annotations

import dataclasses
import math
import types

import jax
import jax.numpy as jnp

from latim_jax.kernels import f32
from latim_jax.model.attention import AttentionMixer, attention_memory
from latim_jax.model.kind import LayerKind
from latim_jax.model.layers import linear, rms_norm


@dataclasses.dataclass(frozen=True)
class MLAConfig:
    """The "mla" kind's config section (``MambaConfig.sections["mla"]``): heads, the query latent rank
    (0: a full q projection), the key-value latent rank, the per-head key part from the latent
    (``nope_dim``), the shared key part (``shared_dim``), the value dim, a bias on kv_a and o_proj, the
    latents' norm eps."""

    heads: int
    kv_rank: int
    nope_dim: int
    shared_dim: int
    v_dim: int
    q_rank: int = 0
    bias: bool = False
    norm_eps: float = 1e-6

    def __post_init__(self):
        for name in ("heads", "kv_rank", "nope_dim", "v_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"MambaConfig.sections['mla'].{name} must be a positive int, found {value!r}"
                )
        for name in ("q_rank", "shared_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"MambaConfig.sections['mla'].{name} must be an int >= 0, found {value!r}")

    @classmethod
    def from_dict(cls, data: dict) -> MLAConfig:
        """Build from a dict; unknown keys are an error naming them."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"unknown field(s) {unknown} in sections['mla']; expected a subset of {sorted(known)}"
            )
        return cls(**data)

    @property
    def qk_dim(self) -> int:
        """n + p: a query's and a key's dim."""
        return self.nope_dim + self.shared_dim


class MLAMixer(AttentionMixer):
    """Multi-head latent attention (see the module docstring): the attention kind's forward, tiles and
    generation with its own projections (every head its own keys and values: G = H)."""

    kind = "mla"
    NAMES = (
        "q_proj",
        "q_a",
        "q_a_b",
        "q_a_norm",
        "q_b",
        "kv_a",
        "kv_a_b",
        "kv_norm",
        "kv_b",
        "o_proj",
        "o_b",
    )

    @property
    def section(self) -> MLAConfig:
        """This kind's config section."""
        return self.config.section("mla")

    @property
    def scale(self) -> float:
        """The softmax scale 1 / sqrt(n + p)."""
        return 1.0 / math.sqrt(self.section.qk_dim)

    @property
    def window(self) -> int:
        """No sliding window."""
        return 0

    @property
    def cache_dims(self):
        """((H, n + p), (H, v)): the expanded keys and values (the cache is not kept as latents)."""
        s = self.section
        return (s.heads, s.qk_dim), (s.heads, s.v_dim)

    def gate(self, x):
        """No output gate."""
        del x

    def project(self, x, positions):
        """q (scaled) (b, l, H, n + p), k (b, l, H, n + p), v (b, l, H, v) fp32 for x (b, l, d)."""
        del positions  # no rotary embedding
        s = self.section
        b, l, _ = x.shape
        if self._get("q_proj") is not None:
            q = linear(x, self.q_proj[...])
        else:
            qa = rms_norm(linear(x, self.q_a[...]), self.q_a_norm[...], s.norm_eps).astype(
                self.q_b[...].dtype
            )
            q = linear(qa, self.q_b[...])
        q = q.reshape(b, l, s.heads, s.qk_dim)
        kva = linear(x, self.kv_a[...], self._get("kv_a_b"))
        c = rms_norm(kva[..., : s.kv_rank], self.kv_norm[...], s.norm_eps).astype(self.kv_b[...].dtype)
        shared = kva[..., s.kv_rank :]  # (b, l, p)
        kv = linear(c, self.kv_b[...]).reshape(b, l, s.heads, s.nope_dim + s.v_dim)
        k_nope, v = kv[..., : s.nope_dim], kv[..., s.nope_dim :]
        k = jnp.concatenate([k_nope, jnp.broadcast_to(shared[:, :, None], (b, l, s.heads, s.shared_dim))], -1)
        return q * self.scale, k, v

    def value_bias(self):
        """(H v,) zeros: every value is its token's (the latent's bias and norm act on the token alone)."""
        s = self.section
        return jnp.zeros((s.heads * s.v_dim,), f32)


def mla_shapes(c) -> dict[str, tuple[int, ...]]:
    """An mla sublayer's parameters (see the module docstring)."""
    s, d = c.section("mla"), c.d_model
    out = {
        "kv_a": (d, s.kv_rank + s.shared_dim),
        "kv_norm": (s.kv_rank,),
        "kv_b": (s.kv_rank, s.heads * (s.nope_dim + s.v_dim)),
        "o_proj": (s.heads * s.v_dim, d),
    }
    if s.q_rank:
        out.update(q_a=(d, s.q_rank), q_a_norm=(s.q_rank,), q_b=(s.q_rank, s.heads * s.qk_dim))
    else:
        out["q_proj"] = (d, s.heads * s.qk_dim)
    if s.bias:
        out.update(kv_a_b=(s.kv_rank + s.shared_dim,), o_b=(d,))
        if s.q_rank:
            out["q_a_b"] = (s.q_rank,)
    return out


def _mla_memory(c, b: int, length: int, rows: int, cols: int) -> int:
    """The attention kind's estimate at the mla's widths (q, k of n + p, values of v per head)."""
    s = c.section("mla")
    view = types.SimpleNamespace(
        attn_heads=s.heads, attn_kv_heads=s.heads, attn_head_dim=max(s.qk_dim, s.v_dim), d_model=c.d_model
    )
    return attention_memory(view, b, length, rows, cols)


def _fan_in(key, shape, c):
    del c
    bound = 1.0 / math.sqrt(shape[0])
    return jax.random.uniform(key, shape, f32, -bound, bound)


def _ones(key, shape, c):
    del key, c
    return jnp.ones(shape)


MLA = LayerKind(
    name="mla", display="latent attention", module=MLAMixer, shapes=mla_shapes, section=MLAConfig,
    output_params=("o_proj", "o_b"), memory=_mla_memory, holds_attention=True,
    init={"q_a": _fan_in, "q_b": _fan_in, "kv_a": _fan_in, "kv_b": _fan_in, "q_a_norm": _ones,
          "kv_norm": _ones, "kv_a_b": _fan_in, "q_a_b": _fan_in},
    splits_sequence=True,  # the attention kind's forward: keys, values and the mask gathered along the length
)  # fmt: skip
