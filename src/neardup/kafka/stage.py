"""A transactional Kafka stage: consume a batch -> process -> produce -> state commit ->
offsets and commit, exactly once. It knows nothing of what the stage computes: that is
its ``Processor`` (``neardup.run``'s deduplication is one).

Each batch is one Kafka transaction and one atomic state write. The steps, in order:

1. ``consume`` up to ``batch_size`` messages (or what arrives in ``batch_max_ms``) from the
   assigned partitions, reading committed data only (``isolation.level=read_committed``);
   ``Processor.read`` reads them (it marks the messages it has processed before, whose
   outputs its state holds: the *replays*).
2. ``Processor.compute``: the batch's results, without writing anything (this overlaps
   the previous batch's step 5).
3. ``begin_transaction``; ``Processor.write`` produces the batch's records into it
   (the outputs, and the state changes to the changelog, ``neardup.kafka.changelog``) ...
4. ... then commits its state atomically: its state changes, each partition's new input
   position, and what a replay needs to produce the same records again.
5. ``send_offsets_to_transaction`` (next offset per partition, with the consumer group's
   metadata) and ``commit_transaction``, in a thread of their own: while the broker
   answers, this thread consumes, reads and computes the next batch (which sees batch
   k's state: it is committed since step 4). The next batch's transaction begins only
   once step 5 has succeeded; only then is the batch counted (``Processor.committed``)
   and ``on_batch`` called.

What a crash leaves, and how a restart (same ``transactional.id``, same state) repairs it:

- before step 4 completes: the state is unchanged; the open Kafka transaction is aborted
  when the restarted producer calls ``init_transactions`` (it fences the old one). The
  consumer group resumes at the last committed offsets and the batch is processed anew
  against the same state, so it gets the same results.
- after step 4, before step 5 completes: the state holds the batch, Kafka does not (the
  next batch may have been computed, but nothing of it written). The batch's messages
  are consumed again; they are replays, so the processor produces their stored records
  again, identical, and its state never takes them twice. The changelog records of the
  batch are produced again too (``Processor.write`` begins every transaction with the
  state changes not yet known committed).
- after step 5: both agree; nothing to repair.
- a producer abandoned while the process lives on (a transactional call that has not
  returned after ``CALL_WAIT_S``, ``neardup.kafka.bounded``; librdkafka's own timeouts do
  not hold after a broker restart): as a crash at the same point. The abandoned producer
  is never called again; a new one with the same ``transactional.id`` fences it and has
  the broker abort its open transaction (a wedged call that returns later cannot commit:
  its epoch is fenced). Abandoned before step 4, the batch is rewound and processed
  anew; in step 5, it is rewound with the next batch and replayed.

An error that is not fatal (broker gone, transaction timed out, abortable error) aborts
the transaction, rewinds the batch's partitions to its first offsets and retries with
exponential backoff; the replay rule makes the retry exact. A fatal producer error
(typically: the broker aborted a transaction that outlived ``transaction.timeout.ms``
during an outage and bumped the producer epoch, which the client reports as fenced)
starts a new producer with the same ``transactional.id``, rewinds and retries the same
way; after ``MAX_PRODUCER_RESETS`` such errors without a committed batch in between (a
live second instance with the same id), ``run`` raises. A commit or abort that still
times out after ``TRANSACTION_RETRY_S`` (a producer wedged by an outage) fails the batch
the same way, and the abort then starts a new producer; so does a batch timing out
locally when batches have failed with the same producer for longer than
``TRANSACTION_RETRY_S`` (seen after an outage: ``send_offsets_to_transaction`` timing out
on every batch while each abort succeeds). Every transactional call
(``init_transactions``, ``begin_transaction``, ``send_offsets_to_transaction``,
``commit_transaction``, ``abort_transaction``) is waited for at most ``CALL_WAIT_S`` and
every wait for step 5's thread at most ``STEP5_WAIT_S``; past that the producer is
abandoned (``ProducerWedged``) and replaced, rewound and retried as for a fatal error,
without counting towards ``MAX_PRODUCER_RESETS``. A step 5 that fails in its thread is
seen when the next batch is about to begin its transaction (or when the consumer is
idle): the failed batch's partitions are rewound with the next batch's, to the failed
batch's first offsets, and the next batch is dropped (it wrote nothing); its messages
come back as replays.

Rebalances happen only inside ``consume`` (step 1), and the revoke callback first waits
for a step 5 in progress (at most until ``STEP5_WAIT_S``; a step 5 still running then
counts as wedged, and its producer is replaced, aborting its transaction, before the next
batch), so no transaction is open when partitions go and a revoked partition never
leaves anything half-done. If that step 5 fails, the batch's messages of the partitions
revoked are not rewound with the rest: their next owner, maybe this consumer again,
resumes at the group's committed offset (which a processor may keep before the batch's
first offset, for the records it still holds). Newly assigned partitions are handed to
``Processor.check`` before any of their messages is read.

A check may take minutes (a restore from a long changelog), longer than the consumer
may go without polling (``max.poll.interval.ms``, librdkafka's measure: past it the
consumer leaves its group, its partitions go to another member, and the restore is
wasted, again and again). So it runs as Kafka Streams restores its tasks, outside the
poll loop's blocking path: in a thread of its own, while the consumer keeps calling
``consume`` with every assigned partition *held* paused (so it keeps its membership
and serves rebalances, and reads nothing); the partitions are fetched again when the
check has ended. The consumer keeps the runtime's hold apart from the pauses the
intake or the processor ask for, so that neither undoes the other. No batch is
processed during a check (the loop waits for it), and the processor is never called
from two threads at once: partitions revoked during a check are handed to
``Processor.revoked`` once it has ended, and partitions assigned during it are held at
once and checked next. A check that raises ends ``run`` as before; a consumer that
fails during a check is replaced once the check has ended.

Read-ahead (with a processor that ``reads_ahead``): when batch k is full (a backlog),
batch k + 1 is consumed *ahead*, before batch k's step 2, taking only what the consumer
has already fetched (no wait), and handed to ``Processor.ahead`` (which may start work
on it elsewhere, e.g. in another process). Batch k + 1 is only held in memory:

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

Progress (``neardup.kafka.progress``): the runtime tells its ``Progress`` when a batch is in
hand, committed or failed, and when it is idle; a consumer whose input has waited with no
batch committed for ``STALL_AFTER_S`` is stalled (``/readyz``, a gauge, a log line once a
minute). While a check runs (a restore), ``/readyz`` says so instead, and the stall clock
stops. A failed batch's retry is logged at its first failure only, the stall then once
a minute, so a batch that fails again and again does not flood the log.

SIGTERM or SIGINT: the batch in progress is finished and committed, a batch read ahead is
dropped, the consumer leaves its group, and ``run`` returns. A check in progress (which
cannot be interrupted, and writes nothing to Kafka) is waited for first, the consumer
polling meanwhile; a SIGKILL then is a crash before step 1.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson
from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer, TopicPartition
from tenacity import Retrying, retry_if_exception, stop_after_delay, wait_exponential

from neardup.config import Settings
from neardup.kafka.bounded import CALL_TIMEOUT_S, CALL_WAIT_S, ProducerWedged, bounded, discard
from neardup.kafka.clients import consumer_config, init_transactions, produce_in_order, producer_config, retriable
from neardup.kafka.intake import OrderedIntake
from neardup.kafka.progress import Progress
from neardup.kafka.rdkafka_log import ProducerLog

log = logging.getLogger(__name__)

#: Fatal producer errors survived in a row (no batch committed in between) before
#: ``run`` gives up: a live second instance with the same transactional.id would
#: otherwise fence this one back and forth.
MAX_PRODUCER_RESETS = 3
#: Seconds ``commit_transaction`` or ``abort_transaction`` is retried, and batches may
#: fail in a row with one producer, before the producer is replaced: after a broker
#: outage librdkafka's request to the transaction coordinator can stay queued and time
#: out forever; a new producer of the same transactional.id fences the old one and has
#: the broker abort its transaction. Well below max.poll.interval.ms (300 s).
TRANSACTION_RETRY_S = 60.0
#: Longest wait for step 5's thread, seconds: its calls are bounded one by one
#: (``neardup.kafka.bounded``), this is a backstop above their sum.
STEP5_WAIT_S = 2 * CALL_WAIT_S + TRANSACTION_RETRY_S + 10.0
#: Seconds for which the consumer's last statistics showing a broker up count as recent.
BROKER_UP_RECENT_S = 15.0
#: Seconds between two ``consume`` calls while ``Processor.check`` runs in its thread: the
#: consumer keeps polling (``max.poll.interval.ms``) and notices the check's end this soon.
#: Each call waits for nothing (its partitions are paused): confluent-kafka serialises
#: the calls on one client, and a ``consume`` waiting back to back would starve the
#: check's own calls on the consumer (e.g. ``committed``, ``list_topics``).
CHECK_POLL_S = 0.1

TP = tuple[str, int]  # (topic, partition)


class Batch(Protocol):
    """What the runtime needs of a batch the processor has read."""

    messages: list[Message]  # as consumed, in order
    full: bool  # as many as ``batch_size``: more are probably waiting


class Written(Protocol):
    """What the runtime needs of a batch whose records and state were written (steps 3, 4)."""

    offsets: list[TopicPartition]  # next offset to consume, per input partition of the batch


class Processor(Protocol):
    """What a stage computes; the runtime calls it from one thread at a time (``check``
    in a thread of its own, see the module docstring), in this order per batch: ``read``
    (maybe ``ahead``), ``compute``, ``write`` (inside the open transaction),
    ``committed`` (after step 5)."""

    reads_ahead: bool  # a full batch's successor is read ahead and handed to ``ahead``
    orders_partitions: bool  # messages of several partitions read in order-key order (``neardup.kafka.intake``)

    def open(self) -> None:
        """Before connecting (start what takes long)."""
        ...

    def start(self, producer: Producer) -> None:
        """Before the consumer subscribes, with the transactional producer initialised
        (e.g. restore state, produce what a crash left unsent in a transaction of its
        own). Raises KafkaException to be retried with a new producer."""
        ...

    def is_output(self, topic: str) -> bool:
        """Whether ``topic`` is one the stage writes (a regex subscription may match it;
        its messages are skipped)."""
        ...

    def check(self, consumer: Consumer, partitions: list[TP]) -> None:
        """Newly assigned partitions, before any of their messages is read. Called in a
        thread of its own while the runtime's thread polls ``consumer`` with the
        partitions paused (no other method is called meanwhile); calls on ``consumer``
        are serialised with the polling."""
        ...

    def revoked(self, partitions: set[TP]) -> None:
        """Partitions gone (no transaction is open)."""
        ...

    def read(self, messages: list[Message], full: bool) -> Batch:
        """Step 1's reading (replays marked; nothing written)."""
        ...

    def ahead(self, batch: Batch) -> None:
        """A batch read ahead (see the module docstring); ``take`` comes before its turn."""
        ...

    def take(self, batch: Batch) -> None:
        """Take back what ``ahead`` started for ``batch`` (also when it is dropped)."""
        ...

    def compute(self, batch: Batch) -> Any:
        """Step 2: the batch's results, written by ``write``. Writes nothing."""
        ...

    def write(self, work: Any, producer: Producer) -> Written:
        """Steps 3 and 4 inside the open transaction: produce, then commit the state.

        Raises:
            KafkaException: a produce error (the transaction is aborted and retried).
        """
        ...

    def committed(self, written: Written, seconds: float) -> Any:
        """After step 5 succeeded, ``seconds`` after the batch's step 2 began; returns what
        ``on_batch`` is called with."""
        ...

    def idle(self) -> None:
        """Nothing consumed this time."""
        ...

    def due(self) -> bool:
        """Whether a batch of no messages should run now (called when idle): e.g. records
        held in a reorder window whose time has come while the input is quiet."""
        ...

    def aborted(self) -> None:
        """A batch failed (its transaction aborted, or its producer replaced): what
        ``compute`` changed in memory for it, or for a batch computed after it, must be
        undone (its messages are consumed again)."""
        ...

    def close(self) -> None: ...


