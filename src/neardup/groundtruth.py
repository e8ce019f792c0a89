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
    """

    earlier: np.ndarray
    later: np.ndarray
    jaccard: np.ndarray
    containment: np.ndarray

    def __len__(self) -> int:
        return len(self.earlier)

    def similarity(self, measure: str) -> np.ndarray:
        return self.containment if measure == "containment" else self.jaccard

    def select(self, mask: np.ndarray) -> Pairs:
        return Pairs(self.earlier[mask], self.later[mask], self.jaccard[mask], self.containment[mask])


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


def exact_pairs(shingles: ShingleBatch, min_similarity: float = 0.0, measure: str = "jaccard") -> Pairs:
    """Every pair sharing a shingle whose exact ``measure`` reaches ``min_similarity``.

    Args:
        shingles: the documents' shingle hashes (sets: repeats are ignored).
        measure: ``"jaccard"`` or ``"containment"`` (of the later document in the earlier).
    """
    m = incidence(shingles)
    sizes = np.asarray(m.sum(axis=1)).ravel()
    product = sp.triu(m @ m.T, k=1).tocoo()
    earlier, later = product.row.astype(np.int64), product.col.astype(np.int64)
    inter = product.data.astype(np.float64)
    jaccard = inter / (sizes[earlier] + sizes[later] - inter)
    containment = inter / np.maximum(sizes[later], 1)
    pairs = Pairs(earlier, later, jaccard, containment)
    return pairs.select(pairs.similarity(measure) >= min_similarity)
