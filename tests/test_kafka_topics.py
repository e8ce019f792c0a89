"""The topics neardup creates take the operator's partition count and replication factor
(``--topic-partitions``, ``--topic-replication-factor``; ``neardup.kafka.topics``), on the
real broker.

The local broker has one node, so a replication factor of 1 is all it can take: the
tests check the partition counts, that the changelogs stay compacted, and that a
replication factor the cluster cannot give stops the command with one line.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid

import pytest
from confluent_kafka.admin import AdminClient, ConfigResource

from kafka_util import create_topic, produce, start_run, stop, wait_committed
from test_sharded_kafka import _Stages, _through_the_stages

from neardup.kafka.limits import HEADERS_ALLOWANCE, SET_BYTES_PER_TEXT_BYTE
from neardup.sharded.topology import Topology


def _described(bootstrap: str, names: list[str]) -> dict[str, tuple[int, int, str]]:
    """(partitions, replicas of partition 0, cleanup.policy) of each topic."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    topics = admin.list_topics(timeout=10).topics
    out = {}
    for name in names:
        meta = topics[name]
        resource = ConfigResource(ConfigResource.Type.TOPIC, name)
        config = admin.describe_configs([resource], request_timeout=30)[resource].result()
        out[name] = (len(meta.partitions), len(meta.partitions[0].replicas), config["cleanup.policy"].value)
    return out


