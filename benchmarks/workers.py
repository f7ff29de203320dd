"""Measurement children: one measurement per process, one JSON line on stdout (see harness.run_worker).

    python benchmarks/workers.py '{"task": "attribute", "impl": "jax", "model_dir": ..., ...}'

Tasks: probe (versions), prepare (build + save a random transformers model), attribute (latim-jax or
the PyTorch baseline), forward (latim-jax vs transformers), matmul / exp (this machine's rates),
compile (latim-jax compile time of a random model built in-process, for the depth test).

Memory: VmRSS after the model is loaded is ``rss_load_gib``; the peak counter (VmHWM) is then reset
(/proc/self/clear_refs), so ``peak_gib`` is the peak during the measured calls and ``working_gib`` =
peak - load is the memory the computation itself needed. A process that imports jax never imports torch
and vice versa.
"""

from __future__ import annotations

import gc
import inspect
import json
import re
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _status_gib(key: str) -> float:
    m = re.search(rf"^{key}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)
    return int(m.group(1)) / 2**20


def reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where not permitted."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def timed(fn, runs: int, budget_s: float, sync):
    """First call (compile + run), then up to ``runs`` timed calls, stopping once they took ``budget_s``
    (at least one when runs >= 1). Returns (last output, first_s, [times], cpu seconds of the runs)."""
    t0 = time.perf_counter()
    out = sync(fn())
    first = time.perf_counter() - t0
    times = []
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    while len(times) < runs:
        t0 = time.perf_counter()
        out = sync(fn())
        times.append(time.perf_counter() - t0)
        if sum(times) >= budget_s:
            break
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    return out, first, times, cpu


def summary(first, times, cpu, rss_load, reset_ok) -> dict:
    """The common fields of a timing record. With no timed call (``runs`` = 0: torch on calls of
    minutes, where there is nothing to compile) the first call is the time and ``compile_s`` is None."""
    med = statistics.median(times) if times else first
    peak = _status_gib("VmHWM")
    return {
        "first_s": first,
        "times_s": times,
        "median_s": med,
        "compile_s": max(first - med, 0.0) if times else None,
        "cpu_util": None if not times else cpu / sum(times),
        "rss_load_gib": rss_load,
        "peak_gib": peak,
        "working_gib": peak - rss_load if reset_ok else None,
        "peak_reset": reset_ok,
    }


def prompts(spec):
    import numpy as np

    rng = np.random.default_rng(spec.get("seed", 0))
    return rng.integers(0, spec["vocab"], (spec.get("batch", 1), spec["length"]))


def load_jax(spec):
    import latim_jax

    return latim_jax.load(spec["model_dir"])


def load_torch(spec):
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        spec["model_dir"], dtype=torch.float32, use_kernels=False
    )
    return model.eval()


def task_probe(spec):
    """Versions of everything measured, and whether attribute() takes ``aggregation=``."""
    import flax
    import jax
    import numpy as np
    import torch
    import transformers

    import latim_jax

    return {
        "versions": {
            "latim_jax": latim_jax.__version__,
            "jax": jax.__version__,
            "jaxlib": getattr(jax.lib, "__version__", None) or jax.__version__,
            "flax": flax.__version__,
            "numpy": np.__version__,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": sys.version.split()[0],
        },
        "jax_devices": [str(d) for d in jax.devices()],
        "torch_threads": torch.get_num_threads(),
        "aggregation_supported": "aggregation" in inspect.signature(latim_jax.attribute).parameters,
    }


def task_prepare(spec):
    """Build a random-weight transformers model of ``spec['shape']`` and save_pretrained it."""
    import torch
    import transformers
    from shapes import transformers_config

    torch.manual_seed(spec.get("seed", 0))
    s = spec["shape"]
    cls = transformers.MambaForCausalLM if s["version"] == 1 else transformers.Mamba2ForCausalLM
    t0 = time.perf_counter()
    model = cls(transformers_config(s)).eval()
    model.save_pretrained(spec["model_dir"])
    n = sum(p.numel() for p in model.parameters())
    return {"params": n, "seconds": time.perf_counter() - t0}


