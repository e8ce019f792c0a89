"""A reference deduplication pipeline on JSONL, as a user would write it with datasketch, rensa or gaoya.

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

gaoya (``gaoya``, streaming) hashes with its own analyzer instead of the Python
shingles: the normalised text goes to ``MinHashStringIndex(hash_size=32,
jaccard_threshold, num_bands=16, band_size=8, analyzer="word", ngram_range=(5, 5))``,
whose Rust word analyzer splits on white space only (punctuation stays on the tokens, so
its 5-grams are not the ``\\w+`` ones; a text of fewer than 5 tokens has no shingle at
all, so its signature is the empty one and gaoya scores it 1.0 against every other such
text: left as gaoya does it, one story of Reuters-21578 is that short); per
document ``query(text, return_similarity=True)``, then ``insert_document``. A document is
a duplicate of the returned earlier document of the highest estimated Jaccard (at least
the threshold; gaoya filters on it; the earliest on a tie). A text with no ``\\w+`` token is rejected as above.

``gaoya-bulk`` reads and parses the whole file first (rejects written as read), then
``par_bulk_insert_docs`` of every normalised text and ``par_bulk_query(...,
return_similarity=True)`` of every one, both on all cores (gaoya's native threads); a document is a
duplicate when the answer for it holds an earlier document (a smaller line number) of
estimated Jaccard at least the threshold, the duplicate of the highest of them (the
earliest on a tie): the rule of the streaming run, where the index holds only earlier
documents. The records are then written in input order. Each result list also holds the
document itself and later ones; those are ignored.

This script imports nothing of neardup but its normalisation (no compiled kernels).

Usage: python benchmarks/reference_dedup.py {datasketch,rensa,gaoya,gaoya-bulk} INPUT --out-dir DIR
"""

from __future__ import annotations

import argparse
import gzip
import re
import sys
from pathlib import Path
from collections.abc import Iterator
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


def _gaoya_index(threshold: float) -> Any:
    """gaoya's string index: its word analyzer, 5-grams, 16 bands x 8 rows of 32-bit hashes."""
    from gaoya.minhash import MinHashStringIndex

    return MinHashStringIndex(hash_size=32, jaccard_threshold=threshold, num_bands=16, band_size=8,
                              analyzer="word", lowercase=False, ngram_range=(5, 5))


def _records(src: IO[bytes], rejects: IO[bytes], text_field: str, id_field: str,
             counts: dict[str, int]) -> Iterator[tuple[int, dict[str, Any], str, str]]:
    """(line number, record, id, normalised text) of each usable line; rejects the others."""
    for number, raw in enumerate(src, start=1):
        if not raw.strip():
            continue
        try:
            record = orjson.loads(raw)
            text = normalize(record[text_field])
        except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
            rejects.write(orjson.dumps({"line": number, "reason": str(exc)}) + b"\n")
            counts["rejects"] += 1
            continue
        if not _WORD.search(text):
            rejects.write(orjson.dumps({"line": number, "reason": "no word"}) + b"\n")
            counts["rejects"] += 1
            continue
        yield number, record, str(record.get(id_field, number)), text


def _write(record: dict[str, Any], doc_id: str, dup_of: str | None, best: float,
           unique: IO[bytes], dups: IO[bytes]) -> None:
    record["neardup"] = {"id": doc_id, "duplicate": dup_of is not None, "duplicate_of": dup_of,
                         "similarity": round(best, 4)}
    (dups if dup_of is not None else unique).write(orjson.dumps(record) + b"\n")


def run_gaoya(bulk: bool, path: str, out_dir: Path, text_field: str, id_field: str,
              threshold: float = 0.8) -> dict[str, int]:
    """``gaoya`` (query then insert per document) or ``gaoya-bulk`` (insert all, query all)."""
    index = _gaoya_index(threshold)
    out_dir.mkdir(parents=True, exist_ok=True)
    ids: dict[int, str] = {}
    counts = {"documents": 0, "duplicates": 0, "rejects": 0}
    with _open(path) as src, open(out_dir / "unique.jsonl", "wb") as unique, \
            open(out_dir / "duplicates.jsonl", "wb") as dups, open(out_dir / "rejects.jsonl", "wb") as rejects:
        if not bulk:
            for number, record, doc_id, text in _records(src, rejects, text_field, id_field, counts):
                match, best = None, 0.0
                for c, s in index.query(text, return_similarity=True):
                    if s >= threshold and (s > best or (s == best and match is not None and c < match)):
                        match, best = c, s
                _write(record, doc_id, ids[match] if match is not None else None, best, unique, dups)
                index.insert_document(number, text)
                ids[number] = doc_id
                counts["documents"] += 1
                counts["duplicates"] += match is not None
            return counts
        rows = list(_records(src, rejects, text_field, id_field, counts))
        numbers = [r[0] for r in rows]
        texts = [r[3] for r in rows]
        index.par_bulk_insert_docs(numbers, texts)
        answers = index.par_bulk_query(texts, return_similarity=True)
        del texts
        ids = {r[0]: r[2] for r in rows}
        for (number, record, doc_id, _), answer in zip(rows, answers):
            match, best = None, 0.0
            for c, s in answer:
                if c < number and s >= threshold and (s > best or (s == best and match is not None and c < match)):
                    match, best = c, s
            _write(record, doc_id, ids[match] if match is not None else None, best, unique, dups)
            counts["documents"] += 1
            counts["duplicates"] += match is not None
    return counts


def run(tool: str, path: str, out_dir: Path, text_field: str, id_field: str,
        n: int = 5, num_perm: int = 128, seed: int = 1, threshold: float = 0.8) -> dict[str, int]:
    """Deduplicate ``path`` into ``out_dir``; returns counts (documents, duplicates, rejects)."""
    if tool in ("gaoya", "gaoya-bulk"):
        return run_gaoya(tool == "gaoya-bulk", path, out_dir, text_field, id_field, threshold)
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
    p.add_argument("tool", choices=["datasketch", "rensa", "gaoya", "gaoya-bulk"])
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
