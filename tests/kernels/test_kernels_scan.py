"""Pallas scan kernels (Mamba-1 selective scan, Mamba-2 SSD) against their pure-jnp references.

Interpret mode on CPU for both kernel variants ("tpu": chunked grid with the state in VMEM scratch;
"gpu": whole sequence per program, state as a fori_loop value), then the real TPU (Mosaic) and GPU
(Triton) lowerings from this CPU machine. Shapes are small and blocks few: interpret mode is slow.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import directional_fd

from latim_jax.kernels import lowering
from latim_jax.kernels.block_sizes import Blocks
from latim_jax.kernels.dispatch import selective_scan, ssd
from latim_jax.kernels.selective_scan import (
    GPU_MAX_CHUNK,
    selective_scan_pallas,
    selective_scan_reference,
    selective_scan_step_reference,
)
from latim_jax.kernels.ssd import ssd_pallas, ssd_reference, ssd_step_reference
from latim_jax.parallel.context import resolve

# Tolerances: max |kernel - reference| / max |reference|, per output. Both paths upcast the inputs to
# fp32 and compute in fp32 (measured: <= 4e-7 for fp32 and bf16 inputs alike); the bf16 bound is looser
# only as headroom, since bf16 inputs change the data, not the arithmetic. Gradients: each scan's
# backward is a Pallas kernel of its own (recomputing each chunk from a state the forward saved),
# compared with jax's differentiation of the reference (an independent path; measured <= 3e-7 for
# Mamba-1, <= 1.4e-6 for Mamba-2's dA, a sum over every step), and with central finite differences of
# the kernel (fp32, eps 1e-3: a directional derivative within 1e-2).
TOL = {
    ("forward", jnp.float32): 1e-5,
    ("forward", jnp.bfloat16): 5e-5,
    ("grad", jnp.float32): 1e-5,
    "fd": 1e-2,
}

VARIANTS = ("tpu", "gpu")  # kernel variants, both run in interpret mode here

# Mamba-1 interpret blocks: 8 time steps x 8 channels, so e = 16 gives two channel blocks.
SCAN_BLOCKS = Blocks(scan_block_l=8, scan_block_e=8)
SCAN_SHAPE = dict(b=2, e=16, n=8)
# Mamba-2 interpret blocks: chunks of 8 (TPU and GPU), GPU head-dim blocks of 4 (two per head).
SSD_BLOCKS = Blocks(ssd_chunk=8, ssd_block_p=4)
SSD_SHAPE = dict(b=2, h=4, p=8, n=8)

# (length, why): 1, a prime, exactly one block, several blocks with a ragged tail.
LENGTHS = [(1, "one step"), (13, "prime"), (8, "one block"), (21, "three blocks, ragged")]


def rel_err(x, ref) -> float:
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(x - ref)) / max(np.max(np.abs(ref)), 1e-30))


def _softplus(x):
    return np.log1p(np.exp(x))


def _normal(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def scan_inputs(l, *, b, e, n, dtype=jnp.float32, seed=0):
    """Random Mamba-1 inputs: (u, delta, A, B, C, D), initial state (b, e, n). numpy RNG: cheap."""
    rng = np.random.default_rng(seed)
    u, delta = _normal(rng, b, l, e), _softplus(_normal(rng, b, l, e) - 1.0)
    A = -np.exp(0.5 * _normal(rng, e, n))
    B, C, D, h0 = _normal(rng, b, l, n), _normal(rng, b, l, n), _normal(rng, e), _normal(rng, b, e, n)
    cast = lambda t: jnp.asarray(t, dtype)
    return (cast(u), cast(delta), jnp.asarray(A), cast(B), cast(C), jnp.asarray(D)), jnp.asarray(h0)


def ssd_inputs(l, *, b, h, p, n, g, dtype=jnp.float32, seed=0):
    """Random Mamba-2 inputs: (x, dt, A, B, C, D), initial state (b, h, p, n)."""
    rng = np.random.default_rng(seed)
    x, dt = _normal(rng, b, l, h, p), _softplus(_normal(rng, b, l, h) - 1.0)
    A = -np.exp(0.5 * _normal(rng, h))
    B, C = _normal(rng, b, l, g, n), _normal(rng, b, l, g, n)
    D, h0 = _normal(rng, h), _normal(rng, b, h, p, n)
    cast = lambda t: jnp.asarray(t, dtype)
    return (cast(x), cast(dt), jnp.asarray(A), cast(B), cast(C), jnp.asarray(D)), jnp.asarray(h0)


# jitted references: eager op-by-op dispatch of the references costs more than the kernels here
scan_reference = jax.jit(selective_scan_reference)
ssd_reference_8 = jax.jit(functools.partial(ssd_reference, chunk_size=8))


# One jitted kernel per variant for the whole module, so equal shapes compile once across tests.
@functools.cache
def scan_kernel(variant):
    kernel = functools.partial(
        selective_scan_pallas, block_sizes=SCAN_BLOCKS, platform=variant, interpret=True
    )
    return jax.jit(kernel)


@functools.cache
def ssd_kernel(variant):
    kernel = functools.partial(
        ssd_pallas, chunk_size=8, block_sizes=SSD_BLOCKS, platform=variant, interpret=True
    )
    return jax.jit(kernel)


def assert_close(out, ref, tol):
    for name, x, r in zip(("y", "final_state"), out, ref, strict=True):
        assert x.shape == r.shape and x.dtype == r.dtype == jnp.float32, name
        assert rel_err(x, r) <= tol, f"{name}: rel err {rel_err(x, r):.2e} > {tol:.0e}"


# --------------------------------------------------------------------------------------------------
# The chunked references == the one-step recurrence (what the kernels are checked against rests on this)
# --------------------------------------------------------------------------------------------------


def _recurrence(step, state, xs):
    """Run ``step(state, *x_t)`` over the time axis 1 of every array in ``xs``; (y (b, l, ...), state)."""
    state, ys = jax.lax.scan(lambda s, x: step(s, *x)[::-1], state, [jnp.moveaxis(x, 1, 0) for x in xs])
    return jnp.moveaxis(ys, 0, 1), state


@pytest.mark.parametrize(("l", "chunk"), [(1, 8), (13, 4), (21, 8), (16, 16)])
def test_scan_reference_matches_recurrence(l, chunk):
    (u, delta, A, B, C, D), h0 = scan_inputs(l, **SCAN_SHAPE)
    step = lambda s, u_t, d_t, B_t, C_t: selective_scan_step_reference(s, u_t, d_t, A, B_t, C_t, D)
    expect = _recurrence(step, h0, (u, delta, B, C))
    got = selective_scan_reference(u, delta, A, B, C, D, h0, chunk=chunk)
    assert_close(got, expect, TOL["forward", jnp.float32])


@pytest.mark.parametrize(("l", "chunk", "g"), [(1, 8, 1), (13, 4, 2), (21, 8, 4), (16, 16, 1)])
def test_ssd_reference_matches_recurrence(l, chunk, g):
    """Heads share their group's B and C (g < h); chunk lengths that divide l and that do not."""
    (x, dt, A, B, C, D), h0 = ssd_inputs(l, **SSD_SHAPE, g=g)
    step = lambda s, x_t, dt_t, B_t, C_t: ssd_step_reference(s, x_t, dt_t, A, B_t, C_t, D)
    expect = _recurrence(step, h0, (x, dt, B, C))
    got = ssd_reference(x, dt, A, B, C, D, chunk, initial_state=h0)
    assert_close(got, expect, TOL["forward", jnp.float32])


