"""attribute with one prompt's length split over the mesh's "seq" axis (issue 43 item 1): per-device
memory of the compiled program against one device's, and its collectives.

    python benchmarks/bench_sequence_attribution.py                  # L = 32k last row, 4096 every row
    python benchmarks/bench_sequence_attribution.py --length 8192 --map-length 1024 --models mamba2
    python benchmarks/bench_sequence_attribution.py --out benchmarks/results/sequence_attribution.json

Each program is ``jax.jit`` of ``latim_jax.attribute`` (l2, exact mode; random 130m-wide two-layer
models of bench_collectives plus the two Gated DeltaNet layers of bench_sequence_axis; one prompt as
embeddings), compiled for one device and for seq = 8 simulated devices, never run: memory is
``compiled.memory_analysis()`` of ONE device's program (an SPMD program is the same on every device),
collectives are read from the optimised HLO as bench_collectives.py does, per layer, in units of one
device's residual stream (l/D d fp32). Two shapes: the last row at ``--length`` (what a long prompt
asks) and every row at ``--map-length``. (XLA's flop estimate counts a loop's body once, so it says
nothing of the score loop's split; the split is checked by tests/parallel/test_sequence_attribution.py,
which records each device's column window.)

What it shows: the score tiles are split by source columns over "seq" (each device scores every asked
row against its l / D sources), so the score work and the output fall as 1/D, and each device holds the
scored layer's factors at its own sources, their halo and the asked rows (latim/source_window.py), so
the memory falls too (0.18-0.21x at seq = 8 for the recurrent kinds; docs/performance.md). The
all-gathers left are the attention forward's K/V. Nothing here needs an accelerator.
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

from bench_collectives import collectives
from bench_sequence_axis import memory, models


def measure(length: int, map_length: int, d: int, names=None) -> list[dict]:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import latim_jax
    from latim_jax.model.config import MambaConfig
    from latim_jax.model.init import init_params
    from latim_jax.model.sharding import shard

    mesh = jax.make_mesh((d,), ("seq",), devices=jax.devices()[:d])
    out = []
    for name, cfg in models(MambaConfig).items():
        if names and name not in names:
            continue
        for L, rows in ((length, [length - 1]), (map_length, None)):
            embeds = jnp.ones((1, L, cfg.d_model), jnp.float32)
            asked = "last" if rows else "every"
            row = {"model": name, "L": L, "rows": asked, "seq": d, "layers": cfg.n_layers}
            for where, m in (("one_device", None), ("split", mesh)):
                model = latim_jax.MambaLM(cfg, init_params(cfg, 0))
                if m is not None:
                    shard(model, m)
                graphdef, state = nnx.split(model)

                def scores(state, e, graphdef=graphdef, m=m, rows=rows):
                    model = nnx.merge(graphdef, state)
                    res = latim_jax.attribute(model, inputs_embeds=e, method="l2", rows=rows, impl="xla",
                                              mesh=m, memory_limit=None)  # fmt: skip
                    return res.scores

                t0 = time.perf_counter()
                compiled = jax.jit(scores).lower(state, embeds).compile()
                row[where] = memory(compiled) | {"compile_s": round(time.perf_counter() - t0, 1)}
                if m is not None:
                    stream = L // d * cfg.d_model * 4
                    row["collectives_per_layer"] = {
                        op: {"count": v["count"] / cfg.n_layers,
                             "streams": round(v["bytes"] / stream / cfg.n_layers, 3)}
                        for op, v in collectives(compiled.as_text()).items() if v["count"]
                    }  # fmt: skip
            one, split = row["one_device"], row["split"]
            row["temp_ratio"] = round(split["temp_mib"] / one["temp_mib"], 3) if one["temp_mib"] else None
            out.append(row)
            print(json.dumps(row), flush=True)
    return out


def markdown(rows: list[dict]) -> str:
    lines = [
        "## attribute (l2, exact) over seq: one device's compiled program vs one of the split program's",
        "",
        "| model | L | rows | seq | one device temp MiB | per device temp MiB | ratio "
        "| out MiB one / per device | collectives per layer: count (streams) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        coll = ", ".join(
            f"{op} {v['count']:g} ({v['streams']:g})" for op, v in r["collectives_per_layer"].items()
        )
        one, split = r["one_device"], r["split"]
        lines.append(
            f"| {r['model']} | {r['L']} | {r['rows']} | {r['seq']} | {one['temp_mib']} | {split['temp_mib']} "
            f"| {r['temp_ratio']} | {one['out_mib']} / {split['out_mib']} | {coll} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=32768, help="the last row's prompt length")
    parser.add_argument("--map-length", type=int, default=4096, help="every row's prompt length")
    parser.add_argument("--seq", type=int, default=8)
    parser.add_argument("--models", nargs="*", default=None, help="a subset of mamba1 mamba2 hybrid gdn")
    parser.add_argument("--out", type=Path, default=None, help="JSON results (a .md table beside it)")
    args = parser.parse_args(argv)
    import jax

    assert len(jax.devices()) == 8, "run as a script: the 8 simulated devices are set before jax starts"
    rows = measure(args.length, args.map_length, args.seq, args.models)
    if args.out is not None:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")
        args.out.with_suffix(".md").write_text(markdown(rows))
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
