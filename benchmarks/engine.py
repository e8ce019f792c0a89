"""Engine throughput: neardup next to datasketch and rensa on the Reuters-21578 corpus.

What is measured, in one process, on the same records (JSONL ``id`` and ``text``):

1. **neardup**: ``neardup.embedded.dedup_files`` with the default ``EngineSettings`` (word
   5-grams, 128 permutations, threshold 0.8, optimal banding), a fresh RocksDB state
   directory and real output files: what ``neardup dedup`` runs. The time is wall clock
   around the call, so it includes gunzipping and parsing the JSONL, writing
   ``unique.jsonl``/``duplicates.jsonl``/``rejects.jsonl`` and the RocksDB writes.
2. **datasketch**: the same text normalisation (``neardup.core.normalize.normalize``), word
   5-grams of ``re.findall(r"\\w+")`` joined by spaces and encoded to UTF-8 (a text of
   fewer than 5 tokens gives one shingle of all its tokens, as in neardup),
   ``MinHash(num_perm=128).update_batch`` and an in-memory ``MinHashLSH(threshold=0.8)``.
3. **rensa** (if installed): the same shingle strings, ``RMinHash(128, seed)`` and an
   in-memory ``RMinHashLSH(threshold=0.8, num_perm=128, num_bands=16)``.

For the references the texts are already in memory; their time covers normalisation, the
Python shingling, MinHash and LSH. Each document is queried, then inserted; it is a
duplicate if any candidate returned by the query (an earlier document) has an estimated
Jaccard similarity (``jaccard`` of the two sketches) of at least the threshold, which is
also neardup's rule. A text without any word token gets no verdict from any tool.

MB is the UTF-8 size of the text fields / 1e6. Each tool runs ``--repeat`` times; the
fastest run is kept. The agreement lines compare the sets of document ids each tool flags
as duplicates.

The stage breakdown re-runs neardup's engine directly (batches of 1000, a fresh RocksDB
store; the fastest of ``--repeat`` runs) and times each stage on the same batch:
``normalize``, ``shingle_batch``, ``MinHasher.signatures``, ``band_hashes``, then
``Detector.detect`` + ``commit`` whole; "rest of detect + commit" is that whole minus the
four stages (bucket look-ups, candidate checks, union-find, the RocksDB write). Two more
lines come from the kept ``dedup_files`` run itself (its ``on_batch`` hook): the time inside
its batches (detect, output writing, commit) and the time outside them (gunzipping and
parsing the JSONL, opening and closing the store).

Usage: python benchmarks/engine.py [--corpus PATH] [--json OUT] [--limit N] [--repeat K]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import re
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import closing
from dataclasses import dataclass, field
from functools import cached_property
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import numpy as np

from neardup.core.lsh import band_hashes
from neardup.core.minhash import MinHasher
from neardup.core.normalize import normalize
from neardup.core.settings import EngineSettings
from neardup.core.shingle import shingle_batch
from neardup.core.types import Document
from neardup.detector import Detector
from neardup.embedded import dedup_files
from neardup.records import record_id, record_text
from neardup.state.rocksdb import RocksDBStateStore

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CORPUS = REPO.parent / "shared" / "data" / "reuters21578" / "reuters21578.jsonl.gz"
FALLBACK_CORPUS = REPO / "tests" / "data" / "reuters_excerpt.jsonl.gz"
TEXT_FIELD, ID_FIELD = "text", "id"
BATCH_SIZE = 1000
RENSA_BANDS = 16
_WORD = re.compile(r"\w+")


@dataclass
class Corpus:
    """The records of a run. ``path`` is the file neardup reads (a cut copy with --limit)."""

    path: Path
    ids: list[str]
    texts: list[str]

    def __len__(self) -> int:
        return len(self.texts)

    @cached_property
    def megabytes(self) -> float:
        return sum(len(t.encode("utf-8")) for t in self.texts) / 1e6


@dataclass
class Result:
    """One tool's (fastest) run: one row of the table."""

    tool: str
    documents: int
    megabytes: float
    seconds: float
    duplicates: int
    setup: str
    duplicate_ids: set[str] = field(default_factory=set, repr=False)
    #: neardup only: seconds spent inside dedup_files' batches (detect, outputs, commit).
    batch_seconds: float | None = None

    @property
    def docs_per_second(self) -> float:
        return self.documents / self.seconds

    @property
    def mb_per_second(self) -> float:
        return self.megabytes / self.seconds

    def as_dict(self, baseline: Result) -> dict[str, object]:
        return {
            "tool": self.tool,
            "setup": self.setup,
            "documents": self.documents,
            "megabytes": round(self.megabytes, 3),
            "seconds": round(self.seconds, 3),
            "documents_per_second": round(self.docs_per_second, 1),
            "megabytes_per_second": round(self.mb_per_second, 3),
            "duplicates": self.duplicates,
            "neardup_speedup": round(baseline.docs_per_second / self.docs_per_second, 2),
        }


# --- corpus ------------------------------------------------------------------------------


