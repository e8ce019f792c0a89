"""Overlap of sorted fingerprint sets, exact or from their bottom-k samples (compiled
with numba).

A document's shingle set is kept as its sorted distinct 32-bit fingerprints
(``fingerprints``), the sets of many documents as one array cut by offsets. The
intersection of two such sets is the textbook merge of two sorted lists (Knuth, TAOCP
vol. 3, §5.2.4): one step per element of either list, no allocation (``merge_count``,
called from the compiled pair loops of ``neardup.core.cluster``).

With ``--verify estimate`` a set is kept only as its k smallest fingerprints (k =
``neardup.core.settings.SAMPLE_PER_PERM`` × num_perm): Broder's min-wise sample MIN_k (Broder 1997, "On the
resemblance and containment of documents", §3), a uniform sample of the set because the
fingerprints are hash values. Two samples are compared below the smaller of their
thresholds (the largest fingerprint of a set that was cut; none for a set kept whole):
below it both samples hold every element of their sets, so the counts there are those of
one coordinated sample of both sets (``sample_counts``). A set of at most k shingles is
kept whole, and two such sets compare exactly.
"""

from __future__ import annotations

import numpy as np
from neardup.core.aot import kernel


@kernel
def _merge(x: np.ndarray, i: int, i_end: int, y: np.ndarray, j: int, j_end: int) -> int:  # pragma: no cover - compiled
    """|x[i:i_end] ∩ y[j:j_end]| of two sorted distinct runs: one step per element of
    either."""
    n = 0
    while i < i_end and j < j_end:
        u, v = x[i], y[j]
        if u == v:
            n += 1
            i += 1
            j += 1
        elif u < v:
            i += 1
        else:
            j += 1
    return n


@kernel
def merge_count(values: np.ndarray, offsets: np.ndarray, a: int, b: int) -> int:  # pragma: no cover - compiled
    """|set a ∩ set b| of flat sets (``values[offsets[a]:offsets[a + 1]]`` is set a)."""
    return _merge(values, offsets[a], offsets[a + 1], values, offsets[b], offsets[b + 1])


@kernel("int64(Array(uint32, 1, 'C', readonly=True), Array(uint32, 1, 'C', readonly=True))")
def intersection_size(a: np.ndarray, b: np.ndarray) -> int:  # pragma: no cover - compiled
    """|a ∩ b| of two sets of sorted distinct fingerprints (uint32, shapes (n,) and (m,),
    read-only), as ``merge_count``. The sharded mode's pairs, one call each: on the
    2-core machine 1.5 µs for two sets of 130 fingerprints against 3.6 µs for
    ``np.intersect1d``, 4.1 against 54 µs for two of 2,000."""
    return _merge(a, 0, len(a), b, 0, len(b))


@kernel
def sample_counts(values: np.ndarray, offsets: np.ndarray, sizes: np.ndarray,
                  a: int, b: int) -> tuple[int, int, int]:  # pragma: no cover - compiled
    """(|A ∩ B|, |A|, |B|) counted over the fingerprints of sets a and b at most the
    threshold of the two samples; the exact sizes when neither sample was cut.

    ``values[offsets[a]:offsets[a + 1]]`` is set a's sample, ``sizes[a]`` its set's
    size: a sample shorter than its set was cut at its largest value."""
    i, i_end = offsets[a], offsets[a + 1]
    j, j_end = offsets[b], offsets[b + 1]
    if i_end - i == sizes[a] and j_end - j == sizes[b]:  # whole sets: exact
        return merge_count(values, offsets, a, b), sizes[a], sizes[b]
    limit = np.uint64(1) << np.uint64(32)
    if i_end - i < sizes[a]:
        limit = min(limit, np.uint64(values[i_end - 1]))
    if j_end - j < sizes[b]:
        limit = min(limit, np.uint64(values[j_end - 1]))
    n = in_a = in_b = 0
    while i < i_end and j < j_end:
        x, y = np.uint64(values[i]), np.uint64(values[j])
        if x > limit and y > limit:
            break
        if x == y:
            n += 1
            in_a += 1
            in_b += 1
            i += 1
            j += 1
        elif x < y:
            in_a += 1
            i += 1
        else:
            in_b += 1
            j += 1
    while i < i_end and np.uint64(values[i]) <= limit:
        in_a += 1
        i += 1
    while j < j_end and np.uint64(values[j]) <= limit:
        in_b += 1
        j += 1
    return n, in_a, in_b


@kernel("Tuple((uint32[::1], int64[::1]))(uint64[::1], int64[::1], int64[::1])")
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


def bottom_k(values: np.ndarray, offsets: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The bottom-k samples of sorted sets: the first (smallest) ``k`` fingerprints of
    each (all of a set of at most ``k``).

    Args:
        values: uint32, shape (total,); offsets: int64, shape (n + 1,): sorted sets, set
            i being ``values[offsets[i]:offsets[i + 1]]``.
        k: the sample size, at least 1.

    Returns:
        (values uint32, offsets int64 of shape (n + 1,)), in the same layout.

    Raises:
        ValueError: ``k`` is below 1.
    """
    if k < 1:
        raise ValueError(f"a sample holds at least 1 fingerprint, not {k}")
    offsets = np.asarray(offsets, dtype=np.int64)
    kept = np.minimum(np.diff(offsets), k)
    out = np.zeros(len(kept) + 1, dtype=np.int64)
    np.cumsum(kept, out=out[1:])
    # index of each kept value: its set's start plus its rank in the set
    ranks = np.arange(out[-1], dtype=np.int64) - np.repeat(out[:-1], kept)
    return values[np.repeat(offsets[:-1], kept) + ranks], out
