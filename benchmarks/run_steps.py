"""``neardup run``'s batch steps in this process: the CPU of the consumer's main thread per
message, without the noise of a whole run.

``kafka_e2e.py`` times the whole process, whose rate moves by 10-20% from one run to the
next on a 2-core machine (the broker, librdkafka's threads and the worker share it). This
script runs the steps that the main thread of ``neardup run`` runs for each batch, in order,
over the same messages each time, and measures that thread's CPU alone
(``time.thread_time``):

- ``read``: ``DedupProcessor.read`` (replays marked; decoding, in this version or later);
- ``compute``: ``DedupProcessor.compute`` (decoding, preparing, the detector's verdicts;
  without ``--pipeline`` the preparation is in it, as for a batch ``neardup run`` prepares
  itself);
- ``write``: ``DedupProcessor.write``: every record produced (a real producer, not
  transactional: no transaction is open), the state committed to a real RocksDB store,
  and the delivery reports served (``Producer.poll``) after it.

Input: ``--messages`` documents of the replayed Reuters stream (``benchlib.replay_stream``),
JSON ``{"id", "text"}`` keyed by id, as ``confluent_kafka.Message`` objects of one
partition of a fresh topic (offsets 0, 1, ...; CreateTime timestamps), in batches of
``--batch-size``. The output topics are created on the broker (``NEARDUP_KAFKA_BOOTSTRAP``,
required) before, deleted after. The changelog is off (it needs a transaction).

Printed: µs of main-thread CPU per message per step, the fastest and the median of
``--rounds`` rounds (each over a fresh store), and the load average. Compare two versions
by running this script with each one's ``src`` on ``PYTHONPATH``, in turn.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

from confluent_kafka import Message, Producer

import benchlib
from kafka_e2e import create_topics, delete_topics, encode


def run_round(bootstrap: str, topic: str, messages: list[Message], batch: int, pipeline: bool) -> dict[str, float]:
    from neardup.config import Settings  # noqa: PLC0415 - the version on PYTHONPATH
    from neardup.detector import Detector  # noqa: PLC0415
    from neardup.run import DedupProcessor  # noqa: PLC0415
    from neardup.state.rocksdb import RocksDBStateStore  # noqa: PLC0415

    settings = Settings(bootstrap_servers=bootstrap, input_topics=[topic], text_field=["text"], id_field="id",
                        changelog="off", pipeline=pipeline)
    engine = settings.engine()
    spent = {"read": 0.0, "compute": 0.0, "write": 0.0}
    with tempfile.TemporaryDirectory() as tmp, RocksDBStateStore(Path(tmp) / "state", engine.state_shape()) as store:
        processor = DedupProcessor(settings, Detector(engine, store))
        processor.open()
        producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})
        try:
            if processor.worker is not None:  # started: batches go to it, as in a run
                deadline = time.monotonic() + 60
                while not processor.worker.ready():
                    if time.monotonic() > deadline:
                        raise TimeoutError("the worker did not start in 60 s")
                    time.sleep(0.05)
            batches = [messages[i:i + batch] for i in range(0, len(messages), batch)]
            clock = time.thread_time
            t0 = clock()
            ahead = processor.read(batches[0], True)
            spent["read"] += clock() - t0
            for k in range(len(batches)):
                current = ahead
                t0 = clock()
                processor.take(current)
                if k + 1 < len(batches):
                    ahead = processor.read(batches[k + 1], True)
                    processor.ahead(ahead)
                t1 = clock()
                work = processor.compute(current)
                t2 = clock()
                written = processor.write(work, producer)
                producer.poll(0)
                spent["read"] += t1 - t0
                spent["compute"] += t2 - t1
                spent["write"] += clock() - t2
                processor.committed(written, 0.0)
            producer.flush(60)
        finally:
            processor.close()
    return {step: 1e6 * seconds / len(messages) for step, seconds in spent.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--messages", type=int, default=40_000)
    ap.add_argument("--batch-size", type=int, default=2000, help="neardup run's default, 2000")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--pipeline", action=argparse.BooleanOptionalAction, default=True,
                    help="decode and prepare in the worker process, as neardup run does (default)")
    args = ap.parse_args()
    bootstrap = os.environ.get("NEARDUP_KAFKA_BOOTSTRAP")
    if not bootstrap:
        print("run_steps.py: set NEARDUP_KAFKA_BOOTSTRAP to a broker", file=sys.stderr)
        return 2
    corpus = benchlib.load_corpus(benchlib.default_corpus())
    topic = f"bench-steps-{uuid.uuid4().hex[:10]}"
    now_ms = int(time.time() * 1000)
    messages = []
    for offset, (doc_id, text) in enumerate(benchlib.replay_stream(corpus, args.messages)):
        key, value = encode(doc_id, text)
        messages.append(Message(topic=topic, partition=0, offset=offset, key=key, value=value,
                                timestamp=(1, now_ms + offset)))
    outputs = [f"{topic}.unique", f"{topic}.duplicates", f"{topic}.dlq"]
    create_topics(bootstrap, [topic, *outputs])
    import neardup  # noqa: PLC0415

    print(f"neardup from {Path(neardup.__file__).parent}; {args.messages:,} messages in batches of "
          f"{args.batch_size:,}, pipeline {'on' if args.pipeline else 'off'}; load {os.getloadavg()[0]:.2f}")
    rounds = []
    try:
        for r in range(args.rounds):
            got = run_round(bootstrap, topic, messages, args.batch_size, args.pipeline)
            rounds.append(got)
            print(f"  round {r + 1}: " + ", ".join(f"{k} {v:.1f}" for k, v in got.items())
                  + f", all {sum(got.values()):.1f} us per message; load {os.getloadavg()[0]:.2f}", flush=True)
    finally:
        delete_topics(bootstrap, [topic, *outputs])
    rows = [[step, f"{min(r[step] for r in rounds):.1f}", f"{statistics.median(r[step] for r in rounds):.1f}"]
            for step in rounds[0]]
    totals = [sum(r.values()) for r in rounds]
    rows.append(["all", f"{min(totals):.1f}", f"{statistics.median(totals):.1f}"])
    print(benchlib.table(["step", "fastest us/message", "median us/message"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