# --------------------------------------------------------------------------------------------------
# Interpret-mode kernel == reference
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("l", [l for l, _ in LENGTHS])
def test_scan_kernel_matches_reference(variant, l):
    args, h0 = scan_inputs(l, **SCAN_SHAPE)
    init = h0 if l == 21 else None  # the several-blocks case also seeds the carried state
    out = scan_kernel(variant)(*args, initial_state=init)
    assert_close(out, scan_reference(*args, init), TOL["forward", jnp.float32])


@pytest.mark.parametrize("variant", VARIANTS)
def test_scan_kernel_bf16_inputs(variant):
    args, _ = scan_inputs(13, **SCAN_SHAPE, dtype=jnp.bfloat16)
    out = scan_kernel(variant)(*args)
    assert_close(out, scan_reference(*args), TOL["forward", jnp.bfloat16])


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(("l", "g"), [(1, 1), (13, 2), (8, 2), (21, 1)])
def test_ssd_kernel_matches_reference(variant, l, g):
    args, h0 = ssd_inputs(l, **SSD_SHAPE, g=g)
    init = h0 if l == 21 else None
    out = ssd_kernel(variant)(*args, initial_state=init)
    assert_close(out, ssd_reference_8(*args, initial_state=init), TOL["forward", jnp.float32])


