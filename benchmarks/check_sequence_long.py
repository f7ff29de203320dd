"""One long prompt split over the mesh's "seq" axis equals one device at L >= 32k (issue 43 item 2): the
logits and every attribution method on the last row and a row subset, on 8 simulated CPU devices.

    python benchmarks/check_sequence_long.py                     # L = 32768 (over an hour on 2 cores)
    python benchmarks/check_sequence_long.py --length 4096 --models mamba1
    python benchmarks/check_sequence_long.py --out benchmarks/results/sequence_long.json

A check, not a test (its run time is CI's budget): tiny random models (d = 16) of each kind that splits
the sequence: Mamba-1; Mamba-2 beside attention, MLP and experts; Gated DeltaNet with attention; KDA with
latent attention. One prompt of ``--length`` tokens, left-padded by 1000 (the padding crosses no shard
boundary at 32k: shards are 4096 long; tests/parallel/test_sequence_attribution.py covers padding across
shards at a small length). For each model: the logits, then l2, alti, logit, grad_input and hidden
attention (minmax: its range spans every row, so it costs the whole map) on the rows l - 1, 7 l/8 + 2
and 3 l/8 + 1 (early in a shard, where the state carried in from earlier shards matters) and pad + 500
(in the first shard, after the padding), one device against seq = 8; the logits on the real positions.
Every error is max |split - one| / max |one| over the whole compared array.
Writes one JSON line per comparison and, with --out, the results and a .md table beside them, rewritten
after each comparison (an interrupted run keeps what it finished).
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

METHODS = ("l2", "alti", "logit", "grad_input", "hidden_attention")  # the costly one last (minmax: every row)


def configs() -> dict:
    """The tiny models, one per group of sequence-splitting kinds."""
    from latim_jax.model.config import MambaConfig

    small = dict(version=2, d_model=16, vocab_size=32, d_state=4, head_dim=4, n_groups=2, chunk_size=64)
    attn = dict(attn_heads=2, attn_kv_heads=1, attn_head_dim=8, mlp_width=24, mlp_gated=True)
    return {
        "mamba1": MambaConfig(version=1, d_model=16, n_layers=2, vocab_size=32, d_state=4, proj_bias=True),
        "hybrid": MambaConfig(n_layers=4, layer_kinds=("mamba2", "attention", "mlp", "moe"), rope_theta=100.0,
                              moe_experts=4, moe_top_k=2, moe_width=8, moe_shared_width=8, **small, **attn),
        "gdn": MambaConfig(version=2, d_model=16, n_layers=2, vocab_size=32, layer_kinds=("gdn", "attention"),
                           **attn, sections={"gdn": dict(k_heads=2, v_heads=4, k_dim=8, v_dim=6, chunk=64)}),
        "kda": MambaConfig(version=2, d_model=16, n_layers=2, vocab_size=32, layer_kinds=("kda", "mla"),
                           sections={"kda": dict(k_heads=2, v_heads=2, k_dim=8, v_dim=8, chunk=64),
                                     "mla": dict(heads=2, kv_rank=4, nope_dim=4, shared_dim=2, v_dim=3)}),
    }  # fmt: skip


def rel(a, b) -> float:
    """max |a - b| / max |b| in float64."""
    import numpy as np

    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def check(name: str, cfg, length: int, pad: int, devices, methods=METHODS):
    """The comparisons of one model, each yielded when done: logits, then each method's scores (and
    floating extras)."""
    import numpy as np
    from jax.sharding import Mesh

    import latim_jax
    from latim_jax.model.init import init_params

    params = init_params(cfg, 1)
    tokens = np.random.default_rng(0).integers(0, 32, (1, length))
    mask = np.ones(tokens.shape, bool)
    mask[:, :pad] = False
    mesh = Mesh(np.asarray(devices).reshape(8), ("seq",))
    # real positions of the prompt, each once: the last, the third of the last shard and the second of
    # the fourth (there the state carried in from the earlier shards has not decayed: rows deep in a
    # shard see little of it), and one in the first shard after the padding
    w = length // 8
    rows = sorted(r for r in {length - 1, 7 * w + 2, 3 * w + 1, min(pad + 500, length - 1)} if r >= pad)
    model = latim_jax.MambaLM(cfg, params)
    t = time.perf_counter()
    err = rel(model(tokens, mask=mask, mesh=mesh)[mask], model(tokens, mask=mask)[mask])  # real positions
    yield {"model": name, "L": length, "what": "logits", "rel_err": err, "s": time.perf_counter() - t}
    for method in methods:
        t = time.perf_counter()
        call = dict(method=method, mask=mask, rows=rows, impl="xla", memory_limit=None)
        want = latim_jax.attribute(latim_jax.MambaLM(cfg, params), tokens, **call)
        got = latim_jax.attribute(latim_jax.MambaLM(cfg, params), tokens, mesh=mesh, **call)
        errs = {"scores": rel(got.scores, want.scores)}
        for key, value in want.extra.items():
            if np.asarray(value).dtype.kind == "f":
                errs[key] = rel(got.extra[key], value)
        yield {"model": name, "L": length, "what": method, "rows": rows, "rel_err": max(errs.values()),
               "errors": errs, "s": time.perf_counter() - t}  # fmt: skip


def markdown(results: list[dict]) -> str:
    """The results as a table: one row per model and comparison."""
    lines = [
        "## One long prompt over seq = 8 against one device (max |split - one| / max |one|)",
        "",
        "| model | L | compared | rows | relative error | s (both runs) |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        rows = " ".join(str(x) for x in r.get("rows", [])) or "-"
        err, s = f"{r['rel_err']:.1e}", f"{r['s']:.0f}"
        lines.append(f"| {r['model']} | {r['L']} | {r['what']} | {rows} | {err} | {s} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    import jax

    from latim_jax.io.atomic import write_bytes_atomic

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=32768, help="the prompt's length (a multiple of 8)")
    parser.add_argument("--pad", type=int, default=1000, help="left padding positions")
    parser.add_argument("--models", nargs="*", default=None, help="a subset of mamba1 hybrid gdn kda")
    parser.add_argument("--methods", nargs="*", default=list(METHODS), help=f"of {' '.join(METHODS)}")
    parser.add_argument("--tol", type=float, default=1e-5, help="the largest relative error accepted")
    parser.add_argument("--out", type=Path, default=None, help="JSON results (a .md table beside it)")
    args = parser.parse_args(argv)
    if len(jax.devices()) < 8:
        parser.error(f"needs 8 devices (simulated on CPU when run as a script), found {len(jax.devices())}")
    cfgs = configs()
    names = args.models or list(cfgs)
    unknown = sorted(set(names) - set(cfgs))
    if unknown:
        parser.error(f"unknown models {unknown}; choose from {sorted(cfgs)}")
    bad = sorted(set(args.methods) - set(METHODS))
    if bad:
        parser.error(f"unknown methods {bad}; choose from {list(METHODS)}")
    if args.length % 8 or not 0 <= args.pad < args.length - 1:
        parser.error(f"--length must be a multiple of 8, --pad in [0, length - 1): {args.length}, {args.pad}")
    if args.out and not args.out.parent.is_dir():  # refused before the first (long) comparison
        parser.error(f"--out {args.out}: the directory {args.out.parent} does not exist")
    results = []
    for name in names:
        for r in check(name, cfgs[name], args.length, args.pad, jax.devices()[:8], args.methods):
            print(json.dumps(r), flush=True)
            results.append(r)
            if args.out:  # rewritten after each comparison: an interrupted run keeps what it finished
                write_bytes_atomic(args.out, (json.dumps({"results": results}, indent=1) + "\n").encode())
                write_bytes_atomic(args.out.with_suffix(".md"), markdown(results).encode())
    worst = max(r["rel_err"] for r in results)
    print(f"worst relative error {worst:.2e} (tolerance {args.tol:.0e})")
    return 0 if worst <= args.tol else 1


if __name__ == "__main__":
    sys.exit(main())
