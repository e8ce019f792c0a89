"""The prepare stage of a sharded deduplication (docs/scale-out.md): a stateless
``Processor`` on the stage runtime (``neardup.kafka.stage``).

Per batch: decode the input messages, normalise, shingle, MinHash and band the documents
(``neardup.detector.Preparer``, as in one process), then produce, in the batch's
transaction, to every shard partition one band record holding the batch's documents
that have a bucket it owns (``neardup.sharded.routing``: their bucket ids there, ids and
shingle sets, as columns) and to every decide partition one documents record holding
the batch's input records that go there (``neardup.sharded.records``). A message that is
no document (``MessageError``, or no shingles after normalisation) goes in it with its
error and in no band record, so that decide sends it to the dead-letter topic and every
input message leaves through decide exactly once. So does a message whose entry would not
fit a documents record alone (the findings topic's ``max.message.bytes``: ``too_large``):
it goes without its value, and if its key and headers alone are still too large, without
them too, so that its dead letter is neardup's headers alone (as ``neardup run``'s last
fallback, ``neardup.kafka.messages.fit``); a record too large for the topic would fail
its batch at every try.

Watermarks: with each batch, and every ``IDLE_MARK_S`` while no input arrives, prepare
sends every shard partition a watermark record (``neardup.sharded.records``): for each
input partition it reads, the largest order key it has sent of it, or, for a partition
read to its end, the time the broker last confirmed that end less ``reorder_window_ms``
if that is later (its next record is stamped after that time: an idle or empty partition
does not hold the others back). A partition counts as read to its end only from the
broker's answer, never from the consumer's cached end offset alone: that cache comes with
fetch responses, and nothing bounds how old it is (no fetch of a paused partition, none
while the broker is out or the group rebalances); taken from it, a partition paused at its
end and written to meanwhile had its watermark moved past its new records, which then
came late. The cache only says when to ask: the ends of the partitions it shows at their
end are asked of the broker in one request at most every ``END_CONFIRM_S``, and the
answer holds as of the time it was asked. A shard processes a document
once every input partition's watermark is past its order key, so that documents are
processed in order-key order however unevenly the partitions are read. A partition
assigned and not yet read has no watermark: the shards wait for it. With the components
cluster policy the same records go to every decide partition too (after the batch's
documents records): decide decides a document only once every earlier one has come.

Reading in step: a partition whose records run more than ``AHEAD_MS`` of record time
ahead of the partition furthest behind (of those with records still to read) is paused
until that one catches up or is read to its end (Kafka Streams picks the partition with
the smallest head timestamp), so that the shards hold little while they wait. A partition
read to its end and written again later counts from its watermark then, not from its last
record sent: a live stream after a quiet spell is never paused.

A bound on what waits downstream (``max_undecided``): in a backlog prepare runs ahead of
the shards (its work per document is a fraction of theirs), and every document it sends
waits in decide's memory, its record there, until its findings come; documents past the
watermark wait in the shards' memory too. A ``LeadMonitor`` thread reads, every
``LEAD_CHECK_S``, decide's consumer group's committed offset of each findings partition
(that of the record of its earliest document still waiting); the documents this process
sent in records at or after it (their offsets from the delivery reports) are those not
yet decided. Once a partition holds more than ``max_undecided`` of them, it reads the record time up to which the shards will
release next: per band partition, that of the latest document of the band record at the
shard group's committed offset (the record of the earliest document held, or the next to
read; it may hold documents released before that one, and its latest is at or after the
earliest held), the smallest over the partitions. Until every findings partition is
under half the bound again, prepare reads only the partitions whose last record sent is at
or behind that time, and pauses the rest, so that what it sends is what the shards release
next. The partition holding the shards back is never paused (its last record is behind the
earliest one held), so the pipeline cannot deadlock; with no record unreleased in the
shards (decide alone is behind), every partition is paused until decide catches up, but
under the components policy, where decide waits for the watermarks too, the partitions
furthest behind are read on. Lead is flow control only: the records sent, and so the
verdicts, are the same.

Nothing is stored: a batch whose transaction fails is consumed again from the group's
committed offsets and gives the same records (the preparation is a pure function of the
messages, the watermarks go back to those of the last committed batch), so exactly once
needs no state here.
"""

from __future__ import annotations

import collections
import logging
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any, TypeVar

import numpy as np
from confluent_kafka import (OFFSET_BEGINNING, OFFSET_END, Consumer, KafkaError, KafkaException, Message, Producer,
                             TopicPartition)

