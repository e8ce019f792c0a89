"""The sharded stages through a real broker: throughput, CPU and bytes per document per
stage, memory per process, and agreement with one process.

Setup: the broker of ``kafka_e2e.start_broker`` (``NEARDUP_KAFKA_BOOTSTRAP``, or a local
one from a private cache). Input: ``--docs`` documents of the replayed Reuters stream
(``benchlib.replay_stream``, light edits), JSON ``{"id", "text"}`` keyed by id, produced
to a fresh topic of ``--input-partitions`` partitions *before* the stages start (a
backlog). Its output topics are created first.

For each count k of ``--processes``: k processes of each stage (``neardup stage prepare |
shard | decide``, each its own ``--instance``) are launched at once with a fresh
``--app`` (with ``--in-turn``, one of each, one after the other: prepare until its group
has committed the whole input and 2 s more, then shard until its group has committed the
whole band topic, then decide; a stage is stopped when the next starts, its CPU taken
then); the time is from the launch to the moment a ``read_committed`` reader of the
output topics has seen every input message (so Python start, group joins and the reorder
window's final flush are in it). Then, before SIGTERM: each process's CPU seconds
(user + system) and peak RSS (VmHWM). After: the committed records and bytes (key +
value) of every internal topic, per input document; and the verdict, match and cluster
of every output against ``Detector`` (one process, default settings) run over the same
documents in order-key order (record timestamp, partition, offset).

Printed: messages/s, CPU µs per document per stage, peak RSS per process, bytes per
document per topic, agreement; the load average before and after each run.

Latency at a paced load (``--paced`` M, 0 by default: off), the approach of
``kafka_e2e.py``'s phase 2. The backlog and the paced documents go to the input
partitions but the last ``--idle-partitions`` (document i to partition i mod the others;
the idle ones get no record at all). Once the reader has seen every backlog output, M more
documents of the replayed stream (the ones after the backlog) are produced at ``--rate``
per second (record timestamp = the ``produce()`` call, CreateTime, this machine's clock;
the producer connected and holding its producer id before the first) while the stages
keep running. The reader (``read_committed``, ``fetch.wait.max.ms`` 10)
keeps each output's record timestamp (CreateTime, stamped by decide's producer inside its
transaction) and its arrival (``time.time()``). Printed for the M paced documents, in ms:
p50 / p90 / p99 / max of *to output* (output record timestamp minus input record
timestamp) and *visible* (arrival at the reader minus input record timestamp: after
decide's transaction commit), *to output* again for the documents produced after the
paced phase's first second, where the time goes (per document, from the record timestamps
of the records the stages wrote for it: input to its last band record, to its last
finding, to its output), the processes per stage, the stages' CPU during the paced
phase (µs per paced document, and cores), and the load average before and after the paced
phase. The paced phase starts once every stage's consumer group is stable with all its
processes, each holding partitions, and 2 s more have passed (the shards' restores of the
partitions they were given): six processes started at once on 2 cores can still be joining
when a small backlog is done, and a rebalance in the paced phase is not its steady latency
(the wait is printed). Agreement with one process then covers the backlog and the paced documents. The
stages hold a band record until every input partition's watermark is past it, and an idle
partition's watermark is the wall clock minus ``--reorder-window-ms``: that window is a
floor under the paced latency.
"""

from __future__ import annotations

import argparse
import os
import signal
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from confluent_kafka import Consumer, ConsumerGroupState, KafkaError, Message, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

import benchlib
from kafka_e2e import encode, start_broker

from neardup.core.retention import Retention
from neardup.core.settings import EngineSettings
from neardup.core.types import Document
from neardup.detector import Detector
from neardup.sharded.reference import ShardedReference
from neardup.sharded.records import FINDINGS_KIND, KIND_HEADER, WATERMARK_KIND, order_key, parse_bands, parse_findings
from neardup.state.memory import MemoryStateStore

ROLES = ("prepare", "shard", "decide")


def create(bootstrap: str, topics: dict[str, int]) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for fut in admin.create_topics([NewTopic(t, num_partitions=n) for t, n in topics.items()]).values():
        fut.result(30)
    deadline = time.monotonic() + 30
    while not all(t in admin.list_topics(timeout=5).topics for t in topics):
        assert time.monotonic() < deadline
        time.sleep(0.1)


