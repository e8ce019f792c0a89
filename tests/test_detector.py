"""The detector: golden cases, batch-size invariance and quality on a Reuters excerpt."""

from __future__ import annotations

import gzip
import json
import pickle
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp
from hypothesis import given, settings
from hypothesis import strategies as st

from neardup.core.lsh import copy_bucket_ids
from neardup.core.normalize import TextNorm, normalize
from neardup.core.settings import EngineSettings
from neardup.core.shingle import shingle_batch
from neardup.core.types import Document, Rejected, Verdict
from neardup.detector import EMPTY_TEXT, NO_TOKENS, Detector
from neardup.state.memory import MemoryStateStore
from neardup.state.rocksdb import RocksDBStateStore

DATA = Path(__file__).parent / "data" / "reuters_excerpt.jsonl.gz"
SETTINGS = EngineSettings()

BASE = (
    "The central bank said on Tuesday it would keep its key lending rate unchanged at "
    "six per cent for the third month in a row, citing steady inflation, firm demand for "
    "credit from manufacturers and a recovery in exports that analysts had not expected "
    "until the second half of the year. The governor told reporters that the board saw "
    "no reason to move before the budget is presented to parliament next month, and that "
    "the currency had been stable against a basket of trading partners since January.\n"
    "Economists polled last week had been split, with nine of sixteen forecasting a cut "
    "of a quarter point to support construction, which shrank for a fifth straight "
    "quarter. Bond yields rose four basis points after the announcement while the main "
    "share index closed little changed, led by gains in shipping and mining stocks. "
    "The bank repeated that it stood ready to act if oil prices pushed consumer prices "
    "above its target range, and said money supply growth had slowed to an annual rate "
    "of seven per cent in the latest month from eight and a half per cent a year ago.\n"
    "Separately, the finance ministry said tax revenue in the first quarter was ahead of "
    "plan, helped by one-off receipts from the sale of a state telephone company stake, "
    "and that it would publish revised borrowing figures together with the budget."
)
STORY = BASE + "\n(Reporting by John Smith; Editing by Jane Doe)"
# Same story, another footer: exact word-5 Jaccard 0.94 with STORY.
REFILED = BASE + "\n(Reporting by Peter Brown in London; Editing by Mary Major)"
UNRELATED = (
    "Heavy rain flooded parts of the northern coast overnight, closing two ports and the "
    "main rail line to the capital. Officials said about four thousand people had left "
    "their homes and that emergency shelters had been opened in schools and churches, "
    "while farmers warned that the sugar cane harvest could be delayed by several weeks."
)


def _jaccard(a: str, b: str) -> float:
    sa, sb = (set(shingle_batch([normalize(t)]).hashes.tolist()) for t in (a, b))
    return len(sa & sb) / len(sa | sb)


def _run(
    docs: Sequence[Document],
    batch_size: int,
    store=None,
    settings: EngineSettings = SETTINGS,
) -> list[Verdict | Rejected]:
    store = store if store is not None else MemoryStateStore(settings.state_shape())
    detector = Detector(settings, store)
    out: list[Verdict | Rejected] = []
    for start in range(0, len(docs), batch_size):
        out += detector.process(docs[start : start + batch_size])
    return out


def _verdict(result: Verdict | Rejected) -> Verdict:
    assert isinstance(result, Verdict), result
    return result


# --- golden cases -----------------------------------------------------------------------


def test_exact_duplicate() -> None:
    first, copy = map(_verdict, _run([Document("a", STORY), Document("b", STORY)], 1))
    assert (first.verdict, first.cluster, first.match) == ("unique", "a", None)
    assert first.similarity == 0.0
    assert (copy.verdict, copy.cluster, copy.match, copy.similarity) == ("duplicate", "a", "a", 1.0)
    assert copy.is_duplicate and not first.is_duplicate
    assert (copy.candidates, copy.rejected) == (1, 0)


def test_near_duplicate_with_changed_footer() -> None:
    assert 0.9 < _jaccard(STORY, REFILED) < 1.0
    _, near = map(_verdict, _run([Document("a", STORY), Document("b", REFILED)], 1))
    assert (near.verdict, near.match, near.cluster) == ("duplicate", "a", "a")
    assert 0.8 <= near.similarity < 1.0


def test_unrelated_text_is_unique() -> None:
    out = _run([Document("a", STORY), Document("u", UNRELATED)], 1)
    unrelated = _verdict(out[1])
    assert (unrelated.verdict, unrelated.cluster, unrelated.match) == ("unique", "u", None)
    assert unrelated.similarity == 0.0 and unrelated.candidates == 0


