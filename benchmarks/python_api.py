"""The Python API (``neardup.Deduplicator``) against ``neardup dedup``, whole processes.

Three processes, one after the other, on the same corpus (Reuters-21578, 21,578 stories,
``--corpus``), default settings, the state in memory (``Deduplicator()``) or in a
temporary directory (``neardup dedup`` without ``--state-dir``):

1. **cli**: ``neardup dedup CORPUS --out-dir D --no-progress`` (reads and writes JSONL).
2. **api-add**: a Python process that imports neardup, reads the corpus (gzip, orjson),
   ``add_many`` every story; then ``query_many`` of every story (each text looked up in the
   state of all of them, nothing added). Its phases are timed inside too.
3. **api-latency**: builds the state of all stories with ``add_many`` (not timed), then
   ``query`` one text at a time for ``--queries`` stories (each with " said " made
   " says ", an edited draft) and prints the p50 and p99 of the call's wall time.

For every process: wall time from launch to exit, CPU seconds (``RUSAGE_CHILDREN``), and
the 1-minute load average before it (the machine is shared: wall times follow the
scheduler's share, the CPU seconds less so).

Usage: python benchmarks/python_api.py [--corpus PATH] [--queries 2000]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import orjson

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"
CORPUS = Path("/work/shared/data/reuters21578/reuters21578.jsonl.gz")


def _read(corpus: Path) -> tuple[list[str], list[str]]:
    with gzip.open(corpus, "rb") as f:
        records = [orjson.loads(line) for line in f]
    return [str(r["id"]) for r in records], [str(r["text"]) for r in records]


def worker(mode: str, corpus: Path, queries: int) -> None:
    """One measured process (``--worker``): prints one JSON line of its phases."""
    from neardup import Deduplicator

    t0 = time.perf_counter()
    ids, texts = _read(corpus)
    out: dict[str, float] = {"documents": len(ids), "read_s": time.perf_counter() - t0}
    with Deduplicator() as index:
        t0 = time.perf_counter()
        results = index.add_many(ids, texts)
        out["add_s"] = time.perf_counter() - t0
        out["duplicates"] = sum(getattr(r, "verdict", "") == "duplicate" for r in results)
        if mode == "add":
            t0 = time.perf_counter()
            found = index.query_many(texts)
            out["query_many_s"] = time.perf_counter() - t0
            out["found_itself"] = sum(bool(f) and f[0].similarity == 1.0 for f in found)
        else:
            rng = random.Random(1)
            picked = rng.sample(range(len(texts)), min(queries, len(texts)))
            index.query(texts[0])  # first call: nothing left to load
            seconds = []
            for i in picked:
                draft = texts[i].replace(" said ", " says ")
                t0 = time.perf_counter()
                index.query(draft)
                seconds.append(time.perf_counter() - t0)
            out["queries"] = len(seconds)
            out["p50_ms"] = float(np.percentile(seconds, 50) * 1e3)
            out["p99_ms"] = float(np.percentile(seconds, 99) * 1e3)
            out["max_ms"] = max(seconds) * 1e3
    print(json.dumps(out))


def _timed(cmd: list[str]) -> tuple[float, float, float, str]:
    """(wall s, CPU s, load average before, stdout) of one process."""
    load = os.getloadavg()[0]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(SRC)})
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        sys.exit(f"{cmd[:4]} failed: {proc.stderr[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, load, proc.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", type=Path, default=CORPUS)
    parser.add_argument("--queries", type=int, default=2000)
    parser.add_argument("--worker", choices=["add", "latency"])
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.corpus, args.queries)
        return
    me = [sys.executable, str(Path(__file__).resolve())]
    print(f"corpus {args.corpus}; load average at start {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    with tempfile.TemporaryDirectory() as scratch:
        # warm the compiled kernels' cache so that no process below compiles them
        _timed([sys.executable, "-m", "neardup.cli", "dedup", str(args.corpus), "--out-dir", f"{scratch}/warm",
                "--no-progress", "--log-level", "WARNING"])
        wall, cpu, load, _ = _timed([sys.executable, "-m", "neardup.cli", "dedup", str(args.corpus),
                                     "--out-dir", f"{scratch}/out", "--no-progress", "--log-level", "WARNING"])
    n = None
    api_wall, api_cpu, api_load, line = _timed([*me, "--worker", "add", "--corpus", str(args.corpus)])
    api = json.loads(line)
    n = api["documents"]
    lat_wall, lat_cpu, lat_load, line = _timed([*me, "--worker", "latency", "--corpus", str(args.corpus),
                                                "--queries", str(args.queries)])
    lat = json.loads(line)
    print(f"{'process':<34}{'wall s':>8}{'CPU s':>8}{'docs/s':>9}{'load':>6}")
    print(f"{'neardup dedup (whole process)':<34}{wall:>8.2f}{cpu:>8.2f}{n / wall:>9,.0f}{load:>6.2f}")
    print(f"{'API add_many + query_many':<34}{api_wall:>8.2f}{api_cpu:>8.2f}{n / api_wall:>9,.0f}{api_load:>6.2f}")
    print(f"  inside: read {api['read_s']:.2f} s, add_many {api['add_s']:.2f} s "
          f"({n / api['add_s']:,.0f} docs/s, {api['duplicates']:.0f} duplicates), query_many {api['query_many_s']:.2f} s "
          f"({n / api['query_many_s']:,.0f} texts/s; {api['found_itself']:.0f} of {n} find a stored text at 1.0)")
    print(f"{'API query latency (one at a time)':<34}{lat_wall:>8.2f}{lat_cpu:>8.2f}{'':>9}{lat_load:>6.2f}")
    print(f"  {lat['queries']:.0f} queries on a state of {n} stories: p50 {lat['p50_ms']:.2f} ms, "
          f"p99 {lat['p99_ms']:.2f} ms, max {lat['max_ms']:.2f} ms")
    print(f"load average at end {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
