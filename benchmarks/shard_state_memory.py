"""Memory of a shard process against the documents it holds: the state in memory
(``ShardIndex``) against on disk (``StoredShardIndex`` over a RocksDB store per shard
partition), with the shard stage's rules and commit order, without Kafka (so the reorder
window's held records, which depend on how the input arrives, are not counted).

Each mode runs in a process of its own: the Reuters replay stream is shingled and banded
in batches, each document routed to the shard partitions it touches
(``neardup.sharded.routing``), and every partition's index is fed in order; on disk, each
batch's member records are applied to the store after the next batch is computed, as the
stage applies a batch once its transaction has committed, and each batch's buckets are read
ahead per partition before its documents are added (``StoredShardIndex.prefetch``), as the
stage reads a released batch's. Printed: resident memory
(VmRSS) and the store's bytes on disk every 20,000 documents, and documents/s.

    PYTHONPATH=src:benchmarks python benchmarks/shard_state_memory.py --docs 200000 --shards 4
"""

from __future__ import annotations

import argparse
import itertools
import os
import time
from pathlib import Path

import numpy as np

import benchlib
from neardup.core.settings import EngineSettings
from neardup.core.types import Document
from neardup.detector import Preparer
from neardup.sharded.records import BandRecord, band_buckets, order_key, order_seq, seq_order
from neardup.sharded.routing import owned_bands
from neardup.sharded.shard import Joins, ShardIndex, StoredShardIndex
from neardup.state.shard_store import ShardStore, member_parts, member_value

BATCH = 500
EVERY = 20_000


def run(mode: str, docs: int, shards: int, state: Path) -> dict[str, object]:
    settings = EngineSettings()
    corpus = benchlib.load_corpus(benchlib.default_corpus())
    stream = (Document(i, t) for i, t in benchlib.replay_stream(corpus, docs))
    prepare = Preparer(settings)
    if mode == "disk":
        stores = [ShardStore(state / f"shard-{q}", band_buckets) for q in range(shards)]
        indexes: list[ShardIndex] = [StoredShardIndex(settings, s) for s in stores]
    else:
        indexes = [ShardIndex(settings) for _ in range(shards)]
    pending: list[list[list[tuple[bytes, bytes]]]] = [[] for _ in range(shards)]
    points, started, busy, n = [], time.perf_counter(), 0.0, 0
    base = benchlib.proc_status_mb()["VmRSS"]
    for at in range(0, docs, BATCH):
        batch = list(itertools.islice(stream, BATCH))
        p = prepare(batch)
        t0 = time.perf_counter()
        records: list[list[tuple[bytes, bytes]]] = [[] for _ in range(shards)]
        if mode == "disk":  # a batch's buckets read ahead, as the stage reads them
            owned = [owned_bands(p.buckets[i], shards) for i in range(len(p.valid))]
            for q in range(shards):
                indexes[q].prefetch(np.concatenate([p.buckets[i][bands[q]] for i, bands in enumerate(owned)]))
        valid = iter(range(len(p.valid)))
        for k, reason in enumerate(p.rejected):
            if reason is not None:
                continue
            i = next(valid)
            order = order_key(1_000 + n, 0, n)
            n += 1
            fp = p.fingerprints[p.fingerprint_offsets[i]:p.fingerprint_offsets[i + 1]]
            for q, bands in enumerate(owned_bands(p.buckets[i], shards)):
                if len(bands):
                    _, joins = indexes[q].add(order_seq(order), p.buckets[i][bands], fp, batch[k].id)
                    if mode == "disk" and not joins.empty:
                        band = BandRecord(order, batch[k].id, joins.buckets, fp).value()
                        records[q].append((b"M" + order, member_value([seq_order(c) for c in joins.copies], band)))
        if mode == "disk":
            for q in range(shards):
                pending[q].append(records[q])
                if len(pending[q]) == 2:  # the batch before is committed: to the store
                    stores[q].apply(pending[q].pop(0))
                    index = indexes[q]
                    assert isinstance(index, StoredShardIndex)
                    index.forget()
                    for key, value in pending[q][0]:
                        copies, raw = member_parts(value)
                        rec = BandRecord.parse(key[1:], raw)
                        index.apply(order_seq(key[1:]), rec.id,
                                    Joins(rec.buckets, tuple(order_seq(c) for c in copies)), rec.fingerprints)
        busy += time.perf_counter() - t0
        if n and (at + BATCH) % EVERY == 0:
            points.append({"documents": n, "rss_mb": benchlib.proc_status_mb()["VmRSS"],
                           "disk_mb": benchlib.dir_bytes(state) / 1e6 if mode == "disk" else 0.0})
    return {"mode": mode, "documents": n, "shards": shards, "rss_at_start_mb": base, "points": points,
            "shard_seconds": busy, "shard_documents_per_second": n / busy,
            "seconds": time.perf_counter() - started}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=200_000)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--mode", choices=["memory", "disk"], help="run one mode here (used by the parent)")
    ap.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "shard_state_memory.json")
    args = ap.parse_args()
    if args.mode:
        return benchlib.mode_worker("neardup-shard-state-",
                                    lambda state: run(args.mode, args.docs, args.shards, state))
    print(f"{args.docs:,} replayed Reuters documents, {args.shards} shard partitions in one process, "
          f"load {os.getloadavg()}")
    runs = benchlib.modes_in_processes(__file__, ("memory", "disk"), "--docs", str(args.docs),
                                       "--shards", str(args.shards))
    rows = []
    for a, b in zip(runs[0]["points"], runs[1]["points"]):
        rows.append([f"{a['documents']:,}", f"{a['rss_mb']:,.0f}", f"{b['rss_mb']:,.0f}", f"{b['disk_mb']:,.0f}"])
    print(benchlib.table(["documents", "memory: RSS MB", "disk: RSS MB", "disk: store MB"], rows))
    for r in runs:
        print(f"{r['mode']}: {r['shard_documents_per_second']:,.0f} documents/s in the shard indexes "
              f"({r['shard_seconds']:.1f} s), RSS at start {r['rss_at_start_mb']:,.0f} MB")
    print(f"load {os.getloadavg()}")
    benchlib.write_json(args.json, {"environment": benchlib.environment(), "runs": runs})


if __name__ == "__main__":
    main()
