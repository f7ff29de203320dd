"""The model configuration shared by Mamba-1 and Mamba-2, and the parameter shapes it implies.

Shape glossary (used across the library):
    b batch, l sequence length, d model width (d_model), e inner width (expand * d),
    n state size (d_state), r dt rank (Mamba-1), h heads, p head dim (e = h * p, Mamba-2),
    g groups (Mamba-2 B/C), k conv width (d_conv), v vocabulary rows (padded);
    attention sublayers: H query heads, G key/value heads, a head dim (attn_head_dim);
    token-wise MLP sublayers: f hidden width (mlp_width).

A model is a stack of residual sublayers h + Mixer(RMSNorm(h)) (or h + RMSNorm(Mixer(h)), the norm after
the sublayer, where ``post_norm_layers`` says so: OLMo-Hybrid), each of one registered *kind*
(:mod:`latim_jax.model.kind`): the Mamba mixer of ``version`` ("mamba1" / "mamba2"), softmax attention
("attention"), a token-wise MLP ("mlp"), ... A plain Mamba model has ``layer_kinds=()``: every
sublayer is its Mamba mixer. A hybrid lists one kind per sublayer (Nemotron-H's pattern, Bamba's
mixer + feed-forward pairs written as two sublayers each). The kinds read today read MambaConfig's own
fields; a kind may instead declare a config *section* (``sections``: kind -> its settings dataclass).
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from latim_jax.model.kind import kind_of, registered

ACTIVATIONS = ("silu", "relu", "identity")
MLP_ACTIVATIONS = ("silu", "relu", "relu2", "gelu", "gelu_tanh")
# how Mamba-2's output y meets its gate SiLU(z) (Falcon-H1 picks per config): "gated" RMSNorm of
# y * SiLU(z) (mamba_ssm, transformers' Mamba2), "before_gate" RMSNorm(y) * SiLU(z), "none" y * SiLU(z)
SSM_NORMS = ("gated", "before_gate", "none")
MOE_ROUTERS = ("softmax_topk", "softmax_all", "sigmoid_groups")


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
    # the sublayers whose RMSNorm follows them, h + RMSNorm(Sublayer(h)) (OLMo-Hybrid's attention and its
    # MLP); every other sublayer is pre-norm, h + Sublayer(RMSNorm(h)). Either way its one norm is "norm"
    post_norm_layers: tuple[int, ...] = ()
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
    attn_qk_norm: bool = False  # each query and key head RMS-normalised before the rotary (q_norm, k_norm)
    attn_output_gate: bool = False  # the heads' output times sigmoid(xhat W_g) before W_o (Qwen3-Next)
    # the q and k norms span every head at once (OLMo-Hybrid: q_norm (H a,), k_norm (G a,)), not each head
    attn_qk_norm_full: bool = False
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
    moe_shared_gate: bool = False  # the shared expert's output times sigmoid(xhat W_sg) (Qwen3-Next)
    # multipliers (Granite): the token embeddings are scaled by embedding_multiplier (inputs_embeds are
    # h^0 as given), the logits divided by logits_scaling; a residual multiplier is folded into each
    # sublayer's output projection when the checkpoint is read
    embedding_multiplier: float = 1.0
    logits_scaling: float = 1.0
    # the config sections of kinds that declare one (LayerKind.section): kind name -> its settings (a
    # dict or the section dataclass on input; held as sorted (name, section) pairs)
    sections: Any = ()

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
        self._check_kinds()  # each kind present checks the fields it reads (the Mamba-2 heads: mamba2's)
        self._check_post_norm()

    def _check_kinds(self) -> None:
        kinds = tuple(self.layer_kinds)
        object.__setattr__(self, "layer_kinds", kinds)
        self._check_sections()
        if kinds and len(kinds) != self.n_layers:
            raise ValueError(
                f"MambaConfig.layer_kinds has {len(kinds)} entries for n_layers {self.n_layers}: "
                "one per sublayer"
            )
        for i, name in enumerate(kinds):
            known = name in registered()
            if not known or kind_of(name).version not in (None, self.version):
                allowed = [k.name for k in registered().values() if k.version in (None, self.version)]
                raise ValueError(f"MambaConfig.layer_kinds[{i}] is {name!r}; expected one of {allowed}")
        for name in dict.fromkeys(self.kinds):
            kind = kind_of(name)
            if kind.section is not None and name not in dict(self.sections):
                raise ValueError(
                    f"MambaConfig: layer kind {name!r} needs its config section sections[{name!r}]"
                )
            kind.check(self)

    def _check_post_norm(self) -> None:
        given = self.post_norm_layers
        if isinstance(given, (str, bytes)) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in tuple(given)
        ):
            raise ValueError(f"MambaConfig.post_norm_layers must be sublayer indices, found {given!r}")
        layers = tuple(sorted(set(given)))
        object.__setattr__(self, "post_norm_layers", layers)
        for i in layers:
            if not 0 <= i < self.n_layers:
                raise ValueError(
                    f"MambaConfig.post_norm_layers names sublayer {i}; n_layers is {self.n_layers}"
                )
            kind = kind_of(self.kinds[i])
            if kind.folds_norm or kind.reads_embeddings:
                raise ValueError(
                    f"MambaConfig.post_norm_layers names sublayer {i}, a {kind.name!r} sublayer: its norm "
                    "feeds its in_proj (or the input it reads with the embeddings), so it cannot follow it"
                )

    def _check_sections(self) -> None:
        given = self.sections
        if isinstance(given, dict):
            given = tuple(given.items())
        out = []
        for item in tuple(given):
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
                raise ValueError(f"MambaConfig.sections must map kind names to sections, found {item!r}")
            name, section = item
            cls = kind_of(name).section
            if cls is None:
                raise ValueError(f"MambaConfig.sections[{name!r}]: layer kind {name!r} declares no section")
            if isinstance(section, dict):
                section = cls.from_dict(section)
            elif not isinstance(section, cls):
                raise ValueError(
                    f"MambaConfig.sections[{name!r}] must be a {cls.__name__} or a dict, found "
                    f"{type(section).__name__}"
                )
            out.append((name, section))
        object.__setattr__(self, "sections", tuple(sorted(out, key=lambda kv: kv[0])))

    def section(self, name: str):
        """The config section of layer kind ``name`` (its ``LayerKind.section`` dataclass); a KeyError
        naming the kind when the config has none."""
        found = dict(self.sections).get(name)
        if found is None:
            raise KeyError(
                f"MambaConfig has no section for layer kind {name!r} (sections: {dict(self.sections)})"
            )
        return found

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
        mix = ", ".join(f"{n} {kind_of(k).display}" for k, n in counts.items())
        return f"{self.family or 'hybrid'}: {mix} sublayers"

    @property
    def has_attention(self) -> bool:
        """Whether some sublayer holds a softmax attention (its kind's ``holds_attention``)."""
        return any(kind_of(k).holds_attention for k in dict.fromkeys(self.kinds))

    @property
    def reads_embeddings(self) -> bool:
        """Whether some sublayer reads the embeddings h^0 besides its own input (a "shared" kind)."""
        return any(kind_of(k).reads_embeddings for k in dict.fromkeys(self.kinds))

    @property
    def is_hybrid(self) -> bool:
        """Whether some sublayer is not the Mamba mixer."""
        return any(k != f"mamba{self.version}" for k in self.kinds)

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
        out["post_norm_layers"] = list(self.post_norm_layers)
        if not out["post_norm_layers"]:
            del out["post_norm_layers"]  # pre-norm configs read the same in older versions
        out["sections"] = {name: dataclasses.asdict(section) for name, section in self.sections}
        if not out["sections"]:
            del out["sections"]  # configs without sections read the same in older versions
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
        layers: a list of {"norm": (d,), "mixer": {...}}, each mixer's parameters its kind's
        ``LayerKind.shapes(config)`` (the Mamba mixers: :func:`latim_jax.model.mixers.mamba_shapes`;
        attention, MLP, MoE, parallel and shared sublayers: the ``*_shapes`` function beside each module).
    """
    c = config
    by_kind = {name: kind_of(name).shapes(c) for name in dict.fromkeys(c.kinds)}
    tree: dict[str, Any] = {
        "embedding": (c.vocab_size, c.d_model),
        "layers": [{"norm": (c.d_model,), "mixer": dict(by_kind[kind])} for kind in c.kinds],
        "norm_f": (c.d_model,),
    }
    if not c.tie_embeddings:
        tree["lm_head"] = (c.vocab_size, c.d_model)
    return tree
