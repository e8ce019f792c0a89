"""The shard stage of a sharded deduplication (docs/scale-out.md): a stateful
``Processor`` on the stage runtime (``neardup.kafka.stage``).

A band record sent without its documents' sets (prepare without a retention window)
names the set records that hold them (``SETS_HEADER``); ``SetReader`` reads those from
the set topic, once per process however many of its partitions a document touches.

Each partition p of the band topic is one shard: its buckets and their members' sets, the
documents held in its reorder window, and its changelog, partition p of
``<app>.shard-changelog`` (compacted). A band record holds a prepare batch's documents
that touch the shard (``neardup.sharded.records``); each is held, released and processed
on its own. Every change is produced to the changelog in the
batch's transaction, so the changelog's committed records are exactly the state of the
committed input offsets. The documents held are not logged: the band topic holds them, and
the offset committed for partition p is that of the band record of its earliest document
still held (or the batch's end when none is), so that a restart reads them again (see
"Held records" below).
Where the state is kept:

- in memory (``ShardIndex``; no ``state_dir``): rebuilt from the whole changelog partition
  when the partition is assigned (Kafka Streams' restore) and after a failed batch
  (``aborted``: what ``compute`` changed in memory is dropped and read again);
- on disk (``state_dir``): a RocksDB store per partition, ``state_dir/shard-<p>``
  (``neardup.state.shard_store``, ``StoredShardIndex``), to which a batch's changelog
  records are applied once its transaction has committed (``committed``), with their
  changelog offsets (from the delivery reports); the members of batches not yet committed
  stay in memory over it. On assignment and after a failed batch, the store reads the
  changelog from its position only (everything when it has none).

Order: a document of a band record is held until every input partition's watermark is
past its order key, then processed with the others released, in order-key order. The watermarks come
from prepare (``neardup.sharded.prepare_stage``: a watermark record to every shard partition
with each batch, and while idle), and are the largest order key prepare has sent of each
input partition, or the wall clock minus ``reorder_window_ms`` for a partition read to its
end; a shard waits for every partition of every input topic it has heard of. So however
unevenly prepare reads the partitions of a backlog, the documents are processed in
order-key order, as one process would; a partition whose prepare is gone holds the shard
until the partition is assigned again (``session.timeout.ms``; at once with static
membership). Watermarks live in memory: after a restart or a failed batch, a shard holds
until each partition's next watermark. A document arriving after a later one was
released (one stamped before its partition's watermark) is processed at once and counted
as late.

Held records: a shard releases in order-key order, so every document it has consumed with
an order key at or below the last one released has been processed, and every one above
it is held. After a restart (or on another process after a rebalance) the shard reads
its band partition again from the committed offset (the record of the earliest document
held); a document of a record before ``P``'s consumed offset is skipped if its order key
is at or below the last released (processed before), held again otherwise. After a
failed batch (``aborted``) the runtime reads again from the failed batch's first offsets
only: the documents held as of the last committed batch are kept in memory for it
(``_Shard.committed_held``).

Changelog records (key -> value; a null value deletes):

- ``b"N" + order key`` -> a batch's members on this shard partition, in the order they
  joined (``neardup.state.shard_store.members_value``; the key is the highest of their
  order keys), each a ``member_value``: ``">I"`` n, n candidate order keys whose copy
  bucket it joined, then a member value (id, the buckets it joined, its set). One record
  per batch and partition (split above ``MEMBERS_RECORD_BYTES``), not one per member: at
  16 shards a document joins about 14 partitions, and a record each cost a produce call
  and librdkafka's work per record. An earlier version wrote ``b"M" + order key`` ->
  one ``member_value``; a restore still reads those.

  With a band topic that keeps its records for good (``retention.ms`` and
  ``retention.bytes`` -1, as the stages create it: ``Topology.keep_bands``), the ``N``
  record holds references instead
  (``neardup.state.shard_store.member_refs_value``): per member its order key, the
  band-topic offset of its band record and its index there, the buckets it joined when
  not all, its copy buckets. The band record is the member's value, as a Kafka Streams
  source topic is the changelog of its table; a restore reads the band records named
  (``_expanded``, ``RESOLVE_MEMBERS`` members at a time), and the set records of those
  sent without their sets, and one no longer there stops it
  with one line (``BandRecordGoneError``). A store takes the members' values as before.
  Whether the band topic keeps its records is read at every assignment; references met
  while it does not stop the stage with one line (``BandTopicNotKeptError``), before the
  records they name are deleted.
- ``b"P"`` -> ``">qq"`` the watermark (ms) and the consumed offset (the band partition's
  offset after the last record of the batch), then the last order key released (none
  yet: empty).
- ``b"E"`` -> the engine settings' digest (``engine_digest``), in the first batch after
  each restore of the partition: the settings the members were indexed with. A partition restored with another digest stops
  the stage with one line (members of another banding would never be met: wrong verdicts,
  silently); one without (written by an earlier version) is taken as it is, with a warning.

Findings go to decide as one findings record per batch and decide partition
(``neardup.sharded.records``).

Retention (``retention_ms``): the shard's index meets only the members held in the window
(``neardup.sharded.shard``), and each time the window's floor has moved by an eighth of it,
the batch deletes the expired members: the in-memory index at once, a store when the
batch has committed (dropping the member from its buckets' lists,
``neardup.state.shard_store``), and in the changelog a null ``N`` record, in the batch's
transaction, for each ``N`` record whose members have all expired (its key, the highest
order key, is below the floor). An ``N`` record with a member still in the window keeps
the expired ones beside it until that one expires too: a restore adds them and the first
batch after it deletes them again (the first removal after a restore is always due). So
the state held stays about 9/8 of the window, in memory and on disk, and the compacted
changelog that plus about a batch per partition. (``M`` records of an earlier version
are not deleted from the changelog: a restore adds them and the window drops them.) The shard's mark after a restore is the time of the last record
released (``P``).

With a window and references, the shard also deletes the band records no longer needed,
as Kafka Streams purges a repartition topic once its records are processed: once a batch
has committed, band partition p's records below its ``_Shard.purge_point`` (the lowest
offset a live ``N`` record refers to, and the offset the batch commits for p) are
deleted (``AdminClient.delete_records``, at most every ``PURGE_INTERVAL_S``, and what is
due when the shard closes). The point
of a committed batch is only ever past records that no committed state needs: a restore,
a failed batch or another owner after a rebalance read from there on. Each ``N`` record's
lowest offset is kept in memory beside its key (``_Shard.ref_floors``), read back from its
references by a restore, and kept in a store as an ``R`` record; a store of an earlier
version, without them, purges nothing until its ``N`` records of then have expired.
"""

