"""`neardup run` against a real Apache Kafka broker: verdicts, exactly once, dead letters."""

from __future__ import annotations

import json
import logging
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition
from kafka_util import (
    committed_offset,
    excerpt,
    produce,
    read_all,
    start_run,
    stop,
    unique,
    wait_committed,
)

from neardup.config import load_settings
from neardup.core.settings import EngineSettings
from neardup.core.types import Document, Verdict
from neardup.detector import Detector
from neardup.embedded import dedup_files
from neardup.run import KafkaDeduplicator
from neardup.state.memory import MemoryStateStore
from neardup.state.rocksdb import RocksDBStateStore

JSON_FIELDS = ["--text-field", "text", "--id-field", "id"]


def _json_messages(records: list[dict]) -> list[tuple[bytes, bytes]]:
    return [(str(r["id"]).encode(), json.dumps(r).encode()) for r in records]


def _verdict_of(out) -> tuple:
    h = out.headers
    return (h["neardup-verdict"].decode(), h["neardup-cluster"].decode(),
            h["neardup-match"].decode(), h["neardup-similarity"].decode())


def _expected(records: list[dict]) -> dict[str, tuple]:
    """Verdicts of an uninterrupted in-process run over the same documents, same order."""
    settings = EngineSettings()
    detector = Detector(settings, MemoryStateStore(settings.state_shape()))
    out: dict[str, tuple] = {}
    for i in range(0, len(records), 1000):
        docs = [Document(str(r["id"]), r["text"]) for r in records[i:i + 1000]]
        for v in detector.process(docs):
            assert isinstance(v, Verdict)
            out[v.id] = (v.verdict, v.cluster, v.match or "", f"{v.similarity:.6f}")
    return out


def _outputs(kafka_bootstrap: str, topic: str, expected: int):
    outs = read_all(kafka_bootstrap, [f"{topic}.unique", f"{topic}.duplicates", f"{topic}.dlq"],
                    expected=expected)
    return outs


def _workers(proc) -> list[int]:
    """Pids of the pipeline's worker processes among the children of ``proc`` (or a pid)."""
    pid = getattr(proc, "pid", proc)
    children = []
    for task in Path(f"/proc/{pid}/task").glob("*"):  # a child belongs to the thread that started it
        try:
            children += (task / "children").read_text().split()
        except OSError:
            pass
    out = []
    for pid in children:
        try:
            if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                out.append(int(pid))
        except OSError:
            pass
    return out


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _until_worker_started(dedup) -> None:
    """Wait (in ``on_batch``) until the pipeline's worker has started: batches are
    prepared in the consumer until then, and in the worker after."""
    deadline = time.monotonic() + 60
    while not dedup._worker_ready():
        assert time.monotonic() < deadline, "the worker did not start in 60 s"
        time.sleep(0.05)


