"""One shard partition's state in a local RocksDB directory: the materialised view of its
changelog partition (``neardup.sharded.shard_stage``), as a Kafka Streams state store is of its
changelog topic, plus the two indexes a shard looks up (a bucket's members, a document's
copy bucket).

The changelog stays the source of truth; the store is never ahead of it. A batch's
changelog records are applied here only after its Kafka transaction committed, in one
atomic write with the store's position (a changelog offset before which every record is
in the store), as quix-streams keeps processed offsets in the data's own ``WriteBatch``.
So a store is valid whenever it opens, after a clean stop, a rebalance or a SIGKILL alike:
what its process committed and did not apply is after its position, and an open reads the
changelog from there (Kafka Streams' restore, from a checkpoint; Kafka Streams itself, whose
stores take writes before the commit, must wipe a store that was not closed cleanly under
exactly-once). Applying is idempotent (a member is applied once; the others are
puts and deletes), so a position may lag behind what the store holds. A changelog record
of a batch's members (``N``) is applied as one ``M`` record per member, and kept as a
marker (its key, its members' order keys); its deletion (every member expired) deletes
the members still here. A deleted member (``M`` with a null value: expired from the
retention window, which the shard stage applies to the store alone as each member
expires, its ``N`` record staying in the changelog until every member in it has expired) leaves its buckets' and copy
buckets' lists and its own copy bucket in the same write; a deletion of a member that is not
here (applied before, or its record compacted away) changes nothing. A store without a
position (new) is wiped and restored in full; a restore cut short resumes at the position
of its last chunk (``neardup.kafka.partition_log.catch_up``).

Key layout (raw bytes; an order key is ``neardup.sharded.records.ORDER``, 20 bytes, whose
byte order is the documents' order):

- the changelog's records, as they are: ``b"P"`` (watermark, consumed band-topic offset
  and last released order key; the records held in the reorder window are not logged, the
  band topic keeps them: ``neardup.sharded.shard_stage``), ``b"E"`` (the engine digest);
- ``b"M" + order key`` -> a member (its copy joins, buckets and shingle set:
  ``member_value``), from an ``N`` record (or an ``M`` record of an earlier version);
- ``b"N" + order key`` -> the order keys of its members, concatenated: an ``N`` record
  applied (its key is the highest of them);
- ``b"B" + bucket id`` (8 bytes big-endian) -> the members' order keys, concatenated in
  the order they joined;
- ``b"C" + order key`` -> the order keys of the documents that joined that document's copy
  bucket, concatenated;
- ``b"O"`` -> the position: ``">q"`` changelog offset.

Most buckets a document falls in hold no one yet, and RocksDB looks up an absent key in
1 to 3 µs even through its Bloom filters (more than it takes to find one that is there). So
the store keeps in memory a Bloom filter of the buckets it holds (``BucketFilter``, 2 to 4
bytes a bucket), made from the ``B`` keys (``load_filter``, or the first lookup after an
open or a wipe) and told of every bucket a write creates; a bucket it rules out is not
looked up. It may let through an
empty bucket (about 1.4% of them, and those emptied since it was made), never rule out one
that holds a member, so ``members`` answers as the store does.
"""

from __future__ import annotations

import os
import struct
import sys
from collections import ChainMap
from collections.abc import Sequence
from typing import cast

import numpy as np
from rocksdict import WriteBatch

from neardup.sharded.records import BAND, ORDER
from neardup.state.view import TopicView

_U64 = struct.Struct(">Q")
#: Bits of a ``BucketFilter`` per bucket it is made for: with two probes, about 1.4% of the
#: empty buckets asked about pass it.
FILTER_BITS_PER_BUCKET = 16
#: The fewest buckets a ``BucketFilter`` is made for (512 kB a store).
FILTER_MIN_BUCKETS = 1 << 18
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # 2**64 / the golden ratio, odd: Knuth's multiplicative hashing
_N = struct.Struct(">I")
_LITTLE_ENDIAN = sys.byteorder == "little"  # uint64 / uint32 arrays are then "<u8" / "<u4" as they are
ORDER_BYTES = ORDER.size

