"""Broker restarts: the broker process is SIGKILLed and started again in place (same data,
same ports) while input keeps arriving.

These tests use a broker of their own (``own_broker`` of conftest), so the broker of the
other tests is never disturbed. After the broker answers again, the consumer must commit
again within a bounded time, and every message must come out exactly once.
"""

from __future__ import annotations

import json
import subprocess
import time
from datetime import datetime

import pytest
from confluent_kafka import KafkaException

from conftest import create_topics
from kafka_util import SteadyInput, committed_offset, excerpt, read_all, start_run, stop, unique, wait_committed

JSON_FIELDS = ["--text-field", "text", "--id-field", "id"]
#: Committing must resume this many seconds after the restarted broker answers.
RESUME_S = 60.0


def _committed(bootstrap: str, group: str, topic: str) -> int:
    try:
        return committed_offset(bootstrap, group, topic, timeout_s=20)
    except KafkaException:
        return -1


def _stop(proc: subprocess.Popen) -> int | None:
    try:
        return stop(proc, timeout_s=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return None


def _check_exactly_once(bootstrap: str, topic: str, expected: set[str]) -> None:
    outs = read_all(bootstrap, [f"{topic}.unique", f"{topic}.duplicates", f"{topic}.dlq"],
                    expected=len(expected))
    keys = [o.key.decode() for o in outs]
    assert len(keys) == len(set(keys)), "a message was produced twice"
    assert set(keys) == expected, "a message is missing"


@pytest.mark.xdist_group("restart-broker")  # one worker: one module-scoped own_broker
def test_broker_killed_and_restarted_in_place_mid_stream(own_broker, tmp_path):
    """SIGKILL the broker while ~300 messages/s arrive, start it again in place: the
    consumer commits again within ``RESUME_S`` of the broker answering, and every
    message comes out exactly once."""
    bs = own_broker.bootstrap
    topic = create_topics(bs, ["restart-mid-stream"])[0]
    group = unique("g-restart")
    log = tmp_path / "run.log"
    proc = start_run(bs, topic, group, tmp_path / "state", *JSON_FIELDS, log=log)
    try:
        with SteadyInput(bs, topic, rate=300) as steady:
            wait_committed(bs, group, topic, 3000, proc, timeout_s=240)
            # Kill it in the steady state: small batches, step 5 always under way.
            wait_committed(bs, group, topic, steady.sent - 300, proc, timeout_s=240)
            own_broker.kill()
            time.sleep(5)
            assert proc.poll() is None, "the consumer must survive the broker's crash"
            own_broker.restart()
            answered = time.monotonic()
            at_restart = _committed(bs, group, topic)
            resumed = None
            while time.monotonic() - answered < RESUME_S + 30:
                assert proc.poll() is None, "the consumer exited"
                if _committed(bs, group, topic) > at_restart >= 0:
                    resumed = time.monotonic() - answered
                    break
                time.sleep(1)
            print(f"committed offset when the broker answered: {at_restart}; "
                  f"committing resumed after {resumed} s")
            assert resumed is not None and resumed < RESUME_S, (
                f"no commit within {RESUME_S + 30:.0f} s of the broker answering again")
            time.sleep(5)  # more input after the restart
        sent = steady.sent
        wait_committed(bs, group, topic, sent, proc, timeout_s=240)
    finally:
        code = _stop(proc)
        print(log.read_text()[-5000:])
    assert code == 0
    assert not steady.failed
    _check_exactly_once(bs, topic, steady.delivered)


@pytest.mark.xdist_group("restart-broker")  # one worker: one module-scoped own_broker
def test_connection_refused_lines_are_rate_limited(own_broker, tmp_path):
    """With the broker down, librdkafka's failed connection attempts (about 20 a second
    per client without a limit) reach the log a bounded number of times."""
    bs = own_broker.bootstrap
    log = tmp_path / "run.log"
    own_broker.kill()
    proc = None
    try:
        proc = start_run(bs, "quiet-input", unique("g-quiet"), tmp_path / "state", log=log)
        time.sleep(20)
        assert proc.poll() is None, "the consumer must wait for the broker, not exit"
    finally:
        own_broker.restart()
        create_topics(bs, ["quiet-input"])
        if proc is not None:
            # logs are served by the clients' polls: wait until they are served, then stop
            wait_until = time.monotonic() + 120
            while "assigned" not in log.read_text() and time.monotonic() < wait_until:
                time.sleep(1)
            code = _stop(proc)
    text = log.read_text()
    refused = text.count("Connection refused")
    print(f"'Connection refused' lines over a 20 s outage: {refused}")
    assert code == 0, text[-3000:]
    assert 0 < refused <= 30, text[-3000:]


def test_a_consumer_restarted_after_sigkill_gets_its_partition_at_once(kafka_bootstrap, kafka_topic_factory,
                                                                        tmp_path):
    """Static membership (group.instance.id from the transactional id) by default: a
    consumer SIGKILLed and started again is assigned its partition without waiting for
    the old member's session (120 s here) to expire."""
    from kafka_util import produce

    topic = kafka_topic_factory("static")
    records = excerpt(600)
    messages = [(str(r["id"]).encode(), json.dumps(r).encode()) for r in records]
    produce(kafka_bootstrap, topic, messages[:400])
    group, state = unique("g-static"), tmp_path / "state"
    long_session = ["-X", "session.timeout.ms=120000"]
    first = start_run(kafka_bootstrap, topic, group, state, *JSON_FIELDS, *long_session,
                      log=tmp_path / "first.log")
    try:
        wait_committed(kafka_bootstrap, group, topic, 400, first)
    finally:
        first.kill()
        first.wait()
    produce(kafka_bootstrap, topic, messages[400:])
    log = tmp_path / "second.log"
    second = start_run(kafka_bootstrap, topic, group, state, *JSON_FIELDS, *long_session, log=log)
    try:
        wait_committed(kafka_bootstrap, group, topic, 600, second, timeout_s=240)
    finally:
        assert _stop(second) == 0
    stamps = {}
    for line in log.read_text().splitlines():
        for what in ("subscribed to", "assigned"):
            if f"neardup.kafka.stage: {what}" in line and what not in stamps:
                stamps[what] = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
    waited = (stamps["assigned"] - stamps["subscribed to"]).total_seconds()
    print(f"assigned {waited:.1f} s after subscribing")
    assert waited < 30, "the restarted consumer waited for the old member's session to expire"
