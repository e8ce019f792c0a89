"""The store's side of a changelog (``neardup.state.changelog``), on real RocksDB: the
logged records rebuild the store byte for byte (replayed in order, after compaction, or
from a snapshot), a failing log leaves the store unchanged, unconfirmed keys are kept
across a reopen, an interrupted restore is seen, and the typed open errors."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from test_retention import _stream

from neardup.core.retention import Retention
from neardup.core.settings import EngineSettings
from neardup.core.types import Document, Verdict
from neardup.detector import Detector
from neardup.state import StateCorruptedError, StateError, StateLockedError, codec
from neardup.state.kv import KeyValueStateStore, Record
from neardup.state.memory import MemoryStateStore
from neardup.state.rocksdb import WIPE_MARKER, RocksDBStateStore

SETTINGS = EngineSettings(num_perm=64)
SHAPE = SETTINGS.state_shape()


def _contents(store: RocksDBStateStore) -> dict[str, list[tuple[bytes, bytes]]]:
    """Every record of every family, read with the backend's scan, the store's own
    changelog bookkeeping left out."""
    return {family: [(k, v) for k, v in store._scan(family)
                     if family != "default" or k not in codec.UNLOGGED_KEYS]
            for family in codec.CHANGELOG_FAMILIES}


def _batches(store: KeyValueStateStore, docs: list[Document], size: int, first_meta: int = 0) -> list[Verdict]:
    """Detect and commit ``docs`` in batches of ``size``, each writing a meta record."""
    detector = Detector(SETTINGS, store)
    verdicts: list[Verdict] = []
    for k, start in enumerate(range(0, len(docs), size)):
        result = detector.detect(docs[start:start + size])
        result.update.meta = {b"batch": str(first_meta + k).encode()}
        store.commit(result.update)
        verdicts += result.verdicts
    return verdicts


def _restored(path: Path, chunks: list[list[Record]]) -> RocksDBStateStore:
    store = RocksDBStateStore(path, SHAPE)
    store.wipe()
    for chunk in chunks:
        store.apply(chunk)
    store.finish_restore()
    return store


def _compacted(records: list[Record]) -> list[Record]:
    """What a compacted topic keeps: the last record per key, tombstoned keys dropped."""
    last = dict(records)
    return [(key, value) for key, value in last.items() if value is not None]


def _chunks(records: list[Record], size: int = 1000) -> list[list[Record]]:
    return [records[i:i + size] for i in range(0, len(records), size)]


def test_logged_records_rebuild_the_store_byte_for_byte(tmp_path: Path) -> None:
    docs = _stream(700)
    records: list[Record] = []
    path = tmp_path / "original"
    with RocksDBStateStore(path, SHAPE, retention=Retention(documents=250), log=records.extend) as store:
        _batches(store, docs[:500], 97)
        assert store.retention_stats()["expired_removed"] > 0  # documents removed mid-way
    tombstones = sum(value is None for _, value in records)
    # a shorter window at reopen: the retention write and the removal at open are logged
    original = RocksDBStateStore(path, SHAPE, retention={"documents": 150}, log=records.extend)
    assert sum(value is None for _, value in records) > tombstones
    _batches(original, docs[500:800], 61, first_meta=100)
    assert not any(codec.split_changelog_key(key)[1] in codec.UNLOGGED_KEYS for key, _ in records)

    with original:
        snapshot = list(original.snapshot_records(chunk=777))
        restores = {"replayed": _restored(tmp_path / "replayed", _chunks(records)),
                    "compacted": _restored(tmp_path / "compacted", _chunks(_compacted(records))),
                    "snapshot": _restored(tmp_path / "snapshot", snapshot)}
        expected = _contents(original)
        assert len(expected["documents"]) > 100 and original.get_meta(b"batch") == b"104"
        for name, restored in restores.items():
            with restored:
                assert _contents(restored) == expected, name
                assert restored.retention == original.retention and restored.next_seq() == original.next_seq()
        following = docs[800:900]
        verdicts = _batches(original, following, 100)
        for name in restores:
            with RocksDBStateStore(tmp_path / name, SHAPE) as restored:
                assert _batches(restored, following, 100) == verdicts, name
                assert _contents(restored) == _contents(original), name
        assert any(v.is_duplicate for v in verdicts)


def test_a_failing_log_leaves_the_store_unchanged(tmp_path: Path) -> None:
    docs = _stream(300)
    records: list[Record] = []
    with RocksDBStateStore(tmp_path / "state", SHAPE, retention=Retention(documents=100), log=records.extend) as store:
        _batches(store, docs[:200], 50)
        before, seq, stats = _contents(store), store.next_seq(), store.retention_stats()
        update = Detector(SETTINGS, store).detect(docs[200:300]).update

        def refuse(_: list[Record]) -> None:
            raise RuntimeError("the transaction was aborted")

        store.log = refuse
        with pytest.raises(RuntimeError, match="aborted"):
            store.commit(update)
        assert _contents(store) == before and store.next_seq() == seq and store.retention_stats() == stats
        store.log = records.extend
        store.commit(update)  # the same update goes through once the log takes it
        assert store.next_seq() == seq + len(update.ids)


def test_unconfirmed_keys_cover_the_batches_since_confirm_and_survive_a_reopen(tmp_path: Path) -> None:
    docs = _stream(300)
    logged: list[list[Record]] = []
    path = tmp_path / "state"
    with RocksDBStateStore(path, SHAPE, log=logged.append) as store:
        _batches(store, docs[:100], 100)
        _batches(store, docs[100:200], 100)
        assert len(logged) == 3  # the settings at open, two batches
        everything = dict(record for batch in logged for record in batch)
        assert dict(store.unconfirmed_records()) == everything
        store.confirm()
        _batches(store, docs[200:300], 100)
        last = dict(logged[-1])
        assert dict(store.unconfirmed_records()) == last
        assert dict(store.unconfirmed_records())[codec.changelog_key("default", codec.NEXT_SEQ_KEY)] == \
            codec.encode_u64(300)
    with RocksDBStateStore(path, SHAPE, log=logged.append) as store:
        assert dict(store.unconfirmed_records()) == last


def test_an_interrupted_restore_is_seen_at_reopen_and_can_start_over(tmp_path: Path) -> None:
    docs = _stream(200)
    with RocksDBStateStore(tmp_path / "original", SHAPE) as original:
        assert original.is_empty()
        _batches(original, docs, 50)
        assert not original.is_empty()
        snapshot = list(original.snapshot_records(chunk=100))
        expected = _contents(original)
    assert len(snapshot) > 2
    path = tmp_path / "restored"
    with RocksDBStateStore(path, SHAPE) as store:
        assert not store.restoring()
        store.wipe()
        assert store.restoring() and store.is_empty()
        store.apply(snapshot[0])  # killed here
    with RocksDBStateStore(path, SHAPE) as store:
        assert store.restoring()
        with pytest.raises(StateError, match="restore"):
            Detector(SETTINGS, store).detect(docs[:1])
        store.wipe()
        for chunk in snapshot:
            store.apply(chunk)
        store.finish_restore()
        assert not store.restoring() and _contents(store) == expected
    with RocksDBStateStore(path, SHAPE) as store:
        assert not store.restoring() and store.next_seq() == len(docs)


def test_a_wipe_killed_inside_destroydb_is_finished_at_the_next_open(tmp_path: Path) -> None:
    """DestroyDB removes CURRENT before the write-ahead logs: a process killed between the
    two leaves a directory RocksDB will not open ("wal_dir contains existing log file").
    The marker a wipe leaves until its empty database is open makes the next open finish
    the wipe, so a restore killed there starts over instead of failing every restart."""
    path = tmp_path / "state"
    with RocksDBStateStore(path, SHAPE) as store:
        _batches(store, _stream(100), 50)
    assert list(path.glob("*.log"))

    def killed_inside_destroydb(marker: bool) -> None:
        (path / "CURRENT").unlink()
        if marker:
            (path / WIPE_MARKER).touch()

    killed_inside_destroydb(marker=False)  # the state itself, without a wipe under way
    with pytest.raises(StateCorruptedError, match="existing log file"):
        RocksDBStateStore(path, SHAPE)
    shutil.rmtree(path)
    with RocksDBStateStore(path, SHAPE) as store:
        _batches(store, _stream(100), 50)
    killed_inside_destroydb(marker=True)
    with RocksDBStateStore(path, SHAPE) as store:
        assert store.is_empty() and not store.restoring()
        assert not (path / WIPE_MARKER).exists()
        _batches(store, _stream(100), 50)
        store.wipe()
        assert store.restoring() and store.is_empty() and not (path / WIPE_MARKER).exists()


def test_a_locked_store_and_a_corrupted_one_raise_typed_errors(tmp_path: Path) -> None:
    path = tmp_path / "state"
    with RocksDBStateStore(path, SHAPE):
        with pytest.raises(StateLockedError, match="cannot open"):
            RocksDBStateStore(path, SHAPE)
    (path / "CURRENT").write_text("garbage\n")
    with pytest.raises(StateCorruptedError, match="Corruption"):
        RocksDBStateStore(path, SHAPE)
    assert not issubclass(StateLockedError, StateCorruptedError)


def test_changelog_keys_and_key_sets_round_trip() -> None:
    for family in codec.CHANGELOG_FAMILIES:
        for key in (b"", b"\x00" * 8, "Grüße".encode()):
            assert codec.split_changelog_key(codec.changelog_key(family, key)) == (family, key)
    assert codec.changelog_key("default", b"x") == b"\x00x" and codec.changelog_key("times", b"") == b"\x08"
    with pytest.raises(ValueError):
        codec.split_changelog_key(bytes([len(codec.CHANGELOG_FAMILIES)]) + b"x")
    keys = {codec.changelog_key("documents", k) for k in codec.seq_keys(np.arange(5000))} | {b"", b"v" * 300}
    raw = codec.encode_key_set(keys)
    assert codec.decode_key_set(raw) == keys and len(raw) < 9 * 5000 / 4


def test_both_backends_log_the_same_records(tmp_path: Path) -> None:
    docs = _stream(400)
    logged: dict[str, list[Record]] = {"rocksdb": [], "memory": []}
    retention = Retention(documents=120)
    stores = [RocksDBStateStore(tmp_path / "state", SHAPE, retention=retention, log=logged["rocksdb"].extend),
              MemoryStateStore(SHAPE, retention=retention, log=logged["memory"].extend)]
    for store in stores:
        _batches(store, docs, 70)
        store.close()
    assert logged["rocksdb"] == logged["memory"]
    assert sum(value is None for _, value in logged["memory"]) > 100  # range deletes expanded
