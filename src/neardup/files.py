"""JSONL (optionally gzipped) source and sinks for the embedded mode.

The source yields one ``Line`` per input line, good or bad, so that no line is lost: a
bad one carries the reason and goes to ``rejects.jsonl``. An input is known by its
content (``Input.key``: size and a hash of its first MiB), not by its name, so that a
file rewritten under the same name is read again from the start. gzip is recognised by
its magic bytes, on stdin too.
"""

from __future__ import annotations

import io
import json
import os
import stat
import sys
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import orjson
import xxhash
from isal import igzip, isal_zlib

from neardup.core.types import Document
from neardup.records import NoMainText, RecordError, record_id, record_text, record_time

if TYPE_CHECKING:
    from neardup.detector import VerdictColumns

GZIP_MAGIC = b"\x1f\x8b"
#: What reading a corrupt or truncated input raises (gzip data is decompressed by ISA-L,
#: ``isal.igzip``: about half the CPU time of the standard ``gzip`` module).
READ_ERRORS: tuple[type[BaseException], ...] = (EOFError, OSError, isal_zlib.error)
#: Bytes of an input hashed into its key (with its size).
HEAD_BYTES = 1 << 20
OUTPUT_NAMES = ("unique", "duplicates", "rejects")


class InputError(ValueError):
    """An input cannot be read: missing, a directory, unreadable, or corrupt."""


class OutputError(ValueError):
    """The outputs cannot be written without destroying earlier ones."""


@dataclass(frozen=True, slots=True)
class Line:
    """One input line: ``number`` (1-based) and either a document or a reject reason."""

    number: int
    record: Any
    document: Document | None
    error: str | None = None
    raw: str | None = None
    data: bytes | None = None  # a parsed line's bytes as read (the outputs repeat them)
    #: a document's record is a JSON object without a ``neardup`` member: its output is
    #: its bytes with that member spliced in (``OutputFiles.write_verdicts``)
    spliceable: bool = False


@dataclass(frozen=True, slots=True)
class Input:
    """An input checked before any output is touched.

    Attributes:
        path: as given (``-`` is stdin).
        key: the name its position is stored under: ``stdin``, or
            ``content:<size>:<xxh3-128 of the first HEAD_BYTES bytes, hex>`` (bytes on
            disk, compressed or not), so equal content is one input whatever its name.
        size: bytes on disk; None for stdin.
    """

    path: str
    key: str
    size: int | None

    @property
    def resumable(self) -> bool:
        return self.path != "-"


def check_input(path: str) -> Input:
    """Stat, open and hash the head of ``path``: every reason not to read it, up front.

    Raises:
        InputError: the path does not exist, is a directory, or cannot be read.
    """
    if path == "-":
        return Input(path, "stdin", None)
    try:
        with open(path, "rb") as f:
            info = os.fstat(f.fileno())
            if stat.S_ISDIR(info.st_mode):
                raise InputError(f"input {path} is a directory, not a JSONL file")
            head = f.read(HEAD_BYTES)
    except IsADirectoryError:
        raise InputError(f"input {path} is a directory, not a JSONL file") from None
    except FileNotFoundError:
        raise InputError(f"input not found: {path}") from None
    except OSError as exc:
        raise InputError(f"cannot read input {path}: {exc.strerror or exc}") from None
    return Input(path, f"content:{info.st_size}:{xxhash.xxh3_128_hexdigest(head)}", info.st_size)


class _Prefixed(io.RawIOBase):
    """``prefix`` then the rest of ``stream``: bytes read ahead, put back."""

    def __init__(self, prefix: bytes, stream: IO[bytes]) -> None:
        self._prefix = prefix
        self._stream = stream

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        if self._prefix:
            n = min(len(buffer), len(self._prefix))
            buffer[:n] = self._prefix[:n]
            self._prefix = self._prefix[n:]
            return n
        data = self._stream.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)


def _read_exactly(stream: IO[bytes], n: int) -> bytes:
    data = b""
    while len(data) < n and (chunk := stream.read(n - len(data))):
        data += chunk
    return data


