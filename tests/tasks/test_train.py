"""Training from scratch: the loss falls, runs are deterministic, the mimetic init sets its values,
checkpoints round-trip, the shipped configs parse."""

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from latim_jax.model import MambaLM
from latim_jax.model.config import MambaConfig
from latim_jax.model.init import init_params
from latim_jax.tasks import copy_task
from latim_jax.tasks import train as tr

REPO = Path(__file__).resolve().parents[2]
STEPS = 120
MODELS = {  # one layer keeps compilation short; the mimetic test uses two
    1: MambaConfig(version=1, d_model=16, n_layers=1, vocab_size=8, d_state=4),
    2: MambaConfig(version=2, d_model=16, n_layers=1, vocab_size=8, d_state=4, head_dim=8, chunk_size=8),
}


def tiny_train_config(version, **kw):
    base = dict(
        model=MODELS[version],
        task=copy_task(vocab_size=8, sep_id=0, min_len=2, max_len=5),
        steps=STEPS,
        batch_size=16,
        lr=1e-2,
        warmup_steps=5,
        eval_every=STEPS,
        eval_size=32,
    )
    return tr.TrainConfig(**{**base, **kw})


@pytest.fixture(scope="module", params=[1, 2], ids=["mamba1", "mamba2"])
def trained(request):
    tc = tiny_train_config(request.param)
    return tc, tr.train(tc, log=None)


def test_loss_falls(trained):
    _, result = trained
    first, last = np.mean(result.losses[:5]), np.mean(result.losses[-5:])
    assert last < first - 0.3, (first, last)
    assert result.final["step"] == STEPS


def test_same_seed_gives_identical_losses(trained):
    tc, result = trained
    again = tr.train(tc, log=None)
    assert again.losses == result.losses
    other = tr.train(tiny_train_config(tc.model.version, seed=1), log=None)
    assert other.losses[0] != result.losses[0]


def test_save_and_load_round_trip(trained, tmp_path):
    tc, result = trained
    out = tr.save_trained(tmp_path / "model", result, tc)
    names = ["latim_config.json", "params", "task.json", "tokenizer.json"]  # tokenizer: the task words
    assert sorted(p.name for p in out.iterdir()) == names
    model = tr.load_trained(out)
    assert model.config == tc.model
    assert (
        model.task["name"] == "copy" and model.task["final_token_accuracy"] == result.final["token_accuracy"]
    )
    tokens = jnp.asarray([[1, 2, 3, 0, 1, 2]])
    np.testing.assert_array_equal(np.asarray(model(tokens)), np.asarray(result.model(tokens)))
    # saving again replaces the directory atomically (no temporaries left behind)
    tr.save_trained(out, result, tc)
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


@pytest.mark.parametrize("version", [1, 2])
def test_mimetic_init_sets_the_documented_values(version):
    c = dataclasses.replace(MODELS[version], n_layers=2)
    base = init_params(c, 3)
    mim = tr.initial_params(c, "mimetic", 3)
    e, n, gn, k = c.d_inner, c.d_state, c.n_groups * c.d_state, c.d_conv
    for b, m in zip(base["layers"], mim["layers"], strict=True):
        b, m = b["mixer"], m["mixer"]
        np.testing.assert_array_equal(m["A_log"], -8.0 * b["A_log"])
        np.testing.assert_array_equal(m["dt_bias"], np.full_like(b["dt_bias"], 0.5413))
        identity = np.zeros((k, c.conv_dim))
        identity[k - 1] = 1.0
        np.testing.assert_array_equal(m["conv_w"], identity)
        np.testing.assert_array_equal(m["conv_b"], 0.0)
        if version == 1:
            r = c.dt_rank
            np.testing.assert_array_equal(m["dt_proj"], 0.0)
            w0, w = b["x_proj"], m["x_proj"]
            b_cols, c_cols, keep = slice(r, r + n), slice(r + n, r + 2 * n), slice(0, r)
        else:
            w0, w = b["in_proj"], m["in_proj"]
            b_cols, c_cols, keep = (
                slice(2 * e, 2 * e + gn),
                slice(2 * e + gn, 2 * e + 2 * gn),
                slice(0, 2 * e),
            )
            np.testing.assert_array_equal(w[:, 2 * e + 2 * gn :], 0.0)  # dt projection
        np.testing.assert_allclose(w[:, b_cols], 0.5 * (w0[:, b_cols] + w0[:, c_cols]), rtol=1e-6)
        np.testing.assert_array_equal(w[:, c_cols], w0[:, c_cols])
        np.testing.assert_array_equal(w[:, keep], w0[:, keep])
        for name in ("in_proj", "out_proj", "D") if version == 1 else ("out_proj", "D", "norm_w"):
            np.testing.assert_array_equal(m[name], b[name])
    # the model sees Delta = 1 and conv output = input
    model = MambaLM(c, mim)
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 5, c.d_model))
    inter = nnx.jit(lambda m, x: m.layers[1].mixer.intermediates(x, mask=jnp.ones(x.shape[:2], bool)))(
        model, x
    )
    np.testing.assert_allclose(np.asarray(inter.delta), 1.0, atol=1e-4)
    np.testing.assert_allclose(np.asarray(inter.c), np.asarray(inter.u), rtol=1e-6, atol=1e-6)


