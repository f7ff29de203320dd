"""The TPU kernels' VMEM budget (kernels/vmem.py): tiles whose buffers overflow a chip's scoped VMEM are
refused before compiling, naming the tile, the bytes, the chip and the largest tile that fits; the
scoped limit each kernel passes is the chip's; and the budget counts exactly the blocks and scratch
each pallas_call declares. Tracing only (jax.eval_shape / make_jaxpr), no libtpu: seconds."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import pytest

from latim_jax.kernels import lowering, vmem
from latim_jax.kernels.block_sizes import Blocks
from latim_jax.kernels.decay import SSM, Decay
from latim_jax.kernels.fused_scores import _tpu_blocks, fused_layer_scores
from latim_jax.kernels.selective_scan import _scan_tpu_blocks, selective_scan_pallas
from latim_jax.kernels.ssd import _ssd_tpu_blocks, ssd_pallas
from latim_jax.latim.mamba import MambaFactors
from latim_jax.parallel.chips import TPU_CHIPS, MiB

S, f32 = jax.ShapeDtypeStruct, jnp.float32
TPU = dict(platform="tpu", interpret=False)


def abstract_factors(version: int, *, l=512, d=768, e=1536, n=128, heads=24, K=4) -> MambaFactors:
    """MambaFactors of ShapeDtypeStructs at mamba(2)-130m widths: the budget reads only shapes."""
    c = heads if version == 2 else e
    bc = (1, l, 1, n) if version == 2 else (1, l, n)
    dec = S((1, l, c), f32)
    A = S((heads,), f32) if version == 2 else S((e, n), f32)
    ssm = SSM(version, A, S((c,), f32), dec, S(bc, f32), S(bc, f32), Decay(dec, dec))
    o = S((1, l, d), f32)
    return MambaFactors(
        mode="exact", ssm=ssm, a=S((K, 1, l, e), f32), G=S((1, l, e), f32), W_out=S((e, d), f32),
        bias=o, output=o, h=o, token_total=o,
    )  # fmt: skip


def scores(f, blocks, chip, method="l2"):
    rows = S((f.ssm.length,), jnp.int32)
    fn = functools.partial(fused_layer_scores, method=method, block_sizes=blocks, chip=chip, **TPU)
    return jax.eval_shape(lambda f, r: fn(f, rows=r), f, rows)


def suggested(err) -> Blocks:
    """The ``Blocks(...)`` a refusal names."""
    fields = re.search(r"Blocks\(([^)]*)\)", str(err)).group(1)
    return Blocks(**{k: int(v) for k, v in (kv.split("=") for kv in fields.split(", "))})


@pytest.mark.parametrize("chip", ["v4", "v5p"])
def test_fused_tile_over_the_chips_vmem_is_refused_with_a_tile_that_fits(chip):
    """Blocks(rows=64, cols=512) at mamba2-130m widths: a 96 MiB (64 x 768 x 512 fp32) accumulator.
    Compiling it fails in Mosaic on v4 (16 MiB) and v5p (64 MiB); the guard refuses it first."""
    f = abstract_factors(2)
    with pytest.raises(vmem.VmemOverflow) as err:
        scores(f, Blocks(rows=64, cols=512), chip)
    text = str(err.value)
    limit = TPU_CHIPS[chip].vmem_limit_bytes // MiB
    for part in (
        "fused score kernel",
        "rows=64 x cols=512",
        "scratch 96.0 MiB",
        f"TPU {chip}",
        f"{limit}.0 MiB",
    ):
        assert part in text, (part, text)
    scores(f, suggested(err.value), chip)  # the named tile traces


def test_the_same_tile_fits_a_chip_with_more_vmem():
    """v5e's 128 MiB VMEM (limit 112 MiB) holds the 96 MiB accumulator: compiled for a compile-only
    v5e with libtpu 0.0.42.1, where the old 48 MiB limit overflowed."""
    scores(abstract_factors(2), Blocks(rows=64, cols=512), "v5e")


def test_an_unknown_generation_is_budgeted_as_the_smallest():
    with pytest.raises(vmem.VmemOverflow, match="unknown TPU generation.*v4.*name the generation"):
        scores(abstract_factors(1), Blocks(rows=16, cols=256), None)


def test_a_vmem_limit_above_the_chips_vmem_is_refused():
    with pytest.raises(vmem.VmemOverflow, match="vmem_limit_bytes.*exceeds the VMEM of TPU v5p"):
        scores(abstract_factors(2), Blocks(vmem_limit_bytes=100 * MiB), "v5p")


def scan_args(l=1024, e=1024, n=16):
    return [S((1, l, e), f32), S((1, l, e), f32), S((e, n), f32), S((1, l, n), f32), S((1, l, n), f32),
            S((e,), f32)]  # fmt: skip


def ssd_args(l=1024, h=2, p=64, n=128):
    return [S((1, l, h, p), f32), S((1, l, h), f32), S((h,), f32), S((1, l, 1, n), f32), S((1, l, 1, n), f32),
            S((h,), f32)]  # fmt: skip


def value_and_grad(fn):
    def loss(*a):
        y, state = fn(*a)
        return jnp.sum(y * y) + jnp.sum(state)

    return jax.value_and_grad(loss, argnums=(0, 1, 3))


def test_scan_tiles_over_vmem_are_refused_forward_and_backward():
    """v4, measured by compiling for it: 1024 x 1024 forward used 25.2 MiB (budget 24.8); 512 x 512
    forward fits, its backward (a (512, 16, 512) state scratch) used 27.1 MiB (budget 26.6)."""
    big = functools.partial(selective_scan_pallas, block_sizes=Blocks(scan_block_l=1024, scan_block_e=1024),
                            chip="v4", **TPU)  # fmt: skip
    with pytest.raises(vmem.VmemOverflow, match=r"selective scan forward kernel.*TPU v4") as err:
        jax.eval_shape(big, *scan_args())
    jax.eval_shape(functools.partial(big, block_sizes=suggested(err.value)), *scan_args())
    mid = functools.partial(big, block_sizes=Blocks(scan_block_l=512, scan_block_e=512))
    jax.eval_shape(mid, *scan_args())
    with pytest.raises(vmem.VmemOverflow, match="selective scan backward kernel") as err:
        jax.eval_shape(value_and_grad(mid), *scan_args())
    jax.eval_shape(value_and_grad(functools.partial(big, block_sizes=suggested(err.value))), *scan_args())


def test_ssd_chunk_over_vmem_is_refused_in_the_backward():
    """v4, measured: chunk 512's forward compiles, its backward used 20.9 MiB of the (q, q) matrices."""
    fn = functools.partial(ssd_pallas, chunk_size=512, block_sizes=Blocks(ssd_chunk=512), chip="v4", **TPU)
    jax.eval_shape(fn, *ssd_args())
    with pytest.raises(vmem.VmemOverflow, match=r"SSD backward kernel: tile ssd_chunk=512.*chunk that fits"):
        jax.eval_shape(value_and_grad(fn), *ssd_args())


