"""neardup starts as the shipped containers run it, on the real process.

The image (deploy/Dockerfile) and the manifests (deploy/k8s) run neardup as uid 10001
with a read-only root file system: the installed package and the home folder cannot be
written, only the mounted paths can (the state volume, ``/tmp``). Without Docker, the
same restrictions are made here: the package is copied into a folder the process cannot
write, as are its home and the prebuilt kernels; as root, the process is started as uid
10001 keeping only the right to read everything (``setpriv``, CAP_DAC_READ_SEARCH: it can
read the interpreter's install under /root, write nothing it does not own); as another
user, the copies are made read-only.

The prebuilt kernels are built as the Dockerfile builds them (its ``RUN python -m
neardup.build_kernels``, its ``ENV``), before the copies are made read-only; the
restricted process then runs with the Dockerfile's environment, ``/tmp`` standing for a
writable folder of the test's.
"""

from __future__ import annotations

import filecmp
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from dockerfile_parse import DockerfileParser

import neardup
from kafka_util import FAST_GROUP, excerpt, produce, read_all, stop, wait_committed

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
EXCERPT = ROOT / "tests" / "data" / "reuters_excerpt.jsonl.gz"
UID = 10001  # the image's user


def _dockerfile_env() -> dict[str, str]:
    return DockerfileParser(path=str(DOCKERFILE), env_replace=True).envs


class Image:
    """A read-only install of the package under test, its prebuilt kernels, a read-only
    home, and the writable folders a container mounts (``tmp``, ``state``)."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.site, self.home, self.prebuilt = base / "site", base / "home", base / "prebuilt"
        self.tmp, self.state = base / "tmp", base / "state"

    def build(self) -> None:
        shutil.copytree(Path(neardup.__file__).parent, self.site / "neardup",
                        ignore=shutil.ignore_patterns("__pycache__", "*.nbi", "*.nbc"))
        self.home.mkdir()
        env = _dockerfile_env()
        build = " ".join(r["value"] for r in DockerfileParser(path=str(DOCKERFILE)).structure
                         if r["instruction"] == "RUN")
        assert 'python -m neardup.build_kernels "$NEARDUP_PREBUILT_KERNELS"' in build
        subprocess.run([sys.executable, "-m", "neardup.build_kernels", str(self.prebuilt)],
                       env={**self._base_env(), "NUMBA_CPU_NAME": env["NUMBA_CPU_NAME"]},
                       check=True, capture_output=True, timeout=900)
        for top in (self.site, self.home, self.prebuilt):
            for path in [top, *top.rglob("*")]:
                path.chmod(path.stat().st_mode & ~0o222)
        for writable in (self.tmp, self.state):
            writable.mkdir()
            if os.geteuid() == 0:
                os.chown(writable, UID, UID)

    def _base_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("NUMBA_", "NEARDUP_", "XDG_", "PYTHON"))}
        return {**env, "PYTHONPATH": str(self.site), "HOME": str(self.home),
                "TMPDIR": str(self.tmp), "PYTHONUNBUFFERED": "1"}

    def env(self, **extra: str) -> dict[str, str]:
        """The Dockerfile's environment, /tmp being this image's writable ``tmp``."""
        image = {k: re.sub(r"^/tmp(?=/|$)", str(self.tmp), v) for k, v in _dockerfile_env().items()
                 if k.startswith("NUMBA_") or k == "NEARDUP_PREBUILT_KERNELS"}
        image["NEARDUP_PREBUILT_KERNELS"] = str(self.prebuilt)
        return {**self._base_env(), **image, **extra}

    def command(self, *argv: str) -> list[str]:
        """``argv`` as the image's user: uid 10001 (as root: only reading rights kept)."""
        if os.geteuid() != 0:
            return list(argv)
        return ["setpriv", f"--reuid={UID}", f"--regid={UID}", "--clear-groups",
                "--inh-caps=-all,+dac_read_search", "--ambient-caps=+dac_read_search", *argv]


#: In a parallel run (pytest-xdist, --dist loadgroup) the tests of the image run on one
#: worker, so that it is built once: its kernels take minutes to compile on a busy machine.
pytestmark = pytest.mark.xdist_group("container-image")


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Image:
    made = Image(tmp_path_factory.mktemp("image"))
    made.build()
    return made


def _files(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_size for p in folder.rglob("*") if p.is_file()}