def open_binary(path: str) -> IO[bytes]:
    """Open ``path`` for reading bytes: ``-`` is stdin; gzip (by its magic bytes, whatever
    the name) is gunzipped (``isal.igzip``; errors: ``READ_ERRORS``).

    Raises:
        FileNotFoundError: the path does not exist.
        IsADirectoryError: the path is a directory.
    """
    binary: IO[bytes]
    if path == "-":
        stdin = sys.stdin.buffer
        binary = io.BufferedReader(_Prefixed(_read_exactly(stdin, 2), stdin))
        if binary.peek(2)[:2] == GZIP_MAGIC:
            binary = igzip.IGzipFile(fileobj=binary, mode="rb")
    else:
        with open(path, "rb") as f:
            magic = f.read(2)
        binary = igzip.open(path, "rb") if magic == GZIP_MAGIC else open(path, "rb")
    return binary


def open_text(path: str) -> IO[str]:
    """``open_binary`` decoded as UTF-8 (undecodable bytes as lone surrogates).

    Raises:
        FileNotFoundError: the path does not exist.
        IsADirectoryError: the path is a directory.
    """
    return io.TextIOWrapper(open_binary(path), encoding="utf-8", errors="surrogateescape")


def read_lines(
    stream: Iterable[bytes],
    text_fields: Sequence[str],
    id_field: str | None,
    start: int = 0,
    time_field: str | None = None,
    text_format: str = "plain",
) -> Iterator[Line]:
    """Parse JSONL from the byte lines of ``stream`` (``open_binary``), skipping the first
    ``start`` lines and blank ones (``parse_line``, which says how each line is read).
    """
    for number, data in numbered_lines(stream, start):
        if (line := parse_line(number, data, text_fields, id_field, time_field, text_format)) is not None:
            yield line


def numbered_lines(stream: Iterable[bytes], start: int = 0) -> Iterator[tuple[int, bytes]]:
    """``(number, bytes)`` of each line of ``stream`` after the first ``start``, numbered
    from 1; lines of white space only (ASCII) are skipped."""
    for number, data in enumerate(stream, start=1):
        if number > start and data.strip():
            yield number, data


def parse_line(number: int, data: bytes, text_fields: Sequence[str], id_field: str | None,
               time_field: str | None = None, text_format: str = "plain") -> Line | None:
    """One JSONL line (``data``, its bytes, line ``number``) as a ``Line``; None for a line
    blank by Unicode's white space.

    With ``time_field`` a document's time (for a retention window) is that field's
    value, ISO 8601 or epoch seconds (``neardup.records.record_time``); without it, its
    arrival.

    With ``text_format`` ``"html"`` the text fields hold HTML and the text is their main
    text (``neardup.records.record_text``); a page with none is rejected, saying so.

    A record's id is its ``id_field`` value, else its line number. Lines that are not
    valid UTF-8, not JSON, or lack the text field come out with ``document=None`` and
    ``error`` set. Lines are parsed by orjson; what it refuses is parsed again by
    ``json``, which also reads NaN, integers beyond 64 bits and lone surrogate escapes,
    and whose error message a reject carries.
    """
    try:
        record = orjson.loads(data)
    except orjson.JSONDecodeError:
        try:
            raw = data.decode("utf-8")
        except UnicodeDecodeError:
            return Line(number, None, None, "invalid UTF-8", data.decode("utf-8", "replace"))
        if not raw.strip():  # blank by Unicode's white space
            return None
        try:
            record = json.loads(raw)
        except (ValueError, RecursionError) as exc:  # also: nesting or digits beyond json's limits
            return Line(number, None, None, f"invalid JSON: {exc}", raw)
    try:
        try:
            text = record_text(record, text_fields, text_format)
            doc_id = record_id(record, id_field) or str(number)
        except NoMainText:
            raise
        except RecordError as refused:
            # orjson reads an integer beyond 64 bits as a float: json keeps it exact
            try:
                record = json.loads(data)
            except (ValueError, RecursionError):
                raise refused from None
            text = record_text(record, text_fields, text_format)
            doc_id = record_id(record, id_field) or str(number)
        when = record_time(record, time_field) if time_field else None
        _check_unicode(id_field or "id", doc_id, text_fields, text)
    except RecordError as exc:
        return Line(number, record, None, str(exc), data.decode("utf-8"))
    spliceable = type(record) is dict and "neardup" not in record  # and not empty: it has a text
    return Line(number, record, Document(doc_id, text, when), data=data, spliceable=spliceable)


