"""The shard stage's batch work (``ShardProcessor.compute``) over real band records,
without a broker: CPU per document, and a digest of every record it produces.

``benchmarks/scale_out.py`` measures a shard process whole (consuming, producing,
committing, start-up); this script isolates what the stage itself does with a batch:
holding and releasing documents by watermark, the index (``ShardIndex``), findings and
member records. Its digest makes a change that must not alter the records checkable:
two commits with the same digest produce the same findings and changelog records, byte
for byte, for the same input.

Input: ``--docs`` documents of the replayed Reuters stream, prepared in batches of 500
with the default engine settings (``scale_out_bytes.load``), cut into band records per
shard partition as prepare cuts them (``neardup.sharded.records.batch_bands``), each
batch followed by a watermark record on every partition that releases it. The stage's
processor, in memory, is given ``--per-batch`` band-topic messages per ``compute`` call
(its transaction batches), the changelog offsets of the batches before taken as
committed. Timed: the ``compute`` calls only (process CPU), ``--rounds`` times, a fresh
processor each round; the garbage collector set as the stage sets it.

With ``--state disk`` each shard partition is a RocksDB store in a temporary directory
(``StoredShardIndex``, as ``neardup stage shard --state-dir`` runs): each batch's changelog
records are applied to the stores after it (``ShardProcessor.committed``, a batch taken as
committed at once), and the CPU of those commits is timed too (printed apart). The
records, and so the digest, are those of the state in memory.

Printed, per round: messages, documents, records produced, the digest (sha256 of their
topic, partition, key, value and headers), CPU seconds and µs per document; the load
average before and after.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import struct
import tempfile
import time
from pathlib import Path

import numpy as np

import benchlib
from scale_out_bytes import load

from neardup.cli import collect_rarely
from neardup.config import Settings
from neardup.kafka.stage import MessageBatch
from neardup.sharded.records import (
    ENGINE_HEADER,
    KIND_HEADER,
    WATERMARK_KIND,
    band_buckets,
    batch_bands,
    engine_digest,
    time_mark,
    watermark_value,
)
from neardup.sharded.routing import shard_bounds
from neardup.sharded.shard import ShardIndex, StoredShardIndex
from neardup.sharded.shard_stage import ShardProcessor, _Shard
from neardup.sharded.topology import Topology
from neardup.state.shard_store import ShardStore


class _Message:
    """A band-topic message as the consumer gives it (the methods ``compute`` calls)."""

    __slots__ = ("_topic", "_partition", "_offset", "_value", "_headers")

    def __init__(self, topic: str, partition: int, offset: int, value: bytes, headers: list) -> None:
        self._topic, self._partition, self._offset, self._value, self._headers = (
            topic, partition, offset, value, headers)

    def topic(self) -> str:
        return self._topic

    def partition(self) -> int:
        return self._partition

    def offset(self) -> int:
        return self._offset

    def value(self) -> bytes:
        return self._value

    def headers(self) -> list:
        return self._headers

    def key(self) -> None:
        return None


def band_messages(docs: int, shards: int, topology: Topology, digest: bytes) -> tuple[list[_Message], int]:
    """The band topic's messages for ``docs`` replayed documents, and how many documents."""
    data = load(docs, 500)
    orders, ids = data["orders"], data["ids"]
    messages: list[_Message] = []
    offsets = [0] * shards
    band_headers = [(ENGINE_HEADER, digest)]
    mark_headers = [(ENGINE_HEADER, digest), (KIND_HEADER, WATERMARK_KIND)]
    for b in data["batches"]:
        grouped, bounds = shard_bounds(b["buckets"], shards)
        sets = b["fps"]
        set_offsets = np.concatenate([[0], np.cumsum([len(s) for s in sets])]).astype(np.int64)
        flat = np.concatenate(sets) if sets else np.zeros(0, dtype=np.uint32)
        values = batch_bands([orders[i] for i in b["docs"]], [ids[i].encode("utf-8") for i in b["docs"]],
                             grouped, bounds, flat, set_offsets, np.ones(len(b["docs"]), dtype=bool))
        (last_ms,) = struct.unpack_from(">q", orders[b["all"][-1]])
        mark = watermark_value({("input", p): (4, time_mark(last_ms)) for p in range(4)})
        for q in range(shards):
            for value in values[q]:
                messages.append(_Message(topology.bands, q, offsets[q], value, band_headers))
                offsets[q] += 1
            messages.append(_Message(topology.bands, q, offsets[q], mark, mark_headers))
            offsets[q] += 1
    return messages, sum(len(b["all"]) for b in data["batches"])


