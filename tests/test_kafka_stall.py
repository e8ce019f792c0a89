"""A consumer that cannot make progress says so, on the real broker: a dead-letter topic
whose ``max.message.bytes`` refuses even a dead letter of neardup's headers alone makes
``neardup run`` retry its batch forever; ``/readyz`` then answers 503 with the reason,
``neardup_input_waiting_since_timestamp_seconds`` holds the time since which it waits,
the log says so once every ``log_every`` seconds (not at every retry). A consumer that
has committed its batches and is idle with nothing to read is not stalled.

(Once the topic takes the record again, the retry commits only after the broker lets a
new producer of the same transactional.id start: the aborted transaction stays
"concurrent" on the broker for minutes here, which these tests do not wait for.)"""

from __future__ import annotations

import logging
import re
import threading
import time
import uuid
from contextlib import contextmanager

from kafka_util import committed_offset, create_topic, http_get as _get, produce
from test_kafka_poison import _set_limit

from neardup.config import load_settings
from neardup.detector import Detector
from neardup.run import KafkaDeduplicator
from neardup.kafka import stage as stage_module
from neardup.kafka.progress import Progress
from neardup.metrics import Metrics
from neardup.server import MetricsServer, Readiness
from neardup.state.rocksdb import RocksDBStateStore

STALL_AFTER_S = 5.0
LOG_EVERY_S = 4.0
#: How long an abort that times out is retried before a new producer (60 s in neardup):
#: the same sequence of events, sooner.
TRANSACTION_RETRY_S = 15.0


def _waiting_since(base: str) -> float:
    _, text = _get(f"{base}/metrics")
    return float(re.search(r"^neardup_input_waiting_since_timestamp_seconds (\S+)$", text, re.M).group(1))