def _check_unicode(id_name: str, doc_id: str, text_fields: Sequence[str], text: str) -> None:
    """Refuse an id or a text holding a lone surrogate (a ``"\\ud800"`` escape that only
    ``json`` reads): it is no Unicode text, and could be neither stored nor shingled.

    Raises:
        RecordError: naming the field.
    """
    for name, value in ((id_name, doc_id), ("/".join(text_fields), text)):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise RecordError(f"invalid JSON: field {name!r} holds a lone surrogate (not Unicode text)") from None


@contextmanager
def _nesting_allowed(levels: int = 4096) -> Iterator[None]:
    """Let ``json``, which recurses, read and write records as deep as orjson reads them
    (1,024 levels): Python's default limit of 1,000 frames is below that."""
    before = sys.getrecursionlimit()
    sys.setrecursionlimit(max(before, levels))
    try:
        yield
    finally:
        sys.setrecursionlimit(before)


def _dumps(entry: dict[str, Any]) -> bytes:
    """One JSON line, UTF-8; a lone surrogate (``"\\ud800"`` in the input) stays escaped."""
    try:
        return (json.dumps(entry, ensure_ascii=False) + "\n").encode("utf-8")
    except UnicodeEncodeError:
        return (json.dumps(entry) + "\n").encode("ascii")


