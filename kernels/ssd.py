"""Mamba-2 SSD (state-space duality) scan, chunked: Pallas kernels (TPU and GPU variants), custom_jvp
wrapper, pure-jnp references.

    state_t[h] = exp(dt_t[h] A[h]) state_{t-1}[h] + dt_t[h] x_t[h] (outer) B_t[g(h)]   (p, n)
    y_t[h]     = state_t[h] . C_t[g(h)] + D[h] x_t[h]

Head h reads group g(h) = h // (h_total / g) (contiguous blocks of heads). dt is the final Delta
(softplus and clamp already applied). Shapes (glossary: b batch, l length, h heads, p head dim, g groups,
n state size, q chunk length): x (b, l, h, p); dt (b, l, h); A (h,); B, C (b, l, g, n); D (h,);
state (b, h, p, n). All math in fp32; any l >= 1 (padded to the chunk internally).

Order of this file: kernels, forward driver, custom_jvp public function, references (last).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from latim_jax.kernels.block_sizes import (
    Blocks,
    gpu_compiler_params,
    next_pow2,
    resolve_target,
    round_up,
    tpu_compiler_params,
)

# --------------------------------------------------------------------------------------------------
# Kernels. Inputs prepared by the driver, all fp32: a = dt A (log-decay per step), xdt = dt x, B, C of
# the head's group, h0 = initial state (p, n). One chunk of q steps, with S_i = sum_{k <= i} a_k its
# chunk-local cumulative log-decay:
#   y_i     = sum_{j <= i} exp(S_i - S_j) (C_i . B_j) xdt_j + exp(S_i) C_i . state_in
#   state_out = exp(S_q) state_in + sum_j exp(S_q - S_j) xdt_j (outer) B_j
# Differences S_i - S_j are masked to the causal triangle before exp. The D x skip is added by the driver.
# --------------------------------------------------------------------------------------------------

_HIGHEST = lax.Precision.HIGHEST  # fp32 operands: IEEE on GPU (default would be TF32), 6-pass on TPU


def _dot(a, b):  # (m, k) (k, n) -> (m, n)
    return jnp.dot(a, b, precision=_HIGHEST, preferred_element_type=jnp.float32)


def _dot_nt(a, b):  # (m, k) (n, k) -> (m, n)
    return lax.dot_general(
        a, b, (((1,), (1,)), ((), ())), precision=_HIGHEST, preferred_element_type=jnp.float32
    )


def _dot_tn(a, b):  # (k, m) (k, n) -> (m, n)
    return lax.dot_general(
        a, b, (((0,), (0,)), ((), ())), precision=_HIGHEST, preferred_element_type=jnp.float32
    )


def _ssd_chunk(seg, causal, exp_S, to_end, decay_chunk, xdt, B, C, h):
    """One chunk, shared by both variants.

    seg (q, q) = S_i - S_j; causal (q, q) bool; exp_S (q, 1) = exp(S_i); to_end (q, 1) = exp(S_q - S_j);
    decay_chunk = exp(S_q) (scalar or (1, 1)); xdt (q, p); B, C (q, n); h (p, n).
    Returns (y (q, p), state after the chunk (p, n)).
    """
    decay = jnp.where(causal, jnp.exp(jnp.where(causal, seg, 0.0)), 0.0)  # (q, q), mask before exp
    scores = _dot_nt(C, B) * decay  # (C_i . B_j) exp(S_i - S_j)
    y = _dot(scores, xdt) + exp_S * _dot_nt(C, h)  # intra-chunk + entering state
    h = decay_chunk * h + _dot_tn(xdt, to_end * B)  # (p, n)
    return y, h


def _ssd_kernel_tpu(a_ref, xdt_ref, B_ref, C_ref, h0_ref, y_ref, hT_ref, h_scr):
    """TPU tile: grid (b, h, l-chunks), l-chunks last and "arbitrary"; one chunk per grid step.

    Blocks: a (q, 1) (column: q on sublanes); xdt/y (q, p); B/C (q, n) of the head's group;
    h0/hT (p, n); scratch h_scr (p, n) carries the state across chunks. Cumulative sums: S_i through
    a tril(ones) @ a matmul, S_j (as a row) through a masked sublane sum; no cumsum in-kernel.
    """
    chunk = pl.program_id(2)

    @pl.when(chunk == 0)
    def _():
        h_scr[...] = h0_ref[...]

    a = a_ref[...]  # (q, 1)
    q = a.shape[0]
    row = lax.broadcasted_iota(jnp.int32, (q, q), 0)
    col = lax.broadcasted_iota(jnp.int32, (q, q), 1)
    causal = row >= col
    a_b = jnp.broadcast_to(a, (q, q))  # [k, j] = a_k
    S_col = _dot(causal.astype(jnp.float32), a_b)  # [i, j] = S_i (tril-ones matmul)
    S_row = jnp.sum(jnp.where(row <= col, a_b, 0.0), axis=0, keepdims=True)  # (1, q): S_j
    S_last = jnp.sum(a, axis=0, keepdims=True)  # (1, 1)
    S_i = S_col[:, :1]  # (q, 1)
    y, h = _ssd_chunk(
        S_col - S_row,
        causal,
        jnp.exp(S_i),
        jnp.exp(S_last - S_i),
        jnp.exp(S_last),
        xdt_ref[...],
        B_ref[...],
        C_ref[...],
        h_scr[...],
    )
    y_ref[...] = y
    h_scr[...] = h

    @pl.when(chunk == pl.num_programs(2) - 1)
    def _():
        hT_ref[...] = h


def _ssd_kernel_gpu(a_ref, xdt_ref, B_ref, C_ref, h0_ref, y_ref, hT_ref, *, q, n_chunks):
    """GPU (Triton) tile: grid (b, h, p-blocks), all parallel; the whole sequence per program.

    Blocks: a (l,); xdt/y (l, tp); B/C (l, n) of the head's group; h0/hT (tp, n). A fori_loop over the
    chunks carries the state as a loop value and loads/stores (q, .) slices; q, tp, n powers of two.
    Cumulative sums: S_i = sum_k tril[i, k] a_k as a masked lane sum (tril(ones) @ a, exact in fp32).
    """
    row = lax.broadcasted_iota(jnp.int32, (q, q), 0)
    col = lax.broadcasted_iota(jnp.int32, (q, q), 1)
    causal = row >= col

    def body(c, h):
        s = pl.ds(pl.multiple_of(c * q, q), q)
        a = a_ref[s]  # (q,)
        S = jnp.sum(jnp.where(causal, a[None, :], 0.0), axis=1)  # (q,): S_i
        S_last = jnp.sum(a)
        y, h = _ssd_chunk(
            S[:, None] - S[None, :],
            causal,
            jnp.exp(S)[:, None],
            jnp.exp(S_last - S)[:, None],
            jnp.exp(S_last),
            xdt_ref[s, :],
            B_ref[s, :],
            C_ref[s, :],
            h,
        )
        y_ref[s, :] = y
        return h

    hT_ref[...] = lax.fori_loop(0, n_chunks, body, h0_ref[...])


# --------------------------------------------------------------------------------------------------
# Forward driver: fp32 casts, padding, layout, pallas_call.
# --------------------------------------------------------------------------------------------------


def _pad_length(x, size: int):
    """Zero-pad axis 1 (length) of x up to `size`: a = xdt = B = C = 0 keeps the state unchanged."""
    if x.shape[1] == size:
        return x
    return jnp.pad(x, [(0, 0), (0, size - x.shape[1])] + [(0, 0)] * (x.ndim - 2))


def _group_of(head, rep: int):
    """g(h) = h // rep, written with lax.div (floor-div in an index_map asks TPU lowering for a device)."""
    return lax.div(head, jnp.int32(rep))


