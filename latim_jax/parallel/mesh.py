"""Device meshes: the three named axes, and placing, padding and gathering the arrays of a split call.

A mesh has up to three named axes (any may be absent or of size 1):

- "data": prompts. The batch is split over it (padded to a multiple by repeating the last prompt).
- "model": the layer computation. Parameters are laid out model-parallel over the inner channels
  (Mamba-1) / heads (Mamba-2) by :func:`latim_jax.model.sharding.shard`, so a model too big for one
  device fits; the residual stream stays replicated over "model". The score stage splits the target
  rows over "model" (rows are independent given the layer's factors), which is what lets one long
  prompt use every device.
- "seq": the length of each prompt, in the forward (logits) and ``attribute``. Each device holds a
  contiguous run of l / D positions; the causal conv reads a halo of the previous shard's last k-1
  inputs, the scans carry their state across shards by an all_gather of per-shard summaries, and
  attention gathers the keys and values (:mod:`latim_jax.parallel.sequence`). The length is padded
  to a multiple of D (padding positions are masked, cut from the logits). The score stage splits the
  source columns over it (each device scores the asked rows against its own l / D sources, from the
  layer's factors gathered whole: :func:`latim_jax.latim.scores.layer_scores`).

Under jit, XLA's SPMD partitioner places the pure-JAX (XLA) path from these shardings. Pallas kernels
are custom calls it cannot partition, so the dispatchers wrap each in ``jax.shard_map``: the scans over
(batch on "data", channels / heads on "model"; :mod:`latim_jax.kernels.dispatch`), the fused score
kernel over (batch on "data", target rows on "model"; :mod:`latim_jax.latim.scores`). The mesh travels
inside the execution context (:class:`latim_jax.parallel.context.Context`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

DATA, MODEL, SEQ = "data", "model", "seq"
AXES = (DATA, MODEL, SEQ)
__all__ = [
    "AXES",
    "DATA",
    "MODEL",
    "P",
    "SEQ",
    "check_mesh",
    "constrain",
    "gather",
    "pad_batch",
    "pad_length",
    "put",
]


def check_mesh(mesh: Mesh) -> Mesh:
    """Validate a user mesh and return it with Auto axis types (XLA propagates the shardings).

    Its axis names must be a subset of ("data", "model", "seq"); ``jax.make_mesh`` meshes (Explicit axes by
    default) are accepted and converted.
    """
    if not isinstance(mesh, Mesh):
        raise ValueError(f"mesh must be a jax.sharding.Mesh, found {type(mesh).__name__}")
    unknown = [n for n in mesh.axis_names if n not in AXES]
    if unknown:
        raise ValueError(f"mesh axes must be named from {AXES}, found {mesh.axis_names}")
    auto = getattr(jax.sharding, "AxisType", None)
    if auto is None:
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(auto.Auto,) * len(mesh.axis_names))


# --------------------------------------------------------------------------------------------------
# Inputs and outputs of a sharded call
# --------------------------------------------------------------------------------------------------


def pad_length(x, length: int):
    """Pad axis 1 of an array with zeros (False for a mask) to ``length`` (right padding)."""
    if x is None or x.shape[1] == length:
        return x
    pad = [(0, 0), (0, length - x.shape[1])] + [(0, 0)] * (x.ndim - 2)
    return jnp.pad(jnp.asarray(x), pad)


def pad_batch(x, multiple: int, *, edge: bool = True):
    """Pad axis 0 of an array to a multiple of ``multiple``, repeating the last entry (``edge``: a
    real prompt, so padding prompts never hold degenerate all-padding rows)."""
    if x is None:
        return None
    extra = (-x.shape[0]) % multiple
    if not extra:
        return x
    pad = [(0, extra)] + [(0, 0)] * (x.ndim - 1)
    return jnp.pad(jnp.asarray(x), pad, mode="edge" if edge else "constant")


def put(x, mesh: Mesh, spec: P):
    """Place a host-global array on ``mesh`` (every process passes the same full array; under several
    processes each contributes the shards of its own devices)."""
    if x is None:
        return None
    sharding = NamedSharding(mesh, spec)
    if jax.process_count() == 1:
        return jax.device_put(x, sharding)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def gather(tree: Any):
    """Every array of ``tree`` fully on this host (process_allgather where a multi-process array is
    not fully addressable); traced values (under jit, grad, vmap) pass unchanged: the caller's
    transformation decides where its outputs live."""

    def one(x):
        if isinstance(x, jax.core.Tracer):
            return x
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return jnp.asarray(multihost_utils.process_allgather(x, tiled=True))
        return x

    return jax.tree.map(one, tree)


def constrain(x, mesh: Mesh | None, spec: P):
    """with_sharding_constraint(x, spec) on ``mesh``; a no-op without a mesh."""
    if mesh is None:
        return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
