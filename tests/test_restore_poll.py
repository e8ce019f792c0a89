"""A restore longer than ``max.poll.interval.ms`` keeps the consumer in its group:
the stage runtime runs ``Processor.check`` in a thread of its own while its consumer keeps
polling with the partitions held paused (``neardup.kafka.stage``)."""

from __future__ import annotations

import re
import threading
import time
import uuid

from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient

from kafka_util import free_port, http_get, produce, read_all, unique
from neardup.config import load_settings
from neardup.kafka.partition_log import read_to_end
from neardup.sharded.topology import Topology
from neardup.sharded.records import ORDER
from test_sharded_kafka import _check_verdicts, _Stages, _stories_and_copies

#: The shard's ``max.poll.interval.ms`` (librdkafka wants it >= ``session.timeout.ms``;
#: deploy/local/kafka.sh's broker takes sessions down to 1 s), ms.
MAX_POLL_MS = 3000
#: Changelog records of the shard's one partition: about 10 s of restore here, at
#: about 110,000 records a second.
CHANGELOG_RECORDS = 1_200_000
RESTORED = re.compile(r"shard (\d+) restored from \S+: (\d+) records, .*? in ([\d.]+) s")


class _Readiness:
    """Polls a process's ``/readyz`` and its restore and waiting gauges in a thread: every
    (``/readyz`` status, its body, (restore gauge, waiting-since gauge) read just before,
    the same read just after) seen. A restore can begin or end between two reads; the two
    gauge reads around each ``/readyz`` read let a test see which one fell inside it."""

    def __init__(self, port: int, stage: str) -> None:
        self.base, self.stage, self.seen = f"http://127.0.0.1:{port}", stage, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _gauge(self, metrics: str, name: str) -> float | None:
        m = re.search(rf'^{name}{{stage="{self.stage}"}} (\S+)$', metrics, re.M)
        return float(m.group(1)) if m else None

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            try:
                before = self._gauges()
                status, body = http_get(f"{self.base}/readyz")
                after = self._gauges()
            except OSError:  # a read timing out: the next poll serves
                continue
            if status and before and after:
                self.seen.append((status, body.strip(), before, after))

    def _gauges(self) -> tuple[float | None, float | None] | None:
        code, metrics = http_get(f"{self.base}/metrics")
        if code != 200:
            return None
        return (self._gauge(metrics, "neardup_stage_restore_in_progress"),
                self._gauge(metrics, "neardup_stage_input_waiting_since_timestamp_seconds"))

    def stop(self) -> list[tuple[int, str, tuple, tuple]]:
        self._stop.set()
        self._thread.join(10)
        return self.seen


def _input_and_long_changelog(kafka_bootstrap: str, topic: str, shards: int):
    """(topic, its messages, the topology): 200 stories and their copies produced to
    ``topic``, and a shard changelog of ``shards`` x ``CHANGELOG_RECORDS`` deletions of held
    records never held: read and applied by a restore, the state they leave is empty (the
    verdicts are those of fresh shards)."""
    messages = _stories_and_copies(200)
    produce(kafka_bootstrap, topic, messages)
    topology = Topology(f"restore-{uuid.uuid4().hex[:8]}", shards=shards, decide_partitions=1)
    topology.ensure(AdminClient({"bootstrap.servers": kafka_bootstrap}))
    produce(kafka_bootstrap, topology.shard_changelog,
            ((b"H" + ORDER.pack(0, 0, i), None) for i in range(shards * CHANGELOG_RECORDS)))
    return topic, messages, topology


