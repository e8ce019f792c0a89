"""Property tests and golden cases for the pure core (neardup.core)."""

from __future__ import annotations

import hashlib
import re
import sys
import unicodedata

import numpy as np
import pytest
import scipy.sparse as sp
import xxhash
from datasketch.lsh import _optimal_param
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from scipy.sparse.csgraph import connected_components

from neardup.core.arrays import sorted_unique
from neardup.core.candidates import batch_candidates, bucket_weights
from neardup.core.decide import decide_batch
from neardup.core.cluster import (
    CANONICAL,
    COMPONENTS,
    CONTAINMENT,
    CONTAINMENT_EITHER,
    CONTAINMENT_OF_EARLIER,
    JACCARD,
    MEASURES,
    Sets,
    cluster_batch,
    pair_similarities,
)
from neardup.core.lsh import LshParams, band_hashes, false_negative_area, false_positive_area, optimal_params, recall_params
from neardup.core.minhash import (
    EMPTY,
    MERSENNE_61,
    MinHasher,
    jaccard_estimate,
    mulmod61_add,
)
from neardup.core.normalize import TextNorm, normalize
from neardup.core.overlap import bottom_k
from neardup.core.settings import CANDIDATE_MARGIN, SCORE_RECALL, EngineSettings
from neardup.core.shingle import ShingleBatch, Shingling, shingle_batch
from neardup.core.xxh3 import xxh3_spans
from neardup.core.unionfind import find, peek_root, union

P = MERSENNE_61
U64 = st.integers(0, 2**64 - 1)
U61 = st.integers(0, 2**61 - 1)
NORMS = st.builds(TextNorm, st.booleans(), st.booleans(), st.booleans(), st.booleans())
SHINGLINGS = st.builds(Shingling, st.sampled_from(["word", "char"]), st.integers(1, 6))
# Few distinct tokens, so that n-grams repeat within and across documents.
SMALL_TEXTS = st.text(alphabet="ab c\n.", max_size=40)
ANY_TEXTS = st.one_of(SMALL_TEXTS, st.text(max_size=30))
FAST = settings(max_examples=150, deadline=None)


# --- normalize --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("ﬁ", "fi"),  # ligature, NFKC
        ("Straße", "strasse"),  # casefold
        ("a \t\n b", "a b"),
        ("  ＨＥＬＬＯ\u00a0World\u2003 ", "hello world"),  # full-width, NBSP, em space
        ("Ⅻ ①", "xii 1"),
        ("ß\u0301", "s\u015b"),  # casefold gives s s U+0301; NFKC composes the last two to ś
    ],
)
def test_normalize_golden(raw: str, expected: str) -> None:
    assert normalize(raw) == expected


def test_normalize_strip_punctuation_golden() -> None:
    norm = TextNorm(strip_punctuation=True)
    assert normalize("Hello, world! «¿Qué?» — (it’s) “fine”…", norm) == "hello world qué its fine"
    assert normalize("!!! ... ---", norm) == ""
    assert normalize("e.\u0301", norm) == "\u00e9"  # the removal makes e + U+0301 adjacent
    # Only P* goes: symbols and digits stay.
    assert normalize("$5 + 3 = €8", norm) == "$5 + 3 = €8"


def test_normalize_flags_off_is_identity() -> None:
    off = TextNorm(nfkc=False, casefold=False, collapse_whitespace=False)
    text = "ﬁ Straße \t x, y"
    assert normalize(text, off) == text


@FAST
@given(ANY_TEXTS, NORMS)
@example("ß\u0301", TextNorm())
@example("e.\u0301", TextNorm(strip_punctuation=True))
def test_normalize_idempotent(text: str, norm: TextNorm) -> None:
    once = normalize(text, norm)
    assert normalize(once, norm) == once


@FAST
@given(ANY_TEXTS, NORMS)
def test_normalize_postconditions(text: str, norm: TextNorm) -> None:
    out = normalize(text, norm)
    if norm.nfkc:
        assert unicodedata.is_normalized("NFKC", out)
    if norm.casefold:
        assert out.casefold() == out
    if norm.collapse_whitespace:
        assert out == out.strip()
        assert not re.search(r"\s\s", out)
        assert all(c == " " or not c.isspace() for c in out)
    if norm.strip_punctuation:
        assert not any(unicodedata.category(c).startswith("P") for c in out)


ALL_WHITESPACE = "".join(c for c in map(chr, range(sys.maxunicode + 1)) if re.fullmatch(r"\s", c))


@FAST
@given(st.lists(st.sampled_from([*ALL_WHITESPACE, "a", "B", "é", "."]), max_size=40).map("".join))
def test_whitespace_collapse_is_regex_semantics(text: str) -> None:
    """Collapsing splits at exactly the characters of re's \\s, all 29 of them."""
    only = TextNorm(nfkc=False, casefold=False)
    assert len(ALL_WHITESPACE) == 29
    assert normalize(text, only) == re.sub(r"\s+", " ", text).strip()


PUNCTUATION = st.text(alphabet=st.characters(categories=["P"]), min_size=1, max_size=20)


@FAST
@given(PUNCTUATION, st.text(max_size=20))
def test_strip_punctuation_removes_only_punctuation(punct: str, text: str) -> None:
    plain = TextNorm(nfkc=False, casefold=False, collapse_whitespace=False)
    strip = TextNorm(nfkc=False, casefold=False, collapse_whitespace=False, strip_punctuation=True)
    assert normalize(punct, strip) == ""
    kept = "".join(c for c in normalize(text, plain) if not unicodedata.category(c).startswith("P"))
    assert normalize(text + punct, strip) == kept


# --- shingling --------------------------------------------------------------------------


def _units(text: str, shingling: Shingling) -> list[str]:
    return re.findall(r"\w+", text) if shingling.kind == "word" else list(text)


def _ngrams(text: str, shingling: Shingling) -> list[tuple[str, ...]]:
    """Reference n-grams: all n-windows, or the whole token list when shorter than n."""
    units, n = _units(text, shingling), shingling.n
    if not units:
        return []
    if len(units) < n:
        return [tuple(units)]
    return [tuple(units[i : i + n]) for i in range(len(units) - n + 1)]