def padded(shapes) -> int:
    return sum(vmem.padded_bytes(s) for s in shapes)


def test_the_budget_counts_what_each_pallas_call_declares():
    """Each kernel's budget lists the same blocks and scratch as its pallas_call (so the guard cannot
    drift from the kernel), and the call passes the chip's scoped-VMEM limit."""
    limit = TPU_CHIPS["v6e"].vmem_limit_bytes
    for version, method in ((2, "alti"), (1, "l2")):
        f = abstract_factors(version, l=256)
        rows = S((256,), jnp.int32)
        fn = functools.partial(
            fused_layer_scores, method=method, block_sizes=Blocks(rows=16), chip="v6e", **TPU
        )
        (call,) = lowering.pallas_grids(lambda f, r, fn=fn: fn(f, rows=r), f, rows)
        p, n = 64 if version == 2 else 1, f.ssm.B.shape[-1]
        ins, out, scratch = _tpu_blocks(version, method, 4, n, 1, p, 16, 128, 768, ec=256)
        assert padded(call["blocks"]) == padded([*ins, out]) and call["scratch"] == scratch
        assert call["vmem_limit_bytes"] == limit
    scan = functools.partial(selective_scan_pallas, block_sizes=Blocks(scan_block_l=256, scan_block_e=512),
                             chip="v6e", **TPU)  # fmt: skip
    fwd, bwd = lowering.pallas_grids(value_and_grad(scan), *scan_args())
    for call, backward in ((fwd, False), (bwd, True)):
        blocks, scratch = _scan_tpu_blocks(256, 512, 16, backward)
        assert padded(call["blocks"]) == padded(blocks) and call["scratch"] == scratch
        assert call["vmem_limit_bytes"] == limit
    ssd = functools.partial(ssd_pallas, chunk_size=128, block_sizes=Blocks(ssd_chunk=128), chip="v6e", **TPU)
    fwd, bwd = lowering.pallas_grids(value_and_grad(ssd), *ssd_args())
    for call, backward in ((fwd, False), (bwd, True)):
        blocks, scratch, _ = _ssd_tpu_blocks(128, 64, 128, backward)
        assert padded(call["blocks"]) == padded(blocks) and call["scratch"] == scratch
        assert call["vmem_limit_bytes"] == limit


def test_padded_bytes_follow_mosaics_tiles():
    assert vmem.padded_bytes((64, 768, 512)) == 96 * MiB
    assert vmem.padded_bytes((None, 1, 8)) == 8 * 128 * 4  # one (8, 128) tile
    assert vmem.padded_bytes((3, 4, 130)) == 3 * 8 * 256 * 4
