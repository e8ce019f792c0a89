"""Restoring ``neardup run``'s state from its Kafka changelog, against opening it again.

Setup as ``kafka_e2e.py`` (its broker start, topic creation and producer): a local broker,
a fresh input topic ``bench-restore-<hex>`` (one partition) and its three output topics,
and ``--messages`` N (default 1,000,000) documents of the replayed Reuters stream
(``benchlib.replay_stream``, light edits) produced to it before neardup starts.

Three runs of ``neardup run --changelog on`` (``kafka_e2e.neardup_command``), one consumer
group, each a subprocess with its own log:

1. *fill*: a fresh state directory A; the N documents are processed (the group's
   committed offset polled every ``--poll-ms`` until it reaches N), then SIGTERM. The
   changelog topic ``<group>.neardup-changelog`` now holds the state.
2. *reopen*: the same directory A again (a plain restart; no new input): the time from
   launch to the ``assigned`` log line (the consumer has its partition, the state was
   opened and checked against the changelog), then SIGTERM.
3. *restore*: a FRESH, empty directory B (no new input): the state is restored from the
   changelog before the consumer starts. Timed: launch to the ``restored N documents from
   changelog T: R records, M MB in S s`` log line (the line's own clock time, to the
   millisecond), and launch to ``assigned``; the line's own records, MB and seconds,
   and from them documents/s and MB/s of the restore. Peak RSS: the process's VmHWM,
   read every ``--poll-ms`` while it runs, and at the ``restored`` line.

Then the sizes on disk of directories A and B (after both processes closed them). The
reopen runs before the restore: a start writes a transaction of meta records to the
changelog, so directory A is behind the changelog once B was started on it (it would
be restored, not reopened). The load average is printed beside each run.

Usage: python benchmarks/restore.py [--messages 1000000] [--json OUT]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import datetime
from pathlib import Path

from confluent_kafka import Consumer, TopicPartition

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402
import kafka_e2e  # noqa: E402

RESTORED = re.compile(r"restored (\d+) documents from changelog (\S+): (\d+) records, ([\d.]+) MB in ([\d.]+) s")


def log_time(line: str) -> float:
    """Epoch seconds of a ``neardup run`` log line (local ``asctime``, to the
    millisecond); NaN if the line does not start with one."""
    try:
        return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
    except ValueError:
        return float("nan")


def run_until(cmd: list[str], log: Path, needles: list[str], poll_s: float, timeout_s: float) -> dict[str, object]:
    """Launch ``cmd`` (output to ``log``), wait until every one of ``needles`` appeared in
    its log, then SIGTERM it. Returns launch time, each needle's line and its log time,
    the VmHWM (MB) at each needle's sighting and at the end, the exit code, the load
    averages at launch and at the last needle.

    Raises:
        RuntimeError: the process exited first; TimeoutError: not seen in ``timeout_s``.
    """
    load_launch = os.getloadavg()
    launched = time.time()
    with open(log, "wb") as stream:
        proc = subprocess.Popen(cmd, stdout=stream, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    seen: dict[str, dict[str, object]] = {}
    peak = 0.0
    deadline = time.monotonic() + timeout_s
    try:
        while len(seen) < len(needles):
            status = benchlib.proc_status_mb(proc.pid)
            peak = max(peak, status.get("VmHWM", 0.0))
            for line in log.read_text(errors="replace").splitlines():
                for needle in needles:
                    if needle not in seen and needle in line:
                        seen[needle] = {"line": line, "at": log_time(line), "seen": time.time(), "peak_rss_mb": peak}
            if len(seen) == len(needles):
                break
            if proc.poll() is not None:
                raise RuntimeError(f"neardup run exited with {proc.returncode}; log:\n{log.read_text()[-3000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{needles} not all logged in {timeout_s} s; log:\n{log.read_text()[-3000:]}")
            time.sleep(poll_s)
        load_end = os.getloadavg()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return {"launched": launched, "seen": seen, "peak_rss_mb": peak, "exit_code": rc,
            "loadavg_launch": load_launch, "loadavg_end": load_end}


def watermarks(bootstrap: str, topic: str) -> tuple[int, int]:
    """(low, high) offsets of partition 0 of ``topic``."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"bench-watermarks-{uuid.uuid4().hex[:8]}"})
    try:
        return consumer.get_watermark_offsets(TopicPartition(topic, 0), timeout=30)
    finally:
        consumer.close()


