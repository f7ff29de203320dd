"""word_spans: words from a tokenizer (its offsets into a text, or ids decoded), and token labels."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

import latim_jax
from latim_jax.io.spans import visible
from latim_jax.tasks import vocab
from latim_jax.tasks.words import word_spans

TEXT = "the cats sat.\n\non  the mat"


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    """A byte-level BPE tokenizer trained here (too few merges for whole words: 'cats' is split), with a
    special token <|bos|> that its post-processor does not add."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=270, initial_alphabet=alphabet, special_tokens=["<|bos|>"])
    tok.train_from_iterator(["the cat sat on the mat"] * 20, trainer)
    root = tmp_path_factory.mktemp("bpe")
    tok.save(str(root / "tokenizer.json"))
    return SimpleNamespace(tokenizer_dir=str(root), task=None, source="bpe"), tok


def test_words_from_text_offsets_and_from_ids_agree(bpe):
    model, tok = bpe
    enc = tok.encode(TEXT)
    assert len(enc.ids) > 9  # sub-word pieces: the rule, not the tokenizer, makes the words
    spans = word_spans(model, text=TEXT)
    assert spans.labels == ("the", "cats", "sat.", "↵↵", "on", "␣", "the", "mat"), spans.labels
    assert list(spans.tokens) == enc.ids
    # every word's tokens decode to the word (the bounds are right, not only the labels)
    for (a, e), label in zip(spans.bounds, spans.labels, strict=True):
        text = tok.decode(enc.ids[a:e])
        assert text.strip() == label or visible(text) == label
    from_ids = word_spans(model, np.asarray(enc.ids))
    assert from_ids.bounds == spans.bounds and from_ids.labels == spans.labels


def test_special_tokens_are_words_and_padding_is_left_out(bpe):
    model, tok = bpe
    bos = tok.token_to_id("<|bos|>")
    ids = [bos] + tok.encode("the cats").ids
    padded = np.asarray([[0, 0] + ids, ids + [0, 0]])
    mask = np.asarray([[False, False] + [True] * len(ids), [True] * len(ids) + [False, False]])
    left, right = word_spans(model, padded, mask=mask)
    assert left.labels == right.labels == ("<|bos|>", "the", "cats")
    assert left.start == 2 and left.end == 2 + len(ids) and right.start == 0 and right.end == len(ids)
    assert [e - a for a, e in left.bounds] == [e - a for a, e in right.bounds]


def test_word_level_task_models_make_every_token_a_word():
    model = latim_jax.load("copy-mamba2")
    ids, _ = vocab.encode(model, "t3 t9 <sep> t3")
    spans = word_spans(model, np.asarray(ids))
    assert spans.bounds == ((0, 1), (1, 2), (2, 3), (3, 4)) and spans.labels == ("t3", "t9", "<sep>", "t3")
    assert word_spans(model, text="t3 t9 <sep> t3").bounds == spans.bounds
    assert latim_jax.token_labels(model, np.asarray([ids])) == (("t3", "t9", "<sep>", "t3"),)


def test_words_need_a_tokenizer_and_ids():
    model = SimpleNamespace(tokenizer_dir="", task=None, source="bare", config=None)
    with pytest.raises(ValueError, match="no tokenizer.json.*give the spans as"):
        word_spans(model, np.arange(3))
