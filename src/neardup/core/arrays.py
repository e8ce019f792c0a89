"""Array helpers shared by the detector and the state: distinct values, and searches in
sorted arrays."""

from __future__ import annotations

import numpy as np
from numba import njit


def sorted_unique(values: np.ndarray) -> np.ndarray:
    """The distinct values of ``values``, ascending (what ``np.unique`` returns).

    By sorting: numpy 2's ``np.unique`` hashes integer arrays, which measured 4 times
    slower on the 100 to 40,000 uint64 values of a batch (660 against 170 µs for 7,000).
    """
    out = np.sort(np.asarray(values).ravel())
    if len(out) < 2:
        return out
    keep = np.empty(len(out), dtype=bool)
    keep[0] = True
    np.not_equal(out[1:], out[:-1], out=keep[1:])
    return out[keep]


@njit(nogil=True, cache=True)
def _equal_ranges(haystack: np.ndarray, needles: np.ndarray) -> tuple[np.ndarray, np.ndarray]:  # pragma: no cover - compiled
    starts = np.empty(len(needles), dtype=np.int64)
    counts = np.zeros(len(needles), dtype=np.int64)
    m = len(haystack)
    lo = 0  # haystack[:lo] < the current needle
    for i in range(len(needles)):
        x = needles[i]
        bound = 1  # gallop: haystack[lo + bound // 2 - 1] < x
        while lo + bound - 1 < m and haystack[lo + bound - 1] < x:
            bound *= 2
        a = lo + bound // 2 if bound > 1 else lo
        b = min(lo + bound - 1, m)
        while a < b:  # the first position in [a, b] not below x
            mid = (a + b) // 2
            if haystack[mid] < x:
                a = mid + 1
            else:
                b = mid
        end = a
        while end < m and haystack[end] == x:
            end += 1
        starts[i] = a
        counts[i] = end - a
        lo = end
    return starts, counts


def equal_ranges(haystack: np.ndarray, needles: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Where each needle's run of equal values lies in ``haystack``.

    A galloping (exponential) search from the previous needle's position (Bentley and
    Yao, "An almost optimal algorithm for unbounded searching", IPL 1976): for n sorted
    needles in m values, O(n log(m / n)) steps instead of n binary searches over all m.

    Args:
        haystack: shape (m,), ascending.
        needles: shape (n,), strictly ascending, of the same dtype.

    Returns:
        (starts, counts), int64, shape (n,) each: ``haystack[starts[i]:starts[i] +
        counts[i]]`` are the values equal to ``needles[i]``; ``starts[i]`` is where the
        needle would be inserted when ``counts[i]`` is 0.

    Raises:
        ValueError: the needles are not strictly ascending, or the dtypes differ.
    """
    if haystack.dtype != needles.dtype:
        raise ValueError(f"needles of {needles.dtype} in a haystack of {haystack.dtype}")
    if len(needles) > 1 and not (needles[1:] > needles[:-1]).all():
        raise ValueError("needles must be strictly ascending")
    return _equal_ranges(haystack, needles)
