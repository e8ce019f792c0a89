"""No message can stop `neardup run`: poison values, records too large for their output
topic, incoming neardup headers, and a fuzz run; against the real broker."""

from __future__ import annotations

import json
import logging
import os
import random
import re
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest
from confluent_kafka import KafkaError

from kafka_util import committed_offset, create_topic, excerpt, produce, read_all, run_until_committed, unique
from test_messages import POISON

from neardup.config import load_settings
from neardup.kafka.limits import HEADERS_ALLOWANCE, TopicLimits

JSON = {"text_field": ["text"], "id_field": "id"}
#: max.message.bytes of the input topics here: 10 MiB, ten times the broker's default.
INPUT_MAX_BYTES = 10 << 20


def _input_topic(bootstrap: str, prefix: str) -> str:
    return create_topic(bootstrap, f"{prefix}-{uuid.uuid4().hex[:12]}",
                        {"max.message.bytes": str(INPUT_MAX_BYTES)})


def _settings(bootstrap: str, topic: str, group: str, **extra):
    return load_settings({"bootstrap_servers": bootstrap, "input_topics": [topic], "group_id": group,
                          "from_beginning": True, **JSON, **extra})


def _outputs(bootstrap: str, topic: str, expected: int):
    return read_all(bootstrap, [f"{topic}.unique", f"{topic}.duplicates", f"{topic}.dlq"], expected=expected)


def _offsets(outs, key_offsets: dict[bytes, int]) -> list[int]:
    """The input offset of every output: a dead letter's source offset header, else by key."""
    return sorted(int(o.headers["neardup-source-offset"]) if o.topic.endswith(".dlq") else key_offsets[o.key]
                  for o in outs)


def test_poison_values_land_once_between_good_messages(kafka_bootstrap, tmp_path):
    """Each poison value, produced between two good messages, comes out exactly once
    (processed, or dead-lettered with its reason), and no batch is ever aborted."""
    good = [(str(r["id"]).encode(), json.dumps(r).encode()) for r in excerpt(len(POISON) + 1)]
    messages = [good[0]]
    for (name, (value, _)), next_good in zip(POISON.items(), good[1:]):
        messages += [(name.encode(), value), next_good]
    topic = _input_topic(kafka_bootstrap, "poison")
    produce(kafka_bootstrap, topic, messages, max_bytes=INPUT_MAX_BYTES + 1000)
    settings = _settings(kafka_bootstrap, topic, unique("g-poison"), batch_size=4, max_message_bytes=4 << 20)
    _, aborts = run_until_committed(settings, tmp_path / "state", len(messages))
    assert aborts == []

    outs = _outputs(kafka_bootstrap, topic, len(messages))
    key_offsets = {key: offset for offset, (key, _) in enumerate(messages)}
    assert _offsets(outs, key_offsets) == list(range(len(messages)))
    by_key = {o.key: o for o in outs}
    for name, (_, kind) in POISON.items():
        o = by_key[name.encode()]
        if kind is None:
            assert o.topic != f"{topic}.dlq" and "neardup-error" not in o.headers, name
        else:
            assert o.topic == f"{topic}.dlq", name
            reason = o.headers["neardup-error"].decode()
            assert {"invalid_json": "invalid JSON: ", "missing_field": ", not a"}[kind] in reason, (name, reason)
    assert all(by_key[key].topic != f"{topic}.dlq" for key, _ in good)
    # the 2 MB value: the dead-letter topic neardup created takes what the 10 MiB input
    # takes, so its dead letter carries it
    deep = by_key[b"deeper-than-orjson-allows"]
    assert deep.value == POISON["deeper-than-orjson-allows"][0] and "neardup-value-bytes" not in deep.headers


WORDS = [f"w{i}" for i in range(100_000)]


