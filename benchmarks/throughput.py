"""Engine throughput on a replayed Reuters stream: neardup (RocksDB) next to datasketch and rensa.

The input: the Reuters-21578 corpus (21,578 stories, JSONL ``id`` and ``text``) replayed
``--rounds`` times (default 10, i.e. 215,780 documents), round 0 unchanged and every later
round with one seeded random light edit per story (fix a typo: two adjacent letters of a
word swapped; drop a word; or add a footer line), ids ``<id>~r<round>`` (see
``benchlib.replay_stream``). The whole stream is built in memory before any timing.

What is timed, in one process, on the same texts:

1. **neardup**: the engine as the consumers drive it: ``Detector(EngineSettings())`` over a
   ``RocksDBStateStore`` in a fresh temporary directory, batches of ``--batch-size`` (1000)
   documents, ``store.commit(detector.detect(batch).update)`` after every batch. Default
   settings: word 5-grams, 128 permutations, threshold 0.8 on the exact Jaccard of the
   stored shingle fingerprints, banding tuned for the candidate threshold, canonical
   cluster policy. docs/s is documents over the summed wall time of ``detect`` + ``commit``.
   **Per-stage time** comes from wrapping, in this process, the functions the detector
   calls (``neardup.detector.normalize``, ``.shingle_batch``, the ``signatures`` method of
   the detector's hasher class (``MinHasher`` or ``OnePermutationHasher``, whichever the
   default settings choose), ``neardup.detector.fingerprint_sets``, ``.band_hashes``,
   ``.bucket_ids``, the bucket index look-up ``BucketIndex.lookup``, the stored
   candidates each document can get ``neardup.detector.batch_candidates``, the reading of
   their sets ``Detector._sets``, the pass per document (candidates, verification,
   clustering, bucket joins) ``neardup.detector.decide_batch`` and naming ``Detector._name`` (ids read
   from the store, ``Verdict`` objects built)) with timers that keep each stage's
   *exclusive* time (a timed call inside another is subtracted from the outer one).
   "rest of detect" is ``detect`` minus the timed stages (the forest closure, local
   nodes, changed nodes, links). ``store.commit`` (the RocksDB write batch) is timed
   around the call. A stage
   the engine no longer calls under that name shows 0 calls and falls into "rest". The
   wrappers' own cost is estimated (calls x the measured cost of an empty wrapped call)
   and printed.
2. **datasketch**: for each document: neardup's ``normalize``, Python word 5-grams
   (``\\w+`` tokens joined by spaces, UTF-8; a text of fewer than 5 tokens is one shingle),
   ``MinHash(num_perm=128).update_batch``, then an in-memory ``MinHashLSH(threshold=0.8)``
   ``query`` followed by ``insert``. A document is a duplicate when a candidate's estimated
   Jaccard (``MinHash.jaccard``) is at least 0.8.
3. **rensa** (if installed): the same shingle strings, ``RMinHash(128, seed)``,
   in-memory ``RMinHashLSH(threshold=0.8, num_perm=128, num_bands=16)``, same rule.

The references' time covers everything from the text in memory to the verdict, their
Python shingling included (``benchlib.run_datasketch``/``run_rensa``, shared with
``engine.py``). They keep everything in memory; neardup persists every batch to RocksDB.
With ``--reference-docs P`` the references run on the first P documents only (rounded up
to whole neardup batches) and the ratios compare them with neardup's time on the same
first P documents (from its per-batch times); the output says so. MB is the UTF-8 size
of the texts / 1e6. The duplicate counts differ by design (neardup verifies exactly,
the references by the MinHash estimate and their own banding); the agreement lines
compare the duplicate id sets.

Usage: python benchmarks/throughput.py [--rounds 10] [--reference-docs N] [--json OUT]
"""

from __future__ import annotations

