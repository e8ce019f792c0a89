"""Overlap the state-free half of batch k + 1 with the state work of batch k.

Normalising, shingling, MinHashing and banding (``Preparer``) need no state, so a worker
process can do them for the next batch while this process verifies, clusters and writes
the current one: the two halves then share the machine's two cores. ``prepared_ahead``
does it for the file mode (results come back in input order); ``PrepareWorker`` is the
worker itself, which the Kafka consumer drives (``neardup.io.kafka``).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from typing import TypeVar

from neardup.core.settings import EngineSettings
from neardup.core.types import Document
from neardup.detector import PreparedBatch, Preparer

T = TypeVar("T")

_worker_preparer: Preparer | None = None


def _start_worker(settings: EngineSettings) -> None:
    global _worker_preparer
    # Ctrl-C reaches the whole process group: the parent decides when the worker stops
    # (it finishes its batch first), so the worker must not die of it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_with_parent, daemon=True).start()
    _worker_preparer = Preparer(settings)


def _exit_with_parent() -> None:
    """End the worker when its parent dies (a SIGKILL leaves no one to shut it down)."""
    parent = multiprocessing.parent_process()
    if parent is not None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(0)


def _prepare_in_worker(texts: list[str]) -> PreparedBatch:
    assert _worker_preparer is not None
    return _worker_preparer.texts(texts)


class PrepareWorker:
    """One spawned process holding a ``Preparer``; batches are prepared in submit order.

    The process is started at once, in the background (about a second of imports), so
    the first ``submit`` may wait for it.
    """

    def __init__(self, settings: EngineSettings) -> None:
        self._pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                                         initializer=_start_worker, initargs=(settings,))
        self._pool.submit(int)  # start the process now, not at the first batch

    def submit(self, documents: list[Document]) -> Future[PreparedBatch]:
        """``Preparer(settings)(documents)``, computed in the worker."""
        return self._pool.submit(_prepare_in_worker, [d.text for d in documents])  # texts pickle fast

    def close(self) -> None:
        """Stop the worker, dropping what was submitted and not started."""
        self._pool.shutdown(wait=True, cancel_futures=True)

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
        pending: tuple[T, Future[PreparedBatch]] | None = None
        for batch in batches:
            submitted = (batch, worker.submit(documents_of(batch)))
            if pending is not None:
                yield pending[0], pending[1].result()
            pending = submitted
        if pending is not None:
            yield pending[0], pending[1].result()
