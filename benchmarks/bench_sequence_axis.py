"""The forward with one prompt's length split over the mesh's "seq" axis (issue 43 item 1): per-device
memory of the compiled sharded forward against one device's, the collectives per layer in its HLO, and
the two ways a shard takes the state entering it (correct the outputs / rescan from it).

    python benchmarks/bench_sequence_axis.py                       # L = 32k, seq = 8 (~5 min, 2 cores)
    python benchmarks/bench_sequence_axis.py --length 4096 --fixup-length 4096
    python benchmarks/bench_sequence_axis.py --out benchmarks/results/sequence_axis.json
    python benchmarks/bench_sequence_axis.py --models gdn --no-fixup   # the Gated DeltaNet layer alone

Memory is XLA's ``compiled.memory_analysis()`` of the jitted logits (random 130m-wide weights, one
prompt, inputs as embeddings): argument, output and temporary bytes of ONE device's program (an SPMD
program is the same on every device). Collectives are read from the optimised HLO as
``bench_collectives.py`` does, divided by the layers; "streams" divides bytes by one device's residual
stream (b l/D d fp32). The fixup comparison compiles one scan (Mamba-2 SSD and Mamba-1 selective
scan, 130m-wide, XLA path) over seq = 8 both ways and times it on the 8 simulated devices (which
share this machine's cores, so the wall time is the total work, not a device's) and reads XLA's flop
estimate. "gdn" is two Gated DeltaNet layers at that width (6 key and 12 value heads of 128, chunks of
64: Qwen3-Next's head shape, value width 2 d): its collectives are the conv's halo and the gather of
the rule's (final state, transition) summaries (latim_jax.parallel.sequence). Nothing here needs an
accelerator.
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # the device count is read once, when jax starts
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import argparse
import json
import sys
import time
from pathlib import Path

from bench_collectives import collectives, configs


def memory(compiled) -> dict:
    """MiB of one device's arguments, outputs and temporaries."""
    m = compiled.memory_analysis()
    mib = 1 << 20
    return {
        "args_mib": round(m.argument_size_in_bytes / mib, 1),
        "out_mib": round(m.output_size_in_bytes / mib, 1),
        "temp_mib": round(m.temp_size_in_bytes / mib, 1),
    }


def models(MambaConfig) -> dict:
    """The measured models: bench_collectives' Mamba-1, Mamba-2 and hybrid, and two Gated DeltaNet
    layers at the same width."""
    gdn = dict(k_heads=6, v_heads=12, k_dim=128, v_dim=128, chunk=64)
    return configs(MambaConfig) | {
        "gdn": MambaConfig(version=2, d_model=768, n_layers=2, vocab_size=512, layer_kinds=("gdn", "gdn"),
                           sections={"gdn": gdn}),
    }  # fmt: skip


