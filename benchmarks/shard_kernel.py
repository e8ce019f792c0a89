"""A compiled, batch-wise shard index against today's ``ShardIndex``: the same findings
and joins, and the CPU per band entry of each, on real band entries, no broker.

The shard stage spends about 32 µs of CPU per band entry (a document on one shard
partition; ``docs/scale-out.md``, "Per-stage costs"), most of it Python over dicts and
lists in ``neardup.sharded.shard.ShardIndex.add``. This script measures the same rules
compiled: ``shard_array_index.ArrayShardIndex`` (its docstring has the layout) meets,
ranks, verifies and joins a band record's documents in one numba call, with
``ShardIndex.add``'s rules (members ranked by buckets shared on this shard, earlier first
among equals; the first ``max_candidates`` verified, then more one at a time while the
best is a near miss; a near miss's copy bucket checked; a bucket joined while it holds
fewer than ``max_bucket_size`` and, with ``duplicate_buckets="new"``, no accepted
candidate; the copy bucket of each accepted candidate below Jaccard 1 joined instead;
a document processed late meets only the members before it). It leaves out the
retention window, the containment measure and the RocksDB store: a measured
alternative, not used by the stage.

Input: ``--docs`` documents of the replayed Reuters stream, prepared in batches of 500
with the default engine settings and routed to ``--shards`` partitions
(``scale_out_bytes.load``): one band record per prepare batch and shard partition, as
prepare sends them. Timed, per shard count, each partition's records through:

- ``ShardIndex``: ``parse_bands``, then ``add`` per document (``ShardProcessor._release``);
- ``ArrayShardIndex.add_batch``: ``parse_bands``, then one call per record, a ``Finding``
  and ``Joins`` per document back (what the stage takes today);
- ``ArrayShardIndex.add_columns``: the record's columns (views, no object per document),
  one call per record, arrays back.

Printed: whether every finding (candidates in verification order, their Jaccard,
containment and similarity) and every join (buckets, copy buckets) of both compiled
paths is ``ShardIndex``'s, and the CPU seconds and µs per band entry of each (reading the
results back for the comparison is not timed; the garbage collector set as the stage
sets it); the compile time apart; the load average.
"""

from __future__ import annotations

import argparse
import os
import struct
import time

import numpy as np

from scale_out_bytes import load
from shard_array_index import ArrayShardIndex

from neardup.cli import collect_rarely
from neardup.core.settings import EngineSettings
from neardup.sharded.records import bands_value, order_seq, parse_bands
from neardup.sharded.routing import group_by_shard
from neardup.sharded.shard import ShardIndex

