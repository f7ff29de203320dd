"""One device's column window of a layer's scores over a mesh's "seq" axis, from its own sources: the
factors compacted to the positions the window reads (docs/performance.md, "attribute over seq").

Device s of D holds positions [s w, (s + 1) w) of every per-position array of the factors (w = l / D:
the forward built them split) and scores the asked rows against those sources. Its pair values read
(the kind's ``positions``, :class:`latim_jax.latim.factors.Factors`):

- the "sources" and "both" fields at its w columns, and at the ``halo`` columns after them (the conv
  taps read M at j + k, k < K): the next shard's first K - 1 positions, one ``ppermute`` (zeros past
  the last shard, where the tiles read nothing real: B, Delta and the taps are 0 there);
- the "rows" and "both" fields at the asked target rows, wherever those live: each row's owner puts
  its values in and a ``psum`` over "seq" gives them to every device (g rows at a time, so a device
  holds one group's row values, not the whole length's).

These are laid out as one compacted sequence of n = 1 + (w + halo) + g slots,

    slot 0               every asked row before the window (its pairs here are all above the diagonal)
    1 .. w + halo        the window and its halo, in order (a row inside them takes its own slot)
    w + halo + 1 ..      the rows after them, in the order of their positions

(a kind with per-chunk factors, the delta rule, takes a whole chunk for slot 0 and pads the rows to
whole chunks: ``slot_unit``, and rebuilds its chunks in its own ``compacted``), so the slots keep the
positions' order and equality, which is all the pair values of a
``sequence_local`` kind read (causal masks, the diagonal, is_far): the tiles run unchanged on the
compacted factors with the column window (1, w) and give the same values as the whole layer's. The
asked rows' scores are then finished in global positions (:func:`latim_jax.latim.scores.finish_scores`).
What a device holds is O((w + g) x the fields' width), not O(l x it): 1/D of the layer for a few rows.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from latim_jax.latim.blocking import row_tiles
from latim_jax.parallel.mesh import P

GROUP_ROWS = 512  # asked rows compacted at a time (one psum of their row values per group)


def layout(f) -> dict[str, tuple[int, str]]:
    """Every per-position array of ``f`` (dotted path -> (length axis, role)), its parts' included;
    arrays that are None (an unbuilt ``token_total``) left out."""
    out = {path: spec for path, spec in (f.positions or {}).items() if get(f, path) is not None}
    for name in f.parts:
        out |= {f"{name}.{path}": spec for path, spec in layout(getattr(f, name)).items()}
    return out


def get(tree, path: str):
    """The field at a dotted ``path`` of nested dataclasses."""
    for name in path.split("."):
        tree = getattr(tree, name)
    return tree


def put(tree, path: str, value):
    """``tree`` with the field at a dotted ``path`` replaced (nested frozen dataclasses and NamedTuples)."""
    name, _, rest = path.partition(".")
    changes = {name: put(getattr(tree, name), rest, value) if rest else value}
    return tree._replace(**changes) if hasattr(tree, "_replace") else dataclasses.replace(tree, **changes)


def split_specs(f, specs, seq: str):
    """The PartitionSpecs ``specs`` of ``f``'s arrays with every per-position array's length axis over
    ``seq`` (its other axes as given: the batch over "data")."""
    for path, (axis, _) in layout(f).items():
        entries = list(get(specs, path))
        entries += [None] * (get(f, path).ndim - len(entries))
        entries[axis] = seq
        specs = put(specs, path, P(*entries))
    return specs


def compact(f, rows, aux, *, width: int, seq: str):
    """Inside ``jax.shard_map`` (``f``'s per-position arrays hold this device's ``width`` positions, aux
    (b, w, d) or None likewise): the compacted factors, the asked ``rows`` (g,) as their slots, and aux
    compacted alike (see the module docstring)."""
    d, s = jax.lax.axis_size(seq), jax.lax.axis_index(seq)
    start, halo, lead = s * width, f.halo, f.slot_unit  # lead: slot 0's chunk (one slot without chunks)
    if halo > width:
        raise ValueError(f"a halo of {halo} columns needs at least {halo} positions per shard, found {width}")
    g = rows.shape[0]
    tail = -(-g // lead) * lead - g  # the rows' slots padded to whole chunks
    owner = rows // width
    local, mine = rows - owner * width, owner == s
    inside = (rows >= start) & (rows < start + width + halo)
    order = jnp.argsort(jnp.argsort(rows))
    slots = jnp.where(rows < start, 0, jnp.where(inside, lead + rows - start, lead + width + halo + order))

    def zeros(x, axis: int, n: int):
        return jnp.zeros((*x.shape[:axis], n, *x.shape[axis + 1 :]), x.dtype)

    def one(x, axis: int, role: str):
        parts = [zeros(x, axis, lead), x]
        if halo:
            first = jax.lax.slice_in_dim(x, 0, halo, axis=axis)
            parts.append(jax.lax.ppermute(first, seq, [(i, i - 1) for i in range(1, d)]))
        at_rows = jnp.take(x, local, axis=axis)
        if role == "sources":
            at_rows = jnp.zeros_like(at_rows)
        else:
            shape = [1] * x.ndim
            shape[axis] = g
            owned = jnp.where(mine.reshape(shape), at_rows, jnp.zeros_like(at_rows))
            at_rows = jax.lax.psum(owned.astype(jnp.int32) if x.dtype == bool else owned, seq).astype(x.dtype)
        return jnp.concatenate(parts + [at_rows, zeros(x, axis, tail)], axis=axis)

    for path, (axis, role) in layout(f).items():
        if role != "chunks":  # the kind's own (compacted below)
            f = put(f, path, one(get(f, path), axis, role))
    f = f.compacted(rows, slots, width=width, lead=lead, seq=seq)
    return f, slots, None if aux is None else one(aux, 1, "rows")


def by_groups(fn, rows, size: int = GROUP_ROWS):
    """``fn(rows_g)`` -> (b, g, ...) (or a tuple of them) over groups of at most ``size`` of ``rows``
    (r,) in one loop, stitched to (b, r, ...): the last group padded by repeating its final row."""
    groups = row_tiles(rows, min(size, rows.shape[0]))
    if groups.shape[0] == 1:
        return fn(groups[0])
    out = jax.lax.map(fn, groups)  # (n, b, g, ...)

    def stitch(x):
        x = jnp.moveaxis(x, 0, 1)
        return x.reshape(x.shape[0], -1, *x.shape[3:])[:, : rows.shape[0]]

    return jax.tree.map(stitch, out)
