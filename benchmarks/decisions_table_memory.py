"""Memory of a decide process against the documents decided: its decisions table in
memory (``DecisionsTable``, Python dicts) against on disk (``StoredDecisionsTable``, a
RocksDB store), without Kafka.

Each mode runs in a process of its own. Decisions are applied as the decide stage applies
what it reads from the decisions topic: chunks of 10,000, each with its position. Two in
three documents join an earlier cluster (as in the replayed Reuters stream: 67,227
duplicates in 100,000), whose canonical is drawn from the last 10,000 canonicals; ids are
Reuters-like ("12345~r3"). Printed: resident memory (VmRSS) and the store's bytes on disk
every 500,000 decisions, decisions applied per second, and lookups per second (a random
decided document: ``seq in table``, then ``table[seq]`` and the canonical's name, as
``decide`` does for an accepted candidate).

    PYTHONPATH=src:benchmarks python benchmarks/decisions_table_memory.py --decisions 3000000
"""

from __future__ import annotations

import argparse
import os
import random
import time
from pathlib import Path

import benchlib
from neardup.sharded.records import order_key, order_seq
from neardup.state.decisions import DecisionsTable, StoredDecisionsTable

CHUNK = 10_000
EVERY = 500_000
LOOKUPS = 200_000


def run(mode: str, decisions: int, state: Path) -> dict[str, object]:
    rng = random.Random(2026)
    table = DecisionsTable() if mode == "memory" else StoredDecisionsTable(state / "decisions")
    base = benchlib.proc_status_mb()["VmRSS"]
    canonicals: list[int] = []
    names: dict[int, str] = {}
    points, busy = [], 0.0
    for at in range(0, decisions, CHUNK):
        chunk = []
        for i in range(at, min(at + CHUNK, decisions)):
            seq = order_seq(order_key(1_700_000_000_000 + i, i % 4, i // 4))
            if not canonicals or rng.random() < 0.33:
                canonical, name = seq, f"{rng.randrange(21_578)}~r{rng.randrange(10)}"
                canonicals.append(seq)
                names[seq] = name
                if len(canonicals) > 10_000:
                    names.pop(canonicals.pop(0))
            else:
                canonical = rng.choice(canonicals)
                name = names[canonical]
            chunk.append((seq, canonical, name))
        t0 = time.perf_counter()
        table.apply(chunk, at + len(chunk))
        busy += time.perf_counter() - t0
        done = at + len(chunk)
        if done % EVERY == 0 or done == decisions:
            points.append({"decisions": done, "rss_mb": benchlib.proc_status_mb()["VmRSS"],
                           "disk_mb": benchlib.dir_bytes(state) / 1e6 if mode == "disk" else 0.0})
    probes = [order_seq(order_key(1_700_000_000_000 + i, i % 4, i // 4))
              for i in (rng.randrange(decisions) for _ in range(LOOKUPS))]
    t0 = time.perf_counter()
    for seq in probes:
        if seq in table:
            table.name(table[seq])
    lookup_s = time.perf_counter() - t0
    table.close()
    return {"mode": mode, "decisions": decisions, "rss_at_start_mb": base, "points": points,
            "apply_seconds": busy, "decisions_per_second": decisions / busy,
            "lookups_per_second": LOOKUPS / lookup_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--decisions", type=int, default=3_000_000)
    ap.add_argument("--mode", choices=["memory", "disk"], help="run one mode here (used by the parent)")
    ap.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "decisions_table_memory.json")
    args = ap.parse_args()
    if args.mode:
        return benchlib.mode_worker("neardup-decisions-", lambda state: run(args.mode, args.decisions, state))
    print(f"{args.decisions:,} decisions applied in chunks of {CHUNK:,}, load {os.getloadavg()}")
    runs = benchlib.modes_in_processes(__file__, ("memory", "disk"), "--decisions", str(args.decisions))
    rows = [[f"{a['decisions']:,}", f"{a['rss_mb']:,.0f}", f"{b['rss_mb']:,.0f}", f"{b['disk_mb']:,.0f}"]
            for a, b in zip(runs[0]["points"], runs[1]["points"])]
    print(benchlib.table(["decisions", "memory: RSS MB", "disk: RSS MB", "disk: store MB"], rows))
    for r in runs:
        first, last = r["points"][0], r["points"][-1]
        per = (last["rss_mb"] - r["rss_at_start_mb"]) * 1e6 / r["decisions"]
        print(f"{r['mode']}: RSS at start {r['rss_at_start_mb']:,.0f} MB, {per:,.0f} bytes of RSS per decision; "
              f"{r['decisions_per_second']:,.0f} decisions/s applied, {r['lookups_per_second']:,.0f} lookups/s"
              + (f"; store {last['disk_mb'] * 1e6 / r['decisions']:,.0f} bytes per decision" if r["mode"] == "disk"
                 else "") + f" (RSS {first['rss_mb']:,.0f} -> {last['rss_mb']:,.0f} MB)")
    print(f"load {os.getloadavg()}")
    benchlib.write_json(args.json, {"environment": benchlib.environment(), "runs": runs})


if __name__ == "__main__":
    main()
