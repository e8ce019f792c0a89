"""Helpers for tests against the real broker: produce, read back, run `neardup run`."""

from __future__ import annotations

import gzip
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition

REPO_ROOT = Path(__file__).resolve().parent.parent
EXCERPT = REPO_ROOT / "tests" / "data" / "reuters_excerpt.jsonl.gz"
# Short sessions so that a restarted consumer gets the partitions of a killed one fast.
FAST_GROUP = ["-X", "session.timeout.ms=3000", "-X", "heartbeat.interval.ms=500"]


def unique(name: str) -> str:
    """``name`` made unique (``<name>-<8 hex>``), for a consumer group or transactional id:
    tests run at the same time on one broker, and a group's changelog topic outlives the
    test, so that a fixed group used again would restore another run's state."""
    return f"{name}-{uuid.uuid4().hex[:8]}"


def excerpt(limit: int | None = None) -> list[dict]:
    with gzip.open(EXCERPT, "rt", encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    return records[:limit]


def input_producer(bootstrap: str, max_bytes: int = 1_000_000) -> Producer:
    """The idempotent producer ``produce`` uses, connected to the broker before it is
    returned: a record's timestamp is taken when it is produced, and records produced
    while a new client still connects can reach a stage reading at the partition's end
    more than its reorder window (500 ms) after their timestamps, to be processed late
    (once, on a loaded CI machine, a shard processed 250 records of a live input late,
    their verdicts not one process's)."""
    producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True,
                         "linger.ms": 20, "message.max.bytes": max_bytes})
    producer.list_topics(timeout=30)
    return producer


def produce(bootstrap: str, topic: str, messages: Iterable[tuple[Any, ...]],
            headers: list[tuple[str, bytes]] | None = None, max_bytes: int = 1_000_000,
            timeout_s: float = 60.0, producer: Producer | None = None) -> int:
    """Produce (key, value) pairs, or (key, value, headers) triples, in order; returns how
    many. ``headers``: those of every pair; ``max_bytes``: the producer's
    ``message.max.bytes``; ``timeout_s``: the longest wait for their delivery;
    ``producer``: one to use (``input_producer``) instead of a new one."""
    producer = producer or input_producer(bootstrap, max_bytes)
    n = 0
    for key, value, *own in messages:
        while True:
            try:
                producer.produce(topic, key=key, value=value, headers=own[0] if own else headers)
                break
            except BufferError:
                producer.poll(0.1)
        n += 1
    assert producer.flush(timeout_s) == 0, f"not every message was delivered in {timeout_s:.0f} s"
    return n


@dataclass(frozen=True)
class Out:
    topic: str
    key: bytes | None
    value: bytes | None
    headers: dict[str, bytes]
    header_list: tuple[tuple[str, bytes], ...] = ()  # as received, in order
    partition: int = -1
    offset: int = -1


def read_all(bootstrap: str, topics: list[str], expected: int | None = None,
             idle_s: float = 3.0, timeout_s: float = 120.0) -> list[Out]:
    """Every committed message of ``topics`` (read_committed), in per-partition order.

    Stops after ``expected`` messages (if given) and then ``idle_s`` without more, or
    after ``idle_s`` without any message, or at ``timeout_s``.
    """
    consumer = Consumer({
        "bootstrap.servers": bootstrap, "group.id": f"reader-{time.time_ns()}",
        "auto.offset.reset": "earliest", "isolation.level": "read_committed",
        "enable.auto.commit": False,
    })
    consumer.subscribe(topics)
    out: list[Out] = []
    deadline = time.monotonic() + timeout_s
    last = time.monotonic()
    try:
        while time.monotonic() < deadline:
            batch = consumer.consume(1000, timeout=0.5)
            got = [m for m in batch if m.error() is None]
            if got:
                last = time.monotonic()
                out += [Out(m.topic(), m.key(), m.value(), dict(m.headers() or []), tuple(m.headers() or ()),
                            m.partition(), m.offset()) for m in got]
            elif time.monotonic() - last > idle_s and (expected is None or len(out) >= expected):
                break
    finally:
        consumer.close()
    return out


#: Answers of a group coordinator that is still loading (a freshly started broker), and
#: the time-out of a fetch held back by offsets of a transaction still open (a consumer
#: killed mid-transaction: the broker aborts it after transaction.timeout.ms, 60 s).
NOT_READY = {KafkaError.NOT_COORDINATOR, KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
             KafkaError.COORDINATOR_NOT_AVAILABLE, KafkaError._TIMED_OUT}


def committed_offset(bootstrap: str, group: str, topic: str, partition: int = 0,
                     timeout_s: float = 120.0) -> int:
    """The consumer group's committed offset of one partition (-1001 when none); asks
    again while the group coordinator is not ready or the offsets are not stable."""
    deadline = time.monotonic() + timeout_s
    while True:
        consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": group,
                             "enable.auto.commit": False})
        try:
            return consumer.committed([TopicPartition(topic, partition)], timeout=10)[0].offset
        except KafkaException as exc:
            if exc.args[0].code() not in NOT_READY or time.monotonic() > deadline:
                raise
        finally:
            consumer.close()
        time.sleep(0.5)


