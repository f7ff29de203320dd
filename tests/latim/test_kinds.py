"""The layer-kind seam (latim_jax.model.kind, filled by latim_jax.latim.kinds): every registered kind
declares what the library reads of it, its factors implement the typed interface (latim_jax.latim.
factors.Factors) with their identities, an unknown kind is refused by name, and a kind declared and
registered from outside the library (a test's own) runs through config, init, the forward, the memory
estimate, the mesh layout and every score without a generic file knowing of it."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_logit_identity_padding_and_rows, rel_err

import latim_jax
from latim_jax.kernels import f32
from latim_jax.kernels.decay import SSM
from latim_jax.latim import memory, source_window
from latim_jax.latim.factors import FORMS, ROLES, Factors
from latim_jax.latim.kinds import KINDS, factors, layer_factors
from latim_jax.model import attention, delta_rule, mixers, mla, mlp, moe, parallel_mixer, shared_block
from latim_jax.model.generate import generate
from latim_jax.model.init import init_params
from latim_jax.model.kind import LayerKind, kind_of, register, registered, unregister
from latim_jax.model.params import ParamModule

# one tiny config per registered kind: the fields each kind reads
KIND_FIELDS = {
    "attention": dict(attn_heads=2, attn_kv_heads=1, attn_head_dim=4),
    "mlp": dict(mlp_width=12, mlp_gated=True),
    "moe": dict(moe_experts=4, moe_top_k=2, moe_width=6, moe_shared_width=5, mlp_gated=True),
    "parallel": dict(attn_heads=2, attn_kv_heads=1, attn_head_dim=4),
    "shared": dict(attn_heads=2, attn_kv_heads=1, attn_head_dim=8, mlp_width=12, mlp_gated=True),
    "gdn": dict(sections={"gdn": dict(k_heads=1, v_heads=2, k_dim=4, v_dim=4, chunk=4, conv_bias=True)}),
    "kda": dict(sections={"kda": dict(k_heads=2, v_heads=2, k_dim=4, v_dim=4, chunk=4)}),
    "mla": dict(sections={"mla": dict(heads=2, kv_rank=4, nope_dim=4, shared_dim=2, v_dim=3)}),
}
LIBRARY_KINDS = ("mamba1", "mamba2", "attention", "mlp", "moe", "parallel", "shared", "gdn", "kda", "mla")


def test_every_module_kind_is_registered_with_its_declaration():
    # every module class of the model package that names a kind is registered, with its declaration
    named = {
        cls.kind
        for module in (mixers, attention, mlp, moe, parallel_mixer, shared_block, delta_rule, mla)
        for cls in vars(module).values()
        if isinstance(cls, type) and issubclass(cls, ParamModule) and cls.kind
    }
    assert named == set(LIBRARY_KINDS) <= set(registered())
    for name, kind in registered().items():
        assert kind.name == name and kind.module.kind == name and callable(kind.factors)
        assert kind.display and callable(kind.shapes) and callable(kind.memory)
    assert KINDS is not None and set(KINDS) == set(registered())


def test_a_kind_declaration_is_checked():
    with pytest.raises(ValueError, match="its module 'MLPMixer' names kind 'mlp'"):
        LayerKind(name="gdn", display="GDN", module=mlp.MLPMixer, shapes=dict, output_params=())
    with pytest.raises(ValueError, match="registered already"):
        register(kind_of("mlp"))
    with pytest.raises(ValueError, match="without its decomposition"):
        register(dataclasses.replace(kind_of("mlp"), name="mlp", factors=None))


def test_an_unknown_kind_is_refused_by_name():
    class DeltaNet:
        kind = "gated_deltanet"

    h, mask = jnp.zeros((1, 3, 8)), jnp.ones((1, 3), bool)
    with pytest.raises(
        ValueError, match=r"no decomposition for layer kind 'gated_deltanet'; registered kinds: \["
    ):
        factors(DeltaNet(), h, mask)
    with pytest.raises(ValueError, match=r"layer_kinds\[1\] is 'gated_deltanet'; expected one of \['mamba2'"):
        latim_jax.MambaConfig(
            version=2, d_model=8, n_layers=2, vocab_size=16, layer_kinds=("mamba2", "gated_deltanet")
        )
    with pytest.raises(ValueError, match=r"layer_kinds\[0\] is 'mamba1'; expected one of"):
        latim_jax.MambaConfig(version=2, d_model=8, n_layers=1, vocab_size=16, layer_kinds=("mamba1",))


def _one_layer(name: str):
    """A model of one sublayer of kind ``name`` (version 1 for mamba1, else 2) and its stream."""
    version = 1 if name == "mamba1" else 2
    extra = {"head_dim": 4, "chunk_size": 8} if version == 2 else {}
    cfg = latim_jax.MambaConfig(
        version=version, d_model=8, n_layers=1, vocab_size=16, d_state=4, layer_kinds=(name,),
        **extra, **KIND_FIELDS.get(name, {}),
    )  # fmt: skip
    model = latim_jax.MambaLM(cfg, init_params(cfg, 3))
    tokens = np.random.default_rng(0).integers(0, 16, (2, 7))
    return model, model.forward(tokens).residuals[0]


@pytest.mark.parametrize("name", LIBRARY_KINDS)
def test_every_kind_factors_implement_the_interface(name):
    """For each registered kind: its factors subclass Factors and declare a form; the form's capability
    is there (an SSM, an attention map, diagonal scores); the pair values projected onto W_out, summed
    over sources, plus beta, give the output (exact mode) and equal token_total; nothing above the
    diagonal."""
    model, h = _one_layer(name)
    extra = {"embeddings": h} if kind_of(name).reads_embeddings else {}
    f = layer_factors(model, h, 0, **extra)
    assert isinstance(f, Factors) and f.form in FORMS and f.kind == name and f.length == 7
    b, L, d = h.shape
    rows = jnp.arange(L)
    V = f.pair_values(rows, 0, L, f.tiles(None, None))
    T = V if f.W_out is None else jnp.einsum("brje,ed->brjd", V, f.W_out)
    assert T.shape == (b, L, L, d)
    assert float(jnp.max(jnp.abs(T * (rows[None, :] > rows[:, None])[None, :, :, None]))) == 0.0
    assert rel_err(T.sum(2) + f.bias, f.output) < 1e-5
    assert rel_err(f.token_total + f.bias, f.output) < 1e-5
    if f.form == "ssm":
        assert isinstance(f.ssm, SSM)
    else:
        assert f.attention_map(rows, 0, L).shape == (b, L, L)
    if f.form == "diagonal":
        l2 = f.diagonal_scores("l2", rows)
        np.testing.assert_allclose(l2, jnp.linalg.norm(T, axis=-1), rtol=1e-5, atol=1e-6)
    # the per-position declaration a mesh's "seq" axis reads (source_window): every declared path is a
    # field with the length on its axis, and a sequence-local kind declares every per-position array
    # (one left out would be read whole where the device holds only its window)
    declared = source_window.layout(f) if f.sequence_local else {}
    for path, (axis, role) in declared.items():
        size = -(-L // f.slot_unit) if role == "chunks" else L  # a chunk's factors: slot_unit positions
        assert role in ROLES and source_window.get(f, path).shape[axis] == size, (name, path)
    if f.sequence_local:
        for keys, x in jax.tree_util.tree_flatten_with_path(f)[0]:
            path = ".".join(k.name for k in keys)
            if x.ndim >= 2 and {L, -(-L // f.slot_unit)} & set(x.shape[1:3]) and path not in declared:
                raise AssertionError(f"{name}: per-position field {path} {x.shape} is not in positions")
    assert f.sequence_local == (name != "shared"), name
    for width in (4, 6):  # the kind's declaration (read by the memory estimate) says what its factors do
        local = f.sequence_local and width % f.slot_unit == 0
        assert kind_of(name).window_scores(model.config, width) == local, (name, width)
    assert f.halo == (3 if name in ("mamba1", "mamba2", "parallel") else 0), (name, f.halo)


@pytest.mark.parametrize("version", [1, 2])
def test_the_factors_honour_the_interface(version):
    """What the scores read of a kind: the pair values projected onto W_out, summed over sources, plus
    beta, give the output (exact mode); token_total is the same sum from one scan; the tiles are a
    complete Blocks; channels_first only changes the layout of the values."""
    extra = {"head_dim": 4, "chunk_size": 8} if version == 2 else {}
    cfg = latim_jax.MambaConfig(version=version, d_model=8, n_layers=1, vocab_size=16, d_state=4, **extra)
    model = latim_jax.MambaLM(cfg, init_params(cfg, 1))
    tokens = np.random.default_rng(0).integers(0, 16, (2, 7))
    h = model.forward(tokens).residuals[0]
    f = layer_factors(model, h, 0)
    assert f.kind == f"mamba{version}" and f.length == 7
    blocks = f.tiles(None, None)
    assert None not in (blocks.rows, blocks.cols, blocks.m1_direct_rows, blocks.m1_few_rows)
    rows = jnp.arange(7)
    V = f.pair_values(rows, 0, 7, blocks)  # (b, r, q, e)
    rebuilt = jnp.einsum("brje,ed->brd", V, f.W_out) + f.bias
    assert rel_err(rebuilt, f.output) < 1e-5
    assert rel_err(f.token_total + f.bias, f.output) < 1e-5
    cf = f.pair_values(rows, 0, 7, blocks, channels_first=True) if version == 1 else None
    if cf is not None:
        np.testing.assert_allclose(jnp.moveaxis(cf, 1, 3), V, rtol=1e-6, atol=1e-7)


# --- a kind from outside the library: a causal mean of values, o_i = s W_o sum_{j <= i} v_j / n_i ---


@dataclasses.dataclass(frozen=True)
class MeanSection:
    """The toy kind's config section: the output scale s."""

    scale: float = 1.0

    @classmethod
    def from_dict(cls, data):
        return cls(**data)


