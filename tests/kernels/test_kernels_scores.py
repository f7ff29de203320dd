"""The fused score kernel (kernels/fused_scores.py) against the blocked pure-JAX scores
(latim_jax.latim.scores.blocked_scores, its reference and backward).

Interpret mode on CPU for both kernel variants ("tpu": e-chunk axis with a VMEM accumulator; "gpu":
in-kernel loop over heads / channel chunks), on tiny random Mamba-1 and Mamba-2 (groups 1 and 2)
models, exact and paper factors, all four scores per compile (compiles dominate the run time);
then vmap, grad and jvp through the custom_jvp, and the real TPU (Mosaic) and GPU (Triton) lowerings.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import directional_fd, rel_err
from test_kernels_scan import CUSTOM_CALL, hardware_calls

import latim_jax
import latim_jax.model.init
from latim_jax.kernels import lowering
from latim_jax.kernels.block_sizes import Blocks
from latim_jax.kernels.decay import SSM, Decay
from latim_jax.kernels.fused_scores import METHODS, fused_layer_scores
from latim_jax.latim.kinds import layer_factors
from latim_jax.latim.mamba import MambaFactors
from latim_jax.latim.scores import blocked_scores

# max |kernel - reference| / max |reference| per score. Both sides compute the same fp32 math in a
# different order (tiles, d-tile partial sums, W_out scaled by G); measured <= 6e-7. The derivative is
# the reference's own (the custom_jvp), so it is checked against central finite differences of the
# kernel's own forward (fp32: within 1e-2 relative), never against the reference's derivative.
TOL = {"forward": 1e-5, "fd": 1e-2}

# Tiny models: e = 32 channels, d = 16, n = 4. m2g1: 2 heads of 16 and K = 3; m2g2: 4 heads of 8.
MODELS = {
    "m1": dict(version=1, d_conv=4),
    "m2g1": dict(version=2, d_conv=3, head_dim=16, n_groups=1),
    "m2g2": dict(version=2, d_conv=4, head_dim=8, n_groups=2),
}
L, BATCH = 13, 2  # a prime length, batch > 1
ROWS = np.array([12, 0, 5, 7, 3])  # an unsorted subset: row blocks of 4 mix causal extents
# several blocks on every axis: 2 row blocks, 2 ragged column blocks, 2 d tiles, 2 e steps
SMALL = Blocks(rows=4, cols=8, d=8, e=16)

# (model, variant, length, rows, blocks, methods): a prime length in several ragged blocks, length 1
# and exactly one block (all rows). Every method runs on each model and variant at the prime length
# (l1 and l2 share everything but abs vs square). At length 1 the unnormalised alti score can be 0
# (max(0, |h + o|_1 - |beta|_1) when the bias term dominates), so that case checks l2. m2g1
# (groups 1, K = 3) is checked by the vmap and grad tests. Each (case, method) is one interpret-mode
# compile, and compiles dominate the run time.
CASES = [
    ("m1", "tpu", L, ROWS, SMALL, METHODS),
    ("m2g2", "tpu", L, ROWS, SMALL, METHODS),
    ("m1", "gpu", L, ROWS, SMALL, ("l2", "logit")),
    ("m2g2", "gpu", L, ROWS, SMALL, ("l1", "alti")),
    ("m2g2", "tpu", 1, np.array([0]), Blocks(rows=8, cols=8, e=16), ("l2",)),
    ("m1", "gpu", 8, np.arange(8), Blocks(rows=8, cols=8, d=16, e=32), ("alti",)),
]


@functools.cache
def model_factors(name: str) -> dict[str, MambaFactors]:
    """The factors (exact and paper) of a tiny random 1-layer model on BATCH prompts of length L."""
    cfg = latim_jax.MambaConfig(d_model=16, n_layers=1, vocab_size=32, d_state=4, **MODELS[name])
    model = latim_jax.MambaLM(cfg, latim_jax.model.init.init_params(cfg, seed=3))
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (BATCH, L))

    @jax.jit
    def build(t):
        h = model.forward(t).residuals[0]
        return {mode: layer_factors(model, h, 0, mode) for mode in ("exact", "paper")}

    return build(tokens)


def factors(name: str, mode: str) -> MambaFactors:
    return model_factors(name)[mode]


def prefix(f: MambaFactors, length: int) -> MambaFactors:
    """The factors of the first ``length`` positions (every per-position quantity is causal)."""
    cut = lambda x, axis=1: jax.lax.slice_in_dim(x, 0, length, axis=axis)  # noqa: E731
    return dataclasses.replace(
        f,
        a=cut(f.a, 2),
        G=cut(f.G),
        ssm=dataclasses.replace(
            f.ssm,
            delta=cut(f.ssm.delta),
            B=cut(f.ssm.B),
            C=cut(f.ssm.C),
            decay=Decay(cut(f.ssm.decay.hi), cut(f.ssm.decay.lo)),
        ),
        bias=cut(f.bias),
        output=cut(f.output),
        h=cut(f.h),
        token_total=cut(f.token_total),
    )


def readout(f: MambaFactors):
    """A random logit readout q (b, l, e)."""
    return jax.random.normal(jax.random.key(7), f.G.shape, jnp.float32)


@functools.partial(jax.jit, static_argnames=("variant", "blocks", "methods"))
def kernel_scores(f, rows, aux, variant, blocks, methods):
    return [fused_layer_scores(f, m, rows, aux=aux, block_sizes=blocks, platform=variant) for m in methods]


@functools.partial(jax.jit, static_argnames=("methods",))
def reference_scores(f, rows, aux, methods):
    return [blocked_scores(f, m, rows, aux) for m in methods]


@pytest.mark.parametrize("name,variant,length,rows,blocks,methods", CASES, ids=lambda v: str(v)[:12])
def test_kernel_matches_blocked_reference(name, variant, length, rows, blocks, methods):
    causal = np.arange(length)[None, :] <= rows[:, None]
    for mode in ("exact", "paper"):
        # the kernel never reads the (static) mode: one compile serves both modes' factors
        f = dataclasses.replace(prefix(factors(name, mode), length), mode="exact")
        aux = readout(f)
        got = kernel_scores(f, jnp.asarray(rows), aux, variant, blocks, methods)
        want = reference_scores(f, jnp.asarray(rows), aux, methods)
        for method, g, w in zip(methods, got, want, strict=True):
            assert g.shape == (BATCH, len(rows), length), (method, g.shape)
            assert rel_err(g, w) < TOL["forward"], (name, variant, length, mode, method, rel_err(g, w))
            assert (np.asarray(g)[:, ~causal] == 0).all(), (method, "upper triangle must be exactly 0")
        assert float(jnp.max(want[0])) > 0  # the comparison is not between zeros


def test_vmap_over_prompts_equals_loop():
    f = prefix(factors("m2g1", "exact"), 7)
    rows = jnp.asarray([6, 1, 4])
    ssm = SSM(version=f.ssm.version, A=None, D=None, delta=0, B=0, C=0, decay=Decay(0, 0))
    axes = MambaFactors(mode=f.mode, ssm=ssm, a=1, G=0, W_out=None, bias=0, output=0, h=0, token_total=0)
    one = lambda g: jax.tree.map(lambda x, ax: x if ax is None else jnp.expand_dims(x, ax), g, axes)  # noqa: E731
    run = jax.jit(lambda g: fused_layer_scores(one(g), "l2", rows, block_sizes=SMALL)[0])
    batched = jax.vmap(run, in_axes=(axes,))(f)
    take = lambda i: jax.tree.map(lambda x, ax: x if ax is None else jnp.take(x, i, ax), f, axes)  # noqa: E731
    looped = jnp.stack([run(take(i)) for i in range(BATCH)])
    assert batched.shape == (BATCH, 3, 7)
    assert rel_err(batched, looped) < TOL["forward"]
    assert rel_err(looped, reference_scores(f, rows, None, ("l2",))[0]) < TOL["forward"]
    assert float(jnp.max(looped)) > 0


def test_grad_through_the_kernel_matches_finite_differences_of_its_forward():
    """The kernel's derivative is the blocked reference's (its custom_jvp), so comparing the two
    gradients would test nothing: the gradient is checked against central finite differences of the
    KERNEL's own forward, along two random directions in the factors and the readout q. A tangent
    that did not belong to the kernel's forward (a wrong reference, a misrouted argument) fails."""
    f = prefix(factors("m2g1", "paper"), 6)
    rows = jnp.asarray([5, 2])
    aux = readout(f)
    weights = jax.random.normal(jax.random.key(1), (BATCH, 2, 6))
    kernel = functools.partial(
        fused_layer_scores, block_sizes=Blocks(rows=2, cols=4, e=16), reference=blocked_scores
    )
    loss_fn = jax.jit(lambda f, aux: jnp.sum(weights * kernel(f, "logit", rows, aux=aux)))
    want = jnp.sum(weights * blocked_scores(f, "logit", rows, aux))  # the forward: an independent path
    assert abs(float(loss_fn(f, aux) - want)) <= TOL["forward"] * float(jnp.abs(want))
    for seed in (0, 1):
        analytic, numeric = directional_fd(loss_fn, (f, aux), eps=1e-3, seed=seed)
        assert abs(analytic - numeric) <= TOL["fd"] * abs(numeric), (seed, analytic, numeric)


