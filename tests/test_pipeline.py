"""The file mode's pipeline (``neardup.pipeline.prepared_ahead``): when a worker is started,
and that its prepared batches are the ones prepared inline."""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Iterator

import numpy as np

from neardup.core.settings import EngineSettings
from neardup.core.types import Document
from neardup.detector import Preparer
from neardup.files import numbered_lines, read_lines
from neardup.pipeline import ParseLines, PrepareTexts, PrepareWorker, prepared_ahead

SETTINGS = EngineSettings()


def _batches(n: int, size: int = 3) -> list[list[Document]]:
    return [[Document(f"{b}-{k}", f"story {b} paragraph {k} of the wire copy, filed late") for k in range(size)]
            for b in range(n)]


def test_small_input_starts_no_worker() -> None:
    children = []
    for _batch, _prepared in prepared_ahead(_batches(3), PrepareTexts(), SETTINGS, parallel=True, worker_after=3):
        children.extend(multiprocessing.active_children())
    assert children == []


def test_small_input_is_prepared_in_a_thread_as_inline() -> None:
    """Before a worker is worth starting, batches are prepared in one thread of this
    process, ahead of the caller: the same arrays as inline, in order."""
    batches = _batches(6)
    inline = [p for _, p in prepared_ahead(batches, PrepareTexts(), SETTINGS, parallel=False)]
    threads = set()
    piped = []
    for batch, prepared in prepared_ahead(batches, PrepareTexts(), SETTINGS, parallel=True, worker_after=6):
        threads |= {t.name for t in threading.enumerate() if t.name.startswith("neardup-prepare")}
        piped.append((batch, prepared))
        assert multiprocessing.active_children() == []
    assert threads
    assert [b for b, _ in piped] == batches
    for a, (_, b) in zip(inline, piped):
        assert np.array_equal(a.buckets, b.buckets) and np.array_equal(a.fingerprints, b.fingerprints)
    time.sleep(0.1)
    assert not [t for t in threading.enumerate() if t.name.startswith("neardup-prepare")]


class _FailsAt(PrepareTexts):
    """Fails on the batch whose first document has id ``bad``."""

    def __init__(self, bad: str) -> None:
        self.bad = bad

    def run(self, texts, preparer):  # type: ignore[no-untyped-def]
        if texts and texts[0].startswith(self.bad):
            raise ValueError("broken batch")
        return super().run(texts, preparer)


def test_an_error_in_the_preparing_thread_is_raised_at_its_batch() -> None:
    batches = _batches(6)
    job = _FailsAt("story 3 ")
    seen = []
    try:
        for batch, _ in prepared_ahead(batches, job, SETTINGS, parallel=True, worker_after=6):
            seen.append(batch)
    except ValueError as exc:
        assert str(exc) == "broken batch"
    else:
        raise AssertionError("the error was not raised")
    assert seen == batches[:3]


def test_worker_batches_equal_inline_ones() -> None:
    batches = _batches(12)
    inline = [p for _, p in prepared_ahead(batches, PrepareTexts(), SETTINGS, parallel=False)]
    started = []
    piped = []
    for batch, prepared in prepared_ahead(batches, PrepareTexts(), SETTINGS, parallel=True, worker_after=1, depth=1):
        started.extend(multiprocessing.active_children())
        piped.append((batch, prepared))
    assert started, "a worker is started for an input longer than worker_after batches"
    assert [b for b, _ in piped] == batches
    for a, (_, b) in zip(inline, piped):
        assert np.array_equal(a.buckets, b.buckets) and np.array_equal(a.fingerprints, b.fingerprints)


#: Lines of every kind the file mode reads: documents (an object, one holding a
#: ``neardup`` member, an integer id beyond 64 bits, NaN), blank ones (ASCII white space is
#: skipped before parsing, Unicode's after), and rejects (not JSON, not UTF-8, not an
#: object, no text, a text that is no string, a lone surrogate).
MIXED_LINES = [
    b'{"id": "a", "text": "the central bank raised its key rate by a quarter point"}\n',
    b'{"id": 123456789012345678901234567890, "text": "grain exports rose in march"}\n',
    b'{"id": "n", "text": "crude oil prices fell", "score": NaN}\n',
    b'{"id": "m", "text": "a record that holds one already", "neardup": {"x": 1}}\n',
    b"   \n",
    "\u3000\n".encode(),
    b"{not json\n",
    b'{"id": "u", "text": "\xff\xfe"}\n',
    b'["a", "list"]\n',
    b'{"id": "t"}\n',
    b'{"id": "v", "text": 7}\n',
    b'{"id": "s", "text": "lone \\ud800 surrogate"}\n',
    b'{"id": "b", "text": "the central bank raised its key rate by a quarter point"}',
]


