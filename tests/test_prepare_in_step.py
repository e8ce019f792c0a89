"""Prepare reads its input partitions in step (``neardup.sharded.prepare_stage``): a
partition more than ``AHEAD_MS`` of record time ahead of the one furthest behind is
paused. The rule, on a real consumer assigned to real partitions."""

from __future__ import annotations

import time
import uuid

from confluent_kafka import Consumer, Producer, TopicPartition

from neardup.config import Settings
from neardup.sharded.prepare_stage import AHEAD_MS, PrepareProcessor
from neardup.sharded.records import order_key, parse_watermarks
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


def _mark_of(processor: PrepareProcessor, tp: tuple[str, int]) -> bytes | None:
    """The watermark ``tp`` gets in the watermark records prepare would send now."""
    records = processor._watermarks()
    return parse_watermarks(records[0][3]).get(tp, (0, None))[1] if records else None


def _mark_answered(processor: PrepareProcessor, tp: tuple[str, int]) -> bytes | None:
    """``_mark_of`` once the broker has answered an end query of ``tp`` asked from now on:
    the first query of a process (a new client: connection, metadata) may take longer than
    ``END_QUERY_TIMEOUT_S`` on a loaded machine, and an unanswered one is asked again after
    ``END_QUERY_PAUSE_S``; the watermark holds meanwhile, as it does in the stage."""
    asked_from = int(time.time() * 1000)
    deadline = time.monotonic() + 20
    while True:
        mark = _mark_of(processor, tp)
        if processor._ends.get(tp, (-1, 0))[1] >= asked_from or time.monotonic() > deadline:
            return mark
        time.sleep(0.1)


def test_a_paused_partition_is_not_taken_as_read_to_its_end(kafka_bootstrap, kafka_topic_factory):
    """A partition read to its end, paused, then written to: while paused the consumer
    fetches nothing of it, so its cached end offset stays where it was. Its watermark must
    not move past its new records (the shards would release the other partitions'
    documents past them, and they would come late); once resumed and read, it is at its
    end again as the broker says."""
    topic = kafka_topic_factory("in-step", partitions=3)
    processor, consumer, (a, b, c) = _prepare(kafka_bootstrap, topic)
    try:
        now = int(time.time() * 1000)
        producer = _read_one_each(processor, consumer, kafka_bootstrap, topic, now - 60_000)
        deadline = time.monotonic() + 30
        while consumer.get_watermark_offsets(TopicPartition(*a), cached=True)[1] != 1:
            assert time.monotonic() < deadline
            consumer.consume(10, timeout=0.2)
        assert _mark_answered(processor, a) > order_key(now, 2, 0)  # read to its end: the time asked less the window

        processor._pause(consumer, [a])
        time.sleep(1.0)  # a fetch in flight as it was paused has come back (fetch.wait.max.ms 500)
        written = int(time.time() * 1000)
        for _ in range(5):
            producer.produce(topic, value=b"y", partition=0)
        producer.flush(10)
        time.sleep(1.0)  # past the reorder window: the wall clock less it is past the new records
        assert consumer.get_watermark_offsets(TopicPartition(*a), cached=True)[1] == 1  # the cache: at its end
        assert _mark_of(processor, a) < order_key(written, 0, 0)  # paused: not past its new records

        consumer.resume([TopicPartition(*a)])
        processor._paused.discard(a)
        time.sleep(0.2)
        assert _mark_of(processor, a) < order_key(written, 0, 0)  # resumed, not yet read
        got = 0
        deadline = time.monotonic() + 30
        while got < 5:
            assert time.monotonic() < deadline
            got += sum(1 for m in consumer.consume(10, timeout=0.2) if m.error() is None and m.partition() == 0)
        processor._sent[a] = order_key(written, 0, 5)
        time.sleep(0.2)
        assert _mark_answered(processor, a) > order_key(written, 2, 0)  # read to its end again
    finally:
        processor.close()
        consumer.close()