from __future__ import annotations

import concurrent.futures
import heapq
import logging
import struct
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from pathlib import Path
from typing import Any

import numpy as np
from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from neardup.config import Settings
from neardup.core.settings import EngineSettings
from neardup.kafka.bounded import discard
from neardup.kafka.clients import admin_config
from neardup.kafka.partition_log import AheadOfTopicError, catch_up, read_to_end, with_retries
from neardup.kafka.topics import keeps_records
from neardup.kafka.stage import MessageBatch, StageHooks, StageRuntime, TP, next_offsets, produce_all
from neardup.sharded.sets import SetReader, SetRecordGoneError
from neardup.sharded.topology import STAGE_PRODUCER, Topology
from neardup.sharded.records import (
    EMPTY_FINDING_BYTES,
    ENGINE_HEADER,
    BandRecordGoneError,
    BandTopicNotKeptError,
    ChangelogLayoutError,
    EngineMismatchError,
    FINDINGS_KIND,
    KIND_HEADER,
    SETS_HEADER,
    ORDER,
    WATERMARK_KIND,
    BandRecord,
    Watermarks,
    band_buckets,
    band_orders,
    check_engine,
    decide_partition,
    engine_digest,
    findings_value,
    found_value,
    order_seq,
    order_time,
    parse_bands,
    seq_order,
    split_runs,
)
from neardup.sharded.shard import Joins, ShardIndex, StoredShardIndex
from neardup.state.shard_store import (
    REF_BYTES,
    MemberRef,
    ShardStore,
    is_refs_value,
    joined_member_value,
    member_parts,
    member_refs,
    member_refs_value,
    members_of,
    members_parts,
    members_value,
)

log = logging.getLogger(__name__)
_PROGRESS = struct.Struct(">qq")  # a ``P`` record: watermark (ms), consumed offset
#: The largest findings record produced, bytes (a batch's findings for one decide
#: partition are split above it; librdkafka's message.max.bytes is 1,000,000 by default).
FINDINGS_RECORD_BYTES = 512 << 10
#: The largest ``N`` record produced (a batch's members on one shard partition), bytes
#: (split above it).
MEMBERS_RECORD_BYTES = 512 << 10
#: Members whose band records a restore reads at a time (``_resolve``): the band records
#: of a group are held in memory until its members are made.
RESOLVE_MEMBERS = 1 << 17
Record = tuple[str, int, bytes | None, bytes | None, list[tuple[str, bytes]]]
#: A shard batch holds about this many times ``batch_size`` documents (``batch_messages``):
#: what a batch costs apart from its documents (a ``P`` record per partition, the findings
#: records, the transaction) is spread over many.
BATCH_DOCUMENTS_PER_SIZE = 10


#: A member joined in a batch: its order key, its ``member_value`` (None when only its
#: reference is logged, without a store), its reference (None when its value is logged).
_Joined = tuple[bytes, "bytes | None", "MemberRef | None"]


#: A changelog record as a restore reads it (``ShardProcessor._expanded``): key, value, and
#: for an ``N`` record of references its members (order key, band record entry, buckets
#: joined, copy buckets' order keys).
_Expanded = tuple[bytes, "bytes | None", "list[tuple[bytes, BandRecord, np.ndarray, Sequence[bytes]]] | None"]


#: An ``R`` store record's value: the lowest band-topic offset an ``N`` record's members
#: refer to (empty: a record of values, referring to none).
_FLOOR = struct.Struct(">q")
#: Seconds between two purges of the band topic (``ShardProcessor._purge``).
PURGE_INTERVAL_S = 10.0
#: Longest wait, seconds, for the purges a closing shard sends (those not yet due).
PURGE_CLOSE_WAIT_S = 10.0


def _floor_value(floor: int | None) -> bytes:
    return b"" if floor is None else _FLOOR.pack(floor)


def _floor_of(value: bytes) -> int | None:
    return _FLOOR.unpack(value)[0] if value else None


def _lowest_offset(members: list[tuple[bytes, BandRecord, np.ndarray, Sequence[bytes]]]) -> int | None:
    """The lowest band-topic offset of an ``N`` record's members as ``_resolve`` read them
    (None: none, a record whose band records were gone)."""
    return min((rec.offset for _, rec, _, _ in members), default=None)


def _picked(buckets: list[int], joined: list[int]) -> list[int]:
    """The indices in ``buckets`` of ``joined``, a subsequence of it (``ShardIndex.add``
    keeps the buckets a document joins in its order). In Python: ``np.isin`` costs some
    20 µs a call on arrays of a few ids, and most documents that meet someone join some
    of their buckets only."""
    out, j = [], 0
    for i, b in enumerate(buckets):
        if j < len(joined) and b == joined[j]:
            out.append(i)
            j += 1
    return out


def _ref_bytes(member: _Joined) -> int:
    """About the bytes of a member's reference in an ``N`` record (``member_refs_value``)."""
    _, _, (_, _, _, some, copies) = member  # type: ignore[misc]
    return REF_BYTES + (0 if some is None else 2 * len(some)) + ORDER.size * len(copies)