class CausalMean(ParamModule):
    """o_i = scale * (sum_{j <= i, real} x_j W_v / n_i) W_o, n_i the real positions up to i."""

    kind = "causal_mean"
    NAMES = ("v_proj", "o_proj")

    def weights(self, mask):
        """(b, l, l) the mean's weights: 1 / n_i on real j <= i."""
        keep = jnp.tril(jnp.ones((mask.shape[1],) * 2, bool))[None] & mask[:, None, :]
        return keep / jnp.maximum(keep.sum(-1, keepdims=True), 1)

    def __call__(self, x, *, mask, ctx=None):
        del ctx
        v = x.astype(f32) @ self.v_proj[...]
        return self.config.section("causal_mean").scale * (self.weights(mask) @ v) @ self.o_proj[...]

    def init_cache(self, batch, max_length):
        del max_length
        return jnp.zeros((batch, self.v_proj[...].shape[1])), jnp.zeros((batch,))

    def step(self, x_t, cache, valid):
        total, n = cache
        total = total + jnp.where(valid[:, None], x_t.astype(f32) @ self.v_proj[...], 0.0)
        n = n + valid
        o = self.config.section("causal_mean").scale * (total / jnp.maximum(n, 1)[:, None]) @ self.o_proj[...]
        return o, (total, n)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MeanFactors(Factors):
    """V_ij = weight_ij v_j, W_out = scale W_o."""

    w: jax.Array
    v: jax.Array
    W_out: jax.Array
    bias: jax.Array
    output: jax.Array
    h: jax.Array
    token_total: jax.Array | None

    kind = "causal_mean"
    channels_first = False

    def pair_values(self, rows, j0, width, blocks, *, channels_first=False):
        cols = j0 + jnp.arange(width)
        w = jnp.take(self.w[:, rows], cols, axis=2, mode="fill", fill_value=0)
        v = jnp.take(self.v, cols, axis=1, mode="fill", fill_value=0)
        return w[..., None] * v[:, None]

    def attention_map(self, rows, j0, width):
        return jnp.take(self.w[:, rows], j0 + jnp.arange(width), axis=2, mode="fill", fill_value=0)


