"""One compiled pass over a batch, document by document: candidates, verification,
clustering, then the document's bucket joins.

Doing the four in turn for each document lets a document's bucket joins depend on its
verdict: with ``only_new`` a duplicate joins only the buckets that hold none of its
accepted candidates that are near copies of it (Jaccard at least the threshold; with a
containment measure, a short text contained in a long one does not stand in for it, so
the long one still joins those buckets). A story's copies then do not pile up in its buckets: a bucket keeps
the earliest version, and a later document that would have met a copy there meets that
version instead (its similarity to it is then verified in the copy's place). Buckets grow
with clusters, not with copies, so the members met, the candidates verified and the index
all stay small as a stream of republished stories grows.

Because the next document of the batch sees the joins of this one, the verdicts are those
of committing the documents one at a time: they do not depend on where batches start.

The stored candidates a document can get are known before the pass: its candidates among
stored members alone (``neardup.core.candidates``, no batch members) are a superset of
the stored ones it gets with the batch's members ranked in, since members of the batch
can only push stored ones out. The caller reads the sets of that superset (and of their
clusters' canonicals) before the pass.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from neardup.core.aot import kernel

from neardup.core.candidates import Window, _choose, _join, _table, _weights, checked_members, window_arrays
from neardup.core.cluster import JACCARD, Clustering, Sets, _cluster_one, _outputs, _pair


class Decisions(NamedTuple):
    """What the pass decided for a batch of n documents of ``bands`` bands.

    Attributes:
        bounds: int64, shape (n + 1,): document i's candidates are the pairs
            ``bounds[i]`` to ``bounds[i + 1]``.
        seqs: uint64, shape (n_pairs,): each pair's candidate seq, ascending per document.
        jaccard, containment: float64, shape (n_pairs,): of the document and the candidate
            (containment of the document in the candidate).
        joined: bool, shape (n * bands,): which (document, band) entries join their bucket.
        copy_docs, copy_buckets: int64, shape (n_copy_joins,): document ``copy_docs[i]``
            joins the copy bucket at index ``copy_buckets[i]`` of the member arrays
            (documents ascending).
        missing: bool, shape (n_local,): local ids whose sets the pass needed but was not
            given (``CopyBuckets.loaded``); when any is set the decisions are incomplete:
            read those sets and run the pass again on the forest as it was.
        clustering: the clustering decisions (``neardup.core.cluster.Clustering``).
    """

    bounds: np.ndarray
    seqs: np.ndarray
    jaccard: np.ndarray
    containment: np.ndarray
    joined: np.ndarray
    copy_docs: np.ndarray
    copy_buckets: np.ndarray
    missing: np.ndarray
    clustering: Clustering


class CopyBuckets(NamedTuple):
    """Copy buckets, with ``only_new`` and the Jaccard measure: the bucket of a document X
    holds the duplicates that X stands in for, those that accepted X (at a Jaccard below
    1) and did not join a bucket X holds. A document C that meets X there and finds it a
    near miss, none accepted, verifies them next: C may be similar to such a copy B
    without being similar to X, and every bucket C shares with B is one X holds (B
    skipped it), so C meets X wherever it would have met B. One level is enough: a
    bucket is held by the accepted candidate that made the copy skip it.

    Attributes:
        bucket: int64, shape (n_local,): per local id, the index of its copy bucket in the
            member arrays, or -1 (no copy bucket looked up: not a possible candidate).
        loaded: bool, shape (n_local,): whether the local id's set is in ``sets``; the
            pass reports the copies it needed without a set in ``Decisions.missing``.
    """

    bucket: np.ndarray
    loaded: np.ndarray


@kernel
def _holds(k: int, c: int, member_starts: np.ndarray, member_counts: np.ndarray,
           member_seqs: np.ndarray, entry_bucket: np.ndarray, joined: np.ndarray, bands: int,
           first_seq: int) -> bool:  # pragma: no cover - compiled
    """Whether bucket ``k`` holds seq ``c``: among its stored members (ascending), or as a
    batch document that joined it."""
    if c < first_seq:
        lo, hi = member_starts[k], member_starts[k] + member_counts[k]
        at = lo + np.searchsorted(member_seqs[lo:hi], np.uint64(c))
        return at < hi and member_seqs[at] == np.uint64(c)
    d = c - first_seq
    for e in range(d * bands, (d + 1) * bands):
        if entry_bucket[e] == k and joined[e]:
            return True
    return False


@kernel
def _mark_covered(d: int, lo: int, hi: int, seqs: np.ndarray, similarity: np.ndarray,
                  threshold: float, member_starts: np.ndarray, member_counts: np.ndarray,
                  member_seqs: np.ndarray, entry_bucket: np.ndarray, joined: np.ndarray, bands: int,
                  first_seq: int, covered: np.ndarray) -> None:  # pragma: no cover - compiled
    """Set ``covered[k]`` to ``d + 1`` for each bucket ``k`` of document ``d`` that holds an
    accepted candidate among the pairs ``lo`` to ``hi`` (as ``_holds`` says, for every
    bucket at once): for a candidate of the batch, the buckets its entries joined, in one
    pass over them; for a stored one, each bucket of ``d`` that has it among its stored
    members. A bucket is then covered for ``d`` when its entry is ``d + 1`` (the array is
    never cleared)."""
    stamp = d + 1
    for j in range(lo, hi):
        if similarity[j] < threshold:
            continue
        c = np.int64(seqs[j])
        if c >= first_seq:
            cd = c - first_seq
            for e in range(cd * bands, (cd + 1) * bands):
                if joined[e]:
                    covered[entry_bucket[e]] = stamp
        else:  # among the stored members (ascending; most buckets hold a few)
            x = np.uint64(c)
            for e in range(d * bands, (d + 1) * bands):
                k = entry_bucket[e]
                if covered[k] == stamp:
                    continue
                for m in range(member_starts[k], member_starts[k] + member_counts[k]):
                    if member_seqs[m] >= x:
                        if member_seqs[m] == x:
                            covered[k] = stamp
                        break


@kernel
def _by_seq(lo: int, hi: int, seqs: np.ndarray, local: np.ndarray, jaccard: np.ndarray,
            containment: np.ndarray) -> None:  # pragma: no cover - compiled
    """Sort the pairs ``lo`` to ``hi`` by candidate seq, in place (insertion sort: a
    document has a few dozen pairs at most)."""
    for i in range(lo + 1, hi):
        s, y, j_, c_ = seqs[i], local[i], jaccard[i], containment[i]
        k = i - 1
        while k >= lo and seqs[k] > s:
            seqs[k + 1], local[k + 1], jaccard[k + 1], containment[k + 1] = (
                seqs[k], local[k], jaccard[k], containment[k])
            k -= 1
        seqs[k + 1], local[k + 1], jaccard[k + 1], containment[k + 1] = s, y, j_, c_


@kernel
def _has_room(k: int, d: int, bands: int, max_bucket_size: int, member_starts: np.ndarray,
              member_counts: np.ndarray, member_until: np.ndarray, head: np.ndarray,
              below: np.ndarray, batch_until: np.ndarray) -> bool:  # pragma: no cover - compiled
    """Whether bucket ``k`` holds fewer than ``max_bucket_size`` members held for document
    ``d`` (a retention window: expired members leave their bucket's room)."""
    held = 0
    for j in range(member_starts[k], member_starts[k] + member_counts[k]):
        held += member_until[j] > d
    x = head[k]
    while x >= 0:
        held += batch_until[x // bands] > d
        x = below[x]
    return held < max_bucket_size


@kernel
def _among(seqs: np.ndarray, lo: int, hi: int, c: np.uint64) -> bool:  # pragma: no cover - compiled
    """Whether seq ``c`` is among the pairs ``lo`` to ``hi`` already."""
    for j in range(lo, hi):
        if seqs[j] == c:
            return True
    return False


@kernel
def _copy_seqs(k: int, d: int, member_starts: np.ndarray, member_counts: np.ndarray,
               member_seqs: np.ndarray, head: np.ndarray, below: np.ndarray,
               copy_entry_doc: np.ndarray, nb: int, first_seq: int, windowed: bool,
               member_until: np.ndarray, batch_until: np.ndarray) -> np.ndarray:  # pragma: no cover - compiled
    """The seqs in copy bucket ``k`` held for document ``d``: its stored members, then the
    batch's documents that joined it (latest first)."""
    count = member_counts[k]
    x = head[k]
    while x >= 0:
        count += 1
        x = below[x]
    out = np.empty(count, dtype=np.uint64)
    m = 0
    for j in range(member_starts[k], member_starts[k] + member_counts[k]):
        if not (windowed and member_until[j] <= d):
            out[m] = member_seqs[j]
            m += 1
    x = head[k]
    while x >= 0:
        doc = copy_entry_doc[x - nb]
        if not (windowed and batch_until[doc] <= d):
            out[m] = np.uint64(first_seq + doc)
            m += 1
        x = below[x]
    return out[:m]


@kernel(
    "Tuple((int64[::1], uint64[::1], float64[::1], float64[::1], boolean[::1], int64[::1], "
    "int64[::1], boolean[::1], int64[::1], int64[::1], int64[::1], int64[::1], int64[::1]))"
    "(int64[::1], int64, int64[::1], int64[::1], uint64[::1], int64[::1], int64, "
    "int64, int64, float64, uint64[::1], int64[::1], int64[::1], int64[::1], "
    "float64, int64, int64, boolean, int64[::1], uint32[::1], int64[::1], boolean, "
    "int64[::1], int64[::1], int64[::1], int64, int64[::1], boolean[::1], "
    "int64[::1])")
def _decide(entry_bucket: np.ndarray, bands: int, member_starts: np.ndarray,
            member_counts: np.ndarray, member_seqs: np.ndarray, room: np.ndarray,
            first_seq: int, max_candidates: int, extra_candidates: int, near: float,
            stored_local: np.ndarray, parent: np.ndarray,
            size: np.ndarray, canonical: np.ndarray, threshold: float, policy: int,
            measure: int, only_new: bool, sizes: np.ndarray, values: np.ndarray,
            offsets: np.ndarray, windowed: bool,
            member_until: np.ndarray, batch_until: np.ndarray, local_until: np.ndarray,
            max_bucket_size: int, copy_bucket: np.ndarray,
            loaded: np.ndarray, weights: np.ndarray):  # pragma: no cover - compiled
    n = len(entry_bucket) // bands
    first = len(stored_local)
    limit = max_candidates + extra_candidates
    nb = len(entry_bucket)
    copies = measure == JACCARD and only_new and len(copy_bucket) > 0
    head = np.full(len(member_starts), -1, dtype=np.int64)
    below = np.full(nb + (n * limit if copies else 0), -1, dtype=np.int64)
    copy_entry_doc = np.empty(n * limit if copies else 0, dtype=np.int64)
    copy_joins = 0
    missing = np.zeros(len(loaded), dtype=np.bool_)
    taken = np.zeros(len(member_starts), dtype=np.int64)
    covered = np.zeros(len(member_starts), dtype=np.int64)  # d + 1: holds an accepted candidate of d
    joined = np.zeros(len(entry_bucket), dtype=np.bool_)
    bounds = np.zeros(n + 1, dtype=np.int64)
    seqs = np.empty(n * limit, dtype=np.uint64)
    local = np.empty(n * limit, dtype=np.int64)
    jaccard = np.empty(n * limit)
    containment = np.empty(n * limit)
    similarity = jaccard if measure == JACCARD else containment
    match, accepted, cluster, cluster_size, related = _outputs(n, first)
    seen = np.empty(limit, dtype=np.int64)
    bits = np.int64(10)  # not the literal 10: numba would compile the callees for it too
    table_keys, table_counts, used = _table(bits)
    filled = np.int64(0)  # (the same: a literal 0 is compiled for apart)
    for d in range(n):
        x = first + d
        chosen, bits, table_keys, table_counts, used = _choose(
            d, entry_bucket, bands, member_starts, member_counts, member_seqs, head, below, taken,
            first_seq, limit, bits, table_keys, table_counts, used, windowed, member_until,
            batch_until, weights)
        lo = filled
        best = -1.0
        expanded = False
        for j in range(len(chosen)):
            # past max_candidates, only after a near miss, and (Jaccard) while none is
            # accepted: an accepted copy stands in for its cluster, while a contained
            # text says nothing of the others a long text contains
            if j >= max_candidates and (best < near or (measure == JACCARD and best >= threshold)):
                break
            if filled - lo >= limit:
                break
            c = chosen[j]
            if expanded and _among(seqs, lo, filled, c):
                continue
            y = _local_id(c, first_seq, first, stored_local)
            seqs[filled], local[filled] = c, y
            jaccard[filled], containment[filled] = _pair(x, y, sizes, values, offsets, measure)
            best = max(best, similarity[filled])
            filled += 1
            # a near miss, none accepted: the copies it stands in for in its buckets. A copy
            # B accepted y (Jaccard at least the threshold t), so by the triangle inequality
            # of the Jaccard distance it can reach t only if this one is at least 2t - 1
            if (copies and max(near, 2.0 * threshold - 1.0) <= similarity[filled - 1] < threshold
                    and best < threshold and copy_bucket[y] >= 0):
                members = _copy_seqs(copy_bucket[y], d, member_starts, member_counts, member_seqs,
                                     head, below, copy_entry_doc, nb, first_seq, windowed,
                                     member_until, batch_until)
                for m in members:
                    if filled - lo >= limit or best >= threshold:
                        break
                    if _among(seqs, lo, filled, m):
                        continue
                    ym = _local_id(m, first_seq, first, stored_local)
                    if not loaded[ym]:  # its set was not read: the caller reads it, runs again
                        missing[ym] = True
                        continue
                    seqs[filled], local[filled] = m, ym
                    jaccard[filled], containment[filled] = _pair(x, ym, sizes, values, offsets, measure)
                    best = max(best, similarity[filled])
                    filled += 1
                    expanded = True
        _by_seq(lo, filled, seqs, local, jaccard, containment)
        bounds[d + 1] = filled
        _cluster_one(d, x, lo, filled, parent, size, canonical, local, similarity, threshold,
                     policy, measure, sizes, values, offsets, seen, match, accepted,
                     cluster, cluster_size, related, windowed, local_until)
        skip_covered = only_new and match[d] >= 0
        if skip_covered:
            _mark_covered(d, lo, filled, seqs, similarity, threshold, member_starts, member_counts,
                          member_seqs, entry_bucket, joined, bands, first_seq, covered)
        for e in range(d * bands, (d + 1) * bands):
            k = entry_bucket[e]
            if windowed and not taken[k] < room[k]:  # full, unless some members expired
                room_left = _has_room(k, d, bands, max_bucket_size, member_starts, member_counts,
                                      member_until, head, below, batch_until)
            else:
                room_left = taken[k] < room[k]
            if room_left and not (skip_covered and covered[k] == d + 1):
                _join(e, k, head, below, taken, joined)
        if copies and match[d] >= 0:
            copy_joins = _join_copies(d, lo, filled, local, seqs, jaccard, threshold, copy_bucket,
                                      entry_bucket, bands, member_starts, member_counts, member_seqs,
                                      joined, first_seq, head, below, taken, room, nb,
                                      copy_entry_doc, copy_joins)
    copy_docs = copy_entry_doc[:copy_joins].copy()
    copy_at = np.empty(copy_joins, dtype=np.int64)
    for x in range(nb, nb + copy_joins):  # the bucket each copy entry joined
        copy_at[x - nb] = -1
    for k in range(len(head)):
        x = head[k]
        while x >= nb:
            copy_at[x - nb] = k
            x = below[x]
    return (bounds, seqs[:filled].copy(), jaccard[:filled].copy(),
            containment[:filled].copy(), joined, copy_docs, copy_at, missing, match, accepted,
            cluster, cluster_size, related)


@kernel
def _local_id(c: np.uint64, first_seq: int, first: int, stored_local: np.ndarray) -> int:  # pragma: no cover - compiled
    """The local id of seq ``c``: a stored one's place in ``stored_local``, or ``first`` on
    for the batch's documents."""
    ci = np.int64(c)  # seqs < 2**32: no mixed signed/unsigned arithmetic below
    if ci < first_seq:
        return np.int64(np.searchsorted(stored_local, c))
    return first + ci - first_seq


@kernel
def _join_copies(d: int, lo: int, hi: int, local: np.ndarray, seqs: np.ndarray,
                 jaccard: np.ndarray, threshold: float, copy_bucket: np.ndarray,
                 entry_bucket: np.ndarray, bands: int, member_starts: np.ndarray,
                 member_counts: np.ndarray, member_seqs: np.ndarray, joined: np.ndarray,
                 first_seq: int, head: np.ndarray, below: np.ndarray, taken: np.ndarray,
                 room: np.ndarray, nb: int, copy_entry_doc: np.ndarray,
                 copy_joins: int) -> int:  # pragma: no cover - compiled
    """Duplicate ``d`` joins the copy bucket of each accepted candidate that is not an
    exact copy of it (Jaccard below 1) and holds one of its buckets, so that it stands in
    for ``d`` there; none when ``d`` has an exact copy among them, which stands in for it
    already. Returns the copy entries used so far."""
    for j in range(lo, hi):
        if jaccard[j] >= 1.0:
            return copy_joins
    for j in range(lo, hi):
        if not (threshold <= jaccard[j] < 1.0):
            continue
        k = copy_bucket[local[j]]
        if k < 0 or taken[k] >= room[k]:
            continue
        holds = False
        for e in range(d * bands, (d + 1) * bands):
            if _holds(entry_bucket[e], np.int64(seqs[j]), member_starts, member_counts,
                      member_seqs, entry_bucket, joined, bands, first_seq):
                holds = True
                break
        if holds:
            e = nb + copy_joins
            copy_entry_doc[copy_joins] = d
            below[e] = head[k]
            head[k] = e
            taken[k] += 1
            copy_joins += 1
    return copy_joins


def decide_batch(entry_bucket: np.ndarray, bands: int, member_starts: np.ndarray,
                 member_counts: np.ndarray, member_seqs: np.ndarray, max_bucket_size: int,
                 first_seq: int, max_candidates: int, stored_local: np.ndarray,
                 parent: np.ndarray, size: np.ndarray, canonical: np.ndarray, threshold: float,
                 policy: int, measure: int, only_new: bool, sets: Sets,
                 extra_candidates: int = 0, near: float = 1.0, window: Window | None = None,
                 local_until: np.ndarray | None = None, copies: CopyBuckets | None = None,
                 weights: np.ndarray | None = None) -> Decisions:
    """Candidates, verification, clustering and bucket joins of documents ``first_seq``,
    ``first_seq + 1``, … in arrival order (see the module docstring).

    Candidates as in ``neardup.core.candidates.batch_candidates`` (Leskovec, Rajaraman,
    Ullman, Mining of Massive Datasets, §3.4.1), similarities as in
    ``neardup.core.cluster.pair_similarities``, clustering as in
    ``neardup.core.cluster.cluster_batch``.

    Args:
        entry_bucket: int64, shape (n * bands,): for document i's band b, the index of its
            bucket in the member arrays (document-major).
        bands: bands per document.
        member_starts, member_counts: int64, shape (n_buckets,): each bucket's stored
            members are ``member_seqs[start:start + count]``.
        member_seqs: uint64: the stored members' seqs, ascending within a bucket.
        max_bucket_size: a bucket takes new members while it holds fewer.
        first_seq: the seq of the batch's first document.
        max_candidates: candidates verified per document (at least 1), those sharing the
            most buckets first (the earliest among equals).
        stored_local: uint64, shape (first,): the stored seqs with local ids 0 … first - 1,
            ascending; every stored candidate must be among them. The batch's documents
            are local ids ``first`` on.
        parent, size, canonical: int64: the union-find forest over the local ids
            (``neardup.core.unionfind``), changed in place.
        threshold: a pair is accepted when its similarity is at least this.
        policy: ``neardup.core.cluster.COMPONENTS`` or ``CANONICAL``.
        measure: ``neardup.core.cluster.JACCARD`` or a containment (``MEASURES``).
        only_new: a duplicate joins only the buckets that hold none of its accepted
            candidates; False: every bucket with room.
        sets: the sets by local id: of the batch's documents, the possible stored
            candidates and the canonicals of their clusters.
        extra_candidates: candidates verified beyond ``max_candidates``, in the same
            order, one by one once the most similar so far is at least ``near`` (a near
            miss: the true match may be further down the list), and with ``JACCARD``
            only while none is accepted.
        near: the similarity that keeps the verification going past ``max_candidates``.
        window: a retention window: which members each document may meet
            (``neardup.core.candidates.Window``); a bucket's room then counts the members
            held for the document only. None: every member.
        local_until: int64, shape (n_local,), with ``window``: for each local id, the
            first document of the batch it is no longer held for; a cluster whose
            canonical has expired is judged by its held members (``neardup.core.cluster``).
        copies: the copy buckets (``CopyBuckets``, their members in the member arrays
            after the band buckets), used with ``only_new`` and ``JACCARD``; None: none.
            A copy bucket takes members while it holds fewer than ``max_bucket_size``
            (a retention window's expired members included).
        weights: int64, one per bucket of the member arrays: rank the candidates by the
            sum of their shared buckets' weights (``neardup.core.candidates.bucket_weights``,
            as ``batch_candidates``); None: by the number of shared buckets.

    Returns:
        ``Decisions``.

    Raises:
        ValueError: ``entry_bucket`` is not a whole number of documents, or
            ``max_candidates`` is below 1 or ``extra_candidates`` below 0.
    """
    n = len(entry_bucket) // max(bands, 1)
    windowed, member_until, batch_until = window_arrays(window, member_seqs, n)
    if windowed:
        if local_until is None or len(local_until) != len(parent):
            raise ValueError("a window needs local_until, one entry per local id")
        local_until = np.asarray(local_until, dtype=np.int64)
    else:
        local_until = np.zeros(0, np.int64)
    out = _decide(*checked_members(entry_bucket, bands, member_starts, member_counts, member_seqs,
                                   max_bucket_size, max_candidates, extra_candidates),
                  first_seq, max_candidates, extra_candidates, float(near),
                  np.asarray(stored_local, dtype=np.uint64), parent, size,
                  canonical, float(threshold), policy, measure, bool(only_new), sets.sizes,
                  sets.values, sets.offsets, windowed, member_until, batch_until,
                  local_until, int(max_bucket_size),
                  *((np.zeros(0, np.int64), np.ones(len(parent), np.bool_)) if copies is None else
                    (np.asarray(copies.bucket, dtype=np.int64), np.asarray(copies.loaded, dtype=np.bool_))),
                  _weights(weights))
    return Decisions(*out[:8], Clustering(*out[8:]))