def fill(args: argparse.Namespace, cmd: list[str], bootstrap: str, topic: str, group: str,
         log: Path) -> dict[str, object]:
    """Run 1: ``neardup run`` until the group's committed offset is N, then SIGTERM."""
    watch = kafka_e2e.OffsetWatch(bootstrap, group, topic)
    peak, cpu = [0.0], [0.0]
    load_launch = os.getloadavg()
    launched = time.time()
    with open(log, "wb") as stream:
        proc = subprocess.Popen(cmd, stdout=stream, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        done = kafka_e2e.wait_for(watch, args.messages, proc, args.poll_ms / 1000, args.timeout, log, peak, cpu)
        load_end = os.getloadavg()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=120)
    finally:
        watch.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return {"seconds": done - launched, "peak_rss_mb": peak[0], "cpu_seconds": cpu[0], "exit_code": rc,
            "loadavg_launch": load_launch, "loadavg_end": load_end}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    default = benchlib.default_corpus()
    p.add_argument("--corpus", type=Path, default=default, help=f"JSONL.gz with id and text (default {default})")
    p.add_argument("--messages", type=int, default=1_000_000, help="documents through neardup run (default 1,000,000)")
    p.add_argument("--batch-size", type=int, help="neardup run --batch-size (default: neardup's)")
    p.add_argument("--poll-ms", type=float, default=100.0, help="offset, log and VmHWM poll interval (default 100)")
    p.add_argument("--seed", type=int, default=1, help="seed of the edits (default 1)")
    p.add_argument("--timeout", type=float, default=3600.0, help="give up after this many seconds per run (default 3600)")
    p.add_argument("--keep-broker", action="store_true", help="leave a broker this script started running")
    p.add_argument("--shared-broker", action="store_true",
                   help="use kafka.sh's default cache (.cache/kafka, the one the tests use)")
    p.add_argument("--keep-topics", action="store_true", help="do not delete the topics at the end")
    p.add_argument("--json", type=Path, help="also write the numbers as JSON here")
    p.add_argument("--logs", type=Path, help="copy the three runs' logs (fill.log, reopen.log, restore.log) here")
    p.add_argument("--profile", type=Path, help="run the restore under cProfile and write its stats here (slows it)")
    args = p.parse_args(argv)
    if args.messages < 1:
        p.error("--messages must be at least 1")
    return args