@dataclass
class MessageBatch:
    """A batch as consumed, with nothing read from it yet (``Batch``)."""

    messages: list[Message]
    full: bool


class StageHooks:
    """What a ``Processor`` does when it has nothing to do at a step: a base for the
    processors that need only some of the steps (the sharded stages)."""

    reads_ahead = False
    orders_partitions = False

    def open(self) -> None:
        pass

    def start(self, producer: Producer) -> None:
        pass

    def revoked(self, partitions: set[TP]) -> None:
        pass

    def read(self, messages: list[Message], full: bool) -> Any:
        return MessageBatch(messages, full)

    def ahead(self, batch: Any) -> None:
        pass

    def take(self, batch: Any) -> None:
        pass

    def committed(self, written: Any, seconds: float) -> Any:
        written.seconds = seconds
        return written

    def idle(self) -> None:
        pass

    def due(self) -> bool:
        return False

    def aborted(self) -> None:
        pass

    def close(self) -> None:
        pass


def next_offsets(messages: list[Message]) -> list[TopicPartition]:
    """The offsets to commit after ``messages``: per partition, its last offset + 1."""
    ends: dict[TP, int] = {}
    for m in messages:
        tp = (m.topic(), m.partition())
        ends[tp] = max(ends.get(tp, 0), m.offset() + 1)
    return [TopicPartition(t, p, o) for (t, p), o in ends.items()]


