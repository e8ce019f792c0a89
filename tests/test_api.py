"""The Python API (``neardup.Deduplicator``) and ``neardup query``: the verdicts of
``neardup dedup``, queries that change nothing, clear errors for bad input, and a public
surface that passes ``mypy --strict``."""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from rocksdict import AccessType, Options, Rdict

from neardup import Deduplicator
from neardup.cli import main
from neardup.core.types import Rejected, Verdict
from neardup.errors import ClosedError, DocumentTypeError, DuplicateIdError, ReadOnlyError
from neardup.state import codec
from neardup.state.errors import SettingsMismatchError, StateError

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
EXCERPT = ROOT / "tests" / "data" / "reuters_excerpt.jsonl.gz"
DOCS = ROOT / "docs" / "python-api.md"
FIELDS = ("verdict", "cluster", "match", "similarity", "nearest", "related")


@pytest.fixture(scope="module")
def stories() -> list[dict[str, object]]:
    with gzip.open(EXCERPT, "rt", encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    assert len(records) == 4000
    return records


def _write(records: list[dict[str, object]], path: Path) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _dedup(inputs: Path, state: Path, out: Path) -> dict[str, dict[str, object]]:
    """``neardup dedup``'s verdicts by id (its outputs' ``neardup`` objects)."""
    assert main(["dedup", str(inputs), "--state-dir", str(state), "--out-dir", str(out),
                 "--no-pipeline", "--log-level", "WARNING", "--overwrite"]) == 0
    found = {}
    for name in ("unique.jsonl", "duplicates.jsonl"):
        for line in (out / name).read_text().splitlines():
            verdict = json.loads(line)["neardup"]
            found[verdict["id"]] = {k: verdict[k] for k in FIELDS}
    return found


def _as_cli(result: Verdict | Rejected) -> dict[str, object]:
    assert isinstance(result, Verdict), result
    out = result.to_dict()
    return {k: out[k] for k in FIELDS}


def _snapshot(state: Path) -> tuple[dict[str, str], dict[str, list[tuple[bytes, bytes]]]]:
    """Every file's SHA-256 and every key and value of every column family."""
    files = {str(p.relative_to(state)): hashlib.sha256(p.read_bytes()).hexdigest()
             for p in sorted(state.rglob("*")) if p.is_file()}
    options = Options(raw_mode=True)
    families = {name: Options(raw_mode=True) for name in codec.FAMILIES}
    db = Rdict(str(state), options, column_families=families, access_type=AccessType.read_only())
    try:
        records = {name: list(db.get_column_family(name).items()) for name in ("default", *codec.FAMILIES)}
    finally:
        db.close()
    return files, records


def test_api_gives_the_verdicts_of_neardup_dedup(stories: list[dict[str, object]], tmp_path: Path) -> None:
    expected = _dedup(_write(stories, tmp_path / "in.jsonl"), tmp_path / "cli-state", tmp_path / "out")
    assert len(expected) == 4000
    assert sum(v["verdict"] == "duplicate" for v in expected.values()) > 50
    ids = [str(r["id"]) for r in stories]
    texts = [str(r["text"]) for r in stories]
    with Deduplicator() as memory:
        in_memory = memory.add_many(ids, texts)
    with Deduplicator(tmp_path / "api-state", batch_size=7) as on_disk:  # batches of 7
        first = on_disk.add_many(ids[:1500], texts[:1500])
    with Deduplicator(tmp_path / "api-state") as reopened:  # one at a time, after a reopen
        assert len(reopened) == 1500
        rest = [reopened.add(i, t) for i, t in zip(ids[1500:], texts[1500:])]
    for results in (in_memory, first + rest):
        assert {r.id: _as_cli(r) for r in results} == expected


def test_query_finds_stored_stories_without_adding_them(stories: list[dict[str, object]]) -> None:
    with Deduplicator() as index:
        results = index.add_many([str(r["id"]) for r in stories[:1000]], [str(r["text"]) for r in stories[:1000]])
        duplicate = next(r for r in results if isinstance(r, Verdict) and r.is_duplicate and " said " in
                         str(stories[r.seq]["text"]))
        story = next(r for r in stories if str(r["id"]) == duplicate.id)
        draft = str(story["text"]).replace(" said ", " says ")
        [best, *others] = index.query(draft, k=3)
        assert best.id in (duplicate.id, duplicate.match) and 0.5 < best.similarity < 1.0
        assert best.cluster == duplicate.cluster != duplicate.id  # the canonical, not the document
        assert [x.similarity for x in others] <= [best.similarity] * len(others)
        exact = index.query(str(story["text"]), k=1)
        assert (exact[0].id, exact[0].similarity) in ((duplicate.id, 1.0), (duplicate.match, 1.0))
        assert index.query("zebra quagga okapi", k=3) == []
        assert len(index) == 1000  # nothing added
        again = index.add(duplicate.id + "-draft", draft)
        assert isinstance(again, Verdict) and again.nearest == best.id and again.similarity == best.similarity


def test_bad_input_raises_clear_errors(tmp_path: Path) -> None:
    index = Deduplicator(tmp_path / "state")
    index.add("a", "the quick brown fox jumps over the lazy dog by the river")
    with pytest.raises(DuplicateIdError, match="'a' is stored already"):
        index.add("a", "another text altogether, nothing like the first one at all")
    with pytest.raises(DuplicateIdError, match="'b' is given twice"):
        index.add_many(["b", "c", "b"], ["one two three four five six", "x y z w v u", "p q r s t u"])
    assert len(index) == 1  # a refused call adds nothing
    with pytest.raises(DocumentTypeError, match="text must be a str, not bytes"):
        index.add("d", b"bytes are not text")  # type: ignore[arg-type]
    with pytest.raises(DocumentTypeError, match="id must be a str, not int"):
        index.add(7, "a text")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="give as many of each"):
        index.add_many(["e", "f"], ["only one text"])
    with pytest.raises(ValueError, match="k must be at least 1"):
        index.query("a text", k=0)
    assert isinstance(index.add("g", "   "), Rejected)
    index.close()
    index.close()  # twice: nothing
    for call in (lambda: index.add("h", "text"), lambda: index.query("text"), lambda: len(index)):
        with pytest.raises(ClosedError, match="closed"):
            call()
    with pytest.raises(SettingsMismatchError):
        Deduplicator(tmp_path / "state", num_perm=64)
    with pytest.raises(TypeError, match="input_topics"):
        Deduplicator(input_topics=["wire"])
    with Deduplicator(tmp_path / "state", read_only=True) as reader:
        with pytest.raises(ReadOnlyError):
            reader.add("i", "text")
        assert [x.id for x in reader.query("the quick brown fox jumps over the lazy dog by the river")] == ["a"]
    with pytest.raises(StateError, match="does not exist"):
        Deduplicator(tmp_path / "missing", read_only=True)
    assert not (tmp_path / "missing").exists()


