"""Overlap the state-free half of batch k + 1 with the state work of batch k.

Normalising, shingling, MinHashing and banding (``Preparer``) need no state, nor does
parsing the input, so a worker process can do them for the next batch while this process
verifies, clusters and writes the current one: the two halves then share the machine's
two cores. Until that process is worth starting, a thread of this process does it: the
compiled kernels and most of numpy's work release the GIL (on Reuters-21578's batches,
two threads prepare 1.7 times as fast as one). What the worker does with a batch is a ``PrepareJob``: ``PrepareTexts`` for
documents already parsed (the Kafka consumer, ``neardup.run``, which drives a
``PrepareWorker`` itself), or ``ParseLines`` for raw input lines (the file mode,
``neardup.embedded``). ``prepared_ahead`` runs a job ahead of the caller, results in
input order.
"""

from __future__ import annotations

import logging
import multiprocessing
import queue
import signal
import sys
import threading
import types
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from itertools import chain, islice
from multiprocessing.connection import Connection
from typing import Any, Generic, Protocol, TypeVar

from neardup.core import numba_math_without_scipy
from neardup.core.settings import EngineSettings
from neardup.core.types import Document
from neardup.detector import PreparedBatch, Preparer
from neardup.files import parse_line

T = TypeVar("T")
R = TypeVar("R")
log = logging.getLogger(__name__)


class WorkerDied(Exception):
    """The worker process is gone (killed, out of memory, ...)."""


class _Failed:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class _Ready:
    """The worker's first message: imported and compiled, it can take batches."""


class PrepareJob(Protocol, Generic[T, R]):
    """The state-free work on one batch (of type T), split so that its middle part can run
    in a worker process: ``payload`` (in the caller) is what is sent to the worker,
    ``run`` (in the worker, or in the caller) does the work and returns something small
    to send back with the ``PreparedBatch``, ``finish`` (in the caller) makes the batch's
    result (of type R) from the batch and that. A job is pickled into the worker once,
    when it starts."""

    def payload(self, batch: T) -> Any: ...

    def run(self, payload: Any, preparer: Preparer) -> tuple[Any, PreparedBatch]: ...

    def finish(self, batch: T, made: Any) -> R: ...


class PrepareTexts:
    """The ``PrepareJob`` of a list of ``Document``s: their texts are sent, the batch is
    its own result."""

    def payload(self, documents: list[Document]) -> list[str]:
        return [d.text for d in documents]  # texts pickle fast

    def run(self, texts: list[str], preparer: Preparer) -> tuple[None, PreparedBatch]:
        return None, preparer.texts(texts)

    def finish(self, documents: list[Document], made: None) -> list[Document]:
        return documents


#: A parsed line as it comes back from ``ParseLines.run``: its index in the batch, then
#: the document's id and time, or the reject's reason and text, and ``spliceable`` (the
#: text stays in the worker: once prepared, it is not needed).
_Parsed = tuple[int, str | None, float | None, str | None, str | None, bool]


@dataclass
class ParsedLines:
    """A batch of input lines once parsed (``ParseLines.finish``), as columns.

    Attributes:
        rejects: (line number, reason, raw text) of each line that is no record, in order.
        numbers, ids, times, data, spliceable: per record, in order: its line number,
            its document's id and time (``Document.id``, ``Document.time``), its bytes
            as read and ``Line.spliceable``.
        last: the number of the batch's last line (the position to commit).
        text_bytes: the UTF-8 bytes of the records' texts, together.
    """

    rejects: list[tuple[int, str, str | None]]
    numbers: list[int]
    ids: list[str]
    times: list[float | None]
    data: list[bytes]
    spliceable: list[bool]
    last: int
    text_bytes: int

    def __len__(self) -> int:
        """The lines that are records or rejects (a line blank by Unicode's white space
        is neither)."""
        return len(self.rejects) + len(self.ids)


