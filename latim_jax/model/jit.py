"""jit for functions of a model, and a bound on the compiled programs a long-lived process keeps.

:func:`jit_model_fn` splits the NNX module into (graphdef, state) and jits a pure function. Unlike
``nnx.jit`` this never writes back into the module, so the wrapped functions can be called with a model
closed over by a user's own ``jax.jit`` / ``jax.vmap`` / ``jax.grad``.

:func:`bound_compiled_programs`: XLA:CPU maps each compiled program's code into the process (about 250
memory maps for one attribution call's programs at a new length or method), the kernel allows
``vm.max_map_count`` (65530 by default), and at that limit LLVM aborts the whole process ("Unable to
allocate section memory": no exception, the work is lost). A notebook sweeping lengths and methods gets
there in a few hundred calls. The library's entry points call this after their work: when programs
were compiled since the last look and the maps pass :data:`MAP_FRACTION` of the limit, jax's caches
are cleared (with a warning; the next calls compile again), which releases the maps.
"""

from __future__ import annotations

import functools
import gc
import warnings

import jax
from flax import nnx

MAP_FRACTION = 0.5  # clear the compiled programs past this fraction of vm.max_map_count
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"  # loaded from a persistent cache: mapped too
_compiles = [0, 0]  # [programs compiled or loaded in this process, at the last look]


def _count_compiles(event: str, duration: float = 0.0, **_) -> None:
    if event in (_COMPILE_EVENT, _CACHE_HIT_EVENT):
        _compiles[0] += 1


jax.monitoring.register_event_duration_secs_listener(_count_compiles)
jax.monitoring.register_event_listener(_count_compiles)


def map_count() -> int | None:
    """The memory maps of this process (None where /proc is not available)."""
    try:
        with open("/proc/self/maps", "rb") as fh:
            return sum(1 for _ in fh)
    except OSError:
        return None


def max_map_count() -> int | None:
    """The kernel's limit on a process's memory maps (vm.max_map_count; None where unknown)."""
    try:
        with open("/proc/sys/vm/max_map_count") as fh:
            return int(fh.read())
    except (OSError, ValueError):
        return None


def bound_compiled_programs() -> bool:
    """Clear jax's compiled-program caches when this process's memory maps pass :data:`MAP_FRACTION`
    of ``vm.max_map_count`` (see the module docstring); returns whether it cleared. Free when nothing
    was compiled since the last call (the maps are read only after new compilations)."""
    if _compiles[0] == _compiles[1]:
        return False
    _compiles[1] = _compiles[0]
    n, limit = map_count(), max_map_count()
    if n is None or limit is None or n < MAP_FRACTION * limit:
        return False
    jax.clear_caches()
    gc.collect()
    warnings.warn(
        f"this process held {n} memory maps, most of them compiled programs, past "
        f"{MAP_FRACTION:.0%} of the kernel's limit vm.max_map_count = {limit} (at the limit XLA aborts "
        f"the process); jax's compiled programs were cleared (now {map_count()} maps), so the next calls "
        "compile again. Fewer distinct lengths and methods per process compile fewer programs.",
        RuntimeWarning,
        stacklevel=3,
    )
    return True


def jit_model_fn(fn=None, *, static_argnames=()):
    """Decorator: ``fn(model, *args, **kw)`` jitted with ``static_argnames`` static and the model's
    graph structure static; its parameters are ordinary (traceable) jit arguments."""
    if fn is None:
        return functools.partial(jit_model_fn, static_argnames=static_argnames)

    @functools.partial(jax.jit, static_argnames=("graphdef", *static_argnames))
    def pure(graphdef, state, *args, **kwargs):
        return fn(nnx.merge(graphdef, state), *args, **kwargs)

    @functools.wraps(fn)
    def wrapper(model, *args, **kwargs):
        graphdef, state = nnx.split(model)
        return pure(graphdef, state, *args, **kwargs)

    def lower(model, *args, **kwargs):
        """``jax.jit(...).lower`` of the call (for compiled memory analysis in benchmarks)."""
        graphdef, state = nnx.split(model)
        return pure.lower(graphdef, state, *args, **kwargs)

    wrapper.lower = lower
    return wrapper
