"""Whole-process speed: ``neardup dedup FILE`` next to rensa, datasketch and gaoya pipelines, each a process.

What a user times: the command from launch to exit (imports, compiled-kernel loading,
reading and parsing the JSONL, the work, writing the outputs, the state). Each tool runs
as its own process, one after the other, on the same file:

1. **neardup**: ``neardup dedup INPUT --out-dir D --text-field text --id-field id
   --no-progress`` (default settings; fresh state in a temporary directory, as without
   ``--state-dir``); the compile cache is warmed beforehand by the start-up runs.
2. **rensa** and 3. **datasketch**: ``reference_dedup.py`` (its docstring: orjson reading,
   Python word 5-grams, in-memory LSH, the same three output files).
4. **gaoya**: ``reference_dedup.py gaoya``: the same reading and writing, gaoya's
   ``MinHashStringIndex`` hashing the normalised text with its own Rust word 5-gram
   analyzer (white-space tokens), 16 bands x 8 rows, query then insert per document.
5. **gaoya-bulk**: ``reference_dedup.py gaoya-bulk``: the whole file read first, then
   ``par_bulk_insert_docs`` and ``par_bulk_query`` on all cores; a document is a duplicate
   when its answer holds an earlier document at or above the threshold. The only tool
   here that is not one pass in input order, and the only one using both cores for its work.

The datasets:

- ``reuters``: plain Reuters-21578 (``--corpus``, 21,578 stories, JSONL.gz);
- ``stream``: ``--stream-docs`` (200,000) documents of edited republications, the corpus
  replayed round after round with one seeded light edit per replayed story
  (``benchlib.replay_stream``), written once as plain JSONL (``id``, ``text``) before any
  timing.

``--rounds`` rounds (default 2); in each round every tool runs once on a dataset before
the next dataset, so that the machine's drift falls on all tools alike; the fastest
round of each tool is kept, the others are printed. On a machine shared with other
work the wall-time ratio follows the scheduler's share; the ratio of CPU seconds (the
fewest of each tool's rounds; neardup's include its second process) is printed too. For every run the script records the
wall time, the CPU seconds of the process and its children (``RUSAGE_CHILDREN``), and the
1-minute load average just before it. The ratios printed are neardup's documents/s over
each reference's.

Start-up: ``--startup-runs`` (5) runs of neardup on the first 5 lines of the corpus (the
first one also warms the compile cache and is not counted), median and fastest wall time.

Usage: python benchmarks/whole_process.py [--rounds 2] [--stream-docs 200000] [--json OUT]
"""

from __future__ import annotations

import argparse
import gzip
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402

HERE = Path(__file__).resolve().parent
TOOLS = ("neardup", "rensa", "datasketch", "gaoya", "gaoya-bulk")


def neardup_command(extra: list[str]) -> list[str]:
    """The ``neardup`` script that pip installed beside this interpreter (what a user of
    this Python runs; the peers run on this interpreter too), else the one on PATH, else
    ``python -m neardup.cli``. A version manager's shim on PATH (pyenv's: a shell script
    that finds the interpreter again, about 0.08 s here) is no part of neardup's time."""
    beside = Path(sys.executable).parent / "neardup"
    exe = str(beside) if beside.exists() else shutil.which("neardup")
    return ([exe] if exe else [sys.executable, "-m", "neardup.cli"]) + extra


def command(tool: str, path: Path, out_dir: Path, neardup_args: list[str]) -> list[str]:
    if tool == "neardup":
        return neardup_command(["dedup", str(path), "--out-dir", str(out_dir), "--text-field", "text",
                                "--id-field", "id", "--no-progress", *neardup_args])
    return [sys.executable, str(HERE / "reference_dedup.py"), tool, str(path), "--out-dir", str(out_dir)]


def timed_run(cmd: list[str], out_dir: Path) -> dict[str, object]:
    """Run ``cmd`` to its end; wall seconds, CPU seconds (with its children), load average
    before, and the lines written to each output file.

    Raises:
        RuntimeError: the process failed.
    """
    shutil.rmtree(out_dir, ignore_errors=True)
    load = os.getloadavg()[0]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr[-2000:]}")
    lines = {}
    for name in ("unique", "duplicates", "rejects"):
        p = out_dir / f"{name}.jsonl"
        lines[name] = sum(1 for _ in open(p, "rb")) if p.exists() else 0
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"seconds": round(wall, 3), "cpu_seconds": round(cpu, 3), "loadavg_1m": round(load, 2), **lines}


def write_stream(corpus_path: Path, docs: int, dest: Path) -> int:
    """The replay stream as JSONL (``id``, ``text``); returns the number of lines."""
    base = benchlib.load_corpus(corpus_path)
    n = 0
    with open(dest, "wb") as out:
        for doc_id, text in benchlib.replay_stream(base, docs, "light", 1):
            out.write(orjson.dumps({"id": doc_id, "text": text}) + b"\n")
            n += 1
    return n


def write_head(corpus_path: Path, lines: int, dest: Path) -> None:
    with gzip.open(corpus_path, "rb") as src, open(dest, "wb") as out:
        for _ in range(lines):
            out.write(src.readline())


def count_lines(path: Path) -> int:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        return sum(1 for line in f if line.strip())


