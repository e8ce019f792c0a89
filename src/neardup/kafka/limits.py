"""The largest record each output topic takes (``max.message.bytes``), read with the
Kafka admin API rather than guessed.

A topic's ``max.message.bytes`` is its own setting, or the broker's ``message.max.bytes``
when the topic does not set it (or does not exist yet: the broker creates it on the
first produce with the broker's setting). The broker compares it with the size of each
record batch it receives.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, ConfigResource, ResourceType

log = logging.getLogger(__name__)

#: Kafka's default ``message.max.bytes`` (1 MiB + 12), taken when the configuration may
#: not be read (no DescribeConfigs permission); a wrong guess is caught per message.
KAFKA_DEFAULT_MAX_BYTES = 1_048_588
#: librdkafka's upper bound of the producer's ``message.max.bytes``; the consumer's
#: producer is given it (unless ``-X message.max.bytes`` says otherwise) so that the
#: topics' limits, not the client's, decide what fits.
PRODUCER_MAX_BYTES = 1_000_000_000
#: librdkafka's default ``batch.size``: the most bytes of records it puts in one batch.
PRODUCER_BATCH_BYTES = 1_000_000
#: What neardup adds to an input record on its way out (its headers: verdict, cluster,
#: match, related and nearest ids, scores, source topic, partition and offset, a dead
#: letter's reason), bytes: the margin of the topics neardup creates over the largest
#: record of their input topics. A record whose ids alone are longer (ids of 10,000s of
#: characters) may still not fit its verdict's topic: it goes to the dead-letter topic,
#: whose own headers are far smaller, with its value.
HEADERS_ALLOWANCE = 64 << 10
#: Bytes of a shingle set (band and changelog records) per byte of text, at most.
SET_BYTES_PER_TEXT_BYTE = 4
_DENIED = {KafkaError.TOPIC_AUTHORIZATION_FAILED, KafkaError.CLUSTER_AUTHORIZATION_FAILED,
           KafkaError.TOPIC_EXCEPTION}


class TopicLimits:
    """``max.message.bytes`` per topic, cached until ``forget``.

    Args:
        config: librdkafka settings of an admin client (``bootstrap.servers``, security).
        batch_bytes: the producer's ``batch.size``; a topic whose limit is lower is
            logged (the broker would refuse a batch of small records as a whole).
        timeout: seconds to wait for the broker's answer.
    """

    def __init__(self, config: dict[str, object], batch_bytes: int = PRODUCER_BATCH_BYTES,
                 timeout: float = 10.0) -> None:
        self._admin = AdminClient(config)
        self._batch_bytes = batch_bytes
        self._warned: set[str] = set()
        self._timeout = timeout
        self._limits: dict[str, int] = {}
        self._broker_default: int | None = None

    def get(self, topic: str) -> int:
        """The largest record ``topic`` takes, in bytes.

        Raises:
            KafkaException: the broker did not answer in time, or another error than
                an unknown topic or a denied permission (which give the broker's
                setting and ``KAFKA_DEFAULT_MAX_BYTES``, logged).
        """
        limit = self._limits.get(topic)
        if limit is None:
            limit = self._limits[topic] = self._read(ResourceType.TOPIC, topic, "max.message.bytes")
            if limit < self._batch_bytes and topic not in self._warned:
                self._warned.add(topic)
                log.warning("topic %s takes record batches of at most %d bytes, less than the producer's "
                            "batch.size (%d): set -X batch.size=%d or less, or a batch of small records "
                            "to it may be refused whole (its messages then go to the dead-letter topic)",
                            topic, limit, self._batch_bytes, limit - 200)
        return limit

    def forget(self) -> None:
        """Read every topic's setting again at its next ``get`` (one may have changed)."""
        self._limits.clear()
        self._broker_default = None

    def _read(self, kind: ResourceType, name: str, setting: str) -> int:
        resource = ConfigResource(kind, name)
        try:
            future = self._admin.describe_configs([resource], request_timeout=self._timeout)[resource]
            return int(future.result(timeout=self._timeout + 1.0)[setting].value)
        except KafkaException as exc:
            code = exc.args[0].code()
            if kind == ResourceType.TOPIC and code == KafkaError.UNKNOWN_TOPIC_OR_PART:
                return self._broker_setting()
            if code in _DENIED:
                log.warning("cannot read %s of %s (%s); assuming %d bytes", setting, name, exc,
                            KAFKA_DEFAULT_MAX_BYTES)
                return KAFKA_DEFAULT_MAX_BYTES
            raise
        except TimeoutError:
            raise KafkaException(KafkaError(KafkaError._TIMED_OUT, f"no answer to DescribeConfigs of {name}",
                                            retriable=True)) from None

    def _broker_setting(self) -> int:
        """The broker's ``message.max.bytes`` (that of any broker: a cluster-wide
        setting)."""
        if self._broker_default is None:
            brokers = self._admin.list_topics(timeout=self._timeout).brokers
            if not brokers:
                raise KafkaException(KafkaError(KafkaError._TRANSPORT, "no broker known", retriable=True))
            self._broker_default = self._read(ResourceType.BROKER, str(min(brokers)), "message.max.bytes")
        return self._broker_default


def output_max_bytes(input_limits: Iterable[int]) -> int:
    """``max.message.bytes`` of an output or dead-letter topic neardup creates, bytes: the
    largest of ``input_limits`` (the input topics' ``max.message.bytes``, bytes; Kafka's
    default when none is known) plus ``HEADERS_ALLOWANCE``, so that any record an input
    topic accepts reaches its verdict's topic, or its dead letter, with its value
    (uncompressed: a record batch compressed by its producer may hold a record larger
    than its topic's limit, see the README)."""
    return max([KAFKA_DEFAULT_MAX_BYTES, *input_limits]) + HEADERS_ALLOWANCE


def internal_max_bytes(input_limits: Iterable[int], floor: int) -> int:
    """``max.message.bytes`` of an internal topic (a changelog, the stages' band and
    document records), bytes: ``floor``, or more when the input topics take records
    whose shingle sets (``SET_BYTES_PER_TEXT_BYTE`` per byte of text) would not fit it."""
    largest = max([KAFKA_DEFAULT_MAX_BYTES, *input_limits])
    return max(floor, SET_BYTES_PER_TEXT_BYTE * largest + HEADERS_ALLOWANCE)


def input_limits(limits: TopicLimits, topics: Iterable[str]) -> list[int]:
    """The ``max.message.bytes`` of each named topic of ``topics`` (bytes); a regex
    (``^...``) is left out, its topics are read when they are assigned.

    Raises:
        KafkaException: as ``TopicLimits.get``.
    """
    return [limits.get(topic) for topic in topics if not topic.startswith("^")]
