"""How often a shard would wait for a verification it no longer does itself: the latency
side of sending each shingle set once ("D3" in docs/scale-out.md, "Bytes per document").

Today a shard verifies its candidates with the sets it keeps, and what a document joins
depends on that: with ``--duplicate-buckets new`` a duplicate skips the buckets holding a
candidate it accepted. Without the sets on the shard (band records of bucket ids only, the
set kept once elsewhere), a document that meets members on a shard partition (a candidate
to verify) joins those members' buckets only once the answer is back. A later document
touching one of those buckets on that partition must wait for it to get one process's
candidates; the others can go on. This script counts them, without a broker: the real
routing and a real ``ShardIndex`` per shard partition over the replayed stream, in order
(``scale_out_bytes.load``, batches of 500).

A document d is pending on partition q for the K documents after it (K: how many later
documents the shards read before d's verification comes back; one round trip through the
set store). An entry (d', q) waits when one of its buckets on q is a bucket d met members
in, for a pending d. Printed per shard count and K: the band entries that wait, the
documents with at least one waiting entry, and the documents pending on some partition.
The buckets of the copy-bucket rule (a near miss's copies) are left out: they add waits.

In the replayed stream a copy comes a whole round (21,578 documents) after its original.
``--close GAP`` builds a stream where copies follow closely instead (a story republished
within minutes, one site's pages crawled in turn): ``--docs`` / (1 + ``--copies``)
stories, each followed by ``--copies`` light edits of it (the replay's later rounds), each
a uniformly random 1 to GAP documents after it; every document is counted.
"""

from __future__ import annotations

import argparse
import os
from collections import deque
from pathlib import Path

import random

import benchlib
from scale_out_bytes import load

from neardup.core.settings import EngineSettings
from neardup.core.types import Document
from neardup.detector import Preparer
from neardup.sharded.records import order_key, order_seq
from neardup.sharded.routing import group_by_shard
from neardup.sharded.shard import ShardIndex


def load_close(docs: int, gap: int, copies: int = 1, batch: int = 500, seed: int = 1) -> dict[str, object]:
    """``load``'s shape for a stream of ``docs`` / (1 + ``copies``) stories, each followed
    by ``copies`` light edits of it (the replay's rounds 1 to ``copies``), each 1 to
    ``gap`` documents after it."""
    n = docs // (1 + copies)
    corpus = benchlib.load_corpus(benchlib.default_corpus())
    size = len(corpus.texts)
    stream = list(benchlib.replay_stream(corpus, copies * size + n))
    rng = random.Random(seed)
    placed = sorted([(float(i), stream[i]) for i in range(n)]
                    + [(i + rng.randint(1, gap) - 0.5, stream[r * size + i]) for r in range(1, copies + 1)
                       for i in range(n)],
                    key=lambda x: x[0])
    ordered = [item for _, item in placed]
    orders = [order_key(1_700_000_000_000 + k, k % 4, k // 4) for k in range(len(ordered))]
    prepare = Preparer(EngineSettings())
    batches = []
    for start in range(0, len(ordered), batch):
        p = prepare([Document(i, t) for i, t in ordered[start:start + batch]])
        idx = [start + j for j, reason in enumerate(p.rejected) if reason is None]
        fps = [p.fingerprints[p.fingerprint_offsets[v]:p.fingerprint_offsets[v + 1]].copy() for v in range(len(idx))]
        batches.append({"docs": idx, "buckets": p.buckets, "fps": fps, "counted": True})
    return {"orders": orders, "ids": [i for i, _ in ordered], "batches": batches}


def waits(data: dict, shards: int, windows: list[int], settings: EngineSettings) -> dict[str, object]:
    """Per window K: entries waiting, documents with a waiting entry; and the counts."""
    index = [ShardIndex(settings) for _ in range(shards)]
    # per partition: bucket -> the stream positions of the documents that left it undetermined
    open_at: list[dict[int, deque[int]]] = [{} for _ in range(shards)]
    entries = pending_docs = docs = 0
    waiting_entries = {k: 0 for k in windows}
    waiting_docs = {k: 0 for k in windows}
    position = 0
    for b in data["batches"]:
        grouped, bounds = group_by_shard(b["buckets"], shards)
        for v, i in enumerate(b["docs"]):
            position += 1
            seq = order_seq(data["orders"][i])
            cut = bounds[v]
            counting = b["counted"]
            waited = {k: False for k in windows}
            pending = False
            for q in range(shards):
                if cut[q + 1] == cut[q]:
                    continue
                bk = grouped[v, cut[q]:cut[q + 1]]
                ids = bk.tolist()
                if counting:
                    entries += 1
                    ages = [position - at for x in ids for at in open_at[q].get(x, ())]
                    for k in windows:
                        if any(age <= k for age in ages):
                            waiting_entries[k] += 1
                            waited[k] = True
                met = [x for x, members in zip(ids, index[q]._members(ids)) if members]
                if met:  # candidates to verify here: its joins of these buckets wait for them
                    pending = True
                    for x in met:
                        open_at[q].setdefault(x, deque()).append(position)
                index[q].add(seq, bk, b["fps"][v], data["ids"][i])
            if counting:
                docs += 1
                pending_docs += pending
                for k in windows:
                    waiting_docs[k] += waited[k]
        horizon = position - max(windows)
        for opened in open_at:  # forget what no window reaches any more
            for x in [x for x, q in opened.items() if q[-1] < horizon]:
                del opened[x]
    return {"shards": shards, "documents": docs, "entries": entries, "pending_documents": pending_docs,
            "waiting_entries": waiting_entries, "waiting_documents": waiting_docs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", type=int, default=20_000)
    ap.add_argument("--count-from", type=int, default=0, help="documents before it go into the state, uncounted")
    ap.add_argument("--shards", type=int, nargs="+", default=[4, 16, 64])
    ap.add_argument("--windows", type=int, nargs="+", default=[100, 1_000, 10_000],
                    help="K: later documents read before a verification comes back")
    ap.add_argument("--close", type=int, default=0, metavar="GAP",
                    help="copies 1 to GAP documents after their originals (see above); 0: the replayed stream")
    ap.add_argument("--copies", type=int, default=1, help="with --close: copies per story")
    ap.add_argument("--json", type=str, default=None)
    args = ap.parse_args()
    report: dict[str, object] = {"git": benchlib.git_state(), "environment": benchlib.environment(),
                                 "args": vars(args), "runs": []}
    if args.close:
        print(f"{benchlib.describe_git(report['git'])}; {args.docs // (1 + args.copies):,} stories, each with "
              f"{args.copies} copies 1 to {args.close:,} documents later")
        data = load_close(args.docs, args.close, args.copies)
    else:
        print(f"{benchlib.describe_git(report['git'])}; {args.docs:,} documents of the replayed stream, "
              f"counted from {args.count_from:,}")
        data = load(args.docs, 500, args.count_from)
    for shards in args.shards:
        r = waits(data, shards, args.windows, EngineSettings())
        report["runs"].append(r)
        n, e = r["documents"], r["entries"]
        print(f"{shards} shards: {n:,} documents, {e:,} band entries ({e / n:.2f} per document); "
              f"documents pending on some partition {r['pending_documents'] / n:.3f}")
        for k in args.windows:
            print(f"  K = {k:>6,}: entries waiting {r['waiting_entries'][k] / e:.4f}, "
                  f"documents with a waiting entry {r['waiting_documents'][k] / n:.4f}")
    print(f"load average {os.getloadavg()}")
    if args.json:
        benchlib.write_json(Path(args.json), report)


if __name__ == "__main__":
    main()