def produce(bootstrap: str, topic: str, messages: list[tuple[bytes, bytes]],
            spacing_ms: int = 0, partitions: int | None = None,
            rate: float | None = None, lag_ms: int = 0) -> dict[bytes, tuple[int, int, int]]:
    """Produce in order; the order key (timestamp, partition, offset) of each key. With
    ``spacing_ms``, record timestamps are set: ``spacing_ms`` apart, the last one now (a
    backlog spanning ``len(messages) * spacing_ms`` of record time). With ``partitions``,
    message i goes to partition i % ``partitions`` (else: the key's partition). With
    ``rate`` (messages/s), message i is produced ``i / rate`` s after the first, its record
    timestamp the time of its ``produce()`` call (``spacing_ms`` 0). With ``lag_ms`` (and
    ``spacing_ms`` and ``partitions``), partition k's records are stamped ``k * lag_ms``
    earlier: a backlog whose partitions lie minutes apart in record time, though produced
    side by side."""
    first = int(time.time() * 1000) - len(messages) * spacing_ms
    started = time.perf_counter()
    where: dict[bytes, tuple[int, int, int]] = {}

    def delivered(err, msg) -> None:  # type: ignore[no-untyped-def]
        assert err is None, err
        where[msg.key()] = (msg.timestamp()[1], msg.partition(), msg.offset())

    p = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True, "linger.ms": 20})
    if rate:  # paced: connected, with its producer id, before the first record is stamped
        p.list_topics(topic, timeout=10)
        p.produce(f"{topic}-warm-up", value=b"")  # a topic of its own (auto-created by the local broker)
        assert p.flush(30) == 0
    for i, (key, value) in enumerate(messages):
        if rate:
            wait = started + i / rate - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
        stamp = {"timestamp": first + i * spacing_ms} if spacing_ms else {}
        if partitions:
            stamp["partition"] = i % partitions
            if lag_ms and spacing_ms:
                stamp["timestamp"] -= (i % partitions) * lag_ms
        while True:
            try:
                p.produce(topic, key=key, value=value, on_delivery=delivered, **stamp)
                break
            except BufferError:
                p.poll(0.05)
        p.poll(0)
    assert p.flush(120) == 0
    return where


class Outputs(threading.Thread):
    """Reads the output topics (read_committed) and keeps each record's headers, record
    timestamp (ms) and arrival. ``fetch_wait_ms``: the consumer's ``fetch.wait.max.ms``
    (how long the broker may hold a fetch that has no data; small to time arrivals)."""

    def __init__(self, bootstrap: str, topics: list[str], fetch_wait_ms: int = 500) -> None:
        super().__init__(daemon=True)
        self.consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"bench-{uuid.uuid4().hex}",
                                  "auto.offset.reset": "earliest", "isolation.level": "read_committed",
                                  "fetch.wait.max.ms": fetch_wait_ms})
        self.consumer.subscribe(topics)
        self.records: list[tuple[bytes, dict[str, bytes]]] = []
        self.arrivals: list[float] = []  # perf_counter of each record's arrival here
        self.timestamps_ms: list[int] = []  # each record's timestamp (CreateTime: decide's produce)
        self.arrivals_ms: list[float] = []  # time.time() of each record's arrival here, in ms
        self.wait_s = min(0.2, fetch_wait_ms / 1000)
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            for m in self.consumer.consume(1000, timeout=self.wait_s):
                if m.error() is None:
                    self.records.append((m.key(), dict(m.headers() or [])))
                    self.arrivals.append(time.perf_counter())
                    self.timestamps_ms.append(m.timestamp()[1])
                    self.arrivals_ms.append(time.time() * 1000)
        self.consumer.close()


def committed_records(bootstrap: str, topic: str) -> Iterator[Message]:
    """Every committed record of every partition of ``topic``, from its start to its end
    (at most 300 s of reading)."""
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"bench-{uuid.uuid4().hex}",
                  "auto.offset.reset": "earliest", "isolation.level": "read_committed",
                  "enable.partition.eof": True})
    try:
        parts = c.list_topics(topic, timeout=10).topics[topic].partitions
        c.assign([TopicPartition(topic, p, 0) for p in parts])
        ended: set[int] = set()
        deadline = time.monotonic() + 300
        while len(ended) < len(parts) and time.monotonic() < deadline:
            for m in c.consume(10_000, timeout=1.0):
                err = m.error()
                if err is None:
                    yield m
                elif err.code() == KafkaError._PARTITION_EOF:
                    ended.add(m.partition())
    finally:
        c.close()


def stamps(bootstrap: str, topic: str, keys: Callable[[Message], list[bytes]]) -> dict[bytes, int]:
    """The latest record timestamp (CreateTime, ms: the producing stage's ``produce()``
    call) per key that ``keys`` finds in a committed record of ``topic``."""
    out: dict[bytes, int] = {}
    for m in committed_records(bootstrap, topic):
        for key in keys(m):
            out[key] = max(out.get(key, 0), m.timestamp()[1])
    return out


def stage_times(bootstrap: str, app: str, sent: dict[bytes, tuple[int, int, int]],
                outputs: dict[bytes, int]) -> dict[str, dict[str, float]]:
    """Where the time from input to output goes, per document of ``sent`` (key -> its
    order key's parts): ms from the input's CreateTime to its last band record's
    (prepare), from there to its last finding's (shard: the reorder hold, and the
    shards' batches), and from there to its output's (decide); quantiles of each."""
    bands = stamps(bootstrap, f"{app}.bands", lambda m: [] if dict(m.headers() or []).get(KIND_HEADER) == WATERMARK_KIND
                   else [rec.order for rec in parse_bands(m.value())])
    found = stamps(bootstrap, f"{app}.findings", lambda m: [
        f[0] for f in parse_findings(m.value())] if dict(m.headers() or []).get(KIND_HEADER) == FINDINGS_KIND else [])
    parts: dict[str, list[float]] = {"prepare": [], "shard": [], "decide": []}
    for key, (ts, partition, offset) in sent.items():
        order = order_key(ts, partition, offset)
        if order in bands and order in found and key in outputs:
            parts["prepare"].append(bands[order] - ts)
            parts["shard"].append(found[order] - bands[order])
            parts["decide"].append(outputs[key] - found[order])
    return {stage: benchlib.quantiles(v) for stage, v in parts.items()}