from neardup.config import Settings, retention_changes
from neardup.core.types import Document
from neardup.detector import Preparer, warm_up
from neardup.kafka.bounded import discard
from neardup.kafka.clients import admin_config
from neardup.kafka.limits import TopicLimits
from neardup.kafka.partition_log import with_retries
from neardup.kafka.rdkafka_log import rdkafka_logger
from neardup.kafka.messages import MessageError, carried_headers, record_size, to_document
from neardup.kafka.stage import StageHooks, StageRuntime, TP, next_offsets, produce
from neardup.sharded.topology import STAGE_PRODUCER, Topology
from neardup.sharded.records import (
    DOCUMENTS_FIXED_BYTES,
    DOCUMENTS_KIND,
    ENGINE_HEADER,
    KIND_HEADER,
    SETS_HEADER,
    SETS_KIND,
    WATERMARK_KIND,
    DocumentEntry,
    band_orders,
    batch_bands,
    sets_ref,
    sets_values,
    decide_partition,
    document_entry_bytes,
    documents_count,
    documents_value,
    engine_digest,
    order_key,
    order_time,
    split_runs,
    time_mark,
    watermark_value,
)
from neardup.sharded.routing import shard_bounds

log = logging.getLogger(__name__)
T = TypeVar("T")


_DOCUMENTS_HEADER = (KIND_HEADER, DOCUMENTS_KIND)
#: The longest wait for the broker to take a batch's set records before its band records
#: name them, seconds (past it the batch fails and is retried).
SET_DELIVERY_S = 30.0


def _on_delivered(lead: LeadMonitor, documents: int) -> Callable[[KafkaError | None, Message], None]:
    """A documents record's delivery report, for ``lead`` (one that failed: nothing; its
    batch is aborted and sent again)."""
    def delivered(err: KafkaError | None, msg: Message) -> None:
        if err is None:
            lead.delivered(msg.partition(), msg.offset(), documents)
    return delivered


def _entry_bytes(entry: DocumentEntry) -> int:
    """An upper bound of ``entry``'s bytes in a documents record, its input topic's in
    the record's table included."""
    return document_entry_bytes(entry) + 2 + len(entry.topic.encode("utf-8"))


#: A record to produce: (topic, partition, key, value, headers).
Record = tuple[str, int, bytes | None, bytes | None, list[tuple[str, bytes]]]
#: Seconds between watermark records while no input arrives.
IDLE_MARK_S = 0.2
#: Record time, ms, an input partition may run ahead of the one furthest behind before it
#: is paused (see the module docstring).
AHEAD_MS = 10_000
#: Seconds to wait for the broker's end offsets (``PrepareProcessor._confirm_ends``: the
#: stage's thread waits), and seconds before asking again after no answer (a broker out
#: must not hold every watermark for the timeout).
END_QUERY_TIMEOUT_S = 0.5
END_QUERY_PAUSE_S = 2.0
#: Seconds an answer of the broker about a partition's end is used for before it is asked
#: again: a partition read to its end has its watermark at most this much behind the
#: wall clock less the reorder window.
END_CONFIRM_S = 0.1
#: Seconds between two reads of what waits downstream (``LeadMonitor``).
LEAD_CHECK_S = 0.25
#: Seconds without a read of what waits downstream before the log says the bound is not kept.
UNREAD_WARN_S = 30.0


def _reader_config(settings: Settings) -> dict[str, Any]:
    """The configuration of a consumer that never subscribes (it reads offsets only) on
    the stage's cluster: the stage's client settings but its static membership."""
    base = {k: v for k, v in settings.kafka.items() if k != "group.instance.id"}
    return base | {"bootstrap.servers": settings.bootstrap_servers, "enable.auto.commit": False,
                   "logger": rdkafka_logger()}


def partition_offsets(reader: Consumer, tps: list[TopicPartition], which: int,
                      timeout: float) -> dict[TP, int]:
    """The earliest (``OFFSET_BEGINNING``) or end (``OFFSET_END``; under read_committed the
    last stable offset) offset of each of ``tps``, in one ListOffsets request per leader.

    Raises:
        KafkaException: no answer within ``timeout`` seconds, or none for a partition.
    """
    found = reader.offsets_for_times([TopicPartition(tp.topic, tp.partition, which) for tp in tps], timeout=timeout)
    failed = [tp for tp in found if tp.error is not None or tp.offset < 0]
    if failed:
        raise KafkaException(failed[0].error or KafkaError(KafkaError._NOENT))
    return {(tp.topic, tp.partition): tp.offset for tp in found}