def _max_bytes(bootstrap: str, names: list[str]) -> dict[str, int]:
    """max.message.bytes of each topic."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    resources = [ConfigResource(ConfigResource.Type.TOPIC, name) for name in names]
    return {r.name: int(f.result()["max.message.bytes"].value)
            for r, f in admin.describe_configs(resources, request_timeout=30).items()}


def _messages(n: int) -> list[tuple[bytes, bytes]]:
    return [(str(i).encode(), json.dumps({"id": str(i), "text": f"story number {i} about the harbour and its ships "
                                                            f"and the weather on day {i}"}).encode())
            for i in range(n)]


def test_run_creates_its_outputs_with_the_partition_count_and_a_compacted_changelog(
        kafka_bootstrap, kafka_topic_factory, tmp_path):
    topic = kafka_topic_factory("topics-run")
    total = produce(kafka_bootstrap, topic, _messages(20))
    group = f"topics-{uuid.uuid4().hex[:8]}"
    log = tmp_path / "run.log"
    proc = start_run(kafka_bootstrap, topic, group, tmp_path / "state", "--text-field", "text", "--id-field", "id",
                     "--topic-partitions", "3", "--topic-replication-factor", "1", log=log)
    try:
        wait_committed(kafka_bootstrap, group, topic, total, proc, log=log)
    finally:
        assert stop(proc) == 0, log.read_text()[-3000:]
    outputs = [f"{topic}.unique", f"{topic}.duplicates", f"{topic}.dlq"]
    changelog = f"{group}.neardup-changelog"
    described = _described(kafka_bootstrap, [*outputs, changelog])
    assert {name: described[name] for name in outputs} == {name: (3, 1, "delete") for name in outputs}
    assert described[changelog] == (1, 1, "compact")  # one partition, compacted, whatever is asked


@pytest.mark.parametrize("changelog", ["on", "off"])
def test_run_with_a_replication_factor_the_cluster_cannot_give_stops_with_one_line(
        kafka_bootstrap, kafka_topic_factory, tmp_path, changelog):
    topic = kafka_topic_factory("topics-rf")
    produce(kafka_bootstrap, topic, _messages(3))
    group = f"topics-{uuid.uuid4().hex[:8]}"
    done = subprocess.run(
        [sys.executable, "-m", "neardup.cli", "run", "--bootstrap-servers", kafka_bootstrap, "--input-topic", topic,
         "--group-id", group, "--state-dir", str(tmp_path / "state"), "--from-beginning", "--metrics-port", "0",
         "--changelog", changelog, "--topic-replication-factor", "3", "--log-level", "WARNING"],
        capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("neardup: error:")]
    assert len(errors) == 1, done.stderr[-3000:]
    # the changelog is created before anything is consumed; the outputs at the first assignment
    names = [f"{group}.neardup-changelog"] if changelog == "on" else [f"{topic}.{s}" for s in ("unique", "duplicates", "dlq")]
    assert any(errors[0].startswith(f"neardup: error: cannot create topic {name} (") for name in names), errors[0]
    assert "replication factor 3" in errors[0] and "--topic-replication-factor" in errors[0]


def test_stages_create_internal_and_output_topics_as_asked(kafka_bootstrap, kafka_topic_factory, tmp_path):
    # an input that takes records of 32 MiB: the topics created take them (and their sets)
    topic = create_topic(kafka_bootstrap, f"topics-stages-{uuid.uuid4().hex[:12]}",
                         {"max.message.bytes": str(32 << 20)})
    messages = _messages(10)
    produce(kafka_bootstrap, topic, messages)
    topology = Topology(f"topics-{uuid.uuid4().hex[:8]}", shards=2, decide_partitions=1)
    stages = _Stages(kafka_bootstrap, topic, topology, tmp_path / "stages.log", reorder_ms=500,
                     extra=("--topic-partitions", "3", "--topic-replication-factor", "1"))
    _through_the_stages(stages, kafka_bootstrap, topic, len(messages), tmp_path / "stages.log")
    described = _described(kafka_bootstrap, [*topology.topics(), f"{topic}.unique", f"{topic}.duplicates",
                                             f"{topic}.dlq"])
    # the outputs take --topic-partitions; the internal topics keep the topology's counts
    for name, (partitions, config) in topology.topics().items():
        assert described[name] == (partitions, 1, config["cleanup.policy"]), name
    for suffix in ("unique", "duplicates", "dlq"):
        assert described[f"{topic}.{suffix}"] == (3, 1, "delete")
    sizes = _max_bytes(kafka_bootstrap, [*topology.topics(), f"{topic}.unique", f"{topic}.dlq"])
    assert sizes == {**{name: SET_BYTES_PER_TEXT_BYTE * (32 << 20) + HEADERS_ALLOWANCE for name in topology.topics()},
                     f"{topic}.unique": (32 << 20) + HEADERS_ALLOWANCE, f"{topic}.dlq": (32 << 20) + HEADERS_ALLOWANCE}


def test_a_stage_with_a_replication_factor_the_cluster_cannot_give_stops_with_one_line(
        kafka_bootstrap, kafka_topic_factory):
    topic = kafka_topic_factory("topics-stage-rf")
    produce(kafka_bootstrap, topic, _messages(1))
    app = f"topics-{uuid.uuid4().hex[:8]}"
    done = subprocess.run([sys.executable, "-m", "neardup.cli", "stage", "prepare", "--bootstrap-servers",
                           kafka_bootstrap, "--input-topic", topic, "--app", app, "--from-beginning",
                           "--topic-replication-factor", "3", "--log-level", "WARNING"],
                          capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("neardup: error:")]
    assert len(errors) == 1, done.stderr[-3000:]
    assert errors[0].startswith(f"neardup: error: cannot create topic {app}.")
    assert "replication factor 3" in errors[0] and "--topic-replication-factor" in errors[0]


@pytest.mark.parametrize("flag", ["--topic-partitions", "--topic-replication-factor"])
def test_a_count_of_zero_is_refused_with_one_line(flag, tmp_path):
    done = subprocess.run([sys.executable, "-m", "neardup.cli", "run", "--bootstrap-servers", "127.0.0.1:1",
                           "--input-topic", "t", "--state-dir", str(tmp_path / "state"), flag, "0"],
                          capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert done.returncode == 2
    assert done.stderr.strip() == (f"neardup: error: {flag} (or NEARDUP_{flag[2:].replace('-', '_').upper()}): "
                                   "must be at least 1, or -1 for the broker's default, not 0")


def test_brokers_fenced_while_they_register_again_is_a_passing_refusal() -> None:
    """KRaft's controller refuses a creation with ``INVALID_REPLICATION_FACTOR`` both for a
    replication factor larger than the brokers (the command stops with one line) and
    while every broker is fenced, as after an outage or a restart (a decide stage once
    exited 2 there): the second is retried like a broker away. The messages are the
    controller's (``StripedReplicaPlacer``, ``ReplicationControlManager``)."""
    from confluent_kafka import KafkaError

    from neardup.kafka.topics import REFUSED, passing

    code = KafkaError.INVALID_REPLICATION_FACTOR
    assert code in REFUSED
    assert passing(KafkaError(code, "All brokers are currently fenced."))
    assert passing(KafkaError(code, "Unable to replicate the partition 1 time(s): All brokers are currently "
                                    "fenced or in controlled shutdown."))
    assert not passing(KafkaError(code, "The target replication factor of 3 cannot be reached because only 1 "
                                        "broker(s) are registered."))
    assert not passing(KafkaError(KafkaError.POLICY_VIOLATION, "All brokers are currently fenced."))
