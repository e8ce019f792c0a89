"""Start-up CPU of each sharded stage process and of ``neardup run``: what every process
pays before its first record, so that the CPU per document of a short run can be split
into start-up and the work per document.

Setup: the broker of ``kafka_e2e.start_broker`` (``NEARDUP_KAFKA_BOOTSTRAP``, or a local
one). Per round and per role (``prepare``, ``shard``, ``decide``, ``run``): a fresh input
topic of ``--input-partitions`` partitions with no record and a fresh ``--app`` (or
group); the process is launched as ``benchmarks/scale_out.py`` launches it, with
``--log-level INFO``, and its log is read every 10 ms until it says its partitions are
assigned. Its CPU seconds (user + system, ``/proc/<pid>/stat``) then are its start-up:
Python, the imports, the Kafka clients, the topics made or checked, the group joined,
a restore of nothing. Then ``--idle-s`` seconds more with no record (the CPU of waiting),
and SIGTERM.

With ``--runs FILE...`` (JSON of ``scale_out.py --processes 1 --with-run``), each run's
CPU per document is printed again less the median start-up of its role: the CPU per
document of the work itself, as a long run would see it.

Printed: per role, the start-up CPU seconds and the wall seconds to assignment of every
round, their median, and the CPU of the idle seconds; then the runs' split; the load
average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import benchlib
from kafka_e2e import create_topics, start_broker

ROLES = ("prepare", "shard", "decide", "run")


def command(role: str, bootstrap: str, topic: str, app: str, args: argparse.Namespace, state: Path) -> list[str]:
    """The command line of ``role`` (as ``scale_out.py`` starts it)."""
    if role == "run":
        return [sys.executable, "-m", "neardup.cli", "run", "--bootstrap-servers", bootstrap, "--input-topic", topic,
                "--group-id", app, "--from-beginning", "--text-field", "text", "--id-field", "id",
                "--unique-topic", f"{topic}.run-unique", "--duplicate-topic", f"{topic}.run-duplicates",
                "--dlq-topic", f"{topic}.run-dlq", "--state-dir", str(state), "--metrics-port", "0",
                "--log-level", "INFO"]
    return [sys.executable, "-m", "neardup.cli", "stage", role, "--bootstrap-servers", bootstrap,
            "--input-topic", topic, "--app", app, "--shards", str(args.shards),
            "--decide-partitions", str(args.decide_partitions), "--instance", "0", "--from-beginning",
            "--text-field", "text", "--id-field", "id", "--log-level", "INFO"]


def one(role: str, bootstrap: str, args: argparse.Namespace) -> tuple[float, float, float]:
    """(start-up CPU seconds, wall seconds to assignment, CPU seconds of the idle time
    after) of one process of ``role`` on an empty input topic.

    Raises:
        RuntimeError: the process stopped, or was not assigned within 120 s.
    """
    tag = uuid.uuid4().hex[:8]
    topic, app = f"startup-{role}-{tag}", f"startup-{tag}"
    create_topics(bootstrap, [topic], partitions=args.input_partitions)
    with tempfile.TemporaryDirectory(prefix="neardup-startup-") as tmp:
        log_path = Path(tmp) / "log"
        with open(log_path, "wb") as log:
            started = time.perf_counter()
            proc = subprocess.Popen(command(role, bootstrap, topic, app, args, Path(tmp) / "state"),
                                    stdout=log, stderr=subprocess.STDOUT)
            try:
                while b": assigned " not in log_path.read_bytes():  # the runtime's line, not a warning naming it
                    if proc.poll() is not None or time.perf_counter() - started > 120:
                        raise RuntimeError(f"{role}: not assigned:\n{log_path.read_text()[-2000:]}")
                    time.sleep(0.01)
                cpu = benchlib.proc_cpu_seconds(proc.pid) or 0.0
                wall = time.perf_counter() - started
                time.sleep(args.idle_s)
                idle = (benchlib.proc_cpu_seconds(proc.pid) or cpu) - cpu
            finally:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
    return cpu, wall, idle


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--input-partitions", type=int, default=4)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--decide-partitions", type=int, default=4)
    ap.add_argument("--idle-s", type=float, default=2.0, help="seconds kept running with no record after assignment")
    ap.add_argument("--runs", type=Path, nargs="*", default=[],
                    help="scale_out.py JSON (--processes 1 --with-run): their CPU per document less the start-ups")
    ap.add_argument("--shared-broker", action="store_true")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    bootstrap, how, _ = start_broker(args.shared_broker)
    load_before = os.getloadavg()
    print(f"broker {how}; {args.input_partitions} input partitions, {args.shards} shards, "
          f"{args.decide_partitions} decide partitions; load average at start {load_before}")
    got: dict[str, list[tuple[float, float, float]]] = {role: [] for role in ROLES}
    for _ in range(args.rounds):
        for role in ROLES:  # in turn, each round
            got[role].append(one(role, bootstrap, args))
    startup = {}
    for role in ROLES:
        cpus = [c for c, _, _ in got[role]]
        startup[role] = statistics.median(cpus)
        print(f"{role}: start-up CPU {', '.join(f'{c:.2f}' for c in cpus)} s (median {startup[role]:.2f}), "
              f"to assignment {', '.join(f'{w:.2f}' for _, w, _ in got[role])} s wall; "
              f"idle {args.idle_s:g} s after: {', '.join(f'{i:.2f}' for _, _, i in got[role])} CPU s")
    split = []
    for path in args.runs:
        measured = json.loads(path.read_text())
        docs = measured["docs"]
        for r in measured["runs"]:
            if r.get("processes_per_stage") != 1 or not r.get("run"):
                continue
            per = dict(r["cpu_us_per_document"], run=r["run"]["cpu_us_per_document"])
            less = {role: per[role] - 1e6 * startup[role] / docs for role in ROLES}
            stages, stages_less = (sum(per[s] for s in ROLES[:3]), sum(less[s] for s in ROLES[:3]))
            split.append({"file": str(path), "shards": measured["shards"], "docs": docs, "cpu_us_per_document": per,
                          "less_startup": less})
            print(f"{path.name} ({measured['shards']} shards, {docs:,} documents): µs per document "
                  + ", ".join(f"{role} {per[role]:.0f} -> {less[role]:.0f}" for role in ROLES)
                  + f"; stages {stages:.0f} -> {stages_less:.0f}, x run {stages / per['run']:.2f} -> "
                  f"{stages_less / less['run']:.2f}")
    load_after = os.getloadavg()
    print(f"load average at end {load_after}")
    if args.json:
        args.json.write_text(json.dumps({"environment": benchlib.environment(), "rounds": args.rounds,
                                         "startup_cpu_seconds": {r: [c for c, _, _ in got[r]] for r in ROLES},
                                         "to_assignment_seconds": {r: [w for _, w, _ in got[r]] for r in ROLES},
                                         "idle_cpu_seconds": {r: [i for _, _, i in got[r]] for r in ROLES},
                                         "median_startup_cpu_seconds": startup, "runs": split,
                                         "load_before": load_before, "load_after": load_after}, indent=1))


if __name__ == "__main__":
    main()