@dataclass(frozen=True)
class ParseLines:
    """The ``PrepareJob`` of a batch of input lines, ``(number, bytes)``: each is parsed
    (``neardup.files.parse_line``) and the documents' texts prepared, in the worker
    process when there is one, so that parsing JSON shares the second core too. What
    comes back is each line without its parsed record (``spliceable`` says how its output
    is written), its text (prepared already) nor its bytes, which the caller keeps.

    ``finish`` gives the batch as ``ParsedLines``.
    """

    text_fields: tuple[str, ...]
    id_field: str | None
    time_field: str | None
    text_format: str = "plain"

    def payload(self, batch: list[tuple[int, bytes]]) -> list[tuple[int, bytes]]:
        return batch

    def run(self, batch: list[tuple[int, bytes]],
            preparer: Preparer) -> tuple[tuple[list[_Parsed], int], PreparedBatch]:
        parsed: list[_Parsed] = []
        texts = []
        text_bytes = 0
        for i, (number, data) in enumerate(batch):
            line = parse_line(number, data, self.text_fields, self.id_field, self.time_field,
                              self.text_format)
            if line is None:
                continue
            if (doc := line.document) is not None:
                parsed.append((i, doc.id, doc.time, None, None, line.spliceable))
                texts.append(doc.text)
                text_bytes += len(doc.text.encode("utf-8"))
            else:
                parsed.append((i, None, None, line.error, line.raw, False))
        return (parsed, text_bytes), preparer.texts(texts)

    def finish(self, batch: list[tuple[int, bytes]], made: tuple[list[_Parsed], int]) -> ParsedLines:
        parsed, text_bytes = made
        out = ParsedLines([], [], [], [], [], [], batch[-1][0], text_bytes)
        numbers, ids, times, data, spliceable = out.numbers, out.ids, out.times, out.data, out.spliceable
        for i, doc_id, when, error, raw, whole in parsed:
            number, line = batch[i]
            if doc_id is not None:
                numbers.append(number)
                ids.append(doc_id)
                times.append(when)
                data.append(line)
                spliceable.append(whole)
            else:
                out.rejects.append((number, error, raw))  # type: ignore[arg-type]
        return out


def _serve(texts_in: Connection, results_out: Connection, settings: EngineSettings,
           job: PrepareJob[Any, Any]) -> None:
    """The worker: run ``job`` on each payload received, send the result back, until EOF.

    A thread reads the incoming batches as they arrive, so the parent never blocks on
    sending one while this process is busy: it can keep several batches in flight.
    """
    # Ctrl-C reaches the whole process group: the parent decides when the worker stops
    # (it finishes its batch first), so the worker must not die of it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    numba_math_without_scipy()
    inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()

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
    while (payload := inbox.get()) is not None:
        try:
            out: tuple[Any, PreparedBatch] | _Failed = job.run(payload, preparer)
        except Exception as exc:  # noqa: BLE001 - raised again in the parent
            out = _Failed(exc)
        try:
            results_out.send(out)
        except OSError:
            return


class PrepareWorker:
    """One spawned process holding a ``Preparer``, running ``job`` (default
    ``PrepareTexts``): ``submit`` batches, later take their ``result``s (or whole
    ``outcome``s), in submit order. Any number of batches may be in flight; the worker
    takes them in as they are sent and prepares them one after the other.

    Plain pipes (no ``ProcessPoolExecutor``): if the worker dies, even in the middle
    of sending a result, this end sees EOF and raises ``WorkerDied`` instead of waiting
    forever; if this process dies, the worker sees EOF and exits.
    """

    def __init__(self, settings: EngineSettings, job: PrepareJob[Any, Any] | None = None) -> None:
        self.job: PrepareJob[Any, Any] = job if job is not None else PrepareTexts()
        context = multiprocessing.get_context("spawn")
        texts_in, self._texts = context.Pipe(duplex=False)
        self._results, results_out = context.Pipe(duplex=False)
        self._process = context.Process(target=_serve, args=(texts_in, results_out, settings, self.job),
                                        name="neardup-prepare", daemon=True)
        # The worker runs ``_serve`` alone: it need not import the caller's main script
        # (spawn imports it unless ``__main__`` has no file; the console script would
        # import the whole command line, about 0.15 s of CPU), so it is given none.
        caller_main = sys.modules["__main__"]
        sys.modules["__main__"] = types.ModuleType("__main__")
        try:
            self._process.start()  # at once: the imports (about half a second) overlap other work
        finally:
            sys.modules["__main__"] = caller_main
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

    def submit(self, batch: Any) -> None:
        """Send ``batch`` (``documents`` for ``PrepareTexts``) to be prepared. Raises
        ``WorkerDied``."""
        try:
            self._texts.send(self.job.payload(batch))
        except OSError as exc:
            raise WorkerDied(str(exc)) from exc

    def outcome(self) -> tuple[Any, PreparedBatch]:
        """``job.run``'s value for the oldest batch submitted and not taken.

        Raises:
            WorkerDied: the worker process is gone.
            Exception: what ``job.run`` raised in the worker.
        """
        out = self._receive()
        if isinstance(out, _Ready):
            out = self._receive()
        if isinstance(out, _Failed):
            raise out.exc
        return out  # type: ignore[return-value]

    def result(self) -> PreparedBatch:
        """``Preparer(settings)(documents)`` of the oldest batch submitted and not taken.

        Raises:
            WorkerDied: the worker process is gone.
        """
        return self.outcome()[1]

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


