"""The store's side of a changelog (``neardup.state.changelog``) on Reuters-21578: what a
run logs, and how long a snapshot and a restore take.

One process, a RocksDB store in a fresh temporary directory, ``EngineSettings()``,
batches of ``--batch-size`` (1000) documents of the corpus (``--docs``, all 21,578 by
default; beyond it, the corpus replayed with light edits, ``benchlib.replay_corpus``),
``store.commit(detector.detect(batch).update)`` per batch, run twice after a warm-up run
of 2,000 documents (compiled kernels loaded, not reported):

- ``no log``: ``log=None`` (the embedded mode);
- ``log``: ``log`` set to a function that keeps the records' count and bytes (key +
  value, a tombstone counting its key only) and ``confirm()`` after each batch.

Printed: docs/s of each run (``detect`` + ``commit`` wall time), records and bytes
logged per document, the bytes of the stored unconfirmed-key set after a batch; then on
the logged store: ``snapshot_records()`` (records, bytes, seconds), and a restore of those
records into a fresh store (``wipe``, ``apply`` per chunk of 10,000, ``finish_restore``:
seconds) checked equal to the original, family by family. The load averages are printed
beside the numbers.

With ``--window N`` both runs keep a retention window of N documents: the removal of
expired documents is logged too (its tombstones counted).

Usage: python benchmarks/changelog.py [--docs N] [--batch-size 1000] [--window N] [--json OUT]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402


def _run(corpus: benchlib.Corpus, path: Path, batch_size: int, logged: bool,
         window: int | None = None) -> tuple[object, dict[str, float]]:
    from neardup.core.retention import Retention
    from neardup.core.settings import EngineSettings
    from neardup.core.types import Document
    from neardup.detector import Detector
    from neardup.state import codec
    from neardup.state.rocksdb import RocksDBStateStore

    counts = {"records": 0, "bytes": 0, "tombstones": 0}

    def log(records: list[tuple[bytes, bytes | None]]) -> None:
        counts["records"] += len(records)
        counts["tombstones"] += sum(value is None for _, value in records)
        counts["bytes"] += sum(len(key) + (len(value) if value is not None else 0) for key, value in records)

    settings = EngineSettings()
    store = RocksDBStateStore(path, settings.state_shape(), log=log if logged else None,
                              retention=Retention(documents=window) if window else None)
    detector = Detector(settings, store)
    seconds = 0.0
    unconfirmed = 0
    for start in range(0, len(corpus), batch_size):
        docs = [Document(i, t) for i, t in zip(corpus.ids[start:start + batch_size],
                                                corpus.texts[start:start + batch_size])]
        begin = time.perf_counter()
        store.commit(detector.detect(docs).update)
        seconds += time.perf_counter() - begin
        if logged:
            unconfirmed = max(unconfirmed, len(store._get("default", codec.UNCONFIRMED_KEY) or b""))
            store.confirm()
    return store, {"docs_per_s": len(corpus) / seconds, **counts, "unconfirmed_set_bytes_max": unconfirmed}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", type=int, default=None,
                        help="first N documents (default: all); more than the corpus: replayed with edits")
    parser.add_argument("--batch-size", type=int, default=benchlib.BATCH_SIZE)
    parser.add_argument("--window", type=int, default=None,
                        help="a retention window of this many documents (expired ones are logged as tombstones)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    from neardup.state import codec
    from neardup.state.rocksdb import RocksDBStateStore
    from neardup.core.settings import EngineSettings

    corpus = benchlib.load_corpus(benchlib.default_corpus())
    if args.docs is not None:
        corpus = benchlib.replay_corpus(corpus, args.docs) if args.docs > len(corpus) else corpus.head(args.docs)
    n = len(corpus)
    report: dict[str, object] = {"docs": n, "batch_size": args.batch_size, "window": args.window, "git": benchlib.git_state()}
    with tempfile.TemporaryDirectory() as tmp:
        _run(corpus.head(2000), Path(tmp) / "warm-up", args.batch_size, logged=False)[0].close()  # type: ignore[attr-defined]
        plain, no_log = _run(corpus, Path(tmp) / "plain", args.batch_size, logged=False, window=args.window)
        plain.close()  # type: ignore[attr-defined]
        load_runs = os.getloadavg()
        store, with_log = _run(corpus, Path(tmp) / "logged", args.batch_size, logged=True, window=args.window)
        begin = time.perf_counter()
        chunks = list(store.snapshot_records())  # type: ignore[attr-defined]
        snapshot_s = time.perf_counter() - begin
        records = sum(map(len, chunks))
        snapshot_bytes = sum(len(k) + len(v) for chunk in chunks for k, v in chunk)
        restored = RocksDBStateStore(Path(tmp) / "restored", EngineSettings().state_shape())
        begin = time.perf_counter()
        restored.wipe()
        for chunk in chunks:
            restored.apply(chunk)
        restored.finish_restore()
        restore_s = time.perf_counter() - begin
        load_restore = os.getloadavg()
        same = all(list(store._scan(f)) == list(restored._scan(f))  # type: ignore[attr-defined]
                   for f in codec.FAMILIES) and restored.next_seq() == store.next_seq()  # type: ignore[attr-defined]
        restored.close()
        store.close()  # type: ignore[attr-defined]
    report.update(no_log=no_log, log=with_log, snapshot={"records": records, "bytes": snapshot_bytes,
                                                          "seconds": snapshot_s},
                  restore={"seconds": restore_s, "identical": same},
                  loadavg_runs=load_runs, loadavg_restore=load_restore, environment=benchlib.environment())
    print(f"{n:,} documents, batches of {args.batch_size}, window {args.window or 'none'}; {benchlib.describe_git(report['git'])}")  # type: ignore[arg-type]
    print(benchlib.table(["run", "docs/s", "records/doc", "bytes/doc", "tombstones", "max unconfirmed set B"], [
        ["no log", f"{no_log['docs_per_s']:,.0f}", "", "", "", ""],
        ["log", f"{with_log['docs_per_s']:,.0f}", f"{with_log['records'] / n:.2f}",
         f"{with_log['bytes'] / n:,.0f}", f"{with_log['tombstones']:,}", f"{with_log['unconfirmed_set_bytes_max']:,}"],
    ]))
    print(f"load average after the runs: {' '.join(f'{x:.2f}' for x in load_runs)}")
    print(f"snapshot: {records:,} records, {snapshot_bytes / 1e6:.1f} MB in {snapshot_s:.2f} s; "
          f"restore (wipe, apply, finish_restore): {restore_s:.2f} s; identical: {same}; "
          f"load average: {' '.join(f'{x:.2f}' for x in load_restore)}")
    if args.json:
        benchlib.write_json(args.json, report)
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
