"""Metrics and health endpoints of ``neardup run`` against the real Kafka broker (no mocks).

A ``neardup run`` subprocess consumes the first 300 Reuters stories plus one message of
every dead-letter kind; its /metrics (fetched over HTTP, parsed with prometheus_client's
parser) must count exactly what it wrote to the output topics, read back with
read_committed. /readyz must say 503 until partitions are assigned, then 200.
"""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition
from prometheus_client.parser import text_string_to_metric_families

from conftest import create_topics
from kafka_util import free_port, http_get as _get

from neardup.cli import main
from neardup.core.settings import EngineSettings
from neardup.core.types import Rejected, Verdict
from neardup.embedded import dedup_files
from neardup.metrics import DEAD_LETTER_REASONS, Metrics
from neardup.server import MetricsServer, Readiness

DATA = Path(__file__).parent / "data" / "reuters_excerpt.jsonl.gz"
STORIES = 300
MAX_MESSAGE_BYTES = 100_000
BAD_MESSAGES: list[tuple[str, bytes | None]] = [
    ("tombstone", None),
    ("too_large", json.dumps({"id": "big", "text": "word " * 30_000}).encode()),
    ("invalid_utf8", b'{"id": "bad-utf8", "text": "caf\xe9"}'),
    ("invalid_json", b'{"id": "bad-json", "text": '),
    ("missing_field", b'{"id": "no-text", "body": "the text is elsewhere"}'),
    ("empty_text", b'{"id": "blank", "text": "  \\n\\t "}'),
]



def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value} of a Prometheus text exposition."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _value(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def _total(samples: dict, name: str) -> float:
    return sum(v for (n, _), v in samples.items() if n == name)


def _wait(predicate, timeout: float, what: str, proc: subprocess.Popen | None = None, log: Path | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = predicate()
        if result:
            return result
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"neardup run exited ({proc.returncode}) while waiting for {what}:\n{log.read_text() if log else ''}")
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}:\n{log.read_text()[-4000:] if log else ''}")


