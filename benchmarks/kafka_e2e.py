"""End to end through Kafka: ``neardup run`` (exactly-once transactions) on a real local broker.

Setup. The broker is ``NEARDUP_KAFKA_BOOTSTRAP`` if that is set (never stopped), else
``bash deploy/local/kafka.sh start`` (a single-node KRaft broker) with its own cache
``NEARDUP_KAFKA_HOME=.cache/kafka-bench`` (jars hard-linked from ``.cache/kafka``): the
test suite freezes the broker of the default cache with SIGSTOP (tests/test_kafka_outage.py),
which would stall a benchmark sharing it; ``--shared-broker`` uses the default cache
anyway. The broker is stopped at the end if this script started it (one already running
from the same cache is reused and left running; ``--keep-broker`` keeps a started one). A fresh topic
``bench-e2e-<hex>`` with one partition is created, and its three output topics
(``.unique``, ``.duplicates``, ``.dlq``, one partition, CreateTime) likewise.

Input. ``--messages`` N (default 100,000) documents of the replayed Reuters stream
(``benchlib.replay_stream``: the 21,578 stories, then replays with one light edit each:
fix a typo, drop a word or add a footer line), each a JSON value ``{"id", "text"}`` with
key = id, produced *before* neardup starts (idempotent producer, ``linger.ms`` 20). The
producer's delivery reports give each input message's offset and CreateTime (the time of
the ``produce()`` call on this machine).

Phase 1, throughput (backlog). ``neardup run --from-beginning --text-field text
--id-field id --metrics-port 0`` (default batch size 2000, batch-max-ms 200) is started as
a subprocess with a fresh group, state directory and transactional id. The consumer
group's committed offset is polled every ``--poll-ms`` (100) ms; the run time is from just
before the process was launched (Python start, RocksDB open, group join included) to the
first poll showing the committed offset at N, so messages/s = N / that time. Also shown:
the start-up (launch to first committed offset seen) and the steady-state rate after it,
and the rate of the transactional run itself, from first consume to last commit:
N over the time from ``neardup run``'s "first messages consumed" log line (its clock
time, to the millisecond) to the first poll showing offset N (so up to ``--poll-ms``
late).
The peak RSS of the ``neardup run`` process (VmHWM, read at each poll) is reported.

Phase 2, latency at a paced load (``--paced`` M, default 5,000, 0 turns it off). Once the
backlog is committed, M more documents of the stream are produced at ``--rate`` (500)
messages/s while ``neardup run`` keeps running, and a ``read_committed`` reader in this
process (``fetch.wait.max.ms`` 10), positioned at the end of the output topics, records
when each output message arrives.

Then ``neardup run`` gets SIGTERM (it commits and exits) and every output topic is read
from the beginning with ``isolation.level=read_committed``.

Latency, all in milliseconds on this machine's clock:

- *input to output, backlog*: output CreateTime minus input CreateTime, for the N
  pre-produced messages. The output CreateTime is stamped by neardup's producer when it
  produces the message, inside the open transaction, before the RocksDB and Kafka commits.
  This includes the time the message waited in the topic before neardup even started, so
  it mostly measures the backlog.
- *since consumer start*: output CreateTime minus the launch time of ``neardup run``: when
  each backlog message was produced out, counted from the start of the consumer (the
  drain curve; its max is about the phase-1 run time).
- *per batch (consumer side)*: neardup produces a batch's messages in one loop, so the
  batches are recovered from the output CreateTimes in input-offset order (a jump of more
  than ``--batch-gap-ms`` 20 ms starts a new batch). The batch interval is the time
  between the first outputs of consecutive batches: consume + detect + produce of a batch
  plus the RocksDB and transaction commit of the one before. This is the consumer-side
  processing time of a batch while it is busy.
- *paced, to output*: output CreateTime minus input CreateTime for the M paced messages
  (waiting for the batch to fill or ``batch-max-ms``, detection, produce).
- *paced, visible*: arrival at the ``read_committed`` reader minus input CreateTime: when a
  downstream reader can see the verdict, after the transaction commit; the real
  end-to-end latency.

Verification: every input message (N + M) must appear exactly once across
unique/duplicates/dlq, with its key and value byte for byte; nothing else may appear.

Changelog. ``--changelog on|off`` passes through to ``neardup run`` (its default: on).
With the changelog on, after the run its topic (``<group>.neardup-changelog``) is read
from the beginning with ``read_committed``: its committed records, and the sum of their
key and value sizes (a tombstone counts its key), per document of the run (N + M). The
topic is read after SIGTERM, before compaction has touched anything but closed segments
(1 GB each by default, so none here).

Pipelined or not, changelog or not. ``--pipeline`` / ``--no-pipeline`` pass through to
``neardup run`` (its default: on; the worker's CPU is counted with the consumer's).
``--compare pipeline`` (or plain ``--compare``) runs the whole benchmark twice on one
broker, ``--no-pipeline`` then ``--pipeline``; ``--compare changelog`` runs it with
``--changelog off`` then ``--changelog on``. Each run has the same input and a fresh
topic, group and state; the two are printed side by side. On a 2-core machine the
pipeline needs the second core free, so note the load averages.

Usage: python benchmarks/kafka_e2e.py [--messages 100000] [--paced 5000 --rate 500]
       [--changelog on|off] [--compare [pipeline|changelog]] [--json OUT]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import numpy as np
from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402

KAFKA_SH = benchlib.REPO / "deploy" / "local" / "kafka.sh"
SUFFIXES = {"unique": ".unique", "duplicate": ".duplicates", "dlq": ".dlq"}


# --- broker and topics -------------------------------------------------------------------


SHARED_HOME = benchlib.REPO / ".cache" / "kafka"  # kafka.sh's default cache (tests use it)
PRIVATE_HOME = benchlib.REPO / ".cache" / "kafka-bench"


def _kafka_sh(*args: str, home: Path | None, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **({"NEARDUP_KAFKA_HOME": str(home)} if home else {})}
    return subprocess.run(["bash", str(KAFKA_SH), *args], cwd=benchlib.REPO, capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL, env=env)


def _seed_private_home() -> None:
    """Give the private cache the shared cache's jars (hard links, else copies), so that
    kafka.sh does not fetch them again with Maven."""
    src, dst = SHARED_HOME / "libs", PRIVATE_HOME / "libs"
    if (dst / ".complete").exists() or not (src / ".complete").exists():
        return
    PRIVATE_HOME.mkdir(parents=True, exist_ok=True)
    tmp = PRIVATE_HOME / f"libs.tmp.{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)

    def link(a: str, b: str) -> None:
        try:
            os.link(a, b)
        except OSError:
            shutil.copy2(a, b)

    shutil.copytree(src, tmp, copy_function=link)
    shutil.rmtree(dst, ignore_errors=True)
    tmp.rename(dst)


def start_broker(shared: bool) -> tuple[str, str, Path | None]:
    """(bootstrap, how, kafka.sh cache dir): how is ``external``, ``reused`` (already
    running from that cache) or ``started``."""
    external = os.environ.get("NEARDUP_KAFKA_BOOTSTRAP", "").strip()
    if external:
        return external, "external", None
    home = None if shared else PRIVATE_HOME
    if home is not None:
        _seed_private_home()
    already = _kafka_sh("status", home=home, timeout=60).returncode == 0
    proc = _kafka_sh("start", home=home)
    lines = [line.strip() for line in proc.stdout.splitlines() if line.strip()]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"kafka.sh start failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return lines[-1], "reused" if already else "started", home


def create_topics(bootstrap: str, names: list[str], timeout: float = 30.0, partitions: int = 1) -> None:
    """``names[0]`` with ``partitions`` partitions, the others with one."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    futures = admin.create_topics([NewTopic(n, num_partitions=partitions if i == 0 else 1, replication_factor=1)
                                   for i, n in enumerate(names)],
                                  operation_timeout=timeout, request_timeout=timeout)
    for fut in futures.values():
        fut.result(timeout=timeout)
    deadline = time.monotonic() + timeout
    while True:
        md = admin.list_topics(timeout=5)
        if all(n in md.topics and md.topics[n].error is None
               and all(p.leader >= 0 for p in md.topics[n].partitions.values()) for n in names):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"topics {names} not ready after {timeout}s")
        time.sleep(0.1)


