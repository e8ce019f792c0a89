"""The retention window: verdicts against a brute-force reference, independence of batch
boundaries and restarts, expired documents leaving memory and disk, clusters outliving
their canonical, changing the window on an existing state, flags and metrics."""

from __future__ import annotations

import gzip
import json
import logging
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from rocksdict import Options, Rdict

from neardup.core.lsh import copy_bucket_ids
from neardup.core.retention import Retention, parse_duration
from neardup.core.settings import EngineSettings
from neardup.core.types import Document, Verdict
from neardup.detector import Detector
from neardup.metrics import Metrics
from neardup.records import RecordError, record_time
from neardup.state import codec
from neardup.state.memory import MemoryStateStore
from neardup.state.rocksdb import RocksDBStateStore

EXCERPT = Path(__file__).parent / "data" / "reuters_excerpt.jsonl.gz"
#: Every bucket member is a candidate and every document joins every bucket: the
#: candidates are exactly the documents sharing a band bucket (the brute-force rule).
ALL_PAIRS = EngineSettings(duplicate_buckets="all", max_bucket_size=1 << 20, max_candidates=1 << 20,
                           cluster_policy="components")


def _stream(n_stories: int = 1200, seed: int = 3) -> list[Document]:
    """Stories of the excerpt, each followed by 0 to 2 lightly edited copies arriving 1 to
    900 documents later; document k has time 1000 + k seconds."""
    rows = [json.loads(line) for line in gzip.open(EXCERPT, "rt")][:n_stories]
    rng = random.Random(seed)
    texts: list[tuple[str, str]] = []
    pending: list[tuple[int, str, str]] = []
    for row in rows:
        texts.append((str(row["id"]), row["text"]))
        for k in range(rng.randint(0, 2)):
            words = row["text"].split()
            if len(words) > 10:
                i = rng.randrange(len(words))
                words[i] = words[i][::-1]
            pending.append((len(texts) + rng.randint(1, 900), f"{row['id']}~{k}", " ".join(words)))
        pending.sort()
        while pending and pending[0][0] <= len(texts):
            _, doc_id, text = pending.pop(0)
            texts.append((doc_id, text))
    texts += [(doc_id, text) for _, doc_id, text in pending]
    return [Document(doc_id, text, 1000.0 + k) for k, (doc_id, text) in enumerate(texts)]


def _run(settings: EngineSettings, store, docs: list[Document], batch: int) -> list[Verdict]:
    detector = Detector(settings, store)
    out: list[Verdict] = []
    for start in range(0, len(docs), batch):
        result = detector.detect(docs[start:start + batch])
        store.commit(result.update)
        out += result.verdicts
    return out


def _brute_force(settings: EngineSettings, docs: list[Document], held) -> list[tuple]:
    """(verdict, match id, candidates) of each document compared with the documents
    ``held(x, y)`` before it that share a band bucket, by exact Jaccard."""
    p = Detector(settings, MemoryStateStore(settings.state_shape())).prepare(docs)
    assert len(p.valid) == len(docs)
    buckets = p.buckets
    sets = [set(p.fingerprints[p.fingerprint_offsets[i]:p.fingerprint_offsets[i + 1]].tolist())
            for i in range(len(docs))]
    out = []
    for x in range(len(docs)):
        best, best_similarity, candidates = None, -1.0, 0
        shared = np.flatnonzero((buckets[:x] == buckets[x]).any(axis=1))
        for y in shared.tolist():
            if not held(x, y):
                continue
            candidates += 1
            jaccard = len(sets[x] & sets[y]) / len(sets[x] | sets[y])
            if jaccard >= settings.threshold and jaccard > best_similarity:
                best, best_similarity = y, jaccard
        out.append(("unique" if best is None else "duplicate", None if best is None else docs[best].id, candidates))
    return out


def test_count_window_equals_comparing_each_document_with_the_window_before_it(tmp_path: Path) -> None:
    docs = _stream()
    window = 300
    with RocksDBStateStore(tmp_path / "state", ALL_PAIRS.state_shape(), retention=Retention(documents=window)) as store:
        got = _run(ALL_PAIRS, store, docs, batch=97)
        assert store.stats()["documents_held"] == window
    expected = _brute_force(ALL_PAIRS, docs, lambda x, y: y >= x - window)
    assert [(v.verdict, v.match, v.candidates) for v in got] == expected
    dups = sum(e[0] == "duplicate" for e in expected)
    everything = _brute_force(ALL_PAIRS, docs, lambda x, y: True)
    assert 100 < dups < sum(e[0] == "duplicate" for e in everything)  # the window matters


