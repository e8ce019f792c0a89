"""Exactly-once streaming deduplication: Kafka consumer -> detector -> transactional producer.

Each batch is one Kafka transaction and one RocksDB ``WriteBatch``. The steps, in order:

1. ``consume`` up to ``batch_size`` messages (or what arrives in ``batch_max_ms``) from the
   assigned partitions, reading committed data only (``isolation.level=read_committed``).
2. For each message, in partition order: if its offset lies below the partition's input
   position stored in RocksDB, the message was processed before a crash, and its stored
   outcome (target topic and added headers) is taken as it is (a *replay*). Otherwise it
   is decoded; a bad one gets a dead-letter outcome with the reason, the good ones go
   through the detector together.
3. ``begin_transaction``; every message is produced to its target topic (unique,
   duplicate or dead-letter) with its key, value and headers (its own ``neardup-*``
   headers renamed ``neardup-input-*``), plus neardup's headers. For a new message the
   record is fitted here, before step 4 stores its outcome, so that a replay produces
   the same record: one larger than its topic's ``max.message.bytes`` (read with the
   admin API, ``TopicLimits``) goes to the dead-letter topic instead, and a dead letter
   larger than that topic's limit goes without the value (and, if still too large,
   without key and headers), its reason saying so and ``neardup-value-bytes`` the
   value's size (``neardup.io.messages.fit``).
4. RocksDB commit, atomically: the detector's state changes, each partition's new input
   position (last new offset + 1), the outcome of every new message, and the deletion of
   the outcomes of the previous batch (committed to Kafka in its step 5, so never needed
   again).
5. ``send_offsets_to_transaction`` (next offset per partition, with the consumer group's
   metadata) and ``commit_transaction``, in a thread of their own: while the broker
   answers, this thread consumes, reads and detects the next batch (which sees batch k's
   state: it is in RocksDB since step 4). The next batch's transaction begins only once
   step 5 has succeeded; only then is the batch counted and ``on_batch`` called.

What a crash leaves, and how a restart (same ``transactional.id``, same state directory)
repairs it:

- before step 4 completes: RocksDB is unchanged; the open Kafka transaction is aborted
  when the restarted producer calls ``init_transactions`` (it fences the old one). The
  consumer group resumes at the last committed offsets and the batch is processed anew
  against the same state, so it gets the same verdicts.
- after step 4, before step 5 completes: RocksDB holds the batch, Kafka does not (the
  next batch may have been detected, but nothing of it written). The batch's messages
  are consumed again; their offsets lie below the stored positions, so
  their stored outcomes are produced again, identical, and the detector never sees a
  document twice (no document is ever a duplicate of itself).
- after step 5: both agree; nothing to repair.
- a producer abandoned while the process lives on (a transactional call that has not
  returned after ``CALL_WAIT_S``, ``neardup.io.bounded``; librdkafka's own timeouts do
  not hold after a broker restart): as a crash at the same point. The abandoned producer
  is never called again; a new one with the same ``transactional.id`` fences it and has
  the broker abort its open transaction (a wedged call that returns later cannot commit:
  its epoch is fenced). Abandoned before step 4, the batch is rewound and processed
  anew; in step 5, it is rewound with the next batch and replayed from its stored
  outcomes.

These repairs need the state the group's offsets were committed with. When partitions
are assigned, and before any of their messages is read, ``neardup.io.state_check``
compares the state with the broker: a partition the group has committed offsets for but
the state has never seen (state directory deleted or replaced), a state behind the
group's offsets, or a topic deleted and created again (another topic id, or a stored
position beyond the partition's end) stops ``run`` with ``StateMismatchError``, unless
``--reset-state`` accepts it (the partition's position becomes the group's committed
offset).

A record that the producer or the broker refuses for a reason of its own
(``PER_MESSAGE_ERRORS``: too large after all, e.g. a topic's limit lowered since it was
read; invalid for the topic) never fails its batch twice: refused by ``produce`` (before
step 4), the message falls back to its next stage at once (verdict topic, dead letter,
dead letter without value, neardup's headers alone) and that outcome is stored; refused
in a delivery report (any time up to step 5), the message is marked for its next stage,
the producer's queue is purged so that the transaction fails at once, and the retry
below produces the marked message at that stage (storing it), and the others as before.

An error that is not fatal (broker gone, transaction timed out, abortable error) aborts
the transaction, rewinds the batch's partitions to its first offsets and retries with
exponential backoff; the replay rule of step 2 makes the retry exact. A fatal producer
error (typically: the broker aborted a transaction that outlived
``transaction.timeout.ms`` during an outage and bumped the producer epoch, which the
client reports as fenced) starts a new producer with the same ``transactional.id``,
rewinds and retries the same way; after ``MAX_PRODUCER_RESETS`` such errors without a
committed batch in between (a live second instance with the same id), ``run`` raises.
A commit or abort that still times out after ``TRANSACTION_RETRY_S`` (a producer wedged
by an outage) fails the batch the same way, and the abort then starts a new producer.
Every transactional call (``init_transactions``, ``begin_transaction``,
``send_offsets_to_transaction``, ``commit_transaction``, ``abort_transaction``) is waited
for at most ``CALL_WAIT_S`` and every wait for step 5's thread at most ``STEP5_WAIT_S``;
past that the producer is abandoned (``ProducerWedged``) and replaced, rewound and
retried as for a fatal error, without counting towards ``MAX_PRODUCER_RESETS``.
A step 5 that fails in its thread is seen when the next batch is about to begin its
transaction (or when the consumer is idle): the failed batch's partitions are rewound
with the next batch's, to the failed batch's first offsets, and the next batch is
dropped (it wrote nothing); its messages come back as replays.

Rebalances happen only inside ``consume`` (step 1), and the revoke callback first waits
for a step 5 in progress (at most until ``STEP5_WAIT_S``; a step 5 still running then
counts as wedged, and its producer is replaced, aborting its transaction, before the next
batch), so no transaction is open when partitions go and a revoked
partition never leaves anything half-done. Verdicts equal those of an
uninterrupted run when the input order is the same, i.e. per partition; with several
partitions the interleaving (and so which copy is the canonical) follows arrival order.

Pipeline (``pipeline``, on by default; ``--no-pipeline`` turns it off). Normalising,
shingling, MinHashing and banding a batch (``Preparer``) need no state, so a worker
process does them for batch k + 1 while this process runs steps 2-5 of batch k: the two
share the machine's cores. When batch k is full (a backlog), batch k + 1 is consumed
*ahead*, before batch k's step 2, taking only what the consumer has already fetched (no
wait); its replays are marked and its messages decoded, and its documents go to the
worker. A batch that is not full is prepared in this process as before, so a consumer
that keeps up waits for no one; so is every batch until the worker has started (its
imports and compiled code take about a second). Batch k + 1 is only held in memory until its turn:

- a crash loses it like any message consumed and not committed: the restart consumes it
  again from the committed offsets.
- a failed batch k (abort or new producer) rewinds the partitions of both batches to
  their first offsets, and batch k + 1 is dropped.
- a rebalance can only be served by the read-ahead's ``consume``, while batch k is held:
  batch k's messages of the revoked partitions are dropped (their next owner, maybe this
  consumer again, resumes at the committed offset, which is where they start), the rest
  of batch k is processed, and batch k + 1 holds only messages consumed after the
  rebalance. So, as before, no transaction is ever open across a rebalance, and no
  batch holds a partition this consumer has lost.
- ``stop()`` finishes batch k and drops batch k + 1 (the next consumer resumes at the
  committed offset).

Batch k + 1's replays are marked against the positions before batch k's commit, which
are the same for it (positions only grow past batch k's own offsets); ``_process``
checks it anyway. The verdicts do not change: the preparation is a pure function of the
documents, and the state work stays in order in this process. The worker holds one
batch at a time and is linked by a pipe, so its death (even mid-result) is seen at once:
batches are prepared in this process from then on.

SIGTERM or SIGINT: the batch in progress is finished and committed, a batch read ahead is
dropped, the consumer leaves its group, and ``run`` returns.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer, TopicCollection, TopicPartition
from confluent_kafka.admin import AdminClient
from tenacity import Retrying, retry_if_exception, stop_after_delay, stop_never, wait_exponential

from neardup.config import Settings
from neardup.io.bounded import CALL_TIMEOUT_S, CALL_WAIT_S, ProducerWedged, bounded, discard
from neardup.core.types import Document, Rejected, Verdict
from neardup.detector import Detector, PreparedBatch, warm_up
from neardup.io.limits import PRODUCER_BATCH_BYTES, PRODUCER_MAX_BYTES, TopicLimits
from neardup.io import state_check
from neardup.io.rdkafka_log import rdkafka_logger
from neardup.io.messages import (
    LAST_STAGE,
    OFFSET_BE,
    Limits,
    MessageError,
    Outcome,
    carried_headers,
    fit,
    source_name,
    to_document,
    verdict_key,
    verdict_key_prefix,
)
from neardup.pipeline import PrepareWorker, WorkerDied
from neardup.state.base import StateStore

log = logging.getLogger(__name__)

#: Fatal producer errors survived in a row (no batch committed in between) before
#: ``run`` gives up: a live second instance with the same transactional.id would
#: otherwise fence this one back and forth.
MAX_PRODUCER_RESETS = 3
#: Seconds ``commit_transaction`` or ``abort_transaction`` is retried before the producer
#: is replaced: after a broker outage librdkafka's request to the transaction coordinator
#: can stay queued and time out forever; a new producer of the same transactional.id
#: fences the old one and has the broker abort its transaction. Well below
#: max.poll.interval.ms (300 s).
TRANSACTION_RETRY_S = 60.0
#: Produce errors of one record that no retry can cure (too large for the topic, refused
#: by it, e.g. no key for a compacted topic): the message falls back to its next stage
#: (``neardup.io.messages.fit``) instead of failing its batch again and again.
PER_MESSAGE_ERRORS = frozenset({
    KafkaError.MSG_SIZE_TOO_LARGE, KafkaError.RECORD_LIST_TOO_LARGE, KafkaError.INVALID_MSG_SIZE,
    KafkaError.INVALID_MSG, KafkaError.INVALID_RECORD, KafkaError.INVALID_TIMESTAMP,
})
#: Timeout handed to ``init_transactions``, seconds (retried while the broker is away).
INIT_TIMEOUT_S = 10.0
#: Longest wait for step 5's thread, seconds: its calls are bounded one by one
#: (``neardup.io.bounded``), this is a backstop above their sum.
STEP5_WAIT_S = 2 * CALL_WAIT_S + TRANSACTION_RETRY_S + 10.0
#: Seconds a subscribed consumer may go without any assignment (an empty one counts)
#: while it sees a broker up, before it is replaced: one subscribed during a broker
#: outage was once seen never to be assigned after the broker came back.
ASSIGN_WAIT_S = 60.0
#: Seconds for which the consumer's last statistics showing a broker up count as recent.
BROKER_UP_RECENT_S = 15.0


def _retriable(exc: BaseException) -> bool:
    if isinstance(exc, KafkaException):
        err = exc.args[0]
        return isinstance(err, KafkaError) and err.retriable() and not err.fatal()
    return False


@dataclass
class BatchStats:
    """What one batch did (for logs and metrics)."""

    messages: int = 0
    replayed: int = 0
    unique: int = 0
    duplicate: int = 0
    dead_letter: dict[str, int] = field(default_factory=dict)
    verdicts: list[Verdict] = field(default_factory=list)
    timestamps_ms: list[int] = field(default_factory=list)
    seconds: float = 0.0


@dataclass(slots=True)
class _Partition:
    """What ``_process`` needs of one input partition of a batch: its verdict key prefix,
    state source name, output topics and their largest records (by target); the next
    offset to commit and the new input position (last offset of a message processed
    anew + 1, None if none)."""

    key_prefix: bytes
    source: str
    topics: dict[str, str]
    limits: Limits
    next_offset: int = 0
    position: int | None = None


@dataclass
class _Item:
    message: Message
    outcome: Outcome | None = None
    replay: bool = False
    verdict: Verdict | None = None  # of a message detected in this batch


@dataclass
class _Batch:
    """Consumed messages, read: replays marked (by the positions at reading time), the
    others decoded (``documents``, of the items in ``fresh``) or given a dead-letter
    outcome. ``in_worker``: the documents were sent to the worker; ``prepared``: its
    result, once taken."""

    messages: list[Message]
    items: list[_Item]
    fresh: list[_Item]
    documents: list[Document]
    full: bool
    in_worker: bool = False
    prepared: PreparedBatch | None = None


@dataclass
class _Pending:
    """A batch whose step 5 (offsets and transaction commit) runs in a thread while the
    next batch is consumed and detected; ``error``: what step 5 raised."""

    messages: list[Message]
    keys: list[bytes]
    stats: BatchStats
    prepared: bool
    thread: threading.Thread | None = None
    error: BaseException | None = None
    deadline: float = 0.0  # time.monotonic() after which the thread counts as wedged


class KafkaDeduplicator:
    """The ``neardup run`` consumer.

    Args:
        settings: Kafka, record and batch settings (``bootstrap_servers`` and
            ``input_topics`` required; a topic starting with ``^`` is a regex).
        detector: the engine, over a persistent state store.
        on_batch: called after every committed batch with its ``BatchStats``.
        on_assignment: called with the assigned partitions after every rebalance.
        on_abort: called with the error after a failed batch's transaction was aborted.
        on_broker: called whenever the broker was heard from: transactions initialised,
            a batch committed, or librdkafka statistics (every ``statistics.interval.ms``,
            default 5000 here) showing a broker connection up. Readiness checks use it.

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
    ) -> None:
        if not settings.bootstrap_servers:
            raise ValueError("--bootstrap-servers is required")
        if not settings.input_topics:
            raise ValueError("at least one --input-topic is required")
        self.settings = settings
        self.detector = detector
        self.store: StateStore = detector.store
        self.on_batch = on_batch
        self.on_assignment = on_assignment
        self.on_abort = on_abort
        self.on_broker = on_broker
        self.transactional_id = settings.transactional_id or f"neardup-{settings.group_id}"
        self._stop = threading.Event()
        self._positions: dict[tuple[str, int], int] = {}
        self._committed_keys: list[bytes] = []
        self._delivery_errors: list[str] = []
        # Messages whose record failed to be produced (verdict key -> the stage to
        # fall back to, and why): their batch fails, and its retry produces them so.
        self._failed: dict[bytes, tuple[int, str]] = {}
        self._purged = False  # the open transaction's queue was purged (it must abort)
        self._limits: TopicLimits | None = None
        self.assignment: list[TopicPartition] = []
        self.consumer: Consumer | None = None
        self.producer: Producer | None = None
        self.worker: PrepareWorker | None = None
        self.batches = 0  # committed
        self.batches_prepared_ahead = 0  # of them, prepared in the worker
        self._revoked_while_reading: set[tuple[str, int]] | None = None
        self._unchecked: list[tuple[str, int]] = []  # assigned, state not checked yet
        self._admin: AdminClient | None = None  # for topic ids
        self._consumed = False  # any message yet (logged once)
        self._pending: _Pending | None = None  # the batch whose transaction is committing
        self._unsettled: list[Message] = []  # messages of a batch whose commit failed
        self._backoff, self._resets = 0.5, 0
        self._subscribed_at, self._ever_assigned = 0.0, False  # the assignment watchdog's
        self._broker_up_at = float("-inf")  # time.monotonic() of the consumer's last sight of a broker up

    # --- topics ---------------------------------------------------------------------
    def target_topic(self, input_topic: str, target: str) -> str:
        s = self.settings
        explicit = {"unique": s.unique_topic, "duplicate": s.duplicate_topic, "dlq": s.dlq_topic}
        suffix = {"unique": "unique", "duplicate": "duplicates", "dlq": "dlq"}
        return explicit[target] or f"{input_topic}.{suffix[target]}"

    def _is_output_topic(self, topic: str) -> bool:
        """True for a topic this consumer writes (a regex subscription may match it)."""
        s = self.settings
        if topic in {s.unique_topic, s.duplicate_topic, s.dlq_topic}:
            return True
        return topic.endswith((".unique", ".duplicates", ".dlq"))

    # --- lifecycle ------------------------------------------------------------------
    def stop(self, *_: Any) -> None:
        """Ask the loop to finish the current batch and return."""
        self._stop.set()

    def _connect(self) -> None:
        s = self.settings
        common = {"bootstrap.servers": s.bootstrap_servers, "logger": rdkafka_logger(), **s.kafka}
        self._limits = TopicLimits(common, int(s.kafka.get("batch.size", PRODUCER_BATCH_BYTES)))
        self._new_producer()
        self._broker_answered()
        # The consumer only once the broker has answered the producer: created during an
        # outage, its first group requests time out queued, and it was once seen never
        # to be assigned after the broker came back.
        self.consumer = Consumer(self._consumer_config())
        self._subscribe()

    def _subscribe(self) -> None:
        assert self.consumer is not None
        topics = list(self.settings.input_topics)
        self.consumer.subscribe(
            topics, on_assign=self._assigned, on_revoke=self._revoked, on_lost=self._revoked
        )
        self._subscribed_at, self._ever_assigned = time.monotonic(), False
        log.info("subscribed to %s as group %s", ", ".join(topics), self.settings.group_id)

    def _new_consumer(self, error: KafkaError) -> None:
        """Replace a consumer that failed fatally (typically a static member fenced by
        its own JoinGroup, retried across an outage longer than the session).

        Raises:
            KafkaException: the fatal error ``MAX_PRODUCER_RESETS`` + 1 times in a row.
        """
        self._resets += 1
        if self._resets > MAX_PRODUCER_RESETS:
            raise KafkaException(error)
        log.warning("consumer failed fatally (%s); starting a new one", error)
        self._replace_consumer()

    def _check_assigned(self) -> None:
        """Replace the consumer if it has had no assignment (not even an empty one) for
        ``ASSIGN_WAIT_S`` since it subscribed, though it sees a broker up. Not counted
        as a reset: the group may be slow, nothing implies a second instance."""
        now = time.monotonic()
        if (self._ever_assigned or now - self._subscribed_at < ASSIGN_WAIT_S
                or now - self._broker_up_at > BROKER_UP_RECENT_S):
            return
        log.warning("no partitions assigned %.0f s after subscribing, though the broker is up; "
                    "starting a new consumer", now - self._subscribed_at)
        self._replace_consumer()

    def _replace_consumer(self) -> None:
        """A new consumer in place of the current one: its partitions are given up as in
        a revocation, the old consumer is dropped uncalled (``neardup.io.bounded.discard``),
        and the new one subscribes; the partitions resume at the group's committed offsets."""
        old, self.consumer = self.consumer, None
        self._revoked(old, list(self.assignment))
        discard(old)
        del old
        self.consumer = Consumer(self._consumer_config())
        self._subscribe()

    def _consumer_config(self) -> dict[str, Any]:
        """The consumer's librdkafka settings: neardup's, then the user's (``-X``).

        Static membership (``group.instance.id``) is on by default, named after the
        transactional id (unique per instance already): a consumer restarted after a
        crash gets its partitions back at once instead of after ``session.timeout.ms``.
        ``-X group.instance.id=NAME`` names it; an empty value turns it off.
        """
        s = self.settings
        config = {
            "bootstrap.servers": s.bootstrap_servers,
            "group.id": s.group_id,
            "group.instance.id": self.transactional_id,
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "isolation.level": "read_committed",
            "auto.offset.reset": "earliest" if s.from_beginning else "latest",
            "statistics.interval.ms": 5000,
            "stats_cb": self._statistics,
            "logger": rdkafka_logger(),
            **s.kafka,
        }
        if not config["group.instance.id"]:
            del config["group.instance.id"]
        return config

    def _producer_config(self) -> dict[str, Any]:
        """The transactional producer's librdkafka settings (the user's ``-X`` win,
        except the consumer-only ``group.instance.id``)."""
        s = self.settings
        config = {
            "transactional.id": self.transactional_id,
            "linger.ms": 5,
            "message.max.bytes": PRODUCER_MAX_BYTES,  # the topics' limits decide
            "bootstrap.servers": s.bootstrap_servers,
            "logger": rdkafka_logger(),
            **s.kafka,
        }
        config.pop("group.instance.id", None)
        return config

    def _new_producer(self) -> None:
        """A transactional producer, initialised (retried until the broker answers), in
        place of the current one, which is dropped without being called again.

        ``init_transactions`` fences any older producer of this transactional.id and
        aborts its open transaction. One that does not return in ``CALL_WAIT_S`` is
        abandoned for another new producer.
        """
        self._discard_producer()
        while True:
            producer = Producer(self._producer_config())
            try:
                self._init_transactions(producer)
            except ProducerWedged as exc:
                log.warning("%s; starting another producer", exc)
                discard(producer)
                del producer
                continue
            self.producer = producer
            log.info("transactional producer %s ready", self.transactional_id)
            return

    def _init_transactions(self, producer: Producer) -> None:
        for attempt in Retrying(
            retry=retry_if_exception(_retriable),
            wait=wait_exponential(multiplier=0.5, max=30),
            stop=stop_never,
            before_sleep=lambda rs: log.warning(
                "broker not reachable yet (%s); retrying", rs.outcome.exception()
            ),
        ):
            with attempt:
                if self._stop.is_set():
                    raise InterruptedError("stopped before the broker answered")
                bounded("init_transactions", producer.init_transactions, INIT_TIMEOUT_S,
                        wait_s=INIT_TIMEOUT_S + CALL_WAIT_S - CALL_TIMEOUT_S)

    def _discard_producer(self) -> None:
        """Drop the producer, never to call it again (``neardup.io.bounded.discard``)."""
        producer, self.producer = self.producer, None
        if producer is not None:
            discard(producer)

    def _assigned(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._ever_assigned = True
        held = {(p.topic, p.partition) for p in self.assignment}  # empty unless cooperative
        self.assignment += [p for p in partitions if (p.topic, p.partition) not in held]
        self._unchecked += [(p.topic, p.partition) for p in partitions]
        log.info("assigned %s", ", ".join(f"{p.topic}[{p.partition}]" for p in partitions) or "nothing")
        if self.on_assignment:
            self.on_assignment(self.assignment)

    def _revoked(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        # No transaction may be committing when partitions go: their next owner resumes
        # at the group's committed offsets. Its outcome is taken up after the rebalance
        # (a wedged one: the producer is replaced then, which aborts the transaction).
        if self._pending is not None:
            self._join_pending(self._pending)
        gone = {(p.topic, p.partition) for p in partitions}
        self.assignment = [p for p in self.assignment if (p.topic, p.partition) not in gone]
        self._unchecked = [tp for tp in self._unchecked if tp not in gone]
        for tp in gone:
            self._positions.pop(tp, None)
        if self._revoked_while_reading is not None:
            self._revoked_while_reading |= gone
        log.info("revoked %s", ", ".join(f"{t}[{p}]" for t, p in sorted(gone)) or "nothing")
        if self.on_assignment:
            self.on_assignment(self.assignment)

    def run(self, install_signal_handlers: bool = True) -> None:
        """Consume until ``stop()`` (or SIGTERM/SIGINT), then commit and leave the group.

        Raises:
            KafkaException: fatal Kafka errors ``MAX_PRODUCER_RESETS`` + 1 times in a row.
        """
        if install_signal_handlers:
            signal.signal(signal.SIGTERM, self.stop)
            signal.signal(signal.SIGINT, self.stop)
        if self.settings.pipeline:
            self.worker = PrepareWorker(self.detector.settings)
        # The compiled kernels load while the producer and consumer connect.
        threading.Thread(target=warm_up, args=(self.detector.settings,), name="neardup-warm-up",
                         daemon=True).start()
        try:
            self._connect()
            self._loop()
        except InterruptedError:  # stopped while waiting for the broker
            pass
        finally:
            self.close()

    def _loop(self) -> None:
        ahead: _Batch | None = None  # the next batch, read ahead (see the module docstring)
        while not self._stop.is_set():
            batch = ahead or self._consume(self.settings.batch_max_ms / 1000)
            ahead = None
            if batch is None:
                self._check_assigned()
                try:
                    self._finish_pending()  # idle: the last batch's commit is surely done
                except KafkaException as exc:
                    self._recover(exc, [])
                try:
                    self._worker_ready()  # idle: take the worker's start-up notice
                except WorkerDied as exc:
                    self._worker_died(exc)
                continue
            if not self._consumed:
                self._consumed = True
                log.info("first messages consumed: %d", len(batch.messages))
            self._take_prepared(batch)  # first: the worker holds one batch at a time
            if batch.full and self.worker is not None and not self._stop.is_set():
                batch, ahead = self._read_ahead(batch)
                if batch is None:
                    continue
            try:
                self._process(batch)
            except KafkaException as exc:
                if ahead is not None:
                    self._take_prepared(ahead)  # and dropped
                self._recover(exc, batch.messages + (ahead.messages if ahead else []))
                ahead = None

    def _recover(self, exc: KafkaException, messages: list[Message]) -> None:
        """After a failed batch (``messages``, and those of a batch whose commit failed
        in the background): a new producer (fatal error) or an aborted transaction,
        the partitions rewound to the first offsets, a backoff.

        Raises:
            KafkaException: ``exc``, when it is the fatal error ``MAX_PRODUCER_RESETS`` + 1
                in a row.
        """
        assert self._pending is None  # ``_process`` and the idle loop take it up first
        if isinstance(exc, ProducerWedged) or self.producer is None:
            # librdkafka's own timeout did not hold (a broker restarted under a call):
            # the producer is dropped uncalled; a new one fences it and the broker aborts
            # its transaction. Not counted as a reset: no second instance is implied.
            log.warning("%s; starting a new producer", exc)
            self._new_producer()
        elif _fatal(exc):
            # e.g. the broker aborted a transaction that outlived its timeout and bumped
            # the producer epoch: a new producer (same transactional.id) resumes; the
            # replay rule makes it exact.
            self._resets += 1
            if self._resets > MAX_PRODUCER_RESETS:
                raise exc
            log.warning("producer failed fatally (%s); starting a new one", exc)
            self._new_producer()
        else:
            log.warning("batch failed (%s); aborting and retrying in %.1f s", exc, self._backoff)
            self._abort()
        self._rewind(self._unsettled + messages)
        self._unsettled = []
        if self.on_abort:
            self.on_abort(exc)
        self._stop.wait(self._backoff)
        self._backoff = min(self._backoff * 2, 30.0)

    def close(self) -> None:
        """Leave the group and stop the worker; a batch read ahead is dropped (the
        group's committed offsets are where its partitions resume)."""
        try:
            self._finish_pending()
        except KafkaException as exc:  # in RocksDB already: replayed at the next start
            log.warning("the last batch's transaction failed at close (%s)", exc)
        if self.consumer is not None:
            self.consumer.close()
            self.consumer = None
        if self.producer is not None:
            try:
                self.producer.flush(10)
            except KafkaException as exc:  # a failed producer has nothing left to deliver
                log.warning("producer flush at close: %s", exc)
            self._discard_producer()
        if self.worker is not None:
            self.worker.close()
            self.worker = None
        if self._admin is not None:
            admin, self._admin = self._admin, None
            discard(admin)
        log.info("consumer closed after %d batches, %d of them prepared ahead in the worker process",
                 self.batches, self.batches_prepared_ahead)

    def _broker_answered(self) -> None:
        if self.on_broker:
            self.on_broker()

    def _statistics(self, stats_json: str) -> None:
        """librdkafka statistics callback (consumer thread): a broker connection is up."""
        try:
            brokers = json.loads(stats_json).get("brokers", {})
        except ValueError:
            return
        if any(b.get("nodeid", -1) >= 0 and b.get("state") == "UP" for b in brokers.values()):
            self._broker_up_at = time.monotonic()
            self._broker_answered()

    def lag(self) -> dict[tuple[str, int], int]:
        """Messages behind per assigned partition: cached high watermark minus position.

        Uses the watermarks of the last fetch responses (no broker request); partitions
        whose watermark or position is not known yet are left out. Call it from the
        consumer's thread (e.g. in ``on_batch``).
        """
        if self.consumer is None or not self.assignment:
            return {}
        out: dict[tuple[str, int], int] = {}
        for tp in self.consumer.position(self.assignment):
            if tp.offset < 0:
                continue
            _, high = self.consumer.get_watermark_offsets(tp, cached=True)
            if high >= 0:
                out[(tp.topic, tp.partition)] = max(0, high - tp.offset)
        return out

    # --- one batch ----------------------------------------------------------------------
    def _consume(self, timeout: float) -> _Batch | None:
        """Up to ``batch_size`` messages, waiting at most ``timeout`` s; None if none."""
        assert self.consumer is not None
        messages = self.consumer.consume(self.settings.batch_size, timeout=timeout)
        fatal = next((m.error() for m in messages if _consumer_fatal(m.error())), None)
        if fatal is not None:
            self._new_consumer(fatal)
            return None
        if self._unchecked:  # newly assigned partitions: before any of their messages is read
            self._check_state()
        full = len(messages) == self.settings.batch_size
        messages = self._usable(messages)
        return self._read(messages, full) if messages else None

    def _check_state(self) -> None:
        """Check the state against the newly assigned partitions (``state_check``).

        Raises:
            StateMismatchError: it does not match and ``--reset-state`` was not given.
        """
        assert self.consumer is not None
        tps = list(dict.fromkeys(self._unchecked))
        topics = sorted({t for t, _ in tps})
        committed = self._committed(tps)
        ids = self._topic_ids(topics)
        stored = dict(zip(topics, self.store.get_verdicts([state_check.topic_id_key(t) for t in topics])))
        facts = [
            state_check.PartitionFacts(
                topic=t, partition=n, position=self.store.get_position(source_name(t, n)),
                committed=committed.get((t, n)), high=self._high_watermark(t, n),
                stored_topic_id=stored[t].decode("ascii") if stored[t] else None, topic_id=ids.get(t),
            )
            for t, n in tps
        ]
        self._positions.update(state_check.check(self.store, facts, self.settings.reset_state))
        self._unchecked = []
        log.info("state checked against %s", ", ".join(p.name for p in facts))

    def _committed(self, tps: list[tuple[str, int]]) -> dict[tuple[str, int], int]:
        """The consumer group's committed offsets (none: left out); asked again while
        the coordinator does not answer."""
        assert self.consumer is not None
        for attempt in Retrying(
            retry=retry_if_exception(lambda e: isinstance(e, KafkaException) and not _fatal(e)),
            wait=wait_exponential(multiplier=0.5, max=10),
            stop=stop_never,
            before_sleep=lambda rs: log.warning("committed offsets: %s; retrying", rs.outcome.exception()),
        ):
            with attempt:
                if self._stop.is_set():
                    raise InterruptedError("stopped before the committed offsets were read")
                got = self.consumer.committed([TopicPartition(t, n) for t, n in tps], timeout=10)
        return {(p.topic, p.partition): p.offset for p in got if p.offset >= 0}

    def _high_watermark(self, topic: str, partition: int) -> int | None:
        assert self.consumer is not None
        try:
            return self.consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout=10)[1]
        except KafkaException as exc:
            log.warning("end offset of %s[%d] not known (%s); not checked", topic, partition, exc)
            return None

    def _topic_ids(self, topics: list[str]) -> dict[str, str]:
        """The broker's topic ids (base64 text); those it does not give are left out."""
        if self._admin is None:
            config = self._producer_config()
            del config["transactional.id"], config["linger.ms"]
            self._admin = AdminClient(config)
        out = {}
        for topic, future in self._admin.describe_topics(TopicCollection(topics), request_timeout=10).items():
            try:
                out[topic] = str(future.result().topic_id)
            except KafkaException as exc:
                log.warning("topic id of %s not known (%s); not checked", topic, exc)
        return out

    def _read_ahead(self, batch: _Batch) -> tuple[_Batch | None, _Batch | None]:
        """(``batch``, the next batch) with the next one's preparation started in the
        worker. The next batch is what the consumer has already fetched (no wait).

        A rebalance served on the way invalidates the messages ``batch`` holds of the
        revoked partitions: they are dropped (their next owner, maybe this consumer
        again, resumes at the group's committed offset, which is where they start).
        """
        self._revoked_while_reading = set()
        try:
            ahead = self._consume(0)
        finally:
            revoked, self._revoked_while_reading = self._revoked_while_reading, None
        if revoked:
            # ahead is from after the rebalance, except (in principle) messages of revoked
            # partitions fetched before it and not reassigned: dropped as well.
            assigned = {(p.topic, p.partition) for p in self.assignment}
            batch = self._without(batch, lambda tp: tp in revoked)
            if ahead is not None:
                ahead = self._without(ahead, lambda tp: tp in revoked and tp not in assigned)
            log.info("rebalanced while reading ahead: messages of revoked partitions dropped")
        if ahead is not None and self.worker is not None:
            try:
                if self._worker_ready():  # until it has started, batches are prepared here
                    self.worker.submit(ahead.documents)
                    ahead.in_worker = True
            except WorkerDied as exc:
                self._worker_died(exc)
        return batch, ahead

    def _without(self, batch: _Batch, drop: Callable[[tuple[str, int]], bool]) -> _Batch | None:
        """``batch`` without the messages of the partitions ``drop`` selects, read again."""
        kept = [m for m in batch.messages if not drop((m.topic(), m.partition()))]
        if len(kept) == len(batch.messages):
            return batch
        return self._read(kept, full=False) if kept else None

    def _usable(self, messages: list[Message]) -> list[Message]:
        out = []
        for m in messages:
            err = m.error()
            if err is not None:
                if err.code() != KafkaError._PARTITION_EOF:
                    log.warning("consume error: %s", err)
                    if err.fatal():
                        raise KafkaException(err)
                continue
            if self._is_output_topic(m.topic()):
                continue
            out.append(m)
        return out

    def _position(self, topic: str, partition: int) -> int:
        tp = (topic, partition)
        if tp not in self._positions:
            self._positions[tp] = self.store.get_position(source_name(topic, partition)) or 0
        return self._positions[tp]

    def _is_replay(self, m: Message) -> bool:
        return m.offset() < self._position(m.topic(), m.partition())

    def _read(self, messages: list[Message], full: bool) -> _Batch:
        """Mark the replays (step 2) and decode the other messages."""
        s = self.settings
        items = [_Item(m, replay=self._is_replay(m)) for m in messages]
        fresh: list[_Item] = []
        documents: list[Document] = []
        for it in items:
            if it.replay:
                continue
            m = it.message
            try:
                doc = to_document(m.value(), m.key(), m.topic(), m.partition(), m.offset(),
                                  s.text_field, s.id_field, s.max_message_bytes)
                ts_type, ts = m.timestamp()  # the retention window's clock; none: arrival
                documents.append(Document(doc.id, doc.text, ts / 1000 if ts_type != 0 else None))
                fresh.append(it)
            except MessageError as exc:
                it.outcome = Outcome.of_error(exc.kind, str(exc), m.topic(), m.partition(), m.offset())
        return _Batch(messages, items, fresh, documents, full)

    def _take_prepared(self, batch: _Batch) -> None:
        """Take the batch's preparation from the worker, if it went there."""
        if not batch.in_worker:
            return
        batch.in_worker = False
        if self.worker is None:
            return
        try:
            batch.prepared = self.worker.result()
        except WorkerDied as exc:
            self._worker_died(exc)

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

    def _process(self, batch: _Batch) -> BatchStats:
        started = time.perf_counter()
        if any(it.replay != self._is_replay(it.message) for it in batch.items):
            # Cannot happen: positions only grow past a batch's own offsets, so those of
            # the batches after it keep their side. Checked all the same, it is cheap.
            batch = self._read(batch.messages, batch.full)  # prepared here
        messages, items = batch.messages, batch.items
        stats = BatchStats(messages=len(messages))

        replays = [it for it in items if it.replay]
        stored = self.store.get_verdicts(
            [verdict_key(it.message.topic(), it.message.partition(), it.message.offset()) for it in replays]
        )
        for it, raw in zip(replays, stored):
            if raw is None:  # produced and committed in an earlier transaction
                log.warning("skipping %s[%d]@%d: already delivered", it.message.topic(), it.message.partition(), it.message.offset())
            else:
                it.outcome = Outcome.from_bytes(raw)
        stats.replayed = len(replays)

        result = self.detector.detect(batch.documents, prepared=batch.prepared)
        for it, res in zip(batch.fresh, result.results):
            m = it.message
            if isinstance(res, Rejected):
                it.outcome = Outcome.of_error("empty_text", res.reason, m.topic(), m.partition(), m.offset())
            else:
                it.outcome = Outcome.of_verdict(res)
                it.verdict = res
                stats.verdicts.append(res)

        assert self.producer is not None and self.consumer is not None
        self._finish_pending()  # the previous batch's transaction, committed meanwhile
        self._delivery_errors.clear()
        self._purged = False
        self._call("begin_transaction", self.producer.begin_transaction)
        # Per message: the hot loop. What depends on the partition only is looked up once.
        partitions: dict[tuple[str, int], _Partition] = {}
        keys: list[bytes] = []  # verdict keys of all the batch's messages (items are 1:1)
        update = result.update
        stored = update.verdicts
        timestamps = stats.timestamps_ms
        dead_letter = stats.dead_letter
        unique = duplicate = 0
        pack_offset = OFFSET_BE.pack
        failed = self._failed
        for it in items:
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
                outcome = fit(outcome, m.key(), m.value(), carried, part.limits, (*tp, offset),
                              *failed.get(key, ()))
                stored[key] = outcome.to_bytes()
            outcome = self._send(part.topics, part.limits, key, outcome, m, carried, stored)
            target = outcome.target
            if target == "unique":
                unique += 1
            elif target == "duplicate":
                duplicate += 1
            else:
                kind = outcome.error_kind or "unknown"
                dead_letter[kind] = dead_letter.get(kind, 0) + 1
                if it.verdict is not None:  # its record did not fit: a dead letter, not a verdict
                    stats.verdicts.remove(it.verdict)
            ts_type, ts = m.timestamp()
            if ts_type != 0:
                timestamps.append(ts)
        stats.unique, stats.duplicate = unique, duplicate
        for part in partitions.values():
            if part.position is not None:
                update.positions[part.source] = part.position
        update.verdict_deletes = self._committed_keys
        self.store.commit(update)
        for source, position in update.positions.items():
            _, topic, partition = source.rsplit(":", 2)
            self._positions[(topic, int(partition))] = position

        # Step 5 in a thread: the broker's answers are waited for while this thread
        # consumes and detects the next batch; ``_finish_pending`` takes it up.
        offsets = [TopicPartition(t, p, part.next_offset) for (t, p), part in partitions.items()]
        pending = _Pending(messages, keys, stats, batch.prepared is not None,
                           deadline=time.monotonic() + STEP5_WAIT_S)
        metadata = self.consumer.consumer_group_metadata()
        pending.thread = threading.Thread(target=self._commit_offsets,
                                          args=(self.producer, pending, offsets, metadata, started),
                                          name="neardup-commit", daemon=True)
        self._pending = pending
        pending.thread.start()
        return stats

    def _commit_offsets(self, producer: Producer, pending: _Pending, offsets: list[TopicPartition],
                        metadata: Any, started: float) -> None:
        """Step 5 of a batch (in its own thread): the input offsets (with the consumer
        group's ``metadata``) into the transaction, then its commit; an error is kept in
        ``pending.error`` (``ProducerWedged``: a call that did not return in time, the
        producer is never called again)."""
        try:
            bounded("send_offsets_to_transaction", producer.send_offsets_to_transaction,
                    offsets, metadata, CALL_TIMEOUT_S)
            self._commit_transaction(producer)
            pending.stats.seconds = time.perf_counter() - started
        except BaseException as exc:  # noqa: BLE001 - raised again by _finish_pending
            pending.error = exc

    def _join_pending(self, pending: _Pending) -> None:
        """Wait for step 5's thread until its deadline; still running then, it counts as
        wedged (``pending.error``)."""
        assert pending.thread is not None
        pending.thread.join(max(0.0, pending.deadline - time.monotonic()))
        if pending.thread.is_alive() and pending.error is None:
            pending.error = ProducerWedged("step 5 (offsets and commit)", STEP5_WAIT_S)

    def _finish_pending(self) -> None:
        """Wait for the batch whose transaction is committing, then count it (or raise).

        Raises:
            KafkaException: its offsets or commit failed; its messages are rewound with
                those of the failing batch (``_recover``).
        """
        pending, self._pending = self._pending, None
        if pending is None:
            return
        self._join_pending(pending)
        if pending.error is not None:
            self._unsettled = pending.messages
            if isinstance(pending.error, ProducerWedged):
                self._discard_producer()
            raise pending.error
        if self._delivery_errors:
            log.error("deliveries failed inside a committed transaction: %s", self._delivery_errors[:3])
        self._committed_keys = pending.keys
        if self._failed:
            for key in pending.keys:
                self._failed.pop(key, None)
        self._backoff, self._resets = 0.5, 0
        self.batches += 1
        self.batches_prepared_ahead += pending.prepared
        self._broker_answered()
        if self.on_batch:
            self.on_batch(pending.stats)

    def _partition(self, topic: str, partition: int) -> _Partition:
        """A new ``_Partition`` of an input partition (for one batch).

        Raises:
            KafkaException: the output topics' ``max.message.bytes`` could not be read.
        """
        assert self._limits is not None
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
        assert self.producer is not None
        produce = self.producer.produce
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
                        self.producer.poll(0.05)
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
            log.error("a dead letter of neardup's headers alone was refused by %s: %s", msg.topic(), err)
        if self._limits is not None:
            self._limits.forget()  # a topic's max.message.bytes may have changed
        if not self._purged and self.producer is not None:
            self._purged = True
            self.producer.purge(in_queue=True, in_flight=True, blocking=False)

    def _commit_transaction(self, producer: Producer) -> None:
        for attempt in Retrying(
            retry=retry_if_exception(_retriable),
            wait=wait_exponential(multiplier=0.2, max=10),
            stop=stop_after_delay(TRANSACTION_RETRY_S),
            reraise=True,
            before_sleep=lambda rs: log.warning("commit_transaction: %s; retrying", rs.outcome.exception()),
        ):
            with attempt:
                bounded("commit_transaction", producer.commit_transaction, CALL_TIMEOUT_S)

    def _abort(self) -> None:
        """Abort the open transaction (retried for ``TRANSACTION_RETRY_S`` while the error is
        not fatal); a fatal error, a call that does not return, or no success in that
        time, starts a new producer, which aborts it as well."""
        assert self.producer is not None
        try:
            self._abort_transaction()
        except KafkaException as exc:
            if _fatal(exc):
                reason = "failed fatally"
            elif isinstance(exc, ProducerWedged):
                reason = "did not return"
            else:
                reason = f"did not succeed in {TRANSACTION_RETRY_S:.0f} s"
            log.warning("abort_transaction %s (%s); starting a new producer", reason, exc)
            self._new_producer()

    def _abort_transaction(self) -> None:
        assert self.producer is not None
        for attempt in Retrying(
            retry=retry_if_exception(lambda e: isinstance(e, KafkaException) and not _fatal(e)
                                     and not isinstance(e, ProducerWedged)),
            wait=wait_exponential(multiplier=0.5, max=30),
            stop=stop_after_delay(TRANSACTION_RETRY_S),
            reraise=True,
            before_sleep=lambda rs: log.warning("abort_transaction: %s; retrying", rs.outcome.exception()),
        ):
            with attempt:
                try:
                    self._call("abort_transaction", self.producer.abort_transaction, CALL_TIMEOUT_S)
                except KafkaException as exc:
                    if exc.args[0].code() != KafkaError._STATE:  # _STATE: none open
                        raise

    def _call(self, what: str, call: Callable[..., Any], *args: Any) -> Any:
        """``call(*args)`` on the producer, waited for at most ``CALL_WAIT_S``.

        Raises:
            ProducerWedged: it did not return; the producer is dropped (``self.producer``
                is None until ``_recover`` starts a new one).
        """
        try:
            return bounded(what, call, *args)
        except ProducerWedged:
            self._discard_producer()
            raise

    def _rewind(self, messages: list[Message]) -> None:
        """Seek the batch's partitions back to its first offsets, to consume it again."""
        assert self.consumer is not None
        first: dict[tuple[str, int], int] = {}
        for m in messages:
            tp = (m.topic(), m.partition())
            first[tp] = min(first.get(tp, m.offset()), m.offset())
        assigned = {(p.topic, p.partition) for p in self.assignment}
        for (topic, partition), offset in first.items():
            if (topic, partition) in assigned:
                self.consumer.seek(TopicPartition(topic, partition, offset))


def _consumer_fatal(err: KafkaError | None) -> bool:
    """A consume error after which the consumer is unusable (librdkafka reports it as
    ``_FATAL``, its ``fatal()`` flag unset)."""
    return err is not None and (err.fatal() or err.code() == KafkaError._FATAL)


def _fatal(exc: KafkaException) -> bool:
    err = exc.args[0]
    return isinstance(err, KafkaError) and err.fatal()