Record = tuple[bytes, "bytes | None"]


def member_value(copies: Sequence[bytes], band: bytes) -> bytes:
    """An ``M`` record's value: ``">I"`` n, the n order keys of the copy buckets joined,
    then the band record value (its id, the buckets it joined, its set)."""
    return _N.pack(len(copies)) + b"".join(copies) + band


def joined_member_value(copies: Sequence[bytes], doc_id: str, buckets: np.ndarray, fingerprints: np.ndarray) -> bytes:
    """``member_value(copies, BandRecord(order, doc_id, buckets, fingerprints).value())``
    in one join: what a shard logs for each document that joins its buckets, so made
    without the intermediate band value (the band value's parts written here rather than
    through ``neardup.sharded.records``' encoders: per member, their calls doubled its
    cost, 0.59 against 1.19 µs).

    Args:
        copies: the order keys of the copy buckets joined (20 bytes each).
        doc_id: the document's id.
        buckets: uint64 (native byte order), shape (k,): the buckets it joined.
        fingerprints: uint32 (native byte order), sorted distinct: its shingle set.
    """
    raw_id = doc_id.encode("utf-8")
    return b"".join((_N.pack(len(copies)), *copies, BAND.pack(len(buckets), len(raw_id), len(fingerprints)), raw_id,
                     (buckets if _LITTLE_ENDIAN else buckets.astype("<u8")).tobytes(),
                     (fingerprints if _LITTLE_ENDIAN else fingerprints.astype("<u4")).tobytes()))


def member_parts(value: bytes) -> tuple[list[bytes], bytes]:
    """(the order keys of the copy buckets joined, the band record value) of an ``M``
    record's value (``">I"`` n, n order keys, a band record value)."""
    (n,) = _N.unpack_from(value)
    copies = [value[4 + ORDER_BYTES * i:4 + ORDER_BYTES * (i + 1)] for i in range(n)]
    return copies, value[4 + ORDER_BYTES * n:]


def members_value(members: Sequence[tuple[bytes, bytes]]) -> bytes:
    """An ``N`` record's value, a batch's members on one shard partition: ``">I"`` n, then
    per member its order key (20 bytes), ``">I"`` length L and its ``member_value`` (L
    bytes). Its key is ``b"N"`` + the highest of the order keys."""
    parts = [_N.pack(len(members))]
    for order, value in members:
        parts += [order, _N.pack(len(value)), value]
    return b"".join(parts)


def members_parts(value: bytes) -> list[tuple[bytes, bytes]]:
    """``members_value``'s inverse: (order key, ``member_value``) per member.

    Raises:
        ValueError (struct.error): a value of another layout.
    """
    (n,) = _N.unpack_from(value)
    at, out = _N.size, []
    for _ in range(n):
        order = value[at:at + ORDER_BYTES]
        (size,) = _N.unpack_from(value, at + ORDER_BYTES)
        at += ORDER_BYTES + _N.size
        out.append((order, value[at:at + size]))
        at += size
    if at != len(value) or any(len(order) != ORDER_BYTES for order, _ in out):
        raise ValueError("members record of the wrong length")
    return out


def members_of(records: Sequence[Record]) -> list[Record]:
    """``records`` with each ``N`` record put as its members' ``M`` records, after its key
    with its members' order keys (concatenated) as the value (a null ``N`` stays as it is)."""
    out: list[Record] = []
    for key, value in records:
        if key[:1] == b"N" and value is not None:
            members = members_parts(value)
            out.append((key, b"".join(order for order, _ in members)))
            out += [(b"M" + order, member) for order, member in members]
        else:
            out.append((key, value))
    return out


