"""The delta rule's M-tile Pallas kernel (kernels/delta_rule_tiles.py) against the XLA scan it replaces
(:func:`latim_jax.kernels.delta_rule.m_tile`, itself checked against M's definition in float64 by
tests/latim/test_delta_rule.py).

Interpret mode on CPU for both variants ("tpu": chunk grid axis with Y in VMEM scratch; "gpu": a loop
over chunks per program), for a decay per head (gdn) and per key channel (kda); then differentiation,
vmap, the dispatch through the execution context, the TPU VMEM guard, and the real TPU (Mosaic) and GPU
(Triton) lowerings from this CPU machine. Shapes are small: interpret mode is slow.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import rel_err

import latim_jax
from latim_jax.kernels import delta_rule, dispatch, lowering, vmem
from latim_jax.kernels.block_sizes import Blocks
from latim_jax.kernels.delta_rule_tiles import m_tile_pallas, tpu_blocks
from latim_jax.latim.kinds import layer_factors
from latim_jax.model.init import init_params
from latim_jax.parallel.chips import TPU_CHIPS, MiB
from latim_jax.parallel.context import XLA, Context

# Tolerances: max |kernel - XLA| / max |XLA|. The kernel runs the scan's products with one-hot
# selections at HIGHEST precision (exact), so in interpret mode it matches to rounding order (measured:
# 0 for both variants); gradients are the XLA reference's own, rematerialised.
TOL = {"forward": 1e-5, "grad": 1e-5, "e2e": 2e-5}
VARIANTS = ("tpu", "gpu")
KINDS = ("gdn", "kda")  # a decay per head (b, l, H) or per key channel (b, l, H, k)
CHUNK, LENGTH = 8, 37  # 37 = 4 chunks and 5 positions: a padded last chunk
# Width tiles below the default so that a tile spans several programs (128: two TPU programs at
# width 140; 16: three GPU programs at width 40).
WIDTH_TILE = {"tpu": 128, "gpu": 16}

# (rows, c0, width, why): rows in any order, repeated; columns straddling chunks and past the end.
CASES = [
    ([36, 3, 20, 36, 9], 5, 40, "rows unordered with a repeat, c0 mid-chunk, columns past the end"),
    ([36], 14, 23, "the last row alone, c0 straddling chunks 1 and 2"),
    ([10, 2], 15, 9, "a tile above the diagonal: zeros"),
    ([30, 31], 24, 140, "two width tiles, c0 at a chunk start, mostly past the end"),
]


def tile_factors(kind: str, *, b=2, length=LENGTH, heads=2, dk=8, seed=0):
    """TileFactors of random q, k (normalised), g <= 0 (small: M reaches across chunks), beta in (0, 2)."""
    rng = np.random.default_rng(seed)
    q, k = rng.normal(size=(2, b, length, heads, dk))
    q = q / np.linalg.norm(q, axis=-1, keepdims=True) / np.sqrt(dk)
    k = k / np.linalg.norm(k, axis=-1, keepdims=True)
    g = -0.1 * rng.uniform(0.01, 0.7, size=(b, length, heads, dk) if kind == "kda" else (b, length, heads))
    beta = 2.0 * rng.uniform(0.05, 0.95, size=(b, length, heads))
    args = [jnp.asarray(x, jnp.float32) for x in (q, k, g, beta)]
    return args, delta_rule.tile_factors(*args, CHUNK)


@functools.cache
def kernel(variant: str, width: int):
    """The interpret-mode kernel jitted with rows and c0 traced (as the score loop calls it)."""
    fn = functools.partial(
        m_tile_pallas, width=width, platform=variant, interpret=True, width_tile=WIDTH_TILE[variant]
    )
    return jax.jit(lambda f, rows, c0: fn(f, rows, c0))


reference = jax.jit(delta_rule.m_tile, static_argnums=3)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_kernel_equals_the_xla_tiles(variant, kind):
    _, tf = tile_factors(kind)
    for rows, c0, width, why in CASES:
        rows, c0 = jnp.asarray(rows, jnp.int32), jnp.int32(c0)
        want = reference(tf, rows, c0, width)
        got = kernel(variant, width)(tf, rows, c0)
        assert got.shape == want.shape == (2, 2, rows.shape[0], width), why
        assert rel_err(got, want) <= TOL["forward"] if np.abs(want).max() else not np.asarray(got).any(), why
        above = np.asarray(rows)[:, None] < int(c0) + np.arange(width)[None, :]
        assert not np.asarray(got)[:, :, above].any(), why  # causal, exactly
        assert np.asarray(got)[:, :, ~above].any() or not (~above).any(), why


@pytest.mark.parametrize("variant", VARIANTS)
def test_one_compile_serves_every_traced_first_column(variant):
    """Under jit with c0 and rows traced, every c0 (each chunk offset, past the end, the whole map's
    first column) gives the XLA tile, with one compile."""
    _, tf = tile_factors("gdn", b=1)
    fn = kernel(variant, 12)
    rows = jnp.asarray([36, 17, 8, 25], jnp.int32)
    for c0 in (0, 3, 7, 8, 19, 31, 36, 40):
        want = reference(tf, rows, jnp.int32(c0), 12)
        assert rel_err(fn(tf, rows, jnp.int32(c0)), want) <= TOL["forward"] or not np.abs(want).max(), c0
    assert fn._cache_size() == 1


@pytest.mark.parametrize("kind", KINDS)
def test_grad_and_jvp_through_the_kernel_equal_the_xla_paths(kind):
    """Reverse and forward mode through q, k, g, beta -> tile factors -> the kernel equal those through
    the XLA tiles (the kernel's derivative is the reference's)."""
    args, _ = tile_factors(kind, b=1)
    rows, c0 = jnp.asarray([36, 9, 20], jnp.int32), jnp.int32(5)
    weights = jnp.asarray(np.random.default_rng(1).normal(size=(1, 2, 3, 20)), jnp.float32)

    def loss(tiles):
        return lambda args: jnp.sum(weights * tiles(delta_rule.tile_factors(*args, CHUNK), rows, c0))

    pallas = loss(lambda f, r, c: m_tile_pallas(f, r, c, 20, platform="tpu", interpret=True))
    xla = loss(lambda f, r, c: delta_rule.m_tile(f, r, c, 20))
    got, want = jax.jit(jax.grad(pallas))(args), jax.jit(jax.grad(xla))(args)
    for name, x, r in zip("qkgb", got, want, strict=True):
        assert np.abs(r).max() > 0 and rel_err(x, r) <= TOL["grad"], name
    direction = [jnp.asarray(np.random.default_rng(2).normal(size=x.shape), jnp.float32) for x in args]
    (_, jvp_got), (_, jvp_want) = jax.jvp(pallas, (args,), (direction,)), jax.jvp(xla, (args,), (direction,))
    assert abs(float(jvp_got - jvp_want)) <= TOL["grad"] * abs(float(jvp_want)), (jvp_got, jvp_want)


@pytest.mark.parametrize("variant", VARIANTS)
def test_vmap_equals_loop(variant):
    """vmap over prompts' factors (shared rows and c0: a batch grid axis) and over c0 (a batched
    scalar-prefetch operand) equal a Python loop of single calls."""
    _, tf = tile_factors("kda", b=1)
    stacked = jax.tree.map(lambda *x: jnp.stack(x), tf, tile_factors("kda", b=1, seed=3)[1])
    rows = jnp.asarray([36, 3, 20], jnp.int32)
    one = functools.partial(m_tile_pallas, width=30, platform=variant, interpret=True)
    got = jax.jit(jax.vmap(lambda f: one(f, rows, 4)))(stacked)
    loop = [one(jax.tree.map(lambda x, i=i: x[i], stacked), rows, 4) for i in range(2)]
    np.testing.assert_array_equal(got, np.stack(loop))
    c0s = jnp.asarray([0, 9, 30], jnp.int32)
    got = jax.jit(jax.vmap(lambda c: one(tf, rows, c)))(c0s)
    np.testing.assert_array_equal(got, np.stack([one(tf, rows, c) for c in c0s]))


def test_the_execution_context_picks_the_kernel():
    """The dispatcher runs the XLA scan without kernels and the Pallas kernel with them (a pallas_call in
    the traced program, interpret mode taken from the context's platform), equal values."""
    _, tf = tile_factors("gdn", b=1)
    rows = jnp.asarray([36, 12], jnp.int32)
    run = lambda ctx: lambda f: dispatch.delta_rule_m_tile(f, rows, 3, 20, ctx=ctx)  # noqa: E731
    pallas = Context(kernels=True, platform="cpu")
    assert lowering.pallas_grids(run(XLA), tf) == []
    (call,) = lowering.pallas_grids(run(pallas), tf)
    assert call["name"] == "_kernel_tpu"
    assert rel_err(run(pallas)(tf), run(XLA)(tf)) <= TOL["forward"]


def test_attribution_with_pallas_equals_xla_on_a_gdn_hybrid():
    """A gdn layer's factors built under impl="pallas" take their M tiles (pair values, attention map)
    from the kernel (interpret mode), those built under impl="xla" from the scan; impl="pallas" equals
    impl="xla" end to end (l2 scores and the hidden-attention baseline)."""
    section = dict(k_heads=2, v_heads=4, k_dim=8, v_dim=6, chunk=8, conv_bias=True)
    config = latim_jax.MambaConfig(
        version=2, d_model=16, n_layers=2, vocab_size=40, d_state=4, head_dim=8, chunk_size=8,
        layer_kinds=("gdn", "mlp"), mlp_width=24, mlp_gated=True, sections={"gdn": section},
    )  # fmt: skip
    model = latim_jax.MambaLM(config, init_params(config, 1))
    tokens = np.random.default_rng(0).integers(0, 40, (2, 13))
    h = model.forward(tokens).residuals[0]
    rows = jnp.asarray([12, 4])
    for impl, kernels in (("pallas", 1), ("xla", 0)):
        f = layer_factors(model, h, 0, impl=impl)
        blocks = f.tiles(None, None)
        assert len(lowering.pallas_grids(lambda f, b=blocks: f.pair_values(rows, 0, 13, b), f)) == kernels
        assert len(lowering.pallas_grids(lambda f: f.attention_map(rows, 0, 13), f)) == kernels
    # built for a TPU, the score tiles' Blocks.vmem_limit_bytes is the scoped limit the kernel passes
    f = dataclasses.replace(f, ctx=Context(kernels=True, platform="tpu", chip="v5e"))
    blocks = f.tiles(None, Blocks(vmem_limit_bytes=40 * MiB))
    (call,) = lowering.pallas_grids(lambda f: f.pair_values(rows, 0, 13, blocks), f)
    assert call["vmem_limit_bytes"] == 40 * MiB
    for method in ("l2", "hidden_attention"):
        x = latim_jax.attribute(model, tokens, method=method, impl="xla", layers=[0])
        p = latim_jax.attribute(model, tokens, method=method, impl="pallas", layers=[0])
        assert np.abs(np.asarray(x.scores)).max() > 0
        assert rel_err(p.scores, x.scores) <= TOL["e2e"], method


# --------------------------------------------------------------------------------------------------
# The TPU VMEM guard and the real lowerings (Mosaic for TPU, Triton for GPU) from this CPU machine
# --------------------------------------------------------------------------------------------------

S = jax.ShapeDtypeStruct
CUSTOM_CALL = {"tpu": "tpu_custom_call", "gpu": "__gpu$xla.gpu.triton"}  # the custom_call target


def abstract_factors(*, b=1, length=4096, heads=2, C=64, k=128):
    """TileFactors of ShapeDtypeStructs at Qwen3-Next's gdn widths (chunk 64, key dim 128)."""
    n = -(-length // C)
    f = lambda *s: S((b, n, heads, *s), jnp.float32)  # noqa: E731
    return delta_rule.TileFactors(f(C, C), f(k, C), f(C, k), f(k, k))


def tpu_tile(rows: int, width: int, chip: str, **kw):
    fn = functools.partial(m_tile_pallas, width=width, platform="tpu", interpret=False, chip=chip, **kw)
    return lambda f, r, c: fn(f, r, c), (abstract_factors(), S((rows,), jnp.int32), S((), jnp.int32))


def test_a_tile_over_the_chips_vmem_is_refused_naming_the_chip_and_a_tile_that_fits():
    """4096 rows x 512 columns: an (4096, 512) fp32 output block, double-buffered, 16 MiB: over v4's 16
    MiB; v5e's 112 MiB limit holds it. The refusal names the kernel, the tile, the chip and its limit,
    and the tile it names traces."""
    fn, args = tpu_tile(4096, 512, "v4")
    with pytest.raises(vmem.VmemOverflow) as err:
        jax.eval_shape(fn, *args)
    text = str(err.value)
    for part in ("delta-rule M tile kernel", "4096 rows x 512 columns", "TPU v4", "16.0 MiB"):
        assert part in text, (part, text)
    rows, cols = map(int, re.search(r"fits: (\d+) rows x (\d+) columns", text).groups())
    assert rows * cols < 4096 * 512
    fn, args = tpu_tile(rows, cols, "v4", width_tile=cols)
    jax.eval_shape(fn, *args)
    jax.eval_shape(*(lambda f, a: (f, *a))(*tpu_tile(4096, 512, "v5e")))
    with pytest.raises(vmem.VmemOverflow, match="unknown TPU generation"):
        jax.eval_shape(*(lambda f, a: (f, *a))(*tpu_tile(4096, 512, None)))


def test_the_budget_counts_what_the_pallas_call_declares():
    """The guard's blocks and scratch are the pallas_call's (so it cannot drift from the kernel), at the
    chip's scoped limit; one program per (prompt, head, width tile, chunk)."""
    fn, args = tpu_tile(64, 67, "v6e")
    (call,) = lowering.pallas_grids(fn, *args)
    ins, out, scratch, _ = tpu_blocks(64, 128, 64, 128)  # chunk 64 and key dim 128 unpadded
    padded = lambda shapes: sum(vmem.padded_bytes(s) for s in shapes)  # noqa: E731
    assert padded(call["blocks"]) == padded([*ins, out]) and call["scratch"] == scratch
    assert call["vmem_limit_bytes"] == TPU_CHIPS["v6e"].vmem_limit_bytes
    assert call["grid"] == (1, 2, 1, 64)
    assert call["arrays"][1:5] == [x.shape for x in args[0]]  # the factors themselves: no padded copy
    # the guard refuses exactly the limits below what the call declares (plus its temporaries)
    need = vmem.need(call["blocks"], call["scratch"], tpu_blocks(64, 128, 64, 128)[3]).total + vmem.RESERVE
    fn, args = tpu_tile(64, 67, "v6e", vmem_limit_bytes=need)
    jax.eval_shape(fn, *args)
    fn, args = tpu_tile(64, 67, "v6e", vmem_limit_bytes=need - 1)
    with pytest.raises(vmem.VmemOverflow):
        jax.eval_shape(fn, *args)


def hardware_calls(text: str) -> list[str]:
    """The custom_call targets of a lowered module's text, in order."""
    return re.findall(r"custom_call @([\w$.]+)", text)


def _lower(platform, fn, *args):
    lower = lowering.lower_for_tpu if platform == "tpu" else lowering.lower_for_gpu
    try:
        return lower(fn, *args).as_text()
    except lowering.LoweringUnsupported as err:
        pytest.skip(str(err))


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
@pytest.mark.parametrize("vmapped", [False, True], ids=["plain", "vmap"])
@pytest.mark.parametrize("platform", ["tpu", "gpu"])
def test_lowers_for_hardware(platform, vmapped):
    """Each variant lowers to exactly one hardware kernel call per pallas_call traced (a kernel left in
    interpret mode, or lowered for another target, fails), at gdn shapes with a chunk of 64, a ragged
    row count and width; on GPU every block but the chunk axis a power of two >= 16."""
    f, rows = abstract_factors(length=1000), S((37,), jnp.int32)
    if vmapped:
        f = jax.tree.map(lambda x: S((3, *x.shape), x.dtype), f)

    def fn(f, rows, c0):
        tile = functools.partial(m_tile_pallas, width=67, platform=platform, interpret=False)
        return (jax.vmap(tile, in_axes=(0, None, None)) if vmapped else tile)(f, rows, c0)

    args = (f, rows, S((), jnp.int32))
    text = _lower(platform, fn, *args)
    calls = lowering.pallas_grids(fn, *args)
    assert hardware_calls(text) == [CUSTOM_CALL[platform]] * len(calls) == [CUSTOM_CALL[platform]]
    (call,) = calls
    for block, array in zip(call["blocks"], call["arrays"], strict=True):  # the last two dims of each
        dims = [d or 1 for d in block[-2:]]
        if platform == "tpu":  # Mosaic: multiples of (8, 128) or the array's own dims
            for d, a, m in zip(dims, array[-2:], (8, 128), strict=True):
                assert d % m == 0 or d == a, (block, array)
            assert dims[0] % 8 == 0, block  # and rows, chunk, key dim padded to sublanes
        else:  # what a program loads: powers of two >= 16 (the chunk axis before them is indexed)
            assert all(d == 1 or (d >= 16 and d & (d - 1) == 0) for d in dims), block


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
@pytest.mark.parametrize("platform", ["tpu", "gpu"])
def test_gradient_lowers_for_hardware(platform):
    """value_and_grad through the kernel lowers: the forward on the hardware, the backward the XLA
    reference's (no second kernel)."""
    f = abstract_factors(length=256)
    rows = jnp.arange(200, 256, 7)

    def loss(f):
        return jnp.sum(m_tile_pallas(f, rows, 64, 67, platform=platform, interpret=False) ** 2)

    text = _lower(platform, jax.value_and_grad(loss), f)
    assert hardware_calls(text) == [CUSTOM_CALL[platform]]


def test_vmem_limit_from_blocks_reaches_the_kernel():
    """The score tiles' ``Blocks.vmem_limit_bytes`` is the limit the dispatcher's kernel passes on TPU."""
    ctx = Context(kernels=True, platform="tpu", chip="v5e")
    f, rows = abstract_factors(length=256), S((8,), jnp.int32)
    blocks = Blocks(vmem_limit_bytes=40 * MiB)

    def fn(f, rows):
        return dispatch.delta_rule_m_tile(f, rows, 0, 67, ctx=ctx, block_sizes=blocks)

    (call,) = lowering.pallas_grids(fn, f, rows)
    assert call["vmem_limit_bytes"] == 40 * MiB