def _until(what, timeout: float = 120.0, step: float = 0.2):
    deadline = time.monotonic() + timeout
    while not (value := what()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(step)
    return value


@contextmanager
def _watched_run(bootstrap: str, topic: str, tmp_path, name: str):
    """A ``KafkaDeduplicator`` of ``topic`` in a thread, watched by a ``Progress`` named
    ``name`` (the test's stall threshold and log interval) behind a metrics server; yields
    (settings, server, thread), then stops it (an abort in progress is retried for a
    minute first) and asserts that it ended."""
    settings = load_settings({"bootstrap_servers": bootstrap, "input_topics": [topic],
                              "group_id": f"g-{topic}", "from_beginning": True, "text_field": ["text"],
                              "id_field": "id", "batch_max_ms": 200, "pipeline": False})
    engine = settings.engine()
    progress = Progress(stall_after=STALL_AFTER_S, log_every=LOG_EVERY_S, name=name)
    readiness = Readiness(progress=progress)
    metrics = Metrics()
    metrics.watch_progress(progress)
    with RocksDBStateStore(tmp_path / "state", engine.state_shape()) as store, \
            MetricsServer(metrics, "127.0.0.1", 0, readiness.check) as server:
        dedup = KafkaDeduplicator(settings, Detector(engine, store), on_assignment=readiness.set_assignment,
                                  on_broker=readiness.broker_answered, progress=progress)
        runner = threading.Thread(target=dedup.run, kwargs={"install_signal_handlers": False})
        runner.start()
        try:
            yield settings, server, runner
        finally:
            dedup.stop()
            runner.join(240)
    assert not runner.is_alive()


def test_a_dead_letter_topic_that_refuses_every_record_shows_as_a_stall(kafka_bootstrap, tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(stage_module, "TRANSACTION_RETRY_S", TRANSACTION_RETRY_S)
    topic = create_topic(kafka_bootstrap, f"stall-{uuid.uuid4().hex[:12]}")
    # a record batch of one record is at least 61 bytes: nothing fits in 40
    create_topic(kafka_bootstrap, f"{topic}.dlq", {"max.message.bytes": "40"})
    produce(kafka_bootstrap, topic, [(b"bad", b"{not json")])
    caplog.set_level(logging.DEBUG, logger="neardup")
    started = time.time()
    with _watched_run(kafka_bootstrap, topic, tmp_path, "neardup run") as (settings, server, runner):
        since = _until(lambda: _waiting_since(server.url))  # the bad message is in hand
        assert started <= since <= time.time()
        status, reason = _until(lambda: (r := _get(f"{server.url}/readyz"))[0] == 503 and r)
        unready_after = time.time() - since
        assert STALL_AFTER_S <= unready_after < STALL_AFTER_S + 3, unready_after
        assert reason.startswith("stalled: no batch committed for "), reason
        assert "attempt(s) failed, the last: " in reason and "\n" not in reason.strip(), reason
        assert committed_offset(kafka_bootstrap, settings.group_id, topic) <= 0
        assert _waiting_since(server.url) == since  # the retries do not move it

        # the log: the stall once every LOG_EVERY_S, even while a retry waits (an abort
        # that times out is retried for a minute); the retries' warning and the
        # refusal once, however many retries there were
        _until(lambda: sum("neardup run is stalled" in r.getMessage() for r in caplog.records) >= 3,
               timeout=4 * LOG_EVERY_S + STALL_AFTER_S)
        # a second retry comes after the abort of the first has been retried for
        # TRANSACTION_RETRY_S (a minute; here shorter) and a new producer started
        _until(lambda: sum("batch failed" in r.getMessage() for r in caplog.records) >= 2, timeout=180)
        status, reason = _get(f"{server.url}/readyz")
        assert status == 503 and "2 attempt(s) failed" in reason, reason
        # the cause, as the processor knows it, not only the transaction's error
        assert f"headers alone was refused by {topic}.dlq: Broker: Message size too large" in reason, reason
        stalls = [r for r in caplog.records if "neardup run is stalled" in r.getMessage()]
        gaps = [b.created - a.created for a, b in zip(stalls, stalls[1:])]
        assert all(LOG_EVERY_S - 0.5 <= gap <= LOG_EVERY_S + 1.5 for gap in gaps), gaps
        first_log_after = stalls[0].created - since
        assert stalls[0].levelno == logging.ERROR and "attempt(s) failed" in stalls[0].getMessage()
        retries = [r for r in caplog.records if "batch failed" in r.getMessage()]
        assert len(retries) >= 2, [r.getMessage() for r in retries]
        assert [r.levelno for r in retries if r.levelno >= logging.WARNING] == [logging.WARNING]
        refusals = [r for r in caplog.records
                    if r.name == "neardup.run" and "headers alone was refused" in r.getMessage()]
        assert len(refusals) == 1, [r.getMessage() for r in refusals]

    assert not runner.is_alive()
    print(f"/readyz 503 {unready_after:.1f} s after the batch was consumed (stall_after {STALL_AFTER_S} s); "
          f"first stall log line after {first_log_after:.1f} s; {len(retries)} retries, "
          f"stall lines {len(stalls)} apart by {[round(g, 1) for g in gaps]} s")


def test_a_stage_that_cannot_commit_shows_as_a_stall(kafka_bootstrap, tmp_path, caplog, monkeypatch):
    """The same for ``neardup stage prepare``: its band topic's max.message.bytes lowered
    below any record, every batch fails; /readyz answers 503 with the reason,
    ``neardup_stage_input_waiting_since_timestamp_seconds{stage="prepare"}`` holds the
    time since which it waits, the log says so."""
    import json

    from confluent_kafka.admin import AdminClient

    from neardup.sharded.prepare_stage import PrepareStage
    from neardup.sharded.topology import Topology
    from neardup.metrics import StageMetrics

    monkeypatch.setattr(stage_module, "TRANSACTION_RETRY_S", TRANSACTION_RETRY_S)
    topic = create_topic(kafka_bootstrap, f"stall-stage-{uuid.uuid4().hex[:12]}")
    topology = Topology(f"stall-{uuid.uuid4().hex[:8]}", shards=1, decide_partitions=1)
    topology.ensure(AdminClient({"bootstrap.servers": kafka_bootstrap}))
    _set_limit(kafka_bootstrap, [topology.bands], 40)
    record = {"id": "1", "text": "a few words of text for the shards"}
    produce(kafka_bootstrap, topic, [(b"1", json.dumps(record).encode())])
    settings = load_settings({"bootstrap_servers": kafka_bootstrap, "input_topics": [topic],
                              "group_id": f"{topology.app}.prepare", "from_beginning": True,
                              "text_field": ["text"], "id_field": "id", "batch_max_ms": 200})
    progress = Progress(stall_after=STALL_AFTER_S, log_every=LOG_EVERY_S, name="the prepare stage")
    readiness = Readiness(progress=progress)
    metrics = StageMetrics("prepare")
    metrics.watch_progress(progress)
    caplog.set_level(logging.INFO, logger="neardup")
    with MetricsServer(metrics, "127.0.0.1", 0, readiness.check) as server:
        stage = PrepareStage(settings, topology, on_assignment=readiness.set_assignment,
                             on_broker=readiness.broker_answered, progress=progress)
        runner = threading.Thread(target=stage.run, kwargs={"install_signal_handlers": False})
        runner.start()

        def since() -> float:
            _, text = _get(f"{server.url}/metrics")
            return float(re.search(r'^neardup_stage_input_waiting_since_timestamp_seconds\{stage="prepare"\} (\S+)$',
                                   text, re.M).group(1))

        try:
            # read once stalled: before the input's batch, an idle watermark batch of prepare's
            # own (``Processor.due``) waits too, for as long as it takes to commit
            status, reason = _until(lambda: (r := _get(f"{server.url}/readyz"))[0] == 503
                                    and r[1].startswith("stalled") and r)
            unready_at = time.time()
            waiting = since()
            unready_after = unready_at - waiting
            assert STALL_AFTER_S <= unready_after < STALL_AFTER_S + 3, unready_after
            assert reason.startswith("stalled: no batch committed for "), reason
            status, reason = _until(lambda: (r := _get(f"{server.url}/readyz"))[0] == 503
                                    and "attempt(s) failed" in r[1] and r, timeout=60)
            assert topology.bands in reason and "Message size too large" in reason, reason
            assert since() == waiting
            _until(lambda: any("the prepare stage is stalled" in r.getMessage() for r in caplog.records),
                   timeout=LOG_EVERY_S + 2)
            assert committed_offset(kafka_bootstrap, settings.group_id, topic) <= 0

        finally:
            stage.stop()
            runner.join(240)  # an abort in progress is retried for a minute first
    assert not runner.is_alive()
    print(f"prepare stage: /readyz 503 {unready_after:.1f} s after the batch was consumed; "
          f"reason: {reason.strip()[:200]}")


def test_an_idle_consumer_is_not_stalled(kafka_bootstrap, tmp_path, caplog):
    """Batches committed (a dead letter among them), then nothing to read for longer than
    ``stall_after``: /readyz answers 200, the gauge is 0, the log says nothing of a stall."""
    topic = create_topic(kafka_bootstrap, f"idle-{uuid.uuid4().hex[:12]}")
    produce(kafka_bootstrap, topic, [(b"bad", b"{not json"),
                                     (b"1", b'{"id": "1", "text": "a few words of text, nothing more"}')])
    caplog.set_level(logging.INFO, logger="neardup")
    with _watched_run(kafka_bootstrap, topic, tmp_path, "the idle consumer") as (settings, server, runner):
        _until(lambda: committed_offset(kafka_bootstrap, settings.group_id, topic) == 2, timeout=120)
        _until(lambda: _get(f"{server.url}/readyz")[0] == 200, timeout=30)
        time.sleep(STALL_AFTER_S + 3)
        status, reason = _get(f"{server.url}/readyz")
        assert status == 200, reason
        assert _waiting_since(server.url) == 0
    assert not runner.is_alive()
    assert not [r for r in caplog.records if "the idle consumer is stalled" in r.getMessage()]


def test_a_restore_is_not_ready_but_not_a_stall_and_restarts_the_waiting_clock():
    """While the runtime restores (``restoring`` .. ``restored``), ``/readyz`` says so and
    the stall clock stops: a restore longer than ``stall_after`` is no stall, and input that
    waited through it waits from its end."""
    progress = Progress(stall_after=1.0)
    readiness = Readiness(progress=progress)
    readiness.broker_answered()
    readiness.set_assignment(["a partition"])
    progress.in_hand()
    progress.restoring("bands[0], bands[1]")
    time.sleep(1.2)
    assert progress.stalled() is None and progress.waiting_since() == 0.0
    ready, reason = readiness.check()
    assert not ready and reason.startswith("restoring the state of bands[0], bands[1] for "), reason
    progress.restored()
    assert readiness.check()[0] is True  # the clock starts again at the restore's end
    assert 0 < time.time() - progress.waiting_since() < 1.0
    time.sleep(1.2)
    assert "stalled" in readiness.check()[1]


def test_the_producer_log_keeps_the_refusal_that_failed_the_transaction(kafka_bootstrap):
    """A record the broker refuses fails the transaction; the call that finds it may say
    "Erroneous state" only. ``ProducerLog`` keeps librdkafka's transaction error, which
    names the topic and the refusal, once the producer's queue is served (``poll``)."""
    from confluent_kafka import KafkaException, Producer

    from neardup.kafka.clients import producer_config
    from neardup.kafka.rdkafka_log import ProducerLog

    topic = create_topic(kafka_bootstrap, f"txnerr-{uuid.uuid4().hex[:12]}", {"max.message.bytes": "40"})
    settings = load_settings({"bootstrap_servers": kafka_bootstrap, "input_topics": [topic]})
    producer_log = ProducerLog()
    producer = Producer(producer_config(settings, f"txnerr-{uuid.uuid4().hex[:8]}", producer_log))
    producer.init_transactions(30)
    producer.begin_transaction()
    reports = []
    producer.produce(topic, value=b"x" * 100, on_delivery=lambda err, msg: reports.append(err))
    _until(lambda: producer.poll(0.1) is not None and reports, timeout=30)
    assert reports[0] is not None and reports[0].code() == 10  # MSG_SIZE_TOO_LARGE
    producer.poll(0)
    error = producer_log.transaction_error
    assert error is not None and not error.startswith("[thrd:"), error
    assert f"ProduceRequest for {topic} [0]" in error and "Message size too large" in error, error
    try:
        producer.commit_transaction(10)
        raise AssertionError("the transaction committed")
    except KafkaException as exc:
        assert exc.args[0].txn_requires_abort(), exc
    producer.abort_transaction(10)
