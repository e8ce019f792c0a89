"""The state outlives its directory: restored from its changelog topic on the real broker,
with every verdict identical to an uninterrupted run (``neardup.kafka.changelog``)."""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from confluent_kafka import Consumer, KafkaError, TopicPartition

from kafka_util import committed_offset, create_topic, excerpt, produce, start_run, stop, unique, wait_committed
from neardup.state import codec
from test_kafka_run import JSON_FIELDS, _assert_once_with_dedup_verdicts, _edited_copies, _json_messages

BATCHES = ["--batch-size", "100"]


def _changelog_keys(bootstrap: str, topic: str) -> list[bytes]:
    """The keys of the committed records of the changelog topic, read from its start to
    its end."""
    reader = Consumer({"bootstrap.servers": bootstrap, "group.id": "changelog-count",
                       "enable.auto.commit": False, "enable.partition.eof": True,
                       "isolation.level": "read_committed", "auto.offset.reset": "earliest"})
    try:
        reader.assign([TopicPartition(topic, 0, 0)])
        keys: list[bytes] = []
        while True:
            for m in reader.consume(10_000, timeout=10):
                if m.error() is None:
                    keys.append(m.key())
                elif m.error().code() == KafkaError._PARTITION_EOF:
                    return keys
    finally:
        reader.close()


def _changelog_records(bootstrap: str, topic: str) -> int:
    """Committed records of the changelog topic, read from its start to its end."""
    return len(_changelog_keys(bootstrap, topic))


def _run_to_end(bootstrap, topic, group, state, log, total, *extra) -> str:
    proc = start_run(bootstrap, topic, group, state, *JSON_FIELDS, *BATCHES, *extra, log=log)
    try:
        wait_committed(bootstrap, group, topic, total, proc, timeout_s=300, log=log)
        # past its start-up (a restore comes before the subscription), even when the
        # input was all committed before it started
        deadline = time.monotonic() + 120
        while "subscribed to" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
    finally:
        assert stop(proc) == 0, log.read_text()[-3000:]
    return log.read_text()


def _set_topic_config(bootstrap: str, topic: str, name: str, value: str) -> None:
    """Set one setting of ``topic`` on the broker."""
    from confluent_kafka.admin import AdminClient, AlterConfigOpType, ConfigEntry, ConfigResource, ResourceType

    admin = AdminClient({"bootstrap.servers": bootstrap})
    resource = ConfigResource(ResourceType.TOPIC, topic, incremental_configs=[
        ConfigEntry(name, value, incremental_operation=AlterConfigOpType.SET)])
    for future in admin.incremental_alter_configs([resource]).values():
        future.result(30)


def _first_part(bootstrap, topic, group, state, log, target, sig) -> None:
    proc = start_run(bootstrap, topic, group, state, *JSON_FIELDS, *BATCHES, log=log)
    try:
        wait_committed(bootstrap, group, topic, target, proc)
    finally:
        proc.send_signal(sig)
        proc.wait(timeout=60)


def test_a_state_directory_deleted_mid_stream_is_restored(kafka_bootstrap, kafka_topic_factory, tmp_path):
    """SIGKILL mid-stream, the state directory deleted, the same directory given again:
    the state comes back from the changelog and every verdict is the uninterrupted one."""
    records = _edited_copies(excerpt(600), rounds=3)  # 1,800 messages
    topic = kafka_topic_factory("cl-deleted")
    group, state = unique("g-cl-deleted"), tmp_path / "state"
    produce(kafka_bootstrap, topic, _json_messages(records[:1000]))  # the rest after the kill: it lands mid-stream
    _first_part(kafka_bootstrap, topic, group, state, tmp_path / "first.log", 700, signal.SIGKILL)
    produce(kafka_bootstrap, topic, _json_messages(records[1000:]))
    shutil.rmtree(state)
    out = _run_to_end(kafka_bootstrap, topic, group, state, tmp_path / "second.log", len(records))
    assert "restored" in out and "from changelog" in out, out[-3000:]
    _assert_once_with_dedup_verdicts(kafka_bootstrap, topic, records)


def test_a_fresh_directory_is_restored(kafka_bootstrap, kafka_topic_factory, tmp_path):
    """The consumer moved to another (empty) state directory between two runs."""
    records = _edited_copies(excerpt(600), rounds=3)
    topic = kafka_topic_factory("cl-fresh")
    group = unique("g-cl-fresh")
    produce(kafka_bootstrap, topic, _json_messages(records[:1200]))  # the rest after the first part
    _first_part(kafka_bootstrap, topic, group, tmp_path / "a", tmp_path / "first.log", 900, signal.SIGTERM)
    produce(kafka_bootstrap, topic, _json_messages(records[1200:]))
    out = _run_to_end(kafka_bootstrap, topic, group, tmp_path / "b", tmp_path / "second.log", len(records))
    assert "restored" in out, out[-3000:]
    _assert_once_with_dedup_verdicts(kafka_bootstrap, topic, records)


