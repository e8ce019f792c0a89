"""A full disk under the state says so, in one line: ENOSPC, the path, what the write held
and what is free; the error of the close that follows (RocksDB's "Writer has previous
error") never replaces it. ``neardup run`` (a real process, the real broker), ``neardup
dedup`` and the stages' RocksDB views (``TopicView``), each on a real small tmpfs.

Needs: root, or another user allowed to ``mount -t tmpfs`` (CI runs as root). Without
it the tests skip, saying so.
"""

from __future__ import annotations

import contextlib
import gzip
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kafka_util import FAST_GROUP, produce
from neardup.cli import main
from neardup.errors import user_error
from neardup.state.errors import StateError
from neardup.state.shard_store import ShardStore

DATA = Path(__file__).parent / "data" / "reuters_excerpt.jsonl.gz"
FULL = "No space left on device"


@contextlib.contextmanager
def small_fs(path: Path, size: str) -> Iterator[None]:
    """A real tmpfs of ``size`` mounted on ``path``; skips the test (with the reason) where
    mounting is not allowed."""
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"a small file system is needed: mount -t tmpfs failed ({done.stderr.strip()}); "
                    "run as root (CI does)")
    try:
        yield
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def _lines(n: int) -> list[str]:
    with gzip.open(DATA, "rt", encoding="utf-8") as f:
        return f.read().splitlines()[:n]


def _check(line: str, state: Path) -> None:
    assert "Writer has previous error" not in line, line
    assert FULL in line and "ENOSPC" in line and str(state) in line, line
    assert "free of 512.0 KiB" in line and "the write held" in line, line


def test_run_on_a_full_disk_names_the_cause(kafka_bootstrap, kafka_topic_factory, tmp_path) -> None:
    topic = kafka_topic_factory("full")
    produce(kafka_bootstrap, topic, [(None, line.encode()) for line in _lines(400)])
    state = tmp_path / "state"
    with small_fs(state, "512k"):
        done = subprocess.run(
            [sys.executable, "-m", "neardup.cli", "run", "--bootstrap-servers", kafka_bootstrap,
             "--input-topic", topic, "--group-id", f"g-{topic}", "--state-dir", str(state),
             "--from-beginning", "--metrics-port", "0", "--batch-size", "100", "--no-pipeline", *FAST_GROUP],
            capture_output=True, text=True, timeout=240, stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert done.returncode == 2, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("neardup: error:")]
    assert len(errors) == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    _check(errors[0], state)


def test_dedup_on_a_full_disk_names_the_cause(capsys, tmp_path) -> None:
    stories = tmp_path / "stories.jsonl"
    stories.write_text("\n".join(_lines(400)) + "\n", encoding="utf-8")
    state = tmp_path / "state"
    with small_fs(state, "512k"):
        capsys.readouterr()
        assert main([str(a) for a in ["dedup", stories, "--out-dir", tmp_path / "out", "--state-dir", state,
                                      "--no-pipeline", "--batch-size", "100"]]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("neardup: error: "), err
    _check(err[0], state)


def test_a_stage_view_on_a_full_disk_names_the_cause(tmp_path) -> None:
    """The shard stage's store (a ``TopicView``, as the decide stage's table): its write
    and its close on a full disk each give a one-line user error with the cause."""
    state = tmp_path / "shard"
    with small_fs(state, "512k"):
        store = ShardStore(state, buckets_of=lambda value: [])
        with pytest.raises(StateError) as caught:
            for n in range(1000):  # 64 KiB of random bytes a write: the disk fills within 8
                store.apply([(b"X%08d" % n, os.urandom(1 << 16))], position=n)
        line = user_error(caught.value)
        assert line is not None
        assert line.startswith("cannot write the shard state"), line
        _check(line, state)
        with contextlib.suppress(StateError):  # its close may fail too, with its own line
            store.close()
