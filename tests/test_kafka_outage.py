"""Broker outages: the real broker process is frozen (SIGSTOP) and thawed (SIGCONT).

The broker frozen is one of the module's own (``own_broker`` of conftest), never the
one the other tests use at the same moment.

A frozen broker answers nothing, as one behind a network partition or in a long pause:
requests time out, the open transaction outlives its timeout and is aborted by the
broker, the consumer group's session expires. The consumer must retry with backoff and
resume with nothing lost and nothing repeated.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager

import pytest

from conftest import OwnBroker, create_topics
from kafka_util import (SteadyInput, committed_offset, excerpt, produce, read_all, start_run, stop, unique,
                        wait_committed)

JSON_FIELDS = ["--text-field", "text", "--id-field", "id"]
SHORT_TXN = ["-X", "transaction.timeout.ms=8000", "--batch-size", "200"]


@contextmanager
def frozen_broker(broker: OwnBroker):
    pid = broker.pid()
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def _messages(records):
    return [(str(r["id"]).encode(), json.dumps(r).encode()) for r in records]


def _check_exactly_once(bootstrap, topic, records):
    outs = read_all(bootstrap, [f"{topic}.unique", f"{topic}.duplicates", f"{topic}.dlq"],
                    expected=len(records))
    keys = [o.key.decode() for o in outs]
    assert len(keys) == len(set(keys)), "a message was produced twice"
    assert set(keys) == {str(r["id"]) for r in records}, "a message is missing"


@pytest.mark.xdist_group("outage-broker")  # one worker: one module-scoped own_broker
def test_broker_frozen_mid_run(own_broker, tmp_path):
    kafka_bootstrap = own_broker.bootstrap
    topic = create_topics(kafka_bootstrap, [unique("outage")])[0]
    group = unique("g-outage")
    log = tmp_path / "run.log"
    # The input arrives at 100 messages/s for 30 s (the producer queues through the
    # outage), so the freeze lands while it is still being processed, however fast the
    # engine is; batches of 50 keep transactions under way.
    with SteadyInput(kafka_bootstrap, topic, rate=100) as steady:
        proc = start_run(kafka_bootstrap, topic, group, tmp_path / "state", *JSON_FIELDS,
                         *SHORT_TXN, "--batch-size", "50", log=log)
        try:
            wait_committed(kafka_bootstrap, group, topic, 400, proc, log=log)
            before, arrived = committed_offset(kafka_bootstrap, group, topic), steady.sent
            with frozen_broker(own_broker):
                time.sleep(15)  # longer than the transaction and session timeouts
                assert proc.poll() is None, "the consumer must survive an outage"
            while steady.sent < 3000:
                assert proc.poll() is None, log.read_text()[-3000:]
                time.sleep(0.5)
        except BaseException:
            stop(proc)
            raise
    try:
        wait_committed(kafka_bootstrap, group, topic, steady.sent, proc, timeout_s=240, log=log)
    finally:
        assert stop(proc) == 0, log.read_text()[-3000:]
    print("committed offset when the broker froze:", before, "of", arrived, "arrived, of", steady.sent)
    assert arrived < 3000, "the broker froze after the whole input arrived"
    assert not steady.failed
    outs = read_all(kafka_bootstrap, [f"{topic}.unique", f"{topic}.duplicates", f"{topic}.dlq"],
                    expected=len(steady.delivered))
    keys = [o.key.decode() for o in outs]
    assert len(keys) == len(set(keys)), "a message was produced twice"
    assert set(keys) == steady.delivered, "a message is missing"


@pytest.mark.xdist_group("outage-broker")  # one worker: one module-scoped own_broker
def test_broker_down_at_start(own_broker, tmp_path):
    kafka_bootstrap = own_broker.bootstrap
    records = excerpt(500)
    topic = create_topics(kafka_bootstrap, [unique("late")])[0]
    group = unique("g-late")
    produce(kafka_bootstrap, topic, _messages(records))
    log = tmp_path / "run.log"
    with frozen_broker(own_broker):
        proc = start_run(kafka_bootstrap, topic, group, tmp_path / "state", *JSON_FIELDS, log=log)
        # Longer than init_transactions' 10 s timeout plus the start-up, so that the
        # first attempt surely fails and the retry is logged.
        time.sleep(25)
        assert proc.poll() is None, "the consumer must wait for the broker, not exit"
    try:
        wait_committed(kafka_bootstrap, group, topic, len(records), proc, timeout_s=240, log=log)
    finally:
        assert stop(proc) == 0
    assert committed_offset(kafka_bootstrap, group, topic) == len(records)
    _check_exactly_once(kafka_bootstrap, topic, records)
    assert "retrying" in log.read_text()


SILENT_MEMBER = """
import sys, time
from confluent_kafka import Consumer
bootstrap, group, topic = sys.argv[1:4]
c = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "max.poll.interval.ms": 30000,
              "session.timeout.ms": 10000, "enable.auto.commit": False, "auto.offset.reset": "earliest"})
