"""The RocksDB state store (rocksdict): one column family per record kind, one atomic
``WriteBatch`` per detector batch.

Writes go through the write-ahead log without fsync: a killed process loses nothing that
``commit`` returned from; a machine that loses power may lose the last batches, which the
input positions stored in the same batches then replay.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from rocksdict import AccessType, BlockBasedOptions, Cache, DBCompressionType, Options, Rdict, WriteBatch, WriteOptions

from neardup.core.retention import Retention
from neardup.state import codec
from neardup.state.errors import StateCorruptedError, StateError, StateLockedError, write_error
from neardup.state.changelog import exclusive
from neardup.state.kv import Deletes, KeyValueStateStore, Puts, Ranges, Record
from neardup.state.view import INFO_LOG_BYTES, INFO_LOG_FILES

log = logging.getLogger(__name__)


#: Memory bounds: a block cache shared by every family, the set cache
#: (``neardup.state.setcache``), and per column family at most two memtables, all
#: memtables together at most DB_WRITE_BUFFER_BYTES (flushed early beyond it). The
#: fingerprint sets that verification reads are kept in the set cache one by one rather
#: than in 4 KiB blocks of about seven sets, of which a batch usually wants one.
BLOCK_CACHE_BYTES = 64 << 20
SET_CACHE_BYTES = 128 << 20
WRITE_BUFFER_BYTES = 16 << 20
DB_WRITE_BUFFER_BYTES = 64 << 20
#: The write-ahead log's bound: past it, the memtables holding the oldest log are flushed.
#: Families that take a few bytes a batch (default, times) would otherwise keep every log
#: file alive until their 16 MB memtable fills (400 MB of logs after 1,200,000 documents).
#: At 128 MB the logs swung between 10 and 134 MB, most of a 200,000-document retention
#: window's state on disk (160 MB of SST files); at 8 MB, no slower (benchmarks/scale.py).
MAX_WAL_BYTES = 8 << 20


#: A file in the state directory while ``_wipe_all`` runs: RocksDB's DestroyDB removes the
#: files one by one (CURRENT before the write-ahead logs), so a process killed inside it
#: leaves a directory RocksDB refuses to open ("wal_dir contains existing log file"). An
#: open that finds this file finishes the wipe first.
WIPE_MARKER = "NEARDUP-WIPING"


#: Families of hash values, which LZ4 cannot shrink: stored uncompressed, which spares
#: the attempt at every flush and compaction.
INCOMPRESSIBLE = ("shingles", "signatures", "buckets")


def _options(cache: Cache, compress: bool = True) -> Options:
    """Options tuned for point lookups: most bucket lookups miss, so a Bloom filter (10
    bits per key) answers them without reading a data block; LZ4 keeps SST files small
    at little CPU."""
    options = Options(raw_mode=True)
    options.create_if_missing(True)
    options.create_missing_column_families(True)
    options.increase_parallelism(os.cpu_count() or 2)
    options.set_write_buffer_size(WRITE_BUFFER_BYTES)
    options.set_max_write_buffer_number(2)
    options.set_db_write_buffer_size(DB_WRITE_BUFFER_BYTES)
    options.set_max_total_wal_size(MAX_WAL_BYTES)
    # RocksDB's own info log (LOG) grows by about 2 MB per million documents with a
    # retention window (a compaction at every removal): rolled and bounded
    options.set_max_log_file_size(INFO_LOG_BYTES)
    options.set_keep_log_file_num(INFO_LOG_FILES)
    options.set_level_compaction_dynamic_level_bytes(True)
    options.set_compression_type(DBCompressionType.lz4() if compress else DBCompressionType.none())
    # A Bloom filter over the memtables too: a lookup that misses skips their skiplists.
    options.set_memtable_prefix_bloom_ratio(0.1)
    options.set_memtable_whole_key_filtering(True)
    table = BlockBasedOptions()
    table.set_bloom_filter(10, False)
    table.set_block_cache(cache)
    table.set_cache_index_and_filter_blocks(True)
    table.set_pin_l0_filter_and_index_blocks_in_cache(True)
    options.set_block_based_table_factory(table)
    return options


def _open_error(path: Path, exc: Exception) -> StateError:
    """The typed error of a failed open: rocksdict raises a plain ``Exception`` whose
    message starts with RocksDB's status ("IO error: While lock file: .../LOCK: ...",
    "IO error: lock hold by current process", "Corruption: ...")."""
    message = f"cannot open state store {path}: {exc}"
    text = str(exc)
    if text.startswith("Corruption:"):
        return StateCorruptedError(message)
    if text.startswith("IO error:") and ("LOCK:" in text or "lock hold" in text):
        return StateLockedError(message + " (another process uses this state directory)")
    return StateError(message)


class RocksDBStateStore(KeyValueStateStore):
    """State in a RocksDB directory.

    Args:
        path: the directory (created when missing).
        settings: the state-shaping settings (``EngineSettings.state_shape()``); stored on
            first open, compared on every later open.
        set_cache_bytes: size of the in-memory cache of fingerprint sets in bytes
            (``neardup.state.setcache``); 0 turns it off.
        retention: the retention window (``neardup.core.retention``), stored with the
            state; a mapping changes only the bounds it names; None keeps the stored one
            (at first: keep everything).
        log: the changelog hook (``neardup.state.changelog``), set before the writes of
            the open; None: no changelog.
        wal: write RocksDB's write-ahead log. False for a state that is not to outlive
            its process (a temporary directory): a crash then loses the writes not yet
            flushed to SST files, and each write is cheaper (about 3% of ``neardup
            dedup``'s time without ``--state-dir``).
        read_only: open RocksDB read-only (no ``LOCK`` taken, so beside a running
            writer; it sees the writes made before the open): the directory must hold
            a neardup state, nothing is created and any write raises ``StateError``.
            ``settings`` None then takes the stored settings (``self.settings``).

    Raises:
        SettingsMismatchError: the directory holds state built with other settings.
        StateLockedError: another process (or store) holds the directory's LOCK.
        StateCorruptedError: RocksDB reports the files as corrupted.
        StateError: the directory cannot be created or opened otherwise (read-only file
            system); later, a write fails (full disk); with ``read_only``, the directory
            is missing or holds no neardup state, or a write was attempted.
    """

    def __init__(self, path: str | os.PathLike[str], settings: dict[str, Any] | None,
                 set_cache_bytes: int = SET_CACHE_BYTES, retention: Retention | Mapping[str, Any] | None = None,
                 log: Callable[[list[Record]], None] | None = None, wal: bool = True,
                 read_only: bool = False) -> None:
        self.path = Path(path)
        self.log = log
        self.read_only = read_only
        if settings is None and not read_only:
            raise ValueError("settings are required unless the store is opened read-only")
        self._write_options = WriteOptions()
        self._write_options.disable_wal = not wal
        self._open_db()
        self._open_settings(settings, set_cache_bytes, retention)

    def _open_db(self) -> None:
        if self.read_only:
            self._open_read_only()
            return
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StateError(f"cannot create the state directory {self.path}: {exc.strerror}") from exc
        if (self.path / WIPE_MARKER).exists():  # a wipe was interrupted: finish it
            self._destroy()
        cache = Cache(BLOCK_CACHE_BYTES)
        families = {name: _options(cache, compress=name not in INCOMPRESSIBLE) for name in codec.FAMILIES}
        try:
            self._db = Rdict(str(self.path), _options(cache), column_families=families)
        except Exception as exc:  # rocksdict raises plain Exception
            raise _open_error(self.path, exc) from exc
        self._take_families()

    def _take_families(self) -> None:
        """The column families (and their handles, for write batches) of the open database."""
        self._families = {"default": self._db}
        self._handles = {"default": self._db.get_column_family_handle("default")}
        for name in codec.FAMILIES:
            self._families[name] = self._db.get_column_family(name)
            self._handles[name] = self._db.get_column_family_handle(name)
        self._closed = False

    def _open_read_only(self) -> None:
        """Open an existing state read-only (``read_only``): no directory, LOCK or file
        is created."""
        if not (self.path / "CURRENT").is_file():
            what = "does not exist" if not self.path.exists() else "is not a neardup state directory (no RocksDB files)"
            raise StateError(f"state directory {self.path} {what}")
        cache = Cache(BLOCK_CACHE_BYTES)
        families = {name: _options(cache, compress=name not in INCOMPRESSIBLE) for name in codec.FAMILIES}
        try:
            self._db = Rdict(str(self.path), _options(cache), column_families=families,
                             access_type=AccessType.read_only())
        except Exception as exc:  # rocksdict raises plain Exception
            if str(exc).startswith("Invalid argument"):  # another comparator, no such families
                raise StateError(f"state directory {self.path} is not a neardup state directory "
                                 f"(a RocksDB database neardup did not write: {exc})") from exc
            raise _open_error(self.path, exc) from exc
        self._take_families()

    def _get_many(self, family: str, keys: Sequence[bytes]) -> list[bytes | None]:
        if not keys:
            return []
        return self._families[family].get(list(keys))

    def _scan(self, family: str) -> Iterator[tuple[bytes, bytes]]:
        return self._families[family].items()

    def _keys(self, family: str, begin: bytes = b"", end: bytes | None = None) -> Iterator[bytes]:
        for key in self._families[family].keys(from_key=begin):
            if end is not None and key >= end:
                return
            yield key

    def _wipe_all(self) -> None:
        """Close the database, destroy its directory (``DestroyDB``), reopen it empty.
        Crash-safe: ``WIPE_MARKER`` stays in the directory until the empty database is
        open, and an open that finds it destroys the directory again."""
        self.close()
        try:
            (self.path / WIPE_MARKER).touch()
        except OSError as exc:
            raise StateError(f"cannot wipe the state store {self.path}: {exc.strerror}") from exc
        self._open_db()

    def _destroy(self) -> None:
        """DestroyDB on the directory, then remove ``WIPE_MARKER``."""
        try:
            Rdict.destroy(str(self.path), Options(raw_mode=True))
            (self.path / WIPE_MARKER).unlink(missing_ok=True)
        except Exception as exc:  # rocksdict raises plain Exception
            raise StateError(f"cannot wipe the state store {self.path}: {exc}") from exc

    def _write_batch(self, puts: Puts, deletes: Deletes | None = None, ranges: Ranges | None = None) -> None:
        if self.read_only:
            raise StateError(f"the state store {self.path} is open read-only")
        batch = WriteBatch(raw_mode=True)
        for family, (begin, end) in (ranges or {}).items():
            batch.delete_range(begin, end, self._handles[family])
        for family, keys in (deletes or {}).items():
            handle, delete = self._handles[family], batch.delete
            for key in keys:
                delete(key, handle)
        for family, pairs in puts.items():
            handle, put = self._handles[family], batch.put
            for key, value in pairs:
                put(key, value, handle)
        size = batch.size_in_bytes()  # the write consumes the batch
        try:
            self._db.write(batch, self._write_options)
        except Exception as exc:  # rocksdict raises plain Exception (e.g. a full disk)
            raise write_error("write the state store", self.path, exc, size) from exc

    def _reclaim(self, end: bytes) -> None:
        """Compact the seq-keyed families below ``end``: the files wholly under a range
        delete are dropped, so the disk space of expired documents comes back at once."""
        for family in (*codec.SEQ_FAMILIES, *codec.BATCH_FAMILIES):
            self._families[family].compact_range(None, end)

    def stats(self) -> dict[str, int]:
        """Documents, estimated keys per family, bytes of SST files and of memtables."""
        out = {"documents": self._next_seq, "max_bucket_size": self._max_bucket,
               "index_entries": len(self.index), "index_bytes": self.index.nbytes,
               "forest_bytes": self.forest.nbytes, **self.retention_stats(), "set_cache_bytes": self.sets.nbytes,
               "set_cache_hits": self.sets.hits, "set_cache_misses": self.sets.misses}
        sst = memtables = 0
        for name in ("default", *codec.FAMILIES):
            family = self._families[name]
            out[f"keys_{name}"] = family.property_int_value("rocksdb.estimate-num-keys") or 0
            sst += family.property_int_value("rocksdb.total-sst-files-size") or 0
            memtables += family.property_int_value("rocksdb.cur-size-all-mem-tables") or 0
        out["sst_bytes"] = sst
        out["memtable_bytes"] = memtables
        return out

    def flush(self) -> None:
        """Flush memtables to SST files (for size measurements)."""
        for family in self._families.values():
            family.flush()

    @exclusive
    def close(self) -> None:
        """Close every family and the database, even when one fails (e.g. its memtable
        cannot be flushed to a full disk; what ``commit`` returned from is in the
        write-ahead log all the same).

        Raises:
            StateError: a family or the database failed to close.
        """
        if self._closed:
            return
        self._closed = True
        failed: Exception | None = None
        families = [family for name, family in self._families.items() if name != "default"]
        # Column-family handles keep the database, and its LOCK, alive until dropped.
        self._handles.clear()
        self._families.clear()
        for family in [*families, self._db]:
            try:
                family.close()
            except Exception as exc:  # rocksdict raises plain Exception
                failed = failed or exc
        if failed is not None:
            raise write_error("close the state store", self.path, failed) from failed

    def __enter__(self) -> RocksDBStateStore:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        """Close the store; when an error is already on its way out (a write that failed
        on a full disk, say), a close that fails too (its memtables cannot be flushed
        either: "Writer has previous error") is logged, not raised, so that the first
        error, which names the cause, is the one reported."""
        if exc is None:
            self.close()
            return
        try:
            self.close()
        except StateError as failed:
            log.warning("%s (after: %s)", failed, exc)
