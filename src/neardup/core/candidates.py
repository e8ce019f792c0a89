"""Candidates of a batch from its LSH buckets, document by document (compiled with numba).

A document's candidates are the documents sharing at least one band bucket with it
(Leskovec, Rajaraman, Ullman, Mining of Massive Datasets, §3.4.1): the bucket's stored
members and the documents of the same batch that joined the bucket before it. A bucket
takes new members only while it holds fewer than ``max_bucket_size`` (a cap against the
buckets of boilerplate that every document shares); a document that finds a bucket full
is still compared with its members. When more than ``max_candidates`` documents qualify,
those sharing the most buckets are kept, earlier ones first among equals. With
bucket weights (containment), a shared bucket counts more the fewer documents it holds
(``bucket_weights``): a rare slot value is better evidence than the slot of a common
shingle that hundreds of unrelated documents share.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from neardup.core.aot import kernel


class Candidates(NamedTuple):
    """The candidates of a batch and the bucket memberships it adds.

    Attributes:
        bounds: int64, shape (n + 1,): document i's candidates are
            ``seqs[bounds[i]:bounds[i + 1]]``.
        seqs: uint64, shape (n_pairs,): candidate seqs, ascending per document.
        joined: bool, shape (n * bands,): which (document, band) entries join their bucket.
    """

    bounds: np.ndarray
    seqs: np.ndarray
    joined: np.ndarray


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # multiplicative hashing (Knuth, TAOCP vol. 3, §6.4)


#: The weight of a shared bucket holding no other document (``bucket_weights``).
MAX_WEIGHT = 9


def bucket_weights(member_counts: np.ndarray, entry_bucket: np.ndarray) -> np.ndarray:
    """How much each bucket counts in the ranking of candidates: ``MAX_WEIGHT -
    floor(log2(m + 1))``, at least 1, where m is its stored members plus the batch's
    entries in it (an inverse document frequency in whole steps, Sparck Jones 1972: a
    bucket of one document weighs 8, one of 255 or more weighs 1). The batch's entries
    are counted whether they join or not, so a bucket weighs the same for every
    document of the batch, and for the first pass that reads the candidates' sets.

    Args:
        member_counts: int64, shape (n_buckets,): stored members per bucket.
        entry_bucket: int64, shape (n * bands,): the batch's bucket per entry.

    Returns:
        int64, shape (n_buckets,).
    """
    m = np.asarray(member_counts, dtype=np.int64) + np.bincount(
        np.asarray(entry_bucket, dtype=np.int64), minlength=len(member_counts))[:len(member_counts)]
    return np.maximum(MAX_WEIGHT - np.floor(np.log2(m + 1.0)).astype(np.int64), 1)


@kernel
def _count(table_keys: np.ndarray, table_counts: np.ndarray, used: np.ndarray, u: int,
           shift: np.uint64, x: np.uint64, w: int) -> int:  # pragma: no cover - compiled
    """Add ``w`` to the count of ``x`` in an open-addressing table (linear probing);
    returns the number of distinct keys, ``used`` listing their slots."""
    mask = len(table_keys) - 1
    h = np.int64((x * _GOLDEN) >> shift)
    while table_counts[h] != 0 and table_keys[h] != x:
        h = (h + 1) & mask
    if table_counts[h] == 0:
        table_keys[h] = x
        used[u] = h
        u += 1
    table_counts[h] += w
    return u


@kernel
def _table(bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # pragma: no cover - compiled
    """An empty counting table of 2**bits slots: keys, counts, used slots."""
    return (np.empty(1 << bits, dtype=np.uint64), np.zeros(1 << bits, dtype=np.int64),
            np.empty(1 << bits, dtype=np.int64))


@kernel
def _meet(d: int, entry_bucket: np.ndarray, bands: int, member_starts: np.ndarray,
          member_counts: np.ndarray, member_seqs: np.ndarray, head: np.ndarray,
          below: np.ndarray, first_seq: int, table_keys: np.ndarray, table_counts: np.ndarray,
          used: np.ndarray, shift: np.uint64, windowed: bool, member_until: np.ndarray,
          batch_until: np.ndarray, weights: np.ndarray) -> int:  # pragma: no cover - compiled
    """Count the members of document ``d``'s buckets in the table: the stored ones, and
    the batch's entries that joined (``head``/``below`` chains); when ``windowed``, only
    those held for ``d`` (``until`` above ``d``, ``neardup.core.retention``). Each bucket
    counts 1, or its entry of ``weights`` if any (``bucket_weights``). Returns the number of distinct members, whose slots are ``used[:u]``."""
    u = 0
    for e in range(d * bands, (d + 1) * bands):
        k = entry_bucket[e]
        w = weights[k] if len(weights) else 1
        for j in range(member_starts[k], member_starts[k] + member_counts[k]):
            if windowed and member_until[j] <= d:
                continue
            u = _count(table_keys, table_counts, used, u, shift, member_seqs[j], w)
        x = head[k]
        while x >= 0:
            if not (windowed and batch_until[x // bands] <= d):
                u = _count(table_keys, table_counts, used, u, shift, np.uint64(first_seq + x // bands), w)
            x = below[x]
    return u


@kernel
def _top(table_keys: np.ndarray, table_counts: np.ndarray, used: np.ndarray, u: int,
         bands: int, limit: int) -> np.ndarray:  # pragma: no cover - compiled
    """The ``limit`` members with the highest counts, in that order (earliest first
    among equals), as seqs; empties the table's used slots."""
    # highest count first, then earliest: one sort of (MAX_WEIGHT * bands - count, seq) keys
    keys = np.empty(u, dtype=np.uint64)
    for i in range(u):
        h = used[i]
        keys[i] = (np.uint64(MAX_WEIGHT * bands - table_counts[h]) << np.uint64(32)) | table_keys[h]
        table_counts[h] = 0
    keys.sort()
    return keys[:limit] & np.uint64(0xFFFFFFFF)


