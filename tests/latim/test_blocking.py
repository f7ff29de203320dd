"""The block loop's two schedules (latim_jax.latim.blocking.blocked): rows known when tracing (numpy: only
the causal tiles, no branch) and traced rows (every tile, a cond skipping the non-causal ones) give the
same scores and the same gradients, and the static one really visits only the causal tiles."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import rel_err as rel

import latim_jax
from latim_jax import Blocks
from latim_jax.latim.blocking import blocked
from latim_jax.latim.kinds import layer_factors
from latim_jax.latim.scores import layer_scores, token_sum
from latim_jax.model.config import MambaConfig
from latim_jax.model.init import init_params

CONFIGS = {
    "m1": MambaConfig(version=1, d_model=16, n_layers=1, vocab_size=32, d_state=4, d_conv=4),
    "m2": MambaConfig(
        version=2, d_model=16, n_layers=1, vocab_size=32, d_state=4, d_conv=3, head_dim=8, n_groups=2,
        chunk_size=4,
    ),
}  # fmt: skip
L = 13
BLOCKS = Blocks(rows=4, cols=3)  # 4 row tiles x 5 column tiles, the last of each partial


def _model(name):
    cfg = CONFIGS[name]
    model = latim_jax.MambaLM(cfg, init_params(cfg, seed=5))
    t = jnp.asarray(np.random.default_rng(1).integers(0, 32, (2, L)))
    mask = jnp.ones((2, L), bool).at[1, :3].set(False)  # left padding in the second prompt
    return model, model.forward(t, mask=mask, impl="xla").residuals[0], mask


def _scores(model, mask, method, rows, **kw):
    def fn(h):
        f = layer_factors(model, h, 0, "exact", mask=mask, impl="xla")
        return layer_scores(f, method, rows, mask=mask, blocks=BLOCKS, **kw)

    return fn


# each version and each of the three tile consumers once, every row or a subset (unsorted, repeated);
# not the full product (CI time)
CASES = [("m1", "hidden_attention", False), ("m2", "alti", False), ("m1", "alti", True), ("m2", "l2", True)]


@pytest.mark.slow  # the schedule is the library's own code: the 3.12 run keeps the structural tests below
@pytest.mark.parametrize(("name", "method", "subset"), CASES)
def test_static_schedule_equals_traced_in_values_and_gradients(name, method, subset):
    model, h, mask = _model(name)
    rows = np.array([12, 0, 5, 7, 7]) if subset else np.arange(L)
    static = _scores(model, mask, method, rows)
    traced = jax.jit(lambda h, r: _scores(model, mask, method, r)(h))  # rows an argument: traced
    want = traced(h, jnp.asarray(rows))
    got = jax.jit(static)(h)
    assert rel(got, want) < 1e-6
    assert float(jnp.abs(got).max()) > 0
    w = jax.random.normal(jax.random.key(0), want.shape)
    g_static = jax.jit(jax.grad(lambda h: jnp.sum(w * static(h))))(h)  # compiled: eager runs each op alone
    g_traced = jax.jit(jax.grad(lambda h: jnp.sum(w * traced(h, jnp.asarray(rows)))))(h)
    assert rel(g_static, g_traced) < 1e-5
    assert float(jnp.abs(g_static).max()) > 0


@pytest.mark.parametrize("name", ["m1", "m2"])
def test_static_token_sum_equals_scan_total(name):
    """The folding form (combine into an accumulator) on the static schedule: the blocked sum over
    sources equals the factors' own scanned total (an independent path)."""
    model, h, mask = _model(name)
    f = layer_factors(model, h, 0, "exact", mask=mask, impl="xla")
    got = token_sum(f, np.arange(L), blocks=BLOCKS)
    assert rel(got, f.token_total) < 1e-5


def _equations(jaxpr):
    """Every equation of a jaxpr, those of nested jaxprs (scan bodies, cond branches, ...) included."""
    for eqn in jaxpr.eqns:
        yield eqn
        for p in eqn.params.values():
            for j in p if isinstance(p, tuple | list) else (p,):
                inner = getattr(j, "jaxpr", j)  # a ClosedJaxpr or a Jaxpr
                if hasattr(inner, "eqns"):
                    yield from _equations(inner)


def _scan_lengths(fn, *args):
    """The lengths of the scans in fn's jaxpr, nested ones included."""
    return [
        e.params["length"] for e in _equations(jax.make_jaxpr(fn)(*args).jaxpr) if e.primitive.name == "scan"
    ]


