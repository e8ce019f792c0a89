"""The embedded mode's JSONL reading and writing (``neardup.files``) through
``dedup_files``: records come out byte for byte as they came, and what orjson reads
differently from ``json`` is read as ``json`` reads it."""

from __future__ import annotations

import json
from pathlib import Path

import orjson

from neardup.core.settings import EngineSettings
from neardup.embedded import dedup_files

STORY = "the central bank left its key interest rate unchanged on thursday, as markets expected"


def _run(tmp_path: Path, lines: list[bytes]) -> dict[str, list[bytes]]:
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"".join(line + b"\n" for line in lines))
    out = tmp_path / "out"
    dedup_files([str(src)], EngineSettings(), out, ["text"], "id", progress=False, parallel=False)
    return {name: (out / f"{name}.jsonl").read_bytes().splitlines() for name in ("unique", "duplicates", "rejects")}


def test_records_come_out_as_they_came(tmp_path: Path) -> None:
    first = ('{"id": "a", "price": 1.50, "place": "Z\\u00fcrich", "text": "%s"}' % STORY).encode()
    copy = ('{ "text" : "%s", "id":"b" }' % STORY).encode()
    out = _run(tmp_path, [first, copy])
    [unique], [duplicate] = out["unique"], out["duplicates"]
    assert unique.startswith(first[:-1] + b',"neardup":')
    assert duplicate.startswith(copy.rstrip()[:-1] + b',"neardup":')
    assert json.loads(duplicate)["neardup"]["match"] == "a"
    assert json.loads(unique)["price"] == 1.5 and json.loads(unique)["place"] == "Zürich"


def test_what_orjson_reads_otherwise_is_read_as_json_reads_it(tmp_path: Path) -> None:
    big = 123456789012345678901234567890
    lines = [
        ('{"id": %d, "text": "%s"}' % (big, STORY)).encode(),  # orjson: a float
        ('{"id": "n", "score": NaN, "text": "%s and more"}' % STORY[:40]).encode(),  # orjson: refused
        ('{"id": "m", "neardup": 1, "count": %d, "text": "other words for another story here"}' % big).encode(),
        b"\xc2\xa0",  # blank by Unicode's white space
        b'{"id": "x", "text": "bad \xff byte"}',
        b"not json",
    ]
    out = _run(tmp_path, lines)
    unique = [json.loads(line) for line in out["unique"]]
    assert [u["neardup"]["id"] for u in unique] == [str(big), "n", "m"]
    assert unique[0]["id"] == big and unique[2]["count"] == big and unique[2]["neardup"]["verdict"] == "unique"
    assert out["unique"][1].startswith(lines[1][:-1])  # NaN kept as it came
    rejects = [json.loads(line) for line in out["rejects"]]
    assert [(r["line"], r["reason"].split(":")[0]) for r in rejects] == [(5, "invalid UTF-8"), (6, "invalid JSON")]


def test_a_corrupt_gzip_input_is_one_error(tmp_path: Path) -> None:
    import gzip

    import pytest

    from neardup.files import InputError

    data = bytearray(gzip.compress(('{"id": "a", "text": "%s"}\n' % STORY).encode() * 50))
    data[20] ^= 0xFF  # inside the deflate stream
    src = tmp_path / "in.jsonl.gz"
    src.write_bytes(bytes(data))
    with pytest.raises(InputError, match="cannot read input"):
        dedup_files([str(src)], EngineSettings(), tmp_path / "out", ["text"], "id", progress=False, parallel=False)


