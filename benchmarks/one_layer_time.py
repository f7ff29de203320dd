"""One 130m-shaped layer's full l2 matrix in one call: wall and CPU seconds (compile included) and the
process's peak RSS. The issue's target: one layer at L = 4096 in <= 2 min (Mamba-2), <= 3 min (Mamba-1).

    python benchmarks/one_layer_time.py 2 4096      # VERSION LENGTH: ~1.5-2 min (Mamba-2), ~2-4 (Mamba-1)
    python benchmarks/one_layer_time.py 2 21632 --precision bfloat16   # long L: memory, in less time
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from shapes import shape  # noqa: E402

import latim_jax  # noqa: E402
from latim_jax.latim.memory import estimate as memory_estimate  # noqa: E402
from latim_jax.latim.scores import PRECISIONS  # noqa: E402
from latim_jax.model.init import init_params  # noqa: E402


def positive_int(text: str) -> int:
    """argparse type: an int >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, found {value}")
    return value


def main(argv=None) -> int:
    """Time one call for ``VERSION LENGTH`` and print one line."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("version", type=int, choices=(1, 2), help="Mamba version")
    p.add_argument("length", type=positive_int, help="prompt length L")
    p.add_argument("--precision", default="float32", choices=PRECISIONS, help="the projection")
    args = p.parse_args(argv)
    version, length = args.version, args.length
    cfg = latim_jax.MambaConfig(**shape("130m", version, n_layers=1))
    model = latim_jax.MambaLM(cfg, init_params(cfg, 0))
    tokens = np.random.default_rng(0).integers(0, 50000, (1, length))
    estimate = memory_estimate(model, 1, length, method="l2")
    wall, cpu = time.perf_counter(), time.process_time()
    kw = dict(method="l2", memory_limit=None, precision=args.precision)
    scores = latim_jax.attribute(model, tokens, **kw).scores
    scores = np.asarray(jax.block_until_ready(scores))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
    print(
        f"Mamba-{version} L={length} l2 {args.precision}, one layer, first call (compile included): wall "
        f"{wall:.1f} s, CPU {cpu:.1f} s, process peak RSS {peak:.2f} GiB (the library's estimate "
        f"{estimate.total / 2**30:.2f} GiB), all finite {bool(np.isfinite(scores).all())}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
