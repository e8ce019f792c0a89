"""Overlap the state-free half of batch k + 1 with the state work of batch k.

Normalising, shingling, MinHashing and banding (``Preparer``) need no state, so a worker
process can do them for the next batch while this process verifies, clusters and writes
the current one: the two halves then share the machine's two cores. ``prepared_ahead``
does it for the file mode (results come back in input order); ``PrepareWorker`` is the
worker itself, which the Kafka consumer drives (``neardup.io.kafka``).
"""

from __future__ import annotations

import multiprocessing
import signal
from collections.abc import Callable, Iterable, Iterator
from multiprocessing.connection import Connection
from typing import TypeVar

from neardup.core.settings import EngineSettings
from neardup.core.types import Document
from neardup.detector import PreparedBatch, Preparer

T = TypeVar("T")


class WorkerDied(Exception):
    """The worker process is gone (killed, out of memory, ...)."""


class _Failed:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


def _serve(conn: Connection, settings: EngineSettings) -> None:
    """The worker: prepare each batch of texts received, send the result back, until EOF."""
    # Ctrl-C reaches the whole process group: the parent decides when the worker stops
    # (it finishes its batch first), so the worker must not die of it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    preparer = Preparer(settings)
    while True:
        try:
            texts = conn.recv()
        except (EOFError, OSError):  # the parent closed the pipe, or died
            return
        try:
            out: PreparedBatch | _Failed = preparer.texts(texts)
        except Exception as exc:  # noqa: BLE001 - raised again in the parent
            out = _Failed(exc)
        try:
            conn.send(out)
        except OSError:
            return


class PrepareWorker:
    """One spawned process holding a ``Preparer``: ``submit`` a batch, later take its
    ``result``; results come back in submit order. Hold at most one batch in flight
    beyond the one whose result is taken next (a pipe, not a queue, links the two).

    A plain pipe (no ``ProcessPoolExecutor``): if the worker dies, even in the middle
    of sending a result, this end sees EOF and raises ``WorkerDied`` instead of waiting
    forever; if this process dies, the worker sees EOF and exits.
    """

    def __init__(self, settings: EngineSettings) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_serve, args=(child, settings),
                                        name="neardup-prepare", daemon=True)
        self._process.start()  # at once: the imports (about a second) overlap other work
        child.close()  # the worker's end lives in the worker only, so its death is EOF here

    def submit(self, documents: list[Document]) -> None:
        """Send ``documents`` to be prepared. Raises ``WorkerDied``."""
        try:
            self._conn.send([d.text for d in documents])  # texts pickle fast
        except OSError as exc:
            raise WorkerDied(str(exc)) from exc

    def result(self) -> PreparedBatch:
        """``Preparer(settings)(documents)`` of the oldest batch submitted and not taken.

        Raises:
            WorkerDied: the worker process is gone.
        """
        try:
            out = self._conn.recv()
        except (EOFError, OSError) as exc:
            raise WorkerDied(f"exit code {self._process.exitcode}") from exc
        if isinstance(out, _Failed):
            raise out.exc
        return out

    def close(self) -> None:
        """Stop the worker, dropping what it was preparing."""
        self._conn.close()
        self._process.join(5)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()

    def __enter__(self) -> PrepareWorker:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def prepared_ahead(
    batches: Iterable[T],
    documents_of: Callable[[T], list[Document]],
    settings: EngineSettings,
    parallel: bool = True,
) -> Iterator[tuple[T, PreparedBatch]]:
    """Yield each batch with its ``PreparedBatch``, preparing one batch ahead.

    Args:
        batches: any batches, in order.
        documents_of: the documents of a batch.
        parallel: prepare in a worker process (spawned); False prepares inline.
    """
    if not parallel:
        preparer = Preparer(settings)
        for batch in batches:
            yield batch, preparer(documents_of(batch))
        return
    with PrepareWorker(settings) as worker:
        pending: T | None = None
        for batch in batches:
            done = (pending, worker.result()) if pending is not None else None
            worker.submit(documents_of(batch))  # prepared while the caller handles ``done``
            pending = batch
            if done is not None:
                yield done
        if pending is not None:
            yield pending, worker.result()
