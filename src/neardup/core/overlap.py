"""Exact overlap of sorted fingerprint sets, for many pairs at once (compiled with numba).

A document's shingle set is kept as its sorted distinct 32-bit fingerprints. The
intersection of two such sets is the textbook merge of two sorted lists (Knuth, TAOCP
vol. 3, §5.2.4): one step per element of either list, no allocation. The loop over pairs
runs compiled, so a batch of thousands of pairs costs one call.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(nogil=True, cache=False)
def _merge_counts(values: np.ndarray, offsets: np.ndarray, left: np.ndarray,
                  right: np.ndarray) -> np.ndarray:  # pragma: no cover - compiled
    out = np.empty(len(left), dtype=np.int64)
    for k in range(len(left)):
        a, a_end = offsets[left[k]], offsets[left[k] + 1]
        b, b_end = offsets[right[k]], offsets[right[k] + 1]
        n = 0
        while a < a_end and b < b_end:
            x, y = values[a], values[b]
            if x == y:
                n += 1
                a += 1
                b += 1
            elif x < y:
                a += 1
            else:
                b += 1
        out[k] = n
    return out


def intersection_sizes(sets: list[np.ndarray], left: np.ndarray, right: np.ndarray) -> np.ndarray:
    """|sets[left[k]] ∩ sets[right[k]]| for each pair k.

    Args:
        sets: sorted, distinct uint32 fingerprints per set.
        left, right: int64, shape (n_pairs,): indices into ``sets``.

    Returns:
        int64, shape (n_pairs,).

    Raises:
        ValueError: ``left`` and ``right`` differ in length.
        IndexError: an index is outside ``sets``.
    """
    if len(left) != len(right):
        raise ValueError(f"{len(left)} left and {len(right)} right indices")
    if len(left) == 0:
        return np.zeros(0, dtype=np.int64)
    left = np.asarray(left, dtype=np.int64)
    right = np.asarray(right, dtype=np.int64)
    for side in (left, right):
        if side.min() < 0 or side.max() >= len(sets):
            raise IndexError(f"set index outside 0..{len(sets) - 1}")
    offsets = np.zeros(len(sets) + 1, dtype=np.int64)
    np.cumsum(np.fromiter(map(len, sets), dtype=np.int64, count=len(sets)), out=offsets[1:])
    values = np.concatenate(sets).astype(np.uint32, copy=False) if sets else np.zeros(0, np.uint32)
    return _merge_counts(values, offsets, left, right)