@kernel
def _choose(d: int, entry_bucket: np.ndarray, bands: int, member_starts: np.ndarray,
            member_counts: np.ndarray, member_seqs: np.ndarray, head: np.ndarray,
            below: np.ndarray, taken: np.ndarray, first_seq: int, limit: int,
            bits: int, table_keys: np.ndarray, table_counts: np.ndarray,
            used: np.ndarray, windowed: bool, member_until: np.ndarray,
            batch_until: np.ndarray, weights: np.ndarray):  # pragma: no cover - compiled
    """Document ``d``'s ``limit`` best candidates, most shared buckets first (``_meet``
    then ``_top``), with the counting table of 2**bits slots, grown first if the members
    met (with repeats) would fill more than half of it. Returns (candidates, bits, the
    table's arrays)."""
    met = 0
    for e in range(d * bands, (d + 1) * bands):
        met += member_counts[entry_bucket[e]] + taken[entry_bucket[e]]
    if 2 * met > (1 << bits):
        while 2 * met > (1 << bits):
            bits += 1
        table_keys, table_counts, used = _table(bits)
    u = _meet(d, entry_bucket, bands, member_starts, member_counts, member_seqs, head, below,
              first_seq, table_keys, table_counts, used, np.uint64(64 - bits), windowed,
              member_until, batch_until, weights)
    chosen = _top(table_keys, table_counts, used, u, bands, limit)
    return chosen, bits, table_keys, table_counts, used


@kernel
def _join(e: int, k: int, head: np.ndarray, below: np.ndarray, taken: np.ndarray,
          joined: np.ndarray) -> None:  # pragma: no cover - compiled
    """Entry ``e`` joins bucket ``k``: pushed on its chain of the batch's members."""
    below[e] = head[k]
    head[k] = e
    taken[k] += 1
    joined[e] = True


@kernel(
    "Tuple((int64[::1], uint64[::1], boolean[::1]))"
    "(int64[::1], int64, int64[::1], int64[::1], uint64[::1], int64[::1], int64, "
    "int64, boolean, int64[::1], int64[::1], int64[::1])")
def _candidates(entry_bucket: np.ndarray, bands: int, member_starts: np.ndarray,
                member_counts: np.ndarray, member_seqs: np.ndarray, room: np.ndarray,
                first_seq: int, max_candidates: int, windowed: bool, member_until: np.ndarray,
                batch_until: np.ndarray, weights: np.ndarray):  # pragma: no cover - compiled
    n = len(entry_bucket) // bands
    head = np.full(len(member_starts), -1, dtype=np.int64)  # last entry that joined a bucket
    below = np.full(len(entry_bucket), -1, dtype=np.int64)  # the entry that joined before it
    taken = np.zeros(len(member_starts), dtype=np.int64)
    joined = np.zeros(len(entry_bucket), dtype=np.bool_)
    bounds = np.zeros(n + 1, dtype=np.int64)
    out = np.empty(n * max_candidates, dtype=np.uint64)
    bits = np.int64(10)  # not the literal 10: numba would compile the callees for it too
    table_keys, table_counts, used = _table(bits)
    filled = np.int64(0)  # (the same: a literal 0 is compiled for apart)
    for d in range(n):
        chosen, bits, table_keys, table_counts, used = _choose(
            d, entry_bucket, bands, member_starts, member_counts, member_seqs, head, below, taken,
            first_seq, max_candidates, bits, table_keys, table_counts, used, windowed, member_until,
            batch_until, weights)
        out[filled : filled + len(chosen)] = np.sort(chosen)
        filled += len(chosen)
        bounds[d + 1] = filled
        for e in range(d * bands, (d + 1) * bands):
            if taken[entry_bucket[e]] < room[entry_bucket[e]]:
                _join(e, entry_bucket[e], head, below, taken, joined)
    return bounds, out[:filled].copy(), joined


