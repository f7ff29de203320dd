"""Where and how a call runs: the execution context (Pallas kernels or XLA, and an optional device mesh)
and the mesh helpers that place, pad and gather arrays. Imports nothing of latim_jax."""

from latim_jax.parallel.context import IMPLS, XLA, Context, check_impl, resolve
from latim_jax.parallel.mesh import AXES, DATA, MODEL, P, check_mesh, constrain, gather, pad_batch, put

__all__ = [
    "AXES",
    "DATA",
    "IMPLS",
    "MODEL",
    "Context",
    "P",
    "XLA",
    "check_impl",
    "check_mesh",
    "constrain",
    "gather",
    "pad_batch",
    "put",
    "resolve",
]
