"""Run one sharded stage as a real process: python stage_run.py prepare BOOTSTRAP TOPIC APP SHARDS DECIDE INSTANCE"""

from __future__ import annotations

import logging
import sys

from neardup.config import load_settings
from neardup.io.prepare_stage import PrepareStage
from neardup.io.topology import Topology


def main() -> None:
    role, bootstrap, topic, app, shards, decide, instance = sys.argv[1:8]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    settings = load_settings({
        "bootstrap_servers": bootstrap, "input_topics": [topic], "group_id": f"{app}.{role}",
        "from_beginning": True, "text_field": ["text"], "id_field": "id", "batch_size": 50,
        "kafka": {"session.timeout.ms": "6000", "heartbeat.interval.ms": "500"},
    })
    assert role == "prepare"
    PrepareStage(settings, Topology(app, int(shards), int(decide)), instance).run()


if __name__ == "__main__":
    main()
