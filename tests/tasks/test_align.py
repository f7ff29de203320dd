"""The synthetic translation task: gold links on hand-built sentences, the encoding, extraction and AER
against values computed by hand."""

from __future__ import annotations

import numpy as np
import pytest

from latim_jax import tasks
from latim_jax.tasks import align

# hand-built (the source full stop is "·", the target's "."): time fronted, plural many-to-one,
# adjective swap, object particle (unaligned), negation with do-support (possible links only), a
# phrasal verb (one-to-many), verb-final -> verb-second
SENT_A = "heute der alt hund -en mein buch ak nicht abholt ·".split()
#          0     1   2   3    4   5    6    7  8     9      10
TGT_A = "the dogs old do not pick up my book today .".split()
SURE_A = {(0, 1), (1, 3), (1, 4), (2, 2), (4, 8), (5, 9), (6, 9), (7, 5), (8, 6), (9, 0), (10, 10)}
POSSIBLE_ONLY_A = {(3, 8), (3, 9)}

# a discourse particle (unaligned), a postposition with a three-word translation (local inversion of the
# PP), a compound noun (one-to-many) in the plural (head word plural), an adverb moved after the verb
SENT_B = "sein kind ja der rot apfelbaum -en vor schnell lacht ·".split()
#          0    1    2  3   4   5         6   7   8       9     10
TGT_B = "his child laugh quickly in front of the apple trees red .".split()
SURE_B = {
    (0, 0), (1, 1), (2, 9), (3, 8), (4, 7), (5, 7), (6, 7), (7, 3), (8, 5), (9, 5), (9, 6), (10, 4),
    (11, 10),
}  # fmt: skip

# object and place together, "next to" (one-to-many function word)
SENT_C = "mein lehrer dein brief ak der tisch neben sucht ·".split()
TGT_C = "my teacher seek your letter next to the table .".split()
SURE_C = {(0, 0), (1, 1), (2, 8), (3, 2), (4, 3), (5, 7), (6, 7), (7, 5), (8, 6), (9, 9)}


@pytest.mark.parametrize(
    "src, tgt, sure, possible_only",
    [
        (SENT_A, TGT_A, SURE_A, POSSIBLE_ONLY_A),
        (SENT_B, TGT_B, SURE_B, set()),
        (SENT_C, TGT_C, SURE_C, set()),
    ],
    ids=["neg-plural-phrasal", "particle-pp-compound", "object-and-place"],
)
def test_translation_and_gold_links_of_hand_built_sentences(src, tgt, sure, possible_only):
    tr = align.translate(src)
    assert list(tr.target) == tgt
    assert set(tr.sure) == sure
    assert set(tr.possible) == sure | possible_only
    linked = {j for _, j in tr.possible}
    unaligned = {j for j, w in enumerate(src) if w in (align.ACC, align.PARTICLE)}
    assert unaligned and not unaligned & linked  # "ak" / "ja" have no link
    assert linked | unaligned == set(range(len(src)))  # every other source word is linked


def test_ungrammatical_sources_are_refused_with_the_position():
    with pytest.raises(ValueError, match="position 2: expected VI, found sieht"):
        align.translate("der hund sieht ·".split())  # transitive verb without an object
    with pytest.raises(ValueError, match="source word 1 'dog' is not in the lexicon"):
        align.translate("der dog schlaeft ·".split())
    with pytest.raises(ValueError, match="after the final"):
        align.translate("der hund schlaeft · ·".split())


def test_generated_sentences_parse_and_are_not_monotone():
    rng = np.random.default_rng(0)
    crossing = 0
    for _ in range(300):
        src = align.sample_source(rng)
        tr = align.translate(src)  # the generator only produces sentences of the grammar
        assert {t for t, _ in tr.possible} == set(range(len(tr.target)))  # every target word linked
        pairs = sorted(tr.sure)
        crossing += any(j2 < j1 for (_, j1), (_, j2) in zip(pairs, pairs[1:], strict=False))
    assert crossing > 250  # reordering makes almost every alignment non-monotone


def test_encoding_layout_rows_and_links():
    task = align.align_task(max_src=12, max_tgt=14)
    batch, links = align.encode(task, [(SENT_A, align.translate(SENT_A))])
    vocab = align.vocabulary(task)
    m, n = len(SENT_A), len(TGT_A)
    words = [vocab[i] for i in batch.tokens[0]]
    assert words[:m] == SENT_A and words[m] == align.SEP and words[m + 1 : m + 1 + n] == TGT_A
    assert words[m + 1 + n] == align.EOS and set(words[m + 2 + n :]) == {align.PAD}
    assert batch.tokens.shape == (1, tasks.sequence_length(task)) == (1, 12 + 14 + 2)
    np.testing.assert_array_equal(np.flatnonzero(batch.loss_mask[0]), np.arange(m, m + n + 1))
    # row m + t predicts target word t; gold = its first sure source, -1 for "do" and the EOS row
    want = [1, 3, 2, -1, 8, 9, 9, 5, 6, 0, 10, -1]
    np.testing.assert_array_equal(batch.gold[0, m : m + n + 1], want)
    assert {tuple(x) for x in np.argwhere(links.sure[0])} == SURE_A
    assert {tuple(x) for x in np.argwhere(links.possible[0] & ~links.sure[0])} == POSSIBLE_ONLY_A
    assert (links.n_src[0], links.n_tgt[0]) == (m, n)


