"""One prompt's length split over the mesh's "seq" axis: the collectives of a sequence-parallel forward.

Shard k of D holds positions [k l/D, (k+1) l/D) of every prompt (l/D = m). What crosses shards:

- The causal conv reads the previous k-1 conv inputs: :func:`previous_rows` passes each shard's last
  k-1 rows to the next by one ``ppermute`` (zeros into shard 0, as the single-device conv pads).
- A linear scan h_t = a_t h_{t-1} + b_t (a diagonal per head / channel-state). Each shard scans from a
  zero state, giving its final state f_k, and its total decay is exp(s_k), s_k = A times the sum of
  its Delta (per head / channel). The state entering shard k is the affine combination

      h_in_k = sum_{j<k} exp(s_{j+1} + ... + s_{k-1}) f_j   (+ exp(s_0 + ... + s_{k-1}) h_0),

  which :func:`carry_in` builds by a log-depth prefix (:func:`prefix`) over the shards' affine maps
  (s_k, f_k), composed as (s1 + s2, exp(A s2) f1 + f2) (every exponent <= 0): log2(D) ppermutes of one
  summary each, then one shift to make it exclusive and one psum for the state after the last shard,
  so a device holds and sends O(log D) summaries (an all_gather, the first version, brought all D and
  combined them in O(D^2)). The shard's outputs are then corrected,
  y_t += C_t . exp(A (Delta_1 + ... + Delta_t)) h_in_k (:func:`ssd_carry`, :func:`selective_scan_carry`),
  or the shard rescanned from h_in_k (twice the scan work); :mod:`latim_jax.kernels.dispatch` picks.
- The gated delta rule (Gated DeltaNet, KDA): S_t = A_t S_{t-1} + beta_t k_t v_t^T, the state (b, H, k,
  v) and A_t = (I - beta_t k_t k_t^T) D_t a k x k matrix per head (a padded position is an identity
  step: beta 0, g 0). Shard s runs the rule from a zero state, giving its final state F_s, and its
  transition P_s = A_end ... A_start (per head: the rule's final state from the identity with zero
  values; :mod:`latim_jax.model.delta_rule` runs both in one call, the identity's k columns beside the
  v values). The state entering shard s is

      S_in_s = sum_{j<s} P_{s-1} ... P_{j+1} F_j,   i.e. S_in_0 = 0, S_in_{j+1} = P_j S_in_j + F_j,

  which :func:`delta_carry_in` builds by the same log-depth prefix over the maps (P_s, F_s), composed
  as (P2 P1, P2 F1 + F2): log2(D) rounds, each a ppermute of one summary (4 MiB per prompt for 32 heads
  of k = v = 128) and 2 b H k^2 (k + v) flops (1.1 GFLOP per prompt and round at that size; the
  all_gather it replaced brought all D summaries, 256 MiB at D = 64, and combined them in D sequential
  products). The shard's outputs are then corrected exactly, o_t += S_in^T (A_t ... A_start)^T
  q_t, that last factor being the identity columns' outputs of the same call. The work: one chunked
  pass of width v + k (its width-bound terms twice a plain pass's for k = v) and an (m, k) x (k, v)
  product per head, about twice the shard's plain rule, as a rerun from S_in would be.
- The compensated cumulative sum S of Delta that the hidden attention M reads (kernels/decay.py): each
  shard sums its own Delta as hi + lo and adds the earlier shards' totals, carried by the same
  log-depth prefix in double-float (hi, lo) arithmetic (:func:`latim_jax.latim.mamba.cumulative_decay`),
  so S keeps its accuracy at any length without a device gathering Delta.
- Attention gathers the keys, values and the mask along the length (every device then holds the
  whole K/V) and masks causally with global positions (:mod:`latim_jax.model.attention`).

Every function here runs inside ``jax.shard_map`` over the context's mesh (:func:`split`), the length
on ``SEQ``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from latim_jax.parallel.context import Context
from latim_jax.parallel.mesh import DATA, SEQ, P

f32 = jnp.float32


def rows_spec(ctx: Context, batch: int, *rest) -> P:
    """The spec of a (b, l, ...) array whose length is split over "seq" (and batch over "data" when it
    divides); ``rest``: the specs of the trailing axes."""
    data = DATA if ctx.axis_size(DATA) > 1 and batch % ctx.axis_size(DATA) == 0 else None
    return P(data, SEQ, *rest)


def split(fn, ctx: Context, in_specs, out_specs):
    """``fn`` under ``jax.shard_map`` over the context's mesh (collectives over "seq" inside)."""
    return jax.shard_map(fn, mesh=ctx.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def offset(length: int, axis: str = SEQ):
    """The global position of this shard's first row (``length``: the rows per shard)."""
    return jax.lax.axis_index(axis) * length


def previous_rows(x, width: int, axis: str = SEQ):
    """The previous shard's last ``width`` rows of x (b, m, ...) along axis 1 (zeros on shard 0)."""
    n = jax.lax.axis_size(axis)
    if width > x.shape[1]:
        raise ValueError(
            f"a halo of {width} rows needs at least {width} positions per shard, found {x.shape[1]}"
        )
    return jax.lax.ppermute(x[:, x.shape[1] - width :], axis, [(i, i + 1) for i in range(n - 1)])


def gather_rows(x, axis: str = SEQ):
    """The whole length of x (b, m, ...): every shard's rows in order, (b, D m, ...)."""
    return jax.lax.all_gather(x, axis, axis=1, tiled=True)


def prefix(summary, combine, axis: str = SEQ, *, reverse: bool = False):
    """The inclusive prefix of the shards' ``summary`` (a pytree, one per shard) under an associative
    ``combine(earlier, later)``: shard k gets summary_0 o ... o summary_k (``reverse``: the suffix,
    summary_k o ... o summary_{D-1}). A log-depth (Hillis-Steele) scan: log2(D) rounds, each one
    ``ppermute`` of one summary to the shard 2^r further on (back) and one combine, so a device holds and
    sends O(log D) summaries, not the D an ``all_gather`` would bring."""
    n, k = jax.lax.axis_size(axis), jax.lax.axis_index(axis)
    acc, step = summary, 1
    while step < n:
        if reverse:
            later = jax.lax.ppermute(acc, axis, [(i + step, i) for i in range(n - step)])  # 0 at the end
            joined, received = combine(acc, later), k < n - step
        else:
            earlier = jax.lax.ppermute(acc, axis, [(i, i + step) for i in range(n - step)])  # 0 below step
            joined, received = combine(earlier, acc), k >= step
        acc = jax.tree.map(lambda j, a, r=received: jnp.where(r, j, a), joined, acc)
        step *= 2
    return acc


def shift_one(x, axis: str = SEQ, *, reverse: bool = False):
    """x of the previous shard (zeros on shard 0): an inclusive prefix made exclusive; ``reverse``: x of
    the next shard (zeros on the last)."""
    n = jax.lax.axis_size(axis)
    pairs = [(i + 1, i) for i in range(n - 1)] if reverse else [(i, i + 1) for i in range(n - 1)]
    return jax.tree.map(lambda a: jax.lax.ppermute(a, axis, pairs), x)


def from_last(x, axis: str = SEQ):
    """x of the last shard, on every shard (one psum of a summary)."""
    last = jax.lax.axis_index(axis) == jax.lax.axis_size(axis) - 1
    return jax.tree.map(lambda a: jax.lax.psum(jnp.where(last, a, jnp.zeros_like(a)), axis), x)


def carry_in(total_delta, A, final, initial=None, axis: str = SEQ):
    """(state entering this shard, state after the last shard) of a linear scan split over ``axis``.

    total_delta: the sum of this shard's Delta (b, h) (Mamba-2) / (b, e) (Mamba-1), its total log-decay
    being total_delta * A, A (h, 1, 1) / (e, n) broadcast against the state; final: its state after
    scanning from zero (b, h, p, n) / (b, e, n); initial: the state before shard 0 (None: zero).

    A shard is the affine map h -> exp(A s) h + f (s its Delta sum, f its final state); two in order
    compose as (s1, f1) then (s2, f2) = (s1 + s2, exp(A s2) f1 + f2), every exponent <= 0. The
    prefix of these maps over the shards (:func:`prefix`, log-depth) made exclusive (:func:`shift_one`)
    gives the state entering each shard from ``initial``. See the module docstring.
    """
    A = A.astype(f32)
    rank = final.ndim

    def decay(s):  # exp(A s), broadcast against the states
        return jnp.exp(s.reshape(s.shape + (1,) * (rank - s.ndim)) * A)

    def combine(earlier, later):
        (s1, f1), (s2, f2) = earlier, later
        return s1 + s2, decay(s2) * f1 + f2

    inclusive = prefix((total_delta.astype(f32), final.astype(f32)), combine, axis)
    (s_before, f_before), (s_all, f_all) = shift_one(inclusive, axis), from_last(inclusive, axis)
    if initial is None:
        return f_before, f_all
    h0 = initial.astype(f32)  # h_0 decays through every shard before
    return decay(s_before) * h0 + f_before, decay(s_all) * h0 + f_all


def ssd_carry(dt, A, C, h_in):
    """Mamba-2: what a state h_in (b, h, p, n) entering the shard adds to its outputs, (b, m, h, p):
    y_t += exp(A sum_{s<=t} Delta_s) C_t . h_in; dt (b, m, h), A (h,), C (b, m, g, n)."""
    b, m, h = dt.shape
    g = C.shape[2]
    decay = jnp.exp(jnp.cumsum(dt.astype(f32) * A.astype(f32), axis=1))  # (b, m, h)
    hg = h_in.reshape(b, g, h // g, *h_in.shape[2:])  # (b, g, r, p, n)
    y = jnp.einsum("bmgn,bgrpn->bmgrp", C.astype(f32), hg, precision="highest").reshape(b, m, h, -1)
    return y * decay[..., None]


def selective_scan_carry(delta, A, C, h_in):
    """Mamba-1: what a state h_in (b, e, n) entering the shard adds to its outputs, (b, m, e):
    y_t[e] += sum_n C_t[n] exp(A[e, n] sum_{s<=t} Delta_s[e]) h_in[e, n]; delta (b, m, e), A (e, n),
    C (b, m, n). One fused elementwise-and-reduce: no (b, m, e, n) array is kept."""
    cum = jnp.cumsum(delta.astype(f32), axis=1)  # (b, m, e)
    decay = jnp.exp(cum[..., None] * A.astype(f32))  # (b, m, e, n)
    return jnp.sum(C.astype(f32)[:, :, None, :] * decay * h_in.astype(f32)[:, None], axis=-1)


def delta_carry_in(final, transition, axis: str = SEQ):
    """The state entering this shard of a gated delta rule split over ``axis``, (b, H, k, v) fp32.

    final: this shard's state after running the rule from zero, F (b, H, k, v); transition: its product
    of the steps' k x k matrices, P = A_end ... A_start (b, H, k, k) (S_out = P S_in + F). Two shards in
    order compose as (P1, F1) then (P2, F2) = (P2 P1, P2 F1 + F2); the log-depth prefix of these maps
    (:func:`prefix`), made exclusive, is the state entering each shard from zero (see the module
    docstring for the cost)."""

    def combine(earlier, later):
        (p1, f1), (p2, f2) = earlier, later
        mul = lambda a, b: jnp.einsum("bhij,bhjv->bhiv", a, b, precision="highest")  # noqa: E731
        return mul(p2, p1), mul(p2, f1) + f2

    inclusive = prefix((transition.astype(f32), final.astype(f32)), combine, axis)
    return shift_one(inclusive, axis)[1]

