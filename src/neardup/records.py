"""Text and id of a JSON record, by dotted field paths; shared by the file and Kafka
adapters."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any

from neardup.extract import main_text


class RecordError(ValueError):
    """A record that cannot be deduplicated; ``str(error)`` is the reason."""


class NoMainText(RecordError):
    """HTML from which ``neardup.extract.main_text`` takes no text."""


_MISSING = object()


def lookup(record: Any, path: str) -> Any:
    """The value at dotted ``path`` (``"a.b.c"``) in nested dicts, or a sentinel if absent."""
    value = record
    for part in path.split("."):
        if not isinstance(value, dict) or part not in value:
            return _MISSING
        value = value[part]
    return value


def record_text(record: Any, text_fields: Sequence[str], text_format: str = "plain") -> str:
    """The record's text: the given fields that are present, joined by newlines; with
    ``text_format`` ``"html"``, the main text of each field's HTML
    (``neardup.extract.main_text``), those with some joined by blank lines.

    Raises:
        RecordError: the record is not a JSON object, none of the fields is present, a
            present field is not a string, or (HTML) holds a lone surrogate.
        NoMainText: HTML fields, none with a main text.
        neardup.extract.ExtraMissing: HTML, and the ``html`` extra is not installed.
    """
    if not isinstance(record, dict):
        raise RecordError(f"record is a JSON {type(record).__name__}, not an object")
    parts = []
    for path in text_fields:
        value = lookup(record, path)
        if value is _MISSING or value is None:
            continue
        if not isinstance(value, str):
            raise RecordError(f"field {path!r} is a {type(value).__name__}, not a string")
        parts.append(value)
    if not parts:
        raise RecordError(f"missing field {' or '.join(map(repr, text_fields))}")
    if text_format == "html":
        for part in parts:  # json reads "\ud800" escapes: no Unicode, no HTML to parse
            try:
                part.encode("utf-8")
            except UnicodeEncodeError:
                raise RecordError(f"field {' or '.join(map(repr, text_fields))} holds a lone surrogate "
                                  "(not Unicode text)") from None
        texts = [t for t in map(main_text, parts) if t]
        if not texts:
            raise NoMainText(f"no main text in the HTML of field {' or '.join(map(repr, text_fields))} "
                             "(empty, or navigation, links and other boilerplate only)")
        return "\n\n".join(texts)
    return "\n".join(parts)


def record_id(record: Any, id_field: str | None) -> str | None:
    """The record's id as a string (numbers converted), None if the field is absent."""
    if id_field is None or not isinstance(record, dict):
        return None
    value = lookup(record, id_field)
    if value is _MISSING or value is None:
        return None
    if isinstance(value, (str, int)) and not isinstance(value, bool):
        return str(value)
    raise RecordError(f"id field {id_field!r} is a {type(value).__name__}, not a string or integer")


def record_time(record: Any, time_field: str) -> float:
    """The record's time in seconds since the Unix epoch, from ``time_field``: a number
    of seconds, or an ISO 8601 string (``2026-11-23T16:20:00Z``; UTC when it names no
    zone).

    Raises:
        RecordError: the field is absent or holds no such time.
    """
    value = lookup(record, time_field) if isinstance(record, dict) else _MISSING
    if value is _MISSING or value is None:
        raise RecordError(f"missing timestamp field {time_field!r}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        try:
            parsed = datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
        except ValueError:
            raise RecordError(f"timestamp field {time_field!r} is not ISO 8601 or epoch seconds: {value[:40]!r}") from None
        if parsed.tzinfo is None:
            parsed = parsed.replace(tzinfo=timezone.utc)
        return parsed.timestamp()
    raise RecordError(f"timestamp field {time_field!r} is a {type(value).__name__}, not a time")
