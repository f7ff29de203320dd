"""Lower a jitted function for TPU or GPU from a CPU-only machine (no device, no final compile).

Interpret mode accepts kernels the hardware rejects; these helpers run the real Pallas lowering:
Mosaic for TPU (block-shape and unsupported-primitive errors surface here) and Triton for GPU
(power-of-two and layout errors surface here). They do not run the backend compile, so numerics,
memory limits and speed still need a device.

- TPU: ``jax.jit(fn).trace(*args).lower(lowering_platforms=("tpu",))``.
- GPU: ``.lower(lowering_platforms=("cuda",))``; on jax versions with ``AbstractDevice`` (0.12) inside
  ``use_abstract_mesh`` with an "NVIDIA H200" abstract GPU device, so that the Triton lowering sees a
  device kind. The arguments are created outside that block.

``LoweringUnsupported`` is raised only when the installed jax genuinely lacks the API (tests turn it
into ``pytest.skip``); any lowering error from the kernel itself propagates.

:func:`pallas_grids` reads the structure of every ``pallas_call`` a function traces to (its grid and
each operand's block shape), so that tests check what the kernel launches, not only that it lowers.
"""

from __future__ import annotations

import contextlib

import jax

GPU_DEVICE_KIND = "NVIDIA H200"


class LoweringUnsupported(RuntimeError):
    """The installed jax cannot lower for the requested platform from this machine."""


def _traced(fn, args):
    jitted = fn if hasattr(fn, "trace") else jax.jit(fn)
    if not hasattr(jitted, "trace"):
        raise LoweringUnsupported(f"jax {jax.__version__} has no jit(...).trace")
    return jitted.trace(*args)


def lower_for_tpu(fn, *args):
    """Lower ``fn(*args)`` for TPU (Mosaic). Returns the ``Lowered`` object."""
    try:
        from jax.experimental.pallas import tpu as _pltpu  # noqa: F401  (registers the Mosaic lowering)
    except ImportError as err:
        raise LoweringUnsupported(f"no Pallas TPU support in jax {jax.__version__}: {err}") from err
    return _traced(fn, args).lower(lowering_platforms=("tpu",))


def _gpu_abstract_mesh():
    """An abstract 1-device mesh with an H200 AbstractDevice, or None where jax has no AbstractDevice."""
    sharding = jax.sharding
    if not (hasattr(sharding, "AbstractDevice") and hasattr(sharding, "use_abstract_mesh")):
        return None
    device = sharding.AbstractDevice(device_kind=GPU_DEVICE_KIND, num_cores=None, platform="gpu")
    return sharding.AbstractMesh((1,), ("x",), abstract_device=device)


def lower_for_gpu(fn, *args):
    """Lower ``fn(*args)`` for CUDA (Pallas Triton). Returns the ``Lowered`` object."""
    try:
        from jax.experimental.pallas import triton as _pltriton  # noqa: F401  (registers Triton lowering)
    except ImportError as err:
        raise LoweringUnsupported(f"no Pallas Triton support in jax {jax.__version__}: {err}") from err
    mesh = _gpu_abstract_mesh()
    scope = jax.sharding.use_abstract_mesh(mesh) if mesh is not None else contextlib.nullcontext()
    with scope:
        return _traced(fn, args).lower(lowering_platforms=("cuda",))


def _block_dim(entry) -> int | None:
    """One block-shape entry as an int (a squeezed or size-1 dimension: None)."""
    if entry is None:
        return None
    size = getattr(entry, "block_size", entry)
    if not isinstance(size, int):  # pl.Squeezed / pl.Element and the like
        return None
    return size


def pallas_grids(fn, *args) -> list[dict]:
    """The ``pallas_call``s that ``fn(*args)`` traces to, in order, each as {"name": the kernel's name,
    "grid": the launch grid, "blocks": each operand's block shape (inputs then outputs; a squeezed
    dimension as None), "arrays": each operand's full shape, "scratch": the scratch shapes,
    "vmem_limit_bytes": the TPU scoped-VMEM limit passed (None: none, or not a TPU call)}. Tracing
    only: works for any platform the kernel was asked to build for (its ``platform=`` argument) on
    this machine."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                gm = eqn.params["grid_mapping"]
                body = eqn.params.get("jaxpr")
                debug = getattr(body, "debug_info", None)
                n_scratch = int(getattr(gm, "num_scratch_operands", 0) or 0)
                invars = body.invars if body is not None else []
                scratch = invars[len(invars) - n_scratch :] if n_scratch else []
                found.append({
                    "name": getattr(debug, "func_name", None),
                    "grid": tuple(int(g) for g in gm.grid),
                    "blocks": [tuple(_block_dim(x) for x in bm.block_shape) for bm in gm.block_mappings],
                    "arrays": [tuple(bm.array_aval.shape) for bm in gm.block_mappings],
                    "scratch": [tuple(v.aval.shape) for v in scratch],
                    "vmem_limit_bytes": getattr(eqn.params.get("compiler_params"), "vmem_limit_bytes", None),
                })  # fmt: skip
            for value in eqn.params.values():
                for sub in value if isinstance(value, list | tuple) else (value,):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        walk(inner)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found
