"""Prepare reads its input partitions in step (``neardup.sharded.prepare_stage``): a
partition more than ``AHEAD_MS`` of record time ahead of the one furthest behind is
paused. The rule, on a real consumer assigned to real partitions."""

from __future__ import annotations

import time
import uuid

from confluent_kafka import Consumer, TopicPartition

from neardup.config import Settings
from neardup.sharded.prepare_stage import AHEAD_MS, PrepareProcessor
from neardup.sharded.records import order_key
from neardup.sharded.topology import Topology


def _prepare(bootstrap: str, topic: str) -> tuple[PrepareProcessor, Consumer, list[tuple[str, int]]]:
    settings = Settings(bootstrap_servers=bootstrap, input_topics=[topic], group_id=f"in-step-{uuid.uuid4().hex[:8]}")
    processor = PrepareProcessor(settings, Topology(f"in-step-{uuid.uuid4().hex[:8]}", shards=2, decide_partitions=1))
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": settings.group_id, "enable.auto.commit": False})
    tps = [(topic, p) for p in range(3)]
    consumer.assign([TopicPartition(t, p, 0) for t, p in tps])
    return processor, consumer, tps


def test_a_partition_far_ahead_of_one_with_a_backlog_is_paused(kafka_bootstrap, kafka_topic_factory):
    topic = kafka_topic_factory("in-step", partitions=3)
    processor, consumer, (a, b, c) = _prepare(kafka_bootstrap, topic)
    try:
        now = int(time.time() * 1000)
        processor._sent = {a: order_key(now, 0, 9), b: order_key(now - 3_600_000, 1, 9), c: order_key(now, 2, 9)}
        processor._in_step(consumer, [a, b, c])  # b's backlog is an hour behind
        assert processor._paused == {a, c}
        processor._sent[b] = order_key(now - AHEAD_MS // 2, 1, 99)  # b caught up to within the bound
        processor._in_step(consumer, [a, b, c])
        assert processor._paused == set()
    finally:
        consumer.close()


def test_a_partition_written_again_after_a_quiet_spell_holds_nothing_back(kafka_bootstrap, kafka_topic_factory):
    """All three partitions were read to their end, then stayed quiet for longer than
    ``AHEAD_MS``; a record came to each, and prepare has sent a's already. b and c have
    their new records still to read and their last records sent are old, yet their next
    ones come after the time they were read to their end: a is not paused (it was, and
    the first documents of every live burst after a quiet minute waited 0.4-1.2 s)."""
    topic = kafka_topic_factory("in-step", partitions=3)
    processor, consumer, (a, b, c) = _prepare(kafka_bootstrap, topic)
    try:
        now = int(time.time() * 1000)
        quiet = now - 2 * AHEAD_MS  # the last records before the quiet spell
        processor._sent = {a: order_key(now, 0, 10), b: order_key(quiet, 1, 10), c: order_key(quiet, 2, 10)}
        processor._caught_up = {a: now - 1000, b: now - 1000, c: now - 1000}
        processor._in_step(consumer, [b, c])  # a is read to its end again
        processor._in_step(consumer, [a, b, c])
        assert processor._paused == set()
        processor._caught_up = {}  # without the marks of the quiet spell: a is held for b and c
        processor._in_step(consumer, [a, b, c])
        assert processor._paused == {a}
    finally:
        consumer.close()
