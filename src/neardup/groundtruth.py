"""Exact all-pairs similarity of shingle sets, by sparse matrix product.

With M the binary document-by-shingle matrix (scipy CSR), (M M^T)[i, j] = |A_i ∩ A_j|,
so the Jaccard similarity |A ∩ B| / (|A| + |B| - |A ∩ B|) and the containment
|A ∩ B| / |A| of every pair that shares a shingle come out of one product. Fine up to
about 50,000 documents of newswire length on one machine (memory grows with the number of
pairs sharing any shingle).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

from neardup.core.shingle import ShingleBatch


@dataclass(frozen=True)
class Pairs:
    """Pairs of documents ``earlier < later`` with their exact similarities.

    Attributes:
        earlier, later: int64, shape (n_pairs,): document indices, ``earlier < later``.
        jaccard: float64, shape (n_pairs,).
        containment: float64, shape (n_pairs,): share of ``later``'s shingles found in
            ``earlier``.
        sizes: int64, shape (n_docs,): every document's set size (None if unknown).
    """

    earlier: np.ndarray
    later: np.ndarray
    jaccard: np.ndarray
    containment: np.ndarray
    sizes: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.earlier)

    def similarity(self, measure: str, direction: str = "new-in-earlier") -> np.ndarray:
        """float64, shape (n_pairs,): Jaccard, or the containment of ``direction``
        (``neardup.core.settings.EngineSettings.containment_direction``: the later in
        the earlier, the earlier in the later, or the larger of the two).

        Raises:
            ValueError: another direction than these, or one that needs ``sizes``
                without them.
        """
        if measure != "containment":
            return self.jaccard
        if direction == "new-in-earlier":
            return self.containment
        if direction not in ("earlier-in-new", "both") or self.sizes is None:
            raise ValueError(f"containment direction {direction!r} needs known set sizes")
        inter = np.rint(self.containment * self.sizes[self.later])  # a whole count: 0.5 * 14 is not 6.999…
        of_earlier = np.minimum(inter / np.maximum(self.sizes[self.earlier], 1), 1.0)
        return of_earlier if direction == "earlier-in-new" else np.maximum(self.containment, of_earlier)

    def ratio(self) -> np.ndarray:
        """float64, shape (n_pairs,): the larger set's size over the smaller's.

        Raises:
            ValueError: ``sizes`` unknown.
        """
        if self.sizes is None:
            raise ValueError("set sizes unknown")
        a, b = self.sizes[self.earlier], self.sizes[self.later]
        return np.maximum(a, b) / np.maximum(np.minimum(a, b), 1)

    def select(self, mask: np.ndarray) -> Pairs:
        return Pairs(self.earlier[mask], self.later[mask], self.jaccard[mask], self.containment[mask],
                     self.sizes)


def incidence(shingles: ShingleBatch) -> sp.csr_matrix:
    """Binary document-by-shingle matrix (float32 CSR, shape (n_docs, n_distinct))."""
    rows = np.repeat(np.arange(len(shingles)), shingles.counts)
    _, cols = np.unique(shingles.hashes, return_inverse=True)
    m = sp.csr_matrix(
        (np.ones(len(cols), dtype=np.float32), (rows, cols)),
        shape=(len(shingles), int(cols.max()) + 1 if len(cols) else 0),
    )
    m.sum_duplicates()
    m.data[:] = 1.0
    return m


def exact_pairs(shingles: ShingleBatch, min_similarity: float = 0.0, measure: str = "jaccard",
                direction: str = "new-in-earlier") -> Pairs:
    """Every pair sharing a shingle whose exact ``measure`` reaches ``min_similarity``.

    Args:
        shingles: the documents' shingle hashes (sets: repeats are ignored).
        measure: ``"jaccard"`` or ``"containment"`` (``direction`` as in
            ``Pairs.similarity``).
    """
    pairs = all_pairs(shingles)
    return pairs.select(pairs.similarity(measure, direction) >= min_similarity)


def best_earlier(pairs: Pairs, n: int, measure: str = "jaccard",
                 direction: str = "new-in-earlier") -> tuple[np.ndarray, np.ndarray]:
    """Each document's most similar earlier document among ``pairs`` (the earliest among
    equals).

    Args:
        pairs: e.g. ``all_pairs``: every pair sharing a shingle.
        n: number of documents.
        measure: ``"jaccard"`` or ``"containment"`` (``direction`` as in ``Pairs.similarity``).

    Returns:
        (similarity float64, shape (n,), 0.0 for a document with no earlier one sharing a
        shingle; earlier int64, shape (n,), -1 then).
    """
    sim = pairs.similarity(measure, direction)
    order = np.lexsort((pairs.earlier, -sim, pairs.later))
    later = pairs.later[order]
    first = np.flatnonzero(np.r_[True, later[1:] != later[:-1]]) if len(later) else np.empty(0, np.int64)
    best_sim = np.zeros(n)
    best = np.full(n, -1, dtype=np.int64)
    best_sim[later[first]] = sim[order[first]]
    best[later[first]] = pairs.earlier[order[first]]
    return best_sim, best


def all_pairs(shingles: ShingleBatch) -> Pairs:
    """Every pair of documents sharing a shingle, with its exact similarities."""
    m = incidence(shingles)
    sizes = np.asarray(m.sum(axis=1)).ravel()
    product = sp.triu(m @ m.T, k=1).tocoo()
    earlier, later = product.row.astype(np.int64), product.col.astype(np.int64)
    inter = product.data.astype(np.float64)
    jaccard = inter / (sizes[earlier] + sizes[later] - inter)
    containment = inter / np.maximum(sizes[later], 1)
    return Pairs(earlier, later, jaccard, containment, sizes.astype(np.int64))
