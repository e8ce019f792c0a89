"""What the score floor costs: ``neardup dedup`` as a whole process on a corpus, with the
banding of each score floor side by side in one run (threshold 0.8), per shingling.

Prints, per (shingling, setting): the banding, wall seconds (fastest of ``--rounds``),
documents/s, the state on disk, and the share of the documents whose best earlier
document lies at or above the setting's floor that report it (``neardup.evaluate``,
exact ground truth; ``--no-reach`` skips it: char:5 takes minutes). The load average is
recorded before and after.

    python benchmarks/score_floor.py                       # Reuters-21578, word:5 and char:5
    python benchmarks/score_floor.py --shingle word:5 --json benchmarks/results/score_floor.json
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402

from benchlib import default_corpus, dir_bytes, environment, load_corpus, table, write_json  # noqa: E402

#: (name, settings beyond the shingling): the earlier default banding, the default floor
#: (threshold - 0.25), and a floor of 0.5.
SETTINGS: list[tuple[str, dict[str, object]]] = [
    ("21 x 6 (optimised for 0.55)", {"bands": 21, "rows": 6}),
    ("floor 0.55 (default)", {}),
    ("floor 0.5", {"score_floor": 0.5}),
]


def _flags(settings: dict[str, object]) -> list[str]:
    """``settings`` as flags of neardup dedup."""
    return [part for k, v in settings.items() for part in (f"--{k.replace('_', '-')}", str(v))]


def _dedup(corpus: Path, shingle: str, flags: list[str], scratch: Path) -> tuple[float, int]:
    """Wall seconds of one ``neardup dedup`` process, and its state directory's bytes."""
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    command = ["neardup", "dedup", str(corpus), "--out-dir", str(scratch / "out"), "--state-dir",
               str(scratch / "state"), "--shingle", shingle, "--log-level", "WARNING", *flags]
    t0 = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0, dir_bytes(scratch / "state")


def _reach(corpus: Path, over: dict[str, object]) -> tuple[int, int, float]:
    """(documents at or above the floor reporting their best earlier one, documents at or
    above the floor, the floor) by ``neardup.evaluate``, with the settings ``over``."""
    from neardup.config import load_settings
    from neardup.evaluate import evaluate
    from neardup.files import open_binary, read_lines

    engine = load_settings(over).engine()
    with open_binary(corpus) as stream:
        docs = [line.document for line in read_lines(stream, ["text"], "id") if line.document is not None]
    report = evaluate(docs, engine)
    reported = np.array(report["score_pairs"]["reported"])
    best = np.array(report["score_pairs"]["exact_best"])
    at = best >= engine.floor
    return int((at & (np.abs(best - reported) <= 1e-9)).sum()), int(at.sum()), engine.floor


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", type=Path, default=default_corpus())
    parser.add_argument("--shingle", action="append", help="word:5 and char:5 unless given")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--no-reach", action="store_true", help="skip the exact ground truth")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    from neardup.config import load_settings

    docs = len(load_corpus(args.corpus))
    load_before = os.getloadavg()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for shingle in args.shingle or ["word:5", "char:5"]:
            _dedup(args.corpus, shingle, [], Path(tmp) / "warm")  # the kernels compiled and cached
            for name, setting in SETTINGS:
                over = {"shingle": shingle, **setting}
                lsh = load_settings(over).engine().bands
                timings = [_dedup(args.corpus, shingle, _flags(setting), Path(tmp) / "run") for _ in range(args.rounds)]
                seconds, state = min(timings)
                row = {"shingle": shingle, "setting": name, "bands": lsh.bands, "rows": lsh.rows,
                       "seconds": round(seconds, 3), "documents_per_second": round(docs / seconds),
                       "state_bytes_per_document": round(state / docs)}
                if not args.no_reach:
                    ok, at, floor = _reach(args.corpus, over)
                    row |= {"floor": floor, "reported_at_floor": ok, "documents_at_floor": at}
                runs.append(row)
                print(row, flush=True)
    load_after = os.getloadavg()
    headers = ["shingles", "setting", "banding", "seconds", "docs/s", "state B/doc", "reach at the floor"]
    rows = [[r["shingle"], r["setting"], f"{r['bands']} x {r['rows']}", r["seconds"], r["documents_per_second"],
             r["state_bytes_per_document"],
             f"{r['reported_at_floor']}/{r['documents_at_floor']} >= {r['floor']:g}" if "floor" in r else "-"]
            for r in runs]
    print(f"{args.corpus.name}: {docs:,} documents, neardup dedup whole processes, threshold 0.8, fastest of "
          f"{args.rounds}; load average {load_before[0]:.2f} before, {load_after[0]:.2f} after")
    print(table(headers, rows))
    if args.json:
        write_json(args.json, {"environment": environment(), "documents": docs, "runs": runs,
                               "load_before": load_before, "load_after": load_after})
    return 0


if __name__ == "__main__":
    sys.exit(main())