def test_a_partition_whose_fetch_is_held_is_not_taken_as_read_to_its_end(kafka_bootstrap, kafka_topic_factory):
    """The consumer's cached end offset comes with fetch responses, and nothing bounds how
    old it is: here the broker holds each fetch for up to ``fetch.wait.max.ms`` (10 s)
    waiting for ``fetch.min.bytes`` (1 MB), as it holds none during an outage or while the
    group rebalances. A partition read to its end and written to while its fetch waits
    shows at its end in the cache, not paused; its watermark must stay below its new
    records."""
    topic = kafka_topic_factory("in-step", partitions=3)
    settings = Settings(bootstrap_servers=kafka_bootstrap, input_topics=[topic], group_id=f"in-step-{uuid.uuid4().hex[:8]}")
    processor = PrepareProcessor(settings, Topology(f"in-step-{uuid.uuid4().hex[:8]}", shards=2, decide_partitions=1))
    consumer = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": settings.group_id,
                         "enable.auto.commit": False, "fetch.wait.max.ms": 10_000, "fetch.min.bytes": 1 << 20})
    a, b, c = tps = [(topic, p) for p in range(3)]
    consumer.assign([TopicPartition(t, p, 0) for t, p in tps])
    try:
        now = int(time.time() * 1000)
        producer = _read_one_each(processor, consumer, kafka_bootstrap, topic, now - 60_000)
        written = int(time.time() * 1000)  # the next fetch of a waits up to 10 s from here
        for _ in range(5):
            producer.produce(topic, value=b"y", partition=0)
        producer.flush(10)
        time.sleep(1.0)  # past the reorder window
        assert consumer.get_watermark_offsets(TopicPartition(*a), cached=True)[1] == 1  # the cache: at its end
        assert consumer.position([TopicPartition(*a)])[0].offset == 1
        assert int(time.time() * 1000) - written < 5_000, "the held fetch may have come back: the test is void"
        assert _mark_of(processor, a) < order_key(written, 0, 0)
        assert _mark_answered(processor, b) > order_key(written, 2, 0)  # b is at its end: the broker says so
    finally:
        processor.close()
        consumer.close()


def test_an_answer_of_the_broker_does_not_outlive_records_the_cache_shows(kafka_bootstrap, kafka_topic_factory):
    """The broker said a partition was at its end a moment ago (its answer is used for
    ``END_CONFIRM_S``); records came since, and the consumer has fetched them: the
    partition has records to read and is behind (reading in step pauses it while prepare
    holds back), whatever that answer said (taken as read to its end, it was resumed
    while prepare held back, and what waited for decide reached ten times the bound)."""
    topic = kafka_topic_factory("in-step", partitions=3)
    processor, consumer, (a, b, c) = _prepare(kafka_bootstrap, topic)
    try:
        now = int(time.time() * 1000)
        producer = _read_one_each(processor, consumer, kafka_bootstrap, topic, now - 60_000)
        assert _mark_answered(processor, a) > order_key(now, 2, 0)  # at its end, as the broker says
        for _ in range(5):
            producer.produce(topic, value=b"y", partition=0)
        producer.flush(10)
        deadline = time.monotonic() + 30
        while consumer.get_watermark_offsets(TopicPartition(*a), cached=True)[1] != 6:  # fetched, not consumed
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert consumer.position([TopicPartition(*a)])[0].offset == 1
        processor._ends[a] = (1, int(time.time() * 1000))  # the broker's answer of a moment ago
        processor._ends_asked = time.monotonic()
        assert _mark_of(processor, a) == order_key(now - 60_000, 0, 0)  # behind: its last record sent
    finally:
        processor.close()
        consumer.close()


def _read_one_each(processor: PrepareProcessor, consumer: Consumer, bootstrap: str, topic: str,
                   stamp_ms: int) -> Producer:
    """Write one record stamped ``stamp_ms`` to each of the three partitions, consume them,
    and hand ``processor`` the consumer with the three sent; return the producer."""
    producer = Producer({"bootstrap.servers": bootstrap})
    for p in range(3):
        producer.produce(topic, value=b"x", partition=p, timestamp=stamp_ms)
    producer.flush(10)
    seen: set[int] = set()
    deadline = time.monotonic() + 30
    while len(seen) < 3 and time.monotonic() < deadline:
        seen |= {m.partition() for m in consumer.consume(10, timeout=0.5) if m.error() is None}
    assert seen == {0, 1, 2}
    tps = [(topic, p) for p in range(3)]
    processor._consumer, processor._counts = consumer, {topic: 3}
    processor._start = {tp: 0 for tp in tps}
    processor._sent = {tp: order_key(stamp_ms, tp[1], 0) for tp in tps}
    return producer