def test_a_read_only_install_and_home_can_load_the_kernels(image: Image) -> None:
    """numba finds no writable cache beside the package or in the home: neardup points it
    at the temporary folder instead of failing at import ('no locator available')."""
    probe = ("import os, neardup.core.xxh3, neardup.state.index; "
             "open(os.path.join(os.path.dirname(neardup.__file__), 'probe'), 'w')")
    env = image.env()
    for name in ("NUMBA_CACHE_DIR", "NUMBA_CPU_NAME", "NEARDUP_PREBUILT_KERNELS"):
        env.pop(name, None)
    denied = subprocess.run(image.command(sys.executable, "-c", probe), env=env,
                            capture_output=True, text=True, timeout=120)
    assert "PermissionError" in denied.stderr, denied.stderr  # the restriction holds
    load = ("import os, neardup.core.xxh3, neardup.state.index; "
            "print(os.environ['NUMBA_CACHE_DIR'])")
    done = subprocess.run(image.command(sys.executable, "-c", load), env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()).parent == image.tmp


def test_dedup_runs_on_the_prebuilt_kernels_without_compiling(image: Image, tmp_path: Path) -> None:
    """The image's environment: the prebuilt kernels are copied into NUMBA_CACHE_DIR and
    used as they are (nothing compiled: numba would add its build to the cache), and the
    outputs are those of an unrestricted run."""
    out = image.state / "dedup-out"
    env = image.env()
    cache = Path(env["NUMBA_CACHE_DIR"])
    shutil.rmtree(cache, ignore_errors=True)  # a fresh container
    started = time.monotonic()
    done = subprocess.run(image.command(sys.executable, "-m", "neardup.cli", "dedup", str(EXCERPT), "--out-dir", str(out),
                                        "--no-progress"),
                          env=env, capture_output=True, text=True, timeout=600)
    seconds = time.monotonic() - started
    assert done.returncode == 0, done.stderr
    assert "compiling kernels" not in done.stderr
    assert _files(cache) == _files(image.prebuilt), "kernels compiled at start"
    print(f"restricted dedup of the excerpt: {seconds:.2f} s")
    reference = tmp_path / "reference"
    subprocess.run([sys.executable, "-m", "neardup.cli", "dedup", str(EXCERPT), "--out-dir",
                    str(reference), "--no-progress"], check=True, capture_output=True, timeout=600)
    for name in ("unique.jsonl", "duplicates.jsonl"):
        assert filecmp.cmp(out / name, reference / name, shallow=False), name


def test_run_starts_on_the_prebuilt_kernels_and_commits(image: Image, kafka_bootstrap: str,
                                                       kafka_topic_factory, tmp_path: Path) -> None:
    """`neardup run` as the StatefulSet runs it: read-only root, uid 10001, the state on
    its volume: it consumes, commits and stops on SIGTERM without compiling a kernel."""
    topic = kafka_topic_factory("container")
    records = excerpt(40)
    produce(kafka_bootstrap, topic, [(str(r["id"]).encode(), json.dumps(r).encode()) for r in records])
    env = image.env()
    cache = Path(env["NUMBA_CACHE_DIR"])
    shutil.rmtree(cache, ignore_errors=True)
    log = tmp_path / "run.log"
    group = f"container-{topic}"
    with open(log, "wb") as stream:
        proc = subprocess.Popen(
            image.command(sys.executable, "-m", "neardup.cli", "run", "--bootstrap-servers", kafka_bootstrap,
                          "--input-topic", topic, "--group-id", group, "--text-field", "text",
                          "--id-field", "id", "--state-dir", str(image.state / "run"),
                          "--from-beginning", "--metrics-port", "0", *FAST_GROUP),
            env=env, stdout=stream, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        wait_committed(kafka_bootstrap, group, topic, len(records), proc, log=log)
    finally:
        code = stop(proc)
    text = log.read_text(errors="replace")
    assert code == 0, text[-4000:]
    assert "compiling kernels" not in text
    assert _files(cache) == _files(image.prebuilt), "kernels compiled at start"
    out = read_all(kafka_bootstrap, [f"{topic}.unique", f"{topic}.duplicates"], expected=len(records))
    assert sorted(m.key for m in out) == sorted(str(r["id"]).encode() for r in records)


def test_seeding_copies_what_is_missing_and_keeps_what_is_there(tmp_path: Path) -> None:
    from neardup.kernel_cache import seed

    prebuilt, cache = tmp_path / "prebuilt", tmp_path / "cache"
    (prebuilt / "core_1").mkdir(parents=True)
    (prebuilt / "core_1" / "a.nbi").write_bytes(b"prebuilt index")
    (prebuilt / "core_1" / "a.1.nbc").write_bytes(b"prebuilt kernel")
    (cache / "core_1").mkdir(parents=True)
    (cache / "core_1" / "a.nbi").write_bytes(b"index compiled here")
    assert seed(cache, prebuilt) == 1
    assert (cache / "core_1" / "a.nbi").read_bytes() == b"index compiled here"
    assert (cache / "core_1" / "a.1.nbc").read_bytes() == b"prebuilt kernel"
    assert sorted(p.name for p in (cache / "core_1").iterdir()) == ["a.1.nbc", "a.nbi"]  # no partial left
    assert seed(cache, prebuilt) == 0
