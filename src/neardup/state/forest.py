"""The union-find forest of every committed document, in memory.

Three uint32 arrays indexed by seq: parent, size and canonical (``neardup.core.unionfind``),
12 bytes per document (12 MB at 1,000,000 documents). Like the bucket index, the store
owns it: each batch's changed nodes are written to RocksDB (family ``nodes``) in the
batch's atomic write and applied here only after that write; the forest is rebuilt from
those records when the store opens. It is a cache of committed state, never ahead of it.

The detector reads it (``nodes``, ``closure``) and clusters a batch on a local copy of the
few nodes the batch can reach, so nothing changes here before the commit.
"""

from __future__ import annotations

import numpy as np

from neardup.core.arrays import sorted_unique
from neardup.core.unionfind import Node


class Forest:
    """Union-find nodes of documents 0 … ``len(self) - 1``; a document never linked is
    a singleton (its own parent, size 1, its own canonical)."""

    def __init__(self) -> None:
        self._n = 0
        self._parent = np.zeros(0, dtype=np.uint32)
        self._size = np.zeros(0, dtype=np.uint32)
        self._canonical = np.zeros(0, dtype=np.uint32)

    def __len__(self) -> int:
        return self._n

    @property
    def nbytes(self) -> int:
        """Bytes held by the arrays (capacity included)."""
        return self._parent.nbytes + self._size.nbytes + self._canonical.nbytes

    def grow(self, n: int) -> None:
        """Hold documents up to ``n - 1``, the new ones as singletons."""
        if n <= self._n:
            return
        if n > len(self._parent):
            capacity = max(n, 2 * len(self._parent), 1024)
            for name in ("_parent", "_size", "_canonical"):
                old = getattr(self, name)
                new = np.empty(capacity, dtype=np.uint32)
                new[: self._n] = old[: self._n]
                setattr(self, name, new)
        fresh = np.arange(self._n, n, dtype=np.uint32)
        self._parent[self._n : n] = fresh
        self._size[self._n : n] = 1
        self._canonical[self._n : n] = fresh
        self._n = n

    def set(self, seqs: np.ndarray, parent: np.ndarray, size: np.ndarray, canonical: np.ndarray) -> None:
        """Overwrite the nodes of ``seqs`` (all arrays of shape (k,), integer dtypes).

        Raises:
            IndexError: a seq or parent is not below ``len(self)``.
        """
        if len(seqs) and max(int(np.max(seqs)), int(np.max(parent))) >= self._n:
            raise IndexError(f"a node outside the forest's {self._n} documents")
        self._parent[seqs] = parent
        self._size[seqs] = size
        self._canonical[seqs] = canonical

    def nodes(self, seqs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(parent, size, canonical) of ``seqs``: int64, shape (len(seqs),) each."""
        seqs = np.asarray(seqs, dtype=np.int64)
        return (self._parent[seqs].astype(np.int64), self._size[seqs].astype(np.int64),
                self._canonical[seqs].astype(np.int64))

    def local_copy(self, reach: np.ndarray, n_new: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A copy of the nodes of ``reach`` to cluster on, followed by ``n_new`` singletons.

        Args:
            reach: sorted distinct seqs closed under parent and canonical (``closure``).
            n_new: new documents, after every seq of ``reach``.

        Returns:
            (parent, size, canonical), int64, shape (len(reach) + n_new,) each, over local
            ids: ``reach[i]`` is i, new document j is ``len(reach) + j``.
        """
        parent, size, canonical = self.nodes(reach)
        first = len(reach)
        new = np.arange(first, first + n_new)
        return (np.concatenate([np.searchsorted(reach, parent), new]),
                np.concatenate([size, np.ones(n_new, dtype=np.int64)]),
                np.concatenate([np.searchsorted(reach, canonical), new]))

    def node(self, seq: int) -> Node | None:
        """The stored entry of ``seq``; None for a singleton or an unknown seq."""
        if not 0 <= seq < self._n:
            return None
        node = Node(int(self._parent[seq]), int(self._size[seq]), int(self._canonical[seq]))
        return None if node == Node(seq, 1, seq) else node

    def closure(self, seqs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Everything clustering ``seqs`` can touch, and the canonicals of their clusters.

        Returns:
            (reach, canonicals), uint64 sorted distinct arrays: ``reach`` holds ``seqs``,
            their ancestors up to the roots, the roots' canonicals and those canonicals'
            ancestors; ``canonicals`` the roots' canonicals alone.
        """
        seqs = sorted_unique(np.asarray(seqs, dtype=np.int64))
        parent = self._parent
        reach = [seqs]
        frontier = seqs
        while len(frontier):  # one level of ancestors per step; trees are shallow
            up = parent[frontier].astype(np.int64)
            frontier = sorted_unique(up[up != frontier])
            reach.append(frontier)
        nodes = sorted_unique(np.concatenate(reach))
        roots = nodes[parent[nodes] == nodes]
        canonicals = sorted_unique(self._canonical[roots].astype(np.int64))
        reach.append(canonicals)
        frontier = canonicals
        while len(frontier):
            up = parent[frontier].astype(np.int64)
            frontier = sorted_unique(up[up != frontier])
            reach.append(frontier)
        return sorted_unique(np.concatenate(reach)).astype(np.uint64), canonicals.astype(np.uint64)