def batch_candidates(entry_bucket: np.ndarray, bands: int, member_starts: np.ndarray,
                     member_counts: np.ndarray, member_seqs: np.ndarray, max_bucket_size: int,
                     first_seq: int, max_candidates: int,
                     window: Window | None = None,
                     weights: np.ndarray | None = None) -> Candidates:
    """Candidates of documents ``first_seq``, ``first_seq + 1``, … in arrival order.

    Args:
        entry_bucket: int64, shape (n * bands,): for document i's band b, the index of its
            bucket (0 … n_buckets - 1) in the member arrays (document-major).
        bands: bands per document.
        member_starts, member_counts: int64, shape (n_buckets,): each bucket's stored
            members are ``member_seqs[start:start + count]``.
        member_seqs: uint64: the stored members' seqs (all below ``first_seq``).
        max_bucket_size: a bucket takes new members while it holds fewer.
        first_seq: the seq of the batch's first document.
        max_candidates: the most candidates kept per document (at least 1).
        window: which members each document may meet (a retention window); None: all.
        weights: int64, shape (n_buckets,): rank by the sum of the shared buckets'
            weights (``bucket_weights``) instead of their number; None: unweighted.

    Returns:
        ``Candidates``.

    Raises:
        ValueError: ``entry_bucket`` is not a whole number of documents, or
            ``max_candidates`` is below 1.
    """
    return Candidates(*_candidates(*checked_members(entry_bucket, bands, member_starts, member_counts,
                                                    member_seqs, max_bucket_size, max_candidates),
                                   first_seq, max_candidates, *window_arrays(window, member_seqs,
                                                                             len(entry_bucket) // max(bands, 1)),
                                   _weights(weights)))


def _weights(weights: np.ndarray | None) -> np.ndarray:
    """``weights`` as the compiled loops take them (empty: unweighted)."""
    return np.zeros(0, np.int64) if weights is None else np.asarray(weights, dtype=np.int64)


class Window(NamedTuple):
    """Which members each document of a batch may meet (``neardup.core.retention``).

    Attributes:
        member_until: int64, shape (n_members,): for each stored member (aligned with
            ``member_seqs``), the first document of the batch it is no longer held for.
        batch_until: int64, shape (n,): the same for each document of the batch.
    """

    member_until: np.ndarray
    batch_until: np.ndarray


def window_arrays(window: Window | None, member_seqs: np.ndarray,
                  n: int) -> tuple[bool, np.ndarray, np.ndarray]:
    """(windowed, member_until int64, batch_until int64) as the compiled loops take them.

    Raises:
        ValueError: the arrays do not match the members or the batch.
    """
    if window is None:
        return False, np.zeros(0, np.int64), np.zeros(0, np.int64)
    if len(window.member_until) != len(member_seqs) or len(window.batch_until) != n:
        raise ValueError("the window's arrays do not match the members or the batch")
    return (True, np.asarray(window.member_until, dtype=np.int64),
            np.asarray(window.batch_until, dtype=np.int64))


def checked_members(entry_bucket: np.ndarray, bands: int, member_starts: np.ndarray,
                    member_counts: np.ndarray, member_seqs: np.ndarray, max_bucket_size: int,
                    max_candidates: int, extra_candidates: int = 0,
                    ) -> tuple[np.ndarray, int, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The arguments of ``batch_candidates`` checked and as the compiled loops take them:
    (entry_bucket int64, bands, member_starts int64, member_counts int64, member_seqs
    uint64, room int64: new members each bucket takes).

    Raises:
        ValueError: ``entry_bucket`` is not a whole number of documents,
            ``max_candidates`` is below 1 or ``extra_candidates`` below 0.
    """
    entry_bucket = np.asarray(entry_bucket, dtype=np.int64)
    if bands < 1 or len(entry_bucket) % bands:
        raise ValueError(f"{len(entry_bucket)} bucket entries for documents of {bands} bands")
    if max_candidates < 1:
        raise ValueError(f"max_candidates must be at least 1, not {max_candidates}")
    if extra_candidates < 0:
        raise ValueError(f"extra_candidates must be at least 0, not {extra_candidates}")
    member_counts = np.asarray(member_counts, dtype=np.int64)
    room = np.maximum(max_bucket_size - member_counts, 0)
    return (entry_bucket, bands, np.asarray(member_starts, dtype=np.int64), member_counts,
            np.asarray(member_seqs, dtype=np.uint64), room)
