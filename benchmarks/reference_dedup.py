"""A reference deduplication pipeline on JSONL, as a user would write it with datasketch or rensa.

What ``whole_process.py`` runs as a separate process next to ``neardup dedup``: read the
JSONL (``.gz`` gunzipped) line by line with orjson, take the ``--text-field`` and
``--id-field``, normalise the text with neardup's ``normalize`` (NFKC, casefold, white
space), cut Python word 5-grams (``\\w+`` tokens joined by spaces; a text of fewer tokens
is one shingle), sketch them (datasketch ``MinHash(128).update_batch`` of the UTF-8
shingles, or rensa ``RMinHash(128).update``), query an in-memory LSH index
(``MinHashLSH(threshold)`` or ``RMinHashLSH(threshold, 128, 16 bands)``), then insert.
A document is a duplicate when a candidate's estimated Jaccard is at least the threshold.
Each record is written to ``unique.jsonl`` or ``duplicates.jsonl`` in ``--out-dir`` as it
came plus a ``neardup``-like verdict object; a line that is not JSON or has no text goes
to ``rejects.jsonl``. The same work as ``benchlib.run_datasketch``/``run_rensa``, plus the
file reading and writing.

This script imports nothing of neardup but its normalisation (no compiled kernels).

Usage: python benchmarks/reference_dedup.py {datasketch,rensa} INPUT --out-dir DIR
"""

from __future__ import annotations

import argparse
import gzip
import re
import sys
from pathlib import Path
from typing import IO, Any

import orjson

from neardup.core.normalize import normalize

_WORD = re.compile(r"\w+")


def shingles(text: str, n: int) -> list[str]:
    """Word n-grams of the normalised text; one shingle of every token when fewer than n."""
    tokens = _WORD.findall(normalize(text))
    if len(tokens) < n:
        return [" ".join(tokens)] if tokens else []
    return [" ".join(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]


def _sketcher(tool: str, num_perm: int, seed: int, threshold: float) -> tuple[Any, Any]:
    """(make_sketch(shingles) -> sketch, lsh index) of ``tool``."""
    if tool == "datasketch":
        from datasketch import MinHash, MinHashLSH

        def make(sh: list[str]) -> Any:
            m = MinHash(num_perm=num_perm, seed=seed)
            m.update_batch([s.encode("utf-8") for s in sh])
            return m

        return make, MinHashLSH(threshold=threshold, num_perm=num_perm)
    from rensa import RMinHash, RMinHashLSH

    def make_r(sh: list[str]) -> Any:
        m = RMinHash(num_perm=num_perm, seed=seed)
        m.update(sh)
        return m

    return make_r, RMinHashLSH(threshold=threshold, num_perm=num_perm, num_bands=16)


def _open(path: str) -> IO[bytes]:
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


def run(tool: str, path: str, out_dir: Path, text_field: str, id_field: str,
        n: int = 5, num_perm: int = 128, seed: int = 1, threshold: float = 0.8) -> dict[str, int]:
    """Deduplicate ``path`` into ``out_dir``; returns counts (documents, duplicates, rejects)."""
    make, lsh = _sketcher(tool, num_perm, seed, threshold)
    out_dir.mkdir(parents=True, exist_ok=True)
    sketches: dict[int, Any] = {}
    ids: dict[int, str] = {}
    counts = {"documents": 0, "duplicates": 0, "rejects": 0}
    with _open(path) as src, open(out_dir / "unique.jsonl", "wb") as unique, \
            open(out_dir / "duplicates.jsonl", "wb") as dups, open(out_dir / "rejects.jsonl", "wb") as rejects:
        for number, raw in enumerate(src, start=1):
            if not raw.strip():
                continue
            try:
                record = orjson.loads(raw)
                text = record[text_field]
                sh = shingles(text, n)
            except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
                rejects.write(orjson.dumps({"line": number, "reason": str(exc)}) + b"\n")
                counts["rejects"] += 1
                continue
            if not sh:
                rejects.write(orjson.dumps({"line": number, "reason": "no word"}) + b"\n")
                counts["rejects"] += 1
                continue
            doc_id = str(record.get(id_field, number))
            sketch = make(sh)
            match, best = None, 0.0
            for c in lsh.query(sketch):
                s = sketch.jaccard(sketches[c])
                if s >= threshold and s > best:
                    match, best = c, s
            record["neardup"] = {"id": doc_id, "duplicate": match is not None,
                                 "duplicate_of": ids[match] if match is not None else None,
                                 "similarity": round(best, 4)}
            (dups if match is not None else unique).write(orjson.dumps(record) + b"\n")
            lsh.insert(number, sketch)
            sketches[number] = sketch
            ids[number] = doc_id
            counts["documents"] += 1
            counts["duplicates"] += match is not None
    return counts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("tool", choices=["datasketch", "rensa"])
    p.add_argument("input", help=".jsonl or .jsonl.gz")
    p.add_argument("--out-dir", type=Path, required=True)
    p.add_argument("--text-field", default="text")
    p.add_argument("--id-field", default="id")
    p.add_argument("--threshold", type=float, default=0.8)
    args = p.parse_args(argv)
    counts = run(args.tool, args.input, args.out_dir, args.text_field, args.id_field, threshold=args.threshold)
    print(orjson.dumps(counts).decode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
