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

    def param_names(self) -> list[str]:
        """The names of the parameters the module holds (no values read)."""
        return [n for n in self.NAMES if hasattr(self, n)]

    def param_dict(self) -> dict:
        """The module's parameters as a plain dict of arrays (the layout of config.param_shapes)."""
        return {n: getattr(self, n)[...] for n in self.NAMES if hasattr(self, n)}


class ComposedModule(ParamModule):
    """A module made of other sublayer modules built from the same flat parameter dict (``PARTS``: the
    attributes holding them; their parameter names differ) plus its own ``NAMES``: a parameter is looked
    up in whichever holds it, and all of them are listed as one flat dict (the checkpoint layout)."""

    PARTS: tuple[str, ...] = ()

    def _holders(self) -> tuple[ParamModule, ...]:
        return (self, *(getattr(self, part) for part in self.PARTS))

    def param(self, name: str):
        """The ``nnx.Param`` called ``name``, from whichever part (or the module itself) holds it."""
        for holder in self._holders():
            if name in ParamModule.param_dict(holder):
                return getattr(holder, name)
        raise KeyError(f"{type(self).__name__} has no parameter {name!r}")

    def _get(self, name):
        """The named parameter's array, from whichever holds it, or None."""
        for holder in self._holders():
            value = ParamModule._get(holder, name)
            if value is not None:
                return value
        return None

    def param_names(self) -> list[str]:
        """The names of every holder's parameters (no values read)."""
        return [n for holder in self._holders() for n in ParamModule.param_names(holder)]

    def param_dict(self) -> dict:
        """Every holder's parameters in one plain dict (the layout of config.param_shapes; each part's
        own ``param_dict``, in the checkpoint's order whatever layout a part holds them in)."""
        out = ParamModule.param_dict(self)
        for part in self.PARTS:
            out.update(getattr(self, part).param_dict())
        return out
