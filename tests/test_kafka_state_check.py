"""State that does not match the input is refused, not trusted: a deleted state directory
and a topic deleted and created again are found when partitions are assigned, and
``neardup run`` exits 2 with one line naming the partition, unless ``--reset-state``."""

from __future__ import annotations

import json
import shutil
import subprocess
import time

from confluent_kafka.admin import AdminClient

from conftest import create_topics
from kafka_util import committed_offset, excerpt, produce, start_run, stop, unique, wait_committed

# The refusal applies without a changelog to restore from (with it, see test_kafka_changelog.py).
JSON_FIELDS = ["--text-field", "text", "--id-field", "id", "--changelog", "off"]


def _messages(records):
    return [(str(r["id"]).encode(), json.dumps(r).encode()) for r in records]


def _first_run(bootstrap, topic, group, state, tmp_path, messages) -> None:
    produce(bootstrap, topic, messages)
    proc = start_run(bootstrap, topic, group, state, *JSON_FIELDS, log=tmp_path / "first.log")
    try:
        wait_committed(bootstrap, group, topic, len(messages), proc)
    finally:
        assert stop(proc) == 0


def _refused(bootstrap, topic, group, state, log) -> str:
    """Start `neardup run`; it must exit 2 on its own; returns its output."""
    proc = start_run(bootstrap, topic, group, state, *JSON_FIELDS, log=log)
    try:
        code = proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        stop(proc)
        raise AssertionError("neardup run started on a state that does not match the input") from None
    out = log.read_text()
    assert code == 2, out[-3000:]
    assert "Traceback" not in out
    return out


def _error_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("neardup: error:")]


def test_a_deleted_state_directory_is_refused(kafka_bootstrap, kafka_topic_factory, tmp_path):
    records = excerpt(500)
    topic = kafka_topic_factory("lost-state")
    group, state = unique("g-lost-state"), tmp_path / "state"
    _first_run(kafka_bootstrap, topic, group, state, tmp_path, _messages(records[:300]))
    shutil.rmtree(state)
    produce(kafka_bootstrap, topic, _messages(records[300:]))

    out = _refused(kafka_bootstrap, topic, group, state, tmp_path / "refused.log")
    [line] = _error_lines(out)
    assert f"partition {topic}[0]" in line and "never seen" in line and "--reset-state" in line
    assert committed_offset(kafka_bootstrap, group, topic) == 300, "nothing was processed"

    assert f"--reset-state: partition {topic}[0]" in _run_reset(kafka_bootstrap, topic, group, state, tmp_path, 500)

    # accepted once: the state has seen the partition now
    log = tmp_path / "again.log"
    proc = start_run(kafka_bootstrap, topic, group, state, *JSON_FIELDS, log=log)
    try:
        deadline = time.monotonic() + 120
        while f"state checked against {topic}[0]" not in log.read_text():
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.5)
    finally:
        assert stop(proc) == 0


def _recreate(bootstrap: str, topic: str) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for future in admin.delete_topics([topic], operation_timeout=30).values():
        future.result()
    deadline = time.monotonic() + 60
    while True:
        try:
            create_topics(bootstrap, [topic])
            return
        except Exception:  # still being deleted
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def test_a_topic_created_again_is_refused(kafka_bootstrap, kafka_topic_factory, tmp_path):
    records = excerpt(700)
    topic = kafka_topic_factory("recreated")
    group, state = unique("g-recreated"), tmp_path / "state"
    _first_run(kafka_bootstrap, topic, group, state, tmp_path, _messages(records[:300]))
    _recreate(kafka_bootstrap, topic)
    produce(kafka_bootstrap, topic, _messages(records[300:]))  # offsets 0..399 again

    out = _refused(kafka_bootstrap, topic, group, state, tmp_path / "refused.log")
    [line] = _error_lines(out)
    assert f"partition {topic}[0]" in line and "created again" in line and "--reset-state" in line

    text = _run_reset(kafka_bootstrap, topic, group, state, tmp_path, 400)
    assert f"--reset-state: partition {topic}[0]" in text
    assert "already delivered" not in text


def _run_reset(kafka_bootstrap, topic, group, state, tmp_path, offset: int) -> str:
    """``neardup run --reset-state`` until the group has committed ``offset``; its log."""
    log = tmp_path / "reset.log"
    proc = start_run(kafka_bootstrap, topic, group, state, *JSON_FIELDS, "--reset-state", log=log)
    try:
        wait_committed(kafka_bootstrap, group, topic, offset, proc)
    finally:
        assert stop(proc) == 0
    return log.read_text()
