"""The latim-jax command line on tiny checkpoints written in the test (jax only)."""

from __future__ import annotations

import numpy as np
import pytest

import latim_jax
from latim_jax.cli import main
from latim_jax.config import MambaConfig
from latim_jax.convert import save_checkpoint
from latim_jax.init import init_params

CFG = MambaConfig(
    version=2, d_model=16, n_layers=2, vocab_size=16, d_state=4, d_conv=4, head_dim=8, chunk_size=8
)
WORDS = ["<unk>", "the", "cat", "sat", "on", "mat", "a", "dog"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A converted checkpoint with a word-level tokenizer.json, and one without a tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok_dir = tmp_path_factory.mktemp("tok")
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tok_dir / "tokenizer.json"))
    with_tok = tmp_path_factory.mktemp("ckpt") / "with"
    save_checkpoint(with_tok, CFG, init_params(CFG, 0), tokenizer_dir=tok_dir)
    without = tmp_path_factory.mktemp("ckpt") / "without"
    save_checkpoint(without, CFG, init_params(CFG, 0))
    return with_tok, without


def test_attribute_text_writes_scores_plot_and_html(ckpt, tmp_path):
    with_tok, _ = ckpt
    out, png, page = tmp_path / "s.npz", tmp_path / "s.png", tmp_path / "s.html"
    rc = main(
        [
            "attribute",
            "--model",
            str(with_tok),
            "--text",
            "the cat sat on the mat",
            "--method",
            "alti",
            "--out",
            str(out),
            "--plot",
            str(png),
            "--html",
            str(page),
        ]
    )
    assert rc == 0
    result = latim_jax.Attribution.load(out)
    assert result.method == "alti" and result.scores.shape == (1, 2, 6, 6)
    np.testing.assert_array_equal(np.asarray(result.tokens[0]), [1, 2, 3, 4, 1, 5])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = page.read_text()
    assert "cat" in text and 'type="range"' in text


def test_attribute_tokens_and_errors(ckpt, tmp_path, capsys):
    with_tok, without = ckpt
    out = tmp_path / "t.npz"
    assert (
        main(
            [
                "attribute",
                "--model",
                str(without),
                "--tokens",
                "1 2 3",
                "--method",
                "l2",
                "--mode",
                "paper",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert "approximation error" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="no tokenizer.json"):
        main(["attribute", "--model", str(without), "--text", "the cat", "--out", str(out)])
    with pytest.raises(SystemExit, match="unknown method"):
        main(
            ["attribute", "--model", str(with_tok), "--tokens", "1 2", "--method", "nope", "--out", str(out)]
        )
    with pytest.raises(SystemExit, match="must lie in"):
        main(["attribute", "--model", str(with_tok), "--tokens", "1 99", "--out", str(out)])
    assert main(["attribute", "--model", str(tmp_path / "missing"), "--tokens", "1", "--out", str(out)]) == 2


def test_generate_cli(ckpt, capsys):
    with_tok, _ = ckpt
    assert main(["generate", "--model", str(with_tok), "--tokens", "1 2 3", "--max-new-tokens", "3"]) == 0
    ids = [int(x) for x in capsys.readouterr().out.split()]
    assert ids[:3] == [1, 2, 3] and len(ids) == 6
