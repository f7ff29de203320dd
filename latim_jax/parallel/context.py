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
- ``Context.platform`` ("tpu" | "gpu" | "cpu") is what the programs are built for, and ``Context.chip``
  the TPU generation ("v4", "v5e", "v5p", "v6e"; :mod:`latim_jax.parallel.chips`) or None. They
  default to the running backend and its first device, and pick the kernel variant (the TPU one, in
  interpret mode, for "cpu"), its scoped-VMEM limit and its VMEM budget. Naming them builds the
  library's programs for a TPU from a CPU host (``resolve("pallas", platform="tpu", chip="v5e")``,
  then ``jax.jit(...).lower()`` or a compile-only device: :mod:`latim_jax.parallel.tpu_check`); the
  kernels read these fields, never ``jax.default_backend()``.
"""

from __future__ import annotations

import dataclasses

import jax
from jax.sharding import Mesh

from latim_jax.parallel.chips import check_chip, normalize_platform, running_chip

IMPLS = ("auto", "xla", "pallas")


@dataclasses.dataclass(frozen=True)
class Context:
    """Where a call runs: ``kernels`` (Pallas kernels instead of the XLA path), ``mesh`` (or None), and
    the ``platform`` ("tpu" | "gpu" | "cpu") and TPU generation ``chip`` the programs are built for
    (None: the running backend's, for a Context made by hand; :func:`resolve` always fills them)."""

    kernels: bool = False
    mesh: Mesh | None = None
    platform: str | None = None
    chip: str | None = None

    def __post_init__(self):
        if self.platform is not None:
            object.__setattr__(self, "platform", normalize_platform(self.platform))
        if self.chip is not None:
            if self.platform not in (None, "tpu"):
                raise ValueError(f"chip={self.chip!r} names a TPU generation, but platform={self.platform!r}")
            object.__setattr__(self, "chip", check_chip(self.chip))
            object.__setattr__(self, "platform", "tpu")

    @property
    def interpret(self) -> bool | None:
        """Whether the Pallas kernels run in interpret mode: on a "cpu" platform (None: the platform is
        the running backend's, and the kernels decide from it)."""
        return None if self.platform is None else self.platform == "cpu"

    def kernel_target(self) -> dict:
        """The keyword arguments naming the target of every Pallas kernel: platform, interpret, chip."""
        return dict(platform=self.platform, interpret=self.interpret, chip=self.chip)

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
        """The same kernel choice and target without the mesh: what runs on one device inside
        ``jax.shard_map``."""
        return dataclasses.replace(self, mesh=None)


XLA = Context()  # the default of internal functions: the XLA path on one device


def check_impl(impl) -> str:
    """Validate an implementation name; returns it."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, found {impl!r}")
    return impl


def resolve(
    impl="auto", mesh: Mesh | None = None, *, platform: str | None = None, chip: str | None = None
) -> Context:
    """The :class:`Context` of a call: ``impl`` "auto" (Pallas kernels on TPU and GPU, XLA elsewhere),
    "xla" or "pallas" (kernels everywhere; interpret mode on CPU), and an optional mesh (validated by
    the caller with :func:`latim_jax.parallel.mesh.check_mesh`). ``platform`` ("tpu" | "gpu" | "cpu")
    and ``chip`` (a TPU generation: "v4", "v5e", "v5p", "v6e", or a device kind) name what the programs
    are built for; None: the running backend (``jax.default_backend()``) and its first device's
    generation, read here once. A chip implies platform "tpu". A Context passes through unchanged (with
    ``mesh`` set when given), so a function may be called with what its caller resolved."""
    if isinstance(impl, Context):
        return impl if mesh is None else dataclasses.replace(impl, mesh=mesh)
    check_impl(impl)
    if chip is not None and platform is None:
        platform = "tpu"
    backend = normalize_platform(jax.default_backend())
    platform = backend if platform is None else normalize_platform(platform)
    if chip is None and platform == "tpu" and backend == "tpu":
        chip = running_chip()
    kernels = platform in ("tpu", "gpu") if impl == "auto" else impl == "pallas"
    return Context(kernels=kernels, mesh=mesh, platform=platform, chip=chip)
