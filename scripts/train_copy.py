"""Train a small Mamba model on the copy task from a JSON config and save it.

Usage: python scripts/train_copy.py CONFIG OUT_DIR [--steps N]

CONFIG: e.g. configs/copy-mamba1.json. OUT_DIR receives params/ (orbax), latim_config.json and
task.json (written atomically); see latim_jax.train.save_trained.
"""

from __future__ import annotations

import argparse

from latim_jax.train import train_from_config


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", help="training config JSON (configs/copy-*.json)")
    parser.add_argument("out", help="output directory (replaced atomically)")
    parser.add_argument("--steps", type=int, default=None, help="override the config's number of steps")
    args = parser.parse_args(argv)
    result = train_from_config(args.config, args.out, steps=args.steps)
    final = result.final
    print(
        f"done: {len(result.losses)} steps in {result.wall_time_s:.0f}s; token accuracy "
        f"{final['token_accuracy']:.4f}, sequence accuracy {final['sequence_accuracy']:.4f} -> {args.out}"
    )


if __name__ == "__main__":
    main()
