"""The order of a Mamba mixer's in_proj columns and conv channels: one block per "model" shard.

A checkpoint stores in_proj's output in parts (Mamba-1: x | z; Mamba-2: z | x | B | C | dt) and the
conv's channels as x (| B | C). Cut into m contiguous column blocks, that order does not line up with
the parts, so every projection would be followed by a reshuffle between devices. A layout with m shards
reorders the columns so that shard k holds, one after the other, the k-th slice of every part:

    in_proj  shard k:  x_k | z_k                       (Mamba-1)
                       z_k | x_k | B_k | C_k | dt_k    (Mamba-2)
    conv     shard k:  x_k (| B_k | C_k)

x_k, z_k are channels [k e/m, (k+1) e/m) and dt_k heads [k h/m, (k+1) h/m), so the layer's value
path, gate and heads stay on their shard from in_proj to out_proj (whose rows are in channel order
already). B_k, C_k are the state projections of the groups shard k's heads read: with g % m == 0 the
shard's own g/m groups; with m % g == 0 the one group its heads belong to, repeated on each of the
m/g shards sharing it (the layer then runs with g' = m groups, each a copy of an original group read
by the same heads: the same maths). Shape letters: see :mod:`latim_jax.model.config`.

A layout of one shard is the checkpoint's order itself; :func:`latim_jax.model.sharding.shard` lays a
mixer out for the mesh's "model" axis, and the mixer's ``param_dict`` gives the checkpoint's order back.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

# which of a mixer's parameters are in in_proj's column order, which in the conv's channel order
IN_ORDER = ("in_proj", "in_proj_b")
CONV_ORDER = ("conv_w", "conv_b")


@dataclasses.dataclass(frozen=True)
class Part:
    """One part of in_proj's output or of the conv's channels: ``name``, its offset and width in the
    checkpoint's order, and ``group`` (the state width n) for B and C, read per group of heads."""

    name: str
    offset: int
    width: int
    group: int = 0


@dataclasses.dataclass(frozen=True)
class ChannelLayout:
    """The column order of one mixer's in_proj and conv for ``shards`` "model" shards (hashable: it is
    part of the module's static structure). ``groups`` is the number of B/C groups the layer runs with
    (g, or m when m shards share fewer groups); ``n_groups`` the checkpoint's."""

    shards: int
    in_parts: tuple[Part, ...]
    conv_parts: tuple[Part, ...]
    n_groups: int = 1
    groups: int = 1

    @property
    def reference(self) -> bool:
        """Whether this is the checkpoint's own order (one shard)."""
        return self.shards == 1

    def width(self, part: Part) -> int:
        """Columns of ``part`` on one shard."""
        if part.group:
            return self.groups // self.shards * part.group
        return part.width // self.shards

    def _parts(self, order: str) -> tuple[Part, ...]:
        return self.in_parts if order == "in" else self.conv_parts

    def shard_width(self, order: str) -> int:
        """Columns one shard holds in ``order`` ("in": in_proj's output, "conv": the conv channels)."""
        return sum(self.width(p) for p in self._parts(order))

    def total_width(self, order: str) -> int:
        """Columns of the whole laid-out array in ``order`` (more than the checkpoint's where B and C
        are repeated)."""
        return self.shards * self.shard_width(order)

    def columns(self, order: str) -> np.ndarray:
        """For each laid-out column, the checkpoint column it holds (int array, ``total_width``)."""
        out = []
        for k in range(self.shards):
            for p in self._parts(order):
                t = np.arange(self.width(p))
                if p.group:  # effective group k g'/m + t // n reads the checkpoint's group eg g / g'
                    eg = k * (self.groups // self.shards) + t // p.group
                    out.append(p.offset + (eg * self.n_groups // self.groups) * p.group + t % p.group)
                else:
                    out.append(p.offset + k * self.width(p) + t)
        return np.concatenate(out)

    def split(self, t, order: str, *runs: tuple[str, ...]):
        """The runs of consecutive parts of t (..., total_width) in ``order``: one array per run,
        (..., shards * run width), each shard's slice of the run in shard order. A run of one part is
        that part in the checkpoint's order (B, C: the ``groups`` groups, each n wide)."""
        lead = t.shape[:-1]
        t = t.reshape(*lead, self.shards, self.shard_width(order))
        starts, at = {}, 0
        for p in self._parts(order):
            starts[p.name] = (at, self.width(p))
            at += self.width(p)
        out = []
        for run in runs:
            lo = starts[run[0]][0]
            hi = starts[run[-1]][0] + starts[run[-1]][1]
            out.append(t[..., lo:hi].reshape(*lead, self.shards * (hi - lo)))
        return out

    def lay_out(self, name: str, value):
        """A parameter in the checkpoint's order -> this layout (a gather along its last axis)."""
        order = _order(name)
        if order is None or self.reference:
            return value
        return value[..., self.columns(order)]

    def restore(self, name: str, value):
        """A parameter in this layout -> the checkpoint's order (each checkpoint column from its first
        laid-out copy). Repeated B/C columns that no longer agree (the laid-out parameters were trained
        or edited copy by copy) raise ValueError: no checkpoint order holds them."""
        order = _order(name)
        if order is None or self.reference:
            return value
        cols = self.columns(order)
        first = np.zeros(cols.max() + 1, np.int64)
        first[cols[::-1]] = np.arange(len(cols))[::-1]  # the last assignment wins: the first copy
        out = value[..., first]
        if self.groups != self.n_groups and not isinstance(value, jax.core.Tracer):
            if not bool(jnp.array_equal(out[..., cols], value)):
                raise ValueError(
                    f"{name}: the copies of B/C columns repeated over {self.shards} shards differ (were the "
                    "laid-out parameters updated copy by copy? a gradient splits over the copies: sum them), "
                    "so they have no checkpoint order"
                )
        return out


def _order(name: str) -> str | None:
    return "in" if name in IN_ORDER else "conv" if name in CONV_ORDER else None


def channel_layout(config, kind: str, shards: int = 1) -> ChannelLayout:
    """The layout of a ``kind`` ("mamba1" / "mamba2") mixer of ``config`` over ``shards`` shards.
    Raises ValueError when the shards do not divide the channels (Mamba-1) or heads (Mamba-2), or when
    neither of the groups and the shards divides the other (:func:`fits` asks first)."""
    e, n = config.d_inner, config.d_state
    if kind == "mamba1":
        if e % shards:
            raise ValueError(f"a Mamba-1 layout over {shards} shards needs e = {e} divisible by it")
        return ChannelLayout(shards, (Part("x", 0, e), Part("z", e, e)), (Part("x", 0, e),))
    g, h = config.n_groups, config.n_heads
    if h % shards or (g % shards and shards % g):
        raise ValueError(
            f"a Mamba-2 layout over {shards} shards needs the heads h = {h} divisible by it and the groups "
            f"g = {g} a multiple or a divisor of it"
        )
    groups = g if g % shards == 0 else shards
    gn = g * n
    in_parts = (
        Part("z", 0, e), Part("x", e, e), Part("B", 2 * e, gn, n), Part("C", 2 * e + gn, gn, n),
        Part("dt", 2 * e + 2 * gn, h),
    )  # fmt: skip
    conv_parts = (Part("x", 0, e), Part("B", e, gn, n), Part("C", e + gn, gn, n))
    return ChannelLayout(shards, in_parts, conv_parts, g, groups)


def fits(config, kind: str, shards: int) -> bool:
    """Whether a ``kind`` mixer of ``config`` has a layout over ``shards`` shards."""
    try:
        channel_layout(config, kind, shards)
    except ValueError:
        return False
    return True