def topic_starts(bootstrap: str, topic: str) -> tuple[int, int]:
    """(offsets deleted from the start of ``topic``'s partitions, their end offsets), summed:
    a shard with a retention window deletes the band records it no longer needs, so
    ``topic_totals`` counts what the topic still holds, not what was written."""
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"starts-{uuid.uuid4().hex[:8]}"})
    try:
        parts = c.list_topics(topic, timeout=10).topics[topic].partitions
        marks = [c.get_watermark_offsets(TopicPartition(topic, q), timeout=10) for q in parts]
        return sum(low for low, _ in marks), sum(high for _, high in marks)
    finally:
        c.close()


def disk_bytes(log_dir: Path, app: str, names: list[str]) -> dict[str, int]:
    """Bytes of the log segments (``*.log``) of each internal topic on the broker's disk
    (``log_dir``, the broker's ``log.dirs``): the record batches as written, compressed
    when the producers compress (``key + value`` counts them uncompressed)."""
    return {name: sum(f.stat().st_size for d in log_dir.glob(f"{app}.{name}-*") for f in d.glob("*.log"))
            for name in names}


def topic_totals(bootstrap: str, topic: str) -> tuple[int, int]:
    """(records, key + value bytes) committed in every partition of ``topic``."""
    records = size = 0
    for m in committed_records(bootstrap, topic):
        records += 1
        size += len(m.key() or b"") + len(m.value() or b"")
    return records, size


def one_process(docs: list[Document], cluster_policy: str = "canonical", shards: int = 1,
                retention_s: float = 0.0) -> dict[str, tuple[str, str | None, str]]:
    """Verdict, match and cluster by id of ``docs`` (in order-key order) in one process;
    with ``retention_s``, the sharded rules with that window on their times
    (``ShardedReference``, which the tests hold the stages to)."""
    settings = EngineSettings(cluster_policy=cluster_policy)
    if retention_s:
        ref = ShardedReference(settings, shards, Retention(seconds=retention_s))
        return {v.id: (v.verdict, v.match, v.cluster) for v in ref.process(docs) if hasattr(v, "verdict")}
    docs = [Document(d.id, d.text) for d in docs]
    detector = Detector(settings, MemoryStateStore(settings.state_shape()))
    out = {}
    for i in range(0, len(docs), 2000):
        for v in detector.process(docs[i:i + 2000]):
            if hasattr(v, "verdict"):
                out[v.id] = (v.verdict, v.match, v.cluster)
    return out


def behind(bootstrap: str, group: str, topic: str) -> int:
    """Records of ``topic`` past consumer group ``group``'s committed offsets, summed over
    its partitions (a partition without a commit counts whole); the last offset of a
    partition written in transactions is its commit marker, which no one consumes, so a
    group that has read everything is 1 behind there."""
    reader = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "enable.auto.commit": False})
    try:
        parts = reader.list_topics(topic, timeout=10).topics[topic].partitions
        tps = [TopicPartition(topic, q) for q in parts]
        at = {tp.partition: tp.offset for tp in reader.committed(tps, timeout=10)}
        total = 0
        for q in parts:
            low, high = reader.get_watermark_offsets(TopicPartition(topic, q), timeout=10)
            total += high - (at[q] if at.get(q, -1) >= 0 else low)
        return total
    finally:
        reader.close()


def cpu_by_role(procs: dict[tuple[str, int], subprocess.Popen], gone: dict[str, float]) -> dict[str, float]:
    """CPU seconds (user + system) per stage: its live processes' and ``gone``'s."""
    return {role: gone[role] + sum(benchlib.proc_cpu_seconds(p.pid) or 0.0 for (r, _), p in procs.items() if r == role)
            for role in ROLES}