def _read_committed(bootstrap: str, topic: str, partitions: int = 1) -> list:
    """Every committed message of ``topic``, up to the end of each partition."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"reader-{uuid.uuid4().hex[:12]}",
            "isolation.level": "read_committed",
            "enable.partition.eof": True,
            "enable.auto.commit": False,
        }
    )
    try:
        consumer.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
        at_end: set[int] = set()
        got = []
        deadline = time.monotonic() + 60
        while len(at_end) < partitions:
            assert time.monotonic() < deadline, f"{topic}: end not reached"
            msg = consumer.poll(0.5)
            if msg is None:
                continue
            if msg.error():
                if msg.error().code() == KafkaError._PARTITION_EOF:
                    at_end.add(msg.partition())
                    continue
                raise KafkaException(msg.error())
            at_end.discard(msg.partition())
            got.append(msg)
        return got
    finally:
        consumer.close()


@pytest.fixture
def stories(tmp_path: Path) -> Path:
    path = tmp_path / "stories.jsonl"
    with gzip.open(DATA, "rt", encoding="utf-8") as src:
        path.write_text("".join(line for _, line in zip(range(STORIES), src)), encoding="utf-8")
    return path


def test_run_serves_metrics_that_match_the_output_topics(kafka_bootstrap, kafka_topic_factory, tmp_path, stories):
    unique_topic = kafka_topic_factory("metrics-unique")
    duplicate_topic = kafka_topic_factory("metrics-dups")
    dlq_topic = kafka_topic_factory("metrics-dlq")
    input_topic = f"metrics-in-{uuid.uuid4().hex[:12]}"  # created once the consumer waits
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = tmp_path / "run.log"
    cmd = [
        sys.executable, "-m", "neardup.cli", "run",
        "--bootstrap-servers", kafka_bootstrap,
        "--input-topic", f"^{input_topic}$",
        "--unique-topic", unique_topic, "--duplicate-topic", duplicate_topic, "--dlq-topic", dlq_topic,
        "--group-id", f"metrics-{uuid.uuid4().hex[:12]}",
        "--from-beginning", "--text-field", "text", "--id-field", "id",
        "--batch-size", "64", "--max-message-bytes", str(MAX_MESSAGE_BYTES),
        # every document joins its buckets, so copies share them (largest bucket >= 2)
        "--duplicate-buckets", "all",
        "--state-dir", str(tmp_path / "state"),
        "--metrics-host", "127.0.0.1", "--metrics-port", str(port),
        "-X", "topic.metadata.refresh.interval.ms=1000",
        "--log-format", "json",
    ]
    with open(log, "wb") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        # Alive, connected to the broker, but no partition to consume: not ready.
        _wait(lambda: _get(f"{base}/healthz")[0] == 200, 30, "/healthz", proc, log)
        status, body = _wait(
            lambda: (r := _get(f"{base}/readyz"))[1].strip() == "no partitions assigned" and r,
            60, "the broker to answer", proc, log,
        )
        assert status == 503

        create_topics(kafka_bootstrap, [input_topic], partitions=2)
        status, body = _wait(lambda: (r := _get(f"{base}/readyz"))[0] == 200 and r, 60, "assignment", proc, log)
        assert body.startswith("ready: 2 partition")

        assert main(["produce", str(stories), "--topic", input_topic, "--bootstrap-servers", kafka_bootstrap]) == 0
        producer = Producer({"bootstrap.servers": kafka_bootstrap})
        for kind, value in BAD_MESSAGES:
            producer.produce(input_topic, key=kind.encode(), value=value)
        assert producer.flush(30) == 0
        total = STORIES + len(BAD_MESSAGES)

        def processed() -> dict | None:
            samples = _samples(_get(f"{base}/metrics")[1])
            done = _total(samples, "neardup_documents_total") + _total(samples, "neardup_dead_letter_total")
            return samples if done >= total else None

        samples = _wait(processed, 120, f"{total} messages to be counted", proc, log)

        unique = _read_committed(kafka_bootstrap, unique_topic)
        duplicates = _read_committed(kafka_bootstrap, duplicate_topic)
        dead = _read_committed(kafka_bootstrap, dlq_topic)
        assert len(unique) + len(duplicates) + len(dead) == total
        assert len(duplicates) > 0
        assert _value(samples, "neardup_documents_total", verdict="unique") == len(unique)
        assert _value(samples, "neardup_documents_total", verdict="duplicate") == len(duplicates)
        assert _total(samples, "neardup_dead_letter_total") == len(dead) == len(BAD_MESSAGES)
        by_key = {m.key().decode(): m for m in dead}
        for kind, _ in BAD_MESSAGES:
            assert _value(samples, "neardup_dead_letter_total", reason=kind) == 1, kind
            assert kind in by_key, kind

        committed = _value(samples, "neardup_transactions_total", outcome="committed")
        assert committed >= 1
        assert _value(samples, "neardup_transactions_total", outcome="aborted") == 0
        assert _value(samples, "neardup_batch_seconds_count") == committed
        assert _value(samples, "neardup_latency_seconds_count") == total
        assert _value(samples, "neardup_candidates_count") == STORIES
        assert _value(samples, "neardup_match_similarity_count") == len(duplicates)
        assert _value(samples, "neardup_cluster_size_count") == len(duplicates)
        assert _value(samples, "neardup_replayed_total") == 0
        # the standard collectors, and counters without _created series
        assert _value(samples, "process_resident_memory_bytes") > 0
        assert any(name == "python_info" for name, _ in samples)
        assert not [name for name, _ in samples if name.endswith("_created")]
        assert _value(samples, "neardup_documents_expired_total") == 0  # no retention window
        assert _value(samples, "neardup_restore_in_progress") == 0
        info = [labels for (name, labels) in samples if name == "neardup_build_info"]
        assert len(info) == 1 and dict(info[0])["num_perm"] == "128"
        for partition in ("0", "1"):
            assert _value(samples, "neardup_consumer_lag", topic=input_topic, partition=partition) == 0

        # The state gauges are refreshed at most every 5 s, on batches and when idle.
        def state_caught_up() -> dict | None:
            s = _samples(_get(f"{base}/metrics")[1])
            return s if _value(s, "neardup_state_documents") == STORIES else None

        samples = _wait(state_caught_up, 30, "the state gauges", proc, log)
        # exact verification (the default) keeps shingle fingerprints, not signatures
        assert _value(samples, "neardup_state_keys", family="shingles") > 0
        assert _value(samples, "neardup_state_keys", family="signatures") == 0
        assert _value(samples, "neardup_state_bytes", kind="memtable") > 0
        assert _value(samples, "neardup_state_bytes", kind="bucket_index") > 0
        assert _value(samples, "neardup_state_bytes", kind="set_cache") > 0
        assert _value(samples, "neardup_largest_bucket_size") >= 2  # duplicates share buckets

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log.read_text()
        lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
        assert any("serving /metrics" in line["message"] for line in lines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        try:
            from confluent_kafka.admin import AdminClient

            AdminClient({"bootstrap.servers": kafka_bootstrap}).delete_topics([input_topic])
        except Exception:
            pass


def test_embedded_metrics_match_the_summary(tmp_path, stories):
    stories.write_text(stories.read_text() + '{"id": "blank", "text": " "}\n')
    metrics = Metrics()
    seen: list[Verdict | Rejected] = []

    def on_batch(results, seconds):
        seen.extend(results)
        metrics.observe_results(results, seconds)

    summary = dedup_files([str(stories)], EngineSettings(), tmp_path / "out", ["text"], "id",
                          batch_size=50, on_batch=on_batch)
    with MetricsServer(metrics, "127.0.0.1", 0) as server:
        status, text = _get(f"{server.url}/metrics")
        assert status == 200
        assert _get(f"{server.url}/readyz") == (200, "ready\n")
    samples = _samples(text)
    assert _value(samples, "neardup_documents_total", verdict="unique") == summary.unique
    assert _value(samples, "neardup_documents_total", verdict="duplicate") == summary.duplicates > 0
    assert _value(samples, "neardup_dead_letter_total", reason="empty_text") == summary.rejects == 1
    assert _value(samples, "neardup_candidates_rejected_total") == summary.rejected_candidates
    assert _value(samples, "neardup_batch_seconds_count") == 7
    sizes = [v.cluster_size for v in seen if isinstance(v, Verdict) and v.is_duplicate]
    assert _value(samples, "neardup_cluster_size_sum") == sum(sizes) >= 2 * summary.duplicates
    for reason in DEAD_LETTER_REASONS:  # every reason exists from the start
        assert ("neardup_dead_letter_total", (("reason", reason),)) in samples


def test_readiness_needs_assignment_and_a_recent_broker():
    readiness = Readiness(broker_timeout=0.2)
    assert readiness.check() == (False, "broker not reached yet")
    readiness.broker_answered()
    assert readiness.check() == (False, "no partitions assigned")
    readiness.set_assignment([TopicPartition("t", 0)])
    assert readiness.check()[0]
    time.sleep(0.3)
    ok, reason = readiness.check()
    assert not ok and reason.startswith("broker silent")


def test_two_registries_do_not_clash():
    a, b = Metrics(), Metrics()
    a.documents.labels("unique").inc(3)
    assert _value(_samples(b.exposition().decode()), "neardup_documents_total", verdict="unique") == 0


def test_endpoints_answer_get_and_head_only():
    import http.client

    def request(server: MetricsServer, method: str, path: str) -> tuple[int, dict[str, str], bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        try:
            conn.request(method, path)
            response = conn.getresponse()
            return response.status, dict(response.getheaders()), response.read()
        finally:
            conn.close()

    with MetricsServer(Metrics(), "127.0.0.1", 0) as server:
        for path in ("/", "/healthz", "/readyz", "/metrics"):
            status, headers, body = request(server, "GET", path)
            assert status == 200 and body
            status, head_headers, head_body = request(server, "HEAD", path)
            assert status == 200 and head_body == b""
            assert head_headers.get("Content-Type") == headers.get("Content-Type")
            for method in ("POST", "PUT", "PATCH", "DELETE", "TRACE", "OPTIONS"):
                status, headers, _ = request(server, method, path)
                assert status == 405, (method, path, status)
                assert headers["Allow"] == "GET, HEAD"


def _families(registry) -> dict[str, object]:
    return {family.name: family for family in registry.collect()}


def test_standard_collectors_and_no_created_series():
    from neardup.metrics import StageMetrics

    for metrics in (Metrics(), StageMetrics("decide")):
        samples = _samples(metrics.exposition().decode())
        names = {name for name, _ in samples}
        assert {"process_resident_memory_bytes", "process_cpu_seconds_total", "python_info",
                "python_gc_collections_total"} <= names
        assert _value(samples, "process_resident_memory_bytes") > 0
        assert not [n for n in names if n.endswith("_created")]
        for family in metrics.registry.collect():  # counters end in _total
            if family.type == "counter":
                assert all(s.name == family.name + "_total" for s in family.samples), family.name


def test_documents_expired_is_a_counter_read_from_the_state():
    from neardup.core.types import Document
    from neardup.detector import Detector
    from neardup.state.memory import MemoryStateStore
    from neardup.core.retention import Retention

    engine = EngineSettings()
    store = MemoryStateStore(engine.state_shape(), retention=Retention(documents=10))
    detector = Detector(engine, store)
    detector.process([Document(str(i), f"story number {i} about something else entirely {i * 7}") for i in range(25)])
    expired = store.stats()["documents_expired"]
    assert expired == 15
    metrics = Metrics()
    metrics.refresh_state(store, force=True)
    family = _families(metrics.registry)["neardup_documents_expired"]
    assert family.type == "counter"
    samples = _samples(metrics.exposition().decode())
    assert _value(samples, "neardup_documents_expired_total") == expired
    assert "neardup_documents_expired" not in {name for name, _ in samples}
    # a process started again on the same state goes on from its count, not from 0
    again = Metrics()
    again.refresh_state(store, force=True)
    assert _value(_samples(again.exposition().decode()), "neardup_documents_expired_total") == expired


def test_restore_in_progress_and_its_statistics():
    from neardup.kafka.changelog import RestoreStats

    metrics = Metrics()
    metrics.observe_restore(True)
    samples = _samples(metrics.exposition().decode())
    assert _value(samples, "neardup_restore_in_progress") == 1
    metrics.observe_restore(RestoreStats(records=120, bytes=4096, seconds=1.5))
    samples = _samples(metrics.exposition().decode())
    assert _value(samples, "neardup_restore_in_progress") == 0
    assert _value(samples, "neardup_restore_records_total") == 120
    assert _value(samples, "neardup_restore_bytes_total") == 4096
    assert _value(samples, "neardup_restore_seconds_total") == 1.5


def test_one_label_name_for_a_verdict():
    """``verdict`` in both modes (unique|duplicate); ``outcome`` only for a transaction's
    committed|aborted; decide's dead letters in a counter of their own, as ``run``'s."""
    from neardup.sharded.decide_stage import DecideWritten
    from neardup.metrics import StageMetrics

    stage = StageMetrics("decide")
    stage.observe(DecideWritten([], messages=10, unique=6, duplicate=3, dead_letter=1))
    run = Metrics()
    for metrics in (run, stage):
        for family in metrics.registry.collect():
            values = {(k, v) for s in family.samples for k, v in s.labels.items()}
            if {v for _, v in values} & {"unique", "duplicate"}:
                assert {k for k, v in values if v in ("unique", "duplicate")} == {"verdict"}, family.name
            if any(k == "outcome" for k, _ in values):
                assert family.name.endswith("transactions"), family.name
    samples = _samples(stage.exposition().decode())
    assert _value(samples, "neardup_stage_documents_total", stage="decide", verdict="unique") == 6
    assert _value(samples, "neardup_stage_documents_total", stage="decide", verdict="duplicate") == 3
    assert _value(samples, "neardup_stage_dead_letter_total", stage="decide") == 1
    assert _value(samples, "neardup_stage_transactions_total", stage="decide", outcome="committed") == 1


def test_observe_many_counts_as_observe_does_one_amount_at_a_time() -> None:
    """Amounts on the bounds, between them, below the first, above the last (+Inf), and
    none: the exposition of ``observe_many`` is the loop's, its sum to the last bits."""
    import numpy as np
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from neardup.metrics import observe_many

    rng = np.random.default_rng(7)
    bounds = (0.0, 0.5, 1.0, 2.0, 10.0)
    amounts = np.concatenate([rng.uniform(-1, 12, 500), np.array(bounds), [-5.0, 1e9, 0.5, 0.5]])
    exposed = []
    for many in (False, True):
        registry = CollectorRegistry()
        h = Histogram("h", "a histogram", registry=registry, buckets=bounds)
        if many:
            observe_many(h, amounts)
            observe_many(h, [])
        else:
            for a in amounts.tolist():
                h.observe(a)
        families = {s.name + str(sorted(s.labels.items())): s.value
                    for f in text_string_to_metric_families(generate_latest(registry).decode())
                    for s in f.samples if not s.name.endswith("_created")}
        exposed.append(families)
    loop, many = exposed
    assert many.keys() == loop.keys() and len(loop) == len(bounds) + 3  # buckets, +Inf, count, sum
    for name, value in loop.items():
        assert many[name] == pytest.approx(value, rel=1e-12), name
    assert many["h_count[]"] == len(amounts)


