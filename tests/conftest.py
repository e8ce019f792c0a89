"""Shared pytest fixtures.

The suite can run in parallel (pytest-xdist, ``pytest -n 5``): the broker tests mostly
wait, so several can run at once. The processes of one run (the controller and its
workers, or the one process of a serial run) share a folder, ``$PYTEST_NEARDUP_RUN_DIR``
(made by :func:`pytest_configure` in the controller, inherited by the workers), where the
first worker that needs a broker records the one it started, so that every worker uses
that one broker.

Kafka
-----
``kafka_bootstrap`` (session scope) -> ``str`` such as ``"127.0.0.1:40123"``:
    the bootstrap address of a real single-node Kafka broker (KRaft, transactions
    supported), one for the whole run, shared by every worker. If the environment
    variable ``NEARDUP_KAFKA_BOOTSTRAP`` is set, that address is used as is. Otherwise
    ``bash deploy/local/kafka.sh start`` is run once, by the first worker that needs it
    (it fetches the broker's jars with Maven the first time, then starts a fresh broker
    on free ports); the controller stops it at the end of the run only if the run
    started it. A broker that fails to start is a test *error*, never a skip.
    Tests on it must not stop, kill or freeze it: other tests use it at the same
    moment. They name their topics, consumer groups and transactional ids uniquely
    (``kafka_topic_factory``, ``kafka_util.unique``): a group's changelog topic
    (``<group>.neardup-changelog``) outlives the test on a broker that is reused.

``own_broker`` (module scope) -> :class:`OwnBroker`: a broker of its own for the tests
    that kill, restart or freeze one (``NEARDUP_KAFKA_HOME`` in a temporary folder, the
    jars linked from the shared cache), started at the first use, stopped after the module.

``create_topics(bootstrap, names, partitions=1, timeout=30.0)``:
    plain helper: create topics (replication factor 1) and wait until every partition
    has a leader. Existing topics are an error.

``kafka_topic_factory`` (function scope) -> ``make(prefix="test", partitions=1) -> str``:
    creates a topic with a unique name (``<prefix>-<12 hex>``) on ``kafka_bootstrap``,
    waits for it, returns its name; the topics are deleted (best effort) afterwards.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
KAFKA_SH = REPO_ROOT / "deploy" / "local" / "kafka.sh"
KAFKA_START_TIMEOUT_S = 900  # first run includes the Maven fetch
#: The folder shared by the processes of one run (see the module docstring).
RUN_DIR_ENV = "PYTEST_NEARDUP_RUN_DIR"
_RUN_DIR_KEY = pytest.StashKey[Path]()
#: JVM options of every broker the tests start (kafka.sh reads them; a user's own setting
#: wins): the C1 compiler only and the serial collector, about half the broker's CPU on the
#: tests' short runs, which share 2 cores with five workers and their processes.
os.environ.setdefault("NEARDUP_KAFKA_JVM_OPTS", "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC")


def _kafka_sh(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(KAFKA_SH), *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def _kafka_home() -> Path:
    """The broker cache of ``kafka.sh`` (``$NEARDUP_KAFKA_HOME``, else the checkout's)."""
    return Path(os.environ.get("NEARDUP_KAFKA_HOME") or REPO_ROOT / ".cache" / "kafka")


def pytest_configure(config: pytest.Config) -> None:
    """In the controller (or the only process of a serial run): make the run's shared folder."""
    if hasattr(config, "workerinput") or os.environ.get(RUN_DIR_ENV):
        return  # an xdist worker, or a pytest run inside a test: the outer run's folder
    run_dir = tempfile.mkdtemp(prefix="neardup-tests-")
    os.environ[RUN_DIR_ENV] = run_dir
    config.stash[_RUN_DIR_KEY] = Path(run_dir)
    if (config.getoption("numprocesses", None) or 0) > 0:
        _warm_kernels()


def _warm_kernels() -> None:
    """Compile numba's kernel cache once, before the workers start (``neardup.build_kernels.warm``
    under ``NEARDUP_KERNELS=jit``, in a process of its own: this one must not import numba).
    Most tests run the kernels the install built ahead of time; those that run numba's JIT
    (``NEARDUP_KERNELS=jit``, a source checkout) would otherwise each compile the same
    kernels at once on a cold cache, on a machine with fewer cores than workers."""
    proc = subprocess.run([sys.executable, "-c", "from neardup.build_kernels import warm; warm()"],
                          capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=1800,
                          env={**os.environ, "NEARDUP_KERNELS": "jit"})
    if proc.returncode != 0:  # the tests that use the kernels compile them and report the error
        print(f"conftest: the kernel warm-up failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}",
              file=sys.stderr)


def pytest_unconfigure(config: pytest.Config) -> None:
    """In the controller, after every worker has finished: stop the broker that the run
    started (not one it found running), and remove the shared folder."""
    run_dir = config.stash.get(_RUN_DIR_KEY, None)
    if run_dir is None:
        return
    try:
        record = run_dir / "kafka.json"
        if record.is_file() and json.loads(record.read_text())["started"]:
            _kafka_sh("stop", timeout=60)
    finally:
        os.environ.pop(RUN_DIR_ENV, None)
        shutil.rmtree(run_dir, ignore_errors=True)



def _shared_broker() -> str:
    """The run's broker: the one a worker recorded in the run's folder, else one started
    now (under a lock on that folder, so that one worker starts it and the others wait)."""
    run_dir = Path(os.environ[RUN_DIR_ENV])
    with open(run_dir / "kafka.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        record = run_dir / "kafka.json"
        if record.is_file():
            return json.loads(record.read_text())["bootstrap"]
        # A broker from the same cache that is already up (e.g. started by hand with
        # `kafka.sh start`) is reused and left running.
        already_running = _kafka_sh("status", timeout=60).returncode == 0
        proc = _kafka_sh("start", timeout=KAFKA_START_TIMEOUT_S)
        lines = [line.strip() for line in proc.stdout.splitlines() if line.strip()]
        if proc.returncode != 0 or not lines:
            raise RuntimeError(
                f"`bash {KAFKA_SH} start` failed (exit {proc.returncode}); "
                "set NEARDUP_KAFKA_BOOTSTRAP to use another broker.\n"
                f"--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}"
            )
        record.write_text(json.dumps({"bootstrap": lines[-1], "started": not already_running}))
        return lines[-1]


@pytest.fixture(scope="session")
def kafka_bootstrap() -> str:
    """Bootstrap address of a real Kafka broker (see module docstring)."""
    external = os.environ.get("NEARDUP_KAFKA_BOOTSTRAP", "").strip()
    return external or _shared_broker()


@dataclass
class OwnBroker:
    """A broker of deploy/local/kafka.sh under its own ``NEARDUP_KAFKA_HOME`` (``home``),
    for a test that kills, restarts or freezes it."""

    home: Path
    bootstrap: str = ""

    def _sh(self, command: str) -> str:
        proc = subprocess.run(["bash", str(KAFKA_SH), command], capture_output=True, text=True,
                              timeout=300, stdin=subprocess.DEVNULL,
                              env={**os.environ, "NEARDUP_KAFKA_HOME": str(self.home)})
        assert proc.returncode == 0, f"kafka.sh {command} failed:\n{proc.stderr[-3000:]}"
        lines = proc.stdout.split()
        return lines[-1] if lines else ""

    def start(self) -> None:
        self.bootstrap = self._sh("start")

    def kill(self) -> None:
        self._sh("kill")

    def restart(self) -> None:
        assert self._sh("restart") == self.bootstrap, "the broker came back on other ports"

    def stop(self) -> None:
        self._sh("stop")

    def pid(self) -> int:
        """The broker's process id (its pid file)."""
        return int((self.home / "run" / "kafka.pid").read_text().strip())


@pytest.fixture(scope="module")
def own_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OwnBroker]:
    """A broker of this module's tests alone (see the module docstring)."""
    # the jars of the shared cache, fetched once (kafka.sh locks the cache) and linked
    proc = _kafka_sh("fetch", timeout=KAFKA_START_TIMEOUT_S)
    assert proc.returncode == 0, f"kafka.sh fetch failed:\n{proc.stderr[-3000:]}"
    home = tmp_path_factory.mktemp("kafka-home")
    (home / "libs").symlink_to(_kafka_home() / "libs")
    broker = OwnBroker(home)
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()


def create_topics(
    bootstrap: str,
    names: Iterable[str],
    partitions: int = 1,
    timeout: float = 30.0,
    config: dict[str, str] | None = None,
) -> list[str]:
    """Create ``names`` with ``partitions`` partitions each (and the topic ``config``) and
    wait for their leaders."""
    from confluent_kafka.admin import AdminClient, NewTopic

    names = list(names)
    admin = AdminClient({"bootstrap.servers": bootstrap})
    futures = admin.create_topics(
        [NewTopic(n, num_partitions=partitions, replication_factor=1, config=config or {}) for n in names],
        operation_timeout=timeout,
        request_timeout=timeout,
    )
    for fut in futures.values():
        fut.result(timeout=timeout)

    deadline = time.monotonic() + timeout
    while True:
        md = admin.list_topics(timeout=min(5.0, timeout))
        ready = all(
            n in md.topics
            and md.topics[n].error is None
            and len(md.topics[n].partitions) == partitions
            and all(p.leader >= 0 for p in md.topics[n].partitions.values())
            for n in names
        )
        if ready:
            return names
        if time.monotonic() > deadline:
            raise TimeoutError(f"topics {names} not ready after {timeout}s")
        time.sleep(0.1)


@pytest.fixture
def kafka_topic_factory(kafka_bootstrap: str) -> Iterator[Callable[..., str]]:
    """``make(prefix="test", partitions=1) -> str``: a fresh, uniquely named topic."""
    created: list[str] = []

    def make(prefix: str = "test", partitions: int = 1) -> str:
        name = f"{prefix}-{uuid.uuid4().hex[:12]}"
        create_topics(kafka_bootstrap, [name], partitions=partitions)
        created.append(name)
        return name

    yield make

    if created:
        from confluent_kafka.admin import AdminClient

        admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
        for fut in admin.delete_topics(created, operation_timeout=10).values():
            try:
                fut.result(timeout=15)
            except Exception:  # best effort: the broker's data dir is wiped per start
                pass
