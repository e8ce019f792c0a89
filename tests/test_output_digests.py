"""`neardup dedup`'s outputs, byte for byte, pinned by their sha256 on fixed corpora: a
change of speed (the kernels built at install, a faster path) must not change one byte of
what a user gets. The digests were taken with the kernels compiled by numba at run and
with those built at install, and with the code before the latter: all the same.

When a change is meant to alter outputs (a new default, a fixed rule), the digests are
updated with it, and the change says why."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import benchlib  # noqa: E402

EXCERPT = ROOT / "tests" / "data" / "reuters_excerpt.jsonl.gz"
REUTERS = ROOT.parent / "shared" / "data" / "reuters21578" / "reuters21578.jsonl.gz"

#: sha256 of unique.jsonl + duplicates.jsonl + rejects.jsonl, default settings.
DIGESTS = {
    "excerpt": "8d2ad701c6cf70dbe51762c6f1821601d74f4a09729500ce13a01406e8d89fb6",
    # the excerpt replayed 3 times with light edits (benchlib.replay_stream, 12,000 documents)
    "excerpt-stream": "b4827db90e392b552977c5b9fff429ca4926121621dcdbe4b04c09707def3078",
    "reuters": "2a3bcde6c2a1a4bd28582f4f4da002d41a96f0ad8f2d738c1d2aadbfd8250ecd",
    # Reuters-21578 replayed to 200,000 documents (whole_process.py's stream)
    "stream-200k": "1c1a81e690708da49f5a13b016c783dd774c56d6bf2767e7d7e54fdbc51dc16e",
}


def _stream(source: Path, docs: int, path: Path) -> Path:
    corpus = benchlib.load_corpus(source)
    path.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in benchlib.replay_stream(corpus, docs)))
    return path


def _digest(inputs: Path, out: Path) -> str:
    done = subprocess.run([sys.executable, "-m", "neardup", "dedup", str(inputs), "--out-dir", str(out), "--no-progress"],
                          capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr[-2000:]
    h = hashlib.sha256()
    for name in ("unique.jsonl", "duplicates.jsonl", "rejects.jsonl"):
        h.update((out / name).read_bytes())
    return h.hexdigest()


def test_outputs_on_the_excerpt_and_its_replayed_stream_are_byte_for_byte_as_pinned(tmp_path: Path) -> None:
    assert _digest(EXCERPT, tmp_path / "excerpt") == DIGESTS["excerpt"]
    stream = _stream(EXCERPT, 12_000, tmp_path / "stream.jsonl")
    assert _digest(stream, tmp_path / "stream") == DIGESTS["excerpt-stream"]


@pytest.mark.skipif(not REUTERS.exists(), reason="Reuters-21578 is not beside the checkout (../shared)")
def test_outputs_on_reuters_and_the_200000_document_stream_are_byte_for_byte_as_pinned(tmp_path: Path) -> None:
    assert _digest(REUTERS, tmp_path / "reuters") == DIGESTS["reuters"]
    stream = _stream(REUTERS, 200_000, tmp_path / "stream.jsonl")
    assert _digest(stream, tmp_path / "stream") == DIGESTS["stream-200k"]
