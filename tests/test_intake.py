"""The timestamp synchronisation across input partitions (``neardup.kafka.intake``), on
real ``confluent_kafka.Message`` objects and a clock the test moves; and its wiring in the
stage runtime."""

from __future__ import annotations

from confluent_kafka import KafkaError, Message

from neardup.config import load_settings
from neardup.detector import Detector
from neardup.kafka.intake import PENDING_WAIT_S, OrderedIntake
from neardup.run import KafkaDeduplicator
from neardup.state.memory import MemoryStateStore


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _message(partition: int, offset: int, ms: int) -> Message:
    return Message(topic="t", partition=partition, offset=offset, value=b"v", timestamp=(1, ms))


def test_partitions_are_released_in_record_time_order_and_a_silent_one_is_waited_for():
    clock = Clock()
    intake = OrderedIntake(100, 2.0, clock=clock)
    intake.assigned([("t", 0), ("t", 1)])
    intake.add([_message(0, 0, 10), _message(0, 1, 30)])
    assert intake.release(10) == []  # partition 1 is empty, not at its end: waited for
    intake.add([_message(1, 0, 20), _message(1, 1, 40)])
    released = intake.release(3)
    assert [(m.partition(), m.offset()) for m in released] == [(0, 0), (1, 0), (0, 1)]
    # partition 0 is empty now: the rest waits until its wait (2 s) runs out
    assert intake.release(10) == []
    clock.now += 2.5
    assert [(m.partition(), m.offset()) for m in intake.release(10)] == [(1, 1)]
    assert intake.waited == 1


def test_a_partition_with_records_to_fetch_is_waited_for_longer():
    clock = Clock()
    pending = {("t", 1)}
    intake = OrderedIntake(100, 2.0, pending=lambda tp: tp in pending, clock=clock)
    intake.assigned([("t", 0), ("t", 1)])
    intake.add([_message(0, 0, 10)])
    clock.now += 2.5
    assert intake.release(10) == []  # past the wait, but the client knows records are coming
    pending.clear()
    assert [m.offset() for m in intake.release(10)] == [0]
    eof = Message(topic="t", partition=1, offset=0, error=KafkaError(KafkaError._PARTITION_EOF))
    intake.add([eof])
    assert intake.waited == 1 and PENDING_WAIT_S > 2.5


def test_the_runtime_tells_its_intake_whether_a_partition_has_records_to_fetch():
    """The runtime hands the intake a callable (it once handed it an attribute of the same
    name, None: a partition waited for past ``--partition-wait-ms`` raised a TypeError and
    stopped ``neardup run`` with a traceback)."""
    settings = load_settings({"bootstrap_servers": "127.0.0.1:1", "input_topics": ["t"], "group_id": "g"})
    engine = settings.engine()
    runtime = KafkaDeduplicator(settings, Detector(engine, MemoryStateStore(engine.state_shape())))
    intake = runtime._intake
    assert intake is not None
    clock = Clock()
    intake._clock = clock
    intake.assigned([("t", 0), ("t", 1)])
    intake.add([_message(0, 0, 10)])
    clock.now += settings.partition_wait_ms / 1000 + 0.5
    assert [m.offset() for m in intake.release(10)] == [0]  # no consumer: nothing pending, passed over
    assert intake.waited == 1
