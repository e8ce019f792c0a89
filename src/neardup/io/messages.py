"""Kafka messages to documents, and verdicts to output headers.

Kept apart from the consumer loop so that the mapping can be read (and tested) alone.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

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
HEADER_ERROR = "neardup-error"
HEADER_SOURCE_TOPIC = "neardup-source-topic"
HEADER_SOURCE_PARTITION = "neardup-source-partition"
HEADER_SOURCE_OFFSET = "neardup-source-offset"


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

    ``to_bytes``/``from_bytes`` give the record stored with the state so that a message
    processed before a crash is produced again with the same verdict.
    """

    target: Target
    headers: Headers
    error_kind: str | None = None

    def to_bytes(self) -> bytes:
        headers = [[k, v.decode("utf-8")] for k, v in self.headers]
        return json.dumps([self.target, headers, self.error_kind]).encode("utf-8")

    @classmethod
    def from_bytes(cls, raw: bytes) -> Outcome:
        target, headers, kind = json.loads(raw)
        return cls(target, [(k, v.encode("utf-8")) for k, v in headers], kind)

    @classmethod
    def of_verdict(cls, verdict: Verdict) -> Outcome:
        headers: Headers = [
            (HEADER_VERDICT, verdict.verdict.encode()),
            (HEADER_CLUSTER, verdict.cluster.encode("utf-8")),
            (HEADER_MATCH, (verdict.match or "").encode("utf-8")),
            (HEADER_SIMILARITY, f"{verdict.similarity:.6f}".encode()),
            (HEADER_JACCARD, f"{verdict.jaccard:.6f}".encode()),
            (HEADER_CONTAINMENT, f"{verdict.containment:.6f}".encode()),
        ]
        if verdict.related is not None:
            headers.append((HEADER_RELATED, verdict.related.encode("utf-8")))
        return cls("duplicate" if verdict.is_duplicate else "unique", headers)

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
    """Key of a message's stored ``Outcome``: ``topic:partition``, NUL, offset u64 BE."""
    return f"{topic}:{partition}".encode() + b"\0" + struct.pack(">Q", offset)


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
            record = json.loads(text)
        except json.JSONDecodeError as exc:
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