def startup(scratch: Path, corpus: Path, runs: int, neardup_args: list[str]) -> dict[str, object]:
    five = scratch / "five.jsonl"
    write_head(corpus, 5, five)
    out = scratch / "out-five"
    timed_run(command("neardup", five, out, neardup_args), out)  # warms the compile cache
    rows = [timed_run(command("neardup", five, out, neardup_args), out) for _ in range(runs)]
    secs = [float(r["seconds"]) for r in rows]  # type: ignore[arg-type]
    return {"documents": 5, "runs": rows, "median_seconds": round(statistics.median(secs), 3),
            "fastest_seconds": round(min(secs), 3)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", type=Path, default=benchlib.default_corpus(), help="JSONL.gz with id and text")
    p.add_argument("--stream-docs", type=int, default=200_000, help="documents of the replay stream (default 200,000; 0 skips it)")
    p.add_argument("--stream-file", type=Path, help="use this JSONL as the stream (e.g. one written before) instead of writing it")
    p.add_argument("--datasets", default="reuters,stream", help="comma list of reuters, stream (default both)")
    p.add_argument("--tools", default=",".join(TOOLS), help=f"comma list of {', '.join(TOOLS)}")
    p.add_argument("--rounds", type=int, default=2, help="rounds of all tools per dataset (default 2)")
    p.add_argument("--startup-runs", type=int, default=5, help="timed start-up runs on 5 documents (default 5; 0 skips)")
    p.add_argument("--neardup-arg", action="append", default=[], help="extra argument for neardup dedup (repeat)")
    p.add_argument("--json", type=Path, help="also write the numbers as JSON here")
    args = p.parse_args(argv)
    tools = [t for t in args.tools.split(",") if t]
    datasets = [d for d in args.datasets.split(",") if d and not (d == "stream" and args.stream_docs == 0)]

    report: dict[str, object] = {"benchmark": "whole_process", "git": benchlib.git_state(),
                                 "environment": benchlib.environment(), "neardup_args": args.neardup_arg,
                                 "command": neardup_command(["dedup", "..."]), "rounds": args.rounds}
    print(f"neardup at {benchlib.describe_git(report['git'])}")  # type: ignore[arg-type]
    print(f"{os.cpu_count()} CPUs, load average at start {report['environment']['loadavg']}")  # type: ignore[index]
    with tempfile.TemporaryDirectory(prefix="neardup-bench-whole-") as tmp:
        scratch = Path(tmp)
        if args.startup_runs:
            s = startup(scratch, args.corpus, args.startup_runs, args.neardup_arg)
            report["startup"] = s
            print(f"\nstart-up, 5 documents, whole process: median {s['median_seconds']:.3f} s, fastest "
                  f"{s['fastest_seconds']:.3f} s over {args.startup_runs} runs (load "
                  f"{', '.join(str(r['loadavg_1m']) for r in s['runs'])})")  # type: ignore[union-attr]
        files = {}
        if "reuters" in datasets:
            files["reuters"] = args.corpus
        if "stream" in datasets and args.stream_file:
            files["stream"] = args.stream_file
        elif "stream" in datasets:
            t0 = time.perf_counter()
            files["stream"] = scratch / f"stream-{args.stream_docs}.jsonl"
            write_stream(args.corpus, args.stream_docs, files["stream"])
            print(f"stream of {args.stream_docs:,} documents written in {time.perf_counter() - t0:.1f} s (not timed)")
        results: dict[str, object] = {}
        for name, path in files.items():
            docs = count_lines(path)
            runs: dict[str, list[dict[str, object]]] = {t: [] for t in tools}
            for r in range(args.rounds):
                for tool in tools:
                    out = scratch / f"out-{tool}"
                    row = timed_run(command(tool, path, out, args.neardup_arg), out)
                    runs[tool].append(row)
                    print(f"  {name} round {r + 1} {tool:<10} {row['seconds']:>7.2f} s  cpu {row['cpu_seconds']:>7.2f} s  "
                          f"load {row['loadavg_1m']}  duplicates {row['duplicates']:,}", flush=True)
            best = {t: min(rows, key=lambda x: x["seconds"]) for t, rows in runs.items()}  # type: ignore[arg-type,return-value]
            table = []
            for tool in tools:
                b = best[tool]
                table.append([tool, f"{b['seconds']:.2f}", f"{b['cpu_seconds']:.2f}",
                              f"{docs / float(b['seconds']):,.0f}", f"{b['duplicates']:,}", b["loadavg_1m"]])  # type: ignore[arg-type]
            print(f"\n{name}: {docs:,} documents ({path.name}), fastest of {args.rounds} rounds")
            print(benchlib.table(["tool", "seconds", "cpu s", "docs/s", "duplicates", "load 1m"], table))
            ratios, cpu_ratios = {}, {}
            if "neardup" in best:
                least_cpu = {t: min(float(x["cpu_seconds"]) for x in rows) for t, rows in runs.items()}  # type: ignore[arg-type]
                for tool in tools:
                    if tool != "neardup":
                        ratios[tool] = round(float(best[tool]["seconds"]) / float(best["neardup"]["seconds"]), 2)  # type: ignore[arg-type]
                        cpu_ratios[tool] = round(least_cpu[tool] / least_cpu["neardup"], 2)
                        print(f"neardup / {tool} docs/s: {ratios[tool]:.2f} (wall time); "
                              f"{cpu_ratios[tool]:.2f} (CPU seconds, fewest of the rounds)")
            results[name] = {"documents": docs, "runs": runs, "fastest": best, "ratios": ratios,
                             "cpu_ratios": cpu_ratios}
        report["datasets"] = results
    report["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    print(f"load average at end {report['loadavg_end']}")
    if args.json:
        benchlib.write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
