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