def _json_of_size(doc_id: str, size: int, seed: int) -> bytes:
    """A JSON record of exactly ``size`` bytes: ``id`` and a text of random words."""
    rng = random.Random(seed)
    head = json.dumps({"id": doc_id, "text": ""}).encode()[:-2]
    words = " ".join(rng.choices(WORDS, k=size // 6 + 1)).encode()
    return head + words[: size - len(head) - 2] + b'"}'


def _read_limit(bootstrap: str, topic: str) -> int:
    from confluent_kafka.admin import AdminClient, ConfigResource, ResourceType

    resource = ConfigResource(ResourceType.TOPIC, topic)
    admin = AdminClient({"bootstrap.servers": bootstrap})  # kept alive until the answer
    return int(admin.describe_configs([resource])[resource].result(10)["max.message.bytes"].value)


@pytest.mark.parametrize("outputs_max", [None, 1_048_588], ids=["created-by-neardup", "existing-1MiB"])
def test_records_too_large_for_their_topic_are_dead_lettered(outputs_max, kafka_bootstrap, tmp_path):
    """Values of 1,000,100 bytes (processed: the producer's own limit no longer
    interferes), 1,048,576 (processed; its record exceeds the output topic's
    max.message.bytes only when that topic exists beforehand with the broker's 1 MiB
    default), 1,048,577 and 5 MiB (over --max-message-bytes) between good messages: each
    lands once, no batch is aborted; a dead letter carries the value, unless the
    dead-letter topic existed beforehand with a limit too small for it."""
    topic = _input_topic(kafka_bootstrap, "big")
    if outputs_max:
        for suffix in ("unique", "duplicates", "dlq"):
            create_topic(kafka_bootstrap, f"{topic}.{suffix}", {"max.message.bytes": str(outputs_max)})
    sizes = {"v1000100": 1_000_100, "v1048576": 1 << 20, "v1048577": (1 << 20) + 1, "v5MiB": 5 << 20}
    good = [(str(r["id"]).encode(), json.dumps(r).encode()) for r in excerpt(len(sizes) + 1)]
    messages = [good[0]]
    for i, ((name, size), next_good) in enumerate(zip(sizes.items(), good[1:])):
        messages += [(name.encode(), _json_of_size(name, size, i)), next_good]
    produce(kafka_bootstrap, topic, messages, max_bytes=INPUT_MAX_BYTES + 1000)
    settings = _settings(kafka_bootstrap, topic, f"g-big-{outputs_max}", batch_size=3)
    batches = []
    _, aborts = run_until_committed(settings, tmp_path / "state", len(messages),
                                    on_batch=lambda dedup, stats: batches.append(stats))
    assert aborts == []
    # each message counted once, by its verdict or as a dead letter
    dead = {"too_large": 2, "output_too_large": 1} if outputs_max else {"too_large": 2}
    assert sum(len(b.verdicts) for b in batches) == len(messages) - sum(dead.values())
    assert sum((Counter(b.dead_letter) for b in batches), Counter()) == dead

    outs = _outputs(kafka_bootstrap, topic, len(messages))
    key_offsets = {key: offset for offset, (key, _) in enumerate(messages)}
    assert _offsets(outs, key_offsets) == list(range(len(messages)))
    by_key = {o.key: o for o in outs}
    assert all(by_key[key].topic != f"{topic}.dlq" for key, _ in good)
    assert by_key[b"v1000100"].topic != f"{topic}.dlq"
    assert by_key[b"v1000100"].value == messages[key_offsets[b"v1000100"]][1]
    dlq_limit = _read_limit(kafka_bootstrap, f"{topic}.dlq")
    assert dlq_limit == (outputs_max or INPUT_MAX_BYTES + HEADERS_ALLOWANCE)
    kinds = {b"v1048577": "too_large", b"v5MiB": "too_large"}
    if outputs_max:
        kinds[b"v1048576"] = "output_too_large"
    else:
        assert by_key[b"v1048576"].topic in (f"{topic}.unique", f"{topic}.duplicates")
        assert by_key[b"v1048576"].value == messages[key_offsets[b"v1048576"]][1]
    for key, kind in kinds.items():
        o = by_key[key]
        reason = o.headers["neardup-error"].decode()
        assert o.topic == f"{topic}.dlq", key
        assert o.headers["neardup-source-offset"] == str(key_offsets[key]).encode()
        if kind == "output_too_large":
            assert reason.startswith("record of ") and f"exceeds max.message.bytes 1048588 of topic {topic}." in reason
        else:
            assert reason.startswith("value of ") and "exceeds the limit of 1048576 bytes" in reason
        if sizes[key.decode()] + 500 < dlq_limit:
            assert o.value == messages[key_offsets[key]][1] and "neardup-value-bytes" not in o.headers
        else:
            assert o.value is None and o.key == key
            assert o.headers["neardup-value-bytes"] == str(sizes[key.decode()]).encode()
            assert f"left out to fit max.message.bytes {dlq_limit} of topic {topic}.dlq" in reason


def test_incoming_neardup_headers_are_renamed(kafka_bootstrap, tmp_path):
    """A message that already carries neardup headers (spoofed, or an output consumed
    again) comes out with one set of neardup headers, its own renamed neardup-input-*."""
    topic = _input_topic(kafka_bootstrap, "spoof")
    records = excerpt(3)
    spoofed = [("origin", b"x"), ("neardup-verdict", b"duplicate"), ("neardup-cluster", b"c9"),
               ("neardup-input-verdict", b"older"), ("neardup-error", b"nothing")]
    messages = [(str(r["id"]).encode(), json.dumps(r).encode()) for r in records] + [(b"bad", b"{not json")]
    produce(kafka_bootstrap, topic, messages, headers=spoofed)
    _, aborts = run_until_committed(_settings(kafka_bootstrap, topic, unique("g-spoof")), tmp_path / "state", len(messages))
    assert aborts == []
    outs = _outputs(kafka_bootstrap, topic, len(messages))
    assert len(outs) == len(messages)
    for o in outs:
        keys = [k for k, _ in o.header_list]
        assert len(keys) == len(set(keys)), keys  # each header once
        carried = [(k, v) for k, v in o.header_list if not k.startswith("neardup-") or k.startswith("neardup-input-")]
        assert carried == [("origin", b"x"), ("neardup-input-verdict", b"duplicate"),
                           ("neardup-input-cluster", b"c9"), ("neardup-input-error", b"nothing")]
        if o.key == b"bad":
            assert o.topic.endswith(".dlq") and o.headers["neardup-error"].startswith(b"invalid JSON")
        else:
            assert o.headers["neardup-verdict"] == b"unique" and o.headers["neardup-cluster"] == o.key


def _set_limit(bootstrap: str, topics: list[str], limit: int) -> None:
    """Set ``max.message.bytes`` of ``topics`` and wait until the broker reports it."""
    from confluent_kafka.admin import AdminClient, AlterConfigOpType, ConfigEntry, ConfigResource, ResourceType

    admin = AdminClient({"bootstrap.servers": bootstrap})
    resources = [ConfigResource(ResourceType.TOPIC, t, incremental_configs=[
        ConfigEntry("max.message.bytes", str(limit), incremental_operation=AlterConfigOpType.SET)]) for t in topics]
    for future in admin.incremental_alter_configs(resources).values():
        future.result(10)
    for t in topics:
        while _read_limit(bootstrap, t) != limit:
            time.sleep(0.1)


def test_a_record_refused_by_the_broker_fails_its_batch_once(kafka_bootstrap, tmp_path):
    """The output topics' max.message.bytes is lowered while the consumer runs (it read
    10 MiB): a 2 MiB record is refused in a delivery report, the batch is aborted, and
    its retry sends that message alone to the dead-letter topic (without its value, now
    too large for it too); every other message of the batch comes out once."""
    topic = _input_topic(kafka_bootstrap, "refused")
    outputs = [f"{topic}.unique", f"{topic}.duplicates", f"{topic}.dlq"]
    for name in outputs:
        create_topic(kafka_bootstrap, name, {"max.message.bytes": str(INPUT_MAX_BYTES)})
    records = [(str(r["id"]).encode(), json.dumps(r).encode()) for r in excerpt(30)]
    first, later = records[:10], records[10:]
    big = (b"big", _json_of_size("big", 2 << 20, 1))
    produce(kafka_bootstrap, topic, first)
    messages = first + later[:10] + [big] + later[10:]

    def on_batch(dedup, stats) -> None:
        if dedup.batches == 1:  # the limits of 10 MiB are read; lower them, then send the rest
            _set_limit(kafka_bootstrap, outputs, 1 << 20)
            produce(kafka_bootstrap, topic, messages[len(first):], max_bytes=INPUT_MAX_BYTES)

    settings = _settings(kafka_bootstrap, topic, unique("g-refused"), max_message_bytes=4 << 20, batch_size=50,
                         batch_max_ms=2000)
    _, aborts = run_until_committed(settings, tmp_path / "state", len(messages), on_batch=on_batch)
    codes = [e.args[0].code() for e in aborts]
    # The delivery report marks the message and purges the queue: step 5 then fails with
    # the refusal itself or, when it reaches send_offsets_to_transaction first, with the
    # transaction's error state (_STATE); either way the batch is aborted once.
    assert codes and codes[0] in (KafkaError.MSG_SIZE_TOO_LARGE, KafkaError._STATE), aborts
    # librdkafka may fail the next transaction once more (sequence numbers out of order)
    assert len(aborts) <= 2, aborts

    outs = _outputs(kafka_bootstrap, topic, len(messages))
    key_offsets = {key: offset for offset, (key, _) in enumerate(messages)}
    assert _offsets(outs, key_offsets) == list(range(len(messages)))
    by_key = {o.key: o for o in outs}
    assert [k for k, o in by_key.items() if o.topic == f"{topic}.dlq"] == [b"big"]
    dead = by_key[b"big"]
    reason = dead.headers["neardup-error"].decode()
    assert reason.startswith(f"not produced to {topic}.unique: Broker: Message size too large"), reason
    assert dead.value is None and dead.headers["neardup-value-bytes"] == str(2 << 20).encode()


# --- fuzz ---------------------------------------------------------------------------
FUZZ_MESSAGES = 3000
FUZZ_SEED = int(os.environ.get("NEARDUP_FUZZ_SEED", "2026"))
HEADER_KEYS = ["origin", "trace", "neardup-verdict", "NEARDUP-Cluster", "neardup-input-verdict",
               "neardup-error", "neardup-", "é", "", "x" * 300]


def _nested(rng: random.Random) -> bytes:
    depth = rng.choice([10, 254, 1000, 1024, 1025, 5000, 200_000])
    open_, close = rng.choice([(b"[", b"]"), (b'{"a":', b"}")])
    return open_ * depth + (b"1" if open_ != b"[" else b"") + close * depth


def _fuzz_value(rng: random.Random, records: list[dict]) -> bytes | None:
    """One value: a good record (often a lightly edited copy), or one of many kinds of
    bad bytes."""
    rec = rng.choice(records)
    good = json.dumps({"id": f"{rec['id']}-{rng.randrange(10**9)}", "text": rec["text"]}).encode()
    kind = rng.randrange(16)
    if kind < 5:
        return good
    if kind == 5:
        return rng.randbytes(rng.randrange(0, 300))
    if kind == 6:  # cut, spliced, bytes replaced
        i, j = sorted(rng.randrange(len(good) + 1) for _ in range(2))
        return good[:i] + rng.randbytes(rng.randrange(0, 8)) + good[j:]
    if kind == 7:
        return _nested(rng)
    if kind == 8:  # deep nesting beside the text
        return good[:-1] + b', "x": ' + _nested(rng) + b"}"
    if kind == 9:  # surrogates, escaped or as (invalid) UTF-8 bytes, in the id or the text
        bad = rng.choice([b"\\ud800", b"\\udfff", b"\\ud83d", b"\xed\xa0\x80", b"\\u0000"])
        field = rng.choice([b'"id": "', b'"text": "'])
        return good.replace(field, field + bad, 1)
    if kind == 10:  # numbers JSON has not, or beyond a double, and of every size
        number = rng.choice([b"NaN", b"Infinity", b"-Infinity", b"1" + b"0" * rng.randrange(300, 6000),
                             b"1e999", b"18446744073709551616", b"-0.0", b"1.5"])
        field = rng.choice([b'"id": ', b'"n": '])
        return b"{" + field + number + b', "text": ' + json.dumps(rec["text"]).encode() + b"}"
    if kind == 11:  # duplicate keys, ids and texts of other types
        return rng.choice([
            b'{"id": "a", "id": "b", "text": "x", "text": ' + json.dumps(rec["text"]).encode() + b"}",
            json.dumps({"id": rng.choice([[1], {"a": 1}, True, 1.5, -7, "", None]), "text": rec["text"]}).encode(),
            json.dumps({"id": "t", "text": rng.choice([1, None, [], {}, "", " \t\n", "!!!", "w" * 5000])}).encode(),
        ])
    if kind == 12:
        return rng.choice([None, b"", b"null", b"[]", b"{}", b'"just a string"'])
    if kind == 13:  # text in odd scripts and characters
        chars = "".join(chr(rng.choice([rng.randrange(32, 0xD800), rng.randrange(0xE000, 0x110000)]))
                        for _ in range(rng.randrange(1, 400)))
        return json.dumps({"id": f"u{rng.randrange(10**9)}", "text": chars}, ensure_ascii=rng.random() < 0.5).encode()
    if kind == 14:  # the same story again, to be found a duplicate
        return json.dumps({"id": f"copy-{rng.randrange(10**9)}", "text": rec["text"] + " (repeat)"}).encode()
    return good.replace(b'"text": "', b'"text": "' + rng.choice([b"\\n", b"\\t", b"\\\\", b"\\\""]) * 50, 1)


def _fuzz_messages(rng: random.Random, n: int) -> list[tuple[bytes | None, bytes | None, list]]:
    records = excerpt(400)
    out = []
    big = set(rng.sample(range(n), 4))  # a few values near and above the limits
    for seq in range(n):
        if seq in big:
            value = rng.choice([_json_of_size(f"big{seq}", rng.choice([1_000_100, 1 << 20]), seq),
                                rng.randbytes(rng.choice([(1 << 20) + 1, 3 << 20]))])
        else:
            value = _fuzz_value(rng, records)
        key = rng.choice([None, b"k%d" % seq, rng.randbytes(rng.randrange(0, 40)), b"\xff" * rng.randrange(1, 2000)])
        headers = [("fuzz-seq", str(seq).encode())]
        for _ in range(rng.choice([0, 0, 1, 3])):
            headers.append((rng.choice(HEADER_KEYS), rng.choice([None, b"", rng.randbytes(rng.randrange(0, 50))])))
        rng.shuffle(headers)
        out.append((key, value, headers))
    return out


def test_fuzz_every_message_lands_exactly_once(kafka_bootstrap, tmp_path):
    """A few thousand random and mutated messages (bytes, broken JSON, deep nesting,
    surrogates, odd numbers, huge values and keys, spoofed headers) through the real
    broker: every input offset comes out exactly once across unique, duplicates and the
    dead-letter topic, one set of neardup headers each, and no batch is aborted."""
    rng = random.Random(FUZZ_SEED)
    messages = _fuzz_messages(rng, FUZZ_MESSAGES)
    topic = _input_topic(kafka_bootstrap, "fuzz")
    produce(kafka_bootstrap, topic, messages, max_bytes=INPUT_MAX_BYTES)
    settings = _settings(kafka_bootstrap, topic, unique("g-fuzz"), batch_size=500)
    _, aborts = run_until_committed(settings, tmp_path / "state", len(messages))
    assert aborts == [], f"seed {FUZZ_SEED}"

    outs = _outputs(kafka_bootstrap, topic, len(messages))
    offsets = sorted(int(o.headers["neardup-source-offset"]) if o.topic.endswith(".dlq") else int(o.headers["fuzz-seq"])
                     for o in outs)
    assert offsets == list(range(len(messages))), f"seed {FUZZ_SEED}"
    kinds = Counter(o.topic.rsplit(".", 1)[1] for o in outs)
    reasons = Counter(re.sub(r"[^a-zA-Z ].*", "", o.headers["neardup-error"].decode())
                      for o in outs if o.topic.endswith(".dlq"))
    print(f"seed {FUZZ_SEED}: {dict(kinds)}; dead letters by reason: {dict(reasons)}")
    assert set(kinds) == {"unique", "duplicates", "dlq"}
    for o in outs:
        own = [k for k, _ in o.header_list if k.startswith("neardup-") and not k.startswith("neardup-input-")]
        assert len(own) == len(set(own)), (own, f"seed {FUZZ_SEED}")
        if not o.topic.endswith(".dlq"):
            key, value, _ = messages[int(o.headers["fuzz-seq"])]
            assert (o.key, o.value) == (key, value)


def test_topic_limits_are_read_from_the_broker(kafka_bootstrap, caplog):
    """A topic's own max.message.bytes, the broker's message.max.bytes for a topic not
    created yet, a warning for a limit below the producer's batch.size; read again
    after ``forget``."""
    small = create_topic(kafka_bootstrap, f"small-{uuid.uuid4().hex[:12]}", {"max.message.bytes": "500000"})
    limits = TopicLimits({"bootstrap.servers": kafka_bootstrap})
    with caplog.at_level(logging.WARNING, logger="neardup.kafka.limits"):
        assert limits.get(small) == 500_000
        assert limits.get(f"absent-{uuid.uuid4().hex}") == 1_048_588  # the broker's default
    assert f"topic {small} takes record batches of at most 500000 bytes" in caplog.text
    assert "set -X batch.size=" in caplog.text
    _set_limit(kafka_bootstrap, [small], 2_000_000)
    assert limits.get(small) == 500_000  # cached
    limits.forget()
    assert limits.get(small) == 2_000_000


def test_a_replay_produces_the_stored_record_though_a_limit_changed(kafka_bootstrap, tmp_path):
    """Where a record goes is decided before the state commit and stored: a crash after
    that commit, then the dead-letter topic's limit raised, and the restarted consumer
    still produces the dead letter without its value, as decided before the crash."""
    topic = _input_topic(kafka_bootstrap, "replay")
    create_topic(kafka_bootstrap, f"{topic}.dlq")  # the broker's default limit, 1 MiB
    good = [(str(r["id"]).encode(), json.dumps(r).encode()) for r in excerpt(150)]
    messages = [(b"huge", _json_of_size("huge", 5 << 20, 0))] + good  # in the first batch, whatever its size
    produce(kafka_bootstrap, topic, messages, max_bytes=INPUT_MAX_BYTES + 1000)
    group, state = unique("g-replay"), tmp_path / "state"
    crashed = subprocess.run([sys.executable, str(Path(__file__).parent / "crash_run.py"), "after_state_commit",
                              "1", kafka_bootstrap, topic, group, str(state)],
                             capture_output=True, text=True, timeout=120)
    assert crashed.returncode == 9, crashed.stderr[-2000:]
    assert committed_offset(kafka_bootstrap, group, topic) < 0  # the first batch's transaction never committed
    _set_limit(kafka_bootstrap, [f"{topic}.dlq"], INPUT_MAX_BYTES)

    settings = _settings(kafka_bootstrap, topic, group, batch_size=100)  # as crash_run.py
    _, aborts = run_until_committed(settings, state, len(messages))
    assert aborts == []
    outs = _outputs(kafka_bootstrap, topic, len(messages))
    key_offsets = {key: offset for offset, (key, _) in enumerate(messages)}
    assert _offsets(outs, key_offsets) == list(range(len(messages)))
    [dead] = [o for o in outs if o.topic == f"{topic}.dlq"]
    assert dead.key == b"huge" and dead.value is None
    assert dead.headers["neardup-value-bytes"] == str(5 << 20).encode()