def test_a_restore_killed_midway_starts_over(kafka_bootstrap, kafka_topic_factory, tmp_path):
    """SIGKILL during the restore itself: the next start restores again, from scratch."""
    records = _edited_copies(excerpt(), rounds=5)  # 20,000 messages: a restore of about 70,000 records
    more = [{**r, "id": f"{r['id']}-late"}  # edited copies, produced after the restore
            for r in _edited_copies(excerpt(500), rounds=2, seed=11)[500:]]
    topic = kafka_topic_factory("cl-kill")
    group = unique("g-cl-kill")
    produce(kafka_bootstrap, topic, _json_messages(records))
    proc = start_run(kafka_bootstrap, topic, group, tmp_path / "a", *JSON_FIELDS, "--batch-size", "2000",
                     log=tmp_path / "first.log")
    try:
        wait_committed(kafka_bootstrap, group, topic, len(records), proc, timeout_s=600)
    finally:
        assert stop(proc) == 0
    log = tmp_path / "second.log"
    proc = start_run(kafka_bootstrap, topic, group, tmp_path / "b", *JSON_FIELDS, log=log)
    deadline = time.monotonic() + 120
    while "restoring the state from changelog" not in log.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert "restored" not in log.read_text().split("restoring the state from changelog")[1], \
        "the restore ended before the kill"
    produce(kafka_bootstrap, topic, _json_messages(more))
    out = _run_to_end(kafka_bootstrap, topic, group, tmp_path / "b", tmp_path / "third.log",
                      len(records) + len(more))
    assert f"restored {len(records)} documents" in out, out[-3000:]
    _assert_once_with_dedup_verdicts(kafka_bootstrap, topic, records + more)


def test_a_compacted_changelog_restores_the_same_state(kafka_bootstrap, kafka_topic_factory, tmp_path):
    """The broker compacts the changelog (small segments, any dirty ratio), dropping the
    records of keys written again (the per-batch meta records, the outcomes deleted each
    batch); a restore from what is left gives the same verdicts.

    Compaction is held back (``min.compaction.lag.ms`` of a day) until the records written
    are counted, then let go: a cleaner pass before the count would leave nothing to see."""
    records = _edited_copies(excerpt(600), rounds=3)
    topic = kafka_topic_factory("cl-compact")
    group = unique("g-cl-compact")
    changelog = f"{group}.neardup-changelog"
    create_topic(kafka_bootstrap, changelog, config={
        "cleanup.policy": "compact", "segment.ms": "100", "min.cleanable.dirty.ratio": "0.001",
        "delete.retention.ms": "0", "min.compaction.lag.ms": str(24 * 3600 * 1000)})
    produce(kafka_bootstrap, topic, _json_messages(records[:1200]))  # the rest after the first part
    _first_part(kafka_bootstrap, topic, group, tmp_path / "a", tmp_path / "first.log", 900, signal.SIGTERM)
    produce(kafka_bootstrap, topic, _json_messages(records[1200:]))
    before = _changelog_records(kafka_bootstrap, changelog)
    _set_topic_config(kafka_bootstrap, changelog, "min.compaction.lag.ms", "0")
    deadline = time.monotonic() + 180
    while (after := _changelog_records(kafka_bootstrap, changelog)) >= before:
        assert time.monotonic() < deadline, "the broker did not compact the changelog"
        time.sleep(2)
    print(f"changelog records: {before} written, {after} after compaction")
    out = _run_to_end(kafka_bootstrap, topic, group, tmp_path / "b", tmp_path / "second.log", len(records))
    [read] = re.findall(r"restored \d+ documents from changelog \S+: (\d+) records", out)
    assert int(read) <= after < before, out[-3000:]
    _assert_once_with_dedup_verdicts(kafka_bootstrap, topic, records)


def test_an_older_copy_of_the_state_is_restored(kafka_bootstrap, kafka_topic_factory, tmp_path):
    """The state directory replaced by a copy taken earlier (a volume snapshot): it is
    behind the changelog, so it is restored from it, not trusted nor refused."""
    records = _edited_copies(excerpt(600), rounds=3)
    topic = kafka_topic_factory("cl-older")
    group, state, copy = unique("g-cl-older"), tmp_path / "state", tmp_path / "copy"
    produce(kafka_bootstrap, topic, _json_messages(records[:600]))
    _run_to_end(kafka_bootstrap, topic, group, state, tmp_path / "first.log", 600)
    shutil.copytree(state, copy)
    produce(kafka_bootstrap, topic, _json_messages(records[600:1200]))
    _run_to_end(kafka_bootstrap, topic, group, state, tmp_path / "second.log", 1200)
    shutil.rmtree(state)
    copy.rename(state)
    produce(kafka_bootstrap, topic, _json_messages(records[1200:]))
    out = _run_to_end(kafka_bootstrap, topic, group, state, tmp_path / "third.log", len(records))
    assert "is behind changelog" in out and "restored 1200 documents" in out, out[-3000:]
    _assert_once_with_dedup_verdicts(kafka_bootstrap, topic, records)


