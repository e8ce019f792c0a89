"""Union-find (disjoint sets) over a parent map, for clustering documents.

Iterative ``find`` with full path compression and ``union`` by size (Tarjan, "Efficiency
of a good but not linear set union algorithm", JACM 1975): no recursion, so no recursion
limit, and near-constant amortised time. Each root also records its cluster's canonical
element, the smallest (earliest) one, which is the cluster id.

The map is any ``MutableMapping[int, Node]``: a dict in memory, or an overlay that loads
nodes from the state store and remembers which it changed. An element missing from the
map is a singleton: its own root, size 1, canonical itself.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import NamedTuple


class Node(NamedTuple):
    """A union-find entry. ``size`` and ``canonical`` are meaningful on roots only."""

    parent: int
    size: int
    canonical: int


def _node(nodes: MutableMapping[int, Node], x: int) -> Node:
    node = nodes.get(x)
    return Node(x, 1, x) if node is None else node


def find(nodes: MutableMapping[int, Node], x: int) -> int:
    """The root of ``x``'s set; compresses the path from ``x`` to it."""
    root = x
    while (parent := _node(nodes, root).parent) != root:
        root = parent
    while x != root:
        node = _node(nodes, x)
        if node.parent != root:
            nodes[x] = node._replace(parent=root)
        x = node.parent
    return root


def peek_root(nodes: Mapping[int, Node], x: int) -> Node:
    """The root entry of ``x``'s set, read without compressing the path (no writes):
    for look-ups that should not turn into stored changes."""
    node = nodes.get(x)
    while node is not None and node.parent != x:
        x = node.parent
        node = nodes.get(x)
    return Node(x, 1, x) if node is None else node


def root_node(nodes: MutableMapping[int, Node], x: int) -> Node:
    """The root entry of ``x``'s set (its size and canonical element)."""
    return _node(nodes, find(nodes, x))


def union(nodes: MutableMapping[int, Node], x: int, y: int) -> int:
    """Merge the sets of ``x`` and ``y``; return the new root.

    The larger set's root becomes the root (ties: ``x``'s); the merged canonical is the
    smaller of the two canonicals.
    """
    rx, ry = find(nodes, x), find(nodes, y)
    if rx == ry:
        return rx
    nx, ny = _node(nodes, rx), _node(nodes, ry)
    if nx.size < ny.size:
        rx, ry, nx, ny = ry, rx, ny, nx
    nodes[ry] = ny._replace(parent=rx)
    nodes[rx] = Node(rx, nx.size + ny.size, min(nx.canonical, ny.canonical))
    return rx
