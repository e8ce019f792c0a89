"""Start-up of ``neardup dedup`` on 5 documents, two or more installs side by side.

Each ``--neardup`` is a ``neardup`` executable (of a virtual environment with its own
install: a commit to compare against, and this one). They run in turn, ``--runs`` times
each, on the first 5 lines of ``--corpus`` (``neardup dedup FILE --out-dir D --overwrite
--text-field text --id-field id --no-progress``), so that the machine's drift falls on all
alike. Printed per executable: the median and fastest wall seconds from launch to exit,
and the median CPU seconds (user + system, the process and its children); then the load
average.

Example, a commit against the working tree::

    git worktree add /tmp/base <commit> && python -m venv /tmp/base-venv && /tmp/base-venv/bin/pip install /tmp/base
    python -m venv /tmp/new-venv && /tmp/new-venv/bin/pip install .
    python benchmarks/startup.py --neardup /tmp/base-venv/bin/neardup --neardup /tmp/new-venv/bin/neardup
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import benchlib
from whole_process import write_head


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--neardup", action="append", required=True, type=Path,
                   help="a neardup executable (repeat: each runs in turn)")
    p.add_argument("--runs", type=int, default=25, help="runs of each (default 25)")
    p.add_argument("--corpus", type=Path, default=benchlib.default_corpus(), help="JSONL.gz with id and text")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="neardup-startup-") as scratch:
        five = Path(scratch) / "five.jsonl"
        write_head(args.corpus, 5, five)
        walls: dict[Path, list[float]] = {exe: [] for exe in args.neardup}
        cpus: dict[Path, list[float]] = {exe: [] for exe in args.neardup}
        load = os.getloadavg()
        for _ in range(args.runs):
            for i, exe in enumerate(args.neardup):
                before = resource.getrusage(resource.RUSAGE_CHILDREN)
                started = time.perf_counter()
                subprocess.run([str(exe), "dedup", str(five), "--out-dir", f"{scratch}/out{i}", "--overwrite",
                                "--text-field", "text", "--id-field", "id", "--no-progress"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
                walls[exe].append(time.perf_counter() - started)
                after = resource.getrusage(resource.RUSAGE_CHILDREN)
                cpus[exe].append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
    for exe in args.neardup:
        print(f"{exe}: wall median {statistics.median(walls[exe]):.3f} s, fastest {min(walls[exe]):.3f} s; "
              f"CPU median {statistics.median(cpus[exe]):.3f} s ({args.runs} runs)")
    print(f"load average {load[0]:.2f} before, {os.getloadavg()[0]:.2f} after (nproc {os.cpu_count()})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
