"""The channel layout of a Mamba mixer over "model" shards (latim_jax.model.channel_layout): each
shard's column block holds the matching slice of every part, the parts read back in the checkpoint's
order, and a laid-out layer computes what the checkpoint's order computes (no mesh needed: the layout
is an order of columns, whatever devices hold them)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from conftest import tiny_config

import latim_jax
from latim_jax.model.channel_layout import channel_layout, fits
from latim_jax.model.config import MambaConfig
from latim_jax.model.init import init_params

M1 = tiny_config(1)
M2 = tiny_config(2, d_conv=4, head_dim=4)  # 8 heads of 4


@pytest.mark.parametrize("shards", [2, 8])
def test_each_shard_holds_its_slice_of_every_part(shards):
    """Mamba-2, e 32, 8 heads of 4, g 2, n 4: shard k's in_proj block is z_k | x_k | B_k | C_k | dt_k, with
    B_k the group of shard k's heads (repeated over the shards of one group when g < m)."""
    e, gn, h, n = 32, 8, 8, 4
    cols = channel_layout(M2, "mamba2", shards).columns("in").reshape(shards, -1)
    for k in range(shards):
        ce, ch = e // shards, h // shards
        z, x = np.arange(k * ce, (k + 1) * ce), e + np.arange(k * ce, (k + 1) * ce)
        group = (k * ch) // (h // 2)  # the group of this shard's heads (all of them: 2 | 8 | heads)
        groups = [group] if shards > 2 else [k]  # g % m == 0: the shard's own g/m groups
        B = np.concatenate([2 * e + g * n + np.arange(n) for g in groups])
        C = B + gn
        dt = 2 * e + 2 * gn + np.arange(k * ch, (k + 1) * ch)
        np.testing.assert_array_equal(cols[k], np.concatenate([z, x, B, C, dt]))


@pytest.mark.parametrize(("cfg", "kind", "shards"), [(M1, "mamba1", 4), (M2, "mamba2", 2), (M2, "mamba2", 8)])
def test_split_and_restore_give_the_checkpoint_order(cfg, kind, shards):
    """A laid-out in_proj row split into parts equals the checkpoint's parts, and restore inverts
    lay_out (B and C: every repeated copy holds its group)."""
    lay = channel_layout(cfg, kind, shards)
    ref = channel_layout(cfg, kind, 1)
    width = ref.total_width("in")
    row = np.arange(width, dtype=np.float32)[None]
    laid = lay.lay_out("in_proj", row)
    names = [p.name for p in ref.in_parts]
    runs = [(n,) for n in names]
    for name, got, want in zip(names, lay.split(laid, "in", *runs), ref.split(row, "in", *runs), strict=True):
        if name in ("B", "C") and lay.groups != ref.groups:  # g' = m groups, each a copy of its group
            want = want.reshape(1, ref.groups, -1).repeat(lay.groups // ref.groups, 1).reshape(1, -1)
        np.testing.assert_array_equal(got, want, err_msg=name)
    np.testing.assert_array_equal(lay.restore("in_proj", laid), row)
    conv = np.arange(ref.total_width("conv"), dtype=np.float32)[None]
    np.testing.assert_array_equal(lay.restore("conv_w", lay.lay_out("conv_w", conv)), conv)


def test_a_laid_out_model_computes_the_same():
    """Laid out for 8 shards on one device: logits and exact contributions equal the checkpoint order's,
    and params() is the checkpoint's bit for bit."""
    tokens = np.random.default_rng(0).integers(0, 32, (2, 9))
    for cfg in (M1, M2):
        params = init_params(cfg, 0)
        plain, laid = latim_jax.MambaLM(cfg, params), latim_jax.MambaLM(cfg, params)
        for block in laid.layers:
            block.mixer.lay_out(8)
        if cfg.version == 2:  # g 2 < 8 shards: B and C repeated, in_proj wider than the checkpoint's
            assert laid.layers[0].mixer.in_proj[...].shape[1] > plain.layers[0].mixer.in_proj[...].shape[1]
        np.testing.assert_allclose(laid(tokens), plain(tokens), rtol=1e-5, atol=1e-6)
        a = latim_jax.attribute(plain, tokens, method="l2").scores
        b = latim_jax.attribute(laid, tokens, method="l2").scores
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-7)
        mixer = laid.layers[0].mixer  # what shard lays out by name, without reading the values back
        assert mixer.param_names() == list(mixer.param_dict())
        for x, y in zip(jax.tree.leaves(plain.params()), jax.tree.leaves(laid.params()), strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_layouts_that_do_not_fit_are_refused_by_name():
    """Shards that do not divide the heads, or groups and shards neither dividing the other."""
    assert not fits(M2, "mamba2", 3) and not fits(M1, "mamba1", 3) and fits(M2, "mamba2", 4)
    with pytest.raises(ValueError, match="heads h = 8"):
        channel_layout(M2, "mamba2", 3)
    odd = MambaConfig(version=2, d_model=24, n_layers=1, vocab_size=32, d_state=4, head_dim=4, n_groups=3)
    with pytest.raises(ValueError, match="groups"):
        channel_layout(odd, "mamba2", 4)
    with pytest.raises(ValueError, match="e = 32"):
        channel_layout(M1, "mamba1", 3)


def test_copies_that_diverged_are_refused_when_read_back():
    """B/C columns repeated over shards, then edited in one copy (what a per-copy update does): params()
    names the parameter instead of saving one copy silently."""
    model = latim_jax.MambaLM(M2, init_params(M2, 0))
    mixer = model.layers[0].mixer
    mixer.lay_out(8)  # g 2 < 8 shards: each group repeated on 4 shards
    model.params()  # the copies agree
    width = mixer.layout.shard_width("in")  # shard 0: z 4 | x 4 | B 4 | C 4 | dt 1
    mixer.in_proj.set_value(mixer.in_proj[...].at[:, width + 9].add(1.0))  # shard 1's copy of B
    with pytest.raises(ValueError, match="in_proj: the copies of B/C columns repeated over 8 shards differ"):
        model.params()