@pytest.mark.parametrize("variant", VARIANTS)
def test_ssd_kernel_bf16_inputs(variant):
    args, _ = ssd_inputs(13, **SSD_SHAPE, g=2, dtype=jnp.bfloat16)
    out = ssd_kernel(variant)(*args)
    assert_close(out, ssd_reference_8(*args), TOL["forward", jnp.bfloat16])


def test_ssd_kernel_chunk_differs_from_call_chunk():
    """The kernel chunk (block_sizes.ssd_chunk) need not equal the caller's chunk_size."""
    args, _ = ssd_inputs(21, **SSD_SHAPE, g=1)
    kernel = functools.partial(
        ssd_pallas, chunk_size=64, block_sizes=Blocks(ssd_chunk=16), platform="tpu", interpret=True
    )
    out = jax.jit(kernel)(*args)
    assert_close(out, ssd_reference_8(*args), TOL["forward", jnp.float32])


# --------------------------------------------------------------------------------------------------
# vmap over a leading prompt axis == python loop; grad through the custom_jvp == grad of the reference
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_scan_vmap_equals_loop(variant):
    prompts = [scan_inputs(13, **SCAN_SHAPE, seed=s)[0] for s in range(3)]
    stacked = [jnp.stack(parts) for parts in zip(*prompts, strict=True)]
    kernel = scan_kernel(variant)
    batched = jax.vmap(kernel)(*stacked)
    looped = [jnp.stack(parts) for parts in zip(*(kernel(*a) for a in prompts), strict=True)]
    assert_close(batched, looped, TOL["forward", jnp.float32])
    assert not np.allclose(batched[0][0], batched[0][1])  # the prompts differ


@pytest.mark.parametrize("variant", VARIANTS)
def test_ssd_vmap_equals_loop(variant):
    prompts = [ssd_inputs(13, **SSD_SHAPE, g=2, seed=s)[0] for s in range(3)]
    stacked = [jnp.stack(parts) for parts in zip(*prompts, strict=True)]
    kernel = ssd_kernel(variant)
    batched = jax.vmap(kernel)(*stacked)
    looped = [jnp.stack(parts) for parts in zip(*(kernel(*a) for a in prompts), strict=True)]
    assert_close(batched, looped, TOL["forward", jnp.float32])
    assert not np.allclose(batched[0][0], batched[0][1])


def _loss(fn, weights):
    """Scalar loss of every output, so each input's gradient is exercised."""
    wy, wh = weights

    def loss(*args):
        y, final_state = fn(*args)
        return jnp.sum(y * wy) + jnp.sum(final_state * wh)

    return loss


def _assert_grads_close(grads, ref_grads):
    for i, (g, r) in enumerate(zip(grads, ref_grads, strict=True)):
        assert g.shape == r.shape and g.dtype == r.dtype, i
        assert rel_err(g, r) <= TOL["grad", jnp.float32], f"arg {i}: {rel_err(g, r):.2e}"
        assert np.any(np.asarray(r) != 0), i


# (variant, with initial state, length): each variant with and without a state to start from; the
# Mamba-1 backward walks one chunk (5 steps) and three chunks with a ragged tail (21 steps of 8).
GRAD_CASES = [("tpu", True, 21), ("gpu", False, 5), ("gpu", True, 21)]
SSD_GRAD_CASES = [("tpu", True, 21), ("gpu", False, 5), ("gpu", True, 21)]  # chunks of 8, g = 2


def _grad_check(kernel, reference, args, h0, with_init):
    """jax.grad of a weighted sum of (y, final_state) w.r.t. every input, kernel vs reference."""
    if with_init:
        args = (*args, h0)
        kernel_fn = lambda *a: kernel(*a[:6], initial_state=a[6])
        reference_fn = lambda *a: reference(*a[:6], initial_state=a[6])
    else:
        kernel_fn, reference_fn = kernel, reference
    ref = reference_fn(*args)
    weights = [_normal(np.random.default_rng(9 + i), *t.shape) for i, t in enumerate(ref)]
    argnums = tuple(range(len(args)))
    grads = jax.jit(jax.grad(_loss(kernel_fn, weights), argnums))(*args)
    _assert_grads_close(grads, jax.jit(jax.grad(_loss(reference_fn, weights), argnums))(*args))
    analytic, numeric = directional_fd(jax.jit(_loss(kernel_fn, weights)), args, eps=1e-3)
    assert abs(analytic - numeric) <= TOL["fd"] * abs(numeric), (analytic, numeric)


