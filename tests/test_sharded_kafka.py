"""The sharded stages against a real broker (docs/scale-out.md)."""

from __future__ import annotations

import json
import shutil
import re
import os
import signal
import struct
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from confluent_kafka.admin import AdminClient

from kafka_util import committed_offset, excerpt, produce, read_all, stop, input_producer
from neardup.config import Settings, load_settings
from neardup.core.settings import EngineSettings
from neardup.core.types import Document
from neardup.detector import Preparer
from neardup.sharded.prepare_stage import PrepareStage
from neardup.sharded.topology import Topology, TopologyMismatchError
from neardup.sharded.records import (
    ID_HEADER,
    KIND_HEADER,
    ORDER,
    ORDER_HEADER,
    SETS_HEADER,
    SHARDS_HEADER,
    WATERMARK_KIND,
    decide_partition,
    engine_digest,
    parse_bands,
    parse_sets,
    parse_sets_ref,
    parse_watermarks,
)
from neardup.sharded.routing import shard_of
from neardup.state.shard_store import is_refs_value, member_refs



def _input(bootstrap: str, make_topic, n: int) -> tuple[str, list[dict]]:
    topic = make_topic("sharded-in", partitions=2)
    records = excerpt(n)
    messages = [(str(r["id"]).encode(), json.dumps(r).encode()) for r in records]
    messages.insert(7, (b"bad", b"{not json"))
    messages.insert(20, (b"empty", json.dumps({"id": "empty", "text": "  "}).encode()))
    produce(bootstrap, topic, messages)
    return topic, records


def _ends(bootstrap: str, topic: str, partitions: int = 2) -> dict[int, int]:
    from confluent_kafka import Consumer, TopicPartition

    c = Consumer({"bootstrap.servers": bootstrap, "group.id": "ends"})
    try:
        return {p: c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in range(partitions)}
    finally:
        c.close()


def _last_offsets(bootstrap: str, topic: str) -> dict[int, int]:
    """The offset of the last committed record of each partition of ``topic``."""
    from confluent_kafka import Consumer

    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"last-{uuid.uuid4().hex}",
                  "auto.offset.reset": "earliest", "isolation.level": "read_committed"})
    c.subscribe([topic])
    out: dict[int, int] = {}
    quiet = time.monotonic()
    while time.monotonic() - quiet < 3:
        for m in c.consume(1000, timeout=0.5):
            if m.error() is None:
                quiet = time.monotonic()
                out[m.partition()] = max(out.get(m.partition(), -1), m.offset())
    c.close()
    return out


def _wait_committed(bootstrap: str, group: str, topic: str, ends: dict[int, int], alive, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while any(committed_offset(bootstrap, group, topic, p) < end for p, end in ends.items()):
        assert alive(), "the stage stopped"
        assert time.monotonic() < deadline, "the stage did not commit the whole input"
        time.sleep(0.3)


def _check_prepared(bootstrap: str, topic: str, topology: Topology, ends: dict[int, int]) -> None:
    """Every input message exactly once in a documents record, with its band records."""
    from neardup.sharded.records import DOCUMENTS_KIND, parse_documents

    out = read_all(bootstrap, [topology.bands, topology.sets, topology.findings])
    records = [o for o in out if o.topic == topology.findings]
    # each document's set once in the set topic, every band record naming its batch's
    set_records = {(o.partition, o.offset): parse_sets(o.value) for o in out if o.topic == topology.sets}
    set_count = Counter(order for sets in set_records.values() for order in sets)
    assert set_count and max(set_count.values()) == 1
    assert all(o.headers.get(KIND_HEADER) == DOCUMENTS_KIND for o in records)
    documents = [entry for o in records for entry in parse_documents(o.value)]
    marks = [o for o in out if o.topic == topology.bands and o.headers.get(KIND_HEADER) == WATERMARK_KIND]
    bands = [o for o in out if o.topic == topology.bands and o.headers.get(KIND_HEADER) != WATERMARK_KIND]
    keys = [ORDER.unpack(d.order)[1:] for d in documents]
    assert all(d.topic == topic for d in documents)
    # watermark records: every input partition's last one is at or past its last document
    last_mark: dict[int, bytes] = {}
    for o in marks:
        for (t, p), (count, mark) in parse_watermarks(o.value).items():
            assert t == topic and count == len(ends)
            last_mark[p] = max(last_mark.get(p, b""), mark)
    for p, end in ends.items():
        last_doc = max((d.order for d in documents if ORDER.unpack(d.order)[1] == p), default=b"")
        assert last_mark[p] >= last_doc
    assert sorted(keys) == sorted((p, off) for p, end in ends.items() for off in range(end))
    assert all(SETS_HEADER in o.headers for o in bands)
    named = [parse_sets_ref(o.headers[SETS_HEADER]) for o in bands]
    bands = [(o, parse_bands(o.value, o.offset, {k: v for at in offsets for k, v in set_records[(sp, at)].items()}))
             for o, (sp, offsets) in zip(bands, named)]
    band_count = Counter(rec.order for _, recs in bands for rec in recs)
    assert set(band_count) == set(set_count)
    assert len(band_count) == sum(d.shards > 0 for d in documents)
    errors = {}
    for d in documents:
        assert band_count.get(d.order, 0) == d.shards
        if d.error is not None:
            errors[d.key] = d.error
    assert set(errors) == {b"bad", b"empty"}
    assert errors[b"bad"].startswith("invalid_json") and errors[b"empty"].startswith("empty_text")
    return documents, bands


def test_prepare_routes_every_document_to_its_shards_and_decide_partition(kafka_bootstrap, kafka_topic_factory):
    topic, records = _input(kafka_bootstrap, kafka_topic_factory, 300)
    topology = Topology(f"sharded-{uuid.uuid4().hex[:8]}", shards=3, decide_partitions=2)
    settings = load_settings({"bootstrap_servers": kafka_bootstrap, "input_topics": [topic],
                              "group_id": f"{topology.app}.prepare", "from_beginning": True,
                              "text_field": ["text"], "id_field": "id", "batch_size": 64})
    stage = PrepareStage(settings, topology)
    import threading

    runner = threading.Thread(target=stage.run, kwargs={"install_signal_handlers": False})
    runner.start()
    ends = _ends(kafka_bootstrap, topic)
    try:
        _wait_committed(kafka_bootstrap, settings.group_id, topic, ends, runner.is_alive)
    finally:
        stage.stop()
        runner.join(60)
    documents, bands = _check_prepared(kafka_bootstrap, topic, topology, ends)
    # the band records hold what one process computes, split by owner
    engine = EngineSettings()
    by_id = {str(r["id"]): r["text"] for r in records}
    per_doc: dict[str, list] = {}
    for o, recs in bands:
        for rec in recs:
            per_doc.setdefault(rec.id, []).append((o, rec))
    ids = sorted(per_doc)
    p = Preparer(engine)([Document(i, by_id[i]) for i in ids])
    for v, doc_id in enumerate(ids):
        got = per_doc[doc_id]
        want = p.buckets[v]
        assert sorted(np.concatenate([rec.buckets for _, rec in got]).tolist()) == sorted(want.tolist())
        fp = p.fingerprints[p.fingerprint_offsets[v]:p.fingerprint_offsets[v + 1]]
        for o, rec in got:
            assert np.array_equal(rec.fingerprints, fp)
    partitions = read_partitions(kafka_bootstrap, topology)
    for (topic_name, part), key, value in partitions:
        if topic_name == topology.bands:
            assert all((shard_of(rec.buckets, 3) == part).all() for rec in parse_bands(value))
        else:
            assert decide_partition(key, 2) == part
    assert {d.doc_id for d in documents if d.error is None} == set(by_id) - {"empty"}


def read_partitions(bootstrap: str, topology: Topology) -> list[tuple[tuple[str, int], bytes, bytes]]:
    """(topic, partition), routing key, value of every committed record of the topology
    (a documents record's, once per document: the document's order key)."""
    from confluent_kafka import Consumer

    from neardup.sharded.records import parse_documents

    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"parts-{uuid.uuid4().hex}",
                  "auto.offset.reset": "earliest", "isolation.level": "read_committed"})
    c.subscribe([topology.bands, topology.findings])
    out, last = [], time.monotonic()
    while time.monotonic() - last < 3:
        for m in c.consume(500, timeout=0.5):
            if m.error() is None:
                last = time.monotonic()
                if (KIND_HEADER, WATERMARK_KIND) in (m.headers() or ()):
                    continue
                if m.topic() == topology.bands:
                    out.append(((m.topic(), m.partition()), m.key(), m.value()))
                else:  # each document of a documents record
                    out += [((m.topic(), m.partition()), d.order, m.value()) for d in parse_documents(m.value())]
    c.close()
    return out


def test_prepare_killed_mid_stream_writes_every_document_once(kafka_bootstrap, kafka_topic_factory, tmp_path):
    topic, _ = _input(kafka_bootstrap, kafka_topic_factory, 1500)
    topology = Topology(f"sharded-{uuid.uuid4().hex[:8]}", shards=4, decide_partitions=2)
    group = f"{topology.app}.prepare"
    ends = _ends(kafka_bootstrap, topic)
    log = open(tmp_path / "stage.log", "ab")

    def start(instance: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "neardup.cli", "stage", "prepare", "--bootstrap-servers",
                                 kafka_bootstrap, "--input-topic", topic, "--app", topology.app, "--shards", "4",
                                 "--decide-partitions", "2", "--instance", instance, "--from-beginning",
                                 "--text-field", "text", "--id-field", "id", "--batch-size", "50",
                                 "-X", "session.timeout.ms=6000", "-X", "heartbeat.interval.ms=500"],
                                stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})

    kills = 0
    for _ in range(2):  # SIGKILL twice, each run past its start-up and 150 more of partition 0 (of ~750)
        # relative to where the run starts: the kill of the one before may land late
        target = min(max(committed_offset(kafka_bootstrap, group, topic, 0), 0) + 150, ends[0])
        proc = start("a")
        try:
            deadline = time.monotonic() + 120
            while ((tmp_path / "stage.log").read_text().count("subscribed to") < kills + 1
                   or committed_offset(kafka_bootstrap, group, topic, 0) < target):
                assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "stage.log").read_text()[-3000:]
                time.sleep(0.05)
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
        kills += 1
    proc = start("a")
    try:
        _wait_committed(kafka_bootstrap, group, topic, ends, lambda: proc.poll() is None)
        # the offsets may all be the killed process's: SIGTERM once this one runs its loop
        deadline = time.monotonic() + 120
        while (tmp_path / "stage.log").read_text().count("subscribed to") < kills + 1:
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert kills == 2
    _check_prepared(kafka_bootstrap, topic, topology, ends)