def test_time_window_with_times_out_of_order_equals_the_watermark_rule(tmp_path: Path) -> None:
    rng = random.Random(11)
    docs = [Document(d.id, d.text, d.time + rng.uniform(-60, 60)) for d in _stream()]  # type: ignore[operator]
    seconds = 250.0
    with RocksDBStateStore(tmp_path / "state", ALL_PAIRS.state_shape(), retention=Retention(seconds=seconds)) as store:
        got = _run(ALL_PAIRS, store, docs, batch=200)
    times = np.array([d.time for d in docs])
    marks = np.maximum.accumulate(times)  # the watermark at each document, its own time included
    expected = _brute_force(ALL_PAIRS, docs, lambda x, y: times[y] >= marks[x] - seconds)
    assert [(v.verdict, v.match, v.candidates) for v in got] == expected


def _verdicts(vs: list[Verdict]) -> list[tuple]:
    return [(v.verdict, v.match, v.cluster, v.related, round(v.similarity, 9), v.candidates,
             v.rejected, v.cluster_size) for v in vs]


@pytest.mark.parametrize("retention", [Retention(documents=250), Retention(seconds=200.0),
                                       Retention(documents=400, seconds=150.0)])
@pytest.mark.parametrize("settings", [EngineSettings(max_bucket_size=3), EngineSettings(cluster_policy="components")])
def test_verdicts_do_not_depend_on_batches_restarts_or_removal(tmp_path: Path, retention: Retention,
                                                               settings: EngineSettings) -> None:
    rng = random.Random(5)
    docs = [Document(d.id, d.text, d.time + rng.uniform(-40, 40)) for d in _stream(900)]  # type: ignore[operator]
    with RocksDBStateStore(tmp_path / "a", settings.state_shape(), retention=retention) as store:
        whole = _run(settings, store, docs, batch=1000)
    one_by_one = _run(settings, MemoryStateStore(settings.state_shape(), retention=retention), docs, batch=1)
    restarted: list[Verdict] = []
    for part in (docs[:333], docs[333:700], docs[700:]):  # reopened twice; batches of 41
        with RocksDBStateStore(tmp_path / "b", settings.state_shape(), retention=retention) as store:
            restarted += _run(settings, store, part, batch=41)
    assert _verdicts(whole) == _verdicts(one_by_one) == _verdicts(restarted)
    assert any(v.is_duplicate for v in whole)


def test_no_window_and_a_window_longer_than_the_stream_agree() -> None:
    docs = _stream(600)
    settings = EngineSettings()
    plain = _run(settings, MemoryStateStore(settings.state_shape()), docs, batch=97)
    long = _run(settings, MemoryStateStore(settings.state_shape(), retention=Retention(documents=10**6)), docs, batch=97)
    assert _verdicts(plain) == _verdicts(long)


def _keys(path: Path, family: str) -> list[int]:
    families = {name: Options(raw_mode=True) for name in codec.FAMILIES}
    db = Rdict(str(path), Options(raw_mode=True), column_families=families)
    try:
        cf = db.get_column_family(family)
        keys = [int.from_bytes(k, "big") for k in cf.keys()]
        cf.close()
        return keys
    finally:
        db.close()


def test_expired_documents_leave_the_index_the_set_cache_and_the_disk(tmp_path: Path) -> None:
    docs = _stream(900)
    window = 200
    settings = EngineSettings()
    path = tmp_path / "state"
    with RocksDBStateStore(path, settings.state_shape(), retention=Retention(documents=window)) as store:
        _run(settings, store, docs, batch=50)
        base = store.forest.base
        n = store.next_seq()
        assert n - window - window // 8 - 50 <= base <= n - window  # removed in steps of an eighth
        # the documents' band buckets and every copy bucket (``neardup.core.decide.CopyBuckets``)
        members = store.index.lookup(np.unique(np.concatenate([
            Detector(settings, store).prepare(docs).buckets.ravel(), copy_bucket_ids(np.arange(n))])))
        assert len(members.seqs) and members.seqs.min() >= base
        assert len(store.index) == len(members.seqs)
        assert not store.sets.lookup(np.arange(base))[0].any()
        stats = store.stats()
        assert stats["documents_held"] == window and stats["documents_expired"] == n - window
        assert stats["expired_removed"] == base
        kept = [seq for seq in store._kept]  # expired canonicals of clusters still held
    for family in ("shingles", "nodes"):
        assert min(_keys(path, family)) >= base
    documents = _keys(path, "documents")
    assert sorted(seq for seq in documents if seq < base) == sorted(kept)
    assert len(kept) < window
    batches = _keys(path, "buckets") + _keys(path, "times")
    assert min(batches) > base - 50  # only batch records reaching the held documents
    with RocksDBStateStore(path, settings.state_shape()) as store:  # the window is stored
        assert store.retention == Retention(documents=window)
        assert store.forest.base == base and len(store.index) == len(members.seqs)


