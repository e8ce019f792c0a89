"""Scale: neardup's documents/s and memory as its RocksDB index grows to 1,000,000 documents.

The input is the replayed Reuters stream (``benchlib.replay_stream``): the 21,578 stories
as they are, then replayed round after round (1,000,000 documents = 46.3 rounds) with
seeded random edits, ids ``<id>~r<round>``. Two variants, each a separate run:

- ``light``: one edit per replay (fix a typo: two adjacent letters swapped; drop a word;
  or add a footer line). Most replays are near-duplicates (exact Jaccard >= 0.8) of their
  original and of one another: every story's LSH buckets fill up with its versions, so the
  candidates per document grow with the round (up to ``max_bucket_size``).
- ``heavy``: a share p ~ U(0, 5%) of a replay's words replaced by random corpus words, then
  one light edit. About 30% of the replays stay >= 0.8 Jaccard of their original; the
  rest are distinct-but-similar documents that are indexed as new clusters (unique) while
  still colliding in buckets with their relatives (rejected candidates). The printed
  duplicate share is measured, not assumed.

Each variant runs in its own subprocess (this script with ``--worker``), so the peak RSS
is that of the engine's process alone: ``Detector(EngineSettings())`` (default settings)
over a ``RocksDBStateStore`` in a fresh temporary directory, batches of ``--batch-size``
(1000), ``store.commit(detector.detect(batch).update)`` per batch. The documents are
generated lazily, batch by batch (the stream's memory is the base corpus, ~50 MB); the
generation time is excluded from the rates.

At each checkpoint (default 100k, 200k, 500k and 1M indexed documents, plus the last
document) the worker reports:

- *window docs/s*: the ``--window`` (20,000) documents just before the checkpoint divided
  by their summed ``detect`` + ``commit`` wall time: the speed at that index size;
- *cumulative docs/s*: all documents so far over all engine time so far;
- *dup share*: duplicates among the window's documents;
- *peak RSS*: ``resource.getrusage(RUSAGE_SELF).ru_maxrss`` (the process's high-water
  mark so far), and *RSS now*: ``VmRSS`` of ``/proc/self/status``; MB = 10^6 bytes.
  "RSS before engine" is read after the corpus is loaded, before the store is opened;
- *state MB*: the bytes of the RocksDB directory on disk.

*Interleaved* (``--paired``, default 20,000; 0 turns it off): the window rates of one
run drift with the machine by 10 to 30% between runs, which is as much as the effect
measured. So, after the last checkpoint, a second store is filled with the stream's first
``--paired-base`` (100,000) documents, and then batches go alternately to it and to the
large store (which one first alternates too): each continues its own stream for
``--paired`` documents. Both rates come from the same stretch of time, and their ratio
(large over small) is the figure to compare with "within 30%". The second store's memory
counts in the process's RSS from then on, so the peak RSS reported is the one at the
checkpoints, read before it opens.

Progress lines go to stderr every ``--progress-every`` documents.

Usage: python benchmarks/scale.py [--docs 1000000] [--variants light,heavy] [--json OUT]
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
from collections import deque
from contextlib import closing
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402

DEFAULT_CHECKPOINTS = (100_000, 200_000, 500_000, 1_000_000)


def _mb_maxrss() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e6  # KiB on Linux


def worker(args: argparse.Namespace) -> int:
    """Run the engine over the stream, printing one JSON object per line to stdout."""
    from neardup.core.settings import EngineSettings
    from neardup.core.types import Document, Verdict
    from neardup.detector import Detector
    from neardup.state.rocksdb import RocksDBStateStore

    def emit(event: str, **fields: object) -> None:
        print(json.dumps({"event": event, **fields}), flush=True)

    git = benchlib.git_state()
    settings = EngineSettings(**({"max_candidates": args.max_candidates} if args.max_candidates else {}))
    base = benchlib.load_corpus(args.corpus)
    checkpoints = sorted({c for c in args.checkpoints if c <= args.docs} | {args.docs})
    emit("start", variant=args.worker, docs=args.docs, git=git, checkpoint_sizes=checkpoints,
         base_documents=len(base), rss_before_engine_mb=benchlib.proc_status_mb().get("VmRSS"),
         maxrss_before_engine_mb=_mb_maxrss(), lsh=[settings.bands.bands, settings.bands.rows],
         verify=settings.verify, max_bucket_size=settings.max_bucket_size)
    stream = benchlib.replay_stream(base, args.docs + args.paired, args.worker, args.seed)
    window: deque[tuple[int, float, int, int]] = deque()  # (documents, engine s, duplicates, candidates) per batch
    in_window = 0
    done = dups_total = rejects = candidates = 0
    engine_s = gen_s = 0.0
    next_cp = 0
    wall0, cpu0 = time.perf_counter(), benchlib.proc_cpu_seconds() or 0.0
    with tempfile.TemporaryDirectory(prefix="neardup-bench-scale-") as tmp:
        state = Path(tmp) / "state"
        with closing(RocksDBStateStore(state, settings.state_shape())) as store:
            detector = Detector(settings, store)
            while done < args.docs:
                g0 = time.perf_counter()
                batch = [Document(i, t) for i, t in
                         (next(stream) for _ in range(min(args.batch_size, args.docs - done)))]
                t0 = time.perf_counter()
                result = detector.detect(batch)
                store.commit(result.update)
                t1 = time.perf_counter()
                gen_s += t0 - g0
                engine_s += t1 - t0
                dups = cands = 0
                for r in result.results:
                    if isinstance(r, Verdict):
                        dups += r.is_duplicate
                        cands += r.candidates
                    else:
                        rejects += 1
                candidates += cands
                done += len(batch)
                dups_total += dups
                window.append((len(batch), t1 - t0, dups, cands))
                in_window += len(batch)
                while in_window - window[0][0] >= args.window:
                    in_window -= window.popleft()[0]
                w_docs = sum(b[0] for b in window)
                w_secs = sum(b[1] for b in window)
                w_dups = sum(b[2] for b in window)
                w_cands = sum(b[3] for b in window)
                if done % args.progress_every < len(batch) or done == args.docs:
                    emit("progress", documents=done, window_docs_per_second=w_docs / w_secs,
                         cumulative_docs_per_second=done / engine_s, rss_mb=benchlib.proc_status_mb().get("VmRSS"),
                         elapsed_seconds=time.perf_counter() - wall0)
                if next_cp < len(checkpoints) and done >= checkpoints[next_cp]:
                    next_cp += 1
                    status = benchlib.proc_status_mb()
                    try:
                        stats = store.stats()
                    except Exception:  # the store API may change under the benchmark
                        stats = {}
                    emit("checkpoint", documents=done, window_documents=w_docs, window_seconds=w_secs,
                         window_docs_per_second=w_docs / w_secs, window_duplicates=w_dups,
                         cumulative_docs_per_second=done / engine_s, engine_seconds=engine_s,
                         generation_seconds=gen_s, elapsed_seconds=time.perf_counter() - wall0,
                         duplicates=dups_total, rejects=rejects, mean_candidates=candidates / max(1, done - rejects),
                         window_mean_candidates=w_cands / w_docs,
                         cpu_seconds=(benchlib.proc_cpu_seconds() or 0.0) - cpu0, loadavg=os.getloadavg()[0],
                         peak_rss_mb=_mb_maxrss(), rss_mb=status.get("VmRSS"), vmhwm_mb=status.get("VmHWM"),
                         state_mb=benchlib.dir_bytes(state) / 1e6,
                         memtable_mb=(stats.get("memtable_bytes") or 0) / 1e6,
                         set_cache_hits=stats.get("set_cache_hits"), set_cache_misses=stats.get("set_cache_misses"))
            if args.paired:
                emit("paired", **paired(args, settings, base, detector, stream, Path(tmp) / "small"))
    emit("end", git_end=benchlib.git_state())


def paired(args: argparse.Namespace, settings: object, base: benchlib.Corpus, large: object,
           large_stream: Iterator[tuple[str, str]], path: Path) -> dict[str, object]:
    """Rates at two index sizes measured interleaved, so that the machine's drift (10 to
    30% between runs of the same code) falls on both alike: a second store is filled with
    the stream's first ``--paired-base`` documents, then batches go alternately to it and
    to the large one (which order first alternates too), ``--paired`` documents each."""
    from neardup.core.types import Document
    from neardup.detector import Detector
    from neardup.state.rocksdb import RocksDBStateStore

    small_stream = benchlib.replay_stream(base, args.paired_base + args.paired, args.worker, args.seed)
    seconds = {"small": 0.0, "large": 0.0}
    with closing(RocksDBStateStore(path, settings.state_shape())) as store:  # type: ignore[attr-defined]
        small = Detector(settings, store)  # type: ignore[arg-type]

        def run(detector: Detector, stream: Iterator[tuple[str, str]], n: int) -> float:
            batch = [Document(i, t) for i, t in (next(stream) for _ in range(n))]
            t0 = time.perf_counter()
            detector.store.commit(detector.detect(batch).update)
            return time.perf_counter() - t0

        for start in range(0, args.paired_base, args.batch_size):
            run(small, small_stream, min(args.batch_size, args.paired_base - start))
        for k, start in enumerate(range(0, args.paired, args.batch_size)):
            n = min(args.batch_size, args.paired - start)
            order = (("small", small, small_stream), ("large", large, large_stream))
            for name, detector, stream in order if k % 2 == 0 else order[::-1]:
                seconds[name] += run(detector, stream, n)  # type: ignore[arg-type]
    return {"small_documents": args.paired_base, "large_documents": args.docs, "documents": args.paired,
            "small_docs_per_second": args.paired / seconds["small"],
            "large_docs_per_second": args.paired / seconds["large"],
            "ratio": seconds["small"] / seconds["large"]}
    return 0


def run_variant(args: argparse.Namespace, variant: str) -> dict[str, object]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", variant, "--docs", str(args.docs),
           "--corpus", str(args.corpus), "--batch-size", str(args.batch_size), "--window", str(args.window),
           "--seed", str(args.seed), "--progress-every", str(args.progress_every),
           "--checkpoints", ",".join(map(str, args.checkpoints))]
    if args.max_candidates:
        cmd += ["--max-candidates", str(args.max_candidates)]
    cmd += ["--paired", str(args.paired), "--paired-base", str(args.paired_base)]
    out: dict[str, object] = {"variant": variant, "checkpoints": []}
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            event = json.loads(line)
            kind = event.pop("event")
            if kind == "start":
                out.update(event)
                print(f"[{variant}] worker pid {proc.pid}: neardup at {benchlib.describe_git(event['git'])}; "
                      f"RSS before engine {event['rss_before_engine_mb']:.0f} MB", file=sys.stderr, flush=True)
            elif kind == "progress":
                print(f"[{variant}] {event['documents']:>9,} docs  window {event['window_docs_per_second']:>6,.0f} docs/s  "
                      f"cumulative {event['cumulative_docs_per_second']:>6,.0f} docs/s  RSS {event['rss_mb']:,.0f} MB  "
                      f"{event['elapsed_seconds']:,.0f} s", file=sys.stderr, flush=True)
            elif kind == "checkpoint":
                out["checkpoints"].append(event)  # type: ignore[union-attr]
            elif kind == "paired":
                out["paired"] = event
            elif kind == "end":
                out.update(event)
        rc = proc.wait()
    if rc != 0:
        raise RuntimeError(f"worker for {variant} exited with {rc}")
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    default = benchlib.default_corpus()
    p.add_argument("--corpus", type=Path, default=default, help=f"JSONL.gz with id and text (default {default})")
    p.add_argument("--docs", type=int, default=1_000_000, help="documents to index (default 1,000,000)")
    p.add_argument("--variants", default="light,heavy", help="comma list of light, heavy (default both)")
    p.add_argument("--checkpoints", type=lambda s: [int(x) for x in s.split(",") if x],
                   default=list(DEFAULT_CHECKPOINTS), help="index sizes to report at (default 100000,200000,500000,1000000)")
    p.add_argument("--window", type=int, default=20_000, help="documents before a checkpoint its docs/s is measured on (default 20,000)")
    p.add_argument("--batch-size", type=int, default=benchlib.BATCH_SIZE, help="documents per batch (default 1000)")
    p.add_argument("--seed", type=int, default=1, help="seed of the edits (default 1)")
    p.add_argument("--progress-every", type=int, default=50_000, help="progress line every N documents (default 50,000)")
    p.add_argument("--json", type=Path, help="also write the numbers as JSON here")
    p.add_argument("--max-candidates", type=int, help="EngineSettings.max_candidates (default: the engine's)")
    p.add_argument("--paired", type=int, default=20_000,
                   help="documents measured interleaved at the last size and at --paired-base (default 20,000; 0: none)")
    p.add_argument("--paired-base", type=int, default=100_000,
                   help="the small index size of the interleaved measurement (default 100,000)")
    p.add_argument("--worker", choices=["light", "heavy"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if min(args.docs, args.window, args.batch_size, args.progress_every) < 1:
        p.error("--docs, --window, --batch-size and --progress-every must be at least 1")
    bad = set(args.variants.split(",")) - {"light", "heavy"}
    if bad:
        p.error(f"unknown variant(s) {', '.join(sorted(bad))}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    env = benchlib.environment()
    variants = [v for v in args.variants.split(",") if v]
    print(f"scale: {args.docs:,} documents per variant ({', '.join(variants)}), batches of {args.batch_size}, "
          f"window {args.window:,}; load average at start {env['loadavg']}", flush=True)
    runs = [run_variant(args, v) for v in variants]

    rows = []
    for run in runs:
        for cp in run["checkpoints"]:  # type: ignore[union-attr]
            rows.append([run["variant"], f"{cp['documents']:,}", f"{cp['window_docs_per_second']:,.0f}",
                         f"{cp['cumulative_docs_per_second']:,.0f}",
                         f"{100 * cp['window_duplicates'] / cp['window_documents']:.1f}%",
                         f"{cp['window_mean_candidates']:.1f}", f"{cp['peak_rss_mb']:,.0f}", f"{cp['rss_mb']:,.0f}",
                         f"{cp['state_mb']:,.0f}", f"{cp['engine_seconds']:,.0f}",
                         f"{100 * cp['cpu_seconds'] / cp['elapsed_seconds']:.0f}%", f"{cp['loadavg']:.2f}"])
    print()
    for run in runs:
        print(f"{run['variant']}: neardup at {benchlib.describe_git(run['git'])}; "  # type: ignore[arg-type]
              f"LSH {run['lsh'][0]}x{run['lsh'][1]}, verify {run['verify']}, max bucket {run['max_bucket_size']}; "  # type: ignore[index]
              f"RSS before engine {run['rss_before_engine_mb']:.0f} MB")
        if run.get("git_end", run["git"])["src_digest"] != run["git"]["src_digest"]:  # type: ignore[index]
            print("  note: src/ changed during this run; the worker used the code it imported at its start")
    print(benchlib.table(
        ["variant", "indexed", "window docs/s", "cumul. docs/s", "dup share", "cand/doc", "peak RSS MB",
         "RSS now MB", "state MB", "engine s", "CPU/wall", "load"], rows))
    print(f"(window docs/s: the {args.window:,} documents before the checkpoint; cand/doc: mean candidates (earlier "
          "documents in its buckets) checked per document of the window; peak RSS: ru_maxrss of the worker process; MB = 1e6 bytes; CPU/wall: the worker's CPU "
          "seconds over its elapsed time so far (RocksDB threads included); load: 1-minute load average)")
    ratios = {}
    for run in runs:
        cps = run["checkpoints"]
        if len(cps) > 1:  # type: ignore[arg-type]
            first, last = cps[0], cps[-1]  # type: ignore[index]
            ratio = last["window_docs_per_second"] / first["window_docs_per_second"]
            ratios[run["variant"]] = round(ratio, 3)
            print(f"{run['variant']}: window docs/s at {last['documents']:,} / at {first['documents']:,} = {ratio:.2f}; "
                  f"peak RSS at {last['documents']:,}: {last['peak_rss_mb']:,.0f} MB")
        pair = run.get("paired")
        if pair:
            print(f"{run['variant']}: interleaved, {pair['documents']:,} documents each: "  # type: ignore[index]
                  f"{pair['large_docs_per_second']:,.0f} docs/s at {pair['large_documents']:,} and "  # type: ignore[index]
                  f"{pair['small_docs_per_second']:,.0f} at {pair['small_documents']:,} indexed: "  # type: ignore[index]
                  f"ratio {pair['ratio']:.2f}")  # type: ignore[index]
    if args.json:
        report = {"benchmark": "scale", "docs": args.docs, "window": args.window, "batch_size": args.batch_size,
                  "seed": args.seed, "corpus": str(args.corpus), "runs": runs,
                  "window_docs_per_second_last_over_first": ratios,
                  "environment": {**env, "loadavg_end": benchlib.environment()["loadavg"]}}
        benchlib.write_json(args.json, report)
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