def run_config(args: argparse.Namespace, bootstrap: str, k: int, messages: list[tuple[bytes, bytes]],
               reference: dict[bytes, tuple[int, int, int]] | None, state_mode: str = "memory",
               paced: Sequence[tuple[bytes, bytes]] = ()) -> dict[str, object]:
    topic = f"bench-scale-{uuid.uuid4().hex[:8]}"
    app = f"bench-app-{uuid.uuid4().hex[:8]}"
    create(bootstrap, {topic: args.input_partitions, **{f"{topic}.{s}": 1 for s in ("unique", "duplicates", "dlq")}})
    fed = (args.input_partitions - args.idle_partitions if args.idle_partitions
           else args.input_partitions if args.partition_lag_s else None)
    where = produce(bootstrap, topic, messages, args.spacing_ms, partitions=fed,
                    lag_ms=round(args.partition_lag_s * 1000))
    reader = Outputs(bootstrap, [f"{topic}.unique", f"{topic}.duplicates", f"{topic}.dlq"],
                     fetch_wait_ms=10 if paced else 500)
    reader.start()
    load_before = os.getloadavg()
    log = open(args.log, "ab")
    procs: dict[tuple[str, int], subprocess.Popen] = {}
    state = Path(tempfile.mkdtemp(prefix="neardup-stage-state-")) if state_mode == "disk" else None
    started = time.perf_counter()
    spies: list[subprocess.Popen] = []
    def launch(role: str, i: int) -> None:
        extra = ["--state-dir", str(state / f"{role}-{i}")] if role != "prepare" and state is not None else []
        if args.chaos:  # static membership: a process restarted under its name gets its partitions back at once
            extra += ["-X", f"group.instance.id={app}-{role}-{i}", "-X", "session.timeout.ms=10000"]
        procs[(role, i)] = subprocess.Popen(
            [sys.executable, "-m", "neardup.cli", "stage", role, "--bootstrap-servers", bootstrap,
             "--input-topic", topic, "--app", app, "--shards", str(args.shards),
             "--decide-partitions", str(args.decide_partitions), "--instance", str(i),
             "--reorder-window-ms", str(args.reorder_window_ms), "--from-beginning",
             "--text-field", "text", "--id-field", "id", "--batch-size", str(args.batch_size),
             *(["--batch-max-ms", str(args.batch_max_ms)] if args.batch_max_ms else []),
             "--cluster-policy", args.cluster_policy, "--log-level", "WARNING", *args.stage_arg, *extra,
             *(["--retention", f"{args.retention_s:g}s"] if args.retention_s else [])],
            stdout=log, stderr=subprocess.STDOUT)
        if args.profile is not None:  # sampled from outside; it writes its profile when the stage exits
            args.profile.mkdir(parents=True, exist_ok=True)
            spies.append(subprocess.Popen(
                ["py-spy", "record", "--gil", "--rate", "200", "--format", "raw", "--pid", str(procs[(role, i)].pid),
                 "--output", str(args.profile / f"{role}-{i}-{procs[(role, i)].pid}.txt")],
                stdout=log, stderr=subprocess.STDOUT))

    n = len(messages)
    cpu_gone = {role: 0.0 for role in ROLES}  # CPU seconds of processes killed, or stopped when done (--in-turn)
    peak_gone: dict[str, float] = {}  # peak RSS MB of the processes stopped when done (--in-turn)
    stopped: list[subprocess.Popen] = []
    if args.in_turn:  # each stage alone with the broker, after the one before has done all of its work
        for role, topic_in, left in (("prepare", topic, 0), ("shard", f"{app}.bands", args.shards)):
            launch(role, 0)
            while behind(bootstrap, f"{app}.{role}", topic_in) > left:
                if procs[(role, 0)].poll() is not None or time.perf_counter() - started > args.timeout:
                    raise RuntimeError(f"{role} stopped or timed out before it had read {topic_in}; see {args.log}")
                time.sleep(0.5)
            time.sleep(2.0 if role == "prepare" else 0.5)  # prepare: its watermark records of partitions read to the end
            cpu_gone[role] = benchlib.proc_cpu_seconds(procs[(role, 0)].pid) or 0.0
            peak_gone[role] = benchlib.proc_status_mb(procs[(role, 0)].pid).get("VmHWM", 0.0)
            stopped.append(procs.pop((role, 0)))
            stopped[-1].send_signal(signal.SIGTERM)
        launch("decide", 0)
    else:
        for role in ROLES:
            for i in range(k):
                launch(role, i)
    chaos_done = not args.chaos
    while len(reader.records) < n:
        if not chaos_done and len(reader.records) >= 0.3 * n:
            # SIGKILL one process of each stage, restart it under its name, add a shard process
            for role in ROLES:
                cpu_gone[role] += benchlib.proc_cpu_seconds(procs[(role, 0)].pid) or 0.0
                procs[(role, 0)].send_signal(signal.SIGKILL)
                procs[(role, 0)].wait(30)
                launch(role, 0)
            launch("shard", k)
            chaos_done = True
            print(f"  killed and restarted prepare 0, shard 0, decide 0; added shard {k}, "
                  f"at {len(reader.records):,} outputs")
        dead = [key for key, p in procs.items() if p.poll() is not None]
        if dead or time.perf_counter() - started > args.timeout:
            for p in procs.values():  # the other stages would run on, orphaned
                p.send_signal(signal.SIGTERM)
            for p in procs.values():
                p.wait(60)
            raise RuntimeError(f"stopped: {dead}, {len(reader.records)} of {n} outputs; see {args.log}")
        time.sleep(0.05)
    seconds = time.perf_counter() - started
    arrivals = reader.arrivals[:n]  # stalls counted from the first output (start-up apart)
    stall = max((b - a for a, b in zip(arrivals, arrivals[1:])), default=0.0)
    cpu = cpu_by_role(procs, cpu_gone)
    latency: dict[str, object] = {}
    if paced:
        print(f"  groups stable with {k} process(es) each after {wait_stable(bootstrap, app, k, procs):.1f} s more",
              file=sys.stderr, flush=True)
        latency = paced_phase(args, bootstrap, topic, app, procs, reader, paced, fed, n, cpu_by_role(procs, cpu_gone), cpu_gone,
                              where)
        n += len(paced)
    rss = {role: max((benchlib.proc_status_mb(p.pid).get("VmHWM", 0.0) for (r, _), p in procs.items() if r == role),
                     default=peak_gone.get(role, 0.0)) for role in ROLES}
    for p in procs.values():
        p.send_signal(signal.SIGTERM)
    for p in [*procs.values(), *stopped]:
        p.wait(60)
    for p in spies:
        p.wait(60)
    load_after = os.getloadavg()
    state_bytes = {role: sum(f.stat().st_size for d in state.glob(f"{role}-*") for f in d.rglob("*") if f.is_file())
                   for role in ("shard", "decide")} if state is not None else {}
    if state is not None:
        shutil.rmtree(state)
    time.sleep(1)
    reader.stop.set()
    reader.join(10)
    keys = Counter(key for key, _ in reader.records)
    topics = {name: topic_totals(bootstrap, f"{app}.{name}")
              for name in ("bands", "sets", "findings", "decisions", "shard-changelog", "decide-changelog")}
    bands_deleted, bands_end = topic_starts(bootstrap, f"{app}.bands")
    disk = disk_bytes(args.broker_log_dir, app, list(topics)) if args.broker_log_dir else {}
    result: dict[str, object] = {
        "processes_per_stage": k, "chaos": args.chaos, "in_turn": args.in_turn, "longest_output_stall_seconds": stall,
        "first_output_seconds": arrivals[0] - started if arrivals else None, "state": state_mode, "state_bytes": state_bytes, "messages": n, "seconds": seconds, "messages_per_second": len(messages) / seconds,
        "outputs": sum(keys.values()), "outputs_repeated": sum(c - 1 for c in keys.values() if c > 1),
        "cpu_us_per_document": {r: 1e6 * c / len(messages) for r, c in cpu.items()},
        "peak_rss_mb_per_process": rss,
        "records_per_document": {t: r / n for t, (r, _) in topics.items()},
        "bytes_per_document": {t: b / n for t, (_, b) in topics.items()},
        "disk_bytes_per_document": {t: b / n for t, b in disk.items()},
        "band_offsets_deleted": bands_deleted, "band_offsets_end": bands_end,
        "load_before": load_before, "load_after": load_after,
    }
    if paced:
        result["paced"] = latency
    if reference is not None:
        order = sorted([*messages, *paced], key=lambda kv: where[kv[0]])
        import json

        docs = [Document(str(json.loads(v)["id"]), json.loads(v)["text"], where[k][0] / 1000) for k, v in order]
        truth = one_process(docs, args.cluster_policy, args.shards, args.retention_s)
        got = {key.decode(): (h["neardup-verdict"].decode(), h["neardup-match"].decode() or None,
                              h["neardup-cluster"].decode()) for key, h in reader.records if "neardup-verdict" in h}
        differ = [i for i in truth if got.get(i) != truth[i]]
        result["agreement"] = 1 - len(differ) / len(truth)
        result["verdict_agreement"] = sum(got.get(i, ("",))[0] == truth[i][0] for i in truth) / len(truth)
        result["cluster_agreement"] = sum(got.get(i, ("", "", ""))[2] == truth[i][2] for i in truth) / len(truth)
        result["differing"] = differ[:20]
    if args.with_run:
        result["run"] = one_run(bootstrap, topic, n, args.batch_size, args.retention_s)
    return result


