"""Containment recall and precision per size ratio on composite articles.

The corpus is ``neardup.composites`` over the Reuters excerpt of the tests
(tests/data/reuters_excerpt.jsonl.gz): its 4,000 stories and 800 composites for word
shingles, the first 1,200 stories and 300 composites for char:5 (its exact ground truth
is the costly part), seed 1. Each cell is ``neardup.evaluate.evaluate`` with
``--measure containment --containment-direction both --duplicate-buckets all`` and
otherwise default settings: pair recall and precision per size-ratio band (the larger
set's size over the smaller's), and the detector's seconds. The load averages (1, 5,
15 min) are printed before and after.

Usage: python benchmarks/containment_quality.py [--json OUT] [--shingle word:5 ...]
    [--threshold 0.5 ...] [--extra-candidates N]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
from pathlib import Path

import orjson

from neardup.composites import composites
from neardup.core.settings import EngineSettings
from neardup.core.shingle import Shingling
from neardup.core.types import Document
from neardup.evaluate import evaluate

EXCERPT = Path(__file__).resolve().parent.parent / "tests" / "data" / "reuters_excerpt.jsonl.gz"
#: (stories, composites) by shingle kind.
SIZES = {"word": (4000, 800), "char": (1200, 300)}


def _corpus(kind: str) -> list[Document]:
    with gzip.open(EXCERPT, "rb") as f:
        stories = [Document(str(r["id"]), r["text"]) for r in map(orjson.loads, f)]
    n_stories, n_composites = SIZES[kind]
    return composites(stories[:n_stories], n_composites, seed=1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--shingle", action="append", help="word:3, word:5, char:5 (repeat)")
    parser.add_argument("--threshold", action="append", type=float, help="containment (repeat)")
    parser.add_argument("--extra-candidates", type=int, help="default: the measure's")
    args = parser.parse_args()
    shingles = args.shingle or ["word:3", "word:5", "char:5"]
    thresholds = args.threshold or [0.5, 0.6, 0.7, 0.8]
    load_before = os.getloadavg()
    print(f"load average before {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}", flush=True)
    cells = []
    corpora: dict[str, list[Document]] = {}
    for shingle in shingles:
        shingling = Shingling.parse(shingle)
        docs = corpora.setdefault(shingling.kind, _corpus(shingling.kind))
        for threshold in thresholds:
            settings = EngineSettings(shingling=shingling, threshold=threshold, measure="containment",
                                      containment_direction="both", duplicate_buckets="all",
                                      extra_candidates=args.extra_candidates)
            report = evaluate(docs, settings)
            bands = [b for b in report["size_ratios"] if b["ratio"] != ">=8x"]
            cells.append({"shingle": shingle, "threshold": threshold, "documents": len(docs),
                          "extra_candidates": settings.extra_candidates,
                          "detector_seconds": report["seconds"]["detector"],
                          "load_average": os.getloadavg(), "size_ratios": report["size_ratios"]})
            print(f"{shingle} {threshold:.1f}  " + "  ".join(
                f"{b['ratio']} recall {b['pair_recall']:.4f} precision {b['pair_precision']:.4f} ({b['exact_pairs']})"
                for b in bands) + f"  detector {report['seconds']['detector']:.1f} s", flush=True)
    load_after = os.getloadavg()
    print(f"load average after {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"load_average_before": load_before, "load_average_after": load_after,
                                         "cells": cells}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
