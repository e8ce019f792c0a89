"""The state's changelog in Kafka: written inside each batch's transaction, read back to
restore a store that is missing, empty or behind (the model of Kafka Streams' changelog
topics and quix-streams' ``state/recovery``).

The changelog is a compacted topic (default ``<group>.neardup-changelog``) with one
partition: the state is one partition, held by one process. Each record is one stored
key, its latest value or a tombstone (layout: ``neardup.state.codec``), so compaction
keeps exactly the live state. The store passes the records of every write to
``ChangelogWriter`` (``store.log``), which produces them into the open transaction; so
the changelog never holds a batch whose outputs were aborted, and never lacks one whose
outputs were committed, once the changes the store had not seen confirmed are produced
again (``store.unconfirmed_records()``: at start, and at the beginning of every
transaction after an aborted one).

Two meta records travel with the state (``StateUpdate.meta``): ``changelog_batch``, a
counter of the transactions that wrote to the changelog, and ``changelog_end``, the
changelog's offset after the last transaction known committed when the batch was
written. On start, before the consumer subscribes (``ChangelogWriter.start``):

- the store is empty (deleted, or a fresh directory), or a restore was interrupted, and
  the changelog holds records: the store is wiped and restored from the changelog
  (``read_committed``, from its first offset to its end), then loaded.
- the store was never logged (a store from before the changelog, or a fresh one) and the
  changelog is empty, or the changelog is another topic than the one the store wrote to
  (deleted and created again: another topic id, or an end before ``changelog_end``): the
  whole store is written to the changelog (a *seed*), in transactions of
  ``SEED_RECORDS`` records.
- the changelog holds a ``changelog_batch`` above the store's, from ``changelog_end`` on:
  the store is an older copy (behind the changelog); it is wiped and restored.
- otherwise the store is current, or one transaction ahead (its last batch's transaction
  was aborted or never committed): the changes not confirmed are produced again. The
  ahead store is rolled forward rather than back: the replay of that batch's messages
  produces their stored outputs, so state and outputs agree again (rolling back would
  make them be processed anew, with the same verdicts, after a full restore).

Then one transaction produces the unconfirmed changes and the meta records, and the
consumer starts.
"""

from __future__ import annotations

import logging
import struct
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, Message, Producer, TopicCollection, TopicPartition
from confluent_kafka.admin import AdminClient, ConfigResource

from neardup.config import Settings
from neardup.kafka.bounded import CALL_TIMEOUT_S, bounded, discard
from neardup.kafka.clients import admin_config, produce_in_order
from neardup.kafka.limits import TopicLimits, input_limits, internal_max_bytes
from neardup.kafka.rdkafka_log import rdkafka_logger
from neardup.kafka.topics import create_missing, new_topic
from neardup.state import codec
from neardup.state.base import StateError, StateUpdate

if TYPE_CHECKING:
    from neardup.state.kv import KeyValueStateStore

log = logging.getLogger(__name__)

Record = tuple[bytes, bytes | None]

BATCH_META = b"changelog_batch"
END_META = b"changelog_end"
TOPIC_ID_META = b"changelog_topic_id"
#: Records per transaction when the whole store is written to an empty changelog.
SEED_RECORDS = 50_000
#: Records asked for per ``consume`` while restoring.
RESTORE_CHUNK = 20_000
#: The changelog topic's ``max.message.bytes`` when neardup creates it: a document's
#: fingerprint set takes 4 bytes a shingle, up to about 4 bytes a character of its text.
CHANGELOG_MAX_BYTES = 64 << 20
_U64 = struct.Struct("<Q")


class ChangelogError(StateError):
    """The changelog topic cannot be used (the message says why, in one line)."""


@dataclass
class RestoreStats:
    """What a restore read: records, bytes (keys and values), seconds."""

    records: int = 0
    bytes: int = 0
    seconds: float = 0.0


def changelog_topic(settings: Settings) -> str:
    return settings.changelog_topic or f"{settings.group_id}.neardup-changelog"