def test_lines_parsed_in_the_worker_are_the_lines_read_here() -> None:
    """The file mode's job (``ParseLines``): run in a worker process or here, it gives the
    lines ``read_lines`` gives (less the parsed record, which the outputs do not use) as
    columns, the batch's position and the records' text bytes, and its documents are
    prepared as ``Preparer`` prepares them."""
    job = ParseLines(("text",), "id", None)
    batch = list(numbered_lines(MIXED_LINES))
    expected = list(read_lines(MIXED_LINES, ["text"], "id"))
    records = [line for line in expected if line.document is not None]
    assert len(expected) == 11 and len(records) == 5
    inline_made, inline_prepared = job.run(job.payload(batch), Preparer(SETTINGS))
    with PrepareWorker(SETTINGS, job) as worker:
        worker.submit(batch)
        made, prepared = worker.outcome()
    for parsed in (job.finish(batch, inline_made), job.finish(batch, made)):
        assert parsed.rejects == [(line.number, line.error, line.raw) for line in expected if line.document is None]
        assert parsed.numbers == [line.number for line in records]
        assert parsed.ids == [line.document.id for line in records]
        assert parsed.times == [line.document.time for line in records]
        assert parsed.data == [line.data for line in records]
        assert parsed.spliceable == [line.spliceable for line in records] == [True, True, True, False, True]
        assert parsed.text_bytes == sum(len(line.document.text.encode()) for line in records)
        assert parsed.last == len(MIXED_LINES) and len(parsed) == 11
    reference = Preparer(SETTINGS)([line.document for line in records])
    for p in (inline_prepared, prepared):
        assert np.array_equal(p.buckets, reference.buckets)
        assert np.array_equal(p.fingerprints, reference.fingerprints)


def test_a_killed_worker_is_replaced_by_preparing_here(caplog) -> None:
    """The worker SIGKILLed mid-stream (as the out-of-memory killer would): every batch
    still comes out, in order, prepared as inline, the batches it held included."""
    batches = _batches(60)
    inline = [p for _, p in prepared_ahead(batches, PrepareTexts(), SETTINGS, parallel=False)]

    def slowly() -> Iterator[list[Document]]:
        for batch in batches:
            time.sleep(0.05)
            yield batch

    out = []
    killed = False
    with caplog.at_level(logging.WARNING, logger="neardup.pipeline"):
        for batch, prepared in prepared_ahead(slowly(), PrepareTexts(), SETTINGS, parallel=True, worker_after=0):
            out.append((batch, prepared))
            if len(out) == 30 and not killed:
                children = multiprocessing.active_children()
                assert children, "the worker was started"
                for child in children:
                    os.kill(child.pid, signal.SIGKILL)
                killed = True
    assert killed
    assert [b for b, _ in out] == batches
    for a, (_, b) in zip(inline, out):
        assert np.array_equal(a.buckets, b.buckets) and np.array_equal(a.fingerprints, b.fingerprints)
    assert "worker process died" in caplog.text


def test_the_worker_does_not_run_the_callers_main_script(tmp_path) -> None:
    """The worker imports what it runs, not the caller's main script: a script that calls
    ``neardup.cli.main`` without an ``if __name__ == "__main__"`` guard (as a user's
    might) runs its command once, and the worker does not import the command line."""
    script = tmp_path / "unguarded.py"
    marks = tmp_path / "imports.txt"
    inputs = tmp_path / "in.jsonl"
    inputs.write_text("".join(f'{{"id": "{i}", "text": "story {i} of the wire, filed late tonight"}}\n'
                              for i in range(3000)))
    script.write_text(
        "import os, sys\n"
        f"with open({str(marks)!r}, 'a') as f:\n"
        "    f.write(f'{os.getpid()} {__name__}\\n')\n"
        "import neardup.embedded as embedded\n"
        "embedded.WORKER_AT_ONCE_BYTES = 0  # a worker at once, for a small input\n"
        "from neardup.cli import main\n"
        f"main(['dedup', {str(inputs)!r}, '--out-dir', {str(tmp_path / 'out')!r}, '--batch-size', '20',\n"
        "      '--no-progress', '--log-level', 'INFO'])\n"
        "print('cli modules in this process:', 'neardup.cli' in sys.modules)\n")
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "preparing worker started" in done.stderr  # the run did use a worker
    imported = [line.split()[1] for line in marks.read_text().splitlines()]
    assert imported == ["__main__"]  # once, by the caller: not again as the worker's __mp_main__
    lines = (tmp_path / "out" / "unique.jsonl").read_text().splitlines()
    assert len(lines) == 3000
