"""Fine-tuning with an attribution term: the gradient of the attribution loss is a descent direction,
the script writes a loadable model and a before/after report (jax only, tiny models)."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import latim_jax
from latim_jax import tasks
from latim_jax.convert import save_checkpoint
from latim_jax.model.config import MambaConfig
from latim_jax.model.init import init_params
from latim_jax.tasks.finetune import FinetuneConfig, attribution_loss

COPY = tasks.copy_task(vocab_size=16, sep_id=0, min_len=3, max_len=5)
CFG = MambaConfig(
    version=2, d_model=16, n_layers=2, vocab_size=16, d_state=4, d_conv=4, head_dim=8, chunk_size=8
)


def tiny():
    m = latim_jax.MambaLM(CFG, init_params(CFG, 0))
    m.task = COPY
    return m


@pytest.mark.parametrize("method", ["l2", "alti"])
def test_gradient_steps_lower_the_attribution_loss(method):
    m = tiny()
    b = tasks.make_batch(COPY, 8, np.random.default_rng(0))
    mask = jnp.asarray(np.arange(b.tokens.shape[1])[None, :] < b.lengths[:, None])
    graphdef, state = nnx.split(m)

    def loss(state):
        return attribution_loss(
            nnx.merge(graphdef, state), jnp.asarray(b.tokens), jnp.asarray(b.gold), mask, method
        )

    value_and_grad = jax.jit(jax.value_and_grad(loss))
    start, grads = value_and_grad(state)
    for _ in range(5):  # plain gradient descent on the attribution term alone
        state = jax.tree.map(lambda p, g: p - 0.05 * g, state, grads)
        value, grads = value_and_grad(state)
    assert float(value) < float(start) - 0.05, (float(start), float(value))


def test_config_errors():
    with pytest.raises(ValueError, match="alti, l2 or l1"):
        FinetuneConfig(method="logit")
    with pytest.raises(ValueError, match="rollout"):
        FinetuneConfig(method="l2", layer=None)


def test_script_writes_a_loadable_model_and_a_report(tmp_path, monkeypatch):
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "finetune_attribution", Path(__file__).resolve().parents[2] / "scripts" / "finetune_attribution.py"
    )
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.chdir(tmp_path)
    save_checkpoint("base", CFG, init_params(CFG, 0))
    (tmp_path / "base" / "task.json").write_text(json.dumps(COPY))
    argv = ["base", "tuned", "--steps", "2", "--batch-size", "4", "--n", "4", "--json", "r.json", "--quiet"]
    assert script.main(argv) == 0
    report = json.loads((tmp_path / "r.json").read_text())
    assert (
        set(report["before"]) == {"accuracy", "auc_layer", "auc_aggregate", "layer"}
        and len(report["history"]) == 2
    )
    tuned = latim_jax.load("tuned")
    assert tuned.task["name"] == "copy"
    base = latim_jax.load("base")
    assert not np.allclose(tuned.layers[1].mixer.out_proj[...], base.layers[1].mixer.out_proj[...])
    assert script.main(argv) == 2  # tuned exists: refused without --force
