"""The retention window in the sharded stages: the sharded rules with a window give one
process's verdicts on the same records in order-key order, the shards drop their expired
members (memory and RocksDB, through the changelog), and the three stages on a real broker
give the reference's verdicts while the shard's state shrinks."""

from __future__ import annotations

import gzip
from collections import Counter
import json
import random
import time
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
    settings = EngineSettings(duplicate_buckets="all")  # every copy joins its buckets
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
    assert ms << 96 not in index.sets and all(ms << 96 not in index.bucket(b) for b in index.buckets)


def test_a_window_by_document_count_is_refused_by_the_reference():
    with pytest.raises(ValueError, match="by time only"):
        ShardedReference(EngineSettings(), 2, Retention(documents=10))
    with pytest.raises(ValueError, match="canonical cluster policy only"):
        ShardedReference(EngineSettings(cluster_policy="components"), 2, WINDOW)


def test_a_document_without_time_is_refused_under_a_window():
    ref = ShardedReference(EngineSettings(), 2, WINDOW)
    with pytest.raises(ValueError, match="no time"):
        ref.process([Document("x", "some words of a text that is long enough to shingle")])


# --- the stages on a real broker -----------------------------------------------------------

def _produce_stamped(bootstrap: str, topic: str, docs: list[Document]) -> None:
    """Each document as a JSON record stamped with its time (ms)."""
    from confluent_kafka import Producer

    producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True, "linger.ms": 20})
    for d in docs:
        producer.produce(topic, key=d.id.encode(), value=json.dumps({"id": d.id, "text": d.text}).encode(),
                         timestamp=round(1000 * d.time))
    assert producer.flush(60) == 0


def _changelog_members(bootstrap: str, topic: str, partitions: int) -> tuple[
        int, int, dict[tuple[int, bytes], bytes], dict[tuple[int, bytes], bool], dict[tuple[int, bytes], int]]:
    """(members put, members deleted, the members live as (partition, order key) -> the key
    of their ``N`` record, whether each ``N`` record (partition, key) was deleted, the
    lowest band-topic offset each ``N`` record of references refers to) of a
    shard changelog topic, read to its end (read_committed); records of references and of
    values in one run, a
    members record put or deleted twice, or a member put twice, in one partition is a
    defect."""
    from confluent_kafka import Consumer, TopicPartition

    from neardup.state.shard_store import is_refs_value, member_refs, members_parts

    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"changelog-{time.time_ns()}",
                  "isolation.level": "read_committed", "enable.auto.commit": False})
    put: Counter[tuple[int, bytes]] = Counter()
    deleted: Counter[tuple[int, bytes]] = Counter()
    members: dict[tuple[int, bytes], list[bytes]] = {}  # (partition, N key) -> its members' order keys
    kinds: Counter[bool] = Counter()  # N records of references (True) and of values
    floors: dict[tuple[int, bytes], int] = {}
    try:
        for p in range(partitions):
            _, end = c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)
            c.assign([TopicPartition(topic, p, 0)])
            position = 0
            while position < end:
                for m in c.consume(1000, timeout=1.0):
                    if m.error() is not None:
                        continue
                    position = m.offset() + 1
                    assert m.key()[:1] != b"M", "a member record of the earlier layout"
                    if m.key()[:1] == b"N":
                        (deleted if m.value() is None else put)[(p, m.key())] += 1
                        if m.value() is not None:
                            refs = is_refs_value(m.value())
                            kinds[refs] += 1
                            if refs:
                                named = member_refs(m.value())
                                members[(p, m.key())] = [ref[0] for ref in named]
                                floors[(p, m.key())] = min(ref[1] for ref in named)
                            else:
                                members[(p, m.key())] = [order for order, _ in members_parts(m.value())]
                if c.position([TopicPartition(topic, p)])[0].offset >= end:
                    break
    finally:
        c.close()
    assert max(put.values(), default=1) == 1 and max(deleted.values(), default=1) == 1
    each = Counter((p, order) for (p, _), orders in members.items() for order in orders)
    assert max(each.values(), default=1) == 1
    live = {(p, order): key for (p, key), orders in members.items() if (p, key) not in deleted for order in orders}
    assert not (kinds[True] and kinds[False]), kinds  # one kind of N record for the whole run
    return len(each), sum(len(members[k]) for k in deleted), live, {k: k in deleted for k in members}, floors


