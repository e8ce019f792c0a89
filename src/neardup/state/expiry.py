"""What a retention window removes from the store, and when.

Which documents are candidates is decided at query time, document by document
(``neardup.core.retention``), so verdicts are exact whatever is still on disk. Removal
follows in bulk: once the expired documents at the front of the arrival order (every
seq below the first one still held) reach an eighth of the held ones, a commit also
removes them, in the same atomic write as its batch: one range delete per family over
their seqs, the bucket-membership and time records of the batches wholly below, their
union-find nodes (the clusters they rooted re-rooted at a held member). The in-memory
bucket index, forest, set cache and times drop them after the write. So memory and disk
hold at most about 9/8 of the window, plus the documents held back by an earlier one
still held (with times out of order, a document expires only once those before it have).
"""

from __future__ import annotations

from bisect import bisect_right

import numpy as np

from neardup.core.retention import NO_TIME, Retention, held

#: Removal waits until the expired front is this share of the held documents.
STEP_SHARE = 8


class Times:
    """Document times (int64 ms) by seq, from ``base`` on, and the first seq of every
    batch whose times are stored (the keys of the ``times`` records)."""

    def __init__(self, base: int = 0) -> None:
        self.base = base
        self._values = np.zeros(0, dtype=np.int64)
        self._n = base
        self.batches: list[int] = []

    @property
    def nbytes(self) -> int:
        return self._values.nbytes

    def extend(self, first_seq: int, times: np.ndarray) -> None:
        """Add the times of documents ``first_seq`` on (``first_seq`` at most ``len``; a
        gap, documents without a stored time, reads as time 0)."""
        end = first_seq + len(times)
        if end - self.base > len(self._values):
            grown = np.zeros(max(end - self.base, 2 * len(self._values), 1024), dtype=np.int64)
            grown[: self._n - self.base] = self._values[: self._n - self.base]
            self._values = grown
        self._values[max(first_seq, self.base) - self.base : end - self.base] = times[max(self.base - first_seq, 0):]
        self._n = max(self._n, end)
        if len(times) and (not self.batches or first_seq > self.batches[-1]):
            self.batches.append(first_seq)

    def grow(self, n: int) -> None:
        """Documents up to ``n - 1`` known, those without a time at 0."""
        if n > self._n:
            self.extend(self._n, np.zeros(n - self._n, dtype=np.int64))
            self.batches.pop()  # not a stored record

    def get(self, seqs: np.ndarray) -> np.ndarray:
        """int64, shape (len(seqs),); ``NO_TIME`` below ``base`` (removed)."""
        seqs = np.asarray(seqs, dtype=np.int64)
        at = seqs - self.base
        if len(at) and at.min() >= 0:
            return self._values[at]
        return np.where(at >= 0, self._values[np.maximum(at, 0)], NO_TIME)

    def since(self, seq: int) -> np.ndarray:
        """int64: the times of documents ``seq`` (at least ``base``) to the last."""
        return self._values[seq - self.base : self._n - self.base]

    def drop_after(self, seq: int) -> None:
        """Forget the times of documents ``seq`` on (a write that failed)."""
        self._n = max(min(self._n, seq), self.base)
        while self.batches and self.batches[-1] >= seq:
            self.batches.pop()

    def drop_below(self, base: int) -> None:
        if base <= self.base:
            return
        self._values = self._values[base - self.base : max(self._n, base) - self.base].copy()
        self.base = base
        self._n = max(self._n, base)
        self.batches = self.batches[max(bisect_right(self.batches, base) - 1, 0):]

    def batch_start(self, seq: int) -> int | None:
        """The first seq of the stored batch holding ``seq`` (None if none is known)."""
        k = bisect_right(self.batches, seq) - 1
        return self.batches[k] if k >= 0 else None


def held_since(times: Times, base: int, next_seq: int, watermark: int,
               retention: Retention) -> np.ndarray:
    """bool, shape (next_seq - base,): which documents from ``base`` are held for the
    next document (``neardup.core.retention.held``)."""
    seqs = np.arange(base, next_seq, dtype=np.int64)
    return held(seqs, times.since(base)[: next_seq - base], next_seq, watermark, retention)


def removal_point(times: Times, next_seq: int, watermark: int, retention: Retention,
                  limit: int) -> int | None:
    """The new ``base`` (first seq held) when removing the expired front is due, at most
    ``limit``; None when it is not due yet."""
    if not retention.active:
        return None
    mask = held_since(times, times.base, next_seq, watermark, retention)
    first = times.base + (int(np.argmax(mask)) if mask.any() else len(mask))
    first = min(first, limit)
    if first - times.base < max(1, (next_seq - first) // STEP_SHARE):
        return None
    return first