def split_orders(raw: bytes | None) -> list[bytes]:
    """The order keys of a ``B`` or ``C`` value."""
    if not raw:
        return []
    return [raw[i:i + ORDER_BYTES] for i in range(0, len(raw), ORDER_BYTES)]


class BucketFilter:
    """A Bloom filter of bucket ids (B. H. Bloom, "Space/time trade-offs in hash coding
    with allowable errors", CACM 13(7), 1970): ``may_hold`` is True for every id added,
    and for about 1.4% of the others while at most ``capacity`` were added.

    Two probes, the top bits of one multiplicative hash of the id (Knuth, TAOCP vol. 3,
    §6.4): bucket ids are hashes already, but the ids of one shard partition share their
    remainder modulo the shard count, so their low bits would not spread.

    Args:
        capacity: the bucket ids it is made for: ``FILTER_BITS_PER_BUCKET`` bits each, a
            power of two of at least 2**16 and at most 2**32 bits (512 MB).
    """

    def __init__(self, capacity: int) -> None:
        k = min(32, max(16, (max(1, capacity) * FILTER_BITS_PER_BUCKET - 1).bit_length()))
        self._low = np.uint64(64 - k)
        self._high = np.uint64(64 - 2 * k)
        self._mask = np.uint64((1 << k) - 1)
        self._bits = np.zeros(1 << (k - 3), dtype=np.uint8)
        self.capacity = (1 << k) // FILTER_BITS_PER_BUCKET
        self.count = 0  # ids added (an id added twice counts twice)

    def _probes(self, buckets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        with np.errstate(over="ignore"):
            x = np.asarray(buckets, dtype=np.uint64) * _GOLDEN  # modulo 2**64
        return x >> self._low, (x >> self._high) & self._mask

    def add(self, buckets: np.ndarray) -> None:
        """Add bucket ids (uint64, shape (n,))."""
        for p in self._probes(buckets):
            np.bitwise_or.at(self._bits, p >> np.uint64(3), np.left_shift(1, p & np.uint64(7)).astype(np.uint8))
        self.count += len(buckets)

    def may_hold(self, buckets: np.ndarray) -> np.ndarray:
        """bool, shape (n,): False only for bucket ids never added (``buckets``: uint64,
        shape (n,))."""
        out = np.ones(len(buckets), dtype=bool)
        for p in self._probes(buckets):
            out &= (self._bits[p >> np.uint64(3)] >> (p & np.uint64(7)).astype(np.uint8)) & np.uint8(1) > 0
        return out

    @property
    def full(self) -> bool:
        """Whether more ids were added than it was made for (its false positives grow)."""
        return self.count > self.capacity


class ShardStore(TopicView):
    """A shard partition's changelog records and bucket index in RocksDB.

    Args:
        path: the directory (created when missing); it is this partition's alone.
        buckets_of: the bucket ids (uint64) a band record value joined: how an ``M``
            record's buckets are read (``neardup.sharded.records.BandRecord``).

    A directory RocksDB cannot open (corrupted, half deleted) is wiped: the changelog
    holds all of it.

    Raises:
        StateError: the directory cannot be created, opened or wiped (permissions, a full
            disk, another process holding it).
    """

    def __init__(self, path: str | os.PathLike[str], buckets_of) -> None:
        self._buckets_of = buckets_of
        self._filter: BucketFilter | None = None  # made at the first lookup (``_held``)
        # the ``B`` values looked up since the last write and between the two writes before
        # it (None: absent), as stored: the write that adds a batch's members to their
        # buckets finds most of them here (the stage looks up a batch's buckets while the
        # batch before is being committed, so before that batch's write)
        self._read: dict[bytes, bytes | None] = {}
        self._read_before: dict[bytes, bytes | None] = {}
        super().__init__(path, "the shard state")

    def wipe(self) -> None:
        self._filter = None
        self._read, self._read_before = {}, {}
        super().wipe()

    def close(self) -> None:
        self._read, self._read_before = {}, {}
        super().close()

    def _stored_values(self, keys: list[bytes]) -> list[bytes | None]:
        """The values of ``keys``, from the lookups kept or else read."""
        kept = ChainMap(self._read, self._read_before)
        unread = [key for key in keys if key not in kept]
        if unread:
            kept = kept.new_child(dict(zip(unread, self._db.get(unread))))
        return [kept[key] for key in keys]

    def _wrote(self, written: dict[bytes, bytes | None]) -> None:
        """After a write: the values kept are those written now; the older of the two
        generations is dropped."""
        for kept in (self._read, self._read_before):
            for key in kept.keys() & written.keys():
                kept[key] = written[key]
        self._read_before, self._read = self._read, {}

    # --- writes ---------------------------------------------------------------------------
    def apply(self, records: Sequence[Record], position: int | None = None) -> None:
        """Apply committed changelog records (in changelog order) in one atomic write: each
        stored as it is (None deletes; an ``N`` record as its marker and its members' ``M``
        records, ``members_of``), each member (``M``) not yet here also appended to
        its buckets' and copy buckets' lists, each member deleted also removed from them
        (and its copy bucket dropped); with ``position``, the new position.

        Raises:
            StateError: the write failed (a full disk).
        """
        records = self._expanded(records)
        batch = WriteBatch(raw_mode=True)
        appended: dict[bytes, list[bytes]] = {}
        members = list({key for key, _ in records if key[:1] == b"M"})
        values = dict(zip(members, self._db.get(members) if members else []))
        present = {key for key, raw in values.items() if raw is not None}
        removed: set[bytes] = set()  # order keys of the members deleted
        for key, value in records:
            if value is None:
                batch.delete(key)
                if key[:1] == b"M" and key in present:
                    present.discard(key)
                    order = key[1:]
                    removed.add(order)
                    copies, band = member_parts(values[key])  # type: ignore[arg-type]
                    for c in copies:
                        appended.setdefault(b"C" + c, [])
                    for b in self._buckets_of(band):
                        appended.setdefault(b"B" + _U64.pack(b), [])
                    appended.pop(b"C" + order, None)
                    batch.delete(b"C" + order)
                continue
            if key in present:  # applied before (a position that lagged): once only
                continue
            batch.put(key, value)
            if key[:1] == b"M":
                present.add(key)
                values[key] = value
                order = key[1:]
                copies, band = member_parts(value)
                for c in copies:
                    appended.setdefault(b"C" + c, []).append(order)
                for b in self._buckets_of(band):
                    appended.setdefault(b"B" + _U64.pack(b), []).append(order)
        created: list[int] = []  # bucket ids that hold a member now and did not
        written: dict[bytes, bytes | None] = {}
        if appended:
            keys = list(appended)
            for key, old in zip(keys, self._stored_values(keys)):
                raw = (old or b"") + b"".join(appended[key])
                if removed:
                    raw = b"".join(o for o in split_orders(raw) if o not in removed)
                if raw:
                    batch.put(key, raw)
                    if old is None and key[:1] == b"B":
                        created.append(_U64.unpack_from(key, 1)[0])
                else:
                    batch.delete(key)
                written[key] = raw or None
        self.write(batch, position)
        self._wrote(written)
        if self._filter is not None and created:  # after the write: the filter holds at least the store's buckets
            self._filter.add(np.array(created, dtype=np.uint64))
            if self._filter.full:  # made anew at the next lookup, larger
                self._filter = None

    def _expanded(self, records: Sequence[Record]) -> list[Record]:
        """``members_of(records)``, each null ``N`` followed by its members' deletions (the
        order keys its marker holds: put in ``records`` or stored before)."""
        records = members_of(records)
        gone = [key for key, value in records if key[:1] == b"N" and value is None]
        if not gone:
            return records
        marks = {key: value for key, value in records if key[:1] == b"N" and value is not None}
        missing = [key for key in gone if key not in marks]
        marks.update(zip(missing, self._db.get(missing) if missing else []))
        out: list[Record] = []
        for key, value in records:
            out.append((key, value))
            if key[:1] == b"N" and value is None:  # every member of it had expired
                out += [(b"M" + order, None) for order in split_orders(marks.get(key))]
        return out

    # --- reads ----------------------------------------------------------------------------
    def members(self, buckets: Sequence[int]) -> list[list[bytes]]:
        """The members' order keys of each bucket (uint64 ids), in the order they joined."""
        if not len(buckets):
            return []
        maybe = self._held().may_hold(np.array(buckets, dtype=np.uint64)).tolist()
        keys = [b"B" + _U64.pack(b) for b in buckets]
        asked = [key for key, m in zip(keys, maybe) if m]
        read = self._read
        if asked:
            read.update(zip(asked, self._db.get(asked)))
        read.update((key, None) for key, m in zip(keys, maybe) if not m)  # held by none: the filter says so
        return [split_orders(read[key]) for key in keys]

    def load_filter(self) -> None:
        """Make the filter of the buckets held now if there is none (else it is made at the
        first lookup): one scan of the ``B`` keys, about 0.5 µs a bucket (0.14 s for
        277,000; a partition of 30 million buckets would take some 15 s, and as long again
        each time the buckets held double)."""
        self._held()

    def _held(self) -> BucketFilter:
        """The filter of the buckets held; made from the ``B`` keys when there is none (after
        an open, a wipe, or once the last one filled), for twice the buckets held."""
        if self._filter is None:
            held = []
            for raw in self._db.keys(from_key=b"B"):
                key = cast(bytes, raw)
                if key[:1] != b"B":
                    break
                held.append(_U64.unpack_from(key, 1)[0])
            self._filter = BucketFilter(max(FILTER_MIN_BUCKETS, 2 * len(held)))
            self._filter.add(np.array(held, dtype=np.uint64))
        return self._filter

    def copies(self, order: bytes) -> list[bytes]:
        """The order keys in the copy bucket of the document ``order``."""
        return split_orders(self._db.get(b"C" + order))

    def member(self, order: bytes) -> bytes | None:
        """The band record value of the member ``order`` (None if it is none)."""
        raw = self._db.get(b"M" + order)
        return None if raw is None else member_parts(raw)[1]

    def prefixed(self, prefix: bytes) -> list[tuple[bytes, bytes]]:
        """Every (key without ``prefix``, value) under a one-byte ``prefix``."""
        out = []
        for key, value in self._db.items(from_key=prefix):
            if not key.startswith(prefix):
                break
            out.append((key[len(prefix):], value))
        return out

    def members_before(self, time_ms: int) -> list[bytes]:
        """The order keys of the members stamped before ``time_ms`` (ms), ascending by
        time. (An order key's time is signed: those before 1970, -1 for a record without a
        timestamp, sort after the others, their sign bit set.)"""
        negative: list[bytes] = []
        for raw in self._db.keys(from_key=b"M\x80"):
            key = cast(bytes, raw)
            if not key.startswith(b"M") or ORDER.unpack(key[1:])[0] >= time_ms:
                break
            negative.append(key[1:])
        out: list[bytes] = []
        if time_ms > 0:
            low = ORDER.pack(time_ms, 0, 0)
            for raw in self._db.keys(from_key=b"M"):
                key = cast(bytes, raw)
                if not key.startswith(b"M") or key[1] >= 0x80 or key[1:] >= low:
                    break
                out.append(key[1:])
        return negative + out

    def last_member(self) -> bytes | None:
        """The highest order key of a member."""
        last = None
        it = self._db.iter()
        try:
            it.seek_for_prev(b"M" + b"\xff" * ORDER_BYTES)
            if it.valid() and it.key()[:1] == b"M":
                last = it.key()[1:]
        finally:
            del it
        return last