@pytest.mark.parametrize("batch_size", [1, 3])
def test_every_document_carries_its_nearest_candidate(batch_size: int) -> None:
    """A unique document reports its most similar candidate and the exact score, even
    below the threshold; a duplicate's nearest candidate is its match."""
    settings = EngineSettings(threshold=0.95)
    docs = [Document("a", STORY), Document("r", REFILED), Document("c", STORY)]
    first, refiled, copy = map(_verdict, _run(docs, batch_size, settings=settings))
    assert (first.nearest, first.similarity) == (None, 0.0)
    assert (refiled.verdict, refiled.match, refiled.nearest) == ("unique", None, "a")
    assert refiled.similarity == pytest.approx(_jaccard(STORY, REFILED), abs=1e-12)
    assert refiled.jaccard == refiled.similarity and refiled.containment > refiled.jaccard
    assert refiled.to_dict()["nearest"] == "a"
    assert (copy.verdict, copy.match, copy.nearest, copy.similarity) == ("duplicate", "a", "a", 1.0)


def test_invalid_texts_are_rejected_without_a_sequence_number() -> None:
    store = MemoryStateStore(SETTINGS.state_shape())
    docs = [
        Document("a", STORY),
        Document("empty", ""),
        Document("blank", " \t\n\u00a0\u3000 "),
        Document("punct", "!!! ... --- ?"),
        Document("u", UNRELATED),
    ]
    out = _run(docs, len(docs), store)
    assert [r.id for r in out] == [d.id for d in docs]
    assert out[1] == Rejected("empty", EMPTY_TEXT)
    assert out[2] == Rejected("blank", EMPTY_TEXT)
    assert out[3] == Rejected("punct", NO_TOKENS)
    assert (_verdict(out[0]).seq, _verdict(out[4]).seq) == (0, 1)
    assert store.next_seq() == 2
    # An all-rejected batch still commits (its positions), without a document.
    detector = Detector(SETTINGS, store)
    assert detector.process([Document("e", "   ")], positions={"in": 7}) == [
        Rejected("e", EMPTY_TEXT)
    ]
    assert store.next_seq() == 2 and store.get_position("in") == 7
    # With punctuation stripped, punctuation-only text is empty.
    stripping = EngineSettings(norm=TextNorm(strip_punctuation=True))
    assert _run([Document("p", "¿¡...!?")], 1, settings=stripping) == [Rejected("p", EMPTY_TEXT)]


@pytest.mark.parametrize("batch_size", [1, 4])
@pytest.mark.parametrize("duplicate_buckets", ["new", "all"])
def test_duplicates_inside_one_batch(batch_size: int, duplicate_buckets: str) -> None:
    settings = EngineSettings(duplicate_buckets=duplicate_buckets)
    docs = [Document("a", STORY), Document("u", UNRELATED), Document("b", REFILED),
            Document("c", STORY)]
    out = list(map(_verdict, _run(docs, batch_size, settings=settings)))
    assert [v.verdict for v in out] == ["unique", "unique", "duplicate", "duplicate"]
    assert [v.cluster for v in out] == ["a", "u", "a", "a"]
    assert (out[2].match, out[3].match, out[3].similarity) == ("a", "a", 1.0)
    if duplicate_buckets == "all":
        assert out[3].candidates == 2  # both earlier members of the cluster, stored or not
    else:
        # b joined only the buckets a is not in; c (a copy of a) is in a's buckets alone
        assert out[3].candidates == 1


def test_best_match_is_most_similar_and_cluster_is_earliest() -> None:
    store = MemoryStateStore(SETTINGS.state_shape())
    _run([Document("a", STORY), Document("u", UNRELATED)], 2, store)
    _run([Document("b", REFILED)], 1, store)
    copy_of_b = _verdict(_run([Document("c", REFILED)], 1, store)[0])
    assert copy_of_b.match == "b" and copy_of_b.similarity == 1.0  # not "a" (~0.94)
    assert copy_of_b.cluster == "a"  # the cluster's earliest document
    assert (copy_of_b.candidates, copy_of_b.rejected) == (2, 0)


def test_verdicts_in_arrival_order() -> None:
    docs = [Document(f"d{i}", text) for i, text in
            enumerate([UNRELATED, STORY, "", REFILED, UNRELATED, "Short note.", STORY])]
    out = _run(docs, 3)
    assert [r.id for r in out] == [d.id for d in docs]
    seqs = [r.seq for r in out if isinstance(r, Verdict)]
    assert seqs == list(range(len(seqs))) == list(range(6))


