"""Exactly-once streaming deduplication: the ``neardup run`` stage, a ``Processor`` on the
transactional stage runtime (``neardup.kafka.stage``, whose docstring gives the steps of a
batch and the crash table). This module says what those steps do here.

- Reading (step 1): a message whose offset lies below the partition's input position
  stored in RocksDB was processed before a crash, and its stored outcome (target topic
  and added headers) is taken as it is (a *replay*). The others are decoded; a bad one
  gets a dead-letter outcome with the reason, the good ones go through the detector
  together (step 2).
- Producing (step 3): every message is produced to its target topic (unique, duplicate
  or dead-letter) with its key, value and headers (its own ``neardup-*`` headers renamed
  ``neardup-input-*``), plus neardup's headers. For a new message the record is fitted
  here, before step 4 stores its outcome, so that a replay produces the same record: one
  larger than its topic's ``max.message.bytes`` (read with the admin API,
  ``TopicLimits``) goes to the dead-letter topic instead, and a dead letter larger than
  that topic's limit goes without the value (and, if still too large, without key and
  headers), its reason saying so and ``neardup-value-bytes`` the value's size
  (``neardup.kafka.messages.fit``). With the changelog on (``neardup.kafka.changelog``), the
  state changes go into the same transaction, after those a crash or an aborted
  transaction left unconfirmed.
- State commit (step 4), one RocksDB write: the detector's state changes, each
  partition's new input position (last new offset + 1), the outcome of every new
  message, and the deletion of the outcomes of the previous batch (committed to Kafka in
  its step 5, so never needed again).

A replay's messages are never seen by the detector, so no document is ever a duplicate of
itself, and the verdicts equal those of an uninterrupted run when the input order is the
same, i.e. per partition; with several partitions the interleaving (and so which copy is
the canonical) follows arrival order.

These repairs need the state the group's offsets were committed with. When partitions
are assigned, and before any of their messages is read, ``neardup.kafka.state_check``
compares the state with the broker: a partition the group has committed offsets for but
the state has never seen (state directory deleted or replaced, and no changelog to
restore it from), a state behind the group's offsets, or a topic deleted and created
again (another topic id, or a stored position beyond the partition's end) stops ``run``
with ``StateMismatchError``, unless ``--reset-state`` accepts it (the partition's position
becomes the group's committed offset).

A record that the producer or the broker refuses for a reason of its own
(``PER_MESSAGE_ERRORS``: too large after all, e.g. a topic's limit lowered since it was
read; invalid for the topic) never fails its batch twice: refused by ``produce`` (before
step 4), the message falls back to its next stage at once (verdict topic, dead letter,
dead letter without value, neardup's headers alone) and that outcome is stored; refused
in a delivery report (any time up to step 5), the message is marked for its next stage,
the producer's queue is purged so that the transaction fails at once, and the retry
produces the marked message at that stage (storing it), and the others as before.

Pipeline (``pipeline``, on by default; ``--no-pipeline`` turns it off). Decoding the
messages (UTF-8, JSON, HTML: ``neardup.kafka.messages.DecodeMessages``) and normalising,
shingling, MinHashing and banding their texts (``Preparer``) need no state, so a worker
process does them for a batch read ahead (``neardup.kafka.stage``) while this process runs
steps 2-5 of the batch before it: the two share the machine's cores. A batch that is not
full is prepared in this process, so a consumer that keeps up waits for no one; so is
every batch until the worker has started (its imports and compiled code take about a
second). A batch read ahead has its replays marked against the positions before the
previous batch's commit, which are the same for it (positions only grow past that
batch's own offsets); ``compute`` checks it anyway. The verdicts do not change: the
decoding and the preparation are pure functions of the messages, and the state work stays in order in
this process. The worker holds one batch at a time and is linked by a pipe, so its death
(even mid-result) is seen at once: batches are prepared in this process from then on.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer, TopicCollection, TopicPartition
from confluent_kafka.admin import AdminClient
from tenacity import Retrying, retry_if_exception, stop_never, wait_exponential

from neardup.config import Settings
from neardup.core.types import Verdict
from neardup.detector import Detector, BatchResult, PreparedBatch, VerdictColumns, warm_up
from neardup.kafka import state_check
from neardup.kafka.changelog import ChangelogWriter, RestoreStats
from neardup.kafka.bounded import discard
from neardup.kafka.clients import admin_config
from neardup.kafka.limits import PRODUCER_BATCH_BYTES, PRODUCER_MAX_BYTES, TopicLimits
from neardup.kafka.messages import (
    LAST_STAGE,
    OFFSET_BE,
    Decoded,
    DecodeMessages,
    Limits,
    RawMessage,
    Outcome,
    carried_headers,
    fit,
    source_name,
    verdict_key,
    verdict_key_prefix,
)
from neardup.kafka.progress import Progress
from neardup.kafka.rdkafka_log import rdkafka_logger
from neardup.kafka.stage import TP, StageRuntime, fatal
from neardup.kafka.topics import create_missing, new_topic, sized_outputs
from neardup.pipeline import PrepareWorker, WorkerDied
from neardup.state.base import StateStore

log = logging.getLogger(__name__)

#: Produce errors of one record that no retry can cure (too large for the topic, refused
#: by it, e.g. no key for a compacted topic): the message falls back to its next stage
#: (``neardup.kafka.messages.fit``) instead of failing its batch again and again.
PER_MESSAGE_ERRORS = frozenset({
    KafkaError.MSG_SIZE_TOO_LARGE, KafkaError.RECORD_LIST_TOO_LARGE, KafkaError.INVALID_MSG_SIZE,
    KafkaError.INVALID_MSG, KafkaError.INVALID_RECORD, KafkaError.INVALID_TIMESTAMP,
})


@dataclass
class BatchStats:
    """What one batch did (for logs and metrics). ``columns``: the verdicts of the
    documents detected in it, of which those at ``dead_columns`` (indices) became dead
    letters (their records did not fit); ``verdicts`` gives the others as ``Verdict`` objects."""

    messages: int = 0
    replayed: int = 0
    unique: int = 0
    duplicate: int = 0
    dead_letter: dict[str, int] = field(default_factory=dict)
    value_left_out: int = 0  # dead letters without the message's value (a topic too small)
    future_times: int = 0  # timestamps beyond now + --future-tolerance, taken as now
    columns: VerdictColumns | None = None
    dead_columns: list[int] = field(default_factory=list)
    timestamps_ms: list[int] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def verdicts(self) -> list[Verdict]:
        """The verdicts of the documents that went to a verdict topic, in input order."""
        if self.columns is None:
            return []
        verdicts = self.columns.verdicts()
        if self.dead_columns:
            dead = set(self.dead_columns)
            verdicts = [v for i, v in enumerate(verdicts) if i not in dead]
        return verdicts


@dataclass(slots=True)
class _Partition:
    """What ``write`` needs of one input partition of a batch: its verdict key prefix,
    state source name, output topics and their largest records (by target); the next
    offset to commit and the new input position (last offset of a message processed
    anew + 1, None if none)."""

    key_prefix: bytes
    source: str
    topics: dict[str, str]
    limits: Limits
    next_offset: int = 0
    position: int | None = None


@dataclass(slots=True)
class _Item:
    message: Message
    outcome: Outcome | None = None
    replay: bool = False
    column: int = -1  # of a message detected in this batch: its verdict's index in the columns
    header_bytes: int = 0  # and what its outcome's headers add to its record (``Outcome.of_columns``)
    stored: bytes = b""  # and its outcome's ``to_bytes()``


@dataclass
class _Batch:
    """Consumed messages, read: replays marked (by the positions at reading time); the
    others (``new``) are decoded when the batch is computed, or in the worker
    (``in_worker``: sent there; ``decoded`` and ``prepared``: its result, once taken).
    Once decoded, a message that is no document has a dead-letter outcome and the
    documents are in ``fresh``, with their ids, times and (decoded here) texts."""

    messages: list[Message]
    items: list[_Item]
    new: list[_Item]
    full: bool
    in_worker: bool = False
    decoded: list[Decoded] | None = None
    prepared: PreparedBatch | None = None
    fresh: list[_Item] = field(default_factory=list)
    ids: list[str] = field(default_factory=list)
    times: list[float | None] = field(default_factory=list)
    texts: list[str] | None = None


@dataclass
class _Work:
    """A batch computed (step 2): outcomes set on its items, the detector's result."""

    batch: _Batch
    stats: BatchStats
    result: BatchResult


