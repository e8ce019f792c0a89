"""Kafka messages to documents, and verdicts to output headers.

Kept apart from the consumer loop so that the mapping can be read (and tested) alone.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import orjson

from neardup.core.types import Document, Verdict
from neardup.records import RecordError, record_id, record_text

Headers = list[tuple[str, bytes]]
Target = Literal["unique", "duplicate", "dlq"]

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

#: Layout version of ``Outcome.to_bytes`` (its first byte).
RECORD_VERSION = 1
_TARGETS: tuple[Target, ...] = ("unique", "duplicate", "dlq")
_TARGET_CODES = {t: i for i, t in enumerate(_TARGETS)}
_RECORD_HEAD = struct.Struct("<BBHH")  # version, target, error kind length + 1, headers
#: A message offset in ``verdict_key``: u64 BE.
OFFSET_BE = struct.Struct(">Q")
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")


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
        HEADER_SOURCE_PARTITION, HEADER_SOURCE_OFFSET,
    )
}


class MessageError(ValueError):
    """A message that goes to the dead-letter topic; ``str(error)`` is the reason.

    ``kind`` names the case for metrics: tombstone, too_large, invalid_utf8, invalid_json,
    missing_field, empty_text.
    """

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(reason)
        self.kind = kind


@dataclass(frozen=True)
class Outcome:
    """Where one input message goes and the headers added to it.

    ``to_bytes``/``from_bytes`` give the record stored with the state (the ``verdicts``
    column family) so that a message processed before a crash is produced again with the
    same verdict. The record, all integers unsigned little-endian:

    ========================= ====================================================
    bytes                     content
    ========================= ====================================================
    1                         layout version, 1 (the JSON form written by earlier
                              versions starts with ``[``, 0x5B)
    1                         target: 0 unique, 1 duplicate, 2 dlq
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
    so ``from_bytes`` only needs the previous layout to read a store written by the
    previous version: it still reads the JSON form
    ``[target, [[key, value as UTF-8 text], ...], error_kind or null]``.
    """

    target: Target
    headers: Headers
    error_kind: str | None = None

    def to_bytes(self) -> bytes:
        """The record of the table above.

        Raises:
            ValueError: a target other than unique, duplicate or dlq; more than 65,535
                headers, a key or ``error_kind`` over 65,534 UTF-8 bytes, or a value of
                4 GiB or more; a key or ``error_kind`` that is not encodable in UTF-8
                (lone surrogates; ``UnicodeEncodeError``).
        """
        kind = self.error_kind
        kind_bytes = b"" if kind is None else kind.encode("utf-8")
        headers = self.headers
        try:
            parts = [
                _RECORD_HEAD.pack(
                    RECORD_VERSION,
                    _TARGET_CODES[self.target],
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
            raise ValueError(f"unknown target {self.target!r}") from None
        except struct.error as exc:
            raise ValueError(f"outcome too large for its record: {exc}") from None
        return b"".join(parts)

    @classmethod
    def from_bytes(cls, raw: bytes) -> Outcome:
        """The outcome of a record written by ``to_bytes``, or of the JSON form written
        by earlier versions (see the class docstring).

        Raises:
            ValueError: an unknown layout version or target, a truncated record or one
                with bytes left over, invalid UTF-8 in a key or ``error_kind``, invalid
                JSON (``json.JSONDecodeError``).
        """
        if raw[:1] == b"[":
            target, headers, kind = json.loads(raw)
            return cls(target, [(k, v.encode("utf-8")) for k, v in headers], kind)
        try:
            version, code, kind_len, count = _RECORD_HEAD.unpack_from(raw, 0)
            if version != RECORD_VERSION:
                raise ValueError(f"unknown outcome record layout {version}")
            if code >= len(_TARGETS):
                raise ValueError(f"unknown outcome target code {code}")
            pos = _RECORD_HEAD.size
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
        return cls(_TARGETS[code], headers, kind)

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
    def of_error(cls, kind: str, reason: str, topic: str, partition: int, offset: int) -> Outcome:
        headers: Headers = [
            (HEADER_ERROR, reason.encode("utf-8")),
            (HEADER_SOURCE_TOPIC, topic.encode("utf-8")),
            (HEADER_SOURCE_PARTITION, str(partition).encode()),
            (HEADER_SOURCE_OFFSET, str(offset).encode()),
        ]
        return cls("dlq", headers, kind)


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
) -> Document:
    """The document of one message.

    The text is the whole value (UTF-8) or, with ``text_fields``, the JSON fields joined.
    The id is ``id_field`` of the JSON value, else the key, else ``topic/partition/offset``.

    JSON is parsed by orjson (RFC 8259, strictly), which never recurses in Python and
    rejects what would break a later step: nesting over 1,024 levels, lone surrogates
    (``"\ud800"``, not encodable in UTF-8), NaN and Infinity, numbers beyond a double;
    integers beyond 64 bits become floats (so an id field holding one is refused); of
    duplicate keys, the last wins.

    Raises:
        MessageError: null value (tombstone), value over ``max_bytes``, invalid UTF-8,
            invalid JSON, or a missing text field.
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
                text = record_text(record, text_fields)
            doc_id = record_id(record, id_field)
        except RecordError as exc:
            raise MessageError("missing_field", str(exc)) from None
    if doc_id is None and key is not None:
        doc_id = key.decode("utf-8", "backslashreplace")
    return Document(doc_id or f"{topic}/{partition}/{offset}", text)