def test_a_shard_started_before_the_other_stages_gets_its_partitions_at_once(kafka_bootstrap, kafka_topic_factory,
                                                                            tmp_path):
    """A shard process started alone on a new deduplication (no prepare or decide has made
    the topology's topics yet) makes them before it subscribes to the band topic, and gets
    its partitions at once. It made them only once assigned, so it subscribed to a topic
    that did not exist and got nothing until its consumer was made anew a minute later."""
    topic = kafka_topic_factory("sharded-shard-first", partitions=1)
    topology = Topology(f"sharded-{uuid.uuid4().hex[:8]}", shards=2, decide_partitions=1)
    log = tmp_path / "stages.log"
    stages = _Stages(kafka_bootstrap, topic, topology, log)
    try:
        started = time.monotonic()
        stages.start("shard")
        while f"assigned {topology.bands}[" not in log.read_text():
            assert stages.alive(), stages.report()
            assert time.monotonic() - started < 40, stages.report()
            time.sleep(0.1)
    finally:
        stages.stop()
    assert "Subscribed topic not available" not in log.read_text(), log.read_text()[-3000:]


def test_a_topology_whose_partition_counts_changed_is_refused(kafka_bootstrap):
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    app = f"sharded-{uuid.uuid4().hex[:8]}"
    created = Topology(app, shards=4, decide_partitions=2).ensure(admin)
    assert sorted(created) == sorted(f"{app}.{name}" for name in (
        "bands", "sets", "findings", "decisions", "shard-changelog", "decide-changelog"))
    assert Topology(app, shards=4, decide_partitions=2).ensure(admin) == []
    with pytest.raises(TopologyMismatchError, match=f"topic {app}.bands has 4 partitions, the topology asks for 8"):
        Topology(app, shards=8, decide_partitions=2).ensure(admin)
    configs = admin.describe_configs([__import__("confluent_kafka.admin", fromlist=["ConfigResource"]).ConfigResource(
        "topic", f"{app}.decisions")])
    (cfg,) = [f.result() for f in configs.values()]
    assert cfg["cleanup.policy"].value == "compact"


# --- the three stages end to end ---------------------------------------------------------

def _stories_and_copies(n: int, seed: int = 5) -> list[tuple[bytes, bytes]]:
    """``n`` stories, then a copy of each with a few words dropped, as (key, JSON value)."""
    rng = np.random.default_rng(seed)
    records = excerpt(n)
    out = [(str(r["id"]).encode(), json.dumps(r).encode()) for r in records]
    for r in records:
        words = r["text"].split()
        for _ in range(int(rng.integers(1, 4))):
            if len(words) > 1:
                del words[int(rng.integers(len(words)))]
        out.append((f"{r['id']}~copy".encode(), json.dumps({"id": f"{r['id']}~copy", "text": " ".join(words)}).encode()))
    return out


def _in_order(bootstrap: str, topic: str) -> list[tuple[tuple[int, int, int], bytes]]:
    """The input's messages as (order key, value), in order-key order."""
    from confluent_kafka import Consumer

    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"order-{uuid.uuid4().hex}",
                  "auto.offset.reset": "earliest"})
    c.subscribe([topic])
    out, last = [], time.monotonic()
    while time.monotonic() - last < 3:
        for m in c.consume(500, timeout=0.5):
            if m.error() is None:
                last = time.monotonic()
                out.append(((m.timestamp()[1], m.partition(), m.offset()), m.value()))
    c.close()
    return sorted(out)


class _Stages:
    """The three stages as real processes (``stage_run.py``)."""

    def __init__(self, bootstrap: str, topic: str, topology: Topology, log: Path, reorder_ms: int = 1000,
                 extra: tuple[str, ...] = ()) -> None:
        self.args = [bootstrap, topic, topology.app, str(topology.shards), str(topology.decide_partitions)]
        self.log_path = log
        self.reorder_ms = str(reorder_ms)
        self.extra = list(extra)
        self.log = open(log, "ab")
        self.procs: dict[tuple[str, str], subprocess.Popen] = {}

    def start(self, role: str, instance: str = "a", *more: str) -> None:
        bootstrap, topic, app, shards, decide = self.args
        self.procs[(role, instance)] = subprocess.Popen(
            [sys.executable, "-m", "neardup.cli", "stage", role, "--bootstrap-servers", bootstrap,
             "--input-topic", topic, "--app", app, "--shards", shards, "--decide-partitions", decide,
             "--instance", instance, "--reorder-window-ms", self.reorder_ms, "--from-beginning",
             "--text-field", "text", "--id-field", "id", "--batch-size", "50",
             "-X", "session.timeout.ms=6000", "-X", "heartbeat.interval.ms=500", *self.extra, *more],
            stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def kill(self, role: str, instance: str = "a") -> None:
        proc = self.procs.pop((role, instance))
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)

    def terminate(self, role: str, instance: str = "a") -> int:
        """SIGTERM once the process handles it; its exit code."""
        proc = self.procs.pop((role, instance))
        return stop(proc)

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs.values())

    def report(self) -> str:
        """Which stages have exited, with their codes, and the end of their shared log."""
        self.log.flush()
        ended = [f"{role}/{instance} exited {p.returncode}" for (role, instance), p in self.procs.items()
                 if p.poll() is not None]
        return f"{', '.join(ended) or 'none exited'}\n{self.log_path.read_text(errors='replace')[-6000:]}"

    def stop_upstream_first(self, topology: Topology, timeout_s: float = 120.0) -> None:
        """SIGTERM prepare, then shard once it has committed every record of the band
        topic (prepare sends watermark records while it runs), then decide once it has
        committed every finding."""
        for role, internal in (("prepare", None), ("shard", topology.bands), ("decide", topology.findings)):
            if internal is not None:
                deadline = time.monotonic() + timeout_s
                group = f"{topology.app}.{role}"
                while any(committed_offset(self.args[0], group, internal, p) != last + 1
                          for p, last in _last_offsets(self.args[0], internal).items()):
                    assert time.monotonic() < deadline, f"{role} did not commit all of {internal}"
                    time.sleep(0.2)
            for key in [k for k in self.procs if k[0] == role]:
                assert self.terminate(*key) == 0

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
        self.procs.clear()


def _in_process(role: str, bootstrap: str, topic: str, topology: Topology, state_dir: Path | None = None):
    """A shard or decide stage in this process (its processor's methods can be replaced),
    batches of 50, short sessions, and the thread that will run it (not started). The stage
    reads its internal topic from the start itself."""
    from neardup.sharded.decide_stage import DecideStage
    from neardup.sharded.shard_stage import ShardStage

    settings = Settings(bootstrap_servers=bootstrap, input_topics=[topic], group_id=f"{topology.app}.{role}",
                        batch_size=50, kafka={"session.timeout.ms": "6000", "heartbeat.interval.ms": "500"})
    stage = {"shard": ShardStage, "decide": DecideStage}[role](settings, topology, "a", state_dir)
    return stage, threading.Thread(target=stage.run, kwargs={"install_signal_handlers": False}, daemon=True)


def _stop(stage, runner, stages: _Stages) -> None:
    """Stop a stage run in this process, its thread, and the stages' processes."""
    stage.stop()
    runner.join(60)
    stages.stop()


def _wait_for_records(bootstrap: str, topic: str, partitions: int, timeout_s: float, stages: _Stages) -> None:
    """Wait until each of ``topic``'s ``partitions`` partitions holds a record; fail the
    test with the stages' report after ``timeout_s`` seconds or if a stage stops."""
    deadline = time.monotonic() + timeout_s
    while empty := [p for p, end in _ends(bootstrap, topic, partitions).items() if end == 0]:
        assert stages.alive() and time.monotonic() < deadline, f"{topic} partitions {empty} still empty: {stages.report()}"
        time.sleep(0.5)


def _outputs(bootstrap: str, topic: str, expected: int, timeout_s: float, alive) -> list:
    deadline = time.monotonic() + timeout_s
    while True:
        out = read_all(bootstrap, [f"{topic}.unique", f"{topic}.duplicates", f"{topic}.dlq"], idle_s=2.0, timeout_s=30)
        if len(out) >= expected or time.monotonic() > deadline:
            return out
        stages = getattr(alive, "__self__", None)
        assert alive(), f"a stage stopped: {stages.report() if isinstance(stages, _Stages) else ''}"


def _through_the_stages(stages: _Stages, bootstrap: str, topic: str, expected: int, log: Path) -> list:
    """One process of each stage, run until ``expected`` outputs came (or 240 s), then
    stopped; the outputs (all of them: asserted)."""
    try:
        for role in ("prepare", "shard", "decide"):
            stages.start(role)
        out = _outputs(bootstrap, topic, expected, 240, stages.alive)
    finally:
        stages.stop()
    assert len(out) == expected, log.read_text()[-4000:]
    return out


def _check_verdicts(bootstrap: str, topic: str, topology: Topology, out: list,
                    dead_letters: set[bytes] = frozenset({b"bad", b"empty"}),
                    engine: EngineSettings | None = None, log: str = "") -> None:
    """Every input message once in the outputs, with the verdicts of the sharded rules
    run in one process in order-key order (``engine``: the stages' settings; ``log``: the
    stages' log, whose late records and failed batches a disagreement shows)."""
    from neardup.sharded.reference import ShardedReference

    ordered = _in_order(bootstrap, topic)
    keys = Counter(o.key for o in out)
    assert sum(keys.values()) == len(ordered), f"{sum(keys.values())} outputs for {len(ordered)} inputs"
    assert max(keys.values()) == 1
    docs = []
    for _, value in ordered:
        try:
            r = json.loads(value)
            docs.append(Document(str(r["id"]), r["text"]))
        except json.JSONDecodeError:
            continue
    reference = {v.id: v for v in ShardedReference(engine or EngineSettings(), topology.shards).process(docs)
                 if hasattr(v, "verdict")}
    got = {o.key.decode(): o for o in out if o.topic != f"{topic}.dlq"}
    assert set(got) == set(reference)
    differ = [k for k, v in reference.items()
              if (got[k].headers["neardup-verdict"].decode(), got[k].headers["neardup-match"].decode() or None,
                  got[k].headers["neardup-cluster"].decode()) != (v.verdict, v.match, v.cluster)]
    seen = [line[:300] for line in log.splitlines() if "came after a later one" in line or "batch failed" in line]
    assert not differ, (f"{len(differ)} of {len(reference)} differ", [
        (k, got[k].headers["neardup-verdict"], got[k].headers["neardup-cluster"], reference[k].verdict,
         reference[k].cluster) for k in differ[:5]], seen[-8:])
    dead = {o.key: o.headers["neardup-error"] for o in out if o.topic == f"{topic}.dlq"}
    assert set(dead) == set(dead_letters)
    assert sum(v.is_duplicate for v in reference.values()) >= 100  # the copies the test is about