def task_attribute(spec):
    """Time and memory of one attribution call (latim-jax or the PyTorch baseline), scores saved on
    request (``save``: a .npy path) for the equality check."""
    import numpy as np

    ids = prompts(spec)
    method, mode = spec["method"], spec.get("mode", "exact")
    rows = spec.get("rows")
    extra = {}
    if spec["impl"] == "jax":
        import jax
        import jax.numpy as jnp

        import latim_jax

        model = load_jax(spec)
        tokens = jnp.asarray(ids)
        kw = dict(method=method, mode=mode, layers=spec.get("layers"), rows=rows)
        if method == "logit":
            kw["target"] = tokens
        if method == "hidden_attention" and spec.get("aggregation_supported"):
            kw["aggregation"] = spec["aggregation"]
        accepted = inspect.signature(latim_jax.attribute).parameters
        if method == "logit" and "rollout_maps" in accepted:  # the logit scores, as torch computes them
            kw["rollout_maps"] = False
        if "memory_limit" in accepted:  # measure what happens, not the library's estimate of it
            kw["memory_limit"] = None
        if spec.get("precision", "float32") != "float32":
            if "precision" not in accepted:
                raise SystemExit("latim_jax.attribute has no precision= (needed for --jax-precision)")
            kw["precision"] = spec["precision"]
        extra["precision"] = spec.get("precision", "float32")
        extra["aggregation"] = kw.get("aggregation", "signed") if method == "hidden_attention" else None

        def fn():
            return latim_jax.attribute(model, tokens, **kw).scores

        sync = jax.block_until_ready
        to_numpy = np.asarray
    else:
        import torch
        import torch_baseline as tb

        model = load_torch(spec)
        ids_t = torch.from_numpy(ids)
        target = ids_t if method == "logit" else None
        agg = spec.get("aggregation", "minmax") if spec.get("aggregation_supported") else "signed"
        extra["aggregation"] = agg if method == "hidden_attention" else None
        extra["threads"] = torch.get_num_threads()

        def fn():
            s = tb.attribute(
                model,
                ids_t,
                method,
                mode,
                spec.get("layers"),
                target=target,
                fair=spec["fair"],
                aggregation=agg,
            )
            return s if rows is None else s[:, :, rows]

        def sync(x):
            return x

        def to_numpy(x):
            return x.numpy()

    gc.collect()
    rss_load = _status_gib("VmRSS")
    reset_ok = reset_peak()
    out, first, times, cpu = timed(fn, spec.get("runs", 3), spec.get("budget_s", 60.0), sync)
    res = {**summary(first, times, cpu, rss_load, reset_ok), **extra}
    if spec.get("save"):
        np.save(spec["save"], to_numpy(out))
    return res


def task_forward(spec):
    """The model forward alone (logits): latim-jax model(tokens) or transformers model(ids).logits."""
    ids = prompts(spec)
    if spec["impl"] == "jax":
        import jax
        import jax.numpy as jnp

        model = load_jax(spec)
        tokens = jnp.asarray(ids)

        def fn():
            return model(tokens)

        sync = jax.block_until_ready
    else:
        import torch

        model = load_torch(spec)
        ids_t = torch.from_numpy(ids)

        def fn():
            with torch.inference_mode():
                return model(ids_t).logits

        def sync(x):
            return x

    gc.collect()
    rss_load = _status_gib("VmRSS")
    reset_ok = reset_peak()
    _, first, times, cpu = timed(fn, spec.get("runs", 3), spec.get("budget_s", 60.0), sync)
    return summary(first, times, cpu, rss_load, reset_ok)


def task_matmul(spec):
    """n x n matmul rate (GFLOP/s = 2 n^3 / median time) in jax or torch, float32 or bfloat16. jax's
    bf16 product accumulates and returns fp32 (``preferred_element_type``), as the library's bf16
    projection does: XLA:CPU's bf16-out product takes another, much slower path (242 against 1588
    GFLOP/s on an AMX Xeon, 2026-12-01). torch's returns bf16 (it has no such option)."""
    n, dtype, reps = spec.get("n", 2048), spec["dtype"], spec.get("reps", 5)
    if spec["impl"] == "jax":
        import jax
        import jax.numpy as jnp

        dt = jnp.dtype(dtype)
        a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.float32).astype(dt)
        b = jax.random.normal(jax.random.PRNGKey(1), (n, n), jnp.float32).astype(dt)
        f = jax.jit(lambda a, b: jnp.matmul(a, b, preferred_element_type=jnp.float32))

        def fn():
            return f(a, b)

        sync = jax.block_until_ready
    else:
        import torch

        dt = getattr(torch, dtype)
        a, b = torch.randn(n, n).to(dt), torch.randn(n, n).to(dt)

        def fn():
            return torch.mm(a, b)

        def sync(x):
            return x

    _, _, times, _ = timed(fn, reps, float("inf"), sync)
    med = statistics.median(times)
    return {"n": n, "dtype": dtype, "median_s": med, "gflops": 2 * n**3 / med / 1e9}


