"""Run one sharded stage as a real process:
python stage_run.py ROLE BOOTSTRAP TOPIC APP SHARDS DECIDE INSTANCE [REORDER_MS]"""

from __future__ import annotations

import logging
import sys

from neardup.config import load_settings
from neardup.io.decide_stage import DecideStage
from neardup.io.prepare_stage import PrepareStage
from neardup.io.shard_stage import ShardStage
from neardup.io.topology import Topology


def main() -> None:
    role, bootstrap, topic, app, shards, decide, instance = sys.argv[1:8]
    reorder_ms = int(sys.argv[8]) if len(sys.argv) > 8 else 1000
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {role}-{instance} %(name)s %(message)s")
    settings = load_settings({
        "bootstrap_servers": bootstrap, "input_topics": [topic], "group_id": f"{app}.{role}",
        "from_beginning": True, "text_field": ["text"], "id_field": "id", "batch_size": 50,
        "kafka": {"session.timeout.ms": "6000", "heartbeat.interval.ms": "500"},
    })
    topology = Topology(app, int(shards), int(decide))
    if role == "prepare":
        PrepareStage(settings, topology, instance).run()
    elif role == "shard":
        ShardStage(settings, topology, instance, reorder_window_ms=reorder_ms).run()
    else:
        DecideStage(settings, topology, instance).run()


if __name__ == "__main__":
    main()
