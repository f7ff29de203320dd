"""scripts/train_copy.py then scripts/compare_models.py, with relative paths, as the README runs them."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
CONFIG = {
    "model": {
        "version": 2,
        "d_model": 8,
        "n_layers": 1,
        "vocab_size": 8,
        "d_state": 2,
        "head_dim": 4,
        "chunk_size": 4,
    },
    "task": {"name": "copy", "vocab_size": 8, "sep_id": 0, "min_len": 2, "max_len": 3},
    "steps": 2,
    "batch_size": 2,
    "eval_every": 2,
    "eval_size": 4,
    "warmup_steps": 1,
}


def script(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_train_then_compare_with_relative_paths(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    Path("cfg.json").write_text(json.dumps(CONFIG))
    assert script("train_copy").main(["cfg.json", "runs/x", "--quiet"]) == 0
    assert sorted(p.name for p in Path("runs/x").iterdir()) == [
        "latim_config.json",
        "params",
        "task.json",
        "tokenizer.json",
    ]
    compare = script("compare_models")
    assert compare.main(["runs/x", "--n", "2", "--methods", "l2", "--markdown", "cmp.md", "--quiet"]) == 0
    assert "| x | silu |" in Path("cmp.md").read_text()
    capsys.readouterr()
    assert compare.main(["runs/x", "--n", "2", "--markdown", "cmp.md"]) == 2  # exists: --force
    assert compare.main(["runs/y"]) == 2
    assert "runs/y" in capsys.readouterr().err


@pytest.mark.parametrize("bad", [{"steps": 2}, {**CONFIG, "task": {"name": "sort"}}])
def test_train_script_refuses_a_bad_config_in_one_line(tmp_path, monkeypatch, capsys, bad):
    monkeypatch.chdir(tmp_path)
    Path("bad.json").write_text(json.dumps(bad))
    assert script("train_copy").main(["bad.json", "out"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: bad.json") and err.count("\n") == 1
    assert script("train_copy").main(["missing.json", "out"]) == 2
    assert not Path("out").exists()
