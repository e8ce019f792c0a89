"""Run the consumer and crash it (os._exit) at one named step of its Nth batch.

Usage: python crash_run.py STEP N BOOTSTRAP TOPIC GROUP STATE_DIR

STEP is one of:
  before_state_commit  after producing, before the RocksDB write of the batch
  after_state_commit   after the RocksDB write, before the Kafka transaction commits
  after_kafka_commit   after the Kafka transaction commits, before the next batch

The store and the consumer are the real ones; the crash is a real process exit.
"""

from __future__ import annotations

import os
import sys

from neardup.config import load_settings
from neardup.detector import Detector
from neardup.run import KafkaDeduplicator
from neardup.state.rocksdb import RocksDBStateStore


def main() -> None:
    step, n, bootstrap, topic, group, state_dir = sys.argv[1:7]
    crash_at = int(n)
    settings = load_settings({
        "bootstrap_servers": bootstrap, "input_topics": [topic], "group_id": group,
        "from_beginning": True, "text_field": ["text"], "id_field": "id", "batch_size": 100,
        "kafka": {"session.timeout.ms": "3000", "heartbeat.interval.ms": "500"},
    })
    engine = settings.engine()
    store = RocksDBStateStore(state_dir, engine.state_shape())
    batches = 0
    real_commit = store.commit

    def commit(update):
        nonlocal batches
        if not update.ids and all(key.startswith(b"\0") for key in update.verdicts):
            return real_commit(update)  # no batch: the topic ids kept at assignment
        batches += 1
        if step == "before_state_commit" and batches == crash_at:
            os._exit(9)
        real_commit(update)
        if step == "after_state_commit" and batches == crash_at:
            os._exit(9)

    store.commit = commit  # type: ignore[method-assign]

    def after_batch(stats):
        if step == "after_kafka_commit" and batches == crash_at:
            os._exit(9)

    KafkaDeduplicator(settings, Detector(engine, store), on_batch=after_batch).run()


if __name__ == "__main__":
    main()
