"""HTML main-text extraction: speed of Resiliparse and trafilatura, and detection quality
on web pages with and without extraction.

The corpus is ``neardup.sitepages.site_pages`` over the Reuters excerpt of the tests
(tests/data/reuters_excerpt.jsonl.gz): the first ``--stories`` stories of at least
``--min-chars`` characters, without the stories the wire re-issued under a new id
(``neardup.sitepages.distinct_stories``; ``--keep-reissues`` keeps them), each a page of one of four site templates (navigation,
ticker, related links, most read, newsletter box, cookie notice, footer) or, for 40 % of
them, of 2 to 4 sites; seed 1.

Speed: each extractor over every page, ``--rounds`` times, one process, one core;
pages/s and MB of HTML per second of the fastest round, and pages from which it took no
text. Resiliparse is called as ``neardup.extract.main_text`` calls it
(``extract_plain_text(main_content=True)``); trafilatura as ``trafilatura.extract(html)``
(its defaults) and with ``fast=True`` (no fallback extractors).

Quality: ``neardup.embedded.dedup_files`` with default engine settings (word:5,
threshold 0.8) over JSONL records holding each page: ``plain`` deduplicates the HTML as
text, ``html`` uses ``text_format="html"`` (the Resiliparse extraction of neardup), and
``trafilatura`` deduplicates the text trafilatura extracted beforehand. A pair of pages
is flagged when both end in one cluster; the true pairs are those of pages of one story.
Recall: true pairs flagged over true pairs; precision: true pairs flagged over pairs
flagged; pairs flagged of one site and different stories are the template's false
positives. ``dedup s``: seconds of ``dedup_files`` (for ``html``, extraction included;
for ``trafilatura``, not: its text was extracted before). The load averages (1, 5, 15 min) are printed before and after.

Usage: python benchmarks/html_extraction.py [--stories 400] [--rounds 3] [--json OUT]
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
import os
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import describe_git, git_state, package_version, table  # noqa: E402

from neardup.core.settings import EngineSettings  # noqa: E402
from neardup.core.types import Document  # noqa: E402
from neardup.embedded import dedup_files  # noqa: E402
from neardup.extract import main_text  # noqa: E402
from neardup.sitepages import Page, distinct_stories, site_pages  # noqa: E402

EXCERPT = Path(__file__).resolve().parent.parent / "tests" / "data" / "reuters_excerpt.jsonl.gz"


def corpus(stories: int, min_chars: int, seed: int = 1, distinct: bool = True) -> list[Page]:
    with gzip.open(EXCERPT, "rb") as f:
        records = [r for r in map(orjson.loads, f) if len(r["text"]) >= min_chars]
    docs = [Document(str(r["id"]), r["text"]) for r in records]
    if distinct:
        docs = distinct_stories(docs, limit=stories)
    docs = docs[:stories]
    title = {str(r["id"]): r["title"] for r in records}
    return site_pages(docs, [title[d.id] for d in docs], seed=seed)


def extractors() -> dict[str, object]:
    import trafilatura

    return {
        "resiliparse": main_text,
        "trafilatura": lambda h: trafilatura.extract(h) or "",
        "trafilatura fast": lambda h: trafilatura.extract(h, fast=True) or "",
    }


def speed(pages: list[Page], rounds: int) -> list[dict[str, object]]:
    html = [p.html for p in pages]
    mb = sum(len(h.encode()) for h in html) / 1e6
    rows = []
    for name, extract in extractors().items():
        best, empty = float("inf"), 0
        for _ in range(rounds):
            t0 = time.perf_counter()
            out = [extract(h) for h in html]  # type: ignore[operator]
            best = min(best, time.perf_counter() - t0)
            empty = sum(1 for o in out if not o)
        rows.append({"extractor": name, "pages": len(html), "seconds": round(best, 3),
                     "pages_per_s": round(len(html) / best, 1), "mb_per_s": round(mb / best, 2), "empty": empty,
                     "version": package_version(name.split()[0])})
    return rows


def quality(pages: list[Page], variant: str, work: Path) -> dict[str, object]:
    path = work / f"{variant}.jsonl"
    if variant == "trafilatura":
        extract = extractors()["trafilatura"]
        records = [{"id": p.id, "text": extract(p.html)} for p in pages]  # type: ignore[operator]
        records = [r if r["text"] else {"id": r["id"]} for r in records]  # rejected as missing text
    else:
        records = [{"id": p.id, "text": p.html} for p in pages]
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in records))
    out = work / f"out-{variant}"
    t0 = time.perf_counter()
    summary = dedup_files([str(path)], EngineSettings(), out, ["text"], "id", progress=False,
                          text_format="html" if variant == "html" else "plain")
    seconds = time.perf_counter() - t0
    cluster: dict[str, str] = {}
    for name in ("unique.jsonl", "duplicates.jsonl"):
        for line in (out / name).read_bytes().splitlines():
            entry = orjson.loads(line)["neardup"]
            cluster[entry["id"]] = entry["cluster"]
    story = {p.id: p.story for p in pages}
    site = {p.id: p.site for p in pages}
    by_story: dict[str, list[str]] = defaultdict(list)
    for p in pages:
        by_story[p.story].append(p.id)
    truth = {frozenset(pair) for ids in by_story.values() for pair in itertools.combinations(ids, 2)}
    members: dict[str, list[str]] = defaultdict(list)
    for page_id, c in cluster.items():
        members[c].append(page_id)
    flagged = {frozenset(pair) for ids in members.values() for pair in itertools.combinations(ids, 2)}
    hits = len(flagged & truth)
    template = sum(1 for a, b in map(tuple, flagged) if story[a] != story[b] and site[a] == site[b])
    return {"variant": variant, "pages": len(pages), "rejected": summary.rejects, "true_pairs": len(truth),
            "flagged_pairs": len(flagged), "true_flagged": hits,
            "recall": round(hits / len(truth), 4) if truth else None,
            "precision": round(hits / len(flagged), 4) if flagged else None,
            "same_site_false_pairs": template, "dedup_seconds": round(seconds, 2)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stories", type=int, default=400)
    parser.add_argument("--min-chars", type=int, default=400, help="shortest story text, characters")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--keep-reissues", action="store_true",
                        help="keep stories the wire re-issued under a new id (their pages count as different stories)")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    print(describe_git(git_state()))
    load_before = os.getloadavg()
    print(f"load average before {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}", flush=True)
    pages = corpus(args.stories, args.min_chars, distinct=not args.keep_reissues)
    sites = len({p.site for p in pages})
    print(f"{len(pages)} pages of {args.stories} stories on {sites} sites, "
          f"mean {sum(len(p.html) for p in pages) / len(pages):,.0f} characters of HTML", flush=True)
    speeds = speed(pages, args.rounds)
    print(table(["extractor", "version", "pages/s", "MB/s", "empty"],
                [[r["extractor"], r["version"], r["pages_per_s"], r["mb_per_s"], r["empty"]] for r in speeds]))
    with tempfile.TemporaryDirectory(prefix="neardup-html-") as work:
        cells = [quality(pages, v, Path(work)) for v in ("plain", "html", "trafilatura")]
    print(table(["text", "pages", "rejected", "true pairs", "flagged", "true flagged", "recall", "precision",
                 "same-site false", "dedup s"],
                [[c["variant"], c["pages"], c["rejected"], c["true_pairs"], c["flagged_pairs"], c["true_flagged"],
                  c["recall"], c["precision"], c["same_site_false_pairs"], c["dedup_seconds"]] for c in cells]))
    load_after = os.getloadavg()
    print(f"load average after {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"git": git_state(), "load_average_before": load_before,
                                         "load_average_after": load_after, "speed": speeds, "quality": cells},
                                        indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