def test_a_restore_longer_than_max_poll_interval_keeps_the_assignment(kafka_bootstrap, kafka_topic_factory,
                                                                      tmp_path):
    """The shard stage's one partition restores from a changelog that takes several
    times ``max.poll.interval.ms`` to read: the consumer stays in the group (librdkafka
    never says the interval was exceeded), the partition is restored once, and every
    message comes out once, with the sharded rules' verdicts."""
    topic, messages, topology = _input_and_long_changelog(kafka_bootstrap, kafka_topic_factory("restore-poll", partitions=2),
                                                           shards=1)
    log = tmp_path / "stages.log"
    stages = _Stages(kafka_bootstrap, topic, topology, log)
    port = free_port()
    out = []
    try:
        stages.start("prepare")
        stages.start("decide")
        stages.start("shard", "a", "-X", f"session.timeout.ms={MAX_POLL_MS}",
                     "-X", f"max.poll.interval.ms={MAX_POLL_MS}", "--metrics-port", str(port),
                     "--metrics-host", "127.0.0.1")
        readiness = _Readiness(port, "shard")
        deadline = time.monotonic() + 240
        while len(out) < len(messages) and time.monotonic() < deadline:
            text = log.read_text()
            # fail at once: without the runtime's polling, the restore is cut short by
            # the group again and again and nothing ever comes out
            assert "maximum poll interval" not in text, text[-3000:]
            assert stages.alive(), text[-3000:]
            out = read_all(kafka_bootstrap, [f"{topic}.unique", f"{topic}.duplicates", f"{topic}.dlq"],
                           idle_s=2.0, timeout_s=30)
        seen = readiness.stop()
    finally:
        stages.stop()
    text = log.read_text()
    assert "maximum poll interval" not in text and "leaving group" not in text, text[-3000:]
    restores = [(int(p), int(n), float(s)) for p, n, s in RESTORED.findall(text)]
    assert len(restores) == 1, restores  # restored once: never lost to the group midway
    # during the restore /readyz says so (503), the restore gauge is 1 and no input counts
    # as waiting (no stall alert); afterwards it is ready again
    restoring = [x for x in seen if x[0] == 503 and x[1].startswith(f"restoring the state of {topology.bands}[0]")]
    assert len(restoring) >= 5, seen[:40]
    # a 10 s restore spans many polls: of the gauge reads just before and just after a
    # /readyz that said "restoring", at least one fell inside the restore
    assert all((1.0, 0.0) in (x[2], x[3]) for x in restoring), [x for x in restoring if (1.0, 0.0) not in (x[2], x[3])]
    # and away from its two ends both did
    assert all(x[2] == x[3] == (1.0, 0.0) for x in restoring[1:-1]), restoring
    assert not [x for x in seen if "stalled" in x[1]], seen
    assert seen[-1][0] == 200 and seen[-1][2][0] == seen[-1][3][0] == 0.0, seen[-10:]
    (_, records, seconds), = restores
    assert records == CHANGELOG_RECORDS
    assert seconds > 2 * MAX_POLL_MS / 1000, f"the restore took only {seconds} s: the test proves nothing"
    assert re.search(rf"checked {re.escape(topology.bands)}\[0\] in [\d.]+ s, held paused", text), text[-3000:]
    assert len(out) == len(messages), text[-3000:]
    _check_verdicts(kafka_bootstrap, topic, topology, out, dead_letters=frozenset())


def test_a_rebalance_during_a_restore_keeps_every_message_once(kafka_bootstrap, kafka_topic_factory, tmp_path):
    """A second shard process joins while the first restores both shard partitions: the
    first stays in the group and serves the rebalance during its restore, drops the
    partition it lost once the restore has ended (``Processor.revoked`` waits for it)
    and restores the one it was given again; every message comes out once, with the
    sharded rules' verdicts."""
    # about half in each partition (the keys' hashes): about 10 s of restore each
    topic, messages, topology = _input_and_long_changelog(kafka_bootstrap,
                                                           kafka_topic_factory("restore-rebalance", partitions=2), shards=2)
    logs = {name: tmp_path / f"{name}.log" for name in ("stages", "a", "b")}
    stages = _Stages(kafka_bootstrap, topic, topology, logs["stages"])
    shards = {name: _Stages(kafka_bootstrap, topic, topology, logs[name],
                            extra=("-X", f"session.timeout.ms={MAX_POLL_MS}",
                                   "-X", f"max.poll.interval.ms={MAX_POLL_MS}")) for name in ("a", "b")}
    both = f"{topology.bands}[0], {topology.bands}[1]"
    out = []
    try:
        stages.start("prepare")
        stages.start("decide")
        shards["a"].start("shard", "a")
        deadline = time.monotonic() + 60
        while f"assigned {both}" not in logs["a"].read_text():
            assert time.monotonic() < deadline and shards["a"].alive(), logs["a"].read_text()[-3000:]
            time.sleep(0.2)
        time.sleep(2.0)  # into the restore of both partitions
        shards["b"].start("shard", "b")
        deadline = time.monotonic() + 240
        alive = lambda: stages.alive() and all(s.alive() for s in shards.values())  # noqa: E731
        while len(out) < len(messages) and time.monotonic() < deadline:
            assert alive()
            out = read_all(kafka_bootstrap, [f"{topic}.unique", f"{topic}.duplicates", f"{topic}.dlq"],
                           idle_s=2.0, timeout_s=30)
    finally:
        for s in (stages, *shards.values()):
            s.stop()
    text = {name: path.read_text() for name, path in logs.items()}
    for name in ("a", "b"):
        assert "maximum poll interval" not in text[name] and "leaving group" not in text[name], text[name][-3000:]
    # a: both partitions checked in one go, the rebalance served meanwhile, then the
    # partition it kept checked again (restored from the changelog anew)
    first = text["a"].index(f"checked {both} in ")
    assert text["a"].index("revoked ") < first, text["a"][-3000:]  # served while it restored
    kept = re.findall(rf"assigned {re.escape(topology.bands)}\[(\d)\]$", text["a"], re.M)
    assert len(kept) == 1, text["a"][-3000:]
    again = [p for p, _, _ in (RESTORED.findall(text["a"][first:]))]
    assert again == kept, text["a"][-3000:]
    gone = 1 - int(kept[0])
    assert [int(p) for p, _, _ in RESTORED.findall(text["b"])] == [gone], text["b"][-3000:]
    assert len(out) == len(messages), text["stages"][-3000:]
    _check_verdicts(kafka_bootstrap, topic, topology, out, dead_letters=frozenset())


