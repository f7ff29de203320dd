"""Token words for a model: its tokenizer.json, or the words of the task it was trained on.

Shipped task models carry a word-level tokenizer.json written by :func:`write_task_tokenizer` from
:func:`latim_jax.tasks.registry.vocabulary` (one whitespace-free word per id: ``t5``, ``<sep>``, ``k3``,
``v7``, ...), so ``--text "t3 t9 <sep> t3"`` and readable plot labels work on them. Text is split on
whitespace only (tokenizers' WhitespaceSplit pre-tokenizer), so words such as ``<sep>`` stay whole.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

from latim_jax.io.atomic import write_bytes_atomic
from latim_jax.io.spans import visible
from latim_jax.tasks import registry

TOKENIZER_FILE = "tokenizer.json"


class TokenizerError(ValueError):
    """A tokenizer.json that the tokenizers library cannot read (the message names the file)."""


class UnknownWordsWarning(UserWarning):
    """Words outside a word-level vocabulary that the tokenizer encoded as its unknown token (the
    message names them and the token); ``words`` holds them all, ``unk`` the token."""

    def __init__(self, words: list[str], unk: str):
        shown = words[:5] + (["..."] if len(words) > 5 else [])
        super().__init__(
            f"{len(words)} word(s) outside the vocabulary became {unk!r}: {shown} (the map attributes "
            "to that placeholder; separate words by spaces)"
        )
        self.words, self.unk = words, unk


def task_words(task: dict, vocab_size: int | None = None) -> list[str]:
    """:func:`latim_jax.tasks.registry.vocabulary` padded to ``vocab_size`` entries with ``<unused{id}>`` (a
    model's embedding table may have more rows than the task has ids)."""
    words = registry.vocabulary(task)
    if vocab_size is not None and vocab_size < len(words):
        raise ValueError(f"the task has {len(words)} ids but the model's vocabulary only {vocab_size}")
    return words + [f"<unused{i}>" for i in range(len(words), vocab_size or len(words))]


def word_tokenizer(words: list[str]):
    """A tokenizers.Tokenizer mapping each word to its index (WordLevel, split on whitespace)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    if len(set(words)) != len(words) or any(not w or w.split() != [w] for w in words):
        raise ValueError("tokenizer words must be distinct, non-empty and free of whitespace")
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tok


def write_task_tokenizer(directory: str | os.PathLike, task: dict, vocab_size: int | None = None) -> Path:
    """Write ``directory/tokenizer.json`` for ``task`` (atomically); returns its path."""
    path = Path(directory) / TOKENIZER_FILE
    text = word_tokenizer(task_words(task, vocab_size)).to_str(pretty=True)
    write_bytes_atomic(path, (text + "\n").encode())
    return path


def load_tokenizer(model):
    """The model's tokenizers.Tokenizer: its tokenizer.json, else one built from its task's words,
    else None. Raises :class:`TokenizerError` naming the file when tokenizer.json cannot be read."""
    from tokenizers import Tokenizer

    directory = getattr(model, "tokenizer_dir", "") or ""
    path = Path(directory) / TOKENIZER_FILE
    if directory and path.is_file():
        try:
            return Tokenizer.from_file(str(path))
        except Exception as err:  # tokenizers raises a bare Exception on a malformed file
            raise TokenizerError(f"{path}: not a readable tokenizer ({' '.join(str(err).split())})") from None
    task = getattr(model, "task", None)
    if task and task.get("name") in registry.TASK_FIELDS:
        return word_tokenizer(task_words(task, model.config.vocab_size))
    return None


def model_words(model, limit: int | None = None) -> list[str] | None:
    """The words of ids 0 .. (``limit`` or the vocabulary size) - 1, or None without a vocabulary."""
    tok = load_tokenizer(model)
    if tok is None:
        return None
    n = model.config.vocab_size if limit is None else min(limit, model.config.vocab_size)
    return [tok.id_to_token(i) or f"<{i}>" for i in range(n)]


def describe(
    words: list[str], total: int | None = None, show_all: int = 64, head: int = 24, tail: int = 4
) -> str:
    """``id=word`` pairs: all of them up to ``show_all`` words, else the first ``head`` and the last
    ``tail`` with the middle elided (``0=<pad> 1=k1 ... (n more) ... 99=v80``). ``words`` may be the
    first entries only of a ``total``-word vocabulary (then only the head is shown)."""
    total = len(words) if total is None else total
    pairs = [f"{i}={w}" for i, w in enumerate(words)]
    if len(pairs) == total and total <= show_all:
        return " ".join(pairs)
    if len(pairs) == total:
        return f"{' '.join(pairs[:head])} ... ({total - head - tail} more) ... {' '.join(pairs[-tail:])}"
    shown = pairs[:head]
    return f"{' '.join(shown)} ... ({total - len(shown)} more)"


def encode(model, text: str) -> tuple[list[int], list[str]]:
    """Token ids and their words for ``text``. Raises ValueError when the model has no tokenizer (and
    no task vocabulary) or when a word is not in a word-level vocabulary that has no unknown token,
    naming it and showing the vocabulary. Where the vocabulary has one (``<unk>``), unknown words
    become it with an :class:`UnknownWordsWarning` naming them."""
    tok = load_tokenizer(model)
    enc = encoding(model, text)
    return list(enc.ids), [_label(tok, i, t) for i, t in zip(enc.ids, enc.tokens, strict=True)]


def encoding(model, text: str):
    """The tokenizer's ``Encoding`` of ``text`` (ids, tokens, offsets into the text), with
    :func:`encode`'s refusals."""
    tok = load_tokenizer(model)
    if tok is None:
        raise ValueError(
            f"the checkpoint {model.source!r} has no tokenizer.json and no task vocabulary; "
            "pass token ids with --tokens '3 5 7' instead"
        )
    try:
        enc = _encode(tok, text)
    except ValueError as err:
        vocab = describe(model_words(model) or [])
        raise ValueError(f"{err} (this model's vocabulary: {vocab}); or pass ids with --tokens") from None
    return enc


def _label(tok, i: int, token: str | None) -> str:
    """A token as a reader sees it: decoded where the tokenizer has a decoder (byte-level BPE's
    ``Ġcat`` is `` cat``), else its vocabulary entry, else the id; whitespace that would not show (a
    space-only token, a line break) made visible (:func:`latim_jax.io.spans.visible`: ␣, ↵)."""
    if tok.decoder is not None:
        text = tok.decode([int(i)])
        if text:
            return visible(text)
    return visible(token) if token else str(int(i))


def encoder(model):
    """``text -> ids`` with the model's tokenizer (None when it has none); ValueError for a text it
    cannot encode (unknown words of a word-level vocabulary without an unknown token named), an
    :class:`UnknownWordsWarning` for words it encoded as its unknown token."""
    tok = load_tokenizer(model)
    if tok is None:
        return None
    return lambda text: list(_encode(tok, text).ids)


def _encode(tok, text: str):
    """``tok.encode(text)``; for a word-level vocabulary, words outside it are refused by name unless
    the vocabulary holds the model's unknown token, which they then become, with a warning naming
    them (never silently)."""
    word_level = _is_word_level(tok)
    unk = unknown_token(tok) if word_level else None
    if word_level and unk is None:
        unknown = [w for w in _words(tok, text) if tok.token_to_id(w) is None]
        if unknown:
            raise ValueError(f"unknown word(s) {unknown[:5]}; separate words by spaces")
    try:
        enc = tok.encode(text)
    except Exception as err:  # tokenizers raises a bare Exception
        raise ValueError(f"the tokenizer cannot encode this text ({' '.join(str(err).split())})") from None
    if unk is not None:
        unk_id = tok.token_to_id(unk)
        spans = [text[a:b] for i, (a, b) in zip(enc.ids, enc.offsets, strict=True) if i == unk_id]
        unknown = [w for w in spans if w != unk]  # the text's own "<unk>" is not an unknown word
        if unknown:
            warnings.warn(UnknownWordsWarning(unknown, unk), stacklevel=3)
    return enc


def _words(tok, text: str) -> list[str]:
    """The words the tokenizer's pre-tokenizer splits ``text`` into (whitespace without one)."""
    if tok.pre_tokenizer is None:
        return text.split()
    return [w for w, _ in tok.pre_tokenizer.pre_tokenize_str(text)]


def labels(model, ids) -> list[str]:
    """A readable label per id: the model's word for it, else the id itself."""
    tok = load_tokenizer(model)
    if tok is None:
        return [str(int(i)) for i in ids]
    return [_label(tok, i, tok.id_to_token(int(i))) for i in ids]


def unknown_token(tok) -> str | None:
    """A word-level tokenizer's unknown token when its vocabulary holds it (else None: an unknown
    word cannot be encoded)."""
    unk = getattr(tok.model, "unk_token", None)
    return unk if unk and tok.token_to_id(unk) is not None else None


def _is_word_level(tok) -> bool:
    return type(tok.model).__name__ == "WordLevel"
