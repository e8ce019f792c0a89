"""Overlap the state-free half of batch k + 1 with the state work of batch k.

Normalising, shingling, MinHashing and banding (``Preparer``) need no state, so a worker
process can do them for the next batch while this process verifies, clusters and writes
the current one: the two halves then share the machine's two cores. Results come back in
input order.
"""

from __future__ import annotations

import multiprocessing
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
    _worker_preparer = Preparer(settings)


def _prepare_in_worker(documents: list[Document]) -> PreparedBatch:
    assert _worker_preparer is not None
    return _worker_preparer(documents)


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
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=context, initializer=_start_worker,
                             initargs=(settings,)) as pool:
        pending: tuple[T, Future[PreparedBatch]] | None = None
        for batch in batches:
            submitted = (batch, pool.submit(_prepare_in_worker, documents_of(batch)))
            if pending is not None:
                yield pending[0], pending[1].result()
            pending = submitted
        if pending is not None:
            yield pending[0], pending[1].result()
