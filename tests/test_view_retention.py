"""A local view of a compacted topic partition (``neardup.state.view.TopicView``, the
shard stores and decide's table) left longer than the topic's ``delete.retention.ms`` is
read in full, not from its position: compaction may have removed tombstones of keys it
holds. Real broker, real RocksDB."""

from __future__ import annotations

import time

from kafka_util import create_topic, produce, unique
from rocksdict import WriteBatch

from neardup.config import Settings
from neardup.kafka.partition_log import catch_up
from neardup.state.view import TopicView


def _catch_up(settings: Settings, topic: str, view: TopicView) -> int | None:
    def apply(chunk):
        batch = WriteBatch(raw_mode=True)
        for m in chunk:
            if m.value() is None:
                batch.delete(m.key())
            else:
                batch.put(m.key(), m.value())
        view.write(batch, chunk[-1].offset() + 1)

    start, _ = catch_up(settings, topic, 0, view.position(), apply, view.wipe, view.position_age_ms())
    return start


def test_a_view_older_than_delete_retention_is_read_in_full(kafka_bootstrap, tmp_path, caplog):
    settings = Settings(bootstrap_servers=kafka_bootstrap)
    topic = unique("view-retention")
    create_topic(kafka_bootstrap, topic, {"cleanup.policy": "compact", "delete.retention.ms": "1500"})
    produce(kafka_bootstrap, topic, [(b"k1", b"v1"), (b"k2", b"v2")])
    view = TopicView(tmp_path / "view", "a test view")
    try:
        assert _catch_up(settings, topic, view) is None  # a new view: read in full
        assert view.position() == 2 and view.get(b"k1") == b"v1"

        produce(kafka_bootstrap, topic, [(b"k1", None)])
        assert _catch_up(settings, topic, view) == 2  # written just now: from its position
        assert view.get(b"k1") is None

        time.sleep(2.0)  # nothing written since: from its position, however old
        assert _catch_up(settings, topic, view) == 3

        time.sleep(2.0)
        produce(kafka_bootstrap, topic, [(b"k2", None), (b"k3", b"v3")])
        caplog.clear()
        assert _catch_up(settings, topic, view) is None  # older than delete.retention.ms, records since
        assert "longer than the topic's delete.retention.ms" in caplog.text
        assert (view.get(b"k2"), view.get(b"k3"), view.position()) == (None, b"v3", 5)
    finally:
        view.close()