c.subscribe([topic])
deadline = time.monotonic() + 60
while not c.assignment() and time.monotonic() < deadline:
    c.poll(0.5)
print("assigned" if c.assignment() else "not assigned", flush=True)
time.sleep(3600)  # never polls again
"""


def test_a_consumer_never_assigned_is_replaced(kafka_bootstrap, kafka_topic_factory, tmp_path):
    """A group that holds the rebalance for longer than the assignment watchdog's wait
    (``--assign-wait-ms`` 10 s here; another member stops polling, and the coordinator
    waits for it to rejoin up to its max.poll.interval.ms, 30 s): the consumer, subscribed
    and never assigned while the broker answers, is replaced, and once the group settles
    every message comes out once."""
    records = excerpt(300)
    topic = kafka_topic_factory("unassigned")
    produce(kafka_bootstrap, topic, _messages(records))
    group = unique("g-unassigned")
    # The other member is a process of its own, killed at the end: a consumer that stopped
    # polling in the middle of a rebalance can hang in close() (librdkafka's assign, called
    # from the rebalance callback close serves), which would hang the test.
    silent = subprocess.Popen([sys.executable, "-c", SILENT_MEMBER, kafka_bootstrap, group, topic],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert silent.stdout is not None and silent.stdout.readline().strip() == "assigned", \
            "the other member was assigned the partition"
        log = tmp_path / "run.log"
        proc = start_run(kafka_bootstrap, topic, group, tmp_path / "state", *JSON_FIELDS,
                         "--assign-wait-ms", "10000", log=log)
        try:
            wait_committed(kafka_bootstrap, group, topic, len(records), proc, timeout_s=240, log=log)
        finally:
            assert stop(proc) == 0, log.read_text()[-3000:]
    finally:
        silent.kill()
        silent.wait(30)
    assert "no partitions assigned" in log.read_text(), "the watchdog replaced the consumer"
    _check_exactly_once(kafka_bootstrap, topic, records)


def test_the_assignment_watchdog_waits_for_a_broker_up_or_twice_as_long():
    """The watchdog's rule (``watchdog_due``): a consumer without partitions is replaced
    after the wait if a broker was seen up lately, after twice the wait whatever it saw
    (its own connections wedged after an outage), and never while it holds partitions."""
    from neardup.kafka.stage import BROKER_UP_RECENT_S, watchdog_due  # noqa: PLC0415

    wait = 60.0
    never = float("-inf")
    assert not watchdog_due(1000.0, None, 999.0, wait)  # assigned
    assert not watchdog_due(1000.0, 1000.0 - wait + 1, 999.0, wait)  # not long enough
    assert watchdog_due(1000.0, 1000.0 - wait, 999.0, wait)  # the wait, a broker up
    assert not watchdog_due(1000.0, 1000.0 - wait, 1000.0 - BROKER_UP_RECENT_S - 1, wait)  # none up lately
    assert not watchdog_due(1000.0, 1000.0 - 2 * wait + 1, never, wait)  # none ever up, under twice the wait
    assert watchdog_due(1000.0, 1000.0 - 2 * wait, never, wait)  # twice the wait: whatever it saw
