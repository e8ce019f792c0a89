"""Kafka messages to documents, and verdicts to output headers.

Kept apart from the consumer loop so that the mapping can be read (and tested) alone.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import orjson

from neardup.core.types import Document, Verdict
from neardup.extract import main_text
from neardup.records import NoMainText, RecordError, record_id, record_text

if TYPE_CHECKING:
    from neardup.detector import VerdictColumns

Headers = list[tuple[str, bytes]]
Target = Literal["unique", "duplicate", "dlq"]
Content = Literal["whole", "no_value", "headers_only"]

HEADER_VERDICT = "neardup-verdict"
HEADER_CLUSTER = "neardup-cluster"
HEADER_MATCH = "neardup-match"
HEADER_SIMILARITY = "neardup-similarity"
HEADER_JACCARD = "neardup-jaccard"
HEADER_CONTAINMENT = "neardup-containment"
HEADER_RELATED = "neardup-related"
HEADER_NEAREST = "neardup-nearest"
HEADER_ERROR = "neardup-error"
HEADER_SOURCE_TOPIC = "neardup-source-topic"
HEADER_SOURCE_PARTITION = "neardup-source-partition"
HEADER_SOURCE_OFFSET = "neardup-source-offset"
HEADER_VALUE_BYTES = "neardup-value-bytes"
#: Prefix of the headers neardup adds. An input message's own headers with this prefix
#: (matched without regard to case) are renamed with ``INPUT_PREFIX``; those already
#: renamed are dropped (``carried_headers``).
PREFIX = "neardup-"
INPUT_PREFIX = "neardup-input-"

#: Layout version of ``Outcome.to_bytes`` (its first byte).
RECORD_VERSION = 2
_TARGETS: tuple[Target, ...] = ("unique", "duplicate", "dlq")
_TARGET_CODES = {t: i for i, t in enumerate(_TARGETS)}
_CONTENTS: tuple[Content, ...] = ("whole", "no_value", "headers_only")
_CONTENT_CODES = {c: i for i, c in enumerate(_CONTENTS)}
# version, target, content, error kind length + 1, headers
_RECORD_HEAD = struct.Struct("<BBBHH")
_RECORD_HEAD_V1 = struct.Struct("<BBHH")  # version 1: no content byte (always whole)
#: A message offset in ``verdict_key``: u64 BE.
OFFSET_BE = struct.Struct(">Q")
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")

#: Upper bound of the bytes a record adds around its key, value and headers when it is
#: alone in a record batch (Kafka's message format v2: the batch header, 61 bytes, and
#: the record's length, attributes, timestamp and offset deltas, key and value lengths
#: and header count as varints of at most 5 or 10 bytes), and of what each header adds
#: (its key and value lengths). The broker compares the batch's size with
#: ``max.message.bytes``.
RECORD_OVERHEAD = 61 + 5 + 1 + 10 + 5 + 5 + 5 + 5
HEADER_OVERHEAD = 5 + 5
#: Stages of an outcome, each the fallback of the one before when its record cannot be
#: produced: 0 its verdict's topic, 1 a dead letter with the whole message, 2 a dead
#: letter without the value, 3 a dead letter of neardup's headers alone.
LAST_STAGE = 3


_VERDICT_HEADERS = {name: (HEADER_VERDICT, name.encode()) for name in ("unique", "duplicate")}


def _key_field(key: str) -> bytes:
    """A header key as stored in an outcome record: length u16 LE, then UTF-8."""
    raw = key.encode("utf-8")
    return _U16.pack(len(raw)) + raw


_KEY_FIELDS = {
    key: _key_field(key)
    for key in (
        HEADER_VERDICT, HEADER_CLUSTER, HEADER_MATCH, HEADER_SIMILARITY, HEADER_JACCARD,
        HEADER_CONTAINMENT, HEADER_RELATED, HEADER_NEAREST, HEADER_ERROR, HEADER_SOURCE_TOPIC,
        HEADER_SOURCE_PARTITION, HEADER_SOURCE_OFFSET, HEADER_VALUE_BYTES,
    )
}


class MessageError(ValueError):
    """A message that goes to the dead-letter topic; ``str(error)`` is the reason.

    ``kind`` names the case for metrics: tombstone, too_large, invalid_utf8, invalid_json,
    missing_field, empty_text (and, set by the consumer, output_too_large and
    produce_failed).
    """

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(reason)
        self.kind = kind


@dataclass(frozen=True)
class Outcome:
    """Where one input message goes, the headers added to it, and what of the message
    goes along (``content``: ``whole``, its key, value and headers; ``no_value``, its
    key and headers; ``headers_only``, nothing of the message but neardup's headers).

    ``to_bytes``/``from_bytes`` give the record stored with the state (the ``verdicts``
    column family) so that a message processed before a crash is produced again with the
    same verdict. The record, all integers unsigned little-endian:

    ========================= ====================================================
    bytes                     content
    ========================= ====================================================
    1                         layout version, 2
    1                         target: 0 unique, 1 duplicate, 2 dlq
    1                         content: 0 whole, 1 no_value, 2 headers_only
    2 (u16)                   length of ``error_kind`` in UTF-8 bytes + 1; 0: None
    2 (u16)                   number of headers
    that length - 1           ``error_kind``, UTF-8
    per header:
    2 (u16)                   key length in bytes
    key length                key, UTF-8
    4 (u32)                   value length in bytes
    value length              value, as is
    ========================= ====================================================

    A record lives from the RocksDB commit of its batch to the commit of the next batch,
    so ``from_bytes`` only needs the previous layouts to read a store written by the
    previous versions: version 1 (the same without the content byte, always whole), and
    the JSON form ``[target, [[key, value as UTF-8 text], ...], error_kind or null]``
    (starts with ``[``, 0x5B).
    """

    target: Target
    headers: Headers
    error_kind: str | None = None
    content: Content = "whole"

    @property
    def stage(self) -> int:
        """0 for a verdict's topic; 1, 2, 3 for a dead letter with the whole message,
        without the value, of neardup's headers alone (see ``LAST_STAGE``)."""
        return 0 if self.target != "dlq" else 1 + _CONTENT_CODES[self.content]

    def to_bytes(self) -> bytes:
        """The record of the table above.

        Raises:
            ValueError: a target other than unique, duplicate or dlq, an unknown
                content; more than 65,535 headers, a key or ``error_kind`` over 65,534
                UTF-8 bytes, or a value of 4 GiB or more; a key or ``error_kind`` that
                is not encodable in UTF-8 (lone surrogates; ``UnicodeEncodeError``).
        """
        kind = self.error_kind
        kind_bytes = b"" if kind is None else kind.encode("utf-8")
        headers = self.headers
        try:
            parts = [
                _RECORD_HEAD.pack(
                    RECORD_VERSION,
                    _TARGET_CODES[self.target],
                    _CONTENT_CODES[self.content],
                    0 if kind is None else len(kind_bytes) + 1,
                    len(headers),
                ),
                kind_bytes,
            ]
            append, pack_len = parts.append, _U32.pack
            for key, value in headers:
                field = _KEY_FIELDS.get(key)
                if field is None:
                    field = _key_field(key)
                append(field)
                append(pack_len(len(value)))
                append(value)
        except KeyError:
            raise ValueError(f"unknown target {self.target!r} or content {self.content!r}") from None
        except struct.error as exc:
            raise ValueError(f"outcome too large for its record: {exc}") from None
        return b"".join(parts)

    @classmethod
    def from_bytes(cls, raw: bytes) -> Outcome:
        """The outcome of a record written by ``to_bytes``, or by earlier versions (see
        the class docstring).

        Raises:
            ValueError: an unknown layout version, target or content, a truncated
                record or one with bytes left over, invalid UTF-8 in a key or
                ``error_kind``, invalid JSON (``json.JSONDecodeError``).
        """
        if raw[:1] == b"[":
            target, headers, kind = json.loads(raw)
            return cls(target, [(k, v.encode("utf-8")) for k, v in headers], kind)
        try:
            if raw[:1] == b"\x01":
                _, code, kind_len, count = _RECORD_HEAD_V1.unpack_from(raw, 0)
                content, pos = 0, _RECORD_HEAD_V1.size
            else:
                version, code, content, kind_len, count = _RECORD_HEAD.unpack_from(raw, 0)
                if version != RECORD_VERSION:
                    raise ValueError(f"unknown outcome record layout {version}")
                pos = _RECORD_HEAD.size
            if code >= len(_TARGETS) or content >= len(_CONTENTS):
                raise ValueError(f"unknown outcome target {code} or content {content}")
            kind = None
            if kind_len:
                end = pos + kind_len - 1
                kind = raw[pos:end].decode("utf-8")
                pos = end
            headers: Headers = []
            unpack_key_len, unpack_len = _U16.unpack_from, _U32.unpack_from
            for _ in range(count):
                (n,) = unpack_key_len(raw, pos)
                pos += 2
                key = raw[pos : pos + n].decode("utf-8")
                pos += n
                (n,) = unpack_len(raw, pos)
                pos += 4
                headers.append((key, bytes(raw[pos : pos + n])))
                pos += n
        except struct.error:
            raise ValueError("truncated outcome record") from None
        if pos != len(raw):
            raise ValueError(f"outcome record of {len(raw)} bytes, {pos} expected")
        return cls(_TARGETS[code], headers, kind, _CONTENTS[content])

    @classmethod
    def of_verdict(cls, verdict: Verdict) -> Outcome:
        """The outcome of a verdict: target unique or duplicate; headers verdict,
        cluster, match (empty when None), similarity, jaccard and containment (decimal
        text, 6 decimals; of the nearest candidate, for a unique document too), related
        and nearest when not None; ids in UTF-8.

        Raises:
            UnicodeEncodeError: an id with lone surrogates.
        """
        name = verdict.verdict
        match = verdict.match
        headers: Headers = [
            _VERDICT_HEADERS.get(name) or (HEADER_VERDICT, name.encode()),
            (HEADER_CLUSTER, verdict.cluster.encode()),
            (HEADER_MATCH, b"" if match is None else match.encode()),
            (HEADER_SIMILARITY, b"%.6f" % verdict.similarity),
            (HEADER_JACCARD, b"%.6f" % verdict.jaccard),
            (HEADER_CONTAINMENT, b"%.6f" % verdict.containment),
        ]
        if verdict.related is not None:
            headers.append((HEADER_RELATED, verdict.related.encode()))
        if verdict.nearest is not None:
            headers.append((HEADER_NEAREST, verdict.nearest.encode()))
        return cls("duplicate" if name == "duplicate" else "unique", headers)

    @classmethod
    def of_columns(cls, columns: VerdictColumns) -> tuple[list[Outcome], list[int], list[bytes]]:
        """``of_verdict`` of each verdict of ``columns``, in order, without making the
        ``Verdict`` objects; the bytes each outcome's headers add to a record
        (``record_size(None, None, outcome.headers) - RECORD_OVERHEAD``); and each
        outcome's ``to_bytes()``.

        Raises:
            UnicodeEncodeError: an id with lone surrogates.
        """
        outcomes: list[Outcome] = []
        sizes: list[int] = []
        records: list[bytes] = []
        append, append_size, append_record = outcomes.append, sizes.append, records.append
        duplicate_header, unique_header = _VERDICT_HEADERS["duplicate"], _VERDICT_HEADERS["unique"]
        whole = _CONTENT_CODES["whole"]
        head = {(dup, n): _RECORD_HEAD.pack(RECORD_VERSION, _TARGET_CODES["duplicate" if dup else "unique"],
                                            whole, 0, n) for dup in (False, True) for n in (6, 7, 8)}
        verdict_field, cluster_field, match_field = (_KEY_FIELDS[k] for k in (HEADER_VERDICT, HEADER_CLUSTER,
                                                                              HEADER_MATCH))
        scores_field = [_KEY_FIELDS[k] for k in (HEADER_SIMILARITY, HEADER_JACCARD, HEADER_CONTAINMENT)]
        related_field, nearest_field = _KEY_FIELDS[HEADER_RELATED], _KEY_FIELDS[HEADER_NEAREST]
        pack_len = _U32.pack
        # the keys' lengths and overheads of the six headers every verdict has
        fixed = 6 * HEADER_OVERHEAD + sum(map(len, (HEADER_VERDICT, HEADER_CLUSTER, HEADER_MATCH, HEADER_SIMILARITY,
                                                     HEADER_JACCARD, HEADER_CONTAINMENT)))
        related_size, nearest_size = HEADER_OVERHEAD + len(HEADER_RELATED), HEADER_OVERHEAD + len(HEADER_NEAREST)
        for dup, cluster, match, sim, jac, con, rel, near in zip(
                columns.duplicate, columns.cluster, columns.match, columns.similarity, columns.jaccard,
                columns.containment, columns.related, columns.nearest):
            verdict = duplicate_header if dup else unique_header
            verdict_b = verdict[1]
            cluster_b = cluster.encode()
            match_b = b"" if match is None else match.encode()
            sim_b, jac_b, con_b = b"%.6f" % sim, b"%.6f" % jac, b"%.6f" % con
            headers: Headers = [
                verdict,
                (HEADER_CLUSTER, cluster_b),
                (HEADER_MATCH, match_b),
                (HEADER_SIMILARITY, sim_b),
                (HEADER_JACCARD, jac_b),
                (HEADER_CONTAINMENT, con_b),
            ]
            size = fixed + len(verdict_b) + len(cluster_b) + len(match_b) + len(sim_b) + len(jac_b) + len(con_b)
            parts = [b"", verdict_field, pack_len(len(verdict_b)), verdict_b,
                     cluster_field, pack_len(len(cluster_b)), cluster_b,
                     match_field, pack_len(len(match_b)), match_b,
                     scores_field[0], pack_len(len(sim_b)), sim_b,
                     scores_field[1], pack_len(len(jac_b)), jac_b,
                     scores_field[2], pack_len(len(con_b)), con_b]
            if rel is not None:
                raw = rel.encode()
                headers.append((HEADER_RELATED, raw))
                size += related_size + len(raw)
                parts += (related_field, pack_len(len(raw)), raw)
            if near is not None:
                raw = near.encode()
                headers.append((HEADER_NEAREST, raw))
                size += nearest_size + len(raw)
                parts += (nearest_field, pack_len(len(raw)), raw)
            parts[0] = head[(bool(dup), len(headers))]
            append(cls("duplicate" if dup else "unique", headers))
            append_size(size)
            append_record(b"".join(parts))
        return outcomes, sizes, records

    @classmethod
    def of_error(cls, kind: str, reason: str, topic: str, partition: int, offset: int) -> Outcome:
        """A dead letter of the whole message: headers error (``reason``), source topic,
        partition and offset."""
        headers: Headers = [
            (HEADER_ERROR, reason.encode("utf-8")),
            (HEADER_SOURCE_TOPIC, topic.encode("utf-8")),
            (HEADER_SOURCE_PARTITION, str(partition).encode()),
            (HEADER_SOURCE_OFFSET, str(offset).encode()),
        ]
        return cls("dlq", headers, kind)

    def stripped(self, content: Content, value_bytes: int, note: str) -> Outcome:
        """This dead letter with less of the message (``content``), ``note`` added to
        its reason and the value's size (bytes, decimal) in ``neardup-value-bytes``."""
        headers = [(k, v + b"; " + note.encode("utf-8")) if k == HEADER_ERROR else (k, v)
                   for k, v in self.headers if k != HEADER_VALUE_BYTES]
        headers.append((HEADER_VALUE_BYTES, str(value_bytes).encode()))
        return Outcome("dlq", headers, self.error_kind, content)


def carried_headers(headers: Headers | None) -> Headers:
    """An input message's headers as they go out: its ``neardup-*`` headers (spoofed, or
    neardup's own output consumed again) renamed ``neardup-input-*``, and those already
    so named dropped, so that an output carries one set of neardup's headers and at most
    one set of its input's. Other headers are kept, in order.
    """
    if not headers:
        return []
    n = len(PREFIX)
    if not any(k[:n].lower() == PREFIX for k, _ in headers):
        return headers
    out: Headers = []
    for k, v in headers:
        if k[:n].lower() == PREFIX:
            if k[: len(INPUT_PREFIX)].lower() == INPUT_PREFIX:
                continue
            k = INPUT_PREFIX + k[n:]
        out.append((k, v))
    return out


def record_size(key: bytes | None, value: bytes | None, *headers: Headers) -> int:
    """Upper bound of the size in bytes of a record of ``key``, ``value`` and the
    ``headers`` lists (one after the other) alone in an uncompressed record batch: what
    the broker compares with the topic's ``max.message.bytes`` (``RECORD_OVERHEAD``,
    ``HEADER_OVERHEAD``)."""
    size = RECORD_OVERHEAD + (len(key) if key else 0) + (len(value) if value else 0)
    for part in headers:
        for k, v in part:
            size += HEADER_OVERHEAD + (len(k) if k.isascii() else len(k.encode("utf-8", "surrogatepass")))
            if v:
                size += len(v)
    return size


#: Where an outcome can go: per target, the topic and the largest record it takes
#: (bytes).
Limits = dict[str, tuple[str, int]]


def fit(outcome: Outcome, key: bytes | None, value: bytes | None, carried: Headers,
        limits: Limits, source: tuple[str, int, int], stage: int = 0,
        failure: str | None = None, header_bytes: int | None = None) -> Outcome:
    """``outcome`` itself if its record fits its topic (``record_size``), else the first
    of its fallbacks that fits (a dead letter with the whole message, without the value,
    of neardup's headers alone: ``Outcome.stage``), never below ``stage``.

    Args:
        carried: the message's headers as they go out (``carried_headers``).
        limits: per target (unique, duplicate, dlq), the topic and its largest record.
        source: the message's topic, partition and offset.
        stage: the first stage allowed (a record of a lower one failed to be produced).
        failure: why that record failed (the dead letter's reason); None: it was too
            large for its topic's ``limits``.
        header_bytes: what ``outcome.headers`` add to a record, when known already
            (``Outcome.of_columns``): they are not counted again.
    """
    if outcome.target != "dlq":
        topic, limit = limits[outcome.target]
        if header_bytes is None:
            size = record_size(key, value, carried, outcome.headers)
        else:
            size = record_size(key, value, carried) + header_bytes
        if stage < 1 and size <= limit:
            return outcome
        if failure is None:
            reason = f"record of {size} bytes exceeds max.message.bytes {limit} of topic {topic}"
        else:
            reason = failure
        outcome = Outcome.of_error("output_too_large" if failure is None else "produce_failed", reason, *source)
    topic, limit = limits["dlq"]
    value_bytes = len(value) if value else 0
    note = failure or f"left out to fit max.message.bytes {limit} of topic {topic}"
    if outcome.content == "whole" and (stage >= 2 or record_size(key, value, carried, outcome.headers) > limit):
        outcome = outcome.stripped("no_value", value_bytes, f"value ({value_bytes} bytes) {note}")
    if outcome.content == "no_value" and (stage >= 3 or record_size(key, None, carried, outcome.headers) > limit):
        outcome = outcome.stripped("headers_only", value_bytes, f"key and headers {note}")
    return outcome


def source_name(topic: str, partition: int) -> str:
    """Name of a partition's input position in the state store."""
    return f"kafka:{topic}:{partition}"


def verdict_key(topic: str, partition: int, offset: int) -> bytes:
    """Key of a message's stored ``Outcome``: ``topic:partition`` (UTF-8), NUL, offset
    u64 BE (``verdict_key_prefix`` + ``OFFSET_BE.pack(offset)``).

    Raises:
        struct.error: an offset outside 0 .. 2**64 - 1.
    """
    return verdict_key_prefix(topic, partition) + OFFSET_BE.pack(offset)


def verdict_key_prefix(topic: str, partition: int) -> bytes:
    """The part of ``verdict_key`` shared by a partition's messages, NUL included."""
    return f"{topic}:{partition}".encode() + b"\0"


def to_document(
    value: bytes | None,
    key: bytes | None,
    topic: str,
    partition: int,
    offset: int,
    text_fields: Sequence[str] | None,
    id_field: str | None,
    max_bytes: int,
    text_format: str = "plain",
) -> Document:
    """The document of one message.

    The text is the whole value (UTF-8) or, with ``text_fields``, the JSON fields joined;
    with ``text_format`` ``"html"``, the main text of that HTML (``neardup.records.record_text``,
    ``neardup.extract.main_text``).
    The id is ``id_field`` of the JSON value, else the key, else ``topic/partition/offset``.

    JSON is parsed by orjson (RFC 8259, strictly), which never recurses in Python and
    rejects what would break a later step: nesting over 1,024 levels, lone surrogates
    (``"\ud800"``, not encodable in UTF-8), NaN and Infinity, numbers beyond a double;
    integers beyond 64 bits become floats (so an id field holding one is refused); of
    duplicate keys, the last wins.

    Raises:
        MessageError: null value (tombstone), value over ``max_bytes``, invalid UTF-8,
            invalid JSON, a missing text field, or HTML without main text (kind
            ``empty_text``).
        neardup.extract.ExtraMissing: HTML, and the ``html`` extra is not installed.
    """
    if value is None:
        raise MessageError("tombstone", "null value (tombstone)")
    if len(value) > max_bytes:
        raise MessageError(
            "too_large", f"value of {len(value)} bytes exceeds the limit of {max_bytes} bytes"
        )
    try:
        text = value.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise MessageError("invalid_utf8", f"invalid UTF-8: {exc}") from None
    doc_id = None
    if text_fields or id_field:
        try:
            record = orjson.loads(value)
        except orjson.JSONDecodeError as exc:
            if text_fields:
                raise MessageError("invalid_json", f"invalid JSON: {exc}") from None
            record = None
        try:
            if text_fields:
                text = record_text(record, text_fields, text_format)
            doc_id = record_id(record, id_field)
        except NoMainText as exc:
            raise MessageError("empty_text", str(exc)) from None
        except RecordError as exc:
            raise MessageError("missing_field", str(exc)) from None
    if text_format == "html" and not text_fields:
        text = main_text(text)
        if not text:
            raise MessageError("empty_text", "no main text in the HTML value "
                                             "(empty, or navigation, links and other boilerplate only)")
    if doc_id is None and key is not None:
        doc_id = key.decode("utf-8", "backslashreplace")
    return Document(doc_id or f"{topic}/{partition}/{offset}", text)


#: A message as ``DecodeMessages`` takes it: value, key, topic, partition, offset.
RawMessage = tuple[bytes | None, bytes | None, str, int, int]
#: A message as ``DecodeMessages`` gives it back: (id, None) for a document (its text
#: stays in the worker, prepared already), or (error kind, reason) for a dead letter.
Decoded = tuple[str, str | None]


@dataclass(frozen=True)
class DecodeMessages:
    """The ``neardup.pipeline.PrepareJob`` of a batch of messages (``RawMessage`` tuples):
    each is decoded (``to_document``: UTF-8, JSON, the text and id fields, HTML) and the
    documents' texts prepared, in the worker process, so that decoding shares the second
    core too. ``run`` gives back, per message in order, a ``Decoded``; ``finish`` gives
    that list as it is.

    Raises (from ``run``, in the caller): ``neardup.extract.ExtraMissing``, as
    ``to_document``.
    """

    text_fields: tuple[str, ...] | None
    id_field: str | None
    max_bytes: int
    text_format: str = "plain"

    def payload(self, batch: list[RawMessage]) -> list[RawMessage]:
        return batch

    def decode(self, batch: list[RawMessage]) -> tuple[list[Decoded], list[str]]:
        """Each message's ``Decoded``, and the texts of the documents, in order."""
        decoded: list[Decoded] = []
        texts: list[str] = []
        for value, key, topic, partition, offset in batch:
            try:
                doc = to_document(value, key, topic, partition, offset, self.text_fields, self.id_field,
                                  self.max_bytes, self.text_format)
            except MessageError as exc:
                decoded.append((exc.kind, str(exc)))
                continue
            decoded.append((doc.id, None))
            texts.append(doc.text)
        return decoded, texts

    def run(self, batch: list[RawMessage], preparer):  # noqa: ANN001, ANN201 - Preparer -> (list[Decoded], PreparedBatch)
        decoded, texts = self.decode(batch)
        return decoded, preparer.texts(texts)

    def finish(self, batch: list[RawMessage], made: list[Decoded]) -> list[Decoded]:
        return made