import argparse
import functools
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import neardup.detector
import neardup.state.codec
import neardup.state.index
from neardup.core.settings import EngineSettings
from neardup.core.types import Document, Verdict
from neardup.detector import Detector
from neardup.state.rocksdb import RocksDBStateStore

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402
from benchlib import Corpus, Result  # noqa: E402

#: (object, attribute, stage label): the functions the detector calls, wrapped for timing.
STAGE_TARGETS: list[tuple[Any, str, str]] = [
    (neardup.detector, "normalize", "normalize"),
    (neardup.detector, "shingle_batch", "shingle_batch"),
    # plus the ``signatures`` method of the detector's hasher class (added in run_neardup)
    (neardup.detector, "fingerprint_sets", "fingerprint_sets"),
    (neardup.detector, "band_hashes", "band_hashes"),
    (neardup.detector, "bucket_ids", "bucket_ids"),
    (neardup.state.index.BucketIndex, "lookup", "BucketIndex.lookup"),
    (neardup.detector, "batch_candidates", "stored candidates (pass 1)"),
    (neardup.detector.Detector, "_sets", "stored sets (multi-get)"),
    (neardup.detector, "decide_batch", "decide_batch (one pass)"),
    (neardup.detector.Detector, "_name", "naming"),
]
REST = "rest of detect"
COMMIT = "store.commit"


