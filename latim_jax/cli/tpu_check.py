"""``latim-jax tpu-check MODEL --chip v5e``: compile a model's programs for a TPU generation from this
host (a CPU will do) and report the memory each needs.

The programs: the model's forward over (batch, length) tokens, and one layer's scores for every
target row (the program ``attribute`` runs per layer) for the first layer of each layer kind, each
built with the Pallas kernels for that TPU (``resolve("pallas", chip=...)``), its parameters passed
as arguments. Each is compiled for a compile-only device (:mod:`latim_jax.parallel.tpu_check`), which
runs Mosaic's layout passes and the VMEM check; a tile over the chip's VMEM budget is refused by the
kernels first (:mod:`latim_jax.kernels.vmem`). Needs libtpu: run it as

    pip install "jax[tpu]==<this jax>"   # libtpu, about 210 MB; no TPU needed
    JAX_PLATFORMS=cpu ALLOW_MULTIPLE_LIBTPU_LOAD=1 latim-jax tpu-check mamba2-130m --chip v5e

Exit code 1 when a program fails to compile (the line says why), 2 without libtpu.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from latim_jax.cli.args import RunFailed, UsageError, load_model, positive_int
from latim_jax.kernels.block_sizes import Blocks
from latim_jax.latim.kinds import factors
from latim_jax.latim.scores import LATIM_METHODS, layer_scores
from latim_jax.parallel.chips import TPU_CHIPS, check_chip
from latim_jax.parallel.context import Context, resolve
from latim_jax.parallel.tpu_check import Compiled, NoLibtpu, compile_for_tpu, compile_only_device


def model_programs(model, ctx: Context, *, batch: int, length: int, method: str, blocks=None):
    """(name, function, arguments) of the programs to compile: the forward, then one layer's scores
    (every row; ``blocks`` the tiles) for the first layer of each kind. Parameters are arguments."""
    tokens = jax.ShapeDtypeStruct((batch, length), jnp.int32)
    mask = jax.ShapeDtypeStruct((batch, length), jnp.bool_)
    h = jax.ShapeDtypeStruct((batch, length, model.config.d_model), jnp.float32)
    graph, params = nnx.split(model)

    def forward(params, tokens):
        return nnx.merge(graph, params)(tokens, impl=ctx)

    out = [("forward", forward, (params, tokens))]
    seen = set()
    for index, block in enumerate(model.layers):
        if block.kind in seen:
            continue
        seen.add(block.kind)
        block_graph, block_params = nnx.split(block)

        def scores(params, h, mask, block_graph=block_graph):
            f = factors(nnx.merge(block_graph, params), h, mask, ctx)
            rows = jnp.arange(h.shape[1])
            return layer_scores(f, method, rows, mask=mask, ctx=ctx, blocks=blocks)

        out.append((f"layer {index} ({block.kind}) {method}", scores, (block_params, h, mask)))
    return out


def check_model(model, chip: str, *, batch=1, length=512, method="l2", blocks=None) -> list[Compiled]:
    """Compile :func:`model_programs` for one chip of TPU generation ``chip`` (Pallas kernels, that
    generation's VMEM budget) on a compile-only device; one :class:`Compiled` per program. Needs libtpu
    (:class:`~latim_jax.parallel.tpu_check.NoLibtpu` otherwise)."""
    chip = check_chip(chip)
    device = compile_only_device(chip)
    ctx = resolve("pallas", chip=chip)
    programs = model_programs(model, ctx, batch=batch, length=length, method=method, blocks=blocks)
    return [compile_for_tpu(fn, *args, chip=chip, name=name, device=device) for name, fn, args in programs]


def add_parser(sub, common=()) -> None:
    """Register ``latim-jax tpu-check`` on the CLI's subparsers (``common``: parent parsers)."""
    p = sub.add_parser(
        "tpu-check",
        parents=list(common),
        help="compile a model's programs for a TPU generation from this host; report their memory",
    )
    p.add_argument("model", help="local directory, shipped name or hub id")
    p.add_argument(
        "--chip", nargs="+", default=["v5e"], help=f"TPU generations: {', '.join(TPU_CHIPS)} (default v5e)"
    )
    p.add_argument("--length", type=positive_int, default=512, help="tokens per prompt (default 512)")
    p.add_argument("--batch", type=positive_int, default=1, help="prompts (default 1)")
    p.add_argument("--method", default="l2", choices=LATIM_METHODS, help="the score compiled (default l2)")
    p.add_argument("--rows", type=positive_int, default=None, help="score tile rows (Blocks(rows=...))")
    p.add_argument("--cols", type=positive_int, default=None, help="score tile columns (Blocks(cols=...))")
    p.set_defaults(func=cmd_tpu_check)


def cmd_tpu_check(args) -> None:
    """Run ``latim-jax tpu-check``: one line per (chip, program); RunFailed if any program failed."""
    try:
        chips = [check_chip(c) for c in args.chip]
    except ValueError as err:
        raise UsageError(str(err)) from err
    model = load_model(args.model)
    blocks = Blocks(rows=args.rows, cols=args.cols)
    failed = 0
    for chip in chips:
        try:
            results = check_model(model, chip, batch=args.batch, length=args.length, method=args.method,
                                  blocks=blocks)  # fmt: skip
        except NoLibtpu as err:
            raise UsageError(str(err)) from err
        for result in results:
            print(result.line(), flush=True)
            failed += not result.ok
    if failed:
        raise RunFailed(f"{failed} program(s) did not compile")
