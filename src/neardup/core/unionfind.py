"""Union-find (disjoint sets) over arrays, for clustering documents (compiled with numba).

Iterative ``find`` with full path compression and ``union`` by size (Tarjan, "Efficiency
of a good but not linear set union algorithm", JACM 1975): no recursion, so no recursion
limit, and near-constant amortised time. Each root also records its cluster's canonical
element, the smallest (earliest) one, which is the cluster id.

A forest is three int64 arrays of one entry per element: ``parent`` (an element is a root
when it is its own parent), ``size`` and ``canonical`` (meaningful on roots only). A
singleton is ``parent[x] == x``, ``size[x] == 1``, ``canonical[x] == x``. The functions
are numba-compiled: they run at C speed inside other compiled loops
(``neardup.core.cluster``) and can be called from Python too.
"""

from __future__ import annotations

import numpy as np
from neardup.core.aot import kernel

from neardup.core.types import Node

__all__ = ["Node", "find", "peek_root", "union"]


@kernel
def find(parent: np.ndarray, x: int) -> int:  # pragma: no cover - compiled
    """The root of ``x``'s set; points every element of the path from ``x`` at it."""
    root = x
    while parent[root] != root:
        root = parent[root]
    while parent[x] != root:
        up = parent[x]
        parent[x] = root
        x = up
    return root


@kernel
def peek_root(parent: np.ndarray, x: int) -> int:  # pragma: no cover - compiled
    """The root of ``x``'s set, without writing (no path compression)."""
    while parent[x] != x:
        x = parent[x]
    return x


@kernel
def union(parent: np.ndarray, size: np.ndarray, canonical: np.ndarray, x: int, y: int) -> int:  # pragma: no cover - compiled
    """Merge the sets of ``x`` and ``y``; return the new root.

    The larger set's root becomes the root (ties: ``x``'s); the merged canonical is the
    smaller of the two canonicals.
    """
    rx = find(parent, x)
    ry = find(parent, y)
    if rx == ry:
        return rx
    if size[rx] < size[ry]:
        rx, ry = ry, rx
    parent[ry] = rx
    size[rx] += size[ry]
    canonical[rx] = min(canonical[rx], canonical[ry])
    return rx