def _prepared_in_thread(batches: Iterable[T], job: PrepareJob[T, R], preparer: Preparer,
                        depth: int) -> Iterator[tuple[R, PreparedBatch]]:
    """``job.run`` on each batch in one thread of this process (``preparer`` is used there
    alone), up to ``depth`` batches ahead of the caller; ``batches`` are taken,
    ``job.payload`` and ``job.finish`` run here; results in order. An error of
    ``job.run`` is raised here, at its batch. Taking the batches in that thread as well
    (reading the input there) was no faster on Reuters-21578: the thread is the busier
    of the two."""
    pending: deque[tuple[T, Future[tuple[Any, PreparedBatch]]]] = deque()

    def oldest() -> tuple[R, PreparedBatch]:
        done, future = pending.popleft()
        made, prepared = future.result()
        return job.finish(done, made), prepared

    with ThreadPoolExecutor(1, thread_name_prefix="neardup-prepare") as pool:
        try:
            for batch in batches:
                pending.append((batch, pool.submit(job.run, job.payload(batch), preparer)))
                if len(pending) > max(depth, 1):
                    yield oldest()
            while pending:
                yield oldest()
        finally:  # the caller stopped early (or failed): what was not started never is
            for _, future in pending:
                future.cancel()


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
    job: PrepareJob[T, R],
    settings: EngineSettings,
    parallel: bool,
    depth: int = 2,
    worker_after: int = WORKER_AFTER_BATCHES,
) -> Iterator[tuple[R, PreparedBatch]]:
    """Run ``job`` on each batch, up to ``depth`` batches ahead; yield each batch's result
    (``job.finish``) with its ``PreparedBatch``, in order.

    The first ``worker_after`` batches are prepared in a thread of this process, up to
    ``depth`` ahead (``job.run`` there, ``job.payload`` and ``job.finish`` here); a
    worker process is started only when there is a batch after them, and until it has
    started (about half a second of imports and compiled code loading) batches are
    prepared here rather than waited for. If the worker dies, the batches it held and
    the rest are prepared here. Without ``parallel`` every batch is prepared here, in
    this thread.

    Args:
        batches: any batches, in order.
        job: what to do with a batch (``PrepareJob``).
        settings: the engine settings (the worker gets a copy).
        parallel: prepare in a worker process (spawned); False prepares inline (the
            ``pipeline`` setting; its default is written in ``neardup.config`` only).
        depth: batches in the worker's hands while the caller handles one (at least 1);
            2 absorbs a batch that takes the worker longer than the caller.
        worker_after: batches prepared here before a worker is started (0: at once).
    """
    preparer: Preparer | None = None

    def here(batch: T) -> tuple[R, PreparedBatch]:
        nonlocal preparer
        preparer = preparer or Preparer(settings)
        made, prepared = job.run(job.payload(batch), preparer)
        return job.finish(batch, made), prepared

    it = iter(batches)
    if not parallel:
        for batch in it:
            yield here(batch)
        return
    preparer = Preparer(settings)
    yield from _prepared_in_thread(islice(it, worker_after), job, preparer, depth)
    ahead = list(islice(it, 1))
    if not ahead:
        return
    rest = chain(ahead, it)
    pending: deque[T] = deque()  # submitted, not yet taken back: prepared here if it dies
    with PrepareWorker(settings, job) as worker:
        try:
            for batch in rest:
                pending.append(batch)  # first: a worker found dead below leaves it to be prepared here
                if len(pending) == 1 and not worker.ready():  # still starting: do not wait for it
                    pending.pop()
                    yield here(batch)
                    continue
                worker.submit(batch)
                if len(pending) > max(depth, 1):
                    made, prepared = worker.outcome()
                    yield job.finish(pending.popleft(), made), prepared
            while pending:
                made, prepared = worker.outcome()
                yield job.finish(pending.popleft(), made), prepared
        except WorkerDied as exc:  # killed (out of memory, ...): the run goes on without it
            log.warning("the preparing worker process died (%s); preparing in this process from now on", exc)
    for batch in chain(pending, rest):
        yield here(batch)