def test_verdict_columns_are_observed_as_their_verdicts(stories):
    """``Metrics.observe_columns`` (a ``neardup run`` batch) counts what
    ``observe_verdicts`` counts of the same verdicts, less those that became dead letters."""
    from neardup.core.types import Document  # noqa: PLC0415
    from neardup.detector import Detector  # noqa: PLC0415
    from neardup.state.memory import MemoryStateStore  # noqa: PLC0415

    engine = EngineSettings()
    detector = Detector(engine, MemoryStateStore(engine.state_shape()))
    records = [json.loads(line) for line in stories.read_text(encoding="utf-8").splitlines()]
    docs = [Document(str(r["id"]), r["text"]) for r in records[:300]]
    result = detector.detect(docs + docs[:40])  # the last 40: copies, duplicates
    dead = [3, 301, 320]
    kept = [v for i, v in enumerate(result.verdicts) if i not in set(dead)]
    by_columns, by_verdicts = Metrics(), Metrics()
    by_columns.observe_columns(result.columns, dead)
    by_verdicts.observe_verdicts(kept)
    assert sum(v.is_duplicate for v in kept) > 0

    def samples(m: Metrics) -> dict:
        names = ("neardup_candidates", "neardup_match_similarity", "neardup_cluster_size",
                 "neardup_candidates_rejected")
        return {(s.name, tuple(sorted(s.labels.items()))): round(s.value, 9)
                for family in text_string_to_metric_families(m.exposition().decode())
                if family.name.startswith(names) for s in family.samples}

    assert samples(by_columns) == samples(by_verdicts)
    assert samples(by_columns)
