"""A synthetic translation task with exact gold word alignments, and the paper's AER.

The paper's second experiment extracts word alignments from the attribution maps of decoder-only MT
models trained on ``src <SEP> tgt`` and scores them with the alignment error rate. IWSLT17 cannot be
downloaded here, so this module builds a small language pair whose alignments are known by construction.

Source language (one token per word): verb-final, adjectives before nouns, postpositions, a plural
particle after the noun, an object particle, a discourse particle:

    S   -> [TIME] NP_subj [ja] [NP_obj ak] [NP_loc POSTP] [ADV] [nicht] V_tr|V_intr ·
    NP  -> DET [ADJ] N [-en]                  (V_tr iff an object is present)

Target language: verb-second (subject, verb group, object, adverb, place, time), nouns before
adjectives, prepositions, negation with do-support:

    S   -> NP_subj [do not] V NP_obj ADV PREP NP_loc TIME .    (each present iff its source is)
    NP  -> DET N(+plural) [ADJ]

Reordering rules: adjective-noun swap inside every NP; the verb moves from the end to second place;
postposition -> preposition (a local inversion of the PP); adverb and time move to the end.
Dictionary: ``LEXICON`` maps every content source word to one or more target words (one-to-many:
compound nouns "apfelbaum" -> "apple tree", phrasal verbs "abholt" -> "pick up", "neben" -> "next to",
"vor" -> "in front of"); the noun plus the plural particle map to one plural target word (many-to-one:
"hund -en" -> "dogs"; a compound takes the plural on its head, "apple trees"). "ak" and "ja" are source
words with no translation (unaligned).

Gold alignment (:func:`translate`): every target word is linked to the source word(s) it translates
(sure links, S): DET, ADJ, N, V, ADV, TIME, POSTP, nicht -> not, · -> . ; a plural noun to its noun and
to "-en" (two sure links); each word of a multi-word translation to its one source word. do-support's
"do" has no sure link: it is possibly linked (P) to both "nicht" and the verb, the case where the rules
leave the choice ambiguous. P includes S.

Sequences: ``[src words] SEP [tgt words] EOS PAD ...`` (ids: PAD 0, SEP 1, EOS 2, then the source then
the target vocabulary). Training rows (the loss) are the target side: rows n_src .. n_src + n_tgt, i.e.
SEP and every target word, predicting the next target word or EOS.

Alignment extraction (the paper's): for target word t, A links t to the source word j < n_src whose
attribution is largest (ties: the earliest). The attribution row read is the row that PREDICTS word t,
position n_src + t (SEP for t = 0), as in the copy evaluation: in a decoder-only model that is where the
model must fetch t's source to produce t; the word's own position (n_src + 1 + t) already has t as input
and computes the next word (``row="own"`` offers it for comparison).

AER (Och and Ney 2003), over a whole test set: AER = 1 - (|A & S| + |A & P|) / (|A| + |S|).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from latim_jax.tasks.batch import Batch

PAD, SEP, EOS = "<pad>", "<sep>", "<eos>"

# source word -> target words, per word class (dict order fixes the vocabulary ids)
DET = {"der": ("the",), "mein": ("my",), "dein": ("your",), "sein": ("his",)}
NOUN = {
    "hund": ("dog",), "katze": ("cat",), "mann": ("man",), "frau": ("woman",), "kind": ("child",),
    "vogel": ("bird",), "lehrer": ("teacher",), "koch": ("cook",), "bauer": ("farmer",),
    "arzt": ("doctor",), "haus": ("house",), "baum": ("tree",), "buch": ("book",), "tisch": ("table",),
    "brief": ("letter",), "apfel": ("apple",), "apfelbaum": ("apple", "tree"),
    "hausdach": ("house", "roof"), "buchladen": ("book", "shop"),
}  # fmt: skip
PLURAL = {
    "dog": "dogs", "cat": "cats", "man": "men", "woman": "women", "child": "children", "bird": "birds",
    "teacher": "teachers", "cook": "cooks", "farmer": "farmers", "doctor": "doctors", "house": "houses",
    "tree": "trees", "book": "books", "table": "tables", "letter": "letters", "apple": "apples",
    "roof": "roofs", "shop": "shops",
}  # fmt: skip
ADJ = {
    "alt": ("old",), "jung": ("young",), "rot": ("red",), "blau": ("blue",), "gut": ("good",),
    "muede": ("tired",), "kalt": ("cold",), "neu": ("new",),
}  # fmt: skip
VERB_TR = {
    "sieht": ("see",), "hoert": ("hear",), "liebt": ("love",), "findet": ("find",), "ruft": ("call",),
    "traegt": ("carry",), "malt": ("paint",), "sucht": ("seek",), "abholt": ("pick", "up"),
    "aufweckt": ("wake", "up"),
}  # fmt: skip
VERB_INTR = {
    "schlaeft": ("sleep",), "lacht": ("laugh",), "singt": ("sing",), "wartet": ("wait",),
    "schwimmt": ("swim",), "aufgibt": ("give", "up"),
}  # fmt: skip
ADV = {"schnell": ("quickly",), "leise": ("quietly",), "gern": ("gladly",), "oft": ("often",)}
TIME = {"heute": ("today",), "morgen": ("tomorrow",), "gestern": ("yesterday",), "abends": ("tonight",)}
POSTP = {
    "unter": ("under",), "auf": ("on",), "hinter": ("behind",), "neben": ("next", "to"),
    "vor": ("in", "front", "of"),
}  # fmt: skip
NEG, PL, ACC, PARTICLE, STOP = "nicht", "-en", "ak", "ja", "·"  # the source full stop: a middle dot
FUNCTION = {NEG: ("not",), PL: (), ACC: (), PARTICLE: (), STOP: (".",)}  # the target full stop: "."
DO = "do"

LEXICON = {**DET, **NOUN, **ADJ, **VERB_TR, **VERB_INTR, **ADV, **TIME, **POSTP, **FUNCTION}
CLASS = {
    w: c
    for c, words in (
        ("DET", DET), ("N", NOUN), ("ADJ", ADJ), ("VT", VERB_TR), ("VI", VERB_INTR), ("ADV", ADV),
        ("TIME", TIME), ("POSTP", POSTP), ("NEG", {NEG: 0}), ("PL", {PL: 0}), ("ACC", {ACC: 0}),
        ("PART", {PARTICLE: 0}), ("STOP", {STOP: 0}),
    )
    for w in words
}  # fmt: skip


def _target_words() -> list[str]:
    out = []
    for words in list(LEXICON.values()) + [tuple(PLURAL.values()), (DO,)]:
        out += [w for w in words if w not in out]
    return out


SOURCE_WORDS = tuple(LEXICON)
TARGET_WORDS = tuple(_target_words())
SPECIALS = (PAD, SEP, EOS)
PAD_ID, SEP_ID, EOS_ID = 0, 1, 2
VOCAB_SIZE = len(SPECIALS) + len(SOURCE_WORDS) + len(TARGET_WORDS)
_SRC_ID = {w: len(SPECIALS) + k for k, w in enumerate(SOURCE_WORDS)}
_TGT_ID = {w: len(SPECIALS) + len(SOURCE_WORDS) + k for k, w in enumerate(TARGET_WORDS)}

# probabilities of the optional parts of a source sentence (the generator's grammar)
OPTIONAL = {"time": 0.3, "particle": 0.15, "object": 0.6, "place": 0.4, "adv": 0.3, "neg": 0.3}
NP_OPTIONAL = {"adj": 0.4, "plural": 0.3}


def align_task(*, min_src: int = 4, max_src: int = 14, max_tgt: int = 16) -> dict:
    """The translation task's metadata dict: source sentences of ``min_src`` .. ``max_src`` words whose
    translations have at most ``max_tgt`` words (sentences outside are redrawn)."""
    task = {"name": "align", "vocab_size": VOCAB_SIZE, "min_src": min_src, "max_src": max_src}
    return check_task({**task, "max_tgt": max_tgt})


def check_task(task: dict) -> dict:
    """Validate an align task dict; errors name the field."""
    if task.get("vocab_size") != VOCAB_SIZE:
        raise ValueError(
            f"align task: vocab_size must be {VOCAB_SIZE} (the lexicon's), found {task.get('vocab_size')}"
        )
    if not 4 <= task["min_src"] <= task["max_src"]:
        raise ValueError(
            f"align task: need 4 <= min_src <= max_src, found {task['min_src']}, {task['max_src']}"
        )
    if task["max_tgt"] < 5:
        raise ValueError(f"align task: max_tgt must be at least 5, found {task['max_tgt']}")
    return task


def sequence_length(task: dict) -> int:
    """Padded length: max_src + SEP + max_tgt + EOS."""
    return task["max_src"] + task["max_tgt"] + 2


def vocabulary(task: dict | None = None) -> list[str]:
    """Token names, index = id: the specials, the source words, the target words (all distinct and free
    of whitespace: the source full stop is a middle dot, the target's a period)."""
    return list(SPECIALS + SOURCE_WORDS + TARGET_WORDS)


@dataclasses.dataclass(frozen=True)
class Translation:
    """A target sentence and its gold alignment: ``sure`` / ``possible`` are sets of
    (target index, source index) pairs, ``possible`` includes ``sure``."""

    target: tuple[str, ...]
    sure: frozenset
    possible: frozenset


def translate(source: Sequence[str]) -> Translation:
    """Translate a source sentence of the grammar above, with its gold links (errors name the word and
    position that break the grammar)."""
    parts = _parse(list(source))
    out, sure, possible = [], set(), set()

    def emit(word, sure_src=(), possible_src=()):
        t = len(out)
        out.append(word)
        sure.update((t, j) for j in sure_src)
        possible.update((t, j) for j in (*sure_src, *possible_src))

    def noun_phrase(np_):
        det, adj, noun, plural = np_
        emit(DET[source[det]][0], [det])
        words = NOUN[source[noun]]
        for k, w in enumerate(words):
            head = k == len(words) - 1
            emit(
                PLURAL[w] if head and plural is not None else w,
                [noun] + ([plural] if head and plural is not None else []),
            )
        if adj is not None:
            emit(ADJ[source[adj]][0], [adj])

    def words_of(j):
        for w in LEXICON[source[j]]:
            emit(w, [j])

    noun_phrase(parts["subj"])
    if parts["neg"] is not None:
        emit(DO, possible_src=[parts["neg"], parts["verb"]])
        words_of(parts["neg"])
    words_of(parts["verb"])
    if parts["obj"] is not None:
        noun_phrase(parts["obj"])
    if parts["adv"] is not None:
        words_of(parts["adv"])
    if parts["place"] is not None:
        np_, postp = parts["place"]
        words_of(postp)
        noun_phrase(np_)
    if parts["time"] is not None:
        words_of(parts["time"])
    words_of(parts["stop"])
    return Translation(tuple(out), frozenset(sure), frozenset(possible))


def _parse(src: list[str]) -> dict:
    """Constituents of a source sentence as source indices (see the grammar in the module docstring)."""
    for j, w in enumerate(src):
        if w not in CLASS:
            raise ValueError(f"source word {j} {w!r} is not in the lexicon")
    pos, parts = 0, {k: None for k in ("time", "obj", "place", "adv", "neg")}

    def cls(k):
        return CLASS[src[k]] if k < len(src) else "END"

    def expect(c):
        nonlocal pos
        if cls(pos) != c:
            raise ValueError(
                f"source position {pos}: expected {c}, found {src[pos] if pos < len(src) else 'end'}"
            )
        pos += 1
        return pos - 1

    def optional(c):
        nonlocal pos
        if cls(pos) == c:
            pos += 1
            return pos - 1
        return None

    def noun_phrase():
        det = expect("DET")
        adj = optional("ADJ")
        noun = expect("N")
        return det, adj, noun, optional("PL")

    parts["time"] = optional("TIME")
    parts["subj"] = noun_phrase()
    optional("PART")
    while cls(pos) == "DET":  # an object (NP ak) and/or a place (NP POSTP), in that order
        np_ = noun_phrase()
        if cls(pos) == "ACC" and parts["obj"] is None and parts["place"] is None:
            expect("ACC")
            parts["obj"] = np_
        else:
            parts["place"] = (np_, expect("POSTP"))
            break
    parts["adv"] = optional("ADV")
    parts["neg"] = optional("NEG")
    parts["verb"] = expect("VT" if parts["obj"] is not None else "VI")
    parts["stop"] = expect("STOP")
    if pos != len(src):
        raise ValueError(f"source position {pos}: words after the final {STOP!r}")
    return parts


def sample_source(rng: np.random.Generator) -> list[str]:
    """One source sentence drawn from the grammar (each optional part with its ``OPTIONAL`` probability,
    each word uniformly from its class)."""

    def pick(words):
        return list(words)[int(rng.integers(len(words)))]

    def noun_phrase():
        np_ = [pick(DET)]
        if rng.random() < NP_OPTIONAL["adj"]:
            np_.append(pick(ADJ))
        np_.append(pick(NOUN))
        if rng.random() < NP_OPTIONAL["plural"]:
            np_.append(PL)
        return np_

    use = {k: rng.random() < p for k, p in OPTIONAL.items()}
    src = [pick(TIME)] if use["time"] else []
    src += noun_phrase()
    src += [PARTICLE] if use["particle"] else []
    src += noun_phrase() + [ACC] if use["object"] else []
    src += noun_phrase() + [pick(POSTP)] if use["place"] else []
    src += [pick(ADV)] if use["adv"] else []
    src += [NEG] if use["neg"] else []
    src += [pick(VERB_TR if use["object"] else VERB_INTR), STOP]
    return src


@dataclasses.dataclass(frozen=True)
class Links:
    """Gold links of a batch, by target word t and source word j: ``sure`` and ``possible`` (b, T, S)
    bool with T = max_tgt, S = max_src (possible includes sure); ``n_src``, ``n_tgt`` (b,) word counts."""

    sure: np.ndarray
    possible: np.ndarray
    n_src: np.ndarray
    n_tgt: np.ndarray


def sample(task: dict, batch_size: int, rng: np.random.Generator) -> tuple[Batch, Links]:
    """A batch of translation sequences and their gold links (sentences outside the task's length limits
    are redrawn)."""
    check_task(task)
    pairs = []
    while len(pairs) < batch_size:
        src = sample_source(rng)
        tr = translate(src)
        if task["min_src"] <= len(src) <= task["max_src"] and len(tr.target) <= task["max_tgt"]:
            pairs.append((src, tr))
    return encode(task, pairs)


def encode(task: dict, pairs) -> tuple[Batch, Links]:
    """Token ids, loss rows and gold links of (source words, :class:`Translation`) pairs."""
    b, L = len(pairs), sequence_length(task)
    T, S = task["max_tgt"], task["max_src"]
    tokens = np.full((b, L), PAD_ID, np.int32)
    loss_mask = np.zeros((b, L), bool)
    gold = np.full((b, L), -1, np.int32)
    sure, possible = np.zeros((b, T, S), bool), np.zeros((b, T, S), bool)
    n_src, n_tgt = np.zeros(b, np.int32), np.zeros(b, np.int32)
    for k, (src, tr) in enumerate(pairs):
        m, n = len(src), len(tr.target)
        if m > S or n > T:
            raise ValueError(f"sentence {k}: {m} source / {n} target words exceed the task's {S} / {T}")
        seq = [_SRC_ID[w] for w in src] + [SEP_ID] + [_TGT_ID[w] for w in tr.target] + [EOS_ID]
        tokens[k, : len(seq)] = seq
        loss_mask[k, m : m + n + 1] = True  # SEP and the target words predict the next word / EOS
        for t, j in sorted(tr.sure, reverse=True):  # ends on each word's first sure source
            gold[k, m + t] = j
        for t, j in tr.sure:
            sure[k, t, j] = True
        for t, j in tr.possible:
            possible[k, t, j] = True
        n_src[k], n_tgt[k] = m, n
    targets = np.concatenate([tokens[:, 1:], tokens[:, -1:]], axis=1)
    lengths = n_src + n_tgt + 2
    batch = Batch(tokens=tokens, targets=targets, loss_mask=loss_mask, gold=gold, lengths=lengths)
    return batch, Links(sure=sure, possible=possible, n_src=n_src, n_tgt=n_tgt)


def make_batch(task: dict, batch_size: int, rng: np.random.Generator) -> Batch:
    """The training batch of :func:`sample` (``Batch.gold``: each target row's first sure source, -1
    for "do" and EOS, which are trained but have no sure link)."""
    return sample(task, batch_size, rng)[0]


ROWS = ("predicting", "own")


def source_scores(maps, links: Links, row: str = "predicting") -> np.ndarray:
    """(b, T, S) attribution of target word t to source word j from (b, l, l) maps, reading row
    n_src + t ("predicting": the position whose next-token prediction is word t) or n_src + 1 + t
    ("own": the word's own position). Entries outside the sentence are -inf."""
    if row not in ROWS:
        raise ValueError(f"row must be one of {ROWS}, found {row!r}")
    maps = np.asarray(maps, np.float64)
    b, T, S = links.sure.shape
    t = np.arange(T)[None, :]
    r = links.n_src[:, None] + t + (1 if row == "own" else 0)  # (b, T)
    r = np.minimum(r, maps.shape[1] - 1)
    out = maps[np.arange(b)[:, None], r][:, :, :S]  # (b, T, S)
    return np.where(inside(links), out, -np.inf)


def inside(links: Links) -> np.ndarray:
    """(b, T, S) bool: the (target word, source word) slots inside each sentence pair."""
    _, T, S = links.sure.shape
    return (np.arange(T)[None, :, None] < links.n_tgt[:, None, None]) & (
        np.arange(S)[None, None] < links.n_src[:, None, None]
    )


def random_scores(links: Links, rng: np.random.Generator) -> np.ndarray:
    """(b, T, S) uniform random scores over each sentence's own source words (-inf on the padding
    slots), so that :func:`extract` links each target word to a uniformly random word of its source."""
    return np.where(inside(links), rng.random(links.sure.shape), -np.inf)


def extract(scores: np.ndarray, links: Links) -> np.ndarray:
    """A (b, T, S) bool: one link per target word, to its highest-scored source word (ties: the
    earliest); none for positions beyond the sentence."""
    scores = np.asarray(scores)
    best = np.argmax(scores, axis=-1)  # first maximum
    onehot = np.arange(scores.shape[-1])[None, None] == best[..., None]
    return onehot & (np.arange(scores.shape[1])[None, :] < links.n_tgt[:, None])[..., None]


def aer(pred, sure, possible) -> float:
    """Alignment error rate of predicted links A against sure S and possible P (arrays of the same
    shape, bool; summed over the whole set): 1 - (|A & S| + |A & P|) / (|A| + |S|). P must include S."""
    A, S, P = (np.asarray(x, bool) for x in (pred, sure, possible))
    if (S & ~P).any():
        raise ValueError("possible links must include the sure links")
    denom = A.sum() + S.sum()
    if denom == 0:
        raise ValueError("AER is undefined without predicted or sure links")
    return float(1.0 - ((A & S).sum() + (A & P).sum()) / denom)


def oracle(links: Links) -> np.ndarray:
    """The best one-link-per-target-word alignment: a sure source where the word has one (the first),
    else a possible one. Its AER is the floor any argmax extraction can reach (above 0 because a plural
    noun has two sure links)."""
    score = links.sure * 2.0 + links.possible - np.arange(links.sure.shape[-1]) * 1e-3
    return extract(np.where(links.possible, score, -np.inf), links) & links.possible