def load_corpus(path: Path, limit: int | None, scratch: Path) -> Corpus:
    """Read ids and texts as neardup does; with ``limit``, also write the cut file."""
    lines: list[str] = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                lines.append(line)
                if limit is not None and len(lines) == limit:
                    break
    if limit is not None:
        path = scratch / f"corpus-{len(lines)}.jsonl.gz"
        with gzip.open(path, "wt", encoding="utf-8") as out:
            out.writelines(lines)
    ids, texts = [], []
    for number, line in enumerate(lines, start=1):
        record = json.loads(line)
        ids.append(record_id(record, ID_FIELD) or str(number))
        texts.append(record_text(record, [TEXT_FIELD]))
    return Corpus(path, ids, texts)


def python_shingles(text: str, n: int) -> list[str]:
    """Word n-grams of the normalised text; one shingle of every token when fewer than n."""
    tokens = _WORD.findall(normalize(text))
    if len(tokens) < n:
        return [" ".join(tokens)] if tokens else []
    return [" ".join(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]


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


def run_datasketch(corpus: Corpus, settings: EngineSettings) -> Result:
    """Python shingling, ``MinHash.update_batch``, in-memory ``MinHashLSH`` query/insert."""
    from datasketch import MinHash, MinHashLSH

    n, num_perm, threshold = settings.shingling.n, settings.num_perm, settings.threshold
    started = time.perf_counter()
    lsh = MinHashLSH(threshold=threshold, num_perm=num_perm)
    sketches: dict[int, MinHash] = {}
    duplicate_ids: set[str] = set()
    for key, (doc_id, text) in enumerate(zip(corpus.ids, corpus.texts)):
        shingles = python_shingles(text, n)
        if not shingles:
            continue
        sketch = MinHash(num_perm=num_perm, seed=settings.seed)
        sketch.update_batch([s.encode("utf-8") for s in shingles])
        if any(sketch.jaccard(sketches[c]) >= threshold for c in lsh.query(sketch)):
            duplicate_ids.add(doc_id)
        lsh.insert(key, sketch)
        sketches[key] = sketch
    seconds = time.perf_counter() - started
    return Result(
        tool="datasketch",
        documents=len(corpus),
        megabytes=corpus.megabytes,
        seconds=seconds,
        duplicates=len(duplicate_ids),
        setup=f"MinHashLSH in memory, {lsh.b} bands x {lsh.r} rows",
        duplicate_ids=duplicate_ids,
    )


def run_rensa(corpus: Corpus, settings: EngineSettings) -> Result:
    """Python shingling, ``RMinHash.update``, in-memory ``RMinHashLSH`` query/insert."""
    from rensa import RMinHash, RMinHashLSH

    n, num_perm, threshold = settings.shingling.n, settings.num_perm, settings.threshold
    started = time.perf_counter()
    lsh = RMinHashLSH(threshold=threshold, num_perm=num_perm, num_bands=RENSA_BANDS)
    sketches: dict[int, RMinHash] = {}
    duplicate_ids: set[str] = set()
    for key, (doc_id, text) in enumerate(zip(corpus.ids, corpus.texts)):
        shingles = python_shingles(text, n)
        if not shingles:
            continue
        sketch = RMinHash(num_perm=num_perm, seed=settings.seed)
        sketch.update(shingles)
        if any(sketch.jaccard(sketches[c]) >= threshold for c in lsh.query(sketch)):
            duplicate_ids.add(doc_id)
        lsh.insert(key, sketch)
        sketches[key] = sketch
    seconds = time.perf_counter() - started
    rows = num_perm // RENSA_BANDS
    return Result(
        tool="rensa",
        documents=len(corpus),
        megabytes=corpus.megabytes,
        seconds=seconds,
        duplicates=len(duplicate_ids),
        setup=f"RMinHashLSH in memory, {RENSA_BANDS} bands x {rows} rows",
        duplicate_ids=duplicate_ids,
    )


def best_of(repeat: int, run: Callable[[], Result]) -> Result:
    """The fastest of ``repeat`` runs."""
    return min((run() for _ in range(repeat)), key=lambda r: r.seconds)


# --- neardup stage breakdown -------------------------------------------------------------

STAGES = ("normalize", "shingle_batch", "MinHasher.signatures", "band_hashes")
REST = "rest of detect + commit"
DETECT = "total detect + commit"


def _batches(docs: Sequence[Document], size: int) -> Iterator[Sequence[Document]]:
    for start in range(0, len(docs), size):
        yield docs[start : start + size]


def stage_seconds(corpus: Corpus, settings: EngineSettings) -> dict[str, float]:
    """Seconds of each engine stage over the corpus (see the module docstring)."""
    docs = [Document(i, t) for i, t in zip(corpus.ids, corpus.texts)]
    hasher = MinHasher(settings.num_perm, settings.seed)
    seconds = dict.fromkeys((*STAGES, DETECT), 0.0)
    with tempfile.TemporaryDirectory(prefix="neardup-bench-stages-") as tmp:
        with closing(RocksDBStateStore(tmp, settings.state_shape())) as store:
            detector = Detector(settings, store)
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


def agreement(neardup: Result, other: Result) -> dict[str, int]:
    a, b = neardup.duplicate_ids, other.duplicate_ids
    return {"both": len(a & b), "only_neardup": len(a - b), f"only_{other.tool}": len(b - a)}


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


def _version(package: str) -> str | None:
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default = DEFAULT_CORPUS if DEFAULT_CORPUS.exists() else FALLBACK_CORPUS
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