def wait_stable(bootstrap: str, app: str, k: int, procs: dict[tuple[str, int], subprocess.Popen],
                timeout_s: float = 120.0, settle_s: float = 2.0) -> float:
    """Wait until the consumer group of every stage (``<app>.<role>``) is stable with ``k``
    members, each assigned at least one partition, then ``settle_s`` more; the seconds
    waited. Raises: RuntimeError: a stage process ended, or ``timeout_s`` passed."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    started = time.perf_counter()
    groups = [f"{app}.{role}" for role in ROLES]
    while True:
        dead = [key for key, p in procs.items() if p.poll() is not None]
        if dead or time.perf_counter() - started > timeout_s:
            raise RuntimeError(f"the stages' groups did not settle: ended {dead}")
        try:
            described = [f.result() for f in admin.describe_consumer_groups(groups, request_timeout=10).values()]
        except Exception:  # noqa: BLE001 - a group not yet known: asked again
            described = []
        if described and all(d.state == ConsumerGroupState.STABLE and len(d.members) == k
                             and all(m.assignment and m.assignment.topic_partitions for m in d.members)
                             for d in described):
            time.sleep(settle_s)
            return time.perf_counter() - started
        time.sleep(0.2)


def paced_phase(args: argparse.Namespace, bootstrap: str, topic: str, app: str, procs: dict[tuple[str, int], subprocess.Popen],
                reader: Outputs, paced: Sequence[tuple[bytes, bytes]], fed: int | None, n: int,
                cpu_before: dict[str, float], cpu_gone: dict[str, float],
                where: dict[bytes, tuple[int, int, int]]) -> dict[str, object]:
    """With the backlog's ``n`` outputs seen: produce ``paced`` at ``args.rate`` to the
    ``fed`` partitions, wait for their outputs (at most ``args.timeout`` s), and return the
    latencies in ms (``benchlib.quantiles``), where they went per stage (``stage_times``,
    reading the ``app``'s internal topics), the stages' CPU over the phase, and the load
    averages before and after it. ``where`` gets the paced records' order keys.

    Raises:
        RuntimeError: a stage process ended, or the outputs did not all come in time.
    """
    load_before = os.getloadavg()
    started = time.perf_counter()
    print(f"  producing {len(paced):,} paced documents at {args.rate:,.0f}/s ...", file=sys.stderr, flush=True)
    sent = produce(bootstrap, topic, paced, partitions=fed, rate=args.rate)
    produce_s = time.perf_counter() - started
    where.update(sent)
    m = n + len(paced)
    while len(reader.records) < m:
        dead = [key for key, p in procs.items() if p.poll() is not None]
        if dead or time.perf_counter() - started > args.timeout:
            raise RuntimeError(f"paced phase stopped: {dead}, {len(reader.records)} of {m} outputs; see {args.log}")
        time.sleep(0.05)
    seconds = time.perf_counter() - started
    cpu = cpu_by_role(procs, cpu_gone)
    load_after = os.getloadavg()
    out_ms: dict[bytes, int] = {}
    seen_ms: dict[bytes, float] = {}
    for (key, _), ts, seen in zip(reader.records, reader.timestamps_ms, reader.arrivals_ms):
        out_ms.setdefault(key, ts)  # the first output of a key (a repeat would be counted apart)
        seen_ms.setdefault(key, seen)
    keys = [key for key, _ in paced]
    to_output = [out_ms[key] - sent[key][0] for key in keys if key in out_ms]
    first = min(sent[key][0] for key in keys)
    settled = [out_ms[key] - sent[key][0] for key in keys if key in out_ms and sent[key][0] >= first + 1000]
    visible = [seen_ms[key] - sent[key][0] for key in keys if key in seen_ms]
    return {"documents": len(paced), "rate": args.rate, "idle_partitions": args.idle_partitions,
            "produce_seconds": produce_s, "seconds": seconds,
            "output_minus_input_ms": benchlib.quantiles(to_output),
            "output_minus_input_after_first_second_ms": benchlib.quantiles(settled),
            "stages_ms": stage_times(bootstrap, app, {key: sent[key] for key in keys}, out_ms),
            "visible_minus_input_ms": benchlib.quantiles(visible),
            "cpu_us_per_document": {r: 1e6 * (cpu[r] - cpu_before[r]) / len(paced) for r in ROLES},
            "cpu_cores": {r: (cpu[r] - cpu_before[r]) / seconds for r in ROLES},
            "load_before": load_before, "load_after": load_after}


def one_run(bootstrap: str, topic: str, n: int, batch_size: int, retention_s: float = 0.0) -> dict[str, float]:
    """``neardup run`` over the same input topic right after the stages, as a whole
    process (a group of its own, from the beginning, state on disk): its seconds from
    launch to the commit of every input offset, and its CPU per document."""
    group = f"bench-run-{uuid.uuid4().hex[:8]}"
    state = Path(tempfile.mkdtemp(prefix="neardup-run-state-"))
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": group})
    parts = [TopicPartition(topic, q) for q in c.list_topics(topic, timeout=10).topics[topic].partitions]
    ends = {tp.partition: c.get_watermark_offsets(tp, timeout=10)[1] for tp in parts}
    started = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "neardup.cli", "run", "--bootstrap-servers", bootstrap, "--input-topic", topic,
         "--group-id", group, "--from-beginning", "--text-field", "text", "--id-field", "id",
         "--unique-topic", f"{topic}.run-unique", "--duplicate-topic", f"{topic}.run-duplicates",
         "--dlq-topic", f"{topic}.run-dlq", "--batch-size", str(batch_size), "--state-dir", str(state),
         *(["--retention", f"{retention_s:g}s"] if retention_s else []),
         "--metrics-port", "0", "--log-level", "WARNING"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            done = {tp.partition: tp.offset for tp in c.committed(parts, timeout=10)}
            if all(done[q] >= end for q, end in ends.items()):
                break
            if proc.poll() is not None or time.perf_counter() - started > 900:
                raise RuntimeError(f"neardup run stopped or took too long at {done} of {ends}")
            time.sleep(0.2)
        seconds = time.perf_counter() - started
        cpu = benchlib.proc_cpu_seconds(proc.pid) or 0.0
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        c.close()
        shutil.rmtree(state, ignore_errors=True)
    return {"seconds": seconds, "messages_per_second": n / seconds, "cpu_us_per_document": 1e6 * cpu / n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", type=int, default=20_000)
    ap.add_argument("--processes", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--input-partitions", type=int, default=4)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--decide-partitions", type=int, default=4)
    ap.add_argument("--reorder-window-ms", type=int, default=500)
    ap.add_argument("--retention-s", type=float, default=0.0,
                    help="every stage (and --with-run's neardup run) with --retention of this many seconds; the "
                         "agreement is then with the sharded rules run in one process with that window, on the "
                         "record timestamps (0: no window)")
    ap.add_argument("--spacing-ms", type=int, default=0,
                    help="record timestamps this many ms apart (a backlog spanning docs x spacing of record time); "
                         "0: the producer's clock")
    ap.add_argument("--partition-lag-s", type=float, default=0.0,
                    help="with --spacing-ms: input partition k's records stamped k times this many seconds earlier "
                         "(message i to partition i %% partitions), so that partitions read side by side lie "
                         "minutes apart in record time (0: none)")
    ap.add_argument("--batch-size", type=int, default=500)
    ap.add_argument("--stage-arg", action="append", default=[],
                    help="an argument passed to every stage process as is (repeat it, e.g. --stage-arg=-X "
                         "--stage-arg=fetch.wait.max.ms=50)")
    ap.add_argument("--batch-max-ms", type=int, default=0,
                    help="the stages' longest wait to fill a batch, ms (0: their default)")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--with-run", action="store_true",
                    help="then neardup run over the same input topic, a whole process: its time and CPU per document")
    ap.add_argument("--cluster-policy", choices=["canonical", "components"], default="canonical",
                    help="the stages' and the one process's cluster policy")
    ap.add_argument("--chaos", action="store_true",
                    help="at 30%% of the outputs, SIGKILL one process of each stage and restart it under its name "
                         "(static membership), and add a shard process")
    ap.add_argument("--in-turn", action="store_true",
                    help="one process per stage, each started when the one before has done all of its work and "
                         "stopped then: each stage's CPU alone with the broker, not sharing the cores with the "
                         "others (messages/s then counts the three in turn)")
    ap.add_argument("--shared-broker", action="store_true")
    ap.add_argument("--broker-log-dir", type=Path, help="the broker's log.dirs (a local broker, e.g. "
                    ".cache/kafka/run/data of deploy/local/kafka.sh): also the internal topics' bytes on its disk, "
                    "as the producers wrote them (compressed)")
    ap.add_argument("--state", nargs="+", choices=["memory", "disk"], default=["memory"],
                    help="where the shard and decide stages keep their state: memory, or disk (--state-dir: "
                         "a RocksDB store per shard partition, and decide's decisions table); each is run")
    ap.add_argument("--paced", type=int, default=0, metavar="M",
                    help="after the backlog's outputs, M more documents at --rate per second: latency from input "
                         "to output (default 0: none)")
    ap.add_argument("--rate", type=float, default=500.0, help="paced documents per second (default 500)")
    ap.add_argument("--idle-partitions", type=int, default=0,
                    help="of the input partitions, how many (the last) get no record; document i goes to "
                         "partition i %% (partitions - idle) (default 0: the key's partition)")
    ap.add_argument("--profile", type=Path, default=None, metavar="DIR",
                    help="sample each stage process with py-spy (--gil, raw folded stacks into DIR; "
                         "its CPU per document is then not comparable)")
    ap.add_argument("--log", type=Path, default=Path("scale_out.log"))
    ap.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "scale_out.json")
    args = ap.parse_args()
    if not 0 <= args.idle_partitions < args.input_partitions:
        ap.error("--idle-partitions must be at least 0 and below --input-partitions")
    if args.paced < 0 or args.rate <= 0:
        ap.error("--paced must be at least 0 and --rate positive")
    if args.partition_lag_s and not args.spacing_ms:
        ap.error("--partition-lag-s needs --spacing-ms (record timestamps set by the producer)")
    if args.paced and (args.chaos or args.spacing_ms):
        ap.error("--paced goes with neither --chaos nor --spacing-ms")
    if args.in_turn and (args.chaos or args.paced or args.processes != [1]):
        ap.error("--in-turn goes with --processes 1 only, and neither --chaos nor --paced")
    bootstrap, how, _ = start_broker(args.shared_broker)
    source = benchlib.default_corpus()
    corpus = benchlib.load_corpus(source)
    stream = [encode(i, t) for i, t in benchlib.replay_stream(corpus, args.docs + args.paced)]
    messages, paced = stream[:args.docs], stream[args.docs:]
    print(f"{len(messages):,} documents of {source.name} replayed, {args.input_partitions} input partitions"
          f"{f' ({args.idle_partitions} idle)' if args.idle_partitions else ''}, {args.shards} shards, "
          f"{args.decide_partitions} decide partitions, reorder window {args.reorder_window_ms} ms"
          f"{f'; then {args.paced:,} paced at {args.rate:,.0f}/s' if args.paced else ''}; broker {how}; "
          f"nproc {os.cpu_count()}")
    runs = []
    for i, (k, mode) in enumerate((k, mode) for k in args.processes for mode in args.state):
        r = run_config(args, bootstrap, k, messages, reference={}, state_mode=mode, paced=paced)
        runs.append(r)
        print(f"\n{k} process(es) per stage{', one stage after the other' if args.in_turn else ''}, state in {mode}: {r['messages_per_second']:,.0f} messages/s "
              f"({r['seconds']:.1f} s "
              f"from launch), outputs {r['outputs']:,} (repeated {r['outputs_repeated']}), "
              f"load {r['load_before']} -> {r['load_after']}; longest output stall "
              f"{r['longest_output_stall_seconds']:.1f} s")
        print("  CPU µs per document: " + ", ".join(f"{s} {v:,.0f}" for s, v in r["cpu_us_per_document"].items()))
        print("  peak RSS MB per process: " + ", ".join(f"{s} {v:,.0f}" for s, v in r["peak_rss_mb_per_process"].items())
              + "".join(f"; {role} state on disk {b / 1e6:,.1f} MB" for role, b in r["state_bytes"].items()))
        print("  records / bytes per document: " + ", ".join(
            f"{t} {r['records_per_document'][t]:.2f} / {r['bytes_per_document'][t]:,.0f}" for t in r["bytes_per_document"]))
        if r["disk_bytes_per_document"]:
            print("  bytes per document on the broker's disk: " + ", ".join(
                f"{t} {v:,.0f}" for t, v in r["disk_bytes_per_document"].items())
                  + f"; all {sum(r['disk_bytes_per_document'].values()):,.0f}")
        if r.get("band_offsets_deleted"):
            print(f"  the band topic as it stands at the end: the shards deleted {r['band_offsets_deleted']:,} of its "
                  f"{r['band_offsets_end']:,} offsets (records no longer needed, with a retention window)")
        if "run" in r:
            print(f"  neardup run over the same topic right after: {r['run']['messages_per_second']:,.0f} messages/s "
                  f"({r['run']['seconds']:.1f} s from launch), CPU {r['run']['cpu_us_per_document']:,.0f} µs per document "
                  f"(the stages together: {sum(r['cpu_us_per_document'].values()):,.0f})")
        if "paced" in r:
            pc = r["paced"]
            print(f"  paced: {pc['documents']:,} documents at {pc['rate']:,.0f}/s over "
                  f"{args.input_partitions - args.idle_partitions} of {args.input_partitions} input partitions "
                  f"({pc['idle_partitions']} idle), {k} process(es) per stage, reorder window "
                  f"{args.reorder_window_ms} ms; produced in {pc['produce_seconds']:.1f} s, all outputs seen "
                  f"{pc['seconds']:.1f} s after the first; load {'/'.join(f'{x:.2f}' for x in pc['load_before'])} -> "
                  f"{'/'.join(f'{x:.2f}' for x in pc['load_after'])} (1/5/15 min)")
            for name, q in (("to output (output CreateTime - input CreateTime)", pc["output_minus_input_ms"]),
                            ("the same, documents produced after the first second",
                             pc["output_minus_input_after_first_second_ms"]),
                            ("visible (arrival at read_committed reader - input CreateTime)",
                             pc["visible_minus_input_ms"])):
                print(f"    {name}, ms: " + (", ".join(f"{s} {q[s]:,.0f}" for s in ("p50", "p90", "p99", "max"))
                                               + f" ({q['count']:,} documents)" if q["count"] else "none"))
            for stage, q in pc["stages_ms"].items():
                print(f"    of which {stage} (to its last record's CreateTime), ms: "
                      + (", ".join(f"{s} {q[s]:,.0f}" for s in ("p50", "p90", "p99", "max")) if q["count"] else "none"))
            print("    CPU µs per paced document: " + ", ".join(f"{s} {v:,.0f}" for s, v in pc["cpu_us_per_document"].items())
                  + "; cores: " + ", ".join(f"{s} {v:.2f}" for s, v in pc["cpu_cores"].items()))
        if "agreement" in r:
            print(f"  agreement with one process (verdict, match, cluster): {r['agreement']:.5f}; "
                  f"verdicts {r['verdict_agreement']:.5f}, clusters {r['cluster_agreement']:.5f}; "
                  f"differing: {r['differing'][:5]}")
    benchlib.write_json(args.json, {"environment": benchlib.environment(), "corpus": source.name, "docs": len(messages),
                                    "input_partitions": args.input_partitions, "shards": args.shards,
                                    "decide_partitions": args.decide_partitions,
                                    "reorder_window_ms": args.reorder_window_ms, "spacing_ms": args.spacing_ms,
                                    "partition_lag_s": args.partition_lag_s,
                                    "paced": args.paced, "rate": args.rate, "idle_partitions": args.idle_partitions,
                                    "runs": runs})


if __name__ == "__main__":
    main()