@dataclass
class _Shard:
    """One shard partition's state."""

    index: ShardIndex
    store: ShardStore | None = None
    # order key -> (record, its band-topic offset), in the order consumed (offset order)
    held: dict[bytes, tuple[BandRecord, int]] = field(default_factory=dict)
    committed_held: dict[bytes, tuple[BandRecord, int]] = field(default_factory=dict)  # as of the last commit
    # what ``held`` took and gave since the last ``changes``: the batch's change to it
    added: list[tuple[bytes, tuple[BandRecord, int]]] = field(default_factory=list)
    removed: list[bytes] = field(default_factory=list)
    queue: list[bytes] = field(default_factory=list)  # the held keys, a heap (a key may repeat)
    last: bytes = b""
    engine_logged: bool = False  # its ``E`` record written since the restore (once is enough: compacted, kept)
    batches: set[bytes] = field(default_factory=set)  # the keys (order keys) of its ``N`` records not deleted
    watermark: int = -(1 << 62)
    consumed: int = -1  # band-topic offset after the last record of the batches logged (P)
    # per ``N`` key (without its prefix): the lowest band-topic offset its members refer
    # to, None for a record of values (``logged``); the same as a heap, (offset, key), with
    # stale entries; the live keys whose offsets are not known (a store of an earlier
    # version): nothing is purged while there are any (``purge_point``)
    ref_floors: dict[bytes, int | None] = field(default_factory=dict)
    floor_heap: list[tuple[int, bytes]] = field(default_factory=list)
    unknown_floors: set[bytes] = field(default_factory=set)
    watermarks: Watermarks = field(default_factory=Watermarks)  # from the watermark records read

    def hold(self, rec: BandRecord, offset: int) -> None:
        if rec.order not in self.held:
            self.held[rec.order] = (rec, offset)
            self.added.append((rec.order, (rec, offset)))
            heapq.heappush(self.queue, rec.order)

    def changes(self) -> tuple[list[tuple[bytes, tuple[BandRecord, int]]], list[bytes]]:
        """What ``held`` took and gave since the last call (in that order: a document held
        and released in one batch is in both)."""
        out = (self.added, self.removed)
        self.added, self.removed = [], []
        return out

    def commit(self, added: list[tuple[bytes, tuple[BandRecord, int]]], removed: list[bytes]) -> None:
        """Apply a committed batch's ``changes`` to ``committed_held``."""
        self.committed_held.update(added)
        for key in removed:
            self.committed_held.pop(key, None)

    def first_held(self) -> int | None:
        """The band-topic offset of the earliest record held (None: none is)."""
        return next(iter(self.held.values()))[1] if self.held else None

    def logged(self, key: bytes, floor: int | None) -> None:
        """An ``N`` record of key ``key`` (without its prefix), its members referring to
        band records from offset ``floor`` on (None: a record of values)."""
        self.batches.add(key)
        self.ref_floors[key] = floor
        if floor is not None:
            heapq.heappush(self.floor_heap, (floor, key))

    def dropped(self, keys: list[bytes]) -> None:
        """``N`` records deleted (every member expired)."""
        self.batches.difference_update(keys)
        for key in keys:
            self.ref_floors.pop(key, None)
            self.unknown_floors.discard(key)

    def purge_point(self, resume: int) -> int | None:
        """The band-topic offset below which no record is needed any more: below
        ``resume``, the offset the batch commits for the partition (a restart reads again
        from there: the earliest record held, or the batch's end; not the ``P`` record's
        consumed offset, which after a restart lies past records still to be read again),
        and below every offset a live ``N`` record refers to (None: not known, an ``N``
        record's references not known)."""
        if self.unknown_floors:
            return None
        heap, floors = self.floor_heap, self.ref_floors
        while heap and floors.get(heap[0][1]) != heap[0][0]:  # deleted since (or logged again)
            heapq.heappop(heap)
        return min(resume, heap[0][0]) if heap else resume

    def progress(self, value: bytes, where: tuple[str, int]) -> None:
        """Take a ``P`` record's value (watermark, consumed offset, last released) of
        changelog partition ``where``.

        Raises:
            ChangelogLayoutError: a ``P`` of an earlier layout (a watermark alone).
        """
        if len(value) not in (_PROGRESS.size, _PROGRESS.size + ORDER.size):
            raise ChangelogLayoutError(*where, f"a progress record of {len(value)} bytes")
        self.watermark, self.consumed = _PROGRESS.unpack_from(value)
        self.last = value[_PROGRESS.size:]

    def requeue(self) -> None:
        """The heap of ``held`` anew (after a restore)."""
        self.queue = list(self.held)
        heapq.heapify(self.queue)

    def ready(self, limit: bytes) -> list[BandRecord]:
        """Take the held records at or below ``limit``, in order-key order."""
        out = []
        while self.queue and self.queue[0] <= limit:
            key = heapq.heappop(self.queue)
            held = self.held.pop(key, None)
            if held is not None:
                self.removed.append(key)
                out.append(held[0])
        return out

    def limit(self) -> bytes | None:
        """The order key up to which every input partition has been sent (``Watermarks.limit``)."""
        return self.watermarks.limit()


@dataclass
class ShardWritten:
    offsets: list[TopicPartition]  # per band partition: its earliest record held, else the batch's end
    messages: int = 0
    documents: int = 0  # the band records' documents
    released: int = 0
    late: int = 0
    lateness_ms: list[int] = field(default_factory=list)  # per late record: ms behind the last released
    malformed: int = 0
    held: int = 0
    expired: int = 0  # members deleted from the retention window
    finding_bytes: int = 0
    changelog_bytes: int = 0
    seconds: float = 0.0
    positions: dict[int, int] = field(default_factory=dict)  # changelog partition -> offset after its last record


