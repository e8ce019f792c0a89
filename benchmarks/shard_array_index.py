"""A shard partition's buckets in arrays, its rules compiled and run a batch at a time:
``ShardIndex``'s findings and joins (``neardup.sharded.shard``, whose docstring states
the rules). A measured alternative (``shard_kernel.py``), not used by the shard stage.

Layout: the buckets in an open-addressing table of uint64 bucket ids (linear probing,
kept at most half full), each bucket's members a linked list of nodes in the order they
joined, with its size; the copy buckets by member; the members' shingle sets one after
the other in one uint32 array. Members get dense local ids in the order they are added;
their order keys are kept as (timestamp, partition, offset) columns, so that a document
processed late meets only the members before it. Every array grows by doubling.

Not here (``ShardIndex`` serves those): the retention window, the containment measure, a
restore from the changelog and the RocksDB store.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from neardup.core.settings import EngineSettings
from neardup.sharded.records import BandRecord
from neardup.sharded.shard import Checked, Finding, Joins

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


@njit(nogil=True, cache=True)
def _slot(keys: np.ndarray, used: np.ndarray, key: np.uint64) -> int:  # pragma: no cover - compiled
    """The table slot of ``key``: its own, or the empty one where it would go."""
    mask = len(keys) - 1
    i = int((key * _GOLDEN) >> np.uint64(40)) & mask
    while used[i] and keys[i] != key:
        i = (i + 1) & mask
    return i


@njit(nogil=True, cache=True)
def _rehash(keys, used, head, tail, count, new_keys, new_used, new_head, new_tail, new_count):  # pragma: no cover
    for i in range(len(keys)):
        if used[i]:
            s = _slot(new_keys, new_used, keys[i])
            new_used[s], new_keys[s] = True, keys[i]
            new_head[s], new_tail[s], new_count[s] = head[i], tail[i], count[i]


@njit(nogil=True, cache=True)
def _earlier(order: np.ndarray, a: int, b: int) -> bool:  # pragma: no cover - compiled
    """Whether member ``a``'s order key (timestamp, partition, offset) is below ``b``'s."""
    for k in range(3):
        if order[a, k] != order[b, k]:
            return order[a, k] < order[b, k]
    return False


@njit(nogil=True, cache=True)
def _similarity(fp: np.ndarray, a0: int, a1: int, b0: int, b1: int) -> tuple[float, float]:  # pragma: no cover
    """(Jaccard, containment of a in b) of two sorted distinct runs of ``fp``."""
    i, j, inter = a0, b0, 0
    while i < a1 and j < b1:
        if fp[i] == fp[j]:
            inter += 1
            i += 1
            j += 1
        elif fp[i] < fp[j]:
            i += 1
        else:
            j += 1
    na, nb = a1 - a0, b1 - b0
    union = na + nb - inter
    return (inter / union if union else 0.0), (inter / na if na else 0.0)


@njit(nogil=True, cache=True)
def _append(nxt, member, head, tail, n_nodes, at, me) -> int:  # pragma: no cover - compiled
    """Append member ``me`` to the list whose head and tail are ``head[at]``, ``tail[at]``."""
    nxt[n_nodes], member[n_nodes] = -1, me
    if head[at] >= 0:
        nxt[tail[at]] = n_nodes
    else:
        head[at] = n_nodes
    tail[at] = n_nodes
    return n_nodes + 1


@njit(nogil=True, cache=True)
def _join(keys, used, head, tail, count, nxt, member, n_nodes, n_used, bucket, me):  # pragma: no cover
    s = _slot(keys, used, bucket)
    if not used[s]:
        used[s], keys[s], head[s], tail[s], count[s] = True, bucket, -1, -1, 0
        n_used += 1
    n_nodes = _append(nxt, member, head, tail, n_nodes, s, me)
    count[s] += 1
    return n_nodes, n_used


@njit(nogil=True, cache=True)
def _add_batch(keys, used, head, tail, count, nxt, member, chead, ctail, ccount, order, fp, fstart, fend,
               n_nodes, n_used, first, boff, bk, foff, fps, cap, max_c, limit, floor, threshold, copies_on,
               only_new_on, out_c, out_j, out_k, out_n, joined, copied, copied_n):  # pragma: no cover - compiled
    """Meet, verify and join documents ``first ..`` (local ids) in order, as
    ``ShardIndex.add`` (Jaccard). Returns the node and used-slot counts after them."""
    n = len(boff) - 1
    members = np.empty(1024, dtype=np.int64)
    owner = np.empty(1024, dtype=np.int64)
    f_at = fend[first - 1] if first > 0 else 0
    for d in range(n):
        me = first + d
        nf = foff[d + 1] - foff[d]
        fp[f_at:f_at + nf] = fps[foff[d]:foff[d + 1]]
        fstart[me], fend[me] = f_at, f_at + nf
        f_at += nf
        b0, b1 = boff[d], boff[d + 1]
        total = 0
        for b in range(b0, b1):
            s = _slot(keys, used, bk[b])
            if used[s]:
                node = head[s]
                while node >= 0:
                    if total == len(members):
                        members = np.concatenate((members, np.empty(total, dtype=np.int64)))
                        owner = np.concatenate((owner, np.empty(total, dtype=np.int64)))
                    members[total], owner[total] = member[node], b
                    total += 1
                    node = nxt[node]
        out_n[d], copied_n[d] = 0, 0
        if total == 0 and cap > 0:  # meets no one here (most do): joins every bucket
            for b in range(b0, b1):
                joined[b] = True
        else:
            # members before the document, ranked by buckets shared here, earlier first among equals
            ms = np.sort(members[:total])
            uniq = np.empty(total, dtype=np.int64)
            cnt = np.empty(total, dtype=np.int64)
            u = 0
            for i in range(total):
                if u and uniq[u - 1] == ms[i]:
                    cnt[u - 1] += 1
                elif _earlier(order, ms[i], me):
                    uniq[u], cnt[u] = ms[i], 1
                    u += 1
            ranked = np.empty(u, dtype=np.int64)
            by_rank = np.argsort(-cnt[:u] * (1 << 40) + uniq[:u])
            for r in range(u):
                ranked[r] = uniq[by_rank[r]]
            nc, best = 0, -1.0
            for j in range(min(u, limit)):
                c = ranked[j]
                if j >= max_c and (best < floor or best >= threshold):
                    break
                if nc >= limit:
                    break
                seen = False
                for x in range(nc):
                    seen |= out_c[d, x] == c
                if seen:
                    continue
                jac, con = _similarity(fp, fstart[me], fend[me], fstart[c], fend[c])
                out_c[d, nc], out_j[d, nc], out_k[d, nc] = c, jac, con
                nc += 1
                best = max(best, jac)
                # a near miss, none accepted: the copies it stands in for
                if copies_on and max(floor, 2 * threshold - 1) <= jac < threshold and best < threshold:
                    node = chead[c]
                    while node >= 0:
                        if nc >= limit or best >= threshold:
                            break
                        m = member[node]
                        seen = False
                        for x in range(nc):
                            seen |= out_c[d, x] == m
                        if not seen and _earlier(order, m, me):
                            jm, cm = _similarity(fp, fstart[me], fend[me], fstart[m], fend[m])
                            out_c[d, nc], out_j[d, nc], out_k[d, nc] = m, jm, cm
                            nc += 1
                            best = max(best, jm)
                        node = nxt[node]
            out_n[d] = nc
            accepted, below_one = False, True
            for x in range(nc):
                accepted |= out_j[d, x] >= threshold
                below_one &= out_j[d, x] < 1.0
            for b in range(b0, b1):
                s = _slot(keys, used, bk[b])
                ok = (count[s] if used[s] else 0) < cap
                if ok and only_new_on and accepted:  # not a bucket holding a candidate it accepted
                    for i in range(total):
                        if owner[i] == b:
                            for x in range(nc):
                                if out_j[d, x] >= threshold and out_c[d, x] == members[i]:
                                    ok = False
                joined[b] = ok
            if copies_on and accepted and below_one:
                for x in range(nc):
                    c = out_c[d, x]
                    if threshold <= out_j[d, x] < 1.0 and ccount[c] < cap:
                        for i in range(total):
                            if members[i] == c:
                                copied[d, copied_n[d]] = c
                                copied_n[d] += 1
                                break
        for b in range(b0, b1):
            if joined[b]:
                n_nodes, n_used = _join(keys, used, head, tail, count, nxt, member, n_nodes, n_used, bk[b], me)
        for x in range(copied_n[d]):
            c = copied[d, x]
            n_nodes = _append(nxt, member, chead, ctail, n_nodes, c, me)
            ccount[c] += 1
    return n_nodes, n_used


def _offsets(arrays: list[np.ndarray]) -> np.ndarray:
    out = np.zeros(len(arrays) + 1, dtype=np.int64)
    np.cumsum([len(a) for a in arrays], out=out[1:])
    return out


def _grown(array: np.ndarray, size: int, fill: int = 0) -> np.ndarray:
    """``array`` with room for ``size`` entries (doubled until it has; new ones ``fill``)."""
    if size <= len(array):
        return array
    new = max(size, 2 * len(array))
    return np.concatenate((array, np.full(new - len(array), fill, dtype=array.dtype)))


class ArrayShardIndex:
    """One shard partition's buckets, copy buckets and member sets in arrays, its rules
    compiled (see the module docstring): ``ShardIndex.add``'s findings and joins, a band
    record at a time, with the Jaccard measure and without a retention window.

    Args:
        settings: the engine settings (threshold, caps, bucket joins).

    Raises:
        ValueError: the containment measure (``ShardIndex`` serves it).
    """

    def __init__(self, settings: EngineSettings) -> None:
        if settings.measure != "jaccard":
            raise ValueError("the array shard index serves the Jaccard measure only")
        s = self.settings = settings
        self._limit = s.max_candidates + s.extra_candidates
        self._copies_on = s.duplicate_buckets == "new"
        self.seqs: list[int] = []  # local id -> seq
        self.ids: list[str] = []  # local id -> document id
        self._nodes = self._used = 0
        size = 1 << 12
        self._keys = np.zeros(size, dtype=np.uint64)
        self._used_at = np.zeros(size, dtype=np.bool_)
        self._head = np.full(size, -1, dtype=np.int64)
        self._tail = np.full(size, -1, dtype=np.int64)
        self._count = np.zeros(size, dtype=np.int64)
        self._nxt = np.full(size, -1, dtype=np.int64)
        self._member = np.zeros(size, dtype=np.int64)
        self._chead = np.full(size, -1, dtype=np.int64)
        self._ctail = np.full(size, -1, dtype=np.int64)
        self._ccount = np.zeros(size, dtype=np.int64)
        self._order = np.zeros((size, 3), dtype=np.int64)
        self._fstart = np.zeros(size, dtype=np.int64)
        self._fend = np.zeros(size, dtype=np.int64)
        self._fp = np.zeros(size * 64, dtype=np.uint32)

    def add_batch(self, records: list[BandRecord]) -> list[tuple[Finding, Joins]]:
        """Meet, verify and join documents in order (``ShardIndex.add`` of each)."""
        if not records:
            return []
        n = len(records)
        boff = _offsets([r.buckets for r in records])
        foff = _offsets([r.fingerprints for r in records])
        bk = np.concatenate([r.buckets for r in records]).astype(np.uint64, copy=False)
        fps = np.concatenate([r.fingerprints for r in records]).astype(np.uint32, copy=False)
        seqs, (out_c, out_j, out_k, out_n, joined, copied, copied_n) = self.add_columns(
            b"".join(r.order for r in records), [r.id for r in records], boff, bk, foff, fps)
        # the common case, read in bulk: no candidate, every bucket joined, no copy bucket
        missed = np.zeros(n, dtype=np.int64)
        if len(bk):
            missed = np.add.reduceat(~joined, boff[:-1])
            missed[boff[:-1] == boff[1:]] = 0  # reduceat of an empty run reads the next entry
        plain = ((out_n == 0) & (missed == 0) & (copied_n == 0)).tolist()
        every = self.seqs
        out: list[tuple[Finding, Joins]] = []
        for d, seq in enumerate(seqs):
            if plain[d]:
                out.append((Finding(seq, ()), Joins(records[d].buckets, ())))
                continue
            m = int(out_n[d])
            checked = tuple(Checked(every[c], j, k, j) for c, j, k in zip(
                out_c[d, :m].tolist(), out_j[d, :m].tolist(), out_k[d, :m].tolist()))
            b0, b1 = boff[d], boff[d + 1]
            copies = tuple(every[c] for c in copied[d, :copied_n[d]].tolist())
            out.append((Finding(seq, checked), Joins(bk[b0:b1][joined[b0:b1]], copies)))
        return out

    def add_columns(self, orders: bytes, ids: list[str], boff: np.ndarray, bk: np.ndarray, foff: np.ndarray,
                    fps: np.ndarray) -> tuple[list[int], tuple[np.ndarray, ...]]:
        """``add_batch`` over columns (a band record's own layout): n documents' order
        keys (20 bytes each, joined), ids, bucket ids (uint64) and sets (uint32) by
        offsets (int64, n + 1).

        Returns:
            Their seqs, and per document: the candidates checked (local ids, int64,
            shape (n, limit)), their Jaccard and containment (float64, the same shape),
            how many (int64, (n,)); per bucket entry whether it joined (bool); the copy
            buckets joined (local ids, (n, limit)) and how many ((n,)).
        """
        n, first = len(ids), len(self.seqs)
        self._room(n, len(bk) + n * self._limit, len(fps))
        seqs = self._take(orders, ids)
        limit = self._limit
        out_c = np.zeros((n, limit), dtype=np.int64)
        out_j = np.zeros((n, limit))
        out_k = np.zeros((n, limit))
        out_n = np.zeros(n, dtype=np.int64)
        joined = np.zeros(len(bk), dtype=np.bool_)
        copied = np.zeros((n, limit), dtype=np.int64)
        copied_n = np.zeros(n, dtype=np.int64)
        s = self.settings
        self._nodes, self._used = _add_batch(
            self._keys, self._used_at, self._head, self._tail, self._count, self._nxt, self._member, self._chead,
            self._ctail, self._ccount, self._order, self._fp, self._fstart, self._fend, self._nodes, self._used,
            first, boff, bk, foff, fps, s.max_bucket_size, s.max_candidates, limit, s.floor, s.threshold,
            self._copies_on, s.duplicate_buckets == "new", out_c, out_j, out_k, out_n, joined, copied, copied_n)
        return seqs, (out_c, out_j, out_k, out_n, joined, copied, copied_n)

    def _take(self, orders: bytes, ids: list[str]) -> list[int]:
        """Local ids for documents of these order keys (20 bytes each, joined) and ids,
        in order; their seqs."""
        first = len(self.seqs)
        keys = np.frombuffer(orders, dtype=[("t", ">i8"), ("p", ">i4"), ("o", ">i8")])
        columns = [keys[c].astype(np.int64) for c in ("t", "p", "o")]
        for k, column in enumerate(columns):
            self._order[first:first + len(ids), k] = column
        seqs = [(t << 96) | (p << 64) | o for t, p, o in zip(*(c.tolist() for c in columns))]
        self.seqs += seqs
        self.ids += ids
        return seqs

    def _room(self, docs: int, nodes: int, fingerprints: int) -> None:
        """Grow the arrays for ``docs`` more documents, ``nodes`` more list nodes (at most
        that many new buckets) and ``fingerprints`` more set entries."""
        n = len(self.seqs) + docs
        for name, fill in (("_chead", -1), ("_ctail", -1), ("_ccount", 0), ("_fstart", 0), ("_fend", 0)):
            setattr(self, name, _grown(getattr(self, name), n, fill))
        if n > len(self._order):
            grown = np.zeros((max(n, 2 * len(self._order)), 3), dtype=np.int64)
            grown[:len(self._order)] = self._order
            self._order = grown
        need = self._nodes + nodes
        self._nxt, self._member = _grown(self._nxt, need, -1), _grown(self._member, need)
        used_f = int(self._fend[len(self.seqs) - 1]) if self.seqs else 0
        self._fp = _grown(self._fp, used_f + fingerprints)
        if 2 * (self._used + nodes) > len(self._keys):  # at most half full
            size = len(self._keys)
            while 2 * (self._used + nodes) > size:
                size *= 2
            keys, used = np.zeros(size, dtype=np.uint64), np.zeros(size, dtype=np.bool_)
            head, tail, count = np.full(size, -1, np.int64), np.full(size, -1, np.int64), np.zeros(size, np.int64)
            _rehash(self._keys, self._used_at, self._head, self._tail, self._count, keys, used, head, tail, count)
            self._keys, self._used_at, self._head, self._tail, self._count = keys, used, head, tail, count
