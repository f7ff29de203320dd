"""Memory of the delta-rule M tiles: the XLA scan over chunks against the Pallas kernel
(kernels/delta_rule_tiles.py), from compiled programs' memory analysis (issue 42 item 4). No timing:
the kernel runs here only in interpret mode, whose speed means nothing.

    python benchmarks/bench_delta_rule_kernel_memory.py      # -> results/delta_rule_kernel_memory.{json,md}
    python benchmarks/bench_delta_rule_kernel_memory.py --quick

Workloads (the models of benchmarks/bench_delta_rule_tiles.py, abstract inputs: nothing runs):
- one gdn layer (d_model 256; 8 value heads, d_k 64, chunk 64), one prompt of L = 4096: the score
  program of its full map (``layer_scores`` over every row: l2, and the hidden attention);
- the tiny hybrid's gdn layer (4 value heads, d_k 8, chunk 8) at L = 16384: the last row (l2).

Each program is compiled for this CPU (``jax.jit(...).lower(...).compile().memory_analysis()``) with
the factors' tiles taken by:
- ``xla``: the scan over chunks (:func:`latim_jax.kernels.delta_rule.m_tile`);
- ``pallas interpret``: the kernel in interpret mode (the CPU emulation of the grid: what
  impl="pallas" costs on a CPU, not a device);
- ``tpu call`` / ``gpu call``: the TPU or GPU variant's wrapper (padding, scalars, VMEM guard) with
  its pallas_call replaced by an opaque host callback taking the same operands and returning the same
  result: the HBM a device program allocates around the kernel (the kernel's own working set lives
  in VMEM or registers: given per TPU program from the guard's count, :func:`tpu_need`).
Reported: the compiled temporaries (temp_size_in_bytes) and the arguments and outputs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from bench_delta_rule_tiles import HYBRID, LAYER  # the same workloads as the time benchmark
from harness import RESULTS, machine, now, write_atomic

import latim_jax
from latim_jax.kernels import delta_rule_tiles
from latim_jax.latim.kinds import layer_factors
from latim_jax.latim.scores import layer_scores
from latim_jax.model.init import init_params
from latim_jax.parallel.context import XLA, Context

PATHS = {
    "xla": XLA,
    "pallas interpret": Context(kernels=True, platform="cpu"),
    "tpu call": Context(kernels=True, platform="tpu", chip="v5e"),
    "gpu call": Context(kernels=True, platform="gpu"),
}
MiB = 1 << 20


class _OpaqueCalls:
    """Stands in for ``jax.experimental.pallas`` inside kernels/delta_rule_tiles.py: ``pallas_call``
    returns a host callback with the call's operands and result shape (XLA must materialise both, and
    can neither fuse nor drop them), everything else is Pallas's own."""

    def __init__(self, pl):
        self._pl = pl

    def __getattr__(self, name):
        return getattr(self._pl, name)

    @staticmethod
    def pallas_call(kernel, out_shape, **kw):
        del kernel, kw

        def call(*args):
            zeros = lambda *a: np.zeros(out_shape.shape, out_shape.dtype)  # noqa: E731
            return jax.pure_callback(zeros, out_shape, *args)

        return call


def abstract_factors(config: dict, layer: int, length: int):
    """The layer's DeltaFactors as ShapeDtypeStructs (XLA context), and the model."""
    cfg = latim_jax.MambaConfig(**config)
    model = latim_jax.MambaLM(cfg, init_params(cfg, 0))
    h = jax.ShapeDtypeStruct((1, length, cfg.d_model), jnp.float32)
    return jax.eval_shape(lambda h: layer_factors(model, h, layer, impl=XLA), h)


def compiled_memory(f, method: str, rows: np.ndarray, ctx: Context) -> dict:
    """Memory analysis of the layer's score program with the factors' tiles in ``ctx``."""
    f = dataclasses.replace(f, ctx=ctx)
    mask = jax.ShapeDtypeStruct((1, f.length), jnp.bool_)
    rows = jnp.asarray(rows, jnp.int32)
    program = jax.jit(lambda f, mask: layer_scores(f, method, rows, mask=mask))
    real = delta_rule_tiles.pl
    if ctx.kernels and not ctx.interpret:
        delta_rule_tiles.pl = _OpaqueCalls(real)
    try:
        stats = program.lower(f, mask).compile().memory_analysis()
    finally:
        delta_rule_tiles.pl = real
    return {
        "temp_mib": stats.temp_size_in_bytes / MiB,
        "argument_mib": stats.argument_size_in_bytes / MiB,
        "output_mib": stats.output_size_in_bytes / MiB,
    }


