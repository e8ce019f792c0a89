"""Exact overlap of sorted fingerprint sets (compiled with numba).

A document's shingle set is kept as its sorted distinct 32-bit fingerprints
(``fingerprints``), the sets of many documents as one array cut by offsets. The
intersection of two such sets is the textbook merge of two sorted lists (Knuth, TAOCP
vol. 3, §5.2.4): one step per element of either list, no allocation (``merge_count``,
called from the compiled pair loops of ``neardup.core.cluster``).
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
        (values uint32, shape (total,); offsets int64, shape (k + 1,)): set i is
        ``values[offsets[i]:offsets[i + 1]]``.
    """
    return _distinct_low32(np.asarray(hashes, dtype=np.uint64), np.asarray(offsets, dtype=np.int64),
                           np.asarray(docs, dtype=np.int64))