def _wait_for_line(log: Path, text: str, proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in (log.read_text() if log.exists() else ""):
        assert proc.poll() is None, f"neardup run exited early with {proc.returncode}"
        assert time.monotonic() < deadline, f"no {text!r} in the log after {timeout_s} s"
        time.sleep(0.1)


def _prepared_ahead(log: Path) -> tuple[int, int]:
    """(batches, of them prepared in the worker) from the consumer's closing log line."""
    found = re.findall(r"consumer closed after (\d+) batches, (\d+) of them prepared ahead", log.read_text())
    assert found, log.read_text()[-3000:]
    return int(found[-1][0]), int(found[-1][1])


@pytest.mark.parametrize("pipeline", [True, False], ids=["pipeline", "no-pipeline"])
def test_run_gives_the_verdicts_of_dedup(pipeline, kafka_bootstrap, kafka_topic_factory, tmp_path):
    records = excerpt()  # the whole committed excerpt, 4,000 stories
    topic = kafka_topic_factory("wire")

    summary = dedup_files(
        [str(_write_jsonl(tmp_path / "in.jsonl", records))], EngineSettings(),
        out_dir=tmp_path / "out", text_fields=["text"], id_field="id", progress=False,
    )
    by_dedup = {}
    for name in ("unique", "duplicates"):
        for line in (tmp_path / "out" / f"{name}.jsonl").read_text().splitlines():
            rec = json.loads(line)
            v = rec["neardup"]
            by_dedup[str(rec["id"])] = (v["verdict"], v["cluster"], v["match"] or "",
                                        f"{v['similarity']:.6f}")

    log = tmp_path / "run.log"
    flag = "--pipeline" if pipeline else "--no-pipeline"
    # A group (so a changelog) of its own per run: the same group would restore the other
    # run's state, in which every document is already present.
    proc = start_run(kafka_bootstrap, topic, f"g-same-{pipeline}", tmp_path / "state", *JSON_FIELDS,
                     "--batch-size", "500", flag, log=log)
    try:
        if pipeline:  # a backlog that arrives once the worker has started
            _wait_for_line(log, "preparing worker started", proc)
        produce(kafka_bootstrap, topic, _json_messages(records))
        wait_committed(kafka_bootstrap, f"g-same-{pipeline}", topic, len(records), proc)
        workers = _workers(proc)
    finally:
        assert stop(proc) == 0
    assert len(workers) == (1 if pipeline else 0)
    assert not any(_alive(w) for w in workers), "the worker outlived the consumer"
    batches, ahead = _prepared_ahead(log)
    assert batches >= len(records) // 500
    if pipeline:  # full batches read ahead once the worker had started (the first were
        # consumed while the messages were still arriving)
        assert "preparing worker started" in log.read_text()
        assert 1 <= ahead < batches, (batches, ahead)
    else:
        assert ahead == 0
    outs = _outputs(kafka_bootstrap, topic, len(records))

    by_run = {o.key.decode(): _verdict_of(o) for o in outs}
    assert len(outs) == len(records) == len(by_run)
    assert summary.duplicates > 20
    assert by_run == by_dedup
    # headers and values pass through unchanged, and the topic matches the verdict
    for o in outs:
        assert json.loads(o.value)["id"] == int(o.key)
        assert o.topic == f"{topic}.{'duplicates' if o.headers['neardup-verdict'] == b'duplicate' else 'unique'}"


def test_partitions_read_unevenly_give_the_verdicts_of_record_time_order(kafka_bootstrap, kafka_topic_factory,
                                                                          tmp_path):
    """A backlog over 4 partitions, 70% of it in partition 0 and none in partition 3, its
    record times in file order: the client fetches the small partitions' records long
    before partition 0's of the same record time, yet `neardup run` (batches of 50) gives
    the verdicts of `dedup` over the file in order, and the empty partition holds nothing
    back."""
    from confluent_kafka import Producer

    records = _edited_copies(excerpt(600), rounds=3)  # each story, then two edited copies
    topic = kafka_topic_factory("uneven", partitions=4)
    producer = Producer({"bootstrap.servers": kafka_bootstrap, "enable.idempotence": True, "linger.ms": 20})
    first = int(time.time() * 1000) - len(records) * 1000
    for i, (key, value) in enumerate(_json_messages(records)):  # 1 s of record time apart, in order
        producer.produce(topic, key=key, value=value, partition=0 if i % 10 < 7 else 1 + i % 2,
                         timestamp=first + i * 1000)
    assert producer.flush(60) == 0
    ends = _partition_ends(kafka_bootstrap, topic, 4)
    assert ends[3] == 0 and ends[0] > ends[1] + ends[2]
    log = tmp_path / "run.log"
    group = f"g-{topic}"  # and so a changelog of its own
    proc = start_run(kafka_bootstrap, topic, group, tmp_path / "state", *JSON_FIELDS,
                     "--batch-size", "50", log=log)
    try:
        _wait(lambda: all(committed_offset(kafka_bootstrap, group, topic, p) >= end
                          for p, end in enumerate(ends) if end), proc, timeout_s=240)
    finally:
        assert stop(proc) == 0
    _assert_once_with_dedup_verdicts(kafka_bootstrap, topic, records)
    assert sum(v[0] == "duplicate" for v in _expected(records).values()) >= 1000  # the copies


def _write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _edited_copies(records: list[dict], rounds: int, seed: int = 7) -> list[dict]:
    """``records`` replayed ``rounds`` times; each replay lightly edited, as wire copy is."""
    rng = random.Random(seed)
    out = []
    for r in range(rounds):
        for rec in records:
            words = rec["text"].split()
            if r and words:
                edit = rng.randrange(3)
                if edit == 0:  # a typo fixed
                    i = rng.randrange(len(words))
                    words[i] = words[i][::-1]
                elif edit == 1:  # a new footer
                    words += ["(Updated", "with", "closing", "prices)"]
                else:  # a word dropped
                    del words[rng.randrange(len(words))]
            out.append({"id": f"{rec['id']}-r{r}", "text": " ".join(words)})
    return out


def _run_in_thread(settings, state_dir: Path, on_batch, target: int,
                   timeout_s: float = 180.0, consumer=KafkaDeduplicator) -> KafkaDeduplicator:
    """Run a ``consumer`` (``KafkaDeduplicator`` or a subclass) in a thread of this
    process until its group has committed ``target`` on partition 0 of its input topic,
    then stop it.

    ``on_batch(dedup, stats)`` is called after every batch."""
    engine = settings.engine()
    topic, group = settings.input_topics[0], settings.group_id
    with RocksDBStateStore(state_dir, engine.state_shape()) as store:
        dedup = consumer(settings, Detector(engine, store),
                         on_batch=lambda stats: on_batch(dedup, stats))
        runner = threading.Thread(target=dedup.run, kwargs={"install_signal_handlers": False})
        runner.start()
        try:
            deadline = time.monotonic() + timeout_s
            while committed_offset(settings.bootstrap_servers, group, topic) < target:
                assert runner.is_alive() and time.monotonic() < deadline
                time.sleep(0.2)
        finally:
            dedup.stop()
            runner.join(60)
    assert not runner.is_alive()
    return dedup

def _assert_once_with_dedup_verdicts(bootstrap: str, topic: str, records: list[dict]) -> None:
    """Every record came out exactly once, with the verdict ``dedup`` gives it."""
    outs = _outputs(bootstrap, topic, len(records))
    keys = [o.key.decode() for o in outs]
    assert len(keys) == len(set(keys)) == len(records)
    assert {o.key.decode(): _verdict_of(o) for o in outs} == _expected(records)

def test_sigkill_at_random_points_loses_and_repeats_nothing(kafka_bootstrap, kafka_topic_factory, tmp_path):
    records = _edited_copies(excerpt(), rounds=5)  # 20,000 messages
    assert len(records) >= 20_000
    # The last 4,000 are produced after the kills, so that every kill lands before the
    # end of the input however fast the consumer is.
    held_back = 4_000
    topic = kafka_topic_factory("crash")
    group = unique("g-crash")
    produce(kafka_bootstrap, topic, _json_messages(records[:-held_back]))
    expected = _expected(records)

    state, log = tmp_path / "state", tmp_path / "run.log"
    rng = random.Random(2026)
    targets = sorted(rng.sample(range(1_000, len(records) - held_back - 1_000), 4))
    progress, seen = [], []
    for target in targets:  # kill right after a random offset is committed, plus a random delay
        proc = start_run(kafka_bootstrap, topic, group, state, *JSON_FIELDS, "--batch-size", "500", log=log)
        try:
            wait_committed(kafka_bootstrap, group, topic, target, proc)
            time.sleep(rng.uniform(0.0, 0.4))
            assert proc.poll() is None, log.read_text()[-3000:]
            workers = _workers(proc)  # none yet if the target was reached before this start
            seen += workers
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
        deadline = time.monotonic() + 10
        while any(_alive(w) for w in workers):
            assert time.monotonic() < deadline, "the worker outlived a killed consumer"
            time.sleep(0.1)
        progress.append(committed_offset(kafka_bootstrap, group, topic))
    print("committed offsets after each SIGKILL:", progress, "; workers killed with the consumer:", seen)
    assert seen, "the pipeline's worker process was running"
    assert progress == sorted(progress) and progress[0] >= targets[0]
    produce(kafka_bootstrap, topic, _json_messages(records[-held_back:]))
    proc = start_run(kafka_bootstrap, topic, group, state, *JSON_FIELDS, log=log)
    try:
        wait_committed(kafka_bootstrap, group, topic, len(records), proc, timeout_s=600)
    finally:
        assert stop(proc) == 0

    outs = _outputs(kafka_bootstrap, topic, len(records))
    keys = [o.key.decode() for o in outs]
    assert len(keys) == len(set(keys)), "a message was produced twice"
    assert set(keys) == set(expected), "a message is missing"
    got = {o.key.decode(): _verdict_of(o) for o in outs}
    assert got == expected
    dups = [k for k, v in got.items() if v[0] == "duplicate"]
    assert len(dups) > 10_000  # the replays are found
    assert all(got[k][2] != k for k in dups), "a document matched itself"


def test_bad_input_goes_to_the_dead_letter_topic(kafka_bootstrap, kafka_topic_factory, tmp_path):
    good = excerpt(40)
    bad = [
        (b"bad-utf8", b"\xff\xfe not utf-8"),
        (b"bad-json", b"{not json"),
        (b"no-field", json.dumps({"id": "no-field", "body": "x"}).encode()),
        (b"empty", json.dumps({"id": "empty", "text": "  \n\t "}).encode()),
        (b"too-big", json.dumps({"id": "too-big", "text": "word " * 4000}).encode()),
        (b"tomb", None),
    ]
    goods = _json_messages(good)
    messages: list[tuple[bytes | None, bytes | None]] = list(goods)
    for i, (key, value) in enumerate(bad):  # spread among the good ones
        messages.insert(3 + 7 * i, (key, value))
    topic = kafka_topic_factory("dirty")
    group = unique("g-dirty")
    produce(kafka_bootstrap, topic, messages, headers=[("origin", b"test")])
    proc = start_run(kafka_bootstrap, topic, group, tmp_path / "state", *JSON_FIELDS,
                     "--max-message-bytes", "16384")
    try:
        wait_committed(kafka_bootstrap, group, topic, len(messages), proc)
    finally:
        assert stop(proc) == 0
    outs = _outputs(kafka_bootstrap, topic, len(messages))
    dlq = {o.key.decode(): o for o in outs if o.topic == f"{topic}.dlq"}
    processed = {o.key.decode() for o in outs if o.topic != f"{topic}.dlq"}
    assert processed == {k.decode() for k, _ in goods}
    assert set(dlq) == {"bad-utf8", "bad-json", "no-field", "empty", "too-big", "tomb"}
    reasons = {
        "bad-utf8": "invalid UTF-8", "bad-json": "invalid JSON", "no-field": "missing field",
        "empty": "empty text after normalisation", "too-big": "exceeds the limit of 16384 bytes",
        "tomb": "null value (tombstone)",
    }
    for key, reason in reasons.items():
        o = dlq[key]
        assert reason in o.headers["neardup-error"].decode()
        assert o.headers["neardup-source-topic"].decode() == topic
        assert o.headers["neardup-source-partition"] == b"0"
        assert int(o.headers["neardup-source-offset"]) >= 0
        assert o.headers["origin"] == b"test"  # original headers kept
    assert dlq["tomb"].value is None
    assert dlq["bad-utf8"].value == b"\xff\xfe not utf-8"


def test_sigterm_then_restart_has_no_gap_and_no_repeat(kafka_bootstrap, kafka_topic_factory, tmp_path):
    records = excerpt(1200)
    first, second = records[:600], records[600:]
    topic = kafka_topic_factory("term")
    group = unique("g-term")
    produce(kafka_bootstrap, topic, _json_messages(first))
    proc = start_run(kafka_bootstrap, topic, group, tmp_path / "state", *JSON_FIELDS)
    wait_committed(kafka_bootstrap, group, topic, len(first), proc)
    assert stop(proc, signal.SIGTERM) == 0
    produce(kafka_bootstrap, topic, _json_messages(second))
    proc = start_run(kafka_bootstrap, topic, group, tmp_path / "state", *JSON_FIELDS)
    try:
        wait_committed(kafka_bootstrap, group, topic, len(records), proc)
    finally:
        assert stop(proc, signal.SIGINT) == 0
    outs = _outputs(kafka_bootstrap, topic, len(records))
    keys = [o.key.decode() for o in outs]
    assert sorted(keys) == sorted(str(r["id"]) for r in records)
    assert {k: v for k, v in ((o.key.decode(), _verdict_of(o)) for o in outs)} == _expected(records)


def test_a_restart_deletes_the_outcomes_its_last_run_kept(kafka_bootstrap, kafka_topic_factory, tmp_path):
    """Each message's outcome is kept until the next batch commits; a stop (or a kill)
    leaves the last batch's, for a replay. Once the group has committed past them, the
    next run deletes them: over runs, the store keeps the outcomes of one batch, not one
    batch per stop."""
    records = _edited_copies(excerpt(300), rounds=2)  # 600 messages
    topic = kafka_topic_factory("stale-outcomes")
    group, state = unique("g-stale-outcomes"), tmp_path / "state"
    batches = ["--batch-size", "100", *JSON_FIELDS]
    for start, end, kill in ((0, 300, signal.SIGTERM), (300, 450, signal.SIGKILL), (450, 600, signal.SIGTERM)):
        produce(kafka_bootstrap, topic, _json_messages(records[start:end]))
        proc = start_run(kafka_bootstrap, topic, group, state, *batches, log=tmp_path / "run.log")
        try:
            wait_committed(kafka_bootstrap, group, topic, end, proc, log=tmp_path / "run.log")
        finally:
            assert stop(proc, kill) in (0, -signal.SIGKILL)
    _assert_once_with_dedup_verdicts(kafka_bootstrap, topic, records)
    settings = load_settings({"bootstrap_servers": kafka_bootstrap, "input_topics": [topic]})
    store = RocksDBStateStore(state, settings.engine().state_shape())
    try:
        prefix = f"{topic}:0".encode() + b"\0"
        kept = [int.from_bytes(key[len(prefix):], "big") for key in store.verdict_keys(prefix, prefix + b"\xff" * 9)]
    finally:
        store.close()
    assert kept and len(kept) <= 100 and min(kept) >= 450, kept  # the last batch's only
    assert "deleting the stored outcomes of" in (tmp_path / "run.log").read_text()


@pytest.mark.parametrize("step", ["before_state_commit", "after_state_commit", "after_kafka_commit"])
def test_crash_at_each_step_of_the_protocol(step, kafka_bootstrap, kafka_topic_factory, tmp_path):
    """A crash between any two steps of a batch: after restart, exactly once, same verdicts."""
    records = _edited_copies(excerpt(300), rounds=2)  # 600 messages, 6 batches of 100
    topic = kafka_topic_factory("step")
    produce(kafka_bootstrap, topic, _json_messages(records))
    group, state = unique(f"g-{step}"), tmp_path / "state"
    crashed = subprocess.run(
        [sys.executable, str(Path(__file__).parent / "crash_run.py"), step, "3",
         kafka_bootstrap, topic, group, str(state)],
        capture_output=True, text=True, timeout=120,
    )
    assert crashed.returncode == 9, crashed.stderr[-2000:]
    before = committed_offset(kafka_bootstrap, group, topic)
    assert before == (300 if step == "after_kafka_commit" else 200)

    proc = start_run(kafka_bootstrap, topic, group, state, *JSON_FIELDS)
    try:
        wait_committed(kafka_bootstrap, group, topic, len(records), proc)
    finally:
        assert stop(proc) == 0
    _assert_once_with_dedup_verdicts(kafka_bootstrap, topic, records)


def test_regex_subscription_and_per_topic_outputs(kafka_bootstrap, kafka_topic_factory, tmp_path):
    prefix = f"feed{random.randrange(10**6)}"
    group = unique("g-regex")
    first, second = kafka_topic_factory(f"{prefix}-a"), kafka_topic_factory(f"{prefix}-b")
    records = excerpt(200)
    produce(kafka_bootstrap, first, _json_messages(records[:100]))
    produce(kafka_bootstrap, second, _json_messages(records[100:]))
    log = tmp_path / "run.log"  # a failure below ends with its tail
    proc = start_run(kafka_bootstrap, f"^{prefix}-.*", group, tmp_path / "state", *JSON_FIELDS,
                     "-X", "topic.metadata.refresh.interval.ms=1000", log=log)
    try:
        wait_committed(kafka_bootstrap, group, first, 100, proc, log=log)
        wait_committed(kafka_bootstrap, group, second, 100, proc, log=log)
    finally:
        assert stop(proc) == 0, log.read_text(errors="replace")[-4000:]
    for topic, part in ((first, records[:100]), (second, records[100:])):
        outs = _outputs(kafka_bootstrap, topic, len(part))
        assert sorted(o.key.decode() for o in outs) == sorted(str(r["id"]) for r in part)
        assert {o.topic for o in outs} <= {f"{topic}.unique", f"{topic}.duplicates"}
    # the outputs the pattern matches are read past, and get no outputs of their own
    from confluent_kafka.admin import AdminClient

    names = AdminClient({"bootstrap.servers": kafka_bootstrap}).list_topics(timeout=10).topics
    assert not [n for n in names if n.startswith(prefix) and n.count(".") > 1]


def test_rebalance_to_a_second_instance_keeps_exactly_once(kafka_bootstrap, kafka_topic_factory, tmp_path):
    """A second consumer joins the group mid-stream: partitions are revoked from the first
    between batches, and every message still comes out exactly once."""
    records = _edited_copies(excerpt(1500), rounds=2)  # 3,000 messages over 2 partitions
    first, second = _json_messages(records[:1500]), _json_messages(records[1500:])
    topic = kafka_topic_factory("rebal", partitions=2)
    group = unique("g-rebal")
    produce(kafka_bootstrap, topic, first)
    a = start_run(kafka_bootstrap, topic, group, tmp_path / "a", *JSON_FIELDS,
                  "--transactional-id", f"{group}-a", "--batch-size", "200", log=tmp_path / "a.log")
    b = None
    try:
        _wait(lambda: sum(max(committed_offset(kafka_bootstrap, group, topic, p), 0)
                          for p in (0, 1)) >= 600, a)
        # b's state has never seen the partitions a committed offsets for: accepted
        # knowingly (its index lacks a's documents)
        b = start_run(kafka_bootstrap, topic, group, tmp_path / "b", *JSON_FIELDS,
                      "--transactional-id", f"{group}-b", "--batch-size", "200", "--reset-state",
                      log=tmp_path / "b.log")
        # b holds a partition: the group has rebalanced while a was working
        _wait(lambda: re.search(r"assigned \S+\[\d\]", (tmp_path / "b.log").read_text()), b)
        produce(kafka_bootstrap, topic, second)
        _wait(lambda: [committed_offset(kafka_bootstrap, group, topic, p) for p in (0, 1)]
              == _partition_ends(kafka_bootstrap, topic), a, timeout_s=240)
    finally:
        assert stop(a) == 0
        if b is not None:
            assert stop(b) == 0
    assert "revoked" in (tmp_path / "a.log").read_text()
    outs = _outputs(kafka_bootstrap, topic, len(records))
    keys = [o.key.decode() for o in outs]
    assert len(keys) == len(set(keys)) == len(records)


def _wait(condition, proc, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert proc.poll() is None, "a consumer exited early"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def _partition_ends(bootstrap: str, topic: str, partitions: int = 2) -> list[int]:
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": "ends"})
    try:
        return [c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in range(partitions)]
    finally:
        c.close()


def test_rebalance_while_a_batch_is_read_ahead_keeps_exactly_once(kafka_bootstrap, kafka_topic_factory,
                                                                   tmp_path, caplog):
    """A second member joins the group while the consumer holds a batch read ahead: the
    revocation is served by the read-ahead, the held messages are dropped, and after the
    member leaves every message comes out exactly once with the verdicts of a plain run."""
    records = _edited_copies(excerpt(1000), rounds=2)  # 2,000 messages, one partition
    topic = kafka_topic_factory("ahead")
    produce(kafka_bootstrap, topic, _json_messages(records))
    group = unique("g-ahead")
    fast = {"session.timeout.ms": "6000", "heartbeat.interval.ms": "300"}
    settings = load_settings({
        "bootstrap_servers": kafka_bootstrap, "input_topics": [topic], "group_id": group,
        "from_beginning": True, "text_field": ["text"], "id_field": "id", "batch_size": 200,
        "kafka": fast,
    })
    assert settings.pipeline

    def intruder() -> None:  # joins, holds the partition (or nothing) for a while, leaves
        c = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": group,
                      "enable.auto.commit": False, **fast})
        c.subscribe([topic])
        deadline = time.monotonic() + 4
        while time.monotonic() < deadline:
            c.poll(0.1)
        c.close()

    joined: list[threading.Thread] = []

    def on_batch(dedup, stats) -> None:
        if dedup.batches == 1:
            _until_worker_started(dedup)
        if len(joined) == 0 and dedup.batches == 3:
            joined.append(threading.Thread(target=intruder, daemon=True))
            joined[0].start()
            time.sleep(2)  # the group rebalances; the revocation waits in our queue

    caplog.set_level(logging.INFO, logger="neardup")
    dedup = _run_in_thread(settings, tmp_path / "state", on_batch, len(records))
    assert joined, "the second member joined"
    joined[0].join(10)
    log = caplog.text
    assert "rebalanced while reading ahead: messages of revoked partitions dropped" in log
    assert dedup.batches_prepared_ahead > 0

    _assert_once_with_dedup_verdicts(kafka_bootstrap, topic, records)


