"""Overlap the state-free half of batch k + 1 with the state work of batch k.

Normalising, shingling, MinHashing and banding (``Preparer``) need no state, so a worker
process can do them for the next batch while this process verifies, clusters and writes
the current one: the two halves then share the machine's two cores. ``prepared_ahead``
does it for the file mode (results come back in input order); ``PrepareWorker`` is the
worker itself, which the Kafka consumer drives (``neardup.io.kafka``).
"""

from __future__ import annotations

import logging
import multiprocessing
import queue
import signal
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from itertools import chain, islice
from multiprocessing.connection import Connection
from typing import TypeVar

from neardup.core.settings import EngineSettings
from neardup.core.types import Document
from neardup.detector import PreparedBatch, Preparer

T = TypeVar("T")
log = logging.getLogger(__name__)


class WorkerDied(Exception):
    """The worker process is gone (killed, out of memory, ...)."""


class _Failed:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class _Ready:
    """The worker's first message: imported and compiled, it can take batches."""


def _serve(texts_in: Connection, results_out: Connection, settings: EngineSettings) -> None:
    """The worker: prepare each batch of texts received, send the result back, until EOF.

    A thread reads the incoming batches as they arrive, so the parent never blocks on
    sending one while this process is busy: it can keep several batches in flight.
    """
    # Ctrl-C reaches the whole process group: the parent decides when the worker stops
    # (it finishes its batch first), so the worker must not die of it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    inbox: queue.SimpleQueue[list[str] | None] = queue.SimpleQueue()

    def receive() -> None:
        while True:
            try:
                inbox.put(texts_in.recv())
            except (EOFError, OSError):  # the parent closed the pipe, or died
                inbox.put(None)
                return

    threading.Thread(target=receive, name="neardup-prepare-inbox", daemon=True).start()
    preparer = Preparer(settings)
    preparer.texts(["ready"])  # loads (or compiles) the numba kernels before saying so
    try:
        results_out.send(_Ready())
    except OSError:
        return
    while (texts := inbox.get()) is not None:
        try:
            out: PreparedBatch | _Failed = preparer.texts(texts)
        except Exception as exc:  # noqa: BLE001 - raised again in the parent
            out = _Failed(exc)
        try:
            results_out.send(out)
        except OSError:
            return


class PrepareWorker:
    """One spawned process holding a ``Preparer``: ``submit`` batches, later take their
    ``result``s, in submit order. Any number of batches may be in flight; the worker
    takes them in as they are sent and prepares them one after the other.

    Plain pipes (no ``ProcessPoolExecutor``): if the worker dies, even in the middle
    of sending a result, this end sees EOF and raises ``WorkerDied`` instead of waiting
    forever; if this process dies, the worker sees EOF and exits.
    """

    def __init__(self, settings: EngineSettings) -> None:
        context = multiprocessing.get_context("spawn")
        texts_in, self._texts = context.Pipe(duplex=False)
        self._results, results_out = context.Pipe(duplex=False)
        self._process = context.Process(target=_serve, args=(texts_in, results_out, settings),
                                        name="neardup-prepare", daemon=True)
        self._process.start()  # at once: the imports (about a second) overlap other work
        # The worker's ends live in the worker only, so its death is EOF here.
        texts_in.close()
        results_out.close()
        self._ready = False

    def ready(self) -> bool:
        """Whether the worker has started (imported and compiled), without waiting.

        Raises:
            WorkerDied: the worker process is gone.
        """
        if not self._ready and self._results.poll():
            self._receive()
        return self._ready

    def _receive(self) -> object:
        try:
            out = self._results.recv()
        except (EOFError, OSError) as exc:
            raise WorkerDied(f"exit code {self._process.exitcode}") from exc
        if isinstance(out, _Ready):
            self._ready = True
            log.info("preparing worker started: batches are prepared in it from now on")
        return out

    def submit(self, documents: list[Document]) -> None:
        """Send ``documents`` to be prepared. Raises ``WorkerDied``."""
        try:
            self._texts.send([d.text for d in documents])  # texts pickle fast
        except OSError as exc:
            raise WorkerDied(str(exc)) from exc

    def result(self) -> PreparedBatch:
        """``Preparer(settings)(documents)`` of the oldest batch submitted and not taken.

        Raises:
            WorkerDied: the worker process is gone.
        """
        out = self._receive()
        if isinstance(out, _Ready):
            out = self._receive()
        if isinstance(out, _Failed):
            raise out.exc
        return out

    def close(self) -> None:
        """Stop the worker, dropping what it was preparing.

        A worker that has not started yet (still importing, loading compiled code) has
        nothing to finish: it is killed at once rather than waited for.
        """
        try:
            started = self.ready()
        except WorkerDied:
            started = True  # gone already: the join below returns at once
        self._texts.close()
        self._results.close()
        if not started:
            self._process.kill()
        self._process.join(5)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()

    def __enter__(self) -> PrepareWorker:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


#: Batches ``prepared_ahead`` prepares in the calling process before it starts a worker.
#: The worker takes a second or more to start (imports, compiled code loading) and
#: prepares about half of the work per document; an input the caller gets through in
#: that time gains nothing from it and, on a busy machine, loses the CPU the start
#: costs: on a loaded 2-core machine, inputs of up to 21,578 documents (Reuters-21578)
#: took 1.6 to 1.8 CPU seconds more with the worker and no less wall time
#: (benchmarks/README.md, "Whole process and start-up").
WORKER_AFTER_BATCHES = 24


def prepared_ahead(
    batches: Iterable[T],
    documents_of: Callable[[T], list[Document]],
    settings: EngineSettings,
    parallel: bool,
    depth: int = 2,
    worker_after: int = WORKER_AFTER_BATCHES,
) -> Iterator[tuple[T, PreparedBatch]]:
    """Yield each batch with its ``PreparedBatch``, preparing up to ``depth`` batches ahead.

    The first ``worker_after`` batches are prepared here; a worker process is started only
    when there is a batch after them, and until it has started (about a second of
    imports and compiled code loading) batches are still prepared here rather than
    waited for.

    Args:
        batches: any batches, in order.
        documents_of: the documents of a batch.
        settings: the engine settings (the worker gets a copy).
        parallel: prepare in a worker process (spawned); False prepares inline (the
            ``pipeline`` setting; its default is written in ``neardup.config`` only).
        depth: batches in the worker's hands while the caller handles one (at least 1);
            2 absorbs a batch that takes the worker longer than the caller.
        worker_after: batches prepared here before a worker is started (0: at once).
    """
    preparer: Preparer | None = None
    it = iter(batches)
    for batch in it if not parallel else islice(it, worker_after):
        preparer = preparer or Preparer(settings)
        yield batch, preparer(documents_of(batch))
    if not parallel:
        return
    ahead = list(islice(it, 1))
    if not ahead:
        return
    with PrepareWorker(settings) as worker:
        pending: deque[T] = deque()
        for batch in chain(ahead, it):
            if not pending and not worker.ready():  # still starting: do not wait for it
                preparer = preparer or Preparer(settings)
                yield batch, preparer(documents_of(batch))
                continue
            worker.submit(documents_of(batch))
            pending.append(batch)
            if len(pending) > max(depth, 1):
                yield pending.popleft(), worker.result()
        while pending:
            yield pending.popleft(), worker.result()