class ShardProcessor(StageHooks):
    """The shard stage's ``Processor``.

    Args:
        settings: Kafka and batch settings; ``settings.engine()`` gives the shard's rules.
        topology: the sharded topics.
        state_dir: where each shard partition's state is kept on disk, a RocksDB store
            per partition (``neardup.state.shard_store``); None: in memory.
        retention_ms: the retention window, ms (see the module docstring); None keeps
            every member.
    """

    def __init__(self, settings: Settings, topology: Topology, state_dir: Path | None = None,
                 retention_ms: int | None = None) -> None:
        self.settings = settings
        self.state_dir = state_dir
        self.retention_ms = retention_ms
        # per batch computed and not yet committed, in order: its changelog records per
        # shard partition (what the stores take once it is committed; with a state_dir),
        # the change to the documents held of each partition it touched (``_Shard.changes``),
        # and with a window, the band records no longer needed once it has committed
        # (``_Shard.purge_point`` per partition it touched)
        self._uncommitted: list[tuple[dict[int, list[tuple[bytes, bytes | None]]],
                                      dict[int, tuple[_Shard, list[tuple[bytes, tuple[BandRecord, int]]],
                                                      list[bytes]]],
                                      dict[int, int | None]]] = []
        self.engine: EngineSettings = settings.engine()
        self.digest = engine_digest(self.engine)
        self.topology = topology
        self.shards: dict[int, _Shard] = {}
        self._ensured = False
        # members logged as references to their band records (``member_refs_value``): a
        # band topic that keeps its records (``check``)
        self._refs = False
        self._kept: bool | None = None  # whether the band topic keeps its records (None: not known)
        # with a window and references, the band records no longer needed are deleted
        # (``_purge``): per band partition, the offset to delete below once due, and the
        # offset deleted below last
        self._purging = False
        self._purge_due: dict[int, int] = {}
        self._purged: dict[int, int] = {}
        self._purged_at = float("-inf")  # time.monotonic() of the last purge
        self._purge_refused = False
        self._admin: AdminClient | None = None
        # documents per band record (``batch_messages``); at first as many as a band record
        # of a full prepare batch holds
        self._per_message = float(settings.batch_size)
        self.set_reader = SetReader(settings, topology.sets)  # the sets of band records sent without them
        self._sets_warned = False  # told that prepare sends the sets apart while this shard keeps a window

    # --- lifecycle ------------------------------------------------------------------
    def is_output(self, topic: str) -> bool:
        return topic in (self.topology.findings, self.topology.shard_changelog)

    def batch_messages(self, batch_size: int) -> int:
        """Messages per batch: about ``BATCH_DOCUMENTS_PER_SIZE`` × ``batch_size`` documents'
        worth, by the documents per band record of the batches before (the largest of the
        last batch, or a slowly falling average); a band record holds up to a prepare batch
        of documents, so ``batch_size`` records could hold a million of them in a backlog
        (one batch of many seconds, all in memory)."""
        return max(1, min(batch_size, int(BATCH_DOCUMENTS_PER_SIZE * batch_size / self._per_message)))

    def start(self, producer: Producer) -> None:
        """Create the topology's topics (once) before the consumer subscribes to the band
        topic: a shard started before any prepare or decide of a new deduplication would
        otherwise subscribe to a topic that does not exist and get no partition until
        its consumer is made anew a minute later.

        Raises:
            TopologyMismatchError: an existing topic has another partition count.
        """
        self._ensure()

    def _ensure(self) -> None:
        if not self._ensured:  # retried: the broker may be out (a check that raises ends the stage)
            with_retries("creating the topology's topics", lambda: self.topology.ensure_with(self.settings))
            self._ensured = True

    def check(self, consumer: Consumer, partitions: list[TP]) -> None:
        """Create the topology's topics (once), then restore the newly assigned shards.

        Raises:
            TopologyMismatchError: an existing topic has another partition count.
            KafkaException: the changelog could not be read.
        """
        self._ensure()
        self._kept = with_retries("reading the band topic's settings", self._bands_kept)
        refs = self._kept is True
        if refs != self._refs:
            log.info("members logged %s", "as references to their band records (the band topic keeps its records)"
                     if refs else "with their sets (the band topic does not keep its records for good)")
        self._refs = refs
        # with a window, the shard deletes the band records its members no longer need
        self._purging = refs and self.retention_ms is not None
        for _, p in partitions:
            self.shards[p] = with_retries(f"restoring shard {p}", lambda p=p: self._restore(p))

    def _bands_kept(self) -> bool | None:
        """Whether the band topic keeps its records for good (``keeps_records``); None when
        this stage may not read the topic's settings (logged: members then keep their values).

        Raises:
            KafkaException: the broker did not answer.
        """
        admin = AdminClient(admin_config(self.settings))
        try:
            # a member's set is in the set topic when its band record was sent without it
            return keeps_records(admin, self.topology.bands) and keeps_records(admin, self.topology.sets)
        except KafkaException as exc:
            if exc.args[0].code() not in (KafkaError.TOPIC_AUTHORIZATION_FAILED, KafkaError.CLUSTER_AUTHORIZATION_FAILED):
                raise
            log.warning("cannot read the settings of %s (%s): members are logged with their sets", self.topology.bands,
                        exc.args[0].str())
            return None
        finally:
            discard(admin)

    def revoked(self, partitions: set[TP]) -> None:
        """The partitions' state is dropped (their stores closed)."""
        for _, p in partitions:
            shard = self.shards.pop(p, None)
            if shard is not None and shard.store is not None:
                shard.store.close()

    def aborted(self) -> None:
        """Drop what memory holds and restore every shard from its changelog, holding the
        records held as of the last committed batch (the runtime reads again from the
        failed batch's first offsets only)."""
        self._uncommitted = []
        for p in list(self.shards):
            held = self.shards[p].committed_held
            shard = self.shards[p] = with_retries(f"restoring shard {p}", lambda p=p: self._restore(p))
            shard.held, shard.committed_held = dict(held), held
            shard.added, shard.removed = [], []
            shard.requeue()

    def committed(self, written: ShardWritten, seconds: float) -> ShardWritten:
        """The oldest batch not yet committed is: its changelog records go to the stores
        (with the changelog offsets their delivery reported), whose overlays then keep
        only the later batches' members."""
        written.seconds = seconds
        if self._uncommitted:
            batch, held, points = self._uncommitted.pop(0)
            for p, (owner, added, removed) in held.items():
                if self.shards.get(p) is owner:  # not a shard restored since (its own batches hold it)
                    owner.commit(added, removed)
            for p, records in batch.items():
                shard = self.shards.get(p)
                if shard is None or shard.store is None:
                    continue
                shard.store.apply(records, written.positions.get(p))
                assert isinstance(shard.index, StoredShardIndex)
                shard.index.forget()
                for later, _, _ in self._uncommitted:
                    for key, value in members_of(later.get(p, ())):
                        if key[:1] == b"M" and value is not None:
                            self._member(shard.index, key[1:], value)
                        elif key[:1] == b"M":
                            shard.index.remove([order_seq(key[1:])])
            self._purge(points)
        return written

    def _purge(self, points: dict[int, int | None]) -> None:
        """Delete the band records below a committed batch's ``points`` (per band partition:
        ``_Shard.purge_point`` after it), at most every ``PURGE_INTERVAL_S`` (the later
        points of the partitions due wait for the next): the records of documents
        processed whose members have expired, as Kafka Streams purges a repartition topic.
        A refusal is logged (once as an error when not authorized: the topic then grows)
        and the partition is tried again with its next point."""
        for p, point in points.items():
            if point is not None and point > max(0, self._purged.get(p, 0)):  # never 0 or -1 (OFFSET_END: all)
                self._purge_due[p] = point
        now = time.monotonic()
        if self._purge_due and now - self._purged_at >= PURGE_INTERVAL_S:
            self._purged_at = now
            self._delete_due()

    def _delete_due(self) -> list[Any]:
        """Send the purges due (``_purge``); their futures (none if the call failed)."""
        if self._admin is None:
            self._admin = AdminClient(admin_config(self.settings))
        due, self._purge_due = self._purge_due, {}
        try:
            futures = self._admin.delete_records([TopicPartition(self.topology.bands, p, point)
                                                  for p, point in sorted(due.items())], request_timeout=30)
        except KafkaException as exc:
            log.warning("could not delete the band records no longer needed (%s); tried again later", exc)
            return []
        for tp, future in futures.items():
            future.add_done_callback(lambda f, p=tp.partition, point=tp.offset: self._deleted(p, point, f))
        return list(futures.values())

    def _deleted(self, p: int, point: int, future: Any) -> None:
        """The outcome of a purge of band partition ``p`` below ``point`` (the admin
        client's thread)."""
        exc = future.exception()
        if exc is None:
            self._purged[p] = max(point, self._purged.get(p, 0))
            return
        err = exc.args[0] if exc.args and isinstance(exc.args[0], KafkaError) else None
        if err is not None and err.code() in (KafkaError.TOPIC_AUTHORIZATION_FAILED,
                                              KafkaError.CLUSTER_AUTHORIZATION_FAILED):
            if not self._purge_refused:
                self._purge_refused = True
                log.error("may not delete the records of %s (%s): the band topic keeps what the shards no longer "
                          "need and grows; allow this stage to delete its records (the DELETE operation on the "
                          "topic)", self.topology.bands, err.str())
            return
        log.warning("deleting the records of %s[%d] below offset %d failed (%s); tried again later",
                    self.topology.bands, p, point, exc)

    def close(self) -> None:
        for shard in self.shards.values():
            if shard.store is not None:
                shard.store.close()
        self.shards = {}
        if self._purge_due:  # the last committed batches' purges, not yet due by the interval
            concurrent.futures.wait(self._delete_due(), timeout=PURGE_CLOSE_WAIT_S)
        if self._admin is not None:
            discard(self._admin)
            self._admin = None
        self.set_reader.close()

    @staticmethod
    def _member(index: ShardIndex, order: bytes, value: bytes) -> None:
        """Add a member (an ``M`` changelog record) to ``index``'s dicts."""
        copies, band = member_parts(value)
        rec = BandRecord.parse(order, band)
        index.apply(order_seq(order), rec.id, Joins(rec.buckets, tuple(order_seq(c) for c in copies)),
                    rec.fingerprints)

    def _restore(self, p: int) -> _Shard:
        if self.state_dir is not None:
            return self._restore_stored(p)
        shard = _Shard(ShardIndex(self.engine, self.retention_ms))
        started, records = time.perf_counter(), 0
        # the ``N`` records (and ``M`` of an earlier version) in changelog order, less the deleted
        members: dict[bytes, bytes] = {}
        engine: bytes | None = None
        for chunk in read_to_end(self.settings, self.topology.shard_changelog, p):
            for m in chunk:
                records += 1
                key, value = m.key(), m.value()
                kind = key[:1]
                if kind in (b"N", b"M"):
                    if value is None:
                        members.pop(key, None)
                    else:
                        members.setdefault(key, value)
                elif kind == b"P" and value is not None:
                    shard.progress(value, (self.topology.shard_changelog, p))
                elif kind == b"E" and value is not None:
                    engine = value
        self._check_state(p, engine, bool(members))
        for group in self._expanded(p, list(members.items())):
            for key, value, batch in group:
                if key[:1] == b"M":
                    self._member(shard.index, key[1:], value)
                    continue
                if batch is not None:  # references: each member from its band record's entry
                    for order, rec, buckets, copies in batch:
                        shard.index.apply(order_seq(order), rec.id, Joins(buckets, tuple(map(order_seq, copies))),
                                          rec.fingerprints)
                    shard.logged(key[1:], _lowest_offset(batch))
                    continue
                try:
                    values = members_parts(value)
                except (ValueError, struct.error) as exc:
                    raise ChangelogLayoutError(self.topology.shard_changelog, p, f"a members record ({exc})") from exc
                for order, member in values:
                    self._member(shard.index, order, member)
                shard.logged(key[1:], None)
        self._resume(shard)
        if records:
            log.info("shard %d restored from %s: %d records, %d members, in %.1f s", p,
                     self.topology.shard_changelog, records, len(shard.index.sets), time.perf_counter() - started)
        return shard

    def _restore_stored(self, p: int) -> _Shard:
        """Open partition ``p``'s store and apply the changelog's records from its position
        (``neardup.state.shard_store``, ``neardup.kafka.partition_log.catch_up``); without
        one (a new store), or with one beyond the changelog's end, wiped and every record."""
        previous = self.shards.pop(p, None)
        if previous is not None and previous.store is not None:
            previous.store.close()
        assert self.state_dir is not None
        store = ShardStore(self.state_dir / f"shard-{p}", band_buckets)
        started = time.perf_counter()

        def wipe() -> None:
            store.wipe()
            store.apply([], position=0)

        # ``N`` records whose band records were gone when read: each must be deleted later
        gone: dict[bytes, tuple[int, bytes]] = {}

        def apply(chunk: list[Message]) -> None:  # the members referred to made whole, a group at a time
            at = 0
            for group in self._expanded(p, [(m.key(), m.value()) for m in chunk], gone):
                at += len(group)
                records: list[tuple[bytes, bytes | None]] = []
                for key, value, batch in group:
                    records.append((key, value if batch is None else members_value(
                        [(order, joined_member_value(copies, rec.id, buckets, rec.fingerprints))
                         for order, rec, buckets, copies in batch])))
                    if key[:1] == b"N":  # its references' floor (``_Shard.ref_floors``)
                        records.append((b"R" + key[1:], None if value is None else _floor_value(
                            None if batch is None else _lowest_offset(batch))))
                store.apply(records, position=chunk[at - 1].offset() + 1)

        try:
            start, records = catch_up(self.settings, self.topology.shard_changelog, p, store.position(), apply,
                                      wipe, store.position_age_ms())
            live = sorted(key for key, _ in store.prefixed(b"N") if key in gone)
            if live:  # a live N record whose band records are gone: restored in full again next time
                wipe()
                raise BandRecordGoneError(self.topology.bands, p, *gone[live[0]])
        except BaseException:
            store.close()
            raise
        shard = _Shard(StoredShardIndex(self.engine, store, self.retention_ms), store)
        floors = {key: _floor_of(value) for key, value in store.prefixed(b"R")}
        for key, _ in store.prefixed(b"N"):
            if key in floors:
                shard.logged(key, floors[key])
            else:  # a store of an earlier version
                shard.batches.add(key)
                shard.unknown_floors.add(key)
        progress = store.get(b"P")
        try:
            self._check_state(p, store.get(b"E"), progress is not None)
            if progress is not None:
                shard.progress(progress, (self.topology.shard_changelog, p))
        except (ChangelogLayoutError, EngineMismatchError):
            store.close()
            raise
        self._resume(shard)
        store.load_index()  # here, in the restore's thread, rather than at the first batch
        log.info("shard %d opened at %s: %s, %d changelog records read, in %.1f s", p, store.path,
                 f"from changelog offset {start}" if start is not None else "restored in full", records,
                 time.perf_counter() - started)
        return shard

    def _expanded(self, p: int, records: list[tuple[bytes, bytes | None]],
                  gone: dict[bytes, tuple[int, bytes]] | None = None) -> Iterator[list[_Expanded]]:
        """Changelog records of partition ``p`` (in changelog order) in groups of at most
        about ``RESOLVE_MEMBERS`` members referred to: each as (key, value, the members of
        an ``N`` record of references, read from the band records it refers to: (order
        key, its band record's entry, the buckets it joined, the order keys of its copy
        buckets); None for any other record).

        Raises:
            ChangelogLayoutError: an ``N`` record of references that cannot be read.
            BandTopicNotKeptError: there are references, and the band topic no longer
                keeps its records.
            BandRecordGoneError: a band record referred to is gone.
            KafkaException: the band topic could not be read.
        """
        group: list[tuple[bytes, bytes | None, list[MemberRef] | None]] = []
        size = 0
        for key, value in records:
            refs = None
            if key[:1] == b"N" and value is not None and is_refs_value(value):
                try:
                    refs = member_refs(value)
                except (ValueError, struct.error) as exc:
                    raise ChangelogLayoutError(self.topology.shard_changelog, p,
                                               f"a members record of references ({exc})") from exc
                size += len(refs)
                if self._kept is False:
                    raise BandTopicNotKeptError(self.topology.bands, self.topology.shard_changelog, p)
            group.append((key, value, refs))
            if size >= RESOLVE_MEMBERS:
                yield self._resolve(p, group, gone)
                group, size = [], 0
        if group:
            yield self._resolve(p, group, gone)

    def _resolve(self, p: int, group: list[tuple[bytes, bytes | None, list[MemberRef] | None]],
                 gone: dict[bytes, tuple[int, bytes]] | None = None) -> list[_Expanded]:
        """``_expanded``'s group with its references made whole: one read of band partition
        ``p`` over the offsets they name.

        Args:
            gone: None: a band record gone raises. Else an ``N`` record naming one that is
                gone comes with no member, its key put here (without its prefix) with the
                first record missing (offset, order key): read in changelog order, a record
                deleted later (every member expired, its band records deleted since) is
                read before its deletion, and the caller checks that each was deleted.

        Raises:
            BandRecordGoneError: a band record referred to is gone (``gone`` None).
        """
        wanted: dict[int, set[int]] = {}
        for _, _, refs in group:
            for _, offset, entry, _, _ in refs or ():
                wanted.setdefault(offset, set()).add(entry)
        got: dict[tuple[int, int], BandRecord] = {}
        if wanted:
            try:
                for chunk in read_to_end(self.settings, self.topology.bands, p, min(wanted), max(wanted) + 1):
                    for m in chunk:
                        entries = wanted.get(m.offset())
                        if entries is None:
                            continue
                        try:
                            recs = parse_bands(m.value() or b"", m.offset(), self._sets_of(m.headers()))
                        except SetRecordGoneError:  # its members as gone as if the band record were
                            continue
                        got.update(((m.offset(), e), recs[e]) for e in entries if e < len(recs))
            except AheadOfTopicError:  # the band topic created again: none of them is there
                pass
        out: list[_Expanded] = []
        for key, value, refs in group:
            if refs is None:
                out.append((key, value, None))
                continue
            members = []
            for order, offset, entry, joined, copies in refs:
                rec = got.get((offset, entry))
                if rec is None or rec.order != order:
                    if gone is None:
                        raise BandRecordGoneError(self.topology.bands, p, offset, order)
                    gone.setdefault(key[1:], (offset, order))
                    members = []
                    break
                buckets = rec.buckets if joined is None else rec.buckets[joined]
                members.append((order, rec, buckets, copies))
            out.append((key, value, members))
        return out

    def _check_state(self, p: int, engine: bytes | None, held: bool) -> None:
        """Whether partition ``p``'s restored state was indexed with this stage's engine
        settings (``engine``: its ``E`` record; ``held``: it has records at all).

        Raises:
            EngineMismatchError: it was indexed with other settings.
        """
        where = f"{self.topology.shard_changelog}[{p}]"
        if engine is not None and engine != self.digest:
            raise EngineMismatchError(
                f"{where} holds members indexed with other engine settings (digest {engine.decode(errors='replace')}, "
                f"this stage's {self.digest.decode()}): every stage of one deduplication needs the same engine "
                "settings; start under a new --app to build an index with these")
        if engine is None and held:
            log.warning("%s holds members of an earlier version, which did not record its engine settings: taken as "
                        "indexed with this stage's; if the banding changed (32 bands x 4 rows at --threshold 0.8 "
                        "since the score floor, 21 x 6 before), give every stage --bands and --rows of the state's "
                        "or start under a new --app", where)

    @staticmethod
    def _resume(shard: _Shard) -> None:
        """The restored index's mark and last seq: those of the last record released."""
        if len(shard.last) == ORDER.size:
            last = order_seq(shard.last)
            shard.index.last = max(shard.index.last, last)
            shard.index.advance(last)

    # --- a batch --------------------------------------------------------------------

    def compute(self, batch: MessageBatch) -> tuple[list[Record], ShardWritten]:
        """Hold, release in order, meet, verify and join; the records to produce."""
        out: list[Record] = []
        ends = next_offsets(batch.messages)
        stats = ShardWritten(ends, messages=len(batch.messages))
        found: dict[int, list[bytes]] = {}  # decide partition -> the findings of its documents
        # decide partition -> its documents' findings without a candidate: order keys, shard partitions
        empty: dict[int, tuple[list[bytes], list[int]]] = {}
        members: dict[int, list[_Joined]] = {}  # shard partition -> its members joined
        store_only: dict[int, list[tuple[bytes, None]]] = {}  # the members expired, for the stores
        touched: set[int] = set()
        whole: dict[tuple[int, bytes], bytes] = {}  # the N records of references as the stores take them
        # shard partition -> the band records consumed in this batch, not late and not held
        # before (order key -> (record, offset), in the order consumed): released at its end
        # if the limit allows, held only if not (a record held and released in one batch
        # need not be held: an abort consumes it again)
        fresh: dict[int, dict[bytes, tuple[BandRecord, int]]] = {}
        behind = watermarks = 0
        prepared = [(ENGINE_HEADER, self.digest)]  # a band record's headers
        for m in batch.messages:
            p = m.partition()
            shard = self.shards[p]
            touched.add(p)
            headers = m.headers()
            if headers != prepared:
                check_engine(headers, self.digest, f"band record {m.topic()}[{p}]@{m.offset()}")
                if (KIND_HEADER, WATERMARK_KIND) in (headers or ()):
                    self._watermark(m, shard)
                    watermarks += 1
                    continue
            try:
                records = parse_bands(m.value() or b"", m.offset(), self._sets_of(headers))
            except (ValueError, struct.error, UnicodeDecodeError) as exc:
                self._malformed(m, exc, found, stats)
                continue
            offset = m.offset()
            stats.documents += len(records)
            if offset < shard.consumed:  # read again after a restart (see the module docstring)
                for rec in records:
                    if rec.order > shard.last:
                        shard.hold(rec, offset)
                continue
            if records:
                shard.watermark = max(shard.watermark, order_time(max(rec.order for rec in records)))
            new = fresh.setdefault(p, {})
            held = shard.held
            for rec in records:
                if shard.last and rec.order <= shard.last:
                    stats.late += 1
                    stats.lateness_ms.append(order_time(shard.last) - order_time(rec.order))
                    behind = max(behind, stats.lateness_ms[-1])
                    self._release(p, shard, [rec], members.setdefault(p, []), found, empty, stats)
                elif rec.order not in held and rec.order not in new:  # as ``_Shard.hold``: once
                    new[rec.order] = (rec, offset)
        bands = len(batch.messages) - watermarks
        if bands:  # up at once, down slowly: a backlog after a quiet spell is cut small soon
            seen = max(1.0, stats.documents / bands)
            self._per_message = max(seen, 0.8 * self._per_message + 0.2 * seen)
        if stats.late:
            log.warning("%d documents of band records came after a later one was released (up to %d ms behind); "
                        "processed late", stats.late, behind)
        t = self.topology
        held: dict[int, tuple[_Shard, list[tuple[bytes, tuple[BandRecord, int]]], list[bytes]]] = {}
        end = {tp.partition: tp.offset for tp in ends}
        for p in sorted(touched):
            shard = self.shards[p]
            limit = shard.limit()
            joined = members.setdefault(p, [])
            ready = [] if limit is None else shard.ready(limit)
            new = fresh.get(p)
            if new:  # this batch's records: released with the held ones up to the limit, the rest held
                go = []
                for order, (rec, offset) in new.items():
                    if limit is not None and order <= limit:
                        go.append(rec)
                    else:
                        shard.hold(rec, offset)
                if go:
                    ready = sorted(ready + go, key=attrgetter("order"))
            if ready:
                shard.index.prefetch(np.concatenate([rec.buckets for rec in ready]))
            self._release(p, shard, ready, joined, found, empty, stats)
            self._members_records(p, shard, joined, out, whole)
            gone = shard.index.expired()
            if gone:  # out of the retention window: deleted from the index, the stores and the changelog
                shard.index.remove(gone)
                store_only[p] = [(b"M" + seq_order(seq), None) for seq in gone]
                floor = shard.index.floor()
                done = sorted(key for key in shard.batches if order_time(key) < floor)  # every member expired
                shard.dropped(done)
                out += [(t.shard_changelog, p, b"N" + key, None, []) for key in done]
                stats.expired += len(gone)
            shard.consumed = max(shard.consumed, end[p])
            out.append((t.shard_changelog, p, b"P", _PROGRESS.pack(shard.watermark, shard.consumed) + shard.last, []))
            if not shard.engine_logged:  # a failed batch restores the shard: written again then
                out.append((t.shard_changelog, p, b"E", self.digest, []))
                shard.engine_logged = True
            stats.held += len(shard.held)
            held[p] = (shard, *shard.changes())
        for q in sorted(set(found) | set(empty)):  # one findings record per decide partition (split if large)
            chunks = split_runs(found.get(q, []), len, FINDINGS_RECORD_BYTES) or [[]]
            orders, shards = empty.get(q, ([], []))
            per = FINDINGS_RECORD_BYTES // EMPTY_FINDING_BYTES
            for i in range(max(len(chunks), -(-len(orders) // per))):
                value = findings_value(chunks[i] if i < len(chunks) else [], orders[i * per:(i + 1) * per],
                                       shards[i * per:(i + 1) * per])
                out.append((t.findings, q, None, value, [(KIND_HEADER, FINDINGS_KIND)]))
        for tp in ends:  # a restart reads again from the earliest record held
            first = self.shards[tp.partition].first_held()
            if first is not None:
                tp.offset = min(tp.offset, first)
        changes: dict[int, list[tuple[bytes, bytes | None]]] = {}
        if self.state_dir is not None:  # for the stores, once the batch has committed
            for topic, part, key, value, _ in out:
                if topic == t.shard_changelog:
                    changes.setdefault(part, []).append((key, whole.get((part, key), value)))  # type: ignore[arg-type]
                    if key[:1] == b"N":  # its references' floor, as ``R`` (the store keeps the values)
                        changes[part].append((b"R" + key[1:], None if value is None else _floor_value(
                            self.shards[part].ref_floors.get(key[1:]))))
            for part, deleted in store_only.items():
                changes.setdefault(part, []).extend(deleted)
        # with a window, the band records no longer needed once this batch has committed
        points = {tp.partition: self.shards[tp.partition].purge_point(tp.offset) for tp in ends} if self._purging else {}
        self._uncommitted.append((changes, held, points))
        return out, stats

    def _sets_of(self, headers: list[tuple[str, bytes]] | None) -> dict[bytes, np.ndarray] | None:
        """The sets of a band record sent without them, by order key (None: a record
        with its sets).

        Raises:
            ValueError: the set records it names are gone or of another layout (the
                record's documents then get an error each, ``_malformed``).
            KafkaException: the set topic could not be read (the batch fails).
        """
        if headers:
            for name, value in headers:
                if name == SETS_HEADER:
                    if self.retention_ms is not None and not self._sets_warned:
                        self._sets_warned = True
                        log.warning("band records name their sets in %s, which nothing deletes: give prepare the "
                                    "shards' --retention too (it then sends the sets in the band records, which the "
                                    "shards delete once no member needs them)", self.topology.sets)
                    return self.set_reader.sets(value)
        return None

    @staticmethod
    def _watermark(m: Message, shard: _Shard) -> None:
        """Take a watermark record's marks (each partition's largest); one of another
        layout is logged and skipped (the next one serves)."""
        try:
            shard.watermarks.take(m.value() or b"")
        except (ValueError, struct.error, UnicodeDecodeError) as exc:
            log.error("band topic %s[%d]@%d: not a watermark record (%s); skipped", m.topic(), m.partition(),
                      m.offset(), exc)

    def _malformed(self, m: Message, exc: Exception, found: dict[int, list[bytes]], stats: ShardWritten) -> None:
        """A band record of another layout (written by something else than prepare): its
        documents, if the order keys at its start can be read, get a finding with the
        error each, which decide sends to the dead-letter topic; else it is skipped, logged."""
        stats.malformed += 1
        try:
            orders = band_orders(m.value() or b"")
        except (ValueError, struct.error) as no_keys:
            log.error("band topic %s[%d]@%d: not a band record (%s; %s); skipped", m.topic(), m.partition(),
                      m.offset(), exc, no_keys)
            return
        for key in orders:
            found.setdefault(decide_partition(key, self.topology.decide_partitions), []).append(
                found_value(key, m.partition(), [], f"malformed_band_record: {exc}"))

    def _release(self, p: int, shard: _Shard, records: list[BandRecord], members: list[_Joined],
                 found: dict[int, list[bytes]], empty: dict[int, tuple[list[bytes], list[int]]],
                 stats: ShardWritten) -> None:
        """Meet, verify and join ``records`` in order: their findings to ``found`` (by
        decide partition; those without a candidate to ``empty``, as columns), the members
        they made to ``members`` (``_Joined``)."""
        t = self.topology
        index = shard.index
        add, alone, id_of, parts = index.add, index.add_alone, index.id_of, t.decide_partitions
        refs, whole = self._refs, not self._refs or self.state_dir is not None
        for rec in records:
            order = rec.order
            seq = order_seq(order)
            q = decide_partition(order, parts)
            some = None  # the indices of the buckets it joined, when not all
            if alone(seq, rec.buckets.tolist(), rec.fingerprints, rec.id):  # met no one, joined every bucket
                checked, joined, copies = (), rec.buckets, ()
            else:
                finding, joins = add(seq, rec.buckets, rec.fingerprints, rec.id)
                checked, joined = finding.checked, None if joins.empty else joins.buckets
                copies = [seq_order(c) for c in joins.copies] if joins.copies else ()
                if refs and joined is not None and len(joined) != len(rec.buckets):
                    some = _picked(rec.buckets.tolist(), joined.tolist())
            if checked:
                found.setdefault(q, []).append(found_value(
                    order, p, [(seq_order(c.seq), id_of(c.seq), c.jaccard, c.containment, c.similarity)
                               for c in checked]))
            else:
                columns = empty.get(q)
                if columns is None:
                    columns = empty[q] = ([], [])
                columns[0].append(order)
                columns[1].append(p)
            if joined is not None:
                members.append((order, joined_member_value(copies, rec.id, joined, rec.fingerprints) if whole else None,
                                (order, rec.offset, rec.entry, some, copies) if refs else None))
            if order > shard.last:
                shard.last = order
        stats.released += len(records)

    def _members_records(self, p: int, shard: _Shard, members: list[_Joined], out: list[Record],
                         whole: dict[tuple[int, bytes], bytes]) -> None:
        """The ``N`` records of ``members`` (shard partition ``p``'s, in the order they
        joined) to ``out``, split above ``MEMBERS_RECORD_BYTES``; their keys to
        ``shard.batches``. Of records of references, the same with the members' values,
        what the store takes, to ``whole`` (by partition and key; with a ``state_dir``)."""
        if not members:
            return
        if members[0][2] is None:  # the members' values
            for chunk in split_runs(members, lambda member: len(member[1]), MEMBERS_RECORD_BYTES):
                key = max(order for order, _, _ in chunk)
                out.append((self.topology.shard_changelog, p, b"N" + key,
                            members_value([(order, value) for order, value, _ in chunk]), []))
                shard.logged(key, None)
            return
        for chunk in split_runs(members, _ref_bytes, MEMBERS_RECORD_BYTES):
            key = max(order for order, _, _ in chunk)
            out.append((self.topology.shard_changelog, p, b"N" + key, member_refs_value([ref for _, _, ref in chunk]), []))
            shard.logged(key, min(ref[1] for _, _, ref in chunk))  # type: ignore[index]
            if self.state_dir is not None:
                whole[(p, b"N" + key)] = members_value([(order, value) for order, value, _ in chunk])

    def write(self, work: tuple[list[Record], ShardWritten], producer: Producer) -> ShardWritten:
        """Produce the batch's findings and changelog records into the open transaction.

        Raises:
            KafkaException: a produce error (the transaction is aborted and retried).
        """
        records, stats = work
        positions = stats.positions

        def delivered(err: KafkaError | None, msg: Message) -> None:  # served by the commit's flush
            if err is None:
                positions[msg.partition()] = max(positions.get(msg.partition(), 0), msg.offset() + 1)

        changelog = self.topology.shard_changelog
        # the stores take the offset after a partition's last record: one delivery report
        # each is enough (a transaction's records of one partition are delivered in order)
        produce_all(producer, records, None if self.state_dir is None else
                    lambda topic, partition: delivered if topic == changelog else None)
        for topic, _, key, value, _ in records:
            size = len(key or b"") + len(value or b"")
            if topic == self.topology.findings:
                stats.finding_bytes += size
            else:
                stats.changelog_bytes += size
        return stats


class ShardStage(StageRuntime):
    """The shard stage: ``ShardProcessor`` on the stage runtime, consuming the band topic.

    Args:
        settings: as ``StageRuntime``'s (its ``input_topics`` are replaced by the band
            topic); ``group_id`` is the stage's consumer group.
        topology: the sharded topics.
        instance: this process's name among the stage's instances.
        state_dir, retention_ms: see ``ShardProcessor``.
        **callbacks: ``on_batch``, ``on_assignment``, ``on_abort``, ``on_broker``.
    """

    producer_defaults = STAGE_PRODUCER

    def __init__(self, settings: Settings, topology: Topology, instance: str = "0",
                 state_dir: Path | None = None, retention_ms: int | None = None, **callbacks: object) -> None:
        # an internal topic is read from its start by a new group (whatever the input's
        # ``from_beginning``): a process that joins after records were written takes them
        settings = settings.model_copy(update={
            "transactional_id": f"neardup-{settings.group_id}-{instance}", "input_topics": [topology.bands],
            "from_beginning": True})
        super().__init__(settings, ShardProcessor(settings, topology, state_dir, retention_ms), **callbacks)
