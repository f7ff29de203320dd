"""latim_jax.load's refusals name what is wrong: a path that does not exist, a directory without any
supported checkpoint (listing what every format needs)."""

from __future__ import annotations

import pytest

import latim_jax
from latim_jax.convert import CheckpointError
from latim_jax.convert.hf import MODEL_TYPES


def test_a_missing_directory_is_named_and_said_not_to_exist(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for source, shown in [
        (tmp_path / "nowhere" / "ck", str(tmp_path / "nowhere" / "ck")),
        ("./ck", str(tmp_path / "ck")),
        (str(tmp_path / "ck"), str(tmp_path / "ck")),
    ]:
        with pytest.raises(CheckpointError) as err:
            latim_jax.load(source)
        message = str(err.value)
        assert f"{shown!r} does not exist" in message and "None" not in message, message


def test_a_directory_without_a_checkpoint_lists_what_every_format_needs(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError) as err:
        latim_jax.load(tmp_path / "empty")
    message = str(err.value)
    assert "found an empty directory" in message, message
    for needed in (
        "latim_config.json",
        "config.json",
        "d_model and n_layer",
        "params.json",
        "model.safetensors",
    ):
        assert needed in message, (needed, message)
    for model_type in MODEL_TYPES:  # every family read, not only Mamba's
        assert model_type in message, (model_type, message)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("")
    with pytest.raises(CheckpointError, match=r"jamba.*found \['notes.txt'\]"):
        latim_jax.load(tmp_path / "other")