def test_forward_mode_through_the_kernel_matches_finite_differences():
    """jax.jvp through the kernel (a custom_jvp: forward mode works) equals the central finite difference
    of the kernel's own forward along a random direction; jax.jacfwd's Jacobian in the tap values a,
    contracted with a direction, equals the finite difference along it (an assembly error fails)."""
    f = prefix(factors("m1", "exact"), 6)
    rows = jnp.asarray([5, 3])
    kernel = functools.partial(
        fused_layer_scores, block_sizes=Blocks(rows=2, cols=4, e=16), reference=blocked_scores
    )
    leaves, tree = jax.tree.flatten(f)
    keys = jax.random.split(jax.random.key(2), len(leaves))
    normal = [jax.random.normal(k, x.shape) for k, x in zip(keys, leaves, strict=True)]
    direction = jax.tree.unflatten(tree, normal)
    loss = jax.jit(lambda f: jnp.sum(kernel(f, "l2", rows) ** 2))
    _, got = jax.jvp(loss, (f,), (direction,))
    eps = 1e-3
    shift = lambda sign: jax.tree.map(lambda x, v: x + sign * eps * v, f, direction)  # noqa: E731
    numeric = (loss(shift(1.0)) - loss(shift(-1.0))) / (2 * eps)
    assert abs(float(got - numeric)) <= TOL["fd"] * abs(float(numeric)), (got, numeric)
    # eager: jax.jit(jax.jacfwd(...)) of the interpret-mode kernel returns garbage on some runs under
    # XLA:CPU's thunk runtime (a race: 3 of 4 processes; eager and one jitted direction are right; the
    # compiled TPU/GPU kernels are not concerned). docs/kernels.md, "Known problems".
    scores_of_a = lambda a: kernel(dataclasses.replace(f, a=a), "l2", rows)  # noqa: E731
    jacobian = jax.jacfwd(scores_of_a)(f.a)  # (b, r, l, K, b, l, e)
    v = jax.random.normal(jax.random.key(3), f.a.shape)
    contracted = jnp.tensordot(jacobian, v, axes=v.ndim)
    fd = (scores_of_a(f.a + eps * v) - scores_of_a(f.a - eps * v)) / (2 * eps)
    assert rel_err(contracted, fd) < TOL["fd"], rel_err(contracted, fd)


