"""Times that would empty the index (``--future-tolerance``), on the real RocksDB store: a
document stamped beyond now plus the tolerance is taken as now and counted, so it moves
no retention window, and every document held before it stays a candidate.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from neardup.config import Settings
from neardup.core.retention import Retention
from neardup.core.settings import EngineSettings
from neardup.core.types import Document
from neardup.detector import Detector
from neardup.state.rocksdb import RocksDBStateStore

TEN_YEARS = 10 * 365 * 86400.0


def _story(n: int) -> str:
    return " ".join(f"w{n}x{k}" for k in range(60))


def _fill(detector: Detector, now: float, count: int) -> None:
    """``count`` distinct stories stamped over the last 50 minutes, in time order."""
    docs = [Document(f"s{k}", _story(k), now - 3000.0 + 3000.0 * k / count) for k in range(count)]
    for start in range(0, count, 100):
        detector.store.commit(detector.detect(docs[start:start + 100]).update)


@pytest.mark.parametrize("future", [TEN_YEARS, 2 * 3600.0])
def test_a_future_timestamp_expires_nothing_early(tmp_path: Path, future: float) -> None:
    settings = EngineSettings()  # --future-tolerance 1h
    with RocksDBStateStore(tmp_path / "state", settings.state_shape(), retention=Retention(seconds=3600.0)) as store:
        detector = Detector(settings, store)
        now = time.time()
        _fill(detector, now, 400)
        assert store.stats()["documents_held"] == 400
        stamped = detector.detect([Document("future", "a story from a clock gone wrong " * 5, now + future)])
        store.commit(stamped.update)
        stats = store.stats()
        assert stats["documents_held"] == 401 and stats["documents_expired"] == 0
        # the oldest document of the window is still a candidate: its copy is a duplicate
        copy = detector.detect([Document("copy-of-s0", _story(0), time.time())])
        assert [(v.verdict, v.match) for v in copy.verdicts] == [("duplicate", "s0")]
        assert stamped.future_times == 1  # counted
        assert stamped.update.times[0] <= round(1000 * time.time())  # taken as now


def test_a_time_within_the_tolerance_is_kept() -> None:
    settings = EngineSettings(future_tolerance_s=600.0)
    from neardup.state.memory import MemoryStateStore

    detector = Detector(settings, MemoryStateStore(settings.state_shape()))
    when = time.time() + 300.0  # a producer's clock 5 minutes ahead
    result = detector.detect([Document("ahead", _story(1), when)])
    assert result.future_times == 0 and result.update.times[0] == round(1000 * when)


def test_the_tolerance_is_a_setting() -> None:
    assert Settings().engine().future_tolerance_s == 3600.0
    assert Settings(future_tolerance="15m").engine().future_tolerance_s == 900.0
    assert Settings(future_tolerance="0").engine().future_tolerance_s == Settings(future_tolerance="0m").engine().future_tolerance_s == 0.0
    with pytest.raises(ValueError, match="--future-tolerance"):
        Settings(future_tolerance="soon").engine()


def _held_back(path: Path, ahead: float) -> tuple[int, int]:
    """Documents one a second (times 1000 + k s, a 100 s window, batches of 50), document
    200 stamped ``ahead`` seconds later than its neighbours: the most documents that had
    expired but were still in the store after a commit, and the store's first document
    (its base) at the end."""
    settings = EngineSettings()
    worst = 0
    with RocksDBStateStore(path, settings.state_shape(), retention=Retention(seconds=100.0)) as store:
        detector = Detector(settings, store)
        docs = [Document(f"s{k}", _story(k), 1000.0 + k + (ahead if k == 200 else 0.0)) for k in range(1000)]
        for start in range(0, len(docs), 50):
            store.commit(detector.detect(docs[start:start + 50]).update)
            stats = store.stats()
            worst = max(worst, stats["documents_expired"] - stats["expired_removed"])
        base = store.stats()["expired_removed"]
    return worst, base


def test_a_document_held_long_holds_back_removal_by_its_lead_at_most(tmp_path: Path) -> None:
    """The bound of the documented limit: expired documents are removed from the front of
    the arrival order, so one held longer than its neighbours (its time ``ahead`` of
    theirs) keeps those after it in the store (not as candidates) until it expires in
    turn: about ``ahead`` seconds of documents more, never more. Its lead is at most
    --future-tolerance when the times follow the wall clock (a later one is taken as
    now)."""
    plain, plain_base = _held_back(tmp_path / "plain", 0.0)
    held, held_base = _held_back(tmp_path / "held", 300.0)
    step = 100 // 8 + 50  # removal waits for an eighth of the window; a batch's documents
    assert plain <= step
    assert 300 - step <= held - plain <= 300 + step  # its lead of 300 s: about 300 documents more
    assert held_base == plain_base > 200  # and once it has expired, all of them go
