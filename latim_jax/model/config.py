"""The model configuration shared by Mamba-1 and Mamba-2, and the parameter shapes it implies.

Shape glossary (used across the library):
    b batch, l sequence length, d model width (d_model), e inner width (expand * d),
    n state size (d_state), r dt rank (Mamba-1), h heads, p head dim (e = h * p, Mamba-2),
    g groups (Mamba-2 B/C), k conv width (d_conv), v vocabulary rows (padded);
    attention sublayers: H query heads, G key/value heads, a head dim (attn_head_dim);
    token-wise MLP sublayers: f hidden width (mlp_width).

A model is a stack of residual sublayers h + Mixer(RMSNorm(h)), each of one *kind*
(:data:`LAYER_KINDS`): the Mamba mixer of ``version`` ("mamba1" / "mamba2"), softmax attention
("attention"), or a token-wise MLP ("mlp"). A plain Mamba model has ``layer_kinds=()``: every
sublayer is its Mamba mixer. A hybrid lists one kind per sublayer (Nemotron-H's pattern, Bamba's
mixer + feed-forward pairs written as two sublayers each).
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

ACTIVATIONS = ("silu", "relu", "identity")
MLP_ACTIVATIONS = ("silu", "relu", "relu2", "gelu", "gelu_tanh")
LAYER_KINDS = ("mamba1", "mamba2", "attention", "mlp", "moe", "parallel", "shared")
# the kinds that hold a softmax attention (a parallel block: Mamba-2 and attention side by side; a
# shared block: Zamba2's transformer block feeding a Mamba-2's input)
ATTENTION_KINDS = ("attention", "parallel", "shared")
# how Mamba-2's output y meets its gate SiLU(z) (Falcon-H1 picks per config): "gated" RMSNorm of
# y * SiLU(z) (mamba_ssm, transformers' Mamba2), "before_gate" RMSNorm(y) * SiLU(z), "none" y * SiLU(z)
SSM_NORMS = ("gated", "before_gate", "none")
# each kind's parameters on its output side: scaling them scales the sublayer's output (a residual
# multiplier folds into them)
OUTPUT_PARAMS = {
    "mamba1": ("out_proj", "out_proj_b"),
    "mamba2": ("out_proj", "out_proj_b"),
    "attention": ("o_proj", "o_b"),
    "mlp": ("down_proj", "down_b"),
    "moe": ("experts_down", "shared_down", "shared_down_b"),  # latent MoE: latent_out(_b), not experts_down
    "parallel": ("out_proj", "out_proj_b", "o_proj", "o_b"),
    "shared": ("out_proj", "out_proj_b"),  # the shared block's output reaches the stream only through the SSM
}
MOE_ROUTERS = ("softmax_topk", "softmax_all", "sigmoid_groups")
# how plots, tables and the CLI name each kind
KIND_NAMES = {"mamba1": "Mamba-1", "mamba2": "Mamba-2", "attention": "attention", "mlp": "MLP", "moe": "MoE",
              "parallel": "Mamba-2 + attention", "shared": "shared block + Mamba-2"}  # fmt: skip


@dataclasses.dataclass(frozen=True, kw_only=True)
class MambaConfig:
    """Architecture of a Mamba-1 (``version=1``) or Mamba-2 (``version=2``) language model.

    ``vocab_size`` is the number of embedding rows (padded vocabulary). ``activation`` is the
    post-conv activation of the value path (the output gate is always SiLU, as in the reference).
    ``time_step_limit`` clamps Mamba-2's Delta (the default ``(0, inf)`` is a no-op).
    A "parallel" sublayer (Falcon-H1) runs the Mamba-2 mixer and attention on the same normalised
    input and adds their outputs (each family's multipliers folded into the weights). A "shared"
    sublayer (Zamba2) is a Mamba-2 sublayer whose input also receives a transformer block's output:
    h + Mamba2(RMSNorm(h + t)), t = W_s MLP(RMSNorm(Attention(RMSNorm([h; h^0])))) with h^0 the
    embeddings (the attention reads 2 d channels).
    """

    version: int
    d_model: int
    n_layers: int
    vocab_size: int
    d_state: int = 16
    d_conv: int = 4
    expand: int = 2
    dt_rank: int = 0  # Mamba-1; 0 means ceil(d_model / 16)
    head_dim: int = 64  # Mamba-2
    n_groups: int = 1  # Mamba-2
    chunk_size: int = 256  # Mamba-2 (only changes rounding)
    conv_bias: bool = True
    proj_bias: bool = False  # bias on in_proj and out_proj
    out_proj_bias: bool | None = None  # out_proj's bias when it differs from proj_bias (Falcon-H1)
    ssm_norm: str = "gated"  # Mamba-2's output norm (SSM_NORMS)
    rms_eps: float = 1e-5
    tie_embeddings: bool = True
    activation: str = "silu"
    time_step_limit: tuple[float, float] = (0.0, math.inf)
    vocab_size_unpadded: int | None = None
    ssm_inner: int = 0  # the SSM inner width e when it is not expand * d_model (Nemotron-H: heads * head_dim)
    # Mamba-1 variants (FalconMamba, Jamba): RMSNorm without weight of dt's low-rank input, B and C
    bcdt_norm: bool = False
    bcdt_eps: float = 1e-6
    bcdt_norm_weight: bool = False  # Jamba: those norms carry weights (dt_norm_w, B_norm_w, C_norm_w)
    # hybrids: one kind per sublayer (empty: every sublayer is the Mamba mixer of `version`)
    layer_kinds: tuple[str, ...] = ()
    family: str = ""  # the checkpoint family it was read from ("nemotron_h", ...), for display
    # attention sublayers
    attn_heads: int = 0
    attn_kv_heads: int = 0
    attn_head_dim: int = 0
    attn_bias: bool = False  # q, k, v biases
    attn_out_bias: bool = False
    attn_scale: float = 0.0  # 0: 1 / sqrt(attn_head_dim)
    rope_theta: float = 0.0  # 0: no rotary embedding
    rope_dim: int = 0  # rotated channels per head (0: the whole head)
    sliding_window: int = 0  # 0: none; else a target attends to at most this many sources (itself included)
    # token-wise MLP sublayers
    mlp_width: int = 0
    mlp_activation: str = "silu"
    mlp_gated: bool = False  # act(x W_gate) * (x W_up), then W_down
    mlp_bias: bool = False
    # mixture-of-experts sublayers (experts and the shared expert take the MLP's form above)
    moe_experts: int = 0
    moe_top_k: int = 0
    moe_width: int = 0  # each expert's hidden width
    moe_shared_width: int = 0  # the shared expert's (0: none)
    moe_router: str = "softmax_topk"
    moe_groups: int = 1  # sigmoid_groups: experts in groups, the best moe_topk_groups groups eligible
    moe_topk_groups: int = 1
    moe_norm_topk: bool = True
    moe_scale: float = 1.0
    moe_latent: int = 0  # Nemotron-H: the routed experts work in a latent width (0: in d_model)
    # multipliers (Granite): the token embeddings are scaled by embedding_multiplier (inputs_embeds are
    # h^0 as given), the logits divided by logits_scaling; a residual multiplier is folded into each
    # sublayer's output projection when the checkpoint is read
    embedding_multiplier: float = 1.0
    logits_scaling: float = 1.0

    @property
    def n_tokens(self) -> int:
        """The real vocabulary: ids in [0, n_tokens) are tokens, and the logits have n_tokens columns
        (mamba_ssm pads the embedding to ``vocab_size`` rows, a multiple of 8 or 16: the rows past the
        tokenizer's vocabulary are no token)."""
        return self.vocab_size if self.vocab_size_unpadded is None else self.vocab_size_unpadded

    def __post_init__(self):
        if self.version not in (1, 2):
            raise ValueError(f"MambaConfig.version must be 1 or 2, found {self.version!r}")
        for name in (
            "d_model",
            "n_layers",
            "vocab_size",
            "d_state",
            "d_conv",
            "expand",
            "head_dim",
            "n_groups",
            "chunk_size",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"MambaConfig.{name} must be a positive int, found {value!r}")
        if self.ssm_norm not in SSM_NORMS:
            raise ValueError(f"MambaConfig.ssm_norm must be one of {SSM_NORMS}, found {self.ssm_norm!r}")
        if self.ssm_norm != "gated" and self.version != 2:
            raise ValueError(f"MambaConfig.ssm_norm {self.ssm_norm!r} is a Mamba-2 option (version is 1)")
        if self.activation not in ACTIVATIONS:
            raise ValueError(
                f"MambaConfig.activation must be one of {ACTIVATIONS}, found {self.activation!r}"
            )
        if not isinstance(self.dt_rank, int) or self.dt_rank < 0:
            raise ValueError(f"MambaConfig.dt_rank must be a positive int (0 = auto), found {self.dt_rank!r}")
        if self.dt_rank == 0:
            object.__setattr__(self, "dt_rank", math.ceil(self.d_model / 16))
        object.__setattr__(self, "time_step_limit", tuple(float(x) for x in self.time_step_limit))
        self._check_kinds()
        if self.version == 2:
            if self.d_inner % self.head_dim:
                raise ValueError(
                    f"Mamba-2 inner width {self.d_inner} (expand*d_model) is not a multiple of "
                    f"head_dim {self.head_dim}"
                )
            if self.n_heads % self.n_groups:
                raise ValueError(
                    f"Mamba-2 n_heads {self.n_heads} is not a multiple of n_groups {self.n_groups}"
                )

    def _check_kinds(self) -> None:
        kinds = tuple(self.layer_kinds)
        object.__setattr__(self, "layer_kinds", kinds)
        if not kinds:
            return
        if len(kinds) != self.n_layers:
            raise ValueError(
                f"MambaConfig.layer_kinds has {len(kinds)} entries for n_layers {self.n_layers}: "
                "one per sublayer"
            )
        ssm = f"mamba{self.version}"
        for i, kind in enumerate(kinds):
            needs_v2 = kind in ("parallel", "shared")
            wrong = (kind.startswith("mamba") and kind != ssm) or (needs_v2 and self.version != 2)
            if kind not in LAYER_KINDS or wrong:
                allowed = [ssm, "attention", "mlp", "moe"]
                allowed += ["parallel", "shared"] if self.version == 2 else []
                raise ValueError(f"MambaConfig.layer_kinds[{i}] is {kind!r}; expected one of {allowed}")
        if self.has_attention:
            for name in ("attn_heads", "attn_kv_heads", "attn_head_dim"):
                value = getattr(self, name)
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise ValueError(
                        f"MambaConfig.{name} must be a positive int for attention, found {value!r}"
                    )
            if self.attn_heads % self.attn_kv_heads:
                raise ValueError(
                    f"MambaConfig.attn_heads {self.attn_heads} is not a multiple of attn_kv_heads "
                    f"{self.attn_kv_heads}"
                )
            if self.rope_dim < 0 or self.rope_dim > self.attn_head_dim or self.rope_dim % 2:
                raise ValueError(
                    f"MambaConfig.rope_dim must be even and within [0, {self.attn_head_dim}], "
                    f"found {self.rope_dim}"
                )
            if self.sliding_window < 0:
                raise ValueError(f"MambaConfig.sliding_window must be >= 0, found {self.sliding_window}")
        if "mlp" in kinds or "shared" in kinds:
            if isinstance(self.mlp_width, bool) or not isinstance(self.mlp_width, int) or self.mlp_width < 1:
                raise ValueError(
                    f"MambaConfig.mlp_width must be a positive int for MLP layers, found {self.mlp_width!r}"
                )
            if self.mlp_activation not in MLP_ACTIVATIONS:
                raise ValueError(
                    f"MambaConfig.mlp_activation must be one of {MLP_ACTIVATIONS}, "
                    f"found {self.mlp_activation!r}"
                )

        if "moe" in kinds:
            for name in ("moe_experts", "moe_top_k", "moe_width"):
                value = getattr(self, name)
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise ValueError(
                        f"MambaConfig.{name} must be a positive int for MoE layers, found {value!r}"
                    )
            latent = self.moe_latent
            if isinstance(latent, bool) or not isinstance(latent, int) or latent < 0:
                raise ValueError(f"MambaConfig.moe_latent must be an int >= 0 (0: none), found {latent!r}")
            if self.moe_top_k > self.moe_experts or self.moe_router not in MOE_ROUTERS:
                raise ValueError(
                    f"MambaConfig: moe_top_k {self.moe_top_k} of {self.moe_experts} experts, router "
                    f"{self.moe_router!r} (one of {MOE_ROUTERS})"
                )
            if self.moe_router == "sigmoid_groups" and (
                self.moe_experts % self.moe_groups or self.moe_experts // self.moe_groups < 2
                or not 1 <= self.moe_topk_groups <= self.moe_groups
            ):  # fmt: skip
                raise ValueError(
                    f"MambaConfig: {self.moe_experts} experts in {self.moe_groups} groups (at least 2 "
                    f"each), {self.moe_topk_groups} groups kept"
                )
            if self.mlp_activation not in MLP_ACTIVATIONS:
                raise ValueError(f"MambaConfig.mlp_activation must be one of {MLP_ACTIVATIONS}")

    @property
    def kinds(self) -> tuple[str, ...]:
        """The kind of every sublayer, in forward order (``layer_kinds``, or the Mamba kind repeated)."""
        return self.layer_kinds or (f"mamba{self.version}",) * self.n_layers

    def describe(self) -> str:
        """A short name: "Mamba-2", or a hybrid's family and mix ("nemotron_h: 12 Mamba-2, 3 attention,
        9 MLP sublayers")."""
        if not self.is_hybrid:
            return f"{self.family}: Mamba-{self.version}" if self.family else f"Mamba-{self.version}"
        counts = {k: self.kinds.count(k) for k in dict.fromkeys(self.kinds)}
        mix = ", ".join(f"{n} {KIND_NAMES[k]}" for k, n in counts.items())
        return f"{self.family or 'hybrid'}: {mix} sublayers"

    @property
    def has_attention(self) -> bool:
        """Whether some sublayer holds a softmax attention (an "attention" or "parallel" kind)."""
        return any(k in ATTENTION_KINDS for k in self.kinds)

    @property
    def reads_embeddings(self) -> bool:
        """Whether some sublayer reads the embeddings h^0 besides its own input (a "shared" kind)."""
        return "shared" in self.kinds

    @property
    def is_hybrid(self) -> bool:
        """Whether some sublayer is not the Mamba mixer."""
        return any(not k.startswith("mamba") for k in self.kinds)

    @property
    def d_inner(self) -> int:
        """Inner width e = expand * d_model (or ``ssm_inner`` when set)."""
        return self.ssm_inner or self.expand * self.d_model

    @property
    def n_heads(self) -> int:
        """Mamba-2 heads h = e / p (Mamba-1: one 'head' per channel, returns e)."""
        return self.d_inner // self.head_dim if self.version == 2 else self.d_inner

    @property
    def conv_dim(self) -> int:
        """Channels through the depthwise conv: e (Mamba-1) or e + 2gn (Mamba-2: x, B, C)."""
        if self.version == 1:
            return self.d_inner
        return self.d_inner + 2 * self.n_groups * self.d_state

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe dict (infinity written as the string "inf")."""
        out = dataclasses.asdict(self)
        out["time_step_limit"] = [_float_to_json(x) for x in self.time_step_limit]
        out["layer_kinds"] = list(self.layer_kinds)
        return out

    def to_json(self) -> str:
        """The config as indented JSON (``MambaConfig.from_dict(json.loads(...))`` reads it back)."""
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MambaConfig:
        """Build from :meth:`to_dict` output; unknown keys are an error naming them."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"unknown latim-jax config field(s) {unknown}; expected a subset of {sorted(known)}"
            )
        data = dict(data)
        if "time_step_limit" in data:
            data["time_step_limit"] = tuple(_float_from_json(x) for x in data["time_step_limit"])
        if "layer_kinds" in data:
            data["layer_kinds"] = tuple(data["layer_kinds"])
        return cls(**data)


def _float_to_json(x: float) -> float | str:
    return "inf" if math.isinf(x) and x > 0 else x


def _float_from_json(x: Any) -> float:
    if isinstance(x, dict) and "__float__" in x:
        x = x["__float__"]
    if isinstance(x, str):
        return float(x.replace("Infinity", "inf"))
    return float(x)


def param_shapes(config: MambaConfig) -> dict[str, Any]:
    """The parameter tree a model of ``config`` holds: nested dicts of shape tuples.

    Layout (math orientation: activations right-multiply, ``y = x @ W``):
        embedding (v, d); norm_f (d,); lm_head (v, d) when untied;
        layers: a list of {"norm": (d,), "mixer": {...}}.
    Mamba-1 mixer: in_proj (d, 2e), conv_w (k, e) [conv_w[k-1] multiplies the current token],
        conv_b (e,), x_proj (e, r+2n), dt_proj (r, e), dt_bias (e,), A_log (e, n), D (e,),
        out_proj (e, d); in_proj_b (2e,) and out_proj_b (d,) when proj_bias.
    Mamba-2 mixer: in_proj (d, 2e+2gn+h) [order z, x, B, C, dt], conv_w (k, e+2gn), conv_b (e+2gn,),
        dt_bias (h,), A_log (h,), D (h,), norm_w (e,) (none when ``ssm_norm`` is "none"), out_proj (e, d);
        biases as in Mamba-1 (out_proj_b follows ``out_proj_bias`` when that is set).
    Attention and MLP sublayers: see :func:`attention_shapes`, :func:`mlp_shapes`; a parallel sublayer
    holds the Mamba-2 mixer's parameters and the attention's in one dict (their names differ); a shared
    sublayer the Mamba-2 mixer's and its transformer block's (:func:`shared_block_shapes`).
    """
    c = config
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
    by_kind = {f"mamba{c.version}": mixer}
    if c.has_attention:
        by_kind["attention"] = attention_shapes(c)
    if "parallel" in c.kinds:  # the Mamba-2 mixer's and the attention's parameters side by side
        by_kind["parallel"] = {**mixer, **by_kind["attention"]}
    if "mlp" in c.kinds:
        by_kind["mlp"] = mlp_shapes(c)
    if "shared" in c.kinds:
        by_kind["shared"] = {**mixer, **shared_block_shapes(c)}
    if "moe" in c.kinds:
        by_kind["moe"] = moe_shapes(c)
    tree: dict[str, Any] = {
        "embedding": (c.vocab_size, d),
        "layers": [{"norm": (d,), "mixer": dict(by_kind[kind])} for kind in c.kinds],
        "norm_f": (d,),
    }
    if not c.tie_embeddings:
        tree["lm_head"] = (c.vocab_size, d)
    return tree


def attention_shapes(c: MambaConfig) -> dict[str, tuple[int, ...]]:
    """An attention sublayer's parameters: q_proj (d, H a), k_proj and v_proj (d, G a), o_proj (H a, d);
    q_b, k_b, v_b when ``attn_bias``, o_b (d,) when ``attn_out_bias``."""
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
    return out


def shared_block_shapes(c: MambaConfig) -> dict[str, tuple[int, ...]]:
    """A shared transformer block's parameters (Zamba2; one copy per sublayer, each with its own adapters
    folded in): attn_norm (2d,) over [h; h^0], the attention's q_proj (2d, H a), k_proj and v_proj
    (2d, G a), o_proj (H a, d), ff_norm (d,), the gated MLP's gate_proj, up_proj (d, f), down_proj (f, d),
    and shared_out (d, d), the linear map into the Mamba-2's input; gate_b, up_b (f,), down_b (d,) when
    ``mlp_bias``."""
    d, a = c.d_model, c.attn_head_dim
    out = {
        "attn_norm": (2 * d,),
        "q_proj": (2 * d, c.attn_heads * a),
        "k_proj": (2 * d, c.attn_kv_heads * a),
        "v_proj": (2 * d, c.attn_kv_heads * a),
        "o_proj": (c.attn_heads * a, d),
        "ff_norm": (d,),
        "gate_proj": (d, c.mlp_width),
        "up_proj": (d, c.mlp_width),
        "down_proj": (c.mlp_width, d),
        "shared_out": (d, d),
    }
    if c.mlp_bias:
        out.update(gate_b=(c.mlp_width,), up_b=(c.mlp_width,), down_b=(d,))
    return out


def mlp_shapes(c: MambaConfig) -> dict[str, tuple[int, ...]]:
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


def moe_shapes(c: MambaConfig) -> dict[str, tuple[int, ...]]:
    """A mixture-of-experts sublayer's parameters: router (d, E) (router_bias (E,) for sigmoid_groups:
    the correction added for the choice only), experts_up (E, d', f), experts_gate (E, d', f) when gated,
    experts_down (E, f, d') with d' = d, or d' = moe_latent with latent_in (d, d') before the experts and
    latent_out (d', d) after their weighted sum (biases latent_in_b, latent_out_b when ``mlp_bias``); the
    shared expert shared_up (d, s), shared_gate, shared_down (s, d) and their biases when ``mlp_bias``."""
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
        if c.mlp_gated:
            out["shared_gate"] = (d, s)
        if c.mlp_bias:
            out.update(shared_up_b=(s,), shared_down_b=(d,))
            if c.mlp_gated:
                out["shared_gate_b"] = (s,)
    return out
