"""The state store over any ordered key-value backend with atomic multi-family writes.

Backends implement a few primitives (multi-get, atomic write, key scans, wipe, close);
this class turns them into the ``StateStore`` protocol with the layouts of
``neardup.state.codec``, and into the store's side of a changelog
(``neardup.state.changelog``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from neardup.core.arrays import sorted_unique
from neardup.core.retention import NO_TIME, Retention
from neardup.core.types import Node
from neardup.state import codec
from neardup.state.base import StateUpdate
from neardup.state.changelog import ChangelogMixin, exclusive
from neardup.state.errors import SettingsMismatchError, StateError
from neardup.state.expiry import Times, held_since, removal_point
from neardup.state.forest import Forest
from neardup.state.index import MAX_SEQ, BucketIndex, BucketMembers
from neardup.state.setcache import SetCache, merge_sets, select_sets

Puts = dict[str, Iterable[tuple[bytes, bytes]]]  # family -> (key, value) pairs
Deletes = dict[str, Iterable[bytes]]  # family -> keys
Ranges = dict[str, tuple[bytes, bytes]]  # family -> [begin, end) keys
Record = tuple[bytes, "bytes | None"]  # a changelog record: (changelog key, value or None)

logger = logging.getLogger(__name__)

#: The ids of this many of the newest documents are kept in memory (``get_ids``): about
#: 8 MB of strings and 1 MB of references. On a 200,000-document replayed stream, where a
#: copy follows its original by 21,578 documents, reading the ids of a batch's matches,
#: clusters and nearest candidates took 0.25 s of a 7 s run from RocksDB.
RECENT_IDS = 1 << 17


class KeyValueStateStore(ChangelogMixin):
    """``StateStore`` logic shared by the backends. Subclasses set ``log`` (or leave it
    None) and call ``_open_settings``."""

    num_perm: int
    settings: dict[str, Any]
    #: Called with the changelog records of every write before the write is applied; if
    #: it raises, the write is not (``neardup.state.changelog``). None: no changelog.
    log: Callable[[list[Record]], None] | None = None

    # --- backend primitives -------------------------------------------------------
    def _get_many(self, family: str, keys: Sequence[bytes]) -> list[bytes | None]:
        raise NotImplementedError

    def _write_batch(self, puts: Puts, deletes: Deletes | None = None, ranges: Ranges | None = None) -> None:
        """Apply ``ranges`` (range deletes), ``deletes`` then ``puts`` atomically."""
        raise NotImplementedError

    def _keys(self, family: str, begin: bytes = b"", end: bytes | None = None) -> Iterator[bytes]:
        """The keys of ``family`` in [begin, end) (end None: to the last), in order."""
        raise NotImplementedError

    def _wipe_all(self) -> None:
        """Drop every record of every family, leaving the backend open and empty."""
        raise NotImplementedError

    def _reclaim(self, end: bytes) -> None:
        """Give back the space of the keys below ``end`` just deleted (compaction)."""

    def _scan(self, family: str) -> Iterator[tuple[bytes, bytes]]:
        """Every (key, value) of ``family``, in key order."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def stats(self) -> dict[str, int]:
        raise NotImplementedError

    # --- shared logic --------------------------------------------------------------
    def _write(self, puts: Puts, deletes: Deletes | None = None, ranges: Ranges | None = None,
               unlogged: frozenset[str] = frozenset()) -> None:
        """Apply ``ranges`` (range deletes), ``deletes`` then ``puts`` atomically. With a
        changelog (``log`` set), first pass their records to ``log`` (the write is not
        applied if it raises), and write the unconfirmed changelog keys in the same write;
        the puts and deletes of the families in ``unlogged`` are applied, not logged."""
        if self.log is None:
            self._write_batch(puts, deletes, ranges)
            return
        puts = {family: list(pairs) for family, pairs in puts.items()}  # generators, read once
        deletes = {family: list(keys) for family, keys in (deletes or {}).items()}
        records = self._records({f: v for f, v in puts.items() if f not in unlogged},
                                {f: v for f, v in deletes.items() if f not in unlogged}, ranges or {})
        unconfirmed = self._unconfirmed | {key for key, _ in records}
        puts["default"] = [*puts.get("default", []), (codec.UNCONFIRMED_KEY, codec.encode_key_set(unconfirmed))]
        self.log(records)
        self._write_batch(puts, deletes, ranges)
        self._unconfirmed = unconfirmed

    def _get(self, family: str, key: bytes) -> bytes | None:
        return self._get_many(family, [key])[0]

    def _open_settings(self, requested: dict[str, Any] | None, set_cache_bytes: int = 0,
                       retention: Retention | Mapping[str, Any] | None = None) -> None:
        """Store or check the settings, then load the counters and the bucket index, and
        start an empty set cache of ``set_cache_bytes`` (``neardup.state.setcache``).
        ``retention`` replaces the stored retention window (a mapping changes only the
        bounds it names; None keeps it); a shorter one expires documents at once.
        ``requested`` None takes the stored settings (a store that has none raises
        ``StateError``: it holds no neardup state). A store
        whose restore was interrupted (``restoring()``) is left unloaded: it takes no
        commit until ``wipe``, ``apply`` and ``finish_restore``.

        Raises:
            SettingsMismatchError: the store holds other settings (or another layout).
        """
        self.lock = threading.RLock()
        self._requested = (None if requested is None else {**requested, "layout": codec.LAYOUT},
                           set_cache_bytes, retention)
        self._unconfirmed: set[bytes] = set()
        self._ready = not self.restoring()
        if self._ready:
            self._load()

    def _load(self) -> None:
        """Open's loading (and ``finish_restore``'s): see ``_open_settings``."""
        requested, set_cache_bytes, retention = self._requested
        raw = self._get("default", codec.UNCONFIRMED_KEY)
        self._unconfirmed = codec.decode_key_set(raw) if raw else set()
        raw = self._get("default", codec.SETTINGS_KEY)
        if raw is None and requested is None:
            self.close()
            raise StateError(f"state directory {getattr(self, 'path', '')} is not a neardup state directory "
                             "(no settings stored)")
        if requested is None:
            requested = codec.decode_settings(raw)
            if requested.get("layout") != codec.LAYOUT:
                self.close()
                raise SettingsMismatchError({"layout": (requested.get("layout"), codec.LAYOUT)})
        if raw is None:
            # next_seq stays absent (0): replayed after a restored state, a fresh store's
            # records must not reset it
            self._write({"default": [(codec.SETTINGS_KEY, codec.encode_settings(requested))]})
            stored = requested
        else:
            stored = codec.decode_settings(raw)
            differences = {
                name: (stored.get(name), requested.get(name))
                for name in set(stored) | set(requested)
                if stored.get(name) != requested.get(name)
            }
            if differences:
                self.close()
                raise SettingsMismatchError(differences)
        self.settings = stored
        self.num_perm = int(stored["num_perm"])
        self._next_seq = codec.decode_u64(self._get("default", codec.NEXT_SEQ_KEY) or b"\0" * 8)
        max_bucket = self._get("default", codec.MAX_BUCKET_KEY)
        self._max_bucket = codec.decode_u64(max_bucket) if max_bucket else 0
        raw = self._get("default", codec.EXPIRED_BELOW_KEY)
        base = codec.decode_u64(raw) if raw else 0
        raw = self._get("default", codec.WATERMARK_KEY)
        self._watermark = codec.decode_i64(raw) if raw else NO_TIME
        self.index = BucketIndex()
        for _, raw in self._scan("buckets"):
            self.index.add(*codec.decode_memberships(raw))
        self.index.drop_below(base)
        self._forest = Forest(base)
        self._forest.grow(self._next_seq)
        keys, values = [], []
        for key, raw in self._scan("nodes"):
            keys.append(key)
            values.append(raw)
        seqs, nodes = codec.decode_nodes(keys, values)
        self._forest.set(seqs, nodes[:, 0], nodes[:, 1], nodes[:, 2])
        self.sets = SetCache(set_cache_bytes)
        self.sets.drop_below(base)
        # The ids of the newest documents committed, by seq modulo its length (a ring):
        # matches, clusters and nearest candidates are mostly recent documents.
        self._ids: list[str] = [""] * RECENT_IDS
        self._ids_from = self._next_seq  # the seqs from here to _next_seq are in it
        self._times = Times(base)
        for key, raw in self._scan("times"):
            self._times.extend(codec.decode_u64(key[::-1]), codec.decode_times(raw))
        self._times.grow(self._next_seq)
        self._kept: dict[int, bytes] = {}  # expired canonicals' documents records, by seq
        for key, raw in self._scan("documents"):
            seq = int.from_bytes(key, "big")
            if seq >= base:
                break
            self._kept[seq] = raw
        self._open_retention(retention)
        self._ready = True

    def _open_retention(self, requested: Retention | Mapping[str, Any] | None) -> None:
        """Take the stored retention window, or store ``requested`` in its place (a log
        line says what changes), then remove what has expired."""
        raw = self._get("default", codec.RETENTION_KEY)
        stored = Retention.from_dict(codec.decode_settings(raw)) if raw else Retention()
        if isinstance(requested, Mapping):
            requested = Retention.from_dict({**stored.to_dict(), **requested})
        self._retention = stored if requested is None else requested
        if requested is not None and requested != stored:
            self._write({"default": [(codec.RETENTION_KEY, codec.encode_settings(requested.to_dict()))]})
            if stored.shorter_than(requested) and self._times.base > 0:
                logger.warning("retention changed from %s to %s: it is longer now, but the %d documents "
                            "that expired before stay forgotten; only documents from now on are kept longer",
                            stored.describe(), requested.describe(), self._times.base)
            else:
                logger.info("retention changed from %s to %s", stored.describe(), requested.describe())
        self.expire()

    @property
    def forest(self) -> Forest:
        """The committed union-find forest (read-only; not part of ``StateStore``)."""
        return self._forest

    def closure(self, seqs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self._forest.closure(seqs)

    def local_nodes(self, reach: np.ndarray, n_new: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self._forest.local_copy(reach, n_new)

    @property
    def retention(self) -> Retention:
        return self._retention

    def watermark(self) -> int:
        return self._watermark

    def get_times(self, seqs: np.ndarray) -> np.ndarray:
        return self._times.get(seqs)

    def retention_stats(self) -> dict[str, int]:
        """documents_held, documents_expired (held for the next document or not, by the
        window; all held without one), expired_removed (removed from the store), and
        oldest_held_ms (the earliest time among the held documents, 0 with none)."""
        base = self._times.base
        mask = held_since(self._times, base, self._next_seq, self._watermark, self._retention)
        times = self._times.since(base)[: len(mask)][mask]
        count = int(mask.sum())
        return {"documents_held": count, "documents_expired": self._next_seq - count,
                "expired_removed": base, "oldest_held_ms": int(times.min()) if count else 0}

    def next_seq(self) -> int:
        """Raises StateError while a restore is under way (``neardup.state.changelog``)."""
        self._check_ready()
        return self._next_seq

    def ready(self) -> bool:
        """Whether the state is loaded: no restore from the changelog under way."""
        return self._ready

    def _check_ready(self) -> None:
        if not self._ready:
            raise StateError("a restore of the state store is under way: wipe it, apply the changelog, "
                             "then finish_restore")

    def max_bucket_size(self) -> int:
        """Length of the largest band bucket ever written."""
        return self._max_bucket

    def bucket_members(self, bucket_ids: np.ndarray) -> BucketMembers:
        return self.index.lookup(bucket_ids)

    def get_signatures(self, seqs: Sequence[int]) -> np.ndarray:
        raws = self._get_many("signatures", codec.seq_keys(list(seqs)))
        missing = [s for s, raw in zip(seqs, raws) if raw is None]
        if missing:
            raise KeyError(f"no signature stored for documents {missing[:5]}")
        return codec.decode_signatures(raws, self.num_perm)  # type: ignore[arg-type]

    def get_nodes(self, seqs: Sequence[int]) -> list[Node | None]:
        return [self._forest.node(seq) for seq in seqs]

    def _documents(self, seqs: Sequence[int]) -> list[tuple[int, str]]:
        raws = self._get_many("documents", codec.seq_keys(list(seqs)))
        if None in raws:
            raise KeyError("unknown document sequence number")
        return [codec.decode_document(raw) for raw in raws]  # type: ignore[arg-type]

    def get_ids(self, seqs: Sequence[int]) -> list[str]:
        ring, low, high = self._ids, self._ids_from, self._next_seq
        size = len(ring)
        out = [ring[seq % size] if low <= seq < high else None for seq in seqs]
        missing = [i for i, doc_id in enumerate(out) if doc_id is None]
        if missing:
            for i, (_, doc_id) in zip(missing, self._documents([seqs[i] for i in missing])):
                out[i] = doc_id
        return out  # type: ignore[return-value]

    def stored_ids(self, seqs: Sequence[int]) -> list[str]:
        """The ids of those of ``seqs`` whose documents are stored (the others expired
        from the retention window, or never were)."""
        raws = self._get_many("documents", codec.seq_keys(list(seqs)))
        return [codec.decode_document(raw)[1] for raw in raws if raw is not None]

    def get_sizes(self, seqs: Sequence[int]) -> np.ndarray:
        return np.array([size for size, _ in self._documents(seqs)], dtype=np.int64)

    def get_fingerprints(self, seqs: Sequence[int], cache: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """Read through the set cache: the sets it lacks come from the store in one
        multi-get and are added to it. ``cache`` False: every set from the store, the
        cache neither read nor changed (a reader in another thread than the writer's)."""
        seqs = np.asarray(seqs, dtype=np.int64)
        if not cache:
            return self._read_sets(seqs)
        hit, values, offsets = self.sets.lookup(seqs)
        if hit.all():
            return values, offsets
        missing = seqs[~hit]
        read = self._read_sets(missing)
        self.sets.add(missing, *read)
        return merge_sets(hit, (values, offsets), read)

    def _read_sets(self, seqs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The stored sets of ``seqs`` in one multi-get (``get_fingerprints``' layout)."""
        raws = self._get_many("shingles", codec.seq_keys(seqs))
        if None in raws:
            raise KeyError("no shingle fingerprints stored for a document")
        return codec.decode_fingerprint_sets(raws)  # type: ignore[arg-type]

    def get_position(self, source: str) -> int | None:
        raw = self._get("positions", source.encode("utf-8"))
        return None if raw is None else codec.decode_u64(raw)

    def get_verdicts(self, keys: Sequence[bytes]) -> list[bytes | None]:
        return self._get_many("verdicts", keys)

    def verdict_keys(self, begin: bytes, end: bytes) -> list[bytes]:
        return list(self._keys("verdicts", begin, end))

    def get_meta(self, name: bytes) -> bytes | None:
        """The runtime's metadata ``name`` (``StateUpdate.meta``), None if never written."""
        return self._get("default", codec.meta_key(name))

    @exclusive
    def commit(self, update: StateUpdate) -> None:
        self._check_ready()
        if update.first_seq != self._next_seq:
            raise StateError(
                f"update starts at document {update.first_seq}, the store at {self._next_seq}"
            )
        if update.signatures is not None and update.signatures.shape != (len(update.ids), self.num_perm):
            raise StateError(
                f"signatures of shape {update.signatures.shape} for {len(update.ids)} "
                f"documents of {self.num_perm} permutations"
            )
        if update.next_seq > MAX_SEQ + 1:
            raise StateError(f"the store holds at most {MAX_SEQ + 1:,} documents")
        times = update.times if update.times is not None else np.full(
            len(update.ids), round(time.time() * 1000), dtype=np.int64)
        if len(times) != len(update.ids):
            raise StateError(f"{len(times)} times for {len(update.ids)} documents")
        keys = codec.seq_keys(np.arange(update.first_seq, update.next_seq))
        sizes = update.sizes.tolist() if update.sizes is not None else [0] * len(keys)
        puts: Puts = {"documents": zip(keys, map(codec.encode_document, sizes, update.ids))}
        if update.signatures is not None:
            sig_bytes = np.ascontiguousarray(update.signatures, dtype="<u8").tobytes()
            width = 8 * self.num_perm
            puts["signatures"] = ((key, sig_bytes[i * width : (i + 1) * width]) for i, key in enumerate(keys))
        if update.fingerprints is not None:
            puts["shingles"] = zip(keys, codec.encode_fingerprint_sets(update.fingerprints,
                                                                        update.fingerprint_offsets))
        if len(update.bucket_ids):
            puts["buckets"] = [(codec.seq_key(update.first_seq),
                                codec.encode_memberships(update.bucket_ids, update.bucket_seqs))]
        max_bucket = max(self._max_bucket, update.largest_bucket)
        nodes = np.asarray(update.nodes, dtype=np.uint64).reshape(-1, 4)
        puts["nodes"] = zip(codec.seq_keys(nodes[:, 0]), codec.encode_nodes(nodes[:, 1:]))
        puts["positions"] = [(source.encode("utf-8"), codec.encode_u64(position))
                             for source, position in update.positions.items()]
        puts["verdicts"] = update.verdicts.items()
        watermark = max(self._watermark, int(times.max())) if len(times) else self._watermark
        puts["default"] = [(codec.NEXT_SEQ_KEY, codec.encode_u64(update.next_seq)),
                           (codec.MAX_BUCKET_KEY, codec.encode_u64(max_bucket)),
                           (codec.WATERMARK_KEY, codec.encode_i64(watermark)),
                           *((codec.meta_key(name), value) for name, value in update.meta.items())]
        if len(times):
            puts["times"] = [(codec.seq_key(update.first_seq), codec.encode_times(times))]
        deletes: Deletes = {"verdicts": update.verdict_deletes}
        self._times.extend(update.first_seq, times)  # undone below if the write fails
        removal = self._removal(update.next_seq, watermark, update.first_seq, nodes, puts, deletes)
        try:
            self._write(puts, deletes, removal.ranges if removal else None,
                        frozenset({"verdicts"}) if update.local_verdicts else frozenset())
        except BaseException:
            self._times.drop_after(update.first_seq)
            raise
        self._remember_ids(update.first_seq, update.ids)
        self._next_seq = update.next_seq
        self._max_bucket = max_bucket
        self._watermark = watermark
        self.index.add(update.bucket_ids, update.bucket_seqs)
        if removal is None:
            self._forest.grow(update.next_seq)
            self._forest.set(nodes[:, 0], nodes[:, 1], nodes[:, 2], nodes[:, 3])
        else:
            self._removed(removal)
        if update.fingerprints is not None:
            # The newest sets that can be read again, those of the documents in a bucket (a
            # document in none is never a candidate): their copies may come soon.
            joined = _distinct_in(update.bucket_seqs, update.first_seq, update.next_seq)
            self.sets.add(joined, *select_sets(update.fingerprints, update.fingerprint_offsets,
                                               joined - update.first_seq))

    # --- retention: removing expired documents (neardup.state.expiry) ---------------
    @exclusive
    def expire(self) -> None:
        """Remove the expired documents now if that is due (after a shorter retention
        window was set), in one atomic write."""
        n = self._next_seq
        puts: Puts = {}
        deletes: Deletes = {}
        removal = self._removal(n, self._watermark, n, np.empty((0, 4), np.uint64), puts, deletes)
        if removal is not None:
            self._write(puts, deletes, removal.ranges)
            self._removed(removal)

    def _removal(self, n: int, watermark: int, limit: int, nodes: np.ndarray, puts: Puts,
                 deletes: Deletes) -> _Removal | None:
        """Plan the removal of the expired documents below the first one held (at most
        ``limit``) if due, adding its writes to ``puts`` and ``deletes``; None if not due.
        ``nodes``: the batch's union-find rows, applied before re-rooting."""
        new_base = removal_point(self._times, n, watermark, self._retention, limit)
        if new_base is None:
            return None
        base = self._times.base
        forest, rows = self._forest.rebased(nodes, n, new_base)
        # the batch's rows of held documents, then the re-rooted ones (written later, so they win)
        held_rows = nodes[nodes[:, 0] >= new_base] if len(nodes) else nodes
        all_rows = np.concatenate([held_rows, rows]) if len(rows) else held_rows
        puts["nodes"] = list(zip(codec.seq_keys(all_rows[:, 0]), codec.encode_nodes(all_rows[:, 1:])))
        referenced = forest.canonicals_below(new_base).tolist()
        newly = [seq for seq in referenced if seq >= base]
        wanted = set(referenced)
        kept = {seq: raw for seq, raw in self._kept.items() if seq in wanted}
        for seq, raw in zip(newly, self._get_many("documents", codec.seq_keys(newly))):
            if raw is not None:
                kept[seq] = raw
        puts["documents"] = [*puts.get("documents", []),
                             *((codec.seq_key(seq), kept[seq]) for seq in newly if seq in kept)]
        deletes["documents"] = [codec.seq_key(seq) for seq in self._kept if seq not in kept]
        ranges: Ranges = {family: (codec.seq_key(base), codec.seq_key(new_base)) for family in codec.SEQ_FAMILIES}
        batch_start = self._times.batch_start(new_base)
        if batch_start is not None:
            ranges.update({family: (codec.seq_key(0), codec.seq_key(batch_start)) for family in codec.BATCH_FAMILIES})
        puts.setdefault("default", [])
        puts["default"] = [*puts["default"], (codec.EXPIRED_BELOW_KEY, codec.encode_u64(new_base))]
        return _Removal(new_base, forest, kept, ranges)

    def _remember_ids(self, first_seq: int, ids: list[str]) -> None:
        """Put the ids of documents ``first_seq`` on, just committed, in the ring of recent
        ids (the oldest give way)."""
        ring = self._ids
        size = len(ring)
        newest = ids[-size:]  # a batch longer than the ring: its last ones
        at = (first_seq + len(ids) - len(newest)) % size
        head = min(len(newest), size - at)  # up to the ring's end, the rest from its start
        ring[at:at + head] = newest[:head]
        ring[:len(newest) - head] = newest[head:]
        self._ids_from = max(self._ids_from, first_seq + len(ids) - size)

    def _removed(self, removal: _Removal) -> None:
        """After the write: drop the removed documents from memory, then reclaim disk."""
        self._ids_from = max(self._ids_from, removal.base)
        self._forest = removal.forest
        self._kept = removal.kept
        self.index.drop_below(removal.base)
        self.sets.drop_below(removal.base)
        # at every removal (an eighth of the window): the files wholly below are dropped, so
        # the state on disk stays within about 9/8 of the window (every half window, it
        # swung by a third; measured in benchmarks/retention.py)
        self._reclaim(codec.seq_key(removal.base))
        self._times.drop_below(removal.base)


class _Removal:
    """A planned removal: the new base, the re-rooted forest, the kept canonical records,
    the range deletes."""

    def __init__(self, base: int, forest: Forest, kept: dict[int, bytes], ranges: Ranges) -> None:
        self.base, self.forest, self.kept, self.ranges = base, forest, kept, ranges


def _distinct_in(seqs: np.ndarray, first: int, end: int) -> np.ndarray:
    """The distinct values of ``seqs`` (uint64), ascending, as int64: by a mask over
    [``first``, ``end``) when they all lie there (a batch's own documents), else by
    sorting (``sorted_unique``)."""
    if len(seqs) and first <= int(seqs.min()) and int(seqs.max()) < end:
        present = np.zeros(end - first, dtype=bool)
        present[(seqs - np.uint64(first)).astype(np.int64)] = True
        return np.flatnonzero(present) + first
    return sorted_unique(seqs).astype(np.int64)
