"""jit for functions of a model: split the NNX module into (graphdef, state), jit a pure function.

Unlike ``nnx.jit`` this never writes back into the module, so the wrapped functions can be called
with a model closed over by a user's own ``jax.jit`` / ``jax.vmap`` / ``jax.grad``.
"""

from __future__ import annotations

import functools

import jax
from flax import nnx


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