def task_exp(spec):
    """exp throughput (G elements/s) on fp32 inputs uniform in [-30, 0] (decay exponents' range), as
    compute: jax sums exp(x) in one fused pass, torch writes into a preallocated buffer."""
    size, reps = spec.get("size", 1 << 24), spec.get("reps", 5)
    if spec["impl"] == "jax":
        import jax
        import jax.numpy as jnp

        x = jax.random.uniform(jax.random.PRNGKey(0), (size,), jnp.float32, -30.0, 0.0)
        f = jax.jit(lambda x: jnp.sum(jnp.exp(x)))

        def fn():
            return f(x)

        sync = jax.block_until_ready
    else:
        import torch

        torch.set_flush_denormal(spec.get("flush", True))
        x = torch.rand(size) * -30.0
        buf = torch.empty_like(x)

        def fn():
            return torch.exp(x, out=buf)

        def sync(x):
            return x

    _, _, times, _ = timed(fn, reps, float("inf"), sync)
    med = statistics.median(times)
    return {"size": size, "median_s": med, "gexp_per_s": size / med / 1e9}


def task_compile(spec):
    """Compile time (first call - steady state) of attribute() and of the forward for a random model
    built in-process from ``spec['config']`` (latim_jax.MambaConfig fields)."""
    import jax
    import jax.numpy as jnp

    import latim_jax
    from latim_jax.model.init import init_params

    cfg = latim_jax.MambaConfig(**spec["config"])
    model = latim_jax.MambaLM(cfg, init_params(cfg, spec.get("seed", 0)))
    tokens = jnp.asarray(prompts({**spec, "vocab": cfg.vocab_size}))
    runs = spec.get("runs", 3)

    def fwd():
        return model.forward(tokens).logits

    def attr():
        return latim_jax.attribute(model, tokens, method=spec.get("method", "l2")).scores

    _, f_first, f_times, _ = timed(fwd, runs, float("inf"), jax.block_until_ready)
    _, a_first, a_times, _ = timed(attr, runs, float("inf"), jax.block_until_ready)
    fm, am = statistics.median(f_times), statistics.median(a_times)
    return {
        "forward_first_s": f_first,
        "forward_median_s": fm,
        "forward_compile_s": max(f_first - fm, 0.0),
        "attribute_first_s": a_first,
        "attribute_median_s": am,
        "attribute_compile_s": max(a_first - am, 0.0),
    }


def task_built(spec):
    """Time and memory of one attribution call on a model built from ``spec['config']`` (MambaConfig
    fields, random weights with seed ``spec['seed']``: hybrids need no transformers checkpoint)."""
    import jax
    import jax.numpy as jnp

    import latim_jax
    from latim_jax.model.init import init_params

    config = latim_jax.MambaConfig.from_dict(spec["config"])
    model = latim_jax.MambaLM(config, init_params(config, spec.get("seed", 0)))
    tokens = jnp.asarray(prompts({**spec, "vocab": config.vocab_size}))
    kw = dict(method=spec["method"], rows=spec.get("rows"), memory_limit=None)

    def fn():
        return latim_jax.attribute(model, tokens, **kw).scores

    gc.collect()
    rss_load = _status_gib("VmRSS")
    reset_ok = reset_peak()
    _, first, times, cpu = timed(fn, spec.get("runs", 2), spec.get("budget_s", 60.0), jax.block_until_ready)
    return summary(first, times, cpu, rss_load, reset_ok)


TASKS = {
    "probe": task_probe,
    "built": task_built,
    "prepare": task_prepare,
    "attribute": task_attribute,
    "forward": task_forward,
    "matmul": task_matmul,
    "exp": task_exp,
    "compile": task_compile,
}


def main() -> None:
    spec = json.loads(sys.argv[1])
    task = spec.get("task")
    if task not in TASKS:
        raise SystemExit(f"unknown task {task!r}; expected one of {sorted(TASKS)}")
    print(json.dumps({"task": task, **TASKS[task](spec)}), flush=True)


if __name__ == "__main__":
    main()
