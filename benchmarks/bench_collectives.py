"""What a pod run moves between devices (issue "pods in fact"): the collectives XLA puts into the compiled
forward, ``attribute`` (each method) and its gradient, model-parallel over 8 simulated CPU devices, per
layer, beside the ideal (one all-reduce of the residual stream per layer, nothing else); then an
estimate for a 7B-shaped Mamba-2 (Codestral Mamba's widths) over 8 and 64 devices at L = 32k.

    python benchmarks/bench_collectives.py                    # the 130m-wide table (~10 min on 2 cores)
    python benchmarks/bench_collectives.py --length 128       # a quick look
    python benchmarks/bench_collectives.py --out benchmarks/results/collectives.json

Collectives are read from the optimised HLO of each compiled program (``jit(...).lower().compile()``):
every all-reduce, all-gather, reduce-scatter, all-to-all and collective-permute, counted once (an
asynchronous pair counts at its start), its bytes the size of its largest result array. "streams"
divides bytes by one residual stream (b l d fp32), the unit of the ideal. Random weights; nothing runs.
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # the device count is read once, when jax starts
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import argparse
import json
import re
import sys
import time
from pathlib import Path

OPS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_OP = re.compile(r"=\s*(\(.*?\)|\S+)\s+(" + "|".join(OPS) + r")(-start)?\(")
_ARRAY = re.compile(r"(pred|[a-z]+\d+)\[([\d,]*)\]")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4,
          "u32": 4, "f64": 8, "s64": 8, "u64": 8}  # fmt: skip


def collectives(hlo_text: str) -> dict[str, dict[str, float]]:
    """{op: {"count": n, "bytes": b}} of the collectives in an optimised HLO module's text."""
    out = {op: {"count": 0, "bytes": 0} for op in OPS}
    for line in hlo_text.splitlines():
        m = _OP.search(line)
        if m is None:
            continue
        sizes = [_BYTES.get(dtype, 4) * _prod(dims) for dtype, dims in _ARRAY.findall(m.group(1))]
        out[m.group(2)]["count"] += 1
        out[m.group(2)]["bytes"] += max(sizes, default=0)
    return out


def _prod(dims: str) -> int:
    n = 1
    for d in filter(None, dims.split(",")):
        n *= int(d)
    return n


def configs(MambaConfig):
    """The 130m-wide layers measured: Mamba-1, Mamba-2 and a hybrid (Mamba-2, attention, MLP)."""
    return {
        "mamba1": MambaConfig(version=1, d_model=768, n_layers=2, vocab_size=512, d_state=16),
        "mamba2": MambaConfig(version=2, d_model=768, n_layers=2, vocab_size=512, d_state=128, head_dim=64,
                              chunk_size=256),
        "hybrid": MambaConfig(version=2, d_model=768, n_layers=3, vocab_size=512, d_state=128, head_dim=64,
                              chunk_size=256, layer_kinds=("mamba2", "attention", "mlp"), attn_heads=12,
                              attn_kv_heads=4, attn_head_dim=64, rope_theta=10000.0, mlp_width=2048,
                              mlp_gated=True),
    }  # fmt: skip