def produce(producer: Producer, topic: str, key: bytes | None, value: bytes | None,
            headers: list[tuple[str, bytes]], partition: int | None = None,
            on_delivery: Callable[[KafkaError | None, Message], None] | None = None) -> None:
    """``producer.produce`` of one record (to ``partition``, or the partitioner's; with
    ``on_delivery``, called with its delivery report), serving delivery reports while the
    producer's queue is full.

    Raises:
        KafkaException: the record is refused.
    """
    extra: dict[str, Any] = {} if partition is None else {"partition": partition}
    if on_delivery is not None:
        extra["on_delivery"] = on_delivery
    while True:
        try:
            producer.produce(topic, value=value, key=key, headers=headers, **extra)
            return
        except BufferError:
            producer.poll(0.05)


#: A record a stage produces: topic, partition (None: the partitioner's), key, value,
#: headers.
ProducedRecord = tuple[str, int | None, bytes | None, bytes | None, list[tuple[str, bytes]]]


def produce_all(producer: Producer, records: list[ProducedRecord],
                on_last_delivery: Callable[[str, int | None], Callable[[KafkaError | None, Message], None] | None]
                | None = None) -> None:
    """Produce a batch's records into the open transaction, the order of each partition's
    records kept: the records of one topic partition that carry no header in one
    ``produce_batch`` call (``neardup.kafka.clients.produce_in_order``), the others one
    ``produce`` each. The last record of each topic partition has the delivery report
    ``on_last_delivery(topic, partition)`` (None: none).

    Raises:
        KafkaException: a record refused (the transaction is aborted and retried).
    """
    groups: dict[tuple[str, int | None], list[ProducedRecord]] = {}
    for record in records:
        groups.setdefault((record[0], record[1]), []).append(record)
    for (topic, partition), group in groups.items():
        delivered = on_last_delivery(topic, partition) if on_last_delivery is not None else None
        if partition is None or any(record[4] for record in group):
            last = len(group) - 1
            for i, (_, _, key, value, headers) in enumerate(group):
                produce(producer, topic, key, value, headers, partition, delivered if i == last else None)
        else:
            produce_in_order(producer, topic, partition, [(key, value) for _, _, key, value, _ in group], delivered)


def _consumer_fatal(err: KafkaError | None) -> bool:
    """A consume error after which the consumer is unusable (librdkafka reports it as
    ``_FATAL``, its ``fatal()`` flag unset)."""
    return err is not None and (err.fatal() or err.code() == KafkaError._FATAL)


def _offsets_unfetched(err: KafkaError | None) -> bool:
    """A consume error after which librdkafka never starts fetching the partitions just
    assigned: their committed offsets could not be fetched with a request-level error
    (``NOT_COORDINATOR`` from a coordinator that moved, as after a broker outage), and
    librdkafka does not ask again (its issue 5586). A new consumer (a new assignment)
    fetches them again."""
    return err is not None and err.str().startswith("Failed to fetch committed offsets")


def _names(tps: list[TP]) -> str:
    return ", ".join(f"{t}[{p}]" for t, p in tps)


def _timed_out(exc: KafkaException) -> bool:
    """A call that timed out locally: librdkafka got no answer in time."""
    err = exc.args[0] if exc.args else None
    return isinstance(err, KafkaError) and err.code() == KafkaError._TIMED_OUT


def fatal(exc: KafkaException) -> bool:
    err = exc.args[0]
    return isinstance(err, KafkaError) and err.fatal()


class _Consumer(Consumer):
    """The stage's consumer: a ``Consumer`` that keeps two reasons for a partition to be
    paused apart, so that neither undoes the other (librdkafka keeps one pause flag per
    partition).

    - *asked*: ``pause``/``resume`` as called by the intake (``neardup.kafka.intake``) or
      the processor (e.g. prepare's flow control), from any thread;
    - *held*: ``hold``/``release`` by the runtime while the partitions' ``Processor.check``
      runs (see ``StageRuntime._check``).

    A partition is fetched when it is neither: a ``resume`` of a held partition takes
    effect at its ``release``, and a ``release`` leaves a partition asked paused paused.
    """

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config)
        self._pauses = threading.Lock()
        self._asked: set[TP] = set()
        self._held: set[TP] = set()

    def pause(self, partitions: list[TopicPartition]) -> None:
        with self._pauses:
            self._asked.update((p.topic, p.partition) for p in partitions)
            super().pause(partitions)

    def resume(self, partitions: list[TopicPartition]) -> None:
        with self._pauses:
            self._asked.difference_update((p.topic, p.partition) for p in partitions)
            free = [p for p in partitions if (p.topic, p.partition) not in self._held]
            if free:
                super().resume(free)

    def hold(self, tps: list[TP]) -> None:
        """Pause ``tps`` until ``release``: nothing of them is fetched, a ``consume`` returns
        none of their messages (librdkafka drops what it had fetched of them and fetches it
        again after the last message it returned)."""
        with self._pauses:
            self._held.update(tps)
            if tps:
                super().pause([TopicPartition(t, p) for t, p in tps])

    def release(self, tps: list[TP]) -> None:
        """End the hold of ``tps``; those not asked paused are fetched again."""
        with self._pauses:
            self._held.difference_update(tps)
            free = [TopicPartition(t, p) for t, p in tps if (t, p) not in self._asked]
            if free:
                super().resume(free)

    @property
    def held(self) -> set[TP]:
        with self._pauses:
            return set(self._held)


