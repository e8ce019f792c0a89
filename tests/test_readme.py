"""The README's Kafka block, run as pasted: its own broker (``kafka.sh start``), ``neardup
produce``, ``neardup run`` in the background, the reader printing duplicates, the stop.

It runs in a scratch directory that links the checkout's ``tests`` and ``deploy``, with
its own broker home (the fetched jars linked) so that its ``kafka.sh stop`` stops its own
broker only, and with ``pip`` standing for the install already made from this checkout
(installing over it would change the environment of every other test).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

from conftest import KAFKA_SH, REPO_ROOT

README = REPO_ROOT / "README.md"


def _kafka_block() -> str:
    blocks = re.findall(r"```sh\n(.*?)```", README.read_text(), re.S)
    [block] = [b for b in blocks if "kafka.sh start" in b and "neardup run" in b]
    return block


def test_the_readme_kafka_block_works_as_pasted(kafka_bootstrap, tmp_path: Path) -> None:
    # kafka_bootstrap: the jars are fetched (the block's broker is another one)
    for name in ("tests", "deploy"):
        (tmp_path / name).symlink_to(REPO_ROOT / name)
    home = tmp_path / "kafka-home"
    home.mkdir()
    cache = Path(os.environ.get("NEARDUP_KAFKA_HOME") or REPO_ROOT / ".cache" / "kafka")
    (home / "libs").symlink_to(cache / "libs")
    shims = tmp_path / "bin"
    shims.mkdir()
    (shims / "pip").write_text("#!/bin/sh\necho 'pip: neardup is installed from this checkout'\n")
    (shims / "pip").chmod(0o755)
    env = {**os.environ, "PATH": f"{shims}:{os.environ['PATH']}", "NEARDUP_KAFKA_HOME": str(home),
           "PYTHONPATH": str(REPO_ROOT / "src")}
    env.pop("NEARDUP_KAFKA_BOOTSTRAP", None)
    proc = subprocess.Popen(["bash", "-c", _kafka_block()], cwd=tmp_path, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        subprocess.run(["bash", str(KAFKA_SH), "stop"], env=env, capture_output=True, timeout=120)
    assert proc.returncode == 0, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert "4000 verdicts read" in out, out[-2000:] + err[-2000:]
    duplicates = [line for line in out.splitlines() if " duplicate of " in line]
    assert len(duplicates) >= 50, out[-2000:]