def measure(length: int, methods) -> list[dict]:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import latim_jax
    from latim_jax.model.config import MambaConfig
    from latim_jax.model.init import init_params
    from latim_jax.model.sharding import shard

    assert len(jax.devices()) == 8, "run as a script: the 8 simulated devices are set before jax starts"
    mesh = jax.make_mesh((1, 8), ("data", "model"))
    rows = []
    for name, cfg in configs(MambaConfig).items():
        model = shard(latim_jax.MambaLM(cfg, init_params(cfg, 0)), mesh)  # laid out before tracing
        embeds = jnp.ones((1, length, cfg.d_model), jnp.float32)
        stream = length * cfg.d_model * 4

        graphdef, state = nnx.split(model)  # the parameters enter as arguments with their shardings

        def scores(state, e, method, graphdef=graphdef):
            m = nnx.merge(graphdef, state)
            return latim_jax.attribute(m, inputs_embeds=e, method=method, mesh=mesh, memory_limit=None).scores

        def forward(state, e, graphdef=graphdef):
            return nnx.merge(graphdef, state).forward(inputs_embeds=e, mesh=mesh).residuals

        programs = {"forward": forward}
        for method in methods:
            programs[f"attribute({method})"] = lambda s, e, m=method: scores(s, e, m)
        programs["grad attribute(l2)"] = jax.grad(lambda s, e: jnp.sum(scores(s, e, "l2") ** 2), argnums=1)
        for what, fn in programs.items():
            t0 = time.perf_counter()
            text = jax.jit(fn).lower(state, embeds).compile().as_text()
            found = collectives(text)
            row = {"model": name, "program": what, "L": length, "layers": cfg.n_layers,
                   "compile_s": round(time.perf_counter() - t0, 1)}  # fmt: skip
            for op, v in found.items():
                row[op] = {"count_per_layer": v["count"] / cfg.n_layers,
                           "streams_per_layer": v["bytes"] / stream / cfg.n_layers}  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def pod_estimate(rows: list[dict]) -> list[dict]:
    """A 7B-shaped Mamba-2 (Codestral Mamba: d 4096, 64 layers, e 8192, 128 heads of 64, 8 groups, state
    128, vocabulary 32768) at L = 32k, one prompt, model-parallel over m devices: per-device parameters
    and activations, the forward's collective bytes per layer in today's layout (the measured streams per
    layer of the 130m-wide Mamba-2 forward, scaled: every moved array is (L, width) and widths scale with
    d) and in the ideal one (one all-reduce of the stream), and the time each takes at a stated
    interconnect rate beside the layer's matmul time at a stated rate."""
    d, layers, e, heads, groups, n, vocab, L = 4096, 64, 8192, 128, 8, 128, 32768, 32768
    ici = 100e9  # bytes/s per device for collectives (ICI all-reduce bus bandwidth, TPU v5e-class)
    mxu = 197e12 * 0.5  # matmul flop/s per device (bf16 peak of a TPU v5e at 50% utilisation)
    in_width = 2 * e + 2 * groups * n + heads
    per_layer = d * in_width + e * d + 4 * (e + 2 * groups * n) + 3 * heads + e + d
    params = layers * per_layer + vocab * d  # tied head
    measured = next((r for r in rows if r["model"] == "mamba2" and r["program"] == "forward"), None)
    out = []
    for m in (8, 64):
        ring = 2 * (m - 1) / m  # a ring all-reduce sends about twice its bytes per device
        stream = L * d * 4  # fp32 residual stream
        if measured is None:
            today = float("nan")
        else:  # streams per layer, the all-reduces weighted as a ring moves them
            today = sum(v["streams_per_layer"] * (ring if k == "all-reduce" else 1.0)
                        for k, v in measured.items() if k in OPS)  # fmt: skip
        flops = 2 * L * d * (in_width + e)  # in_proj and out_proj, the layer's matmuls
        act = L * (in_width + e + d) * 4 / m  # the projection output, y and the layer output, per device
        out.append({
            "devices": m, "params_per_device_GiB": params * 2 / m / 2**30,
            "activations_per_layer_per_device_GiB": act / 2**30,
            "ideal_MiB_per_layer": ring * stream / 2**20, "today_MiB_per_layer": today * stream / 2**20,
            "ideal_ms": 1e3 * ring * stream / ici, "today_ms": 1e3 * today * stream / ici,
            "matmul_ms": 1e3 * flops / m / mxu,
            "assumptions": "bf16 weights, fp32 stream; 100 GB/s per device for collectives; 98.5 TFLOP/s "
                           "per device for matmuls; one prompt; today's moves scaled from 8 devices",
        })  # fmt: skip
    return out


def markdown(rows: list[dict], pod: list[dict]) -> str:
    """The two tables: collectives per layer (count, and bytes in residual streams), and the 7B estimate."""
    short = {"all-reduce": "all-reduce", "all-gather": "all-gather", "reduce-scatter": "reduce-scatter",
             "all-to-all": "all-to-all", "collective-permute": "permute"}  # fmt: skip
    length = rows[0]["L"] if rows else 0
    lines = [
        f"Model-parallel over 8 simulated devices (mesh data 1 x model 8), d_model 768, L = {length}, one "
        "prompt; per layer: count / bytes in residual streams (b l d fp32). Ideal: one all-reduce of one "
        "stream per layer (forward), nothing else.",
        "",
        "| model | program | " + " | ".join(short[o] for o in OPS) + " |",
        "|---|---|" + "---|" * len(OPS),
    ]
    for r in rows:
        cells = [f"{r[o]['count_per_layer']:.3g} / {r[o]['streams_per_layer']:.3g}" for o in OPS]
        lines.append(f"| {r['model']} | {r['program']} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "A 7B-shaped Mamba-2 (Codestral Mamba widths: d 4096, 64 layers, e 8192, 128 heads, 8 groups, "
        "state 128) at L = 32k, one prompt, model-parallel; forward, per layer. "
        + (pod[0]["assumptions"] if pod else ""),
        "",
        "| devices | params / device GiB | activations / layer / device GiB | ideal MiB (ms) "
        "| today MiB (ms) | matmul ms |",
        "|---|---|---|---|---|---|",
    ]
    for p in pod:
        lines.append(
            f"| {p['devices']} | {p['params_per_device_GiB']:.2f} "
            f"| {p['activations_per_layer_per_device_GiB']:.3f} "
            f"| {p['ideal_MiB_per_layer']:.0f} ({p['ideal_ms']:.1f}) "
            f"| {p['today_MiB_per_layer']:.0f} ({p['today_ms']:.1f}) | {p['matmul_ms']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--length", type=int, default=512)
    p.add_argument("--methods", default="l2,alti,logit,hidden_attention")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    rows = measure(args.length, args.methods.split(","))
    pod = pod_estimate(rows)
    for row in pod:
        print(json.dumps(row), flush=True)
    if args.out:
        args.out.write_text(json.dumps({"collectives": rows, "pod_7b": pod}, indent=1))
        args.out.with_suffix(".md").write_text(markdown(rows, pod))


if __name__ == "__main__":
    sys.exit(main())
