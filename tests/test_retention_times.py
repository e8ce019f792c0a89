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
    assert Settings(future_tolerance="0").engine().future_tolerance_s == 0.0
    with pytest.raises(ValueError, match="--future-tolerance"):
        Settings(future_tolerance="soon").engine()
