"""Long inputs with bounded memory: the estimate before a call, refusal naming options that fit, top_k,
bf16 output and streaming to disk (jax only)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import rel_err as rel
from conftest import tiny_config

import latim_jax
from latim_jax.latim.memory import InsufficientMemoryError, estimate
from latim_jax.model.config import MambaConfig
from latim_jax.model.init import init_params

CFG = tiny_config(2, d_conv=4, n_groups=1, chunk_size=8)


@pytest.fixture(scope="module")
def model():
    return latim_jax.MambaLM(CFG, init_params(CFG, 0))


def test_estimate_scales_as_the_output_does(model):
    full = [estimate(model, 1, L).output for L in (1024, 2048, 4096)]
    assert full[1] == 4 * full[0] and full[2] == 4 * full[1]  # all rows: O(L^2) per layer
    last = [estimate(model, 1, L, rows=1).total for L in (4096, 8192)]
    assert last[1] < 2.2 * last[0]  # one row: O(L)
    assert estimate(model, 1, 4096, top_k=8).output == 2 * 1 * 4096 * 8 * 8  # values + int32 sources
    assert estimate(model, 1, 4096, out_dtype="bfloat16").output * 2 == estimate(model, 1, 4096).output
    assert estimate(model, 1, 4096, stream=True).output == 0


def test_a_mesh_divides_what_it_splits_per_device(model):
    """On a mesh the estimate is per device: the prompts divide over "data", the score matrix and the
    output over "model" (rows) and "seq" (columns), the streams over "seq"; the layer's working set is
    a device's compacted window for a kind that scores its own (Mamba, here) and the whole length for
    one gathered whole (a shared block); a refusal says "per device"; a bad split is refused by name."""
    from latim_jax.latim.memory import check_fits

    L, d = 128, CFG.d_model
    one = estimate(model, 4, L, method="l2")
    split = estimate(model, 4, L, method="l2", split={"data": 2, "model": 2, "seq": 4})
    assert split.output * 16 == one.output  # 4 prompts x L rows x L columns over 2 x 2 x 4 devices
    assert split.streams == 2 * 2 * (L // 4) * d * 4 and one.streams == 2 * 4 * L * d * 4
    two = estimate(model, 2, L, method="l2")  # the working set of 2 prompts at the whole length
    assert split.layer - 2 * (L // 2) * (L // 4) * 4 == two.layer - 2 * L * L * 4  # window = layer
    # a long prompt's last row over seq = 8: the Mamba layer's working set falls about 8x (its window of
    # 1/8 of the sources, the halo, one row), a shared block's does not (gathered)
    long_one, long_seq = (estimate(model, 1, 32768, rows=1, split=sp).layer for sp in (None, {"seq": 8}))
    assert 6 < long_one / long_seq < 8.5, long_one / long_seq
    shared_cfg = MambaConfig(version=2, d_model=16, n_layers=2, vocab_size=32, d_state=4, head_dim=4,
                             layer_kinds=("shared", "mamba2"), attn_heads=2, attn_kv_heads=1, attn_head_dim=8,
                             mlp_width=24, mlp_gated=True)  # fmt: skip
    shared = latim_jax.MambaLM(shared_cfg, init_params(shared_cfg, 0))
    sh_one, sh_seq = (estimate(shared, 1, 32768, rows=1, split=sp).layer for sp in (None, {"seq": 8}))
    assert sh_seq > 0.9 * sh_one, (sh_one, sh_seq)
    assert split.parameters == one.parameters
    assert estimate(model, 4, L, split={"data": 1}) == estimate(model, 4, L)
    with pytest.raises(InsufficientMemoryError, match=r"per device \(mesh data=2, seq=4\)"):
        check_fits(model, 4, L, limit=split.parameters, split={"data": 2, "seq": 4})
    for bad, words in (({"sequence": 2}, "unknown mesh axes"), ({"seq": 0}, "'seq' axis size")):
        with pytest.raises(ValueError, match=words):
            estimate(model, 4, L, split=bad)


@pytest.mark.parametrize("version", [1, 2])
def test_estimate_against_the_compiled_programs_memory(version):
    """The per-layer part of the estimate against XLA's own account of the compiled per-layer program
    (temporaries + outputs of ``score_layer``), every row and the last row: never more than 10% under
    it, at most 4x over (it is meant as a safe bound; measured here: 0.97-3.6x)."""
    import jax.numpy as jnp

    from latim_jax.latim.attribution import score_layer
    from latim_jax.latim.request import LayerJob
    from latim_jax.parallel.context import XLA

    cfg = MambaConfig(version=version, d_model=128, n_layers=1, vocab_size=64, d_state=16, d_conv=4,
                      head_dim=32, chunk_size=64)  # fmt: skip
    m = latim_jax.MambaLM(cfg, init_params(cfg, 0))
    L = 1024
    for rows in (None, 1):
        r = jnp.arange(L) if rows is None else jnp.asarray([L - 1])
        h, mask = jnp.zeros((1, L, 128)), jnp.ones((1, L), bool)
        lowered = score_layer.lower(m.layers[0], h, mask, r, None, job=LayerJob("l2"), ctx=XLA)
        analysis = lowered.compile().memory_analysis()
        measured = analysis.temp_size_in_bytes + analysis.output_size_in_bytes
        ratio = estimate(m, 1, L, method="l2", rows=rows).layer / measured
        assert 0.9 <= ratio <= 4.0, (rows, ratio)


def test_refusal_names_options_that_fit_and_they_do(model):
    t = np.random.default_rng(0).integers(0, 32, (2, 128))
    need = estimate(model, 2, 128).total
    limit = need - estimate(model, 2, 128).output // 3  # too little for the full output
    with pytest.raises(
        InsufficientMemoryError, match=r"needs about .* MiB.*Options that fit: rows=\[-1\]"
    ) as err:
        latim_jax.attribute(model, t, method="l2", memory_limit=limit)
    message = str(err.value)
    assert "top_k=32" in message and "stream_to=DIR" in message and "bfloat16" in message
    latim_jax.attribute(model, t, method="l2", rows=[-1], memory_limit=limit)  # the first option fits
    latim_jax.attribute(model, t, method="l2", top_k=32, memory_limit=limit)
    latim_jax.attribute(model, t, method="l2", out_dtype="bfloat16", memory_limit=limit)


def test_auto_limit_keeps_a_margin_of_the_free_memory(model, monkeypatch):
    """The "auto" limit refuses a call whose estimate fits the free memory but not with the margin (the
    estimate can fall ~10% short of the measured peak); the same bytes given explicitly are accepted."""
    from latim_jax.latim import memory
    from latim_jax.latim.memory import AUTO_MARGIN

    t = np.random.default_rng(0).integers(0, 32, (1, 128))
    need = estimate(model, 1, 128).total
    free = int(need * (1 + AUTO_MARGIN) / 2)  # between the estimate and estimate x margin
    monkeypatch.setattr(memory, "available", lambda: free)
    with pytest.raises(InsufficientMemoryError, match="needs about"):
        latim_jax.attribute(model, t, method="l2", memory_limit="auto")
    latim_jax.attribute(model, t, method="l2", memory_limit=free)
    monkeypatch.setattr(memory, "available", lambda: int(need * AUTO_MARGIN) + 1)
    latim_jax.attribute(model, t, method="l2", memory_limit="auto")


def test_top_k_bf16_and_streaming_equal_the_full_scores(model, tmp_path):
    t = np.random.default_rng(1).integers(0, 32, (2, 12))
    mask = np.arange(12)[None, :] >= np.array([[0], [3]])
    full = latim_jax.attribute(model, t, method="alti", mask=mask)
    s = np.asarray(full.scores)
    top = latim_jax.attribute(model, t, method="alti", mask=mask, top_k=4)
    src = np.asarray(top.extra["sources"])
    assert top.scores.shape == (2, 2, 12, 4) and top.top_k == 4
    want = -np.sort(-s, axis=-1)[..., :4]
    np.testing.assert_allclose(np.where(src >= 0, top.scores, 0), np.where(src >= 0, want, 0), rtol=1e-6)
    picked = np.take_along_axis(s, np.maximum(src, 0), -1)
    np.testing.assert_allclose(np.where(src >= 0, picked, 0), np.where(src >= 0, top.scores, 0), rtol=1e-6)
    assert (src[0, :, 0, 1:] == -1).all() and src[0, 0, 0, 0] == 0  # row 0 has a single source
    assert (src[1, :, :3] == -1).all()  # padding rows have none
    with pytest.raises(ValueError, match="top_k"):
        top.rollout()
    half = latim_jax.attribute(model, t, method="alti", mask=mask, out_dtype="bfloat16")
    assert str(half.scores.dtype) == "bfloat16" and rel(np.asarray(half.scores, np.float32), s) < 4e-3
    out = tmp_path / "streamed"
    streamed = latim_jax.attribute(model, t, method="alti", mask=mask, stream_to=out)
    assert isinstance(streamed.scores, np.memmap) and sorted(p.name for p in out.iterdir()) == [
        "arrays.npz", "meta.json", "scores.npy"
    ]  # fmt: skip
    np.testing.assert_array_equal(np.asarray(streamed.scores), s)
    back = latim_jax.Attribution.load(out)
    np.testing.assert_array_equal(np.asarray(back.rollout()), np.asarray(full.rollout()))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]
    with pytest.raises(FileExistsError, match="not an empty directory"):
        latim_jax.attribute(model, t, method="alti", stream_to=out)


def test_contributions_refuses_before_any_work_naming_the_size_of_T(model, monkeypatch):
    """contributions materialises T (b, l, l, d): a call whose estimate exceeds the limit is refused
    before any layer runs, naming T's size and what fits; "auto" (the default) reads the free memory;
    a limit that holds the estimate runs."""
    from latim_jax.latim import attribution, memory
    from latim_jax.latim.attribution import contributions_estimate

    t = np.random.default_rng(0).integers(0, 32, (2, 64))
    need = contributions_estimate(model, 2, 64, layer=1).total
    T = 2 * 64 * 64 * CFG.d_model * 4  # 512 KiB
    assert need > T + contributions_estimate(model, 2, 64, layer=1).parameters

    def no_work(*args, **kwargs):
        raise AssertionError("work started before the memory check")

    with monkeypatch.context() as patch:
        patch.setattr(attribution, "_layer_contributions", no_work)
        patch.setattr(latim_jax.MambaLM, "run_layers", no_work)
        with pytest.raises(
            InsufficientMemoryError, match=r"materialise T \(b, l, l, d\) = 512\.00 KiB"
        ) as err:
            latim_jax.contributions(model, t, layer=1, memory_limit=need - 1)
        assert err.value.needed == need and err.value.limit == need - 1 and err.value.length == 64
        assert err.value.options == {"batch": 1} and "one prompt at a time fits" in str(err.value)
        assert "at most 63 tokens per prompt fit" in str(err.value) and "memory_limit=None" in str(err.value)
        patch.setattr(memory, "available", lambda: int(need * memory.AUTO_MARGIN) - 2)
        with pytest.raises(InsufficientMemoryError, match="more than the"):
            latim_jax.contributions(model, t, layer=1)  # memory_limit="auto"
        with pytest.raises(ValueError, match="memory_limit must be"):
            latim_jax.contributions(model, t, layer=1, memory_limit="lots")
    c = latim_jax.contributions(model, t, layer=1, memory_limit=need)
    assert c.T.shape == (2, 64, 64, CFG.d_model)


@pytest.mark.parametrize("version", [1, 2])
def test_contributions_estimate_bounds_the_compiled_programs_memory(version):
    """The per-layer part and T of the contributions estimate against XLA's account of the compiled
    program (temporaries + outputs): a safe bound, at most 3x over (measured 1.5-2x)."""
    import jax.numpy as jnp

    from latim_jax.latim.attribution import _layer_contributions, contributions_estimate
    from latim_jax.parallel.context import XLA

    cfg = MambaConfig(version=version, d_model=32, n_layers=1, vocab_size=64, d_state=8, d_conv=4,
                      head_dim=16, chunk_size=32)  # fmt: skip
    m = latim_jax.MambaLM(cfg, init_params(cfg, 0))
    L = 128
    h, mask = jnp.zeros((1, L, 32)), jnp.ones((1, L), bool)
    lowered = _layer_contributions.lower(m.layers[0], h, mask, None, mode="exact", ctx=XLA)
    analysis = lowered.compile().memory_analysis()
    measured = analysis.temp_size_in_bytes + analysis.output_size_in_bytes
    est = contributions_estimate(m, 1, L, layer=0)
    assert 1.0 <= (est.layer + est.output) / measured <= 3.0, (est.layer + est.output) / measured
