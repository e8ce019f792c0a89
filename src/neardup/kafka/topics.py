"""Creating the topics neardup writes to when they are missing, with the operator's
partition count and replication factor (``--topic-partitions``,
``--topic-replication-factor``; -1: the broker's ``num.partitions`` and
``default.replication.factor``). Existing topics are never changed.

Each output and dead-letter topic is created with a ``max.message.bytes`` that fits any
record its input topics accept plus neardup's headers (``sized_outputs``), read from the
input topics when their partitions are assigned: a topic that a regex subscription adds
later gets outputs sized for it when it is first assigned. An output topic that exists
already (created beforehand, or shared by input topics of which one added later takes
larger records) keeps its limit; a smaller one than needed is logged at assignment, with
the command that raises it, and a record it cannot take goes to the dead-letter topic,
or, if that is too small as well, goes there without its value (``neardup.kafka.messages.fit``,
counted by ``neardup_dead_letter_value_left_out``).

Every place that creates topics goes through ``create_missing``: the outputs and
dead-letter topics of ``neardup run`` (``neardup.run``) and of the decide stage, the
changelog of ``neardup run`` (``neardup.kafka.changelog``), and the internal topics of the
sharded stages (``neardup.sharded.topology``).
"""

from __future__ import annotations

import logging

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic, ResourceType

from neardup.kafka.limits import TopicLimits, input_limits, output_max_bytes

log = logging.getLogger(__name__)

#: A partition count or replication factor that leaves the choice to the broker.
BROKER_DEFAULT = -1

#: Errors of a creation that the broker refuses for what was asked (not a passing fault):
#: asking again cannot help, so the command stops with one line.
REFUSED = {
    KafkaError.INVALID_REPLICATION_FACTOR,
    KafkaError.INVALID_PARTITIONS,
    KafkaError.INVALID_CONFIG,
    KafkaError.INVALID_REPLICA_ASSIGNMENT,
    KafkaError.POLICY_VIOLATION,
    KafkaError.TOPIC_AUTHORIZATION_FAILED,
    KafkaError.CLUSTER_AUTHORIZATION_FAILED,
}

_HINTS = {
    KafkaError.INVALID_REPLICATION_FACTOR: "give --topic-replication-factor at most the number of brokers",
    KafkaError.INVALID_PARTITIONS: "give --topic-partitions of at least 1 (or -1 for the broker's default)",
    KafkaError.POLICY_VIOLATION: "the broker's create.topic.policy refused it; create the topic beforehand",
    KafkaError.TOPIC_AUTHORIZATION_FAILED: "the principal needs Create on the topic (or on the cluster), "
                                           "or create the topic beforehand (deploy/README.md, ACLs)",
    KafkaError.CLUSTER_AUTHORIZATION_FAILED: "the principal needs Create on the topic (or on the cluster), "
                                             "or create the topic beforehand (deploy/README.md, ACLs)",
}


def passing(error: KafkaError) -> bool:
    """Whether a refusal in ``REFUSED`` is a passing state of the cluster rather than what
    was asked: KRaft's controller answers ``INVALID_REPLICATION_FACTOR`` "All brokers are
    currently fenced" (or "... fenced or in controlled shutdown") while the brokers
    register again after an outage or a restart."""
    return error.code() == KafkaError.INVALID_REPLICATION_FACTOR and "currently fenced" in error.str()


class TopicCreationError(ValueError):
    """The broker refused to create a topic as asked (a replication factor larger than
    the brokers, a partition count or topic setting it does not take, a missing Create
    permission); the message says which topic, what was asked and what to change, in
    one line."""


def _count(value: int) -> str:
    return "the broker's default" if value == BROKER_DEFAULT else str(value)


def new_topic(name: str, partitions: int, replication_factor: int,
              config: dict[str, str] | None = None) -> NewTopic:
    """A topic to create: ``partitions`` and ``replication_factor`` counts (-1: the
    broker's default), ``config`` its topic settings (e.g. ``cleanup.policy``)."""
    return NewTopic(name, num_partitions=partitions, replication_factor=replication_factor, config=config or {})


def create_missing(admin: AdminClient, topics: list[NewTopic], timeout_s: float = 30.0) -> list[str]:
    """Create ``topics`` (all of them missing when asked; one created meanwhile by another
    process counts as there).

    Returns:
        The names of the topics this call created.

    Raises:
        TopicCreationError: the broker refused one for what was asked (``REFUSED``).
        KafkaException: another failure (the broker away, a timeout, the brokers fenced
            while they register again: ``passing``): may pass.
    """
    if not topics:
        return []
    asked = {t.topic: t for t in topics}
    created = []
    for name, future in admin.create_topics(topics, request_timeout=timeout_s).items():
        try:
            future.result()
        except KafkaException as exc:
            error = exc.args[0]
            if error.code() == KafkaError.TOPIC_ALREADY_EXISTS:
                continue
            if error.code() in REFUSED and not passing(error):
                topic = asked[name]
                hint = _HINTS.get(error.code())
                raise TopicCreationError(
                    f"cannot create topic {name} (partitions {_count(topic.num_partitions)}, replication factor "
                    f"{_count(topic.replication_factor)}): {error.str().rstrip('.')}" + (f"; {hint}" if hint else "")) from None
            raise
        created.append(name)
        topic = asked[name]
        log.info("created topic %s (%s partitions, replication factor %s%s)", name, _count(topic.num_partitions),
                 _count(topic.replication_factor),
                 ", " + ", ".join(f"{k}={v}" for k, v in sorted(topic.config.items())) if topic.config else "")
    return created


def topic_config(admin: AdminClient, topic: str, timeout_s: float = 30.0) -> dict[str, str]:
    """``topic``'s settings as the broker reports them (its own and the defaults).

    Raises:
        KafkaException: the broker did not answer, or refused the request.
    """
    resource = ConfigResource(ResourceType.TOPIC, topic)
    entries = admin.describe_configs([resource], request_timeout=timeout_s)[resource].result(timeout=timeout_s + 1)
    return {name: entry.value for name, entry in entries.items()}


def keeps_records(admin: AdminClient, topic: str, timeout_s: float = 30.0) -> bool:
    """Whether ``topic`` keeps its records for good: ``cleanup.policy=delete`` without a
    time or size limit (``retention.ms`` and ``retention.bytes`` -1).

    Raises:
        KafkaException: the broker did not answer, or refused the request.
    """
    config = topic_config(admin, topic, timeout_s)
    return config["cleanup.policy"] == "delete" and config["retention.ms"] == config["retention.bytes"] == "-1"


def sized_outputs(limits: TopicLimits, input_topics: list[str], outputs: list[str],
                  existing: set[str] | dict[str, object]) -> dict[str, str]:
    """The topic config (``max.message.bytes``, ``output_max_bytes`` of the input
    topics' limits) to create the missing ones of ``outputs`` (the output and dead-letter
    topics of ``input_topics``) with; each one of ``existing`` that takes less is logged
    (a warning naming the setting to raise).

    Raises:
        KafkaException: a topic's limit could not be read.
    """
    needed = output_max_bytes(input_limits(limits, input_topics))
    for name in outputs:
        if name in existing:
            have = limits.get(name)
            if have < needed:
                log.warning("topic %s takes records of at most %d bytes, less than its inputs %s may bring "
                            "(%d with neardup's headers): larger ones go to the dead-letter topic, or without "
                            "their value if it is too small too; raise it with kafka-configs.sh --alter "
                            "--entity-type topics --entity-name %s --add-config max.message.bytes=%d",
                            name, have, ", ".join(input_topics), needed, name, needed)
    return {"max.message.bytes": str(needed)}