def columns(value: bytes) -> tuple[bytes, list[str], np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A band record's documents as ``ArrayShardIndex.add_columns`` takes them: order
    keys (joined), ids, bucket offsets and ids, set offsets and sets (views of
    ``value``; the layout of ``neardup.sharded.records``)."""
    (n,) = struct.unpack_from(">I", value)
    at = 4 + 20 * n
    orders = value[4:at]
    entries = np.frombuffer(value, dtype=[("k", ">u2"), ("n_id", ">u2"), ("f", ">u4")], count=n, offset=at)
    at += 8 * n
    k, n_id, f = (entries[c].astype(np.int64) for c in ("k", "n_id", "f"))
    raw = value[at:at + int(n_id.sum())].decode("utf-8")  # ids are UTF-8; cut by characters below
    ends = np.cumsum(n_id).tolist()
    ids = [value[at + a:at + b].decode("utf-8") for a, b in zip([0, *ends[:-1]], ends)] if not raw.isascii() \
        else [raw[a:b] for a, b in zip([0, *ends[:-1]], ends)]
    at += int(n_id.sum())
    boff, foff = np.zeros(n + 1, dtype=np.int64), np.zeros(n + 1, dtype=np.int64)
    np.cumsum(k, out=boff[1:])
    np.cumsum(f, out=foff[1:])
    bk = np.frombuffer(value, dtype="<u8", count=int(boff[-1]), offset=at).astype(np.uint64)
    fps = np.frombuffer(value, dtype="<u4", count=int(foff[-1]), offset=at + 8 * int(boff[-1])).astype(np.uint32)
    return orders, ids, boff, bk, foff, fps


def _as_found(q: int, index: ArrayShardIndex, seqs: list[int], out: tuple[np.ndarray, ...],
              bk: np.ndarray, boff: np.ndarray) -> list[tuple]:
    out_c, out_j, out_k, out_n, joined, copied, copied_n = out
    every = index.seqs
    return [(q, seq, tuple((every[out_c[d, x]], out_j[d, x], out_k[d, x], out_j[d, x]) for x in range(out_n[d])),
             tuple(bk[boff[d]:boff[d + 1]][joined[boff[d]:boff[d + 1]]].tolist()),
             tuple(every[copied[d, x]] for x in range(copied_n[d]))) for d, seq in enumerate(seqs)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", type=int, default=20_000)
    ap.add_argument("--shards", type=int, nargs="+", default=[4, 16, 64])
    args = ap.parse_args()
    collect_rarely()  # the collector as the stage sets it
    print(f"load average at start {os.getloadavg()}")
    data = load(args.docs, 500)
    orders, ids = data["orders"], data["ids"]
    settings = EngineSettings()
    t0 = time.perf_counter()
    ArrayShardIndex(settings).add_columns(bytes(20), ["x"], np.array([0, 1]), np.array([7], dtype=np.uint64),
                                          np.array([0, 1]), np.array([3], dtype=np.uint32))
    print(f"compile or cache load: {time.perf_counter() - t0:.1f} s")
    for shards in args.shards:
        # the band records prepare sends: one per prepare batch and shard partition
        records: list[list[bytes]] = [[] for _ in range(shards)]
        for b in data["batches"]:
            grouped, bounds = group_by_shard(b["buckets"], shards)
            per: dict[int, list] = {}
            for v, i in enumerate(b["docs"]):
                cut = bounds[v]
                for q in range(shards):
                    if cut[q + 1] > cut[q]:
                        per.setdefault(q, []).append((orders[i], ids[i].encode(), grouped[v, cut[q]:cut[q + 1]],
                                                      b["fps"][v]))
            for q, es in per.items():
                o, i_, bk, fp = zip(*es)
                records[q].append(bands_value(list(o), list(i_), list(bk), list(fp)))
        entries = sum(len(parse_bands(v)) for rs in records for v in rs)
        timed: dict[str, float] = {}
        # today's: parse_bands, then ShardIndex.add per document (as ShardProcessor._release)
        t0 = time.process_time()
        raw_py = []
        for q in range(shards):
            py_index = ShardIndex(settings)
            for value in records[q]:
                raw_py.append((q, [py_index.add(order_seq(rec.order), rec.buckets, rec.fingerprints, rec.id)
                                   for rec in parse_bands(value)]))
        timed["ShardIndex: parse_bands, add per document"] = time.process_time() - t0
        # compiled, from the same per-document records: one add_batch per band record
        t0 = time.process_time()
        raw_nb = []
        for q in range(shards):
            nb_index = ArrayShardIndex(settings)
            for value in records[q]:
                raw_nb.append((q, nb_index.add_batch(parse_bands(value))))
        timed["ArrayShardIndex: parse_bands, add_batch per record (a Finding and Joins per document)"] = \
            time.process_time() - t0
        # compiled, over the record's columns: no object per document
        t0 = time.process_time()
        raw_col = []
        for q in range(shards):
            col_index = ArrayShardIndex(settings)
            for value in records[q]:
                cols = columns(value)
                raw_col.append((q, col_index, cols, col_index.add_columns(*cols)))
        timed["ArrayShardIndex: the record's columns, add_columns per record (arrays out)"] = \
            time.process_time() - t0
        found_py, found_nb = ([(q, finding.seq, tuple((c.seq, c.jaccard, c.containment, c.similarity)
                                                      for c in finding.checked),
                                tuple(joins.buckets.tolist()), joins.copies)
                               for q, results in raw for finding, joins in results] for raw in (raw_py, raw_nb))
        found_col = [f for q, index, cols, (seqs, out) in raw_col for f in _as_found(q, index, seqs, out, cols[3],
                                                                                      cols[2])]
        met = sum(bool(f[2]) for f in found_py)
        print(f"\n{shards} shards: {entries:,} band entries ({entries / args.docs:.2f} per document, {met:,} meet a "
              f"candidate); every finding and join the same as ShardIndex's: add_batch {found_nb == found_py}, "
              f"add_columns {found_col == found_py}")
        for what, seconds in timed.items():
            print(f"  {what}: {seconds:.2f} s CPU, {1e6 * seconds / entries:.1f} µs per entry")
    print(f"\nload average at end {os.getloadavg()}")


if __name__ == "__main__":
    main()
