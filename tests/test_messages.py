"""The stored outcome record (``Outcome.to_bytes``/``from_bytes``) and verdict headers."""

from __future__ import annotations

import json
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from neardup.core.types import Verdict
from neardup.detector import VerdictColumns
from neardup.kafka.messages import (
    HEADER_CONTAINMENT,
    HEADER_JACCARD,
    HEADER_OVERHEAD,
    HEADER_SIMILARITY,
    RECORD_OVERHEAD,
    RECORD_VERSION,
    DecodeMessages,
    MessageError,
    Outcome,
    carried_headers,
    fit,
    record_size,
    to_document,
)

FAST = settings(max_examples=300, deadline=None)
KEYS = st.text(max_size=40).filter(lambda k: _encodable(k))
HEADERS = st.lists(st.tuples(KEYS, st.binary(max_size=60)), max_size=12)
KINDS = st.none() | KEYS
WHOLE_OUTCOMES = st.builds(Outcome, st.sampled_from(["unique", "duplicate", "dlq"]), HEADERS, KINDS)
OUTCOMES = st.builds(Outcome, st.sampled_from(["unique", "duplicate", "dlq"]), HEADERS, KINDS,
                     st.sampled_from(["whole", "no_value", "headers_only"]))
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
@given(WHOLE_OUTCOMES.filter(lambda o: all(_utf8(v) for _, v in o.headers)))
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
    outcome = Outcome("dlq", [("k", b"\x00\xff"), ("é", b"")], "tombstone", "no_value")
    body = (
        struct.pack("<HH", len("tombstone") + 1, 2) + b"tombstone"
        + struct.pack("<H", 1) + b"k" + struct.pack("<I", 2) + b"\x00\xff"
        + struct.pack("<H", 2) + "é".encode() + struct.pack("<I", 0)
    )
    assert outcome.to_bytes() == bytes([2, 2, 1]) + body
    assert Outcome("unique", []).to_bytes() == bytes([2, 0, 0, 0, 0, 0, 0])
    # layout 1, written by the previous version: no content byte, always the whole message
    assert Outcome.from_bytes(bytes([1, 2]) + body) == Outcome("dlq", outcome.headers, "tombstone", "whole")
    assert Outcome.from_bytes(bytes([1, 0, 0, 0, 0, 0])) == Outcome("unique", [])


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        bytes([3, 0, 0, 0, 0, 0, 0]),  # unknown layout version
        bytes([2, 3, 0, 0, 0, 0, 0]),  # unknown target
        bytes([2, 0, 3, 0, 0, 0, 0]),  # unknown content
        bytes([1, 3, 0, 0, 0, 0]),  # unknown target, layout 1
        bytes([2, 0, 0, 0, 0, 1, 0]),  # one header announced, none there
        Outcome("unique", [("k", b"value")]).to_bytes()[:-1],  # value cut short
        Outcome("unique", [("k", b"value")]).to_bytes() + b"\x00",  # bytes left over
        bytes([2, 2, 0, 3, 0, 0, 0]) + b"\xff\xfe",  # error kind not UTF-8
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


@FAST
@given(st.lists(VERDICTS, max_size=8))
def test_outcomes_of_columns_are_those_of_the_verdicts(verdicts: list[Verdict]) -> None:
    """``Outcome.of_columns`` gives ``of_verdict``'s outcome of each verdict, the bytes its
    headers add to a record as ``record_size`` counts them, and its stored record."""
    columns = VerdictColumns(
        ids=[v.id for v in verdicts], first_seq=0, duplicate=[v.is_duplicate for v in verdicts],
        cluster=[v.cluster for v in verdicts], match=[v.match for v in verdicts],
        similarity=[v.similarity for v in verdicts], jaccard=[v.jaccard for v in verdicts],
        containment=[v.containment for v in verdicts], candidates=[v.candidates for v in verdicts],
        rejected=[v.rejected for v in verdicts], cluster_size=[v.cluster_size for v in verdicts],
        related=[v.related for v in verdicts], nearest=[v.nearest for v in verdicts],
    )
    outcomes, sizes, records = Outcome.of_columns(columns)
    assert outcomes == [Outcome.of_verdict(v) for v in verdicts]
    assert sizes == [record_size(None, None, o.headers) - RECORD_OVERHEAD for o in outcomes]
    assert records == [o.to_bytes() for o in outcomes]


