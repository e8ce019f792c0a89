"""The retention window in the sharded stages: the sharded rules with a window give one
process's verdicts on the same records in order-key order, the shards drop their expired
members (memory and RocksDB, through the changelog), and the three stages on a real broker
give the reference's verdicts while the shard's state shrinks."""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

import numpy as np
import pytest

from neardup.core.retention import Retention
from neardup.core.settings import EngineSettings
from neardup.core.types import Document, Verdict
from neardup.detector import Detector, Preparer
from neardup.sharded.reference import ShardedReference, run_sharded
from neardup.sharded.shard import ShardIndex
from neardup.state.memory import MemoryStateStore

REUTERS = Path("/work/shared/data/reuters21578/reuters21578.jsonl.gz")
WINDOW = Retention(seconds=300.0)
#: the first document's time, seconds (2020-09-13): the order keys' times are its ms
T0 = 1_600_000_000.0


def _stories(n: int) -> list[tuple[str, str]]:
    out = []
    with gzip.open(REUTERS, "rt", encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            body = (row.get("body") or "").strip()
            if len(body.split()) >= 40:
                out.append((str(row["id"]), body))
            if len(out) == n:
                break
    return out


def _stream(n_stories: int, seed: int = 7, spread: int = 900) -> list[Document]:
    """Reuters stories, each followed by 0 to 3 copies (some exact, some with a word or
    two changed) arriving 1 to ``spread`` documents later; document k is stamped
    ``T0 + k`` seconds, so that with a 300 s window a copy arriving more than 300
    documents after its story no longer meets it (but may meet an earlier copy)."""
    rng = random.Random(seed)
    texts: list[tuple[str, str]] = []
    pending: list[tuple[int, str, str]] = []
    for story_id, text in _stories(n_stories):
        texts.append((story_id, text))
        for k in range(rng.choice((0, 1, 1, 2, 3))):
            words = text.split()
            for _ in range(rng.randint(0, 2)):
                i = rng.randrange(len(words))
                words[i] = words[i][::-1]
            pending.append((len(texts) + rng.randint(1, spread), f"{story_id}~{k}", " ".join(words)))
        pending.sort()
        while pending and pending[0][0] <= len(texts):
            _, doc_id, copy = pending.pop(0)
            texts.append((doc_id, copy))
    texts += [(doc_id, copy) for _, doc_id, copy in pending]
    return [Document(doc_id, text, T0 + k) for k, (doc_id, text) in enumerate(texts)]


def _one_process(docs: list[Document], settings: EngineSettings, retention: Retention | None) -> list[Verdict]:
    detector = Detector(settings, MemoryStateStore(settings.state_shape(), retention=retention))
    out = []
    for i in range(0, len(docs), 400):
        out += detector.process(docs[i:i + 400])
    return out


@pytest.fixture(scope="module")
def stream() -> list[Document]:
    return _stream(1500)


@pytest.fixture(scope="module")
def one(stream) -> list[Verdict]:
    """One process's verdicts with the window."""
    return _one_process(stream, EngineSettings(), WINDOW)


@pytest.mark.parametrize("shards", [1, 4])
def test_sharded_rules_with_a_window_give_one_process_verdicts(stream, one, shards):
    settings = EngineSettings()
    ref = ShardedReference(settings, shards, WINDOW)
    sharded = []
    for i in range(0, len(stream), 700):
        sharded += ref.process(stream[i:i + 700])
    assert len(sharded) == len(one) == len(stream)
    # the window matters on this stream: without it, more copies are found
    unbounded = _one_process(stream, settings, None)
    found, found_unbounded = sum(v.is_duplicate for v in one), sum(v.is_duplicate for v in unbounded)
    assert 500 < found < found_unbounded - 100
    same_verdicts = sum((a.id, a.verdict, a.match) == (b.id, b.verdict, b.match) for a, b in zip(one, sharded))
    same_clusters = sum(a.cluster == b.cluster for a, b in zip(one, sharded))
    print(f"shards={shards}: {len(one)} documents, {found} duplicates (unbounded {found_unbounded}); "
          f"same verdict and match {same_verdicts}, same cluster {same_clusters}")
    assert same_verdicts == len(one)
    assert same_clusters == len(one)
    # the shards removed what expired, and hold about the window (9/8 of it at most)
    assert ref.expired > 0.5 * len(stream)
    for shard in ref.shards:
        assert len(shard.sets) <= 9 / 8 * 300 + 20
    assert len(ref.clusters) <= 9 / 8 * 300 + 20


def test_a_cluster_outlives_its_canonical_in_the_sharded_rules(stream, one):
    """A copy arriving after its story expired joins the cluster through a copy still
    held, and the cluster keeps the story's id, as in one process."""
    settings = EngineSettings()
    sharded = run_sharded(stream, settings, 4, batch_size=500, retention=WINDOW)
    at = {d.id: d.time for d in stream}
    outlived = [b for a, b in zip(one, sharded)
                if b.is_duplicate and at[b.id] - at[b.cluster] > WINDOW.seconds]
    assert len(outlived) >= 5
    assert all(a.cluster == b.cluster for a, b in zip(one, sharded) if b in outlived)


def test_an_expired_member_is_no_candidate_and_is_removed():
    settings = EngineSettings()
    text = _stories(1)[0][1]
    docs = [Document("a", text), Document("b", text), Document("c", text)]
    p = Preparer(settings)(docs)
    fp = p.fingerprints[p.fingerprint_offsets[0]:p.fingerprint_offsets[1]]
    index = ShardIndex(settings, retention_ms=10_000)
    ms = int(T0 * 1000)
    first, _ = index.add(ms << 96, p.buckets[0], fp, "a")
    second, _ = index.add((ms + 10_000) << 96 | 1, p.buckets[1], fp, "b")  # at the floor: held
    third, _ = index.add((ms + 10_001) << 96 | 2, p.buckets[2], fp, "c")  # "a" one ms past it
    assert [c.seq for c in second.checked] == [ms << 96]
    assert [c.seq for c in third.checked] == [(ms + 10_000) << 96 | 1]
    gone = index.expired()
    assert gone == [ms << 96]
    index.remove(gone)
    assert ms << 96 not in index.sets and all(ms << 96 not in m for m in index.buckets.values())


def test_a_window_by_document_count_is_refused_by_the_reference():
    with pytest.raises(ValueError, match="by time only"):
        ShardedReference(EngineSettings(), 2, Retention(documents=10))


def test_a_document_without_time_is_refused_under_a_window():
    ref = ShardedReference(EngineSettings(), 2, WINDOW)
    with pytest.raises(ValueError, match="no time"):
        ref.process([Document("x", "some words of a text that is long enough to shingle")])
