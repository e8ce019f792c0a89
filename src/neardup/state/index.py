"""The LSH bucket index in memory: which documents are in which band bucket.

Every document is filed under one 64-bit bucket id per band (``neardup.core.lsh.
bucket_ids``). The index holds those (bucket, seq) memberships as a few sorted runs, the
layout of a log-structured merge tree (O'Neil et al., "The log-structured merge-tree",
Acta Informatica 1996) kept in numpy arrays: each committed batch adds a small run, and
the newest run is merged into the one before it while that one is at most ``FANOUT``
times larger, so there are O(log n) runs and each membership is merged O(log n) times
(runs stop growing at ``MAX_RUN``). Each run has a directory indexed by the top bits of
the bucket id (ids are hashes, so about 2 to 4 members per entry): a lookup is one
directory probe and a short scan per bucket id and run, compiled, for a whole batch.

The store owns the index: it writes each batch's memberships to RocksDB in the batch's
atomic write, adds them to the index only after that write, and rebuilds the index from
those records when it opens. The index is therefore a cache of committed state, never
ahead of it. With a retention window, the memberships of expired documents are removed
in bulk (``drop_below``) when the store removes those documents.

Memory: 12 bytes per membership (uint64 bucket id, uint32 seq) and 1 to 2 for the
directories, plus up to twice ``MAX_RUN`` memberships for a moment while two runs merge.
At 1,000,000 documents of 21 bands (21 million memberships) that is about 280 MB.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
from neardup.core.aot import kernel

from neardup.state.errors import StateError

#: A run is merged into the previous one while that one is at most FANOUT times larger
#: and the merged run would hold at most MAX_RUN memberships (100 MB): bigger merges
#: would need twice their size in memory for a moment.
FANOUT = 4
MAX_RUN = 1 << 23
MAX_SEQ = np.iinfo(np.uint32).max


@dataclass(frozen=True)
class BucketMembers:
    """The members of a set of buckets (the answer to ``BucketIndex.lookup``).

    Attributes:
        counts: int64, shape (n_buckets,): members of each bucket asked for.
        owner: int64, shape (n_members,): index of the bucket (in the lookup's input) of
            each member, ascending.
        seqs: uint64, shape (n_members,): the members' seqs, ascending within a bucket.
    """

    counts: np.ndarray
    owner: np.ndarray
    seqs: np.ndarray


class _Run(NamedTuple):
    """A sorted run: bucket ids (uint64, ascending), their seqs (uint32), and a directory
    (uint32, shape (2**k + 1,)): the members whose bucket id has top k bits d are
    ``directory[d]:directory[d + 1]``, with ``shift`` = 64 - k."""

    buckets: np.ndarray
    seqs: np.ndarray
    directory: np.ndarray
    shift: np.uint64


def _run(buckets: np.ndarray, seqs: np.ndarray) -> _Run:
    """A run with its directory of about one entry per 2 to 4 members (bucket ids are
    hashes, so the members spread evenly over it)."""
    k = min(max(len(buckets).bit_length() - 2, 4), 32)
    shift = np.uint64(64 - k)
    return _Run(buckets, seqs, _directory(buckets, shift, 1 << k), shift)


@kernel("uint32[::1](uint64[::1], uint64, int64)")
def _directory(buckets: np.ndarray, shift: np.uint64, size: int) -> np.ndarray:  # pragma: no cover - compiled
    """uint32, shape (size + 1,): entry d is the first position whose bucket id has top
    bits d or more (one pass over the sorted run, no temporary of its length)."""
    directory = np.empty(size + 1, dtype=np.uint32)
    d = 0
    for i in range(len(buckets)):
        top = np.int64(buckets[i] >> shift)
        while d <= top:
            directory[d] = i
            d += 1
    while d <= size:
        directory[d] = len(buckets)
        d += 1
    return directory


class BucketIndex:
    """Sorted runs of (bucket id, seq) memberships; see the module docstring."""

    def __init__(self) -> None:
        self._runs: list[_Run] = []  # oldest first

    def __len__(self) -> int:
        return sum(len(run.buckets) for run in self._runs)

    @property
    def runs(self) -> int:
        return len(self._runs)

    @property
    def nbytes(self) -> int:
        """Bytes held by the runs and their directories."""
        return sum(r.buckets.nbytes + r.seqs.nbytes + r.directory.nbytes for r in self._runs)

    def add(self, buckets: np.ndarray, seqs: np.ndarray) -> None:
        """File ``seqs[i]`` under bucket ``buckets[i]``.

        Args:
            buckets: uint64, shape (k,): bucket ids.
            seqs: uint64, shape (k,): seqs, all greater than every seq already indexed,
                ascending among equal bucket ids.

        Raises:
            StateError: a seq does not fit in 32 bits (more than 4,294,967,295 documents).
        """
        if len(buckets) == 0:
            return
        if int(seqs.max()) > MAX_SEQ:
            raise StateError(f"the bucket index holds seqs up to {MAX_SEQ:,}")
        order = np.argsort(buckets, kind="stable")
        self._runs.append(_run(np.asarray(buckets, dtype=np.uint64)[order], seqs[order].astype(np.uint32)))
        while len(self._runs) > 1:
            older, newer = len(self._runs[-2].buckets), len(self._runs[-1].buckets)
            if older > FANOUT * newer or older + newer > MAX_RUN:
                break
            newer_run = self._runs.pop()
            self._runs[-1] = _run(*_merge_runs(self._runs[-1].buckets, self._runs[-1].seqs,
                                               newer_run.buckets, newer_run.seqs))

    def drop_below(self, base: int) -> None:
        """Remove the memberships of the documents below ``base`` (expired), freeing their
        memory: a run wholly below goes at once, a run holding some is rewritten without
        them (runs keep their order, so they stay sorted)."""
        runs = []
        for run in self._runs:
            keep = run.seqs >= base
            if keep.all():
                runs.append(run)
            elif keep.any():
                runs.append(_run(run.buckets[keep], run.seqs[keep]))
        self._runs = runs

    def renumber(self, new_seqs: np.ndarray) -> None:
        """Give every membership of seq s the seq ``new_seqs[s]``, and drop those where it
        is negative (removed documents).

        Args:
            new_seqs: int64, shape (at least the highest seq + 1,): ascending where not
                negative (so the runs stay sorted), each below 2**32.
        """
        runs = []
        for run in self._runs:
            seqs = new_seqs[run.seqs]
            keep = seqs >= 0
            if keep.any():
                runs.append(_run(run.buckets[keep], seqs[keep].astype(np.uint32)))
        self._runs = runs

    def lookup(self, buckets: np.ndarray) -> BucketMembers:
        """Members of each bucket in ``buckets`` (uint64, shape (n,), distinct): one
        directory probe and a short scan per bucket and run.

        Raises:
            ValueError: ``buckets`` holds a bucket id twice.
        """
        buckets = np.asarray(buckets, dtype=np.uint64)
        if len(buckets) > 1 and not (buckets[1:] > buckets[:-1]).all():
            ordered = np.sort(buckets)
            if (ordered[1:] == ordered[:-1]).any():
                raise ValueError("a bucket id asked for twice")
        ranges = [_ranges(run.buckets, run.directory, run.shift, buckets) for run in self._runs]
        counts = np.zeros(len(buckets), dtype=np.int64)
        for _, found in ranges:
            counts += found
        fill = np.zeros(len(buckets), dtype=np.int64)  # where each bucket's members go next
        np.cumsum(counts[:-1], out=fill[1:])
        seqs = np.empty(int(counts.sum()), dtype=np.uint64)
        for (starts, found), run in zip(ranges, self._runs):  # oldest first
            _gather(run.seqs, starts, found, seqs, fill)
        owner = np.repeat(np.arange(len(buckets), dtype=np.int64), counts)
        return BucketMembers(counts, owner, seqs)


@kernel("UniTuple(int64[::1], 2)(uint64[::1], uint32[::1], uint64, uint64[::1])")
def _ranges(run: np.ndarray, directory: np.ndarray, shift: np.uint64,
            needles: np.ndarray) -> tuple[np.ndarray, np.ndarray]:  # pragma: no cover - compiled
    """Start and count of each needle's members in a run, through its directory."""
    starts = np.empty(len(needles), dtype=np.int64)
    counts = np.zeros(len(needles), dtype=np.int64)
    for i in range(len(needles)):
        x = needles[i]
        d = x >> shift
        j = np.int64(directory[d])
        end = np.int64(directory[d + 1])
        while j < end and run[j] < x:
            j += 1
        starts[i] = j
        while j < end and run[j] == x:
            j += 1
        counts[i] = j - starts[i]
    return starts, counts


@kernel("void(uint32[::1], int64[::1], int64[::1], uint64[::1], int64[::1])")
def _gather(run_seqs: np.ndarray, starts: np.ndarray, counts: np.ndarray, out: np.ndarray,
            fill: np.ndarray) -> None:  # pragma: no cover - compiled
    """Append each bucket's members of one run at ``fill`` (advanced)."""
    for k in range(len(starts)):
        at = fill[k]
        for j in range(counts[k]):
            out[at + j] = run_seqs[starts[k] + j]
        fill[k] = at + counts[k]


@kernel("Tuple((uint64[::1], uint32[::1]))(uint64[::1], uint32[::1], uint64[::1], uint32[::1])")
def _merge_runs(a_buckets: np.ndarray, a_seqs: np.ndarray, b_buckets: np.ndarray,
                b_seqs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:  # pragma: no cover - compiled
    n = len(a_buckets) + len(b_buckets)
    buckets = np.empty(n, dtype=np.uint64)
    seqs = np.empty(n, dtype=np.uint32)
    i = j = 0
    for k in range(n):
        if j == len(b_buckets) or (i < len(a_buckets) and a_buckets[i] <= b_buckets[j]):
            buckets[k], seqs[k] = a_buckets[i], a_seqs[i]
            i += 1
        else:
            buckets[k], seqs[k] = b_buckets[j], b_seqs[j]
            j += 1
    return buckets, seqs
