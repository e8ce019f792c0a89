"""A cache of stored shingle fingerprint sets in memory, by seq: a ring buffer.

Exact verification reads the sorted fingerprints of every stored candidate (family
``shingles``). A RocksDB point read costs 2 to 7 µs per set (the binding's per-key cost,
then the block cache or, past its size, the OS page cache), while the block cache holds
whole 4 KiB blocks of about seven sets each, of which a batch usually wants one. This
cache holds single sets instead: the sets of the newest documents that joined a bucket
(near-duplicates tend to arrive close together; a document in no bucket is never a
candidate) and the sets read lately (the same stored documents keep coming back as
candidates while their story is republished), in one ``uint32`` ring of
``capacity_bytes``, overwritten oldest first (FIFO).

A stored set never changes, so the cache cannot be stale. Like the bucket index and the
forest it holds committed state only: the store fills it after a batch's write and after
its reads; it starts empty when the store opens.

Memory: ``capacity_bytes`` for the ring plus 12 bytes per document ever stored (where each
set starts in the ring and its length).
"""

from __future__ import annotations

import numpy as np
from neardup.core.aot import kernel


@kernel("void(uint32[::1], int64[::1], int64[::1], uint32[::1])")
def _copy_out(ring: np.ndarray, starts: np.ndarray, lengths: np.ndarray,
              out: np.ndarray) -> None:  # pragma: no cover - compiled
    capacity = len(ring)
    at = 0
    for k in range(len(starts)):
        position = starts[k] % capacity
        for j in range(lengths[k]):
            out[at] = ring[position]
            at += 1
            position += 1
            if position == capacity:
                position = 0


@kernel("void(uint32[::1], int64, uint32[::1])")
def _copy_in(ring: np.ndarray, written: int, values: np.ndarray) -> None:  # pragma: no cover - compiled
    capacity = len(ring)
    position = written % capacity
    for j in range(len(values)):
        ring[position] = values[j]
        position += 1
        if position == capacity:
            position = 0