class ChangelogWriter:
    """Produces a store's changes to its changelog topic, inside the open transaction,
    and restores the store from it at start.

    Args:
        settings: Kafka settings (``changelog_topic``, or ``<group>.neardup-changelog``).
        on_restore: called with True when a restore begins, then with its ``RestoreStats``
            when it ends (readiness and metrics).

    The instance is the store's ``log`` hook (``__call__``): outside a transaction (the
    writes a store makes while it opens) it produces nothing; those changes are among the
    store's unconfirmed ones, produced at start.
    """

    def __init__(self, settings: Settings, on_restore: Callable[[bool | RestoreStats], None] | None = None) -> None:
        self.settings = settings
        self.topic = changelog_topic(settings)
        self.on_restore = on_restore
        self.producer: Producer | None = None  # the open transaction's, None outside one
        self.end = 0  # offset after the last record delivered (of the last transaction)
        self.batch = 0  # the ``changelog_batch`` counter of the last transaction
        self._awaiting = False  # a transaction's records are produced, its commit not seen
        self._skip_confirm = False  # the store wrote outside a transaction meanwhile

    # --- writing ----------------------------------------------------------------------
    def __call__(self, records: list[Record]) -> None:
        """Produce ``records`` into the open transaction (none open: nothing).

        Raises:
            KafkaException: ``produce`` failed (the transaction must abort).
        """
        producer = self.producer
        if producer is None:
            # A write outside a transaction (opening, the state check): its changes stay
            # unconfirmed, produced at the start of the next transaction, even when the
            # transaction awaited now commits.
            self._skip_confirm = self._skip_confirm or (self._awaiting and bool(records))
            return
        # A delivery report for the last record only (records of one partition are
        # delivered in order): the end offset. A failed record fails the commit.
        produce_in_order(producer, self.topic, 0, records, self._delivered)

    def _delivered(self, err: KafkaError | None, msg: Message) -> None:
        if err is None:  # a failed record fails the transaction's commit
            self.end = max(self.end, msg.offset() + 1)

    def begin(self, producer: Producer, store: KeyValueStateStore) -> dict[bytes, bytes]:
        """The transaction of ``producer`` is open: the store's unconfirmed changes go into
        it first (after an aborted transaction, a crash, or writes outside one), and the
        store's writes from now on. Returns the meta records for the batch's update.

        Raises:
            KafkaException: ``produce`` failed.
        """
        self.producer = producer
        self._awaiting = True
        self(store.unconfirmed_records())
        self.batch += 1
        return {BATCH_META: _U64.pack(self.batch), END_META: _U64.pack(self.end)}

    def end_transaction(self) -> None:
        """The batch's records are all produced (its commit is yet to come)."""
        self.producer = None

    def confirm(self, store: KeyValueStateStore) -> None:
        """The transaction is committed: the store forgets its unconfirmed changes (unless
        it wrote outside the transaction meanwhile: they are produced with the next)."""
        self._awaiting = False
        if self._skip_confirm:
            self._skip_confirm = False
            return
        store.confirm()

    # --- start ------------------------------------------------------------------------
    def start(self, store: KeyValueStateStore, producer: Producer) -> None:
        """Bring the store and the changelog in line (see the module docstring), then
        produce the store's unconfirmed changes in one transaction and confirm them.

        Raises:
            ChangelogError: the topic exists and is not compacted, or cannot be created.
            KafkaException: a Kafka call failed (retried by the caller with a new producer).
            SettingsMismatchError: the restored state was built with other settings.
        """
        admin = AdminClient(admin_config(self.settings))
        try:
            topic_id = self._ensure_topic(admin)
            low, high = self._watermarks()
            action = self._plan(store, topic_id, low, high)
            if action == "restore":
                self._restore(store, low, high)
            elif action == "seed":
                self._seed(store, producer)
            self.batch, self.end = _u64(store.get_meta(BATCH_META)) or 0, self._watermarks()[1]
            # One transaction: what the store has not seen confirmed, and the meta records.
            self._transaction(producer, lambda: store.commit(empty_update(
                store, {**self.begin(producer, store), TOPIC_ID_META: topic_id.encode()})))
            self.confirm(store)
        finally:
            discard(admin)

    def _plan(self, store: KeyValueStateStore, topic_id: str, low: int, high: int) -> str:
        """"restore", "seed" or "current" (see the module docstring), logged."""
        batch = _u64(store.get_meta(BATCH_META))
        end = _u64(store.get_meta(END_META)) or 0
        if store.restoring() or store.is_empty():
            return "restore" if self._has_records(low, high) else "seed"  # seed: a fresh store's settings
        if batch is None and self._has_records(low, high):
            log.warning("state in %s was never written to changelog %s, which holds records: "
                        "restoring from the changelog", self.settings.state_dir, self.topic)
            return "restore"
        if batch is None or store.get_meta(TOPIC_ID_META) != topic_id.encode() or end > high:
            if batch is not None:
                log.warning("changelog %s is not the one this state was written to (created again, or "
                            "truncated)", self.topic)
            log.info("writing the whole state to changelog %s", self.topic)
            return "seed"
        if self._newer_batch(end, high, batch):
            log.warning("the state in %s is behind changelog %s (an older copy): restoring from it",
                        self.settings.state_dir, self.topic)
            return "restore"
        return "current"

    def _transaction(self, producer: Producer, body: Callable[[], None]) -> None:
        """``body()`` (producing) in a transaction of its own.

        Raises:
            KafkaException: a call failed or did not return (``ProducerWedged``).
        """
        bounded("begin_transaction", producer.begin_transaction)
        self.producer = producer
        try:
            body()
            self.end_transaction()
            bounded("commit_transaction", producer.commit_transaction, CALL_TIMEOUT_S)
        except BaseException:
            self.end_transaction()
            self._awaiting = False
            try:
                bounded("abort_transaction", producer.abort_transaction, CALL_TIMEOUT_S)
            except KafkaException as exc:
                log.warning("abort_transaction: %s", exc)
            raise

    def _seed(self, store: KeyValueStateStore, producer: Producer) -> None:
        """Write every record of the store to the changelog, ``SEED_RECORDS`` a transaction
        (idempotent: a crash midway seeds again at the next start)."""
        started, count = time.perf_counter(), 0
        for chunk in store.snapshot_records(SEED_RECORDS):
            self._transaction(producer, lambda chunk=chunk: self(chunk))
            count += len(chunk)
        log.info("wrote %d records to changelog %s in %.1f s", count, self.topic, time.perf_counter() - started)

    # --- reading ----------------------------------------------------------------------
    def _reader(self) -> Consumer:
        return Consumer({
            "bootstrap.servers": self.settings.bootstrap_servers, "logger": rdkafka_logger(),
            **self.settings.kafka,
            "group.id": f"neardup-restore-{uuid.uuid4()}", "enable.auto.commit": False,
            "enable.partition.eof": True, "isolation.level": "read_committed",
            "auto.offset.reset": "earliest", "fetch.max.bytes": 64 << 20,
            "max.partition.fetch.bytes": 16 << 20, "queued.max.messages.kbytes": 256 << 10,
        })

    def _watermarks(self) -> tuple[int, int]:
        reader = self._reader()
        try:
            return reader.get_watermark_offsets(TopicPartition(self.topic, 0), timeout=30)
        finally:
            reader.close()

    def _read(self, start: int, high: int) -> Iterator[list[Record]]:
        """Chunks of the committed records from offset ``start`` to the end."""
        if start >= high:
            return
        reader = self._reader()
        try:
            reader.assign([TopicPartition(self.topic, 0, start if start > 0 else OFFSET_BEGINNING)])
            while True:
                # consume waits for its count or its timeout, the end of the partition
                # counting as one message: a short timeout, not to wait at the end.
                messages = reader.consume(RESTORE_CHUNK, timeout=0.2)
                chunk: list[Record] = []
                done = False
                for m in messages:
                    err = m.error()
                    if err is not None:
                        if err.code() == KafkaError._PARTITION_EOF:
                            done = True
                            continue
                        raise KafkaException(err)
                    chunk.append((m.key(), m.value()))
                if chunk:
                    yield chunk
                if done:
                    return
        finally:
            reader.close()

    def _has_records(self, low: int, high: int) -> bool:
        """Whether the committed part of the changelog holds any record."""
        return any(True for _ in self._read(low, high)) if high > low else False

    def _newer_batch(self, start: int, high: int, batch: int | None) -> bool:
        """Whether the changelog from ``start`` holds a ``changelog_batch`` above ``batch``."""
        key = codec.changelog_key("default", codec.META_PREFIX + BATCH_META)
        for chunk in self._read(start, high):
            for k, v in chunk:
                if k == key and v is not None and _U64.unpack(v)[0] > (batch or 0):
                    return True
        return False

    def _restore(self, store: KeyValueStateStore, low: int, high: int) -> None:
        """Wipe the store and apply the changelog's records to it, then load it."""
        if self.on_restore:
            self.on_restore(True)
        stats = RestoreStats()
        started = last_log = time.perf_counter()
        log.info("restoring the state from changelog %s (offsets %d to %d)", self.topic, low, high)
        store.wipe()
        for chunk in self._read(low, high):
            store.apply(chunk)
            stats.records += len(chunk)
            stats.bytes += sum(len(k) + (len(v) if v is not None else 0) for k, v in chunk)
            if time.perf_counter() - last_log > 10:
                last_log = time.perf_counter()
                log.info("restoring: %d records, %.1f MB, %.0f s", stats.records, stats.bytes / 1e6,
                         last_log - started)
        store.finish_restore()
        stats.seconds = time.perf_counter() - started
        log.info("restored %d documents from changelog %s: %d records, %.1f MB in %.1f s",
                 store.next_seq(), self.topic, stats.records, stats.bytes / 1e6, stats.seconds)
        if self.on_restore:
            self.on_restore(stats)

    # --- the topic --------------------------------------------------------------------
    def _ensure_topic(self, admin: AdminClient) -> str:
        """The changelog topic's id, the topic created (compacted, one partition,
        ``--topic-replication-factor`` replicas) if missing.

        Raises:
            ChangelogError: it exists without ``cleanup.policy=compact``, or cannot be created.
            TopicCreationError: the broker refused the creation for what was asked.
        """
        try:
            return self._describe(admin)
        except KafkaException as exc:
            if exc.args[0].code() != KafkaError.UNKNOWN_TOPIC_OR_PART:
                raise
        try:  # a record holds a document's shingle set: sized for the input topics' largest
            largest = input_limits(TopicLimits(admin_config(self.settings)), self.settings.input_topics)
        except KafkaException as exc:
            log.warning("max.message.bytes of the input topics not read (%s)", exc.args[0].str())
            largest = []
        config = {"cleanup.policy": "compact",
                  "max.message.bytes": str(internal_max_bytes(largest, CHANGELOG_MAX_BYTES))}
        try:
            create_missing(admin, [new_topic(self.topic, 1, self.settings.topic_replication_factor, config)])
        except KafkaException as exc:
            raise ChangelogError(f"cannot create the changelog topic {self.topic}: {exc.args[0].str()}") from exc
        return self._describe(admin)

    def _describe(self, admin: AdminClient) -> str:
        description = admin.describe_topics(TopicCollection([self.topic]), request_timeout=30)[self.topic].result()
        resource = ConfigResource(ConfigResource.Type.TOPIC, self.topic)
        config = admin.describe_configs([resource], request_timeout=30)[resource].result()
        policy = config["cleanup.policy"].value if "cleanup.policy" in config else ""
        if "compact" not in policy:
            raise ChangelogError(f"the changelog topic {self.topic} has cleanup.policy={policy}; it must be "
                                 "compact (or give another --changelog-topic)")
        return str(description.topic_id)


def empty_update(store: KeyValueStateStore, meta: dict[bytes, bytes]) -> StateUpdate:
    """A state update without documents, writing ``meta`` only."""
    return StateUpdate(first_seq=store.next_seq(), signatures=np.empty((0, store.num_perm), np.uint64),
                       ids=[], meta=meta)


def _u64(raw: bytes | None) -> int | None:
    return None if raw is None else _U64.unpack(raw)[0]
