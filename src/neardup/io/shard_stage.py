"""The shard stage of a sharded deduplication (docs/scale-out.md): a stateful
``Processor`` on the stage runtime (``neardup.io.stage``).

Each partition p of the band topic is one shard: its buckets and their members' sets
(``neardup.sharded.shard.ShardIndex``, in memory), the records held in its reorder
window, and its changelog, partition p of ``<app>.shard-changelog`` (compacted). Every
change is produced to the changelog in the batch's transaction, so the changelog's
committed records are exactly the state of the committed input offsets; the state is
rebuilt from them when the partition is assigned (Kafka Streams' restore) and after a
failed batch (``aborted``: what ``compute`` changed in memory is dropped and read again).

The reorder window: a band record is held until the partition's watermark (the largest
record timestamp it has seen) is ``reorder_window_ms`` past its own, then processed with
the others released, in order-key order; when the partition has had no record for that
long of wall time, everything held is released (``due``), the time counted from the last
full batch (while batches are full the process is behind: a partition without a record
then has records still to be read, and releasing it would make them late). A record
arriving after a later one was released is processed at once and counted as late.

Changelog records (key -> value; a null value deletes):

- ``b"H" + order key`` -> the band record's value: held in the window.
- ``b"M" + order key`` -> ``">I"`` n, n candidate order keys whose copy bucket it joined,
  then a band record value (id, the buckets it joined, its set): a member.
- ``b"P"`` -> the watermark (``">q"``, ms) + the last order key released (none yet: empty).
"""

from __future__ import annotations

import logging
import struct
import time
from dataclasses import dataclass, field

import orjson
from confluent_kafka import Consumer, Message, Producer, TopicPartition

from neardup.config import Settings
from neardup.core.settings import EngineSettings
from neardup.io.partition_log import read_to_end, with_retries
from neardup.io.stage import MessageBatch, StageHooks, StageRuntime, TP, next_offsets, produce
from neardup.io.topology import Topology
from neardup.sharded.records import (
    KIND_HEADER,
    ORDER,
    BandRecord,
    check_engine,
    decide_partition,
    engine_digest,
    order_seq,
    order_time,
    seq_order,
)
from neardup.sharded.shard import Joins, ShardIndex

log = logging.getLogger(__name__)

_N = struct.Struct(">I")
_WATERMARK = struct.Struct(">q")
Record = tuple[str, int, bytes | None, bytes | None, list[tuple[str, bytes]]]


@dataclass
class _Shard:
    """One shard partition's state."""

    index: ShardIndex
    held: dict[bytes, BandRecord] = field(default_factory=dict)
    logged: set[bytes] = field(default_factory=set)  # held keys whose H record is committed or in this batch
    last: bytes = b""
    watermark: int = -(1 << 62)
    arrived: float = field(default_factory=time.monotonic)


@dataclass
class ShardWritten:
    offsets: list[TopicPartition]
    messages: int = 0
    released: int = 0
    late: int = 0
    lateness_ms: list[int] = field(default_factory=list)  # per late record: ms behind the last released
    malformed: int = 0
    held: int = 0
    finding_bytes: int = 0
    changelog_bytes: int = 0
    seconds: float = 0.0


