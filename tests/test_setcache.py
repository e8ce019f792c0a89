"""The set cache: a ring of fingerprint sets that never answers wrong, and keeps the newest.

Against a dict of every set ever added (the reference), through wrap-arounds of the ring;
then through a RocksDB store, where verdicts must not depend on the cache.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from neardup.core.settings import EngineSettings
from neardup.core.types import Document
from neardup.detector import Detector
from neardup.state.rocksdb import RocksDBStateStore
from neardup.state.setcache import SetCache, merge_sets, select_sets

DATA = Path(__file__).parent / "data" / "reuters_excerpt.jsonl.gz"

# A step adds the sets of some seqs, or looks seqs up. A seq's set never changes (as in a
# store): its length is seq % 13 and its values follow from the seq.
_STEPS = st.lists(st.one_of(st.tuples(st.just("add"), st.lists(st.integers(0, 60), min_size=1, max_size=8)),
                            st.tuples(st.just("lookup"), st.lists(st.integers(0, 70), max_size=12))),
                  min_size=1, max_size=40)


def _set(seq: int) -> np.ndarray:
    return (np.arange(seq % 13, dtype=np.uint32) * np.uint32(2654435761) + np.uint32(seq)).astype(np.uint32)


@settings(max_examples=400, deadline=None)
@given(st.integers(0, 40), _STEPS)
def test_hits_are_exact_and_exactly_the_newest_sets(capacity: int, steps: list) -> None:
    """A model of the ring: the sets stored, in order; a seq is a hit exactly when the
    values stored since its latest copy began (its own included) fit in the ring."""
    cache = SetCache(4 * capacity)
    stored: list[int] = []
    for kind, seqs in steps:
        if kind == "add":
            sets = [_set(seq) for seq in seqs]
            offsets = np.zeros(len(seqs) + 1, dtype=np.int64)
            np.cumsum([len(x) for x in sets], out=offsets[1:])
            cache.add(np.array(seqs), np.concatenate(sets), offsets)
            if capacity:  # of one call, its last sets that fit in the ring together
                kept, room = [], capacity
                for seq in reversed(seqs):
                    if seq % 13 > room:
                        break
                    kept.append(seq)
                    room -= seq % 13
                stored.extend(reversed(kept))
            continue
        hit, values, offsets = cache.lookup(np.array(seqs, dtype=np.int64))
        expected = []
        for seq in seqs:
            last = max((i for i, x in enumerate(stored) if x == seq), default=None)
            expected.append(last is not None and sum(x % 13 for x in stored[last:]) <= capacity)
        assert hit.tolist() == expected
        assert len(offsets) == hit.sum() + 1
        for k, seq in enumerate(np.array(seqs, dtype=np.int64)[hit].tolist()):
            assert values[offsets[k]:offsets[k + 1]].tolist() == _set(seq).tolist()


def test_lookup_counts_hits_and_misses() -> None:
    cache = SetCache(4 * 10)
    values = np.arange(9, dtype=np.uint32)
    cache.add(np.array([5, 7, 3]), values, np.array([0, 4, 4, 9]))
    hit, got, offsets = cache.lookup(np.array([3, 4, 5, 7, 1000]))
    assert hit.tolist() == [True, False, True, True, False]
    assert got.tolist() == [4, 5, 6, 7, 8, 0, 1, 2, 3] and offsets.tolist() == [0, 5, 9, 9]
    assert (cache.hits, cache.misses) == (3, 2)
    cache.add(np.array([8]), np.arange(100, 103, dtype=np.uint32), np.array([0, 3]))  # 12 values > 10
    hit, got, _ = cache.lookup(np.array([5, 7, 3, 8]))
    assert hit.tolist() == [False, True, True, True] and got.tolist() == [4, 5, 6, 7, 8, 100, 101, 102]


def test_off_cache_and_bad_capacity() -> None:
    cache = SetCache(0)
    cache.add(np.array([0]), np.arange(3, dtype=np.uint32), np.array([0, 3]))
    assert not cache.lookup(np.array([0]))[0].any()
    with pytest.raises(ValueError, match="capacity_bytes"):
        SetCache(-4)


def test_merge_sets_interleaves_in_order() -> None:
    cached = (np.array([1, 2, 3], dtype=np.uint32), np.array([0, 2, 3]))  # {1, 2}, {3}
    read = (np.array([9], dtype=np.uint32), np.array([0, 0, 1]))  # {}, {9}
    values, offsets = merge_sets(np.array([False, True, False, True]), cached, read)
    assert values.tolist() == [1, 2, 9, 3] and offsets.tolist() == [0, 0, 2, 3, 4]


def test_select_sets_picks_in_order() -> None:
    values, offsets = np.array([1, 2, 3, 9], dtype=np.uint32), np.array([0, 2, 2, 3, 4])  # {1, 2}, {}, {3}, {9}
    picked, picked_offsets = select_sets(values, offsets, np.array([3, 0, 1, 0]))
    assert picked.tolist() == [9, 1, 2, 1, 2] and picked_offsets.tolist() == [0, 1, 3, 3, 5]
    none, none_offsets = select_sets(values, offsets, np.array([], dtype=np.int64))
    assert none.tolist() == [] and none_offsets.tolist() == [0]
    with pytest.raises(IndexError):
        select_sets(values, offsets, np.array([4]))


def test_only_sets_of_documents_in_a_bucket_are_written_through(tmp_path: Path) -> None:
    """A document in no bucket is never a candidate: an exact copy (which joins none) is
    not written to the ring, the story and an unrelated one are."""
    settings = EngineSettings()
    story = "the quick brown fox jumps over the lazy dog near the river bank at dawn today"
    other = "markets closed higher on friday as oil prices rose for a third straight week"
    with RocksDBStateStore(tmp_path, settings.state_shape(), set_cache_bytes=1 << 20) as store:
        Detector(settings, store).process([Document("a", story), Document("copy", story),
                                           Document("b", other)])
        hit, _, _ = store.sets.lookup(np.array([0, 1, 2]))
        assert hit.tolist() == [True, False, True]


def _replay(path: Path, set_cache_bytes: int, texts: list[tuple[str, str]]) -> tuple[list, dict]:
    settings = EngineSettings()
    with RocksDBStateStore(path, settings.state_shape(), set_cache_bytes=set_cache_bytes) as store:
        detector = Detector(settings, store)
        results = []
        for start in range(0, len(texts), 500):
            results += detector.process([Document(i, t) for i, t in texts[start:start + 500]])
        return results, store.stats()


def test_verdicts_do_not_depend_on_the_set_cache(tmp_path: Path) -> None:
    """Stories and their copies (each copy cut by a word), with the cache off, much
    smaller than the stream (it wraps many times) and larger: the same verdicts."""
    with gzip.open(DATA, "rt", encoding="utf-8") as f:
        stories = [json.loads(line) for line in f][:1500]
    texts = [(str(s["id"]), s["text"]) for s in stories]
    for r in range(1, 4):
        texts += [(f"{s['id']}~{r}", " ".join(s["text"].split()[r:])) for s in stories]
    off, stats_off = _replay(tmp_path / "off", 0, texts)
    small, stats_small = _replay(tmp_path / "small", 64 << 10, texts)
    large, stats_large = _replay(tmp_path / "large", 64 << 20, texts)
    assert sum(r.is_duplicate for r in off if hasattr(r, "is_duplicate")) > 3000
    assert small == off and large == off
    assert stats_off["set_cache_hits"] == 0 and stats_off["set_cache_misses"] > 0
    # Copies of a story arrive 1,500 documents apart: only the large cache still has it.
    assert stats_large["set_cache_hits"] > 10 * stats_large["set_cache_misses"]
    assert stats_small["set_cache_hits"] < stats_large["set_cache_hits"]