def _low_watermarks(bootstrap: str, topic: str, partitions: int) -> dict[int, int]:
    """Each partition's first offset (records before it deleted)."""
    from confluent_kafka import Consumer, TopicPartition

    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"watermarks-{time.time_ns()}"})
    try:
        return {p: c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[0] for p in range(partitions)}
    finally:
        c.close()


@pytest.mark.parametrize("state", ["memory", "disk"])
def test_stages_with_a_window_give_the_reference_verdicts_and_shrink_the_shards(
        kafka_bootstrap, kafka_topic_factory, tmp_path, state):
    """Prepare, shard and decide with ``--retention 3s`` (the shard stopped and restarted
    mid-stream: restored from its changelog, or reopened at its store's position) give
    every message once, with the verdicts of the sharded rules run in one process with
    the window; the shards deleted their expired members (changelog deletions, stores
    holding about the window), logged the members as references to their band records,
    and deleted the band records none refers to any more (a restart after that restores
    from the rest)."""
    import uuid

    from kafka_util import read_all
    from test_sharded_kafka import _Stages, _outputs

    from neardup.sharded.topology import Topology
    from neardup.sharded.records import order_seq
    from neardup.state.shard_store import ShardStore

    # stamped 50 ms apart: the first half before now; the second from the time it is
    # produced on (a record stamped more than the reorder window before the wall clock,
    # on a partition read to its end, may come after a later one was released)
    now = time.time()
    docs = [Document(d.id, d.text, now - 10 + 0.05 * k) for k, d in enumerate(_stream(170, seed=11, spread=200))]
    window = Retention(seconds=3.0)
    topic = kafka_topic_factory("sharded-retention", partitions=2)
    topology = Topology(f"retention-{uuid.uuid4().hex[:8]}", shards=4, decide_partitions=2)
    log = tmp_path / "stages.log"
    disk = state == "disk"
    stages = _Stages(kafka_bootstrap, topic, topology, log, reorder_ms=1000, extra=("--retention", "3s"))
    shard_state = ("--state-dir", str(tmp_path / "shard-state")) if disk else ()
    decide_state = ("--state-dir", str(tmp_path / "decide-state")) if disk else ()
    half = len(docs) // 2
    try:
        _produce_stamped(kafka_bootstrap, topic, docs[:half])
        stages.start("prepare")
        stages.start("shard", "a", *shard_state)
        stages.start("decide", "a", *decide_state)
        assert len(_outputs(kafka_bootstrap, topic, half, 120, stages.alive)) >= half, log.read_text()[-3000:]
        assert stages.terminate("shard") == 0, log.read_text()[-3000:]
        later = time.time() + 0.5 - docs[half].time
        docs[half:] = [Document(d.id, d.text, d.time + later) for d in docs[half:]]
        _produce_stamped(kafka_bootstrap, topic, docs[half:])
        stages.start("shard", "a", *shard_state)
        out = _outputs(kafka_bootstrap, topic, len(docs), 120, stages.alive)
    finally:
        stages.stop()
    text = log.read_text()
    assert "Traceback" not in text, text[-3000:]
    assert len(out) == len(docs), text[-3000:]
    assert max(Counter(o.key for o in out).values()) == 1

    # the reference: the sharded rules in one process, in order-key order, same window
    ordered = [m for m in read_all(kafka_bootstrap, [topic], idle_s=1.0)]
    assert len(ordered) == len(docs)
    ref = ShardedReference(EngineSettings(), topology.shards, window)
    reference = {v.id: v for v in ref.process(sorted(docs, key=lambda d: d.time))}
    assert sum(v.is_duplicate for v in reference.values()) >= 60  # the copies the test is about
    got = {o.key.decode(): o for o in out}
    assert set(got) == set(reference)
    differ = [k for k, v in reference.items()
              if (got[k].headers["neardup-verdict"].decode(), got[k].headers["neardup-match"].decode() or None,
                  got[k].headers["neardup-cluster"].decode()) != (v.verdict, v.match, v.cluster)]
    late = [line[:200] for line in text.splitlines() if "came after a later one" in line]
    assert not differ, (differ[:5], late[:3])
    # the window changed verdicts: without it, more copies are found
    unbounded = {v.id: v for v in ShardedReference(EngineSettings(), topology.shards).process(
        sorted(docs, key=lambda d: d.time))}
    assert sum(v.is_duplicate for v in unbounded.values()) > sum(v.is_duplicate for v in reference.values()) + 20

    # the shards deleted their expired members, in the changelog and the stores
    puts, deletes, live, records, floors = _changelog_members(kafka_bootstrap, topology.shard_changelog,
                                                              topology.shards)
    print(f"{state}: {len(docs)} documents; changelog: {puts} members, {deletes} deleted, {len(live)} live, "
          f"{len(records)} members records, {sum(records.values())} deleted")
    assert len(live) == puts - deletes
    # a members record is deleted once its highest member (its key) has left the window:
    # a shard partition's floor is the time of the latest document it processed (at least
    # its latest member's) less 3 s, and its last removal was due at most an eighth of the
    # window before that
    latest_ms = 1000 * max(d.time for d in docs)
    key_ms = {k: order_seq(k[1][1:]) >> 96 for k in records}
    floor = {p: max(t for (q, _), t in key_ms.items() if q == p) - 3000 for p, _ in records}
    assert all(records[k] for k in records if key_ms[k] < floor[k[0]] - 3000 / 8 - 100), "expired, not deleted"
    assert not any(records[k] for k in records if key_ms[k] >= latest_ms - 3000 + 100), "deleted in the window"
    assert deletes >= puts / 3  # of a stream spanning more than 3 windows
    # the members are references to their band records (the stages create the band topic
    # kept for good), and the shards deleted the band records no live N record refers to:
    # every partition's start is past some records, and at or below what is referred to
    assert set(floors) == set(records)
    low = _low_watermarks(kafka_bootstrap, topology.bands, topology.shards)
    print(f"{state}: band topic starts at {low}")
    assert all(low[p] > 0 for p in low), low
    for (p, key), floor in floors.items():
        if not records[(p, key)]:
            assert low[p] <= floor, (p, low[p], floor)
    # and every shard partition restores in full from what is left, in memory and on a new
    # disk (read in changelog order, a deleted N record names band records deleted since)
    from neardup.config import Settings
    from neardup.sharded.records import seq_order
    from neardup.sharded.shard_stage import ShardProcessor

    settings = Settings(bootstrap_servers=kafka_bootstrap, input_topics=[topic], group_id=topology.app)
    for state_dir in (None, tmp_path / "restored"):
        processor = ShardProcessor(settings, topology, state_dir, retention_ms=3000)
        try:
            processor.check(None, [(topology.bands, p) for p in range(topology.shards)])
            for p in range(topology.shards):
                shard = processor.shards[p]
                got = {seq_order(seq) for seq in shard.index.sets} if state_dir is None else \
                    {order for order, _ in shard.store.prefixed(b"M")}
                assert got == {order for q, order in live if q == p}, (state_dir, p)
        finally:
            processor.close()
    latest = latest_ms / 1000
    if disk:  # a store drops each member as it expires: what it holds is live, and in the window
        stored: set[tuple[int, bytes]] = set()
        for p in range(topology.shards):
            store = ShardStore(tmp_path / "shard-state" / f"shard-{p}", lambda band: [])
            try:
                stored |= {(p, k) for k, _ in store.prefixed(b"M")}
            finally:
                store.close()
        assert stored <= set(live), len(stored - set(live))
        assert all(order_seq(k) >> 96 >= 1000 * (latest - 3 * 9 / 8) - 100 for _, k in stored)
        held = {k for k in live if order_seq(k[1]) >> 96 >= 1000 * latest - 3000 + 100}  # never past the floor
        assert held <= stored, len(held - stored)