class StageTimer:
    """Exclusive wall time and call count per label of wrapped functions."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: Counter[str] = Counter()
        self._children: list[float] = []

    def wrap(self, label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            self._children.append(0.0)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                self.seconds[label] += dt - self._children.pop()
                self.calls[label] += 1
                if self._children:
                    self._children[-1] += dt

        return timed

    def overhead_per_call(self, calls: int = 200_000) -> float:
        """Seconds an empty wrapped call costs beyond an empty plain call."""
        probe = StageTimer()
        plain = lambda: None  # noqa: E731
        wrapped = probe.wrap("probe", plain)
        t0 = time.perf_counter()
        for _ in range(calls):
            plain()
        t1 = time.perf_counter()
        for _ in range(calls):
            wrapped()
        t2 = time.perf_counter()
        return max(0.0, ((t2 - t1) - (t1 - t0)) / calls)


@contextmanager
def instrumented(timer: StageTimer, targets: list[tuple[Any, str, str]]) -> Iterator[list[str]]:
    """Wrap the ``targets`` present; yields the labels of the missing ones."""
    saved, missing = [], []
    for owner, name, label in targets:
        fn = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name, None)
        if fn is None or not callable(fn):
            missing.append(label)
            continue
        saved.append((owner, name, fn))
        setattr(owner, name, timer.wrap(label, fn))
    try:
        yield missing
    finally:
        for owner, name, fn in reversed(saved):
            setattr(owner, name, fn)


@dataclass
class NeardupRun:
    documents: int
    megabytes: float
    detect_seconds: float
    commit_seconds: float
    duplicates: int
    rejects: int
    setup: str
    stage_seconds: dict[str, float]
    stage_calls: dict[str, int]
    missing_stages: list[str]
    overhead_seconds: float
    doc_seconds: np.ndarray = field(repr=False)  # engine seconds per document (batch time / batch size)
    is_duplicate: np.ndarray = field(repr=False)  # bool per document

    @property
    def seconds(self) -> float:
        return self.detect_seconds + self.commit_seconds

    def prefix(self, stream: Corpus, n: int) -> Result:
        """The run cut to the first ``n`` documents of ``stream`` (whole batches, or all)."""
        part = stream if n == len(stream) else stream.head(n)
        return Result(
            tool="neardup",
            documents=n,
            megabytes=part.megabytes,
            seconds=float(self.doc_seconds[:n].sum()),
            duplicates=int(self.is_duplicate[:n].sum()),
            setup=self.setup,
            duplicate_ids={part.ids[i] for i in np.flatnonzero(self.is_duplicate[:n])},
        )


def run_neardup(stream: Corpus, settings: EngineSettings, batch_size: int) -> NeardupRun:
    docs = [Document(i, t) for i, t in zip(stream.ids, stream.texts)]
    timer = StageTimer()
    doc_seconds = np.zeros(len(docs))
    is_dup = np.zeros(len(docs), dtype=bool)
    lsh = settings.bands
    with tempfile.TemporaryDirectory(prefix="neardup-bench-throughput-") as tmp, \
            closing(RocksDBStateStore(tmp, settings.state_shape())) as store:
        detector = Detector(settings, store)
        hasher = type(detector.hasher)
        targets = STAGE_TARGETS[:2] + [(hasher, "signatures", f"{hasher.__name__}.signatures")] + STAGE_TARGETS[2:]
        with instrumented(timer, targets) as missing:
            detect_s, commit_s, rejects = run_batches(detector, store, docs, batch_size, doc_seconds, is_dup)
    stages = {label: timer.seconds.get(label, 0.0) for _, _, label in targets}
    calls = {label: timer.calls.get(label, 0) for _, _, label in targets}
    stages[REST] = detect_s - sum(stages.values())
    stages[COMMIT] = commit_s
    return NeardupRun(
        documents=len(docs),
        megabytes=stream.megabytes,
        detect_seconds=detect_s,
        commit_seconds=commit_s,
        duplicates=int(is_dup.sum()),
        rejects=rejects,
        setup=(f"Detector + RocksDBStateStore, batches of {batch_size}, commit each; {getattr(settings, 'minhash', 'classic')} MinHash, "
               f"{lsh.bands} bands x {lsh.rows} rows, verify {settings.verify}"),
        stage_seconds=stages,
        stage_calls=dict(calls),
        missing_stages=missing,
        overhead_seconds=timer.overhead_per_call() * sum(calls.values()),
        doc_seconds=doc_seconds,
        is_duplicate=is_dup,
    )


def run_batches(detector: Detector, store: RocksDBStateStore, docs: list[Document], batch_size: int,
                doc_seconds: np.ndarray, is_dup: np.ndarray) -> tuple[float, float, int]:
    """detect + commit batch after batch, filling the per-document arrays; returns
    (detect seconds, commit seconds, rejected documents)."""
    detect_s = commit_s = 0.0
    rejects = 0
    for start in range(0, len(docs), batch_size):
        batch = docs[start : start + batch_size]
        t0 = time.perf_counter()
        result = detector.detect(batch)
        t1 = time.perf_counter()
        store.commit(result.update)
        t2 = time.perf_counter()
        detect_s += t1 - t0
        commit_s += t2 - t1
        doc_seconds[start : start + len(batch)] = (t2 - t0) / len(batch)
        for k, r in enumerate(result.results):
            if isinstance(r, Verdict):
                if r.is_duplicate:
                    is_dup[start + k] = True
            else:
                rejects += 1
        if (start // batch_size) % 20 == 19:
            done = start + len(batch)
            print(f"  neardup: {done:,} documents, {done / (detect_s + commit_s):,.0f} docs/s so far",
                  file=sys.stderr, flush=True)
    return detect_s, commit_s, rejects


def run_neardup_pipelined(stream: Corpus, settings: EngineSettings, batch_size: int) -> tuple[Result, np.ndarray] | None:
    """The same engine with ``neardup.pipeline.prepared_ahead``: the next batch prepared in
    a worker process while this one is detected and committed; None if the engine has no
    pipeline. Wall time of the whole loop (worker start included); not instrumented."""
    try:
        from neardup.pipeline import PrepareTexts, prepared_ahead
    except ImportError:
        return None
    docs = [Document(i, t) for i, t in zip(stream.ids, stream.texts)]
    batches = [docs[i : i + batch_size] for i in range(0, len(docs), batch_size)]
    is_dup = np.zeros(len(docs), dtype=bool)
    with tempfile.TemporaryDirectory(prefix="neardup-bench-throughput-") as tmp, \
            closing(RocksDBStateStore(tmp, settings.state_shape())) as store:
        detector = Detector(settings, store)
        start = 0
        t0 = time.perf_counter()
        for batch, prepared in prepared_ahead(batches, PrepareTexts(), settings, True):
            result = detector.detect(batch, prepared)
            store.commit(result.update)
            for k, r in enumerate(result.results):
                if isinstance(r, Verdict) and r.is_duplicate:
                    is_dup[start + k] = True
            start += len(batch)
        seconds = time.perf_counter() - t0
    return Result(
        tool="neardup pipelined",
        documents=len(docs),
        megabytes=stream.megabytes,
        seconds=seconds,
        duplicates=int(is_dup.sum()),
        setup="as neardup, with neardup.pipeline.prepared_ahead (2 processes: prepare k+1 while k is detected "
              "and committed); wall time including the worker's start",
    ), is_dup


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    default = benchlib.default_corpus()
    p.add_argument("--corpus", type=Path, default=default, help=f"JSONL.gz with id and text (default {default})")
    p.add_argument("--rounds", type=int, default=10, help="times the corpus is replayed (default 10: 215,780 documents)")
    p.add_argument("--docs", type=int, help="total documents instead of whole rounds")
    p.add_argument("--reference-docs", type=int, help="run datasketch and rensa on the first N documents only (default all)")
    p.add_argument("--references", default="datasketch,rensa", help="comma list of references, or 'none' (default datasketch,rensa)")
    p.add_argument("--batch-size", type=int, default=benchlib.BATCH_SIZE, help="neardup batch size (default 1000)")
    p.add_argument("--edits", choices=["light", "heavy"], default="light", help="edits on replays (default light)")
    p.add_argument("--seed", type=int, default=1, help="seed of the edits (default 1)")
    p.add_argument("--pipelined", action=argparse.BooleanOptionalAction, default=True,
                   help="also run neardup with its pipeline (neardup.pipeline, 2 processes) if the engine has one (default on)")
    p.add_argument("--json", type=Path, help="also write the numbers as JSON here")
    args = p.parse_args(argv)
    if args.rounds < 1 or (args.docs is not None and args.docs < 1) or args.batch_size < 1:
        p.error("--rounds, --docs and --batch-size must be at least 1")
    if args.reference_docs is not None and args.reference_docs < 1:
        p.error("--reference-docs must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    settings = EngineSettings()
    git = benchlib.git_state()
    env = benchlib.environment()
    base = benchlib.load_corpus(args.corpus)
    total = args.docs or args.rounds * len(base)
    t0 = time.perf_counter()
    stream = benchlib.replay_corpus(base, total, args.edits, args.seed)
    build_s = time.perf_counter() - t0
    refs = [r for r in args.references.split(",") if r and r != "none"]
    if "rensa" in refs and not benchlib.package_version("rensa"):
        print("rensa not installed: skipped", file=sys.stderr)
        refs.remove("rensa")
    ref_docs = total if args.reference_docs is None else min(total, args.reference_docs)
    if ref_docs < total:  # whole neardup batches, so that neardup's time on them is exact
        ref_docs = min(total, -(-ref_docs // args.batch_size) * args.batch_size)

    print(f"neardup at {benchlib.describe_git(git)}")
    print(f"corpus {args.corpus}: {len(base):,} stories replayed to {total:,} documents "
          f"({total / len(base):.2f} rounds, {args.edits} edits, seed {args.seed}), "
          f"{stream.megabytes:.1f} MB of text; built in {build_s:.1f} s (not timed)")
    print(f"settings: threshold {settings.threshold}, num_perm {settings.num_perm}, shingles {settings.shingling}, "
          f"verify {settings.verify}, banding {settings.bands.bands}x{settings.bands.rows}; "
          f"load average at start {env['loadavg']}\n")

    print("running neardup ...", file=sys.stderr, flush=True)
    cpu = {}
    c0, w0 = time.process_time(), time.perf_counter()
    nd = run_neardup(stream, settings, args.batch_size)
    cpu["neardup"] = (time.process_time() - c0) / (time.perf_counter() - w0)
    piped = None
    if args.pipelined:
        print("running neardup pipelined ...", file=sys.stderr, flush=True)
        c0, w0 = time.process_time(), time.perf_counter()
        piped = run_neardup_pipelined(stream, settings, args.batch_size)
        cpu["neardup pipelined (main process)"] = (time.process_time() - c0) / (time.perf_counter() - w0)
    ref_corpus = stream if ref_docs == total else stream.head(ref_docs)
    results: list[Result] = []
    runners = {"datasketch": benchlib.run_datasketch, "rensa": benchlib.run_rensa}
    for name in refs:
        print(f"running {name} on {ref_docs:,} documents ...", file=sys.stderr, flush=True)
        c0, w0 = time.process_time(), time.perf_counter()
        results.append(runners[name](ref_corpus, settings))
        cpu[name] = (time.process_time() - c0) / (time.perf_counter() - w0)
    nd_full = nd.prefix(stream, total)
    nd_ref = nd.prefix(stream, ref_docs)
    nd_ref.tool = "neardup" if ref_docs == total else f"neardup (first {ref_docs:,})"

    # --- the tables ----------------------------------------------------------------------
    rows = []
    extra = [piped[0]] if piped else []
    for r in [nd_full] + extra + ([nd_ref] if ref_docs < total else []) + results:
        rows.append([r.tool, f"{r.documents:,}", f"{r.seconds:.1f}", f"{r.docs_per_second:,.0f}",
                     f"{r.mb_per_second:.2f}", f"{r.duplicates:,}", f"{100 * r.duplicates / r.documents:.1f}%"])
    print(benchlib.table(["tool", "documents", "seconds", "docs/s", "MB/s", "duplicates", "dup share"], rows))
    if ref_docs < total:
        print(f"(references ran on the first {ref_docs:,} of {total:,} documents, --reference-docs; "
              f"ratios below use neardup's time on those same documents)")
    ratios = {}
    for r in results:
        ratio = nd_ref.docs_per_second / r.docs_per_second
        ratios[r.tool] = round(ratio, 3)
        print(f"neardup/{r.tool} docs/s: {ratio:.2f}  ({nd_ref.docs_per_second:,.0f} / {r.docs_per_second:,.0f})")
    piped_ratios = {}
    if piped and ref_docs == total:  # the pipelined run is timed as a whole only
        for r in results:
            ratio = piped[0].docs_per_second / r.docs_per_second
            piped_ratios[r.tool] = round(ratio, 3)
            print(f"neardup pipelined/{r.tool} docs/s: {ratio:.2f}  "
                  f"({piped[0].docs_per_second:,.0f} / {r.docs_per_second:,.0f})")
    if piped:
        same = bool(np.array_equal(piped[1], nd.is_duplicate))
        print(f"neardup pipelined / neardup docs/s: {piped[0].docs_per_second / nd_full.docs_per_second:.2f} "
              f"(same {total:,} documents); verdicts identical: {'yes' if same else 'NO'}")
    print("setups:")
    print(f"  neardup     {nd.setup}")
    if piped:
        print(f"  neardup pipelined  {piped[0].setup}")
    for r in results:
        print(f"  {r.tool:<11} {r.setup}; Python shingling included")
    agreements = {}
    if results:
        print("agreement of duplicate sets with neardup (same documents):")
        for r in results:
            a = benchlib.agreement(Result("neardup", 0, 0, 1, 0, "", nd_ref.duplicate_ids), r)
            agreements[r.tool] = a
            print(f"  {r.tool:<11} both {a['both']:,}, only neardup {a['only_neardup']:,}, "
                  f"only {r.tool} {a[f'only_{r.tool}']:,}")

    n = nd.documents
    print(f"\nneardup stages over {n:,} documents (exclusive wall time; batches of {args.batch_size}):")
    stage_rows = []
    for label, s in nd.stage_seconds.items():
        calls = nd.stage_calls.get(label)
        note = "" if calls is None else f"{calls:,}"
        if label in nd.missing_stages:
            note = "not in this engine"
        elif calls == 0:
            note = "0 (not called)"
        stage_rows.append([label, f"{s:.2f}", f"{s / n * 1e6:.1f}", f"{100 * s / nd.seconds:.1f}%", note])
    stage_rows.append(["total detect + commit", f"{nd.seconds:.2f}", f"{nd.seconds / n * 1e6:.1f}", "100.0%", ""])
    print(benchlib.table(["stage", "seconds", "us/doc", "share", "calls"], stage_rows))
    print(f"(timer overhead, estimated: {nd.overhead_seconds / n * 1e6:.2f} us/doc, inside the stages; "
          f"rejected documents: {nd.rejects})")

    rounds = max(1, -(-n // len(base)))
    round_rows, per_round = [], []
    for r in range(rounds):
        lo, hi = r * len(base), min(n, (r + 1) * len(base))
        secs = float(nd.doc_seconds[lo:hi].sum())
        dups = int(nd.is_duplicate[lo:hi].sum())
        per_round.append({"round": r, "documents": hi - lo, "seconds": round(secs, 3),
                          "documents_per_second": round((hi - lo) / secs, 1), "duplicates": dups})
        round_rows.append([r, f"{hi - lo:,}", f"{secs:.1f}", f"{(hi - lo) / secs:,.0f}", f"{dups:,}"])
    print("\nneardup by round (index grows; a batch's time is shared evenly by its documents):")
    print(benchlib.table(["round", "documents", "seconds", "docs/s", "duplicates"], round_rows))
    load_end = benchlib.environment()["loadavg"]
    print("\nprocess CPU / wall while each tool ran (RocksDB threads count too; well under 100%: "
          "the process waited or was starved): " + ", ".join(f"{k} {100 * v:.0f}%" for k, v in cpu.items())
          + f"; load average at start {env['loadavg']}, at end {load_end} ({env['cpus']} CPUs)")
    end_git = benchlib.git_state()
    if end_git["src_digest"] != git["src_digest"]:
        print(f"note: src/ changed during the run (now {benchlib.describe_git(end_git)}); "
              "the measurement used the code imported at the start")

    if args.json:
        report = {
            "benchmark": "throughput",
            "git": git,
            "corpus": str(args.corpus),
            "stream": {"base_documents": len(base), "documents": total, "edits": args.edits,
                       "seed": args.seed, "megabytes": round(stream.megabytes, 3)},
            "settings": {**settings.state_shape(), "threshold": settings.threshold},
            "batch_size": args.batch_size,
            "reference_documents": ref_docs,
            "results": [nd_full.as_dict()] + [r.as_dict() for r in extra]
                       + ([nd_ref.as_dict()] if ref_docs < total else [])
                       + [r.as_dict(nd_ref) for r in results],
            "neardup_over_reference_docs_per_second": ratios,
            "neardup_pipelined_over_reference_docs_per_second": piped_ratios,
            "pipelined_verdicts_identical": bool(np.array_equal(piped[1], nd.is_duplicate)) if piped else None,
            "agreement": agreements,
            "neardup": {"detect_seconds": round(nd.detect_seconds, 3), "commit_seconds": round(nd.commit_seconds, 3),
                        "rejects": nd.rejects, "setup": nd.setup},
            "stages_us_per_document": {k: round(v / n * 1e6, 2) for k, v in nd.stage_seconds.items()},
            "stage_calls": nd.stage_calls,
            "missing_stages": nd.missing_stages,
            "timer_overhead_us_per_document": round(nd.overhead_seconds / n * 1e6, 3),
            "by_round": per_round,
            "cpu_over_wall": {k: round(v, 3) for k, v in cpu.items()},
            "environment": {**env, "loadavg_end": load_end},
        }
        benchlib.write_json(args.json, report)
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