@FAST
@given(VERDICTS, st.integers(0, 3000), st.integers(RECORD_OVERHEAD, 4000), st.integers(0, 3))
def test_fit_with_the_headers_bytes_known_decides_as_without(verdict: Verdict, value_size: int, limit: int,
                                                              stage: int) -> None:
    """``fit`` given what the outcome's headers add (``header_bytes``, as ``Outcome.of_columns``
    counts them) gives the same outcome as counting them itself, and the outcome itself
    (the same object) when its record fits."""
    outcome = Outcome.of_verdict(verdict)
    limits = {"unique": ("u", limit), "duplicate": ("d", limit), "dlq": ("q", limit + 500)}
    carried = [("trace", b"abc")]
    args = (outcome, b"key", b"v" * value_size, carried, limits, ("t", 0, 7), stage, "refused" if stage else None)
    given_size = fit(*args, header_bytes=record_size(None, None, outcome.headers) - RECORD_OVERHEAD)
    assert given_size == fit(*args)
    assert (given_size is outcome) == (stage == 0 and record_size(b"key", b"v" * value_size, carried,
                                                                    outcome.headers) <= limit)


DEEP = b"[" * 1000 + b"]" * 1000
POISON = {
    "deep-value": (DEEP, "missing_field"),  # a JSON array, not an object
    "deep-sibling": (b'{"id": "d", "text": "a story", "x": ' + DEEP + b"}", None),
    "deeper-than-orjson-allows": (b"[" * 1_000_000 + b"]" * 1_000_000, "invalid_json"),
    "surrogate-id": (b'{"id": "\\ud800", "text": "a story"}', "invalid_json"),
    "surrogate-text": (b'{"id": "s", "text": "a \\udfff story"}', "invalid_json"),
    "nan": (b'{"id": "n", "text": "a story", "score": NaN}', "invalid_json"),
    "infinity": (b'{"id": "i", "text": "a story", "score": -Infinity}', "invalid_json"),
    "huge-number": (b'{"id": "h", "text": "a story", "n": 1' + b"0" * 5000 + b"}", "invalid_json"),
    "huge-id": (b'{"id": 1' + b"0" * 5000 + b', "text": "a story"}', "invalid_json"),
    "id-beyond-64-bits": (b'{"id": 18446744073709551616, "text": "a story"}', "missing_field"),
    "duplicate-keys": (b'{"id": "a", "id": "b", "text": "x", "text": "a story"}', None),
}


@pytest.mark.parametrize("name", list(POISON))
def test_to_document_of_poison_values(name: str) -> None:
    """Each value decodes to a document or raises MessageError of the expected kind;
    nothing else escapes (no RecursionError, ValueError, UnicodeEncodeError)."""
    value, kind = POISON[name]
    if kind is None:
        doc = to_document(value, b"key", "t", 0, 7, ["text"], "id", 1 << 21)
        doc.id.encode("utf-8")  # ids and text reach headers and the state as UTF-8
        doc.text.encode("utf-8")
        assert doc.text == "a story"
        assert doc.id in {"d", "b"}
    else:
        with pytest.raises(MessageError) as raised:
            to_document(value, b"key", "t", 0, 7, ["text"], "id", 1 << 21)
        assert raised.value.kind == kind


def test_decoding_in_the_worker_gives_what_decoding_here_gives() -> None:
    """``DecodeMessages.run`` (the worker's half of a batch read ahead): per message the
    document's id, or the dead letter's kind and reason ``to_document`` raises; and the
    documents' texts prepared as ``Preparer.texts`` prepares them."""
    import numpy as np  # noqa: PLC0415

    from neardup.core.settings import EngineSettings  # noqa: PLC0415
    from neardup.detector import Preparer  # noqa: PLC0415

    values = [POISON[name][0] for name in POISON] + [
        None, b"\xff\xfe not UTF-8", b'{"text": "no id field, so the key"}', b'{"id": 5}',
        b'{"id": "big", "text": "' + b"x " * 600 + b'"}',
        b'{"id": "w1", "text": "the quick brown fox jumps over the lazy dog near the river"}']
    batch = [(v, None if i % 3 else b"k%d" % i, "wire", i % 2, 100 + i) for i, v in enumerate(values)]
    job = DecodeMessages(("text",), "id", 1000)
    decoded, prepared = job.run(batch, Preparer(EngineSettings()))
    texts = []
    assert len(decoded) == len(batch)
    for (value, key, topic, partition, offset), (name, reason) in zip(batch, decoded):
        try:
            doc = to_document(value, key, topic, partition, offset, ["text"], "id", 1000)
        except MessageError as exc:
            assert (name, reason) == (exc.kind, str(exc))
        else:
            assert (name, reason) == (doc.id, None)
            texts.append(doc.text)
    assert sum(reason is None for _, reason in decoded) == len(texts) >= 3
    assert {name for name, reason in decoded if reason is not None} >= {"tombstone", "invalid_utf8", "too_large",
                                                                      "missing_field", "invalid_json"}
    here = Preparer(EngineSettings()).texts(texts)
    assert np.array_equal(prepared.fingerprints, here.fingerprints)
    assert np.array_equal(prepared.buckets, here.buckets)
    assert prepared.rejected == here.rejected


