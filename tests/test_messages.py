"""The stored outcome record (``Outcome.to_bytes``/``from_bytes``) and verdict headers."""

from __future__ import annotations

import json
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from neardup.core.types import Verdict
from neardup.io.messages import (
    HEADER_CONTAINMENT,
    HEADER_JACCARD,
    HEADER_SIMILARITY,
    RECORD_VERSION,
    Outcome,
)

FAST = settings(max_examples=300, deadline=None)
KEYS = st.text(max_size=40).filter(lambda k: _encodable(k))
HEADERS = st.lists(st.tuples(KEYS, st.binary(max_size=60)), max_size=12)
KINDS = st.none() | KEYS
OUTCOMES = st.builds(Outcome, st.sampled_from(["unique", "duplicate", "dlq"]), HEADERS, KINDS)
SCORES = st.floats(allow_nan=False, allow_infinity=False, min_value=-2.0, max_value=2.0)
VERDICTS = st.builds(
    Verdict,
    id=st.text(max_size=20).filter(lambda k: _encodable(k)),
    seq=st.integers(0, 2**40),
    verdict=st.sampled_from(["unique", "duplicate"]),
    cluster=st.text(max_size=20).filter(lambda k: _encodable(k)),
    match=st.none() | st.text(max_size=20).filter(lambda k: _encodable(k)),
    similarity=SCORES,
    candidates=st.integers(0, 5000),
    rejected=st.integers(0, 5000),
    cluster_size=st.integers(1, 10_000),
    jaccard=SCORES,
    containment=SCORES,
    related=st.none() | st.text(max_size=20).filter(lambda k: _encodable(k)),
    nearest=st.none() | st.text(max_size=20).filter(lambda k: _encodable(k)),
)


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _old_json(outcome: Outcome) -> bytes:
    """The record as the previous version wrote it (its ``Outcome.to_bytes``)."""
    headers = [[k, v.decode("utf-8")] for k, v in outcome.headers]
    return json.dumps([outcome.target, headers, outcome.error_kind]).encode("utf-8")


@FAST
@given(OUTCOMES)
def test_record_round_trip(outcome: Outcome) -> None:
    raw = outcome.to_bytes()
    assert raw[0] == RECORD_VERSION
    assert Outcome.from_bytes(raw) == outcome


@FAST
@given(VERDICTS)
def test_verdict_outcome_round_trip(verdict: Verdict) -> None:
    outcome = Outcome.of_verdict(verdict)
    assert Outcome.from_bytes(outcome.to_bytes()) == outcome


@FAST
@given(OUTCOMES.filter(lambda o: all(_utf8(v) for _, v in o.headers)))
def test_previous_json_records_are_read(outcome: Outcome) -> None:
    assert Outcome.from_bytes(_old_json(outcome)) == outcome


def _utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def test_previous_json_record_golden() -> None:
    raw = b'["dlq", [["neardup-error", "invalid JSON: caf\\u00e9"], ["neardup-source-offset", "7"]], "invalid_json"]'
    assert Outcome.from_bytes(raw) == Outcome(
        "dlq", [("neardup-error", "invalid JSON: café".encode()), ("neardup-source-offset", b"7")], "invalid_json"
    )


def test_record_golden() -> None:
    outcome = Outcome("dlq", [("k", b"\x00\xff"), ("é", b"")], "tombstone")
    expected = (
        bytes([1, 2]) + struct.pack("<HH", len("tombstone") + 1, 2) + b"tombstone"
        + struct.pack("<H", 1) + b"k" + struct.pack("<I", 2) + b"\x00\xff"
        + struct.pack("<H", 2) + "é".encode() + struct.pack("<I", 0)
    )
    assert outcome.to_bytes() == expected
    assert Outcome("unique", []).to_bytes() == bytes([1, 0, 0, 0, 0, 0])


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        bytes([2, 0, 0, 0, 0, 0]),  # unknown layout version
        bytes([1, 3, 0, 0, 0, 0]),  # unknown target
        bytes([1, 0, 0, 0, 1, 0]),  # one header announced, none there
        Outcome("unique", [("k", b"value")]).to_bytes()[:-1],  # value cut short
        Outcome("unique", [("k", b"value")]).to_bytes() + b"\x00",  # bytes left over
        bytes([1, 2, 3, 0, 0, 0]) + b"\xff\xfe",  # error kind not UTF-8
        b"[not json",
    ],
)
def test_bad_records_raise_value_error(raw: bytes) -> None:
    with pytest.raises(ValueError):
        Outcome.from_bytes(raw)


def test_unrepresentable_outcomes_raise_value_error() -> None:
    with pytest.raises(ValueError):
        Outcome("elsewhere", []).to_bytes()  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        Outcome("unique", [("k" * 70_000, b"")]).to_bytes()
    with pytest.raises(ValueError):
        Outcome("dlq", [], "k" * 65_535).to_bytes()


@FAST
@given(VERDICTS)
def test_verdict_headers(verdict: Verdict) -> None:
    """The headers of a verdict, as documented: scores with 6 decimals, UTF-8 ids."""
    outcome = Outcome.of_verdict(verdict)
    expected = [
        ("neardup-verdict", verdict.verdict.encode()),
        ("neardup-cluster", verdict.cluster.encode()),
        ("neardup-match", (verdict.match or "").encode()),
        (HEADER_SIMILARITY, f"{verdict.similarity:.6f}".encode()),
        (HEADER_JACCARD, f"{verdict.jaccard:.6f}".encode()),
        (HEADER_CONTAINMENT, f"{verdict.containment:.6f}".encode()),
    ]
    if verdict.related is not None:
        expected.append(("neardup-related", verdict.related.encode()))
    if verdict.nearest is not None:
        expected.append(("neardup-nearest", verdict.nearest.encode()))
    assert outcome == Outcome("duplicate" if verdict.is_duplicate else "unique", expected)