def test_mimetic_handles_projection_biases():
    c = MambaConfig(version=2, d_model=16, n_layers=1, vocab_size=8, d_state=4, head_dim=8, proj_bias=True)
    base, mim = init_params(c, 0), tr.initial_params(c, "mimetic", 0)
    e, gn = c.d_inner, c.d_state
    b0, b1 = base["layers"][0]["mixer"]["in_proj_b"], mim["layers"][0]["mixer"]["in_proj_b"]
    np.testing.assert_array_equal(b1[2 * e + 2 * gn :], 0.0)
    np.testing.assert_allclose(
        b1[2 * e : 2 * e + gn], 0.5 * (b0[2 * e : 2 * e + gn] + b0[2 * e + gn : 2 * e + 2 * gn])
    )


def test_weight_decay_skips_ssm_parameters():
    mask = tr._decay_mask(MambaLM(MODELS[1], init_params(MODELS[1], 0)).params())
    assert mask["embedding"] and mask["layers"][0]["mixer"]["in_proj"]
    assert not any(mask["layers"][0]["mixer"][name] for name in ("A_log", "D", "dt_bias", "conv_w", "conv_b"))
    assert not mask["norm_f"]


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.json")), ids=lambda p: p.name)
def test_shipped_configs_parse(path):
    # names: TASK-mambaV[-VARIANT] or TASK-hybrid[-KIND][-VARIANT] (attention with Mamba-2 sublayers, or
    # with KIND's: gdn, default init), VARIANT an activation (relu, identity), the init ("default") or a
    # curriculum stage
    tc = tr.TrainConfig.from_json(path)
    task, version, *variant = path.stem.split("-")
    assert tc.task["name"] == task
    recurrent = "mamba2"
    if version == "hybrid":
        if variant and variant[0] in ("gdn", "kda"):
            recurrent, variant = variant[0], variant[1:]
        assert tc.model.version == 2 and "attention" in tc.model.kinds and recurrent in tc.model.kinds
    else:
        assert tc.model.version == int(version[-1]) and not tc.model.is_hybrid
    assert tc.model.vocab_size >= tc.task["vocab_size"]
    variant = variant[0] if variant else None
    assert tc.model.activation == (variant if variant in ("relu", "identity") else "silu")
    default = variant == "default" or not recurrent.startswith("mamba")  # mimetic init is Mamba's
    assert tc.init == ("default" if default else "mimetic")


def test_bad_configs_are_rejected():
    with pytest.raises(ValueError, match="init"):
        tiny_train_config(1, init="xavier")
    with pytest.raises(ValueError, match="unknown training config"):
        tr.TrainConfig.from_dict({"model": MODELS[1].to_dict(), "task": copy_task(), "lr_max": 1.0})
    with pytest.raises(ValueError, match="exceeds"):
        tiny_train_config(1, task=copy_task(vocab_size=32))


def test_init_from_continues_from_a_saved_model(trained, tmp_path, monkeypatch):
    tc, result = trained
    tr.save_trained(tmp_path / "stage1", result, tc)
    monkeypatch.chdir(tmp_path)  # init_from is relative to the working directory
    stage2 = dataclasses.replace(tc, init_from="stage1", steps=2)
    start = tr.starting_params(stage2)
    saved = jax.tree.map(np.asarray, result.model.params())
    jax.tree.map(np.testing.assert_array_equal, start, saved)  # not a fresh initialisation
    assert not np.array_equal(start["embedding"], tr.starting_params(tc)["embedding"])
    assert len(tr.train(stage2, log=None).losses) == 2
    other = dataclasses.replace(stage2, model=dataclasses.replace(tc.model, d_state=8))
    with pytest.raises(ValueError, match=r"differs from the training config in \['d_state'\]"):
        tr.starting_params(other)