def test_detect_does_not_write() -> None:
    store = MemoryStateStore(SETTINGS.state_shape())
    detector = Detector(SETTINGS, store)
    docs = [Document("a", STORY), Document("b", REFILED)]
    first = detector.detect(docs)
    # a joins every bucket, its duplicate b only those a is not in, and a's copy bucket
    shared = np.isin(_bucket_ids(SETTINGS, REFILED), _bucket_ids(SETTINGS, STORY)).sum()
    assert 0 < shared < SETTINGS.bands.bands
    assert len(first.update.bucket_ids) == 2 * SETTINGS.bands.bands - shared + 1
    assert first.update.bucket_ids[-1] == copy_bucket_ids(np.array([0]))[0]
    assert store.next_seq() == 0
    assert store.bucket_members(np.unique(first.update.bucket_ids)).counts.sum() == 0
    second = detector.detect(docs)
    assert first.results == second.results
    assert first.update.ids == ["a", "b"] and first.update.first_seq == 0
    store.commit(first.update)
    assert _verdict(detector.process([Document("c", STORY)])[0]).cluster == "a"


def test_full_buckets_still_compare() -> None:
    settings = EngineSettings(max_bucket_size=2, duplicate_buckets="all")
    store = MemoryStateStore(settings.state_shape())
    copies = [Document(f"c{i}", STORY) for i in range(6)]
    out = list(map(_verdict, _run(copies, 2, store, settings)))
    assert [v.verdict for v in out] == ["unique"] + ["duplicate"] * 5
    assert {v.cluster for v in out} == {"c0"}
    assert max(v.candidates for v in out) == 2
    assert store.max_bucket_size() == 2
    members = store.bucket_members(np.unique(_bucket_ids(settings, STORY)))
    assert members.counts.tolist() == [2] * settings.bands.bands
    assert set(members.seqs.tolist()) == {0, 1}  # the first two joined, later copies did not


def _bucket_ids(settings: EngineSettings, text: str) -> np.ndarray:
    return Detector(settings, MemoryStateStore(settings.state_shape())).prepare(
        [Document("x", text)]).buckets[0]


def test_candidates_across_batches_and_within() -> None:
    """Stored members and earlier documents of the same batch are both candidates; a
    document is never its own candidate; a restart rebuilds the bucket index."""
    settings = EngineSettings(duplicate_buckets="all")  # every document joins every bucket
    store = MemoryStateStore(settings.state_shape())
    detector = Detector(settings, store)
    out = [_verdict(r) for r in detector.process([Document("a", STORY), Document("x", UNRELATED)])]
    assert [v.candidates for v in out] == [0, 0]
    out = [_verdict(r) for r in detector.process(
        [Document("b", REFILED), Document("c", STORY), Document("y", UNRELATED)])]
    assert [v.candidates for v in out] == [1, 2, 1]  # b: a; c: a and b; y: x
    assert [v.match for v in out] == ["a", "a", "x"]
    assert store.stats()["index_entries"] == 5 * SETTINGS.bands.bands


def test_duplicates_join_only_new_buckets() -> None:
    """With ``duplicate_buckets="new"`` (the default) a duplicate joins only the buckets
    that hold none of its accepted candidates: exact copies join none, an edited copy
    only the buckets its edit changed, a unique document all."""
    store = MemoryStateStore(SETTINGS.state_shape())
    detector = Detector(SETTINGS, store)
    bands = SETTINGS.bands.bands
    story, refiled = _bucket_ids(SETTINGS, STORY), _bucket_ids(SETTINGS, REFILED)
    changed = int((~np.isin(refiled, story)).sum())
    detector.process([Document("a", STORY), Document("a2", STORY)])
    assert store.stats()["index_entries"] == bands  # the copy joined nothing
    detector.process([Document("b", REFILED), Document("x", UNRELATED)])
    assert store.stats()["index_entries"] == 2 * bands + changed + 1  # and a's copy bucket
    members = store.bucket_members(np.unique(np.concatenate([story, refiled])))
    assert set(members.seqs.tolist()) == {0, 2}  # a, and b where a is not
    assert store.bucket_members(copy_bucket_ids(np.array([0]))).seqs.tolist() == [2]
    # c (a copy of b) meets a where a is, b where b's edit is: both are candidates; b
    # stands in for it everywhere, so it joins no copy bucket either
    c = _verdict(detector.process([Document("c", REFILED)])[0])
    assert (c.candidates, c.match, c.similarity, c.cluster) == (2, "b", 1.0, "a")
    assert store.stats()["index_entries"] == 2 * bands + changed + 1


