"""The latim-jax command line on tiny checkpoints written in the test (jax only). Every test runs in
its own temporary directory and passes relative paths, as a user would."""

from __future__ import annotations

import re

import numpy as np
import pytest

import latim_jax
from latim_jax import tasks
from latim_jax.cli import main
from latim_jax.convert import save_checkpoint
from latim_jax.io import plotting
from latim_jax.model.config import MambaConfig
from latim_jax.model.init import init_params
from latim_jax.tasks.vocab import write_task_tokenizer

CFG = MambaConfig(
    version=2, d_model=16, n_layers=2, vocab_size=16, d_state=4, d_conv=4, head_dim=8, chunk_size=8
)
WORDS = ["<unk>", "the", "cat", "sat", "on", "mat", "a", "dog"]
COPY = tasks.copy_task(vocab_size=16, sep_id=0, min_len=2, max_len=6)
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """Three tiny checkpoints: with a word-level tokenizer.json ("with"), without one ("without"),
    and a copy-task model with its task.json and task tokenizer ("copy")."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    root = tmp_path_factory.mktemp("ckpts")
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    (root / "tok").mkdir()
    tok.save(str(root / "tok" / "tokenizer.json"))
    save_checkpoint(root / "with", CFG, init_params(CFG, 0), tokenizer_dir=root / "tok")
    save_checkpoint(root / "without", CFG, init_params(CFG, 0))
    save_checkpoint(root / "copy", CFG, init_params(CFG, 1))
    (root / "copy" / "task.json").write_text(__import__("json").dumps(tasks.task_summary(COPY)))
    write_task_tokenizer(root / "copy", COPY, CFG.vocab_size)
    _bpe_checkpoint(root)
    return root


def _bpe_checkpoint(root):
    """root/bpe: a model with a byte-level BPE tokenizer trained here (sub-word pieces: 'cats' is two)."""
    import dataclasses

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=270, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the cat sat on the mat"] * 20, trainer)
    (root / "bpetok").mkdir()
    tok.save(str(root / "bpetok" / "tokenizer.json"))
    cfg = dataclasses.replace(CFG, vocab_size=272)
    save_checkpoint(root / "bpe", cfg, init_params(cfg, 2), tokenizer_dir=root / "bpetok")


@pytest.fixture
def here(ckpts, tmp_path, monkeypatch):
    """Work in tmp_path with the checkpoints linked in as ./with, ./without, ./copy, ./bpe."""
    for name in ("with", "without", "copy", "bpe"):
        (tmp_path / name).symlink_to(ckpts / name, target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_attribute_text_writes_scores_plot_and_html(here):
    argv = ["attribute", "--model", "with", "--text", "the cat sat on the mat", "--method", "alti"]
    assert main(argv + ["--out", "s.npz", "--plot", "s.png", "--html", "s.html"]) == 0
    result = latim_jax.Attribution.load("s.npz")
    assert result.method == "alti" and result.scores.shape == (1, 2, 6, 6)
    np.testing.assert_array_equal(np.asarray(result.tokens[0]), [1, 2, 3, 4, 1, 5])
    assert (here / "s.png").read_bytes()[:8] == PNG
    text = (here / "s.html").read_text()
    assert "cat" in text and 'type="range"' in text


def test_attribute_generate_foil_and_words(here, capsys):
    """--generate scores the continuation's rows (the file holds prompt + continuation, with labels);
    --foil contrasts; --words sums sources per word, labels the pictures with words."""
    argv = ["attribute", "--model", "bpe", "--method", "logit", "--text", "the cats sat", "--out", "g.npz"]
    assert main(argv + ["--generate", "3", "--foil", " mat", "--html", "g.html"]) == 0
    assert "generated 3 token(s):" in capsys.readouterr().out
    g = latim_jax.Attribution.load("g.npz")
    n = len(g.labels[0])
    assert (
        g.tokens.shape == (1, n) and g.rows == tuple(range(n - 4, n - 1)) and g.scores.shape == (1, 2, 3, n)
    )
    assert "foil" in g.extra and g.labels[0][:3] == ("the", " cat", "s")  # "cats" is two pieces
    want = latim_jax.attribute(
        latim_jax.load("bpe"), np.asarray(g.tokens), "logit", rows=list(g.rows),
        target=np.asarray(g.extra["targets"]), foil=np.asarray(g.extra["foil"]),
    )  # fmt: skip
    np.testing.assert_allclose(g.scores, want.scores, rtol=1e-5, atol=1e-6)
    assert main(argv[:-1] + ["w.npz", "--words", "--plot", "w.png", "--html", "w.html"]) == 0
    w = latim_jax.Attribution.load("w.npz")
    assert w.labels == (("the", "cats", "sat"),) and w.scores.shape == (1, 2, 3, 3)
    total = w.extra["direct"] + w.scores.sum((1, 3)) + w.extra["bias"].sum(1)
    np.testing.assert_allclose(total, w.extra["logit"], rtol=1e-5, atol=1e-5)
    assert '"1:cats"' in (here / "w.html").read_text() and (here / "w.png").read_bytes()[:8] == PNG


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--target", "the cat"], "--target 'the cat' is 2 tokens"),
        (["--target", "99"], r"--target 99: a token id must lie in \[0, 16\)"),
        (["--method", "alti", "--foil", "cat"], "--target and --foil apply to --method logit / grad_input"),
        (["--generate", "2", "--rows", "last"], "--generate scores the generated tokens' rows"),
    ],
)
def test_attribute_target_foil_and_generate_refusals(here, capsys, extra, message):
    argv = ["attribute", "--model", "with", "--method", "logit", "--text", "the cat sat"]
    assert main(argv + extra) == 2
    assert re.search(message, capsys.readouterr().err)


def test_attribute_tokens_paper_mode_prints_the_error(here, capsys):
    argv = ["attribute", "--model", "without", "--tokens", "1 2 3", "--method", "l2", "--mode", "paper"]
    assert main(argv + ["--out", "t.npz"]) == 0
    assert "approximation error" in capsys.readouterr().out
    assert latim_jax.Attribution.load("t.npz").mode == "paper"


def test_generate_cli(here, capsys):
    assert main(["generate", "--model", "with", "--tokens", "1 2 3", "--max-new-tokens", "3"]) == 0
    ids = [int(x) for x in capsys.readouterr().out.split()]
    assert ids[:3] == [1, 2, 3] and len(ids) == 6
    assert main(["generate", "--model", "with", "--text", "the cat", "--max-new-tokens", "2", "--words"]) == 0
    words = capsys.readouterr().out.split()
    assert words[:2] == ["the", "cat"] and len(words) == 4 and set(words) <= set(WORDS)


def test_task_model_takes_text_in_its_vocabulary_and_labels_rows_by_position(here, monkeypatch):
    # the copy task's words: "<sep>" for id 0, "t<id>" for the content ids
    assert tasks.vocabulary(COPY)[:3] == ["<sep>", "t1", "t2"]
    assert main(["attribute", "--model", "copy", "--text", "t5 t6 t7 <sep> t5 t6", "--out", "a.npz"]) == 0
    np.testing.assert_array_equal(
        np.asarray(latim_jax.Attribution.load("a.npz").tokens[0]), [5, 6, 7, 0, 5, 6]
    )
    # rows 0 1 2 of "5 6 7 8 0 5 6 7 8" are the tokens 5 6 7: the figure must say so (not 6 7 8)
    drawn = []
    monkeypatch.setattr(plotting, "save_figure", lambda fig, path: drawn.append(fig))
    argv = ["attribute", "--model", "copy", "--tokens", "5 6 7 8 0 5 6 7 8", "--rows", "0 1 2"]
    assert main(argv + ["--out", "b.npz", "--plot", "b.png", "--html", "b.html"]) == 0
    (fig,) = drawn
    for ax in fig.panels:
        assert [t.get_text() for t in ax.get_yticklabels()] == ["t5", "t6", "t7"]
        assert [t.get_text() for t in ax.get_xticklabels()][:5] == ["t5", "t6", "t7", "t8", "<sep>"]
    assert '"rows": ["0:t5", "1:t6", "2:t7"]' in (here / "b.html").read_text()


def test_text_with_unknown_words_explains_the_vocabulary(here, capsys):
    assert main(["attribute", "--model", "copy", "--text", "hello t5", "--out", "a.npz"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'hello'" in err and "0=<sep> 1=t1" in err and "--tokens" in err
    assert main(["attribute", "--model", "without", "--text", "the cat", "--out", "a.npz"]) == 2
    assert "no tokenizer.json" in capsys.readouterr().err


def test_text_with_unknown_words_becomes_unk_with_a_note_where_the_vocabulary_has_one(here, capsys):
    """The "with" tokenizer declares <unk> (id 0): an unknown word becomes it, named in one note; a
    dataset line says which line it was."""
    argv = ["attribute", "--model", "with", "--text", "the zebra sat okapi", "--out", "u.npz"]
    assert main(argv + ["--method", "l2"]) == 0
    err = capsys.readouterr().err
    notes = [line for line in err.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and "2 word(s)" in notes[0] and "['zebra', 'okapi']" in notes[0], err
    np.testing.assert_array_equal(np.asarray(latim_jax.Attribution.load("u.npz").tokens[0]), [1, 0, 3, 0])
    (here / "p.txt").write_text("the cat sat\nthe gnu sat\n")
    argv = ["attribute-dataset", "--model", "with", "--input", "p.txt", "--out", "r", "--quiet"]
    assert main(argv + ["--method", "l2"]) == 0
    err = capsys.readouterr().err
    assert "p.txt:2:" in err and "['gnu']" in err and "p.txt:1" not in err, err
    np.testing.assert_array_equal(np.asarray(latim_jax.open_results("r")["2"].tokens), [[1, 0, 3]])


def test_plot_format_follows_the_extension(here):
    argv = ["attribute", "--model", "without", "--tokens", "1 2 3 4"]
    assert main(argv + ["--out", "a.npz", "--plot", "a.jpg"]) == 0
    assert (here / "a.jpg").read_bytes()[:3] == b"\xff\xd8\xff"  # JPEG, not PNG bytes
    assert main(argv + ["--out", "b.npz", "--plot", "b.svg"]) == 0
    assert b"<svg" in (here / "b.svg").read_bytes()[:500]
    assert main(argv + ["--out", "c.npz", "--plot", "c.bmp"]) == 2
    assert not (here / "c.npz").exists()  # refused before computing anything


def test_plot_layers_selects_panels(here, monkeypatch):
    drawn = []
    monkeypatch.setattr(plotting, "save_figure", lambda fig, path: drawn.append(fig))
    argv = ["attribute", "--model", "without", "--tokens", "1 2 3", "--out", "a.npz", "--plot", "a.png"]
    assert main(argv + ["--plot-layers", "1"]) == 0
    assert [ax.get_title() for ax in drawn[0].panels] == ["layer 1"]
    assert main(argv + ["--force", "--layers", "0", "--plot-layers", "1"]) == 2  # layer 1 not scored


def test_info_prints_config_task_sizes_and_vocabulary(here, capsys):
    assert main(["info", "copy"]) == 0
    out = capsys.readouterr().out
    assert "Mamba-2, 2 layers, d_model 16" in out
    n_params = sum(int(np.prod(np.shape(a))) for a in __import__("jax").tree.leaves(init_params(CFG, 0)))
    assert f"parameters: {n_params:,}" in out
    assert "task: copy (vocab_size 16, sep_id 0" in out
    assert "vocabulary: 16 ids, from tokenizer.json: 0=<sep> 1=t1 2=t2" in out and "15=t15" in out
    assert main(["info", "without"]) == 0
    assert "no tokenizer" in capsys.readouterr().out
    assert main(["info", "--model", "copy"]) == 0  # as the other commands take it
    assert "task: copy" in capsys.readouterr().out
    assert main(["info", "copy", "--model", "without"]) == 2  # two models: which one?
    assert "the model given twice" in capsys.readouterr().err


def test_info_on_a_shipped_model_shows_its_vocabulary(capsys):
    assert main(["info", "mqar-mamba2"]) == 0
    out = capsys.readouterr().out
    assert "task: mqar" in out and "0=<pad> 1=k1" in out and "17=v1" in out


def test_quiet_flag_turns_progress_off_for_the_command(here, monkeypatch):
    from latim_jax.io import progress

    seen = []
    real = progress.set_quiet
    monkeypatch.setattr(progress, "set_quiet", lambda q=True: (seen.append(q), real(q)))
    assert main(["info", "without", "--quiet"]) == 0
    assert seen[0] is True and not progress.is_quiet()  # on for the command, reset after


def test_a_hybrid_names_each_panel_and_layer_kind(tmp_path, monkeypatch, capsys):
    """The shipped hybrid through the CLI: the PNG panels and the HTML page name each sublayer's kind,
    info lists the sublayers, and the saved scores record the kinds."""
    monkeypatch.chdir(tmp_path)
    drawn = []
    monkeypatch.setattr(plotting, "save_figure", lambda fig, path: drawn.append(fig))
    argv = ["attribute", "--model", "needle-hybrid", "--text", "w1 K3 V7 w2 w5 K3", "--method", "logit"]
    assert main(argv + ["--out", "h.npz", "--plot", "h.png", "--html", "h.html"]) == 0
    titles = ["layer 0 (Mamba-2)", "layer 1 (attention)", "layer 2 (Mamba-2)"]
    assert [ax.get_title() for ax in drawn[0].panels] == titles
    page = (tmp_path / "h.html").read_text()
    assert all(t in page for t in titles)
    assert latim_jax.Attribution.load("h.npz").layer_kinds == ("mamba2", "attention", "mamba2")
    assert main(["info", "needle-hybrid"]) == 0
    out = capsys.readouterr().out
    assert "layers: 2 x [RMSNorm, Mamba-2] (layers 0, 2)" in out
    assert "layers: 1 x [RMSNorm, attention] (layers 1)" in out
