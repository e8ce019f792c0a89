"""The largest record each output topic takes (``max.message.bytes``), read with the
Kafka admin API rather than guessed.

A topic's ``max.message.bytes`` is its own setting, or the broker's ``message.max.bytes``
when the topic does not set it (or does not exist yet: the broker creates it on the
first produce with the broker's setting). The broker compares it with the size of each
record batch it receives.
"""

from __future__ import annotations

import logging

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
