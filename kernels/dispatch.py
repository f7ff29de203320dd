"""One entry point per scan: ``impl="auto" | "xla" | "pallas"``; every implementation returns the same pytree.

- "xla": the pure-jnp reference (any backend).
- "pallas": the Pallas kernel; on a CPU default backend it runs in interpret mode (the TPU variant).
- "auto": Pallas on TPU and GPU, the reference on CPU.

``block_sizes`` (a ``BlockSizes``) tunes the Pallas tiles; None takes ``BlockSizes.for_platform``.
Both Pallas paths accept ``initial_state`` in the kernel and are differentiable (backward = VJP of the
reference).
"""

from __future__ import annotations

import jax

from latim_jax.kernels.selective_scan import (
    selective_scan_pallas,
    selective_scan_reference,
    selective_scan_step_reference,
)
from latim_jax.kernels.ssd import ssd_pallas, ssd_reference, ssd_step_reference

IMPLS = ("auto", "xla", "pallas")


def check_impl(impl: str) -> str:
    """Validate an ``impl`` name."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, found {impl!r}")
    return impl


def use_pallas(impl: str) -> bool:
    """Whether ``impl`` resolves to the Pallas kernel on the current default backend."""
    check_impl(impl)
    if impl == "auto":
        return jax.default_backend() in ("tpu", "gpu")
    return impl == "pallas"


def selective_scan(u, delta, A, B, C, D, initial_state=None, *, impl="auto", block_sizes=None):
    """Mamba-1 selective scan -> (y (b, l, e), final_state (b, e, n)). See kernels/selective_scan.py."""
    if use_pallas(impl):
        return selective_scan_pallas(u, delta, A, B, C, D, initial_state, block_sizes=block_sizes)
    return selective_scan_reference(u, delta, A, B, C, D, initial_state)


def ssd(x, dt, A, B, C, D, chunk_size=64, initial_state=None, *, impl="auto", block_sizes=None):
    """Mamba-2 chunked SSD -> (y (b, l, h, p), final_state (b, h, p, n)). See kernels/ssd.py."""
    if use_pallas(impl):
        return ssd_pallas(x, dt, A, B, C, D, chunk_size, initial_state, block_sizes=block_sizes)
    return ssd_reference(x, dt, A, B, C, D, chunk_size, initial_state)


def selective_scan_step(state, u, delta, A, B, C, D):
    """One Mamba-1 recurrent step (decoding; a few elementwise ops, no kernel). See selective_scan.py."""
    return selective_scan_step_reference(state, u, delta, A, B, C, D)


def ssd_step(state, x, dt, A, B, C, D):
    """One Mamba-2 recurrent step (decoding; no kernel). See ssd.py."""
    return ssd_step_reference(state, x, dt, A, B, C, D)
