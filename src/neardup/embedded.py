"""The embedded mode: deduplicate JSONL files without Kafka, with the state on disk."""

from __future__ import annotations

import logging
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from itertools import islice
from pathlib import Path

from tqdm import tqdm

from neardup.core.settings import EngineSettings
from neardup.core.types import Document, Rejected, Verdict
from neardup.detector import Detector
from neardup.io.files import Line, OutputFiles, open_text, read_lines, source_name
from neardup.pipeline import prepared_ahead
from neardup.state.rocksdb import RocksDBStateStore

log = logging.getLogger(__name__)


@dataclass
class Summary:
    """Counts of one ``dedup`` run. ``seconds`` is wall-clock time."""

    documents: int = 0
    unique: int = 0
    duplicates: int = 0
    clusters: int = 0
    rejected_candidates: int = 0
    rejects: int = 0
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
        return (
            f"documents            {self.documents:>10,}\n"
            f"unique               {self.unique:>10,}\n"
            f"duplicates           {self.duplicates:>10,}\n"
            f"clusters             {self.clusters:>10,}  (with a duplicate in this run)\n"
            f"rejected candidates  {self.rejected_candidates:>10,}  (below the threshold)\n"
            f"rejects              {self.rejects:>10,}  (malformed lines)\n"
            f"documents/s          {self.documents_per_second:>10,.0f}\n"
            f"seconds              {self.seconds:>10,.2f}"
        )


def _documents(batch: list[Line]) -> list[Document]:
    return [line.document for line in batch if line.document is not None]


def _batches(lines: Iterable[Line], size: int) -> Iterator[list[Line]]:
    it = iter(lines)
    while batch := list(islice(it, size)):
        yield batch


def dedup_files(
    inputs: list[str],
    settings: EngineSettings,
    out_dir: Path,
    text_fields: list[str],
    id_field: str | None,
    state_dir: Path | None = None,
    batch_size: int = 1000,
    append: bool = False,
    progress: bool | None = None,
    on_batch: Callable[[list[Verdict | Rejected], float], None] | None = None,
    parallel: bool = True,
) -> Summary:
    """Deduplicate ``inputs`` (JSONL, ``.jsonl.gz`` or ``-``) in order, into ``out_dir``.

    With ``state_dir`` the state persists: a later run finds duplicates of earlier runs'
    documents, and a file already read is resumed after its last committed line. Without
    it the state lives in a temporary directory removed at the end.

    Args:
        on_batch: called after each batch with its results and its seconds (metrics).
        parallel: prepare the next batch (normalise, shingle, MinHash) in a worker
            process while the current one is verified and written
            (``neardup.pipeline``).

    Raises:
        FileNotFoundError: an input does not exist.
        SettingsMismatchError: ``state_dir`` holds state built with other settings.
    """
    summary = Summary()
    clusters: set[str] = set()
    with tempfile.TemporaryDirectory(prefix="neardup-state-") as scratch:
        store = RocksDBStateStore(state_dir or scratch, settings.state_shape())
        detector = Detector(settings, store)
        outputs = OutputFiles(out_dir, append=append)
        started = time.perf_counter()
        bar = tqdm(unit=" docs", disable=None if progress is None else not progress)
        try:
            for path in inputs:
                source = source_name(path)
                start = 0 if path == "-" else (store.get_position(source) or 0)
                if start:
                    summary.resumed_at_line[path] = start
                    log.info("%s: resuming after line %d", path, start)
                with open_text(path) as stream:
                    lines = read_lines(stream, text_fields, id_field, start=start)
                    for batch, prepared in prepared_ahead(
                        _batches(lines, batch_size), _documents, settings, parallel
                    ):
                        t0 = time.perf_counter()
                        good = [line for line in batch if line.document is not None]
                        result = detector.detect([line.document for line in good], prepared)  # type: ignore[misc]
                        for line in batch:
                            if line.error is not None:
                                outputs.write_reject(line.number, line.error, raw=line.raw)
                                summary.rejects += 1
                        for line, outcome in zip(good, result.results):
                            summary.input_bytes += len(line.document.text.encode("utf-8"))  # type: ignore[union-attr]
                            if isinstance(outcome, Rejected):
                                outputs.write_reject(line.number, outcome.reason, outcome.id)
                                summary.rejects += 1
                                continue
                            outputs.write_verdict(line.record, outcome)
                            summary.documents += 1
                            summary.rejected_candidates += outcome.rejected
                            if outcome.is_duplicate:
                                summary.duplicates += 1
                                clusters.add(outcome.cluster)
                            else:
                                summary.unique += 1
                        outputs.flush()
                        result.update.positions[source] = batch[-1].number
                        store.commit(result.update)
                        bar.update(len(batch))
                        if on_batch is not None:
                            on_batch(result.results, time.perf_counter() - t0)
        finally:
            bar.close()
            outputs.close()
            store.close()
        summary.clusters = len(clusters)
        summary.seconds = time.perf_counter() - started
    return summary
