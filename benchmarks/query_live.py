"""Queries on the live state of `neardup run` (POST /query, ``neardup.server.QueryServer``):
their latency while the consumer commits, and the consumer's throughput with and without
queries.

Setup: the broker of ``kafka_e2e.start_broker``. Input: the replayed Reuters stream
(``benchlib.replay_stream``, light edits), JSON ``{"id", "text"}``.

Two phases, each a fresh `neardup run` process (its own topic, group and state, with
``--query-port``), whole processes as a user runs them:

1. **Backlog**: ``--messages`` pre-produced; the time from the first committed offset to
   the last, without queries, then (another topic, the same messages) with ``--clients``
   threads querying back to back (each a text of the stream, ``k`` = 5). Printed: messages/s
   of each, and the query latencies of the second.
2. **Paced**: a backlog of ``--messages`` committed first (the state to query), then
   ``--paced`` messages produced at ``--rate`` messages/s while ``--clients`` threads query
   back to back; printed: query latency p50/p99/max, queries/s, and whether the consumer
   kept up (its committed offset at the end of the pacing against what was produced).

The load average is printed before and after each phase.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

import benchlib
from benchlib import wait_listening
from confluent_kafka import Producer
from kafka_e2e import (
    OffsetWatch,
    Sent,
    create_topics,
    encode,
    neardup_command,
    new_producer,
    produce_all,
    start_broker,
    wait_for,
)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Querier(threading.Thread):
    """Queries ``url`` back to back with the texts of ``texts`` until stopped; keeps each
    latency (seconds) and any status other than 200."""

    def __init__(self, url: str, texts: list[str], seed: int) -> None:
        super().__init__(daemon=True)
        self.url, self.texts, self.rng = url, texts, random.Random(seed)
        self.latencies: list[float] = []
        self.failures: list[str] = []
        self.stop_event = threading.Event()

    def run(self) -> None:
        while not self.stop_event.is_set():
            body = json.dumps({"text": self.rng.choice(self.texts), "k": 5}).encode()
            request = urllib.request.Request(self.url, data=body, headers={"Content-Type": "application/json"})
            started = time.perf_counter()
            try:
                with urllib.request.urlopen(request, timeout=30) as response:
                    response.read()
                self.latencies.append(time.perf_counter() - started)
            except Exception as exc:  # noqa: BLE001 - counted, the phase goes on
                self.failures.append(str(exc))
                time.sleep(0.1)


def _ms(values: list[float]) -> str:
    if not values:
        return "no query answered"
    a = np.asarray(values) * 1000
    return (f"p50 {np.percentile(a, 50):.1f} ms, p99 {np.percentile(a, 99):.1f} ms, max {a.max():.1f} ms "
            f"({len(a):,} queries)")


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _start(bootstrap: str, topic: str, tmp: Path, port: int) -> tuple[subprocess.Popen, str, Path]:
    group = f"bench-query-{uuid.uuid4().hex[:8]}"
    cmd = neardup_command(bootstrap, topic, group, tmp / f"state-{group}", None) + ["--query-port", str(port)]
    log = tmp / f"{group}.log"
    with open(log, "wb") as stream:
        proc = subprocess.Popen(cmd, stdout=stream, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return proc, group, log


@contextmanager
def _running(bootstrap: str, messages: list[tuple[bytes, bytes]], texts: list[str], clients: int,
             tmp: Path) -> Iterator[tuple[str, Producer, subprocess.Popen, OffsetWatch, Path, list[Querier]]]:
    """A fresh topic holding ``messages``, `neardup run` on it with ``--query-port``
    (listening), and ``clients`` queriers not yet started: (topic, producer, process,
    offset watch, log, queriers); stopped at the end."""
    topic = f"bench-query-{uuid.uuid4().hex[:10]}"
    create_topics(bootstrap, [topic])
    producer = new_producer(bootstrap)
    produce_all(producer, topic, messages, Sent())
    port = _free_port()
    proc, group, log = _start(bootstrap, topic, tmp, port)
    watch = OffsetWatch(bootstrap, group, topic)
    queriers = [Querier(f"http://127.0.0.1:{port}/query", texts, seed=i) for i in range(clients)]
    try:
        wait_listening(port, proc)
        yield topic, producer, proc, watch, log, queriers
    finally:
        for q in queriers:
            q.stop_event.set()
        proc.terminate()
        proc.wait(timeout=120)
        watch.close()


def backlog(bootstrap: str, messages: list[tuple[bytes, bytes]], texts: list[str], clients: int,
            tmp: Path) -> dict[str, object]:
    """Phase 1 with ``clients`` querying threads (0: none): messages/s from the first
    committed offset to the last, and the latencies."""
    with _running(bootstrap, messages, texts, clients, tmp) as (_, _, proc, watch, log, queriers):
        for q in queriers:
            q.start()
        done = wait_for(watch, len(messages), proc, 0.05, 1800, log, [0.0], [0.0])
    first = next((t, o) for t, o in watch.timeline if o > 0)
    rate = (len(messages) - first[1]) / (done - first[0]) if done > first[0] else float("nan")  # one batch: no rate
    latencies = [x for q in queriers for x in q.latencies]
    return {"clients": clients, "messages_per_s": rate, "latencies": latencies,
            "failures": sum(len(q.failures) for q in queriers)}


def paced(bootstrap: str, messages: list[tuple[bytes, bytes]], extra: list[tuple[bytes, bytes]], texts: list[str],
          rate: float, clients: int, tmp: Path) -> dict[str, object]:
    """Phase 2: the backlog committed, then ``extra`` at ``rate`` while ``clients`` query."""
    with _running(bootstrap, messages, texts, clients, tmp) as (topic, producer, proc, watch, log, queriers):
        wait_for(watch, len(messages), proc, 0.1, 1800, log, [0.0], [0.0])
        for q in queriers:
            q.start()
        started = time.time()
        produce_all(producer, topic, extra, Sent(), rate=rate)
        produced_s = time.time() - started
        at_end = watch.poll()
        for q in queriers:
            q.stop_event.set()
        caught_up = wait_for(watch, len(messages) + len(extra), proc, 0.05, 600, log, [0.0], [0.0])
    latencies = [x for q in queriers for x in q.latencies]
    return {"rate": len(extra) / produced_s, "latencies": latencies, "queries_per_s": len(latencies) / produced_s,
            "behind_at_end": len(messages) + len(extra) - at_end, "caught_up_after_s": caught_up - (started + produced_s),
            "failures": sum(len(q.failures) for q in queriers)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--messages", type=int, default=20_000, help="backlog messages (default 20,000)")
    p.add_argument("--paced", type=int, default=40_000, help="paced messages of phase 2 (default 40,000)")
    p.add_argument("--rate", type=float, default=2_000.0, help="paced messages per second (default 2,000)")
    p.add_argument("--clients", type=int, default=1, help="querying threads, each back to back (default 1)")
    p.add_argument("--shared-broker", action="store_true", help="the broker of the checkout's cache, not a private one")
    args = p.parse_args(argv)

    base = benchlib.load_corpus(benchlib.default_corpus())
    stream = [encode(i, t) for i, t in benchlib.replay_stream(base, args.messages + args.paced, "light", 1)]
    texts = [json.loads(v)["text"] for _, v in stream[: args.messages]]
    bootstrap, how, _ = start_broker(args.shared_broker)
    print(f"broker {bootstrap} ({how}); neardup at {benchlib.describe_git(benchlib.git_state())}", flush=True)
    with tempfile.TemporaryDirectory(prefix="neardup-bench-query-") as tmp:
        for clients in (0, args.clients):
            print(f"load before: {_load()}", flush=True)
            r = backlog(bootstrap, stream[: args.messages], texts, clients, Path(tmp))
            print(f"backlog of {args.messages:,}, {clients} querying client(s): {r['messages_per_s']:,.0f} messages/s"
                  + (f"; queries {_ms(r['latencies'])}, {r['failures']} failed" if clients else ""), flush=True)
            print(f"load after: {_load()}", flush=True)
        print(f"load before: {_load()}", flush=True)
        r = paced(bootstrap, stream[: args.messages], stream[args.messages:], texts, args.rate, args.clients, Path(tmp))
        print(f"paced {args.paced:,} at {r['rate']:,.0f} messages/s over a state of {args.messages:,}, "
              f"{args.clients} querying client(s): queries {_ms(r['latencies'])}, {r['queries_per_s']:.0f} queries/s, "
              f"{r['failures']} failed; {r['behind_at_end']:,} messages not yet committed when the pacing ended, "
              f"caught up {r['caught_up_after_s']:.1f} s later", flush=True)
        print(f"load after: {_load()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
