"""A shard partition's state on disk (``neardup.state.shard_store``, ``StoredShardIndex``),
on real RocksDB: the same findings as the in-memory index while batches are committed one
behind (as the stage runtime commits them), after a reopen, and the checkpoint rule."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from neardup.core.settings import EngineSettings
from neardup.detector import Preparer
from neardup.sharded.records import BandRecord, order_key, order_seq, seq_order
from neardup.sharded.routing import owned_bands
from neardup.sharded.shard import Finding, Joins, ShardIndex, StoredShardIndex
from neardup.state import shard_store
from neardup.state.shard_store import (
    LAYOUT_KEY,
    ShardStore,
    joined_member_value,
    member_parts,
    member_value,
    members_parts,
    members_value,
)
from test_quality import _excerpt
from test_sharded import _republished

SETTINGS = EngineSettings()
SHARDS = 2


def _stream(n: int) -> list[tuple[bytes, str, list[np.ndarray], np.ndarray]]:
    """(order key, id, buckets per shard, set) of ``n`` stories and two rounds of edits."""
    docs = _republished(_excerpt()[:n], rounds=2, seed=3)
    p = Preparer(SETTINGS)(docs)
    out = []
    for i, d in enumerate(docs):
        fp = p.fingerprints[p.fingerprint_offsets[i]:p.fingerprint_offsets[i + 1]]
        parts = [p.buckets[i][bands] for bands in owned_bands(p.buckets[i], SHARDS)]
        out.append((order_key(1_000 + i, 0, i), d.id, parts, fp))
    return out


def _store(path: Path) -> ShardStore:
    return ShardStore(path, lambda band: BandRecord.parse(bytes(20), band).buckets.tolist())


def _overlay(index: StoredShardIndex, batches: list[list[tuple[bytes, bytes]]]) -> None:
    index.forget()
    for records in batches:
        for key, value in records:
            copies, band = member_parts(value)
            rec = BandRecord.parse(key[1:], band)
            index.apply(order_seq(key[1:]), rec.id, Joins(rec.buckets, tuple(order_seq(c) for c in copies)),
                        rec.fingerprints)


def _add(index: ShardIndex, doc, shard: int) -> tuple[Finding, list[tuple[bytes, bytes]], list[str]]:
    order, doc_id, parts, fp = doc
    finding, joins = index.add(order_seq(order), parts[shard], fp, doc_id)
    names = [index.id_of(c.seq) for c in finding.checked]
    if joins.empty:
        return finding, [], names
    band = BandRecord(order, doc_id, joins.buckets, fp).value()
    return finding, [(b"M" + order, member_value([seq_order(c) for c in joins.copies], band))], names


@pytest.mark.parametrize("prefetch", [False, True])
def test_a_stored_index_finds_what_the_in_memory_one_finds(tmp_path: Path, prefetch: bool) -> None:
    """Batches of 100; each batch's member records reach the store only after the next
    batch is computed (the runtime's pipelined commit), the overlay holding the rest; the
    stores are closed and opened again halfway. With ``prefetch``, each batch's buckets are
    read ahead as the stage reads them (``StoredShardIndex.prefetch``), and stay read
    while a batch before is committed."""
    docs = _stream(400)  # 1,200 documents
    memory = [ShardIndex(SETTINGS) for _ in range(SHARDS)]
    stores = [_store(tmp_path / f"shard-{q}") for q in range(SHARDS)]
    stored = [StoredShardIndex(SETTINGS, s) for s in stores]
    pending: list[list[list[tuple[bytes, bytes]]]] = [[] for _ in range(SHARDS)]
    matches = 0
    for start in range(0, len(docs), 100):
        if start == 600:  # every batch committed, the stores closed and opened again
            for q in range(SHARDS):
                for records in pending[q]:
                    stores[q].apply(records)
                pending[q] = []
                stores[q].close()
                stores[q] = _store(tmp_path / f"shard-{q}")
                stored[q] = StoredShardIndex(SETTINGS, stores[q])
        for q in range(SHARDS):
            batch = []
            if prefetch:
                stored[q].prefetch(np.concatenate([doc[2][q] for doc in docs[start:start + 100]]))
            for doc in docs[start:start + 100]:
                want, want_records, want_names = _add(memory[q], doc, q)
                got, got_records, got_names = _add(stored[q], doc, q)
                assert got == want and got_records == want_records and got_names == want_names, doc[1]
                matches += sum(c.similarity >= SETTINGS.threshold for c in got.checked)
                batch += got_records
            pending[q].append(batch)
            if len(pending[q]) == 2:  # the batch before is committed: to the store
                stores[q].apply(pending[q].pop(0))
                _overlay(stored[q], pending[q])
    assert matches > 1000  # the edited copies are found
    for s in stores:
        s.close()


def test_bucket_lookups_answer_what_the_store_holds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``members`` (the index in memory, its members renumbered here as soon as a few
    have gone) against a model of the buckets built from the member records applied,
    after every write: batches looked up one ahead of their write (as the stage's
    pipelined commit does), members deleted (their buckets emptied too), a reopen, a
    wipe."""
    monkeypatch.setattr(shard_store, "RENUMBER_MIN", 10)
    monkeypatch.setattr(shard_store, "LOAD_CHUNK", 100)  # the keys read in many chunks at a reopen
    docs = _stream(300)
    path = tmp_path / "shard-0"
    store = _store(path)
    index = StoredShardIndex(SETTINGS, store)
    absent = np.random.default_rng(2).integers(0, 1 << 63, 500, dtype=np.uint64).tolist()
    model: dict[int, list[bytes]] = {}

    def write(records: list[tuple[bytes, bytes | None]]) -> None:
        for key, value in records:
            if value is None:
                for members in model.values():
                    if key[1:] in members:
                        members.remove(key[1:])
            else:
                for b in BandRecord.parse(key[1:], member_parts(value)[1]).buckets.tolist():
                    model.setdefault(b, []).append(key[1:])
        store.apply(records)

    def check() -> None:
        asked = [*model, *absent]
        assert store.members(asked) == [model.get(b, []) for b in asked]

    pending: list[tuple[bytes, bytes | None]] = []
    written = []
    for start in range(0, len(docs), 100):
        batch = []
        for doc in docs[start:start + 100]:
            store.members(doc[2][0].tolist())  # looked up before the batch before is written
            batch += _add(index, doc, 0)[1]
        write(pending)
        index.forget()
        pending = batch
        written.append(batch)
        _overlay(index, [pending])
        check()
    write(pending)
    check()
    assert sum(map(len, model.values())) > 5_000
    gone = [(key, None) for batch in written[:6] for key, _ in batch]  # expired members, most of them
    store.members([*model])
    write(gone)
    check()
    assert any(not members for members in model.values())  # buckets emptied
    assert store._buckets is not None and store._buckets.dead == 0  # renumbered
    # members sharing buckets, each in a write of its own after one lookup of them all
    fp = np.arange(10, dtype=np.uint32)
    shared = [(order_key(9_000 + i, 0, i), np.array([5 + i, 6 + i, 7 + i], dtype=np.uint64)) for i in range(3)]
    store.members([int(b) for _, buckets in shared for b in buckets])
    for order, buckets in shared:
        write([(b"M" + order, member_value([], BandRecord(order, "s", buckets, fp).value()))])
    assert model[7] == [order for order, _ in shared]
    check()
    store.close()
    store = _store(path)
    check()
    store.wipe()
    assert store.members([*model]) == [[] for _ in model]
    store.close()


def test_the_position_is_kept_with_the_data_and_applying_twice_changes_nothing(tmp_path: Path) -> None:
    """A position that lags (the changelog read again from an older offset) applies a
    member once; a directory RocksDB cannot open is wiped (the changelog holds it all)."""
    path = tmp_path / "shard-0"
    store = _store(path)
    assert store.position() is None
    docs = _stream(3)[:2]
    index = StoredShardIndex(SETTINGS, store)
    records = _add(index, docs[0], 0)[1] + _add(index, docs[1], 0)[1] + [(b"P", b"x"), (b"H" + docs[0][0], b"h")]
    assert len(records) == 4
    store.apply(records[:1], position=5)
    before = store.members(docs[0][2][0].tolist())
    store.apply(records, position=9)  # records[0] again
    store.apply(records[2:3] + [(b"H" + docs[0][0], None)], position=11)
    store.close()
    store = _store(path)
    assert store.position() == 11 and store.get(b"P") == b"x" and store.prefixed(b"H") == []
    assert store.last_member() == docs[1][0]
    after = store.members(docs[0][2][0].tolist())
    assert after == before and [keys.count(docs[0][0]) for keys in after] == [1] * len(after)
    second = store.members(docs[1][2][0].tolist())
    assert second and [keys.count(docs[1][0]) for keys in second] == [1] * len(second)
    store.close()
    (path / "CURRENT").unlink()  # as a process killed inside RocksDB's DestroyDB leaves it
    store = _store(path)
    assert store.position() is None and store.get(b"P") is None
    store.close()


def test_a_store_of_an_earlier_layout_is_wiped_when_it_opens(tmp_path: Path) -> None:
    """A store without the layout key (one of an earlier layout, whose bucket keys mean
    another thing) opens empty, without a position: it is restored from the changelog."""
    path = tmp_path / "shard-0"
    store = _store(path)
    doc = _stream(1)[0]
    store.apply(_add(StoredShardIndex(SETTINGS, store), doc, 0)[1], position=1)
    store.close()
    store = _store(path)
    assert store.position() == 1 and all(store.members(doc[2][0].tolist()))  # the same layout: kept
    store._db.delete(LAYOUT_KEY)
    store.close()
    store = _store(path)
    assert store.position() is None and not any(store.members(doc[2][0].tolist()))
    assert store.get(LAYOUT_KEY) is not None
    store.close()


def test_a_members_record_applies_as_its_members_one_by_one(tmp_path: Path) -> None:
    """An ``N`` record (a batch's members on one partition, as the shard stage writes them)
    leaves a store as its members' own records would, plus its marker (their order keys);
    applied again (a position that lagged) it changes nothing; its deletion deletes them
    as their own deletions would; a value cut short is refused."""
    docs = _stream(60)  # 180 documents, copies among them
    index = ShardIndex(SETTINGS)
    records = [r for doc in docs for r in _add(index, doc, 0)[1]]
    assert len(records) > 100
    one_by_one, batched = _store(tmp_path / "m"), _store(tmp_path / "n")
    try:
        one_by_one.apply(records, position=len(records))
        chunks = [records[i:i + 50] for i in range(0, len(records), 50)]
        keyed = [(b"N" + max(k[1:] for k, _ in chunk), members_value([(k[1:], v) for k, v in chunk]))
                 for chunk in chunks]
        batched.apply(keyed[:2], position=2)
        batched.apply(keyed, position=len(keyed))  # the first two again
        buckets = sorted({b for doc in docs for b in doc[2][0].tolist()})
        assert batched.members(buckets) == one_by_one.members(buckets)
        assert any(len(m) > 1 for m in batched.members(buckets))
        for order, _ in [(k[1:], v) for k, v in records]:
            assert batched.member(order) == one_by_one.member(order)
            assert batched.copies(order) == one_by_one.copies(order)
        assert [k for k, _ in batched.prefixed(b"N")] == sorted(k[1:] for k, _ in keyed)
        assert [v for _, v in batched.prefixed(b"N")][0] == b"".join(k[1:] for k, _ in chunks[0])
        batched.apply([(keyed[0][0], None)], position=len(keyed) + 1)  # every member of it expired
        one_by_one.apply([(k, None) for k, _ in chunks[0]], position=len(records) + 1)
        assert [k for k, _ in batched.prefixed(b"N")] == sorted(k[1:] for k, _ in keyed[1:])
        assert batched.members(buckets) == one_by_one.members(buckets)  # its members went with it
        assert all(batched.member(k[1:]) is None for k, _ in chunks[0])
        assert members_parts(keyed[1][1]) == [(k[1:], v) for k, v in chunks[1]]
        with pytest.raises(ValueError):
            members_parts(keyed[1][1][:-3])
    finally:
        one_by_one.close()
        batched.close()


@pytest.mark.parametrize("copies", [0, 1, 3])
def test_a_joined_member_is_encoded_as_the_member_value_of_its_band_value(copies: int) -> None:
    """What the shard logs per member (``joined_member_value``, one join) is byte for byte
    ``member_value`` of the ``BandRecord`` value, and reads back as the same member."""
    order, copy_keys = order_key(7, 1, 9), [order_key(5, 0, i) for i in range(copies)]
    for buckets, fp in [(np.array([3, 2**64 - 1], dtype=np.uint64), np.array([1, 7, 2**32 - 1], dtype=np.uint32)),
                        (np.zeros(0, dtype=np.uint64), np.zeros(0, dtype=np.uint32))]:
        got = joined_member_value(copy_keys, "doc-é", buckets, fp)
        assert got == member_value(copy_keys, BandRecord(order, "doc-é", buckets, fp).value())
        keys, band = member_parts(got)
        rec = BandRecord.parse(order, band)
        assert (keys, rec.id, rec.buckets.tolist(), rec.fingerprints.tolist()) == (
            copy_keys, "doc-é", buckets.tolist(), fp.tolist())


def test_member_references_read_back_as_written_and_name_the_buckets_joined() -> None:
    """``member_refs_value`` / ``member_refs`` round trip (all buckets joined, some, copy
    buckets, none), and the stage's indices of the buckets joined are those of each
    joined bucket in the record's order, duplicates of a bucket id included."""
    from neardup.sharded.shard_stage import _picked

    rng = np.random.default_rng(7)
    refs = []
    for i in range(300):
        some = None if i % 3 else sorted(rng.choice(8, size=int(rng.integers(0, 8)), replace=False).tolist())
        copies = [order_key(1_700_000_000_000 + j, 1, j) for j in range(int(rng.integers(0, 3)))]
        refs.append((order_key(1_700_000_000_000 + i, 0, i), int(rng.integers(0, 1 << 40)), i % 2001, some, copies))
    value = shard_store.member_refs_value(refs)
    assert shard_store.is_refs_value(value) and not shard_store.is_refs_value(shard_store.members_value([]))
    back = shard_store.member_refs(value)
    assert [(o, off, e, None if j is None else list(j), list(c)) for o, off, e, j, c in back] == [
        (o, off, e, j, c) for o, off, e, j, c in refs]
    assert shard_store.member_refs(shard_store.member_refs_value([])) == []
    with pytest.raises(ValueError):
        shard_store.member_refs(value[:-1])
    for _ in range(200):
        buckets = rng.integers(0, 6, size=int(rng.integers(1, 9))).tolist()  # ids may repeat
        keep = rng.random(len(buckets)) < 0.5
        joined = [b for b, k in zip(buckets, keep) if k]
        picked = _picked(buckets, joined)
        assert [buckets[i] for i in picked] == joined
