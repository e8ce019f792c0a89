"""Sharded rules against one process: agreement of verdicts, and the state per shard.

The input: the Reuters-21578 corpus replayed with edits (``benchlib.replay_stream``),
``--docs`` documents. One process: ``Detector(EngineSettings())`` over an in-memory store,
batches of 2,000. Sharded: ``neardup.sharded.reference.ShardedReference`` with each of
``--shards`` partition counts, in the same order (the order a reorder window restores).

Printed per partition count: the documents whose verdict, match or cluster differ from
one process's (and, for each cluster difference, whether one process's cluster canonical
was among the candidates the shards checked: the one place where the rules differ), and
per shard the documents that reached it, the bucket entries and the shingle sets it
holds (4 bytes per fingerprint). Bucket entries fall as 1/shards; a document's set is
kept on every shard where it joins a bucket, so sets per shard fall only as far as
documents touch fewer shards.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from benchlib import default_corpus, environment, load_corpus, replay_corpus, table, write_json

from neardup.core.settings import EngineSettings
from neardup.core.types import Document, Verdict
from neardup.detector import Detector
from neardup.sharded.reference import ShardedReference
from neardup.state.memory import MemoryStateStore


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", type=int, default=100_000)
    ap.add_argument("--shards", type=int, nargs="+", default=[1, 2, 4, 16, 64])
    ap.add_argument("--edits", choices=["light", "heavy"], default="light")
    ap.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "scale_out_agreement.json")
    args = ap.parse_args()
    corpus = replay_corpus(load_corpus(default_corpus()), args.docs, args.edits)
    docs = [Document(i, t) for i, t in zip(corpus.ids, corpus.texts)]
    settings = EngineSettings()
    print(f"{len(docs):,} documents ({args.edits} edits), {settings.bands.bands} bands x "
          f"{settings.bands.rows} rows; load {os.getloadavg()}")
    detector = Detector(settings, MemoryStateStore(settings.state_shape()))
    one: list[Verdict] = []
    for i in range(0, len(docs), 2000):
        one += [v for v in detector.process(docs[i:i + 2000]) if isinstance(v, Verdict)]
    duplicates = sum(v.is_duplicate for v in one)
    print(f"one process: {duplicates:,} duplicates of {len(one):,} documents")
    report: dict[str, object] = {"environment": environment(), "docs": len(docs), "edits": args.edits,
                                 "bands": settings.bands.bands, "duplicates": duplicates, "runs": []}
    rows = []
    for shards in args.shards:
        ref = ShardedReference(settings, shards)
        started = time.perf_counter()
        sharded: list[Verdict] = []
        for i in range(0, len(docs), 2000):
            sharded += [v for v in ref.process(docs[i:i + 2000]) if isinstance(v, Verdict)]
        seconds = time.perf_counter() - started
        differ = {f: sum(getattr(a, f) != getattr(b, f) for a, b in zip(one, sharded))
                  for f in ("verdict", "match", "cluster")}
        any_differ = sum(any(getattr(a, f) != getattr(b, f) for f in differ) for a, b in zip(one, sharded))
        entries = [s.bucket_entries() for s in ref.shards]
        sets = [len(s.sets) for s in ref.shards]
        set_bytes = [4 * sum(len(x) for x in s.sets.values()) for s in ref.shards]
        run = {"shards": shards, "agreement": 1 - any_differ / len(one), "differ": differ,
               "documents_differing": any_differ, "seconds": seconds,
               "touched_per_shard": ref.touched.tolist(), "bucket_entries_per_shard": entries,
               "sets_per_shard": sets, "set_bytes_per_shard": set_bytes,
               "shards_touched_per_document": float(ref.touched.sum() / len(one)),
               "sets_held_per_document": sum(sets) / len(one)}
        report["runs"].append(run)
        rows.append([shards, f"{run['agreement']:.5f}", differ["verdict"], differ["match"], differ["cluster"],
                     f"{run['shards_touched_per_document']:.2f}", f"{max(entries):,}",
                     f"{max(sets):,}", f"{max(set_bytes) / 1e6:.1f}", f"{run['sets_held_per_document']:.2f}"])
        for a, b in zip(one, sharded):
            if a.cluster != b.cluster and a.verdict == b.verdict:
                print(f"  {shards} shards, {a.id}: one process's cluster {a.cluster}, sharded {b.cluster} "
                      f"(related {b.related})")
    print(table(["shards", "agreement", "verdict", "match", "cluster", "shards/doc", "max entries",
                 "max sets", "max set MB", "sets/doc"], rows))
    print(f"load {os.getloadavg()}")
    write_json(args.json, report)


if __name__ == "__main__":
    main()
