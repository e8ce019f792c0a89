"""The decide stage of a sharded deduplication (docs/scale-out.md): a stateful
``Processor`` on the stage runtime (``neardup.kafka.stage``), consuming the findings topic.

A document's record (from prepare) and the findings of the shards it touched (from the
shards) meet on its decide partition. Once all have come, and the cluster of every
candidate it accepted is known, the document is decided (``neardup.sharded.decide``): its
record is produced to ``<input>.unique`` or ``<input>.duplicates`` with today's headers
(or, for a message that was no document, to ``<input>.dlq`` with its error), and its
cluster to the compacted decisions topic (one record per batch, its documents' decisions
as columns), which every decide process reads in full (the decisions table: the clusters
of earlier documents decided anywhere). A candidate is
always earlier than the document and its own decision needs only earlier documents, so
the earliest undecided document can always be decided: no deadlock. The table is in memory,
read from the topic's start at every start, or with ``state_dir`` in a RocksDB store
(``neardup.state.decisions``) reopened at its position. With the components cluster
policy a decision also names the clusters it merges, the table is a union-find forest,
and documents are decided in order-key order across all decide processes
(``_decide_in_order``): prepare sends its watermarks to the decide partitions too, and
each process publishes, per partition it owns, how far every document is decided (a
record ``b"P" + partition`` in the decisions topic).

What waits lives in memory; the findings topic keeps its records. The offset committed
for findings partition q is that of the earliest record of a document still waiting (or
the batch's end when none waits), and the stage's changelog (partition q of
``<app>.decide-changelog``, compacted), written in the batch's transaction, holds
``b"P"`` -> ``">q"`` the consumed offset (after the batch's last record of q), and per
batch at most one record of the documents that began to wait in it, ``b"A"`` + the first
one's order key -> their order keys, and one of the documents it decided whose ``A``
record stays live, ``b"D"`` + the first one's order key -> their order keys. The
documents waiting are those of the live ``A`` records less those of the live ``D``
records. An ``A`` record is deleted (a tombstone) in the batch that decides the last of
its documents, a ``D`` record in the batch that deletes the last ``A`` record it names
(``_Log``). So a batch logs what changed, in a few records, not every document still
waiting (a backlog keeps tens of thousands waiting per partition) nor a record per
document. The layouts before are read too: one record per waiting document (``b"W"`` +
its order key -> ``b""``, deleted when it is decided), and a ``P`` record with the
waiting order keys after the offset. When the partition is assigned, its records are read again from the committed
offset: before the consumed offset, those of the documents listed are taken again, the
others (decided before) skipped. After a failed batch (``aborted``) the runtime reads again from the
failed batch's first offsets: the documents waiting as of the last commit are kept in
memory for it. The decisions table needs no undo: a decision is a function of the
findings and of earlier decisions, so one taken in a batch that failed is taken again
the same.

A record too large for its output topic goes to the dead-letter topic, with less of the
message if need be (``neardup.kafka.messages.fit``, as in ``neardup run``). Not yet here
(docs/scale-out.md): the fallback when the broker refuses a record that fitted by its
topic's limit as read (``neardup run``'s per-message errors). What it decided is counted
in the stage's metrics (``DecideWritten``: documents by verdict, dead letters, waiting).
"""

from __future__ import annotations

import heapq
import logging
import struct
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import orjson
from confluent_kafka import OFFSET_BEGINNING, Consumer, Message, Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from neardup.config import Settings
from neardup.kafka.bounded import discard
from neardup.kafka.clients import admin_config
from neardup.kafka.limits import TopicLimits
from neardup.kafka.messages import HEADER_VALUE_BYTES, Limits, Outcome, fit
from neardup.kafka.partition_log import catch_up, read_to_end, with_retries
from neardup.kafka.rdkafka_log import rdkafka_logger
from neardup.kafka.stage import MessageBatch, ProducedRecord, StageHooks, StageRuntime, TP, next_offsets, produce_all
from neardup.kafka.topics import create_missing, new_topic, sized_outputs
from neardup.sharded.topology import STAGE_PRODUCER, Topology
from neardup.sharded.decide import decide, waiting_for
from neardup.sharded.records import (
    ChangelogLayoutError,
    DECISIONS_KEY,
    DECISIONS_RECORD_BYTES,
    DOCUMENTS_KIND,
    DecisionEntry,
    DocumentEntry,
    ENGINE_HEADER,
    ERROR_HEADER,
    ID_HEADER,
    KIND_HEADER,
    ORDER,
    ORDER_HEADER,
    SHARDED_PREFIX,
    SHARDS_HEADER,
    TOPIC_HEADER,
    VALUE_BYTES_HEADER,
    FINDINGS_KIND,
    WATERMARK_KIND,
    Watermarks,
    check_engine_value,
    decisions_entry_bytes,
    decisions_value,
    engine_digest,
    fields_seq,
    order_seq,
    parse_decisions,
    parse_documents,
    parse_findings_columns,
    seq_order,
    split_runs,
)
from neardup.sharded.shard import Checked, Finding, window_time
from neardup.state.decisions import DecisionsTable, StoredDecisionsTable

log = logging.getLogger(__name__)