def delete_topics(bootstrap: str, names: list[str]) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for fut in admin.delete_topics(names, operation_timeout=10).values():
        try:
            fut.result(timeout=15)
        except Exception:  # best effort
            pass


# --- producing ---------------------------------------------------------------------------


@dataclass
class Sent:
    """What the producer's delivery reports said about the input messages, by key."""

    offset: dict[bytes, int] = field(default_factory=dict)
    timestamp_ms: dict[bytes, int] = field(default_factory=dict)
    digest: dict[bytes, bytes] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    def delivered(self, err, msg) -> None:  # type: ignore[no-untyped-def]
        if err is not None:
            self.errors.append(str(err))
            return
        self.offset[msg.key()] = msg.offset()
        self.timestamp_ms[msg.key()] = msg.timestamp()[1]


def encode(doc_id: str, text: str) -> tuple[bytes, bytes]:
    return doc_id.encode("utf-8"), json.dumps({"id": doc_id, "text": text}, ensure_ascii=False).encode("utf-8")


def new_producer(bootstrap: str) -> Producer:
    return Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True, "linger.ms": 20})


def produce_all(producer: Producer, topic: str, messages: list[tuple[bytes, bytes]], sent: Sent,
                rate: float | None = None, partitions: int = 1) -> float:
    """Produce in order (at ``rate`` messages/s if given), message i to partition
    i % ``partitions``; returns the seconds taken."""
    started = time.perf_counter()
    for i, (key, value) in enumerate(messages):
        if rate:
            wait = started + i / rate - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
        sent.digest[key] = hashlib.blake2b(value, digest_size=16).digest()
        while True:
            try:
                producer.produce(topic, key=key, value=value, partition=i % partitions,
                                 on_delivery=sent.delivered)
                break
            except BufferError:
                producer.poll(0.05)
        producer.poll(0)
    if producer.flush(120) != 0:
        raise RuntimeError("not every input message was delivered")
    if sent.errors:
        raise RuntimeError(f"delivery errors: {sent.errors[:3]}")
    return time.perf_counter() - started