def _mutations(seed: bytes) -> st.SearchStrategy[bytes]:
    """``seed`` with bytes cut, repeated or replaced."""
    return st.tuples(st.integers(0, len(seed)), st.integers(0, len(seed)), st.binary(max_size=8),
                     st.integers(1, 300)).map(
        lambda t: seed[: min(t[0], t[1])] + t[2] * (t[3] if t[2] in (b"[", b"{", b"\\") else 1) + seed[max(t[0], t[1]):])


SEEDS = [b'{"id": "x", "text": "a story", "more": [1, 2.5, {"k": null}]}', b'{"id": 12, "text": "\\u00e9\\ud83d\\ude00"}']


@FAST
@given(st.binary(max_size=200) | st.sampled_from(SEEDS).flatmap(_mutations))
def test_to_document_of_any_bytes(value: bytes) -> None:
    for fields, id_field in ((["text"], "id"), (None, "id"), (None, None)):
        try:
            doc = to_document(value, None, "t", 0, 7, fields, id_field, 1 << 20)
        except MessageError:
            continue
        doc.id.encode("utf-8")
        doc.text.encode("utf-8")


def test_carried_headers_rename_incoming_neardup_headers() -> None:
    incoming = [("origin", b"a"), ("neardup-verdict", b"duplicate"), ("Neardup-Cluster", b"x"),
                ("neardup-input-verdict", b"older"), ("NEARDUP-INPUT-match", b"y"), ("tail", None)]
    assert carried_headers(incoming) == [("origin", b"a"), ("neardup-input-verdict", b"duplicate"),
                                         ("neardup-input-Cluster", b"x"), ("tail", None)]
    plain = [("origin", b"a")]
    assert carried_headers(plain) == plain
    assert carried_headers(None) == [] and carried_headers([]) == []


def test_record_size_golden() -> None:
    # the bound: batch header and record framing, then per header its two lengths
    assert record_size(b"k", b"vv", [("h", b"x"), ("é", None)]) == RECORD_OVERHEAD + 3 + 2 * HEADER_OVERHEAD + 2 + 2
    assert record_size(None, None, []) == RECORD_OVERHEAD == 97


LIMITS = {"unique": ("t.unique", 1000), "duplicate": ("t.duplicates", 1000), "dlq": ("t.dlq", 700)}
VERDICT = Outcome("unique", [("neardup-verdict", b"unique")])


def _fit(value: bytes, outcome: Outcome = VERDICT, **kw) -> Outcome:
    return fit(outcome, b"key", value, [("origin", b"abc")], LIMITS, ("t", 0, 5), **kw)


def test_fit_keeps_what_fits_and_falls_back_stage_by_stage() -> None:
    assert _fit(b"v" * 100) is VERDICT
    too_big = _fit(b"v" * 900)  # over 1000 with its headers, and over the dead-letter topic's 700
    assert too_big.target == "dlq" and too_big.error_kind == "output_too_large"
    assert too_big.content == "no_value" and too_big.stage == 2
    headers = dict(too_big.headers)
    assert headers["neardup-error"].startswith(b"record of 1")
    assert b"exceeds max.message.bytes 1000 of topic t.unique" in headers["neardup-error"]
    assert b"; value (900 bytes) left out to fit max.message.bytes 700 of topic t.dlq" in headers["neardup-error"]
    assert headers["neardup-value-bytes"] == b"900" and headers["neardup-source-offset"] == b"5"
    mid = _fit(b"v" * 300, Outcome("unique", [("neardup-verdict", b"x" * 600)]))
    assert mid.target == "dlq" and mid.content == "whole"  # too large with its verdict, not as a dead letter
    # a failed record: the next stage, whatever the sizes, with the failure as reason
    failed = _fit(b"v" * 10, stage=1, failure="not produced to t.unique: refused")
    assert failed.error_kind == "produce_failed" and failed.content == "whole"
    assert dict(failed.headers)["neardup-error"] == b"not produced to t.unique: refused"
    assert _fit(b"v", failed, stage=2, failure="again").content == "no_value"
    bare = _fit(b"v", failed, stage=3, failure="again")
    assert bare.content == "headers_only" and bare.stage == 3


def test_fit_drops_key_and_headers_when_even_they_do_not_fit() -> None:
    out = fit(VERDICT, b"k" * 1000, b"v", [], LIMITS, ("t", 0, 5))
    assert out.content == "headers_only"
    assert b"key and headers left out" in dict(out.headers)["neardup-error"]
