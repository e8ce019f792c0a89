"""The union-find forest of every committed document, in memory.

Three uint32 arrays indexed by seq: parent, size and canonical (``neardup.core.unionfind``),
12 bytes per document (12 MB at 1,000,000 documents). Like the bucket index, the store
owns it: each batch's changed nodes are written to RocksDB (family ``nodes``) in the
batch's atomic write and applied here only after that write; the forest is rebuilt from
those records when the store opens. It is a cache of committed state, never ahead of it.

The detector reads it (``nodes``, ``closure``) and clusters a batch on a local copy of the
few nodes the batch can reach, so nothing changes here before the commit.

With a retention window the documents below ``base`` have expired and left the arrays
(``rebased``): a cluster whose root expired gets its earliest held member as root, with
the cluster's size and canonical, and every held member whose path went through an
expired node points at the root directly. So clusters outlive their members: the
canonical may be an expired document (a seq below ``base``), kept as the cluster id. A
seq below ``base`` reads as a singleton.
"""

from __future__ import annotations

import numpy as np

from neardup.core.arrays import sorted_unique
from neardup.core.types import Node


class Forest:
    """Union-find nodes of documents ``base`` … ``len(self) - 1``; a document never linked
    is a singleton (its own parent, size 1, its own canonical), and so reads every
    document below ``base`` (expired)."""

    def __init__(self, base: int = 0) -> None:
        self._base = base
        self._n = base
        self._parent = np.zeros(0, dtype=np.uint32)
        self._size = np.zeros(0, dtype=np.uint32)
        self._canonical = np.zeros(0, dtype=np.uint32)

    def __len__(self) -> int:
        return self._n

    @property
    def base(self) -> int:
        """The first document held; those below have expired."""
        return self._base

    @property
    def nbytes(self) -> int:
        """Bytes held by the arrays (capacity included)."""
        return self._parent.nbytes + self._size.nbytes + self._canonical.nbytes

    def grow(self, n: int) -> None:
        """Hold documents up to ``n - 1``, the new ones as singletons."""
        if n <= self._n:
            return
        b = self._base
        if n - b > len(self._parent):
            capacity = max(n - b, 2 * len(self._parent), 1024)
            for name in ("_parent", "_size", "_canonical"):
                old = getattr(self, name)
                new = np.empty(capacity, dtype=np.uint32)
                new[: self._n - b] = old[: self._n - b]
                setattr(self, name, new)
        fresh = np.arange(self._n, n, dtype=np.uint32)
        self._parent[self._n - b : n - b] = fresh
        self._size[self._n - b : n - b] = 1
        self._canonical[self._n - b : n - b] = fresh
        self._n = n

    def set(self, seqs: np.ndarray, parent: np.ndarray, size: np.ndarray, canonical: np.ndarray) -> None:
        """Overwrite the nodes of ``seqs`` (all arrays of shape (k,), integer dtypes); nodes
        below ``base`` are ignored (expired).

        Raises:
            IndexError: a seq or parent is not below ``len(self)``.
        """
        if len(seqs) and max(int(np.max(seqs)), int(np.max(parent))) >= self._n:
            raise IndexError(f"a node outside the forest's {self._n} documents")
        seqs = np.asarray(seqs, dtype=np.int64)
        keep = seqs >= self._base
        at = seqs[keep] - self._base
        self._parent[at] = np.asarray(parent)[keep]
        self._size[at] = np.asarray(size)[keep]
        self._canonical[at] = np.asarray(canonical)[keep]

    def nodes(self, seqs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(parent, size, canonical) of ``seqs``: int64, shape (len(seqs),) each."""
        seqs = np.asarray(seqs, dtype=np.int64)
        gone = seqs < self._base
        if not gone.any():
            at = seqs - self._base
            return (self._parent[at].astype(np.int64), self._size[at].astype(np.int64),
                    self._canonical[at].astype(np.int64))
        at = np.where(gone, 0, seqs - self._base)
        parent = np.where(gone, seqs, self._parent[at]).astype(np.int64)
        size = np.where(gone, 1, self._size[at]).astype(np.int64)
        canonical = np.where(gone, seqs, self._canonical[at]).astype(np.int64)
        return parent, size, canonical

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
        if not self._base <= seq < self._n:
            return None
        at = seq - self._base
        node = Node(int(self._parent[at]), int(self._size[at]), int(self._canonical[at]))
        return None if node == Node(seq, 1, seq) else node

    def _parents(self, seqs: np.ndarray) -> np.ndarray:
        """int64 parents of ``seqs`` (int64); a seq below ``base`` is its own parent."""
        gone = seqs < self._base
        if not gone.any():
            return self._parent[seqs - self._base].astype(np.int64)
        return np.where(gone, seqs, self._parent[np.where(gone, 0, seqs - self._base)]).astype(np.int64)

    def closure(self, seqs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Everything clustering ``seqs`` can touch, and the canonicals of their clusters.

        Returns:
            (reach, canonicals), uint64 sorted distinct arrays: ``reach`` holds ``seqs``,
            their ancestors up to the roots, the roots' canonicals and those canonicals'
            ancestors; ``canonicals`` the roots' canonicals alone.
        """
        seqs = sorted_unique(np.asarray(seqs, dtype=np.int64))
        reach = [seqs]
        frontier = seqs
        while len(frontier):  # one level of ancestors per step; trees are shallow
            up = self._parents(frontier)
            frontier = sorted_unique(up[up != frontier])
            reach.append(frontier)
        nodes = sorted_unique(np.concatenate(reach))
        roots = nodes[self._parents(nodes) == nodes]
        canonicals = sorted_unique(self.nodes(roots)[2])
        reach.append(canonicals)
        frontier = canonicals
        while len(frontier):
            up = self._parents(frontier)
            frontier = sorted_unique(up[up != frontier])
            reach.append(frontier)
        return sorted_unique(np.concatenate(reach)).astype(np.uint64), canonicals.astype(np.uint64)

    def rebased(self, nodes: np.ndarray, n: int, base: int) -> tuple[Forest, np.ndarray]:
        """This forest grown to ``n`` documents with ``nodes`` applied, then without the
        documents below ``base`` (expired); ``self`` is not changed.

        A cluster whose root is below ``base`` gets its earliest held member as root
        (with the cluster's size and canonical, which may be expired: the cluster id
        stays); every held member with an expired node on its path to the root points at
        the root directly.

        Args:
            nodes: uint64, shape (k, 4): rows (seq, parent, size, canonical) to apply first.
            n: documents after the batch.
            base: the new first document held, at least ``self.base``.

        Returns:
            (the new forest, uint64 rows of shape (j, 4) of the held nodes that changed,
            to be stored).
        """
        b0 = self._base
        m = self._n - b0
        parent = np.arange(b0, n, dtype=np.int64)
        size = np.ones(n - b0, dtype=np.int64)
        canonical = parent.copy()
        parent[:m], size[:m], canonical[:m] = self._parent[:m], self._size[:m], self._canonical[:m]
        nodes = np.asarray(nodes, dtype=np.int64).reshape(-1, 4)
        nodes = nodes[nodes[:, 0] >= b0]
        at = nodes[:, 0] - b0
        parent[at], size[at], canonical[at] = nodes[:, 1], nodes[:, 2], nodes[:, 3]

        held = np.arange(base, n, dtype=np.int64)
        up = parent[base - b0:].copy()
        touched = np.zeros(len(held), dtype=bool)
        while True:  # pointer jumping to the roots, noting paths through expired nodes
            touched |= up < base
            nxt = parent[up - b0]
            if (nxt == up).all():
                break
            up = nxt
        roots = up
        # new root of each cluster: the old one if held, else its earliest held member
        order_roots, first_member = np.unique(roots, return_index=True)
        new_root_of = np.where(order_roots >= base, order_roots, held[first_member])
        new_root = new_root_of[np.searchsorted(order_roots, roots)]
        new_parent = parent[base - b0:].copy()
        new_size = size[base - b0:].copy()
        new_canonical = canonical[base - b0:].copy()
        new_parent[touched] = new_root[touched]
        moved = order_roots < base  # clusters whose root expired: the new root takes its node
        if moved.any():
            r_at = new_root_of[moved] - base
            new_parent[r_at] = new_root_of[moved]
            new_size[r_at] = size[order_roots[moved] - b0]
            new_canonical[r_at] = canonical[order_roots[moved] - b0]
        changed = ((new_parent != parent[base - b0:]) | (new_size != size[base - b0:])
                   | (new_canonical != canonical[base - b0:]))
        forest = Forest(base)
        forest._n = n
        forest._parent = new_parent.astype(np.uint32)
        forest._size = new_size.astype(np.uint32)
        forest._canonical = new_canonical.astype(np.uint32)
        rows = np.column_stack([held[changed], new_parent[changed], new_size[changed],
                                new_canonical[changed]]).astype(np.uint64)
        return forest, rows

    def canonicals_below(self, base: int) -> np.ndarray:
        """uint64, sorted distinct: the canonicals below ``base`` of the held clusters."""
        m = self._n - self._base
        seqs = np.arange(self._base, self._n, dtype=np.int64)
        roots = self._parent[:m].astype(np.int64) == seqs
        canonical = self._canonical[:m][roots].astype(np.int64)
        return sorted_unique(canonical[canonical < base]).astype(np.uint64)