class SetCache:
    """Fingerprint sets by seq, the last ``capacity_bytes`` of them added.

    Args:
        capacity_bytes: size of the ring (4 bytes per fingerprint); 0 turns the cache off.

    Raises:
        ValueError: ``capacity_bytes`` is negative.
    """

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be at least 0, not {capacity_bytes}")
        self._ring = np.zeros(capacity_bytes // 4, dtype=np.uint32)
        self._written = 0  # values ever added; the ring holds the last len(ring) of them
        self._base = 0  # seqs below have expired and left the cache
        self._start = np.full(0, -1, dtype=np.int64)  # by seq - base: position of its set, -1 if never added
        self._length = np.zeros(0, dtype=np.int32)
        self.hits = 0
        self.misses = 0

    @property
    def nbytes(self) -> int:
        """Bytes held by the ring and the per-seq arrays (capacity included)."""
        return self._ring.nbytes + self._start.nbytes + self._length.nbytes

    def lookup(self, seqs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The cached sets among ``seqs``.

        Args:
            seqs: uint64 or int64, shape (k,).

        Returns:
            ``hit`` (bool, shape (k,)): which seqs are cached; and the sets of
            ``seqs[hit]``, in that order, as ``values`` (uint32) and ``offsets`` (int64,
            shape (hit.sum() + 1,)).
        """
        seqs = np.asarray(seqs, dtype=np.int64) - self._base
        known = (seqs >= 0) & (seqs < len(self._start))
        starts = np.full(len(seqs), -1, dtype=np.int64)
        starts[known] = self._start[seqs[known]]
        hit = (starts >= 0) & (starts >= self._written - len(self._ring))
        lengths = self._length[seqs[hit]].astype(np.int64)
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        values = np.empty(offsets[-1], dtype=np.uint32)
        if len(values):
            _copy_out(self._ring, starts[hit], lengths, values)
        found = int(hit.sum())
        self.hits += found
        self.misses += len(seqs) - found
        return hit, values, offsets

    def drop_below(self, base: int) -> None:
        """Forget the sets of the documents below ``base`` (expired), and their memory."""
        if base <= self._base:
            return
        cut = min(base - self._base, len(self._start))
        self._start = self._start[cut:].copy()
        self._length = self._length[cut:].copy()
        self._base = base

    def add(self, seqs: np.ndarray, values: np.ndarray, offsets: np.ndarray) -> None:
        """Add the sets of ``seqs`` (``values[offsets[i]:offsets[i + 1]]`` for ``seqs[i]``),
        overwriting the oldest. Of one call only the last sets that fit in the ring
        together are added (none, when the last set alone is longer than the ring).

        Args:
            seqs: uint64 or int64, shape (k,).
            values: uint32, shape (offsets[-1],).
            offsets: int64, shape (k + 1,).
        """
        seqs = np.asarray(seqs, dtype=np.int64)
        if len(seqs) and seqs.min() < self._base:  # expired documents are not added
            keep = np.flatnonzero(seqs >= self._base)
            values, offsets = select_sets(values, np.asarray(offsets, dtype=np.int64), keep)
            seqs = seqs[keep]
        seqs = seqs - self._base
        if not len(self._ring) or not len(seqs):
            return
        offsets = np.asarray(offsets, dtype=np.int64)
        lengths = np.diff(offsets)
        starts = offsets[:-1] - offsets[0]
        # Only the last len(ring) values of one call survive: the sets starting before
        # them (a set longer than the ring among them) are not added.
        first = int(np.searchsorted(starts, starts[-1] + lengths[-1] - len(self._ring), side="left"))
        seqs, lengths, starts = seqs[first:], lengths[first:], starts[first:]
        if not len(seqs):
            return
        values = values[offsets[0] + starts[0]:offsets[-1]]
        starts = starts - starts[0]
        top = int(seqs.max()) + 1
        if top > len(self._start):
            grown = max(top, 2 * len(self._start), 1024)
            self._start = np.concatenate([self._start, np.full(grown - len(self._start), -1, np.int64)])
            self._length = np.concatenate([self._length, np.zeros(grown - len(self._length), np.int32)])
        values = np.ascontiguousarray(values, dtype=np.uint32)
        _copy_in(self._ring, self._written, values)
        self._start[seqs] = self._written + starts
        self._length[seqs] = lengths
        self._written += len(values)


def merge_sets(hit: np.ndarray, cached: tuple[np.ndarray, np.ndarray],
               read: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Interleave two lists of sets in the order ``hit`` gives.

    Args:
        hit: bool, shape (k,): set k is the next of ``cached`` where True, else the next
            of ``read``.
        cached, read: each (values uint32, offsets int64), holding ``hit.sum()`` and
            ``(~hit).sum()`` sets.

    Returns:
        (values uint32, offsets int64 of shape (k + 1,)): the k sets in order.
    """
    (a, a_offsets), (b, b_offsets) = cached, read
    lengths = np.empty(len(hit), dtype=np.int64)
    lengths[hit], lengths[~hit] = np.diff(a_offsets), np.diff(b_offsets)
    offsets = np.zeros(len(hit) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    values = np.empty(offsets[-1], dtype=np.uint32)
    values[np.repeat(hit, lengths)] = a
    values[np.repeat(~hit, lengths)] = b
    return values, offsets


def select_sets(values: np.ndarray, offsets: np.ndarray, picks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sets ``picks`` of a list of sets, in that order.

    Args:
        values, offsets: the sets (uint32 values; int64 offsets, shape (n + 1,)).
        picks: int64, shape (k,): indices of sets, 0 to n - 1.

    Returns:
        (values uint32, offsets int64 of shape (k + 1,)).

    Raises:
        IndexError: a pick outside 0 to n - 1.
    """
    picks = np.asarray(picks, dtype=np.int64)
    if len(picks) and (picks.min() < 0 or picks.max() >= len(offsets) - 1):
        raise IndexError(f"set index outside 0..{len(offsets) - 2}")
    starts = offsets[picks]
    lengths = offsets[picks + 1] - starts
    out_offsets = np.zeros(len(picks) + 1, dtype=np.int64)
    np.cumsum(lengths, out=out_offsets[1:])
    at = np.repeat(starts - out_offsets[:-1], lengths) + np.arange(out_offsets[-1])
    return values[at], out_offsets