@dataclass
class _Written:
    """A batch produced and stored (steps 3, 4): the offsets to commit, the verdict keys
    of all its messages, what it did."""

    offsets: list[TopicPartition]
    keys: list[bytes]
    stats: BatchStats
    prepared: bool


class DedupProcessor:
    """The deduplication stage's ``Processor`` (``neardup.kafka.stage``).

    Args:
        settings: record, topic and batch settings.
        detector: the engine, over a persistent state store.
        on_restore: with the changelog on, called when a restore begins (True) and ends
            (its ``RestoreStats``).
    """

    def __init__(self, settings: Settings, detector: Detector,
                 on_restore: Callable[[bool | RestoreStats], None] | None = None) -> None:
        self.settings = settings
        self.detector = detector
        self.store: StateStore = detector.store
        self.changelog: ChangelogWriter | None = None
        if settings.changelog == "on":
            self.changelog = getattr(self.store, "log", None) or ChangelogWriter(settings)
            if on_restore is not None:
                self.changelog.on_restore = on_restore
            self.store.log = self.changelog  # opened without it: the start writes the whole state
        self.reads_ahead = settings.pipeline
        self.orders_partitions = True  # several input partitions are read in order-key order
        self._positions: dict[TP, int] = {}
        self._committed_keys: list[bytes] = []
        self._delivery_errors: list[str] = []
        # Messages whose record failed to be produced (verdict key -> the stage to
        # fall back to, and why): their batch fails, and its retry produces them so.
        self._failed: dict[bytes, tuple[int, str]] = {}
        self._purged = False  # the open transaction's queue was purged (it must abort)
        self._refused: set[bytes] = set()  # verdict keys whose last-stage refusal is logged
        self._refusal: str | None = None  # the last one, until a batch commits
        common = {"bootstrap.servers": settings.bootstrap_servers, "logger": rdkafka_logger(), **settings.kafka}
        self._limits = TopicLimits(common, int(settings.kafka.get("batch.size", PRODUCER_BATCH_BYTES)))
        self._admin: AdminClient | None = None  # for topic ids
        self._producer: Producer | None = None  # of the open transaction
        self.worker: PrepareWorker | None = None
        self.batches_prepared_ahead = 0
        text_fields = tuple(settings.text_field) if settings.text_field else None
        self.decoder = DecodeMessages(text_fields, settings.id_field, settings.max_message_bytes, settings.text_format)

    def open(self) -> None:
        """Start the worker, and load the compiled kernels while the clients connect."""
        if self.settings.pipeline:
            self.worker = PrepareWorker(self.detector.settings, self.decoder)
        threading.Thread(target=warm_up, args=(self.detector.settings,), name="neardup-warm-up",
                         daemon=True).start()

    # --- topics ---------------------------------------------------------------------
    def target_topic(self, input_topic: str, target: str) -> str:
        s = self.settings
        explicit = {"unique": s.unique_topic, "duplicate": s.duplicate_topic, "dlq": s.dlq_topic}
        suffix = {"unique": "unique", "duplicate": "duplicates", "dlq": "dlq"}
        return explicit[target] or f"{input_topic}.{suffix[target]}"

    def is_output(self, topic: str) -> bool:
        """True for a topic this consumer writes (a regex subscription may match it)."""
        s = self.settings
        if topic in {s.unique_topic, s.duplicate_topic, s.dlq_topic}:
            return True
        return topic.endswith((".unique", ".duplicates", ".dlq"))

    # --- lifecycle ------------------------------------------------------------------
    def start(self, producer: Producer) -> None:
        """With the changelog on: restore the state from it, or write to it what it lacks
        (``neardup.kafka.changelog``)."""
        if self.changelog is not None:
            self.changelog.start(self.store, producer)
            self._positions.clear()

    def close(self) -> None:
        """Stop the worker and the admin client."""
        if self.worker is not None:
            self.worker.close()
            self.worker = None
        if self._admin is not None:
            admin, self._admin = self._admin, None
            discard(admin)

    def revoked(self, partitions: set[TP]) -> None:
        for tp in partitions:
            self._positions.pop(tp, None)

    def due(self) -> bool:
        return False

    def cause(self) -> str | None:
        """Why batches fail, when this processor knows better than the error of the
        transaction (a record the dead-letter topic refuses at its last stage)."""
        return self._refusal

    def aborted(self) -> None:
        """Nothing to undo: ``compute`` changes nothing (the state is written in step 4,
        and a batch consumed again after it is a replay)."""

    def idle(self) -> None:
        try:
            self._worker_ready()  # idle: take the worker's start-up notice
        except WorkerDied as exc:
            self._worker_died(exc)

    # --- the state check ----------------------------------------------------------------
    def check(self, consumer: Consumer, partitions: list[TP]) -> None:
        """Check the state against newly assigned partitions (``state_check``).

        Raises:
            StateMismatchError: it does not match and ``--reset-state`` was not given.
        """
        topics = sorted({t for t, _ in partitions})
        committed = self._committed(consumer, partitions)
        ids = self._topic_ids(topics)
        stored = dict(zip(topics, self.store.get_verdicts([state_check.topic_id_key(t) for t in topics])))
        facts = [
            state_check.PartitionFacts(
                topic=t, partition=n, position=self.store.get_position(source_name(t, n)),
                committed=committed.get((t, n)), high=_high_watermark(consumer, t, n),
                stored_topic_id=stored[t].decode("ascii") if stored[t] else None, topic_id=ids.get(t),
            )
            for t, n in partitions
        ]
        self._positions.update(state_check.check(self.store, facts, self.settings.reset_state))
        # a new list: the one held may be the last written batch's own keys
        self._committed_keys = [*self._committed_keys, *self._stale_outcomes(committed)]
        log.info("state checked against %s", ", ".join(p.name for p in facts))
        # a regex subscription matches the outputs too: theirs are never created (each
        # would be matched in turn, <input>.unique.unique and so on, until the broker refuses)
        self._create_outputs([t for t in topics if not self.is_output(t)])

    def _stale_outcomes(self, committed: dict[TP, int]) -> list[bytes]:
        """The stored outcomes of messages below their partition's committed offset: kept
        for a replay that can no longer come (those of the last batch before a stop or a
        kill, whose deletion came with the next batch), deleted by the next batch."""
        stale: list[bytes] = []
        for (topic, partition), offset in committed.items():
            prefix = verdict_key_prefix(topic, partition)
            stale += self.store.verdict_keys(prefix, prefix + OFFSET_BE.pack(offset))
        if stale:
            log.info("deleting the stored outcomes of %d messages committed before", len(stale))
        return stale

    def _create_outputs(self, input_topics: list[str]) -> None:
        """Create the output topics of ``input_topics`` that are missing
        (``--topic-partitions``, ``--topic-replication-factor``, a ``max.message.bytes``
        that takes any record of ``input_topics``: ``sized_outputs``), before anything is
        produced to them: a transactional record produced to a topic the broker is still
        creating was once seen lost although its transaction committed (the first record
        of ``<input>.unique``; librdkafka forgets a partition's message sequence while its
        topic is reported missing).

        Raises:
            TopicCreationError: the broker refused a creation for what was asked.
        """
        if self._admin is None:
            self._admin = AdminClient(admin_config(self.settings))
        names = sorted({self.target_topic(t, target) for t in input_topics for target in ("unique", "duplicate", "dlq")})
        try:
            existing = self._admin.list_topics(timeout=10).topics
        except KafkaException as exc:
            log.warning("output topics not checked (%s); the broker may create them at the first record", exc)
            return
        s = self.settings
        try:
            config = sized_outputs(self._limits, input_topics, names, existing)
        except KafkaException as exc:
            log.warning("max.message.bytes of %s not read (%s); outputs created with the broker's",
                        ", ".join(input_topics), exc.args[0].str())
            config = {}
        missing = [new_topic(name, s.topic_partitions, s.topic_replication_factor, config)
                   for name in names if name not in existing]
        try:
            create_missing(self._admin, missing)
        except KafkaException as exc:
            log.warning("output topics %s not created (%s); the broker may create them at the first record",
                        ", ".join(t.topic for t in missing), exc.args[0].str())

    def _committed(self, consumer: Consumer, tps: list[TP]) -> dict[TP, int]:
        """The consumer group's committed offsets (none: left out); asked again while
        the coordinator does not answer."""
        for attempt in Retrying(
            retry=retry_if_exception(lambda e: isinstance(e, KafkaException) and not fatal(e)),
            wait=wait_exponential(multiplier=0.5, max=10),
            stop=stop_never,
            before_sleep=lambda rs: log.warning("committed offsets: %s; retrying", rs.outcome.exception()),
        ):
            with attempt:
                got = consumer.committed([TopicPartition(t, n) for t, n in tps], timeout=10)
        return {(p.topic, p.partition): p.offset for p in got if p.offset >= 0}

    def _topic_ids(self, topics: list[str]) -> dict[str, str]:
        """The broker's topic ids (base64 text); those it does not give are left out."""
        if self._admin is None:
            self._admin = AdminClient(admin_config(self.settings))
        out = {}
        for topic, future in self._admin.describe_topics(TopicCollection(topics), request_timeout=10).items():
            try:
                out[topic] = str(future.result().topic_id)
            except KafkaException as exc:
                log.warning("topic id of %s not known (%s); not checked", topic, exc)
        return out

    # --- reading (step 1) -------------------------------------------------------------
    def _position(self, topic: str, partition: int) -> int:
        tp = (topic, partition)
        if tp not in self._positions:
            self._positions[tp] = self.store.get_position(source_name(topic, partition)) or 0
        return self._positions[tp]

    def _is_replay(self, m: Message) -> bool:
        return m.offset() < self._position(m.topic(), m.partition())

    def read(self, messages: list[Message], full: bool) -> _Batch:
        """Mark the replays; the other messages are decoded later (``_decode``), in the
        worker for a batch read ahead (``ahead``)."""
        items = [_Item(m, replay=self._is_replay(m)) for m in messages]
        return _Batch(messages, items, [it for it in items if not it.replay], full)

    def _decode(self, batch: _Batch) -> None:
        """Decode the batch's new messages here, unless the worker did
        (``batch.decoded``): a message that is no document gets its dead-letter
        outcome, the documents go to ``fresh``."""
        decoded = batch.decoded
        texts: list[str] | None = None
        batch.fresh, batch.ids, batch.times = [], [], []
        if decoded is None:
            decoded, texts = self.decoder.decode(_raw(batch.new))
        for it, (name, reason) in zip(batch.new, decoded, strict=True):
            m = it.message
            if reason is not None:
                it.outcome = Outcome.of_error(name, reason, m.topic(), m.partition(), m.offset())
                continue
            ts_type, ts = m.timestamp()  # the retention window's clock; none: arrival
            batch.fresh.append(it)
            batch.ids.append(name)
            batch.times.append(ts / 1000 if ts_type != 0 else None)
        batch.texts = texts

    def ahead(self, batch: _Batch) -> None:
        """Start decoding and preparing a batch read ahead in the worker, once it has
        started."""
        if self.worker is None:
            return
        try:
            if self._worker_ready():  # until it has started, batches are prepared here
                self.worker.submit(_raw(batch.new))
                batch.in_worker = True
        except WorkerDied as exc:
            self._worker_died(exc)

    def take(self, batch: _Batch) -> None:
        """Take the batch's decoding and preparation from the worker, if it went there
        (if the worker failed on it, the batch is decoded and prepared here: an error
        of the input is raised there)."""
        if not batch.in_worker:
            return
        batch.in_worker = False
        if self.worker is None:
            return
        try:
            batch.decoded, batch.prepared = self.worker.outcome()
        except WorkerDied as exc:
            self._worker_died(exc)
        except Exception as exc:  # noqa: BLE001 - the same input decoded here raises it again
            log.debug("the preparing worker failed on a batch (%s); decoding it here", exc)

    def _worker_ready(self) -> bool:
        """Whether the worker has started; False without a worker.

        Raises:
            WorkerDied: the worker process is gone.
        """
        return self.worker is not None and self.worker.ready()

    def _worker_died(self, exc: WorkerDied) -> None:
        assert self.worker is not None
        log.warning("the preparing worker process died (%s); preparing in this process from now on", exc)
        self.worker.close()
        self.worker = None

    # --- computing (step 2) -----------------------------------------------------------
    def compute(self, batch: _Batch) -> _Work:
        """The replays' stored outcomes and the detector's verdicts (nothing written)."""
        if any(it.replay != self._is_replay(it.message) for it in batch.items):
            # Cannot happen: positions only grow past a batch's own offsets, so those of
            # the batches after it keep their side. Checked all the same, it is cheap.
            batch = self.read(batch.messages, batch.full)  # prepared here
        stats = BatchStats(messages=len(batch.messages))
        replays = [it for it in batch.items if it.replay]
        stored = self.store.get_verdicts(
            [verdict_key(it.message.topic(), it.message.partition(), it.message.offset()) for it in replays]
        )
        for it, raw in zip(replays, stored):
            if raw is None:  # produced and committed in an earlier transaction
                log.warning("skipping %s[%d]@%d: already delivered", it.message.topic(), it.message.partition(), it.message.offset())
            else:
                it.outcome = Outcome.from_bytes(raw)
        stats.replayed = len(replays)

        self._decode(batch)
        prepared = batch.prepared
        if prepared is None:
            assert batch.texts is not None  # decoded here
            prepared = self.detector.prepare.texts(batch.texts)
        result = self.detector.detect_prepared(batch.ids, batch.times, prepared)
        stats.future_times = result.future_times
        stats.columns = result.columns
        outcomes, sizes, records = Outcome.of_columns(result.columns)
        j = 0
        for it, reason in zip(batch.fresh, result.reasons, strict=True):
            if reason is not None:
                m = it.message
                it.outcome = Outcome.of_error("empty_text", reason, m.topic(), m.partition(), m.offset())
            else:
                it.outcome, it.header_bytes, it.stored, it.column = outcomes[j], sizes[j], records[j], j
                j += 1
        return _Work(batch, stats, result)

    # --- producing and storing (steps 3 and 4) ----------------------------------------
    def write(self, work: _Work, producer: Producer) -> _Written:
        """Produce every message's record into the open transaction, then commit the
        state (RocksDB).

        Raises:
            KafkaException: a produce error other than a per-message one.
        """
        self._producer = producer
        self._delivery_errors.clear()
        self._purged = False
        batch, stats, update = work.batch, work.stats, work.result.update
        # Per message: the hot loop. What depends on the partition only is looked up once.
        partitions: dict[TP, _Partition] = {}
        keys: list[bytes] = []  # verdict keys of all the batch's messages (items are 1:1)
        stored = update.verdicts
        timestamps = stats.timestamps_ms
        dead_letter = stats.dead_letter
        unique = duplicate = 0
        pack_offset = OFFSET_BE.pack
        failed = self._failed
        for it in batch.items:
            m = it.message
            offset = m.offset()
            tp = (m.topic(), m.partition())
            part = partitions.get(tp)
            if part is None:
                part = partitions[tp] = self._partition(*tp)
            key = part.key_prefix + pack_offset(offset)
            keys.append(key)
            if offset >= part.next_offset:
                part.next_offset = offset + 1
            outcome = it.outcome
            if outcome is None:
                continue
            carried = carried_headers(m.headers())
            if not it.replay or key in failed:
                # Where the record goes is decided here, before the state commit that
                # stores it: a replay produces the same record.
                if not it.replay:
                    part.position = offset + 1
                verdict = it.column >= 0
                fitted = fit(outcome, m.key(), m.value(), carried, part.limits, (*tp, offset),
                             *failed.get(key, (0, None)), it.header_bytes if verdict else None)
                # a verdict left as it is has its stored record made with it (``Outcome.of_columns``)
                stored[key] = it.stored if verdict and fitted is outcome else fitted.to_bytes()
                outcome = fitted
            outcome = self._send(part.topics, part.limits, key, outcome, m, carried, stored)
            target = outcome.target
            if target == "unique":
                unique += 1
            elif target == "duplicate":
                duplicate += 1
            else:
                kind = outcome.error_kind or "unknown"
                dead_letter[kind] = dead_letter.get(kind, 0) + 1
                if outcome.content != "whole":
                    stats.value_left_out += 1
                if it.column >= 0:  # its record did not fit: a dead letter, not a verdict
                    stats.dead_columns.append(it.column)
            ts_type, ts = m.timestamp()
            if ts_type != 0:
                timestamps.append(ts)
        stats.unique, stats.duplicate = unique, duplicate
        for part in partitions.values():
            if part.position is not None:
                update.positions[part.source] = part.position
        update.verdict_deletes = self._committed_keys
        update.local_verdicts = True  # only a replay of this store reads them (``StateUpdate``)
        if self.changelog is None:
            self.store.commit(update)
        else:
            update.meta.update(self.changelog.begin(producer, self.store))
            try:
                self.store.commit(update)  # its records go to the changelog first
            finally:
                self.changelog.end_transaction()
        for source, position in update.positions.items():
            _, topic, partition = source.rsplit(":", 2)
            self._positions[(topic, int(partition))] = position
        offsets = [TopicPartition(t, p, part.next_offset) for (t, p), part in partitions.items()]
        return _Written(offsets, keys, stats, batch.prepared is not None)

    def committed(self, written: _Written, seconds: float) -> BatchStats:
        """After the batch's transaction committed: its outcomes are deleted with the
        next batch's commit (never needed again)."""
        if self._delivery_errors:
            log.error("deliveries failed inside a committed transaction: %s", self._delivery_errors[:3])
        self._committed_keys = written.keys
        if self.changelog is not None:
            self.changelog.confirm(self.store)
        if self._failed:
            for key in written.keys:
                self._failed.pop(key, None)
        self._refused.clear()
        self._refusal = None
        self.batches_prepared_ahead += written.prepared
        written.stats.seconds = seconds
        return written.stats

    def _partition(self, topic: str, partition: int) -> _Partition:
        """A new ``_Partition`` of an input partition (for one batch).

        Raises:
            KafkaException: the output topics' ``max.message.bytes`` could not be read.
        """
        topics = {target: self.target_topic(topic, target) for target in ("unique", "duplicate", "dlq")}
        producer_max = int(self.settings.kafka.get("message.max.bytes", PRODUCER_MAX_BYTES))
        return _Partition(
            key_prefix=verdict_key_prefix(topic, partition),
            source=source_name(topic, partition),
            topics=topics,
            limits={target: (name, min(self._limits.get(name), producer_max)) for target, name in topics.items()},
        )

    def _send(self, topics: dict[str, str], limits: Limits, key: bytes, outcome: Outcome,
              message: Message, carried: list[tuple[str, bytes]], stored: dict[bytes, bytes]) -> Outcome:
        """Produce the record of ``message``'s ``outcome`` (``key``: its verdict key)
        and return the outcome; if ``produce`` itself refuses the record for a reason
        of its own (``PER_MESSAGE_ERRORS``), the outcome's next stage that fits is
        stored in ``stored`` instead, and produced.

        Raises:
            KafkaException: another error of ``produce``, or one of a record at the
                last stage.
        """
        assert self._producer is not None
        produce = self._producer.produce
        while True:
            content = outcome.content
            headers = carried + outcome.headers if carried and content != "headers_only" else outcome.headers
            topic = topics[outcome.target]
            value = message.value() if content == "whole" else None
            msg_key = message.key() if content != "headers_only" else None
            delivered = partial(self._delivered, key, outcome.stage)
            try:
                while True:
                    try:
                        produce(topic, value=value, key=msg_key, headers=headers, on_delivery=delivered)
                        return outcome
                    except BufferError:  # the queue is full: serve delivery reports
                        self._producer.poll(0.05)
            except KafkaException as exc:
                err = exc.args[0]
                if err.code() not in PER_MESSAGE_ERRORS or outcome.stage >= LAST_STAGE:
                    raise
                source = (message.topic(), message.partition(), message.offset())
                outcome = fit(outcome, message.key(), message.value(), carried, limits, source,
                              outcome.stage + 1, f"not produced to {topic}: {err.str()}")
                stored[key] = outcome.to_bytes()

    def _delivered(self, key: bytes, stage: int, err: KafkaError | None, msg: Message) -> None:
        """Delivery report of the record of stage ``stage`` of the message of verdict
        key ``key``. A per-message error marks the message for its next stage and
        purges the producer's queue: the transaction fails at once (it would wait for
        the records queued behind the failed one until its timeout) and is retried."""
        if err is None:
            return
        self._delivery_errors.append(f"{msg.topic()}: {err}")
        if err.code() not in PER_MESSAGE_ERRORS:
            return
        if stage < LAST_STAGE:
            self._failed[key] = (stage + 1, f"not produced to {msg.topic()}: {err.str()}")
        else:
            self._refusal = f"a dead letter of neardup's headers alone was refused by {msg.topic()}: {err.str()}"
            if key not in self._refused:  # once: the batch is retried until it commits
                self._refused.add(key)
                log.error("%s", self._refusal)
        self._limits.forget()  # a topic's max.message.bytes may have changed
        if not self._purged and self._producer is not None:
            self._purged = True
            self._producer.purge(in_queue=True, in_flight=True, blocking=False)