def _doc_hashes(batch: ShingleBatch, d: int) -> list[int]:
    return batch.hashes[batch.offsets[d] : batch.offsets[d + 1]].tolist()


@FAST
@given(st.lists(ANY_TEXTS, max_size=8), SHINGLINGS)
def test_shingle_batch_equals_concatenated_single_documents(
    texts: list[str], sh: Shingling
) -> None:
    batch = shingle_batch(texts, sh)
    assert batch.hashes.dtype == np.uint64 and batch.offsets.dtype == np.int64
    assert len(batch) == len(texts) and batch.offsets[0] == 0
    singles = [shingle_batch([t], sh) for t in texts]
    expected = [h for s in singles for h in s.hashes.tolist()]
    assert batch.hashes.tolist() == expected
    assert batch.counts.tolist() == [len(s.hashes) for s in singles]


@FAST
@given(st.lists(st.one_of(ANY_TEXTS, st.text(st.characters(codec="utf-8"), max_size=30),
                          st.text(st.characters(categories=["Cs", "Mn", "Lo", "Nd", "Zs"]), max_size=12)),
                max_size=8))
@example(["naïve café", "", "日本語のテキスト", "emoji 😀x😀 ok", "e\u0301\ud800x", "a_b-c", "ü" * 70 + " " + "x" * 300])
def test_word_tokens_are_regex_tokens_hashed_with_xxh3(texts: list[str]) -> None:
    """Word 1-grams are the ``\\w+`` tokens of each text, each hashed with xxh3-64 of its
    UTF-8 bytes (lone surrogates passed through)."""
    batch = shingle_batch(texts, Shingling("word", 1))
    for d, text in enumerate(texts):
        expected = [xxhash.xxh3_64_intdigest(t.encode("utf-8", "surrogatepass"))
                    for t in re.findall(r"\w+", text)]
        assert _doc_hashes(batch, d) == expected


def test_the_word_table_filled_block_by_block_is_re_word_class_at_every_code_point() -> None:
    """The table of ``\\w`` code points is filled a block at a time, as texts use them
    (a start-up saving): filled for every code point it is ``re``'s ``\\w`` exactly."""
    from neardup.core.shingle import _word_characters

    expected = np.zeros(sys.maxunicode + 1, dtype=bool)
    for match in re.finditer(r"\w+", "".join(map(chr, range(sys.maxunicode + 1)))):
        expected[match.start():match.end()] = True
    assert _word_characters()[:128].tolist() == expected[:128].tolist()
    table = _word_characters(np.arange(sys.maxunicode + 1, dtype=np.uint32))
    assert np.array_equal(table, expected)


@FAST
@given(st.binary(max_size=400), st.lists(st.tuples(st.integers(0, 400), st.integers(0, 300)), max_size=30))
def test_xxh3_spans_equal_the_library(data: bytes, spans: list[tuple[int, int]]) -> None:
    """Every length class of XXH3 (0, 1-3, 4-8, 9-16, 17-128 compiled; longer by the
    library) gives the library's value."""
    spans = [(min(a, len(data)), min(a + n, len(data))) for a, n in spans]
    starts = np.array([a for a, _ in spans], dtype=np.int64)
    ends = np.array([b for _, b in spans], dtype=np.int64)
    got = xxh3_spans(np.frombuffer(data, dtype=np.uint8), starts, ends)
    assert got.dtype == np.uint64
    assert got.tolist() == [xxhash.xxh3_64_intdigest(data[a:b]) for a, b in spans]


def test_xxh3_spans_every_short_length() -> None:
    data = np.random.default_rng(3).integers(0, 256, 600, dtype=np.uint8)
    lengths = np.arange(0, 260)
    got = xxh3_spans(data, 7 + lengths * 0, 7 + lengths)
    assert got.tolist() == [xxhash.xxh3_64_intdigest(data[7 : 7 + n].tobytes()) for n in lengths]
    with pytest.raises(ValueError):
        xxh3_spans(data, np.array([5]), np.array([4]))
    with pytest.raises(ValueError):
        xxh3_spans(data, np.array([0]), np.array([601]))


def test_xxh3_spans_compiles_one_kernel_for_every_layout() -> None:
    """A batch of one token (a one-element, hence contiguous, slice of the word edges), of
    many tokens (a strided slice) and a writable buffer all run the same compiled kernel,
    so the kernels built into the image serve every batch `neardup run` sees."""
    from neardup.core.xxh3 import _hash_spans

    for texts in (["alone"], ["two words", "and three more"], [""]):
        shingle_batch(texts, Shingling("word", 1))
    data = np.arange(40, dtype=np.uint8)
    edges = np.arange(0, 40, 5, dtype=np.int64)
    xxh3_spans(data, edges[0::2], edges[1::2])
    xxh3_spans(data, edges[:1], edges[1:2])
    if hasattr(_hash_spans, "signatures"):  # numba's JIT
        assert len(_hash_spans.signatures) == 1, _hash_spans.signatures
    else:  # built at install: every call took the built kernel, none went to numba
        assert _hash_spans.fallbacks == 0


@FAST
@given(st.lists(ANY_TEXTS, max_size=8), SHINGLINGS)
def test_shingle_counts_and_hashes_match_reference_ngrams(texts: list[str], sh: Shingling) -> None:
    """Counts are m-n+1 / 1 / 0; equal n-grams <-> equal hashes, across the whole batch."""
    batch = shingle_batch(texts, sh)
    by_gram: dict[tuple[str, ...], int] = {}
    by_hash: dict[int, tuple[str, ...]] = {}
    for d, text in enumerate(texts):
        m = len(_units(text, sh))
        grams = _ngrams(text, sh)
        assert len(grams) == (m - sh.n + 1 if m >= sh.n else min(m, 1))
        hashes = _doc_hashes(batch, d)
        assert len(hashes) == len(grams)
        for gram, h in zip(grams, hashes):
            assert by_gram.setdefault(gram, h) == h  # equal n-grams, equal hashes
            assert by_hash.setdefault(h, gram) == gram  # different n-grams, different hashes


