"""Clustering a batch of verified candidates, document by document (compiled with numba).

Accepted pairs (similarity at least the threshold) form clusters through union-find
(``neardup.core.unionfind``); a cluster's id is its earliest document, the canonical.
Two policies:

- ``COMPONENTS``: every accepted pair is joined, so a chain A~B, B~C puts A and C
  together however unlike they are (the connected components of the similarity graph).
- ``CANONICAL`` (against that chaining): a document joins the cluster, among those of its
  accepted candidates, whose canonical is most similar to it, and only when that
  similarity reaches the threshold too. Otherwise it is still a duplicate of its best
  match but starts its own cluster, and records its match's cluster as ``related``.
  Clusters therefore never merge, and every member is similar to its canonical.

Elements are local ids, ordered like the documents' arrival (so the smallest id is the
earliest document). A similarity that the candidates did not give (a document against a
canonical it did not meet in a bucket) is computed here from the documents' sets: exact,
from sorted fingerprints, or estimated from their bottom-k samples (``neardup.core.overlap``).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from neardup.core.aot import kernel

from neardup.core.overlap import sample_counts
from neardup.core.unionfind import find, peek_root, union

COMPONENTS, CANONICAL = 0, 1
#: Measures: Jaccard; containment of the new document in the earlier one |A ∩ B| / |A|;
#: of the earlier one in the new |A ∩ B| / |B|; or either, the larger of the two
#: |A ∩ B| / min(|A|, |B|) (the overlap coefficient).
JACCARD, CONTAINMENT, CONTAINMENT_OF_EARLIER, CONTAINMENT_EITHER = 0, 1, 2, 3
MEASURES = (JACCARD, CONTAINMENT, CONTAINMENT_OF_EARLIER, CONTAINMENT_EITHER)


class Sets(NamedTuple):
    """The documents' sets, by local id, for similarities computed while clustering.

    Attributes:
        sizes: int64, shape (n,): shingle-set sizes.
        values, offsets: the sets as uint32 sorted fingerprints, set i being
            ``values[offsets[i]:offsets[i + 1]]`` (int64 offsets, shape (n + 1,)): whole,
            or, when shorter than ``sizes[i]``, a bottom-k sample of it.
    """

    sizes: np.ndarray
    values: np.ndarray
    offsets: np.ndarray


class Clustering(NamedTuple):
    """What ``cluster_batch`` decided for each document of the batch (int64, shape (n,)).

    Attributes:
        match: index (into the pair arrays) of the best accepted candidate; -1 when no
            candidate was accepted (a unique document).
        accepted: candidates accepted.
        canonical: local id of the canonical of the document's cluster (itself if alone).
        cluster_size: documents in that cluster right after this document joined.
        related: local id of the canonical of the match's cluster when the document
            started its own cluster under ``CANONICAL``; -1 otherwise.
    """

    match: np.ndarray
    accepted: np.ndarray
    canonical: np.ndarray
    cluster_size: np.ndarray
    related: np.ndarray


@kernel
def _pair(a: int, b: int, sizes: np.ndarray, values: np.ndarray, offsets: np.ndarray,
          measure: int) -> tuple[float, float]:  # pragma: no cover - compiled
    """Jaccard of sets a (the later) and b (the earlier), and their containment: of b in
    a with ``CONTAINMENT_OF_EARLIER``, the larger one with ``CONTAINMENT_EITHER``, of a
    in b otherwise. Exact for whole sets, estimated from bottom-k samples otherwise."""
    inter, in_a, in_b = sample_counts(values, offsets, sizes, a, b)
    union = in_a + in_b - inter
    jaccard = inter / union if union > 0 else 0.0
    of_a = inter / in_a if in_a > 0 else 0.0
    of_b = inter / in_b if in_b > 0 else 0.0
    if measure == CONTAINMENT_OF_EARLIER:
        return jaccard, of_b
    if measure == CONTAINMENT_EITHER:
        return jaccard, max(of_a, of_b)
    return jaccard, of_a


@kernel
def _pairs(left: np.ndarray, right: np.ndarray, sizes: np.ndarray, values: np.ndarray,
           offsets: np.ndarray, measure: int) -> tuple[np.ndarray, np.ndarray]:  # pragma: no cover - compiled
    jaccard = np.empty(len(left))
    containment = np.empty(len(left))
    for k in range(len(left)):
        jaccard[k], containment[k] = _pair(left[k], right[k], sizes, values, offsets, measure)
    return jaccard, containment


def pair_similarities(sets: Sets, left: np.ndarray, right: np.ndarray,
                      measure: int = CONTAINMENT) -> tuple[np.ndarray, np.ndarray]:
    """Jaccard and containment of each pair k: of set ``left[k]`` in set ``right[k]``,
    or as ``measure`` says (``CONTAINMENT_OF_EARLIER``: of ``right[k]`` in ``left[k]``;
    ``CONTAINMENT_EITHER``: the larger of the two).

    Whole sets: exact, from the merge of the sorted fingerprints. Bottom-k samples
    (``--verify estimate``): the same ratios counted below the samples' common threshold
    (``neardup.core.overlap.sample_counts``, Broder 1997).

    Args:
        sets: the sets, by local id.
        left, right: int64, shape (n_pairs,): local ids.

    Returns:
        Two float64 arrays of shape (n_pairs,).

    Raises:
        ValueError: ``left`` and ``right`` differ in length.
        IndexError: an id is outside the sets.
    """
    left = np.asarray(left, dtype=np.int64)
    right = np.asarray(right, dtype=np.int64)
    if len(left) != len(right):
        raise ValueError(f"{len(left)} left and {len(right)} right ids")
    for side in (left, right):
        if len(side) and (side.min() < 0 or side.max() >= len(sets.sizes)):
            raise IndexError(f"set id outside 0..{len(sets.sizes) - 1}")
    return _pairs(left, right, sets.sizes, sets.values, sets.offsets, measure)


@kernel
def _cluster_one(i: int, x: int, lo: int, hi: int, parent: np.ndarray, size: np.ndarray,
                 canonical: np.ndarray, candidates: np.ndarray, similarity: np.ndarray,
                 threshold: float, policy: int, measure: int, sizes: np.ndarray,
                 values: np.ndarray, offsets: np.ndarray,
                 seen: np.ndarray, match: np.ndarray, accepted: np.ndarray, cluster: np.ndarray,
                 cluster_size: np.ndarray, related: np.ndarray, windowed: bool,
                 local_until: np.ndarray) -> None:  # pragma: no cover - compiled
    """Cluster document ``i`` of the batch (local id ``x``), whose candidates are the pairs
    ``lo`` to ``hi``; its decisions go to entry ``i`` of the output arrays. ``seen``:
    scratch space of at least ``hi - lo`` entries. When ``windowed``, a canonical whose
    ``local_until`` is at most ``i`` has expired (``neardup.core.retention``): its cluster
    is judged by its best accepted candidate instead, which the document then joins."""
    best = -1
    for k in range(lo, hi):
        if similarity[k] >= threshold:
            accepted[i] += 1
            if best < 0 or similarity[k] > similarity[best]:
                best = k
    match[i] = best
    if best < 0:
        return
    if policy == COMPONENTS:
        for k in range(lo, hi):
            if similarity[k] >= threshold:
                union(parent, size, canonical, candidates[k], x)
    else:
        # the canonicals of the accepted candidates' clusters, ascending, distinct
        m = 0
        for k in range(lo, hi):
            if similarity[k] >= threshold:
                seen[m] = canonical[peek_root(parent, candidates[k])]
                m += 1
        ordered = np.sort(seen[:m])
        target, target_similarity = -1, -1.0
        for j in range(m):
            c = ordered[j]
            if j > 0 and c == ordered[j - 1]:
                continue
            s = -1.0
            join = c
            if windowed and local_until[c] <= i:  # expired: its best held member stands in
                for k in range(lo, hi):
                    if (similarity[k] >= threshold and similarity[k] > s
                            and canonical[peek_root(parent, candidates[k])] == c):
                        s, join = similarity[k], candidates[k]
            else:
                for k in range(lo, hi):  # a candidate's similarity is known already
                    if candidates[k] == c:
                        s = similarity[k]
                        break
                if s < 0.0:
                    jaccard, containment = _pair(x, c, sizes, values, offsets, measure)
                    s = jaccard if measure == JACCARD else containment
            if s > target_similarity:
                target, target_similarity = join, s
        if target_similarity < threshold:
            related[i] = canonical[peek_root(parent, candidates[best])]
            return
        union(parent, size, canonical, target, x)
    root = find(parent, x)
    cluster[i] = canonical[root]
    cluster_size[i] = size[root]


@kernel
def _outputs(n: int, first: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:  # pragma: no cover - compiled
    """The ``Clustering`` arrays of ``n`` documents from local id ``first``, before any
    decision: no match, alone in their own cluster."""
    return (np.full(n, -1, dtype=np.int64), np.zeros(n, dtype=np.int64),
            np.arange(first, first + n).astype(np.int64), np.ones(n, dtype=np.int64),
            np.full(n, -1, dtype=np.int64))


@kernel
def _cluster(parent: np.ndarray, size: np.ndarray, canonical: np.ndarray, first: int,
             bounds: np.ndarray, candidates: np.ndarray, similarity: np.ndarray,
             threshold: float, policy: int, measure: int, sizes: np.ndarray,
             values: np.ndarray, offsets: np.ndarray):  # pragma: no cover - compiled
    n = len(bounds) - 1
    match, accepted, cluster, cluster_size, related = _outputs(n, first)
    seen = np.empty(max(len(candidates), 1), dtype=np.int64)
    for i in range(n):
        _cluster_one(i, first + i, bounds[i], bounds[i + 1], parent, size, canonical, candidates,
                     similarity, threshold, policy, measure, sizes, values, offsets,
                     seen, match, accepted, cluster, cluster_size, related, False, bounds[:0])
    return match, accepted, cluster, cluster_size, related


def cluster_batch(parent: np.ndarray, size: np.ndarray, canonical: np.ndarray, first: int,
                  bounds: np.ndarray, candidates: np.ndarray, similarity: np.ndarray,
                  threshold: float, policy: int, measure: int, sets: Sets) -> Clustering:
    """Cluster the documents ``first``, ``first + 1``, … in that order, updating the forest.

    Args:
        parent, size, canonical: int64, shape (n_local,): the union-find forest over local
            ids (``neardup.core.unionfind``), changed in place. It must hold every
            candidate with its ancestors and the canonicals of their clusters.
        first: local id of the batch's first document; the batch's documents are
            ``first`` to ``first + len(bounds) - 2``, after every other local id.
        bounds: int64, shape (n + 1,): the candidates of document ``first + i`` are the
            pairs ``bounds[i]`` to ``bounds[i + 1]``.
        candidates: int64, shape (n_pairs,): local id of each pair's candidate.
        similarity: float64, shape (n_pairs,): each pair's similarity (``measure``).
        threshold: a pair is accepted when its similarity is at least this.
        policy: ``COMPONENTS`` or ``CANONICAL``.
        measure: ``JACCARD`` or a containment (``MEASURES``).
        sets: the sets of the batch's documents and of the canonicals, for similarities
            the pairs do not give (``CANONICAL`` only).

    Returns:
        The decisions per document (``Clustering``).
    """
    n = len(bounds) - 1
    if len(candidates) != len(similarity) or (n >= 0 and bounds[-1] != len(candidates)):
        raise ValueError("bounds, candidates and similarity disagree")
    if policy not in (COMPONENTS, CANONICAL) or measure not in MEASURES:
        raise ValueError(f"unknown policy {policy} or measure {measure}")
    return Clustering(*_cluster(parent, size, canonical, first, bounds, candidates, similarity,
                                float(threshold), policy, measure, sets.sizes, sets.values,
                                sets.offsets))
