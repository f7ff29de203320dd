"""The scan dispatcher: one entry point per scan, taking the execution context; every implementation
returns the same pytree.

``ctx`` is a :class:`latim_jax.parallel.context.Context`, resolved once at the API edge:
- ``ctx.kernels`` False: the pure-jnp reference (any backend); True: the Pallas kernel, built for
  ``ctx.platform`` (interpret mode for "cpu") and, on TPU, ``ctx.chip``'s VMEM.
- ``ctx.mesh``: with a mesh, each Pallas scan runs inside ``jax.shard_map`` over (batch on "data",
  channels / heads on "model"); the XLA path is left to XLA's SPMD partitioner. Channel-parallel scans
  need no cross-shard carry (each channel or head is an independent recurrence); Mamba-2's B/C groups
  split with the heads when the shards divide them, else each shard gathers the groups of its heads.
- A mesh with a "seq" axis splits the length: both paths (XLA and Pallas) then run under shard_map
  over (batch on "data", length on "seq", channels on "model"); each shard scans from a zero state and
  :func:`latim_jax.parallel.sequence.carry_in` combines the shards' (total decay, final state)
  summaries into the state entering each shard. ``fixup="correct"`` adds that state's decayed
  read-out C_t . exp(A cum Delta_t) h_in to the shard's outputs (one elementwise pass); "rescan"
  scans the shard again from it; "auto" (default) rescans on the XLA path, where the first pass
  shrinks to its final state (its outputs are dead code), and corrects with the Pallas kernels
  (benchmarks/results/sequence_axis.md). The final state returned is the whole length's (the same
  on every "seq" shard).

:func:`delta_rule_m_tile` picks, the same way, between the delta rule's M tiles by an XLA scan over chunks
(:func:`latim_jax.kernels.delta_rule.m_tile`) and the Pallas kernel of kernels/delta_rule_tiles.py; it
takes no mesh (the score stage calls it per device, inside its own shard_map).

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

from latim_jax.kernels import delta_rule
from latim_jax.kernels.delta_rule_tiles import m_tile_pallas
from latim_jax.kernels.selective_scan import (
    selective_scan_pallas,
    selective_scan_reference,
    selective_scan_step_reference,
)
from latim_jax.kernels.ssd import XLA_CHUNK, ssd_pallas, ssd_reference, ssd_step_reference
from latim_jax.parallel import sequence
from latim_jax.parallel.context import XLA, Context
from latim_jax.parallel.mesh import SEQ

FIXUPS = ("auto", "correct", "rescan")  # how a shard of a split length takes the state entering it


def _mesh_axes(ctx: Context, batch: int, channels: int):
    """(batch axis, channel axis, length axis) for shard_map: "data" / "model" only where the mesh has
    it (size > 1) and it divides the dimension (else that dimension stays whole on every device);
    "seq" where the mesh splits the length."""
    data = "data" if ctx.axis_size("data") > 1 and batch % ctx.axis_size("data") == 0 else None
    model = "model" if ctx.axis_size("model") > 1 and channels % ctx.axis_size("model") == 0 else None
    return data, model, ctx.axis(SEQ)


def _fixup(fixup: str, ctx: Context) -> str:
    """The fixup of a split length: "auto" is "rescan" on the XLA path (the zero-start pass's outputs
    are unused, so XLA drops them and that pass only computes the final state) and "correct" with the
    Pallas kernels (a custom call always writes its outputs: a rescan would be two full passes)."""
    if fixup not in FIXUPS:
        raise ValueError(f"fixup must be one of {FIXUPS}, found {fixup!r}")
    if fixup == "auto":
        return "correct" if ctx.kernels else "rescan"
    return fixup


def selective_scan(
    u, delta, A, B, C, D, initial_state=None, *, ctx: Context = XLA, block_sizes=None, fixup="auto"
):
    """Mamba-1 selective scan -> (y (b, l, e), final_state (b, e, n)). See kernels/selective_scan.py.
    ``fixup``: how a length split over "seq" takes the state entering each shard (see module doc)."""
    fixup = _fixup(fixup, ctx)
    data, model, seq = _mesh_axes(ctx, u.shape[0], u.shape[-1])
    if not ctx.kernels and seq is None:
        return selective_scan_reference(u, delta, A, B, C, D, initial_state)
    kernel = selective_scan_reference
    if ctx.kernels:
        kernel = functools.partial(selective_scan_pallas, block_sizes=block_sizes, **ctx.kernel_target())
    if data is None and model is None and seq is None:
        return kernel(u, delta, A, B, C, D, initial_state)

    def local(u, delta, A, B, C, D, h0=None):
        if seq is None:
            return kernel(u, delta, A, B, C, D, h0)
        y, final = kernel(u, delta, A, B, C, D)  # from a zero state
        total = jnp.sum(delta.astype(jnp.float32), axis=1)  # (b, e)
        h_in, h_last = sequence.carry_in(total, A, final, h0, seq)
        if fixup == "rescan":
            return kernel(u, delta, A, B, C, D, h_in)[0], h_last
        return y + sequence.selective_scan_carry(delta, A, C, h_in), h_last

    rows, chan, state = P(data, seq, model), P(model), P(data, model, None)
    bc = P(data, seq, None)
    args, specs = (u, delta, A, B, C, D), (rows, rows, P(model, None), bc, bc, chan)
    if initial_state is not None:
        args, specs = args + (initial_state,), specs + (state,)
    run = jax.shard_map(local, mesh=ctx.mesh, in_specs=specs, out_specs=(rows, state), check_vma=False)
    return run(*args)


def ssd(
    x, dt, A, B, C, D, chunk_size=64, initial_state=None, *, ctx: Context = XLA, block_sizes=None,
    fixup="auto",
):  # fmt: skip
    """Mamba-2 chunked SSD -> (y (b, l, h, p), final_state (b, h, p, n)). See kernels/ssd.py.
    ``fixup``: how a length split over "seq" takes the state entering each shard (see module doc)."""
    fixup = _fixup(fixup, ctx)
    data, model, seq = _mesh_axes(ctx, x.shape[0], x.shape[2])
    if not ctx.kernels:  # the chunk length changes only rounding: the XLA path takes its fastest
        kernel = functools.partial(ssd_reference, chunk_size=min(chunk_size, XLA_CHUNK))
        if seq is None:
            return kernel(x, dt, A, B, C, D, initial_state=initial_state)
    else:
        kernel = functools.partial(
            ssd_pallas, chunk_size=chunk_size, block_sizes=block_sizes, **ctx.kernel_target()
        )
    if data is None and model is None and seq is None:
        return kernel(x, dt, A, B, C, D, initial_state=initial_state)
    rep = x.shape[2] // B.shape[2]  # heads per B/C group
    # groups split with the heads when the shards divide them (each shard's heads read its own groups,
    # as a channel-matched layout arranges); else every shard takes all groups and picks its heads'
    own_groups = model is not None and B.shape[2] % ctx.axis_size("model") == 0

    def local(x, dt, A, B, C, D, h0=None):
        if model is not None and not own_groups:  # this shard's heads may span groups: one per local head
            heads = jax.lax.axis_index("model") * x.shape[2] + jnp.arange(x.shape[2])
            B, C = (jnp.take(t, heads // rep, axis=2) for t in (B, C))
        if seq is None:
            return kernel(x, dt, A, B, C, D, initial_state=h0)
        y, final = kernel(x, dt, A, B, C, D)  # from a zero state
        total = jnp.sum(dt.astype(jnp.float32), axis=1)  # (b, h)
        h_in, h_last = sequence.carry_in(total, A[:, None, None], final, h0, seq)
        if fixup == "rescan":
            return kernel(x, dt, A, B, C, D, initial_state=h_in)[0], h_last
        return y + sequence.ssd_carry(dt, A, C, h_in), h_last

    heads = P(data, seq, model, None)
    bc = P(data, seq, model if own_groups else None, None)
    specs = [heads, P(data, seq, model), P(model), bc, bc, P(model)]
    args = [x, dt, A, B, C, D]
    if initial_state is not None:
        specs.append(P(data, model, None, None))
        args.append(initial_state)
    out = (heads, P(data, model, None, None))
    return jax.shard_map(local, mesh=ctx.mesh, in_specs=tuple(specs), out_specs=out, check_vma=False)(*args)


def delta_rule_m_tile(factors, rows, c0, width: int, *, ctx: Context = XLA, block_sizes=None):
    """The delta rule's hidden attention M[rows, c0 : c0 + width] per head, (b, H, r, width), from the
    layer's :class:`~latim_jax.kernels.delta_rule.TileFactors`: the XLA scan over chunks, or with
    ``ctx.kernels`` the Pallas kernel built for ``ctx``'s target (interpret mode on CPU; on TPU its
    chip's VMEM, or ``block_sizes.vmem_limit_bytes``). See kernels/delta_rule_tiles.py."""
    if not ctx.kernels:
        return delta_rule.m_tile(factors, rows, c0, width)
    limit = None if block_sizes is None else block_sizes.vmem_limit_bytes
    return m_tile_pallas(factors, rows, c0, width, vmem_limit_bytes=limit, **ctx.kernel_target())


def selective_scan_step(state, u, delta, A, B, C, D):
    """One Mamba-1 recurrent step (decoding; a few elementwise ops, no kernel). See selective_scan.py."""
    return selective_scan_step_reference(state, u, delta, A, B, C, D)


def ssd_step(state, x, dt, A, B, C, D):
    """One Mamba-2 recurrent step (decoding; no kernel). See ssd.py."""
    return ssd_step_reference(state, x, dt, A, B, C, D)
