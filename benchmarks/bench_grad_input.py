"""grad_input before and after the gathered-target-logits backward (issue 26, item 5), side by side in one
process: the previous form (the VJP of the whole (b, l, v) logits with a one-hot cotangent per row,
written out here) against latim_jax's, on a Mamba-2 layer stack with a 50k vocabulary, every row.

Usage: python benchmarks/bench_grad_input.py [--length 256] [--d-model 256] [--layers 4]
Writes benchmarks/results/grad_input.{json,md}.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from harness import RESULTS, machine, markdown_table, now, write_atomic, write_json

import latim_jax
from latim_jax.kernels import f32
from latim_jax.latim.baselines import grad_input_scores
from latim_jax.latim.scores import finish_scores, safe_norm
from latim_jax.model.init import init_params
from latim_jax.model.lm import block_forward


def before(model, h, layer, rows, targets, mask):
    """The previous grad_input: a VJP of the (b, l, v) logits, one dense one-hot cotangent per row."""

    def logits(x):
        for block in model.layers[layer:]:
            x = block_forward(block, x, mask)
        return model.head(x)

    _, vjp = jax.vjp(logits, h.astype(f32))
    b, length = h.shape[:2]

    def one_row(i):
        onehot = jax.nn.one_hot(targets[:, i], model.config.n_tokens, dtype=f32)
        (g,) = vjp(jnp.zeros((b, length, model.config.n_tokens), f32).at[:, i].set(onehot))
        return safe_norm(g * h, -1)

    return finish_scores(jnp.moveaxis(jax.lax.map(one_row, rows), 0, 1), "grad_input", rows, mask)


def _time(fn, runs=2):
    out = jax.block_until_ready(fn())
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return out, min(times)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=50280)
    args = parser.parse_args(argv)
    config = latim_jax.MambaConfig(
        version=2, d_model=args.d_model, n_layers=args.layers, vocab_size=args.vocab, d_state=64, head_dim=64,
        chunk_size=128,
    )  # fmt: skip
    model = latim_jax.MambaLM(config, init_params(config, 0))
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, args.vocab, (1, args.length)))
    targets = jnp.asarray(rng.integers(0, args.vocab, (1, args.length)))
    mask = jnp.ones((1, args.length), bool)
    h = model.forward(tokens).residuals[0]
    rows = jnp.arange(args.length)
    old_fn = jax.jit(lambda h: before(model, h, 0, rows, targets, mask))
    new_fn = jax.jit(lambda h: grad_input_scores(model, h, 0, rows, targets, mask))
    old, t_old = _time(lambda: old_fn(h))
    new, t_new = _time(lambda: new_fn(h))
    err = float(jnp.abs(old - new).max() / jnp.abs(old).max())
    result = {"when": now(), "machine": machine(), "args": vars(args), "before_s": t_old, "after_s": t_new,
              "speedup": t_old / t_new, "max_rel_diff": err}  # fmt: skip
    write_json(RESULTS / "grad_input.json", result)
    table = markdown_table(
        ["L", "d", "layers", "vocab", "before s", "after s", "speedup", "max rel. diff"],
        [[str(args.length), str(args.d_model), str(args.layers), str(args.vocab), f"{t_old:.2f}",
          f"{t_new:.2f}", f"{t_old / t_new:.1f}x", f"{err:.1e}"]],
    )  # fmt: skip
    write_atomic(
        RESULTS / "grad_input.md", f"grad_input, every row, one prompt ({result['when']})\n\n{table}\n"
    )
    print(table)


if __name__ == "__main__":
    main()
