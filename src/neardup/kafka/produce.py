"""Replay JSONL files into a Kafka topic (``neardup produce``): demos, load and tests.

Each non-blank line becomes one message: the value is the line's bytes as they are
(newline removed, never re-encoded, so a malformed line reaches the topic malformed), the
key is the line's ``id_field`` when the line is a JSON object that has it, else no key.
"""

from __future__ import annotations

import gzip
import logging
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import IO

import orjson
from confluent_kafka import KafkaError, Message, Producer

from neardup.config import FILE_ID_FIELD
from neardup.kafka.limits import PRODUCER_MAX_BYTES
from neardup.records import RecordError, record_id

log = logging.getLogger(__name__)


class ProduceError(RuntimeError):
    """Some messages were not delivered; ``str(error)`` names the first failures."""


@dataclass
class ProduceSummary:
    """What ``produce_files`` sent: messages, value bytes, seconds of wall-clock time."""

    messages: int = 0
    bytes: int = 0
    seconds: float = 0.0


@contextmanager
def _open_bytes(path: str) -> Iterator[IO[bytes]]:
    if path == "-":
        yield sys.stdin.buffer
    elif path.endswith(".gz"):
        with gzip.open(path, "rb") as f:
            yield f
    else:
        with open(path, "rb") as f:
            yield f


def line_key(line: bytes, id_field: str | None) -> bytes | None:
    """The message key of one JSONL line: its ``id_field`` value, UTF-8, or None."""
    if not id_field:
        return None
    try:
        doc_id = record_id(orjson.loads(line), id_field)
    except (ValueError, RecordError):  # not JSON (orjson.JSONDecodeError), or an id of another type
        return None
    return doc_id.encode("utf-8") if doc_id is not None else None


def produce_files(
    paths: list[str],
    topic: str,
    bootstrap_servers: str,
    id_field: str | None = FILE_ID_FIELD,
    kafka: dict[str, str] | None = None,
    limit: int | None = None,
    rate: float | None = None,
    timeout: float = 60.0,
) -> ProduceSummary:
    """Produce every line of ``paths`` (JSONL, ``.gz``, or ``-`` for stdin) to ``topic``.

    Args:
        id_field: JSON field whose value keys the message (None: no keys).
        kafka: extra librdkafka producer settings.
        limit: stop after this many messages.
        rate: at most this many messages per second (None: as fast as possible).
        timeout: seconds to wait for the last deliveries.

    Raises:
        FileNotFoundError: an input does not exist.
        ProduceError: a message was not delivered.
    """
    failures: list[str] = []

    def delivered(err: KafkaError | None, msg: Message) -> None:
        if err is not None:
            failures.append(f"{msg.topic()}: {err}")

    producer = Producer(  # the topic's max.message.bytes, not the client's 1 MB, decides what fits
        {"bootstrap.servers": bootstrap_servers, "enable.idempotence": True, "linger.ms": 20,
         "message.max.bytes": PRODUCER_MAX_BYTES, **(kafka or {})}
    )
    summary = ProduceSummary()
    started = time.perf_counter()
    for path in paths:
        with _open_bytes(path) as stream:
            for raw in stream:
                line = raw.rstrip(b"\r\n")
                if not line.strip():
                    continue
                if limit is not None and summary.messages >= limit:
                    break
                if rate:
                    delay = started + summary.messages / rate - time.perf_counter()
                    if delay > 0:
                        producer.poll(delay)
                while True:
                    try:
                        producer.produce(topic, value=line, key=line_key(line, id_field), on_delivery=delivered)
                        break
                    except BufferError:
                        producer.poll(0.1)
                producer.poll(0)
                summary.messages += 1
                summary.bytes += len(line)
    left = producer.flush(timeout)
    summary.seconds = time.perf_counter() - started
    if left:
        failures.append(f"{left} message(s) still undelivered after {timeout:.0f} s")
    if failures:
        raise ProduceError(f"{len(failures)} failure(s): {'; '.join(failures[:3])}")
    log.info("produced %d messages (%d bytes) to %s in %.2f s", summary.messages, summary.bytes, topic, summary.seconds)
    return summary