class OutputFiles:
    """``unique.jsonl``, ``duplicates.jsonl`` and ``rejects.jsonl`` in ``out_dir``.

    Each unique or duplicate record is written as it came, plus a ``neardup`` object with
    the document id neardup used and the verdict; each reject as
    ``{"line", "reason", "id", "raw"}``.

    Earlier outputs are never destroyed unasked. ``committed`` is what the state recorded
    at its last commit: each file's length in bytes (``flush``'s value). Outputs the
    state recorded are continued, cut back to the recorded lengths first: what a killed
    run wrote after its last commit is written again by the rerun, exactly once; outputs
    shorter than recorded (changed since) are refused. Outputs the state did not record
    are appended to with ``append`` and refused otherwise. ``overwrite`` empties them in
    every case.

    Args:
        out_dir: created when missing.
        committed: output name -> bytes, or None when the state recorded none here.
        append: append to outputs the state did not record.
        overwrite: empty the outputs first, whatever they hold.

    Raises:
        OutputError: non-empty outputs, neither recorded nor ``append``/``overwrite``;
            outputs shorter than recorded (changed since); or ``out_dir`` or a file in it
            cannot be created or opened.
    """

    def __init__(self, out_dir: Path, committed: dict[str, int] | None = None,
                 append: bool = False, overwrite: bool = False) -> None:
        self.paths = {name: out_dir / f"{name}.jsonl" for name in OUTPUT_NAMES}
        self._files: dict[str, IO[bytes]] = {}
        self._pending: dict[str, list[bytes]] = {name: [] for name in OUTPUT_NAMES}  # lines not written yet
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
            sizes = {name: path.stat().st_size if path.exists() else 0 for name, path in self.paths.items()}
            keep = _lengths_to_keep(out_dir, sizes, committed, append, overwrite)
            for name, path in self.paths.items():
                f = self._files[name] = open(path, "r+b" if path.exists() else "wb")
                f.truncate(keep[name])
                f.seek(keep[name])
        except OSError as exc:
            self.close()
            raise OutputError(f"--out-dir {out_dir}: cannot write the outputs: {exc.strerror or exc}") from exc

    @staticmethod
    def _write_encoded(pending: list[bytes], entry: dict[str, Any], data: bytes) -> None:
        """The record of ``data`` read again and encoded with ``neardup`` set to ``entry``."""
        with _nesting_allowed():  # a record orjson read (up to 1,024 levels) json can write
            record = json.loads(data)  # by json, which keeps integers beyond 64 bits exact
            out = dict(record) if isinstance(record, dict) else {"value": record}
            out["neardup"] = entry
            pending.append(_dumps(out))

    def write_verdicts(self, columns: VerdictColumns, data: Sequence[bytes], spliceable: Sequence[bool]) -> None:
        """Queue the output line of each record (``data``: the lines' bytes as read) with
        its verdict (``columns``, one per line, in order); ``flush`` writes them.

        A ``spliceable`` record (``Line.spliceable``: a JSON object without a ``neardup``
        member) is written as its bytes with the ``neardup`` member spliced in before its
        closing brace: the record comes out byte for byte as it came, without being
        encoded again. Any other record is read again and encoded with ``neardup`` set.
        The ``neardup`` member is the verdict as ``Verdict.to_dict`` gives it, after
        ``"id"``.
        """
        pending = {True: self._pending["duplicates"], False: self._pending["unique"]}
        dumps, join = orjson.dumps, b"".join
        for doc_id, dup, cluster, match, sim, jac, con, related, nearest, k, r, line, whole in zip(
                columns.ids, columns.duplicate, columns.cluster, columns.match, columns.similarity,
                columns.jaccard, columns.containment, columns.related, columns.nearest,
                columns.candidates, columns.rejected, data, spliceable):
            entry = {"id": doc_id, "verdict": "duplicate" if dup else "unique", "cluster": cluster,
                     "match": match, "similarity": round(sim, 6), "jaccard": round(jac, 6),
                     "containment": round(con, 6), "related": related, "nearest": nearest,
                     "candidates": k, "rejected_candidates": r}
            if whole:
                head = line.rstrip()
                if head.endswith(b"}"):
                    try:
                        pending[dup].append(join((head[:-1], b',"neardup":', dumps(entry), b"}\n")))
                        continue
                    except orjson.JSONEncodeError:  # a lone surrogate in an id: json escapes it
                        pass
            self._write_encoded(pending[dup], entry, line)

    def write_reject(self, line: int, reason: str, doc_id: str | None = None, raw: str | None = None) -> None:
        """Queue a reject line; ``flush`` writes it."""
        entry = {"line": line, "reason": reason, "id": doc_id, "raw": raw}
        self._pending["rejects"].append(_dumps(entry))

    def flush(self) -> dict[str, int]:
        """Write out what was queued (one write per file) and flush to the operating system;
        returns each file's length in bytes, to be committed with the batch's state.

        Raises:
            OutputError: a file cannot be written (full disk, ...).
        """
        for name, f in self._files.items():
            lines, self._pending[name] = self._pending[name], []
            try:
                if lines:
                    f.write(b"".join(lines))
                f.flush()
            except OSError as exc:  # a full disk, a quota, an I/O error
                raise OutputError(f"cannot write {self.paths[name]}: {exc.strerror or exc}") from exc
        return {name: f.tell() for name, f in self._files.items()}

    def close(self) -> None:
        for f in self._files.values():
            try:
                f.close()
            except OSError:  # what a full disk kept back: the rerun writes it again
                pass


def _lengths_to_keep(out_dir: Path, sizes: dict[str, int], committed: dict[str, int] | None,
                     append: bool, overwrite: bool) -> dict[str, int]:
    """Bytes of each output to keep (see ``OutputFiles``). Raises OutputError."""
    if overwrite:
        return dict.fromkeys(sizes, 0)
    if committed is not None:
        for name, size in sizes.items():
            if size < committed.get(name, 0):
                raise OutputError(
                    f"{out_dir / (name + '.jsonl')} holds {size:,} bytes, fewer than the "
                    f"{committed[name]:,} the state recorded: it was changed since; use "
                    "--overwrite to start the outputs anew (earlier verdicts are not "
                    "written again) or another --out-dir"
                )
        return {name: committed.get(name, 0) for name in sizes}
    if append or not any(sizes.values()):
        return sizes
    name = next(n for n, size in sizes.items() if size)
    raise OutputError(
        f"{out_dir / (name + '.jsonl')} is not empty and not from this state: use "
        "--append to add to it, --overwrite to replace it, or another --out-dir"
    )
