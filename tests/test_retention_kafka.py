"""`neardup run --retention` against a real Kafka broker: the window follows the record
timestamps, and SIGKILLs at random points change no verdict and lose or repeat nothing."""

from __future__ import annotations

import json
import random
import signal
import time
from pathlib import Path

from confluent_kafka import Producer
from kafka_util import committed_offset, excerpt, read_all, start_run, stop, unique, wait_committed

from neardup.core.retention import Retention
from neardup.core.settings import EngineSettings
from neardup.core.types import Document, Verdict
from neardup.detector import Detector
from neardup.state.memory import MemoryStateStore

RETENTION_S = 1800  # 30 min of record time; the stream spans 2,000 messages x 2 s


def _records(seed: int = 9) -> list[dict]:
    """600 stories and lightly edited copies of them, 2,000 in all; each copy follows its
    story by up to 1,500 messages, so some are within the window and some beyond. Record
    times run 2 s apart with up to 90 s of jitter (out of order, as from several producers)."""
    rng = random.Random(seed)
    stories = excerpt(600)
    out = [{"id": str(r["id"]), "text": r["text"]} for r in stories]
    while len(out) < 2000:
        story = rng.choice(stories)
        words = story["text"].split()
        if len(words) > 10:
            i = rng.randrange(len(words))
            words[i] = words[i][::-1]
        at = min(len(out), stories.index(story) + rng.randint(1, 1500))
        out.insert(at, {"id": f"{story['id']}~{len(out)}", "text": " ".join(words)})
    start_ms = 1_700_000_000_000
    for k, record in enumerate(out):
        record["ts_ms"] = start_ms + 2000 * k + rng.randint(-90_000, 90_000)
    return out


def _produce(bootstrap: str, topic: str, records: list[dict]) -> None:
    producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True, "linger.ms": 20})
    for r in records:
        producer.produce(topic, key=r["id"].encode(), value=json.dumps({"id": r["id"], "text": r["text"]}).encode(),
                         timestamp=r["ts_ms"])
        producer.poll(0)
    assert producer.flush(60) == 0


def _expected(records: list[dict]) -> dict[str, tuple]:
    """The verdicts of one uninterrupted in-process run with the same window and times."""
    settings = EngineSettings()
    detector = Detector(settings, MemoryStateStore(settings.state_shape(), retention=Retention(seconds=RETENTION_S)))
    out = {}
    for i in range(0, len(records), 1000):
        docs = [Document(r["id"], r["text"], r["ts_ms"] / 1000) for r in records[i:i + 1000]]
        for v in detector.process(docs):
            assert isinstance(v, Verdict)
            out[v.id] = (v.verdict, v.cluster, v.match or "", f"{v.similarity:.6f}")
    return out


def test_a_time_window_by_record_timestamp_survives_sigkills(kafka_bootstrap, kafka_topic_factory, tmp_path: Path) -> None:
    records = _records()
    topic = kafka_topic_factory("retention")
    expected = _expected(records)
    everything = _expected_without_window(records)
    assert sum(v[0] == "duplicate" for v in expected.values()) < sum(v[0] == "duplicate" for v in everything.values())

    state, log = tmp_path / "state", tmp_path / "run.log"
    group = unique("g-ret")
    flags = ("--text-field", "text", "--id-field", "id", "--batch-size", "200", "--retention", "30m")
    rng = random.Random(7)
    # The input is produced a little ahead of each kill, so that every run has work left
    # when it is killed (however fast it is), and the last run, stopped with SIGTERM,
    # has surely started its loop: it processes the last part itself.
    sent = 0
    for target in (rng.randrange(300, 700), rng.randrange(800, 1200), rng.randrange(1300, 1700)):
        _produce(kafka_bootstrap, topic, records[sent:target + 150])
        sent = target + 150
        proc = start_run(kafka_bootstrap, topic, group, state, *flags, log=log)
        try:
            wait_committed(kafka_bootstrap, group, topic, target, proc, timeout_s=900, log=log)
            time.sleep(rng.uniform(0.0, 0.3))
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
    _produce(kafka_bootstrap, topic, records[sent:])
    proc = start_run(kafka_bootstrap, topic, group, state, *flags, log=log)
    try:
        wait_committed(kafka_bootstrap, group, topic, len(records), proc, timeout_s=900, log=log)
    finally:
        assert stop(proc) == 0, log.read_text()[-3000:]
    assert committed_offset(kafka_bootstrap, group, topic) == len(records)

    outs = read_all(kafka_bootstrap, [f"{topic}.unique", f"{topic}.duplicates", f"{topic}.dlq"], expected=len(records))
    keys = [o.key.decode() for o in outs]
    assert len(keys) == len(set(keys)) == len(records)
    got = {o.key.decode(): (o.headers["neardup-verdict"].decode(), o.headers["neardup-cluster"].decode(),
                            o.headers["neardup-match"].decode(), o.headers["neardup-similarity"].decode())
           for o in outs}
    assert got == expected


def _expected_without_window(records: list[dict]) -> dict[str, tuple]:
    settings = EngineSettings()
    detector = Detector(settings, MemoryStateStore(settings.state_shape()))
    docs = [Document(r["id"], r["text"]) for r in records]
    return {v.id: (v.verdict,) for v in detector.process(docs) if isinstance(v, Verdict)}