# --- reading -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Out:
    topic: str
    offset: int
    key: bytes | None
    digest: bytes
    timestamp_ms: int
    timestamp_type: int
    received_s: float


def _out(m, received: float) -> Out:  # type: ignore[no-untyped-def]
    ts_type, ts = m.timestamp()
    value = m.value() or b""
    return Out(m.topic(), m.offset(), m.key(), hashlib.blake2b(value, digest_size=16).digest(), ts, ts_type, received)


class LiveReader(threading.Thread):
    """A read_committed reader from the current end of ``topics``, recording arrivals."""

    def __init__(self, bootstrap: str, topics: list[str]) -> None:
        super().__init__(daemon=True)
        self.consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"bench-reader-{uuid.uuid4().hex[:8]}",
                                  "isolation.level": "read_committed", "enable.auto.commit": False,
                                  "fetch.wait.max.ms": 10})
        parts = []
        for t in topics:
            _low, high = self.consumer.get_watermark_offsets(TopicPartition(t, 0), timeout=10)
            parts.append(TopicPartition(t, 0, high))
        self.consumer.assign(parts)
        self.got: list[Out] = []
        self.stop_event = threading.Event()

    def run(self) -> None:
        try:
            while not self.stop_event.is_set():
                for m in self.consumer.consume(1000, timeout=0.02):
                    if m.error() is None:
                        self.got.append(_out(m, time.time()))
        finally:
            self.consumer.close()


def read_outputs(bootstrap: str, topics: list[str], expected: int, idle_s: float = 3.0,
                 timeout_s: float = 300.0) -> list[Out]:
    """Every committed message of ``topics`` from the beginning (read_committed)."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"bench-check-{uuid.uuid4().hex[:8]}",
                         "auto.offset.reset": "earliest", "isolation.level": "read_committed",
                         "enable.auto.commit": False})
    consumer.assign([TopicPartition(t, 0, 0) for t in topics])
    out: list[Out] = []
    deadline = time.monotonic() + timeout_s
    last = time.monotonic()
    try:
        while time.monotonic() < deadline:
            got = [m for m in consumer.consume(5000, timeout=0.5) if m.error() is None]
            now = time.time()
            if got:
                last = time.monotonic()
                out += [_out(m, now) for m in got]
            elif time.monotonic() - last > idle_s and len(out) >= expected:
                break
            elif time.monotonic() - last > 4 * idle_s + 10:
                break
    finally:
        consumer.close()
    return out


# --- the run -----------------------------------------------------------------------------


def neardup_command(bootstrap: str, topic: str, group: str, state_dir: Path, batch_size: int | None,
                    pipeline: bool | None = None, profile: Path | None = None,
                    changelog: str | None = None) -> list[str]:
    exe = Path(sys.executable).parent / "neardup"
    head = [str(exe)] if exe.exists() else ([shutil.which("neardup")] if shutil.which("neardup") else
                                             [sys.executable, "-m", "neardup.cli"])
    if profile is not None:  # the console script is a Python file: run it under cProfile
        head = [sys.executable, "-m", "cProfile", "-o", str(profile),
                *(head[1:] if head[0] == sys.executable else head)]
    cmd = [*head, "run", "--bootstrap-servers", bootstrap, "--input-topic", topic, "--group-id", group,
           "--state-dir", str(state_dir), "--from-beginning", "--text-field", "text", "--id-field", "id",
           "--metrics-port", "0"]
    if batch_size:
        cmd += ["--batch-size", str(batch_size)]
    if pipeline is not None:
        cmd.append("--pipeline" if pipeline else "--no-pipeline")
    if changelog is not None:
        cmd += ["--changelog", changelog]
    return cmd


def changelog_topic(group: str) -> str:
    """``neardup run``'s default changelog topic of consumer group ``group``."""
    return f"{group}.neardup-changelog"


@dataclass
class TopicBytes:
    """The committed records of one partition: count, key and value bytes, offsets."""

    records: int = 0
    key_bytes: int = 0
    value_bytes: int = 0
    tombstones: int = 0
    low: int = 0
    high: int = 0
    seconds: float = 0.0