def test_a_dead_worker_is_replaced_by_preparing_inline(kafka_bootstrap, kafka_topic_factory, tmp_path, caplog):
    """The worker process is killed mid-run: the consumer prepares its batches itself from
    then on, with the same verdicts, every message exactly once."""

    records = _edited_copies(excerpt(1000), rounds=2)  # 2,000 messages
    topic = kafka_topic_factory("worker")
    produce(kafka_bootstrap, topic, _json_messages(records))
    group = unique("g-worker")
    settings = load_settings({
        "bootstrap_servers": kafka_bootstrap, "input_topics": [topic], "group_id": group,
        "from_beginning": True, "text_field": ["text"], "id_field": "id", "batch_size": 200,
    })
    killed: list[int] = []

    def on_batch(dedup, stats) -> None:
        if dedup.batches == 1:
            _until_worker_started(dedup)
        if not killed and dedup.batches == 4:
            killed.extend(_workers(os.getpid()))
            for pid in killed:
                os.kill(pid, signal.SIGKILL)

    caplog.set_level(logging.INFO, logger="neardup")
    dedup = _run_in_thread(settings, tmp_path / "state", on_batch, len(records))
    assert len(killed) == 1
    assert "the preparing worker process died" in caplog.text
    # batches 3 and 4, and maybe 5 and 6: batch 4's commit is taken up (and the kill
    # sent) while batch 5 is processed, with batch 6 already handed to the worker, whose
    # preparations may come back before the kill lands
    assert 2 <= dedup.batches_prepared_ahead <= 4 < dedup.batches

    _assert_once_with_dedup_verdicts(kafka_bootstrap, topic, records)


