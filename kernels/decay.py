"""The hidden attention M of a Mamba layer (the decay tile): its ONE definition (shape letters: see
latim_jax.model.config; c = e channels for Mamba-1, h heads for Mamba-2).

    Mamba-1, per channel e:  M_{i,t}[e] = sum_n C_i[n] B_t[n] Delta_t[e] exp(A[e,n] (S_i[e] - S_t[e]))
    Mamba-2, per head h:     M_{i,t}[h] = (C_i[g(h)] . B_t[g(h)]) Delta_t[h] exp(A[h] (S_i[h] - S_t[h]))
    plus [i = t] D on the diagonal, and M_{i,t} = 0 for t > i,

with S_i = sum_{k<=i} Delta_k. S is held as a compensated (double-float) cumulative sum, so the segment
sums S_i - S_t keep fp32 relative accuracy at any length, and the exponent is masked before
exponentiating (never exp of a difference of long cumulative sums, never an overflow whose gradient
would be NaN).

Who uses what:
- the elementwise entry (:func:`m2_entry`, :func:`m1_entry`, :func:`with_skip`) is the formula itself:
  :func:`decay_tile` builds blocks of M from it, and every tile body of the fused score kernel
  (kernels/fused_scores_tiles.py) calls the same functions on its in-kernel layout;
- :func:`decay_tile` is the block-level M of the XLA score path, the hidden-attention baseline and
  (through them) the fused kernel's reference;
- Mamba-1 tiles whose every source precedes every target (:func:`is_far`) factor the decay through the
  tile's first target (:func:`far_factors`), so that a per-channel (r x n)(n x q) product replaces the
  r q e n exponentials: :func:`far_tile` (M itself), :func:`far_tapped` (M applied to the conv taps,
  never forming M) and :func:`far_mean` (M's mean over channels); :func:`m1_far_or_near` is the one
  split between them and the direct form (a ``lax.cond`` over tile-sized operands), for all three;
- Mamba-2 tiles are built inside :func:`m2_far_or_near`, the same kind of cond (far tiles skip the
  mask), with whatever consumes M (the score path's conv taps) inside it.
"""

from __future__ import annotations

import dataclasses
import functools
import operator

import jax
import jax.numpy as jnp

from latim_jax.kernels import f32
from latim_jax.kernels.products import bmul


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Decay:
    """Compensated cumulative sums of Delta: S = hi + lo, each (b, l, c). S's tangent rides on hi alone
    (lo is held fixed: its tangent is zero but for rounding, see :func:`compensated_cumsum`)."""

    hi: jax.Array
    lo: jax.Array


def two_sum(a, b):
    """(a + b, its rounding error) exactly (Knuth's TwoSum): a + b = s + err in real arithmetic."""
    s = a + b
    bb = s - a
    return s, (a - (s - bb)) + (b - bb)


def compensated_cumsum(delta) -> Decay:
    """S_t = sum_{k<=t} delta_k along axis 1 as an unevaluated sum hi + lo (:func:`two_sum` per step)."""

    def step(carry, x):
        hi, lo = carry
        s, err = two_sum(hi, x)
        lo = lo + err
        return (s, lo), (s, lo)

    zero = jnp.zeros_like(delta[:, 0])
    _, (hi, lo) = jax.lax.scan(step, (zero, zero), jnp.swapaxes(delta.astype(f32), 0, 1))
    # S's tangent is cumsum(d delta), carried by hi alone (s = hi + x); lo's is the tangent of rounding
    # errors, zero but for rounding. Without it the backward of a score loop accumulates a second
    # full-size cotangent of S (130m Mamba-1 l2 gradient at L = 1024: 247 -> 241 MiB temporaries)
    return Decay(jnp.swapaxes(hi, 0, 1), jax.lax.stop_gradient(jnp.swapaxes(lo, 0, 1)))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SSM:
    """What M is built from, for one layer (fp32): A (e, n) Mamba-1 / (h,) Mamba-2; D (e,) / (h,);
    delta (b, l, c); B, C (b, l, n) Mamba-1 / (b, l, g, n) Mamba-2; decay = S (:class:`Decay`)."""

    version: int = dataclasses.field(metadata=dict(static=True))
    A: jax.Array
    D: jax.Array
    delta: jax.Array
    B: jax.Array
    C: jax.Array
    decay: Decay

    @classmethod
    def build(cls, version: int, A, D, delta, B, C, decay: Decay | None = None) -> SSM:
        """The SSM of a layer, its cumulative sums of Delta computed here unless given (``decay``: a
        length split over devices sums its shards' own, :func:`latim_jax.latim.mamba.cumulative_decay`)."""
        return cls(version, A, D, delta, B, C, compensated_cumsum(delta) if decay is None else decay)

    @property
    def length(self) -> int:
        """Sequence length l."""
        return self.delta.shape[1]

    def take(self, positions) -> SSM:
        """This SSM at ``positions`` (p,) only: Delta, B, C and S gathered to length p, A and D kept
        (what a tile's branch of a ``lax.cond`` reads instead of the whole layer: see
        :func:`m1_far_or_near`)."""

        def at(x):
            return x[:, positions]

        decay = Decay(at(self.decay.hi), at(self.decay.lo))
        return SSM(self.version, self.A, self.D, at(self.delta), at(self.B), at(self.C), decay)

    @property
    def heads(self) -> int:
        """c: the maps' channel count, e (Mamba-1) or h (Mamba-2)."""
        return self.A.shape[0]


