"""The scan dispatcher: one entry point per scan, taking the execution context; every implementation
returns the same pytree.

``ctx`` is a :class:`latim_jax.parallel.context.Context`, resolved once at the API edge:
- ``ctx.kernels`` False: the pure-jnp reference (any backend); True: the Pallas kernel, built for
  ``ctx.platform`` (interpret mode for "cpu") and, on TPU, ``ctx.chip``'s VMEM.
- ``ctx.mesh``: with a mesh, each Pallas scan runs inside ``jax.shard_map`` over (batch on "data",
  channels / heads on "model"); the XLA path is left to XLA's SPMD partitioner. Channel-parallel scans
  need no cross-shard carry (each channel or head is an independent recurrence); Mamba-2's B/C groups
  split with the heads when the shards divide them, else each shard gathers the groups of its heads.

``block_sizes`` (a :class:`~latim_jax.kernels.block_sizes.Blocks`) tunes the Pallas tiles; None fields
take ``Blocks.for_platform``'s. Both Pallas paths accept ``initial_state`` in the kernel and are
differentiable through Pallas backward kernels (reverse mode, any order; forward mode needs the XLA
path).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from latim_jax.kernels.selective_scan import (
    selective_scan_pallas,
    selective_scan_reference,
    selective_scan_step_reference,
)
from latim_jax.kernels.ssd import XLA_CHUNK, ssd_pallas, ssd_reference, ssd_step_reference
from latim_jax.parallel.context import XLA, Context


def _mesh_axes(ctx: Context, batch: int, channels: int):
    """(mesh, batch axis, channel axis) for shard_map: an axis only where the mesh has it (size > 1)
    and it divides the dimension (else that dimension stays whole on every device)."""
    data = "data" if ctx.axis_size("data") > 1 and batch % ctx.axis_size("data") == 0 else None
    model = "model" if ctx.axis_size("model") > 1 and channels % ctx.axis_size("model") == 0 else None
    if data is None and model is None:
        return None, None, None
    return ctx.mesh, data, model


def selective_scan(u, delta, A, B, C, D, initial_state=None, *, ctx: Context = XLA, block_sizes=None):
    """Mamba-1 selective scan -> (y (b, l, e), final_state (b, e, n)). See kernels/selective_scan.py."""
    if not ctx.kernels:
        return selective_scan_reference(u, delta, A, B, C, D, initial_state)
    kernel = functools.partial(selective_scan_pallas, block_sizes=block_sizes, **ctx.kernel_target())
    mesh, data, model = _mesh_axes(ctx, u.shape[0], u.shape[-1])
    if mesh is None:
        return kernel(u, delta, A, B, C, D, initial_state)
    seq, chan, state = P(data, None, model), P(model), P(data, model, None)
    bc = P(data, None, None)
    args, specs = (u, delta, A, B, C, D), (seq, seq, P(model, None), bc, bc, chan)
    if initial_state is not None:
        args, specs = args + (initial_state,), specs + (state,)
    return jax.shard_map(kernel, mesh=mesh, in_specs=specs, out_specs=(seq, state), check_vma=False)(*args)


def ssd(x, dt, A, B, C, D, chunk_size=64, initial_state=None, *, ctx: Context = XLA, block_sizes=None):
    """Mamba-2 chunked SSD -> (y (b, l, h, p), final_state (b, h, p, n)). See kernels/ssd.py."""
    if not ctx.kernels:  # the chunk length changes only rounding: the XLA path takes its fastest
        return ssd_reference(x, dt, A, B, C, D, min(chunk_size, XLA_CHUNK), initial_state)
    kernel = functools.partial(
        ssd_pallas, chunk_size=chunk_size, block_sizes=block_sizes, **ctx.kernel_target()
    )
    mesh, data, model = _mesh_axes(ctx, x.shape[0], x.shape[2])
    if mesh is None:
        return kernel(x, dt, A, B, C, D, initial_state=initial_state)
    rep = x.shape[2] // B.shape[2]  # heads per B/C group
    # groups split with the heads when the shards divide them (each shard's heads read its own groups,
    # as a channel-matched layout arranges); else every shard takes all groups and picks its heads'
    own_groups = model is not None and B.shape[2] % ctx.axis_size("model") == 0

    def local(x, dt, A, B, C, D, h0=None):
        if model is not None and not own_groups:  # this shard's heads may span groups: one per local head
            heads = jax.lax.axis_index("model") * x.shape[2] + jnp.arange(x.shape[2])
            B, C = (jnp.take(t, heads // rep, axis=2) for t in (B, C))
        return kernel(x, dt, A, B, C, D, initial_state=h0)

    heads = P(data, None, model, None)
    bc = P(data, None, model if own_groups else None, None)
    specs = [heads, P(data, None, model), P(model), bc, bc, P(model)]
    args = [x, dt, A, B, C, D]
    if initial_state is not None:
        specs.append(P(data, model, None, None))
        args.append(initial_state)
    out = (heads, P(data, model, None, None))
    return jax.shard_map(local, mesh=mesh, in_specs=tuple(specs), out_specs=out, check_vma=False)(*args)


def selective_scan_step(state, u, delta, A, B, C, D):
    """One Mamba-1 recurrent step (decoding; a few elementwise ops, no kernel). See selective_scan.py."""
    return selective_scan_step_reference(state, u, delta, A, B, C, D)


def ssd_step(state, x, dt, A, B, C, D):
    """One Mamba-2 recurrent step (decoding; no kernel). See ssd.py."""
    return ssd_step_reference(state, x, dt, A, B, C, D)
