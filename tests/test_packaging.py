"""The package as an index would receive it: an SPDX license expression with its file,
classifiers, no deprecated metadata, the ``py.typed`` marker."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_wheel_carries_an_spdx_license_and_its_text(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-cache-dir",
                           str(ROOT), "-w", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    output = done.stdout + done.stderr
    assert "SetuptoolsDeprecationWarning" not in output, output[-3000:]
    (wheel,) = tmp_path.glob("neardup-*.whl")
    with zipfile.ZipFile(wheel) as z:
        info = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = z.read(info).decode()
        license_text = z.read(next(n for n in z.namelist() if n.endswith("licenses/LICENSE"))).decode()
        assert "neardup/py.typed" in z.namelist()  # PEP 561: type checkers read the package's hints
    assert "License-Expression: Apache-2.0" in metadata.splitlines()
    assert "License-File: LICENSE" in metadata.splitlines()
    assert not [line for line in metadata.splitlines() if line.startswith("Classifier: License ::")]
    assert "Classifier: Programming Language :: Python :: 3.11" in metadata.splitlines()
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