def test_lines_nested_deeper_than_json_reads_are_rejected(tmp_path: Path) -> None:
    """Nesting beyond orjson's 1,024 levels (and so read again by json, which recurses),
    and digits beyond json's limit for integers, are rejects; the run goes on."""
    deep = b"[" * 5000 + b"]" * 5000
    lines = [
        ('{"id": "a", "text": "%s"}' % STORY).encode(),
        deep,
        b'{"id": "s", "text": "x", "y": ' + deep + b"}",
        b"[" * 1000 + b"]" * 1000,  # orjson reads it: a list, not an object
        b'{"id": 1' + b"0" * 5000 + b', "text": "a story"}',
        ('{"id": "b", "text": "%s"}' % STORY[:50]).encode(),
    ]
    out = _run(tmp_path, lines)
    assert [json.loads(line)["id"] for line in out["unique"]] == ["a", "b"]
    rejects = [json.loads(line) for line in out["rejects"]]
    assert [(r["line"], r["reason"].split(":")[0].split(",")[0]) for r in rejects] == [
        (2, "invalid JSON"), (3, "invalid JSON"), (4, "record is a JSON list"), (5, "invalid JSON")]


def test_a_lone_surrogate_in_the_id_or_text_is_a_reject(tmp_path: Path) -> None:
    """json reads ``"\\ud800"`` (orjson does not): such an id or text is no Unicode text
    and cannot be stored, so the line is a reject and the run goes on."""
    lines = [
        ('{"id": "a", "text": "%s"}' % STORY).encode(),
        b'{"id": "c\\ud800", "text": "a story about the weather in the north of the country"}',
        b'{"id": "d", "text": "a story \\udfff about harvests"}',
        ('{"id": "b", "text": "%s"}' % STORY[:50]).encode(),
    ]
    out = _run(tmp_path, lines)
    assert [json.loads(line)["id"] for line in out["unique"]] == ["a", "b"]
    rejects = [json.loads(line) for line in out["rejects"]]
    assert [(r["line"], "lone surrogate" in r["reason"]) for r in rejects] == [(2, True), (3, True)]


def test_a_deep_record_holding_a_neardup_member_is_written(tmp_path: Path) -> None:
    """A record with a ``neardup`` member is encoded again: as deep as orjson reads
    (1,000 levels here), json must write it too."""
    deep = b"[" * 1000 + b"]" * 1000
    lines = [b'{"id": "a", "text": "%s", "neardup": 1, "deep": ' % STORY.encode() + deep + b"}"]
    out = _run(tmp_path, lines)
    [record] = [orjson.loads(line) for line in out["unique"]]  # json cannot read it back
    assert record["neardup"]["id"] == "a" and record["neardup"]["verdict"] == "unique"


def test_the_neardup_member_is_the_verdict_as_its_dict(tmp_path: Path) -> None:
    """``OutputFiles.write_verdicts`` writes each record's ``neardup`` member from the
    verdict columns, key for key and value for value what ``Verdict.to_dict`` gives (after
    ``"id"``), for a spliced record and for one encoded again."""
    from neardup.detector import VerdictColumns  # noqa: PLC0415
    from neardup.files import OutputFiles  # noqa: PLC0415

    columns = VerdictColumns(
        ids=["a", "b\u00e9"], first_seq=7, duplicate=[False, True], cluster=["a", "a"], match=[None, "a"],
        similarity=[0.0, 0.81234567], jaccard=[0.0, 0.81234567], containment=[0.0, 1 / 3],
        candidates=[0, 2], rejected=[0, 1], cluster_size=[1, 2], related=[None, None], nearest=[None, "a"])
    data = [b'{"id": "a", "text": "x"}\n', b'[1, 2]\n']
    outputs = OutputFiles(tmp_path)
    outputs.write_verdicts(columns, data, [True, False])
    outputs.flush()
    outputs.close()
    unique = [json.loads(line) for line in (tmp_path / "unique.jsonl").read_text().splitlines()]
    duplicates = [json.loads(line) for line in (tmp_path / "duplicates.jsonl").read_text().splitlines()]
    first, second = columns.verdicts()
    assert unique == [{"id": "a", "text": "x", "neardup": {"id": "a", **first.to_dict()}}]
    assert duplicates == [{"value": [1, 2], "neardup": {"id": "b\u00e9", **second.to_dict()}}]
    assert list(duplicates[0]["neardup"]) == ["id", *second.to_dict()]  # the same key order
