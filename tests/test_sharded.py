"""The sharded rules (``neardup.sharded``) against one process, in one process."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import given, settings as hsettings, strategies as st

from neardup.core.settings import EngineSettings
from neardup.core.shingle import Shingling
from neardup.core.types import Document, Verdict
from neardup.detector import Detector, Preparer
from neardup.sharded.reference import run_sharded
from neardup.sharded.records import (
    BAND_ENTRY_BYTES,
    BandRecord,
    band_orders,
    band_values,
    bands_value,
    batch_bands,
    DOCUMENTS_FIXED_BYTES,
    DocumentEntry,
    decisions_value,
    document_entry_bytes,
    documents_count,
    documents_value,
    findings_value,
    found_value,
    order_key,
    parse_bands,
    parse_sets,
    parse_sets_ref,
    parse_decisions,
    parse_documents,
    parse_findings,
    parse_findings_columns,
    sets_ref,
    sets_values,
)
from neardup.sharded.routing import group_by_shard, owned_bands, shard_bounds, shard_of
from neardup.state.memory import MemoryStateStore
from test_quality import _chains, _excerpt


def _one_process(docs: list[Document], settings: EngineSettings) -> list[Verdict]:
    detector = Detector(settings, MemoryStateStore(settings.state_shape()))
    out = []
    for i in range(0, len(docs), 500):
        out += detector.process(docs[i:i + 500])
    return out


def _republished(docs: list[Document], rounds: int, seed: int) -> list[Document]:
    """The stories, then ``rounds`` rounds of copies, each with a few words dropped or
    replaced, so that copies of copies drift away from the first version."""
    rng = np.random.default_rng(seed)
    out = list(docs)
    previous = {d.id: d.text.split() for d in docs}
    for r in range(1, rounds + 1):
        for d in docs:
            words = list(previous[d.id])
            for _ in range(int(rng.integers(1, 6))):
                at = int(rng.integers(len(words)))
                if rng.random() < 0.5 and len(words) > 1:
                    del words[at]
                else:
                    words[at] = f"w{rng.integers(10**6)}"
            previous[d.id] = words
            out.append(Document(f"{d.id}~r{r}", " ".join(words)))
    return out


@given(st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=64), st.integers(1, 40))
@hsettings(max_examples=50, deadline=None)
def test_every_band_has_one_owner(buckets, shards):
    ids = np.array(buckets, dtype=np.uint64)
    owner = shard_of(ids, shards)
    assert ((owner >= 0) & (owner < shards)).all()
    parts = owned_bands(ids, shards)
    assert sorted(np.concatenate(parts).tolist()) == list(range(len(ids)))
    for p, bands in enumerate(parts):
        assert (owner[bands] == p).all()


@given(st.lists(st.lists(st.integers(0, 2**64 - 1), min_size=9, max_size=9), min_size=1, max_size=20),
       st.integers(1, 20))
@hsettings(max_examples=50, deadline=None)
def test_a_batch_grouped_by_shard_is_each_documents_owned_bands(rows, shards):
    buckets = np.array(rows, dtype=np.uint64)
    grouped, bounds = group_by_shard(buckets, shards)
    for i, row in enumerate(buckets):
        for q, bands in enumerate(owned_bands(row, shards)):
            assert grouped[i, bounds[i][q]:bounds[i][q + 1]].tolist() == row[bands].tolist()


def test_band_and_findings_records_read_back_as_written():
    rng = np.random.default_rng(3)
    fp = np.unique(rng.integers(0, 2**32, size=50, dtype=np.uint64)).astype(np.uint32)
    parts = [rng.integers(0, 2**63, size=k, dtype=np.uint64) for k in (1, 3)]
    key = order_key(1_700_000_000_000, 2, 77)
    for b, value in zip(parts, band_values("doc-é", parts, fp)):  # a member's value
        rec = BandRecord.parse(key, value)
        assert (rec.id, rec.buckets.tolist(), rec.fingerprints.tolist()) == ("doc-é", b.tolist(), fp.tolist())
    # a band record: documents of one batch as columns, any id (empty included), any set
    orders = [key, order_key(1_700_000_000_000, 0, 3), order_key(1_699_999_999_999, 1, 8)]
    sets = [fp, fp[:1], np.zeros(0, np.uint32)]
    for ids in (["doc-é", "", "x" * 300], ["doc-1", "", "x" * 300]):  # ids read in one decode when ASCII
        value = bands_value(orders, [i.encode() for i in ids], [parts[1], parts[0], parts[0][:0]], sets)
        assert [(r.order, r.id, r.buckets.tolist(), r.fingerprints.tolist()) for r in parse_bands(value)] == [
            (o, i, b.tolist(), f.tolist()) for o, i, b, f in zip(orders, ids, [parts[1], parts[0], parts[0][:0]], sets)]
    assert parse_bands(bands_value([], [], [], [])) == []
    assert band_orders(value) == orders
    for cut in (value[:-1], value[:30], value + b"\x00"):
        with pytest.raises(ValueError):
            parse_bands(cut)
    earlier = order_key(1_699_999_999_000, 0, 5)
    found = [found_value(key, 3, [(earlier, "x", 0.5, 0.75, 0.5), (earlier, "ü", 1.0, 1.0, 1.0)]),
             found_value(earlier, 0, [], "malformed_band_record: cut short")]
    assert parse_findings(findings_value(found)) == [
        (key, 3, [(1_699_999_999_000, 0, 5, "x", 0.5, 0.75, 0.5), (1_699_999_999_000, 0, 5, "ü", 1.0, 1.0, 1.0)],
         None),
        (earlier, 0, [], "malformed_band_record: cut short")]
    with pytest.raises(ValueError):
        parse_findings(findings_value(found)[:-1])
    # the findings without a candidate go as columns, after the others
    columns = findings_value(found[:1], [earlier, key], [1, 2])
    assert parse_findings_columns(columns) == (parse_findings(findings_value(found[:1])), [earlier, key], [1, 2])
    assert parse_findings(columns)[1:] == [(earlier, 1, [], None), (key, 2, [], None)]
    for cut in (columns[:-1], columns[:-4], columns[:-6], columns + b"\x00"):
        with pytest.raises(ValueError):
            parse_findings(cut)
    # a record of the earlier version, without the columns, is read as it was
    assert parse_findings_columns(b"".join([struct.pack(">I", 2), *found])) == (parse_findings(findings_value(found)), [], [])


def test_buckets_spread_evenly_over_shards():
    ids = np.random.default_rng(1).integers(0, 2**64 - 1, size=80_000, dtype=np.uint64, endpoint=True)
    counts = np.bincount(shard_of(ids, 8), minlength=8)
    assert counts.min() > 0.95 * 10_000 and counts.max() < 1.05 * 10_000


def test_shards_below_one_are_refused():
    with pytest.raises(ValueError, match="at least 1"):
        shard_of(np.zeros(1, np.uint64), 0)


@pytest.mark.parametrize("shards", [1, 3, 8])
def test_sharded_verdicts_are_those_of_one_process(shards):
    docs = _republished(_excerpt()[:1500], rounds=3, seed=shards)
    settings = EngineSettings()
    one = _one_process(docs, settings)
    sharded = run_sharded(docs, settings, shards, batch_size=700)
    assert len(sharded) == len(one)
    assert sum(v.is_duplicate for v in one) > 1500  # the copies the test is about
    assert [(v.id, v.verdict, v.match) for v in sharded] == [(v.id, v.verdict, v.match) for v in one]
    same_cluster = sum(a.cluster == b.cluster for a, b in zip(one, sharded))
    assert same_cluster >= 0.999 * len(one)


def test_a_chain_of_edits_is_found_through_a_shards_copy_bucket():
    docs = _chains(300, seed=3)
    settings = EngineSettings(shingling=Shingling.parse("word:5"), threshold=0.9)
    one = _one_process(docs, settings)
    sharded = run_sharded(docs, settings, 4)
    assert sum(v.is_duplicate for v in one) == 600
    assert [(v.verdict, v.match) for v in sharded] == [(v.verdict, v.match) for v in one]


def _bridged(stories: list[Document]) -> list[Document]:
    """Each story's first and last 70% of words (two clusters at Jaccard 0.5: their
    overlap is too small), then the whole stories, each similar to both halves."""
    halves, wholes = [], []
    for d in stories:
        words = d.text.split()
        if len(words) >= 40:
            k = int(len(words) * 0.7)
            halves += [Document(f"{d.id}~head", " ".join(words[:k])), Document(f"{d.id}~tail", " ".join(words[-k:]))]
            wholes.append(Document(f"{d.id}~whole", d.text))
    return halves + wholes


@pytest.mark.parametrize("shards", [1, 4])
def test_the_components_policy_gives_one_process_clusters(shards, monkeypatch):
    # copies of copies drift (a chain of edits is one cluster under components), and a
    # whole story merges the clusters of its two halves into the earlier one
    import neardup.sharded.reference as reference

    stories = _excerpt()
    docs = _republished(stories[:1000], rounds=2, seed=5) + _bridged(stories[1000:1300])
    settings = EngineSettings(cluster_policy="components", threshold=0.5)
    merges, rule = [], reference.decide

    def counted(*args, **kwargs):  # the rule itself, its merges counted
        verdict, cluster, merged = rule(*args, **kwargs)
        merges.extend(merged)
        return verdict, cluster, merged

    monkeypatch.setattr(reference, "decide", counted)
    one = _one_process(docs, settings)
    sharded = run_sharded(docs, settings, shards, batch_size=700)
    assert len(merges) > 200  # the merges the test is about
    assert [(v.id, v.verdict, v.match, v.cluster) for v in sharded] == [(v.id, v.verdict, v.match, v.cluster) for v in one]
    assert all(v.related is None for v in sharded)
    # the policies differ on these documents, so the comparison above is about components
    canonical = _one_process(docs, EngineSettings(threshold=0.5))
    assert sum(a.cluster != b.cluster for a, b in zip(one, canonical)) > 200


@pytest.mark.parametrize("flag, value, line", [
    ("--verify", "estimate", "neardup stage verifies exactly only (--verify exact)"),
])
def test_a_stage_refuses_what_the_sharded_rules_do_not_implement(flag, value, line, capsys):
    from neardup.cli import main

    assert main(["stage", "shard", "--bootstrap-servers", "127.0.0.1:9", "--input-topic", "t", flag, value]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"neardup: error: {line}"


def test_a_document_processed_late_meets_only_earlier_members():
    """The reorder window let a document through after a later near-duplicate: it meets the
    earlier members only (so it never waits for the later one's decision, which may wait
    for its own), and still joins its buckets for the documents after both."""
    from neardup.detector import Preparer
    from neardup.sharded.shard import ShardIndex

    settings = EngineSettings()
    text = _excerpt()[0].text
    words = text.split()
    docs = [Document(str(i), " ".join(words[:-i] if i else words)) for i in range(4)]
    p = Preparer(settings)(docs)
    fingerprints = [p.fingerprints[p.fingerprint_offsets[i]:p.fingerprint_offsets[i + 1]] for i in range(4)]
    index = ShardIndex(settings)
    seqs = {"0": 10, "1": 30, "2": 20, "3": 40}  # "2" comes after "1", though it is earlier
    found = {}
    for i, d in enumerate(docs):
        finding, _ = index.add(seqs[d.id], p.buckets[i], fingerprints[i], d.id)
        found[d.id] = {c.seq for c in finding.checked}
    assert found["0"] == set() and found["1"] == {10}
    assert found["2"] == {10}, "the late document met a later one"
    assert found["3"] == {10, 20, 30}, "the late document did not join its buckets"


def test_the_prepare_stage_refuses_a_state_dir(capsys, tmp_path):
    from neardup.cli import main

    assert main(["stage", "prepare", "--bootstrap-servers", "127.0.0.1:9", "--input-topic", "t",
                 "--state-dir", str(tmp_path / "s")]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == \
        "neardup: error: --state-dir is for the shard and decide stages; the prepare stage keeps no state"
    assert not (tmp_path / "s").exists()


def test_decisions_records_read_back_as_written():
    keys = [order_key(1_700_000_000_000 + i, i % 3, i) for i in range(5)]
    decisions = [(keys[1], keys[0], "a", ()), (keys[2], keys[2], "c-é" * 40_000, ()),  # an id above 64 kB
                 (keys[4], keys[0], "", [keys[2], keys[3]])]
    value = decisions_value(decisions)
    assert parse_decisions(value) == [(o, c, i, list(m) if m else ()) for o, c, i, m in decisions]
    assert parse_decisions(decisions_value([])) == []
    for cut in (value[:-1], value + b"x", value[:30]):
        with pytest.raises((ValueError, struct.error)):
            parse_decisions(cut)


def test_documents_records_read_back_as_written():
    keys = [order_key(1_700_000_000_000 + i, i % 3, i) for i in range(4)]
    entries = [
        DocumentEntry(keys[0], 14, b"k0", b'{"id": "a", "text": "x"}', [], "wire", "a", None, None),
        DocumentEntry(keys[1], 0, None, b"not json", [("trace", b"t1"), ("empty", None), ("ünï", b"")], "wire.b",
                      "", "bad_json: Expecting value", None),
        DocumentEntry(keys[2], 3, b"", None, [], "wire", "c-é" * 40_000, None, 2_000_000),  # sent without its value
        DocumentEntry(keys[3], 1, None, b"", [], "wire.b", "", None, None),
    ]
    value = documents_value(entries)
    assert parse_documents(value) == entries
    assert documents_count(value) == 4
    for e in entries:  # what a split counts on
        assert len(documents_value([e])) == DOCUMENTS_FIXED_BYTES + 2 + len(e.topic.encode()) + document_entry_bytes(e)
    assert parse_documents(documents_value([])) == []
    for cut in (value[:-1], value + b"x", value[:30], value[:2]):
        with pytest.raises((ValueError, struct.error)):
            parse_documents(cut)


@pytest.mark.parametrize("shards", [1, 4, 16, 64, 1024])
def test_a_batch_s_band_records_built_as_columns_are_those_built_document_by_document(shards):
    """``batch_bands`` (what prepare sends) gives, per shard partition, the band records
    ``bands_value`` gives for the documents touching it in turn, byte for byte, cut after
    the document that takes a record above the limit; a document left out touches none."""
    docs = _republished(_excerpt()[:150], rounds=1, seed=5)
    p = Preparer(EngineSettings())(docs)
    n = len(p.valid)
    orders = [order_key(1_700_000_000_000 + v, v % 3, v) for v in range(n)]
    ids = [f"d{v}-é".encode() for v in range(n)]
    sets = [p.fingerprints[p.fingerprint_offsets[v]:p.fingerprint_offsets[v + 1]] for v in range(n)]
    grouped, bounds = shard_bounds(p.buckets, shards)
    assert bounds.tolist() == group_by_shard(p.buckets, shards)[1]
    include = np.ones(n, dtype=bool)
    include[[3, 40]] = False
    for limit in (512 << 10, 9_000):
        got = batch_bands(orders, ids, grouped, bounds, p.fingerprints, p.fingerprint_offsets, include, limit)
        assert len(got) == shards
        for q in range(shards):
            entries = [(orders[v], ids[v], grouped[v, bounds[v, q]:bounds[v, q + 1]], sets[v])
                       for v in range(n) if include[v] and bounds[v, q + 1] > bounds[v, q]]
            want, start, size = [], 0, 0
            for j, (_, raw_id, buckets, fp) in enumerate(entries):
                if j > start and size > limit:
                    want.append(bands_value(*map(list, zip(*entries[start:j]))))
                    start, size = j, 0
                size += BAND_ENTRY_BYTES + len(raw_id) + 8 * len(buckets) + 4 * len(fp)
            if entries:
                want.append(bands_value(*map(list, zip(*entries[start:]))))
            assert got[q] == want, (q, limit)
            assert all(r.order not in (orders[3], orders[40]) for value in got[q] for r in parse_bands(value))
        if limit == 9_000 and shards == 1:
            assert len(got[0]) > 3  # the limit cuts


@pytest.mark.parametrize("shards", [1, 16])
def test_band_records_sent_without_their_sets_read_back_with_the_set_records(shards):
    """prepare without a retention window sends each set once (``sets_values``) and band
    records without them (``with_sets=False``); read back with the set records, every
    band record's documents are those of the records with their sets. A set record cut
    short, a set lacking, sets twice and a reference of another length are refused."""
    docs = _republished(_excerpt()[:150], rounds=1, seed=5)
    p = Preparer(EngineSettings())(docs)
    n = len(p.valid)
    orders = [order_key(1_700_000_000_000 + v, v % 3, v) for v in range(n)]
    ids = [f"d{v}".encode() for v in range(n)]
    grouped, bounds = shard_bounds(p.buckets, shards)
    include = np.ones(n, dtype=bool)
    include[[3, 40]] = False
    for limit in (512 << 10, 9_000):
        values = sets_values(orders, p.fingerprints, p.fingerprint_offsets, include, limit)
        assert all(len(v) <= limit for v in values) and (len(values) > 3) == (limit == 9_000)
        sets = {}
        for v in values:
            sets.update(parse_sets(v))
        assert list(sets) == [orders[v] for v in range(n) if include[v]]
        with_sets = batch_bands(orders, ids, grouped, bounds, p.fingerprints, p.fingerprint_offsets, include, limit)
        without = batch_bands(orders, ids, grouped, bounds, p.fingerprints, p.fingerprint_offsets, include, limit,
                              with_sets=False)
        for q in range(shards):
            want = [(r.order, r.id, r.buckets.tolist(), r.fingerprints.tolist())
                    for value in with_sets[q] for r in parse_bands(value)]
            got = [(r.order, r.id, r.buckets.tolist(), r.fingerprints.tolist())
                   for value in without[q] for r in parse_bands(value, 7, sets)]
            assert got == want and want
            assert sum(map(len, without[q])) < sum(map(len, with_sets[q]))
            with pytest.raises(ValueError, match="in none of its set records"):
                parse_bands(without[q][0], 7, {})
            with pytest.raises(ValueError, match="sets of its own"):
                parse_bands(with_sets[q][0], 7, sets)
    for cut in (values[0][:-1], values[0][:30], values[0] + b"\x00"):
        with pytest.raises(ValueError):
            parse_sets(cut)
    assert parse_sets_ref(sets_ref(5, [17, 18])) == (5, [17, 18])
    with pytest.raises(ValueError):
        parse_sets_ref(sets_ref(5, [17])[:-1])


@pytest.mark.parametrize("shards", [1, 4])
def test_a_document_that_meets_no_one_joins_as_add_would_have_it(shards):
    """``ShardIndex.add_alone`` (the shard's path for a document that meets no one there)
    leaves each shard partition's index as ``add`` does, document after document, on a
    stream of stories and their copies; it takes the documents of no copy and leaves to ``add``
    every one that meets someone, and a document naming a bucket twice."""
    from neardup.sharded.shard import ShardIndex

    settings = EngineSettings()
    docs = _republished(_excerpt()[:60], rounds=2, seed=5)
    p = Preparer(settings)(docs)
    grouped, bounds = shard_bounds(p.buckets, shards)
    fps = [p.fingerprints[p.fingerprint_offsets[i]:p.fingerprint_offsets[i + 1]] for i in range(len(docs))]
    by_add = [ShardIndex(settings) for _ in range(shards)]
    by_alone = [ShardIndex(settings) for _ in range(shards)]
    taken = met = 0
    for i, d in enumerate(docs):
        seq = (1_000 + i) << 96
        for s in range(shards):
            buckets = grouped[i, bounds[i, s]:bounds[i, s + 1]]
            if not len(buckets):
                continue
            if i == 7 and s == 0:  # a bucket named twice: not taken, add lists it twice
                buckets = np.concatenate([buckets, buckets[:1]])
            finding, _ = by_add[s].add(seq, buckets, fps[i], d.id)
            if by_alone[s].add_alone(seq, buckets.tolist(), fps[i], d.id):
                taken += 1
                assert not finding.checked
            else:
                met += bool(finding.checked)
                again, _ = by_alone[s].add(seq, buckets, fps[i], d.id)
                assert again == finding
    for a, b in zip(by_add, by_alone):
        assert a.buckets == b.buckets and a.ids == b.ids and a.copies == b.copies
        assert (a.last, a.mark) == (b.last, b.mark)
        assert a.sets.keys() == b.sets.keys() and all(np.array_equal(a.sets[k], b.sets[k]) for k in a.sets)
    assert taken > 0 and met > 0, (taken, met)
    assert any(isinstance(m, list) and len(set(m)) < len(m) for m in by_alone[0].buckets.values())


@hsettings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.lists(st.integers(0, 99), max_size=8), st.booleans()),
                min_size=1, max_size=30), st.integers(0, 4))
def test_decide_s_changelog_lists_the_waiting_documents_across_restores_and_failed_batches(batches, waiting_before):
    """``_Log`` (decide's changelog of waiting documents, per batch): after every batch,
    the changelog compacted to each key's last value, read back, lists exactly the
    documents waiting; a batch taken back (its transaction failed) leaves the log as it
    was; a log read back goes on as the one that wrote it. Each batch: some documents
    begin to wait, some of those listed are decided (picked by index), and it may fail."""
    from neardup.sharded.decide_stage import _Log, _WAITING

    keys = [order_key(1_700_000_000_000 + i, 0, i) for i in range(400)]
    fresh = iter(keys[waiting_before:])
    waiting = set(keys[:waiting_before])  # listed by the earlier layout's ``W`` records
    changelog = {_WAITING + k: b"" for k in waiting}
    log = _Log.read({}, {}, waiting)

    def read_back() -> _Log:
        lists = {b"A": {}, b"D": {}}
        for key, value in changelog.items():
            if key[:1] in lists:
                lists[key[:1]][key] = [value[at:at + 20] for at in range(0, len(value), 20)]
        return _Log.read(lists[b"A"], lists[b"D"], {key[1:] for key in changelog if key[:1] == b"W"})

    for new, picks, fails in batches:
        began = sorted(next(fresh) for _ in range(new))
        listed = sorted(waiting)
        decided = sorted({listed[i % len(listed)] for i in picks}) if listed else []
        before = (dict(log.listed), dict(log.alive), {k: set(v) for k, v in log.names.items()},
                  {k: set(v) for k, v in log.named_by.items()})
        records, change = log.update(began, decided)
        if fails:
            log.undo(change)
            assert (log.listed, log.alive, log.names, log.named_by) == before
            records, change = log.update(began, decided)  # the batch read again
        for key, value in records:
            if value is None:
                changelog.pop(key, None)  # compaction keeps no value of a deleted key
            else:
                changelog[key] = value
        waiting = (waiting - set(decided)) | set(began)
        assert set(log.listed) == waiting
        restored = read_back()
        assert set(restored.listed) == waiting
        assert (restored.listed, restored.alive, restored.names, restored.named_by) == \
               (log.listed, log.alive, log.names, log.named_by)
        log = restored  # a restart: the next batch goes on from the log read back
    assert len([k for k in changelog if k[:1] in (b"A", b"D")]) <= 2 * len(batches)  # two records per batch at most


def test_a_shard_partition_purges_below_what_its_live_members_records_and_its_restart_need():
    """``_Shard.purge_point``: the lowest of the offsets its live ``N`` records of
    references name and the offset the batch commits (where a restart reads again);
    records of values name none; one ``N`` record whose references are not known (a store
    of an earlier version) stops it."""
    from neardup.sharded.shard import ShardIndex
    from neardup.sharded.shard_stage import _Shard

    shard = _Shard(ShardIndex(EngineSettings()))
    shard.consumed = 50  # a P record's consumed offset past what a restart reads again: no bound
    assert shard.purge_point(50) == 50
    assert shard.purge_point(20) == 20
    for key, floor in ((b"a", 30), (b"b", None), (b"c", 12), (b"gone", 3)):
        shard.logged(key, floor)
    shard.dropped([b"gone"])
    assert shard.purge_point(50) == 12
    assert shard.purge_point(7) == 7  # the earliest record held, committed for a restart
    shard.dropped([b"c"])
    assert shard.purge_point(50) == 30
    shard.logged(b"a", 40)  # logged again (a batch computed anew): its latest offset counts
    assert shard.purge_point(50) == 40
    shard.batches.add(b"old")  # a store's record of an earlier version: its references not known
    shard.unknown_floors.add(b"old")
    assert shard.purge_point(50) is None
    shard.dropped([b"old"])
    assert shard.purge_point(50) == 40


def test_an_order_key_s_integer_is_that_of_its_fields():
    """``order_seq`` reads the 20 bytes as one signed integer: ``fields_seq`` of the
    fields for every timestamp (none: -1), partition and offset, and ordered like the keys
    of stamped records."""
    from neardup.sharded.records import fields_seq, order_seq

    keys = [(ts, p, off) for ts in (-1, 0, 1, 1_700_000_000_000, (1 << 63) - 1)
            for p in (0, 1, (1 << 31) - 1) for off in (0, 7, (1 << 63) - 1)]
    assert [order_seq(order_key(*k)) for k in keys] == [fields_seq(*k) for k in keys]
    stamped = [k for k in keys if k[0] >= 0]  # (a key without a timestamp, -1, sorts last as bytes)
    assert sorted(stamped, key=lambda k: order_seq(order_key(*k))) == sorted(stamped, key=lambda k: order_key(*k))
