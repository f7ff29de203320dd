"""The execution context: which implementation runs and on which devices, decided once at the API edge.

Every public entry point (``MambaLM.__call__`` / ``forward``, ``attribute``, ``contributions``,
``conservation_error``) takes the user's ``impl`` ("auto" | "xla" | "pallas") and optional ``mesh`` and
calls :func:`resolve` exactly once. The resulting :class:`Context` is hashable, so it travels down as a
static argument of the jitted per-layer functions; below the API edge nothing looks at ``impl`` strings
or the default backend again:

- ``Context.kernels`` is THE choice between the Pallas kernels (the scans and the fused score kernel;
  interpret mode on a CPU backend) and the pure-JAX path. The scan dispatcher
  (:mod:`latim_jax.kernels.dispatch`) and the score dispatcher (:mod:`latim_jax.latim.scores`) read it.
- ``Context.mesh`` is the device mesh (axes "data" and/or "model"; :mod:`latim_jax.parallel.mesh`) or
  None. Kernels run under ``jax.shard_map`` over it; the XLA path is partitioned by XLA.
"""

from __future__ import annotations

import dataclasses

import jax
from jax.sharding import Mesh

IMPLS = ("auto", "xla", "pallas")


@dataclasses.dataclass(frozen=True)
class Context:
    """Where a call runs: ``kernels`` (Pallas kernels instead of the XLA path) and ``mesh`` (or None)."""

    kernels: bool = False
    mesh: Mesh | None = None

    def axis_size(self, name: str) -> int:
        """Size of mesh axis ``name`` (1 without a mesh or without that axis)."""
        if self.mesh is None or name not in self.mesh.axis_names:
            return 1
        return int(self.mesh.shape[name])

    def axis(self, name: str) -> str | None:
        """``name`` when the mesh has that axis with size > 1, else None (a replicated dimension)."""
        return name if self.axis_size(name) > 1 else None

    @property
    def split(self) -> bool:
        """Whether the mesh splits anything (an axis of size > 1)."""
        return self.mesh is not None and any(s > 1 for s in self.mesh.devices.shape)

    def local(self) -> Context:
        """The same kernel choice without the mesh: what runs on one device inside ``jax.shard_map``."""
        return Context(kernels=self.kernels)


XLA = Context()  # the default of internal functions: the XLA path on one device


def check_impl(impl) -> str:
    """Validate an implementation name; returns it."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, found {impl!r}")
    return impl


def resolve(impl="auto", mesh: Mesh | None = None) -> Context:
    """The :class:`Context` of a call: ``impl`` "auto" (Pallas kernels on TPU and GPU, XLA elsewhere),
    "xla" or "pallas" (kernels everywhere; interpret mode on CPU), and an optional mesh (validated by
    the caller with :func:`latim_jax.parallel.mesh.check_mesh`). A Context passes through unchanged
    (with ``mesh`` set when given), so a function may be called with what its caller resolved."""
    if isinstance(impl, Context):
        return impl if mesh is None else dataclasses.replace(impl, mesh=mesh)
    check_impl(impl)
    kernels = jax.default_backend() in ("tpu", "gpu") if impl == "auto" else impl == "pallas"
    return Context(kernels=kernels, mesh=mesh)