def measure_forward(length: int, d: int, names=None) -> list[dict]:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import latim_jax
    from latim_jax.model.config import MambaConfig
    from latim_jax.model.init import init_params
    from latim_jax.model.sharding import shard

    rows = []
    mesh = jax.make_mesh((d,), ("seq",), devices=jax.devices()[:d])
    for name, cfg in models(MambaConfig).items():
        if names and name not in names:
            continue
        embeds = jnp.ones((1, length, cfg.d_model), jnp.float32)
        row = {"model": name, "L": length, "seq": d, "layers": cfg.n_layers}
        for where, m in (("one_device", None), ("split", mesh)):
            model = latim_jax.MambaLM(cfg, init_params(cfg, 0))
            if m is not None:
                shard(model, m)
            graphdef, state = nnx.split(model)

            def logits(state, e, graphdef=graphdef, m=m):
                return nnx.merge(graphdef, state).forward(inputs_embeds=e, impl="xla", mesh=m).logits

            t0 = time.perf_counter()
            compiled = jax.jit(logits).lower(state, embeds).compile()
            row[where] = memory(compiled) | {"compile_s": round(time.perf_counter() - t0, 1)}
            if m is not None:
                stream = length // d * cfg.d_model * 4
                found = collectives(compiled.as_text())
                row["collectives_per_layer"] = {
                    op: {
                        "count": v["count"] / cfg.n_layers,
                        "streams": round(v["bytes"] / stream / cfg.n_layers, 3),
                    }
                    for op, v in found.items()
                    if v["count"]
                }
        one, split = row["one_device"]["temp_mib"], row["split"]["temp_mib"]
        row["temp_ratio"] = round(split / one, 3) if one else None
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def measure_fixup(length: int, d: int, repeats: int = 3) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from latim_jax.kernels import dispatch
    from latim_jax.parallel.context import Context
    from latim_jax.parallel.mesh import check_mesh

    mesh = check_mesh(jax.make_mesh((d,), ("seq",), devices=jax.devices()[:d]))
    ctx = Context(mesh=mesh, platform="cpu")
    rng = np.random.default_rng(0)
    h, p, n, e, n1 = 24, 64, 128, 1536, 16  # mamba2-130m and mamba-130m widths

    def arr(*shape, lo=None, hi=None):
        x = rng.uniform(lo, hi, shape) if lo is not None else rng.normal(size=shape)
        return jnp.asarray(x, jnp.float32)

    scans = {
        "mamba2_ssd": (
            lambda fixup: lambda *a: dispatch.ssd(*a, 256, ctx=ctx, fixup=fixup),
            (arr(1, length, h, p), arr(1, length, h, lo=0.001, hi=0.1), -arr(h, lo=1, hi=16),
             arr(1, length, 1, n), arr(1, length, 1, n), jnp.ones(h)),
        ),
        "mamba1_scan": (
            lambda fixup: lambda *a: dispatch.selective_scan(*a, ctx=ctx, fixup=fixup),
            (arr(1, length, e), arr(1, length, e, lo=0.001, hi=0.1), -arr(e, n1, lo=1, hi=16),
             arr(1, length, n1), arr(1, length, n1), jnp.ones(e)),
        ),
    }  # fmt: skip
    rows = []
    for name, (make, args) in scans.items():
        outs = {}
        for fixup in ("correct", "rescan"):
            compiled = jax.jit(make(fixup)).lower(*args).compile()
            cost = compiled.cost_analysis()
            cost = cost[0] if isinstance(cost, list) else cost
            jax.block_until_ready(compiled(*args))
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                outs[fixup] = jax.block_until_ready(compiled(*args))
                times.append(time.perf_counter() - t0)
            row = {"scan": name, "fixup": fixup, "L": length, "seq": d, "wall_s": round(min(times), 3),
                   "gflop": round(cost.get("flops", 0.0) / 1e9, 2)} | memory(compiled)  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
        y0, y1 = outs["correct"][0], outs["rescan"][0]
        print(json.dumps({"scan": name, "rel_diff": float(jnp.abs(y0 - y1).max() / jnp.abs(y1).max())}))
    return rows


def markdown(forward: list[dict], fixup: list[dict]) -> str:
    lines = [
        "## Per-device memory of the forward (one device vs the length over seq)",
        "",
        "| model | L | seq | one device temp MiB | per device temp MiB | ratio | args MiB "
        "| collectives per layer: count (streams) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in forward:
        coll = ", ".join(
            f"{op} {v['count']:g} ({v['streams']:g})" for op, v in r["collectives_per_layer"].items()
        )
        one, split = r["one_device"], r["split"]
        lines.append(
            f"| {r['model']} | {r['L']} | {r['seq']} | {one['temp_mib']} | {split['temp_mib']} "
            f"| {r['temp_ratio']} | {split['args_mib']} | {coll} |"
        )
    if not fixup:
        return "\n".join(lines) + "\n"
    lines += [
        "",
        "## Correct vs rescan (one scan over seq, 8 simulated devices sharing the cores)",
        "",
        "| scan | fixup | L | wall s | GFLOP (XLA estimate, per device) | temp MiB |",
        "|---|---|---|---|---|---|",
    ]
    for r in fixup:
        lines.append(
            f"| {r['scan']} | {r['fixup']} | {r['L']} | {r['wall_s']} | {r['gflop']} | {r['temp_mib']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=32768)
    parser.add_argument("--fixup-length", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=8)
    parser.add_argument("--models", nargs="*", default=None, help="a subset of mamba1 mamba2 hybrid gdn")
    parser.add_argument("--no-fixup", action="store_true", help="skip the correct-vs-rescan comparison")
    parser.add_argument("--out", type=Path, default=None, help="JSON results (a .md table beside it)")
    args = parser.parse_args(argv)
    import jax

    assert len(jax.devices()) == 8, "run as a script: the 8 simulated devices are set before jax starts"
    forward = measure_forward(args.length, args.seq, args.models)
    fixup = [] if args.no_fixup else measure_fixup(args.fixup_length, args.seq)
    if args.out is not None:
        args.out.write_text(json.dumps({"forward": forward, "fixup": fixup}, indent=1) + "\n")
        args.out.with_suffix(".md").write_text(markdown(forward, fixup))
    print(markdown(forward, fixup))
    return 0


if __name__ == "__main__":
    sys.exit(main())
