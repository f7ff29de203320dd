"""Where the time of one layer's attribution goes, stage by stage, in latim-jax and in the PyTorch way.

    python benchmarks/profile_layer.py --version 2 --method l2 --length 512      # 130m shape: ~1-2 min
    python benchmarks/profile_layer.py --quick                                     # tiny: seconds

latim-jax (each stage jitted on its own, median of --runs after a warm-up call): the forward, the
layer factors (latim_jax.latim.kinds.layer_factors: intermediates, tap values, token total), the
blocked scores (latim_jax.latim.scores.layer_scores), with the floor (benchmarks/floor.py) for scale.
PyTorch (benchmarks/torch_baseline.py, fair): the hooked transformers forward, the layer values, the
hidden attention M, the gate, the conv-corrected weights W, V = G * W, the projection T = W_out V,
the score. The blocked scores are also split into the pair values alone and the projection alone;
latim-jax's stages report CPU seconds too (steadier than wall time on a shared machine).
One process for both (time only: the memory comparison is bench_vs_torch.py's). Internal
latim_jax functions are called directly, so this script follows the library's internals
(latim.kinds.layer_factors, latim.scores.layer_scores, latim.blocking.blocked).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import floor  # noqa: E402
from shapes import shape as make_shape  # noqa: E402
from shapes import transformers_config  # noqa: E402

CPU: dict[str, float] = {}  # stage -> median process CPU seconds (all threads): steadier when shared


def timeit(fn, runs, sync=lambda x: x, name=None):
    """Median seconds of ``runs`` calls after one warm-up call; returns (median, last output). With
    ``name``, the median process CPU seconds go to CPU[name] (wall time inflates under load, CPU
    time much less)."""
    out = sync(fn())
    times, cpu = [], []
    for _ in range(runs):
        t0, c0 = time.perf_counter(), time.process_time()
        out = sync(fn())
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    if name:
        CPU[name] = statistics.median(cpu)
    return statistics.median(times), out


def profile_jax(path, ids, method, mode, runs) -> dict:
    import jax
    import jax.numpy as jnp

    import latim_jax
    from latim_jax.latim.blocking import blocked
    from latim_jax.latim.kinds import layer_factors
    from latim_jax.latim.scores import layer_scores, project, safe_norm

    model = latim_jax.load(path)
    tokens = jnp.asarray(ids)
    sync = jax.block_until_ready
    fwd = jax.jit(lambda t: model.forward(t).residuals)
    t_fwd, res = timeit(lambda: fwd(tokens), runs, sync, "forward_s")
    factors = jax.jit(lambda h: layer_factors(model, h, 0, mode))
    t_fac, f = timeit(lambda: factors(res[0]), runs, sync, "layer_factors_s")
    L = ids.shape[1]
    rows = jnp.arange(L)
    aux = None
    if method == "logit":  # any direction: the cost does not depend on it
        aux = jnp.ones((ids.shape[0], L, f.W_out.shape[0]), jnp.float32)
    valid = jnp.ones(ids.shape, bool)
    scores = jax.jit(lambda f: layer_scores(f, method, rows, mask=valid, aux=aux))
    t_sc, _ = timeit(lambda: scores(f), runs, sync, "scores_s")
    # the blocked scores split: the pair values V (hidden attention, taps, gate; summed over e) alone,
    # and the projection onto W_out + norm of a constant block alone, over the same causal blocks
    blocks = f.tiles(None, None)

    def value_block(g, rb, j0):
        return g.pair_values(rb, j0, blocks.cols, blocks).sum(-1)

    def projection_block(rb, j0, W):
        return safe_norm(project(const * rb[0], W), -1)

    values = jax.jit(lambda g: blocked(lambda rb, j0: value_block(g, rb, j0), rows, L, blocks))
    t_val, _ = timeit(lambda: values(f), runs, sync, "pair_values_only_s")
    const = jnp.ones((ids.shape[0], blocks.rows, blocks.cols, f.W_out.shape[0]), jnp.float32)
    proj = jax.jit(lambda W: blocked(lambda rb, j0: projection_block(rb, j0, W), rows, L, blocks))
    t_proj, _ = timeit(lambda: proj(f.W_out), runs, sync, "projection_only_s")
    t_all, _ = timeit(
        lambda: latim_jax.attribute(model, tokens, method=method, mode=mode).scores, runs, sync, "attribute_s"
    )
    return {
        "forward_s": t_fwd,
        "layer_factors_s": t_fac,
        "scores_s": t_sc,
        "pair_values_only_s": t_val,
        "projection_only_s": t_proj,
        "attribute_s": t_all,
    }


def profile_torch(path, ids, method, mode, runs) -> dict:
    import torch
    import torch_baseline as tb
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, use_kernels=False
    ).eval()
    ids_t = torch.from_numpy(ids)
    mixer = model.backbone.layers[0].mixer
    stages: dict[str, list[float]] = {}

    def run():
        def mark(name, t0):
            stages.setdefault(name, []).append(time.perf_counter() - t0)
            return time.perf_counter()

        t = time.perf_counter()
        cap = tb.capture(model, ids_t)
        t = mark("forward (hooked)", t)
        lv = tb.layer_values(mixer, cap.xhat[0])
        t = mark("layer values", t)
        if method == "hidden_attention":
            M = tb.hidden_attention(lv, True, with_D=False)
            t = mark("hidden attention M", t)
            tb.aggregate(M, "minmax")
            mark("aggregate", t)
            return
        M = tb.hidden_attention(lv, True)
        t = mark("hidden attention M", t)
        G = lv.G if lv.heads is None else tb.mamba2_gate(M, lv, mixer)
        a = tb.tap_values(lv, mixer.activation, mode)
        t = mark("gate and tap values", t)
        W = tb.conv_weights(M, lv, a)
        del M
        t = mark("conv-corrected W", t)
        W.mul_(G[..., None])
        t = mark("V = G * W", t)
        T = tb.project(W, lv)
        del W
        t = mark("projection T = W_out V", t)
        if method == "logit":
            direction = tb.logit_direction(model, cap, ids_t)
            T.mul_(direction.transpose(1, 2)[..., None]).sum(1)
        elif method == "l2":
            torch.linalg.vector_norm(T, dim=1)
        mark("score" if method != "alti" else "(alti score not split)", t)

    with tb.numerics(True), torch.inference_mode():
        run()
        stages.clear()
        for _ in range(runs):
            run()
        t_all, _ = timeit(lambda: tb.attribute(model, ids_t, method, mode, target=ids_t), runs)
    out = {k: statistics.median(v) for k, v in stages.items()}
    out["attribute_s"] = t_all
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--shape", default="130m")
    p.add_argument("--version", type=int, default=2)
    p.add_argument("--method", default="l2", choices=["l2", "alti", "logit", "hidden_attention"])
    p.add_argument("--mode", default="exact")
    p.add_argument("--length", type=int, default=512)
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--impls", nargs="+", default=["jax", "torch"])
    args = p.parse_args(argv)
    if args.quick:
        args.shape, args.length = "quick", 128
    import numpy as np
    import torch
    import transformers

    s = make_shape(args.shape, args.version, n_layers=1)
    ids = np.random.default_rng(0).integers(0, s["vocab_size"], (1, args.length))
    with tempfile.TemporaryDirectory(prefix="latim-profile-") as tmp:
        torch.manual_seed(0)
        cls = transformers.MambaForCausalLM if args.version == 1 else transformers.Mamba2ForCausalLM
        cls(transformers_config(s)).eval().save_pretrained(tmp)
        result = {"shape": args.shape, "version": args.version, "method": args.method, "length": args.length}
        if "jax" in args.impls:
            result["latim-jax"] = profile_jax(tmp, ids, args.method, args.mode, args.runs)
        if "torch" in args.impls:
            result["torch-fair"] = profile_torch(tmp, ids, args.method, args.mode, args.runs)
    w = floor.work(s, args.method, args.length)
    result["floor"] = {"flops": 2 * w["macs"], "exps": w["exps"], "bytes": w["bytes"]}
    result["latim-jax-cpu"] = dict(CPU)
    for impl in ("latim-jax", "torch-fair"):
        for k, v in result.get(impl, {}).items():
            cpu = f"  ({CPU[k]:.4g} CPU s)" if impl == "latim-jax" and k in CPU else ""
            print(f"{impl:10s} {k:28s} {v:.4g} s{cpu}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
