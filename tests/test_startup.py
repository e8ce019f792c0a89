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


def test_the_command_line_loads_no_http_server_code() -> None:
    """The HTTP server (neardup.server, wsgiref, http.server) loads only when something
    is served."""
    code = ("import sys, neardup.cli, neardup.errors, neardup.embedded; "
            "print(sorted(m for m in ('neardup.server', 'wsgiref', 'http.server') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"})
    assert out.stdout.strip() == "[]"


def test_a_dedup_run_loads_no_scipy_linear_algebra(tmp_path: Path) -> None:
    """numba's first compiled call would import SciPy's BLAS (installed with the test
    extras) for linear algebra no kernel uses; ``neardup`` keeps it out, and SciPy
    stays importable after."""
    (tmp_path / "in.jsonl").write_text('{"id": "a", "text": "wheat exports rose in march"}\n'
                                       '{"id": "b", "text": "wheat exports rose in march"}\n')
    code = (
        "import sys; from neardup.cli import main; "
        f"code = main(['dedup', {str(tmp_path / 'in.jsonl')!r}, '--out-dir', {str(tmp_path / 'out')!r}, '--no-progress']); "
        "loaded = 'scipy.linalg' in sys.modules; import scipy.linalg, scipy.sparse; print(code, loaded)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"})
    assert out.stdout.split()[-2:] == ["0", "False"]
    assert (tmp_path / "out" / "duplicates.jsonl").read_text().count("\n") == 1