class ShardProcessor(StageHooks):
    """The shard stage's ``Processor``.

    Args:
        settings: Kafka and batch settings; ``settings.engine()`` gives the shard's rules.
        topology: the sharded topics.
        reorder_window_ms: how long (record time, and wall time when idle) a band record
            is held before it is processed in order-key order.
    """

    def __init__(self, settings: Settings, topology: Topology, reorder_window_ms: int) -> None:
        self.settings = settings
        self.engine: EngineSettings = settings.engine()
        self.digest = engine_digest(self.engine)
        self.topology = topology
        self.window_ms = reorder_window_ms
        self.shards: dict[int, _Shard] = {}
        self._ensured = False
        self._flush: set[int] = set()

    # --- lifecycle ------------------------------------------------------------------



    def is_output(self, topic: str) -> bool:
        return topic in (self.topology.findings, self.topology.shard_changelog)

    def check(self, consumer: Consumer, partitions: list[TP]) -> None:
        """Create the topology's topics (once), then restore the newly assigned shards.

        Raises:
            TopologyMismatchError: an existing topic has another partition count.
            KafkaException: the changelog could not be read.
        """
        if not self._ensured:
            self.topology.ensure_with(self.settings)
            self._ensured = True
        for _, p in partitions:
            self.shards[p] = with_retries(f"restoring shard {p}", lambda p=p: self._restore(p))

    def revoked(self, partitions: set[TP]) -> None:
        for _, p in partitions:
            self.shards.pop(p, None)

    def aborted(self) -> None:
        """Drop what memory holds and restore every shard from its changelog."""
        for p in list(self.shards):
            self.shards[p] = with_retries(f"restoring shard {p}", lambda p=p: self._restore(p))

    def _restore(self, p: int) -> _Shard:
        shard = _Shard(ShardIndex(self.engine))
        started, records = time.perf_counter(), 0
        for chunk in read_to_end(self.settings, self.topology.shard_changelog, p):
            for m in chunk:
                records += 1
                key, value = m.key(), m.value()
                kind, order = key[:1], key[1:]
                if kind == b"H":
                    if value is None:
                        shard.held.pop(order, None)
                        shard.logged.discard(order)
                    else:
                        shard.held[order] = BandRecord.parse(order, value)
                        shard.logged.add(order)
                elif kind == b"M" and value is not None:
                    (n,) = _N.unpack_from(value)
                    copies = tuple(order_seq(value[4 + 20 * i:24 + 20 * i]) for i in range(n))
                    rec = BandRecord.parse(order, value[4 + 20 * n:])
                    shard.index.apply(order_seq(order), rec.id, Joins(rec.buckets, copies), rec.fingerprints)
                elif kind == b"P" and value is not None:
                    shard.watermark, shard.last = _WATERMARK.unpack_from(value)[0], value[_WATERMARK.size:]
        if records:
            log.info("shard %d restored from %s: %d records, %d members, %d held, in %.1f s", p,
                     self.topology.shard_changelog, records, len(shard.index.sets), len(shard.held),
                     time.perf_counter() - started)
        return shard

    # --- a batch --------------------------------------------------------------------




    def due(self) -> bool:
        """Whether a shard has held records and no arrival for the window's length."""
        now = time.monotonic()
        self._flush = {p for p, s in self.shards.items()
                       if s.held and now - s.arrived >= self.window_ms / 1000}
        return bool(self._flush)

    def compute(self, batch: MessageBatch) -> tuple[list[Record], ShardWritten]:
        """Hold, release in order, meet, verify and join; the records to produce."""
        out: list[Record] = []
        stats = ShardWritten(next_offsets(batch.messages), messages=len(batch.messages))
        now = time.monotonic()
        if batch.full:
            # More are waiting: this process is behind, so none of its shards is quiet
            # (a shard without an arrival in a backlog has records still to be read).
            for s in self.shards.values():
                s.arrived = now
        else:
            # shards of this process without an arrival for the window's length are
            # flushed, even while others are busy
            self._flush |= {p for p, s in self.shards.items() if s.held and now - s.arrived >= self.window_ms / 1000}
        touched: set[int] = set(self._flush)
        behind = 0
        for m in batch.messages:
            p = m.partition()
            shard = self.shards[p]
            touched.add(p)
            shard.arrived = now
            check_engine(m.headers(), self.digest, f"band record {m.topic()}[{p}]@{m.offset()}")
            try:
                rec = BandRecord.parse(m.key(), m.value())
            except (ValueError, struct.error, UnicodeDecodeError) as exc:
                self._malformed(m, exc, out, stats)
                continue
            shard.watermark = max(shard.watermark, order_time(rec.order))
            if shard.last and rec.order <= shard.last:
                stats.late += 1
                stats.lateness_ms.append(order_time(shard.last) - order_time(rec.order))
                behind = max(behind, stats.lateness_ms[-1])
                self._release(p, shard, [rec], out, stats)
            else:
                shard.held[rec.order] = rec
        if stats.late:
            log.warning("%d band records came after a later one was released (up to %d ms behind); "
                        "processed late", stats.late, behind)
        for p in sorted(touched):
            shard = self.shards[p]
            if p in self._flush:
                ready = sorted(shard.held)
            else:
                limit = shard.watermark - self.window_ms
                ready = sorted(k for k in shard.held if order_time(k) <= limit)
            self._release(p, shard, [shard.held.pop(k) for k in ready], out, stats)
            for k, rec in shard.held.items():
                if k not in shard.logged:
                    shard.logged.add(k)
                    out.append((self.topology.shard_changelog, p, b"H" + k, rec.value(), []))
            out.append((self.topology.shard_changelog, p, b"P",
                        _WATERMARK.pack(shard.watermark) + shard.last, []))
            stats.held += len(shard.held)
        self._flush = set()
        return out, stats

    def _malformed(self, m: Message, exc: Exception, out: list[Record], stats: ShardWritten) -> None:
        """A band record of another layout (written by something else than prepare): its
        document, if its key names one, gets a finding with the error, which decide sends
        to the dead-letter topic; else it is skipped, logged."""
        stats.malformed += 1
        key = m.key() or b""
        if len(key) != ORDER.size:
            log.error("band topic %s[%d]@%d: not a band record (%s); skipped", m.topic(), m.partition(),
                      m.offset(), exc)
            return
        value = orjson.dumps({"shard": m.partition(), "checked": [], "error": f"malformed_band_record: {exc}"})
        out.append((self.topology.findings, decide_partition(key, self.topology.decide_partitions), key, value,
                    [(KIND_HEADER, b"finding")]))

    def _release(self, p: int, shard: _Shard, records: list[BandRecord], out: list[Record],
                 stats: ShardWritten) -> None:
        t = self.topology
        for rec in records:
            seq = order_seq(rec.order)
            finding, joins = shard.index.add(seq, rec.buckets, rec.fingerprints, rec.id)
            checked = [[*ORDER.unpack(seq_order(c.seq)), shard.index.ids[c.seq], c.jaccard, c.containment,
                        c.similarity] for c in finding.checked]
            value = orjson.dumps({"shard": p, "checked": checked})
            out.append((t.findings, decide_partition(rec.order, t.decide_partitions), rec.order, value,
                        [(KIND_HEADER, b"finding")]))
            if rec.order in shard.logged:
                shard.logged.discard(rec.order)
                out.append((t.shard_changelog, p, b"H" + rec.order, None, []))
            if not joins.empty:
                copies = b"".join(seq_order(c) for c in joins.copies)
                member = BandRecord(rec.order, rec.id, joins.buckets, rec.fingerprints).value()
                out.append((t.shard_changelog, p, b"M" + rec.order,
                            _N.pack(len(joins.copies)) + copies + member, []))
            if rec.order > shard.last:
                shard.last = rec.order
            stats.released += 1

    def write(self, work: tuple[list[Record], ShardWritten], producer: Producer) -> ShardWritten:
        """Produce the batch's findings and changelog records into the open transaction.

        Raises:
            KafkaException: a produce error (the transaction is aborted and retried).
        """
        records, stats = work
        for topic, partition, key, value, headers in records:
            produce(producer, topic, key, value, headers, partition)
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
        reorder_window_ms: see ``ShardProcessor``.
        **callbacks: ``on_batch``, ``on_assignment``, ``on_abort``, ``on_broker``.
    """

    def __init__(self, settings: Settings, topology: Topology, instance: str = "0",
                 reorder_window_ms: int = 2000, **callbacks: object) -> None:
        settings = settings.model_copy(update={
            "transactional_id": f"neardup-{settings.group_id}-{instance}", "input_topics": [topology.bands]})
        super().__init__(settings, ShardProcessor(settings, topology, reorder_window_ms), **callbacks)
