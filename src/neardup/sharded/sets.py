"""The shard stage's reader of the set topic (``<app>.sets``, docs/scale-out.md): each
document's shingle set, written once by prepare, however many shard partitions the
document touches, as Kafka Streams reads a global table.

A band record sent without its sets names its batch's set records (``SETS_HEADER``: the
set topic's partition and their offsets); prepare commits them in the band record's
transaction, so a band record read committed has its set records committed before it.
``SetReader.sets`` returns their sets by order key, read once and kept (least recently
used first out, above ``cache_bytes``): the band records of one prepare batch on every
shard partition a process holds name the same set records. A process reads the set
partitions forward from the first offset asked; an offset behind that (a restore, a
band partition read again) or far ahead seeks there.
"""

from __future__ import annotations

import logging
import struct
import time
import uuid
from collections import OrderedDict

import numpy as np
from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from neardup.config import Settings
from neardup.kafka.rdkafka_log import rdkafka_logger
from neardup.sharded.records import parse_sets, parse_sets_ref

log = logging.getLogger(__name__)

#: Bytes of set records kept read (their values) by a shard process.
CACHE_BYTES = 256 << 20
#: An offset this far past a partition's position is sought, not read up to.
SEEK_AHEAD = 1_000
#: The set reader's ``fetch.wait.max.ms`` (librdkafka's default: 500).
FETCH_WAIT_MS = 50
#: The longest wait for a set record, seconds (past it the batch fails and is retried).
WAIT_S = 60.0


class SetRecordGoneError(ValueError):
    """A set record a band record names is not in the set topic (deleted, or the topic
    created again)."""

    def __init__(self, topic: str, partition: int, offset: int) -> None:
        super().__init__(f"set record {topic}[{partition}]@{offset} is gone")
        self.topic, self.partition, self.offset = topic, partition, offset


class SetReader:
    """The sets of the set records that band records name, read from the set topic.

    Args:
        settings: the client settings (``bootstrap_servers``, ``kafka``).
        topic: the set topic.
        cache_bytes: bytes of set records kept read.
    """

    def __init__(self, settings: Settings, topic: str, cache_bytes: int = CACHE_BYTES) -> None:
        self.settings = settings
        self.topic = topic
        self.cache_bytes = cache_bytes
        self._consumer: Consumer | None = None
        self._next: dict[int, int] = {}  # partition -> the offset after the last record read
        # (partition, offset) -> (its sets by order key, its bytes), least recently used first
        self._cache: OrderedDict[tuple[int, int], tuple[dict[bytes, np.ndarray], int]] = OrderedDict()
        self._held = 0

    def sets(self, ref: bytes) -> dict[bytes, np.ndarray]:
        """Order key -> uint32 shingle set of every document of the set records ``ref``
        names (a band record's ``SETS_HEADER``).

        Raises:
            ValueError: ``ref``, or a set record it names, of another layout.
            SetRecordGoneError: a set record it names is gone.
            KafkaException: the broker did not give it within ``WAIT_S``.
        """
        partition, offsets = parse_sets_ref(ref)
        if len(offsets) == 1:
            return self._record(partition, offsets[0])
        out: dict[bytes, np.ndarray] = {}
        for offset in offsets:
            out.update(self._record(partition, offset))
        return out

    def close(self) -> None:
        if self._consumer is not None:
            self._consumer.close()
            self._consumer = None

    def _record(self, partition: int, offset: int) -> dict[bytes, np.ndarray]:
        key = (partition, offset)
        cached = self._cache.get(key)
        if cached is not None:
            self._cache.move_to_end(key)
            return cached[0]
        consumer = self._reader()
        at = self._next.get(partition)
        if at is None:
            consumer.incremental_assign([TopicPartition(self.topic, partition, offset)])
            self._next[partition] = offset
        elif offset < at or offset > at + SEEK_AHEAD:
            consumer.incremental_unassign([TopicPartition(self.topic, partition)])
            consumer.incremental_assign([TopicPartition(self.topic, partition, offset)])
            self._next[partition] = offset
        deadline = time.monotonic() + WAIT_S
        asked = time.monotonic()  # when the partition's offsets were last asked (once a second while waiting)
        while key not in self._cache:
            if self._next[partition] > offset:
                raise SetRecordGoneError(self.topic, partition, offset)
            if time.monotonic() > deadline:
                raise KafkaException(KafkaError(KafkaError._TIMED_OUT,
                                                f"set record {self.topic}[{partition}]@{offset} not read in {WAIT_S:.0f} s"))
            # what has arrived, else the next record to arrive (``consume`` waits for all
            # the messages asked or the timeout)
            got = consumer.consume(512, timeout=0) or consumer.consume(1, timeout=0.5)
            if not got and time.monotonic() - asked > 1.0:
                # a set record is committed before the band record naming it: one below the
                # partition's first offset, or at or past its end, was deleted (or the topic
                # made anew), and no record will come to show it
                asked = time.monotonic()
                low, high = consumer.get_watermark_offsets(TopicPartition(self.topic, partition), timeout=10)
                if not low <= offset < high:
                    raise SetRecordGoneError(self.topic, partition, offset)
            for m in got:
                err = m.error()
                if err is not None:
                    if err.code() != KafkaError._PARTITION_EOF:
                        log.warning("set topic %s: %s", self.topic, err)
                    continue
                p, o = m.partition(), m.offset()
                if o < self._next.get(p, 0):  # before a seek took effect
                    continue
                self._next[p] = o + 1
                value = m.value() or b""
                try:
                    sets = parse_sets(value)
                except (ValueError, struct.error) as exc:
                    if (p, o) == key:
                        raise ValueError(f"set record {self.topic}[{p}]@{o}: {exc}") from exc
                    log.error("set topic %s[%d]@%d: not a set record (%s); skipped", self.topic, p, o, exc)
                    continue
                self._put((p, o), sets, len(value))
        return self._cache[key][0]

    def _put(self, key: tuple[int, int], sets: dict[bytes, np.ndarray], size: int) -> None:
        self._cache[key] = (sets, size)
        self._held += size
        while self._held > self.cache_bytes and len(self._cache) > 1:
            _, (_, gone) = self._cache.popitem(last=False)
            self._held -= gone

    def _reader(self) -> Consumer:
        if self._consumer is None:
            self._consumer = Consumer({
                "bootstrap.servers": self.settings.bootstrap_servers, "logger": rdkafka_logger(),
                **self.settings.kafka, "group.id": f"neardup-sets-{uuid.uuid4()}", "enable.auto.commit": False,
                "enable.partition.eof": False, "isolation.level": "read_committed",
                "auto.offset.reset": "earliest", "queued.max.messages.kbytes": 65536,
                # a set record is asked for just after its transaction committed; a fetch
                # the broker holds at the partition's end waits up to fetch.wait.max.ms
                "fetch.wait.max.ms": FETCH_WAIT_MS,
            })
        return self._consumer