@pytest.mark.parametrize(("variant", "with_init", "l"), GRAD_CASES)
def test_scan_grad_matches_reference(variant, with_init, l):
    args, h0 = scan_inputs(l, **SCAN_SHAPE)
    _grad_check(scan_kernel(variant), scan_reference, args, h0, with_init)


@pytest.mark.parametrize("kernel", ["scan", "ssd"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_backward_kernel_differentiates_again_and_vmaps(variant, kernel):
    """The gradient through a backward kernel is itself differentiable (a Hessian-vector product, as
    grad x input scores need) and batches under vmap; forward mode stops with JAX's custom_vjp error."""
    if kernel == "scan":
        make, fn, reference = (
            functools.partial(scan_inputs, **SCAN_SHAPE),
            scan_kernel(variant),
            scan_reference,
        )
    else:
        make = functools.partial(ssd_inputs, **SSD_SHAPE, g=2)
        fn, reference = ssd_kernel(variant), ssd_reference_8
    args, h0 = make(13)
    args = (*args, h0)
    rng = np.random.default_rng(3)
    weights = [_normal(rng, *args[0].shape) for _ in range(2)]

    def loss(f):
        return lambda *a: jnp.sum(jnp.sin(f(*a[:6], initial_state=a[6])[0]) * weights[0])

    def hvp(f):  # d/d(x, A) of <grad wrt delta, v>: reverse over reverse through the backward
        inner = jax.grad(loss(f), argnums=0)
        return jax.jit(jax.grad(lambda *a: jnp.vdot(inner(*a), weights[1]), argnums=(1, 2)))(*args)

    _assert_grads_close(hvp(fn), hvp(reference))
    prompts = [(*make(13, seed=s)[0], h0) for s in range(2)]
    stacked = [jnp.stack(parts) for parts in zip(*prompts, strict=True)]
    grad = jax.grad(loss(fn), argnums=(0, 1, 3))
    batched = jax.jit(jax.vmap(grad))(*stacked)
    looped = [jnp.stack(p) for p in zip(*(jax.jit(grad)(*a) for a in prompts), strict=True)]
    _assert_grads_close(batched, looped)
    assert not np.allclose(batched[0][0], batched[0][1])  # the prompts differ
    with pytest.raises(TypeError, match="custom_vjp"):
        jax.jvp(loss(fn), args, tuple(jnp.ones_like(a) for a in args))


@pytest.mark.parametrize(("variant", "with_init", "l"), SSD_GRAD_CASES)
def test_ssd_grad_matches_reference(variant, with_init, l):
    args, h0 = ssd_inputs(l, **SSD_SHAPE, g=2)
    _grad_check(ssd_kernel(variant), ssd_reference_8, args, h0, with_init)


# --------------------------------------------------------------------------------------------------
# Dispatcher and block sizes
# --------------------------------------------------------------------------------------------------


def _has_pallas_call(fn, *args) -> bool:
    return "pallas_call" in str(jax.make_jaxpr(fn)(*args))


def test_dispatch_routes():
    """xla -> reference, auto -> reference on CPU, pallas -> kernel (interpret mode on CPU)."""
    args, h0 = scan_inputs(13, **SCAN_SHAPE)
    sargs, s0 = ssd_inputs(13, **SSD_SHAPE, g=2)
    for impl, expect in (("xla", False), ("auto", jax.default_backend() != "cpu"), ("pallas", True)):
        ctx = resolve(impl)
        assert _has_pallas_call(functools.partial(selective_scan, ctx=ctx), *args, h0) is expect, impl
        ssd_fn = lambda *a, ctx=ctx: ssd(*a[:6], 8, a[6], ctx=ctx)
        assert _has_pallas_call(ssd_fn, *sargs, s0) is expect, impl
    with pytest.raises(ValueError, match="impl"):
        resolve("triton")

    kernels = resolve("pallas")
    pallas = jax.jit(functools.partial(selective_scan, ctx=kernels, block_sizes=SCAN_BLOCKS))
    assert_close(pallas(*args, h0), scan_reference(*args, h0), TOL["forward", jnp.float32])
    pallas = jax.jit(functools.partial(ssd, chunk_size=8, ctx=kernels, block_sizes=SSD_BLOCKS))
    sref = ssd_reference_8(*sargs, initial_state=s0)
    assert_close(pallas(*sargs, initial_state=s0), sref, TOL["forward", jnp.float32])


def test_block_sizes():
    tpu, gpu, cpu = (Blocks.for_platform(p) for p in ("tpu", "gpu", "cpu"))
    assert tpu.scan_block_l % 128 == 0 and tpu.scan_block_e % 128 == 0 and tpu.ssd_chunk % 8 == 0
    assert all(v & (v - 1) == 0 for v in (gpu.scan_block_e, gpu.ssd_chunk, gpu.ssd_block_p))
    assert Blocks.for_platform("cuda") == gpu and cpu.ssd_chunk is None
    with pytest.raises(dataclasses_frozen_error()):
        tpu.scan_block_l = 8
    with pytest.raises(ValueError):
        Blocks(scan_block_l=0)
    with pytest.raises(ValueError):
        Blocks.for_platform("metal")
    with pytest.raises(ValueError, match="positive int"):
        Blocks(rows=True)
    # None fields take the running path's defaults; set fields are kept
    mine = Blocks(rows=3, scan_block_e=64).over(tpu)
    assert (mine.rows, mine.scan_block_e, mine.cols, mine.ssd_chunk) == (3, 64, tpu.cols, tpu.ssd_chunk)
    assert Blocks.for_layer(2, 4096) == Blocks(
        rows=64,
        cols=64,
        m1_direct_rows=32,
        m1_tangent_rows=16,
        m1_state_group=2,
        m1_few_rows=4,
        tangent_rows=16,
    )
    assert Blocks.for_layer(1, 4096).tangent_rows is None
    one_row = Blocks.for_layer(1, 4096, n_rows=1)
    assert (one_row.rows, one_row.cols) == (1, 1024)


def dataclasses_frozen_error():
    import dataclasses

    return dataclasses.FrozenInstanceError


# --------------------------------------------------------------------------------------------------
# Lowering for the real backends from this CPU machine (Mosaic for TPU, Triton for GPU)
# --------------------------------------------------------------------------------------------------

LOWER_BLOCKS = Blocks(scan_block_l=128, scan_block_e=128, ssd_chunk=64, ssd_block_p=32)
CUSTOM_CALL = {"tpu": "tpu_custom_call", "gpu": "__gpu$xla.gpu.triton"}  # the custom_call target


def hardware_calls(text: str) -> list[str]:
    """The custom_call targets of a lowered module's text, in order."""
    return re.findall(r"custom_call @([\w$.]+)", text)


def _lower(platform, fn, args):
    lower = lowering.lower_for_tpu if platform == "tpu" else lowering.lower_for_gpu
    try:
        return lower(fn, *args).as_text()
    except lowering.LoweringUnsupported as err:
        pytest.skip(str(err))


def _lowering_case(kernel, vmapped):
    """(fn, ShapeDtypeStruct args): several l-chunks, channel/head blocks and groups, bf16 B."""
    S = jax.ShapeDtypeStruct
    f32, bf16 = jnp.float32, jnp.bfloat16
    if kernel == "scan":
        b, l, e, n = 2, 300, 256, 16
        shapes = [
            ((b, l, e), f32),
            ((b, l, e), f32),
            ((e, n), f32),
            ((b, l, n), bf16),
            ((b, l, n), f32),
            ((e,), f32),
        ]
        fn = selective_scan_pallas
    else:
        b, l, h, p, g, n = 2, 300, 4, 64, 2, 32
        shapes = [
            ((b, l, h, p), f32),
            ((b, l, h), f32),
            ((h,), f32),
            ((b, l, g, n), bf16),
            ((b, l, g, n), f32),
            ((h,), f32),
        ]
        fn = ssd_pallas
    if vmapped:
        shapes = [((3, *s), d) for s, d in shapes]
    return fn, [S(s, d) for s, d in shapes]


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
@pytest.mark.parametrize("vmapped", [False, True], ids=["plain", "vmap"])
@pytest.mark.parametrize("kernel", ["scan", "ssd"])
@pytest.mark.parametrize("platform", ["tpu", "gpu"])
def test_lowers(platform, kernel, vmapped):
    fn, args = _lowering_case(kernel, vmapped)
    fn = functools.partial(fn, block_sizes=LOWER_BLOCKS, platform=platform, interpret=False)
    """Every pallas_call the function traces (one here) lowers to one hardware kernel call, and nothing
    else does: a kernel left in interpret mode or lowered to another target fails."""
    fn = jax.vmap(fn) if vmapped else fn
    text = _lower(platform, fn, args)
    assert hardware_calls(text) == [CUSTOM_CALL[platform]] * len(lowering.pallas_grids(fn, *args))


@pytest.mark.parametrize("kernel", ["scan", "ssd"])
@pytest.mark.parametrize("platform", ["tpu", "gpu"])
def test_each_variant_launches_the_grid_its_blocks_imply(platform, kernel):
    """The structure each hardware variant launches (read from the traced pallas_call): one program per
    (batch, channel or head block, sequence block) on TPU, the sequence walked inside each program on
    GPU; blocks of the asked sizes; every input position inside the padded arrays the grid covers. Its
    gradient launches the forward once (saving its checkpoints) and the backward kernel on the same
    grid."""
    fn, args = _lowering_case(kernel, False)
    fn = functools.partial(fn, block_sizes=LOWER_BLOCKS, platform=platform, interpret=False)
    (call,) = lowering.pallas_grids(fn, *args)
    ceil = lambda a, b: -(-a // b)  # noqa: E731
    B = LOWER_BLOCKS
    if kernel == "scan":
        b, l, e = 2, 300, 256
        if platform == "tpu":
            want_grid = (b, e // B.scan_block_e, ceil(l, B.scan_block_l))
            want = ((None, B.scan_block_l, B.scan_block_e), (b, want_grid[2] * B.scan_block_l, e))
        else:
            want_grid = (b, e // B.scan_block_e)  # the sequence padded to whole checkpoint chunks
            lp = ceil(l, min(B.scan_block_l, GPU_MAX_CHUNK)) * min(B.scan_block_l, GPU_MAX_CHUNK)
            want = ((None, lp, B.scan_block_e), (b, lp, e))
    else:
        b, l, h, p = 2, 300, 4, 64
        lp = ceil(l, B.ssd_chunk) * B.ssd_chunk  # the sequence padded to whole chunks
        if platform == "tpu":  # a program per chunk, the whole head dim
            want_grid = (b, h, lp // B.ssd_chunk)
            want = ((None, None, B.ssd_chunk, p), (b, h, lp, p))
        else:  # a program per head dim block, the chunks walked inside
            want_grid = (b, h, p // B.ssd_block_p)
            want = ((None, lp, None, B.ssd_block_p), (b, lp, h, p))
    assert call["grid"] == want_grid, call["grid"]
    assert want in list(zip(call["blocks"], call["arrays"], strict=True)), (want, call["blocks"])

    def loss(*a):
        y, state = fn(*a)
        return jnp.sum(y * y) + jnp.sum(state)

    grads = lowering.pallas_grids(jax.value_and_grad(loss, argnums=(0, 1, 4)), *args)
    assert [c["grid"] for c in grads] == [want_grid] * 2
    # the forward saves one state per chunk (its checkpoint output); the backward reads them back
    if kernel == "scan":
        gpu_chunk = min(B.scan_block_l, GPU_MAX_CHUNK)  # the GPU checkpoint spacing, capped
        chunks = want_grid[2] if platform == "tpu" else ceil(l, gpu_chunk)
        width = B.scan_block_e
        block = (None, chunks, 16, width) if platform == "gpu" else (None, None, 16, width)
        saved = (block, (b, chunks, 16, e))
    else:
        chunks, n = lp // B.ssd_chunk, 32
        block = (None, None, chunks, B.ssd_block_p, n) if platform == "gpu" else (None, None, None, p, n)
        saved = (block, (b, h, chunks, p, n))
    for call in grads:
        assert saved in list(zip(call["blocks"], call["arrays"], strict=True)), (saved, call["blocks"])
    assert grads[1]["name"] == f"_{kernel}_bwd_kernel_{platform}"


def test_tpu_lowering_rejects_misaligned_blocks():
    fn, args = _lowering_case("scan", False)
    fn = functools.partial(fn, block_sizes=Blocks(scan_block_l=100), platform="tpu", interpret=False)
    with pytest.raises(ValueError, match="multiple of 128"):
        _lower("tpu", fn, args)


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
@pytest.mark.parametrize("kernel", ["scan", "ssd"])
@pytest.mark.parametrize("platform", ["tpu", "gpu"])
def test_gradient_lowers(platform, kernel):
    """The backward kernel lowers for the hardware together with the forward kernel it differentiates."""
    fn, args = _lowering_case(kernel, False)
    fn = functools.partial(fn, block_sizes=LOWER_BLOCKS, platform=platform, interpret=False)

    def loss(*a):
        y, state = fn(*a)
        return jnp.sum(y * y) + jnp.sum(state)

    text = _lower(platform, jax.value_and_grad(loss, argnums=(0, 1, 4)), args)
    assert text.count(CUSTOM_CALL[platform]) >= 2