# --- the Reuters excerpt ----------------------------------------------------------------


@pytest.fixture(scope="module")
def reuters() -> list[Document]:
    with gzip.open(DATA, "rt", encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    assert len(records) == 4000
    return [Document(str(r["id"]), r["text"]) for r in records]


@pytest.fixture(scope="module")
def exact_jaccard(reuters: list[Document]) -> sp.csr_matrix:
    """Exact word-5 Jaccard of every pair sharing a shingle (CSR, zero elsewhere)."""
    batch = shingle_batch([normalize(d.text, SETTINGS.norm) for d in reuters], SETTINGS.shingling)
    rows, cols = [], []
    for d in range(len(reuters)):
        unique = np.unique(batch.hashes[batch.offsets[d] : batch.offsets[d + 1]])
        rows.append(np.full(len(unique), d))
        cols.append(unique)
    _, col_ids = np.unique(np.concatenate(cols), return_inverse=True)
    row_ids = np.concatenate(rows)
    m = sp.csr_matrix(
        (np.ones(len(row_ids), dtype=np.int32), (row_ids, col_ids)),
        shape=(len(reuters), int(col_ids.max()) + 1),
    )
    inter = (m @ m.T).tocoo()
    sizes = np.asarray(m.sum(axis=1)).ravel()
    jac = inter.data / (sizes[inter.row] + sizes[inter.col] - inter.data)
    return sp.csr_matrix((jac, (inter.row, inter.col)), shape=inter.shape)


@pytest.fixture(scope="module")
def rocksdb_verdicts(
    reuters: list[Document], tmp_path_factory: pytest.TempPathFactory
) -> list[Verdict | Rejected]:
    """Default settings, batches of 500, on RocksDB."""
    path = tmp_path_factory.mktemp("reuters") / "state"
    with RocksDBStateStore(path, SETTINGS.state_shape()) as store:
        out = _run(reuters, 500, store)
        assert store.next_seq() == sum(isinstance(r, Verdict) for r in out)
    return out


def test_batch_size_does_not_change_verdicts(
    reuters: list[Document], rocksdb_verdicts: list[Verdict | Rejected]
) -> None:
    by_size = {size: _run(reuters, size) for size in (1, 7, 1000)}
    assert by_size[1] == by_size[7] == by_size[1000] == rocksdb_verdicts
    assert sum(isinstance(r, Verdict) and r.is_duplicate for r in by_size[1]) > 50


def test_quality_on_reuters_excerpt(
    reuters: list[Document],
    exact_jaccard: sp.csr_matrix,
    rocksdb_verdicts: list[Verdict | Rejected],
) -> None:
    """Recall >= 95% at exact Jaccard >= 0.8; every reported match has Jaccard >= 0.6."""
    index = {d.id: i for i, d in enumerate(reuters)}
    earlier = sp.tril(exact_jaccard, k=-1).tocoo()
    should = set(earlier.row[earlier.data >= 0.8].tolist())
    assert len(should) == 112  # as documented in tests/data/README.md

    verdicts = [r for r in rocksdb_verdicts if isinstance(r, Verdict)]
    assert len(verdicts) == len(reuters)
    flagged = {index[v.id]: index[v.match] for v in verdicts if v.is_duplicate and v.match}
    assert len(flagged) == sum(v.is_duplicate for v in verdicts)
    match_jaccard = {d: float(exact_jaccard[d, m]) for d, m in flagged.items()}
    assert all(m < d for d, m in flagged.items())

    found = len(should & flagged.keys())
    recall = found / len(should)
    precision_06 = np.mean([j >= 0.6 for j in match_jaccard.values()])
    precision_08 = np.mean([j >= 0.8 for j in match_jaccard.values()])
    print(
        f"\nreuters excerpt: {len(should)} documents with an earlier partner at J >= 0.8; "
        f"{found} flagged, recall {recall:.4f}; {len(flagged)} flagged in all; "
        f"match J >= 0.6: {precision_06:.4f}, match J >= 0.8: {precision_08:.4f}; "
        f"lowest match J {min(match_jaccard.values()):.3f}"
    )
    assert recall >= 0.95
    assert precision_06 == 1.0, sorted(match_jaccard.items(), key=lambda kv: kv[1])[:5]


def test_prepared_batch_survives_pickling() -> None:
    """A batch prepared in the worker process arrives whole, its fingerprints as one
    array cut by offsets."""
    docs = [Document("a", STORY), Document("e", "  "), Document("b", UNRELATED), Document("c", "x")]
    prepared = Detector(SETTINGS, MemoryStateStore(SETTINGS.state_shape())).prepare(docs)
    copy = pickle.loads(pickle.dumps(prepared))
    assert copy.rejected == prepared.rejected == [None, EMPTY_TEXT, None, None]
    assert copy.fingerprints.dtype == np.uint32 and len(copy.fingerprint_offsets) == 4
    for name in ("valid", "fingerprints", "fingerprint_offsets", "sizes", "bucket_keys",
                 "bucket_entries", "buckets"):
        assert np.array_equal(getattr(copy, name), getattr(prepared, name))
    sets = np.split(copy.fingerprints, copy.fingerprint_offsets[1:-1])
    assert [len(f) for f in sets] == copy.sizes.tolist() and all(len(f) > 0 for f in sets)
    assert all((np.diff(f.astype(np.int64)) > 0).all() for f in sets)  # sorted, distinct
    empty = Detector(SETTINGS, MemoryStateStore(SETTINGS.state_shape())).prepare([Document("e", "")])
    copy = pickle.loads(pickle.dumps(empty))
    assert len(copy.fingerprints) == 0 and copy.fingerprint_offsets.tolist() == [0]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.text(alphabet=st.sampled_from(list("ab_ Ç1\t\n\u00a0\u2003\u3000.-")), max_size=40),
                min_size=1, max_size=6))
