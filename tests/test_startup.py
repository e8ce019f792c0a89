"""What a command imports at start-up: nothing it does not use."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"


def test_the_command_line_loads_no_metrics_code() -> None:
    """prometheus_client (and the metrics) load only when metrics are served."""
    code = "import sys, neardup.cli; print(sorted(m for m in ('prometheus_client', 'neardup.metrics') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"})
    assert out.stdout.strip() == "[]"
