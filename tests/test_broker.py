"""Tests against the real Kafka broker (no mocks): plain round-trip and transactions.

They prove that the development/CI broker (deploy/local/kafka.sh) works on one node,
including the transaction coordinator (transaction.state.log.* settings) and
read_committed isolation, which the engine's exactly-once path relies on.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from itertools import islice

from confluent_kafka import Consumer, KafkaException, Producer, TopicPartition


def _consumer(bootstrap: str, **extra) -> Consumer:
    conf = {
        "bootstrap.servers": bootstrap,
        "group.id": f"test-{uuid.uuid4().hex[:12]}",
        "auto.offset.reset": "earliest",
        "enable.auto.commit": False,
        "session.timeout.ms": 6000,
    }
    conf.update(extra)
    return Consumer(conf)


def _polled(consumer: Consumer, timeout: float) -> Iterator:
    """Messages as they arrive, for ``timeout`` seconds; raises on an error message."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        msg = consumer.poll(0.5)
        if msg is None:
            continue
        if msg.error():
            raise KafkaException(msg.error())
        yield msg


def _consume(consumer: Consumer, want: int, timeout: float = 30.0) -> list:
    """Poll until ``want`` messages arrived (or the timeout passed); return them."""
    return list(islice(_polled(consumer, timeout), want))


def _consume_until(consumer: Consumer, last: bytes, timeout: float = 30.0) -> list:
    """Poll until a message whose value is ``last`` arrived; return all of them."""
    got = []
    for msg in _polled(consumer, timeout):
        got.append(msg)
        if msg.value() == last:
            return got
    raise AssertionError(f"{last!r} not received within {timeout}s; got {[m.value() for m in got]}")


def test_produce_consume_round_trip(kafka_bootstrap, kafka_topic_factory):
    topic = kafka_topic_factory("roundtrip", partitions=2)
    producer = Producer({"bootstrap.servers": kafka_bootstrap, "enable.idempotence": True})
    sent = {f"k{i}".encode(): f"value {i} \u00e9".encode() for i in range(10)}
    for key, value in sent.items():
        producer.produce(topic, key=key, value=value, headers=[("h", b"1")])
    assert producer.flush(30) == 0

    consumer = _consumer(kafka_bootstrap)
    try:
        consumer.subscribe([topic])
        msgs = _consume(consumer, len(sent))
    finally:
        consumer.close()

    assert {m.key(): m.value() for m in msgs} == sent
    assert {m.partition() for m in msgs} <= {0, 1}
    assert all(m.headers() == [("h", b"1")] for m in msgs)


def test_transactions_read_committed(kafka_bootstrap, kafka_topic_factory):
    src = kafka_topic_factory("txn-in")
    dst = kafka_topic_factory("txn-out")

    # Input records for a consume-transform-produce loop.
    plain = Producer({"bootstrap.servers": kafka_bootstrap})
    for i in range(3):
        plain.produce(src, value=f"in-{i}".encode())
    assert plain.flush(30) == 0

    group = f"txn-group-{uuid.uuid4().hex[:12]}"
    source = _consumer(kafka_bootstrap, **{"group.id": group, "isolation.level": "read_committed"})
    producer = Producer(
        {
            "bootstrap.servers": kafka_bootstrap,
            "transactional.id": f"txn-test-{uuid.uuid4().hex[:12]}",
            "transaction.timeout.ms": 60000,
        }
    )
    try:
        source.subscribe([src])
        inputs = _consume(source, 3)
        assert [m.value() for m in inputs] == [b"in-0", b"in-1", b"in-2"]

        producer.init_transactions(30)

        # Transaction 1: outputs + the consumer's offsets, committed atomically.
        producer.begin_transaction()
        producer.produce(dst, value=b"committed-1")
        producer.send_offsets_to_transaction(
            source.position(source.assignment()), source.consumer_group_metadata(), 30
        )
        producer.commit_transaction(30)

        # Transaction 2: aborted; its record is written to the log but must stay hidden.
        producer.begin_transaction()
        producer.produce(dst, value=b"aborted-1")
        assert producer.flush(30) == 0
        producer.abort_transaction(30)

        # Transaction 3: committed after the abort.
        producer.begin_transaction()
        producer.produce(dst, value=b"committed-2")
        producer.commit_transaction(30)

        committed = source.committed([TopicPartition(src, 0)], timeout=30)
        assert committed[0].offset == 3
    finally:
        source.close()

    def read_all(isolation: str) -> list[bytes]:
        # committed-2 is the last record written, after aborted-1 in the log.
        reader = _consumer(kafka_bootstrap, **{"isolation.level": isolation})
        try:
            reader.assign([TopicPartition(dst, 0, 0)])
            return [m.value() for m in _consume_until(reader, b"committed-2")]
        finally:
            reader.close()

    assert read_all("read_committed") == [b"committed-1", b"committed-2"]
    # The aborted record really reached the log: only isolation hides it.
    assert read_all("read_uncommitted") == [b"committed-1", b"aborted-1", b"committed-2"]

    # A new consumer of the group resumes after the transactionally committed offsets.
    plain.produce(src, value=b"in-3")
    assert plain.flush(30) == 0
    resumed = _consumer(kafka_bootstrap, **{"group.id": group})
    try:
        resumed.subscribe([src])
        assert [m.value() for m in _consume(resumed, 1)] == [b"in-3"]
    finally:
        resumed.close()
