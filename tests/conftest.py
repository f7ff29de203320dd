"""Shared fixtures: tiny random transformers models saved with save_pretrained (no downloads)."""

from __future__ import annotations

import os

# Tests run tiny models many times with many shapes: XLA's compile time, not run time, dominates, so
# the tests (only) skip LLVM's expensive optimisation passes. Numerics are checked at fp32 tolerances.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
    " --xla_llvm_disable_expensive_passes=true"
).strip()

import numpy as np
import pytest

torch_needed = pytest.mark.torch

# The tiny random Mamba models most tests run on (one definition; a test states only what it changes):
# d 16, e 32, n 4, two layers, 32 ids; Mamba-2 with 4 heads of 8 in 2 groups, chunks of 4 (a prompt of
# 11 crosses two chunk boundaries) and a 3-tap conv.
TINY = {
    1: dict(version=1, d_model=16, n_layers=2, vocab_size=32, d_state=4, d_conv=4),
    2: dict(version=2, d_model=16, n_layers=2, vocab_size=32, d_state=4, d_conv=3, head_dim=8, n_groups=2,
            chunk_size=4),
}  # fmt: skip


def tiny_config(version: int, **changes):
    """The tiny config of Mamba-``version`` (:data:`TINY`) with ``changes``."""
    from latim_jax.model.config import MambaConfig

    return MambaConfig(**{**TINY[version], **changes})


def tiny_model(version: int, seed: int = 3, **changes):
    """A random MambaLM of :func:`tiny_config` (parameters from ``seed``)."""
    import latim_jax
    from latim_jax.model.init import init_params

    cfg = tiny_config(version, **changes)
    return latim_jax.MambaLM(cfg, init_params(cfg, seed=seed))


def build_hf(
    version: int,
    *,
    seed: int = 0,
    vocab: int = 48,
    d_model: int = 16,
    n_layers: int = 2,
    d_state: int = 4,
    d_conv: int = 4,
    head_dim: int = 8,
    n_groups: int = 1,
    chunk_size: int = 8,
    tied: bool = True,
    act: str = "silu",
    use_bias: bool = False,
    conv_bias: bool = True,
    dtype: str = "float32",
):
    """A tiny random transformers Mamba(2)ForCausalLM with non-trivial norms, D, A_log and biases."""
    import torch
    import transformers

    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab,
        hidden_size=d_model,
        state_size=d_state,
        num_hidden_layers=n_layers,
        conv_kernel=d_conv,
        expand=2,
        hidden_act=act,
        use_bias=use_bias,
        use_conv_bias=conv_bias,
        tie_word_embeddings=tied,
    )
    if version == 1:
        model = transformers.MambaForCausalLM(transformers.MambaConfig(**common))
    else:
        cfg = transformers.Mamba2Config(
            num_heads=2 * d_model // head_dim,
            head_dim=head_dim,
            n_groups=n_groups,
            chunk_size=chunk_size,
            **common,
        )
        model = transformers.Mamba2ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if (
                "norm" in name
                or name.endswith(".D")
                or "A_log" in name
                or "dt_bias" in name
                or "bias" in name
            ):
                p.add_(0.3 * torch.randn_like(p))
    model = model.eval()
    if dtype == "bfloat16":
        model = model.to(torch.bfloat16)
    return model


@pytest.fixture(scope="session")
def hf_dir(tmp_path_factory):
    """save_pretrained a tiny model once per (name, kwargs): returns (directory, transformers model)."""
    cache = {}

    def make(name: str, version: int, *, max_shard_size=None, **kw):
        if name not in cache:
            model = build_hf(version, **kw)
            path = tmp_path_factory.mktemp(name)
            extra = {"max_shard_size": max_shard_size} if max_shard_size else {}
            model.save_pretrained(path, **extra)
            cache[name] = (path, model)
        return cache[name]

    return make


