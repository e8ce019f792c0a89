"""Retention: an endless stream with a window of 200,000 documents against the same stream
with none, side by side.

The stream is the replayed Reuters corpus with light edits (``benchlib.replay_stream``:
the 21,578 stories, then round after round of edited copies, ids ``<id>~r<round>``),
3,000,000 documents by default. Two variants, each in its own subprocess (this script
with ``--worker``), started together so that they share the same stretch of the
machine's time:

- ``window``: ``RocksDBStateStore(..., retention=Retention(documents=--window))``;
- ``none``: no retention (every document stays a candidate), the default.

With ``--in-turn`` the variants run one after the other instead, each with the machine to
itself: together, the no-window run's growing compactions share the two cores with the
window's run and slow it as the no-window state grows.

Each worker runs ``Detector(EngineSettings())`` over a RocksDB store in a fresh temporary
directory, batches of ``--batch-size`` (1000), ``store.commit(detector.detect(batch).update)``
per batch; the documents are generated lazily and their generation time is excluded
from the rates. Every ``--sample-every`` (100,000) documents a worker reports:

- *docs/s*: the documents since the last sample over their summed ``detect`` + ``commit``
  wall time;
- *state MB*: bytes of the RocksDB directory on disk (MB = 10^6 bytes);
- *RSS MB*: ``VmRSS`` now, and *peak RSS MB*: ``ru_maxrss`` (the high-water mark so far);
- *held*: documents held by the window (``store.stats()``), *index*: bucket memberships
  in memory;
- the load averages (1, 5, 15 min) at the sample.

After the window has filled (samples from ``2 * window`` documents on), the spread of
each measure (largest over smallest sample) says whether it stays flat: "flat" is a
spread of at most 1.2. A variant stops early once it has run ``--max-seconds`` of wall
time (the no-window run may not reach the end in reasonable time); the report says where.

Usage: python benchmarks/retention.py [--docs 3000000] [--window 200000] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from contextlib import closing
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402

VARIANTS = ("window", "none")


def _mb_maxrss() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e6  # KiB on Linux


def worker(args: argparse.Namespace) -> int:
    """Run the engine over the stream, printing one JSON object per line to stdout."""
    from neardup.core.retention import Retention
    from neardup.core.settings import EngineSettings
    from neardup.core.types import Document, Verdict
    from neardup.detector import Detector
    from neardup.state.rocksdb import RocksDBStateStore

    def emit(event: str, **fields: object) -> None:
        print(json.dumps({"event": event, "variant": args.worker, **fields}), flush=True)

    settings = EngineSettings()
    retention = Retention(documents=args.window) if args.worker == "window" else None
    base = benchlib.load_corpus(args.corpus)
    emit("start", docs=args.docs, git=benchlib.git_state(), base_documents=len(base),
         rss_before_engine_mb=benchlib.proc_status_mb().get("VmRSS"))
    stream = benchlib.replay_stream(base, args.docs, "light", args.seed)
    done = duplicates = 0
    engine_s = 0.0
    since_docs, since_s = 0, 0.0
    wall0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="neardup-bench-retention-") as tmp:
        state = Path(tmp) / "state"
        with closing(RocksDBStateStore(state, settings.state_shape(), retention=retention)) as store:
            detector = Detector(settings, store)
            while done < args.docs:
                batch = [Document(i, t) for i, t in
                         (next(stream) for _ in range(min(args.batch_size, args.docs - done)))]
                t0 = time.perf_counter()
                result = detector.detect(batch)
                store.commit(result.update)
                t1 = time.perf_counter()
                engine_s += t1 - t0
                since_s += t1 - t0
                since_docs += len(batch)
                done += len(batch)
                duplicates += sum(1 for r in result.results if isinstance(r, Verdict) and r.is_duplicate)
                if done % args.sample_every < len(batch) or done == args.docs:
                    stats = store.stats()
                    emit("sample", documents=done, docs_per_second=since_docs / since_s,
                         cumulative_docs_per_second=done / engine_s, state_mb=benchlib.dir_bytes(state) / 1e6,
                         rss_mb=benchlib.proc_status_mb().get("VmRSS"), peak_rss_mb=_mb_maxrss(),
                         held=stats.get("documents_held"), index_entries=stats.get("index_entries"),
                         duplicates=duplicates, loadavg=list(os.getloadavg()),
                         elapsed_seconds=time.perf_counter() - wall0)
                    since_docs, since_s = 0, 0.0
                    if time.perf_counter() - wall0 > args.max_seconds and done < args.docs:
                        emit("stopped", documents=done, reason=f"--max-seconds {args.max_seconds} of wall time reached")
                        break
    emit("end", git_end=benchlib.git_state())
    return 0


def spread(samples: list[dict[str, object]], key: str) -> float | None:
    values = [float(s[key]) for s in samples if s.get(key)]  # type: ignore[arg-type]
    return max(values) / min(values) if values else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=3_000_000)
    ap.add_argument("--window", type=int, default=200_000)
    ap.add_argument("--batch-size", type=int, default=1000)
    ap.add_argument("--sample-every", type=int, default=100_000)
    ap.add_argument("--max-seconds", type=float, default=5400.0, help="wall time after which a variant stops (default 5400)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--in-turn", action="store_true",
                    help="run the variants one after the other, each with the machine to itself (default: together)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--corpus", type=Path, default=benchlib.default_corpus())
    ap.add_argument("--json", type=Path)
    ap.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)

    env = benchlib.environment()
    print(f"retention benchmark: {args.docs:,} documents, window {args.window:,}; nproc {os.cpu_count()}, "
          f"load {os.getloadavg()}", flush=True)
    variants = args.variants.split(",")

    def launch(variant: str) -> subprocess.Popen:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", variant, "--docs", str(args.docs),
               "--window", str(args.window), "--batch-size", str(args.batch_size), "--sample-every",
               str(args.sample_every), "--max-seconds", str(args.max_seconds), "--seed", str(args.seed),
               "--corpus", str(args.corpus)]
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)

    def collect(variant: str, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            event = json.loads(line)
            events[variant].append(event)
            if event["event"] in ("sample", "stopped"):
                print(json.dumps(event), flush=True)
        proc.wait()

    print("variants run " + ("one after the other" if args.in_turn else "together, one process each"), flush=True)
    events: dict[str, list[dict[str, object]]] = {v: [] for v in variants}
    procs = {} if args.in_turn else {v: launch(v) for v in variants}
    for variant in variants:
        collect(variant, launch(variant) if args.in_turn else procs[variant])

    runs = []
    for variant, evs in events.items():
        samples = [e for e in evs if e["event"] == "sample"]
        settled = [s for s in samples if int(s["documents"]) >= 2 * args.window]  # type: ignore[call-overload]
        stopped = next((e for e in evs if e["event"] == "stopped"), None)
        runs.append({"variant": variant, "samples": samples, "stopped": stopped,
                     "start": next((e for e in evs if e["event"] == "start"), None),
                     "spread_after_window": {key: spread(settled, key) for key in
                                             ("docs_per_second", "state_mb", "rss_mb", "peak_rss_mb")}})
    rows = []
    by_docs: dict[int, dict[str, dict[str, object]]] = {}
    for run in runs:
        for s in run["samples"]:  # type: ignore[union-attr]
            by_docs.setdefault(int(s["documents"]), {})[run["variant"]] = s  # type: ignore[index]
    for docs in sorted(by_docs):
        row: list[object] = [f"{docs:,}"]
        for variant in variants:
            s = by_docs[docs].get(variant)
            row += ([f"{s['docs_per_second']:,.0f}", f"{s['state_mb']:,.0f}", f"{s['rss_mb']:,.0f}",
                     f"{s['peak_rss_mb']:,.0f}", " ".join(f"{x:.2f}" for x in s["loadavg"])]  # type: ignore[union-attr]
                    if s else ["-"] * 5)
        rows.append(row)
    headers = ["documents"] + [f"{v} {h}" for v in variants for h in ("docs/s", "state MB", "RSS MB", "peak MB", "load")]
    print(benchlib.table(headers, rows))
    for run in runs:
        print(f"{run['variant']}: spread after the window fills (largest / smallest sample): "
              + ", ".join(f"{k} {v:.2f}" for k, v in run["spread_after_window"].items() if v))  # type: ignore[union-attr]
        if run["stopped"]:
            print(f"{run['variant']}: stopped at {run['stopped']['documents']:,} documents: {run['stopped']['reason']}")  # type: ignore[index]
    report = {"benchmark": "retention", "docs": args.docs, "window": args.window, "batch_size": args.batch_size,
              "in_turn": args.in_turn,
              "sample_every": args.sample_every, "environment": env, "runs": runs}
    if args.json:
        benchlib.write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