def test_a_store_drops_a_deleted_member_from_its_bucket_and_copy_lists(tmp_path):
    """``ShardStore.apply``: a member's null record (expired) takes it out of every bucket
    and copy-bucket list it joined (its bucket keys go), drops its own copy bucket; a deletion applied again (or of a member never here) changes nothing."""
    from neardup.sharded.records import BandRecord, order_key
    from neardup.state.shard_store import ShardStore, member_value

    def member(ms: int, buckets: list[int], copies: list[bytes]) -> tuple[bytes, bytes]:
        order = order_key(ms, 0, ms)
        band = BandRecord(order, f"d{ms}", np.array(buckets, dtype=np.uint64), np.arange(5, dtype=np.uint32))
        return b"M" + order, member_value(copies, band.value())

    store = ShardStore(tmp_path / "s", lambda band: BandRecord.parse(bytes(20), band).buckets.tolist())
    try:
        a, b, c = member(1000, [1, 2], []), member(2000, [2, 3], [order_key(1000, 0, 1000)]), member(3000, [3], [])
        store.apply([a, b, c], position=3)
        assert [len(m) for m in store.members([1, 2, 3])] == [1, 2, 2]
        assert store.copies(order_key(1000, 0, 1000)) == [order_key(2000, 0, 2000)]
        assert store.members_before(2500) == [order_key(1000, 0, 1000), order_key(2000, 0, 2000)]
        store.apply([(a[0], None)], position=4)
        assert store.members([1, 2, 3]) == [[], [order_key(2000, 0, 2000)], [order_key(2000, 0, 2000),
                                                                               order_key(3000, 0, 3000)]]
        assert store.copies(order_key(1000, 0, 1000)) == []
        store.apply([(b[0], None), (a[0], None)], position=6)
        assert store.members([1, 2, 3]) == [[], [], [order_key(3000, 0, 3000)]]
        assert store.members_before(10_000) == [order_key(3000, 0, 3000)]
        assert [k[:8] for k, _ in store.prefixed(b"B")] == [(3).to_bytes(8, "big")]  # the others' keys go
        store.close()
        store = ShardStore(tmp_path / "s", lambda band: BandRecord.parse(bytes(20), band).buckets.tolist())
        assert store.members([1, 2, 3]) == [[], [], [order_key(3000, 0, 3000)]]  # as read again from the keys
    finally:
        store.close()


