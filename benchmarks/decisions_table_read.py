"""What a decide process spends reading the decisions topic into its table, per decision,
for the two layouts of the topic: one JSON record per document (before) and one binary
record per decide batch (``neardup.sharded.records``, "Decisions record").

Every decide process reads the whole topic (its start, then every decision taken
anywhere), so at scale each decision is read once per decide process. Setup: the broker of
``kafka_e2e.start_broker``; two fresh topologies whose decisions topics get the same
``--decisions`` decisions (documents in order, a tenth of them duplicates of an earlier
one), one per layout, ``--batch`` decisions per batch record. Timed: the CPU of
``DecideProcessor.start`` (a consumer reads the topic from its start into the in-memory
table), ``--rounds`` times each, alternating; printed: the medians per decision, the
records read, the load average.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
import uuid
from pathlib import Path

import orjson
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient

import benchlib
from kafka_e2e import start_broker

from neardup.cli import collect_rarely
from neardup.config import Settings
from neardup.sharded.decide_stage import DecideProcessor
from neardup.sharded.records import DECISIONS_KEY, ORDER, decisions_value, order_key
from neardup.sharded.topology import Topology


def fill(bootstrap: str, topology: Topology, decisions: list[tuple[bytes, bytes, str, tuple]], batch: int,
         batched: bool) -> int:
    """Write ``decisions`` to the topology's decisions topic in one layout; records written."""
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 20})
    records = 0
    if batched:
        for start in range(0, len(decisions), batch):
            chunk = decisions[start:start + batch]
            producer.produce(topology.decisions, key=DECISIONS_KEY + chunk[0][0], value=decisions_value(chunk),
                             partition=0)
            records += 1
    else:
        for order, cluster, cluster_id, _ in decisions:
            producer.produce(topology.decisions, key=order, partition=0, value=orjson.dumps(
                {"cluster": list(ORDER.unpack(cluster)), "cluster_id": cluster_id}))
            records += 1
            if records % 10_000 == 0:
                producer.poll(0)
    producer.flush(60)
    return records


def read_once(bootstrap: str, topology: Topology) -> tuple[float, int]:
    """(CPU seconds of ``DecideProcessor.start``, decisions read)."""
    settings = Settings(bootstrap_servers=bootstrap, group_id=f"table-read-{uuid.uuid4().hex[:8]}",
                        input_topics=["decisions-table-read"])
    processor = DecideProcessor(settings, topology, None)
    try:
        t0 = time.process_time()
        processor.start(None)
        return time.process_time() - t0, processor._table_decisions
    finally:
        processor.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--decisions", type=int, default=100_000)
    ap.add_argument("--batch", type=int, default=500, help="decisions per batch record")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--shared-broker", action="store_true")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    bootstrap, how, _ = start_broker(args.shared_broker)
    report: dict[str, object] = {"git": benchlib.git_state(), "environment": benchlib.environment(),
                                 "args": {k: str(v) for k, v in vars(args).items()}, "broker": how,
                                 "load_average_start": os.getloadavg()}
    print(f"{benchlib.describe_git(report['git'])}; broker {how} at {bootstrap}; load average {os.getloadavg()}")
    rng = random.Random(1)
    orders = [order_key(1_700_000_000_000 + i, i % 4, i // 4) for i in range(args.decisions)]
    decisions = []
    for i, order in enumerate(orders):
        j = rng.randrange(i) if i and rng.random() < 0.1 else i  # a tenth: a duplicate of an earlier one
        decisions.append((order, orders[j], f"doc-{j}", ()))
    admin = AdminClient({"bootstrap.servers": bootstrap})
    layouts = {}
    for name, batched in (("one JSON record per document", False), ("one binary record per batch", True)):
        topology = Topology(f"table-read-{uuid.uuid4().hex[:8]}", shards=1, decide_partitions=1)
        topology.ensure(admin)
        layouts[name] = (topology, fill(bootstrap, topology, decisions, args.batch, batched))
    collect_rarely()
    spent: dict[str, list[float]] = {name: [] for name in layouts}
    for _ in range(args.rounds):
        for name, (topology, _) in layouts.items():
            seconds, read = read_once(bootstrap, topology)
            assert read == args.decisions, (name, read)
            spent[name].append(seconds)
    report["layouts"] = {}
    for name, (_, records) in layouts.items():
        median = statistics.median(spent[name])
        report["layouts"][name] = {"records": records, "cpu_seconds": spent[name],
                                   "us_per_decision": 1e6 * median / args.decisions}
        print(f"{name}: {records:,} records, CPU median {median:.3f} s of {args.rounds} reads, "
              f"{1e6 * median / args.decisions:.2f} µs per decision")
    report["load_average_end"] = os.getloadavg()
    print(f"load average {os.getloadavg()}")
    if args.json:
        benchlib.write_json(args.json, report)


if __name__ == "__main__":
    main()