class _FailingCommit(KafkaDeduplicator):
    """Step 5 of batch ``fail_at`` fails in its thread without committing (as a broker
    timeout would): the transaction stays open with the batch's messages produced."""

    fail_at = 3

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.step5 = 0
        self.aborted: list[Exception] = []
        self.on_abort = self.aborted.append

    def _commit_offsets(self, producer, pending, offsets, metadata, started) -> None:
        self.step5 += 1
        if self.step5 == self.fail_at:
            pending.error = KafkaException(KafkaError(KafkaError._TIMED_OUT, "injected", retriable=True))
            return
        super()._commit_offsets(producer, pending, offsets, metadata, started)


def test_a_failed_commit_in_its_thread_is_retried_exactly_once(kafka_bootstrap, kafka_topic_factory, tmp_path):
    """Step 5 of one batch fails while the next batch is being detected: the transaction is
    aborted, both batches are consumed again (the failed one as replays of its stored
    outcomes), and every message comes out once with the verdicts of a plain run."""
    records = _edited_copies(excerpt(300), rounds=2)  # 600 messages, 6 batches of 100
    topic = kafka_topic_factory("step5")
    produce(kafka_bootstrap, topic, _json_messages(records))
    settings = load_settings({
        "bootstrap_servers": kafka_bootstrap, "input_topics": [topic], "group_id": unique("g-step5"),
        "from_beginning": True, "text_field": ["text"], "id_field": "id", "batch_size": 100,
        "pipeline": False,
    })
    dedup = _run_in_thread(settings, tmp_path / "state", lambda dedup, stats: None, len(records),
                           timeout_s=120, consumer=_FailingCommit)
    assert [str(e.args[0].str()) for e in dedup.aborted] == ["injected"]
    assert dedup.step5 > dedup.batches >= 6  # the failed batch's step 5 ran again
    _assert_once_with_dedup_verdicts(kafka_bootstrap, topic, records)


