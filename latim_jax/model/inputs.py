"""Validation of what users pass in: token ids, embeddings, padding masks, layer and row selections.

Every check runs before any cast (a cast to int32 would silently wrap ids >= 2**31) and names the
problem. Under ``jax.jit`` / ``jax.vmap`` the values are not known when the checks run, so only shapes
and dtypes raise; a prompt whose traced values fail a check (an id outside the vocabulary, a mask with
a hole or no valid position) is instead made NaN from its embedding on (:func:`traced_invalid`), so its
logits and scores are NaN, never plausible numbers, and the other prompts are unaffected.

Padding: a mask (b, l) marks the valid positions of each prompt. They must form one contiguous run
per row (left padding, right padding, or both); a row with a hole or with no valid position is
refused. See :mod:`latim_jax.model.mixers` for how padding is skipped (zero conv input and Delta).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np


def is_traced(x) -> bool:
    """Whether ``x`` is an abstract value inside a jax transformation."""
    return isinstance(x, jax.core.Tracer)


def check_tokens(tokens, vocab_size: int) -> jax.Array:
    """Token ids (b, l) -> int32 jax array, validated before the cast: 2-D, integer dtype, at least one
    prompt and one position, and (when concrete) every id in [0, vocab_size)."""
    if tokens is None:
        raise ValueError("pass token ids (b, l) or inputs_embeds (b, l, d)")
    if is_traced(tokens):
        _check_token_shape(tokens.shape, tokens.dtype)
        return tokens.astype(jnp.int32)
    _check_equal_lengths(tokens, "tokens")
    t = np.asarray(tokens)
    if t.dtype == object:
        raise ValueError(
            "token ids must be integers that fit in 64 bits (found larger or non-integer values)"
        )
    _check_token_shape(t.shape, t.dtype)
    lo, hi = int(t.min()), int(t.max())
    if lo < 0 or hi >= vocab_size:
        raise ValueError(f"token ids must lie in [0, {vocab_size}), found min {lo} max {hi}")
    return jax.device_put(t.astype(np.int32))  # not jnp.asarray: that compiles a program per shape


def traced_invalid(ids, mask, vocab_size: int) -> jax.Array | None:
    """(b,) bool: the prompts whose traced inputs fail the value checks that concrete inputs get (ids
    in [0, vocab_size), a mask with one contiguous valid run); None when nothing is traced.

    ``ids`` (b, l) int or None (embeddings given), ``mask`` (b, l) bool."""
    bad = None
    if ids is not None and is_traced(ids):
        bad = ((ids < 0) | (ids >= vocab_size)).any(-1)
    if is_traced(mask):
        n = mask.sum(-1)
        first = jnp.argmax(mask, -1)
        last = mask.shape[-1] - 1 - jnp.argmax(mask[:, ::-1], -1)
        holed = (n == 0) | (last - first + 1 != n)
        bad = holed if bad is None else bad | holed
    return bad


def _check_token_shape(shape, dtype) -> None:
    """Shape before dtype: an empty prompt (``[[]]``) reaches numpy as float64, and its problem is
    the missing tokens, not the dtype."""
    if len(shape) != 2:
        raise ValueError(f"tokens must have shape (batch, length), found shape {tuple(shape)}")
    if shape[0] < 1:
        raise ValueError(
            f"tokens hold no prompt (batch size 0, shape {tuple(shape)}): expected int ids of shape "
            "(batch, length) with at least one prompt"
        )
    if shape[1] < 1:
        raise ValueError(
            f"the prompt is empty: tokens have shape {tuple(shape)}; expected int ids of shape (batch, "
            "length) with at least one position"
        )
    if not np.issubdtype(np.dtype(dtype), np.integer):
        raise ValueError(f"tokens must be integer ids, found dtype {dtype}")


def _check_equal_lengths(x, what: str) -> None:
    """Refuse a list of prompts of different lengths (numpy would say only "inhomogeneous shape"),
    naming the lengths and the way to pass them: padded to one length, with ``mask=``."""
    if isinstance(x, np.ndarray | jax.Array) or not isinstance(x, Sequence) or isinstance(x, str | bytes):
        return
    lengths = [len(row) if isinstance(row, Sequence | np.ndarray | jax.Array) else None for row in x]
    if None in lengths or len(set(lengths)) < 2:
        return
    shown = ", ".join(f"prompt {b}: {n}" for b, n in list(enumerate(lengths))[:8])
    more = f", ... ({len(lengths) - 8} more)" if len(lengths) > 8 else ""
    raise ValueError(
        f"{what}: the prompts have different lengths ({shown}{more}); pad them to one length "
        "(any id inside the vocabulary) and pass mask=, a (batch, length) bool array that is True on "
        "the real tokens (docs/guide.md, 'Padding and masks')"
    )


def check_embeds(inputs_embeds, d_model: int) -> jax.Array:
    """inputs_embeds (b, l, d_model) float -> fp32 jax array (finite when concrete; concrete values are
    checked and cast on the host, so that no program is compiled for their length)."""
    if not is_traced(inputs_embeds):
        _check_equal_lengths(inputs_embeds, "inputs_embeds")
    e = inputs_embeds if is_traced(inputs_embeds) else np.asarray(inputs_embeds)
    if e.ndim != 3 or e.shape[-1] != d_model:
        raise ValueError(f"inputs_embeds must have shape (batch, length, {d_model}), found {tuple(e.shape)}")
    if not jnp.issubdtype(e.dtype, jnp.floating):
        raise ValueError(f"inputs_embeds must be floating point, found dtype {e.dtype}")
    if e.shape[0] < 1 or e.shape[1] < 1:
        raise ValueError(f"inputs_embeds hold no prompt or no position: shape {tuple(e.shape)}")
    if is_traced(e):
        return e.astype(jnp.float32)
    if not np.isfinite(e).all():
        raise ValueError("inputs_embeds hold NaN or inf")
    return jax.device_put(e.astype(np.float32))


def check_mask(mask, batch: int, length: int) -> jax.Array:
    """A padding mask (b, l) of valid positions -> bool jax array; None means every position is valid
    (an all-True array: the mask is always an array, so all-valid and padded calls trace alike).

    Concrete masks are checked: shape, boolean (or 0/1) values, at least one valid position per row
    and one contiguous valid run per row (left and/or right padding; a hole is refused, with the row
    and positions named).
    """
    if mask is None:  # built on the host: jnp.ones would compile a program per length
        return jax.device_put(np.ones((batch, length), bool))
    if is_traced(mask):
        if tuple(mask.shape) != (batch, length):
            raise ValueError(f"mask must have shape (batch, length) = {(batch, length)}, found {mask.shape}")
        return mask.astype(bool)
    m = np.asarray(mask)
    if m.shape != (batch, length):
        raise ValueError(f"mask must have shape (batch, length) = {(batch, length)}, found {m.shape}")
    if m.dtype != bool:
        if not (np.issubdtype(m.dtype, np.number) and np.isin(m, (0, 1)).all()):
            raise ValueError(f"mask must be boolean (or 0/1) valid-position flags, found dtype {m.dtype}")
        m = m.astype(bool)
    for b, row in enumerate(m):
        valid = np.flatnonzero(row)
        if valid.size == 0:
            raise ValueError(f"mask row {b} has no valid position")
        if valid[-1] - valid[0] + 1 != valid.size:
            holes = np.flatnonzero(~row[valid[0] : valid[-1] + 1]) + valid[0]
            raise ValueError(
                f"mask row {b} has a hole at position(s) {holes[:8].tolist()}: valid positions must be one "
                "contiguous run (padding on the left and/or right only)"
            )
    return jax.device_put(m)


def bucket_length(length: int) -> int:
    """The padded length that ``length`` positions are computed at, so that nearby lengths share one
    compiled program: a multiple of 16 up to 64, of 32 up to 512, of 128 up to 4096, then of 512
    (at most ~50% more positions for tiny inputs, where compilation dominates, and ~12% for long ones)."""
    step = 16 if length <= 64 else 32 if length <= 512 else 128 if length <= 4096 else 512
    return -(-length // step) * step


def bucket_pad(x, mask):
    """(x, mask) right-padded along axis 1 to :func:`bucket_length` of their length, the mask marking
    the added positions as padding (exact: padding is skipped by construction). ``x``: validated ids
    (b, l) or embeddings (b, l, d); ``mask`` (b, l) bool. Traced inputs are returned as they are (their
    program is the caller's).

    The padding is done on the host and the results placed with ``jax.device_put``: an eager ``jnp.pad``
    would compile one program per unpadded length, which is what buckets are there to avoid."""
    if is_traced(x) or is_traced(mask):
        return x, mask
    extra = bucket_length(x.shape[1]) - x.shape[1]
    if extra == 0:
        return x, mask
    widths = [(0, 0), (0, extra)] + [(0, 0)] * (x.ndim - 2)
    return (
        jax.device_put(np.pad(np.asarray(x), widths)),
        jax.device_put(np.pad(np.asarray(mask), ((0, 0), (0, extra)))),
    )


def check_layers(layers, n_layers: int) -> tuple[int, ...]:
    """None (all layers), an int, or ints in [-n, n) -> a non-empty tuple of distinct layer indices in
    [0, n) (a layer named twice, also as k and k - n, is refused)."""
    if layers is None:
        return tuple(range(n_layers))
    items = _as_int_list(layers, "layers")
    out = []
    for x in items:
        if not -n_layers <= x < n_layers:
            raise ValueError(f"layer must be an int in [0, {n_layers}) (or negative from the end), found {x}")
        out.append(x % n_layers)
    if not out:
        raise ValueError("layers must name at least one layer")
    _refuse_repeats(items, out, "layers", "layer")
    return tuple(out)


def check_rows(rows, length: int, end: int | None = None) -> tuple[int, ...] | None:
    """None (all positions), an int, or ints in [-end, l) -> a non-empty tuple of distinct positions in
    [0, l) (a position named twice, also as a negative and a positive index, is refused).

    A negative row counts back from ``end`` (the position after the prompts' last real token; default
    ``length``): -1 is the last real token, not a right padding position."""
    if rows is None:
        return None
    end = length if end is None else end
    items = _as_int_list(rows, "rows")
    out = []
    for r in items:
        if not -end <= r < length:
            raise ValueError(
                f"rows must be ints in [0, {length}) (or in [-{end}, 0): from the end of the real tokens), "
                f"found {r}"
            )
        out.append(r if r >= 0 else end + r)
    if not out:
        raise ValueError("rows must name at least one position")
    _refuse_repeats(items, out, "rows", "position")
    return tuple(out)


def _refuse_repeats(given: list[int], resolved: list[int], what: str, unit: str) -> None:
    """Refuse a selection that names one layer / position twice (its scores would be returned twice),
    naming the repeated value and, where they differ, the given indices that resolve to it (-1 and
    n - 1 are one)."""
    seen: dict[int, list[int]] = {}
    for g, r in zip(given, resolved, strict=True):
        seen.setdefault(r, []).append(g)
    repeated = {r: g for r, g in seen.items() if len(g) > 1}
    if not repeated:
        return
    named = "; ".join(
        f"{unit} {r}" + ("" if set(g) == {r} else f" (given as {', '.join(map(str, g))})")
        for r, g in repeated.items()
    )
    raise ValueError(
        f"{what} {given} name the same {unit} more than once ({named}): each {unit} is scored once, so "
        f"list it once"
    )


def real_end(rows, mask, given: bool, length: int) -> int | None:
    """Where negative ``rows`` count back from: the position after every prompt's last real token
    (None: ``length``, when no row is negative or no mask was given).

    ``mask`` (b, >= length) the call's valid positions (``given``: the caller passed one). Refuses a
    traced mask (the real end is unknown under a transformation) and prompts whose real tokens end at
    different positions (one row index cannot name each prompt's last token), naming both ways out."""
    if rows is None or not given or all(r >= 0 for r in _as_int_list(rows, "rows")):
        return None
    if is_traced(mask):
        raise ValueError(
            "negative rows count back from each prompt's last real token, which a traced mask hides: "
            "pass rows counted from the start (0-based positions)"
        )
    m = np.asarray(mask)[:, :length]
    ends = sorted({int(np.flatnonzero(row)[-1]) + 1 for row in m})
    if len(ends) > 1:
        raise ValueError(
            f"negative rows count back from each prompt's last real token, and these prompts' real tokens "
            f"end at different positions ({[e - 1 for e in ends[:6]]}{' ...' if len(ends) > 6 else ''}): "
            "pass rows counted from the start, pad the prompts on the left so that they end together, or "
            "attribute them one at a time (latim-jax attribute-dataset --rows last does)"
        )
    return ends[0]


def _as_int_list(x, what: str) -> list[int]:
    """An int, a sequence of ints, or a concrete integer array -> a list of Python ints."""
    if is_traced(x):
        raise ValueError(f"{what} must be concrete ints (they fix the output shape), not a traced array")
    if isinstance(x, bool) or isinstance(x, float):
        raise ValueError(f"{what} must be ints, found {x!r}")
    if isinstance(x, int | np.integer):
        return [int(x)]
    arr = np.asarray(x) if not isinstance(x, Sequence) or isinstance(x, str) else None
    if arr is not None:
        if arr.ndim > 1 or not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"{what} must be ints or a 1-D integer array, found {x!r}")
        return [int(v) for v in arr.reshape(-1)]
    out = []
    for v in x:
        if isinstance(v, bool) or not isinstance(v, int | np.integer):
            raise ValueError(f"{what} must be ints, found {v!r}")
        out.append(int(v))
    return out