def load(pair: object) -> str:
    a, b = pair  # type: ignore[misc]
    return f"{a[0]:.2f} / {b[0]:.2f}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    n = args.messages
    if args.profile:
        args.profile.parent.mkdir(parents=True, exist_ok=True)
    base = benchlib.load_corpus(args.corpus)
    bootstrap, how, home = kafka_e2e.start_broker(args.shared_broker)
    print(f"broker {bootstrap} ({how})", flush=True)
    topic = f"bench-restore-{uuid.uuid4().hex[:10]}"
    group = f"bench-restore-{uuid.uuid4().hex[:8]}"
    outputs = [topic + s for s in kafka_e2e.SUFFIXES.values()]
    changelog = kafka_e2e.changelog_topic(group)
    git = benchlib.git_state()
    try:
        kafka_e2e.create_topics(bootstrap, [topic, *outputs])
        producer = kafka_e2e.new_producer(bootstrap)
        stream = (kafka_e2e.encode(i, t) for i, t in benchlib.replay_stream(base, n, "light", args.seed))
        produce_s = kafka_e2e.produce_all(producer, topic, stream, kafka_e2e.Sent())
        print(f"pre-produced {n:,} messages to {topic} in {produce_s:.1f} s", flush=True)
        with tempfile.TemporaryDirectory(prefix="neardup-bench-restore-") as tmp:
            dir_a, dir_b = Path(tmp) / "state-a", Path(tmp) / "state-b"

            def command(state: Path, profile: Path | None = None) -> list[str]:
                return kafka_e2e.neardup_command(bootstrap, topic, group, state, args.batch_size, profile=profile,
                                                 changelog="on")

            print(f"neardup at {benchlib.describe_git(git)}")
            print("$ " + " ".join(command(Path("<tmp>/state-a"))), flush=True)
            filled = fill(args, command(dir_a), bootstrap, topic, group, Path(tmp) / "fill.log")
            print(f"fill: {n:,} documents in {filled['seconds']:.1f} s ({n / filled['seconds']:,.0f}/s), "
                  f"exit {filled['exit_code']}; load {load((filled['loadavg_launch'], filled['loadavg_end']))}",
                  flush=True)
            low, high = watermarks(bootstrap, changelog)
            size_a = benchlib.dir_bytes(dir_a)

            reopen = run_until(command(dir_a), Path(tmp) / "reopen.log", ["assigned"], args.poll_ms / 1000,
                               args.timeout)
            print(f"reopen: exit {reopen['exit_code']}", flush=True)
            restore = run_until(command(dir_b, args.profile), Path(tmp) / "restore.log", ["restored ", "assigned"],
                                args.poll_ms / 1000, args.timeout)
            size_b = benchlib.dir_bytes(dir_b)
            size_a_after = benchlib.dir_bytes(dir_a)
            reopen_log = (Path(tmp) / "reopen.log").read_text(errors="replace")
            if args.logs:
                args.logs.mkdir(parents=True, exist_ok=True)
                for name in ("fill.log", "reopen.log", "restore.log"):
                    shutil.copy(Path(tmp) / name, args.logs / name)
    finally:
        if not args.keep_topics:
            try:
                kafka_e2e.delete_topics(bootstrap, [topic, *outputs, changelog])
            except Exception as exc:  # best effort
                print(f"deleting the topics failed: {exc}", file=sys.stderr)
        if how == "started" and not args.keep_broker:
            kafka_e2e._kafka_sh("stop", home=home, timeout=120)
            print("broker stopped", file=sys.stderr)

    line = restore["seen"]["restored "]
    match = RESTORED.search(line["line"])
    if match is None:
        raise RuntimeError(f"unexpected restore line: {line['line']}")
    docs, records, mb, seconds = int(match[1]), int(match[3]), float(match[4]), float(match[5])
    to_line = line["at"] - restore["launched"]
    restore_ready = restore["seen"]["assigned"]["at"] - restore["launched"]
    reopen_ready = reopen["seen"]["assigned"]["at"] - reopen["launched"]
    if "restored " in reopen_log:
        print("NOTE: the reopen of directory A restored it from the changelog", flush=True)
    print(f"\nchangelog {changelog}: offsets {low:,} to {high:,} after the fill")
    print(benchlib.table(["", "seconds", "load at launch / end"], [
        [f"fill: {n:,} documents, launch -> committed offset N", f"{filled['seconds']:.1f}",
         load((filled["loadavg_launch"], filled["loadavg_end"]))],
        ["reopen (same directory): launch -> assigned", f"{reopen_ready:.1f}",
         load((reopen["loadavg_launch"], reopen["loadavg_end"]))],
        ["restore (fresh directory): launch -> 'restored' line", f"{to_line:.1f}",
         load((restore["loadavg_launch"], restore["loadavg_end"]))],
        ["restore (fresh directory): launch -> assigned", f"{restore_ready:.1f}", ""],
        ["restore itself (the line's seconds)", f"{seconds:.1f}", ""],
    ]))
    print(f"\nrestored {docs:,} documents: {records:,} records, {mb:,.1f} MB in {seconds:.1f} s -> "
          f"{docs / seconds:,.0f} documents/s, {mb / seconds:,.1f} MB/s, {records / seconds:,.0f} records/s")
    print(benchlib.table(["", "fill (A)", "reopen (A)", "restore (B)"], [
        ["peak RSS MB (VmHWM)", f"{filled['peak_rss_mb']:,.0f}", f"{reopen['peak_rss_mb']:,.0f}",
         f"{restore['peak_rss_mb']:,.0f}"],
        ["  at the 'restored' line", "", "", f"{line['peak_rss_mb']:,.0f}"],
        ["state directory MB", f"{size_a / 1e6:,.1f}", f"{size_a_after / 1e6:,.1f}", f"{size_b / 1e6:,.1f}"],
        ["exit code after SIGTERM", str(filled["exit_code"]), str(reopen["exit_code"]), str(restore["exit_code"])],
    ]))
    print(f"({os.cpu_count()} CPUs; target: {n:,} documents restored in under 60 s: "
          f"{'met' if to_line < 60 else 'NOT met'} at {to_line:.1f} s from launch)")

    report = {
        "benchmark": "restore", "git": git, "broker": how, "messages": n, "group": group,
        "command": command(Path("<tmp>/state")), "produce_seconds": round(produce_s, 3),
        "changelog_offsets": [low, high],
        "fill": filled, "reopen": {k: v for k, v in reopen.items()}, "restore": restore,
        "restored": {"documents": docs, "records": records, "mb": mb, "seconds": seconds,
                     "launch_to_line_seconds": round(to_line, 3), "launch_to_assigned_seconds": round(restore_ready, 3),
                     "documents_per_second": round(docs / seconds, 1), "mb_per_second": round(mb / seconds, 2)},
        "reopen_launch_to_assigned_seconds": round(reopen_ready, 3),
        "state_dir_bytes": {"original_after_fill": size_a, "original_after_reopen": size_a_after, "restored": size_b},
        "environment": benchlib.environment(),
    }
    if args.json:
        benchlib.write_json(args.json, report)
        print(f"\nwrote {args.json}")
    return 0 if filled["exit_code"] == reopen["exit_code"] == restore["exit_code"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