def test_rejects_unknown_method_and_missing_readout():
    f = factors("m1", "exact")
    with pytest.raises(ValueError, match="fused scores support"):
        fused_layer_scores(f, "hidden_attention", jnp.arange(3))
    with pytest.raises(ValueError, match="needs aux"):
        fused_layer_scores(f, "logit", jnp.arange(3))


# --------------------------------------------------------------------------------------------------
# Real lowerings (Mosaic for TPU, Triton for GPU) from this CPU machine, at hardware-legal shapes
# --------------------------------------------------------------------------------------------------


def synthetic_factors(version: int, *, b=1, l=256, d=256, e=256, n=16, heads=4, groups=2, K=4):
    """Random MambaFactors at lowering shapes (Mamba-2: heads of e / heads; Mamba-1: heads = e)."""
    rng = np.random.default_rng(0)
    arr = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    c = heads if version == 2 else e
    bc = (b, l, groups, n) if version == 2 else (b, l, n)
    delta = jnp.abs(arr(b, l, c))
    A = -jnp.abs(arr(heads) if version == 2 else arr(e, n))
    return MambaFactors(
        mode="exact", ssm=SSM.build(version, A, arr(c), delta, arr(*bc), arr(*bc)), a=arr(K, b, l, e),
        G=arr(b, l, e), W_out=arr(e, d), bias=arr(b, l, d), output=arr(b, l, d), h=arr(b, l, d),
        token_total=arr(b, l, d),
    )  # fmt: skip


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
@pytest.mark.parametrize("platform", ["tpu", "gpu"])
@pytest.mark.parametrize("version", [1, 2])
def test_lowers_for_hardware(platform, version):
    f = synthetic_factors(version)
    rows = jnp.arange(0, 256, 3)  # 86 rows: a ragged last row block

    def scores(f, rows):  # l2 and alti: the alti epilogue is the only one with extra inputs
        return [fused_layer_scores(f, m, rows, platform=platform, interpret=False) for m in ("l2", "alti")]

    lower = lowering.lower_for_tpu if platform == "tpu" else lowering.lower_for_gpu
    try:
        text = lower(scores, f, rows).as_text()
    except lowering.LoweringUnsupported as err:
        pytest.skip(str(err))
    # one hardware kernel per pallas_call traced (l2 and alti: two), none left in interpret mode
    assert (
        hardware_calls(text)
        == [CUSTOM_CALL[platform]] * len(lowering.pallas_grids(scores, f, rows))
        == [CUSTOM_CALL[platform]] * 2
    )


