"""Restoring the shard partitions of a sharded deduplication from its changelog, as a
shard process does when partitions are assigned to it (``ShardProcessor._restore``, state
in memory): wall and CPU seconds, members restored, peak RSS.

It reads the topics of an existing deduplication, such as one that
``benchmarks/scale_out.py`` leaves on the broker (``--app``: its ``bench-app-...``
prefix, printed in its log; ``--list`` names the deduplications on the broker with their
shard counts and whether their changelogs log members as references to their band
records or with their values). Run it once per deduplication to compare the two.

Usage:
    python benchmarks/shard_restore.py --bootstrap HOST:PORT --list
    python benchmarks/shard_restore.py --bootstrap HOST:PORT --app bench-app-4b5daa12
"""

from __future__ import annotations

import argparse
import os
import resource
import time

from confluent_kafka import Consumer, TopicPartition
from confluent_kafka.admin import AdminClient

import benchlib
from neardup.config import Settings
from neardup.sharded.shard_stage import ShardProcessor
from neardup.sharded.topology import Topology
from neardup.state.shard_store import is_refs_value

SUFFIX = ".shard-changelog"


def layout(bootstrap: str, changelog: str) -> str:
    """How partition 0 of ``changelog`` logs its members: "references", "values" or "none"."""
    reader = Consumer({"bootstrap.servers": bootstrap, "group.id": "neardup-shard-restore-bench",
                       "enable.partition.eof": True, "isolation.level": "read_committed"})
    try:
        reader.assign([TopicPartition(changelog, 0, 0)])
        while True:
            m = reader.poll(10)
            if m is None or m.error() is not None:
                return "none"
            if (m.key() or b"")[:1] == b"N" and m.value() is not None:
                return "references" if is_refs_value(m.value()) else "values"
    finally:
        reader.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bootstrap", required=True)
    ap.add_argument("--app", help="the deduplication's topic prefix (its stages' --app)")
    ap.add_argument("--list", action="store_true", help="list the deduplications on the broker")
    args = ap.parse_args()
    topics = AdminClient({"bootstrap.servers": args.bootstrap}).list_topics(timeout=30).topics
    if args.list:
        for name, meta in sorted(topics.items()):
            if name.endswith(SUFFIX):
                print(f"{name[:-len(SUFFIX)]}: {len(meta.partitions)} shard partitions, members logged as "
                      f"{layout(args.bootstrap, name)}")
        return
    if not args.app:
        ap.error("--app or --list")
    changelog = args.app + SUFFIX
    if changelog not in topics:
        ap.error(f"no topic {changelog} on {args.bootstrap}")
    shards = len(topics[changelog].partitions)
    print(f"{benchlib.describe_git(benchlib.git_state())}; load average at start {os.getloadavg()}")
    processor = ShardProcessor(Settings(bootstrap_servers=args.bootstrap, input_topics=["unused"], group_id=args.app),
                               Topology(args.app, shards, 1))
    wall, cpu, members = time.perf_counter(), time.process_time(), 0
    for p in range(shards):
        members += len(processor._restore(p).index.sets)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    print(f"{args.app}: members logged as {layout(args.bootstrap, changelog)}, {shards} shard partitions, "
          f"{members:,} members restored in {wall:.2f} s wall, {cpu:.2f} s CPU; peak RSS "
          f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB; load average at end {os.getloadavg()}")


if __name__ == "__main__":
    main()