@FAST
@given(st.lists(st.lists(st.integers(0, 2**64 - 1), max_size=12), max_size=6), st.integers(1, 7))
def test_ngram_hashes_fold_each_window_with_combine(docs: list[list[int]], n: int) -> None:
    """The compiled fold of token hashes into n-gram hashes is ``hashing.combine`` folded
    left over each window (the whole text when it has fewer than n tokens, none for an
    empty one), at the offsets given."""
    from neardup.core.hashing import combine
    from neardup.core.xxh3 import _ngram_hashes, ngram_hashes

    expected: list[int] = []
    counts = []
    for tokens in docs:
        width = min(n, len(tokens))
        windows = [tokens[i : i + width] for i in range(len(tokens) - width + 1)] if tokens else []
        counts.append(len(windows))
        for window in windows:
            acc = np.array([window[0]], dtype=np.uint64)
            for h in window[1:]:
                acc = combine(acc, np.array([h], dtype=np.uint64))
            expected.append(int(acc[0]))
    tokens = np.array([h for doc in docs for h in doc], dtype=np.uint64)
    token_offsets = np.concatenate([[0], np.cumsum([len(doc) for doc in docs])]).astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    assert ngram_hashes(tokens, token_offsets, offsets, n).tolist() == expected
    if not hasattr(_ngram_hashes, "signatures"):  # built at install: no call went to numba
        assert _ngram_hashes.fallbacks == 0


@pytest.mark.parametrize(
    ("text", "n", "count"),
    [("a b c d e f g", 5, 3), ("a b c d e", 5, 1), ("a b", 5, 1), ("x", 5, 1), ("", 5, 0),
     ("... --- !!!", 5, 0), ("one two three", 1, 3)],
)
def test_word_shingle_counts_golden(text: str, n: int, count: int) -> None:
    assert shingle_batch([text], Shingling("word", n)).counts.tolist() == [count]


def test_shingle_order_matters_and_is_shared_across_documents() -> None:
    word2 = Shingling("word", 2)
    ab, ba = shingle_batch(["a b", "b a"], word2).hashes.tolist()
    assert ab != ba
    batch = shingle_batch(["x a b y", "a b", "q r b a"], word2)
    assert ab in _doc_hashes(batch, 0) and [ab] == _doc_hashes(batch, 1)
    assert ba in _doc_hashes(batch, 2) and ab not in _doc_hashes(batch, 2)
    # A short document's single shingle is the n-gram of its tokens (here the 2-gram).
    assert shingle_batch(["a b"], Shingling("word", 5)).hashes.tolist() == [ab]
    char3 = Shingling("char", 3)
    abc, cba = shingle_batch(["abc", "cba"], char3).hashes.tolist()
    assert abc != cba
    assert _doc_hashes(shingle_batch(["zabcz"], char3), 0)[1] == abc
    assert shingle_batch(["ab", ""], char3).counts.tolist() == [1, 0]


def test_shingle_empty_batch() -> None:
    batch = shingle_batch([], Shingling())
    assert len(batch) == 0 and batch.hashes.size == 0 and batch.offsets.tolist() == [0]


@given(SHINGLINGS)
def test_shingling_parse_round_trip(sh: Shingling) -> None:
    assert Shingling.parse(str(sh)) == sh
    assert Shingling.parse(f"  {sh}\n") == sh


def test_shingling_parse_forms_and_errors() -> None:
    assert Shingling.parse("7") == Shingling("word", 7)
    assert Shingling.parse("char:3") == Shingling("char", 3)
    assert str(Shingling()) == "word:5"
    bad_specs = [
        "", "word:", "word:0", "char:-1", "char:x", "chars:5", "5:word", "a:b:5", "word:2.5"
    ]
    for bad in bad_specs:
        with pytest.raises(ValueError, match="bad shingling"):
            Shingling.parse(bad)
    with pytest.raises(ValueError):
        Shingling("word", 0)
    with pytest.raises(ValueError):
        Shingling("line", 3)  # type: ignore[arg-type]


# --- MinHash ----------------------------------------------------------------------------


def _reference_signature(hasher: MinHasher, hashes: list[int]) -> list[int]:
    """Big-int MinHash: min over x of (a*(x mod p) + b) mod p, EMPTY for no shingle."""
    if not hashes:
        return [int(EMPTY)] * hasher.num_perm
    xs = {h % P for h in hashes}
    return [
        min((a * x + b) % P for x in xs) for a, b in zip(hasher.a.tolist(), hasher.b.tolist())
    ]


# Pinned from the implementation at the time of writing (word:5 shingles, xxh3 token
# hashes, SplitMix64 combine, (a x + b) mod 2^61-1 with PCG64-drawn a, b). A failure
# here means signatures changed across versions: existing state stores become stale.
GOLDEN_TEXT = "The quick brown fox jumps over the lazy dog"
GOLDEN_SHINGLES = [
    13852113444385862672, 3226168397894255593, 4397384116634963041,
    11690809499512371543, 17723617560499858545,
]
GOLDEN_SIGNATURE_16 = [
    626952108524038624, 939977345672151053, 1028674639367737126, 537277678080788787,
    73132680055705153, 63831147449589186, 326411623805774663, 316085331124102788,
    243644941426558734, 385996073656024233, 309485332082048236, 367889661656185062,
    10600202830784132, 46043601440450880, 142802177890840768, 536262035316329570,
]
# sha256 of MinHasher(128, seed=1).signature(1..1000) as little-endian u64.
GOLDEN_SHA256_128 = "5203f2ffcd6ea4c004a07afa63b9b93a24aa7c8ea5147d30db000322f4fc27e3"


def test_minhash_golden_values() -> None:
    shingles = shingle_batch([normalize(GOLDEN_TEXT)], Shingling("word", 5)).hashes
    assert shingles.tolist() == GOLDEN_SHINGLES
    for hasher in (MinHasher(16, 1), MinHasher(16, 1)):
        assert hasher.signature(shingles).tolist() == GOLDEN_SIGNATURE_16
    assert _reference_signature(MinHasher(16, 1), GOLDEN_SHINGLES) == GOLDEN_SIGNATURE_16
    sig = MinHasher(128, 1).signature(np.arange(1, 1001, dtype=np.uint64))
    assert hashlib.sha256(sig.astype("<u8").tobytes()).hexdigest() == GOLDEN_SHA256_128


