"""Shared pytest fixtures.

Kafka
-----
``kafka_bootstrap`` (session scope) -> ``str`` such as ``"127.0.0.1:40123"``:
    the bootstrap address of a real single-node Kafka broker (KRaft, transactions
    supported). If the environment variable ``NEARDUP_KAFKA_BOOTSTRAP`` is set, that
    address is used as is. Otherwise ``bash deploy/local/kafka.sh start`` is run (it
    fetches the broker's jars with Maven the first time, then starts a fresh broker
    on free ports); the broker is stopped at the end of the session only if this
    fixture started it. A broker that fails to start is a test *error*, never a skip.

``create_topics(bootstrap, names, partitions=1, timeout=30.0)``:
    plain helper: create topics (replication factor 1) and wait until every partition
    has a leader. Existing topics are an error.

``kafka_topic_factory`` (function scope) -> ``make(prefix="test", partitions=1) -> str``:
    creates a topic with a unique name (``<prefix>-<12 hex>``) on ``kafka_bootstrap``,
    waits for it, returns its name; the topics are deleted (best effort) afterwards.
"""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from pathlib import Path
from typing import Callable, Iterable, Iterator

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
KAFKA_SH = REPO_ROOT / "deploy" / "local" / "kafka.sh"
KAFKA_START_TIMEOUT_S = 900  # first run includes the Maven fetch


def _kafka_sh(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(KAFKA_SH), *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


@pytest.fixture(scope="session")
def kafka_bootstrap() -> Iterator[str]:
    """Bootstrap address of a real Kafka broker (see module docstring)."""
    external = os.environ.get("NEARDUP_KAFKA_BOOTSTRAP", "").strip()
    if external:
        yield external
        return

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
    bootstrap = lines[-1]
    try:
        yield bootstrap
    finally:
        if not already_running:
            _kafka_sh("stop", timeout=60)


def create_topics(
    bootstrap: str,
    names: Iterable[str],
    partitions: int = 1,
    timeout: float = 30.0,
) -> list[str]:
    """Create ``names`` with ``partitions`` partitions each and wait for their leaders."""
    from confluent_kafka.admin import AdminClient, NewTopic

    names = list(names)
    admin = AdminClient({"bootstrap.servers": bootstrap})
    futures = admin.create_topics(
        [NewTopic(n, num_partitions=partitions, replication_factor=1) for n in names],
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