_CONSUMED = struct.Struct(">q")  # a ``P`` record: the consumed offset (an earlier layout: then the waiting order keys)
_WAITING = b"W"  # an earlier layout's record of one waiting document: this, then its order key
_BEGAN = b"A"  # the record of the documents that began to wait in a batch: this, then the first one's order key
_DECIDED = b"D"  # the record of the documents a batch decided whose ``A`` record stays live: likewise
_PARTITION = struct.Struct(">i")  # a decide partition, in the key of its progress record (components)
Record = ProducedRecord


def _one_document(m: Message, headers: list[tuple[str, bytes | None]],
                  named: dict[str, bytes | None]) -> DocumentEntry:
    """A document record of an earlier version (one per document, its fields in headers),
    as a documents record's entry.

    Raises:
        ValueError: a value-size header that is no number.
    """
    error, value_bytes = named.get(ERROR_HEADER), named.get(VALUE_BYTES_HEADER)
    return DocumentEntry(named.get(ORDER_HEADER) or b"", int(named.get(SHARDS_HEADER) or b"0"), m.key(), m.value(),
                         [(k, v) for k, v in headers if not k.startswith(SHARDED_PREFIX)],
                         (named.get(TOPIC_HEADER) or b"").decode("utf-8"), (named.get(ID_HEADER) or b"").decode("utf-8"),
                         None if error is None else error.decode("utf-8"),
                         None if value_bytes is None else int(value_bytes))


@dataclass(slots=True)
class _Waiting:
    """A document on its way: its record once come, its findings."""

    record: DocumentEntry | None = None
    findings: dict[int, list | tuple] = field(default_factory=dict)  # shard partition -> its candidates
    error: str | None = None  # a shard could not read its band record
    first: int = 1 << 62  # the findings-topic offset of its earliest record
    shards: int = 0  # how many shards answer (its record's ``SHARDS_HEADER``)

    def copy(self) -> _Waiting:
        return _Waiting(self.record, dict(self.findings), self.error, self.first, self.shards)

    @property
    def complete(self) -> bool:
        """Its record and every shard's finding have come."""
        return self.record is not None and len(self.findings) >= self.shards


@dataclass
class _Change:
    """What ``_Log.update`` changed, for ``_Log.undo``."""

    began: tuple[bytes, list[bytes]] | None = None  # the A key written, and its documents
    decided: list[tuple[bytes, bytes]] = field(default_factory=list)  # (document, its A or W key)
    deleted: list[bytes] = field(default_factory=list)  # the A and W keys deleted
    unnamed: list[tuple[bytes, bytes]] = field(default_factory=list)  # (D key, A key) references dropped
    deleted_d: list[bytes] = field(default_factory=list)  # the D keys deleted
    written_d: bytes | None = None  # the D key written


@dataclass
class _Log:
    """A decide partition's waiting documents as its changelog lists them (see the module
    docstring): the keys of the live records and what they hold."""

    listed: dict[bytes, bytes] = field(default_factory=dict)  # a document not decided -> its A (or W) key
    alive: dict[bytes, int] = field(default_factory=dict)  # a live A (or W) key -> its documents not decided
    names: dict[bytes, set[bytes]] = field(default_factory=dict)  # a live D key -> the live A keys it names
    named_by: dict[bytes, set[bytes]] = field(default_factory=dict)  # a live A key -> the live D keys naming it

    @classmethod
    def read(cls, began: dict[bytes, list[bytes]], decided: dict[bytes, list[bytes]], waiting: set[bytes]) -> _Log:
        """The log of a partition's live ``A`` records (key -> documents), ``D`` records
        (the same) and the documents of its ``W`` records."""
        log = cls()
        done = {order for orders in decided.values() for order in orders}
        of = {}
        for key, orders in began.items():
            for order in orders:
                of[order] = key
                if order not in done:
                    log.listed[order] = key
        log.listed.update((order, _WAITING + order) for order in waiting)
        for key in log.listed.values():
            log.alive[key] = log.alive.get(key, 0) + 1
        for d, orders in decided.items():
            named = {of[order] for order in orders if of.get(order) in log.alive}
            if named:
                log.names[d] = named
                for key in named:
                    log.named_by.setdefault(key, set()).add(d)
        return log

    def update(self, began: list[bytes], decided: list[bytes]) -> tuple[list[tuple[bytes, bytes | None]], _Change]:
        """``decided`` (listed documents decided in a batch) and ``began`` (documents that
        began to wait in it, not listed), each sorted: the changelog records (key, value;
        None: a tombstone) and the change."""
        change = _Change()
        out: list[tuple[bytes, bytes | None]] = []
        for order in decided:
            key = self.listed.pop(order)
            self.alive[key] -= 1
            change.decided.append((order, key))
        for key in sorted({key for _, key in change.decided if not self.alive[key]}):
            del self.alive[key]
            out.append((key, None))
            change.deleted.append(key)
            for d in sorted(self.named_by.pop(key, ())):
                names = self.names[d]
                names.discard(key)
                change.unnamed.append((d, key))
                if not names:
                    del self.names[d]
                    out.append((d, None))
                    change.deleted_d.append(d)
        kept = [(order, key) for order, key in change.decided if key in self.alive]
        if kept:  # decided, their A record still live: listed as decided until it is deleted
            d = _DECIDED + kept[0][0]
            self.names[d] = {key for _, key in kept}
            for _, key in kept:
                self.named_by.setdefault(key, set()).add(d)
            out.append((d, b"".join(order for order, _ in kept)))
            change.written_d = d
        if began:
            key = _BEGAN + began[0]
            self.alive[key] = len(began)
            self.listed.update(dict.fromkeys(began, key))
            out.append((key, b"".join(began)))
            change.began = (key, began)
        return out, change

    def undo(self, change: _Change) -> None:
        """Take ``change`` back (its batch failed)."""
        if change.began is not None:
            key, began = change.began
            del self.alive[key]
            for order in began:
                del self.listed[order]
        if change.written_d is not None:
            for key in self.names.pop(change.written_d):
                self.named_by[key].discard(change.written_d)
                if not self.named_by[key]:
                    del self.named_by[key]
        for d, key in change.unnamed:
            self.names.setdefault(d, set()).add(key)
            self.named_by.setdefault(key, set()).add(d)
        for key in change.deleted:
            self.alive[key] = 0
        for order, key in change.decided:
            self.listed[order] = key
            self.alive[key] += 1


