"""The parameter holder every sublayer module (Mamba mixer, attention, MLP) shares: named arrays as
``nnx.Param`` attributes, optional ones absent, and the plain-dict view the checkpoint layout uses."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx


class ParamModule(nnx.Module):
    """A module whose parameters are the entries of ``NAMES`` present in ``params`` (optional ones, a
    bias say, may be missing). ``kind`` names the layer kind: the key under which the decomposition
    registers how to write the module's output as a sum over source tokens (latim_jax.latim.kinds)."""

    kind = ""
    NAMES: tuple[str, ...] = ()

    def __init__(self, config, params: dict):
        self.config = config
        for name in self.NAMES:
            if name in params:
                setattr(self, name, nnx.Param(jnp.asarray(params[name])))

    def _get(self, name):
        """The named parameter's array, or None when the module has no such parameter."""
        p = getattr(self, name, None)
        return None if p is None else p[...]

    def param(self, name: str):
        """The ``nnx.Param`` called ``name`` (what a mesh layout replaces in place)."""
        return getattr(self, name)

    def param_dict(self) -> dict:
        """The module's parameters as a plain dict of arrays (the layout of config.param_shapes)."""
        return {n: getattr(self, n)[...] for n in self.NAMES if hasattr(self, n)}
