"""Length buckets share compiled programs: two prompt lengths that pad to one bucket compile once
(latim_jax.attribute with bucket=True, the default), and the bucketed scores equal the unbucketed ones."""

from __future__ import annotations

import contextlib
import logging

import jax
import numpy as np
import pytest
from conftest import rel_err as rel

import latim_jax
from latim_jax.model.config import MambaConfig
from latim_jax.model.init import init_params
from latim_jax.model.inputs import bucket_length

FIRST, SECOND = 20, 21  # one bucket (32)
CFG = {
    1: MambaConfig(version=1, d_model=8, n_layers=2, vocab_size=16, d_state=2, d_conv=3),
    2: MambaConfig(version=2, d_model=8, n_layers=2, vocab_size=16, d_state=2, head_dim=4, chunk_size=8),
}


@contextlib.contextmanager
def compiles():
    """The programs jax compiles inside the block (one line each, naming the argument shapes)."""
    seen = []

    class Catch(logging.Handler):
        def emit(self, record):
            msg = record.getMessage()
            if msg.startswith("Compiling "):  # the program's name and its arguments' shapes
                name, _, types = msg.partition(" with global shapes and types ")
                seen.append(f"{name} {types.partition('. Argument mapping')[0][-240:]}")

    catch, log = Catch(), logging.getLogger("jax")
    log.addHandler(catch)
    try:
        with jax.log_compiles(True):
            yield seen
    finally:
        log.removeHandler(catch)


def prompt(length, seed=0):
    return np.random.default_rng(seed).integers(1, 16, (2, length))


CASES = [
    (2, "l2", {}),
    (2, "alti", {}),
    (2, "logit", {}),
    (1, "alti", {"rows": [-1], "mask": True}),
    (2, "l2", {"top_k": 3, "target": None}),
    (2, "grad_input", {"target": 5}),
]


@pytest.mark.parametrize(("version", "method", "kw"), CASES, ids=[f"m{v}-{m}-{len(k)}" for v, m, k in CASES])
def test_one_bucket_compiles_once(version, method, kw):
    """The second length of a bucket compiles nothing that the same length again would not: every
    program sees the bucket's length (before, the score program took rows = arange(l), and the padding,
    the all-valid mask and the cuts to l ran eagerly at l). grad_input's eager lax.map recompiles its
    scan on every call, even at one length (its jaxpr is a new closure each time): that is not a bucket's
    cost, so the repeat of the first length is the reference."""
    assert bucket_length(FIRST) == bucket_length(SECOND)
    model = latim_jax.MambaLM(CFG[version], init_params(CFG[version], 0))
    kw = dict(kw)

    def call(length, **extra):
        args = dict(kw)
        if args.pop("mask", False):  # left padding: the first two positions of prompt 0
            m = np.ones((2, length), bool)
            m[0, :2] = False
            args["mask"] = m
        return latim_jax.attribute(model, prompt(length, length), method=method, **args, **extra)

    first = call(FIRST)
    with compiles() as again:
        call(FIRST)
    with compiles() as seen:
        second = call(SECOND)
    assert (again == []) == (method != "grad_input"), again
    assert sorted(seen) == sorted(again), (
        f"{len(seen)} programs compiled at length {SECOND} in bucket {bucket_length(SECOND)} (at length "
        f"{FIRST} again: {len(again)}):\n" + "\n".join(seen)
    )
    for length, got in ((FIRST, first), (SECOND, second)):
        want = call(length, bucket=False)
        assert got.scores.shape == want.scores.shape
        assert rel(got.scores, want.scores) < 1e-5, (length, rel(got.scores, want.scores))
        assert sorted(got.extra) == sorted(want.extra)
        for k in want.extra:
            assert got.extra[k].shape == want.extra[k].shape, k
            if k == "sources":
                assert np.array_equal(got.extra[k], want.extra[k])
            else:
                assert rel(got.extra[k], want.extra[k]) < 1e-5, (k, rel(got.extra[k], want.extra[k]))
        assert np.array_equal(got.tokens, want.tokens)
        assert (got.mask is None) == (want.mask is None)
        if want.mask is not None:
            assert np.array_equal(got.mask, want.mask)