@dataclass
class _Check:
    """A ``Processor.check`` running in a thread of its own (``StageRuntime._check``)."""

    partitions: list[TP]
    done: threading.Event
    error: BaseException | None = None
    revoked: set[TP] = field(default_factory=set)  # meanwhile: ``Processor.revoked`` once it has ended
    kept: list[Message] = field(default_factory=list)  # consumed meanwhile, of partitions still assigned


@dataclass
class _Pending:
    """A batch whose step 5 (offsets and transaction commit) runs in a thread while the
    next batch is consumed and computed; ``error``: what step 5 raised."""

    messages: list[Message]
    written: Written
    thread: threading.Thread | None = None
    error: BaseException | None = None
    deadline: float = 0.0  # time.monotonic() after which the thread counts as wedged
    seconds: float = 0.0  # from step 2 to the end of step 5
    revoked: set[TP] = field(default_factory=set)  # partitions revoked meanwhile: never rewound


def watchdog_due(now: float, unassigned_since: float | None, broker_up_at: float, wait_s: float) -> bool:
    """Whether the assignment watchdog replaces the consumer (``StageRuntime._check_assigned``):
    unassigned since ``unassigned_since`` (``time.monotonic()``; None: assigned) for at
    least ``wait_s`` seconds with a broker seen up in the last ``BROKER_UP_RECENT_S``
    (at ``broker_up_at``), or for at least twice ``wait_s`` whatever was seen."""
    if unassigned_since is None:
        return False
    unassigned = now - unassigned_since
    return unassigned >= 2 * wait_s or (unassigned >= wait_s and now - broker_up_at <= BROKER_UP_RECENT_S)


