"""Large messages are never lost, on the real broker: the topics ``neardup run`` creates
take any record its input topics accept plus neardup's headers (``neardup.kafka.topics``),
so a message of an input that takes 10 MiB reaches ``.unique`` or, over
``--max-message-bytes``, a dead letter with its value; only an output topic that exists
already with a smaller limit makes a dead letter leave the value out, and then it says
so, points at the source offset, and ``neardup_dead_letter_value_left_out`` counts it.
"""

from __future__ import annotations

import logging
import random
import uuid

from confluent_kafka.admin import AdminClient, ConfigResource

from kafka_util import create_topic, produce, read_all, run_until_committed, start_run, stop, wait_committed
from neardup.config import Settings
from neardup.kafka.limits import HEADERS_ALLOWANCE
from neardup.kafka.messages import HEADER_ERROR, HEADER_SOURCE_OFFSET, HEADER_SOURCE_TOPIC, HEADER_VALUE_BYTES
from neardup.metrics import Metrics

MIB = 1 << 20
INPUT_LIMIT = 10 * MIB
WORDS = [f"w{n}" for n in range(5000)]


def _text(size: int, seed: int) -> bytes:
    """ASCII words, exactly ``size`` bytes."""
    rng = random.Random(seed)
    parts, total = [], 0
    while total < size:
        word = rng.choice(WORDS) + " "
        parts.append(word)
        total += len(word)
    return "".join(parts).encode()[:size]


def _max_bytes(bootstrap: str, topic: str) -> int:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    resource = ConfigResource(ConfigResource.Type.TOPIC, topic)
    return int(admin.describe_configs([resource], request_timeout=30)[resource].result()["max.message.bytes"].value)


def _input(bootstrap: str) -> tuple[str, list[bytes]]:
    """An input topic taking 10 MiB records, holding a small message, one of 1 MiB
    (1,048,576 bytes), one of 1 MiB + 1 and one of 5 MiB (offsets 0-3)."""
    topic = create_topic(bootstrap, f"large-{uuid.uuid4().hex[:12]}", {"max.message.bytes": str(INPUT_LIMIT)})
    values = [b"a short story about a harbour and its ships", _text(MIB, 1), _text(MIB + 1, 2), _text(5 * MIB, 3)]
    produce(bootstrap, topic, [(f"k{i}".encode(), v) for i, v in enumerate(values)], max_bytes=INPUT_LIMIT + MIB)
    return topic, values


def test_run_creates_outputs_that_take_what_its_input_takes(kafka_bootstrap, tmp_path) -> None:
    topic, values = _input(kafka_bootstrap)
    group = f"large-{uuid.uuid4().hex[:8]}"
    log = tmp_path / "run.log"
    proc = start_run(kafka_bootstrap, topic, group, tmp_path / "state", log=log)
    try:
        wait_committed(kafka_bootstrap, group, topic, len(values), proc, log=log)
    finally:
        assert stop(proc) == 0, log.read_text()[-3000:]
    outputs = [f"{topic}.unique", f"{topic}.duplicates", f"{topic}.dlq"]
    out = {int(m.headers[HEADER_SOURCE_OFFSET]) if m.topic.endswith(".dlq") else int(m.key[1:]): m
           for m in read_all(kafka_bootstrap, outputs, expected=len(values))}
    assert sorted(out) == [0, 1, 2, 3]
    assert out[0].topic == out[1].topic == f"{topic}.unique"  # 1,048,576 bytes: within --max-message-bytes
    assert out[2].topic == out[3].topic == f"{topic}.dlq"  # over it: dead letters, with their value
    for offset in range(4):
        assert out[offset].value == values[offset], (offset, out[offset].topic, out[offset].headers)
    for offset in (2, 3):
        assert b"exceeds the limit of 1048576 bytes" in out[offset].headers[HEADER_ERROR]
        assert HEADER_VALUE_BYTES not in out[offset].headers
    for name in outputs:
        assert _max_bytes(kafka_bootstrap, name) == INPUT_LIMIT + HEADERS_ALLOWANCE, name


def test_an_existing_smaller_dead_letter_topic_leaves_the_value_out_and_says_so(kafka_bootstrap, tmp_path,
                                                                                 caplog) -> None:
    topic, values = _input(kafka_bootstrap)
    small = 256 << 10  # outputs created beforehand, with a smaller limit than the input's
    for suffix in ("unique", "duplicates", "dlq"):
        create_topic(kafka_bootstrap, f"{topic}.{suffix}", {"max.message.bytes": str(small)})
    metrics = Metrics()
    settings = Settings(bootstrap_servers=kafka_bootstrap, input_topics=[topic], group_id=f"g-{topic}",
                        from_beginning=True, metrics_port=0)
    with caplog.at_level(logging.WARNING, logger="neardup.kafka.topics"):
        run_until_committed(settings, tmp_path / "state", len(values),
                            on_batch=lambda dedup, stats: metrics.observe_batch(stats))
    needed = INPUT_LIMIT + HEADERS_ALLOWANCE
    assert f"--entity-name {topic}.dlq --add-config max.message.bytes={needed}" in caplog.text
    outputs = [f"{topic}.unique", f"{topic}.duplicates", f"{topic}.dlq"]
    assert _max_bytes(kafka_bootstrap, f"{topic}.dlq") == small  # an existing topic is never changed
    got = read_all(kafka_bootstrap, outputs, expected=len(values))  # in order per topic only
    assert sorted(m.topic for m in got) == [f"{topic}.dlq"] * 3 + [f"{topic}.unique"]
    dead = sorted((m for m in got if m.topic.endswith(".dlq")), key=lambda m: int(m.headers[HEADER_SOURCE_OFFSET]))
    for offset, m in enumerate(dead, start=1):
        assert m.value is None, offset
        assert m.headers[HEADER_SOURCE_TOPIC] == topic.encode()
        assert m.headers[HEADER_SOURCE_OFFSET] == str(offset).encode()
        assert m.headers[HEADER_VALUE_BYTES] == str(len(values[offset])).encode()
        assert f"left out to fit max.message.bytes {small} of topic {topic}.dlq".encode() in m.headers[HEADER_ERROR]
    assert metrics.value_left_out._value.get() == 3
