"""Engine throughput: neardup next to datasketch and rensa on the Reuters-21578 corpus.

What is measured, in one process, on the same records (JSONL ``id`` and ``text``):

1. **neardup**: ``neardup.embedded.dedup_files`` with the default ``EngineSettings`` (word
   5-grams, 128 permutations, threshold 0.8, optimal banding), a fresh RocksDB state
   directory and real output files: what ``neardup dedup`` runs. The time is wall clock
   around the call, so it includes gunzipping and parsing the JSONL, writing
   ``unique.jsonl``/``duplicates.jsonl``/``rejects.jsonl`` and the RocksDB writes. With an
   engine that has ``neardup.pipeline`` (dedup's default), the next batch is prepared in a
   second process meanwhile, so this time can use two cores.
2. **datasketch**: the same text normalisation (``neardup.core.normalize.normalize``), word
   5-grams of ``re.findall(r"\\w+")`` joined by spaces and encoded to UTF-8 (a text of
   fewer than 5 tokens gives one shingle of all its tokens, as in neardup),
   ``MinHash(num_perm=128).update_batch`` and an in-memory ``MinHashLSH(threshold=0.8)``.
3. **rensa** (if installed): the same shingle strings, ``RMinHash(128, seed)`` and an
   in-memory ``RMinHashLSH(threshold=0.8, num_perm=128, num_bands=16)``.

For the references the texts are already in memory; their time covers normalisation, the
Python shingling, MinHash and LSH. Each document is queried, then inserted; it is a
duplicate if any candidate returned by the query (an earlier document) has an estimated
Jaccard similarity (``jaccard`` of the two sketches) of at least the threshold (neardup's
rule with ``verify="estimate"``; its default decides on the exact Jaccard of the stored
shingle fingerprints). A text without any word token gets no verdict from any tool.

MB is the UTF-8 size of the text fields / 1e6. Each tool runs ``--repeat`` times; the
fastest run is kept. The agreement lines compare the sets of document ids each tool flags
as duplicates.

The stage breakdown re-runs neardup's engine directly (batches of 1000, a fresh RocksDB
store; the fastest of ``--repeat`` runs) and times each stage on the same batch:
``normalize``, ``shingle_batch``, the detector's hasher's ``signatures`` (classic MinHash
or one-permutation hashing, whichever the settings choose), ``band_hashes``, then
``Detector.detect`` + ``commit`` whole; "rest of detect + commit" is that whole minus the
four stages (bucket look-ups, candidate checks, union-find, the RocksDB write). Two more
lines come from the kept ``dedup_files`` run itself (its ``on_batch`` hook): the time inside
its batches (detect, output writing, commit) and the time outside them (gunzipping and
parsing the JSONL, opening and closing the store, and waiting for the pipeline's worker).

The shared pieces (corpus loading, the reference implementations) live in
``benchlib.py``; ``throughput.py`` measures the same tools on a larger replayed stream.

Usage: python benchmarks/engine.py [--corpus PATH] [--json OUT] [--limit N] [--repeat K]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import closing
from pathlib import Path

import numpy as np

from neardup.core.lsh import band_hashes
from neardup.core.normalize import normalize
from neardup.core.settings import EngineSettings
from neardup.core.shingle import shingle_batch
from neardup.core.types import Document
from neardup.detector import Detector
from neardup.embedded import dedup_files
from neardup.state.rocksdb import RocksDBStateStore

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import (  # noqa: E402  (this folder on sys.path first)
    BATCH_SIZE,
    ID_FIELD,
    TEXT_FIELD,
    Corpus,
    Result,
    agreement,
    default_corpus,
    load_corpus,
    run_datasketch,
    run_rensa,
)
from benchlib import package_version as _version  # noqa: E402


# --- the tools ---------------------------------------------------------------------------


def run_neardup(corpus: Corpus, settings: EngineSettings) -> Result:
    """``dedup_files`` end to end, into a fresh state directory and output directory."""
    with tempfile.TemporaryDirectory(prefix="neardup-bench-") as tmp:
        out_dir, state_dir = Path(tmp) / "out", Path(tmp) / "state"
        batch_times: list[float] = []
        started = time.perf_counter()
        summary = dedup_files(
            [str(corpus.path)],
            settings,
            out_dir=out_dir,
            text_fields=[TEXT_FIELD],
            id_field=ID_FIELD,
            state_dir=state_dir,
            progress=False,
            on_batch=lambda _results, seconds: batch_times.append(seconds),
        )
        seconds = time.perf_counter() - started
        with open(out_dir / "duplicates.jsonl", encoding="utf-8") as f:
            duplicate_ids = {str(json.loads(line)[ID_FIELD]) for line in f}
    assert summary.documents + summary.rejects == len(corpus), summary
    assert summary.duplicates == len(duplicate_ids), summary
    lsh = settings.bands
    return Result(
        tool="neardup",
        documents=len(corpus),
        megabytes=corpus.megabytes,
        seconds=seconds,
        duplicates=summary.duplicates,
        setup=f"dedup_files, RocksDB, {lsh.bands} bands x {lsh.rows} rows",
        duplicate_ids=duplicate_ids,
        batch_seconds=sum(batch_times),
    )


def best_of(repeat: int, run: Callable[[], Result]) -> Result:
    """The fastest of ``repeat`` runs."""
    return min((run() for _ in range(repeat)), key=lambda r: r.seconds)


# --- neardup stage breakdown -------------------------------------------------------------

STAGES = ("normalize", "shingle_batch", "signatures (detector.hasher)", "band_hashes")
REST = "rest of detect + commit"
DETECT = "total detect + commit"


def _batches(docs: Sequence[Document], size: int) -> Iterator[Sequence[Document]]:
    for start in range(0, len(docs), size):
        yield docs[start : start + size]


def stage_seconds(corpus: Corpus, settings: EngineSettings) -> dict[str, float]:
    """Seconds of each engine stage over the corpus (see the module docstring)."""
    docs = [Document(i, t) for i, t in zip(corpus.ids, corpus.texts)]
    seconds = dict.fromkeys((*STAGES, DETECT), 0.0)
    with tempfile.TemporaryDirectory(prefix="neardup-bench-stages-") as tmp:
        with closing(RocksDBStateStore(tmp, settings.state_shape())) as store:
            detector = Detector(settings, store)
            hasher = detector.hasher  # the engine's signature scheme, whichever it is
            for batch in _batches(docs, BATCH_SIZE):
                t0 = time.perf_counter()
                texts = [normalize(d.text, settings.norm) for d in batch]
                t1 = time.perf_counter()
                shingles = shingle_batch(texts, settings.shingling)
                t2 = time.perf_counter()
                signatures = hasher.signatures(shingles)[np.flatnonzero(shingles.counts > 0)]
                t3 = time.perf_counter()
                band_hashes(signatures, settings.bands)
                t4 = time.perf_counter()
                store.commit(detector.detect(batch).update)
                t5 = time.perf_counter()
                for stage, dt in zip((*STAGES, DETECT), (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)):
                    seconds[stage] += dt
    whole = seconds.pop(DETECT)
    seconds[REST] = whole - sum(seconds[s] for s in STAGES)
    seconds[DETECT] = whole
    return seconds


def stage_breakdown(corpus: Corpus, settings: EngineSettings, repeat: int, neardup: Result) -> dict[str, float]:
    """Microseconds per document: the fastest of ``repeat`` stage runs, then the split of
    the kept ``dedup_files`` run into time inside and outside its batches."""
    seconds = min((stage_seconds(corpus, settings) for _ in range(repeat)), key=lambda s: s[DETECT])
    assert neardup.batch_seconds is not None
    seconds["dedup_files: in batches (detect, outputs, commit)"] = neardup.batch_seconds
    seconds["dedup_files: outside batches (JSONL in, store open/close)"] = neardup.seconds - neardup.batch_seconds
    seconds["dedup_files: end to end"] = neardup.seconds
    return {stage: s / len(corpus) * 1e6 for stage, s in seconds.items()}


# --- report ------------------------------------------------------------------------------


def render_table(results: list[Result]) -> str:
    base = results[0]
    head = f"{'tool':<11} {'documents':>9} {'seconds':>8} {'docs/s':>8} {'MB/s':>6} {'duplicates':>10} {'neardup x':>9}"
    lines = [head, "-" * len(head)]
    for r in results:
        lines.append(
            f"{r.tool:<11} {r.documents:>9,} {r.seconds:>8.2f} {r.docs_per_second:>8,.0f} "
            f"{r.mb_per_second:>6.2f} {r.duplicates:>10,} {base.docs_per_second / r.docs_per_second:>9.2f}"
        )
    return "\n".join(lines)


def render_stages(stages: dict[str, float]) -> str:
    width = max(map(len, stages))
    return "\n".join(f"  {name:<{width}} {us:>9.1f} us/doc" for name, us in stages.items())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default = default_corpus()
    p.add_argument("--corpus", type=Path, default=default, help=f"JSONL.gz with id and text (default {default})")
    p.add_argument("--json", type=Path, help="also write the numbers as JSON here")
    p.add_argument("--limit", type=int, help="only the first N records")
    p.add_argument("--repeat", type=int, default=1, help="runs per tool; the fastest is kept (default 1)")
    args = p.parse_args(argv)
    if args.repeat < 1 or (args.limit is not None and args.limit < 1):
        p.error("--repeat and --limit must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    settings = EngineSettings()
    tools: list[Callable[[Corpus, EngineSettings], Result]] = [run_neardup, run_datasketch]
    if _version("rensa"):
        tools.append(run_rensa)
    else:
        print("rensa not installed: skipped", file=sys.stderr)

    with tempfile.TemporaryDirectory(prefix="neardup-bench-corpus-") as scratch:
        corpus = load_corpus(args.corpus, args.limit, Path(scratch))
        print(f"corpus {args.corpus}: {len(corpus):,} documents, {corpus.megabytes:.2f} MB of text")
        print(f"best of {args.repeat} run(s) per tool; threshold {settings.threshold}, "
              f"num_perm {settings.num_perm}, shingles {settings.shingling}\n")
        results = []
        for run in tools:
            results.append(best_of(args.repeat, lambda run=run: run(corpus, settings)))
        stages = stage_breakdown(corpus, settings, args.repeat, results[0])

    neardup = results[0]
    agreements = {r.tool: agreement(neardup, r) for r in results[1:]}
    print(render_table(results))
    print("(neardup x: neardup's documents/s over the tool's)")
    for r in results:
        print(f"  {r.tool:<11} {r.setup}")
    print("\nagreement of duplicate sets with neardup:")
    for tool, counts in agreements.items():
        print(f"  {tool:<11} both {counts['both']:,}, only neardup {counts['only_neardup']:,}, "
              f"only {tool} {counts[f'only_{tool}']:,}")
    print(f"\nneardup stages (batches of {BATCH_SIZE}, RocksDB; best of {args.repeat}):")
    print(render_stages(stages))

    if args.json:
        report = {
            "corpus": str(args.corpus),
            "documents": len(corpus),
            "megabytes": round(corpus.megabytes, 3),
            "repeat": args.repeat,
            "settings": {**settings.state_shape(), "threshold": settings.threshold},
            "results": [r.as_dict(neardup) for r in results],
            "agreement": agreements,
            "stages_us_per_document": {k: round(v, 2) for k, v in stages.items()},
            "environment": {
                "python": platform.python_version(),
                "machine": platform.machine(),
                "cpus": os.cpu_count(),
                **{p: _version(p) for p in ("neardup", "numpy", "rocksdict", "datasketch", "rensa")},
            },
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