def test_three_stages_give_the_sharded_verdicts_once_each(kafka_bootstrap, kafka_topic_factory, tmp_path):
    topic = kafka_topic_factory("sharded-e2e", partitions=2)
    messages = _stories_and_copies(200)
    messages.insert(7, (b"bad", b"{not json"))
    messages.insert(20, (b"empty", json.dumps({"id": "empty", "text": "  "}).encode()))
    produce(kafka_bootstrap, topic, messages)
    topology = Topology(f"sharded-{uuid.uuid4().hex[:8]}", shards=4, decide_partitions=2)
    stages = _Stages(kafka_bootstrap, topic, topology, tmp_path / "stages.log")
    try:
        for role in ("prepare", "shard", "decide"):
            stages.start(role)
        out = _outputs(kafka_bootstrap, topic, len(messages), 240, stages.alive)
        stages.stop_upstream_first(topology)
    finally:
        stages.stop()
    assert len(out) == len(messages), (tmp_path / "stages.log").read_text()[-4000:]
    _check_verdicts(kafka_bootstrap, topic, topology, out)
    # the internal topics' offsets are committed past their last record (a restart
    # resumes there, not at the beginning)
    for stage, internal in (("shard", topology.bands), ("decide", topology.findings)):
        for p, last in _last_offsets(kafka_bootstrap, internal).items():
            assert committed_offset(kafka_bootstrap, f"{topology.app}.{stage}", internal, p) == last + 1
    # band records held and documents waiting are not logged (the band and findings
    # topics keep them): the changelogs hold the members, each partition's progress, and
    # the order key of each document waiting after a batch, once (a tombstone when decided)
    logged = read_all(kafka_bootstrap, [topology.shard_changelog, topology.decide_changelog], idle_s=2.0)
    kinds = Counter((o.topic, o.key[:1]) for o in logged)
    assert {(topology.shard_changelog, b"N"), (topology.shard_changelog, b"P"), (topology.shard_changelog, b"E"),
            (topology.decide_changelog, b"P")} <= set(kinds) <= {
        (topology.shard_changelog, b"N"), (topology.shard_changelog, b"P"), (topology.shard_changelog, b"E"),
        (topology.decide_changelog, b"P"), (topology.decide_changelog, b"A"), (topology.decide_changelog, b"D")}, kinds
    # the engine settings the members were indexed with, in every partition with progress
    assert {o.value for o in logged if o.topic == topology.shard_changelog and o.key == b"E"} == {
        engine_digest(Settings().engine())}
    assert {o.partition for o in logged if o.topic == topology.shard_changelog and o.key == b"P"} == {
        o.partition for o in logged if o.topic == topology.shard_changelog and o.key == b"E"}
    progress = [o for o in logged if o.topic == topology.decide_changelog and o.key == b"P"]
    assert {len(o.value) for o in progress} == {8}  # the consumed offset alone
    # the documents that began to wait in a batch, one record (written once, deleted once),
    # each document in one; the documents decided whose record stays live, likewise
    lists = [o for o in logged if o.topic == topology.decide_changelog and o.key[:1] in (b"A", b"D")]
    writes = Counter(o.key for o in lists)
    assert all(n <= 2 for n in writes.values()), writes.most_common(3)
    began = [o.value[at:at + 20] for o in lists if o.key[:1] == b"A" and o.value for at in range(0, len(o.value), 20)]
    assert len(began) == len(set(began)) and kinds[(topology.decide_changelog, b"A")] < len(messages) / 4
    last = {(o.partition, o.key): o.value for o in lists}  # in offset order: each key's last value
    assert all(value is None for value in last.values())  # every document decided: every list deleted
    # the members: one record per batch and partition, each member once, keyed by its highest;
    # without a retention window the band topic keeps its records, and the members refer to them
    batches = [o for o in logged if o.topic == topology.shard_changelog and o.key[:1] == b"N"]
    assert batches and all(is_refs_value(o.value) for o in batches)
    members = [(o.partition, ref[0]) for o in batches for ref in member_refs(o.value)]
    assert len(members) == len(set(members)) >= len(messages) / 2  # the documents joining buckets
    assert kinds[(topology.shard_changelog, b"N")] < len(members) / 4
    assert all(o.key[1:] == max(ref[0] for ref in member_refs(o.value)) for o in batches)
    # each refers to its band record: the document of that order key, at that offset
    bands = {(o.partition, o.offset): parse_bands(o.value, o.offset) for o in read_all(kafka_bootstrap, [topology.bands], idle_s=2.0)
             if o.headers.get(KIND_HEADER) != WATERMARK_KIND}
    assert all(bands[(o.partition, offset)][entry].order == order
               for o in batches for order, offset, entry, _, _ in member_refs(o.value))
    # the findings of a batch go to decide in one record per decide partition
    findings = read_all(kafka_bootstrap, [topology.findings], idle_s=2.0)
    assert sum(o.headers.get(KIND_HEADER) == b"findings" for o in findings) < len(messages) / 2


class _Undecided:
    """Reads the most documents of one findings partition that decide's group has not
    passed: those of the documents records from its committed offset to the end."""

    def __init__(self, bootstrap: str, topology: Topology) -> None:
        from confluent_kafka import Consumer

        self.topology = topology
        self.admin = AdminClient({"bootstrap.servers": bootstrap})
        self.reader = Consumer({"bootstrap.servers": bootstrap, "group.id": f"undecided-{uuid.uuid4()}",
                                "enable.auto.commit": False, "isolation.level": "read_uncommitted"})

    def __call__(self) -> int:
        from confluent_kafka import ConsumerGroupTopicPartitions, TopicPartition
        from confluent_kafka.admin import OffsetSpec

        from neardup.sharded.records import DOCUMENTS_KIND, KIND_HEADER, documents_count

        t = self.topology
        tps = [TopicPartition(t.findings, q) for q in range(t.decide_partitions)]
        [future] = self.admin.list_consumer_group_offsets([ConsumerGroupTopicPartitions(f"{t.app}.decide", tps)]).values()
        committed = {tp.partition: max(tp.offset, 0) for tp in future.result(10).topic_partitions}
        ends = {tp.partition: f.result(10).offset
                for tp, f in self.admin.list_offsets({tp: OffsetSpec.latest() for tp in tps}).items()}
        counts = dict.fromkeys(ends, 0)
        todo = {q for q, end in ends.items() if committed.get(q, 0) < end}
        self.reader.assign([TopicPartition(t.findings, q, committed.get(q, 0)) for q in todo])
        deadline = time.monotonic() + 10
        while todo and time.monotonic() < deadline:
            for m in self.reader.consume(1000, timeout=0.2):
                q = m.partition()
                if m.error() is not None or q not in todo:
                    continue
                if m.offset() < ends[q] and (KIND_HEADER, DOCUMENTS_KIND) in (m.headers() or ()):
                    counts[q] += documents_count(m.value())
            # past the end (a transaction's last offset is its commit marker, never consumed)
            todo -= {tp.partition for tp in self.reader.position([TopicPartition(t.findings, q) for q in todo])
                     if tp.offset >= ends[tp.partition]}
        self.reader.unassign()
        return max(counts.values(), default=0)

    def close(self) -> None:
        self.reader.close()


def test_a_backlog_does_not_grow_what_waits_for_decide_past_the_bound(kafka_bootstrap, kafka_topic_factory,
                                                                       tmp_path):
    """Prepare runs ahead of the shards in a backlog; with ``--max-undecided`` it holds
    back once a findings partition has more documents than that not yet decided (waiting
    in decide's memory), reading on as the shards release: what waits stays near the bound
    (without it, what waits can grow to the whole backlog of a partition, about 1,000
    documents here), and every message comes out once with the sharded verdicts."""
    from confluent_kafka import KafkaException

    bound = 150
    topic = kafka_topic_factory("sharded-lead", partitions=2)
    messages = _stories_and_copies(2000)
    topology = Topology(f"sharded-{uuid.uuid4().hex[:8]}", shards=4, decide_partitions=2)
    topology.ensure(AdminClient({"bootstrap.servers": kafka_bootstrap}))
    log = tmp_path / "stages.log"
    stages = _Stages(kafka_bootstrap, topic, topology, log)
    lags: list[int] = []
    try:
        stages.start("shard")
        stages.start("decide")
        stages.start("prepare", "a", "--max-undecided", str(bound))
        deadline = time.monotonic() + 120
        while f"assigned {topic}[" not in log.read_text():  # prepare, reading already: the backlog comes at once
            assert stages.alive() and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        time.sleep(1.0)
        produce(kafka_bootstrap, topic, messages)
        done = threading.Event()

        undecided = _Undecided(kafka_bootstrap, topology)

        def sample() -> None:
            while not done.wait(0.1):
                try:
                    lags.append(undecided())
                except KafkaException:  # a sample the broker did not answer in time
                    pass
            undecided.close()

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        out = _outputs(kafka_bootstrap, topic, len(messages), 300, stages.alive)
        done.set()
        sampler.join(30)
    finally:
        stages.stop()
    text = log.read_text()
    print(f"documents not yet decided, per sample: {lags}")
    _check_verdicts(kafka_bootstrap, topic, topology, out, dead_letters=set(), log=text)
    assert "holding back" in text and "no longer holding back" in text, text[-3000:]
    assert len(lags) > 20 and max(lags) <= 5 * bound, lags[:80]  # the bound, and what is in flight when it is met


def test_a_backlog_read_unevenly_gives_the_verdicts_of_order_key_order(kafka_bootstrap, kafka_topic_factory,
                                                                         tmp_path):
    """A backlog spanning 70 minutes of record time over 4 input partitions, 70% of it in
    partition 0 and none in partition 3: prepare reads the sparse partitions far ahead of
    partition 0 in record time, the empty one never has a record. The shards process
    every document once every partition's watermark is past it, so the verdicts are those
    of the sharded rules in order-key order (a window of record time would process
    partition 0's documents late), and the empty partition holds nothing back."""
    from confluent_kafka import Producer

    topic = kafka_topic_factory("sharded-uneven", partitions=4)
    messages = _stories_and_copies(200)
    producer = Producer({"bootstrap.servers": kafka_bootstrap, "enable.idempotence": True, "linger.ms": 20})
    first = int(time.time() * 1000) - len(messages) * 10_000
    for i, (key, value) in enumerate(messages):  # 10 s of record time apart, in order
        producer.produce(topic, key=key, value=value, partition=0 if i % 10 < 7 else 1 + i % 2,
                         timestamp=first + i * 10_000)
    assert producer.flush(60) == 0
    topology = Topology(f"sharded-{uuid.uuid4().hex[:8]}", shards=4, decide_partitions=2)
    stages = _Stages(kafka_bootstrap, topic, topology, tmp_path / "stages.log")
    try:
        for role, instance in (("prepare", "a"), ("shard", "a"), ("shard", "b"), ("decide", "a")):
            stages.start(role, instance)
        time.sleep(3)
        stages.start("prepare", "b")  # a rebalance while prepare a reads: partitions move mid-backlog
        out = _outputs(kafka_bootstrap, topic, len(messages), 240, stages.alive)
    finally:
        stages.stop()
    log = (tmp_path / "stages.log").read_text(errors="replace")
    assert len(out) == len(messages), log[-4000:]
    _check_verdicts(kafka_bootstrap, topic, topology, out, dead_letters=set())
    assert "processed late" not in log


