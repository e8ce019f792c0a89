"""The three sharded stages through a broker restart: the broker process is SIGKILLed and
started again in place (same data, same ports) while the input keeps arriving.

A broker of its own (``own_broker`` of conftest), so the other tests' broker
is never disturbed. Every input message must come out once, with the verdicts of the
sharded rules run in one process, and no stage may stop or print a traceback.
"""

from __future__ import annotations

import threading
import time
import uuid

from confluent_kafka import Producer

from conftest import create_topics
from neardup.sharded.topology import Topology
from test_sharded_kafka import _check_verdicts, _outputs, _Stages, _stories_and_copies


class PacedInput:
    """Produces ``messages`` (key, value) in a thread, ``per_second`` a second, through
    broker outages (librdkafka queues them and sends them once the broker answers)."""

    def __init__(self, bootstrap: str, topic: str, messages: list[tuple[bytes, bytes]], per_second: float) -> None:
        self.topic, self.messages, self.per_second = topic, messages, per_second
        self.failed: list[str] = []
        self._producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True,
                                   "linger.ms": 5, "message.timeout.ms": 600000})
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _on_delivery(self, err, msg) -> None:
        if err is not None:
            self.failed.append(str(err))

    def _run(self) -> None:
        start = time.monotonic()
        for i, (key, value) in enumerate(self.messages):
            while time.monotonic() - start < i / self.per_second:
                self._producer.poll(0.02)
            self._producer.produce(self.topic, key=key, value=value, on_delivery=self._on_delivery)

    def start(self) -> PacedInput:
        self._thread.start()
        return self

    def finish(self) -> None:
        self._thread.join(120)
        assert self._producer.flush(300) == 0, "the test's input was not all delivered"


def test_stages_survive_a_broker_restart_mid_stream(own_broker, tmp_path):
    bs = own_broker.bootstrap
    topic = create_topics(bs, [f"sharded-restart-{uuid.uuid4().hex[:6]}"], partitions=2)[0]
    messages = _stories_and_copies(200)
    topology = Topology(f"sharded-{uuid.uuid4().hex[:8]}", shards=4, decide_partitions=2)
    # a reorder window longer than the broker is away, so that no shard releases a record
    # before the ones prepare could not send while it was down
    stages = _Stages(bs, topic, topology, tmp_path / "stages.log", reorder_ms=45_000,
                     extra=("-X", "transaction.timeout.ms=10000"))
    feed = PacedInput(bs, topic, messages, per_second=25)
    try:
        for role in ("prepare", "shard", "decide"):
            stages.start(role)
        time.sleep(5)
        feed.start()
        time.sleep(6)  # about 150 messages in, the stages busy
        own_broker.kill()
        time.sleep(5)
        assert stages.alive(), f"every stage must survive the broker's crash: {stages.report()}"
        own_broker.restart()
        feed.finish()
        out = _outputs(bs, topic, len(messages), 300, stages.alive)
        assert stages.alive(), f"a stage stopped after the restart: {stages.report()}"
    finally:
        stages.stop()
    log = (tmp_path / "stages.log").read_text()
    assert not feed.failed
    assert len(out) == len(messages), log[-4000:]
    assert "Traceback" not in log, log[-4000:]
    _check_verdicts(bs, topic, topology, out, dead_letters=set())
