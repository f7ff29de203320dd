"""A broadcast product whose derivative is a contraction: :func:`bmul`.

Why: the transpose of a broadcast product ``x[:, :, None] * y`` with respect to the smaller operand is a
multiply and a reduction over the broadcast axes. XLA:CPU (jax 0.10) sends such reductions to its
YNNPACK reduce fusion, which runs them ~9x slower than the same contraction written as a dot_general
(a (1, 35, 256, 16) product summed over its last axis: 0.98 ms against 0.11 ms; over a middle axis
0.99 against 0.10 ms; benchmarks/notes.md). Inside the score tiles these reductions were most of a
gradient's time. :func:`bmul` computes the plain product (the forward is unchanged) and gives it a
tangent written as einsums, whose transposes are dot_generals.
"""

from __future__ import annotations

import string

import jax
import jax.numpy as jnp


def _operand(z, shape: tuple[int, ...]):
    """``z`` without the axes it is broadcast along in a product of ``shape``, and its einsum letters."""
    padded = (1,) * (len(shape) - z.ndim) + z.shape
    kept = [i for i, (m, n) in enumerate(zip(padded, shape, strict=True)) if m == n]
    return z.reshape([shape[i] for i in kept]), "".join(string.ascii_letters[i] for i in kept)


@jax.custom_jvp
def bmul(x, y):
    """``x * y`` (numpy broadcasting), differentiated through einsums: the tangent is
    ``einsum(dx, y) + einsum(x, dy)`` with the broadcast axes as the einsum's free axes, so reverse mode
    sums over them with dot_generals (see the module docstring). Forward mode and higher orders work
    as for any differentiable custom_jvp."""
    return x * y


@bmul.defjvp
def _bmul_jvp(primals, tangents):
    x, y = primals
    dx, dy = tangents
    shape = jnp.broadcast_shapes(x.shape, y.shape)
    out = string.ascii_letters[: len(shape)]
    xs, lx = _operand(x, shape)
    ys, ly = _operand(y, shape)
    dxs, dys = _operand(dx, shape)[0], _operand(dy, shape)[0]
    spec = f"{lx},{ly}->{out}"
    return bmul(x, y), jnp.einsum(spec, dxs, ys) + jnp.einsum(spec, xs, dys)