def _ssd_forward_tpu(a, xdt, B, C, h0, chunk: int, interpret: bool):
    """pallas_call of the TPU variant. a (b, l, h); xdt (b, l, h, p). Returns (y_ssm, final state)."""
    b, l, h, p = xdt.shape
    g, n = B.shape[2], B.shape[3]
    q = min(chunk, round_up(l, 8))
    if not interpret and q % 8:
        raise ValueError(f"TPU ssd_chunk must be a multiple of 8, found {q}")
    lp, rep = round_up(l, q), h // g
    a_t = _pad_length(a, lp).transpose(0, 2, 1)[..., None]  # (b, h, lp, 1)
    xdt_t = _pad_length(xdt, lp).transpose(0, 2, 1, 3)  # (b, h, lp, p)
    B_t, C_t = (_pad_length(t, lp).transpose(0, 2, 1, 3) for t in (B, C))  # (b, g, lp, n)

    def spec(width, grouped=False):
        head = (lambda j: _group_of(j, rep)) if grouped else (lambda j: j)
        return pl.BlockSpec((pl.squeezed, pl.squeezed, q, width), lambda i, j, k: (i, head(j), k, 0))

    state = pl.BlockSpec((pl.squeezed, pl.squeezed, p, n), lambda i, j, k: (i, j, 0, 0))
    y, hT = pl.pallas_call(
        _ssd_kernel_tpu,
        out_shape=(
            jax.ShapeDtypeStruct((b, h, lp, p), jnp.float32),
            jax.ShapeDtypeStruct((b, h, p, n), jnp.float32),
        ),
        grid=(b, h, lp // q),
        in_specs=[spec(1), spec(p), spec(n, True), spec(n, True), state],
        out_specs=(spec(p), state),
        scratch_shapes=[pltpu.VMEM((p, n), jnp.float32)],
        compiler_params=tpu_compiler_params(("parallel", "parallel", "arbitrary")),
        interpret=interpret,
    )(a_t, xdt_t, B_t, C_t, h0)
    return y.transpose(0, 2, 1, 3)[:, :l], hT


def _ssd_forward_gpu(a, xdt, B, C, h0, chunk: int, block_p, num_warps: int, interpret: bool):
    """pallas_call of the GPU variant, natural layouts. Returns (y_ssm (b, l, h, p), final state)."""
    b, l, h, p = xdt.shape
    g, n = B.shape[2], B.shape[3]
    q = min(chunk, max(next_pow2(l), 1 if interpret else 16))
    tp = p if block_p is None else min(block_p, p)
    if not interpret:
        for name, v in (("chunk", q), ("block_p", tp), ("n", n)):
            if v & (v - 1) or v < 16:
                raise ValueError(f"the GPU SSD needs {name} to be a power of two >= 16, found {v}")
    if p % tp:
        raise ValueError(f"ssd_block_p={tp} must divide the head dim p={p}")
    lp, rep = round_up(l, q), h // g
    a, xdt, B, C = (_pad_length(t, lp) for t in (a, xdt, B, C))

    seq = pl.BlockSpec((pl.squeezed, lp, pl.squeezed, tp), lambda i, j, k: (i, 0, j, k))
    bc = pl.BlockSpec((pl.squeezed, lp, pl.squeezed, n), lambda i, j, k: (i, 0, _group_of(j, rep), 0))
    state = pl.BlockSpec((pl.squeezed, pl.squeezed, tp, n), lambda i, j, k: (i, j, k, 0))
    y, hT = pl.pallas_call(
        functools.partial(_ssd_kernel_gpu, q=q, n_chunks=lp // q),
        out_shape=(
            jax.ShapeDtypeStruct((b, lp, h, p), jnp.float32),
            jax.ShapeDtypeStruct((b, h, p, n), jnp.float32),
        ),
        grid=(b, h, p // tp),
        in_specs=[
            pl.BlockSpec((pl.squeezed, lp, pl.squeezed), lambda i, j, k: (i, 0, j)),
            seq,
            bc,
            bc,
            state,
        ],
        out_specs=(seq, state),
        compiler_params=gpu_compiler_params(num_warps),
        interpret=interpret,
    )(a, xdt, B, C, h0)
    return y[:, :l], hT


def _ssd_forward(x, dt, A, B, C, D, chunk_size, initial_state, config):
    """Kernel forward: (y (b, l, h, p), final_state (b, h, p, n)), both fp32."""
    block_sizes, target, interpret = config
    x, dt, A, B, C, D = (t.astype(jnp.float32) for t in (x, dt, A, B, C, D))
    b, _, h, p = x.shape
    h0 = (
        jnp.zeros((b, h, p, B.shape[-1]), jnp.float32)
        if initial_state is None
        else initial_state.astype(jnp.float32)
    )
    chunk = block_sizes.ssd_chunk or chunk_size
    a, xdt = dt * A, dt[..., None] * x  # (b, l, h), (b, l, h, p)
    if target == "tpu":
        y, final = _ssd_forward_tpu(a, xdt, B, C, h0, chunk, interpret)
    else:
        y, final = _ssd_forward_gpu(
            a, xdt, B, C, h0, chunk, block_sizes.ssd_block_p, block_sizes.num_warps_ssd, interpret
        )
    return y + D[:, None] * x, final


# --------------------------------------------------------------------------------------------------
# Public function: custom_jvp whose tangent is the JVP of the pure-jnp reference (so reverse mode is the
# reference's VJP, and higher orders work too).
# --------------------------------------------------------------------------------------------------


@functools.partial(jax.custom_jvp, nondiff_argnums=(6, 8))
def _ssd_custom(x, dt, A, B, C, D, chunk_size, initial_state, config):
    return _ssd_forward(x, dt, A, B, C, D, chunk_size, initial_state, config)


@_ssd_custom.defjvp
def _ssd_jvp(chunk_size, config, primals, tangents):
    x, dt, A, B, C, D, h0 = primals
    out = _ssd_custom(x, dt, A, B, C, D, chunk_size, h0, config)

    def reference(x, dt, A, B, C, D, h0):
        return ssd_reference(x, dt, A, B, C, D, chunk_size, initial_state=h0)

    _, tangent_out = jax.jvp(reference, primals, tangents)
    return out, tangent_out


def ssd_pallas(
    x, dt, A, B, C, D, chunk_size=64, initial_state=None, *, block_sizes=None, platform=None, interpret=None
):
    """Pallas chunked SSD -> (y (b, l, h, p), final_state (b, h, p, n)), fp32, any l >= 1.

    The kernel chunk is ``block_sizes.ssd_chunk`` (None: ``chunk_size``); the result does not depend on
    it beyond rounding. platform: "tpu" | "gpu" kernel variant (None: ``jax.default_backend()``; on CPU
    the TPU variant); interpret: None runs interpret mode exactly when the default backend is CPU.
    ``initial_state`` (b, h, p, n) is supported in the kernel. Differentiable: the backward pass is the
    VJP of ``ssd_reference`` (a custom_jvp: any order of differentiation works).
    """
    target, interpret = resolve_target(platform, interpret)
    block_sizes = (block_sizes or Blocks()).over(Blocks.for_platform("cpu" if interpret else target))
    if x.shape[2] % B.shape[2]:
        raise ValueError(f"heads h={x.shape[2]} must be a multiple of groups g={B.shape[2]}")
    config = (block_sizes, target, interpret)
    if initial_state is None:  # the kernel always takes one: a custom_jvp needs array arguments
        initial_state = jnp.zeros((x.shape[0], x.shape[2], x.shape[3], B.shape[-1]), jnp.float32)
    return _ssd_custom(x, dt, A, B, C, D, chunk_size, initial_state, config)


# --------------------------------------------------------------------------------------------------
# Pure-jnp references.
# --------------------------------------------------------------------------------------------------


XLA_CHUNK = 128  # chunk length of the XLA path (dispatch.ssd): the fastest of 64/128/256 on CPU


def ssd_reference(x, dt, A, B, C, D, chunk_size=64, initial_state=None):
    """Pure-jnp chunked SSD. Returns (y (b, l, h, p), final_state (b, h, p, n)).

    The result does not depend on ``chunk_size`` beyond rounding. Heads are kept as (g, r): group g's
    r = h / g heads share its B and C, so C_i . B_j is formed once per group, and every product is a
    batched matmul with its batch axes leading (b, c, g[, r]) and the chunk axis next to the
    contraction, which XLA:CPU runs without transposing the operands.
    """
    b, l, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    r = h // g
    x, dt, A, D, B, C = (t.astype(jnp.float32) for t in (x, dt, A, D, B, C))
    q = min(chunk_size, l)
    pad = (-l) % q
    if pad:  # dt = 0 on padding: no decay, no input
        x, dt, B, C = (jnp.pad(t, [(0, 0), (0, pad)] + [(0, 0)] * (t.ndim - 2)) for t in (x, dt, B, C))
    nc = (l + pad) // q
    Bs = B.reshape(b, nc, q, g, n)
    Cs = C.reshape(b, nc, q, g, n)
    # within-chunk cumulative log-decay S (b, c, g, r, q) and dt x (b, c, g, r, q, p). S as a product
    # with the (q, q) upper-triangular ones, not jnp.cumsum: XLA:CPU lowers cumsum to a two-level
    # reduce-window whose indexing it then fused into the (q, q) decay exponentials below (~7 ns per
    # entry; the SSD at L = 4096 took 30% longer). As accurate (fp32 sums of <= q terms either way).
    upper = jnp.triu(jnp.ones((q, q), jnp.float32))
    S = jnp.einsum(
        "bcgrj,ji->bcgri", jnp.moveaxis((dt * A).reshape(b, nc, q, g, r), 2, -1), upper, precision="highest"
    )
    dtx = jnp.moveaxis((dt[..., None] * x).reshape(b, nc, q, g, r, p), 2, 4)

    # 1. intra-chunk (diagonal blocks): decay exp(S_i - S_j) for j <= i, masked before exp
    causal = jnp.tril(jnp.ones((q, q), bool))
    decay = jnp.exp(jnp.where(causal, S[..., :, None] - S[..., None, :], -jnp.inf))  # (b, c, g, r, i, j)
    CB = jnp.einsum("bcign,bcjgn->bcgij", Cs, Bs)
    y_diag = jnp.einsum("bcgrij,bcgrjp->bcgrip", CB[:, :, :, None] * decay, dtx)

    # 2. each chunk's own contribution to the state at its end, (b, c, g, r, p, n)
    to_end = jnp.exp(S[..., -1:] - S)
    chunk_states = jnp.einsum("bcjgn,bcgrjp->bcgrpn", Bs, dtx * to_end[..., None])

    # 3. carry states across chunks (sequential over the few chunks)
    init = (
        jnp.zeros((b, g, r, p, n), jnp.float32)
        if initial_state is None
        else initial_state.astype(jnp.float32).reshape(b, g, r, p, n)
    )
    chunk_decay = jnp.exp(S[..., -1])  # (b, c, g, r)

    def carry(state, inputs):
        decay_c, new_c = inputs
        return decay_c[..., None, None] * state + new_c, state  # emit the state entering the chunk

    final, entering = jax.lax.scan(
        carry, init, (jnp.moveaxis(chunk_decay, 1, 0), jnp.moveaxis(chunk_states, 1, 0))
    )
    entering = jnp.moveaxis(entering, 0, 1)  # (b, c, g, r, p, n)

    # 4. contribution of the entering state to each position
    y_off = jnp.einsum("bcign,bcgrpn->bcgrip", Cs, entering) * jnp.exp(S)[..., None]
    y = jnp.moveaxis(y_diag + y_off, 4, 2).reshape(b, nc * q, h, p)[:, :l] + D[:, None] * x[:, :l]
    return y, final.reshape(b, h, p, n)


def ssd_step_reference(state, x, dt, A, B, C, D):
    """One recurrent step. state (b, h, p, n); x (b, h, p); dt (b, h); B, C (b, g, n)."""
    h = x.shape[1]
    B = jnp.repeat(B, h // B.shape[1], axis=1)
    C = jnp.repeat(C, h // C.shape[1], axis=1)
    dA = jnp.exp(dt * A)[..., None, None]
    state = dA * state + (dt[..., None] * x)[..., None] * B[:, :, None, :]
    y = jnp.einsum("bhpn,bhn->bhp", state, C) + D[:, None] * x
    return y, state