def tpu_vmem(f, rows: int, width: int) -> dict:
    """The TPU variant's VMEM per program for this layer's tiles (the guard's count)."""
    _, _, _, C, _ = f.chunks.local.shape
    k = f.chunks.carry.shape[-1]
    Cp, kp, rp, wt, _ = delta_rule_tiles._sizes("tpu", C, k, rows, width, None)
    need = delta_rule_tiles.tpu_need(Cp, kp, rp, wt)
    return {"tile": f"{rows} x {width}", "padded": f"C {Cp}, k {kp}, rows {rp}, width tile {wt}",
            "vmem_mib": need.total / MiB}  # fmt: skip


def cell(name: str, config: dict, layer: int, length: int, method: str, rows: np.ndarray) -> dict:
    f = abstract_factors(config, layer, length)
    blocks = f.tiles(len(rows), None)
    K = f.a.shape[1]
    width = blocks.cols + (K - 1 if method != "hidden_attention" else 0)
    tile = f"{blocks.rows} x {blocks.cols}"
    out = {"workload": name, "L": length, "method": method, "rows": len(rows), "score_tile": tile,
           "tpu_vmem": tpu_vmem(f, blocks.rows, width)}  # fmt: skip
    for path, ctx in PATHS.items():
        out[path] = compiled_memory(f, method, rows, ctx)
        print(name, method, path, out[path], flush=True)
    return out


def table(result: dict) -> str:
    lines = [
        f"Delta-rule M tiles, compiled memory (CPU compile, nothing run): {result['created']}, "
        f"{result['machine'].get('cpu', '')}.",
        "",
        "| workload | L | method | score tile | "
        + " | ".join(f"{p} temp MiB" for p in PATHS)
        + " | args MiB | TPU VMEM per program |",
        "|---|---|---|---|" + "---|" * len(PATHS) + "---|---|",
    ]
    for c in result["cells"]:
        temps = " | ".join(f"{c[p]['temp_mib']:.1f}" for p in PATHS)
        v = c["tpu_vmem"]
        lines.append(
            f"| {c['workload']} | {c['L']} | {c['method']} | {c['score_tile']} | {temps} | "
            f"{c['xla']['argument_mib']:.1f} | {v['vmem_mib']:.2f} MiB ({v['tile']}; {v['padded']}) |"
        )
    lines += [
        "",
        "temp: XLA's temporaries of the layer's whole score program (the tile loop's buffers are reused "
        "across tiles). tpu/gpu call: the kernel replaced by an opaque call with its operands and result, "
        "so the column is what a device allocates in HBM around the kernel (padded factor copies, the "
        "tile, the score loop), not the kernel's VMEM, given in the last column for one TPU program "
        "(double-buffered blocks, Y, in-body temporaries). pallas interpret: the CPU emulation. "
        f"Command: {result['command']}.",
    ]
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small lengths (checks the script)")
    p.add_argument("--out", default="delta_rule_kernel_memory")
    args = p.parse_args(argv)
    layer_len, hybrid_len = (256, 1024) if args.quick else (4096, 16384)
    command = "python benchmarks/bench_delta_rule_kernel_memory.py " + " ".join(argv or sys.argv[1:])
    result = {"created": now(), "machine": machine(), "jax": jax.__version__, "quick": args.quick,
              "command": command.strip(), "cells": []}  # fmt: skip
    every = np.arange(layer_len)
    for method in ("l2", "hidden_attention"):
        result["cells"].append(cell("one gdn layer, full map", LAYER, 0, layer_len, method, every))
    last = np.array([hybrid_len - 1])
    result["cells"].append(cell("tiny hybrid's gdn layer, last row", HYBRID, 0, hybrid_len, "l2", last))
    path = RESULTS / f"{args.out}.json"
    write_atomic(path, json.dumps(result, indent=2) + "\n")
    write_atomic(path.with_suffix(".md"), table(result) + "\n")
    print(table(result))


if __name__ == "__main__":
    main()