def test_a_state_from_before_the_changelog_is_written_to_it(kafka_bootstrap, kafka_topic_factory, tmp_path):
    """A state built with --changelog off, then run with the changelog: the whole state is
    written to the changelog at start, so a later loss of the directory is restored."""
    records = _edited_copies(excerpt(600), rounds=3)
    topic = kafka_topic_factory("cl-seed")
    group, state = unique("g-cl-seed"), tmp_path / "state"
    produce(kafka_bootstrap, topic, _json_messages(records[:600]))
    _run_to_end(kafka_bootstrap, topic, group, state, tmp_path / "first.log", 600, "--changelog", "off")
    produce(kafka_bootstrap, topic, _json_messages(records[600:1200]))
    out = _run_to_end(kafka_bootstrap, topic, group, state, tmp_path / "second.log", 1200)
    assert "writing the whole state to changelog" in out, out[-3000:]
    shutil.rmtree(state)
    produce(kafka_bootstrap, topic, _json_messages(records[1200:]))
    out = _run_to_end(kafka_bootstrap, topic, group, state, tmp_path / "third.log", len(records))
    assert "restored 1200 documents" in out, out[-3000:]
    _assert_once_with_dedup_verdicts(kafka_bootstrap, topic, records)


def test_the_outcomes_of_messages_stay_out_of_the_changelog(kafka_bootstrap, kafka_topic_factory, tmp_path):
    """Each message's outcome is stored until the next batch commits, to answer the replay
    of a batch whose transaction did not commit from the same directory
    (``test_crash_at_each_step_of_the_protocol``). The changelog does not carry it: its
    records go into the batch's own transaction, so a restore holds the committed
    batches only, and no message of theirs is read again. A crash after the state commit
    of the third batch, then a restore into a new directory: the changelog holds the two
    committed batches and no outcome of a message, the third batch is processed anew,
    and every message comes out once with the verdicts of a plain run."""
    records = _edited_copies(excerpt(300), rounds=2)  # 600 messages, 6 batches of 100
    topic = kafka_topic_factory("cl-outcomes")
    produce(kafka_bootstrap, topic, _json_messages(records))
    group = unique("g-cl-outcomes")
    crashed = subprocess.run(
        [sys.executable, str(Path(__file__).parent / "crash_run.py"), "after_state_commit", "3",
         kafka_bootstrap, topic, group, str(tmp_path / "a")],
        capture_output=True, text=True, timeout=120,
    )
    assert crashed.returncode == 9, crashed.stderr[-2000:]
    assert committed_offset(kafka_bootstrap, group, topic) == 200
    families = Counter()
    for key in _changelog_keys(kafka_bootstrap, f"{group}.neardup-changelog"):
        family, stored = codec.split_changelog_key(key)
        families[family if family != "verdicts" or stored.startswith(b"\0") else "outcomes"] += 1
    assert families["documents"] == 200 and families["verdicts"] == 1, families  # the topic id
    assert families["outcomes"] == 0, families
    out = _run_to_end(kafka_bootstrap, topic, group, tmp_path / "b", tmp_path / "second.log", len(records))
    assert "restored 200 documents" in out, out[-3000:]
    _assert_once_with_dedup_verdicts(kafka_bootstrap, topic, records)


def _read_all(bootstrap: str, topic: str, count: int) -> list[tuple[bytes | None, bytes | None]]:
    reader = Consumer({"bootstrap.servers": bootstrap, "group.id": "in-order", "enable.auto.commit": False,
                       "auto.offset.reset": "earliest"})
    try:
        reader.assign([TopicPartition(topic, 0, 0)])
        out: list[tuple[bytes | None, bytes | None]] = []
        deadline = time.monotonic() + 60
        while len(out) < count and time.monotonic() < deadline:
            out += [(m.key(), m.value()) for m in reader.consume(1000, timeout=1) if m.error() is None]
        return out
    finally:
        reader.close()


def test_records_produced_in_one_call_keep_their_order_through_a_full_queue(kafka_bootstrap, kafka_topic_factory) -> None:
    """``produce_in_order`` on a producer whose queue holds 10 records, given 35: the
    queue fills part way (the broker takes nothing before ``linger.ms``), the rest are
    produced once it drains, all in their order, tombstones too; the last record's
    delivery report comes with its offset. A record the producer refuses raises."""
    import pytest
    from confluent_kafka import KafkaException, Producer

    from neardup.kafka.clients import produce_in_order

    topic = kafka_topic_factory("in-order")
    producer = Producer({"bootstrap.servers": kafka_bootstrap, "queue.buffering.max.messages": 10,
                         "linger.ms": 200, "message.max.bytes": 4000})
    records = [(b"k%02d" % i, None if i % 7 == 3 else b"v%02d" % i) for i in range(35)]
    reports: list[int] = []
    produce_in_order(producer, topic, 0, records, lambda err, msg: reports.append(msg.offset()))
    assert producer.flush(30) == 0
    assert reports == [34]
    assert _read_all(kafka_bootstrap, topic, 35) == records
    with pytest.raises(KafkaException) as refused:
        produce_in_order(producer, topic, 0, [(b"a", b"x"), (b"b", b"y" * 5000), (b"c", b"z")])
    assert refused.value.args[0].code() == KafkaError.MSG_SIZE_TOO_LARGE
    producer.purge()
    producer.flush(30)