def start_run(bootstrap: str, topic: str, group: str, state_dir: Path, *extra: str,
              log: Path | None = None) -> subprocess.Popen:
    """Start `neardup run` as a real process."""
    cmd = [sys.executable, "-m", "neardup.cli", "run", "--bootstrap-servers", bootstrap,
           "--input-topic", topic, "--group-id", group, "--state-dir", str(state_dir),
           "--from-beginning", "--metrics-port", "0", *FAST_GROUP, *extra]
    stream = open(log, "ab") if log else subprocess.DEVNULL
    return subprocess.Popen(cmd, stdout=stream, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def wait_committed(bootstrap: str, group: str, topic: str, target: int, proc: subprocess.Popen,
                   timeout_s: float = 300.0, log: Path | None = None) -> None:
    """Wait until the group has committed ``target`` on partition 0 of ``topic``; the
    error raised (the process gone, or the time out) ends with the tail of ``log``."""
    deadline = time.monotonic() + timeout_s
    tail = (lambda: "\n" + log.read_text(errors="replace")[-4000:]) if log else (lambda: "")
    while time.monotonic() < deadline:
        if committed_offset(bootstrap, group, topic) >= target:
            return
        assert proc.poll() is None, f"neardup run exited early with {proc.returncode}{tail()}"
        time.sleep(0.2)
    raise TimeoutError(f"{group} did not reach offset {target} of {topic} "
                       f"(at {committed_offset(bootstrap, group, topic)}){tail()}")


def catches(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler for ``sig`` (Linux: SigCgt in /proc/<pid>/status)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = next((line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), "0")
    return bool(int(mask, 16) >> (sig - 1) & 1)


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout_s: float = 60.0) -> int:
    """Send ``sig`` once the process handles it (not while the interpreter is still
    starting, where it would die of it), then wait for its exit code."""
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None and not catches(proc.pid, sig) and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(sig)
    return proc.wait(timeout=timeout_s)


def create_topic(bootstrap: str, name: str, config: dict[str, str] | None = None,
                 timeout: float = 30.0) -> str:
    """Create one topic (one partition) with topic ``config`` and wait for its leader."""
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(name, 1, 1, config=config or {})])[name].result(timeout)
    deadline = time.monotonic() + timeout
    while True:
        topic = admin.list_topics(timeout=5).topics.get(name)
        if topic is not None and topic.error is None and all(p.leader >= 0 for p in topic.partitions.values()):
            return name
        assert time.monotonic() < deadline, f"topic {name} not ready"
        time.sleep(0.1)


def run_until_committed(settings, state_dir: Path, target: int, timeout_s: float = 180.0,
                        consumer=None, on_batch=None) -> tuple[object, list[Exception]]:
    """Run a ``KafkaDeduplicator`` (or ``consumer``, a subclass) in a thread of this
    process until its group has committed ``target`` on partition 0 of its first input
    topic, then stop it; returns it and the errors of the batches it aborted.
    ``on_batch(dedup, stats)`` is called after every committed batch."""
    import threading

    from neardup.detector import Detector
    from neardup.run import KafkaDeduplicator
    from neardup.state.rocksdb import RocksDBStateStore

    engine = settings.engine()
    topic, group = settings.input_topics[0], settings.group_id
    aborts: list[Exception] = []
    with RocksDBStateStore(state_dir, engine.state_shape()) as store:
        dedup = (consumer or KafkaDeduplicator)(
            settings, Detector(engine, store), on_abort=aborts.append,
            on_batch=(lambda stats: on_batch(dedup, stats)) if on_batch else None)
        runner = threading.Thread(target=dedup.run, kwargs={"install_signal_handlers": False})
        runner.start()
        try:
            deadline = time.monotonic() + timeout_s
            while committed_offset(settings.bootstrap_servers, group, topic) < target:
                assert runner.is_alive(), "the consumer stopped"
                assert time.monotonic() < deadline, f"offset {target} not committed in {timeout_s} s; aborts: {aborts[:3]}"
                time.sleep(0.2)
        finally:
            dedup.stop()
            runner.join(60)
    assert not runner.is_alive()
    return dedup, aborts


class SteadyInput:
    """Produces JSON messages with ids 0, 1, ... at ``rate`` per second in a thread,
    through broker outages (librdkafka queues them); ``delivered`` holds the ids whose
    delivery was confirmed."""

    def __init__(self, bootstrap: str, topic: str, rate: float) -> None:
        self.topic, self.rate = topic, rate
        self.records = excerpt()
        self.delivered: set[str] = set()
        self.failed: list[str] = []
        self.sent = 0
        self._stop = threading.Event()
        self._producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True,
                                   "linger.ms": 5, "message.timeout.ms": 600000})
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _on_delivery(self, err, msg) -> None:
        if err is None:
            self.delivered.add(msg.key().decode())
        else:
            self.failed.append(str(err))

    def _run(self) -> None:
        start = time.monotonic()
        while not self._stop.is_set():
            due = int((time.monotonic() - start) * self.rate)
            while self.sent < due:
                r = self.records[self.sent % len(self.records)]
                key = str(self.sent)
                value = json.dumps({"id": key, "text": r["text"]}).encode()
                self._producer.produce(self.topic, key=key.encode(), value=value,
                                       on_delivery=self._on_delivery)
                self.sent += 1
            self._producer.poll(0.02)

    def __enter__(self) -> SteadyInput:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
        assert self._producer.flush(300) == 0, "the test's input was not all delivered"


_HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback only, no proxy


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the OS's pick)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_get(url: str) -> tuple[int, str]:
    """(status, body) of a GET; (0, reason) when nothing listens yet."""
    try:
        with _HTTP.open(url, timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except urllib.error.URLError as exc:
        return 0, str(exc.reason)