def test_a_restore_ends_while_another_member_writes_to_its_partition(kafka_bootstrap, kafka_topic_factory):
    """``read_to_end`` stops at the end the partition had when it began, though another
    member (the partition's new owner, after a rebalance during the restore) keeps
    committing transactions to it: a restore the runtime lets finish after its partition
    was revoked ends, instead of following the new owner's writes."""
    topic = kafka_topic_factory("restore-tail", partitions=1)
    produce(kafka_bootstrap, topic, ((b"H" + ORDER.pack(0, 0, i), None) for i in range(300_000)))
    writing = threading.Event()
    done = threading.Event()

    def owner() -> None:  # a transaction of a few records every 20 ms until the read has ended
        producer = Producer({"bootstrap.servers": kafka_bootstrap, "transactional.id": unique("restore-tail")})
        producer.init_transactions(30)
        i = 0
        while not done.wait(0.02):
            producer.begin_transaction()
            for _ in range(5):
                producer.produce(topic, key=b"H" + ORDER.pack(1, 0, i), value=None, partition=0)
                i += 1
            producer.commit_transaction(30)
            writing.set()
        producer.flush(10)

    writer = threading.Thread(target=owner, daemon=True)
    writer.start()
    try:
        assert writing.wait(30)
        settings = load_settings({"bootstrap_servers": kafka_bootstrap, "input_topics": [topic]})
        got = threading.Event()
        records = []

        def read() -> None:
            records.extend(m.offset() for chunk in read_to_end(settings, topic, 0) for m in chunk)
            got.set()

        threading.Thread(target=read, daemon=True).start()
        assert got.wait(120), "the read followed the other member's writes and never ended"
    finally:
        done.set()
        writer.join(60)
    assert len(records) >= 300_000 + 5  # what was there when it began: the 300,000 and a transaction
    assert records == sorted(set(records))


def test_sigterm_during_a_restore_ends_it_first_then_exits_0(kafka_bootstrap, kafka_topic_factory, tmp_path):
    """SIGTERM while a shard partition restores: the restore (which cannot be interrupted)
    ends, the consumer polling meanwhile, then the stage closes and exits 0."""
    topic = kafka_topic_factory("restore-sigterm", partitions=1)
    topology = Topology(f"restore-{uuid.uuid4().hex[:8]}", shards=1, decide_partitions=1)
    topology.ensure(AdminClient({"bootstrap.servers": kafka_bootstrap}))
    produce(kafka_bootstrap, topology.shard_changelog,
            ((b"H" + ORDER.pack(0, 0, i), None) for i in range(CHANGELOG_RECORDS)))
    log = tmp_path / "stages.log"
    stages = _Stages(kafka_bootstrap, topic, topology, log,
                     extra=("-X", f"session.timeout.ms={MAX_POLL_MS}", "-X", f"max.poll.interval.ms={MAX_POLL_MS}"))
    try:
        stages.start("shard")
        deadline = time.monotonic() + 60
        while f"assigned {topology.bands}[0]" not in log.read_text():
            assert time.monotonic() < deadline and stages.alive(), log.read_text()[-3000:]
            time.sleep(0.2)
        time.sleep(2.0)  # into the restore
        assert stages.terminate("shard") == 0, log.read_text()[-3000:]
    finally:
        stages.stop()
    text = log.read_text()
    assert "Traceback" not in text and "maximum poll interval" not in text, text[-3000:]
    stopping = text.index(f"stopping once the check of {topology.bands}[0] has ended")
    restored = text.index("shard 0 restored from")
    assert stopping < restored < text.index("consumer closed after 0 batches"), text[-3000:]
