"""What a pipeline and an operator expect of the command: ``python -m neardup``, JSON logs
with RFC 3339 times."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXCERPT = ROOT / "tests" / "data" / "reuters_excerpt.jsonl.gz"


def test_python_dash_m_neardup_is_the_command() -> None:
    done = subprocess.run([sys.executable, "-m", "neardup", "--version"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("neardup ")


def test_json_logs_carry_rfc3339_times_with_a_time_zone(capsys) -> None:
    import logging

    from neardup.cli import _setup_logging
    from neardup.config import load_settings

    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        _setup_logging(load_settings({"log_format": "json", "log_level": "INFO"}))
        logging.getLogger("neardup.test").info("consumer started")
    finally:
        root.handlers[:], _ = saved[0], root.setLevel(saved[1])
    (line,) = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    record = json.loads(line)
    assert record["message"] == "consumer started" and record["level"] == "INFO"
    when = datetime.fromisoformat(record["time"])  # RFC 3339: date "T" time, offset
    assert "T" in record["time"] and when.utcoffset() is not None, record["time"]


def _dedup(tmp_path: Path, source: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "neardup", "dedup", str(source), "--out-dir", str(tmp_path / "out"),
                           "--no-progress", *flags], capture_output=True, text=True, timeout=600)


def test_dedup_with_every_line_rejected_exits_1_with_one_line(tmp_path: Path) -> None:
    misspelt = _dedup(tmp_path, EXCERPT, "--text-field", "body")
    assert misspelt.returncode == 1
    assert misspelt.stderr.strip().splitlines() == [
        f"neardup: error: every line was rejected (4,000; the first: line 1: missing field 'body'; "
        f"all in {tmp_path / 'out' / 'rejects.jsonl'})"]
    plain = tmp_path / "plain.txt"
    plain.write_text("a story in plain text\nand another one\n")
    done = _dedup(tmp_path, plain, "--overwrite")
    assert done.returncode == 1 and "every line was rejected (2; the first: line 1: invalid JSON" in done.stderr


def test_dedup_with_some_lines_rejected_says_how_many_and_succeeds(tmp_path: Path) -> None:
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text('{"id": 1, "text": "the quick brown fox jumps over the lazy dog"}\nnot json\n{"id": 2}\n')
    done = _dedup(tmp_path, mixed)
    assert done.returncode == 0, done.stderr
    assert "neardup: 2 of 3 lines rejected (the first: line 2: invalid JSON" in done.stderr
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    nothing = _dedup(tmp_path, empty, "--overwrite")
    assert nothing.returncode == 0 and "rejected" not in nothing.stderr  # no input is no error
