"""The cost model of the sharded stages checked by a simulation that replays the measured
per-stage costs at a target rate.

Inputs:

- measured runs of ``benchmarks/scale_out.py`` (``--measured``, JSON, one process per
  stage, at two or more shard counts): per stage, CPU µs per document and records and
  bytes per document on each topic. Each stage's CPU per document is fitted as
  ``a + b * r``, where ``r`` is the band entries per document (one per shard partition a
  document touches, from the routing below at the measured shard count), by least
  squares over the runs; so are the bytes per document of the band, findings and
  changelog topics.
- the routing of real documents (``--docs`` of the replayed Reuters stream, prepared with
  the default engine settings): for each shard count, which shard partitions every
  document touches, hence ``r`` and the share of band entries of each partition.

The simulation: a fluid queue per process (one core each, first in first out), time
steps of ``--step`` seconds for ``--seconds`` seconds, documents arriving at ``--rate``
per second round-robin over the input partitions; each document costs prepare's fitted
CPU in the process owning its input partition, ``(a + b * r) / r`` in the shard process
owning each partition it touches (partitions dealt to processes round-robin), and
decide's fitted CPU in the process owning its decide partition (by a hash of its
position). A stage keeps up when the backlog of its busiest process at the end stays
under ``--max-backlog`` seconds of work. For each stage the fewest processes that keep up
(a stage cannot use more processes than it has partitions) are compared with the
analytic count, rate × CPU per document / 1 core. Also printed: the document's latency
through the three queues (the reorder window and the commits come on top), Kafka
bandwidth per topic, and the state per shard partition for ``--index`` documents.

Printed: the fitted costs, then per shard count a table; ``--json`` keeps it all.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

import numpy as np

import benchlib

from neardup.core.settings import EngineSettings
from neardup.core.types import Document
from neardup.detector import Preparer
from neardup.sharded.routing import shard_of

ROLES = ("prepare", "shard", "decide")
TOPICS = ("bands", "sets", "findings", "decisions", "shard-changelog", "decide-changelog")


def fit(rs: list[float], ys: list[float]) -> tuple[float, float]:
    """(a, b) of ``y = a + b * r`` by least squares; with one distinct ``r``, b = y / r."""
    if len(set(rs)) < 2:
        return 0.0, float(np.mean(ys) / np.mean(rs))
    b, a = np.polyfit(np.asarray(rs, float), np.asarray(ys, float), 1)
    return float(a), float(b)


def load_costs(paths: list[Path], entries: dict[int, float], disk: bool = False) -> dict[str, object]:
    """The fitted ``(a, b)`` per stage (CPU µs per document) and per topic (bytes per
    document), from the one-process-per-stage run of each measured file; ``entries``:
    per shard count, the shard partitions a document touches (its band entries: a
    band record holds a batch's entries for one partition, so the records per document
    no longer count them); ``disk``: the bytes as the broker holds them
    (``disk_bytes_per_document``: compressed when the producers compress) instead of key
    + value. A topic a run does not name (the set topic before the sets went once) counts 0."""
    runs = []
    for path in paths:
        data = json.loads(path.read_text())
        run = next(r for r in data["runs"] if r["processes_per_stage"] == 1)
        runs.append({"shards": data["shards"], "docs": data["docs"], "r": entries[data["shards"]],
                     "cpu": run["cpu_us_per_document"],
                     "bytes": run["disk_bytes_per_document" if disk else "bytes_per_document"],
                     "load": [run["load_before"], run["load_after"]]})
    rs = [x["r"] for x in runs]
    return {"runs": runs,
            "cpu": {role: fit(rs, [x["cpu"][role] for x in runs]) for role in ROLES},
            "bytes": {t: fit(rs, [x["bytes"].get(t, 0.0) for x in runs]) for t in TOPICS}}


def routing(docs: int, shard_counts: list[int]) -> tuple[dict[int, list[np.ndarray]], float]:
    """Per shard count, the partitions each sampled document touches; and the mean
    fingerprint-set size in bytes (uint32 fingerprints)."""
    corpus = benchlib.load_corpus(benchlib.default_corpus())
    documents = [Document(i, t) for i, t in benchlib.replay_stream(corpus, docs)]
    settings = EngineSettings()
    prepare = Preparer(settings)
    buckets, set_bytes = [], []
    for i in range(0, len(documents), 2000):
        p = prepare(documents[i:i + 2000])
        buckets.append(p.buckets)
        set_bytes.append(4 * np.diff(p.fingerprint_offsets))
    all_buckets = np.concatenate(buckets)
    touched = {s: [np.unique(row) for row in shard_of(all_buckets, s)] for s in shard_counts}
    return touched, float(np.concatenate(set_bytes).mean())


def simulate(costs: dict, touched: list[np.ndarray], shards: int, processes: dict[str, int],
             partitions: dict[str, int], rate: float, seconds: float, step: float) -> dict[str, object]:
    """One run of the fluid simulation; returns each stage's final backlog of its busiest
    process (s of work) and the p50/p99 latency through the queues (s)."""
    r = float(np.mean([len(t) for t in touched]))
    cpu = {role: a + b * r for role, (a, b) in costs["cpu"].items()}
    per_record = cpu["shard"] / r
    backlog = {role: np.zeros(processes[role]) for role in ROLES}
    owner = {role: np.arange(partitions[role]) % processes[role] for role in ROLES}
    rng = np.random.default_rng(1)
    per_step = rate * step
    latencies = []
    n = len(touched)
    k = 0
    for s in range(int(seconds / step)):
        count = int((s + 1) * per_step) - int(s * per_step)
        idx = np.arange(k, k + count) % n
        work = {}
        inputs = owner["prepare"][np.arange(k, k + count) % partitions["prepare"]]
        work["prepare"] = np.bincount(inputs, minlength=processes["prepare"]) * cpu["prepare"]
        parts = np.concatenate([touched[i] for i in idx]) if count else np.zeros(0, int)
        work["shard"] = np.bincount(owner["shard"][parts], minlength=processes["shard"]) * per_record
        decide_at = owner["decide"][rng.integers(0, partitions["decide"], count)]
        work["decide"] = np.bincount(decide_at, minlength=processes["decide"]) * cpu["decide"]
        for role in ROLES:
            backlog[role] = np.maximum(0.0, backlog[role] + work[role] * 1e-6 - step)
        k += count
        if count:
            # a document waits for the backlog of its prepare process, of the slowest
            # shard process it touches, and of its decide process
            first = idx[0]
            shard_wait = max((backlog["shard"][owner["shard"][p]] for p in touched[first]), default=0.0)
            latencies.append(backlog["prepare"][inputs[0]] + shard_wait + backlog["decide"][decide_at[0]])
    lat = np.asarray(latencies)
    return {"backlog_s": {role: float(backlog[role].max()) for role in ROLES},
            "latency_p50_s": float(np.percentile(lat, 50)), "latency_p99_s": float(np.percentile(lat, 99))}


def fewest(costs: dict, touched: list[np.ndarray], shards: int, role: str, partitions: dict[str, int],
           analytic: dict[str, float], args: argparse.Namespace) -> int | None:
    """The fewest processes of ``role`` that keep up (the other stages given enough), or
    None when even one per partition does not."""
    lo = max(1, math.floor(analytic[role]))
    for p in range(lo, partitions[role] + 1):
        procs = {x: (p if x == role else partitions[x]) for x in ROLES}
        out = simulate(costs, touched, shards, procs, partitions, args.rate, args.seconds, args.step)
        if out["backlog_s"][role] <= args.max_backlog:
            return p
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    results = Path(__file__).parent / "results"
    ap.add_argument("--measured", type=Path, nargs="+",
                    default=[results / "scale_out_members_4.json", results / "scale_out_members_16.json",
                             results / "scale_out_members_64.json"])
    ap.add_argument("--docs", type=int, default=20_000, help="documents routed (the replayed Reuters stream)")
    ap.add_argument("--shards", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--rate", type=float, default=100_000, help="documents per second")
    ap.add_argument("--index", type=float, default=1e9, help="documents in the index")
    ap.add_argument("--input-partitions", type=int, default=256)
    ap.add_argument("--decide-partitions", type=int, default=256)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--step", type=float, default=0.01)
    ap.add_argument("--max-backlog", type=float, default=0.5, help="seconds of work left at the end")
    ap.add_argument("--json", type=Path, default=results / "scale_out_sim.json")
    ap.add_argument("--disk", action="store_true", help="the bytes on the broker's disk (scale_out.py "
                    "--broker-log-dir: compressed as the producers wrote them) instead of key + value")
    args = ap.parse_args()

    measured = sorted({json.loads(p.read_text())["shards"] for p in args.measured})
    touched, set_bytes = routing(args.docs, sorted(set(args.shards) | set(measured)))
    costs = load_costs(args.measured, {s: float(np.mean([len(t) for t in touched[s]])) for s in measured}, args.disk)
    print(f"load average {os.getloadavg()}")
    print("measured (one process per stage): " + "; ".join(
        f"{x['shards']} shards, {x['docs']:,} docs: {x['r']:.2f} band entries/doc, CPU µs/doc "
        + "/".join(f"{x['cpu'][s]:.0f}" for s in ROLES) for x in costs["runs"]))
    print("fitted CPU µs per document, a + b × r: " + ", ".join(
        f"{s} {a:.0f} + {b:.1f} r" for s, (a, b) in costs["cpu"].items()))
    out = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                    if k != "measured"}, "measured": [str(p) for p in args.measured],
           "costs": costs, "set_bytes": set_bytes, "targets": []}
    bands = EngineSettings().bands.bands
    for shards in args.shards:
        r = float(np.mean([len(t) for t in touched[shards]]))
        cpu = {role: a + b * r for role, (a, b) in costs["cpu"].items()}
        analytic = {role: args.rate * cpu[role] * 1e-6 for role in ROLES}
        partitions = {"prepare": args.input_partitions, "shard": shards, "decide": args.decide_partitions}
        need = {role: fewest(costs, touched[shards], shards, role, partitions, analytic, args) for role in ROLES}
        row: dict[str, object] = {"shards": shards, "band_records_per_doc": r, "cpu_us_per_doc": cpu,
                                  "analytic_cores": analytic, "simulated_processes": need}
        if all(need.values()):
            procs = {role: int(need[role]) for role in ROLES}
            row["with_those"] = simulate(costs, touched[shards], shards, procs, partitions, args.rate,
                                         args.seconds, args.step)
        row["kafka_mb_per_s"] = {t: args.rate * (a + b * r) / 1e6 for t, (a, b) in costs["bytes"].items()}
        row["state_per_shard_gb"] = {
            "sets": args.index * r * set_bytes / shards / 1e9,
            "bucket_entries_8_bytes": args.index * bands * 8 / shards / 1e9}
        out["targets"].append(row)
        print(f"\n{shards} shards: {r:.2f} band entries per document; CPU µs/doc "
              + ", ".join(f"{s} {cpu[s]:.0f}" for s in ROLES))
        print("  processes (1 core each) at {:,.0f} docs/s, analytic -> simulated: ".format(args.rate) + ", ".join(
            f"{s} {analytic[s]:.1f} -> {need[s] if need[s] else 'no (more than ' + str(partitions[s]) + ' partitions needed)'}"
            for s in ROLES))
        if "with_those" in row:
            w = row["with_those"]
            print(f"  with those: latency through the queues p50 {w['latency_p50_s'] * 1e3:.0f} ms, "
                  f"p99 {w['latency_p99_s'] * 1e3:.0f} ms (reorder window and commits on top)")
        print("  Kafka MB/s written: " + ", ".join(f"{t} {v:,.0f}" for t, v in row["kafka_mb_per_s"].items())
              + f"; all {sum(row['kafka_mb_per_s'].values()):,.0f}")
        st = row["state_per_shard_gb"]
        print(f"  state per shard partition at {args.index:,.0f} documents: sets {st['sets']:,.1f} GB, "
              f"bucket entries {st['bucket_entries_8_bytes']:,.1f} GB (8 bytes each)")
    benchlib.write_json(args.json, out)


if __name__ == "__main__":
    main()