def _story(n: int) -> str:
    return " ".join(f"w{n}x{k}" for k in range(60))


def _filler(start: int, count: int) -> list[Document]:
    return [Document(f"f{k}", _story(k)) for k in range(start, start + count)]


def _edit(text: str, k: int) -> str:
    words = text.split()
    words[k] = "edited"
    return " ".join(words)


@pytest.mark.parametrize("policy", ["canonical", "components"])
def test_a_cluster_outlives_its_canonical(tmp_path: Path, policy: str) -> None:
    settings = EngineSettings(cluster_policy=policy)
    path = tmp_path / "state"
    story = _story(10_000)
    retention = Retention(documents=20)
    with RocksDBStateStore(path, settings.state_shape(), retention=retention) as store:
        detector = Detector(settings, store)
        first = detector.process([Document("A", story), Document("A1", _edit(story, 1))])
        assert first[1].cluster == "A" and first[1].match == "A"
        detector.process(_filler(0, 15))
        detector.process([Document("A2", _edit(story, 2))])  # A still held: 17 documents back
        detector.process(_filler(15, 25))  # A, A1 and A2 expire (and are removed)
        assert store.forest.base > 0 and store.retention_stats()["documents_held"] == 20
    with RocksDBStateStore(path, settings.state_shape()) as store:  # after a restart too
        detector = Detector(settings, store)
        [late] = detector.process([Document("A3", _edit(story, 3))])
        assert late.verdict == "unique"  # every member expired: nothing held to match
        assert late.cluster == "A3"
    with RocksDBStateStore(tmp_path / "held", settings.state_shape(), retention=retention) as store:
        detector = Detector(settings, store)
        detector.process([Document("A", story)])
        detector.process(_filler(0, 12))
        detector.process([Document("A1", _edit(story, 1))])
        detector.process(_filler(12, 12))  # A expires and is removed; A1 is held
        assert store.forest.base > 0 and store.get_times(np.array([0]))[0] < 0
        [copy] = detector.process([Document("A2", _edit(story, 2))])
        assert copy.verdict == "duplicate" and copy.match == "A1"
        assert copy.cluster == "A"  # the expired canonical's id stays the cluster id
        assert copy.cluster_size == 3 and copy.related is None
        detector.process(_filler(24, 25))  # now every member has expired
        assert "A" not in store.get_ids(list(store._kept))  # its record went with the last member


def test_shortening_expires_at_once_and_lengthening_brings_nothing_back(tmp_path: Path, caplog) -> None:
    settings = EngineSettings()
    path = tmp_path / "state"
    docs = _stream(400)
    with RocksDBStateStore(path, settings.state_shape()) as store:
        _run(settings, store, docs, batch=100)
        n = store.next_seq()
        assert store.stats()["documents_held"] == n and store.retention == Retention()
    with RocksDBStateStore(path, settings.state_shape(), retention={"documents": 100}) as store:
        assert store.stats()["documents_held"] == 100
        assert store.forest.base == n - 100  # removed at once, before any new document
        assert min(_keys_open(store)) >= n - 100
    caplog.set_level(logging.INFO, logger="neardup.state.kv")
    with RocksDBStateStore(path, settings.state_shape(), retention={"documents": 1000, "seconds": 3600.0}) as store:
        assert store.retention == Retention(documents=1000, seconds=3600.0)
        assert store.stats()["documents_held"] == 100  # what expired stays expired
    assert any("stay forgotten" in r.getMessage() for r in caplog.records)
    with RocksDBStateStore(path, settings.state_shape(), retention={"seconds": None}) as store:
        assert store.retention == Retention(documents=1000)  # only the bound named changes


def _keys_open(store: RocksDBStateStore) -> list[int]:
    return [int.from_bytes(k, "big") for k in store._families["shingles"].keys()]


def test_metrics_report_held_expired_and_the_oldest_age() -> None:
    settings = EngineSettings()
    store = MemoryStateStore(settings.state_shape(), retention=Retention(documents=50))
    _run(settings, store, _stream(120), batch=40)
    metrics = Metrics()
    metrics.refresh_state(store, force=True)
    text = metrics.exposition().decode()
    n = store.next_seq()
    assert "neardup_documents_held 50.0" in text
    assert f"neardup_documents_expired_total {float(n - 50)}" in text
    age = float(next(line.split()[1] for line in text.splitlines()
                     if line.startswith("neardup_oldest_held_age_seconds ")))
    oldest = 1000.0 + n - 50  # the stream's times: 1000 + k seconds
    import time
    assert abs(age - (time.time() - oldest)) < 60


