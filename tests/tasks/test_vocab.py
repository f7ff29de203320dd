"""Task vocabularies and the word-level tokenizers of task models (shipped and trained)."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

import latim_jax
from latim_jax import tasks
from latim_jax.io.loading import ASSETS, SHIPPED
from latim_jax.tasks import vocab


def test_copy_vocabulary_names_sep_and_content_ids():
    words = tasks.vocabulary(tasks.copy_task(vocab_size=6, sep_id=2, min_len=1, max_len=3))
    assert words == ["t0", "t1", "<sep>", "t3", "t4", "t5"]


def test_mqar_vocabulary_names_pad_keys_and_values():
    task = tasks.mqar_task(vocab_size=10, n_keys=4, min_pairs=1, max_pairs=2, num_queries=1)
    assert tasks.vocabulary(task) == ["<pad>", "k1", "k2", "k3", "k4", "v1", "v2", "v3", "v4", "v5"]
    # the batches use exactly these roles: keys at even positions, values after them
    batch = tasks.make_batch(task, 8, np.random.default_rng(0))
    words = tasks.vocabulary(task)
    for row, n in zip(batch.tokens, batch.lengths, strict=True):
        assert all(words[t].startswith("k") for t in row[:n:2])
        assert all(words[t].startswith("v") for t in row[1:n:2])
        assert all(words[t] == "<pad>" for t in row[n:])


def test_vocabulary_reads_task_records_and_refuses_other_tasks():
    record = {**tasks.copy_task(vocab_size=4), "final_token_accuracy": 1.0, "training": {"steps": 3}}
    assert tasks.vocabulary(record) == ["<sep>", "t1", "t2", "t3"]
    with pytest.raises(ValueError, match="not a task record"):
        tasks.vocabulary({"name": "sort"})


def test_task_tokenizer_round_trips_ids_and_pads_to_the_model_vocabulary(tmp_path):
    task = tasks.copy_task(vocab_size=5, sep_id=0, min_len=1, max_len=2)
    path = vocab.write_task_tokenizer(tmp_path, task, vocab_size=7)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path))
    assert tok.encode("t3 <sep>  t4 t3").ids == [3, 0, 4, 3]
    assert [tok.id_to_token(i) for i in range(7)] == [
        "<sep>",
        "t1",
        "t2",
        "t3",
        "t4",
        "<unused5>",
        "<unused6>",
    ]
    with pytest.raises(ValueError, match="only 3"):
        vocab.task_words(task, vocab_size=3)


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_models_carry_their_task_tokenizer(name):
    model = latim_jax.load(name)
    assert (ASSETS / name / "tokenizer.json").is_file()
    words = vocab.model_words(model)
    assert words == vocab.task_words(model.task, model.config.vocab_size)
    ids = tasks.make_batch(tasks.task_fields(model.task), 1, np.random.default_rng(1)).tokens[0]
    text = " ".join(words[i] for i in ids)
    assert vocab.encode(model, text)[0] == [int(i) for i in ids]


def test_save_trained_writes_the_task_tokenizer(tmp_path, monkeypatch):
    from latim_jax.model import MambaLM
    from latim_jax.model.config import MambaConfig
    from latim_jax.model.init import init_params
    from latim_jax.tasks import train

    cfg = MambaConfig(version=2, d_model=8, n_layers=1, vocab_size=12, d_state=2, head_dim=4, chunk_size=4)
    task = tasks.mqar_task(vocab_size=10, n_keys=4, min_pairs=1, max_pairs=2, num_queries=1)
    tc = train.TrainConfig(model=cfg, task=task, steps=1)
    final = {"step": 1, "loss": 1.0, "token_accuracy": 0.5, "sequence_accuracy": 0.0}
    result = train.TrainResult(
        model=MambaLM(cfg, init_params(cfg, 0)), losses=[1.0], evals=[final], wall_time_s=0
    )
    monkeypatch.chdir(tmp_path)
    out = train.save_trained("runs/m", result, tc)  # a relative path
    assert sorted(p.name for p in out.iterdir()) == [
        "latim_config.json",
        "params",
        "task.json",
        "tokenizer.json",
    ]
    model = latim_jax.load("runs/m")
    assert vocab.labels(model, [0, 1, 5, 10, 11]) == ["<pad>", "k1", "v1", "<unused10>", "<unused11>"]
    assert json.loads((out / "task.json").read_text())["name"] == "mqar"
    np.testing.assert_array_equal(
        np.asarray(jax.tree.leaves(model.params())[0]), np.asarray(jax.tree.leaves(result.model.params())[0])
    )


def test_a_task_model_without_tokenizer_json_still_has_words(tmp_path):
    from latim_jax.convert import save_checkpoint
    from latim_jax.model.config import MambaConfig
    from latim_jax.model.init import init_params

    cfg = MambaConfig(version=1, d_model=8, n_layers=1, vocab_size=8, d_state=2, d_conv=2)
    save_checkpoint(tmp_path / "m", cfg, init_params(cfg, 0))
    (tmp_path / "m" / "task.json").write_text(json.dumps(tasks.copy_task(vocab_size=8, min_len=2, max_len=3)))
    model = latim_jax.load(tmp_path / "m")
    assert model.tokenizer_dir == ""
    assert vocab.encode(model, "t1 <sep> t1") == ([1, 0, 1], ["t1", "<sep>", "t1"])


def test_describe_elides_long_vocabularies():
    assert vocab.describe(["a", "b"]) == "0=a 1=b"
    long = [f"w{i}" for i in range(100)]
    text = vocab.describe(long)
    assert text.startswith("0=w0 1=w1") and "(72 more)" in text and text.endswith("99=w99")


def test_byte_level_labels_are_shown_decoded(tmp_path):
    """A byte-level BPE tokenizer's entries read "Ġcat"; the labels of figures and the CLI show what
    the text holds, " cat"."""
    from types import SimpleNamespace

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from latim_jax.tasks import vocab

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok.train_from_iterator(
        ["the cat sat on the mat"] * 20, trainers.BpeTrainer(vocab_size=300, initial_alphabet=alphabet)
    )
    tok.save(str(tmp_path / "tokenizer.json"))
    model = SimpleNamespace(tokenizer_dir=str(tmp_path), task=None, source="bpe")
    ids, labels = vocab.encode(model, "the cat sat")
    assert tok.encode("the cat sat").tokens[1] == "Ġcat"  # what the vocabulary holds
    assert labels == ["the", " cat", " sat"] and vocab.labels(model, ids) == labels
