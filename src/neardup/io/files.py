"""JSONL (optionally gzipped) source and sinks for the embedded mode.

The source yields one ``Line`` per input line, good or bad, so that no line is lost: a
bad one carries the reason and goes to ``rejects.jsonl``.
"""

from __future__ import annotations

import gzip
import io
import json
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from neardup.core.types import Document, Verdict
from neardup.records import RecordError, record_id, record_text


@dataclass(frozen=True, slots=True)
class Line:
    """One input line: ``number`` (1-based) and either a document or a reject reason."""

    number: int
    record: Any
    document: Document | None
    error: str | None = None
    raw: str | None = None


def source_name(path: str) -> str:
    """The name under which the input position of ``path`` is stored."""
    return "stdin" if path == "-" else f"file:{Path(path).resolve()}"


def open_text(path: str) -> IO[str]:
    """Open ``path`` for reading text: ``-`` is stdin, ``*.gz`` is gunzipped.

    Raises:
        FileNotFoundError: the path does not exist.
    """
    if path == "-":
        return io.TextIOWrapper(sys.stdin.buffer, encoding="utf-8", errors="surrogateescape")
    if path.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8", errors="surrogateescape")
    return open(path, encoding="utf-8", errors="surrogateescape")


def read_lines(
    stream: IO[str],
    text_fields: Sequence[str],
    id_field: str | None,
    start: int = 0,
) -> Iterator[Line]:
    """Parse JSONL from ``stream``, skipping the first ``start`` lines.

    A record's id is its ``id_field`` value, else its line number. Blank lines are
    skipped. Lines that are not valid UTF-8, not JSON, or lack the text field come out
    with ``document=None`` and ``error`` set.
    """
    for number, raw in enumerate(stream, start=1):
        if number <= start or not raw.strip():
            continue
        try:
            raw.encode("utf-8")
        except UnicodeEncodeError:
            yield Line(number, None, None, "invalid UTF-8", raw.encode("utf-8", "surrogateescape").decode("utf-8", "replace"))
            continue
        try:
            record = json.loads(raw)
        except json.JSONDecodeError as exc:
            yield Line(number, None, None, f"invalid JSON: {exc}", raw)
            continue
        try:
            text = record_text(record, text_fields)
            doc_id = record_id(record, id_field) or str(number)
        except RecordError as exc:
            yield Line(number, record, None, str(exc), raw)
            continue
        yield Line(number, record, Document(doc_id, text))


class OutputFiles:
    """``unique.jsonl``, ``duplicates.jsonl`` and ``rejects.jsonl`` in ``out_dir``.

    Each unique or duplicate record is written as it came, plus a ``neardup`` object with
    the verdict; each reject as ``{"line", "reason", "id", "raw"}``.
    """

    def __init__(self, out_dir: Path, append: bool = False) -> None:
        out_dir.mkdir(parents=True, exist_ok=True)
        mode = "a" if append else "w"
        self.paths = {
            name: out_dir / f"{name}.jsonl" for name in ("unique", "duplicates", "rejects")
        }
        self._files = {
            name: open(path, mode, encoding="utf-8") for name, path in self.paths.items()
        }

    def write_verdict(self, record: Any, verdict: Verdict) -> None:
        out = dict(record) if isinstance(record, dict) else {"value": record}
        out["neardup"] = verdict.to_dict()
        name = "duplicates" if verdict.is_duplicate else "unique"
        self._files[name].write(json.dumps(out, ensure_ascii=False) + "\n")

    def write_reject(self, line: int, reason: str, doc_id: str | None = None, raw: str | None = None) -> None:
        entry = {"line": line, "reason": reason, "id": doc_id, "raw": raw}
        self._files["rejects"].write(json.dumps(entry, ensure_ascii=False) + "\n")

    def flush(self) -> None:
        for f in self._files.values():
            f.flush()

    def close(self) -> None:
        for f in self._files.values():
            f.close()
