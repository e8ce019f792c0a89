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
- ``b"B" + bucket id (8 bytes big-endian) + order key`` -> empty: one key per member of a
  bucket, so that joining a bucket or leaving it is a put or a delete, never a rewrite of
  the bucket's list (read first);
- ``b"C" + order key`` -> the order keys of the documents that joined that document's copy
  bucket, concatenated;
- ``b"R" + order key`` -> the lowest band-topic offset the members of that ``N`` record
  refer to (``">q"``; empty: a record of values): what a shard with a retention window
  may delete of its band partition (``neardup.sharded.shard_stage``); written by the
  shard beside the ``N`` records, deleted with them;
- ``b"O"`` -> the position: ``">q"`` changelog offset;
- ``b"V"`` -> the layout (``LAYOUT``): a store of another layout is wiped when it opens
  (and restored from the changelog).

A bucket's members are looked up in memory (``CommittedBuckets``: the ``B`` keys as
sorted runs of (bucket id, row), ``neardup.state.index.BucketIndex``, with each row's
order key: 33 bytes a ``B`` key), made from the ``B`` keys
(``load_index``, or the first lookup after an open or a wipe) and told of every write
after it is made. RocksDB takes 1 to 5 µs to look up a key, even an absent one (most
buckets a document falls in hold no one yet), where the runs answer a batch's buckets in
one compiled pass; and the write that adds a batch's members needs no read of the buckets
they join.
"""

from __future__ import annotations

import os
import struct
import sys
from collections.abc import Sequence
from typing import cast

import numpy as np
from rocksdict import WriteBatch

from neardup.sharded.records import BAND, ORDER
from neardup.state.index import BucketIndex
from neardup.state.view import TopicView

_U64 = struct.Struct(">Q")
_N = struct.Struct(">I")
LAYOUT_KEY = b"V"
LAYOUT = b"members-2"  # a ``B`` key per member of a bucket
#: ``CommittedBuckets`` renumbers its members once more than this many and more than the
#: members alive have left.
RENUMBER_MIN = 1 << 16
#: ``B`` keys read at a time when the index in memory is made.
LOAD_CHUNK = 1 << 16
_B_KEY = np.dtype([("kind", "V1"), ("bucket", ">u8"), ("order", "V20")])  # a ``B`` key's parts
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


#: The first 4 bytes of an ``N`` value of member references (``member_refs_value``); read
#: as the member count of a ``members_value`` they would be over 4 billion members.
REFS_MAGIC = b"\xffREF"
#: A member reference: its order key, the band-topic offset of the band record that holds
#: it, its index there, the buckets it joined (their count; ``ALL_JOINED``: all of the
#: record's) and the copy buckets it joined (their count).
_REF = np.dtype([("order", "V20"), ("offset", ">i8"), ("entry", ">u4"), ("joined", ">u2"), ("copies", ">u2")])
ALL_JOINED = 0xFFFF
REF_BYTES = _REF.itemsize  # a member's reference without its joined buckets' indices and copy buckets
#: (order key, band-topic offset, index in that record, indices of the record's buckets it
#: joined or None for all of them, order keys of the copy buckets it joined)
MemberRef = tuple[bytes, int, int, "Sequence[int] | None", Sequence[bytes]]


def member_refs_value(refs: Sequence[MemberRef]) -> bytes:
    """An ``N`` record's value of references: a batch's members on one shard partition as
    where the band topic holds them, not their sets (the band record is the member's
    value, as a Kafka Streams source-topic changelog is the table's). ``REFS_MAGIC``,
    ``">I"`` n, n ``_REF`` rows, then the joined buckets' indices (``">u2"`` each) of the
    rows that did not join all, then the copy buckets' order keys (20 bytes each), both in
    row order.

    Raises:
        ValueError: a member of over 65,534 buckets or 65,535 copy buckets.
    """
    orders, offsets, entries, joined, copies = zip(*refs) if refs else ((),) * 5
    picked = [j for j in joined if j is not None]
    n_copies = [len(c) for c in copies]
    if max(map(len, picked), default=0) >= ALL_JOINED or max(n_copies, default=0) > 0xFFFF:
        raise ValueError("a member of over 65,534 buckets or 65,535 copy buckets")
    table = np.empty(len(refs), dtype=_REF)
    table["order"] = np.frombuffer(b"".join(orders), dtype="V20")
    table["offset"] = offsets
    table["entry"] = entries
    table["joined"] = [ALL_JOINED if j is None else len(j) for j in joined]
    table["copies"] = n_copies
    return b"".join((REFS_MAGIC, _N.pack(len(refs)), table.tobytes(),
                     np.concatenate(picked).astype(">u2").tobytes() if picked else b"",
                     *(c for cs in copies for c in cs)))


def is_refs_value(value: bytes) -> bool:
    """Whether an ``N`` value holds member references (``member_refs_value``)."""
    return value[:4] == REFS_MAGIC


def member_refs(value: bytes) -> list[MemberRef]:
    """``member_refs_value``'s inverse.

    Raises:
        ValueError (struct.error): a value of another layout.
    """
    if not is_refs_value(value):
        raise ValueError("not a members record of references")
    (n,) = _N.unpack_from(value, 4)
    at = 4 + _N.size
    table = np.frombuffer(value, dtype=_REF, count=n, offset=at)
    at += _REF.itemsize * n
    counts = np.where(table["joined"] == ALL_JOINED, 0, table["joined"]).astype(np.int64)
    picked = np.frombuffer(value, dtype=">u2", count=int(counts.sum()), offset=at).astype(np.int64)
    at += 2 * len(picked)
    n_copies = table["copies"].astype(np.int64)
    if len(value) != at + ORDER_BYTES * int(n_copies.sum()):
        raise ValueError("members record of references of the wrong length")
    out: list[MemberRef] = []
    j_at = c_at = 0
    for row, count, c in zip(table.tolist(), counts.tolist(), n_copies.tolist()):
        order, offset, entry, flag, _ = row
        joined = None if flag == ALL_JOINED else picked[j_at:j_at + count]
        j_at += count
        out.append((bytes(order), offset, entry, joined,
                    [value[at + ORDER_BYTES * (c_at + i):at + ORDER_BYTES * (c_at + i + 1)] for i in range(c)]))
        c_at += c
    return out


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


class CommittedBuckets:
    """The members of a store's buckets, in memory: its ``B`` keys as (bucket id, row)
    pairs in a ``BucketIndex`` (sorted runs merged as a log-structured merge tree), with
    the member's order key of each row: a row per (bucket, member), given in the order
    they are added. A member removed has its rows marked dead, skipped by lookups; the
    rows are numbered anew without the dead once these outnumber the living (and
    ``RENUMBER_MIN``).

    Memory: 33 bytes a row (12 in the runs, 20 its order key, 1 its mark), about a row
    per member at 1,024 shard partitions (32 bands), 8 at 4.
    """

    def __init__(self) -> None:
        self.index = BucketIndex()
        self._orders = bytearray()  # the order key of row i at [20 i, 20 i + 20)
        self._alive = np.zeros(1024, dtype=bool)
        self.count = 0  # rows given
        self.dead = 0

    def _grow(self, count: int) -> None:
        if count > len(self._alive):
            grown = np.zeros(max(2 * len(self._alive), count), dtype=bool)
            grown[:self.count] = self._alive[:self.count]
            self._alive = grown
        self._alive[self.count:count] = True
        self.count = count

    def add_rows(self, keys: bytes) -> None:
        """Add rows: ``keys`` the ``B`` keys (29 bytes each: ``b"B"``, the bucket id
        big-endian, the order key), concatenated, of memberships not held already."""
        rows = np.frombuffer(keys, dtype=_B_KEY)
        first = self.count
        self._grow(first + len(rows))
        self._orders += rows["order"].tobytes()
        self.index.add(rows["bucket"].astype(np.uint64), np.arange(first, self.count, dtype=np.uint64))

    def remove_rows(self, keys: bytes) -> None:
        """Remove rows: ``keys`` as ``add_rows``'s (one not held is skipped)."""
        rows = np.frombuffer(keys, dtype=_B_KEY)
        if not len(rows):
            return
        gone = {order.tobytes() for order in rows["order"]}
        orders = self._orders
        for i in self.index.lookup(np.unique(rows["bucket"].astype(np.uint64))).seqs.tolist():
            if self._alive[i] and bytes(orders[ORDER_BYTES * i:ORDER_BYTES * (i + 1)]) in gone:
                self._alive[i] = False
                self.dead += 1
        if self.dead > max(RENUMBER_MIN, self.count - self.dead):
            self._renumber()

    def _renumber(self) -> None:
        alive = self._alive[:self.count]
        new_rows = np.cumsum(alive, dtype=np.int64) - 1
        new_rows[~alive] = -1
        self.index.renumber(new_rows)
        self._orders = bytearray(np.frombuffer(self._orders, dtype=f"V{ORDER_BYTES}")[alive].tobytes())
        living = self.count - self.dead
        self._alive = np.zeros(max(1024, 2 * living), dtype=bool)
        self.count = self.dead = 0
        self._grow(living)

    def held(self, buckets: np.ndarray) -> dict[int, list[bytes]]:
        """The members' order keys of those of ``buckets`` (uint64, shape (n,), repeats
        allowed) that hold any, ascending; the others are left out."""
        distinct = np.unique(buckets)
        found = self.index.lookup(distinct)
        if not len(found.seqs):
            return {}
        live = self._alive[found.seqs]
        orders = self._orders
        ids = distinct.tolist()
        out: dict[int, list[bytes]] = {}
        for k, i in zip(found.owner[live].tolist(), found.seqs[live].tolist()):
            out.setdefault(ids[k], []).append(bytes(orders[ORDER_BYTES * i:ORDER_BYTES * (i + 1)]))
        for members in out.values():
            if len(members) > 1:
                members.sort()
        return out


class ShardStore(TopicView):
    """A shard partition's changelog records and bucket index in RocksDB.

    Args:
        path: the directory (created when missing); it is this partition's alone.
        buckets_of: the bucket ids (uint64) a band record value joined: how an ``M``
            record's buckets are read (``neardup.sharded.records.BandRecord``).

    A directory RocksDB cannot open (corrupted, half deleted), or of another layout, is
    wiped: the changelog holds all of it.

    Raises:
        StateError: the directory cannot be created, opened or wiped (permissions, a full
            disk, another process holding it).
    """

    def __init__(self, path: str | os.PathLike[str], buckets_of) -> None:
        self._buckets_of = buckets_of
        self._buckets: CommittedBuckets | None = None  # made at the first lookup (``_committed``)
        super().__init__(path, "the shard state")
        if self._db.get(LAYOUT_KEY) != LAYOUT:  # new, or of an earlier layout
            self.wipe()

    def wipe(self) -> None:
        self._buckets = None
        super().wipe()
        batch = WriteBatch(raw_mode=True)
        batch.put(LAYOUT_KEY, LAYOUT)
        self.write(batch, None)

    def close(self) -> None:
        self._buckets = None
        super().close()

    # --- writes ---------------------------------------------------------------------------
    def apply(self, records: Sequence[Record], position: int | None = None) -> None:
        """Apply committed changelog records (in changelog order) in one atomic write: each
        stored as it is (None deletes; an ``N`` record as its marker and its members' ``M``
        records, ``members_of``), each member (``M``) not yet here also put in its buckets
        and appended to its copy buckets' lists, each member deleted also taken out of them
        (and its copy bucket dropped); with ``position``, the new position.

        Raises:
            StateError: the write failed (a full disk).
        """
        records = self._expanded(records)
        batch = WriteBatch(raw_mode=True)
        appended: dict[bytes, list[bytes]] = {}  # copy buckets
        members = list({key for key, _ in records if key[:1] == b"M"})
        values = dict(zip(members, self._db.get(members) if members else []))
        present = {key for key, raw in values.items() if raw is not None}
        before = set(present)
        rows: dict[bytes, list[bytes]] = {}  # ``M`` key -> its member's ``B`` keys, put or deleted
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
                    rows[key] = [b"B" + _U64.pack(b) + order for b in self._buckets_of(band)]
                    for row in rows[key]:
                        batch.delete(row)
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
                rows[key] = [b"B" + _U64.pack(b) + order for b in self._buckets_of(band)]
                for row in rows[key]:
                    batch.put(row, b"")
        if appended:
            keys = list(appended)
            for key, old in zip(keys, self._db.get(keys)):
                raw = (old or b"") + b"".join(appended[key])
                if removed:
                    raw = b"".join(o for o in split_orders(raw) if o not in removed)
                if raw:
                    batch.put(key, raw)
                else:
                    batch.delete(key)
        self.write(batch, position)
        if self._buckets is not None:  # after the write: the lookups answer what is stored
            self._buckets.remove_rows(b"".join(row for key in before - present for row in rows[key]))
            self._buckets.add_rows(b"".join(row for key in present - before for row in rows[key]))

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
        """The members' order keys of each bucket (uint64 ids), ascending."""
        held = self.held(buckets)
        return [list(held.get(b, ())) for b in buckets]

    def held(self, buckets: Sequence[int] | np.ndarray) -> dict[int, list[bytes]]:
        """The members' order keys of those of ``buckets`` (uint64 ids) that hold any,
        ascending; the others are left out."""
        if not len(buckets):
            return {}
        return self._committed().held(np.asarray(buckets, dtype=np.uint64))

    def load_index(self) -> None:
        """Make the buckets' index in memory if there is none (else it is made at the
        first lookup): one scan of the ``B`` keys, about 1 µs a membership."""
        self._committed()

    def _committed(self) -> CommittedBuckets:
        """The buckets' index in memory; made from the ``B`` keys when there is none (after
        an open or a wipe)."""
        if self._buckets is None:
            self._buckets = CommittedBuckets()
            keys: list[bytes] = []
            for raw in self._db.keys(from_key=b"B"):
                key = cast(bytes, raw)
                if key[:1] != b"B":
                    break
                keys.append(key)
                if len(keys) == LOAD_CHUNK:
                    self._buckets.add_rows(b"".join(keys))
                    keys = []
            self._buckets.add_rows(b"".join(keys))
        return self._buckets

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
