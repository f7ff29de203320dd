"""Write BENCHMARKS.md: the current numbers and the commands that produce them.

    python benchmarks/report.py            # rewrites BENCHMARKS.md at the repository root

BENCHMARKS.md holds the targets table (benchmarks/targets.md, hand-written), the tables of the
current result files (:data:`CURRENT`, in that order), the commands, the machine, and a list linking
every other result file of benchmarks/results/ (earlier runs, kept as the record). The lab notes stay
in benchmarks/notes.md, linked, not copied.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_scaling  # noqa: E402
import bench_vs_torch  # noqa: E402
import harness as H  # noqa: E402

ROOT = H.HERE.parent
COMMANDS = """\
```bash
# the whole 24-layer 130m model at L = 512 against the fair PyTorch (about 40 minutes)
python benchmarks/bench_vs_torch.py --shapes 130m --scopes model --model-lengths 512 --forward-lengths \\
    --plain-max-length 0 --runs 1 --budget-s 1 --torch-runs 0 --out benchmarks/results/vs_torch_model_512.json
# last row of 24 layers at 1k / 4k / 16k, throughput, a 2.8b-shaped model over 8 simulated devices
python benchmarks/bench_scale_out.py all --out benchmarks/results/scale_out.json
# two checkouts on the same workloads (did a change keep speed and memory?)
python benchmarks/bench_ab.py --a OLD_CHECKOUT --b . --out benchmarks/results/ab.json
# latim-jax vs the PyTorch way, every shape and scope (each measurement a guarded subprocess)
python benchmarks/bench_vs_torch.py --quick                 # validation, tiny shapes (minutes)
nice -n 10 python benchmarks/bench_vs_torch.py              # full run (hours; see its docstring)
# scaling: time/memory vs L and batch, largest L under a cap, last-row cost, compile time vs depth
python benchmarks/bench_scaling.py --quick
nice -n 10 python benchmarks/bench_scaling.py
# fp32 vs precision="bfloat16" (the bf16 projection), one layer per version (~6 min)
python benchmarks/bench_precision.py
# one layer's full matrix at L = 4096 (the issue's 2 / 3 minute targets)
python benchmarks/one_layer_time.py 2 4096
# the gradient's time and memory against the forward
python benchmarks/bench_gradients.py --lengths 256 1024 4096
python benchmarks/bench_gradients.py --d-model 128 --lengths 1024 2048 4096 \\
    --out benchmarks/results/gradients_d128.json
python benchmarks/bench_gradients.py --lengths 1024 --repeats 1 \\
    --out benchmarks/results/gradients_130m_1024.json
python benchmarks/bench_gradients.py --lengths 2048 --repeats 0 \\
    --out benchmarks/results/gradients_130m_2048.json
python benchmarks/bench_gradients.py --versions 2 --d-model 128 --lengths 1024 2048 4096 \\
    --out benchmarks/results/gradients_m2_d128.json
python benchmarks/bench_gradients.py --versions 2 --lengths 1024 --repeats 1 \\
    --out benchmarks/results/gradients_m2_130m_1024.json
python benchmarks/bench_gradients.py --versions 1 --lengths 1024 --repeats 1 \\
    --out benchmarks/results/gradients_130m_1024_m1.json
python benchmarks/bench_gradients.py --versions 1 --lengths 2048 --repeats 0 \\
    --out benchmarks/results/gradients_130m_2048_m1.json
python benchmarks/bench_gradients.py --versions 1 --d-model 128 --lengths 1024 2048 4096 \\
    --out benchmarks/results/gradients_d128_m1.json
python benchmarks/bench_gradients.py --versions 1 --lengths 1024 --repeats 1 \\
    --out benchmarks/results/gradients_130m_1024_m1_rows.json
python benchmarks/bench_gradients.py --versions 2 --lengths 1024 --repeats 1 \\
    --out benchmarks/results/gradients_m2_130m_1024_rows.json
python benchmarks/bench_gradients.py --versions 1 --d-model 128 --lengths 1024 2048 4096 \\
    --out benchmarks/results/gradients_d128_m1_rows.json
python benchmarks/bench_gradients.py --versions 2 --d-model 128 --lengths 1024 2048 4096 \\
    --out benchmarks/results/gradients_m2_d128_rows.json
python benchmarks/bench_gradients.py --versions 1 2 --d-model 128 --lengths 1024 --repeats 10 \\
    --out benchmarks/results/gradients_d128_1024_rows.json
python benchmarks/bench_gradients.py --versions 1 --lengths 2048 --repeats 0 \\
    --out benchmarks/results/gradients_130m_2048_m1_rows.json
python benchmarks/bench_gradients.py --lengths 4096 --compile-only \\
    --out benchmarks/results/gradients_130m_4096_compiled_rows.json
# Mamba-2's tiles of Blocks.tangent_rows = 16 rows under differentiation, beside the unsplit tiles
python benchmarks/bench_gradients.py --versions 2 --lengths 1024 \\
    --out benchmarks/results/gradients_m2_130m_1024_tangent.json
python benchmarks/bench_gradients.py --versions 2 --lengths 1024 --tangent-rows 64 \\
    --out benchmarks/results/gradients_m2_130m_1024_unsplit.json
python benchmarks/bench_gradients.py --versions 2 --d-model 128 --lengths 1024 --repeats 10 \\
    --out benchmarks/results/gradients_m2_d128_1024_tangent.json
python benchmarks/bench_gradients.py --versions 2 --d-model 128 --lengths 1024 --repeats 10 \\
    --tangent-rows 64 --out benchmarks/results/gradients_m2_d128_1024_unsplit.json
python benchmarks/bench_gradients.py --versions 2 --d-model 128 --lengths 4096 --repeats 2 \\
    --out benchmarks/results/gradients_m2_d128_4096_tangent.json
python benchmarks/bench_gradients.py --versions 2 --d-model 128 --lengths 4096 --repeats 2 \\
    --tangent-rows 64 --out benchmarks/results/gradients_m2_d128_4096_unsplit.json
python benchmarks/bench_gradients.py --versions 2 --d-model 128 --lengths 1024 2048 4096 --repeats 5 \\
    --out benchmarks/results/gradients_m2_d128_tangent.json
python benchmarks/bench_gradients.py --versions 2 --lengths 2048 4096 --compile-only \\
    --out benchmarks/results/gradients_m2_130m_compiled_tangent.json
python benchmarks/bench_gradients.py --lengths 4096 --repeats 0 \\
    --out benchmarks/results/gradients_130m_4096.json  # ~30 min
python benchmarks/bench_gradients.py --lengths 4096 --compile-only \\
    --out benchmarks/results/gradients_130m_4096_compiled.json
# a Nemotron-H-shaped hybrid beside Mamba-2 (last row at 4096, full map at 1024; ~12 min)
python benchmarks/bench_hybrid.py
# Gated DeltaNet M tiles, chunk factors against the one-hot scan per tile (~15 min; --no-scan-long ~8)
python benchmarks/bench_delta_rule_tiles.py
# the delta-rule tile kernel's compiled memory beside the XLA tiles (compiles only)
python benchmarks/bench_delta_rule_kernel_memory.py
# grad_input before / after the gathered target logits (one process, values compared)
python benchmarks/bench_grad_input.py
# the collectives of a model-parallel forward / attribute / gradient per layer, and a 7B pod estimate
python benchmarks/bench_collectives.py --out benchmarks/results/collectives.json
# one prompt's length over a "seq" mesh axis (8 simulated devices): the forward's collectives and
# memory per device, attribute's per-device memory, the pod estimate, and equality with one device at 32k
python benchmarks/bench_sequence_axis.py --out benchmarks/results/sequence_axis.json
python benchmarks/bench_sequence_attribution.py --out benchmarks/results/sequence_attribution.json
python benchmarks/pod_estimate.py
python benchmarks/check_sequence_long.py --methods l2 alti logit --out benchmarks/results/sequence_long.json
# this file
python benchmarks/report.py
# the PyTorch baseline equals latim-jax (every method, both modes, both versions)
python -m pytest -q tests/latim/test_torch_baseline.py
# Pallas kernels on a GPU, when one is lent
python benchmarks/gpu_check.py
```
"""


# the newest run of each measurement, in the order BENCHMARKS.md shows them
CURRENT = (
    "hybrid",  # a Nemotron-H-shaped hybrid beside plain Mamba-2 of the same width (issue 25)
    "delta_rule_tiles",  # Gated DeltaNet M tiles: per-chunk factors against the one-hot scan (issue 42)
    "delta_rule_kernel_memory",  # the same tiles as a Pallas kernel: compiled memory (issue 42)
    "collectives",  # what a model-parallel run moves per layer, and a 7B pod estimate (issue 26)
    "gradients_m2_130m_1024_tangent",  # Mamba-2, 16-row tiles under differentiation, 130m, L = 1024
    "gradients_m2_130m_1024_unsplit",  # the same code with the unsplit tiles (--tangent-rows 64)
    "gradients_m2_d128_1024_tangent",  # the pair at d 128, L = 1024, medians of 10 calls
    "gradients_m2_d128_1024_unsplit",
    "gradients_m2_d128_4096_tangent",  # the pair at d 128, L = 4096, medians of 2 calls
    "gradients_m2_d128_4096_unsplit",
    "gradients_m2_d128_tangent",  # d 128, L = 1024 / 2048 / 4096 (one call at 4096)
    "gradients_m2_130m_compiled_tangent",  # 130m, L = 2048 / 4096, compiled temporaries
    "gradients_130m_1024_m1_rows",  # Mamba-1 after the taps' scan and 16-row tangent passes, 130m, 1024
    "gradients_130m_2048_m1_rows",  # the same at L = 2048
    "gradients_m2_130m_1024_rows",  # Mamba-2 with its sliced taps restored, 130m, L = 1024
    "gradients_d128_m1_rows",  # Mamba-1 at d 128, L = 1024 / 2048 / 4096
    "gradients_m2_d128_rows",  # Mamba-2 at d 128
    "gradients_d128_1024_rows",  # both at d 128, L = 1024, medians of 10 calls
    "gradients_130m_4096_compiled_rows",  # both at the 130m width, L = 4096, compiled temporaries
    "gradients_130m_1024_m1",  # Mamba-1 after the tap windows and S's one tangent, 130m, L = 1024
    "gradients_130m_2048_m1",  # the same at L = 2048
    "gradients_d128_m1",  # the same at d 128, L = 1024 / 2048 / 4096
    "gradients_130m_4096",  # both versions at the 130m width, L = 4096
    "gradients_130m_4096_compiled",  # the same, compiled temporaries only
    "gradients_130m_1024",  # the gradient against the forward after the static schedule (issue 26)
    "gradients_m2_d128",  # Mamba-2 after its tile's cond (M and the taps written out once), d 128
    "gradients_m2_130m_1024",  # the same at the 130m width
    "gradients_130m_2048",  # both versions at the 130m width, L = 2048
    "gradients_d128",  # the same at a small width, L = 1024 / 2048 / 4096 (issue 26)
    "grad_input",  # grad_input through the gathered target logits against the whole-logits VJP (issue 26)
    "ab_redesign",  # the redesign (issue 24) against the code before it, same workloads, one job
    "vs_torch_model_512",  # the whole 24-layer 130m model at L = 512 against the fair PyTorch
    "vs_torch_methods_512_amx",  # one layer, every method, fair and plain PyTorch
    "scale_out",  # last row at 1k / 4k / 16k, throughput, a 2.8b-shaped model over 8 devices
    "scaling_rows_m1",  # Mamba-1 row subsets and last rows
    "precision",  # fp32 vs the bf16 projection
    "gradients",  # the gradient's time and memory against the forward
    "scaling",  # time and memory vs length and batch, compile time vs depth
)


def section(path: Path) -> list[str]:
    """One result file: where it came from, then its tables."""
    data = json.loads(path.read_text())
    kind = data.get("kind")
    if kind not in ("vs_torch", "scaling"):  # gradients, scale-out, A/B: the markdown their script wrote
        md = path.with_suffix(".md")
        body = md.read_text().strip() if md.is_file() else "(no markdown beside it)"
        return [f"## {path.name}", "", body, ""]
    m = data.get("machine", {})
    quick = data.get("settings", {}).get("quick")
    title = f"## {path.name}" + (" (quick validation: tiny shapes, not performance numbers)" if quick else "")
    lines = [
        title,
        "",
        f"Command: `{data.get('command', '?')}`  ",
        f"Run: {data.get('created', '?')} to {data.get('finished', 'unfinished')}; load average at the start "
        f"{m.get('loadavg_at_start', '?')} on {m.get('cores', '?')} cores (above the core count the machine "
        "was shared and times are inflated).",
        "",
    ]
    if kind == "vs_torch":
        data.setdefault("forward", [])
        lines.append(bench_vs_torch.tables(data))
    elif kind == "scaling":
        lines.append(bench_scaling.tables(data))
    return lines


def machine_section(files: list[Path]) -> list[str]:
    """Machine and versions of the newest full (else any) result."""
    if not files:
        return ["No result files yet: run the commands above.", ""]
    data = json.loads(files[0].read_text())
    m, v = data.get("machine", {}), data.get("versions", {})
    return [
        "## Machine and versions",
        "",
        f"- CPU: {m.get('cpu')} ({m.get('cores')} cores visible; flags: {m.get('cpu_flags') or '-'}), "
        f"RAM {m.get('ram_gib')} GiB, {m.get('os')}",
        "- " + ", ".join(f"{k} {val}" for k, val in v.items()),
        f"- torch threads: {data.get('torch_threads', '-')}; jax: its default CPU thread pool",
        "",
    ]


def build(results: Path, targets: Path) -> str:
    current = [results / f"{name}.json" for name in CURRENT if (results / f"{name}.json").is_file()]
    out = [
        "# Benchmarks",
        "",
        "Generated by `python benchmarks/report.py` from `benchmarks/results/*.json`; the targets table is "
        "`benchmarks/targets.md`, the lab notes (every measurement and what was tried, oldest first) are "
        "[benchmarks/notes.md](benchmarks/notes.md).",
        "",
        "latim-jax against LaTIM computed the PyTorch way (`benchmarks/torch_baseline.py`: channel-first, "
        "the per-channel hidden attention (D, L, L), the conv-corrected weights and T (L, L, d) "
        "materialised, then the score; 'fair' = flush denormals + decay exponent clamped at -80, 'plain' = "
        "neither), on random-weight models of the real 130m shape, plus the scaling of latim-jax alone and "
        "the floor (`benchmarks/floor.py`: 2 * L^2/2 * D * d flops of the causal-half projection and the "
        "decay exponentials, at this machine's measured matmul and exp rates). Only numbers of one job "
        "compare: the machine differs from run to run (each section states its host and load).",
        "",
        "## Where the targets stand",
        "",
        targets.read_text().strip() if targets.is_file() else "(no benchmarks/targets.md)",
        "",
        "## Commands",
        "",
        COMMANDS,
    ]
    out += machine_section([f for f in current if "machine" in json.loads(f.read_text())])
    for f in current:
        out += section(f)
    others = sorted(p for p in results.glob("*.md") if p.with_suffix(".json") not in current)
    out += ["## Earlier runs (the record)", ""]
    out += [f"- [{p.relative_to(ROOT).as_posix()}]({p.relative_to(ROOT).as_posix()})" for p in others]
    out += ["", "Task evaluations (AUC, AER, retrieval) are in `benchmarks/results/tasks/`.", ""]
    return "\n".join(out).rstrip() + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--results", type=Path, default=H.RESULTS)
    p.add_argument("--targets", type=Path, default=H.HERE / "targets.md")
    p.add_argument("--out", type=Path, default=ROOT / "BENCHMARKS.md")
    args = p.parse_args(argv)
    H.write_atomic(args.out, build(args.results, args.targets))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