# --------------------------------------------------------------------------------------------------
# The entry: elementwise, broadcasting, also traced inside the fused kernels' tile bodies.
# --------------------------------------------------------------------------------------------------


def m2_entry(cb, A, seg, dt, causal):
    """Mamba-2 M without D: cb * exp(A seg) * dt where ``causal``, exactly 0 elsewhere (cb and dt finite):
    the exponent is masked to -inf before exp, so nothing overflows and the gradient is 0 there.
    cb = C_i . B_t of the head's group, seg = S_i - S_t, dt = Delta_t. No select after the exp: with
    one, XLA:CPU stopped fusing the tile into the logit score's contraction and wrote the (r, q, e)
    values out (one 130m Mamba-2 layer's logit scores at L = 512: 0.41 -> 0.77 s)."""
    return cb * jnp.exp(jnp.where(causal, A * seg, -jnp.inf)) * dt


def m1_entry(cb_terms, A_terms, seg, dt, causal, mul=operator.mul):
    """Mamba-1 M without D: (sum_n cb_n exp(A_n seg)) * dt where ``causal``, exactly 0 elsewhere (dt
    finite). ``cb_terms`` / ``A_terms``: the n values of C_i[n] B_t[n] and of A[:, n], each broadcastable
    against seg; the n-sum is n fused passes over the seg block (no (.., e, n) tensor). dt multiplies
    after the select, not inside it: inside, XLA:CPU fused the tile less well into what consumes it
    (one 130m Mamba-1 layer's logit scores at L = 512: ~10% slower). ``mul``: the broadcast product
    (the XLA path passes :func:`~latim_jax.kernels.products.bmul`, whose transposes are contractions;
    the kernels' tile bodies keep the plain one)."""
    seg = jnp.where(causal, seg, 0.0)
    s = sum(mul(cb, jnp.exp(a * seg)) for cb, a in zip(cb_terms, A_terms, strict=True))
    return mul(jnp.where(causal, s, 0.0), dt)


def with_skip(M, diag, D):
    """M + [i = t] D: the skip term on the diagonal."""
    return M + jnp.where(diag, D, 0.0)


# --------------------------------------------------------------------------------------------------
# Blocks of M for target rows x source columns (index arrays).
# --------------------------------------------------------------------------------------------------


def segment_sum(decay: Decay, rows, cols):
    """S_i - S_t for target positions ``rows`` (r,) and source positions ``cols`` (q,): (b, r, q, c)."""
    hi_i, lo_i = decay.hi[:, rows], decay.lo[:, rows]
    hi_t, lo_t = decay.hi[:, cols], decay.lo[:, cols]
    return (hi_i[:, :, None] - hi_t[:, None]) + (lo_i[:, :, None] - lo_t[:, None])


def causal_mask(rows, cols, length):
    """(r, q) bool: source t <= target i and t inside the sequence."""
    return (cols[None, :] <= rows[:, None]) & (cols[None, :] < length)