def test_containment_in_both_directions_through_the_stages(kafka_bootstrap, kafka_topic_factory, tmp_path):
    """`--measure containment --containment-direction both`: stories, then their first
    halves (a cut: the new text inside an earlier one) and the stories quoted inside a
    longer article (an earlier text inside the new one). The stages give the verdicts of
    the sharded rules in one process, and agree with one process (the detector) on at
    least 99% of the documents."""
    from neardup.detector import Detector
    from neardup.state.memory import MemoryStateStore

    records = excerpt(400)
    stories = [r for r in records if len(r["text"].split()) >= 60][:150]
    fillers = [r for r in records if r not in stories]
    messages = [(str(r["id"]).encode(), json.dumps(r).encode()) for r in stories]
    for i, r in enumerate(stories):
        words = r["text"].split()
        if i % 2:  # a cut
            doc = {"id": f"{r['id']}~cut", "text": " ".join(words[:len(words) // 2 + 5])}
        else:  # quoted inside a longer article, about twice as long
            doc = {"id": f"{r['id']}~quoted", "text": fillers[i % len(fillers)]["text"][:len(r["text"])] + " "
                   + r["text"]}
        messages.append((doc["id"].encode(), json.dumps(doc).encode()))
    topic = kafka_topic_factory("sharded-containment", partitions=2)
    produce(kafka_bootstrap, topic, messages)
    flags = ("--measure", "containment", "--containment-direction", "both")
    engine = EngineSettings(measure="containment", containment_direction="both")
    topology = Topology(f"sharded-{uuid.uuid4().hex[:8]}", shards=4, decide_partitions=2)
    stages = _Stages(kafka_bootstrap, topic, topology, tmp_path / "stages.log", extra=flags)
    out = _through_the_stages(stages, kafka_bootstrap, topic, len(messages), tmp_path / "stages.log")
    _check_verdicts(kafka_bootstrap, topic, topology, out, dead_letters=set(), engine=engine)
    got = {o.key.decode(): o.headers["neardup-verdict"].decode() for o in out}
    # a pair is found whichever of the two comes first in order-key order (records produced
    # in the same millisecond are ordered by partition)
    for kind in ("~cut", "~quoted"):
        found = sum("duplicate" in (v, got[k[:-len(kind)]]) for k, v in got.items() if k.endswith(kind))
        assert found >= 60, (kind, found)
    ordered = [json.loads(v) for _, v in _in_order(kafka_bootstrap, topic)]
    one = {v.id: v.verdict for v in Detector(engine, MemoryStateStore(engine.state_shape())).process(
        [Document(str(r["id"]), r["text"]) for r in ordered])}
    agree = sum(got[k] == v for k, v in one.items()) / len(one)
    assert agree >= 0.99, agree


def test_the_components_policy_through_the_stages(kafka_bootstrap, kafka_topic_factory, tmp_path):
    """`--cluster-policy components`: each story's first and last 70% of words (two
    clusters at Jaccard 0.5), then the whole stories, each merging its halves' clusters,
    then a copy of each half. Two decide processes (one with its table on disk, its forest
    reopened by a restart midway) give the verdicts and clusters of the sharded rules in
    one process, which are one process's (``tests/test_sharded.py``): a copy is decided
    only once the merge of an earlier whole story is known, wherever it was decided."""
    from neardup.sharded.reference import ShardedReference

    stories = [r for r in excerpt(300) if len(r["text"].split()) >= 40][:120]
    halves, wholes, copies = [], [], []
    for r in stories:
        words = r["text"].split()
        k = int(len(words) * 0.7)
        for part, text in (("head", words[:k]), ("tail", words[-k:])):
            halves.append({"id": f"{r['id']}~{part}", "text": " ".join(text)})
            copies.append({"id": f"{r['id']}~{part}~copy", "text": " ".join(text[1:])})
        wholes.append({"id": f"{r['id']}~whole", "text": r["text"]})
    docs = halves + wholes + copies
    topic = kafka_topic_factory("sharded-components", partitions=2)
    produce(kafka_bootstrap, topic, [(d["id"].encode(), json.dumps(d).encode()) for d in docs[:len(docs) // 2]])
    flags = ("--cluster-policy", "components", "--threshold", "0.5")
    engine = EngineSettings(cluster_policy="components", threshold=0.5)
    topology = Topology(f"sharded-{uuid.uuid4().hex[:8]}", shards=4, decide_partitions=2)
    log = tmp_path / "stages.log"
    stages = _Stages(kafka_bootstrap, topic, topology, log, extra=flags)
    table = ("--state-dir", str(tmp_path / "decide-state"))
    try:
        stages.start("prepare", "a", "--max-undecided", "20")  # and holding back often: nothing stalls
        stages.start("shard")
        stages.start("decide", "a", *table)
        stages.start("decide", "b")
        _outputs(kafka_bootstrap, topic, len(docs) // 2, 240, stages.alive)
        assert stages.terminate("decide") == 0
        produce(kafka_bootstrap, topic, [(d["id"].encode(), json.dumps(d).encode()) for d in docs[len(docs) // 2:]])
        stages.start("decide", "a", *table)
        out = _outputs(kafka_bootstrap, topic, len(docs), 240, stages.alive)
    finally:
        stages.stop()
    assert len(out) == len(docs), log.read_text()[-4000:]
    _check_verdicts(kafka_bootstrap, topic, topology, out, dead_letters=set(), engine=engine, log=log.read_text())
    assert "from offset" in log.read_text()  # the restarted decide reopened its table
    assert "holding back" in log.read_text()
    # the clusters are those of components, not of the canonical policy
    ordered = [json.loads(v) for _, v in _in_order(kafka_bootstrap, topic)]
    canonical = ShardedReference(EngineSettings(threshold=0.5), topology.shards).process(
        [Document(str(r["id"]), r["text"]) for r in ordered])
    got = {o.key.decode(): o.headers["neardup-cluster"].decode() for o in out}
    assert sum(got[v.id] != v.cluster for v in canonical) >= 50


@pytest.mark.parametrize("shard_state", ["memory", "disk"])
def test_stages_scaled_and_killed_mid_stream_give_every_message_once(kafka_bootstrap, kafka_topic_factory, tmp_path,
                                                                      shard_state):
    # each stage runs 1, then 3, then 2 processes (one of the three SIGKILLed) while the
    # input arrives; partitions move between processes, shard state moves with its
    # changelog partition (on disk: each shard and decide process has its own --state-dir)
    import threading

    topic = kafka_topic_factory("sharded-scale", partitions=2)
    messages = _stories_and_copies(300)
    messages.insert(7, (b"bad", b"{not json"))
    messages.insert(20, (b"empty", json.dumps({"id": "empty", "text": "  "}).encode()))
    topology = Topology(f"sharded-{uuid.uuid4().hex[:8]}", shards=4, decide_partitions=2)
    # a window longer than a killed prepare's partitions take to move (its session timeout)
    stages = _Stages(kafka_bootstrap, topic, topology, tmp_path / "stages.log", reorder_ms=15_000)

    def feed() -> None:  # about 40 s of input
        for i in range(0, len(messages), 15):
            produce(kafka_bootstrap, topic, messages[i:i + 15])
            time.sleep(1.0)

    def start(role: str, instance: str) -> None:
        disk = role != "prepare" and shard_state == "disk"
        stages.start(role, instance, *(["--state-dir", str(tmp_path / f"{role}-{instance}")] if disk else []))

    feeder = threading.Thread(target=feed)
    try:
        for role in ("prepare", "shard", "decide"):
            start(role, "a")
        feeder.start()
        time.sleep(12)
        for role in ("prepare", "shard", "decide"):
            start(role, "b")
            start(role, "c")
        time.sleep(12)
        # every shard partition has state in its changelog before "a" goes: on a loaded
        # machine a process starts slowly and the 15 s window holds the first records
        _wait_for_records(kafka_bootstrap, topology.shard_changelog, topology.shards, 180, stages)
        for role in ("prepare", "shard", "decide"):
            stages.kill(role, "a")
        feeder.join()
        out = _outputs(kafka_bootstrap, topic, len(messages), 240, stages.alive)
    finally:
        feeder.join()
        stages.stop()
    log = (tmp_path / "stages.log").read_text()
    assert len(out) == len(messages), log[-4000:]
    # a shard partition moved with its state
    moved = r"restored from" if shard_state == "memory" else r"restored in full, [1-9]\d* changelog records read"
    assert re.search(moved, log), log[-4000:]
    late = log.count("processed late")
    if late == 0:
        _check_verdicts(kafka_bootstrap, topic, topology, out)
    else:  # exactly once all the same; the verdicts of late records may differ
        keys = Counter(o.key for o in out)
        assert sum(keys.values()) == len(messages) and max(keys.values()) == 1
        pytest.fail(f"{late} band records came later than the reorder window: {log[-2000:]}")


def test_state_on_disk_reads_only_the_newer_records_after_a_stop_or_a_kill(
        kafka_bootstrap, kafka_topic_factory, tmp_path):
    """``--state-dir``: the shard stopped (SIGTERM) or SIGKILLed mid-stream reopens its
    RocksDB stores at their positions, reading only the changelog's newer records; a
    store deleted is restored in full. Decide, SIGKILLed, reopens its decisions table at
    its position; deleted, it reads the table in full. Every message once, the sharded
    rules' verdicts."""
    topic = kafka_topic_factory("sharded-disk", partitions=2)
    messages = _stories_and_copies(240)
    messages.insert(7, (b"bad", b"{not json"))
    messages.insert(20, (b"empty", json.dumps({"id": "empty", "text": "  "}).encode()))
    parts = [messages[:160], messages[160:320], messages[320:]]
    topology = Topology(f"sharded-{uuid.uuid4().hex[:8]}", shards=4, decide_partitions=2)
    log = tmp_path / "stages.log"
    stages = _Stages(kafka_bootstrap, topic, topology, log, reorder_ms=5000)
    state = ("--state-dir", str(tmp_path / "shard-state"))
    decide_state = ("--state-dir", str(tmp_path / "decide-state"))
    opened = re.compile(r"shard (\d) opened at .*?: (restored in full|from changelog offset \d+), (\d+) changelog records read")
    table = re.compile(r"decisions table opened at \S+: (read in full|from offset \d+), \d+ records read \((\d+) decisions\)")
    try:
        produce(kafka_bootstrap, topic, parts[0])
        stages.start("prepare")
        stages.start("decide", "a", *decide_state)
        stages.start("shard", "a", *state)
        assert len(_outputs(kafka_bootstrap, topic, len(parts[0]), 240, stages.alive)) >= len(parts[0])
        assert stages.terminate("shard") == 0, log.read_text()[-3000:]
        stages.kill("decide")
        produce(kafka_bootstrap, topic, parts[1][:80])
        stages.start("shard", "a", *state)
        stages.start("decide", "a", *decide_state)
        assert len(_outputs(kafka_bootstrap, topic, len(parts[0]) + 80, 240, stages.alive)) >= len(parts[0]) + 80
        stages.kill("shard")  # mid-stream: more arrives while it is down
        stages.kill("decide")
        produce(kafka_bootstrap, topic, parts[1][80:])
        shutil.rmtree(tmp_path / "shard-state" / "shard-3")
        shutil.rmtree(tmp_path / "decide-state")
        stages.start("shard", "a", *state)
        stages.start("decide", "a", *decide_state)
        produce(kafka_bootstrap, topic, parts[2])
        out = _outputs(kafka_bootstrap, topic, len(messages), 240, stages.alive)
    finally:
        stages.stop()
    text = log.read_text()
    assert "Traceback" not in text, text[-3000:]
    opens = [(int(p), how, int(n)) for p, how, n in opened.findall(text)]
    assert [how for _, how, _ in opens[:4]] == ["restored in full"] * 4, opens  # new stores
    restarts = opens[4:]
    assert sorted(p for p, _, _ in restarts) == [0, 0, 1, 1, 2, 2, 3, 3], opens
    full = [(p, n) for p, how, n in restarts if how == "restored in full"]
    assert [p for p, _ in full] == [3], opens  # the deleted store only
    # at its position: far fewer records than the changelog holds (the deleted store's)
    assert all(n < full[0][1] / 3 for p, how, n in restarts if how != "restored in full"), opens
    tables = [(how.split()[0], int(n)) for how, n in table.findall(text)]
    assert [how for how, _ in tables] == ["read", "from", "read"], tables  # new, reopened, deleted
    # reopened at its position: few of the decisions taken before the kill read again (at
    # most those it had not read back yet); deleted: all of them (the 240 outputs before
    # it, less the dead letters)
    assert tables[1][1] < len(parts[0]) / 3 and tables[2][1] >= len(parts[0]) + 80 - 2, tables
    assert len(out) == len(messages), text[-4000:]
    _check_verdicts(kafka_bootstrap, topic, topology, out)


def test_a_stage_started_with_other_partition_counts_stops_with_one_line(kafka_bootstrap, kafka_topic_factory):
    topic = kafka_topic_factory("sharded-counts", partitions=1)
    produce(kafka_bootstrap, topic, [(b"1", b'{"id": "1", "text": "a few words of text here"}')])
    app = f"sharded-{uuid.uuid4().hex[:8]}"
    Topology(app, shards=4, decide_partitions=2).ensure(AdminClient({"bootstrap.servers": kafka_bootstrap}))
    done = subprocess.run([sys.executable, "-m", "neardup.cli", "stage", "prepare", "--bootstrap-servers",
                           kafka_bootstrap, "--input-topic", topic, "--app", app, "--shards", "8",
                           "--from-beginning", "--log-level", "WARNING"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        f"neardup: error: topic {app}.bands has 4 partitions, the topology asks for 8; "
        "a sharded state cannot change its partition counts")
    assert "Traceback" not in done.stderr


def test_a_malformed_band_record_dead_letters_its_document_and_stalls_nothing(kafka_bootstrap, kafka_topic_factory, tmp_path):
    # something else than prepare writes to the band topic: the shard neither crashes
    # nor skips the document silently
    from confluent_kafka import Producer

    from neardup.sharded.records import KIND_HEADER, TOPIC_HEADER, order_key

    topic = kafka_topic_factory("sharded-bad", partitions=1)
    topology = Topology(f"sharded-{uuid.uuid4().hex[:8]}", shards=2, decide_partitions=1)
    topology.ensure(AdminClient({"bootstrap.servers": kafka_bootstrap}))
    key = order_key(1_700_000_000_000, 0, 0)
    p = Producer({"bootstrap.servers": kafka_bootstrap})
    p.produce(topology.findings, key=b"k", value=b'{"id": "x", "text": "some text"}', partition=0,
              headers=[(KIND_HEADER, b"document"), (ORDER_HEADER, key), (TOPIC_HEADER, topic.encode()),
                       (SHARDS_HEADER, b"1"), (ID_HEADER, b"x")])
    # one document that says 1 bucket and holds none; then a record without even its count
    p.produce(topology.bands, value=struct.pack(">I", 1) + key + struct.pack(">HHI", 1, 0, 0), partition=1)
    p.produce(topology.bands, value=b"\x00\x01", partition=0)
    assert p.flush(30) == 0
    stages = _Stages(kafka_bootstrap, topic, topology, tmp_path / "stages.log")
    try:
        stages.start("shard")
        stages.start("decide")
        out = _outputs(kafka_bootstrap, topic, 1, 120, stages.alive)
        assert stages.alive()
    finally:
        stages.stop()
    log = (tmp_path / "stages.log").read_text()
    assert [(o.topic, o.key) for o in out] == [(f"{topic}.dlq", b"k")], log[-3000:]
    assert out[0].headers["neardup-error"].decode().startswith("band record of the wrong length")
    assert "not a band record" in log and "Traceback" not in log


def test_a_set_record_gone_dead_letters_its_documents_and_stalls_nothing(kafka_bootstrap, kafka_topic_factory,
                                                                          tmp_path):
    """The set topic's records deleted (by hand) after prepare sent a backlog and before the
    shards read it: every document comes out once, a dead letter naming the set record
    gone, and the stages run on."""
    from confluent_kafka import OFFSET_END, TopicPartition

    topic, records = _input(kafka_bootstrap, kafka_topic_factory, 30)
    topology = Topology(f"sharded-{uuid.uuid4().hex[:8]}", shards=2, decide_partitions=1)
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    topology.ensure(admin)
    log = tmp_path / "stages.log"
    stages = _Stages(kafka_bootstrap, topic, topology, log)
    try:
        stages.start("prepare")  # left running: its watermarks release the documents
        _wait_committed(kafka_bootstrap, f"{topology.app}.prepare", topic, _ends(kafka_bootstrap, topic),
                        stages.alive)
        sets = [TopicPartition(topology.sets, p, OFFSET_END) for p in range(topology.shards)]
        for future in admin.delete_records(sets).values():
            future.result(30)
        stages.start("shard")
        stages.start("decide")
        out = _outputs(kafka_bootstrap, topic, len(records) + 2, 120, stages.alive)
        assert stages.alive(), stages.report()
    finally:
        stages.stop()
    text = log.read_text()
    keys = Counter(o.key for o in out)
    assert len(keys) == len(records) + 2 and max(keys.values()) == 1, text[-3000:]
    errors = {o.key: o.headers["neardup-error"].decode() for o in out if o.topic == f"{topic}.dlq"}
    valid = set(keys) - {b"bad", b"empty"}
    assert len(valid) == len(records)
    assert all(re.fullmatch(rf"set record {re.escape(topology.sets)}\[\d+\]@\d+ is gone", errors.get(k, ""))
               for k in valid), errors
    assert "Traceback" not in text


def test_records_too_large_for_a_topic_become_dead_letters(kafka_bootstrap, kafka_topic_factory, tmp_path):
    # a document record larger than the findings topic takes, one whose headers alone are,
    # and an output record larger than its output topic takes: all reach the dead-letter
    # topic, nothing stalls
    from confluent_kafka.admin import NewTopic

    topic = kafka_topic_factory("sharded-large", partitions=1)
    topology = Topology(f"sharded-{uuid.uuid4().hex[:8]}", shards=2, decide_partitions=1)
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    small = [NewTopic(topology.findings, 1, config={"max.message.bytes": "20000"}),
             NewTopic(f"{topic}.unique", 1, config={"max.message.bytes": "6000"})]
    for future in admin.create_topics(small).values():
        future.result(30)
    from neardup.kafka.messages import record_size

    words = " ".join(f"word{i}" for i in range(1000))  # about 9 KB
    # a record 10 bytes under the findings topic's limit: its documents record (its id,
    # order key and input topic beside it) is not; it was sent without its value, and
    # came out of decide as a verdict with no value
    edge = {"id": "edge", "text": " ".join(f"item{i}" for i in range(500)), "pad": ""}
    edge["pad"] = "x" * (20000 - 10 - record_size(b"edge", json.dumps(edge).encode()))
    assert record_size(b"edge", json.dumps(edge).encode()) == 20000 - 10
    huge = " ".join(f"term{i}" for i in range(4000))  # about 38 KB
    produce(kafka_bootstrap, topic, [(b"small", json.dumps({"id": "small", "text": "a short story of a few words here"}).encode()),
                                     (b"long", json.dumps({"id": "long", "text": words}).encode()),
                                     (b"huge", json.dumps({"id": "huge", "text": huge}).encode()),
                                     (b"tagged", json.dumps({"id": "tagged", "text": "a story with large headers"}).encode(),
                                      [("trace", b"t" * 25_000)]),
                                     (b"edge", json.dumps(edge).encode()),
                                     (b"after", json.dumps({"id": "after", "text": "the story after all of them"}).encode())])
    stages = _Stages(kafka_bootstrap, topic, topology, tmp_path / "stages.log")
    try:
        for role in ("prepare", "shard", "decide"):
            stages.start(role)
        out = _outputs(kafka_bootstrap, topic, 6, 120, stages.alive)
    finally:
        stages.stop()
    got = {o.key: o for o in out}
    assert len(out) == 6, (tmp_path / "stages.log").read_text()[-3000:]
    assert got[b"small"].topic == f"{topic}.unique"
    assert got[b"long"].topic == f"{topic}.dlq"
    assert got[b"long"].headers["neardup-error"].startswith(b"record of ")
    assert b"max.message.bytes 6000" in got[b"long"].headers["neardup-error"]
    assert got[b"huge"].topic == f"{topic}.dlq" and got[b"huge"].value is None
    assert got[b"huge"].headers["neardup-error"].startswith(b"a record of ")
    assert int(got[b"huge"].headers["neardup-value-bytes"]) > 20000
    # its headers alone too large for the findings topic: its dead letter is neardup's
    # headers alone, as neardup run's last fallback (no key, no value, no input header)
    tagged = next(o for o in out if o.key is None)
    assert tagged.topic == f"{topic}.dlq" and tagged.value is None and "trace" not in tagged.headers
    assert tagged.headers["neardup-error"].startswith(b"a record of ")
    assert b"key and headers left out to fit max.message.bytes 20000" in tagged.headers["neardup-error"]
    assert int(tagged.headers["neardup-source-offset"]) == 3
    assert got[b"edge"].topic == f"{topic}.dlq" and got[b"edge"].value is None
    assert got[b"edge"].headers["neardup-error"].startswith(b"a record of ")
    assert int(got[b"edge"].headers["neardup-value-bytes"]) == len(json.dumps(edge).encode())
    assert got[b"after"].topic == f"{topic}.unique"


def test_a_stage_with_other_engine_settings_stops_with_one_line(kafka_bootstrap, kafka_topic_factory, tmp_path):
    topic = kafka_topic_factory("sharded-engine", partitions=1)
    produce(kafka_bootstrap, topic, [(b"1", json.dumps({"id": "1", "text": "a few words of text for the shards"}).encode())])
    topology = Topology(f"sharded-{uuid.uuid4().hex[:8]}", shards=2, decide_partitions=1)
    stages = _Stages(kafka_bootstrap, topic, topology, tmp_path / "stages.log")
    try:
        stages.start("prepare")
        shard = subprocess.run(
            [sys.executable, "-m", "neardup.cli", "stage", "shard", "--bootstrap-servers", kafka_bootstrap,
             "--input-topic", topic, "--app", topology.app, "--shards", "2", "--decide-partitions", "1",
             "--threshold", "0.9", "--log-level", "WARNING"], capture_output=True, text=True, timeout=180)
    finally:
        stages.stop()
    assert shard.returncode == 2, shard.stderr[-2000:]
    last = shard.stderr.strip().splitlines()[-1]
    assert last.startswith(f"neardup: error: band record {topology.bands}[") and last.endswith(
        "every stage of one deduplication needs the same engine settings")
    assert "Traceback" not in shard.stderr


@pytest.mark.xdist_group("sharded-outage-broker")  # one worker: one module-scoped own_broker
@pytest.mark.parametrize("shard_state", ["memory", "disk"])
def test_stages_survive_a_broker_outage_mid_stream(own_broker, tmp_path, shard_state):
    # the broker frozen (SIGSTOP) for longer than the transaction and session timeouts
    # while the input arrives: every stage retries, and every message comes out once,
    # with the verdicts of the rules run in one process (on disk: a failed batch reopens
    # the shard's stores at their positions). A broker of the module's own: the one the
    # other tests use at the same moment is never frozen.
    import threading

    from conftest import create_topics
    from test_kafka_outage import frozen_broker

    kafka_bootstrap = own_broker.bootstrap
    # Stamped by the broker when appended: a record stamped by its producer (CreateTime)
    # while the broker is frozen reaches it only once the producer has reconnected (seen:
    # more than the 30 s window after its stamp, a request having timed out at 10 s), and
    # is then late by the shards' rules (processed at once, counted in
    # neardup_reorder_late_records). Appended stamps keep the test on the outage.
    topic = create_topics(kafka_bootstrap, [f"sharded-outage-{uuid.uuid4().hex[:12]}"], partitions=2,
                          config={"message.timestamp.type": "LogAppendTime"})[0]
    messages = _stories_and_copies(200)
    topology = Topology(f"sharded-{uuid.uuid4().hex[:8]}", shards=4, decide_partitions=2)
    # a window longer than the outage, so that no shard releases early while it lasts
    stages = _Stages(kafka_bootstrap, topic, topology, tmp_path / "stages.log", reorder_ms=30_000,
                     extra=("-X", "transaction.timeout.ms=8000"))

    fed: list[BaseException] = []

    # One producer for the whole input, connected before the broker is frozen: a client
    # that first connects while the broker is frozen was seen never to get its producer id
    # once the broker came back (librdkafka; no message delivered in 240 s), which is the
    # test's own input failing, not a stage.
    feeder_producer = input_producer(kafka_bootstrap)
    feeder_producer.list_topics(topic, timeout=30)

    def feed() -> None:  # through the outage: each chunk waits for the broker to come back
        try:
            for i in range(0, len(messages), 20):
                produce(kafka_bootstrap, topic, messages[i:i + 20], timeout_s=240, producer=feeder_producer)
                time.sleep(0.5)
        except BaseException as exc:  # noqa: BLE001 - reported by the test below
            fed.append(exc)

    try:
        for role in ("prepare", "shard", "decide"):
            disk = role != "prepare" and shard_state == "disk"
            stages.start(role, "a", *(["--state-dir", str(tmp_path / f"{role}-state")] if disk else []))
        time.sleep(5)
        feeder = threading.Thread(target=feed)
        feeder.start()
        time.sleep(4)
        with frozen_broker(own_broker):
            time.sleep(15)
            assert stages.alive(), "a stage must survive an outage"
        feeder.join()
        assert not fed, f"the test's input producer failed: {fed[0]!r}"
        out = _outputs(kafka_bootstrap, topic, len(messages), 300, stages.alive)
    finally:
        stages.stop()
    log = (tmp_path / "stages.log").read_text()
    assert len(out) == len(messages), log[-4000:]
    assert "Traceback" not in log
    _check_verdicts(kafka_bootstrap, topic, topology, out, dead_letters=set(), log=log)


@pytest.mark.parametrize("shard_state", ["memory", "disk"])
def test_a_failed_batch_whose_partition_came_back_resumes_where_the_held_records_start(
        kafka_bootstrap, kafka_topic_factory, tmp_path, shard_state):
    # The shard holds band records for the reorder window (one input partition stays empty:
    # its watermark is the wall clock minus the window), and commits the offset of the
    # earliest record held. A batch after them fails (its producer fenced by a second one of
    # its transactional.id) while its partition is revoked and assigned back, kept paused so
    # that nothing of it is consumed before the failure is taken up: the partition must
    # resume at the group's committed offset. Rewound to the failed batch's first offset
    # (after the held records, which the shard restored from its changelog no longer
    # holds), those documents never got a verdict.
    import threading

    from confluent_kafka import Producer, TopicPartition

    from neardup.sharded.shard_stage import ShardProcessor

    topic = kafka_topic_factory("sharded-reassigned", partitions=2)
    topology = Topology(f"sharded-{uuid.uuid4().hex[:8]}", shards=1, decide_partitions=1)
    stages = _Stages(kafka_bootstrap, topic, topology, tmp_path / "stages.log", reorder_ms=20_000)
    stage, runner = _in_process("shard", kafka_bootstrap, topic, topology,
                                      tmp_path / "shard-state" if shard_state == "disk" else None)
    processor = stage.processor
    assert isinstance(processor, ShardProcessor)
    armed, fired, taken_up = threading.Event(), threading.Event(), threading.Event()
    consumer: list = []
    paused: list[TopicPartition] = []
    check, write, aborted = processor.check, processor.write, processor.aborted

    def checking(c, partitions):  # the consumer, to pause it
        consumer[:] = [c]
        check(c, partitions)

    def writing(work, producer):
        written = write(work, producer)
        if armed.is_set() and not fired.is_set():
            fired.set()
            fence = Producer({"bootstrap.servers": kafka_bootstrap, "transactional.id": stage.transactional_id})
            fence.init_transactions(30)  # this batch's transaction is aborted, its producer fenced
            paused[:] = [TopicPartition(topology.bands, p) for p in processor.shards]
            consumer[0].pause(paused)  # kept paused across the rebalance
            consumer[0].unsubscribe()  # revoked and assigned back in the next consume
            stage._subscribe()
        return written

    def aborting():
        aborted()
        if fired.is_set() and not taken_up.is_set():
            taken_up.set()
            consumer[0].resume(paused)

    processor.check, processor.write, processor.aborted = checking, writing, aborting
    stories = excerpt(20)
    try:
        stages.start("prepare")
        stages.start("decide")
        runner.start()
        producer = Producer({"bootstrap.servers": kafka_bootstrap})
        for r in stories:  # all to partition 0: partition 1 stays empty, so every record is held
            producer.produce(topic, key=str(r["id"]).encode(), value=json.dumps(r).encode(), partition=0)
        assert producer.flush(30) == 0
        deadline = time.monotonic() + 60
        while sum(len(s.held) for s in list(processor.shards.values())) < len(stories):
            assert time.monotonic() < deadline, "the shard never held every band record"
            time.sleep(0.1)
        batches = stage.batches
        while stage.batches < batches + 2:  # the records held are committed as such
            assert time.monotonic() < deadline and runner.is_alive()
            time.sleep(0.1)
        armed.set()
        assert fired.wait(30) and taken_up.wait(60), "no batch failed while its partition came back"
        out = _outputs(kafka_bootstrap, topic, len(stories), 120, lambda: stages.alive() and runner.is_alive())
    finally:
        _stop(stage, runner, stages)
    log = (tmp_path / "stages.log").read_text()
    assert sorted(o.key for o in out) == sorted(str(r["id"]).encode() for r in stories), log[-3000:]


def test_decide_batches_aborted_while_documents_wait_give_every_verdict_once(
        kafka_bootstrap, kafka_topic_factory, tmp_path):
    # On an abort decide goes back to the documents waiting as of the last commit (and
    # the consumed offsets and logged documents then), and the runtime reads the failed
    # batches again. Here a batch fails midway, after it decided documents (a broker error
    # in its computation: creating an input's output topics, say), then decide's producer
    # is fenced at the next three batches it writes, which decide documents and may follow
    # a batch still committing: every message must come out once, with the sharded
    # verdicts. Decide runs in this process and joins its group whenever it starts: it
    # reads the findings topic from its start all the same. The shard starts once decide
    # holds documents, so that documents wait across commits (with the shards done before
    # decide starts, every batch brought documents and their findings together, and no
    # abort had a waiting document to take back).
    from confluent_kafka import KafkaError, KafkaException, Producer

    from neardup.sharded.decide_stage import DecideProcessor

    topic = kafka_topic_factory("sharded-decide-aborts", partitions=2)
    messages = _stories_and_copies(150)
    produce(kafka_bootstrap, topic, messages)
    topology = Topology(f"sharded-{uuid.uuid4().hex[:8]}", shards=2, decide_partitions=2)
    stages = _Stages(kafka_bootstrap, topic, topology, tmp_path / "stages.log")
    stage, runner = _in_process("decide", kafka_bootstrap, topic, topology)
    processor = stage.processor
    assert isinstance(processor, DecideProcessor)
    write, aborted, attempt = processor.write, processor.aborted, processor._try
    failed, fenced, undone, waited = [], [], [], []

    def trying(q, order, w, out, stats):
        state = attempt(q, order, w, out, stats)
        if state == "decided" and stats.unique + stats.duplicate == 20 and not failed:
            failed.append(sum(len(w) for w in processor.partitions.values()))
            raise KafkaException(KafkaError(KafkaError._TIMED_OUT, "the broker did not answer (test)"))
        return state

    def writing(work, producer):
        written = write(work, producer)
        if failed and len(fenced) < 3:
            fenced.append(written.unique + written.duplicate)
            Producer({"bootstrap.servers": kafka_bootstrap,
                      "transactional.id": stage.transactional_id}).init_transactions(30)
        return written

    def aborting():
        undone.append(len(processor._uncommitted))
        aborted()
        waited.append(sum(len(w) for w in processor.partitions.values()))

    def holding() -> int:
        while True:
            try:
                return sum(len(w) for w in list(processor.partitions.values()))
            except RuntimeError:  # changed size meanwhile (decide's thread): again
                continue

    processor.write, processor.aborted, processor._try = writing, aborting, trying
    try:
        stages.start("prepare")
        runner.start()
        deadline = time.monotonic() + 120
        while holding() == 0:
            assert stages.alive() and runner.is_alive() and time.monotonic() < deadline, stages.report()
            time.sleep(0.2)
        stages.start("shard")
        out = _outputs(kafka_bootstrap, topic, len(messages), 240, lambda: stages.alive() and runner.is_alive())
    finally:
        _stop(stage, runner, stages)
    log = (tmp_path / "stages.log").read_text()
    assert len(failed) == 1 and len(fenced) == 3 and len(undone) >= 4, (failed, fenced, undone)
    assert any(fenced) and max(undone) >= 1 and any(waited), (fenced, undone, waited)  # decisions taken back
    _check_verdicts(kafka_bootstrap, topic, topology, out, dead_letters=set(), log=log)


def test_a_batch_whose_computation_meets_a_broker_error_is_retried_while_the_previous_commits(
        kafka_bootstrap, kafka_topic_factory, tmp_path):
    # A stage's computation may ask the broker (decide creates an input topic's outputs at
    # its first verdict, prepare reads the findings topic's limit); in an outage that
    # fails with a KafkaException while the previous batch's transaction is committing.
    # The batch is retried; it once ended the stage (an AssertionError of the runtime).
    import threading

    from confluent_kafka import KafkaError, KafkaException

    topic = kafka_topic_factory("sharded-compute-error", partitions=2)
    topology = Topology(f"sharded-{uuid.uuid4().hex[:8]}", shards=2, decide_partitions=1)
    stages = _Stages(kafka_bootstrap, topic, topology, tmp_path / "stages.log")
    stage, runner = _in_process("shard", kafka_bootstrap, topic, topology)
    compute, failed = stage.processor.compute, threading.Event()

    def computing(batch):
        if batch.messages and stage._pending is not None and not failed.is_set():
            failed.set()
            raise KafkaException(KafkaError(KafkaError._TIMED_OUT, "the broker did not answer (test)"))
        return compute(batch)

    stage.processor.compute = computing
    messages = _stories_and_copies(20)
    try:
        stages.start("prepare")
        stages.start("decide")
        runner.start()
        produce(kafka_bootstrap, topic, messages)
        out = _outputs(kafka_bootstrap, topic, len(messages), 120, lambda: stages.alive() and runner.is_alive())
        assert failed.is_set(), "no batch met the error while the previous one was committing"
    finally:
        _stop(stage, runner, stages)
    assert sorted(o.key for o in out) == sorted(k for k, _ in messages), (tmp_path / "stages.log").read_text()[-3000:]


def test_a_decisions_table_ahead_of_its_topic_is_read_again_in_full(kafka_bootstrap, tmp_path, caplog):
    """A decisions table on disk whose position lies beyond the end of its topic (the
    topology's topics deleted and created again under the same app) describes another
    topic: it is wiped and the topic read in full, not trusted."""
    from neardup.sharded.decide_stage import DecideProcessor
    from neardup.sharded.records import order_key, order_seq
    from neardup.state.decisions import StoredDecisionsTable

    topology = Topology(f"sharded-{uuid.uuid4().hex[:8]}", shards=2, decide_partitions=1)
    stale = order_seq(order_key(1_700_000_000_000, 0, 5))
    table = StoredDecisionsTable(tmp_path / "decisions")
    table.apply([(stale, stale, "old")], 1_000)
    table.close()
    settings = Settings(bootstrap_servers=kafka_bootstrap, input_topics=["sharded-ahead"], group_id=topology.app)
    processor = DecideProcessor(settings, topology, tmp_path)
    try:
        with caplog.at_level("INFO", logger="neardup.sharded.decide_stage"):
            processor.start(None)
        assert stale not in processor.clusters  # the old entry is gone
        assert processor.clusters.position() is None  # nothing read from the new, empty topic
        assert "is beyond the end of" in caplog.text and "read in full" in caplog.text, caplog.text
    finally:
        processor.close()


def test_the_decisions_table_reads_batched_decisions_and_the_earlier_one_record_per_document(kafka_bootstrap):
    """The decisions topic as written now (one binary record per batch) and as written
    before (one JSON record per document, keyed by it), read into one table."""
    import orjson

    from neardup.sharded.decide_stage import DecideProcessor
    from neardup.sharded.records import DECISIONS_KEY, decisions_value, order_key, order_seq

    topology = Topology(f"sharded-{uuid.uuid4().hex[:8]}", shards=2, decide_partitions=1)
    topology.ensure(AdminClient({"bootstrap.servers": kafka_bootstrap}))
    k = [order_key(1_700_000_000_000 + i, 0, i) for i in range(4)]
    batch = [(k[2], k[0], "a", ()), (k[3], k[3], "d-é", ())]
    produce(kafka_bootstrap, topology.decisions, [
        (k[0], orjson.dumps({"cluster": [1_700_000_000_000, 0, 0], "cluster_id": "a"})),  # before
        (k[1], orjson.dumps({"cluster": [1_700_000_000_001, 0, 1], "cluster_id": "b"})),
        (DECISIONS_KEY + k[2], decisions_value(batch)),  # now
    ])
    settings = Settings(bootstrap_servers=kafka_bootstrap, input_topics=["sharded-table"], group_id=topology.app)
    processor = DecideProcessor(settings, topology, None)
    try:
        processor.start(None)
        seqs = [order_seq(key) for key in k]
        assert [processor.clusters[s] for s in seqs] == [seqs[0], seqs[1], seqs[0], seqs[3]]
        assert [processor.clusters.name(s) for s in (seqs[0], seqs[1], seqs[3])] == ["a", "b", "d-é"]
        assert processor._table_decisions == 4
    finally:
        processor.close()


def test_decide_restores_the_documents_waiting_from_its_changelog(kafka_bootstrap, tmp_path):
    """Decide's changelog partition read back: the consumed offset of the last ``P``
    record, and the documents waiting: those of the ``A`` records (one per batch, of the
    documents that began to wait in it) less those of the ``D`` records (the documents a
    batch decided whose ``A`` record stays live), with those of the earlier layouts, one
    ``W`` record each (a tombstone: decided) and a ``P`` record listing them (offset, then
    order keys). The ``P`` list's are not counted as logged: the next batch writes their
    records before its ``P`` record replaces the list."""
    import struct

    from neardup.sharded.decide_stage import DecideProcessor
    from neardup.sharded.records import order_key

    topology = Topology(f"sharded-{uuid.uuid4().hex[:8]}", shards=2, decide_partitions=1)
    topology.ensure(AdminClient({"bootstrap.servers": kafka_bootstrap}))
    keys = [order_key(1_700_000_000_000 + i, 0, i) for i in range(5)]
    settings = Settings(bootstrap_servers=kafka_bootstrap, input_topics=["sharded-waiting"], group_id=topology.app)
    processor = DecideProcessor(settings, topology, None)
    produce(kafka_bootstrap, topology.decide_changelog, [(b"P", struct.pack(">q", 40) + keys[0] + keys[1])])
    consumed, listed, logged = processor._restore(0)
    assert (consumed, listed, logged.listed) == (40, {keys[0], keys[1]}, {})  # the earliest layout
    produce(kafka_bootstrap, topology.decide_changelog, [
        (b"W" + keys[0], b""), (b"W" + keys[2], b""), (b"W" + keys[3], b""), (b"W" + keys[4], b""),
        (b"P", struct.pack(">q", 57)),  # a batch after the upgrade: keys[1] was decided in it
        (b"W" + keys[3], None), (b"W" + keys[0], None), (b"P", struct.pack(">q", 60)),  # the next batch
    ])
    consumed, listed, logged = processor._restore(0)
    assert (consumed, listed, set(logged.listed)) == (60, {keys[2], keys[4]}, {keys[2], keys[4]})
    # then batches of this layout: the documents that began to wait in each, one record, and
    # those decided whose record stays live; a record deleted once all of its are decided
    produce(kafka_bootstrap, topology.decide_changelog, [
        (b"A" + keys[0], keys[0] + keys[1] + keys[3]), (b"P", struct.pack(">q", 70)),
        (b"W" + keys[2], None), (b"D" + keys[1], keys[1]), (b"P", struct.pack(">q", 80)),  # keys[2], keys[1] decided
    ])
    consumed, listed, logged = processor._restore(0)
    assert (consumed, listed) == (80, {keys[0], keys[3], keys[4]})
    assert logged.names == {b"D" + keys[1]: {b"A" + keys[0]}}
    records, _ = logged.update([], [keys[0], keys[3]])  # the rest of the A record decided: it and its D record go
    assert records == [(b"A" + keys[0], None), (b"D" + keys[1], None)]


def test_documents_listed_at_a_restore_stay_listed_until_read_again_and_decided(kafka_bootstrap, tmp_path):
    """Decide restores a partition whose changelog lists three documents waiting, and
    reads their records again in two batches. After the first batch, the two documents
    not yet read again are still listed in the changelog (no tombstone): a rebalance
    right then (another process restores the partition) still reads them again. They were
    once tombstoned there, and a rebalance at that moment lost them: prepared, never
    decided, never output."""
    from confluent_kafka import Consumer, TopicPartition

    from neardup.kafka.stage import MessageBatch
    from neardup.sharded.decide_stage import DecideProcessor
    from neardup.sharded.records import (ENGINE_HEADER, ID_HEADER, KIND_HEADER, ORDER_HEADER, SHARDS_HEADER,
                                         TOPIC_HEADER, engine_digest, order_key)

    topology = Topology(f"sharded-{uuid.uuid4().hex[:8]}", shards=1, decide_partitions=1)
    topology.ensure(AdminClient({"bootstrap.servers": kafka_bootstrap}))
    settings = Settings(bootstrap_servers=kafka_bootstrap, input_topics=["sharded-listed"], group_id=topology.app)
    digest = engine_digest(settings.engine())
    keys = [order_key(1_700_000_000_000 + i, 0, i) for i in range(3)]
    # three documents prepared, their shard's findings not yet come: each waits
    produce(kafka_bootstrap, topology.findings, [
        (f"d{i}".encode(), b"{}", [(KIND_HEADER, b"document"), (ORDER_HEADER, key), (TOPIC_HEADER, b"sharded-listed"),
                                   (ENGINE_HEADER, digest), (SHARDS_HEADER, b"1"), (ID_HEADER, f"d{i}".encode())])
        for i, key in enumerate(keys)])
    produce(kafka_bootstrap, topology.decide_changelog,
            [(b"W" + key, b"") for key in keys] + [(b"P", struct.pack(">q", 3))])

    reader = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": f"reader-{uuid.uuid4()}",
                       "enable.auto.commit": False})
    reader.assign([TopicPartition(topology.findings, 0, 0)])
    records = []
    deadline = time.monotonic() + 30
    while len(records) < 3 and time.monotonic() < deadline:
        records += [m for m in reader.consume(10, timeout=0.5) if m.error() is None]
    reader.close()
    assert len(records) == 3

    processor = DecideProcessor(settings, topology, None)
    try:
        processor.start(None)
        processor.check(None, [(topology.findings, 0)])
        out, _ = processor.compute(MessageBatch(records[:1], full=False))  # the first read again
    finally:
        processor.close()
    log = [(key, value) for topic, _, key, value, _ in out if topic == topology.decide_changelog]
    assert not [key for key, value in log if value is None], "a document not yet read again was tombstoned"
    produce(kafka_bootstrap, topology.decide_changelog, log)  # the batch committed; then a rebalance
    _, listed, _ = DecideProcessor(settings, topology, None)._restore(0)
    assert listed == set(keys), "the next owner of the partition must read every waiting document again"


@pytest.mark.parametrize("state", ["memory", "disk"])
def test_a_shard_state_indexed_with_other_engine_settings_stops_the_shard_with_one_line(
        kafka_bootstrap, kafka_topic_factory, tmp_path, state):
    # a shard partition's changelog says its members were indexed with other engine
    # settings (another banding: they would never be met again): the shard stops at once
    # with one line instead of giving wrong verdicts silently
    topic = kafka_topic_factory("sharded-state-engine", partitions=1)
    topology = Topology(f"sharded-{uuid.uuid4().hex[:8]}", shards=1, decide_partitions=1)
    topology.ensure(AdminClient({"bootstrap.servers": kafka_bootstrap}))
    other = engine_digest(Settings(threshold=0.9).engine())
    produce(kafka_bootstrap, topology.shard_changelog,
            [(b"P", struct.pack(">qq", 1_700_000_000_000, 0)), (b"E", other)])
    stage = subprocess.run(
        [sys.executable, "-m", "neardup.cli", "stage", "shard", "--bootstrap-servers", kafka_bootstrap,
         "--input-topic", topic, "--app", topology.app, "--shards", "1", "--decide-partitions", "1",
         *(["--state-dir", str(tmp_path / "shard")] if state == "disk" else []),
         "--log-level", "WARNING", "-X", "session.timeout.ms=6000"],
        capture_output=True, text=True, timeout=180)
    assert stage.returncode == 2, stage.stderr[-2000:]
    last = stage.stderr.strip().splitlines()[-1]
    assert last.startswith(f"neardup: error: {topology.shard_changelog}[0] holds members indexed with other "
                           f"engine settings (digest {other.decode()}"), last
    assert last.endswith("start under a new --app to build an index with these")
    assert "Traceback" not in stage.stderr


@pytest.mark.parametrize("role", ["shard", "decide"])
def test_a_changelog_of_an_earlier_layout_stops_a_stage_with_one_line(kafka_bootstrap, kafka_topic_factory,
                                                                      tmp_path, role):
    # a shard changelog whose progress record is a watermark alone, a decide changelog
    # with a finding logged on its own: the layouts of an earlier version, which this
    # one cannot read; the stage says so and how to start again, never misreads them
    import struct

    topic = kafka_topic_factory("sharded-layout", partitions=1)
    topology = Topology(f"sharded-{uuid.uuid4().hex[:8]}", shards=1, decide_partitions=1)
    topology.ensure(AdminClient({"bootstrap.servers": kafka_bootstrap}))
    changelog = topology.shard_changelog if role == "shard" else topology.decide_changelog
    old = (b"P", struct.pack(">q", 1_700_000_000_000)) if role == "shard" else (b"F" + bytes(20), b"{}")
    produce(kafka_bootstrap, changelog, [old])
    stage = subprocess.run(
        [sys.executable, "-m", "neardup.cli", "stage", role, "--bootstrap-servers", kafka_bootstrap,
         "--input-topic", topic, "--app", topology.app, "--shards", "1", "--decide-partitions", "1",
         "--state-dir", str(tmp_path / role), "--log-level", "WARNING", "-X", "session.timeout.ms=6000"],
        capture_output=True, text=True, timeout=180)
    assert stage.returncode == 2, stage.stderr[-2000:]
    last = stage.stderr.strip().splitlines()[-1]
    assert last.startswith(f"neardup: error: {changelog}[0] was written by an earlier version of neardup"), last
    assert last.endswith("start the deduplication under a new --app")
    assert "Traceback" not in stage.stderr


@pytest.mark.parametrize("state", ["memory", "disk"])
def test_a_shard_restores_members_records_and_the_member_records_of_the_earlier_layout(
        kafka_bootstrap, tmp_path, state):
    """A shard changelog partition holding an earlier version's ``M`` records (one member
    each, one of them deleted) and ``N`` records (a batch's members each, one deleted)
    restores to exactly the members not deleted, in memory and in a store, with the ``N``
    records live as the ones to delete when their members expire."""
    from neardup.sharded.records import BandRecord, order_key, order_seq
    from neardup.sharded.shard_stage import ShardProcessor
    from neardup.state.shard_store import member_value, members_value

    topology = Topology(f"sharded-{uuid.uuid4().hex[:8]}", shards=1, decide_partitions=1)
    topology.ensure(AdminClient({"bootstrap.servers": kafka_bootstrap}))
    settings = Settings(bootstrap_servers=kafka_bootstrap, input_topics=["sharded-members"], group_id=topology.app)
    keys = [order_key(1_700_000_000_000 + i, 0, i) for i in range(8)]

    def member(i: int) -> bytes:  # document i joins buckets i and 100 (shared by all)
        band = BandRecord(keys[i], f"d{i}", np.array([i, 100], dtype=np.uint64), np.arange(i, i + 5, dtype=np.uint32))
        return member_value([], band.value())

    produce(kafka_bootstrap, topology.shard_changelog, [
        (b"M" + keys[0], member(0)), (b"M" + keys[1], member(1)), (b"M" + keys[0], None),  # the earlier layout
        (b"N" + keys[4], members_value([(keys[i], member(i)) for i in (2, 3, 4)])),
        (b"N" + keys[6], members_value([(keys[i], member(i)) for i in (5, 6)])),
        (b"N" + keys[4], None),  # every member of it expired
        (b"N" + keys[7], members_value([(keys[7], member(7))])),
        (b"P", struct.pack(">qq", 1_700_000_000_007, 12) + keys[7]), (b"E", engine_digest(settings.engine()))])
    processor = ShardProcessor(settings, topology, tmp_path / "shard" if state == "disk" else None)
    try:
        shard = processor._restore(0)
        live = [1, 5, 6, 7]
        assert shard.batches == {keys[6], keys[7]}  # the N records live
        index = shard.index
        assert [index.id_of(order_seq(keys[i])) for i in live] == [f"d{i}" for i in live]
        assert sorted(index._members([100])[0]) == [order_seq(keys[i]) for i in live]
        assert [list(m) for m in index._members([0, 2, 5])] == [[], [], [order_seq(keys[5])]]
        assert shard.consumed == 12 and shard.last == keys[7]
    finally:
        processor.close()


@pytest.mark.parametrize("state", ["memory", "disk"])
def test_a_shard_restores_members_logged_as_references_to_their_band_records(kafka_bootstrap, tmp_path, state):
    """``N`` records of references (a deduplication without a retention window, whose band
    topic keeps its records) restore the members from the band records they name: all
    buckets or some, with their copy buckets, beside ``N`` records of values; a reference
    to a band record the topic no longer holds stops the restore with one line."""
    from neardup.sharded.records import (BandRecord, BandRecordGoneError, BandTopicNotKeptError, bands_value,
                                         order_key, order_seq)
    from neardup.sharded.shard_stage import ShardProcessor
    from neardup.state.shard_store import member_refs_value, member_value, members_value

    topology = Topology(f"sharded-{uuid.uuid4().hex[:8]}", shards=1, decide_partitions=1, keep_bands=True)
    topology.ensure(AdminClient({"bootstrap.servers": kafka_bootstrap}))
    settings = Settings(bootstrap_servers=kafka_bootstrap, input_topics=["sharded-refs"], group_id=topology.app)
    keys = [order_key(1_700_000_000_000 + i, 0, i) for i in range(6)]

    def buckets(i: int) -> np.ndarray:  # document i in buckets i, 100 (shared by all) and 200 + i
        return np.array([i, 100, 200 + i], dtype=np.uint64)

    def fingerprints(i: int) -> np.ndarray:
        return np.arange(i, i + 5, dtype=np.uint32)

    # band records at offsets 0 (documents 1 and 2) and 2 (document 3), a watermark-like
    # record of another kind between them
    produce(kafka_bootstrap, topology.bands, [
        (None, bands_value([keys[1], keys[2]], [b"d1", b"d2"], [buckets(1), buckets(2)], [fingerprints(1), fingerprints(2)])),
        (None, b"not a band record"),
        (None, bands_value([keys[3]], [b"d3"], [buckets(3)], [fingerprints(3)]))])
    band0 = BandRecord(keys[0], "d0", buckets(0), fingerprints(0))
    produce(kafka_bootstrap, topology.shard_changelog, [
        (b"N" + keys[0], members_value([(keys[0], member_value([], band0.value()))])),  # a record of values
        # 1 joins all, 2 only bucket 100 (index 1), 3 all and the copy bucket of 1
        (b"N" + keys[2], member_refs_value([(keys[1], 0, 0, None, []), (keys[2], 0, 1, [1], [])])),
        (b"N" + keys[3], member_refs_value([(keys[3], 2, 0, None, [keys[1]])])),
        (b"P", struct.pack(">qq", 1_700_000_000_003, 3) + keys[3]), (b"E", engine_digest(settings.engine()))])
    processor = ShardProcessor(settings, topology, tmp_path / "shard" if state == "disk" else None)
    try:
        shard = processor._restore(0)
        assert shard.batches == {keys[0], keys[2], keys[3]}
        index = shard.index
        assert [index.id_of(order_seq(keys[i])) for i in range(4)] == ["d0", "d1", "d2", "d3"]
        assert [sorted(m) for m in index._members([100, 2, 202, 203])] == [
            [order_seq(keys[i]) for i in range(4)], [], [], [order_seq(keys[3])]]
        assert index._copies(order_seq(keys[1])) == [order_seq(keys[3])]
        assert [list(m) for m in index._members([1])] == [[order_seq(keys[1])]]
    finally:
        processor.close()
    # a reference to a band record that is not there (offset 9): the restore stops, naming it
    produce(kafka_bootstrap, topology.shard_changelog, [
        (b"N" + keys[5], member_refs_value([(keys[5], 9, 0, None, [])]))])
    processor = ShardProcessor(settings, topology, tmp_path / "shard2" if state == "disk" else None)
    try:
        with pytest.raises(BandRecordGoneError, match=r"no longer holds the band record at offset 9"):
            processor._restore(0)
    finally:
        processor.close()
    # the band topic given a retention: a shard assigned the partition stops before any
    # record referred to is deleted, naming the setting (and logs no more references)
    from confluent_kafka.admin import AlterConfigOpType, ConfigEntry, ConfigResource, ResourceType

    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    resource = ConfigResource(ResourceType.TOPIC, topology.bands, incremental_configs=[
        ConfigEntry("retention.ms", "604800000", incremental_operation=AlterConfigOpType.SET)])
    admin.incremental_alter_configs([resource])[resource].result(30)
    processor = ShardProcessor(settings, topology, tmp_path / "shard3" if state == "disk" else None)
    try:
        with pytest.raises(BandTopicNotKeptError, match=r"no longer keeps its records for good; set it back"):
            processor.check(None, [(topology.bands, 0)])
        assert not processor._refs
    finally:
        processor.close()


def test_a_shard_with_a_window_logs_references_and_deletes_the_band_records_no_longer_needed(kafka_bootstrap):
    """A shard with a window over a band topic kept for good logs its members as
    references, and deletes a band partition's records below the point a committed batch
    gives (``_purge``: never below 1, where the admin API's -1 would delete them all;
    never back)."""
    from confluent_kafka import Consumer, Producer, TopicPartition

    from neardup.sharded.shard_stage import ShardProcessor

    topology = Topology(f"sharded-{uuid.uuid4().hex[:8]}", shards=2, decide_partitions=1, keep_bands=True)
    topology.ensure(AdminClient({"bootstrap.servers": kafka_bootstrap}))
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    for p in (0, 1):
        for i in range(10):
            producer.produce(topology.bands, value=b"x%d" % i, partition=p)
    assert producer.flush(30) == 0
    settings = Settings(bootstrap_servers=kafka_bootstrap, input_topics=["sharded-window"], group_id=topology.app)
    processor = ShardProcessor(settings, topology, None, retention_ms=3_600_000)
    c = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": f"low-{uuid.uuid4().hex[:8]}"})

    def low(p: int) -> int:
        return c.get_watermark_offsets(TopicPartition(topology.bands, p), timeout=10)[0]

    def settled(want: dict[int, int]) -> bool:
        deadline = time.time() + 30
        while time.time() < deadline:
            if {p: low(p) for p in want} == want:
                return True
            time.sleep(0.2)
        return False

    try:
        processor.check(None, [])
        assert processor._refs and processor._purging
        processor._purge({0: 4, 1: 0})
        assert settled({0: 4, 1: 0})
        processor._purged_at = float("-inf")  # as once PURGE_INTERVAL_S has passed
        processor._purge({0: 3, 1: -1})  # neither back nor everything
        processor._purged_at = float("-inf")
        processor._purge({1: 7})
        assert settled({0: 4, 1: 7})
    finally:
        processor.close()
        c.close()
