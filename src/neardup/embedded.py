"""The embedded mode: deduplicate JSONL files without Kafka, with the state on disk
(``--state-dir``), or for one run only.

A rerun never destroys earlier output: each batch's state commit records, with the
inputs' positions, the outputs' lengths in bytes, and a rerun cuts the outputs back to
them before it goes on, so a run killed at any point and run again gives exactly the
outputs of an uninterrupted run (``neardup.files.OutputFiles``).
"""

from __future__ import annotations

import json
import logging
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import xxhash
from tqdm import tqdm

from neardup.config import MEMORY_STATE_BYTES, default
from neardup.core.retention import Retention
from neardup.core.settings import EngineSettings
from neardup.core.types import Rejected, Verdict
from neardup.extract import require_extractor
from neardup.detector import BatchResult, Detector
from neardup.files import (
    READ_ERRORS,
    Input,
    InputError,
    OutputFiles,
    check_input,
    numbered_lines,
    open_binary,
)
from neardup.pipeline import WORKER_AFTER_BATCHES, ParsedLines, ParseLines, prepared_ahead
from neardup.state.base import StateError, StateUpdate
from neardup.state.kv import KeyValueStateStore
from neardup.state.memory import MemoryStateStore
from neardup.state.rocksdb import RocksDBStateStore

log = logging.getLogger(__name__)
T = TypeVar("T")

#: Keys of the embedded mode's records in the state's ``verdicts`` family (a Kafka topic
#: name holds no ``\\0``, so they cannot meet the consumer's keys).
OUTPUTS_KEY = b"dedup:outputs\0"  # + resolved out dir: JSON {output name: bytes}
PATH_KEY = b"dedup:path\0"  # + resolved input path: the Input.key last read under it
#: Set (to the last line committed, ASCII) by every batch read from stdin, deleted when
#: stdin ends: present at the start, a run over stdin was interrupted.
STDIN_KEY = b"dedup:stdin\0"


#: Inputs of at least this many bytes on disk (gzipped ones count as stored) start the
#: worker process at once rather than after ``neardup.pipeline.WORKER_AFTER_BATCHES``
#: batches: on the 2-core machine (3 rounds, load 1.2-1.7), a 200,000-document stream
#: (170 MB) took 7.5-7.6 s so against 8.1-8.3 s, Reuters-21578 (43 MB, 8 MB gzipped)
#: 1.8-1.9 s against 1.7-1.8 s.
WORKER_AT_ONCE_BYTES = 64 << 20


def _one_run_store(sources: list[Input], settings: EngineSettings, scratch: str,
                   retention: Retention | dict[str, Any] | None) -> KeyValueStateStore:
    """The state of a run without ``--state-dir`` (``MEMORY_STATE_BYTES``): written without
    a write-ahead log when in RocksDB, nothing being recovered from it."""
    if retention is None and all(source.size is not None for source in sources) \
            and sum(source.size or 0 for source in sources) < MEMORY_STATE_BYTES:
        return MemoryStateStore(settings.state_shape())
    return RocksDBStateStore(scratch, settings.state_shape(), wal=False, retention=retention)


@dataclass
class Summary:
    """Counts of one ``dedup`` run. ``seconds`` is wall-clock time."""

    documents: int = 0
    unique: int = 0
    duplicates: int = 0
    clusters: int = 0
    rejected_candidates: int = 0
    rejects: int = 0
    first_reject: str = ""  # "line N: reason" of the first rejected line
    renamed_ids: int = 0
    input_bytes: int = 0
    seconds: float = 0.0
    resumed_at_line: dict[str, int] = field(default_factory=dict)

    @property
    def documents_per_second(self) -> float:
        return self.documents / self.seconds if self.seconds else 0.0

    def as_dict(self) -> dict[str, object]:
        out = asdict(self)
        out["documents_per_second"] = round(self.documents_per_second, 1)
        out["megabytes_per_second"] = round(
            self.input_bytes / 1e6 / self.seconds if self.seconds else 0.0, 3
        )
        return out

    def render(self) -> str:
        renamed = f"renamed ids          {self.renamed_ids:>10,}  (an id seen before)\n" if self.renamed_ids else ""
        return (
            f"documents            {self.documents:>10,}\n"
            f"unique               {self.unique:>10,}\n"
            f"duplicates           {self.duplicates:>10,}\n"
            f"clusters             {self.clusters:>10,}  (with a duplicate in this run)\n"
            f"rejected candidates  {self.rejected_candidates:>10,}  (below the threshold)\n"
            f"rejects              {self.rejects:>10,}  (malformed lines)\n"
            f"{renamed}"
            f"documents/s          {self.documents_per_second:>10,.0f}\n"
            f"seconds              {self.seconds:>10,.2f}"
        )