@FAST
@given(st.lists(U64, max_size=40), st.integers(0, 2**32), st.integers(1, 40))
def test_minhash_matches_big_int_reference(hashes: list[int], seed: int, num_perm: int) -> None:
    h1, h2 = MinHasher(num_perm, seed), MinHasher(num_perm, seed)
    sig = h1.signature(np.array(hashes, dtype=np.uint64))
    assert sig.dtype == np.uint64 and sig.shape == (num_perm,)
    assert sig.tolist() == _reference_signature(h1, hashes)
    assert h2.signature(np.array(hashes, dtype=np.uint64)).tolist() == sig.tolist()


@FAST
@given(st.lists(st.lists(U64, max_size=30), max_size=10))
def test_minhash_batch_equals_single_signatures(docs: list[list[int]]) -> None:
    hasher = MinHasher(32, 7)
    hashes = np.array([h for d in docs for h in d], dtype=np.uint64)
    offsets = np.concatenate([[0], np.cumsum([len(d) for d in docs])]).astype(np.int64)
    sigs = hasher.signatures(ShingleBatch(hashes, offsets))
    assert sigs.shape == (len(docs), 32)
    for d, doc in enumerate(docs):
        assert sigs[d].tolist() == hasher.signature(np.array(doc, dtype=np.uint64)).tolist()
        assert (sigs[d] == EMPTY).all() == (not doc)
        assert (sigs[d] < EMPTY).all() == bool(doc)


def test_minhash_blocks_across_large_batches() -> None:
    """Batches larger than one hashing block, with empty and huge documents mixed in."""
    rng = np.random.default_rng(3)
    sizes = [0, 5000, 0, 0, 3, 2000, 2100, 0, 9000, 1, 4096, 4095, 0]
    docs = [rng.integers(0, 2**64, size=k, dtype=np.uint64) for k in sizes]
    hasher = MinHasher(16, 1)
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    sigs = hasher.signatures(ShingleBatch(np.concatenate(docs), offsets))
    for d, doc in enumerate(docs):
        assert sigs[d].tolist() == _reference_signature(hasher, doc.tolist())


@FAST
@given(st.lists(U64, min_size=1, max_size=40), st.randoms(use_true_random=False))
def test_minhash_invariant_to_order_and_repeats(hashes: list[int], rnd) -> None:
    hasher = MinHasher(64, 1)
    shuffled = hashes * 2 + hashes[: len(hashes) // 2]
    rnd.shuffle(shuffled)
    base = hasher.signature(np.array(sorted(set(hashes)), dtype=np.uint64))
    assert hasher.signature(np.array(shuffled, dtype=np.uint64)).tolist() == base.tolist()


def test_minhash_seed_changes_signature() -> None:
    shingles = np.arange(1, 200, dtype=np.uint64)
    a, b = MinHasher(128, 1).signature(shingles), MinHasher(128, 2).signature(shingles)
    assert (a != b).mean() > 0.9
    assert not np.array_equal(MinHasher(128, 1).a, MinHasher(128, 2).a)
    with pytest.raises(ValueError):
        MinHasher(0)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(U61, U61, U61), min_size=1, max_size=8))
@example([(P - 1, P - 1, P - 1), (2**61 - 1, 2**61 - 1, 2**61 - 1), (0, 0, 0), (1, 0, 0)])
def test_mulmod61_add_matches_big_int(triples: list[tuple[int, int, int]]) -> None:
    a, x, b = (np.array(col, dtype=np.uint64) for col in zip(*triples))
    got = mulmod61_add(a, x, b)
    assert got.tolist() == [(ai * xi + bi) % P for ai, xi, bi in triples]


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**63))
def test_jaccard_estimate_error(seed: int) -> None:
    """2,000 random set pairs, Jaccard uniform on [0, 1]: MAE <= 0.03 at num_perm=128.

    The expected MAE is about 0.028 (0.8 * E[sqrt(J(1-J)/128)]); 2,000 pairs keep the
    sampling spread of the mean near 0.0005.
    """
    rng = np.random.default_rng(seed)
    n_pairs = 2000
    union_sizes = rng.integers(20, 300, size=n_pairs)
    targets = rng.uniform(0.0, 1.0, size=n_pairs)
    targets[:20] = [0.0] * 10 + [1.0] * 10
    sets, exact = [], []
    for u, j in zip(union_sizes, targets):
        values = np.unique(rng.integers(0, 2**64, size=u, dtype=np.uint64))
        common = int(round(j * len(values)))
        only_a = (len(values) - common) // 2
        a = values[: common + only_a]
        b = np.concatenate([values[:common], values[common + only_a :]])
        sets += [a, b]
        exact.append(len(np.intersect1d(a, b)) / len(np.union1d(a, b)))
    offsets = np.concatenate([[0], np.cumsum([len(s) for s in sets])]).astype(np.int64)
    sigs = MinHasher(128, 1).signatures(ShingleBatch(np.concatenate(sets), offsets))
    est = jaccard_estimate(sigs[0::2], sigs[1::2])
    err = est - np.array(exact)
    assert est.shape == (n_pairs,)
    assert np.min(exact) == 0.0 and np.max(exact) == 1.0
    assert np.all(est[np.array(exact) == 1.0] == 1.0)
    assert np.abs(err).mean() <= 0.03
    assert abs(err.mean()) <= 0.01  # unbiased


# --- LSH --------------------------------------------------------------------------------

THRESHOLDS = [round(0.5 + 0.05 * k, 2) for k in range(10)]  # 0.5 .. 0.95


@pytest.mark.parametrize("num_perm", [64, 128, 256])
def test_optimal_params_match_datasketch(num_perm: int) -> None:
    for threshold in THRESHOLDS:
        ours = optimal_params(threshold, num_perm)
        assert (ours.bands, ours.rows) == _optimal_param(threshold, num_perm, 0.5, 0.5), threshold
        assert ours.bands * ours.rows <= num_perm