def _raw(items: list[_Item]) -> list[RawMessage]:
    """The messages of ``items`` as ``DecodeMessages`` takes them."""
    return [(m.value(), m.key(), m.topic(), m.partition(), m.offset()) for m in (it.message for it in items)]


def _high_watermark(consumer: Consumer, topic: str, partition: int) -> int | None:
    try:
        return consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout=10)[1]
    except KafkaException as exc:
        log.warning("end offset of %s[%d] not known (%s); not checked", topic, partition, exc)
        return None


class KafkaDeduplicator(StageRuntime):
    """The ``neardup run`` consumer: the deduplication processor on the stage runtime.

    Args:
        settings: Kafka, record and batch settings (``bootstrap_servers`` and
            ``input_topics`` required; a topic starting with ``^`` is a regex).
        detector: the engine, over a persistent state store.
        on_batch: called after every committed batch with its ``BatchStats``.
        on_assignment, on_abort, on_broker: as ``StageRuntime``'s.
        on_restore: as ``DedupProcessor``'s.
        progress: as ``StageRuntime``'s.

    Raises:
        ValueError: no bootstrap servers or no input topic.
    """

    def __init__(
        self,
        settings: Settings,
        detector: Detector,
        on_batch: Callable[[BatchStats], None] | None = None,
        on_assignment: Callable[[list[TopicPartition]], None] | None = None,
        on_abort: Callable[[KafkaException], None] | None = None,
        on_broker: Callable[[], None] | None = None,
        on_restore: Callable[[bool | RestoreStats], None] | None = None,
        progress: Progress | None = None,
    ) -> None:
        super().__init__(settings, DedupProcessor(settings, detector, on_restore), on_batch=on_batch,
                         on_assignment=on_assignment, on_abort=on_abort, on_broker=on_broker, progress=progress)
        self.detector = detector

    @property
    def batches_prepared_ahead(self) -> int:
        """Committed batches prepared in the worker process."""
        return self.processor.batches_prepared_ahead

    def _worker_ready(self) -> bool:
        return self.processor._worker_ready()

    def _closing_note(self) -> str:
        return f", {self.batches_prepared_ahead} of them prepared ahead in the worker process"