def _batches(items: Iterable[T], size: int) -> Iterator[list[T]]:
    it = iter(items)
    while batch := list(islice(it, size)):
        yield batch


def _hash64(text: str) -> int:
    return xxhash.xxh3_64_intdigest(text.encode("utf-8", "surrogatepass"))


class DistinctIds:
    """Renames a document whose id an earlier document has (in this run or in the state)
    to ``<id>@<file name>:<line>`` (then ``#2``, ``#3``, ... while that is taken too), so
    that every record can be told apart in the outputs' ``cluster`` and ``match``.

    Ids are remembered as 64-bit XXH3 hashes; the state's ids are read once when a run
    starts, so a resumed run names documents as an uninterrupted one would, save for the
    ids of documents that expired from a retention window: the state no longer holds them,
    so a later document with such an id keeps it.
    """

    warnings = 5  # the first renames are logged one by one, the rest counted

    def __init__(self, store: KeyValueStateStore, chunk: int = 1 << 16) -> None:
        self._seen: set[int] = set()
        n = store.next_seq()
        for first in range(0, n, chunk):
            self._seen.update(_hash64(i) for i in store.stored_ids(range(first, min(n, first + chunk))))
        self.renamed = 0

    def __call__(self, ids: list[str], numbers: list[int], source: str) -> None:
        """Make ``ids`` distinct, in order, renaming in place (``numbers``: the line
        numbers of their records; ``source``: the file's name)."""
        seen, add = self._seen, self._seen.add
        for i, doc_id in enumerate(ids):
            h = _hash64(doc_id)
            if h not in seen:
                add(h)
                continue
            base = name = f"{doc_id}@{source}:{numbers[i]}"
            k = 1
            while (h := _hash64(name)) in seen:
                k += 1
                name = f"{base}#{k}"
            add(h)
            self.renamed += 1
            if self.renamed <= self.warnings:
                log.warning("%s:%d: id %r seen before; named %r in the outputs", source, numbers[i], doc_id, name)
            ids[i] = name


def _write_batch(outputs: OutputFiles, parsed: ParsedLines, result: BatchResult, summary: Summary,
                 clusters: set[str]) -> None:
    """Queue a batch's outputs: its lines that are no records, then its records, each
    a reject (``result.reasons``) or a verdict; count them in ``summary``, and the
    clusters of its duplicates in ``clusters``."""
    def reject(number: int, reason: str, doc_id: str | None = None, raw: str | None = None) -> None:
        outputs.write_reject(number, reason, doc_id, raw)
        summary.first_reject = summary.first_reject or f"line {number}: {reason}"
        summary.rejects += 1

    for number, error, raw in parsed.rejects:
        reject(number, error, raw=raw)
    summary.input_bytes += parsed.text_bytes
    data, spliceable = parsed.data, parsed.spliceable
    if len(result.columns) < len(parsed.ids):  # rejected by the engine (an empty text)
        for number, reason, doc_id in zip(parsed.numbers, result.reasons, parsed.ids):
            if reason is not None:
                reject(number, reason, doc_id)
        valid = [i for i, reason in enumerate(result.reasons) if reason is None]
        data, spliceable = [data[i] for i in valid], [spliceable[i] for i in valid]
    columns = result.columns
    outputs.write_verdicts(columns, data, spliceable)
    duplicates = sum(columns.duplicate)
    summary.documents += len(columns)
    summary.duplicates += duplicates
    summary.unique += len(columns) - duplicates
    summary.rejected_candidates += sum(columns.rejected)
    if duplicates:
        clusters.update(c for c, dup in zip(columns.cluster, columns.duplicate) if dup)