def test_prepare_equals_shingling_the_normalised_texts(texts: list[str]) -> None:
    """The preparer skips collapsing white space for word shingles (it changes no word
    token): fingerprints and reject reasons are those of the fully normalised texts."""
    prepared = Detector(SETTINGS, MemoryStateStore(SETTINGS.state_shape())).prepare.texts(texts)
    normalised = [normalize(t, SETTINGS.norm) for t in texts]
    batch = shingle_batch(normalised, SETTINGS.shingling)
    valid = np.flatnonzero(batch.counts > 0)
    assert prepared.valid.tolist() == valid.tolist()
    expected = [sorted({int(h) & 0xFFFFFFFF for h in batch.hashes[batch.offsets[d]:batch.offsets[d + 1]]})
                for d in valid]
    got = np.split(prepared.fingerprints, prepared.fingerprint_offsets[1:-1]) if len(valid) else []
    assert [f.tolist() for f in got] == expected
    assert prepared.rejected == [None if n else (EMPTY_TEXT if not t else NO_TOKENS)
                                 for t, n in zip(normalised, batch.counts.tolist())]


def _copies(reuters: list[Document], stories: int = 150) -> list[Document]:
    """Each of ``stories`` stories followed closely by three copies, each edited anew
    (a word dropped, a footer, both), so that copies of copies share batches."""
    out: list[Document] = []
    for i, d in enumerate(reuters[:stories]):
        words = d.text.split()
        cut = " ".join(words[:len(words) // 2] + words[len(words) // 2 + 1:])
        out += [d, Document(f"{d.id}~cut", cut), Document(f"{d.id}~footer", d.text + " (Reporting by the desk)"),
                Document(f"{d.id}~both", cut + " (Reporting by the desk)")]
        if i % 2:
            out[-8:] = out[-8::2] + out[-7::2]  # interleave two stories' versions
    return out


@pytest.mark.parametrize("duplicate_buckets", ["new", "all"])
def test_batch_size_does_not_change_verdicts_or_buckets_of_copies(
    reuters: list[Document], duplicate_buckets: str
) -> None:
    """Which buckets a duplicate joins depends on its verdict; the document-by-document
    pass makes verdicts and bucket joins those of committing one document at a time."""
    settings = EngineSettings(duplicate_buckets=duplicate_buckets)
    docs = _copies(reuters)
    runs = {}
    for size in (1, 3, 8, len(docs)):
        store = MemoryStateStore(settings.state_shape())
        runs[size] = (_run(docs, size, store, settings), store.stats()["index_entries"])
    assert len({repr(r) for r in runs.values()}) == 1
    verdicts, entries = runs[1]
    duplicates = sum(isinstance(v, Verdict) and v.is_duplicate for v in verdicts)
    assert duplicates >= 400
    bands = settings.bands.bands
    if duplicate_buckets == "all":
        assert entries == len(docs) * bands
    else:
        assert entries < (len(docs) - duplicates / 2) * bands