def is_far(rows, cols):
    """Whether a tile is far: every source strictly before every target, so it holds no diagonal entry
    and no masked pair, and (Mamba-1) its decay factors through its first target."""
    return jnp.max(cols) < jnp.min(rows)


def decay_tile(
    ssm: SSM, rows, cols, *, with_D=True, direct=False, direct_rows=32, tangent_rows=16, state_group=2
):  # fmt: skip
    """M_{i,t} for i in ``rows``, t in ``cols`` (index arrays; cols may run past the end: zero there):
    (b, r, q, c).

    Mamba-1: a far tile (:func:`is_far`) is the per-channel product of its factors, other tiles take
    the direct form (:func:`m1_far_or_near`). Mamba-2: the direct form, far and near tiles split by
    :func:`m2_far_or_near`. ``direct``: the direct form on every tile, without P and
    Q (for a few rows, where the factored product's operand costs more than the exponentials).
    """
    length = ssm.length
    if ssm.version == 1:
        if direct:
            safe = jnp.minimum(cols, length - 1)
            return m1_direct_tile(
                ssm, rows, safe, rows, cols, length, with_D, direct_rows, tangent_rows, state_group
            )
        return m1_far_or_near(
            ssm,
            rows,
            cols,
            far_tile,
            lambda M: M,
            with_D=with_D,
            direct_rows=direct_rows,
            tangent_rows=tangent_rows,
            state_group=state_group,
        )
    return m2_far_or_near(ssm, rows, cols, lambda M: M, with_D=with_D)


def tile_local(ssm: SSM, rows, cols):
    """The SSM at a tile's positions (:meth:`SSM.take`: ``rows``, then ``cols`` clamped into the
    sequence) and the indices of the rows and of the columns in it: what the branches of a far/near
    cond read instead of the whole layer."""
    safe = jnp.minimum(cols, ssm.length - 1)
    local = ssm.take(jnp.concatenate([rows, safe]))
    return local, jnp.arange(rows.shape[0]), rows.shape[0] + jnp.arange(cols.shape[0])


def m2_far_or_near(ssm: SSM, rows, cols, apply, *args, with_D: bool):
    """``apply(M, *args)`` for the Mamba-2 tile M of target positions ``rows`` and source positions
    ``cols`` (with D when ``with_D``), inside one ``lax.cond`` on :func:`is_far` whose branches read only
    tile-sized arrays (the SSM at the tile's positions, :meth:`SSM.take`, and ``args``): a far tile
    skips the causal mask and the diagonal (it has neither), a near one applies both.

    The cond is also where M and ``apply``'s result are written out: without it XLA:CPU fused M's
    gathers, masks and exponentials, and the taps' sum, into every consumer of the (r, q, e) block in
    the backward (the gate's and the taps' transposes), recomputing them per channel and per pass (one
    d_model 128 layer's l2 gradient at L = 1024: 2.4 -> 0.96 s; optimization_barrier does not survive
    XLA:CPU's passes). Reading tile-sized operands keeps the cond's transpose from returning a
    full-size zero cotangent per tile (an L^3 term; see :func:`m1_far_or_near`)."""
    length = ssm.length
    local, ir, ic = tile_local(ssm, rows, cols)

    def far_branch(local, *args):
        return apply(m2_direct_tile(local, ir, ic, rows, cols, length, with_D=False, far=True), *args)

    def near_branch(local, *args):
        return apply(m2_direct_tile(local, ir, ic, rows, cols, length, with_D=with_D), *args)

    return jax.lax.cond(is_far(rows, cols), far_branch, near_branch, local, *args)