class LeadMonitor:
    """What waits downstream of prepare: the documents of the documents records this
    process sent (``delivered``, from their delivery reports, in the stage's thread) at or
    after decide's group's committed offset of their partition, that offset read from the
    broker every ``LEAD_CHECK_S`` in a thread of its own (see the module docstring).

    A read that fails (the broker out) is logged at DEBUG and the last values kept; after
    ``UNREAD_WARN_S`` without one, a warning says the bound is not kept. Until the first
    read prepare does not hold back: a monitor that cannot read (e.g. no right to describe
    decide's group) must not stop the stage.
    """

    def __init__(self, settings: Settings, topology: Topology, limit: int) -> None:
        self.topology, self.limit = topology, limit
        app = topology.app
        base = _reader_config(settings)
        # Consumers that never subscribe, so never join their group: ``committed`` reads the
        # group's offsets and ``offsets_for_times`` the partitions' ends. Not an AdminClient:
        # librdkafka 2.16 aborts the process (rd_kafka_enq_once_del_source_return's assertion)
        # when a coordinator request of its admin API times out across a broker restart.
        self._groups = {role: Consumer({**base, "group.id": f"{app}.{role}",
                                        "isolation.level": "read_uncommitted"})
                        for role in ("decide", "shard")}
        self._probe = Consumer({**base, "group.id": f"neardup-lead-{app}", "isolation.level": "read_committed",
                                "max.partition.fetch.bytes": 65536, "fetch.max.bytes": 1 << 20})
        # per decide partition: (offset, documents) of the documents records sent, in
        # offset order, those decide has passed dropped; and their documents in all
        self._sent: list[collections.deque[tuple[int, int]]] = [collections.deque()
                                                                 for _ in range(topology.decide_partitions)]
        self._documents = [0] * topology.decide_partitions
        self._lock = threading.Lock()  # over ``_sent`` and ``_documents``: the stage's thread and this one
        self._committed: list[int] | None = None  # decide's group's offset per partition, at the last read
        self.released: int | None = None  # the record time (ms) up to which the shards release next
        self.over = False  # holding back (stage thread)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="neardup-lead", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        if not self._thread.is_alive():  # a read still waiting on a broker that is out keeps it
            for consumer in (self._probe, *self._groups.values()):
                consumer.close()

    def delivered(self, q: int, offset: int, documents: int) -> None:
        """A documents record of ``documents`` documents written at ``offset`` of decide
        partition ``q`` (its delivery report)."""
        with self._lock:
            self._sent[q].append((offset, documents))
            self._documents[q] += documents

    def undecided(self) -> int:
        """The most documents of one findings partition, of those this process sent, that
        decide's group has not passed (-1 before the first read)."""
        committed = self._committed
        if committed is None:
            return -1
        with self._lock:
            for q, (sent, at) in enumerate(zip(self._sent, committed)):
                while sent and sent[0][0] < at:
                    self._documents[q] -= sent.popleft()[1]
            return max(self._documents)

    def holding_back(self) -> bool:
        """Whether prepare holds back now: over ``limit``, until under ``limit // 2``
        (called from the stage's thread)."""
        undecided = self.undecided()
        over = undecided > (self.limit // 2 if self.over else self.limit)
        if over != self.over:
            self.over = over
            log.info("%s: %d records of a findings partition not yet decided (bound %d); reading %s",
                     "holding back" if over else "no longer holding back", undecided, self.limit,
                     "only the partitions behind what the shards release" if over else "every partition")
        return over

    def _run(self) -> None:
        read_at = time.monotonic()  # the last read that succeeded (or the start)
        warned = False
        while not self._stop.wait(LEAD_CHECK_S):
            try:
                self._read()
                read_at, warned = time.monotonic(), False
            except Exception as exc:  # noqa: BLE001 - advisory: the last values stand
                log.debug("reading what waits downstream: %s", exc)
                if not warned and time.monotonic() - read_at > UNREAD_WARN_S:
                    warned = True  # once per spell: the bound is not kept while it cannot be read
                    log.warning("--max-undecided is not enforced: what waits downstream could not be read for "
                                "%.0f s (%s)", time.monotonic() - read_at, exc)

    def _behind(self, role: str, topic: str, partitions: int) -> dict[int, tuple[int, int]]:
        """Per partition of ``topic``: (the ``role`` group's committed offset, else the
        earliest offset; the end offset, high watermark). Raises ``KafkaException`` when the
        broker does not answer within 5 s."""
        reader = self._groups[role]
        tps = [TopicPartition(topic, q) for q in range(partitions)]
        at = {tp.partition: tp.offset for tp in reader.committed(tps, timeout=5) if tp.offset >= 0}
        ends = {q: end for (_, q), end in partition_offsets(reader, tps, OFFSET_END, 5).items()}
        uncommitted = [tp for tp in tps if tp.partition not in at]
        if uncommitted:  # the group has not committed there yet: all of it is ahead of the group
            at |= {q: o for (_, q), o in partition_offsets(reader, uncommitted, OFFSET_BEGINNING, 5).items()}
        return {q: (at[q], ends[q]) for q in ends}

    def _read(self) -> None:
        t = self.topology
        behind = self._behind("decide", t.findings, t.decide_partitions)
        self._committed = [behind[q][0] for q in range(t.decide_partitions)]
        if self.over or self.undecided() > self.limit // 2:
            self.released = self._releasing()

    def _releasing(self) -> int | None:
        """The record time (ms) up to which the shards release next (``_latest_in`` of the
        band record at the shard group's committed offset, the smallest over the band
        partitions); None if every partition is passed."""
        t = self.topology
        behind = {q: at for q, (at, end) in self._behind("shard", t.bands, t.shards).items() if at < end}
        if not behind:
            return None
        self._probe.assign([TopicPartition(t.bands, q, at) for q, at in behind.items()])
        first: dict[int, int] = {}
        deadline = time.monotonic() + 2 * LEAD_CHECK_S
        while len(first) < len(behind) and time.monotonic() < deadline:
            for m in self._probe.consume(100, timeout=0.5):
                latest = self._latest_in(m) if m.partition() not in first else None
                if latest is not None:
                    first[m.partition()] = latest
        self._probe.unassign()
        return min(first.values(), default=None)

    @staticmethod
    def _latest_in(m: Message) -> int | None:
        """The latest record time (ms) of a band record's documents (None: an error, a
        watermark record, or one that cannot be read). The record at the shard group's
        committed offset holds the earliest document the shard holds, and documents it has
        released before it: the latest of them is at or after the earliest held, so the
        partition holding the shard back (its last record sent before the earliest held)
        is never paused."""
        if m.error() is not None or (KIND_HEADER, WATERMARK_KIND) in (m.headers() or ()):
            return None
        try:
            orders = band_orders(m.value() or b"")
        except (ValueError, struct.error):
            return None
        return order_time(max(orders)) if orders else None  # order keys compare as their times first


@dataclass
class PrepareBatch:
    messages: list[Message]
    full: bool
    documents: list[Document] = field(default_factory=list)
    decoded: list[Message] = field(default_factory=list)  # the messages of ``documents``
    errors: dict[int, str] = field(default_factory=dict)  # message index -> "kind: reason"
    sent: dict[TP, bytes] = field(default_factory=dict)  # the largest order key sent per partition, with it


@dataclass
class PrepareWritten:
    offsets: list[TopicPartition]
    messages: int
    band_records: int
    band_bytes: int
    document_bytes: int
    seconds: float = 0.0
    sent: dict[TP, bytes] = field(default_factory=dict)


class PrepareProcessor(StageHooks):
    """The prepare stage's ``Processor``.

    Args:
        settings: record and engine settings (``text_field``, ``id_field``, ...).
        topology: the sharded topics.
    """

    def __init__(self, settings: Settings, topology: Topology) -> None:
        self.settings = settings
        self.topology = topology
        self.preparer = Preparer(settings.engine())
        self.digest = engine_digest(settings.engine())
        # decide orders its decisions by the watermarks under the components policy only
        self._components = settings.engine().cluster_policy == "components"
        self.marked = [topology.bands] + ([topology.findings] if self._components else [])
        self._ensured = False
        self._limit: int | None = None
        self._consumer: Consumer | None = None
        self._counts: dict[str, int] = {}  # input topic -> partition count
        self._start: dict[TP, int] = {}  # where reading began, per assigned partition
        self._sent: dict[TP, bytes] = {}  # the largest order key sent per partition, this batch included
        self._sent_committed: dict[TP, bytes] = {}  # ... as of the last committed batch
        self._marked_at = 0.0
        self._paused: set[TP] = set()
        # per partition, its end offset as the broker last said it, and the wall-clock time
        # (ms) it was asked at (``_confirm_ends``)
        self._ends: dict[TP, tuple[int, int]] = {}
        self._ends_asked = 0.0  # monotonic time the broker was last asked
        self._unasked = 0.0  # monotonic time before which the broker is not asked again
        # asks the ends: a connection of its own, as a request on the stage's consumer's waits
        # behind a fetch the broker holds (up to fetch.wait.max.ms at a partition's end)
        self._ends_reader: Consumer | None = None
        # per partition, the record time (ms) its next record comes after, as of the last time
        # it was read to its end (the wall clock minus the reorder window then)
        self._caught_up: dict[TP, int] = {}
        self.lead: LeadMonitor | None = None  # started with the stage (``open``)
        # each shingle set once, to the set topic, and band records of bucket ids only;
        # with a retention window the band records keep the sets (the shards delete the
        # band records their expired members no longer need, and nothing deletes set records)
        self.sets_once = (retention_changes(settings) or {}).get("seconds") is None
        self._set_partition = -1  # the set topic's partition of the last batch (in turn)

    def open(self) -> None:
        threading.Thread(target=warm_up, args=(self.preparer.settings,), name="neardup-warm-up",
                         daemon=True).start()
        self.lead = LeadMonitor(self.settings, self.topology, self.settings.max_undecided)

    def close(self) -> None:
        if self.lead is not None:
            self.lead.close()
            self.lead = None
        if self._ends_reader is not None:
            self._ends_reader.close()
            self._ends_reader = None

    def is_output(self, topic: str) -> bool:
        return topic in (self.topology.bands, self.topology.sets, self.topology.findings)

    def check(self, consumer: Consumer, partitions: list[TP]) -> None:
        """Create the topology's topics (once), before anything is produced to them, and
        read the findings topic's ``max.message.bytes`` (once).

        Raises:
            TopologyMismatchError: an existing topic has another partition count.
        """
        if not self._ensured:  # retried: the broker may be out (a check that raises ends the stage)
            with_retries("creating the topology's topics", lambda: self.topology.ensure_with(self.settings))
            self._ensured = True
        if self._limit is None:  # read here, retried: in ``compute`` a broker outage would fail the batch
            limits = TopicLimits(admin_config(self.settings))
            self._limit = with_retries(f"reading max.message.bytes of {self.topology.findings}",
                                       lambda: limits.get(self.topology.findings))
        if consumer is not self._consumer:
            self._paused = set()
        self._consumer = consumer
        # What the check asks the broker goes through a client of its own (``_read``), not
        # the stage's consumer: that one may fail while the check runs (the runtime replaces
        # it once the check has ended), and one was seen to answer "Broker transport
        # failure" after an outage for as long as it was asked: the check never ended and
        # the stage never read again
        for topic in sorted({t for t, _ in partitions}):
            meta = self._read(f"reading the metadata of {topic}", lambda c, t=topic: c.list_topics(t, timeout=10))
            self._counts[topic] = len(meta.topics[topic].partitions)
        tps = [TopicPartition(t, p) for t, p in partitions]
        # librdkafka keeps a partition paused across a rebalance: one this process paused,
        # revoked and assigned again would never be read again
        consumer.resume(tps)
        self._paused.difference_update(partitions)
        start = {(tp.topic, tp.partition): tp.offset
                 for tp in self._read("reading committed offsets", lambda c: c.committed(tps, timeout=10))}
        unset = [TopicPartition(t, p) for (t, p), offset in start.items() if offset < 0]
        if unset:  # no committed offset: the reset policy's end
            which = OFFSET_BEGINNING if self.settings.from_beginning else OFFSET_END
            start |= self._read("reading the offsets of the partitions without a committed one",
                                lambda c: partition_offsets(c, unset, which, 10))
        self._start.update(start)

    def _read(self, what: str, call: Callable[[Consumer], T]) -> T:
        """``call`` on a new consumer of the stage's group that never subscribes (so never
        joins it), retried with another (``with_retries``)."""

        def attempt() -> T:
            reader = Consumer({**_reader_config(self.settings), "group.id": self.settings.group_id})
            try:
                return call(reader)
            finally:
                discard(reader)

        return with_retries(what, attempt)

    def revoked(self, partitions: set[TP]) -> None:
        for tp in partitions:
            self._paused.discard(tp)
            self._ends.pop(tp, None)
            self._start.pop(tp, None)
            self._sent.pop(tp, None)
            self._sent_committed.pop(tp, None)
            self._caught_up.pop(tp, None)

    def due(self) -> bool:
        """Idle: time for watermark records (the wall clock moves the ends of read partitions)."""
        return bool(self._start) and time.monotonic() - self._marked_at >= IDLE_MARK_S

    def aborted(self) -> None:
        self._sent = dict(self._sent_committed)

    def committed(self, written: PrepareWritten, seconds: float) -> PrepareWritten:
        written.seconds = seconds
        self._sent_committed = written.sent
        return written

    def _in_step(self, consumer: Consumer, behind: list[TP]) -> None:
        """Pause the partitions more than ``AHEAD_MS`` ahead of the one furthest behind,
        resume those no longer ahead (all of them when none is behind). A partition's head
        is its last record sent, or, if later, the time it was last read to its end minus
        the reorder window (its watermark then): after a quiet spell longer than
        ``AHEAD_MS``, the first partition written again is not paused for the others. While the lead
        monitor holds back: pause those whose last record sent is past the earliest
        record the shards have not released (every one, if none is), resume the others."""
        heads = {tp: order_time(self._sent[tp]) for tp in behind if tp in self._sent}
        lead = self.lead
        limit: float | None
        if lead is not None and lead.holding_back():
            released = lead.released
            if released is not None:
                limit = released
            elif self._components:  # decide waits for the watermarks: the partitions furthest behind go on
                limit = min(heads.values(), default=None)
            else:
                limit = float("-inf")
        else:
            # a partition idle a while and then written again is not behind by its last record
            # sent: its next records come after the time it was last read to its end
            heads = {tp: max(t, self._caught_up.get(tp, t)) for tp, t in heads.items()}
            active = [heads[tp] for tp in heads if tp not in self._paused]
            floor = min(active, default=None)
            limit = None if floor is None else floor + AHEAD_MS
        pause = [tp for tp, t in heads.items() if limit is not None and t > limit and tp not in self._paused]
        resume = [tp for tp in self._paused if limit is None or tp not in heads or heads[tp] <= limit]
        if pause:
            self._pause(consumer, pause)
        if resume:
            consumer.resume([TopicPartition(t, p) for t, p in resume])
            self._paused.difference_update(resume)
        if pause or resume:
            log.debug("reading in step: paused %s, resumed %s", sorted(pause), sorted(resume))

    def _pause(self, consumer: Consumer, partitions: list[TP]) -> None:
        """Pause ``partitions``: nothing of them is fetched until they are resumed."""
        consumer.pause([TopicPartition(t, p) for t, p in partitions])
        self._paused.update(partitions)

    def _watermarks(self) -> list[Record]:
        """The watermark records of what ``_sent`` holds (one per shard partition; none
        while no input partition has a watermark)."""
        consumer = self._consumer
        if consumer is None or not self._start:
            return []
        window = self.settings.reorder_window_ms
        positions: dict[TP, int] = {}
        ask: set[TP] = set()  # partitions the consumer's cache shows at their end (or knows no end of)
        # (only these can be read to their end: the cache lags, but never shows records that are not there)
        for tp in consumer.position([TopicPartition(t, p) for t, p in self._start]):
            key = (tp.topic, tp.partition)
            positions[key] = position = tp.offset if tp.offset >= 0 else self._start.get(key, -1)
            _, high = consumer.get_watermark_offsets(tp, cached=True)
            if position >= 0 and not 0 <= position < high:
                ask.add(key)
        self._confirm_ends(ask)
        marks: dict[TP, tuple[int, bytes]] = {}
        behind: list[TP] = []  # partitions with records still to read
        for key, position in positions.items():
            mark = self._sent.get(key)
            end, asked_ms = self._ends.get(key, (-1, 0))
            # read to its end as of asked_ms (its next record comes after), unless the cache
            # shows records past the position since (an answer up to END_CONFIRM_S old)
            if key in ask and 0 <= end <= position:
                caught_up = asked_ms - window
                mark = max(mark or b"", time_mark(caught_up))
                self._caught_up[key] = max(self._caught_up.get(key, caught_up), caught_up)
            else:
                behind.append(key)
            if mark is not None and key[0] in self._counts:
                marks[key] = (self._counts[key[0]], mark)
        self._marked_at = time.monotonic()
        self._in_step(consumer, behind)
        if not marks:
            return []
        value = watermark_value(marks)
        headers = [(KIND_HEADER, WATERMARK_KIND), (ENGINE_HEADER, self.digest)]
        counts = {self.topology.bands: self.topology.shards, self.topology.findings: self.topology.decide_partitions}
        return [(topic, q, None, value, headers) for topic in self.marked for q in range(counts[topic])]

    def _confirm_ends(self, partitions: set[TP]) -> None:
        """Ask the broker the end offsets of ``partitions`` (``partition_offsets``, read
        committed: the last stable offset, as far as the stage's consumer reads) and keep
        each with the wall-clock time it was asked at, unless it was asked less than
        ``END_CONFIRM_S`` ago, or the broker gave no answer less than
        ``END_QUERY_PAUSE_S`` ago (then the ends said before stay)."""
        now = time.monotonic()
        if not partitions or now - self._ends_asked < END_CONFIRM_S or now < self._unasked:
            return
        self._ends_asked = now
        if self._ends_reader is None:
            self._ends_reader = Consumer({**_reader_config(self.settings), "isolation.level": "read_committed",
                                          "group.id": f"neardup-ends-{self.topology.app}"})
        asked_ms = int(time.time() * 1000)
        try:
            ends = partition_offsets(self._ends_reader, [TopicPartition(t, p) for t, p in partitions], OFFSET_END,
                                     END_QUERY_TIMEOUT_S)
        except KafkaException as exc:
            log.debug("reading the end offsets of %d partitions: %s", len(partitions), exc)
            self._unasked = time.monotonic() + END_QUERY_PAUSE_S
            return
        self._ends.update((tp, (end, asked_ms)) for tp, end in ends.items())

    def read(self, messages: list[Message], full: bool) -> PrepareBatch:
        s = self.settings
        batch = PrepareBatch(messages, full)
        for i, m in enumerate(messages):
            try:
                doc = to_document(m.value(), m.key(), m.topic(), m.partition(), m.offset(),
                                  s.text_field, s.id_field, s.max_message_bytes)
            except MessageError as exc:
                batch.errors[i] = f"{exc.kind}: {exc}"
                continue
            batch.documents.append(doc)
            batch.decoded.append(m)
        return batch

    def compute(self, batch: PrepareBatch) -> tuple[PrepareBatch, list[Record]]:
        """Every record of the batch, in input order, then the watermark records (nothing
        produced); an idle batch (no message) has watermark records only."""
        out = self._records(batch) if batch.messages else []
        out += self._watermarks()
        batch.sent = dict(self._sent)
        return batch, out

    def _records(self, batch: PrepareBatch) -> list[Record]:
        """The band and documents records of the batch's messages, in input order; the
        largest order key of each partition goes to ``_sent``."""
        t = self.topology
        p = self.preparer(batch.documents)
        grouped, bounds = shard_bounds(p.buckets, t.shards)
        touched = (bounds[:, 1:] > bounds[:, :-1]).sum(axis=1).tolist()  # shard partitions per document
        band_headers = [(ENGINE_HEADER, self.digest)]
        by_message: dict[int, tuple[str, int, int]] = {}  # message index -> (document id, band entries, p.valid index)
        orders: list[bytes] = []  # per valid document (p.valid's order): order key, id
        ids: list[bytes] = []
        include = np.ones(len(p.valid), dtype=bool)  # the valid documents sent to the shards
        valid = iter(range(len(p.valid)))
        at = {id(m): i for i, m in enumerate(batch.messages)}
        keys = [self._order(m) for m in batch.messages]  # order keys, by message index
        carried = [m.headers() or [] for m in batch.messages]  # read once: each call makes the list anew
        for doc, m, reason in zip(batch.documents, batch.decoded, p.rejected):
            i = at[id(m)]
            if reason is not None:
                batch.errors[i] = f"empty_text: {reason}"
                continue
            v = next(valid)
            orders.append(keys[i])
            ids.append(doc.id.encode("utf-8"))
            by_message[i] = (doc.id, touched[v], v)
        out: list[Record] = []
        headers = [_DOCUMENTS_HEADER, (ENGINE_HEADER, self.digest)]
        limit = self._findings_limit()
        room = limit - record_size(None, None, headers) - DOCUMENTS_FIXED_BYTES  # per record
        # decide partition -> its documents, in input order, with their bytes (``_entry_bytes``)
        documents: dict[int, list[tuple[DocumentEntry, int]]] = {}
        for i, (m, key) in enumerate(zip(batch.messages, keys)):
            tp = (m.topic(), m.partition())
            if key > self._sent.get(tp, b""):
                self._sent[tp] = key
            doc = by_message.get(i)
            entry = DocumentEntry(key, doc[1] if doc else 0, m.key(), m.value(), carried_headers(carried[i]),
                                  m.topic(), doc[0] if doc else "", batch.errors.get(i), None)
            size = _entry_bytes(entry)
            if size > room and doc is not None:  # a documents record of it alone would not fit: a dead letter
                batch.errors[i] = (f"too_large: a record of {size + limit - room} bytes does not fit "
                                   f"max.message.bytes {limit} of topic {t.findings}")
                include[doc[2]] = False  # and no band record
                entry = entry._replace(shards=0, doc_id="", error=batch.errors[i])
                size = _entry_bytes(entry)
            if size > room:  # its dead letter goes without it
                entry = entry._replace(value=None, value_bytes=len(entry.value or b""))
                size = _entry_bytes(entry)
            if size > room:  # its key and headers alone too large: neardup's headers alone, as ``fit``'s last stage
                entry = entry._replace(key=None, carried=[], error=f"{entry.error}; key and headers left out to fit "
                                       f"max.message.bytes {limit} of topic {t.findings}")
                size = _entry_bytes(entry)
            documents.setdefault(decide_partition(key, t.decide_partitions), []).append((entry, size))
        for q, entries in sorted(documents.items()):  # one documents record per decide partition, split if large
            for chunk in split_runs(entries, itemgetter(1), room):
                out.append((t.findings, q, None, documents_value([entry for entry, _ in chunk]), headers))
        # one band record per shard partition (split if large), built as columns
        if self.sets_once and include.any():
            # the sets once each, first: ``write`` waits for the broker to take them alone,
            # then names them in the band records (the header's empty value)
            self._set_partition = (self._set_partition + 1) % t.shards
            set_headers = [(KIND_HEADER, SETS_KIND), (ENGINE_HEADER, self.digest)]
            out[:0] = [(t.sets, self._set_partition, None, value, set_headers)
                       for value in sets_values(orders, p.fingerprints, p.fingerprint_offsets, include)]
            band_headers = [*band_headers, (SETS_HEADER, b"")]
        for q, values in enumerate(batch_bands(orders, ids, grouped, bounds, p.fingerprints,
                                                p.fingerprint_offsets, include, with_sets=not self.sets_once)):
            out += [(t.bands, q, None, value, band_headers) for value in values]
        return out

    def _findings_limit(self) -> int:
        """The largest record the findings topic takes, bytes (read once)."""
        if self._limit is None:
            self._limit = TopicLimits(admin_config(self.settings)).get(self.topology.findings)
        return self._limit

    @staticmethod
    def _set_offsets(producer: Producer, sets: list[int | KafkaError]) -> list[int]:
        """The offsets of the batch's set records, once the broker has them (their
        delivery reports; a flush of the producer, one round trip per batch).

        Raises:
            KafkaException: a set record not delivered (the transaction is aborted and retried).
        """
        producer.flush(SET_DELIVERY_S)
        failed = next((x for x in sets if isinstance(x, KafkaError)), None)
        if failed is not None or not sets:
            raise KafkaException(failed or KafkaError(KafkaError._TIMED_OUT, "set records not delivered"))
        return sorted(sets)  # type: ignore[type-var]

    @staticmethod
    def _order(m: Message) -> bytes:
        ts_type, ts = m.timestamp()
        return order_key(ts if ts_type != 0 else -1, m.partition(), m.offset())

    def write(self, work: tuple[PrepareBatch, list[Record]], producer: Producer) -> PrepareWritten:
        """Produce the batch's records into the open transaction.

        Raises:
            KafkaException: a produce error (the transaction is aborted and retried).
        """
        batch, records = work
        band_records = band_bytes = document_bytes = 0
        lead = self.lead
        sets: list[int | KafkaError] = []  # the offsets of the batch's set records, as delivered
        set_partition = -1
        ref: list[tuple[str, bytes]] | None = None  # the band records' headers naming them
        for topic, partition, key, value, headers in records:
            if topic == self.topology.sets:
                produce(producer, topic, key, value, headers, partition, _on_set_delivered(sets))
                set_partition = partition  # type: ignore[assignment]
                band_bytes += len(value or b"")  # what the band records carried before
                continue
            if headers and headers[-1] == (SETS_HEADER, b""):
                if ref is None:
                    ref = [*headers[:-1], (SETS_HEADER, sets_ref(set_partition, self._set_offsets(producer, sets)))]
                headers = ref
            if lead is not None and topic == self.topology.findings and headers[0] == _DOCUMENTS_HEADER:
                produce(producer, topic, key, value, headers, partition, _on_delivered(lead, documents_count(value)))
            else:
                produce(producer, topic, key, value, headers, partition)
            size = len(value or b"") + len(key or b"")
            if topic == self.topology.bands and headers[0][0] == ENGINE_HEADER:  # not a watermark record
                band_records += 1
                band_bytes += size
            else:
                document_bytes += size
        return PrepareWritten(next_offsets(batch.messages), len(batch.messages), band_records, band_bytes,
                              document_bytes, sent=batch.sent)


def _on_set_delivered(sets: list[int | KafkaError]) -> Callable[[KafkaError | None, Message], None]:
    def delivered(err: KafkaError | None, msg: Message) -> None:
        sets.append(err if err is not None else msg.offset())
    return delivered


class PrepareStage(StageRuntime):
    """The prepare stage: ``PrepareProcessor`` on the stage runtime.

    Args:
        settings: as ``StageRuntime``'s; its ``group_id`` is the stage's consumer group
            and, with ``instance``, its transactional id.
        topology: the sharded topics.
        instance: this process's name among the stage's instances (each needs its own
            transactional id).
        **callbacks: ``on_batch``, ``on_assignment``, ``on_abort``, ``on_broker``.
    """

    producer_defaults = STAGE_PRODUCER

    def __init__(self, settings: Settings, topology: Topology, instance: str = "0", **callbacks: Any) -> None:
        settings = settings.model_copy(update={"transactional_id": f"neardup-{settings.group_id}-{instance}"})
        super().__init__(settings, PrepareProcessor(settings, topology), **callbacks)