@pytest.mark.parametrize("platform", ["tpu", "gpu"])
@pytest.mark.parametrize("version", [1, 2])
def test_the_fused_grid_covers_every_row_and_source_once(platform, version):
    """The launched structure (read from the traced pallas_call) of each hardware variant: one program
    per (prompt, row tile, source tile, output-channel block[, inner-channel block on TPU]); the output
    padded to whole tiles by less than one tile; the source tile of the tap values the output's."""
    f = synthetic_factors(version)
    K, b, l, e = f.a.shape
    d = f.W_out.shape[1]
    rows = jnp.arange(0, 256, 3)  # 86 rows: a ragged last row block
    (call,) = lowering.pallas_grids(
        lambda f, rows: fused_layer_scores(f, "l2", rows, platform=platform, interpret=False), f, rows
    )
    (_, _, ti, tj), (ob, nd, rp, lp) = call["blocks"][-1], call["arrays"][-1]  # the output
    assert ob == b and rp % ti == 0 and lp % tj == 0
    assert 86 <= rp < 86 + ti and l <= lp < l + tj  # every row and source, less than a tile of padding
    assert call["grid"][:4] == (b, rp // ti, lp // tj, nd)
    taps = [
        blk
        for blk, arr in zip(call["blocks"], call["arrays"], strict=True)
        if arr in ((b, K, e, l), (b, K, l, e))
    ]
    assert taps, call
    if platform == "tpu":  # (K, e block, source tile): the inner channels are the grid's last axis
        (blk,) = taps
        assert blk[3] == tj and call["grid"][4] * blk[2] == e
    else:  # (K, source tile, all of e): the channels are walked inside the program
        (blk,) = taps
        assert blk[2] == tj and blk[3] == e and len(call["grid"]) == 4
    assert d % nd == 0


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
@pytest.mark.parametrize("platform", ["tpu", "gpu"])
def test_gradient_lowers_for_hardware(platform):
    """jax.value_and_grad through the fused kernel (forward on the hardware, backward = the blocked
    reference's rematerialised VJP) lowers for TPU and GPU."""
    f = synthetic_factors(2)
    rows = jnp.arange(0, 256, 3)

    def loss(f):
        return jnp.sum(
            fused_layer_scores(f, "l2", rows, platform=platform, interpret=False, reference=blocked_scores)
        )

    lower = lowering.lower_for_tpu if platform == "tpu" else lowering.lower_for_gpu
    try:
        text = lower(jax.value_and_grad(loss), f).as_text()
    except lowering.LoweringUnsupported as err:
        pytest.skip(str(err))
    # the forward's kernel on the hardware; the backward is the reference's XLA (no second kernel)
    assert hardware_calls(text) == [CUSTOM_CALL[platform]]


def test_alti_gain_is_accurate_relative_to_the_contribution():
    """|a| - |a - t| (ALTI's per-coordinate gain) within a few fp32 ulps of |t| for |a| up to 1e6 |t|:
    the exact value from float64, exactly s t where a and a - t share a sign, exactly 0 at t = 0. The
    direct fp32 form |a| - |a - t| fails the same bound (it loses |a| / |t| digits), so the bound
    tells the two apart."""
    from latim_jax.kernels.fused_scores_tiles import alti_gain

    rng = np.random.default_rng(0)
    n = 20000
    t = (rng.standard_normal(n) * 10.0 ** rng.uniform(-3, 1, n)).astype(np.float32)
    a = (rng.standard_normal(n) * np.abs(t) * 10.0 ** rng.uniform(-2, 6, n)).astype(np.float32)
    t[:100] = 0.0
    a64, t64 = a.astype(np.float64), t.astype(np.float64)
    exact = np.abs(a64) - np.abs(a64 - t64)  # float64: error <= 1e-16 |a| <= 1e-10 |t|
    got = np.asarray(alti_gain(jnp.asarray(a), jnp.asarray(t))).astype(np.float64)
    scale = np.maximum(np.abs(t64), np.finfo(np.float64).tiny)
    assert np.max(np.abs(got - exact)[100:] / scale[100:]) <= 4 * np.finfo(np.float32).eps
    assert np.all(got[:100] == 0.0)
    same = (a64 >= 0) == (a64 - t64 >= 0)
    np.testing.assert_array_equal(got[same], np.where(a64 >= 0, t64, -t64)[same])
    naive = (np.abs(a) - np.abs(a - t)).astype(np.float64)
    assert np.max(np.abs(naive - exact)[100:] / scale[100:]) > 1e-3
