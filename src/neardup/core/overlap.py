"""Exact overlap of sorted fingerprint sets, for many pairs at once (compiled with numba).

A document's shingle set is kept as its sorted distinct 32-bit fingerprints. The
intersection of two such sets is the textbook merge of two sorted lists (Knuth, TAOCP
vol. 3, §5.2.4): one step per element of either list, no allocation. The loop over pairs
runs compiled, so a batch of thousands of pairs costs one call.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(nogil=True, cache=True)
def merge_count(values: np.ndarray, offsets: np.ndarray, a: int, b: int) -> int:  # pragma: no cover - compiled
    """|set a ∩ set b| of flat sets (``values[offsets[a]:offsets[a + 1]]`` is set a)."""
    i, i_end = offsets[a], offsets[a + 1]
    j, j_end = offsets[b], offsets[b + 1]
    n = 0
    while i < i_end and j < j_end:
        x, y = values[i], values[j]
        if x == y:
            n += 1
            i += 1
            j += 1
        elif x < y:
            i += 1
        else:
            j += 1
    return n


@njit(nogil=True, cache=True)
def _merge_counts(values: np.ndarray, offsets: np.ndarray, left: np.ndarray,
                  right: np.ndarray) -> np.ndarray:  # pragma: no cover - compiled
    out = np.empty(len(left), dtype=np.int64)
    for k in range(len(left)):
        out[k] = merge_count(values, offsets, left[k], right[k])
    return out


@njit(nogil=True, cache=True)
def _distinct_low32(hashes: np.ndarray, offsets: np.ndarray, docs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:  # pragma: no cover - compiled
    values = np.empty(offsets[-1], dtype=np.uint32)
    out = np.zeros(len(docs) + 1, dtype=np.int64)
    n = 0
    for i in range(len(docs)):
        d = docs[i]
        part = (hashes[offsets[d] : offsets[d + 1]] & np.uint64(0xFFFFFFFF)).astype(np.uint32)
        part.sort()
        for j in range(len(part)):
            if j == 0 or part[j] != part[j - 1]:
                values[n] = part[j]
                n += 1
        out[i + 1] = n
    return values[:n].copy(), out


def fingerprints(hashes: np.ndarray, offsets: np.ndarray, docs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The sorted distinct fingerprints (low 32 bits of the hashes) of documents ``docs``.

    Args:
        hashes: uint64, shape (total,): every document's hashes, one after the other.
        offsets: int64, shape (n_docs + 1,): document d's are ``hashes[offsets[d]:offsets[d + 1]]``.
        docs: int64, shape (k,): the documents wanted, in output order.

    Returns:
        (values uint32, offsets int64 of shape (k + 1,)): the sets, as in ``flatten``.
    """
    return _distinct_low32(np.asarray(hashes, dtype=np.uint64), np.asarray(offsets, dtype=np.int64),
                           np.asarray(docs, dtype=np.int64))


def flatten(sets: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Sets as one array: (values uint32, shape (total,); offsets int64, shape
    (len(sets) + 1,)), set k being ``values[offsets[k]:offsets[k + 1]]``."""
    offsets = np.zeros(len(sets) + 1, dtype=np.int64)
    np.cumsum(np.fromiter(map(len, sets), dtype=np.int64, count=len(sets)), out=offsets[1:])
    values = np.concatenate(sets).astype(np.uint32, copy=False) if sets else np.zeros(0, np.uint32)
    return values, offsets


def intersection_sizes(values: np.ndarray, offsets: np.ndarray, left: np.ndarray,
                       right: np.ndarray) -> np.ndarray:
    """|set left[k] ∩ set right[k]| for each pair k.

    Args:
        values: uint32, shape (total,): the sets' sorted, distinct fingerprints, one set
            after the other.
        offsets: int64, shape (n_sets + 1,): set k is ``values[offsets[k]:offsets[k + 1]]``.
        left, right: int64, shape (n_pairs,): set indices.

    Returns:
        int64, shape (n_pairs,).

    Raises:
        ValueError: ``left`` and ``right`` differ in length.
        IndexError: an index is outside the sets.
    """
    if len(left) != len(right):
        raise ValueError(f"{len(left)} left and {len(right)} right indices")
    if len(left) == 0:
        return np.zeros(0, dtype=np.int64)
    left = np.asarray(left, dtype=np.int64)
    right = np.asarray(right, dtype=np.int64)
    n_sets = len(offsets) - 1
    for side in (left, right):
        if side.min() < 0 or side.max() >= n_sets:
            raise IndexError(f"set index outside 0..{n_sets - 1}")
    return _merge_counts(values, offsets, left, right)