def test_static_schedule_visits_only_causal_tiles_without_a_branch():
    rows, length, blocks = np.arange(10), 10, Blocks(rows=4, cols=3)  # 3 row tiles x 4 column tiles

    def tile(rb, j0):
        return jnp.ones((1, 4, 3)) * (rb[:, None] + 100 * j0)[None]

    # causal pairs: row tile 0 (rows 0-3) columns 0, 3; tile 1 (4-7) 0, 3, 6; tile 2 (8, 9, 9, 9) all 4
    assert _scan_lengths(lambda: blocked(tile, rows, length, blocks)) == [9]
    assert _scan_lengths(lambda r: blocked(tile, r, length, blocks), jnp.asarray(rows)) == [12]
    jaxpr = str(jax.make_jaxpr(lambda: blocked(tile, rows, length, blocks))())
    assert "cond" not in jaxpr
    got = np.asarray(blocked(tile, rows, length, blocks))[0]
    j = np.arange(length)
    want = np.where((j // 3 * 3)[None, :] <= np.array([3, 3, 3, 3, 7, 7, 7, 7, 9, 9])[:, None],
                    rows[:, None] + 100 * (j // 3 * 3)[None, :], 0)  # fmt: skip
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got, np.asarray(blocked(tile, jnp.asarray(rows), length, blocks))[0])


def test_attribute_every_row_equals_explicit_rows():
    """attribute passes every row as a static schedule, an explicit list of them as traced rows."""
    cfg = dataclasses.replace(CONFIGS["m1"], n_layers=2)
    model = latim_jax.MambaLM(cfg, init_params(cfg, seed=2))
    t = np.random.default_rng(2).integers(0, 32, (2, L))
    for method in ("l2", "alti"):
        every = latim_jax.attribute(model, t, method=method, blocks=BLOCKS).scores
        listed = latim_jax.attribute(model, t, method=method, blocks=BLOCKS, rows=list(range(L))).scores
        assert rel(every, listed) < 1e-6


def test_tap_products_differentiate_as_the_plain_broadcast_products():
    """tap_sum and gated carry einsum tangents (for XLA:CPU's backward): their jvp and vjp equal jax's
    own differentiation of the plain broadcast products they compute."""
    from latim_jax.latim.mamba import gated, tap_sum

    k = jax.random.split(jax.random.key(1), 6)
    M, a = jax.random.normal(k[0], (2, 5, 6 + 3, 3)), jax.random.normal(k[1], (4, 2, 6, 3, 2))
    G, acc = jax.random.normal(k[2], (2, 5, 6)), jax.random.normal(k[3], (2, 5, 4, 6))

    def plain_tap(M, a):
        return sum(M[:, :, i : i + 6, :, None] * a[i][:, None] for i in range(4))

    def plain_gate(G, acc):
        return G[:, :, None] * acc

    for fast, plain, args in ((tap_sum, plain_tap, (M, a)), (gated, plain_gate, (G, acc))):
        np.testing.assert_allclose(fast(*args), plain(*args), rtol=1e-6)
        t = tuple(jax.random.normal(k[4], x.shape) for x in args)
        jvp = [jax.jvp(f, args, t)[1] for f in (fast, plain)]
        np.testing.assert_allclose(jvp[0], jvp[1], rtol=1e-5, atol=1e-6)
        w = jax.random.normal(k[5], plain(*args).shape)
        g_fast, g_plain = (
            jax.grad(lambda *x, f=f, w=w: jnp.sum(w * f(*x)), argnums=(0, 1))(*args) for f in (fast, plain)
        )
        for gf, gp in zip(g_fast, g_plain, strict=True):
            np.testing.assert_allclose(gf, gp, rtol=1e-5, atol=1e-6)
        # second order (grad x input differentiates through a gradient): Hessian-vector products agree
        hvp = [
            jax.jvp(jax.grad(lambda *x, f=f: jnp.sum(jnp.sin(f(*x))), argnums=(0, 1)), args, t)[1]
            for f in (fast, plain)
        ]
        for hf, hp in zip(*hvp, strict=True):
            np.testing.assert_allclose(hf, hp, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    ("x_shape", "y_shape"),
    [((2, 5, 1, 4), (2, 1, 3, 4)), ((4,), (2, 3, 4)), ((2, 3, 1), (1, 3, 5)), ((2, 1, 1, 3), (2, 4, 6, 3))],
)
def test_bmul_differentiates_as_the_plain_product_through_contractions(x_shape, y_shape):
    """bmul (kernels/products.py) is x * y with einsum tangents: values, jvp, vjp and Hessian-vector
    products equal jax's differentiation of the plain product, and its gradient with respect to the
    broadcast operand is a dot_general, not a reduce_sum (what XLA:CPU runs ~9x faster)."""
    from latim_jax.kernels.products import bmul

    k = jax.random.split(jax.random.key(2), 6)
    x, y = jax.random.normal(k[0], x_shape), jax.random.normal(k[1], y_shape)
    np.testing.assert_array_equal(bmul(x, y), x * y)
    t = (jax.random.normal(k[2], x_shape), jax.random.normal(k[3], y_shape))
    np.testing.assert_allclose(jax.jvp(bmul, (x, y), t)[1], jax.jvp(jnp.multiply, (x, y), t)[1], rtol=1e-6)
    w = jax.random.normal(k[4], (x * y).shape)

    def loss(f):
        return lambda x, y: jnp.sum(w * jnp.sin(f(x, y)))

    for gf, gp in zip(
        jax.grad(loss(bmul), (0, 1))(x, y), jax.grad(loss(jnp.multiply), (0, 1))(x, y), strict=True
    ):
        np.testing.assert_allclose(gf, gp, rtol=1e-5, atol=1e-6)
    hvp = [jax.jvp(jax.grad(loss(f), (0, 1)), (x, y), t)[1] for f in (bmul, jnp.multiply)]
    for hf, hp in zip(*hvp, strict=True):
        np.testing.assert_allclose(hf, hp, rtol=1e-4, atol=1e-5)
    jaxprs = [
        str(jax.make_jaxpr(jax.grad(lambda x, f=f: jnp.sum(w * f(x, y))))(x)) for f in (bmul, jnp.multiply)
    ]
    assert "dot_general" in jaxprs[0] and "dot_general" not in jaxprs[1]
    assert jaxprs[0].count("reduce_sum") < jaxprs[1].count("reduce_sum")  # the loss's own sum stays


# (states, group): two groups of 4; four of 2; 6 states, not a multiple of 4: one pass
@pytest.mark.parametrize("n,group", [(8, 4), (8, 2), (6, 4)])
def test_direct_form_state_sum_differentiates_as_the_plain_sum(n, group):
    """m1_state_sum (kernels/decay.py: the Mamba-1 direct form's n-sum, whose tangent runs in
    rematerialised groups of ``Blocks.m1_state_group`` states) has the values, jvp, vjp and
    Hessian-vector products of the plain sum over n of C_i B_t[n] exp(A[:, n] seg), masked and times
    Delta, differentiated by jax; and its backward holds one group's exponential blocks: the gradient's
    jaxpr has a scan over n / group groups."""
    from latim_jax.kernels.decay import m1_state_sum

    k = jax.random.split(jax.random.key(3), 8)
    b, r, q, e = 2, 3, 5, 6
    cb = jax.random.normal(k[0], (b, r, q, n))
    A = -jnp.exp(jax.random.normal(k[1], (e, n)))
    seg = jnp.abs(jax.random.normal(k[2], (b, r, q, e)))
    dt = jax.nn.softplus(jax.random.normal(k[3], (b, 1, q, e)))
    causal = (jnp.arange(q)[None, :] <= jnp.arange(r)[:, None] + 1)[None, :, :, None]

    def plain(cb, A, seg, dt):
        s = sum(cb[..., i, None] * jnp.exp(A[:, i] * jnp.where(causal, seg, 0.0)) for i in range(n))
        return jnp.where(causal, s, 0.0) * dt

    def fast(cb, A, seg, dt):
        return m1_state_sum(cb, A, seg, dt, causal, group)

    args = (cb, A, seg, dt)
    np.testing.assert_allclose(fast(*args), plain(*args), rtol=1e-5, atol=1e-6)
    t = tuple(jax.random.normal(k[4 + i], x.shape) for i, x in enumerate(args))
    np.testing.assert_allclose(jax.jvp(fast, args, t)[1], jax.jvp(plain, args, t)[1], rtol=1e-5, atol=1e-5)

    def loss(f):
        return lambda *x: jnp.sum(jnp.sin(f(*x)))

    argnums = (0, 1, 2, 3)
    grads = [jax.grad(loss(f), argnums)(*args) for f in (fast, plain)]
    for gf, gp in zip(*grads, strict=True):
        np.testing.assert_allclose(gf, gp, rtol=1e-5, atol=1e-5)
    hvp = [jax.jvp(jax.grad(loss(f), argnums), args, t)[1] for f in (fast, plain)]
    for hf, hp in zip(*hvp, strict=True):
        np.testing.assert_allclose(hf, hp, rtol=1e-4, atol=1e-4)
    groups = n // group if n % group == 0 else 1
    lengths = _scan_lengths(jax.grad(loss(fast), argnums), *args)
    assert groups in lengths, lengths


@pytest.mark.parametrize("method", ["l2", "hidden_attention"])
@pytest.mark.parametrize("name", ["m1", "m2"])
def test_far_near_split_reads_tile_sized_arrays(name, method):
    """The far/near conds (kernels/decay.py m1_far_or_near, m2_far_or_near) take tile-sized operands only:
    had a branch read the layer's (b, l, e) Delta, B, C or S, the cond's transpose would add a full-size
    zero cotangent per tile (a gradient growing as L^3). No operand of any cond in the gradient's
    program has the sequence length L = 13 (tiles are 8 x 4, above m1_few_rows, so a branch's 8 rows and
    4 + K - 1 columns are not 13 either; e 32, n 4, d 16)."""
    model, h, mask = _model(name)
    kw = {"aggregation": "abs"} if method == "hidden_attention" else {}

    def loss(h):
        f = layer_factors(model, h, 0, "exact", mask=mask, impl="xla")
        return jnp.sum(layer_scores(f, method, np.arange(L), mask=mask, blocks=Blocks(rows=8, cols=4), **kw))

    conds = [e for e in _equations(jax.make_jaxpr(jax.grad(loss))(h).jaxpr) if e.primitive.name == "cond"]
    assert conds, "the far/near split is a cond"
    for eqn in conds:
        shapes = [v.aval.shape for v in eqn.invars]
        assert not any(L in s for s in shapes), shapes


def _decay_by_definition(ssm):
    """M (b, l, l, c) in float64 numpy, straight from the definition (kernels/decay.py's docstring):
    sum_n C_i[n] B_t[n] Delta_t exp(A (S_i - S_t)) per channel (Mamba-1) or per head over its group
    (Mamba-2), D on the diagonal, 0 above it; S a float64 cumulative sum."""
    delta, B, C, A, D = (np.asarray(x, np.float64) for x in (ssm.delta, ssm.B, ssm.C, ssm.A, ssm.D))
    S = np.cumsum(delta, axis=1)  # (b, l, c)
    seg = S[:, :, None] - S[:, None, :]  # (b, i, t, c)
    if ssm.version == 1:  # A (e, n), B / C (b, l, n)
        M = np.einsum("bin,btn,btc,bitcn->bitc", C, B, delta, np.exp(A * seg[..., None]))
    else:  # A (h,), B / C (b, l, g, n): head h reads group h // (h / g)
        group = np.arange(A.shape[0]) // (A.shape[0] // B.shape[2])
        cb = np.einsum("bign,btgn->bitg", C, B)[..., group]
        M = cb * delta[:, None] * np.exp(A * seg)
    length = delta.shape[1]
    M = np.where(np.tril(np.ones((length, length), bool))[None, :, :, None], M, 0.0)
    return M + np.eye(length)[None, :, :, None] * D


@pytest.mark.parametrize("name", ["m1", "m2"])
def test_decay_tiles_equal_the_definition(name):
    """decay_tile on far tiles (every source before every target: Mamba-1's factored product, Mamba-2's
    unmasked branch), near tiles (the diagonal) and tiles running past the end equals M computed from
    its definition in float64: each branch of the far/near split is checked, not only their agreement."""
    from latim_jax.kernels.decay import decay_tile, is_far

    model, h, mask = _model(name)
    ssm = layer_factors(model, h, 0, "exact", mask=mask, impl="xla").ssm
    want = _decay_by_definition(ssm)
    cases = [(range(8, 12), range(0, 3), True), (range(4, 8), range(3, 6), False),
             (range(9, 13), range(11, 14), False), (range(12, 13), range(6, 9), True)]  # fmt: skip
    for rows, cols, far in cases:
        rows, cols = np.array(rows), np.array(cols)
        assert bool(is_far(rows, cols)) == far
        got = np.asarray(decay_tile(ssm, jnp.asarray(rows), jnp.asarray(cols)))
        ok = cols < L
        expect = np.zeros(got.shape)
        expect[:, :, ok] = want[:, rows][:, :, cols[ok]]
        assert np.abs(expect).max() > 0
        np.testing.assert_allclose(got, expect, rtol=2e-5, atol=1e-6 * np.abs(want).max())


@pytest.mark.parametrize("traced", [False, True])
def test_a_column_window_equals_those_columns_of_the_whole_map(traced):
    """blocked(..., columns=(start, width)) (a device's share of the sources on a "seq" axis, start
    traced) is exactly the window of the whole map, with the static schedule and with the traced one,
    for windows at the start, inside and at the end, and a width the tiles do not divide."""
    from latim_jax.latim.scores import blocked_scores

    model, h, mask = _model("m2")
    f = layer_factors(model, h, 0, "exact", mask=mask, impl="xla")
    rows = np.array([2, 6, 12])
    rows = jnp.asarray(rows) if traced else rows
    whole = blocked_scores(f, "l2", rows, blocks=BLOCKS)
    window = jax.jit(lambda start: blocked_scores(f, "l2", rows, blocks=BLOCKS, columns=(start, 5)))
    for start in (0, 4, 8):
        assert np.array_equal(window(start), whole[:, :, start : start + 5]), start
    assert float(jnp.abs(whole[:, :, 8:]).max()) > 0