@pytest.mark.parametrize("num_perm", [16, 100, 128])
def test_optimal_params_is_the_least_weighted_area(num_perm: int) -> None:
    """The banding minimises fp_weight * false-positive area + fn_weight * false-negative
    area over every (bands, rows), the first (fewest bands, then rows) of equal scores."""
    for threshold in (0.3, 0.55, 0.8):
        for fp_weight in (0.5, 0.2):
            best = min(
                ((fp_weight * false_positive_area(threshold, LshParams(b, r))
                  + (1 - fp_weight) * false_negative_area(threshold, LshParams(b, r)), b, r)
                 for b in range(1, num_perm + 1) for r in range(1, num_perm // b + 1)),
                key=lambda x: x[0],
            )
            ours = optimal_params(threshold, num_perm, fp_weight, 1 - fp_weight)
            assert (ours.bands, ours.rows) == best[1:], (threshold, fp_weight)


def test_banding_computed_once_per_setting() -> None:
    for choose, optimised in ((recall_params, False), (optimal_params, True)):
        choose.cache_clear()
        for threshold in (0.8, 0.8, 0.8, 0.9):
            EngineSettings(threshold=threshold, candidate_threshold=threshold - 0.2 if optimised else None)
        info = choose.cache_info()
        assert (info.misses, info.hits) == (2, 2), choose


def test_the_default_banding_reaches_the_score_floor() -> None:
    """Without a banding or candidate threshold given, a pair at the score floor is a
    candidate with probability SCORE_RECALL or more, with the most rows that allow it."""
    for threshold, floor in ((0.8, None), (0.8, 0.5), (0.9, None), (0.7, 0.6), (0.95, 0.9)):
        engine = EngineSettings(threshold=threshold, score_floor=floor)
        lsh, at = engine.bands, engine.floor
        assert at == (floor if floor is not None else threshold - CANDIDATE_MARGIN)
        assert lsh.probability(at) >= SCORE_RECALL, (threshold, floor, lsh)
        wider = LshParams(engine.num_perm // (lsh.rows + 1), lsh.rows + 1)
        assert wider.probability(at) < SCORE_RECALL, (threshold, floor, lsh)
    assert (EngineSettings().bands.bands, EngineSettings().bands.rows) == (32, 4)
    with pytest.raises(ValueError, match="score floor"):
        EngineSettings(threshold=0.8, score_floor=0.85)


def test_optimal_params_errors() -> None:
    for kwargs in [{"threshold": 0.0}, {"threshold": 1.0}, {"num_perm": 0},
                   {"false_positive_weight": 0.7, "false_negative_weight": 0.7}]:
        with pytest.raises(ValueError):
            optimal_params(**kwargs)
    with pytest.raises(ValueError):
        LshParams(0, 3)


def _collision_rate(params: LshParams, s: float, n_pairs: int, seed: int) -> float:
    """Share of simulated signature pairs (slots equal with probability s) sharing a bucket."""
    rng = np.random.default_rng(seed)
    width = params.bands * params.rows + 3  # spare slots must not matter
    a = rng.integers(0, P, size=(n_pairs, width), dtype=np.uint64)
    other = rng.integers(0, P, size=(n_pairs, width), dtype=np.uint64)
    b = np.where(rng.random((n_pairs, width)) < s, a, other)
    return float(np.mean(np.any(band_hashes(a, params) == band_hashes(b, params), axis=1)))


@pytest.mark.parametrize(("threshold", "num_perm"), [(0.8, 128), (0.5, 64), (0.9, 256)])
def test_banding_reproduces_s_curve(threshold: float, num_perm: int) -> None:
    params = optimal_params(threshold, num_perm)
    n_pairs = 20_000
    for k, s in enumerate([0.3, threshold - 0.1, threshold, threshold + 0.05, 0.98]):
        expected = 1.0 - (1.0 - s**params.rows) ** params.bands
        assert params.probability(s) == pytest.approx(expected)
        rate = _collision_rate(params, s, n_pairs, seed=k)
        tolerance = 5.0 * np.sqrt(expected * (1.0 - expected) / n_pairs) + 1e-3
        assert abs(rate - expected) <= tolerance, (s, rate, expected)


@FAST
@given(st.integers(1, 4), st.integers(1, 4), st.integers(2, 12), st.integers(0, 2**32))
def test_band_hashes_equal_iff_rows_equal(bands: int, rows: int, n_docs: int, seed: int) -> None:
    params = LshParams(bands, rows)
    rng = np.random.default_rng(seed)
    values = rng.integers(0, P, size=3, dtype=np.uint64)  # 3 values: many equal rows
    sigs = values[rng.integers(0, 3, size=(n_docs, bands * rows + 1))]
    bh = band_hashes(sigs, params)
    assert bh.shape == (n_docs, bands) and bh.dtype == np.uint64
    cut = sigs[:, : bands * rows].reshape(n_docs, bands, rows)
    for i in range(n_docs):
        for j in range(n_docs):
            rows_equal = (cut[i] == cut[j]).all(axis=1)
            assert ((bh[i] == bh[j]) == rows_equal).all()


def test_band_hashes_order_sensitive_and_checked() -> None:
    params = LshParams(1, 2)
    bh = band_hashes(np.array([[1, 2], [2, 1]], dtype=np.uint64), params)
    assert bh[0, 0] != bh[1, 0]
    with pytest.raises(ValueError):
        band_hashes(np.zeros((2, 5), dtype=np.uint64), LshParams(2, 3))


# --- union-find -------------------------------------------------------------------------


def singletons(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A forest of ``n`` singletons: (parent, size, canonical), int64."""
    return np.arange(n, dtype=np.int64), np.ones(n, dtype=np.int64), np.arange(n, dtype=np.int64)


def flatten(sets: list[np.ndarray]) -> Sets:
    """Exact ``Sets`` of sorted uint32 fingerprint arrays."""
    offsets = np.concatenate([[0], np.cumsum([len(x) for x in sets])]).astype(np.int64)
    values = np.concatenate([np.zeros(0, np.uint32), *sets]).astype(np.uint32)
    return Sets(np.diff(offsets), values, offsets)


def _parent_chain_is_acyclic(parent: np.ndarray, x: int) -> bool:
    for _ in range(len(parent) + 1):
        if parent[x] == x:
            return True
        x = int(parent[x])
    return False


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 40).flatmap(
        lambda n: st.tuples(
            st.just(n),
            st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)), max_size=60),
        )
    )
)
def test_union_find_matches_connected_components(case: tuple[int, list[tuple[int, int]]]) -> None:
    n, edges = case
    parent, size, canonical = singletons(n)
    for x, y in edges:
        root = union(parent, size, canonical, x, y)
        before = parent.copy()
        assert peek_root(parent, x) == peek_root(parent, y) == root
        assert np.array_equal(parent, before)  # peek_root reads, never writes
        assert find(parent, x) == find(parent, y) == root
        assert all(_parent_chain_is_acyclic(parent, z) for z in range(n))
    rows, cols = (list(c) for c in zip(*edges)) if edges else ([], [])
    graph = sp.coo_matrix((np.ones(len(rows)), (rows, cols)), shape=(n, n))
    _, labels = connected_components(graph, directed=False)
    roots = [find(parent, x) for x in range(n)]
    for x in range(n):
        for y in range(n):
            assert (roots[x] == roots[y]) == (labels[x] == labels[y])
        component = np.flatnonzero(labels == labels[x])
        assert size[roots[x]] == len(component)
        assert canonical[roots[x]] == component.min()
        assert parent[x] == roots[x]  # path compressed by the find above


def test_find_on_long_chain_has_no_recursion_and_compresses() -> None:
    n = 100_000
    parent = np.arange(1, n + 1, dtype=np.int64)
    parent[-1] = n - 1
    assert n > sys.getrecursionlimit()
    assert peek_root(parent, 0) == n - 1 and parent[0] == 1
    assert find(parent, 0) == n - 1
    assert (parent == n - 1).all()


def test_union_by_size_and_canonical() -> None:
    parent, size, canonical = singletons(8)
    union(parent, size, canonical, 5, 6)
    union(parent, size, canonical, 5, 7)
    big = find(parent, 5)
    assert union(parent, size, canonical, 1, 7) == big  # the larger set's root stays root
    assert (size[big], canonical[big]) == (4, 1)
    assert union(parent, size, canonical, 6, 1) == big and size[find(parent, 6)] == 4  # already joined
    assert {x for x in range(8) if find(parent, x) == big} == {1, 5, 6, 7}
    assert all(parent[x] == x and size[x] == 1 for x in (0, 2, 3, 4))


def _cluster_reference(n_stored: int, roots: list[int], sets: list[set[int]],
                       pairs: list[list[int]], threshold: float, policy: int,
                       measure: int) -> list[tuple[int, int, int, int, int]]:
    """The clustering rules in plain Python over sets, one document after the other.
    Stored document k starts in the cluster of canonical ``roots[k]``."""
    cluster = {k: roots[k] for k in range(n_stored)}  # element -> canonical

    def sim(a: int, b: int) -> float:  # a the later document, b the earlier
        inter = len(sets[a] & sets[b])
        if measure == JACCARD:
            return inter / len(sets[a] | sets[b])
        whole = {CONTAINMENT: len(sets[a]), CONTAINMENT_OF_EARLIER: len(sets[b]),
                 CONTAINMENT_EITHER: min(len(sets[a]), len(sets[b]))}[measure]
        return inter / whole

    out = []
    for i, cands in enumerate(pairs):
        x = n_stored + i
        cluster[x] = x
        sims = [sim(x, c) for c in cands]
        accepted = [k for k, v in enumerate(sims) if v >= threshold]
        if not accepted:
            out.append((-1, 0, x, 1, -1))
            continue
        best = max(accepted, key=sims.__getitem__)  # the first of the most similar
        related = -1
        if policy == COMPONENTS:
            merged = {cluster[cands[k]] for k in accepted} | {x}
            canonical = min(merged)
            for e, c in cluster.items():
                if c in merged:
                    cluster[e] = canonical
        else:
            canonicals = sorted({cluster[cands[k]] for k in accepted})
            target = max(canonicals, key=lambda c: sim(x, c))
            if sim(x, target) >= threshold:
                cluster[x] = target
            else:
                related = cluster[cands[best]]
        size = sum(c == cluster[x] for c in cluster.values())
        out.append((best, len(accepted), cluster[x], size, related))
    return out


@settings(max_examples=150, deadline=None)
@given(st.data(), st.sampled_from([COMPONENTS, CANONICAL]), st.sampled_from(MEASURES))
def test_cluster_batch_matches_the_rules(data: st.DataObject, policy: int, measure: int) -> None:
    n_stored = data.draw(st.integers(0, 6))
    n = data.draw(st.integers(1, 8))
    sets = data.draw(st.lists(st.sets(st.integers(0, 6), min_size=1), min_size=n_stored + n,
                              max_size=n_stored + n))
    # stored clusters: each stored document's canonical is an earlier (or the same) one
    roots: list[int] = []
    for k in range(n_stored):
        joins = data.draw(st.integers(0, k))
        roots.append(k if joins == k else roots[joins])
    pairs = [sorted(data.draw(st.sets(st.integers(0, n_stored + i - 1), max_size=4))) if n_stored + i else []
             for i in range(n)]
    threshold = data.draw(st.sampled_from([0.3, 0.5, 0.8]))

    parent, size, canonical = singletons(n_stored + n)
    for k, r in enumerate(roots):
        union(parent, size, canonical, r, k)
    for k in range(n_stored):
        assert canonical[find(parent, k)] == roots[k]
    exact = flatten([np.array(sorted(x), dtype=np.uint32) for x in sets])
    bounds = np.cumsum([0] + [len(c) for c in pairs]).astype(np.int64)
    cands = np.array([c for cs in pairs for c in cs], dtype=np.int64)
    left = np.repeat(np.arange(n_stored, n_stored + n), np.diff(bounds))
    jaccard, containment = pair_similarities(exact, left, cands, measure)
    sim = jaccard if measure == JACCARD else containment

    got = cluster_batch(parent, size, canonical, n_stored, bounds, cands, sim, threshold, policy,
                        measure, exact)
    expected = _cluster_reference(n_stored, roots, [set(x) for x in sets], pairs, threshold, policy, measure)
    match = [int(m) - int(bounds[i]) if m >= 0 else -1 for i, m in enumerate(got.match)]
    assert list(zip(match, got.accepted.tolist(), got.canonical.tolist(), got.cluster_size.tolist(),
                    got.related.tolist())) == expected


def _candidates_reference(buckets: list[list[int]], stored: dict[int, list[int]], cap: int,
                          first_seq: int, most: int) -> tuple[list[list[int]], list[bool]]:
    """The bucket rules in plain Python: members met, joins, top ``most`` by shared buckets."""
    members = {k: list(v) for k, v in stored.items()}
    found, joined = [], []
    for d, row in enumerate(buckets):
        shared: dict[int, int] = {}
        for k in row:
            for q in members.get(k, []):
                shared[q] = shared.get(q, 0) + 1
            joins = len(members.get(k, [])) < cap
            joined.append(joins)
            if joins:
                members.setdefault(k, []).append(first_seq + d)
        ranked = sorted(shared, key=lambda q: (-shared[q], q))[:most]
        found.append(sorted(ranked))
    return found, joined


@FAST
@given(st.data(), st.integers(1, 3), st.integers(1, 4), st.integers(1, 5))
def test_batch_candidates_follow_the_bucket_rules(data: st.DataObject, bands: int, cap: int,
                                                   most: int) -> None:
    n_buckets = data.draw(st.integers(1, 6))
    first_seq = data.draw(st.integers(0, 5))
    stored = {k: sorted(data.draw(st.sets(st.integers(0, first_seq - 1), max_size=cap + 1)))
              if first_seq else [] for k in range(n_buckets)}
    n = data.draw(st.integers(0, 6))
    # distinct buckets across the bands of one document, as bucket ids are
    buckets = [data.draw(st.permutations(range(n_buckets)))[:bands] for _ in range(n)]
    if any(len(row) < bands for row in buckets):
        return
    counts = np.array([len(stored[k]) for k in range(n_buckets)], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    seqs = np.array([q for k in range(n_buckets) for q in stored[k]], dtype=np.uint64)
    got = batch_candidates(np.array([k for row in buckets for k in row], dtype=np.int64), bands,
                           starts, counts, seqs, cap, first_seq, most)
    found, joined = _candidates_reference(buckets, stored, cap, first_seq, most)
    assert [got.seqs[got.bounds[i] : got.bounds[i + 1]].tolist() for i in range(n)] == found
    assert got.joined.tolist() == joined


def test_bucket_weights_rank_a_rare_shared_bucket_above_a_common_one() -> None:
    # one new document (seq 400) in two buckets: bucket 0 holds seq 250 alone, bucket 1
    # the 300 seqs 0-299 but 250; three candidates kept
    counts = np.array([1, 299], dtype=np.int64)
    starts = np.array([0, 1], dtype=np.int64)
    seqs = np.array([250] + [q for q in range(300) if q != 250], dtype=np.uint64)
    entries = np.array([0, 1], dtype=np.int64)
    weights = bucket_weights(counts, entries)
    assert weights.tolist() == [8, 1]  # 9 - floor(log2(members + batch entries + 1))
    plain = batch_candidates(entries, 2, starts, counts, seqs, 1000, 400, 3)
    weighted = batch_candidates(entries, 2, starts, counts, seqs, 1000, 400, 3, weights=weights)
    assert plain.seqs.tolist() == [0, 1, 2]  # one shared bucket each: the earliest
    assert weighted.seqs.tolist() == [0, 1, 250]  # the rare bucket first, then the earliest


def _ranked_below(near_similarity: float, match_similarity: float, extra: int) -> tuple[int, int]:
    """One new document (local id 9) whose 8 stored candidates sharing 2 of its 3 buckets
    (local ids 0-7) have Jaccard ``near_similarity`` with it, and whose ninth (8), sharing
    one bucket, has ``match_similarity``: threshold 0.8, near misses from 0.55, the cap
    at 8 plus ``extra``. Returns (match local id or -1, candidates verified)."""
    text = np.arange(100, dtype=np.uint32)
    sets = [text[: round(100 * near_similarity)]] * 8 + [text[: round(100 * match_similarity)], text]
    counts = np.array([8, 8, 1], dtype=np.int64)
    starts = np.array([0, 8, 16], dtype=np.int64)
    seqs = np.array(list(range(8)) * 2 + [8], dtype=np.uint64)
    parent, size, canonical = singletons(10)
    out = decide_batch(np.array([0, 1, 2], dtype=np.int64), 3, starts, counts, seqs, 256, 9, 8,
                       np.arange(9, dtype=np.uint64), parent, size, canonical, 0.8, CANONICAL,
                       JACCARD, True, flatten(sets), extra, 0.55)
    match = int(out.clustering.match[0])
    return (int(out.seqs[match]) if match >= 0 else -1), int(out.bounds[1])


def test_verification_goes_past_the_cap_only_after_near_misses() -> None:
    # the true match ranks ninth, behind eight near misses of the same template: found
    assert _ranked_below(0.6, 1.0, extra=4) == (8, 9)
    assert _ranked_below(0.6, 1.0, extra=0) == (-1, 8)  # the plain cap loses it
    # behind eight clear misses, the verification stops at the cap
    assert _ranked_below(0.3, 1.0, extra=4) == (-1, 8)
    # a copy among the first eight is accepted: the cap holds (a story republished often)
    assert _ranked_below(1.0, 1.0, extra=4) == (0, 8)


# --- sorted arrays ----------------------------------------------------------------------


@FAST
@given(st.lists(st.integers(0, 30) | st.integers(0, 2**64 - 1), max_size=80))
def test_sorted_unique_is_numpy_unique(values: list[int]) -> None:
    array = np.array(values, dtype=np.uint64)
    assert sorted_unique(array).tolist() == sorted(set(values)) == np.unique(array).tolist()


# --- exact overlap ------------------------------------------------------------------------

FINGERPRINT_SETS = st.lists(
    st.sets(st.integers(0, 2**32 - 1) | st.integers(0, 40), max_size=60).map(
        lambda xs: np.array(sorted(xs), dtype=np.uint32)),
    min_size=1, max_size=8)


@FAST
@given(FINGERPRINT_SETS, st.data())
def test_pair_similarities_equal_python_sets(sets: list[np.ndarray], data: st.DataObject) -> None:
    sets = [x for x in sets if len(x)] or [np.array([7], dtype=np.uint32)]
    pairs = data.draw(st.lists(st.tuples(st.integers(0, len(sets) - 1),
                                         st.integers(0, len(sets) - 1)), max_size=20))
    left = np.array([a for a, _ in pairs], dtype=np.int64)
    right = np.array([b for _, b in pairs], dtype=np.int64)
    jaccard, containment = pair_similarities(flatten(sets), left, right)
    assert jaccard.dtype == containment.dtype == np.float64
    python = [(set(sets[a].tolist()), set(sets[b].tolist())) for a, b in pairs]
    assert jaccard.tolist() == [len(x & y) / len(x | y) for x, y in python]
    assert containment.tolist() == [min(len(x & y) / len(x), 1.0) for x, y in python]
    _, of_earlier = pair_similarities(flatten(sets), left, right, CONTAINMENT_OF_EARLIER)
    assert of_earlier.tolist() == [len(x & y) / len(y) for x, y in python]
    _, either = pair_similarities(flatten(sets), left, right, CONTAINMENT_EITHER)
    assert either.tolist() == [len(x & y) / min(len(x), len(y)) for x, y in python]


def sampled(sets: list[np.ndarray], k: int) -> Sets:
    """``Sets`` of the bottom-k samples of sorted uint32 fingerprint arrays, with the
    whole sets' sizes (as ``--verify estimate`` keeps them)."""
    whole = flatten(sets)
    values, offsets = bottom_k(whole.values, whole.offsets, k)
    return Sets(whole.sizes, values, offsets)


def test_bottom_k_keeps_the_smallest() -> None:
    sets = [np.array([3, 9, 12, 40], np.uint32), np.array([], np.uint32), np.array([5, 6], np.uint32)]
    whole = flatten(sets)
    values, offsets = bottom_k(whole.values, whole.offsets, 3)
    assert offsets.tolist() == [0, 3, 3, 5] and values.tolist() == [3, 9, 12, 5, 6]
    with pytest.raises(ValueError):
        bottom_k(whole.values, whole.offsets, 0)


def test_pair_similarities_on_samples_count_below_the_common_threshold() -> None:
    """Two cut samples compare below the smaller of their largest values (Broder 1997's
    MIN_k): there both hold every element of their sets."""
    a = np.array([1, 2, 3, 4, 5, 6], np.uint32)     # sample [1, 2, 3, 4]: threshold 4
    b = np.array([2, 3, 5, 7, 8, 9, 10], np.uint32)  # sample [2, 3, 5, 7]: threshold 7
    c = np.array([2, 3, 6], np.uint32)               # whole: no threshold
    sets = sampled([a, b, c], 4)
    assert sets.offsets.tolist() == [0, 4, 8, 11] and sets.sizes.tolist() == [6, 7, 3]
    jaccard, containment = pair_similarities(sets, np.array([0, 1, 2]), np.array([1, 2, 0]))
    # a, b below 4: {1, 2, 3, 4} and {2, 3}: 2 of 4; a in b: 2 of a's 4
    # b, c below 7: {2, 3, 5, 7} and {2, 3, 6}: 2 of 5; b in c: 2 of b's 4
    # c, a below 4: {2, 3} and {1, 2, 3, 4}: 2 of 4; c in a: 2 of c's 2
    assert jaccard.tolist() == [0.5, 0.4, 0.5]
    assert containment.tolist() == [0.5, 0.5, 1.0]


@FAST
@given(FINGERPRINT_SETS, st.integers(1, 70))
def test_samples_of_whole_sets_compare_exactly(sets: list[np.ndarray], k: int) -> None:
    """A set of at most k fingerprints is its own sample: two such compare exactly."""
    left, right = np.meshgrid(np.arange(len(sets)), np.arange(len(sets)))
    left, right = left.ravel(), right.ravel()
    whole = [len(x) <= k for x in sets]
    both = np.array([whole[a] and whole[b] for a, b in zip(left, right)])
    exact = pair_similarities(flatten(sets), left, right, CONTAINMENT_EITHER)
    estimate = pair_similarities(sampled(sets, k), left, right, CONTAINMENT_EITHER)
    for got, want in zip(estimate, exact):
        assert got[both].tolist() == want[both].tolist()


@pytest.mark.parametrize("size", [400, 3000])
def test_sample_estimate_error(size: int) -> None:
    """Pairs of sets at Jaccard 0.8 larger than the sample: the estimate from 256-element
    samples is unbiased and its error about √(J(1 − J)/k) or less (0.025)."""
    rng = np.random.default_rng(size)
    errors = []
    for _ in range(300):
        universe = rng.choice(2**32, size=size + size // 9, replace=False).astype(np.uint32)
        shared = size - size // 9  # |A ∩ B| / |A ∪ B| = 8/9 of size over 10/9 of it: 0.8
        a = np.sort(universe[:size])
        b = np.sort(np.concatenate([universe[:shared], universe[size:]]))
        exact = pair_similarities(flatten([a, b]), np.array([0]), np.array([1]))[0][0]
        estimate = pair_similarities(sampled([a, b], 256), np.array([0]), np.array([1]))[0][0]
        errors.append(estimate - exact)
    errors = np.array(errors)
    assert abs(errors.mean()) < 0.006
    assert errors.std() < 0.03


def test_pair_similarities_errors() -> None:
    sets = flatten([np.array([1, 2], dtype=np.uint32)])
    with pytest.raises(IndexError):
        pair_similarities(sets, np.array([0]), np.array([1]))
    with pytest.raises(ValueError):
        pair_similarities(sets, np.array([0]), np.array([], dtype=np.int64))