def test_aer_on_hand_made_alignments():
    S = np.zeros((1, 3, 3), bool)
    S[0, 0, 0] = S[0, 1, 2] = True
    P = S.copy()
    P[0, 2, 1] = True  # target word 2 has only a possible link
    perfect = P.copy()  # |A&S| = 2, |A&P| = 3, |A| = 3, |S| = 2 -> 1 - 5/5
    assert align.aer(perfect, S, P) == 0.0
    wrong = np.zeros_like(S)
    wrong[0, 0, 1] = wrong[0, 1, 0] = wrong[0, 2, 2] = True  # nothing right -> 1 - 0/5
    assert align.aer(wrong, S, P) == 1.0
    half = np.zeros_like(S)
    half[0, 0, 0] = half[0, 1, 0] = half[0, 2, 1] = True  # |A&S| = 1, |A&P| = 2 -> 1 - 3/5
    assert align.aer(half, S, P) == pytest.approx(0.4)
    with pytest.raises(ValueError, match="include the sure"):
        align.aer(half, S, np.zeros_like(S))


def test_extraction_reads_the_predicting_row_and_the_oracle_floor():
    task = align.align_task(max_src=12, max_tgt=14)
    batch, links = align.encode(task, [(SENT_A, align.translate(SENT_A))])
    m, L = len(SENT_A), batch.tokens.shape[1]
    maps = np.zeros((1, L, L))
    for t, j in [(0, 1), (1, 3), (2, 2), (3, 8), (4, 8), (5, 9), (6, 9), (7, 5), (8, 6), (9, 0), (10, 10)]:
        maps[0, m + t, j] = 1.0  # the row predicting word t points at its source
        maps[0, m + t, m + 1] = 5.0  # a larger score on a target-side column must be ignored
    pred = align.extract(align.source_scores(maps, links, "predicting"), links)
    # 10 sure links hit (|S| = 11: "dogs" has two), "do" hits a possible link: 1 - (10 + 11) / (11 + 11)
    assert align.aer(pred, links.sure, links.possible) == pytest.approx(1 - 21 / 22)
    assert align.aer(align.oracle(links), links.sure, links.possible) == pytest.approx(1 - 21 / 22)
    # the same map read at each word's own row is shifted by one word
    own = align.extract(align.source_scores(maps, links, "own"), links)
    assert own[0, 0, 3] and own[0, 10].sum() == 1  # word 0 read at row m + 1: word 1's source
    with pytest.raises(ValueError, match="row must be one of"):
        align.source_scores(maps, links, "next")


def test_batches_are_deterministic_and_within_limits():
    task = align.align_task()
    a, la = align.sample(task, 64, np.random.default_rng(3))
    b, lb = align.sample(task, 64, np.random.default_rng(3))
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(la.possible, lb.possible)
    assert la.n_src.min() >= task["min_src"] and la.n_src.max() <= task["max_src"]
    assert (
        la.n_tgt.max() <= task["max_tgt"]
        and tasks.make_batch(task, 2, np.random.default_rng(0)).tokens.shape[1] == 32
    )
    assert len(align.vocabulary(task)) == task["vocab_size"] == align.VOCAB_SIZE
    with pytest.raises(ValueError, match="vocab_size"):
        tasks.check_task({**task, "vocab_size": 10})


def test_random_baseline_draws_only_the_sentences_own_source_words():
    """The random reference links each target word to a uniformly random word of its own source
    (never a padding slot), and its AER is the expectation computed by hand from the gold links."""
    task = align.align_task()
    _, links = align.sample(task, 512, np.random.default_rng(0))
    rng = np.random.default_rng(1)
    real_words = np.arange(links.sure.shape[1])[None] < links.n_tgt[:, None]
    draws = []
    for _ in range(10):
        pred = align.extract(align.random_scores(links, rng), links)
        assert not (pred & ~align.inside(links)).any()
        np.testing.assert_array_equal(pred.sum(-1), real_words)
        draws.append(align.aer(pred, links.sure, links.possible))
    # E|A & S| = sum over target words of |S_t| / n_src (one uniform link each), likewise for P
    n_src = links.n_src[:, None].astype(float)
    hits = (links.sure.sum(-1) / n_src + links.possible.sum(-1) / n_src)[real_words].sum()
    expected = 1 - hits / (real_words.sum() + links.sure.sum())
    assert np.mean(draws) == pytest.approx(expected, abs=0.005)