def m2_direct_tile(ssm: SSM, ir, ic, rows, cols, length: int, *, with_D: bool, far: bool = False):
    """The Mamba-2 M (b, r, q, h) for target positions ``rows`` (r,) and source positions ``cols`` (q,)
    of a sequence of ``length``, reading ``ssm``'s arrays at indices ``ir`` and ``ic`` (as
    :func:`m1_direct_tile`). ``far``: the tile is far (:func:`is_far`), so no mask and no D are applied."""
    dt = ssm.delta[:, ic].astype(f32)[:, None]  # (b, 1, q, h)
    heads, g = ssm.heads, ssm.C.shape[2]
    cb = jnp.einsum("brgn,bqgn->brqg", ssm.C[:, ir].astype(f32), ssm.B[:, ic].astype(f32))
    cb = jnp.repeat(cb, heads // g, axis=-1)  # (b, r, q, h): head h reads group h // (h/g)
    seg = segment_sum(ssm.decay, ir, ic)
    if far:  # every pair causal (seg >= 0, no overflow), no diagonal
        return m2_entry(cb, ssm.A, seg, dt, True)
    causal = causal_mask(rows, cols, length)  # (r, q)
    M = m2_entry(cb, ssm.A, seg, dt, causal[None, :, :, None])
    if with_D:
        diag = (rows[:, None] == cols[None, :])[None, :, :, None]  # (1, r, q, 1)
        M = with_skip(M, diag, ssm.D.astype(f32))
    return M


def m1_far_or_near(
    ssm: SSM, rows, cols, far, near, *args, with_D: bool, direct_rows: int = 32, tangent_rows: int = 16,
    state_group: int = 2,
):  # fmt: skip
    """A Mamba-1 tile, split: ``far(P, Q, *args)`` when it is far (:func:`is_far`; P, Q its
    :func:`far_factors`), else ``near(M, *args)`` with M the tile's direct form (:func:`m1_direct_tile`,
    with D when ``with_D``). One ``lax.cond`` whose branches read only tile-sized arrays: P, Q and the
    SSM at the tile's positions (:meth:`SSM.take`) are gathered before it. (The transpose of a cond
    returns a cotangent for every array its branches read; had the near branch read the layer's
    (b, l, e) Delta and S, every far tile's backward would have added a full-size zero array: a term
    growing as L^3. P and Q are outside the cond also for the forward: inside, XLA fuses their
    exponentials into the product.)"""
    length = ssm.length
    safe = jnp.minimum(cols, length - 1)
    P, Q = far_factors(ssm, rows, safe)
    local, ir, ic = tile_local(ssm, rows, cols)

    def far_branch(P, Q, local, *args):
        return far(P, Q, *args)

    def near_branch(P, Q, local, *args):
        # M out of a second cond on the same predicate (false here) is written out once: fused into
        # the taps' transposing consumer, XLA:CPU ran its exponentials in the consumer's strided
        # order (the near tiles ~3x slower; optimization_barrier does not survive XLA's passes)
        M = jax.lax.cond(
            is_far(rows, cols),
            lambda local: jnp.zeros((*P.shape[:2], Q.shape[1], P.shape[2]), f32),
            lambda local: m1_direct_tile(
                local, ir, ic, rows, cols, length, with_D, direct_rows, tangent_rows, state_group
            ),
            local,
        )
        return near(M, *args)

    return jax.lax.cond(is_far(rows, cols), far_branch, near_branch, P, Q, local, *args)


def m1_direct_tile(
    ssm: SSM, ir, ic, rows, cols, length: int, with_D: bool, direct_rows: int, tangent_rows: int = 16,
    state_group: int = 2,
):  # fmt: skip
    """The Mamba-1 direct form of M (b, r, q, e) for target positions ``rows`` (r,) and source positions
    ``cols`` (q,) of a sequence of ``length``, reading ``ssm``'s arrays at indices ``ir`` (the rows) and
    ``ic`` (the columns, clamped into the sequence): the positions themselves for the layer's SSM, or
    ``arange`` offsets into an SSM taken at the tile's positions (:meth:`SSM.take`). Its r q e n
    exponentials run in passes of ``direct_rows`` rows (``tangent_rows`` under differentiation),
    rematerialised under differentiation (they are n times the tile's size), and a pass's backward
    takes its states ``state_group`` at a time (:func:`m1_state_sum`)."""
    causal = causal_mask(rows, cols, length)  # (r, q)
    dt = ssm.delta[:, ic].astype(f32)[:, None]  # (b, 1, q, e)
    M = jax.checkpoint(
        lambda ssm, causal, dt: _m1_direct(ssm, ir, ic, causal, dt, direct_rows, tangent_rows, state_group)
    )(ssm, causal, dt)
    if with_D:
        diag = (rows[:, None] == cols[None, :])[None, :, :, None]  # (1, r, q, 1)
        M = with_skip(M, diag, ssm.D.astype(f32))
    return M


@functools.partial(jax.custom_jvp, nondiff_argnums=(5, 6, 7))
def _m1_direct(ssm: SSM, rows, cols, causal, dt, direct_rows: int, tangent_rows: int, state_group: int):
    """The Mamba-1 direct form (b, r, q, e), in passes of ``direct_rows`` target rows when r is a larger
    multiple of it (each pass rematerialised: the backward of one pass holds a (pass, q, e, n) block of
    exponentials, so a 64-row tile costs the backward what a 32-row tile did).

    Differentiated, the passes take at most ``tangent_rows`` (``Blocks.m1_tangent_rows``) rows: a 130m
    Mamba-1 layer's l2 gradient at L = 1024 then holds 211 MiB of temporaries instead of 217 at the same
    speed, where 16-row passes in the forward cost it ~4% (its 32-row default stays)."""
    return _m1_passes(ssm, rows, cols, causal, dt, direct_rows, state_group)


@_m1_direct.defjvp
def _m1_direct_jvp(direct_rows, tangent_rows, state_group, primals, tangents):
    rows = min(direct_rows, tangent_rows)
    return jax.jvp(lambda *args: _m1_passes(*args, rows, state_group), primals, tangents)


def _m1_passes(ssm: SSM, rows, cols, causal, dt, direct_rows: int, state_group: int):
    """:func:`_m1_direct`'s value, in passes of ``direct_rows``."""
    r = rows.shape[0]

    def one(rows, causal):
        cb = bmul(ssm.C[:, rows][:, :, None, :], ssm.B[:, cols][:, None, :, :])  # (b, r, q, n)
        seg = segment_sum(ssm.decay, rows, cols)
        return m1_state_sum(cb, ssm.A, seg, dt, causal[None, :, :, None], state_group)

    if r <= direct_rows or r % direct_rows:
        return one(rows, causal)
    passes = jax.lax.map(
        jax.checkpoint(lambda args: one(*args)),
        (rows.reshape(-1, direct_rows), causal.reshape(-1, direct_rows, causal.shape[1])),
    )  # (passes, b, pass, q, e)
    passes = jnp.moveaxis(passes, 0, 1)
    return passes.reshape(passes.shape[0], r, *passes.shape[3:])


def _state_sum(cb, A, seg, dt, causal):
    """:func:`m1_entry` over the states of cb (b, r, q, n) and A (e, n) (n = all, or one group)."""
    n = A.shape[1]
    return m1_entry(
        [cb[..., k, None] for k in range(n)], [A[:, k] for k in range(n)], seg, dt, causal, mul=bmul
    )


@functools.partial(jax.custom_jvp, nondiff_argnums=(5,))
def m1_state_sum(cb, A, seg, dt, causal, group: int = 2):
    """The direct form's :func:`m1_entry` for cb (b, r, q, n) = C_i[n] B_t[n], A (e, n), seg (b, r, q, e),
    dt (b, 1, q, e) and causal (1, r, q, 1): the n terms in one fused pass, as before.

    Its tangent takes the states in groups of ``group`` (``Blocks.m1_state_group``; all n at once when
    n is not a multiple of it), in a scan whose step is
    rematerialised: the transpose of the plain sum held all n exponential blocks exp(A[:, n] seg) of
    the pass at once (16 x (32, 35, e) fp32 for a 130m Mamba-1 near tile, ~105 MiB of its gradient's
    341 MiB of temporaries at L = 1024), the scan's holds one group's (4: 263 MiB; 2 once the taps'
    tangent held one window at a time, 230 -> 217 MiB, where 1 gains nothing more). The forward keeps
    the one fused pass (a scan there cost the 130m forward ~25%); the gradient recomputes each group's
    exponentials once more."""
    return _state_sum(cb, A, seg, dt, causal)


@m1_state_sum.defjvp
def _m1_state_sum_jvp(size, primals, tangents):
    cb, A, seg, dt, causal = primals
    dcb, dA, dseg, ddt, _ = tangents
    n = A.shape[1]
    g = size if n % size == 0 else n

    @jax.checkpoint
    def group(acc, xs):
        cb_g, A_g, dcb_g, dA_g = xs  # (b, r, q, g), (e, g) and their tangents
        entry = lambda cb_g, A_g, seg, dt: _state_sum(cb_g, A_g, seg, dt, causal)  # noqa: E731
        return acc + jax.jvp(entry, (cb_g, A_g, seg, dt), (dcb_g, dA_g, dseg, ddt))[1], None

    def grouped(x):  # (..., n) -> (n / g, ..., g)
        return jnp.moveaxis(x.reshape(*x.shape[:-1], n // g, g), -2, 0)

    zero = jnp.zeros(jnp.broadcast_shapes(seg.shape, dt.shape), f32)
    tangent, _ = jax.lax.scan(group, zero, (grouped(cb), grouped(A), grouped(dcb), grouped(dA)))
    return m1_state_sum(cb, A, seg, dt, causal, size), tangent


def far_factors(ssm: SSM, rows, cols):
    """The two factors of the Mamba-1 M through the reference r = min(rows):

        P[i, e, n] = C_i[n] exp(A[e, n] (S_i - S_r)[e])                (b, r, e, n)
        Q[t, e, n] = B_t[n] Delta_t[e] exp(A[e, n] (S_r - S_t)[e])     (b, q, e, n)

    so that sum_n P[i, e, n] Q[t, e, n] = M_{i,t}[e] without D for every source t <= r (both
    exponentials <= 1); ``cols`` must lie inside the sequence. Both exponents are clamped at 0: a
    source after r gets a finite factor that no caller uses (its tile takes the direct form), never an
    overflow whose gradient would be NaN."""
    A = ssm.A
    ref = jnp.min(rows)[None]
    to_i = jnp.maximum(segment_sum(ssm.decay, rows, ref)[:, :, 0], 0.0)  # (b, r, e): S_i - S_r
    from_t = jnp.maximum(segment_sum(ssm.decay, ref, cols)[:, 0], 0.0)  # (b, q, e): S_r - S_t
    P = bmul(ssm.C[:, rows].astype(f32)[:, :, None], jnp.exp(bmul(A, to_i[..., None])))
    B_dt = bmul(ssm.B[:, cols].astype(f32)[:, :, None], ssm.delta[:, cols].astype(f32)[..., None])
    Q = B_dt * jnp.exp(bmul(A, from_t[..., None]))
    return P, Q


def far_tile(P, Q):
    """M[i, t, e] = sum_n P[i, e, n] Q[t, e, n] of a far tile (b, r, q, e): a (r x n)(n x q) product per
    channel, from (r + q) e n exponentials instead of the direct form's r q e n."""
    return jnp.einsum("bren,bqen->brqe", P, Q)


def far_tapped(P, Q, a):
    """sum_k M_{i,j+k}[e] a_k[j, e] of a far tile, channels first (b, e, r, width), without forming M:
    the taps go onto the small factor Q (q = width + K - 1 columns), then one per-channel product."""
    K, width = a.shape[0], a.shape[2]
    # tap k as a product with the whole window Q, sliced after: a linearisation keeps Q (an operand of
    # the far/near cond) instead of K shifted slices of it as residuals of the cond
    Qa = sum(
        bmul(Q, in_window(a[k], k, K)[..., None])[:, k : k + width] for k in range(K)
    )  # (b, width, e, n)
    return jnp.einsum("bren,bjen->berj", P, Qa)  # the batched product's own layout


def in_window(x, k: int, K: int):
    """x (b, q, ...) placed at offset k of a (b, q + K - 1, ...) window of zeros: tap k's term of a sum
    sum_k W[:, k : k + q] * x_k, written (W * in_window(x_k))[:, k : k + q], multiplies the whole window
    W. Linearised, the term then keeps W itself as its residual, once for all K taps, rather than K
    shifted slices of it (a window M or Q of a score tile: 4 copies written out per tile backward)."""
    return jnp.pad(x, ((0, 0), (k, K - 1 - k)) + ((0, 0),) * (x.ndim - 2))


def far_mean(P, Q):
    """The mean over channels of a far tile's M, (b, r, q): one (r x e n)(e n x q) product."""
    return jnp.einsum("bren,bqen->brq", P, Q) / P.shape[2]


def full_hidden_attention(ssm: SSM, *, with_D=True):
    """The whole (b, l, l, c) M (small inputs only)."""
    idx = jnp.arange(ssm.length)
    return decay_tile(ssm, idx, idx, with_D=with_D)