@pytest.mark.parametrize("kind", ["memory", "disk"])
def test_the_decisions_table_drops_expired_decisions_and_keeps_canonical_names(tmp_path, kind):
    """``expire_before``: the decisions stamped before the time go (on disk: across a
    reopen); a held decision whose canonical went still names it; a lookup of a dropped
    one is its own cluster (counted); the topic's older records are not taken back."""
    from neardup.sharded.records import order_key, order_seq
    from neardup.state.decisions import DecisionsTable, StoredDecisionsTable

    def seq(ms: int) -> int:
        return order_seq(order_key(ms, 0, ms))

    def table():
        return DecisionsTable() if kind == "memory" else StoredDecisionsTable(tmp_path / "t")

    t = table()
    try:
        t.apply([(seq(1000), seq(1000), "story"), (seq(2000), seq(1000), "story"),
                 (seq(3000), seq(3000), "other"), (seq(4000), seq(1000), "story")], position=4)
        t.expire_before(2500)
        assert t.expired_below() == 2500
        assert t[seq(4000)] == seq(1000) and t[seq(3000)] == seq(3000)
        assert t.name(seq(1000)) == "story"  # the cluster outlives its canonical
        assert seq(1000) in t and t[seq(2000)] == seq(2000) and t.fallbacks == 1
        with pytest.raises(KeyError):
            t[seq(5000)]
        t.apply([(seq(2000), seq(1000), "story")], position=5)  # read again: not kept
        assert t[seq(2000)] == seq(2000)
    finally:
        t.close()
    if kind == "disk":
        t = table()
        try:
            assert t.expired_below() == 2500 and t[seq(4000)] == seq(1000) and t.name(seq(1000)) == "story"
            assert t[seq(2000)] == seq(2000)
        finally:
            t.close()


@pytest.mark.parametrize("flag, value, line", [
    ("--retention-documents", "1000", "neardup stage keeps a retention window by time only (--retention): a window "
     "of the last N documents (--retention-documents) needs one count of every document, which no shard has"),
    ("--timestamp-field", "published", "neardup stage takes a document's time from its record timestamp, which "
     "orders the shards (--timestamp-field is not read): stamp the input records with the document time instead"),
    ("--retention", "3 parsecs", "not a duration: '3 parsecs' (e.g. 72h, 7d, 30m, 3600)"),
    ("--cluster-policy", "components", "neardup stage keeps a retention window with the canonical cluster policy "
     "only: a merged cluster's root may be older than the window (use neardup run for both)"),
])
def test_a_stage_refuses_a_window_it_cannot_keep_with_one_line(flag, value, line, capsys):
    from neardup.cli import main

    window = ["--retention", "1h"] if flag == "--cluster-policy" else []
    assert main(["stage", "shard", "--bootstrap-servers", "127.0.0.1:9", "--input-topic", "t", *window,
                 flag, value]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == f"neardup: error: {line}" and "Traceback" not in err
