"""Reading one partition of a topic from its first committed record to its end: the
restore of a stage's state from its changelog partition (Kafka Streams' model)."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterator
from typing import TypeVar

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, Message, TopicPartition
from confluent_kafka.admin import AdminClient
from tenacity import Retrying, retry_if_exception, stop_never, wait_exponential

from neardup.config import Settings
from neardup.kafka.clients import admin_config
from neardup.kafka.rdkafka_log import rdkafka_logger
from neardup.kafka.topics import topic_config

log = logging.getLogger(__name__)
CHUNK = 10_000
T = TypeVar("T")


def with_retries(what: str, restore: Callable[[], T]) -> T:
    """``restore()``, started again from scratch after an error of the broker or the
    client that is not fatal (a broker restarting answers "unknown partition" or times
    out for a while), with exponential backoff up to 10 s, for as long as it takes: a
    restore builds its state anew, so a second attempt is exact.

    Raises:
        KafkaException: a fatal error.
    """
    for attempt in Retrying(
        retry=retry_if_exception(lambda e: isinstance(e, KafkaException) and not e.args[0].fatal()),
        wait=wait_exponential(multiplier=0.5, max=10), stop=stop_never, reraise=True,
        before_sleep=lambda rs: log.warning("%s: %s; retrying", what, rs.outcome.exception()),
    ):
        with attempt:
            return restore()
    raise AssertionError("unreachable")


def _reader(settings: Settings) -> Consumer:
    return Consumer({
        "bootstrap.servers": settings.bootstrap_servers, "logger": rdkafka_logger(), **settings.kafka,
        "group.id": f"neardup-restore-{uuid.uuid4()}", "enable.auto.commit": False,
        "enable.partition.eof": True, "isolation.level": "read_committed",
        "auto.offset.reset": "earliest",
    })


class AheadOfTopicError(Exception):
    """A store's position lies beyond the end of its topic partition: the topic was
    deleted and created again, and the store describes the old one."""


def read_to_end(settings: Settings, topic: str, partition: int, start: int = 0,
                until: int | None = None) -> Iterator[list[Message]]:
    """Chunks of the committed records of one partition (``read_committed``), from offset
    ``start`` (or the first record, if later) to the end at the time of reading, or to
    offset ``until`` (excluded; the chunk that reaches it may hold records beyond).

    Raises:
        KafkaException: a consume error other than the partition's end.
        AheadOfTopicError: ``start`` is beyond the partition's end.
    """
    reader = _reader(settings)
    try:
        low, high = reader.get_watermark_offsets(TopicPartition(topic, partition), timeout=30)
        if start > high:
            raise AheadOfTopicError(f"position {start} is beyond the end of {topic}[{partition}] ({high})")
        if until is not None:
            high = min(high, until)
        if high <= max(low, start):
            return
        reader.assign([TopicPartition(topic, partition, start if start > low else OFFSET_BEGINNING)])
        while True:
            messages = reader.consume(CHUNK, timeout=0.2)
            chunk: list[Message] = []
            done = False
            for m in messages:
                err = m.error()
                if err is not None:
                    if err.code() == KafkaError._PARTITION_EOF:
                        done = True
                        continue
                    raise KafkaException(err)
                chunk.append(m)
            if chunk:
                yield chunk
            if done or reader.position([TopicPartition(topic, partition)])[0].offset >= high:  # the end at the start
                return
    finally:
        reader.close()


def catch_up(settings: Settings, topic: str, partition: int, position: int | None,
             apply: Callable[[list[Message]], None], wipe: Callable[[], None],
             age_ms: int | None = None) -> tuple[int | None, int]:
    """Bring a local view of one topic partition (a state store, a global table) up to the
    partition's end: ``apply`` its committed records in chunks from ``position`` on. With
    no position (a new view), or one beyond the partition's end (the topic was deleted and
    created again: the view describes the old one, logged), the view is ``wipe``d first and
    the partition read from its start. ``apply`` writes a chunk together with the position
    after it, so a catch-up cut short resumes where it stopped.

    A view whose position was written (``age_ms`` ago) longer than the topic's
    ``delete.retention.ms`` before, with records past it, is read in full as well (logged):
    compaction may have removed the tombstones of keys it holds, which reading from the
    position would never delete.

    Returns:
        (the position read from, None when read in full; the records read).

    Raises:
        KafkaException: a consume error other than the partition's end.
    """
    def read(start: int | None) -> int:
        if start is None:
            wipe()
        n = 0
        for chunk in read_to_end(settings, topic, partition, start or 0):
            apply(chunk)
            n += len(chunk)
        return n

    stale = _tombstones_may_be_gone(settings, topic, partition, position, age_ms)
    if stale:
        log.warning("%s; read in full", stale)
        return None, read(None)
    try:
        return position, read(position)
    except AheadOfTopicError as exc:
        log.warning("%s; the topic was created again: read in full", exc)
        return None, read(None)


#: delete.retention.ms per topic, with when it was read (time.monotonic()).
_DELETE_RETENTION: dict[tuple[str | None, str], tuple[float, int]] = {}
DELETE_RETENTION_TTL_S = 300.0


def delete_retention_ms(settings: Settings, topic: str) -> int:
    """The topic's ``delete.retention.ms`` (how long compaction keeps a tombstone), read
    with the admin client, kept for ``DELETE_RETENTION_TTL_S``.

    Raises:
        KafkaException: the broker did not answer, or refused the request.
    """
    key = (settings.bootstrap_servers, topic)
    cached = _DELETE_RETENTION.get(key)
    if cached is not None and time.monotonic() - cached[0] < DELETE_RETENTION_TTL_S:
        return cached[1]
    value = int(topic_config(AdminClient(admin_config(settings)), topic)["delete.retention.ms"])
    _DELETE_RETENTION[key] = (time.monotonic(), value)
    return value


def _tombstones_may_be_gone(settings: Settings, topic: str, partition: int, position: int | None,
                            age_ms: int | None) -> str | None:
    """Why a view at ``position``, written ``age_ms`` ago, must be read in full (see
    ``catch_up``); None when reading from its position is exact."""
    if position is None or age_ms is None:
        return None
    retention = delete_retention_ms(settings, topic)
    if age_ms <= retention:
        return None
    reader = _reader(settings)
    try:
        _, high = reader.get_watermark_offsets(TopicPartition(topic, partition), timeout=30)
    finally:
        reader.close()
    if high <= position:
        return None  # nothing written since: nothing missed
    return (f"the view of {topic}[{partition}] was last brought to offset {position} {age_ms / 3.6e6:.1f} h ago, "
            f"longer than the topic's delete.retention.ms ({retention / 3.6e6:.1f} h): compaction may have "
            f"removed tombstones of keys it holds")