def _path_key(source: Input) -> bytes:
    return PATH_KEY + str(Path(source.path).resolve()).encode("utf-8", "surrogateescape")


def _start_line(store: KeyValueStateStore, source: Input) -> int:
    """The line after which ``source`` resumes (0: from the start); logs what is resumed."""
    if not source.resumable:
        return 0
    start = store.get_position(source.key) or 0
    [before] = store.get_verdicts([_path_key(source)])
    if start:
        log.info("%s: resuming after line %d: the content read before (%d bytes, the same "
                 "first MiB)", source.path, start, source.size)
    elif before is not None and before.decode() != source.key:
        log.warning("%s: not the file read before under this name (its size or first MiB "
                    "differ): reading it from line 1", source.path)
    return start


def _check_stdin(store: KeyValueStateStore, sources: list[Input], state_dir: Path | None) -> None:
    """A run over stdin cannot be resumed: stdin has no identity, so nothing tells the
    lines read before from others. Say so (one line), and refuse a rerun over stdin of
    a state whose run over stdin was interrupted: it would read again the lines already
    in the state, and its outputs would not be those of an uninterrupted run.

    Raises:
        InputError: stdin is an input and the state holds an interrupted run over it.
    """
    if state_dir is None or all(source.resumable for source in sources):
        return
    [interrupted] = store.get_verdicts([STDIN_KEY])
    if interrupted is not None:
        raise InputError(
            f"the state in {state_dir} holds a run over stdin interrupted after line {interrupted.decode()}, "
            "and stdin cannot be resumed (it has no identity); give the input as a file, or start again "
            "with an empty --state-dir and --overwrite")
    log.info("stdin cannot be resumed (it has no identity): if this run is interrupted, a rerun over "
             "stdin with --state-dir %s is refused", state_dir)


def _commit_stdin_read(store: KeyValueStateStore, settings: EngineSettings) -> None:
    """stdin was read to its end: the next run may read stdin again."""
    store.commit(StateUpdate(first_seq=store.next_seq(), ids=[],
                             signatures=np.empty((0, settings.num_perm), np.uint64),
                             verdict_deletes=[STDIN_KEY]))


def _numbered(source: Input, stream: Iterable[bytes], start: int) -> Iterator[tuple[int, bytes]]:
    try:
        yield from numbered_lines(stream, start)
    except READ_ERRORS as exc:  # truncated or corrupt gzip, I/O error
        raise InputError(f"cannot read input {source.path}: {exc}") from None


def _commit_outputs(store: KeyValueStateStore, settings: EngineSettings, key: bytes,
                    lengths: dict[str, int]) -> None:
    """Record the outputs' lengths before the first batch: a run killed before its first
    commit is then continued like any other."""
    store.commit(StateUpdate(first_seq=store.next_seq(), ids=[],
                             signatures=np.empty((0, settings.num_perm), np.uint64),
                             verdicts={key: json.dumps(lengths).encode()}))


def _close(bar: tqdm, outputs: OutputFiles | None, store: KeyValueStateStore, failing: bool = False) -> None:
    """Close everything; when ``failing``, a store that fails to close (after a full
    disk, say) does not hide the error that stopped the run."""
    bar.close()
    if outputs is not None:
        outputs.close()
    try:
        store.close()
    except StateError:
        if not failing:
            raise


