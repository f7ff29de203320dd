"""Properties of the attribution API on random tiny models (jax only: runs without torch)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import directional_fd, tiny_config
from conftest import rel_err as rel
from flax import nnx

import latim_jax
from latim_jax import Blocks
from latim_jax.model.init import init_params

TOL = {"fp32": 1e-5, "alti": 5e-5, "grad_fd": 2e-2, "bf16_conservation": 1e-5}

CONFIGS = {"m1": tiny_config(1), "m2": tiny_config(2)}


def make(name, **changes):
    cfg = dataclasses.replace(CONFIGS[name], **changes)
    return latim_jax.MambaLM(cfg, init_params(cfg, seed=3))


def tokens(batch=2, length=11, seed=0):
    return np.random.default_rng(seed).integers(0, 32, (batch, length))


@pytest.mark.parametrize("name", ["m1", "m2"])
def test_rollout_rows_and_logit_identity(name):
    model = make(name)
    t = tokens()
    alti = latim_jax.attribute(model, t, method="alti")
    R = np.asarray(alti.rollout())
    row_sums = np.asarray(alti.scores).sum(-1)
    assert np.allclose(row_sums[row_sums > 0], 1, atol=1e-5)
    assert np.allclose(R.sum(-1), 1, atol=1e-5) and (R >= 0).all()
    logit = latim_jax.attribute(model, t, method="logit")
    # per layer: direct + sum_l sum_j c^l_ij + sum_l bias^l = the model's logit
    direct = (
        np.asarray(logit.extra["direct"])
        + np.asarray(logit.scores).sum((1, 3))
        + np.asarray(logit.extra["bias"]).sum(1)
    )
    assert rel(direct, logit.extra["logit"]) < TOL["fp32"]
    # through the rollout
    total = np.asarray(logit.rollout()).sum(-1) + np.asarray(logit.extra["bias"]).sum(1)
    assert rel(total, logit.extra["logit"]) < TOL["fp32"]
    want = np.take_along_axis(np.asarray(model(t)), np.asarray(logit.extra["targets"])[..., None], -1)[..., 0]
    assert rel(logit.extra["logit"], want) < TOL["fp32"]
    with pytest.raises(ValueError, match="rollout"):
        latim_jax.attribute(model, t, method="l2").rollout()


@pytest.mark.parametrize("name", ["m1", "m2"])
def test_logit_rollout_maps_option(name):
    """rollout_maps=False skips the ALTI maps, not the logit scores; None computes the real alti maps."""
    model = make(name)
    t = tokens()
    full = latim_jax.attribute(model, t, method="logit")
    alone = latim_jax.attribute(model, t, method="logit", rollout_maps=False)
    assert "alti" not in alone.extra
    np.testing.assert_allclose(np.asarray(alone.scores), np.asarray(full.scores), rtol=1e-5, atol=1e-6)
    alti = latim_jax.attribute(model, t, method="alti")
    np.testing.assert_allclose(np.asarray(full.extra["alti"]), np.asarray(alti.scores), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="rollout_maps=False"):
        alone.rollout()
    with pytest.raises(ValueError, match="every layer and every row"):
        latim_jax.attribute(model, t, method="logit", rows=[-1], rollout_maps=True)
    with pytest.raises(ValueError, match="rollout_maps must be"):
        latim_jax.attribute(model, t, method="logit", rollout_maps="no")


def test_rollout_of_a_layer_prefix_is_refused(tmp_path):
    """layers=[0] of a 2-layer model is not a rollout of the model (the logit identity would fail
    silently): refused, also after a save and load; per_layer=True is the way to each prefix."""
    model = make("m1")
    t = tokens()
    prefix = latim_jax.attribute(model, t, method="alti", layers=[0])
    assert prefix.n_layers == 2
    with pytest.raises(ValueError, match=r"holds layers \[0\] of 2"):
        prefix.rollout()
    prefix.save(tmp_path / "a.npz")
    with pytest.raises(ValueError, match=r"holds layers \[0\] of 2"):
        latim_jax.Attribution.load(tmp_path / "a.npz").rollout()
    full = latim_jax.attribute(model, t, method="alti")
    steps = full.rollout(per_layer=True)
    np.testing.assert_allclose(np.asarray(steps[:, 0]), np.asarray(prefix.scores[:, 0]), rtol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["m1", "m2"])
def test_hidden_attention_aggregations(name):
    from latim_jax.kernels.decay import full_hidden_attention

    model = make(name)
    t = tokens(length=9)
    runs = {
        a: latim_jax.attribute(model, t, method="hidden_attention", aggregation=a)
        for a in ("minmax", "abs", "signed")
    }
    # the per-channel tensor, built independently of the blocked path
    M = []
    for layer in range(2):
        from latim_jax.latim.kinds import layer_factors

        h = model.forward(t, impl="xla").residuals[layer]
        f = layer_factors(model, h, layer)
        M.append(np.asarray(full_hidden_attention(f.ssm, with_D=False)))
    M = np.stack(M, 1)  # (b, layers, i, j, c)
    causal = np.tril(np.ones((9, 9), bool))
    assert (M[:, :, ~causal] == 0).all() and (M[:, :, causal] < 0).any()  # signed: the reason for minmax
    np.testing.assert_allclose(runs["signed"].scores, M.mean(-1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(runs["abs"].scores, np.abs(M).mean(-1), rtol=1e-5, atol=1e-6)
    lo = M[:, :, causal].min(axis=(2, 3))[:, :, None, None]  # per prompt and layer
    hi = M[:, :, causal].max(axis=(2, 3))[:, :, None, None]
    want = np.where(causal, (M.mean(-1) - lo) / (hi - lo), 0.0)
    np.testing.assert_allclose(runs["minmax"].scores, want, rtol=1e-5, atol=1e-6)
    s = np.asarray(runs["minmax"].scores)
    assert s.min() >= 0 and s.max() <= 1
    R = np.asarray(runs["minmax"].rollout())
    assert np.allclose(R.sum(-1), 1, atol=1e-5) and (R >= 0).all()
    with pytest.raises(ValueError, match="non-negative"):
        runs["signed"].rollout()
    with pytest.raises(ValueError, match="aggregation must be"):
        latim_jax.attribute(model, t, method="hidden_attention", aggregation="mean")
    # a row subset equals the full map's rows (minmax normalises over the whole triangle)
    sub = latim_jax.attribute(model, t, method="hidden_attention", rows=[3, 8])
    np.testing.assert_allclose(sub.scores, s[:, :, [3, 8]], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["m1", "m2"])
def test_minmax_range_keeps_only_real_causal_pairs(name):
    """The range minmax divides by: the min and max of M over causal pairs whose two positions are both
    real, from the separate range pass and (Mamba-2) from the map's own blocks, against numpy on the
    full M. The mask here marks positions the factors did not skip, so M is large outside it."""
    from latim_jax.kernels.decay import full_hidden_attention
    from latim_jax.latim.hidden_attention import _m2_mean_and_range, hidden_attention_range
    from latim_jax.latim.kinds import layer_factors

    model = make(name)
    t = tokens(length=13)
    h = model.forward(t, impl="xla").residuals[1]
    f = layer_factors(model, h, 1)
    M = np.asarray(full_hidden_attention(f.ssm, with_D=False))  # (b, i, j, c)
    mask = np.zeros((2, 13), bool)
    mask[0, 3:9], mask[1, 5:13] = True, True  # a real run in the middle, and left padding
    keep = np.tril(np.ones((13, 13), bool))[None] & mask[:, :, None] & mask[:, None, :]
    want_lo = np.array([M[b][keep[b]].min() for b in range(2)])
    want_hi = np.array([M[b][keep[b]].max() for b in range(2)])
    tri = np.tril(np.ones((13, 13), bool))
    lo_all = np.array([M[b][tri].min() for b in range(2)])
    hi_all = np.array([M[b][tri].max() for b in range(2)])
    moved = np.abs(np.concatenate([lo_all - want_lo, hi_all - want_hi])).max()
    assert moved > 1e-2 * np.abs(np.concatenate([want_lo, want_hi])).max()  # the mask changes the range
    for blocks in (Blocks(rows=4, cols=4), Blocks(rows=8, cols=3)):
        lo, hi = hidden_attention_range(f.ssm, jnp.asarray(mask), f.tiles(None, blocks))
        assert rel(lo, want_lo) < TOL["fp32"] and rel(hi, want_hi) < TOL["fp32"], blocks
        if name == "m2":
            _, lo, hi = _m2_mean_and_range(
                f.ssm, jnp.arange(13)[::-1], jnp.asarray(mask), f.tiles(None, blocks)
            )
            assert rel(lo, want_lo) < TOL["fp32"] and rel(hi, want_hi) < TOL["fp32"], blocks


@pytest.mark.parametrize("name", ["m1", "m2"])
def test_blocked_and_row_subsets_equal_full(name):
    model = make(name)
    t = tokens(length=13)
    c = latim_jax.contributions(model, t, 1)
    full_l2 = np.linalg.norm(np.asarray(c.T), axis=-1)
    for blocks in (Blocks(rows=4, cols=4), Blocks(rows=8, cols=3), Blocks(rows=16, cols=16)):
        got = latim_jax.attribute(model, t, method="l2", layers=[1], blocks=blocks).scores[:, 0]
        assert rel(got, full_l2) < TOL["fp32"], blocks
    rows = [12, 0, 5]
    sub = latim_jax.attribute(model, t, method="l2", layers=[1], rows=rows).scores[:, 0]
    assert rel(sub, full_l2[:, rows]) < TOL["fp32"]
    last = latim_jax.attribute(model, t, method="alti", rows=[-1])
    assert last.scores.shape == (2, 2, 1, 13)
    assert (
        rel(last.scores[:, :, 0], latim_jax.attribute(model, t, method="alti").scores[:, :, -1]) < TOL["alti"]
    )


@pytest.mark.parametrize("name", ["m1", "m2"])
@pytest.mark.parametrize("mode", ["exact", "paper"])
def test_scanned_token_total_equals_blocked_pair_sum(name, mode):
    from latim_jax.latim.kinds import layer_factors
    from latim_jax.latim.scores import token_sum

    model = make(name, conv_bias=True)
    t = jnp.asarray(tokens(length=13))
    h = model.forward(t, impl="xla").residuals[1]
    f = layer_factors(model, h, 1, mode, impl="xla")
    pair_sum = token_sum(f, jnp.arange(13), blocks=Blocks(rows=4, cols=4))
    assert rel(f.token_total, pair_sum) < TOL["fp32"]
    if mode == "exact":
        assert rel(f.token_total + f.bias, f.output) < TOL["fp32"]
    else:  # SiLU: the paper mode's reconstruction misses part of the output
        assert rel(f.token_total + f.bias, f.output) > 1e-2


def test_identity_activation_modes_agree_and_paper_error():
    silu = make("m2")
    ident = make("m2", activation="identity", conv_bias=False)
    t = tokens(batch=1)
    ex, pa = latim_jax.contributions(ident, t, 0), latim_jax.contributions(ident, t, 0, mode="paper")
    assert rel(pa.T, ex.T) < TOL["fp32"]
    assert latim_jax.conservation_error(ident, t, 0, mode="paper") < TOL["fp32"]
    err_silu = latim_jax.attribute(silu, t, method="l2", mode="paper").extra["approximation_error"]
    err_id = latim_jax.attribute(ident, t, method="l2", mode="paper").extra["approximation_error"]
    assert (np.asarray(err_silu) > 1e-2).all() and (np.asarray(err_id) < 1e-5).all()
    relu = make("m1", activation="relu")
    assert latim_jax.conservation_error(relu, t, 1) < TOL["fp32"]


def test_vmap_and_jit_equal_loop():
    model = make("m2")
    t = tokens(batch=3, length=9)
    batched = latim_jax.attribute(model, t, method="alti").scores
    loop = np.stack([latim_jax.attribute(model, t[i : i + 1], method="alti").scores[0] for i in range(3)])
    assert rel(batched, loop) < TOL["alti"]
    vm = jax.vmap(lambda x: latim_jax.attribute(model, x[None], method="alti").scores[0])(jnp.asarray(t))
    assert rel(vm, loop) < TOL["alti"]
    jitted = jax.jit(lambda x: latim_jax.attribute(model, x, method="alti").scores)(jnp.asarray(t))
    assert rel(jitted, batched) < TOL["alti"]


def test_grad_through_attribution_matches_finite_differences():
    model = make("m1")
    t = tokens(batch=1, length=6)
    graphdef, state = nnx.split(model)
    weights = jnp.asarray(np.random.default_rng(1).normal(size=(1, 2, 6, 6)), jnp.float32)

    def f(scale):
        st = jax.tree.map(lambda x: x, state)
        emb = state["embedding"][...] * scale
        st["embedding"] = nnx.Param(emb)
        m = nnx.merge(graphdef, st)
        return jnp.sum(latim_jax.attribute(m, t, method="l2").scores * weights)

    g = jax.grad(f)(1.0)
    eps = 1e-2
    fd = (f(1.0 + eps) - f(1.0 - eps)) / (2 * eps)
    assert abs(float(g) - float(fd)) <= TOL["grad_fd"] * max(abs(float(fd)), 1e-3)


def test_grad_input_matches_direct_jacobian():
    model = make("m2")
    t = tokens(batch=1, length=6)
    res = latim_jax.attribute(model, t, method="grad_input", layers=[1])
    out = model.forward(t)
    h = out.residuals[1]
    targets = np.asarray(res.extra["targets"])[0]

    def logit(x, i):
        o = model.layers[1](x, mask=jnp.ones(x.shape[:2], bool))
        return model.head(o)[0, i, targets[i]]

    grad = jax.jit(jax.grad(logit), static_argnums=1)  # compiled: eager runs each op alone
    for i in (0, 5):
        g = grad(h, i)
        want = np.linalg.norm(np.asarray(g * h)[0], axis=-1)
        assert rel(res.scores[0, 0, i], want) < 1e-4


def test_mask_zeroes_padding_and_renormalises():
    model = make("m1")
    t = tokens(batch=2, length=8)
    mask = np.ones((2, 8), bool)
    mask[1, 5:] = False
    r = latim_jax.attribute(model, t, method="alti", mask=mask)
    s = np.asarray(r.scores)
    assert (s[1, :, 5:, :] == 0).all() and (s[1, :, :, 5:] == 0).all()
    single = latim_jax.attribute(model, t[1:2, :5], method="alti").scores
    assert rel(s[1:2, :, :5, :5], single) < TOL["alti"]  # batch with padding == single prompt


def test_save_and_load_round_trip(tmp_path):
    model = make("m2")
    r = latim_jax.attribute(model, tokens(), method="logit")
    path = tmp_path / "scores.npz"
    r.save(path)
    back = latim_jax.Attribution.load(path)
    assert back.method == "logit" and back.mode == "exact" and back.layers == r.layers
    np.testing.assert_array_equal(np.asarray(back.scores), np.asarray(r.scores))
    np.testing.assert_array_equal(np.asarray(back.tokens), np.asarray(r.tokens))
    np.testing.assert_array_equal(np.asarray(back.rollout()), np.asarray(r.rollout()))
    assert [p.name for p in tmp_path.iterdir()] == ["scores.npz"]  # no temporary left behind
    (tmp_path / "bad.npz").write_bytes(b"not a zip")
    with pytest.raises(ValueError, match="bad.npz"):
        latim_jax.Attribution.load(tmp_path / "bad.npz")


def test_bad_inputs_give_clear_errors():
    model = make("m1")
    t = tokens(batch=1, length=5)
    with pytest.raises(ValueError, match="must lie in"):
        latim_jax.attribute(model, np.array([[1, 99]]))
    with pytest.raises(ValueError, match="at least one position"):
        latim_jax.attribute(model, np.zeros((1, 0), np.int32))
    with pytest.raises(ValueError, match="unknown method"):
        latim_jax.attribute(model, t, method="attention")
    with pytest.raises(ValueError, match="mode must be"):
        latim_jax.attribute(model, t, mode="approximate")
    with pytest.raises(ValueError, match="layer must be"):
        latim_jax.attribute(model, t, layers=[2])
    with pytest.raises(ValueError, match="layer must be"):
        latim_jax.contributions(model, t, 5)
    with pytest.raises(ValueError, match="mask must have shape"):
        latim_jax.attribute(model, t, mask=np.ones((1, 4), bool))
    with pytest.raises(ValueError, match="rows must be"):
        latim_jax.attribute(model, t, rows=[5])


def test_nan_in_scores_is_reported():
    params = jax.tree.map(np.array, init_params(CONFIGS["m1"], seed=0))
    params["layers"][1]["mixer"]["out_proj"][0, 0] = np.nan
    model = latim_jax.MambaLM(CONFIGS["m1"], params)
    with pytest.raises(FloatingPointError, match=r"layer\(s\) \[1\]"):
        latim_jax.attribute(model, tokens(batch=1, length=4), method="l2")


def test_api_accepts_ints_and_arrays_and_refuses_what_would_wrap():
    from latim_jax.model.generate import generate

    model = make("m2")
    t = tokens(batch=2, length=7)
    full = np.asarray(latim_jax.attribute(model, t, method="l2").scores)
    one = latim_jax.attribute(model, t, method="l2", layers=1, rows=-1)
    assert one.layers == (1,) and one.rows == (6,) and one.scores.shape == (2, 1, 1, 7)
    assert rel(one.scores[:, 0, 0], full[:, 1, 6]) < TOL["fp32"]
    arr = latim_jax.attribute(model, t, method="l2", layers=np.array([0]), rows=jnp.asarray([2, 5]))
    assert rel(arr.scores[:, 0], full[:, 0, [2, 5]]) < TOL["fp32"]
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="Blocks.rows must be a positive int"):
            Blocks(rows=bad)
    with pytest.raises(ValueError, match="rows must be ints"):
        latim_jax.attribute(model, t, rows=[1.0])
    with pytest.raises(ValueError, match="blocks must be"):
        latim_jax.attribute(model, t, blocks=(8, 8))
    # ids >= 2**32 would wrap to small ids under an int32 cast: refused before any cast, everywhere
    wrapping = [[2**32 + 5, 6, 7]]
    for call in (
        lambda: latim_jax.attribute(model, wrapping),
        lambda: model(wrapping),
        lambda: generate(model, wrapping, 2),
        lambda: latim_jax.contributions(model, np.array(wrapping), 0),
    ):
        with pytest.raises(ValueError, match=r"must lie in \[0, 32\), found min 6 max 4294967301"):
            call()
    with pytest.raises(ValueError, match="fit in 64 bits"):
        model([[2**70, 1]])
    with pytest.raises(ValueError, match="no prompt"):
        latim_jax.attribute(model, np.zeros((0, 5), np.int64))
    with pytest.raises(ValueError, match="target ids must lie in"):
        latim_jax.attribute(model, t, method="logit", target=2**32 + 1)


def test_target_and_masks_work_under_jit():
    model = make("m1")
    t = jnp.asarray(tokens(batch=2, length=6))
    mask = jnp.asarray(np.arange(6)[None, :] >= np.array([[0], [2]]))  # the second prompt left-padded
    targets = jnp.asarray(np.random.default_rng(2).integers(0, 32, (2, 6)))
    eager = latim_jax.attribute(model, t, method="logit", target=targets, mask=mask).scores

    @jax.jit
    def run(t, targets, mask):
        return latim_jax.attribute(model, t, method="logit", target=targets, mask=mask).scores

    assert rel(run(t, targets, mask), eager) < TOL["fp32"]
    assert rel(jax.jit(lambda t: latim_jax.attribute(model, t, method="logit", target=3).scores)(t),
               latim_jax.attribute(model, t, method="logit", target=3).scores) < TOL["fp32"]  # fmt: skip


@pytest.mark.parametrize("name", ["m1", "m2"])
def test_bf16_exact_mode_conserves_what_the_forward_computed(name):
    """bf16 weights: the decomposition reads the conv input as the forward rounded it, and the out_proj
    input's rounding (no token's) goes to beta, so exact mode conserves as in fp32 (measured ~1e-7)."""
    cfg = dataclasses.replace(CONFIGS[name], proj_bias=True)
    params = jax.tree.map(lambda x: np.asarray(x).astype(jnp.bfloat16), init_params(cfg, seed=3))
    model = latim_jax.MambaLM(cfg, params)
    assert model.layers[0].mixer.out_proj[...].dtype == jnp.bfloat16
    t = tokens(length=9)
    for layer in range(cfg.n_layers):
        assert latim_jax.conservation_error(model, t, layer) < TOL["bf16_conservation"], layer


def _m1_hidden_attention_by_definition(ssm, rows, cols):
    """Mamba-1's M (b, r, q, e) in float64 from its definition, a loop over (i, t) independent of the
    library's direct and factored forms: M_{i,t,c} = sum_n C_{i,n} exp(A_{c,n} sum_{k=t+1..i} Delta_{k,c})
    Delta_{t,c} B_{t,n} for t <= i (+ D_c at t = i), 0 for t > i."""
    A, D = np.asarray(ssm.A, np.float64), np.asarray(ssm.D, np.float64)
    dt, B, C = (np.asarray(x, np.float64) for x in (ssm.delta, ssm.B, ssm.C))
    M = np.zeros((dt.shape[0], len(rows), len(cols), A.shape[0]))
    for r, i in enumerate(rows):
        for q, t in enumerate(cols):
            if t > i:
                continue
            decay = np.exp(A[None] * dt[:, t + 1 : i + 1].sum(1)[..., None])  # (b, e, n)
            M[:, r, q] = np.einsum("bn,ben,bn->be", C[:, i], decay, B[:, t]) * dt[:, t]
            M[:, r, q] += D if t == i else 0.0
    return M


def test_mamba1_tiles_equal_the_definition():
    """Far tiles (all sources before the targets: the factored decay) and near tiles (the direct form)
    equal M computed in float64 from its definition, not from another branch of the library."""
    from latim_jax.kernels.decay import decay_tile
    from latim_jax.latim.kinds import layer_factors

    model = make("m1")
    t = tokens(length=24)
    h = model.forward(t, impl="xla").residuals[1]
    f = layer_factors(model, h, 1)
    tiles = ((np.arange(12, 20), np.arange(0, 12)), (np.array([23, 15, 17]), np.arange(3, 15)),
             (np.arange(8, 16), np.arange(4, 16)))  # fmt: skip
    for rows, cols in tiles:
        got = decay_tile(f.ssm, jnp.asarray(rows), jnp.asarray(cols))
        assert rel(got, _m1_hidden_attention_by_definition(f.ssm, rows, cols)) < TOL["fp32"], (rows, cols)


@pytest.mark.slow  # the library's own tile algebra: the 3.12 run keeps the faster tile tests
def test_mamba1_far_pair_values_rebuild_the_output_and_their_gradient_matches_finite_differences():
    """Mamba-1 pair values on far tiles (the factored decay, kernels.decay.far_factors; with at most
    Blocks.m1_few_rows rows, the direct form) and one near tile for the remaining sources add up, with
    beta, to the layer's output from the forward scan (exact mode conserves); and the gradient of blocked
    scores over far tiles (8 x 4 blocks: factored; 2 x 4: the few-rows direct form) matches central
    finite differences of the same scores."""
    from latim_jax.latim.kinds import layer_factors
    from latim_jax.latim.scores import layer_scores

    model = make("m1", conv_bias=True)
    t = jnp.asarray(tokens(length=24))
    h = model.forward(t, impl="xla").residuals[1]
    f = layer_factors(model, h, 1)
    for rows, far_end in ((np.arange(16, 20), 12), (np.array([23, 21, 22]), 16), (np.array([23]), 16)):
        tiles = f.tiles(None, None)
        parts = [f.pair_values(jnp.asarray(rows), j0, 4, tiles) for j0 in range(0, far_end, 4)]
        assert far_end + model.config.d_conv - 2 < rows.min()  # those tiles are far
        parts.append(f.pair_values(jnp.asarray(rows), far_end, 24 - far_end, tiles))  # the near rest
        V = jnp.concatenate(parts, 2)  # (b, r, 24, e), zero past each row
        rebuilt = np.einsum("brje,ed->brd", np.asarray(V), np.asarray(f.W_out)) + np.asarray(f.bias)[:, rows]
        assert rel(rebuilt, np.asarray(f.output)[:, rows]) < TOL["fp32"], rows

    def loss(h, blocks):
        g = layer_factors(model, h, 1)
        s = layer_scores(g, "l2", jnp.arange(24), mask=jnp.ones((2, 24), bool), blocks=blocks)
        return jnp.sum(jnp.sin(s))

    for blocks in (Blocks(rows=8, cols=4), Blocks(rows=2, cols=4)):
        analytic, numeric = directional_fd(lambda h, b=blocks: loss(h, b), (h,), eps=1e-3)
        assert abs(analytic - numeric) <= TOL["grad_fd"] * abs(numeric), (blocks, analytic, numeric)


@pytest.mark.slow  # the library's own tile algebra: the 3.12 run keeps the faster tile tests
def test_mamba1_direct_form_in_row_chunks_equals_one_pass(monkeypatch):
    """The near tiles' direct form run in passes of Blocks.m1_direct_rows target rows (4 here, so 8-
    and 12-row tiles split; 6 rows do not divide and run in one pass) gives the one-pass values and
    gradient."""
    import latim_jax.kernels.decay as decay
    from latim_jax.latim.kinds import layer_factors
    from latim_jax.latim.scores import layer_scores

    model = make("m1", conv_bias=True)
    t = jnp.asarray(tokens(length=24))
    h = model.forward(t, impl="xla").residuals[1]

    def loss(h, blocks):
        g = layer_factors(model, h, 1)
        s = layer_scores(g, "l2", jnp.arange(24), mask=jnp.ones((2, 24), bool), blocks=blocks)
        return jnp.sum(jnp.sin(s)), s

    grad = jax.jit(jax.grad(loss, has_aux=True), static_argnums=1)  # traced afresh for each Blocks
    want, want_s = grad(h, Blocks(rows=24, cols=24))
    calls = []
    direct = decay._m1_direct
    monkeypatch.setattr(decay, "_m1_direct", lambda *a: calls.append((a[1].shape[0], a[5])) or direct(*a))
    for rows, cols in ((8, 8), (12, 5), (6, 6)):
        got, got_s = grad(h, Blocks(rows=rows, cols=cols, m1_direct_rows=4))
        assert rel(got_s, want_s) < TOL["fp32"] and rel(got, want) < 1e-4
    assert {(8, 4), (12, 4), (6, 4)} <= set(calls)


def test_mamba1_direct_form_takes_fewer_rows_per_pass_when_differentiated(monkeypatch):
    """Differentiated, the direct form runs in passes of at most Blocks.m1_tangent_rows rows (4 here) while
    an undifferentiated call keeps Blocks.m1_direct_rows (12): the scores and the gradient equal those of
    one 24-row pass, and each path took the pass size it should (a rule that ignored m1_tangent_rows, or a
    forward that took it, fails the recorded sizes). The state sum inside took Blocks.m1_state_group."""
    import latim_jax.kernels.decay as decay
    from latim_jax.latim.kinds import layer_factors
    from latim_jax.latim.scores import layer_scores

    model = make("m1", conv_bias=True)
    t = jnp.asarray(tokens(length=24))
    h = model.forward(t, impl="xla").residuals[1]

    def scores(h, blocks):
        g = layer_factors(model, h, 1)
        return layer_scores(g, "l2", jnp.arange(24), mask=jnp.ones((2, 24), bool), blocks=blocks)

    def loss(h, blocks):
        return jnp.sum(jnp.sin(scores(h, blocks)))

    value = jax.jit(scores, static_argnums=1)  # each compiled program traced afresh for each Blocks
    grad = jax.jit(jax.grad(loss), static_argnums=1)
    one = Blocks(rows=24, cols=24, m1_direct_rows=24, m1_tangent_rows=24)
    want_s, want = value(h, one), grad(h, one)
    sizes = []
    passes = decay._m1_passes
    monkeypatch.setattr(decay, "_m1_passes", lambda *a: sizes.append(a[5]) or passes(*a))
    groups, state_sum = [], decay.m1_state_sum
    monkeypatch.setattr(decay, "m1_state_sum", lambda *a: groups.append(a[5]) or state_sum(*a))
    split = Blocks(rows=24, cols=24, m1_direct_rows=12, m1_tangent_rows=4, m1_state_group=1)
    got_s = value(h, split)
    assert set(sizes) == {12} and rel(got_s, want_s) < TOL["fp32"]
    sizes.clear()
    got = grad(h, split)
    # the tangent's passes ran at 4 rows (the forward pass under a checkpoint may take the primal's 12)
    assert 4 in sizes and rel(got, want) < 1e-4
    assert set(groups) == {1}


@pytest.mark.parametrize("name, static", [("m2", True), ("m1", False)])
def test_score_tiles_take_tangent_rows_when_differentiated(monkeypatch, name, static):
    """Differentiated, the XLA score path runs its tiles with Blocks.tangent_rows target rows (4 here)
    while a plain call keeps Blocks.rows (8): the scores, the gradient and a forward-mode derivative
    equal those of the same tiles unsplit (tangent_rows = rows), on both versions and both schedules
    (numpy rows: static; traced rows: the cond), and each path took the rows it should (a rule that
    ignored tangent_rows, or a value that took it, fails the recorded sizes)."""
    import latim_jax.latim.scores as scores_mod
    from latim_jax.latim.kinds import layer_factors

    real, sizes = scores_mod.blocked, []

    def spy(tile, rows, length, blocks, **kw):
        sizes.append(blocks.rows)
        return real(tile, rows, length, blocks, **kw)

    monkeypatch.setattr(scores_mod, "blocked", spy)
    model = make(name)
    rows = np.arange(24) if static else jnp.arange(24)
    h = model.forward(jnp.asarray(tokens(length=24)), impl="xla").residuals[1]
    v = jnp.asarray(np.random.default_rng(1).normal(size=h.shape), h.dtype)

    def scores(h, blocks):
        g = layer_factors(model, h, 1)
        return scores_mod.layer_scores(g, "l2", rows, mask=jnp.ones((2, 24), bool), blocks=blocks)

    def loss(h, blocks):
        return jnp.sum(jnp.sin(scores(h, blocks)))

    # each derivative one compiled program (each traces the tiles afresh, so the spy sees each path)
    value = jax.jit(scores, static_argnums=1)
    grad = jax.jit(jax.grad(loss), static_argnums=1)
    tangent = jax.jit(lambda h, v, b: jax.jvp(lambda h: loss(h, b), (h,), (v,))[1], static_argnums=2)
    unsplit, split = Blocks(rows=8, cols=8, tangent_rows=8), Blocks(rows=8, cols=8, tangent_rows=4)
    want_s, want, want_t = value(h, unsplit), grad(h, unsplit), tangent(h, v, unsplit)
    sizes.clear()
    got_s = value(h, split)
    assert sizes == [8] and rel(got_s, want_s) < TOL["fp32"]
    sizes.clear()
    got = grad(h, split)
    assert set(sizes) == {4} and rel(got, want) < 1e-4
    sizes.clear()
    got_t = tangent(h, v, split)
    assert set(sizes) == {4} and abs(got_t - want_t) < 1e-4 * abs(want_t)
    # forward and reverse mode agree: the derivative along v is the gradient's inner product with v
    assert abs(got_t - jnp.vdot(got, v)) < 1e-4 * abs(got_t)


def test_compensated_cumsum_keeps_short_segments_accurate_far_along_the_sequence():
    """S_i - S_t from the compensated cumulative sum equals float64 to fp32 relative accuracy
    of the segment itself, for short segments thousands of steps in (where S is ~1e3-1e4 times the
    segment: the plain fp32 cumsum, checked to fail the same bound, loses ~3 digits there); lengths
    1 to 5003, with a channel axis."""
    from latim_jax.kernels.decay import compensated_cumsum, segment_sum

    rng = np.random.default_rng(0)
    for length in (1, 63, 5003):
        delta = rng.uniform(0.2, 1.8, (2, length, 3)).astype(np.float32)
        exact = np.cumsum(delta.astype(np.float64), axis=1)
        decay = compensated_cumsum(jnp.asarray(delta))
        total = np.asarray(decay.hi, np.float64) + np.asarray(decay.lo, np.float64)
        assert np.max(np.abs(total - exact) / exact) < 1e-7
        rows = np.arange(0, length, max(1, length // 200))  # ~200 targets spread over the sequence
        for k in (1, 3, 17):
            cols = np.maximum(rows - k, 0)
            want = exact[:, rows] - exact[:, cols]  # (b, m, c) for the pairs (rows[m], cols[m])
            got = np.asarray(segment_sum(decay, jnp.asarray(rows), jnp.asarray(cols)))  # (b, m, m, c)
            got = np.einsum("bmmc->bmc", got)
            scale = np.maximum(np.abs(want), 1e-3)
            assert np.max(np.abs(got - want) / scale) < 2e-6, (length, k)
            if length > 1000:  # the bound is not met by construction: the plain fp32 sum fails it
                plain = np.cumsum(delta, axis=1, dtype=np.float32).astype(np.float64)
                naive = plain[:, rows] - plain[:, cols]
                assert np.max(np.abs(naive - want) / scale) > 1e-5


def test_compensated_cumsum_tangent_is_the_cumsum_of_the_tangent():
    """The tangent of S = hi + lo is cumsum(d Delta), all on hi (lo is held fixed, so a score loop's
    backward keeps one cotangent of S): jvp and vjp against the float64 cumulative sum, lo's tangent
    exactly zero."""
    from latim_jax.kernels.decay import compensated_cumsum

    rng = np.random.default_rng(1)
    delta, t = (jnp.asarray(rng.uniform(0.2, 1.8, (2, 300, 3)).astype(np.float32)) for _ in range(2))
    _, dec = jax.jvp(compensated_cumsum, (delta,), (t,))
    want = np.cumsum(np.asarray(t, np.float64), axis=1)
    assert np.max(np.abs(np.asarray(dec.hi, np.float64) - want) / want) < 1e-6
    assert not np.any(np.asarray(dec.lo))
    ct = rng.standard_normal(delta.shape).astype(np.float32)
    (got,) = jax.vjp(lambda d: (S := compensated_cumsum(d)).hi + S.lo, delta)[1](jnp.asarray(ct))
    want_ct = np.cumsum(ct.astype(np.float64)[:, ::-1], axis=1)[:, ::-1]  # the cumsum's transpose
    assert np.max(np.abs(np.asarray(got, np.float64) - want_ct) / np.abs(want_ct).max()) < 1e-6


def test_mamba1_minmax_row_subset_warns_that_it_costs_the_whole_map(monkeypatch):
    """Mamba-1 minmax hidden attention over a row subset of a long prompt warns (its range needs the
    whole map) and still returns the full map's rows; "signed", every row, a short prompt and Mamba-2
    (a range over heads) do not warn."""
    import warnings

    from latim_jax.latim import request

    monkeypatch.setattr(request, "MINMAX_SUBSET_WARN_LENGTH", 10)
    m1, m2 = make("m1"), make("m2")
    t = tokens(length=12)
    kw = dict(method="hidden_attention", layers=[1])
    with pytest.warns(UserWarning, match="aggregation='signed'"):
        sub = latim_jax.attribute(m1, t, rows=[3, -1], **kw)
    full = latim_jax.attribute(m1, t, **kw)
    np.testing.assert_allclose(sub.scores, full.scores[:, :, [3, 11]], rtol=1e-6, atol=1e-7)

    def ours(caught):
        return [w for w in caught if "aggregation='signed'" in str(w.message)]

    for model, tok, extra in (
        (m1, t, dict(rows=[-1], aggregation="signed")),
        (m1, t, dict(rows=list(range(12)))),
        (m1, t[:, :9], dict(rows=[-1])),
        (m2, t, dict(rows=[-1])),
    ):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            latim_jax.attribute(model, tok, **kw, **extra)
        assert not ours(caught), extra


def test_input_errors_name_the_problem_and_the_way_to_pass_it():
    """An empty prompt, prompts of different lengths, an aggregation for a method that does not read it,
    a layer or row named twice and an unreadable memory_limit are each refused with a message naming
    the problem (not numpy's or int()'s words, not silently ignored or returned twice)."""
    model = make("m1")
    t = tokens(batch=1, length=5)
    with pytest.raises(ValueError, match=r"the prompt is empty: tokens have shape \(1, 0\)"):
        latim_jax.attribute(model, [[]])
    with pytest.raises(ValueError, match=r"different lengths \(prompt 0: 3, prompt 1: 2\).*pad.*mask="):
        latim_jax.attribute(model, [[1, 2, 3], [1, 2]])
    with pytest.raises(ValueError, match="different lengths"):
        model([[1, 2], [3]])
    with pytest.raises(ValueError, match=r"inputs_embeds: the prompts have different lengths"):
        latim_jax.attribute(model, inputs_embeds=[np.zeros((3, 16)), np.zeros((2, 16))])
    for method in ("l2", "alti", "logit", "grad_input"):
        with pytest.raises(
            ValueError, match=f"aggregation='minmax' applies to method='hidden_attention' only.*{method}"
        ):
            latim_jax.attribute(model, t, method=method, aggregation="minmax")
    a = latim_jax.attribute(model, t, method="hidden_attention", aggregation="abs", layers=[0], rows=[4])
    assert a.aggregation == "abs"
    assert (
        latim_jax.attribute(model, t, method="hidden_attention", layers=[0], rows=[4]).aggregation == "minmax"
    )
    with pytest.raises(ValueError, match=r"layers \[1, 1\] name the same layer more than once \(layer 1\)"):
        latim_jax.attribute(model, t, method="l2", layers=[1, 1])
    with pytest.raises(ValueError, match=r"layer 1 \(given as 1, -1\)"):
        latim_jax.attribute(model, t, method="l2", layers=[1, -1])
    with pytest.raises(
        ValueError, match=r"rows \[2, 2\] name the same position more than once \(position 2\)"
    ):
        latim_jax.attribute(model, t, method="l2", rows=[2, 2])
    with pytest.raises(ValueError, match=r"position 4 \(given as -1, 4\)"):
        latim_jax.attribute(model, t, method="l2", rows=[-1, 4])
    with pytest.raises(
        ValueError, match="memory_limit must be \"auto\", a number of bytes or None, found 'lots'"
    ):
        latim_jax.attribute(model, t, method="l2", memory_limit="lots")


def test_forward_mode_through_the_pallas_scans_names_impl_xla():
    """jax.jvp through attribute / contributions with impl="pallas" stops at the scans' custom_vjp; the
    error says forward mode needs impl="xla" (and impl="xla" differentiates forward)."""
    model = make("m2")
    x = model.forward(tokens(batch=1, length=4)).residuals[0]

    def scores(e, impl):
        return latim_jax.attribute(
            model, inputs_embeds=e, method="l2", layers=[0], rows=[3], impl=impl
        ).scores

    with pytest.raises(TypeError, match=r"forward-mode differentiation .* Pass impl='xla' for forward mode"):
        jax.jvp(lambda e: scores(e, "pallas"), (x,), (jnp.ones_like(x),))
    with pytest.raises(TypeError, match=r"Pass impl='xla'"):
        jax.jvp(lambda e: latim_jax.contributions(model, inputs_embeds=e, impl="pallas").T, (x,), (x,))
    _, tangent = jax.jvp(lambda e: scores(e, "xla"), (x,), (jnp.ones_like(x),))
    assert np.isfinite(np.asarray(tangent)).all()
