"""Progress bars: drawn on stderr only when it is a terminal and quiet mode is off."""

from __future__ import annotations

import io
import sys

import pytest

from latim_jax.io import progress


class FakeTerminal(io.StringIO):
    def isatty(self):
        return True


@pytest.fixture(autouse=True)
def not_quiet():
    """Each test starts with the library's switch off, whatever ran before it in this process."""
    progress.set_quiet(False)
    yield
    progress.set_quiet(False)


def fake_terminal(monkeypatch) -> FakeTerminal:
    """stderr replaced by a terminal-like buffer (inside the test: pytest re-installs its own capture
    between a fixture's setup and the test call)."""
    stream = FakeTerminal()
    monkeypatch.setattr(sys, "stderr", stream)
    return stream


def test_bar_on_a_terminal(monkeypatch):
    terminal = fake_terminal(monkeypatch)
    assert list(progress.progress(range(3), total=3, desc="work")) == [0, 1, 2]
    assert "work" in terminal.getvalue() and "0/3" in terminal.getvalue()


def test_silent_when_not_a_terminal(monkeypatch):
    stream = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stream)
    items = range(3)
    assert progress.progress(items, desc="work") is items  # returned unwrapped
    with progress.progress(total=3) as bar:
        bar.update(3)
    assert stream.getvalue() == ""


def test_quiet_switch_and_context(monkeypatch):
    terminal = fake_terminal(monkeypatch)
    with progress.quiet():
        assert progress.is_quiet()
        assert list(progress.progress(range(2), desc="hidden")) == [0, 1]
    assert not progress.is_quiet()
    progress.set_quiet(True)
    try:
        list(progress.progress(range(2), desc="hidden"))
    finally:
        progress.set_quiet(False)
    assert "hidden" not in terminal.getvalue()
    list(progress.progress(range(2), desc="forced", enabled=True))
    assert "forced" in terminal.getvalue()


def test_evaluate_shows_batches_on_a_terminal(monkeypatch):
    terminal = fake_terminal(monkeypatch)
    from latim_jax import tasks
    from latim_jax.model import MambaLM
    from latim_jax.model.config import MambaConfig
    from latim_jax.model.init import init_params
    from latim_jax.tasks import evaluate as ev

    cfg = MambaConfig(version=2, d_model=8, n_layers=1, vocab_size=8, d_state=2, head_dim=4, chunk_size=4)
    task = tasks.copy_task(vocab_size=8, min_len=2, max_len=3)
    methods = [("LaTIM l2 (exact)", "l2", "exact")]
    ev.evaluate(MambaLM(cfg, init_params(cfg, 0)), task, n_sequences=4, batch_size=2, methods=methods)
    assert "evaluate copy" in terminal.getvalue() and "/2 [" in terminal.getvalue()


def test_training_shows_steps_on_a_terminal(monkeypatch, capsys):
    terminal = fake_terminal(monkeypatch)
    from latim_jax import tasks
    from latim_jax.model.config import MambaConfig
    from latim_jax.tasks import train

    cfg = MambaConfig(version=1, d_model=8, n_layers=1, vocab_size=8, d_state=2, d_conv=2)
    task = tasks.copy_task(vocab_size=8, min_len=2, max_len=3)
    tc = train.TrainConfig(
        model=cfg, task=task, steps=2, batch_size=2, eval_every=2, eval_size=4, warmup_steps=1
    )
    train.train(tc)
    assert "train:" in terminal.getvalue() and "/2 [" in terminal.getvalue()
    assert "step     2" in capsys.readouterr().out  # the log line still reaches stdout


def test_long_attribution_follows_the_switch(monkeypatch):
    """attribute's layer bar from L = 1024 on: on a terminal, and neither under quiet nor into a pipe
    (it once forced itself on past both)."""
    import numpy as np

    import latim_jax
    from latim_jax.model import MambaLM
    from latim_jax.model.config import MambaConfig
    from latim_jax.model.init import init_params

    cfg = MambaConfig(version=2, d_model=8, n_layers=2, vocab_size=8, d_state=2, head_dim=4, chunk_size=8)
    model = MambaLM(cfg, init_params(cfg, 0))
    tokens = np.zeros((1, 1024), np.int32)
    terminal = fake_terminal(monkeypatch)
    latim_jax.attribute(model, tokens, method="l2", rows=[-1])
    assert "l2 layers" in terminal.getvalue()
    with progress.quiet():
        terminal = fake_terminal(monkeypatch)
        latim_jax.attribute(model, tokens, method="l2", rows=[-1])
        assert terminal.getvalue() == ""
    pipe = io.StringIO()
    monkeypatch.setattr(sys, "stderr", pipe)
    latim_jax.attribute(model, tokens, method="l2", rows=[-1])
    assert pipe.getvalue() == ""