@dataclass
class _Undo:
    """What one batch changed, to take back if its transaction aborts: per waiting
    document it changed, its partition and its state before the batch (None: it came in
    the batch); per partition, the consumed offset before the batch and what the batch
    changed in its log."""

    waiting: dict[bytes, tuple[int, _Waiting | None]] = field(default_factory=dict)
    partitions: dict[int, tuple[int, _Change]] = field(default_factory=dict)

    def forget(self, q: int) -> None:
        """Drop what concerns partition ``q`` (assigned anew, or revoked)."""
        self.waiting = {order: change for order, change in self.waiting.items() if change[0] != q}
        self.partitions.pop(q, None)


@dataclass
class DecideWritten:
    offsets: list[TopicPartition]
    messages: int = 0
    unique: int = 0
    duplicate: int = 0
    dead_letter: int = 0
    waiting: int = 0
    seconds: float = 0.0


class DecideProcessor(StageHooks):
    """The decide stage's ``Processor``.

    Args:
        settings: Kafka and batch settings; ``settings.engine()`` gives the threshold.
        topology: the sharded topics.
        state_dir: where the decisions table is kept on disk (``state_dir/decisions``, a
            RocksDB store); None: in memory.
        retention_ms: the shards' retention window, ms (``neardup.sharded.shard``): a
            cluster whose canonical expired is judged by its best member, and the table
            drops the decisions stamped more than two windows before the latest document
            decided here (``expire``); None: no window.
    """

    def __init__(self, settings: Settings, topology: Topology, state_dir: Path | None = None,
                 retention_ms: int | None = None) -> None:
        self.settings = settings
        self.retention_ms = retention_ms
        self._future_s = settings.engine().future_tolerance_s
        self._latest = -(1 << 62)  # the latest document time decided here (ms), for expiry
        self.threshold = settings.engine().threshold
        self.policy = settings.engine().cluster_policy
        self.digest = engine_digest(settings.engine())
        self.topology = topology
        self.partitions: dict[int, dict[bytes, _Waiting]] = {}
        self.state_dir = state_dir
        self.clusters: DecisionsTable = DecisionsTable(self.policy == "components")  # on disk: at start
        self._table: Consumer | None = None
        self._outputs: set[str] = set()
        self._blocked: dict[int, set[bytes]] = {}  # complete documents waiting for a cluster
        self._retry_all = False  # after a restore: every waiting document is tried once
        self._consumed: dict[int, int] = {}  # findings partition -> offset after its last batch's records
        self._listed: dict[int, set[bytes]] = {}  # ... the documents waiting at its last commit (a restart)
        # per partition, the documents its changelog lists as waiting, as of the last batch computed
        self._logs: dict[int, _Log] = {}
        # per partition, (first, order key) of its waiting documents, a heap: the earliest
        # record to read again after a restart, without a pass over every one per batch
        self._firsts: dict[int, list[tuple[int, bytes]]] = {}
        # per batch computed and not yet committed, oldest first: what it changed. An undo
        # log rather than a copy of the state per batch: in a backlog thousands of
        # documents wait per partition, and a copy of them all at every batch cost about a
        # tenth of the stage's CPU
        self._uncommitted: list[_Undo] = []
        self._table_new = False  # decisions came to the table since the last batch
        self._decided: list[DecisionEntry] = []  # the batch's decisions not yet in a decisions record
        self._table_decisions = 0  # decisions read from the table's topic (logged at start)
        self._limits = TopicLimits(admin_config(settings))  # max.message.bytes of the output topics
        self._batch_targets: dict[str, tuple[dict[str, str], Limits]] = {}  # by input topic, for one batch
        self._ensured = False
        # components: watermarks per owned partition; per decide partition, the first seq
        # not known to be decided (read from the decisions topic), and what was published
        self._marks: dict[int, Watermarks] = {}
        self._progress: dict[int, int] = {}
        self._published: dict[int, int] = {}

    # --- lifecycle ------------------------------------------------------------------

    def start(self, producer: Producer) -> None:
        """Open the decisions table and read the topic's records past its position to
        their end.

        Raises:
            StateError: the table's store cannot be opened.
        """
        if self._table is not None:
            return
        if self.state_dir is not None and not isinstance(self.clusters, StoredDecisionsTable):
            self.clusters = StoredDecisionsTable(self.state_dir / "decisions", self.policy == "components")
        self._ensure()
        started = time.perf_counter()
        self._table_decisions = 0
        start, read = with_retries("reading the decisions table", lambda: catch_up(
            self.settings, self.topology.decisions, 0, self.clusters.position(), self._apply_decisions,
            self.clusters.wipe, self.clusters.position_age_ms()))
        position = self.clusters.position()
        table = Consumer({
            "bootstrap.servers": self.settings.bootstrap_servers, "logger": rdkafka_logger(),
            **self.settings.kafka, "group.id": f"neardup-decisions-{uuid.uuid4()}",
            "enable.auto.commit": False, "isolation.level": "read_committed",
            "auto.offset.reset": "earliest"})
        table.assign([TopicPartition(self.topology.decisions, 0, OFFSET_BEGINNING if position is None else position)])
        self._table = table
        log.info("decisions table %s: %s, %d records read (%d decisions), in %.1f s",
                 f"opened at {self.clusters.path}" if isinstance(self.clusters, StoredDecisionsTable) else "in memory",
                 "read in full" if start is None else f"from offset {start}", read, self._table_decisions,
                 time.perf_counter() - started)

    def close(self) -> None:
        if self._table is not None:
            self._table.close()
            self._table = None
        if isinstance(self.clusters, StoredDecisionsTable):
            self.clusters.close()
            self.clusters = DecisionsTable(self.policy == "components")

    def _ensure(self) -> None:
        if not self._ensured:
            self.topology.ensure_with(self.settings)
            self._ensured = True

    def is_output(self, topic: str) -> bool:
        return topic == self.topology.decisions or topic.endswith((".unique", ".duplicates", ".dlq"))

    def check(self, consumer: Consumer, partitions: list[TP]) -> None:
        """Read the ``P`` records of the newly assigned partitions (their waiting
        documents are read again from the findings topic).

        Raises:
            KafkaException: the changelog could not be read.
        """
        for _, q in partitions:
            consumed, listed, logged = with_retries(f"restoring decide partition {q}", lambda q=q: self._restore(q))
            self.partitions[q], self._consumed[q], self._listed[q] = {}, consumed, listed
            self._logs[q] = logged
            for undo in self._uncommitted:
                undo.forget(q)
            self._firsts[q] = []
            self._blocked.pop(q, None)
        self._retry_all = True

    def revoked(self, partitions: set[TP]) -> None:
        for _, q in partitions:
            for state in (self.partitions, self._blocked, self._consumed, self._listed,
                          self._marks, self._published, self._logs, self._firsts):
                state.pop(q, None)
            for undo in self._uncommitted:
                undo.forget(q)

    def aborted(self) -> None:
        """Back to the documents waiting as of the last commit (the runtime reads again
        from the failed batch's first offsets)."""
        self.clusters.forget_taken()  # the retry takes them again
        for undo in reversed(self._uncommitted):  # newest first
            for order, (q, before) in undo.waiting.items():
                waiting = self.partitions.get(q)
                if waiting is None:
                    continue
                if before is None:
                    waiting.pop(order, None)
                else:
                    waiting[order] = before
            for q, (consumed, change) in undo.partitions.items():
                if q in self.partitions:
                    self._consumed[q] = consumed
                    self._logs[q].undo(change)
        self._uncommitted = []
        for q in self.partitions:
            self._index_firsts(q)
        self._blocked.clear()
        self._published.clear()  # the progress records of the failed batch were not written
        self._marks.clear()  # taken again from the records read again, with their documents
        self._retry_all = True

    def committed(self, written: DecideWritten, seconds: float) -> DecideWritten:
        written.seconds = seconds
        if self._uncommitted:
            self._uncommitted.pop(0)
        return written

    def _restore(self, q: int) -> tuple[int, set[bytes], _Log]:
        """Partition ``q``'s changelog: (its consumed offset, -1 without one; the order
        keys of the documents waiting at the last commit; the log of those its ``A`` and
        ``W`` records list, the rest being listed in a ``P`` record of the earliest layout).

        Raises:
            ChangelogLayoutError: the partition holds records of another layout.
        """
        consumed, in_p, waiting = -1, set(), set()
        lists: dict[bytes, dict[bytes, list[bytes]]] = {_BEGAN: {}, _DECIDED: {}}
        topic = self.topology.decide_changelog
        for chunk in read_to_end(self.settings, topic, q):
            for m in chunk:
                key, value = m.key() or b"", m.value()
                if key[:1] == _WAITING and len(key) == 1 + ORDER.size and not value:
                    if value is None:
                        waiting.discard(key[1:])
                    else:
                        waiting.add(key[1:])
                    continue
                if key[:1] in lists and len(key) == 1 + ORDER.size:
                    if value is None:
                        lists[key[:1]].pop(key, None)
                    elif not value or len(value) % ORDER.size:
                        raise ChangelogLayoutError(topic, q, f"a record of key {key[:1]!r} and {len(value)} bytes")
                    else:
                        lists[key[:1]][key] = [value[at:at + ORDER.size] for at in range(0, len(value), ORDER.size)]
                    continue
                if value is None:
                    continue
                if key != b"P" or (len(value) - _CONSUMED.size) % ORDER.size:
                    raise ChangelogLayoutError(topic, q, f"a record of key {key[:1]!r} and {len(value)} bytes")
                (consumed,) = _CONSUMED.unpack_from(value)
                in_p = {value[at:at + ORDER.size] for at in range(_CONSUMED.size, len(value), ORDER.size)}
        logged = _Log.read(lists[_BEGAN], lists[_DECIDED], waiting)
        listed = in_p | set(logged.listed)
        if listed:
            log.info("decide partition %d: %d documents waiting, read again from the findings topic", q, len(listed))
        return consumed, listed, logged

    # --- the decisions table -----------------------------------------------------------
    def _apply_decisions(self, messages: list[Message]) -> int:
        """Apply a chunk of the decisions topic's records to the table, with the offset
        after the last as its position; how many were decisions."""
        decisions, progress = [], 0
        for m in messages:
            if m.error() is not None or m.value() is None:
                continue
            key = m.key() or b""
            if key[:1] == DECISIONS_KEY and len(key) == 1 + ORDER.size:  # a batch's decisions
                decisions += [(order_seq(order), order_seq(cluster), cluster_id,
                               tuple(order_seq(root) for root in merged))
                              for order, cluster, cluster_id, merged in parse_decisions(m.value())]
                continue
            if len(key) != ORDER.size:  # a decide partition's progress (components)
                self._progress[_PARTITION.unpack(key[1:])[0]] = int.from_bytes(m.value(), "big")
                progress += 1
                continue
            d = orjson.loads(m.value())  # one document's decision (written by an earlier version)
            merged = tuple(order_seq(ORDER.pack(*k)) for k in d.get("merged", ()))
            decisions.append((order_seq(m.key()), order_seq(ORDER.pack(*d["cluster"])), d["cluster_id"], merged))
        offsets = [m.offset() for m in messages if m.error() is None]
        if offsets:
            self.clusters.apply(decisions, offsets[-1] + 1)
        self._table_decisions += len(decisions)
        return len(decisions) + progress

    def _poll_table(self) -> int:
        """Apply the decisions that came to the table; sets ``_table_new`` if any did."""
        assert self._table is not None
        n = 0
        while True:
            got = self._table.consume(10_000, timeout=0)
            if not got:
                self._table_new = self._table_new or n > 0
                return n
            n += self._apply_decisions(got)

    # --- a batch --------------------------------------------------------------------

    def due(self) -> bool:
        """Whether decisions read from the table may let a waiting document go."""
        return self._poll_table() > 0 and any(self.partitions.values())

    def compute(self, batch: MessageBatch) -> tuple[list[Record], DecideWritten]:
        t = self.topology
        out: list[Record] = []
        ends = next_offsets(batch.messages)
        stats = DecideWritten(ends, messages=len(batch.messages))
        self._poll_table()
        self._batch_targets = {}
        new_decisions, self._table_new = self._table_new, False
        touched: dict[int, set[bytes]] = {}
        # what this batch changes (also the waiting documents copied or made in it, for
        # ``_changing``); kept from the start: a batch failing midway is taken back too
        undo = _Undo()
        self._uncommitted.append(undo)
        self._decided = []
        settled: dict[int, set[bytes]] = {}  # per partition, the documents decided in this batch
        # per partition, per document: [the offset of its first findings record without a
        # candidate in this batch, then those records' shard partitions]
        empty_of: dict[int, dict[bytes, list[int]]] = {}
        for m in batch.messages:
            q = m.partition()
            offset = m.offset()
            # read again after a restart: only the documents that were waiting are taken
            listed = self._listed.get(q) if offset < self._consumed.get(q, -1) else None
            headers = m.headers() or []  # a new list at each call
            named = dict(reversed(headers))  # each name's first value (neardup's names come once)
            kind = named.get(KIND_HEADER)
            if kind == WATERMARK_KIND:  # components: prepare's progress on this partition
                self._watermark(m)
                continue
            if kind in (DOCUMENTS_KIND, b"document"):  # b"document": one per record, an earlier version's
                where = f"{kind.decode()} record {m.topic()}[{q}]@{offset}"
                check_engine_value(named.get(ENGINE_HEADER), self.digest, where)
                try:
                    entries = (parse_documents(m.value() or b"") if kind == DOCUMENTS_KIND
                               else [_one_document(m, headers, named)])
                except (ValueError, struct.error, UnicodeDecodeError) as exc:
                    log.error("findings topic %s: not a %s record (%s); skipped", where, kind.decode(), exc)
                    continue
                waiting, orders = self.partitions[q], touched.setdefault(q, set())
                for e in entries:
                    if listed is not None and e.order not in listed:
                        continue
                    w = self._changing(q, waiting, e.order, undo)
                    w.record, w.shards = e, e.shards
                    self._first(q, e.order, w, offset)
                    orders.add(e.order)
            elif kind == FINDINGS_KIND:
                try:
                    found, empty_orders, empty_shards = parse_findings_columns(m.value() or b"")
                except (ValueError, struct.error, UnicodeDecodeError) as exc:
                    log.error("findings topic %s[%d]@%d: not a findings record (%s); skipped", m.topic(), q,
                              m.offset(), exc)
                    continue
                waiting, orders = self.partitions[q], touched.setdefault(q, set())
                for order, shard, checked, error in found:
                    if listed is not None and order not in listed:
                        continue
                    w = self._changing(q, waiting, order, undo)
                    w.findings[shard] = checked
                    self._first(q, order, w, offset)
                    if error is not None:
                        w.error = error
                    orders.add(order)
                # the findings without a candidate (most), gathered per document over the
                # batch's records (one per shard partition that answered): one change each
                pending = empty_of.setdefault(q, {})
                for order, shard in zip(empty_orders, empty_shards):
                    got = pending.get(order)
                    if got is not None:
                        got.append(shard)
                    elif listed is None or order in listed:
                        pending[order] = [offset, shard]  # the offset of its earliest such record
            else:
                log.error("findings topic %s[%d]@%d: neither a document nor a findings record; skipped",
                          m.topic(), q, m.offset())
        for q, pending in empty_of.items():
            waiting, orders = self.partitions[q], touched[q]
            for order, got in pending.items():
                w = self._changing(q, waiting, order, undo)
                w.findings.update(dict.fromkeys(got[1:], ()))
                self._first(q, order, w, got[0])
                orders.add(order)
        changed = set(touched)  # the partitions whose waiting documents change
        arrived = touched  # per partition, the documents given a record or a finding here
        # Only what changed is tried: documents given a record or a finding in this batch,
        # and, once any decision is new (read from the table or taken here), those that
        # were complete but waited for a candidate's cluster.
        if self._retry_all:
            self._retry_all = False
            new_decisions = True
            touched = {q: set(waiting) for q, waiting in self.partitions.items()}
        if self.policy == "components":
            changed |= self._decide_in_order(out, stats, settled, undo)
            touched = {}
        while touched or new_decisions:
            decided = 0
            for q in sorted(self.partitions):
                waiting, blocked = self.partitions[q], self._blocked.setdefault(q, set())
                for order in sorted(touched.get(q, set()) | (blocked if new_decisions else set())):
                    w = waiting.get(order)
                    if w is None or not w.complete:
                        continue
                    state = self._try(q, order, w, out, stats)
                    if state == "decided":
                        undo.waiting.setdefault(order, (q, w))
                        del waiting[order]
                        settled.setdefault(q, set()).add(order)
                        blocked.discard(order)
                        changed.add(q)
                        decided += 1
                    elif state == "blocked":
                        blocked.add(order)
            touched, new_decisions = {}, decided > 0
            if not decided:
                break
        self._decisions_records(out)
        self._expire()
        end = {tp.partition: tp.offset for tp in ends}
        for q in sorted(changed):
            waiting = self.partitions[q]
            before = self._consumed.get(q, -1)
            consumed = self._consumed[q] = max(before, end.get(q, -1))
            # a document leaves the log once decided: one listed at a restart and not yet
            # read again stays logged though it is not in memory (a rebalance before it is
            # read again must list it again)
            # every document waiting before this batch is logged: of those waiting now,
            # only ones that came in it can be new to the log
            logged, gone = self._logs.setdefault(q, _Log()), settled.get(q, set())
            listed = logged.listed
            dropped = sorted(order for order in gone if order in listed)
            added = sorted(order for order in arrived.get(q, ()) if order in waiting and order not in listed)
            records, change = logged.update(added, dropped)
            out += [(t.decide_changelog, q, key, value, []) for key, value in records]
            out.append((t.decide_changelog, q, b"P", _CONSUMED.pack(consumed), []))
            undo.partitions[q] = (before, change)
        for tp in ends:  # a restart reads again from the earliest record of a waiting document
            earliest = self._earliest(tp.partition)
            if earliest is not None:
                tp.offset = min(tp.offset, earliest)
        stats.waiting = sum(len(waiting) for waiting in self.partitions.values())
        return out, stats

    def _decisions_records(self, out: list[Record]) -> None:
        """The decisions taken since the last call as decisions records (one, split if
        large; ``neardup.sharded.records``) to ``out``."""
        for chunk in split_runs(self._decided, decisions_entry_bytes, DECISIONS_RECORD_BYTES):
            out.append((self.topology.decisions, 0, DECISIONS_KEY + chunk[0][0], decisions_value(chunk), []))
        self._decided = []

    def _first(self, q: int, order: bytes, w: _Waiting, offset: int) -> None:
        """``w.first`` lowered to ``offset`` if that is earlier (noted in ``_firsts``)."""
        if offset < w.first:
            w.first = offset
            heapq.heappush(self._firsts.setdefault(q, []), (offset, order))

    def _earliest(self, q: int) -> int | None:
        """The findings-topic offset of the earliest record of a document waiting on
        partition ``q`` (None: none waits). ``_firsts`` holds every waiting document's
        ``first`` (and stale entries, dropped here: of documents decided since, or whose
        ``first`` came earlier)."""
        heap, waiting = self._firsts.get(q), self.partitions.get(q, {})
        while heap:
            first, order = heap[0]
            w = waiting.get(order)
            if w is not None and w.first == first:
                return first
            heapq.heappop(heap)
        return None

    def _index_firsts(self, q: int) -> None:
        """``_firsts`` of partition ``q`` anew from its waiting documents."""
        heap = [(w.first, order) for order, w in self.partitions.get(q, {}).items()]
        heapq.heapify(heap)
        self._firsts[q] = heap

    @staticmethod
    def _changing(q: int, waiting: dict[bytes, _Waiting], order: bytes, undo: _Undo) -> _Waiting:
        """The waiting document ``order`` of partition ``q`` (new if none), a copy put in
        its place: the batch's ``undo`` keeps the former one for ``aborted`` (copy on
        write); once per batch (the documents in ``undo.waiting`` were copied or made in
        this batch, and are changed in place after)."""
        w = waiting.get(order)
        if order in undo.waiting:
            if w is not None:
                return w
        else:
            undo.waiting[order] = (q, w)
        w = waiting[order] = _Waiting() if w is None else w.copy()
        return w

    def _decide_in_order(self, out: list[Record], stats: DecideWritten, settled: dict[int, set[bytes]],
                         undo: _Undo) -> set[int]:
        """The components policy: a document's cluster is the union of its candidates'
        clusters with every merge decided before it, so documents are decided in
        order-key order: this process's in turn across its partitions, none while an
        earlier one waits (for its record, a finding, or a candidate's cluster), and none
        before every earlier document has come to its partitions (prepare's watermarks)
        and been decided on the others (their published progress). Then the progress of
        each partition it owns goes to the decisions topic when it moved. Returns the
        partitions with a document decided; the documents decided go to ``settled``, their
        former states to ``undo``."""
        limit, changed = self._decidable(), set()
        for order, q in sorted((order, q) for q, waiting in self.partitions.items() for order in waiting):
            if limit is None or order_seq(order) >= limit:
                break
            if self._try(q, order, self.partitions[q][order], out, stats) != "decided":
                break
            undo.waiting.setdefault(order, (q, self.partitions[q][order]))
            del self.partitions[q][order]
            settled.setdefault(q, set()).add(order)
            changed.add(q)
        self._decisions_records(out)  # before the progress they cover, in the topic's order
        for q, waiting in self.partitions.items():
            mark = self._marks[q].limit() if q in self._marks else None
            if mark is None:
                continue
            first = order_seq(mark) + 1  # every document before it has come
            if waiting:
                first = min(first, order_seq(min(waiting)))
            if self._published.get(q) != first:
                self._published[q] = first
                out.append((self.topology.decisions, 0, b"P" + _PARTITION.pack(q), first.to_bytes(24, "big"), []))
        return changed

    def _decidable(self) -> int | None:
        """The seq below which every document of the partitions this process does not
        own is decided, and every document of those it owns has come (None: a partition
        with no watermark or no progress yet)."""
        bounds = []
        for q in range(self.topology.decide_partitions):
            if q in self.partitions:
                mark = self._marks[q].limit() if q in self._marks else None
                if mark is None:
                    return None
                bounds.append(order_seq(mark) + 1)
            elif q in self._progress:
                bounds.append(self._progress[q])
            else:
                return None
        return min(bounds, default=None)

    def _watermark(self, m: Message) -> None:
        """Take a watermark record of partition ``m.partition()``; one of another layout is
        logged and skipped (the next one serves)."""
        try:
            self._marks.setdefault(m.partition(), Watermarks()).take(m.value() or b"")
        except (ValueError, struct.error, UnicodeDecodeError) as exc:
            log.error("findings topic %s[%d]@%d: not a watermark record (%s); skipped", m.topic(),
                      m.partition(), m.offset(), exc)

    def _try(self, q: int, order: bytes, w: _Waiting, out: list[Record], stats: DecideWritten) -> str:
        """Decide one document if it can be (its records appended to ``out``): "decided",
        "incomplete" (its record or a finding has not come), or "blocked" (a candidate
        it accepted has no cluster yet)."""
        if not w.complete:
            return "incomplete"
        doc = w.record
        assert doc is not None
        key, value, carried, topic = doc.key, doc.value, doc.carried, doc.topic
        seq = order_seq(order)
        error = doc.error or w.error
        if error:
            kind, _, reason = error.partition(": ")
            _, partition, offset = ORDER.unpack(order)
            outcome = Outcome.of_error(kind, reason, topic, partition, offset)
            if doc.value_bytes is not None:  # too large for the findings topic: sent without its value
                outcome = Outcome(outcome.target, outcome.headers + [(HEADER_VALUE_BYTES, str(doc.value_bytes).encode())],
                                  outcome.error_kind, "no_value")
        else:
            names: dict[int, str] = {seq: doc.doc_id}
            findings = []
            for checked in w.findings.values():
                if not checked:  # this shard met no one (most): nothing for ``decide``
                    continue
                items = []
                for ts, p, o, cid, jac, con, sim in checked:
                    c = fields_seq(ts, p, o)
                    if c >= seq:  # a later document (a shard of another rule): never waited for
                        continue
                    names[c] = cid
                    items.append(Checked(c, jac, con, sim))
                findings.append(Finding(seq, tuple(items)))
            if waiting_for(findings, self.clusters, self.threshold):
                return "blocked"
            held_from = self._held_from(seq)
            verdict, cluster, merged = decide(seq, findings, self.clusters, self.threshold,
                                              lambda s: names.get(s) or self.clusters.name(s), self.policy,
                                              held_from)
            cluster_id = names.get(cluster) or self.clusters.name(cluster)
            self.clusters.take(seq, cluster, cluster_id, merged)
            outcome = Outcome.of_verdict(verdict)
            # merged (components): the roots of the clusters joined to this one
            self._decided.append((order, seq_order(cluster), cluster_id, [seq_order(r) for r in merged]))
        topics, limits = self._targets(topic)
        # a record too large for its topic goes to the dead-letter topic, with less of the
        # message if need be (as in ``neardup run``: ``neardup.kafka.messages.fit``)
        _, partition, offset = ORDER.unpack(order)
        outcome = fit(outcome, key, value, carried, limits, (topic, partition, offset))
        content = outcome.content
        if outcome.target == "unique":
            stats.unique += 1
        elif outcome.target == "duplicate":
            stats.duplicate += 1
        else:
            stats.dead_letter += 1
        out.append((topics[outcome.target], None, key if content != "headers_only" else None,
                    value if content == "whole" else None,
                    carried + outcome.headers if content != "headers_only" else outcome.headers))
        return "decided"

    def _held_from(self, seq: int) -> int | None:
        """With a window, the earliest time (ms) held for document ``seq``: its own time
        (taken as now beyond now plus the future tolerance) minus the window, as its
        shards' floor when they process it in order; also moves ``_latest``."""
        if self.retention_ms is None:
            return None
        t, _ = window_time(seq, self._future_s)
        self._latest = max(self._latest, t)
        return t - self.retention_ms

    def _expire(self) -> None:
        """Drop the decisions stamped more than two windows before the latest document
        decided here, each time that point has moved by an eighth of the window: one window
        for the shards' (a shard reports only members at or above its floor, the time of
        the document it processes minus the window), one more for the documents still to
        decide that are stamped before the latest (another decide partition behind this
        one, a partition assigned here later)."""
        if self.retention_ms is None or self._latest < -(1 << 61):
            return
        point = self._latest - 2 * self.retention_ms
        if point - self.clusters.expired_below() >= max(1, self.retention_ms // 8):
            self.clusters.expire_before(point)

    def _targets(self, topic: str) -> tuple[dict[str, str], Limits]:
        """The output topics of input topic ``topic`` by target (created first if need
        be, ``_create_outputs``) and their largest records, read once per batch."""
        got = self._batch_targets.get(topic)
        if got is None:
            self._create_outputs(topic)
            topics = {"unique": f"{topic}.unique", "duplicate": f"{topic}.duplicates", "dlq": f"{topic}.dlq"}
            got = self._batch_targets[topic] = (topics, {t: (n, self._limits.get(n)) for t, n in topics.items()})
        return got

    def _create_outputs(self, topic: str) -> None:
        """Create the output topics of an input topic before the first record goes there
        (a record produced to a topic being created was once seen lost, see
        ``neardup.run``), with ``--topic-partitions``, ``--topic-replication-factor``
        and a ``max.message.bytes`` that takes any record of ``topic`` (``sized_outputs``).

        Raises:
            TopicCreationError: the broker refused a creation for what was asked.
            KafkaException: the broker could not be asked.
        """
        if topic in self._outputs:
            return
        admin = AdminClient(admin_config(self.settings))
        try:
            names = [f"{topic}.{suffix}" for suffix in ("unique", "duplicates", "dlq")]
            existing = admin.list_topics(timeout=10).topics
            s = self.settings
            config = sized_outputs(self._limits, [topic], names, existing)
            create_missing(admin, [new_topic(n, s.topic_partitions, s.topic_replication_factor, config)
                                   for n in names if n not in existing])
        finally:
            discard(admin)
        self._outputs.add(topic)

    def write(self, work: tuple[list[Record], DecideWritten], producer: Producer) -> DecideWritten:
        """Produce the batch's outputs, decisions and changelog records into the open
        transaction.

        Raises:
            KafkaException: a produce error (the transaction is aborted and retried).
        """
        records, stats = work
        produce_all(producer, records)
        return stats


class DecideStage(StageRuntime):
    """The decide stage: ``DecideProcessor`` on the stage runtime, consuming the findings
    topic.

    Args:
        settings: as ``StageRuntime``'s (its ``input_topics`` are replaced by the findings
            topic); ``group_id`` is the stage's consumer group.
        topology: the sharded topics.
        instance: this process's name among the stage's instances.
        state_dir, retention_ms: see ``DecideProcessor``.
        **callbacks: ``on_batch``, ``on_assignment``, ``on_abort``, ``on_broker``.
    """

    producer_defaults = STAGE_PRODUCER

    def __init__(self, settings: Settings, topology: Topology, instance: str = "0", state_dir: Path | None = None,
                 retention_ms: int | None = None, **callbacks: object) -> None:
        # an internal topic is read from its start by a new group (whatever the input's
        # ``from_beginning``): a process that joins after records were written takes them
        settings = settings.model_copy(update={
            "transactional_id": f"neardup-{settings.group_id}-{instance}", "input_topics": [topology.findings],
            "from_beginning": True})
        super().__init__(settings, DecideProcessor(settings, topology, state_dir, retention_ms), **callbacks)