def dedup_files(
    inputs: list[str],
    settings: EngineSettings,
    out_dir: Path,
    text_fields: list[str],
    id_field: str | None,
    state_dir: Path | None = None,
    batch_size: int = default("batch_size"),
    append: bool = False,
    overwrite: bool = False,
    progress: bool | None = None,
    on_batch: Callable[[list[Verdict | Rejected], float], None] | None = None,
    parallel: bool = default("pipeline"),
    time_field: str | None = None,
    retention: Retention | dict[str, Any] | None = None,
    text_format: str = "plain",
) -> Summary:
    """Deduplicate ``inputs`` (JSONL, gzipped or not, or ``-``) in order, into ``out_dir``.

    With ``state_dir`` the state persists: a later run finds duplicates of earlier runs'
    documents, an input already read (known by its content, ``neardup.files.Input``)
    is resumed after its last committed line, and outputs the state recorded are
    continued (``neardup.files.OutputFiles``). Without it the state lives for the run
    only: in memory for small inputs, else in a temporary directory removed at the end
    (``MEMORY_STATE_BYTES``). Every input is checked before any output is touched.

    Args:
        batch_size: documents per batch (the ``Settings`` default, as ``neardup dedup``).
        append: append to non-empty outputs that the state did not record.
        overwrite: empty the outputs first.
        on_batch: called after each batch with its results and its seconds (metrics).
        parallel: parse and prepare the next batch (normalise, shingle, MinHash) in a worker
            process while the current one is verified and written
            (``neardup.pipeline``).
        time_field: the field holding each record's time for a retention window (ISO
            8601 or epoch seconds); None: the time a line is read.
        retention: the retention window stored with the state (a mapping changes only
            the bounds it names); None keeps the stored one (``neardup.core.retention``).
        text_format: ``"html"``: the text fields hold HTML pages and their main text is
            deduplicated (``neardup.extract``); a page with none is rejected.

    Raises:
        InputError: an input is missing, a directory, unreadable or corrupt.
        OutputError: the outputs hold earlier output this run would destroy.
        SettingsMismatchError: ``state_dir`` holds state built with other settings.
    """
    if text_format == "html":
        require_extractor()
    sources = [check_input(path) for path in inputs]
    summary = Summary()
    clusters: set[str] = set()
    with tempfile.TemporaryDirectory(prefix="neardup-state-") as scratch:
        store = (RocksDBStateStore(state_dir, settings.state_shape(), retention=retention) if state_dir
                 else _one_run_store(sources, settings, scratch, retention))
        outputs: OutputFiles | None = None
        bar = tqdm(unit=" docs", disable=None if progress is None else not progress)
        try:
            outputs_key = OUTPUTS_KEY + str(out_dir.resolve()).encode("utf-8", "surrogateescape")
            _check_stdin(store, sources, state_dir)  # before any output is touched
            [recorded] = store.get_verdicts([outputs_key])
            outputs = OutputFiles(out_dir, json.loads(recorded) if recorded else None,
                                  append=append, overwrite=overwrite)
            _commit_outputs(store, settings, outputs_key, outputs.flush())
            detector = Detector(settings, store)
            ids = DistinctIds(store)
            parse = ParseLines(tuple(text_fields), id_field, time_field, text_format)
            large = sum(source.size or 0 for source in sources) >= WORKER_AT_ONCE_BYTES
            worker_after = 0 if large else WORKER_AFTER_BATCHES
            started = time.perf_counter()
            for source in sources:
                start = _start_line(store, source)
                if start:
                    summary.resumed_at_line[source.path] = start
                name = "stdin" if source.path == "-" else Path(source.path).name
                with open_binary(source.path) as stream:
                    numbered = _batches(_numbered(source, stream, start), batch_size)
                    for parsed, prepared in prepared_ahead(numbered, parse, settings, parallel,
                                                           worker_after=worker_after):
                        t0 = time.perf_counter()
                        ids(parsed.ids, parsed.numbers, name)
                        result = detector.detect_prepared(parsed.ids, parsed.times, prepared)
                        _write_batch(outputs, parsed, result, summary, clusters)
                        # The outputs' lengths go into the same atomic write as the
                        # batch's state and position: a rerun cuts them back to it.
                        result.update.verdicts[outputs_key] = json.dumps(outputs.flush()).encode()
                        if source.resumable:
                            result.update.positions[source.key] = parsed.last
                            result.update.verdicts[_path_key(source)] = source.key.encode()
                        else:
                            result.update.verdicts[STDIN_KEY] = str(parsed.last).encode()
                        store.commit(result.update)
                        bar.update(len(parsed))
                        if on_batch is not None:
                            on_batch(result.results, time.perf_counter() - t0)
                if not source.resumable:
                    _commit_stdin_read(store, settings)
            summary.renamed_ids = ids.renamed
            if ids.renamed > DistinctIds.warnings:
                log.warning("%d ids seen before were renamed (<id>@<file>:<line>)", ids.renamed)
        except BaseException:
            _close(bar, outputs, store, failing=True)
            raise
        _close(bar, outputs, store)
        summary.clusters = len(clusters)
        summary.seconds = time.perf_counter() - started
    return summary