def rel_err(got, want) -> float:
    """max |got - want| / max |want|."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def directional_fd(fn, args, *, eps=1e-3, seed=0):
    """(jax.grad's directional derivative, the central finite difference) of the scalar fn(*args) along a
    random unit-scale direction in every floating argument (a pytree per argument).

    The finite difference uses only fn's forward, so it checks a custom backward against the forward
    it belongs to (fp32: expect agreement to ~1e-3 relative with eps ~1e-3 on O(1) inputs).
    """
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)

    def direction(x):
        if not jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating):
            return None
        return jnp.asarray(rng.standard_normal(np.shape(x)), jnp.asarray(x).dtype)

    dirs = jax.tree.map(direction, args)
    # both compiled: eager, every primitive of a tile loop's body runs (and compiles) on its own
    grads = jax.jit(jax.grad(lambda *a: fn(*a), argnums=tuple(range(len(args)))))(*args)
    value = jax.jit(fn)
    analytic = sum(
        float(jnp.vdot(g, v)) for g, v in zip(jax.tree.leaves(grads), jax.tree.leaves(dirs), strict=True)
    )

    def shifted(sign):
        moved = jax.tree.map(lambda x, v: x if v is None else x + sign * eps * v, args, dirs,
                             is_leaf=lambda x: x is None)  # fmt: skip
        return float(value(*moved))

    return analytic, (shifted(1.0) - shifted(-1.0)) / (2 * eps)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Free jax's compiled programs after each test module: one long pytest process otherwise keeps every
    module's executables (several GB over the whole suite)."""
    yield
    import jax

    jax.clear_caches()


def assert_l2_vmap_and_gradient(model, embeds, layers, *, eps=1e-3):
    """The l2 scores of ``layers`` for each prompt of ``embeds`` (n, l, d): jax.vmap over the prompts
    equals the Python loop (1e-5), and jax.grad of sum(scores^2) for the first prompt equals the central
    finite difference with step ``eps`` (2e-3 relative)."""
    import jax
    import jax.numpy as jnp

    import latim_jax

    def score(e):
        return latim_jax.attribute(model, inputs_embeds=e[None], method="l2", layers=layers).scores[0]

    mapped = jax.vmap(score)(embeds)
    looped = jnp.stack([score(e) for e in embeds])
    np.testing.assert_allclose(mapped, looped, rtol=1e-5, atol=1e-6)
    analytic, numeric = directional_fd(lambda e: jnp.sum(score(e) ** 2), (embeds[0],), eps=eps)
    assert abs(analytic - numeric) <= 2e-3 * max(abs(numeric), 1e-3), (analytic, numeric)


def assert_attention_map_and_pallas(model, tokens, layer: int):
    """The hidden attention of ``layer`` (a kind whose map is a softmax attention's: parallel, shared) has
    rows summing to 1, and the l2 scores with ``impl="pallas"`` equal XLA's (2e-5)."""
    import latim_jax

    a = latim_jax.attribute(model, tokens, method="hidden_attention", layers=[layer])
    np.testing.assert_allclose(a.scores.sum(-1), 1.0, rtol=1e-5)  # softmax rows (an SSM's are not)
    xla = latim_jax.attribute(model, tokens, method="l2", impl="xla")
    pallas = latim_jax.attribute(model, tokens, method="l2", impl="pallas")
    assert rel_err(pallas.scores, xla.scores) < 2e-5


def assert_logit_identity_padding_and_rows(model, tokens, pad: int = 6):
    """On prompts (2, l) with the second left-padded by ``pad``: the logit identity holds over every
    sublayer (1e-5), ``layer_kinds`` is the model's, and alti / logit maps of the padded prompt equal the
    prompt alone and rows [-1, 10] equal those rows of the full map (2e-5)."""
    import latim_jax

    length = tokens.shape[1]
    mask = np.ones(tokens.shape, bool)
    mask[1, :pad] = False
    a = latim_jax.attribute(model, tokens, method="logit", mask=mask)
    total = a.scores.sum((1, 3)) + a.extra["bias"].sum(1) + a.extra["direct"]
    assert rel_err(np.where(mask, total, 0), np.where(mask, a.extra["logit"], 0)) < 1e-5
    assert a.layer_kinds == model.config.kinds
    for method in ("alti", "logit"):
        full = a if method == "logit" else latim_jax.attribute(model, tokens, method=method, mask=mask)
        alone = latim_jax.attribute(model, tokens[1:, pad:], method=method)
        np.testing.assert_allclose(full.scores[1, :, pad:, pad:], alone.scores[0], rtol=2e-5, atol=2e-6)
        last = latim_jax.attribute(model, tokens, method=method, mask=mask, rows=[-1, 10])
        np.testing.assert_allclose(last.scores, full.scores[:, :, [length - 1, 10]], rtol=2e-5, atol=2e-6)


def chromium():
    """The path of a headless Chromium, or skip (fail when LATIM_JAX_REQUIRE_BROWSER is set, as in CI)."""
    import os
    import shutil

    found = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if found is None and os.environ.get("LATIM_JAX_REQUIRE_BROWSER"):
        pytest.fail("LATIM_JAX_REQUIRE_BROWSER is set and no Chromium is installed")
    if found is None:
        pytest.skip("no Chromium here (CI installs Debian's chromium and requires it)")
    return found


def dump_dom(browser, url) -> tuple[str, str]:
    """(the DOM after the page's scripts ran, the browser's log) of ``url`` in headless ``browser``."""
    import subprocess

    done = subprocess.run(
        [browser, "--headless=new", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr", "--v=0",
         "--virtual-time-budget=5000", "--dump-dom", url],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    return done.stdout, done.stderr
