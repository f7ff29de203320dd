"""Words of a prompt from the model's tokenizer: the spans :meth:`latim_jax.Attribution.aggregate` sums
over, and a readable label per token.

The rule (one for text and for ids): a token starts a new word when it is the prompt's first real
token, when its text begins with whitespace, when the text before it (the previous token's, or the
gap of the original text between the two) ends with whitespace, or when it or the previous token is a
special token (``<|endoftext|>``, ``<s>``: a word of its own), except that whitespace-only tokens in a
row make one word. So byte-level BPE's "Ġcat" opens a word and "s" continues it; a run of whitespace
tokens (byte-level "Ġ", "Ċ Ċ") is a word of its own, shown as ␣ or ↵↵; punctuation stays with the
word it is written against ("cat." is one word). Word-level tokenizers (the shipped task models) make
every token a word.

From text, a token's text is its span of the original string by the tokenizer's offsets (with the gap
before it); from ids, it is the token decoded alone (a byte-level token that is part of one UTF-8
character decodes to "�", which is not whitespace, so it continues the word). A word's label is its
text with the surrounding whitespace stripped (a whitespace-only word keeps it, made visible).
"""

from __future__ import annotations

import numpy as np

from latim_jax.io.spans import Spans, visible
from latim_jax.model.inputs import check_mask
from latim_jax.tasks import vocab


def _tokenizer(model):
    tok = vocab.load_tokenizer(model)
    if tok is None:
        raise ValueError(
            f"the checkpoint {getattr(model, 'source', '')!r} has no tokenizer.json and no task vocabulary: "
            "give the spans as (start, end) pairs instead"
        )
    return tok


def _starts(pieces: list[str], special: list[bool]) -> list[bool]:
    """Whether each token opens a word (the module's rule), from each token's text (with the gap of the
    original text before it) and whether it is a special token."""
    out = []
    for k, p in enumerate(pieces):
        before = pieces[k - 1] if k else ""
        blank_run = k > 0 and not p.strip() and not before.strip()  # whitespace after whitespace: one word
        out.append(
            k == 0
            or special[k]
            or special[k - 1]
            or (not blank_run and (p[:1].isspace() or before[-1:].isspace()))
        )
    return out


def _spans_of(tok, ids, pieces, special, texts_of) -> Spans:
    """Spans from the word starts, labelled by ``texts_of(start, end)`` (the word's raw text; a special
    token by its vocabulary entry)."""
    starts = [k for k, s in enumerate(_starts(pieces, special)) if s]
    bounds = list(zip(starts, starts[1:] + [len(pieces)], strict=True))
    labels = []
    for a, e in bounds:
        raw = tok.id_to_token(ids[a]) or str(ids[a]) if special[a] else texts_of(a, e)
        labels.append(raw.strip() if raw.strip() else visible(raw))
    return Spans(tuple(bounds), tuple(labels))


def _special_ids(tok) -> set[int]:
    """The ids of the tokenizer's special tokens."""
    return {int(i) for i, t in tok.get_added_tokens_decoder().items() if t.special}


def word_spans(model, tokens=None, *, text: str | None = None, mask=None):
    """The words of a prompt as :class:`latim_jax.io.spans.Spans` (bounds, labels, and the ids), for
    :meth:`latim_jax.Attribution.aggregate`.

    Either ``text`` (encoded with the model's tokenizer: words from its offsets into the text; the
    returned ``Spans.tokens`` are the ids to attribute), or ``tokens``: ids (L,) -> one Spans, or (B, L)
    -> a list of one Spans per prompt, with ``mask`` (B, L) the real positions (padding on either side
    is left out: each prompt's spans cover its real positions). The word rule is the module's.
    ValueError when the model has no tokenizer."""
    tok = _tokenizer(model)
    word_level = type(tok.model).__name__ == "WordLevel" or tok.decoder is None
    special_ids = _special_ids(tok)
    if text is not None:
        if tokens is not None:
            raise ValueError("pass tokens or text, not both")
        enc = vocab.encoding(model, text)  # one encoding: the ids and their offsets into the text
        ids, offsets = list(enc.ids), list(enc.offsets)
        special = [i in special_ids for i in ids]
        ends = [0] + [e for _, e in offsets]
        pieces = [text[ends[k] : offsets[k][1]] for k in range(len(ids))]  # the gap before, then the token
        if word_level:
            pieces = [" " + p for p in pieces]
        spans = _spans_of(tok, ids, pieces, special, lambda a, e: text[offsets[a][0] : offsets[e - 1][1]])
        return Spans(spans.bounds, spans.labels, tuple(int(i) for i in ids))
    if tokens is None:
        raise ValueError("pass tokens (ids) or text")
    arr = np.asarray(tokens)
    if arr.dtype == object or not np.issubdtype(arr.dtype, np.integer) or arr.ndim not in (1, 2):
        raise ValueError(f"tokens must be int ids (L,) or (B, L), found {arr.dtype} {arr.shape}")
    single = arr.ndim == 1
    arr = arr[None] if single else arr
    keep = np.asarray(check_mask(mask, *arr.shape))
    out = []
    for row, m in zip(arr, keep, strict=True):
        real = np.flatnonzero(m)
        if real.size == 0:
            raise ValueError("a prompt with no real position has no words")
        lo, ids = int(real[0]), [int(i) for i in row[real[0] : real[-1] + 1]]
        special = [i in special_ids for i in ids]
        if word_level:
            pieces = [" " + (tok.id_to_token(i) or str(i)) for i in ids]
        else:
            pieces = [tok.decode([i], skip_special_tokens=False) for i in ids]
        text_of = lambda a, e, ids=ids: _decoded(tok, ids[a:e], word_level)  # noqa: E731
        spans = _spans_of(tok, ids, pieces, special, text_of)
        bounds = tuple((a + lo, e + lo) for a, e in spans.bounds)
        out.append(Spans(bounds, spans.labels, tuple(ids)))
    return out[0] if single else out


def _decoded(tok, ids: list[int], word_level: bool) -> str:
    """The text of a word's ids."""
    if word_level:
        return " ".join(tok.id_to_token(i) or str(i) for i in ids)
    return tok.decode(ids, skip_special_tokens=False)


def token_labels(model, tokens) -> tuple[tuple[str, ...], ...]:
    """A readable label per token (whitespace made visible), one tuple per prompt of ``tokens`` (L,) or
    (B, L): what :meth:`latim_jax.Attribution.with_labels` takes."""
    arr = np.asarray(tokens)
    arr = arr[None] if arr.ndim == 1 else arr
    return tuple(tuple(vocab.labels(model, row)) for row in arr)