def test_sigterm_wrapped_by_the_library_it_interrupted_still_exits_0(monkeypatch, caplog):
    """SIGTERM landing inside a library call while the command starts, which turns the
    raised signal into an exception of its own (pydantic building a settings class turns
    it into a ``SchemaError``): the command still stops with 0, not a traceback."""
    import neardup.cli as cli

    def interrupted(args):
        try:
            os.kill(os.getpid(), signal.SIGTERM)  # the handler raises here, on the next bytecode
            time.sleep(5)
        except BaseException:
            raise RuntimeError("Error building a validator")  # noqa: B904 - as the library does
        raise AssertionError("SIGTERM was not handled")

    monkeypatch.setattr(cli, "_settings", interrupted)
    assert threading.current_thread() is threading.main_thread()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    with caplog.at_level(logging.INFO, logger="neardup"):
        code = cli.main(["stage", "shard", "--bootstrap-servers", "127.0.0.1:1", "--input-topic", "never",
                         "--app", "never"])
    assert code == 0
    assert "stopped by SIGTERM while starting (it interrupted: RuntimeError)" in caplog.text
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the start-up handler is gone again


@pytest.mark.parametrize("role", ["run", "stage-shard"])
def test_sigterm_while_starting_exits_0_without_a_traceback(tmp_path, role):
    """A consumer stopped while it still waits for a broker (none listens on the port):
    SIGTERM, sent as soon as the process handles it, ends it with 0 and no traceback."""
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed = f"127.0.0.1:{s.getsockname()[1]}"
    log = tmp_path / "run.log"
    if role == "run":
        proc = start_run(closed, "never", unique("g-never"), tmp_path / "state", *JSON_FIELDS, log=log)
    else:
        proc = subprocess.Popen(
            [sys.executable, "-m", "neardup.cli", "stage", "shard", "--bootstrap-servers", closed,
             "--input-topic", "never", "--app", "never", "--shards", "2"],
            stdout=log.open("ab"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        assert stop(proc, timeout_s=60) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "Traceback" not in log.read_text()
