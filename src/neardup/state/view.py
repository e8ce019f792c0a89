"""A local RocksDB store that is the materialised view of one Kafka topic partition (a
changelog, or a global table's topic), as a Kafka Streams state store is of its changelog:
the topic stays the source of truth and the store is never ahead of it.

What is in the store is applied only from committed records, in one atomic write with the
store's position (the topic offset before which every record is in the store) and the
wall-clock time of that write, as quix-streams keeps processed offsets in the data's own
``WriteBatch``. So a store is
valid whenever it opens, after a clean stop, a rebalance or a SIGKILL alike, and an open
reads the topic from its position on. A directory RocksDB calls corrupted is wiped (the
topic holds all of it); a store without a position is read in full.

Memory is bounded per process, whatever the stores hold: per store at most two memtables
of ``WRITE_BUFFER_BYTES``, and one block cache of ``BLOCK_CACHE_BYTES`` shared by every
store of the process (index and filter blocks in it too).
"""

from __future__ import annotations

import os
import shutil
import struct
import time
from pathlib import Path

from rocksdict import BlockBasedIndexType, BlockBasedOptions, Cache, Options, Rdict, WriteBatch

from neardup.state.errors import StateError, write_error

#: RocksDB's info log: files of at most INFO_LOG_BYTES, the INFO_LOG_FILES newest kept
#: (every store: these views and ``neardup.state.rocksdb``'s).
INFO_LOG_BYTES = 1 << 20
INFO_LOG_FILES = 2
WRITE_BUFFER_BYTES = 8 << 20
BLOCK_CACHE_BYTES = 64 << 20
POSITION_KEY = b"O"
POSITION_TIME_KEY = b"T"  # when the position was last written, ms since the epoch
_Q = struct.Struct(">q")
_cache: Cache | None = None


def _options() -> Options:
    global _cache
    if _cache is None:
        _cache = Cache(BLOCK_CACHE_BYTES)
    options = Options(raw_mode=True)
    options.create_if_missing(True)
    options.set_write_buffer_size(WRITE_BUFFER_BYTES)
    options.set_max_write_buffer_number(2)
    options.set_max_log_file_size(INFO_LOG_BYTES)  # RocksDB's info log, rolled and bounded
    options.set_keep_log_file_num(INFO_LOG_FILES)
    table = BlockBasedOptions()
    table.set_bloom_filter(10, False)  # most lookups of a bucket miss
    table.set_block_cache(_cache)
    table.set_cache_index_and_filter_blocks(True)
    # Index and filter cut into 4 KiB partitions under a pinned top level: whole, a large
    # file's filter (1.2 MB at a million keys) is more than a shard of the LRU cache holds,
    # so it was read from the file again at every lookup (22,000 lookups/s against 400,000)
    table.set_partition_filters(True)
    table.set_index_type(BlockBasedIndexType.two_level_index_search())
    table.set_metadata_block_size(4096)
    table.set_pin_top_level_index_and_filter(True)
    options.set_block_based_table_factory(table)
    return options


def _empty(path: Path) -> None:
    """Remove what directory ``path`` holds (created when missing)."""
    path.mkdir(parents=True, exist_ok=True)
    for child in path.iterdir():
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()


class TopicView:
    """A RocksDB directory holding the view of one topic partition, with its position.

    Args:
        path: the directory (created when missing); it is this view's alone.
        what: how errors name it ("the shard state", "the decisions table").

    Raises:
        StateError: the directory cannot be created, opened or wiped (permissions, a full
            disk, another process holding it).
    """

    def __init__(self, path: str | os.PathLike[str], what: str) -> None:
        self.path = Path(path)
        self.what = what
        self._db: Rdict | None = self._open()

    def _open(self) -> Rdict:
        options = _options()
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            try:
                return Rdict(str(self.path), options)
            except Exception as exc:  # rocksdict raises plain Exception
                if not str(exc).startswith("Corruption:"):
                    raise
                _empty(self.path)  # the topic holds it all
                return Rdict(str(self.path), options)
        except Exception as exc:
            raise StateError(f"cannot open {self.what} {self.path}: {exc}") from exc

    def close(self) -> None:
        """Close the database.

        Raises:
            StateError: it failed to close (e.g. its memtable cannot be flushed to a full
                disk; what ``write`` returned from is in the write-ahead log all the same).
        """
        if self._db is not None:
            db, self._db = self._db, None
            try:
                db.close()
            except Exception as exc:  # rocksdict raises plain Exception
                raise write_error(f"close {self.what}", self.path, exc) from exc

    def wipe(self) -> None:
        """Drop everything (what the directory holds is removed; the directory stays, so
        that it may be a mount point).

        Raises:
            StateError: it cannot be removed or created.
        """
        self.close()
        try:
            _empty(self.path)
        except OSError as exc:
            raise StateError(f"cannot wipe {self.what} {self.path}: {exc.strerror}") from exc
        self._db = self._open()

    def position(self) -> int | None:
        """The topic offset before which every record is in the store; None: none (a new
        store, or one whose restore did not finish)."""
        raw = self._db.get(POSITION_KEY)
        return None if raw is None else _Q.unpack(raw)[0]

    def position_age_ms(self) -> int | None:
        """Milliseconds since the position was last written; None: never (or written
        before the time was kept)."""
        raw = self._db.get(POSITION_TIME_KEY)
        return None if raw is None else max(0, int(time.time() * 1000) - _Q.unpack(raw)[0])

    def get(self, key: bytes) -> bytes | None:
        return self._db.get(key)

    def write(self, batch: WriteBatch, position: int | None) -> None:
        """Write ``batch`` atomically, with ``position`` (if given) as the new position.

        Raises:
            StateError: the write failed (a full disk).
        """
        if position is not None:
            batch.put(POSITION_KEY, _Q.pack(position))
            batch.put(POSITION_TIME_KEY, _Q.pack(int(time.time() * 1000)))
        size = batch.size_in_bytes()  # the write consumes the batch
        try:
            self._db.write(batch)
        except Exception as exc:  # rocksdict raises plain Exception
            raise write_error(f"write {self.what}", self.path, exc, size) from exc