def run(messages: list[_Message], shards: int, per_batch: int, settings: Settings,
        topology: Topology, state: Path | None = None, refs: bool = True) -> tuple[str, int, float, float]:
    """(digest, records produced, CPU seconds of the ``compute`` calls and of the commits
    to the stores). ``state``: a directory for the stores (None: in memory); ``refs``: the
    members logged as references to their band records (the stage without a retention
    window, its band topic kept), else with their values."""
    processor = ShardProcessor(settings, topology, state)
    processor._refs = refs
    for p in range(shards):
        if state is None:
            processor.shards[p] = _Shard(ShardIndex(processor.engine))
        else:
            store = ShardStore(state / f"shard-{p}", band_buckets)
            store.apply([], position=0)
            processor.shards[p] = _Shard(StoredShardIndex(processor.engine, store), store)
    digest, records, spent, committing = hashlib.sha256(), 0, 0.0, 0.0
    try:
        for start in range(0, len(messages), per_batch):
            t0 = time.process_time()
            out, written = processor.compute(MessageBatch(messages[start:start + per_batch], True))
            t1 = time.process_time()
            if state is None:
                processor._uncommitted.clear()  # taken as committed
            else:
                processor.committed(written, 0.0)
            committing += time.process_time() - t1
            spent += t1 - t0
            for record in out:
                digest.update(repr(record).encode())
            records += len(out)
    finally:
        processor.close()
    return digest.hexdigest()[:16], records, spent, committing


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", type=int, default=20_000)
    ap.add_argument("--shards", type=int, nargs="+", default=[4, 16])
    ap.add_argument("--per-batch", type=int, default=40, help="band-topic messages per compute call")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--state", choices=["memory", "disk"], default="memory",
                    help="the shard partitions' state: in memory, or a RocksDB store each")
    ap.add_argument("--members", choices=["refs", "values"], default="refs",
                    help="the members' changelog records: references to their band records (the stage without "
                         "a retention window) or their values (with one, or a band topic not kept)")
    ap.add_argument("--json", type=str, default=None)
    args = ap.parse_args()
    settings = Settings(bootstrap_servers="unused:9092", group_id="shard-compute")
    digest = engine_digest(settings.engine())
    report: dict[str, object] = {"git": benchlib.git_state(), "environment": benchlib.environment(),
                                 "load_average_start": os.getloadavg(), "runs": []}
    print(f"{benchlib.describe_git(report['git'])}; load average at start {os.getloadavg()}")
    collect_rarely()
    for shards in args.shards:
        topology = Topology("shard-compute", shards, 4)
        messages, docs = band_messages(args.docs, shards, topology, digest)
        for r in range(args.rounds):
            with tempfile.TemporaryDirectory(prefix="neardup-shard-compute-") as tmp:
                found, records, seconds, committing = run(messages, shards, args.per_batch, settings, topology,
                                                          Path(tmp) if args.state == "disk" else None,
                                                          refs=args.members == "refs")
            total = seconds + committing
            print(f"{shards} shards: {len(messages):,} messages, {docs:,} documents, {records:,} records "
                  f"(digest {found}), CPU {total:.2f} s, {1e6 * total / docs:.0f} µs per document"
                  + (f" (commits to the stores {committing:.2f} s)" if args.state == "disk" else ""))
            report["runs"].append({"shards": shards, "round": r, "state": args.state, "members": args.members,
                                   "messages": len(messages),
                                   "documents": docs, "records": records, "digest": found,
                                   "cpu_seconds": total, "commit_cpu_seconds": committing,
                                   "us_per_document": 1e6 * total / docs})
    report["load_average_end"] = os.getloadavg()
    print(f"load average at end {os.getloadavg()}")
    if args.json:
        benchlib.write_json(Path(args.json), report)


if __name__ == "__main__":
    main()