def test_durations_and_timestamps_are_parsed() -> None:
    assert parse_duration("72h") == 259200 and parse_duration("7d") == 604800
    assert parse_duration("90") == 90 and parse_duration("1.5m") == 90
    for bad in ("3x", "", "-1h", "0s"):
        with pytest.raises(ValueError):
            parse_duration(bad)
    assert record_time({"t": "2026-01-01T00:00:00Z"}, "t") == 1767225600.0
    assert record_time({"t": "2026-01-01T01:00:00+01:00"}, "t") == 1767225600.0
    assert record_time({"t": "2026-01-01 00:00:00"}, "t") == 1767225600.0  # UTC without a zone
    assert record_time({"m": {"t": 1767225600}}, "m.t") == 1767225600.0
    for bad in ({"t": "yesterday"}, {}, {"t": [1]}):
        with pytest.raises(RecordError):
            record_time(bad, "t")


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "neardup.cli", *args], cwd=cwd, capture_output=True, text=True)


def test_dedup_with_a_time_window_by_timestamp_field(tmp_path: Path) -> None:
    text = "the quick brown fox jumps over the lazy dog near the river bank this morning"
    rows = [{"id": "a", "text": text, "ts": "2026-01-01T00:00:00Z"},
            {"id": "b", "text": text, "ts": "2026-01-02T00:00:00Z"},  # a is 24 h old: held
            {"id": "c", "text": text, "ts": "2026-01-06T00:00:00Z"},  # b is 96 h old: expired
            {"id": "d", "text": "other words", "ts": "soon"}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    done = _cli("dedup", "in.jsonl", "--state-dir", "st", "--out-dir", "out", "--retention", "72h",
                "--timestamp-field", "ts", "--no-pipeline", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    unique = [json.loads(line)["id"] for line in (tmp_path / "out" / "unique.jsonl").read_text().splitlines()]
    dups = [json.loads(line) for line in (tmp_path / "out" / "duplicates.jsonl").read_text().splitlines()]
    assert unique == ["a", "c"] and [(d["id"], d["neardup"]["match"]) for d in dups] == [("b", "a")]
    [reject] = [json.loads(line) for line in (tmp_path / "out" / "rejects.jsonl").read_text().splitlines()]
    assert "timestamp field 'ts'" in reject["reason"]
    bad = _cli("dedup", "in.jsonl", "--out-dir", "out2", "--retention", "3 parsecs", cwd=tmp_path)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "neardup: error: not a duration: '3 parsecs' (e.g. 72h, 7d, 30m, 3600)"]
    bad = _cli("dedup", "in.jsonl", "--out-dir", "out2", "--retention-documents", "0", cwd=tmp_path)
    assert bad.returncode == 2 and "--retention-documents" in bad.stderr and "Traceback" not in bad.stderr


def test_dedup_resumes_on_a_state_whose_documents_expired(tmp_path: Path) -> None:
    """A second `dedup` on a state dir from which the count window removed documents starts
    (the ids of the expired documents are no longer known, and not needed), and a rerun
    over the same file adds nothing."""
    rows = [{"id": f"d{i}", "text": f"story number {i} " + " ".join(f"w{i}x{j}" for j in range(20))}
            for i in range(6)]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "more.jsonl").write_text(json.dumps({"id": "d0", "text": rows[0]["text"]}) + "\n")
    first = _cli("dedup", "in.jsonl", "--state-dir", "st", "--out-dir", "out", "--retention-documents", "2",
                 "--no-pipeline", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    again = _cli("dedup", "in.jsonl", "--state-dir", "st", "--out-dir", "out", "--no-pipeline", cwd=tmp_path)
    assert again.returncode == 0 and "Traceback" not in again.stderr, again.stderr
    assert len((tmp_path / "out" / "unique.jsonl").read_text().splitlines()) == 6
    more = _cli("dedup", "more.jsonl", "--state-dir", "st", "--out-dir", "out", "--no-pipeline", cwd=tmp_path)
    assert more.returncode == 0 and "Traceback" not in more.stderr, more.stderr
    # d0 expired: its copy is unique again, and keeps its id (the expired one's is forgotten)
    unique = [json.loads(line)["id"] for line in (tmp_path / "out" / "unique.jsonl").read_text().splitlines()]
    assert unique == [f"d{i}" for i in range(6)] + ["d0"]