def topic_bytes(bootstrap: str, topic: str, timeout_s: float = 600.0) -> TopicBytes:
    """Read partition 0 of ``topic`` from its first offset to its end (read_committed,
    up to the last stable offset) and count its records and their key and value bytes."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"bench-count-{uuid.uuid4().hex[:8]}",
                         "auto.offset.reset": "earliest", "isolation.level": "read_committed",
                         "enable.auto.commit": False, "enable.partition.eof": True,
                         "fetch.max.bytes": 64 << 20, "max.partition.fetch.bytes": 16 << 20})
    out = TopicBytes()
    started = time.perf_counter()
    try:
        out.low, out.high = consumer.get_watermark_offsets(TopicPartition(topic, 0), timeout=30)
        if out.high <= out.low:
            return out
        consumer.assign([TopicPartition(topic, 0, out.low)])
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            done = False
            for m in consumer.consume(10_000, timeout=1.0):
                err = m.error()
                if err is not None:
                    done = done or err.code() == KafkaError._PARTITION_EOF
                    continue
                value = m.value()
                out.records += 1
                out.key_bytes += len(m.key() or b"")
                if value is None:
                    out.tombstones += 1
                else:
                    out.value_bytes += len(value)
            if done:
                break
        else:
            raise TimeoutError(f"reading {topic} took more than {timeout_s} s")
    finally:
        consumer.close()
    out.seconds = time.perf_counter() - started
    return out


def first_consumed_at(log_lines: list[str]) -> float:
    """The time (epoch seconds) of ``neardup run``'s "first messages consumed" log line
    (text format: local ``asctime`` to the millisecond, this machine's clock); NaN if
    absent."""
    for line in log_lines:
        if "first messages consumed" in line:
            try:
                return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
            except ValueError:
                break
    return float("nan")


class OffsetWatch:
    """Polls the group's committed offsets of ``topic``'s first ``partitions`` partitions;
    their sum is the messages committed (one partition: its offset)."""

    def __init__(self, bootstrap: str, group: str, topic: str, partitions: int = 1) -> None:
        self.consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "enable.auto.commit": False})
        self.tps = [TopicPartition(topic, p) for p in range(partitions)]
        self.timeline: list[tuple[float, int]] = []

    def poll(self) -> int:
        try:
            offsets = [tp.offset for tp in self.consumer.committed(self.tps, timeout=10)]
            offset = sum(max(o, 0) for o in offsets) if any(o >= 0 for o in offsets) else -1
        except KafkaException:
            offset = -1
        self.timeline.append((time.time(), offset))
        return offset

    def close(self) -> None:
        self.consumer.close()


def wait_for(watch: OffsetWatch, target: int, proc: subprocess.Popen, poll_s: float, timeout_s: float,
             log: Path, peak: list[float], cpu: list[float]) -> float:
    """Poll until the committed offset reaches ``target``; returns that wall-clock time.
    ``cpu``: set to the CPU seconds of the process tree and of the main thread alone."""
    deadline = time.monotonic() + timeout_s
    last_print = 0.0
    while time.monotonic() < deadline:
        offset = watch.poll()
        status = benchlib.proc_status_mb(proc.pid)
        if "VmHWM" in status:
            peak[0] = max(peak[0], status["VmHWM"])
        seconds = tree_cpu_seconds(proc.pid)
        if seconds is not None:
            cpu[0] = seconds
            cpu[1] = benchlib.proc_cpu_seconds(proc.pid, proc.pid) or cpu[1]
        if offset >= target:
            return watch.timeline[-1][0]
        if proc.poll() is not None:
            raise RuntimeError(f"neardup run exited with {proc.returncode}; log:\n{log.read_text()[-3000:]}")
        if time.monotonic() - last_print > 10:
            last_print = time.monotonic()
            print(f"  committed offset {max(offset, 0):,} of {target:,}", file=sys.stderr, flush=True)
        time.sleep(poll_s)
    raise TimeoutError(f"committed offset did not reach {target} in {timeout_s} s; log:\n{log.read_text()[-3000:]}")


def tree_cpu_seconds(pid: int) -> float | None:
    """CPU seconds of ``pid`` and its live children (the pipeline's worker process)."""
    total = benchlib.proc_cpu_seconds(pid)
    if total is None:
        return None
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        children = []
    return total + sum(benchlib.proc_cpu_seconds(c) or 0.0 for c in children)


def batches_from_timestamps(out_ts: np.ndarray, gap_ms: float) -> list[tuple[int, int, int]]:
    """(first index, size, first output ms) of each batch; ``out_ts`` in input order."""
    starts = np.concatenate([[0], np.flatnonzero(np.diff(out_ts) > gap_ms) + 1])
    ends = np.concatenate([starts[1:], [len(out_ts)]])
    return [(int(s), int(e - s), int(out_ts[s:e].min())) for s, e in zip(starts, ends)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    default = benchlib.default_corpus()
    p.add_argument("--corpus", type=Path, default=default, help=f"JSONL.gz with id and text (default {default})")
    p.add_argument("--messages", type=int, default=100_000, help="pre-produced messages (default 100,000)")
    p.add_argument("--paced", type=int, default=5_000, help="messages produced at --rate after the backlog (default 5,000; 0: none)")
    p.add_argument("--rate", type=float, default=500.0, help="paced messages per second (default 500)")
    p.add_argument("--batch-size", type=int, help="neardup run --batch-size (default: neardup's, 2000)")
    p.add_argument("--partitions", type=int, default=1, help="partitions of the input topic (default 1)")
    p.add_argument("--idle-partitions", type=int, default=0,
                   help="of them, how many get no message (default 0); message i goes to partition "
                        "i %% (partitions - idle)")
    p.add_argument("--pipeline", action=argparse.BooleanOptionalAction, default=None,
                   help="neardup run --pipeline / --no-pipeline (default: neardup's, on)")
    p.add_argument("--changelog", choices=["on", "off"],
                   help="neardup run --changelog (default: neardup's, on); on: its topic's records and bytes are counted")
    p.add_argument("--compare", nargs="?", const="pipeline", choices=list(COMPARE),
                   help="run twice on the same broker and print the two side by side (--json: both reports): "
                        "pipeline (the default) = --no-pipeline then --pipeline; changelog = --changelog off then on; "
                        "same input, fresh topic, group and state each")
    p.add_argument("--poll-ms", type=float, default=100.0, help="committed-offset poll interval (default 100)")
    p.add_argument("--batch-gap-ms", type=float, default=20.0, help="output-timestamp jump that starts a batch (default 20)")
    p.add_argument("--seed", type=int, default=1, help="seed of the edits (default 1)")
    p.add_argument("--timeout", type=float, default=1800.0, help="give up after this many seconds per phase (default 1800)")
    p.add_argument("--keep-broker", action="store_true", help="leave a broker this script started running")
    p.add_argument("--shared-broker", action="store_true",
                   help="use kafka.sh's default cache (.cache/kafka, the one the tests use) instead of the private "
                        ".cache/kafka-bench")
    p.add_argument("--keep-topics", action="store_true", help="do not delete the topics at the end")
    p.add_argument("--json", type=Path, help="also write the numbers as JSON here")
    p.add_argument("--profile", type=Path,
                   help="run neardup under cProfile and write its stats here (main process only; slows it)")
    args = p.parse_args(argv)
    if not 0 <= args.idle_partitions < args.partitions:
        p.error("--idle-partitions must be at least 0 and below --partitions")
    if args.messages < 1 or args.paced < 0 or args.rate <= 0:
        p.error("--messages must be at least 1, --paced at least 0, --rate positive")
    return args


def ms_row(name: str, values: np.ndarray | list[float]) -> list[str]:
    q = benchlib.quantiles(values)
    if not q["count"]:
        return [name, "-", "-", "-", "-", "0"]
    return [name, *(f"{q[k]:,.0f}" for k in ("p50", "p90", "p99", "max")), f"{q['count']:,}"]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.compare:
        return compare(args)
    rc, report = run(args)
    if args.json:
        benchlib.write_json(args.json, report)
        print(f"\nwrote {args.json}")
    return rc


#: ``--compare`` kinds: the two runs, each (column label, the arguments it overrides).
COMPARE: dict[str, list[tuple[str, dict[str, object]]]] = {
    "pipeline": [("--no-pipeline", {"pipeline": False}), ("--pipeline", {"pipeline": True})],
    "changelog": [("--changelog off", {"changelog": "off"}), ("--changelog on", {"changelog": "on"})],
}


def compare(args: argparse.Namespace) -> int:
    """``run`` twice on one broker (``COMPARE[args.compare]``); a side-by-side table."""
    reports, rcs = {}, []
    keep = args.keep_broker
    started = False
    labels = [label for label, _ in COMPARE[args.compare]]
    for label, overrides in COMPARE[args.compare]:
        print(f"\n=== neardup run {label} ===", flush=True)
        one = argparse.Namespace(**{**vars(args), **overrides, "compare": None, "keep_broker": True})
        rc, reports[label] = run(one)
        rcs.append(rc)
        started = started or reports[label]["broker"] == "started"
    if started and not keep:
        _kafka_sh("stop", home=None if args.shared_broker else PRIVATE_HOME, timeout=120)
        print("broker stopped", file=sys.stderr)

    def row(name: str, get) -> list[str]:  # type: ignore[no-untyped-def]
        return [name, *(get(reports[k]) for k in labels)]

    def cl(key: str, fmt: str):  # type: ignore[no-untyped-def]
        return lambda r: format(r["changelog"][key], fmt) if r.get("changelog") else "-"

    def ms(key: str, q: str):  # type: ignore[no-untyped-def]
        return lambda r: f"{r['latency_ms'][key][q]:,.0f}" if r["latency_ms"][key]["count"] else "-"

    rows = [
        row("messages/s (launch -> offset N)", lambda r: f"{r['messages_per_second']:,.0f}"),
        row("messages/s steady (first commit -> N)", lambda r: f"{r['steady_messages_per_second']:,.0f}"),
        row("messages/s (first consume -> N)", lambda r: f"{r['first_consume_messages_per_second']:,.0f}"),
        row("CPU s in phase 1 (neardup run and its worker)", lambda r: f"{r['cpu_seconds_phase1']:.1f}"),
        row("peak RSS MB (main process)", lambda r: f"{r['peak_rss_mb']:,.0f}"),
        row("load average at launch / at offset N",
            lambda r: f"{r['loadavg_launch'][0]:.2f} / {r['loadavg_phase1_end'][0]:.2f}"),
    ]
    for key, name in (("backlog_batch_interval", "batch interval"),
                      ("backlog_output_minus_input", "backlog output - input"),
                      ("paced_output_minus_input", "paced output - input"),
                      ("paced_visible_minus_input", "paced visible - input")):
        for q in ("p50", "p99"):
            rows.append(row(f"{name} {q}, ms", ms(key, q)))
    rows += [
        row("changelog records per document", cl("records_per_document", ".2f")),
        row("changelog bytes per document (key + value)", cl("bytes_per_document", ",.0f")),
        row("changelog MB (committed records, key + value)", lambda r: f"{(r['changelog']['key_bytes'] + r['changelog']['value_bytes']) / 1e6:,.1f}" if r.get("changelog") else "-"),
        row("exactly once", lambda r: "OK" if r["verification"]["ok"] else "FAILED"),
    ]
    a, b = (reports[k] for k in labels)
    for key, name in (("messages_per_second", "launch -> offset N"),
                      ("first_consume_messages_per_second", "first consume -> offset N")):
        rows.append([f"{labels[1]} vs {labels[0]}, messages/s {name}", "",
                     f"{100 * (b[key] / a[key] - 1):+.1f}%"])
    print(f"\nside by side ({args.messages:,} backlog messages, {args.paced:,} paced at {args.rate:,.0f}/s; "
          f"{os.cpu_count()} CPUs):")
    print(benchlib.table(["", *labels], rows))
    if args.json:
        benchlib.write_json(args.json, {"benchmark": f"kafka_e2e --compare {args.compare}", "runs": reports})
        print(f"\nwrote {args.json}")
    return max(rcs)


def run(args: argparse.Namespace) -> tuple[int, dict[str, object]]:
    """One benchmark run (see the module docstring): exit code and the report."""
    n, m = args.messages, args.paced
    base = benchlib.load_corpus(args.corpus)
    stream = [encode(i, t) for i, t in benchlib.replay_stream(base, n + m, "light", args.seed)]
    backlog, paced = stream[:n], stream[n:]

    bootstrap, how, home = start_broker(args.shared_broker)
    where = "" if home is None else f" from {home.relative_to(benchlib.REPO)}"
    print(f"broker {bootstrap} ({how}{where}{', stopped at the end' if how == 'started' and not args.keep_broker else ''})",
          flush=True)
    topic = f"bench-e2e-{uuid.uuid4().hex[:10]}"
    outputs = {k: topic + s for k, s in SUFFIXES.items()}
    group = f"bench-e2e-{uuid.uuid4().hex[:8]}"
    report: dict[str, object] = {"benchmark": "kafka_e2e", "broker": how, "topic": topic, "group": group}
    proc = None
    try:
        create_topics(bootstrap, [topic, *outputs.values()], partitions=args.partitions)
        fed = args.partitions - args.idle_partitions
        report["partitions"], report["idle_partitions"] = args.partitions, args.idle_partitions
        sent = Sent()
        producer = new_producer(bootstrap)
        produce_s = produce_all(producer, topic, backlog, sent, partitions=fed)
        mb = sum(len(v) for _, v in backlog) / 1e6
        print(f"pre-produced {n:,} messages ({mb:.1f} MB of JSON values) to {topic} in {produce_s:.1f} s", flush=True)

        with tempfile.TemporaryDirectory(prefix="neardup-bench-e2e-") as tmp:
            log = Path(tmp) / "neardup-run.log"
            cmd = neardup_command(bootstrap, topic, group, Path(tmp) / "state", args.batch_size, args.pipeline,
                                  args.profile, args.changelog)
            git = benchlib.git_state()
            print(f"neardup at {benchlib.describe_git(git)}")
            print("$ " + " ".join(cmd[:1] + [c if c != str(Path(tmp) / "state") else "<tmp>/state" for c in cmd[1:]]),
                  flush=True)
            watch = OffsetWatch(bootstrap, group, topic, args.partitions)
            peak, cpu = [0.0], [0.0, 0.0]
            load_start = os.getloadavg()
            launched = time.time()
            with open(log, "wb") as log_stream:
                proc = subprocess.Popen(cmd, stdout=log_stream, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        env={**os.environ, "PYTHONUNBUFFERED": "1"})
            done = wait_for(watch, n, proc, args.poll_ms / 1000, args.timeout, log, peak, cpu)
            cpu_phase1, main_cpu_phase1, load_phase1 = cpu[0], cpu[1], os.getloadavg()
            first = next((t, o) for t, o in watch.timeline if o > 0)
            run_s = done - launched
            steady = (n - first[1]) / (done - first[0]) if done > first[0] else float("nan")

            reader = None
            paced_s = 0.0
            if m:
                reader = LiveReader(bootstrap, list(outputs.values()))
                reader.start()
                time.sleep(0.5)
                print(f"producing {m:,} paced messages at {args.rate:,.0f}/s ...", file=sys.stderr, flush=True)
                paced_s = produce_all(producer, topic, paced, sent, rate=args.rate, partitions=fed)
                wait_for(watch, n + m, proc, args.poll_ms / 1000, args.timeout, log, peak, cpu)
                deadline = time.monotonic() + 30
                while len(reader.got) < m and time.monotonic() < deadline:
                    time.sleep(0.1)
                reader.stop_event.set()
                reader.join(10)
            watch.close()
            proc.send_signal(signal.SIGTERM)
            rc = proc.wait(timeout=120)
            proc = None
            log_lines = log.read_text(errors="replace").splitlines()
            log_tail = log_lines[-5:]
            first_consume = first_consumed_at(log_lines)

        got = read_outputs(bootstrap, list(outputs.values()), n + m)
        logged = topic_bytes(bootstrap, changelog_topic(group)) if args.changelog != "off" else None

        # --- verification ------------------------------------------------------------------
        counts = Counter(o.key for o in got)
        by_topic = Counter(o.topic for o in got)
        expected_keys = set(sent.offset)
        missing = expected_keys - set(counts)
        repeated = {k: c for k, c in counts.items() if c > 1}
        unexpected = set(counts) - expected_keys
        altered = sum(1 for o in got if o.key in sent.digest and o.digest != sent.digest[o.key])
        ok = not missing and not repeated and not unexpected and not altered and len(got) == n + m
        by_key = {o.key: o for o in got}

        # --- latencies ---------------------------------------------------------------------
        keys_in_order = [k for k, _ in backlog]
        in_ts = np.array([sent.timestamp_ms[k] for k in keys_in_order], dtype=np.float64)
        out_ts = np.array([by_key[k].timestamp_ms if k in by_key else np.nan for k in keys_in_order])
        e2e = out_ts - in_ts
        since_start = out_ts - launched * 1000
        batches = batches_from_timestamps(np.nan_to_num(out_ts, nan=0.0), args.batch_gap_ms)
        intervals = [b[2] - a[2] for a, b in zip(batches, batches[1:])]
        sizes = [b[1] for b in batches]
        paced_out, paced_visible = [], []
        if m and reader is not None:
            arrived = {o.key: o for o in reader.got}
            for k, _ in paced:
                if k in by_key:
                    paced_out.append(by_key[k].timestamp_ms - sent.timestamp_ms[k])
                if k in arrived:
                    paced_visible.append(arrived[k].received_s * 1000 - sent.timestamp_ms[k])
        ts_types = Counter(o.timestamp_type for o in got)
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
        if not args.keep_topics:
            try:
                delete_topics(bootstrap, [topic, *outputs.values(),
                                          *([changelog_topic(group)] if args.changelog != "off" else [])])
            except Exception as exc:  # best effort
                print(f"deleting the topics failed: {exc}", file=sys.stderr)
        if how == "started" and not args.keep_broker:
            _kafka_sh("stop", home=home, timeout=120)
            print("broker stopped", file=sys.stderr)

    # --- report ----------------------------------------------------------------------------
    consumed_rate = n / (done - first_consume) if done > first_consume else float("nan")
    print()
    print(benchlib.table(
        ["phase", "messages", "seconds", "messages/s"],
        [["produce backlog (before neardup starts)", f"{n:,}", f"{produce_s:.1f}", f"{n / produce_s:,.0f}"],
         ["neardup run: launch -> committed offset N", f"{n:,}", f"{run_s:.1f}", f"{n / run_s:,.0f}"],
         ["  start-up: launch -> first commit seen", f"{first[1]:,}", f"{first[0] - launched:.1f}", ""],
         ["  start-up: launch -> first consume", "", f"{first_consume - launched:.1f}", ""],
         ["first consume -> committed offset N", f"{n:,}", f"{done - first_consume:.1f}", f"{consumed_rate:,.0f}"],
         ["  steady: first commit -> offset N", f"{n - first[1]:,}", f"{done - first[0]:.1f}", f"{steady:,.0f}"],
         *([[f"paced produce at {args.rate:,.0f}/s", f"{m:,}", f"{paced_s:.1f}", f"{m / paced_s:,.0f}"]] if m else [])]))
    print(f"neardup run: exit code {rc} after SIGTERM; peak RSS (VmHWM) {peak[0]:,.0f} MB; "
          f"committed offset polled every {args.poll_ms:.0f} ms")
    print(f"neardup run CPU in phase 1: {cpu_phase1:.1f} s over {run_s:.1f} s wall ({100 * cpu_phase1 / run_s:.0f}% of a core; with its worker process, if any), "
          f"{main_cpu_phase1:.1f} s of it in the main thread (consume, state, produce; "
          f"{1e6 * main_cpu_phase1 / n:.0f} us per message); "
          f"load average {load_start[0]:.2f} at launch, {load_phase1[0]:.2f} at offset N ({os.cpu_count()} CPUs)")
    print("\nlatency, ms (this machine's clock; see the docstring for each definition):")
    print(benchlib.table(["latency", "p50", "p90", "p99", "max", "count"], [
        ms_row("backlog: output CreateTime - input CreateTime", e2e[~np.isnan(e2e)]),
        ms_row("backlog: output CreateTime - consumer launch", since_start[~np.isnan(since_start)]),
        ms_row("backlog: batch interval (consumer side, per batch)", intervals),
        *([ms_row(f"paced {args.rate:,.0f}/s: output CreateTime - input CreateTime", paced_out),
           ms_row(f"paced {args.rate:,.0f}/s: visible to read_committed - input CreateTime", paced_visible)] if m else []),
    ]))
    print(f"backlog batches recovered from output timestamps: {len(batches):,}, "
          f"{np.mean(sizes):,.0f} messages each on average (gap > {args.batch_gap_ms:.0f} ms)")
    print("\nverification (read_committed, every output topic from the beginning):")
    print(benchlib.table(["topic", "messages"], [[t, f"{by_topic.get(t, 0):,}"] for t in outputs.values()]
                         + [["total", f"{len(got):,}"]]))
    print(f"inputs {n + m:,}; missing {len(missing):,}; more than once {len(repeated):,}; "
          f"unknown keys {len(unexpected):,}; value changed {altered:,}; output timestamp types {dict(ts_types)} "
          f"(1 = CreateTime) -> {'OK: every input exactly once' if ok else 'FAILED'}")
    changelog: dict[str, object] | None = None
    if logged is not None:
        changelog = {"topic": changelog_topic(group), "records": logged.records, "tombstones": logged.tombstones,
                     "key_bytes": logged.key_bytes, "value_bytes": logged.value_bytes,
                     "low_offset": logged.low, "high_offset": logged.high, "documents": n + m,
                     "records_per_document": round(logged.records / (n + m), 3),
                     "bytes_per_document": round((logged.key_bytes + logged.value_bytes) / (n + m), 1)}
        print(f"\nchangelog {changelog['topic']} (read_committed from offset {logged.low:,} to {logged.high:,} "
              f"in {logged.seconds:.1f} s): {logged.records:,} records ({logged.tombstones:,} tombstones), "
              f"{(logged.key_bytes + logged.value_bytes) / 1e6:,.1f} MB (keys {logged.key_bytes / 1e6:,.1f} MB); "
              f"per document of the run ({n + m:,}): {changelog['records_per_document']:.2f} records, "
              f"{changelog['bytes_per_document']:,.0f} bytes")
    if rc != 0:
        print("neardup run log tail:\n  " + "\n  ".join(log_tail))

    report.update({
        "git": git,
        "command": cmd,
        "messages": n, "paced": m, "rate": args.rate,
        "produce_seconds": round(produce_s, 3),
        "run_seconds": round(run_s, 3),
        "messages_per_second": round(n / run_s, 1),
        "startup_seconds": round(first[0] - launched, 3),
        "first_committed_offset": first[1],
        "steady_messages_per_second": round(steady, 1),
        "first_consume_seconds": round(first_consume - launched, 3),
        "first_consume_messages_per_second": round(consumed_rate, 1),
        "peak_rss_mb": round(peak[0], 1),
        "cpu_seconds_phase1": round(cpu_phase1, 2),
        "main_thread_cpu_seconds_phase1": round(main_cpu_phase1, 2),
        "loadavg_launch": load_start, "loadavg_phase1_end": load_phase1,
        "exit_code": rc,
        "changelog_flag": args.changelog,
        "changelog": changelog,
        "latency_ms": {
            "backlog_output_minus_input": benchlib.quantiles(e2e[~np.isnan(e2e)]),
            "backlog_output_minus_launch": benchlib.quantiles(since_start[~np.isnan(since_start)]),
            "backlog_batch_interval": benchlib.quantiles(intervals),
            "paced_output_minus_input": benchlib.quantiles(paced_out),
            "paced_visible_minus_input": benchlib.quantiles(paced_visible),
        },
        "batches": {"count": len(batches), "mean_size": float(np.mean(sizes)), "gap_ms": args.batch_gap_ms},
        "committed_offset_timeline": [(round(t - launched, 3), o) for t, o in watch.timeline],
        "verification": {"ok": ok, "outputs": dict(by_topic), "total": len(got), "missing": len(missing),
                         "repeated": len(repeated), "unexpected": len(unexpected), "altered": altered},
        "environment": benchlib.environment(),
    })
    return (0 if ok and rc == 0 else 1), report


if __name__ == "__main__":
    sys.exit(main())