def mean_factors(block, h, mask, ctx, mode, *, hold_fixed=False, with_total=False):
    del ctx, mode
    m = block.mixer
    v = block.normed(h, hold_fixed=hold_fixed).astype(f32) @ m.v_proj[...]
    w, W_out = m.weights(mask), m.config.section("causal_mean").scale * m.o_proj[...]
    out = m(block.normed(h), mask=mask)
    return MeanFactors(w, v, W_out, jnp.zeros_like(out), out, h.astype(f32), out if with_total else None)


@pytest.fixture
def causal_mean():
    kind = LayerKind(
        name="causal_mean", display="causal mean", module=CausalMean, section=MeanSection,
        output_params=("o_proj",), channel_axis={"v_proj": 1, "o_proj": 0},
        shapes=lambda c: {"v_proj": (c.d_model, c.d_model), "o_proj": (c.d_model, c.d_model)},
        memory=lambda c, b, length, rows, cols: 4 * b * length * length,
    )  # fmt: skip
    register(kind, factors=mean_factors)
    yield kind
    unregister("causal_mean")


@pytest.mark.slow
def test_a_kind_registered_from_outside_runs_through_everything(causal_mean):
    """The toy kind enters through its declaration and one register call: its config section (checked,
    round-tripped through JSON), parameters and initialisation, the forward and generation, the memory
    estimate, describe(), and the scores: the exact decomposition conserves, the logit identity holds
    across the hybrid, padded prompts equal the prompt alone."""
    with pytest.raises(ValueError, match=r"needs its config section sections\['causal_mean'\]"):
        latim_jax.MambaConfig(version=2, d_model=8, n_layers=1, vocab_size=16, layer_kinds=("causal_mean",))
    with pytest.raises(ValueError, match="layer kind 'mlp' declares no section"):
        latim_jax.MambaConfig(version=2, d_model=8, n_layers=1, vocab_size=16, sections={"mlp": {}})
    cfg = latim_jax.MambaConfig(
        version=2, d_model=8, n_layers=3, vocab_size=16, d_state=4, head_dim=4, chunk_size=8,
        layer_kinds=("mamba2", "causal_mean", "mamba2"), sections={"causal_mean": {"scale": 0.5}},
    )  # fmt: skip
    assert cfg.section("causal_mean") == MeanSection(0.5)
    assert latim_jax.MambaConfig.from_dict(cfg.to_dict()) == cfg
    assert "1 causal mean" in cfg.describe()
    model = latim_jax.MambaLM(cfg, init_params(cfg, 0))
    tokens = np.random.default_rng(1).integers(0, 16, (2, 13))
    h = model.forward(tokens).residuals[1]
    direct = h + model.layers[1].mixer(model.layers[1].normed(h), mask=jnp.ones((2, 13), bool))
    np.testing.assert_allclose(model.forward(tokens).residuals[2], direct, rtol=1e-6, atol=1e-6)
    assert latim_jax.conservation_error(model, tokens, layer=1) < 1e-5
    assert_logit_identity_padding_and_rows(model, tokens)
    est = memory.estimate(model, 2, 2048, method="l2")
    assert est.layer >= 4 * 2 * 2048 * 2048  # the toy kind's declared working set is the largest
    out = generate(model, tokens[:1, :5], max_new_tokens=3)
    full = np.asarray(model(out[:, :-1])).argmax(-1)[:, 4:]
    np.testing.assert_array_equal(np.asarray(out)[:, 5:], full)