def test_threads_share_one_index() -> None:
    with Deduplicator() as index:
        text = "the quick brown fox jumps over the lazy dog by the river bank at dawn"
        results: list[Verdict | Rejected] = []

        def worker(k: int) -> None:
            for j in range(25):
                results.append(index.add(f"{k}-{j}", text))
                index.query(text)

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        verdicts = [r for r in results if isinstance(r, Verdict)]
        assert sorted(v.seq for v in verdicts) == list(range(100))
        assert sum(not v.is_duplicate for v in verdicts) == 1
        assert len({v.cluster for v in verdicts}) == 1


def test_neardup_query_changes_nothing(stories: list[dict[str, object]], tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    first, second = _write(stories[:2000], tmp_path / "first.jsonl"), _write(stories[2000:], tmp_path / "second.jsonl")
    state, control = tmp_path / "state", tmp_path / "control"
    _dedup(first, state, tmp_path / "out1")
    shutil.copytree(state, control)
    before = _snapshot(state)
    capsys.readouterr()
    draft = tmp_path / "draft.txt"
    draft.write_text(str(stories[2500]["text"]))
    assert main(["query", "--state-dir", str(state), "--file", str(draft), str(stories[10]["text"]), "-k", "2"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["query"] for line in lines] == [0, 1]
    assert lines[0]["nearest"][0]["id"] == str(stories[10]["id"])  # the argument comes first
    assert lines[0]["nearest"][0]["similarity"] == 1.0
    assert _snapshot(state) == before
    # the next dedup run decides as if no query had been made
    after_query = _dedup(second, state, tmp_path / "out2")
    without = _dedup(second, control, tmp_path / "out3")
    assert after_query == without


def test_neardup_query_reads_stdin_lines(stories: list[dict[str, object]], tmp_path: Path) -> None:
    ids = [str(r["id"]) for r in stories[:300]]
    with Deduplicator(tmp_path / "state") as index:
        index.add_many(ids, [str(r["text"]) for r in stories[:300]])
    texts = "\n".join(" ".join(str(r["text"]).split()) for r in stories[100:103])
    proc = subprocess.run([sys.executable, "-m", "neardup", "query", "--state-dir", str(tmp_path / "state"),
                           "--lines", "-k", "1"], input=texts, capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    found = [json.loads(line)["nearest"][0]["id"] for line in proc.stdout.splitlines()]
    assert found == ids[100:103]


@pytest.mark.parametrize("kind", ["missing", "empty", "other-rocksdb"])
def test_neardup_query_refuses_a_state_that_is_not_one(kind: str, tmp_path: Path) -> None:
    state = tmp_path / "state"
    if kind == "empty":
        state.mkdir()
    elif kind == "other-rocksdb":
        db = Rdict(str(state))
        db["key"] = "value"
        db.close()
    proc = subprocess.run([sys.executable, "-m", "neardup", "query", "--state-dir", str(state), "a text"],
                          capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert re.fullmatch(r"neardup: error: state directory \S+ (does not exist|is not a neardup state directory .*)\n",
                        proc.stderr), proc.stderr
    assert (kind == "missing") != state.exists()


def test_import_neardup_stays_cheap() -> None:
    code = ("import sys, neardup; heavy = [m for m in ('numba', 'rocksdict', 'neardup.api') if m in sys.modules]; "
            "print(heavy); print(neardup.Deduplicator.__module__)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"})
    assert proc.stdout.splitlines() == ["[]", "neardup.api"], proc.stderr


@pytest.mark.skipif(importlib.util.find_spec("mypy") is None, reason="mypy is in the test extra")
def test_the_public_api_passes_mypy_strict(tmp_path: Path) -> None:
    user = tmp_path / "user.py"
    user.write_text(
        "from neardup import Deduplicator, Neighbour, Rejected, Verdict\n"
        "with Deduplicator(threshold=0.9) as index:\n"
        "    result: Verdict | Rejected = index.add('a', 'some text here')\n"
        "    found: list[Neighbour] = index.query('some text', k=2)\n"
        "    many: list[Verdict | Rejected] = index.add_many(['b'], ['t'], [1.5])\n")
    proc = subprocess.run([sys.executable, "-m", "mypy", "--strict", "--follow-imports=silent",
                           "--ignore-missing-imports", "--no-incremental", "--cache-dir", str(tmp_path / "cache"),
                           str(SRC / "neardup" / "api.py"), str(SRC / "neardup" / "query.py"),
                           str(SRC / "neardup" / "__init__.py"), str(user)],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          env={"MYPYPATH": str(SRC), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_python_api_page_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocks = re.findall(r"```python\n(.*?)```", DOCS.read_text(), re.S)
    assert blocks
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {}
    for block in blocks:
        exec(compile(block, str(DOCS), "exec"), namespace)  # noqa: S102 - the page's own code


def test_query_finds_the_copies_behind_a_story() -> None:
    # w2 is a duplicate of w1: with duplicate_buckets="new" it joins w1's copy bucket, not
    # the band buckets w1 holds, and a query reaches it through w1 as the detector does
    story = "Wheat exports from Canada rose 12 pct in the week to March 20, the grain board said on Friday."
    with Deduplicator() as index:
        index.add("w1", story)
        assert index.add("w2", story + " Reuter").verdict == "duplicate"  # type: ignore[union-attr]
        found = index.query("CORRECTED - " + story, k=3)
    assert [(n.id, n.cluster) for n in found] == [("w1", "w1"), ("w2", "w1")]
    assert found[0].similarity > found[1].similarity > 0.8


def test_a_read_only_index_opens_beside_the_writer(tmp_path: Path) -> None:
    text = "the quick brown fox jumps over the lazy dog by the river bank"
    with Deduplicator(tmp_path / "state") as writer:
        writer.add("a", text)
        with pytest.raises(StateError):  # a second writer: RocksDB's lock
            Deduplicator(tmp_path / "state")
        with Deduplicator(tmp_path / "state", read_only=True) as reader:
            assert len(reader) == 1 and [n.id for n in reader.query(text)] == ["a"]
        writer.add("b", "an entirely different story about grain exports from canada this week")
        with Deduplicator(tmp_path / "state", read_only=True) as reader:  # sees what was committed
            assert len(reader) == 2