class StageRuntime:
    """Runs a ``Processor`` as one exactly-once Kafka stage (see the module docstring).

    Args:
        settings: Kafka and batch settings (``bootstrap_servers`` and ``input_topics``
            required; a topic starting with ``^`` is a regex).
        processor: what the stage computes.
        on_batch: called after every committed batch with ``Processor.committed``'s result.
        on_assignment: called with the assigned partitions after every rebalance.
        on_abort: called with the error after a failed batch's transaction was aborted.
        on_broker: called whenever the broker was heard from: transactions initialised,
            a batch committed, or librdkafka statistics (every ``statistics.interval.ms``,
            default 5000 here) showing a broker connection up. Readiness checks use it.
        progress: told of every batch in hand, committed or failed (``neardup.kafka.progress``);
            default: one of its own.

    Raises:
        ValueError: no bootstrap servers or no input topic.
    """

    #: librdkafka settings of the stage's producer over neardup's (the user's ``-X`` win).
    producer_defaults: dict[str, Any] = {}

    def __init__(
        self,
        settings: Settings,
        processor: Processor,
        on_batch: Callable[[Any], None] | None = None,
        on_assignment: Callable[[list[TopicPartition]], None] | None = None,
        on_abort: Callable[[KafkaException], None] | None = None,
        on_broker: Callable[[], None] | None = None,
        progress: Progress | None = None,
    ) -> None:
        if not settings.bootstrap_servers:
            raise ValueError("--bootstrap-servers is required")
        if not settings.input_topics:
            raise ValueError("at least one --input-topic is required")
        self.settings = settings
        self.processor = processor
        self.on_batch = on_batch
        self.on_assignment = on_assignment
        self.on_abort = on_abort
        self.on_broker = on_broker
        self.progress = progress or Progress()
        self.transactional_id = settings.transactional_id or f"neardup-{settings.group_id}"
        self._stop = threading.Event()
        self.assignment: list[TopicPartition] = []
        self.consumer: _Consumer | None = None
        self.producer: Producer | None = None
        self._producer_log = ProducerLog()  # the current producer's, for its transaction error
        self.batches = 0  # committed
        self._revoked_while_reading: set[TP] | None = None
        self._unchecked: list[TP] = []  # assigned, not handed to ``Processor.check`` yet
        self._checking: _Check | None = None  # the ``Processor.check`` running in its thread
        self._consumed = False  # any message yet (logged once)
        self._pending: _Pending | None = None  # the batch whose transaction is committing
        self._unsettled: list[Message] = []  # messages of a batch whose commit failed
        self._backoff, self._resets = 0.5, 0
        self._failing_since: float | None = None  # time.monotonic() of this producer's first failed batch in a row
        self._input_failed = False  # a batch of messages failed since one last committed
        self._unassigned_since: float | None = None  # the assignment watchdog's: time.monotonic()
        self._broker_up_at = float("-inf")  # time.monotonic() of the consumer's last sight of a broker up
        # consumed messages not in a batch yet, released in order-key order (a processor that orders partitions)
        self._intake = (OrderedIntake(settings.batch_size, settings.partition_wait_ms / 1000, self._records_pending)
                        if getattr(processor, "orders_partitions", False) else None)

    # --- lifecycle ------------------------------------------------------------------
    def stop(self, *_: Any) -> None:
        """Ask the loop to finish the current batch and return."""
        self._stop.set()

    def run(self, install_signal_handlers: bool = True) -> None:
        """Consume until ``stop()`` (or SIGTERM/SIGINT), then commit and leave the group.

        Raises:
            KafkaException: fatal Kafka errors ``MAX_PRODUCER_RESETS`` + 1 times in a row.
        """
        if install_signal_handlers:
            signal.signal(signal.SIGTERM, self.stop)
            signal.signal(signal.SIGINT, self.stop)
        self.progress.start()
        try:
            self.processor.open()
            self._connect()
            self._loop()
        except InterruptedError:  # stopped while waiting for the broker
            pass
        except BaseException as exc:
            # A close that fails too (the state's memtables cannot be flushed to the
            # full disk that stopped the loop) must not hide the error naming the cause.
            try:
                self.close()
            except Exception as failed:
                log.warning("closing after an error failed too: %s (after: %s)", failed, exc)
            finally:
                self.progress.close()
            raise
        try:
            self.close()
        finally:
            self.progress.close()

    def close(self) -> None:
        """Leave the group and close the processor; a batch read ahead is dropped (the
        group's committed offsets are where its partitions resume)."""
        try:
            self._finish_pending()
        except KafkaException as exc:  # in the state already: replayed at the next start
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
        self.processor.close()
        log.info("consumer closed after %d batches%s", self.batches, self._closing_note())

    def _closing_note(self) -> str:
        """Text added to the log line at close."""
        return ""

    def _connect(self) -> None:
        self._new_producer()
        self._broker_answered()
        while True:
            assert self.producer is not None
            try:
                self.processor.start(self.producer)
                break
            except KafkaException as exc:
                log.warning("start-up transaction failed (%s); retrying with a new producer", exc)
                self._stop.wait(self._backoff)
                self._backoff = min(self._backoff * 2, 30.0)
                self._new_producer()
        # The consumer only once the broker has answered the producer: created during an
        # outage, its first group requests time out queued, and it was once seen never
        # to be assigned after the broker came back.
        self.consumer = _Consumer(self._consumer_config())
        self._subscribe()

    def _consumer_config(self) -> dict[str, Any]:
        config = consumer_config(self.settings, self.transactional_id, self._statistics)
        if self._intake is not None:  # a partition read to its end holds nothing back
            config["enable.partition.eof"] = True
        return config

    def _subscribe(self) -> None:
        assert self.consumer is not None
        topics = list(self.settings.input_topics)
        self.consumer.subscribe(
            topics, on_assign=self._assigned, on_revoke=self._revoked, on_lost=self._revoked
        )
        self._unassigned_since = time.monotonic()
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
        ``Settings.assign_wait_ms`` (60 s by default) since it subscribed, or since it lost
        all its partitions (a revocation, or a session expired in an outage), though it
        sees a broker up; or for twice that, whatever it sees (``watchdog_due``): one
        subscribed during a broker outage was once seen never to be assigned after the
        broker came back, and one whose session expired while the broker was frozen was
        seen to wait for 5 minutes with no connection of its own coming up again, though
        the broker served the other stages. Not counted as a reset: the group may be
        slow, nothing implies a second instance."""
        now = time.monotonic()
        if not watchdog_due(now, self._unassigned_since, self._broker_up_at, self.settings.assign_wait_ms / 1000):
            return
        assert self._unassigned_since is not None
        seen = "though the broker is up" if now - self._broker_up_at <= BROKER_UP_RECENT_S else \
            "and no broker connection of its own up"
        log.warning("no partitions assigned %.0f s after subscribing or losing them, %s; starting a new consumer",
                    now - self._unassigned_since, seen)
        self._replace_consumer()

    def _replace_consumer(self) -> None:
        """A new consumer in place of the current one: its partitions are given up as in
        a revocation, the old consumer is dropped uncalled (``neardup.kafka.bounded.discard``),
        and the new one subscribes; the partitions resume at the group's committed offsets."""
        old, self.consumer = self.consumer, None
        self._revoked(old, list(self.assignment))
        discard(old)
        del old
        self.consumer = _Consumer(self._consumer_config())
        self._subscribe()

    def _new_producer(self) -> None:
        """A transactional producer, initialised (retried until the broker answers), in
        place of the current one, which is dropped without being called again.

        ``init_transactions`` fences any older producer of this transactional.id and
        aborts its open transaction. One that does not return in ``CALL_WAIT_S`` is
        abandoned for another new producer.
        """
        self._discard_producer()
        while True:
            self._producer_log = ProducerLog()
            producer = Producer(producer_config(self.settings, self.transactional_id, self._producer_log,
                                                self.producer_defaults))
            try:
                init_transactions(producer, self._stop)
            except ProducerWedged as exc:
                log.warning("%s; starting another producer", exc)
                discard(producer)
                del producer
                continue
            self.producer = producer
            self._failing_since = None
            log.info("transactional producer %s ready", self.transactional_id)
            return

    def _discard_producer(self) -> None:
        """Drop the producer, never to call it again (``neardup.kafka.bounded.discard``)."""
        producer, self.producer = self.producer, None
        if producer is not None:
            discard(producer)

    def _assigned(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._unassigned_since = None
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
        gone = {(p.topic, p.partition) for p in partitions}
        if self._pending is not None:
            self._join_pending(self._pending)
            self._pending.revoked |= gone
        self.assignment = [p for p in self.assignment if (p.topic, p.partition) not in gone]
        self._unchecked = [tp for tp in self._unchecked if tp not in gone]
        if self._checking is not None:  # the processor is in ``check``: told once it has ended
            self._checking.revoked |= gone
            self._checking.kept = [m for m in self._checking.kept if (m.topic(), m.partition()) not in gone]
        else:
            self.processor.revoked(gone)
        if self._intake is not None:
            self._intake.revoked(gone)
        if not self.assignment and self._unassigned_since is None:
            self._unassigned_since = time.monotonic()  # until the next assignment, even an empty one
        if self._revoked_while_reading is not None:
            self._revoked_while_reading |= gone
        log.info("revoked %s", ", ".join(f"{t}[{p}]" for t, p in sorted(gone)) or "nothing")
        if self.on_assignment:
            self.on_assignment(self.assignment)

    def _broker_answered(self) -> None:
        if self.on_broker:
            self.on_broker()

    def _statistics(self, stats_json: str) -> None:
        """librdkafka statistics callback (consumer thread): a broker connection is up."""
        try:
            brokers = orjson.loads(stats_json).get("brokers", {})
        except ValueError:
            return
        if any(b.get("nodeid", -1) >= 0 and b.get("state") == "UP" for b in brokers.values()):
            self._broker_up_at = time.monotonic()
            self._broker_answered()

    def _records_pending(self, tp: TP) -> bool:
        """Whether the consumer knows ``tp`` to have records past its position (its cached
        high watermark; no broker request)."""
        if self.consumer is None:
            return False
        try:
            position = self.consumer.position([TopicPartition(*tp)])[0].offset
            _, high = self.consumer.get_watermark_offsets(TopicPartition(*tp), cached=True)
        except KafkaException:
            return False
        return position >= 0 and high > position

    def lag(self) -> dict[TP, int]:
        """Messages behind per assigned partition: cached high watermark minus position.

        Uses the watermarks of the last fetch responses (no broker request); partitions
        whose watermark or position is not known yet are left out. Call it from the
        consumer's thread (e.g. in ``on_batch``).
        """
        if self.consumer is None or not self.assignment:
            return {}
        out: dict[TP, int] = {}
        for tp in self.consumer.position(self.assignment):
            if tp.offset < 0:
                continue
            _, high = self.consumer.get_watermark_offsets(tp, cached=True)
            if high >= 0:
                out[(tp.topic, tp.partition)] = max(0, high - tp.offset)
        return out

    # --- the loop ---------------------------------------------------------------------
    def _loop(self) -> None:
        ahead: Batch | None = None  # the next batch, read ahead (see the module docstring)
        while not self._stop.is_set():
            batch = ahead or self._consume(self.settings.batch_max_ms / 1000)
            ahead = None
            if batch is None:
                self._check_assigned()
                try:
                    self._finish_pending()  # idle: the last batch's commit is surely done
                except KafkaException as exc:
                    self._recover(exc, [])
                self.processor.idle()
                # a failed batch is retried while partitions are assigned (rewound, or due again)
                self.progress.idle(lambda: bool(self.assignment))
                if self.processor.due():
                    self.progress.in_hand()
                    try:
                        self._process(self.processor.read([], False))
                    except KafkaException as exc:
                        self._recover(exc, [])
                continue
            self.progress.in_hand()
            if not self._consumed:
                self._consumed = True
                log.info("first messages consumed: %d", len(batch.messages))
            self.processor.take(batch)  # first: work started ahead is taken in order
            if batch.full and self.processor.reads_ahead and not self._stop.is_set():
                batch, ahead = self._read_ahead(batch)
                if batch is None:
                    continue
            try:
                self._process(batch)
            except KafkaException as exc:
                if ahead is not None:
                    self.processor.take(ahead)  # and dropped
                self._recover(exc, batch.messages + (ahead.messages if ahead else []))
                ahead = None

    def _consume(self, timeout: float) -> Batch | None:
        """Up to ``batch_size`` messages, waiting at most ``timeout`` s, read by the
        processor; None if none. With a processor that orders partitions, the messages
        released in order-key order (``neardup.kafka.intake``), consumed until the batch is
        full or ``timeout`` has passed: a partition waited for must not cut batches short."""
        size = self._batch_messages()
        if self._intake is None:
            got = self._consume_once(timeout)
            if got is None or not got[1]:
                return None
            return self.processor.read(got[1], len(got[0]) == size)
        deadline = time.monotonic() + timeout
        released: list[Message] = []
        while True:
            got = self._consume_once(max(0.0, deadline - time.monotonic()))
            if got is None:  # a new consumer: what was consumed is read again from the committed offsets
                return None
            if released:  # a rebalance served in this consume: messages of partitions revoked go
                assigned = {(p.topic, p.partition) for p in self.assignment}
                released = [m for m in released if (m.topic(), m.partition()) in assigned]
            released += self._in_order(got[0], got[1], size - len(released))
            if len(released) >= size or time.monotonic() >= deadline or self._stop.is_set():
                break
        return self.processor.read(released, len(released) == size) if released else None

    def _batch_messages(self) -> int:
        """Messages per batch: ``batch_size``, or what the processor asks for (its
        ``batch_messages(batch_size)``: a stage whose messages hold many documents each)."""
        ask = getattr(self.processor, "batch_messages", None)
        return self.settings.batch_size if ask is None else ask(self.settings.batch_size)

    def _consume_once(self, timeout: float) -> tuple[list[Message], list[Message]] | None:
        """One ``consume`` call: (what it returned, the messages usable); None when the
        consumer failed and was replaced."""
        assert self.consumer is not None
        messages = self.consumer.consume(self._batch_messages(), timeout=timeout)
        fatal_error = next((m.error() for m in messages if _consumer_fatal(m.error())), None)
        if fatal_error is not None:
            self._new_consumer(fatal_error)
            return None
        unfetched = next((m.error() for m in messages if _offsets_unfetched(m.error())), None)
        if unfetched is not None:  # not counted as a reset: no second instance is implied
            log.warning("%s: the consumer would never fetch these partitions; starting a new consumer",
                        unfetched.str())
            self._replace_consumer()
            return None
        if self._unchecked:  # newly assigned partitions: before any of their messages is read
            kept = self._check(messages)
            if kept is None:
                return None
            messages = kept
        return messages, self._usable(messages)

    def _check(self, messages: list[Message]) -> list[Message] | None:
        """Hand the newly assigned partitions (``_unchecked``) to ``Processor.check`` in a
        thread of its own, while this thread keeps calling ``consume`` every
        ``CHECK_POLL_S`` (without waiting in it) with every assigned partition held
        paused (``_Consumer.hold``): a check that takes longer than
        ``max.poll.interval.ms`` (a restore from a long changelog) keeps the group
        membership, and no message is read of a partition whose check has not ended.
        Partitions assigned meanwhile are held as well and checked next; partitions revoked
        meanwhile are handed to ``Processor.revoked`` once the check has ended (the
        processor is called from one thread at a time). At the end the partitions are
        released (fetched again, unless asked paused).

        Args:
            messages: consumed with the assignment, before the check.

        Returns:
            ``messages`` and any consumed meanwhile, less those of partitions revoked
            meanwhile; None when the consumer failed meanwhile and was replaced (after
            the check had ended).

        Raises:
            what ``Processor.check`` raised (it is not retried here).
        """
        consumer = self.consumer
        assert consumer is not None and self._checking is None
        kept, checked = messages, []
        failed: KafkaError | None = None  # the consumer is unusable: replaced once the check has ended
        unfetched: KafkaError | None = None  # partitions it would never fetch: a new consumer as well
        while self._unchecked and failed is None and unfetched is None:
            tps = list(dict.fromkeys(self._unchecked))
            self._unchecked = []
            consumer.hold([(p.topic, p.partition) for p in self.assignment])
            check = self._checking = _Check(tps, threading.Event(), kept=list(kept))
            thread = threading.Thread(target=self._run_check, args=(consumer, check), name="neardup-check",
                                      daemon=True)
            started, stopping = time.monotonic(), False
            self.progress.restoring(_names(tps))
            thread.start()
            try:
                while not check.done.wait(CHECK_POLL_S):
                    if failed is not None or unfetched is not None:
                        continue
                    got = consumer.consume(self.settings.batch_size, timeout=0)
                    failed = next((m.error() for m in got if _consumer_fatal(m.error())), None)
                    unfetched = next((m.error() for m in got if _offsets_unfetched(m.error())), None)
                    new = [tp for tp in self._unchecked if tp not in consumer.held]  # assigned meanwhile
                    if new:
                        consumer.hold(new)
                    check.kept += got
                    if self._stop.is_set() and not stopping:
                        stopping = True
                        log.info("stopping once the check of %s has ended", _names(tps))
            finally:
                check.done.wait()  # never leave the processor to another call while it checks
                self._checking = None
                self.progress.restored()
                if check.revoked:
                    self.processor.revoked(check.revoked)
            kept = check.kept
            if check.error is not None:
                raise check.error
            checked += tps
            seconds = time.monotonic() - started
            if seconds >= 1.0:
                log.info("checked %s in %.1f s, held paused while the consumer kept polling", _names(tps), seconds)
        if failed is not None:
            self._new_consumer(failed)
            return None
        if unfetched is not None:
            log.warning("%s: the consumer would never fetch these partitions; starting a new consumer",
                        unfetched.str())
            self._replace_consumer()
            return None
        consumer.release(list(consumer.held))
        assigned = {(p.topic, p.partition) for p in self.assignment}
        checked = [tp for tp in dict.fromkeys(checked) if tp in assigned]
        if self._intake is not None:  # librdkafka keeps a partition paused across a rebalance
            consumer.resume([TopicPartition(t, p) for t, p in checked])
            self._intake.assigned(checked)  # their wait starts now, their messages are taken from now
        return kept

    def _run_check(self, consumer: Consumer, check: _Check) -> None:
        """``Processor.check`` of ``check.partitions`` (in the check's thread); what it
        raises is kept in ``check.error``."""
        try:
            self.processor.check(consumer, check.partitions)
        except BaseException as exc:  # noqa: BLE001 - raised again by _check
            check.error = exc
        finally:
            check.done.set()

    def _in_order(self, consumed: list[Message], usable: list[Message], limit: int) -> list[Message]:
        """Up to ``limit`` messages in order-key order, from those held and ``usable``
        (consumed now; the partition-EOF events among ``consumed`` say which partitions
        are read to their end); pauses the partitions whose held messages reach the
        intake's capacity, resumes the others."""
        assert self._intake is not None and self.consumer is not None
        keep = {id(m) for m in usable}
        self._intake.add(m for m in consumed if id(m) in keep
                         or (m.error() is not None and m.error().code() == KafkaError._PARTITION_EOF))
        released = self._intake.release(limit)
        pause, resume = self._intake.flow()
        if pause:
            self.consumer.pause([TopicPartition(t, p) for t, p in pause])
        if resume:
            self.consumer.resume([TopicPartition(t, p) for t, p in resume])
        return released

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
            if self.processor.is_output(m.topic()):
                continue
            out.append(m)
        return out

    def _read_ahead(self, batch: Batch) -> tuple[Batch | None, Batch | None]:
        """(``batch``, the next batch, handed to ``Processor.ahead``). The next batch is
        what the consumer has already fetched (no wait).

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
        if ahead is not None:
            self.processor.ahead(ahead)
        return batch, ahead

    def _without(self, batch: Batch, drop: Callable[[TP], bool]) -> Batch | None:
        """``batch`` without the messages of the partitions ``drop`` selects, read again."""
        kept = [m for m in batch.messages if not drop((m.topic(), m.partition()))]
        if len(kept) == len(batch.messages):
            return batch
        return self.processor.read(kept, full=False) if kept else None

    def _process(self, batch: Batch) -> None:
        started = time.perf_counter()
        try:
            work = self.processor.compute(batch)
        except KafkaException:
            # a request of the processor's the broker did not answer (an outage): the batch
            # fails as a produce error would, once the previous batch's commit is taken up
            # (its own failure, if it failed, is raised instead: both are rewound)
            self._finish_pending(more_in_hand=True)
            raise
        assert self.producer is not None and self.consumer is not None
        self._finish_pending(more_in_hand=True)  # the previous batch's transaction, committed meanwhile
        self._producer_log.transaction_error = None
        self._call("begin_transaction", self.producer.begin_transaction)
        written = self.processor.write(work, self.producer)
        # Step 5 in a thread: the broker's answers are waited for while this thread
        # consumes and computes the next batch; ``_finish_pending`` takes it up.
        pending = _Pending(batch.messages, written, deadline=time.monotonic() + STEP5_WAIT_S)
        metadata = self.consumer.consumer_group_metadata()
        pending.thread = threading.Thread(target=self._commit_offsets,
                                          args=(self.producer, pending, written.offsets, metadata, started),
                                          name="neardup-commit", daemon=True)
        self._pending = pending
        pending.thread.start()

    def _commit_offsets(self, producer: Producer, pending: _Pending, offsets: list[TopicPartition],
                        metadata: Any, started: float) -> None:
        """Step 5 of a batch (in its own thread): the input offsets (with the consumer
        group's ``metadata``) into the transaction, then its commit; an error is kept in
        ``pending.error`` (``ProducerWedged``: a call that did not return in time, the
        producer is never called again)."""
        try:
            if offsets:  # none: a batch of no messages (``Processor.due``)
                bounded("send_offsets_to_transaction", producer.send_offsets_to_transaction,
                        offsets, metadata, CALL_TIMEOUT_S)
            self._commit_transaction(producer)
            pending.seconds = time.perf_counter() - started
        except BaseException as exc:  # noqa: BLE001 - raised again by _finish_pending
            pending.error = exc

    def _join_pending(self, pending: _Pending) -> None:
        """Wait for step 5's thread until its deadline; still running then, it counts as
        wedged (``pending.error``)."""
        assert pending.thread is not None
        pending.thread.join(max(0.0, pending.deadline - time.monotonic()))
        if pending.thread.is_alive() and pending.error is None:
            pending.error = ProducerWedged("step 5 (offsets and commit)", STEP5_WAIT_S)

    def _finish_pending(self, more_in_hand: bool = False) -> None:
        """Wait for the batch whose transaction is committing, then count it (or raise);
        ``more_in_hand``: a later batch is held (for ``Progress.committed``).

        Raises:
            KafkaException: its offsets or commit failed; its messages are rewound with
                those of the failing batch (``_recover``).
        """
        pending, self._pending = self._pending, None
        if pending is None:
            return
        self._join_pending(pending)
        if pending.error is not None:
            # a partition revoked meanwhile is not rewound: its next owner (maybe this
            # consumer again) resumes at the group's committed offset, which a processor
            # may keep before the batch's first offset (records it still holds)
            self._unsettled = [m for m in pending.messages if (m.topic(), m.partition()) not in pending.revoked]
            if isinstance(pending.error, ProducerWedged):
                self._discard_producer()
            raise pending.error
        result = self.processor.committed(pending.written, pending.seconds)
        if pending.messages or not self._input_failed:
            # a batch of no messages (``Processor.due``) committing is no progress for
            # input whose batch keeps failing
            self.progress.committed(more_in_hand)
            self._input_failed = False
        self._backoff, self._resets = 0.5, 0
        self._failing_since = None
        self.batches += 1
        self._broker_answered()
        if self.on_batch:
            self.on_batch(result)

    def _recover(self, exc: KafkaException, messages: list[Message]) -> None:
        """After a failed batch (``messages``, and those of a batch whose commit failed
        in the background): a new producer (fatal error) or an aborted transaction,
        the partitions rewound to the first offsets, a backoff.

        Raises:
            KafkaException: ``exc``, when it is the fatal error ``MAX_PRODUCER_RESETS`` + 1
                in a row.
        """
        assert self._pending is None  # ``_process`` and the idle loop take it up first
        # The first failure since the last commit is logged; the retries of a batch that
        # keeps failing go to the debug log, the stall is logged once a minute (``Progress``).
        self._input_failed = self._input_failed or bool(self._unsettled or messages)
        cause = getattr(self.processor, "cause", None)
        why = cause() if cause is not None else None
        if why is None and not isinstance(exc, ProducerWedged) and self.producer is not None:
            why = self._transaction_error(exc)
        level = logging.WARNING if self.progress.failed(f"{why} ({exc})" if why else exc) == 1 else logging.DEBUG
        if self._failing_since is None:
            self._failing_since = time.monotonic()
        if isinstance(exc, ProducerWedged) or self.producer is None:
            # librdkafka's own timeout did not hold (a broker restarted under a call):
            # the producer is dropped uncalled; a new one fences it and the broker aborts
            # its transaction. Not counted as a reset: no second instance is implied.
            log.warning("%s; starting a new producer", exc)
            self._new_producer()
        elif fatal(exc):
            # e.g. the broker aborted a transaction that outlived its timeout and bumped
            # the producer epoch: a new producer (same transactional.id) resumes; the
            # replay rule makes it exact.
            self._resets += 1
            if self._resets > MAX_PRODUCER_RESETS:
                raise exc
            log.warning("producer failed fatally (%s); starting a new one", exc)
            self._new_producer()
        elif _timed_out(exc) and time.monotonic() - self._failing_since > TRANSACTION_RETRY_S:
            # Seen after a broker outage: a request to the transaction coordinator stays
            # queued on a connection that never comes back, and every batch's
            # send_offsets_to_transaction times out while its abort succeeds. A new
            # producer fences this one and connects afresh. (Not for errors the broker
            # returns: a refused record, a transaction still being aborted.)
            log.warning("batches have failed for %.0f s with this producer (%s); starting a new producer",
                        time.monotonic() - self._failing_since, exc)
            self._new_producer()
        else:
            log.log(level, "batch failed (%s); aborting and retrying in %.1f s", exc, self._backoff)
            self._abort()
        self._rewind(self._unsettled + messages)
        self._unsettled = []
        self.processor.aborted()
        if self.on_abort:
            self.on_abort(exc)
        self._stop.wait(self._backoff)
        self._backoff = min(self._backoff * 2, 30.0)

    def _transaction_error(self, exc: KafkaException) -> str | None:
        """The transaction error the producer logged (``ProducerLog``), when ``exc`` does
        not say it already: a record the broker refused fails the transaction, and the
        call that finds it failed may say "Erroneous state" only. The producer's queue is
        served first (``poll(0)``): the line is queued before the state changes."""
        assert self.producer is not None
        try:
            self.producer.poll(0)
        except KafkaException:  # poll raises the producer's fatal error, which says why itself
            return None
        error = self._producer_log.transaction_error
        if error is None or (isinstance(exc.args[0], KafkaError) and exc.args[0].str() in error):
            return None
        return error

    # --- transactional calls ------------------------------------------------------------
    def _commit_transaction(self, producer: Producer) -> None:
        for attempt in Retrying(
            retry=retry_if_exception(retriable),
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
            if fatal(exc):
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
            retry=retry_if_exception(lambda e: isinstance(e, KafkaException) and not fatal(e)
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
        first: dict[TP, int] = {}
        for m in messages:
            tp = (m.topic(), m.partition())
            first[tp] = min(first.get(tp, m.offset()), m.offset())
        assigned = {(p.topic, p.partition) for p in self.assignment}
        for (topic, partition), offset in first.items():
            if (topic, partition) in assigned:
                self.consumer.seek(TopicPartition(topic, partition, offset))
        if self._intake is not None:  # held messages after the seek are consumed again
            self._intake.drop(first)
