"""One shard partition's buckets: the earlier members a document meets there, their exact
verification, and the document's bucket joins, for the buckets this partition owns alone.

The rules are the single process's (``neardup.core.candidates``, ``neardup.core.decide``)
applied to the shard's buckets: members met are ranked by the buckets they share with the
document *on this shard*, earlier first among equals; the first ``max_candidates`` are
verified, then up to ``extra_candidates`` more one at a time while the best so far is a
near miss (and, for Jaccard, none is accepted); a bucket takes new members while it holds
fewer than ``max_bucket_size``; with ``duplicate_buckets="new"`` a document skips the
buckets holding a candidate it accepted, and joins instead the copy bucket of each
accepted candidate (Jaccard below 1) that holds one of them here, where a later near miss
of that candidate finds it. Every candidate met here joined a bucket here, so the shard
holds its shingle set and verifies it exactly without asking anyone: a document's set is
kept on every shard where it joins a bucket.

``ShardIndex`` keeps all of it in memory (the model, ``neardup.sharded.reference``, and the
shard stage without a state directory); ``StoredShardIndex`` keeps it in a RocksDB store
per shard partition.

A retention window (``retention_ms``) is one process's (``neardup.core.retention``) with a
document's time read from its order key (``order_time``, ms; a seq's high bits): the shard's
*mark* is the latest document time it has processed, its own included, and a member is a
candidate, counts towards its bucket's room and stands in a copy bucket only while its time
is at least the mark minus the window. Shards process documents in order-key order, so the
mark at a document is its own time, as one process's watermark is on the same records in
that order. A time later than now plus ``future_tolerance_s`` does not move the mark beyond
now (one process takes it as now; here the member keeps its stamp, so it stays a candidate
until the mark passes that stamp). The mark only grows, so a member that has expired never
comes back: ``expired`` hands them out in bulk, once the window's floor has moved by an
eighth of the window, and ``remove`` drops them (``neardup.state.expiry``'s schedule, by
time).
"""

from __future__ import annotations

import heapq
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from typing import TYPE_CHECKING

import numpy as np

from neardup.core.arrays import read_only
from neardup.core.overlap import intersection_size
from neardup.core.settings import EngineSettings
from neardup.core.retention import NO_TIME
from neardup.sharded.records import BandRecord, order_seq, seq_order

if TYPE_CHECKING:
    from neardup.state.shard_store import ShardStore


@dataclass(slots=True)  # not frozen: made per document, and a frozen one takes 3.6 times as long
class Checked:
    """One verified candidate: its seq and its exact similarities to the document
    (``containment``: of the document in the candidate; ``similarity``: the measure's)."""

    seq: int
    jaccard: float
    containment: float
    similarity: float


@dataclass(slots=True)  # not frozen: made per document, and a frozen one takes 3.6 times as long
class Finding:
    """What one shard partition found for one document.

    Attributes:
        seq: the document's seq (its place in the order key's order).
        checked: the verified candidates, in verification order.
    """

    seq: int
    checked: tuple[Checked, ...]


@dataclass(slots=True)  # not frozen: made per document, and a frozen one takes 3.6 times as long
class Joins:
    """What one document added to a shard: the buckets it joined (uint64 ids), the
    candidates whose copy bucket it joined (seqs); its set is kept when either is not
    empty. ``ShardIndex.apply`` adds them again (a restore)."""

    buckets: np.ndarray
    copies: tuple[int, ...]

    @property
    def empty(self) -> bool:
        return not len(self.buckets) and not self.copies


def similarities(a: np.ndarray, b: np.ndarray, measure: str, direction: str) -> tuple[float, float, float]:
    """(Jaccard, containment of ``a`` in ``b``, the measure's similarity) of two sets.

    Args:
        a, b: uint32, sorted distinct fingerprints (``neardup.core.overlap``): ``a`` the
            new document's, ``b`` the earlier one's.
        measure: ``"jaccard"`` or ``"containment"``.
        direction: the containment direction (``EngineSettings.containment_direction``).
    """
    inter = intersection_size(read_only(a), read_only(b))
    union = len(a) + len(b) - inter
    jaccard = inter / union if union else 0.0
    containment = inter / len(a) if len(a) else 0.0
    if measure == "jaccard":
        return jaccard, containment, jaccard
    if direction == "new-in-earlier":
        return jaccard, containment, containment
    if direction == "earlier-in-new":
        return jaccard, containment, inter / len(b) if len(b) else 0.0
    return jaccard, containment, inter / min(len(a), len(b)) if len(a) and len(b) else 0.0


#: Removal of expired members waits until the window's floor has moved this share of it.
STEP_SHARE = 8


def seq_time(seq: int) -> int:
    """The record time (ms) of an order seq (``neardup.sharded.records.order_seq``)."""
    return seq >> 96


def window_time(seq: int, future_tolerance_s: float) -> tuple[int, bool]:
    """Document ``seq``'s time (ms) for the retention window, and whether it lay beyond
    now plus ``future_tolerance_s`` (seconds) and was taken as now (as one process takes
    it: ``neardup.core.retention``)."""
    t = seq_time(seq)
    now = time.time() * 1000
    if t > now + 1000 * future_tolerance_s:
        return int(round(now)), True
    return t, False


class ShardIndex:
    """The buckets one shard partition owns and the sets of their members (in memory).

    Args:
        settings: the engine settings (threshold, measure, caps, bucket joins, future
            tolerance).
        retention_ms: the retention window, ms (see the module docstring); None keeps
            every member.

    Raises:
        ValueError: a window below 1 ms.
    """

    def __init__(self, settings: EngineSettings, retention_ms: int | None = None) -> None:
        if retention_ms is not None and retention_ms < 1:
            raise ValueError(f"a retention window of {retention_ms} ms keeps nothing")
        self.settings = settings
        # bucket id -> its members' seqs in the order they joined: the seq itself while
        # it has one member (most buckets: no list object each), a list once it has more
        self.buckets: dict[int, int | list[int]] = {}
        self.sets: dict[int, np.ndarray] = {}
        self.copies: dict[int, list[int]] = {}
        self.ids: dict[int, str] = {}
        self.last = -1  # the highest seq added
        self._copies_on = settings.duplicate_buckets == "new" and settings.measure == "jaccard"
        self.retention_ms = retention_ms
        self.mark = NO_TIME  # the latest document time processed (ms), future ones taken as now
        self.future = 0  # documents whose time lay beyond now plus the future tolerance
        self._removed_below = NO_TIME  # the floor of the last removal
        self._joins: dict[int, Joins] = {}  # a member's joins (to remove it), with a window
        self._by_time: list[int] = []  # the members' seqs, a heap (with a window)

    # --- the retention window ----------------------------------------------------------
    def floor(self) -> int:
        """The earliest member time (ms) still held: the mark minus the window
        (``NO_TIME`` without a window or before any document)."""
        if self.retention_ms is None or self.mark == NO_TIME:
            return NO_TIME
        return self.mark - self.retention_ms

    def advance(self, seq: int) -> int:
        """Move the mark to document ``seq``'s time (ms; taken as now when it lies beyond
        now plus the future tolerance); returns the floor for that document."""
        if self.retention_ms is None:
            t = seq_time(seq)
            if t > self.mark:
                self.mark = t
            return NO_TIME
        t, future = window_time(seq, self.settings.future_tolerance_s)
        self.future += future
        self.mark = max(self.mark, t)
        return self.floor()

    def expired(self) -> list[int]:
        """The members (seqs, ascending) that have expired, once removing them is due
        (the floor moved by an eighth of the window since the last removal); [] otherwise."""
        floor = self.floor()
        if self.retention_ms is None or floor == NO_TIME \
                or floor - self._removed_below < max(1, self.retention_ms // STEP_SHARE):
            return []
        self._removed_below = floor
        return self._expired_below(floor)

    def _expired_below(self, floor: int) -> list[int]:
        out = []
        while self._by_time and seq_time(self._by_time[0]) < floor:
            out.append(heapq.heappop(self._by_time))
        return out

    def remove(self, seqs: list[int]) -> None:
        """Drop expired members from the buckets, copy buckets, sets and ids."""
        gone = set(seqs)
        touched: set[int] = set()
        copied: set[int] = set()
        for seq in seqs:
            joins = self._joins.pop(seq, None)
            if joins is not None:
                touched.update(joins.buckets.tolist())
                copied.update(joins.copies)
            self.copies.pop(seq, None)
            self.sets.pop(seq, None)
            self.ids.pop(seq, None)
        for b in touched:
            kept = [m for m in self.bucket(b) if m not in gone]
            if len(kept) > 1:
                self.buckets[b] = kept
            elif kept:
                self.buckets[b] = kept[0]
            else:
                self.buckets.pop(b, None)
        for c in copied:
            if c in self.copies:
                kept = [m for m in self.copies[c] if m not in gone]
                if kept:
                    self.copies[c] = kept
                else:
                    del self.copies[c]

    def add(self, seq: int, buckets: np.ndarray, fingerprints: np.ndarray, doc_id: str = "") -> tuple[Finding, Joins]:
        """Meet, verify and join: one document, after every earlier one.

        Only members that come before it (a lower seq) are candidates: one the reorder
        window let through late meets none of the later documents already added, so a
        document never waits for the decision of a later one (which may wait for it).

        Args:
            seq: the document's seq, above every seq added before (below some of them
                only for a record processed late).
            buckets: uint64, shape (k,): its bucket ids in the bands this shard owns.
            fingerprints: uint32, sorted distinct: its shingle set.
            doc_id: its external id (kept with its set, ``ids``).

        Returns:
            The shard's ``Finding`` for the document, and what it joined.
        """
        s = self.settings
        bucket_ids = buckets.tolist()
        floor = self.advance(seq)
        if self._none_held(bucket_ids):
            lists: list[Sequence[int]] = []
        else:
            lists = self._members(bucket_ids)
            if floor != NO_TIME:  # a retention window: only the members held are met
                lowest = floor << 96  # the first seq of the floor's millisecond
                lists = [[m for m in members if m >= lowest] for members in lists]
        if not any(lists) and s.max_bucket_size > 0:  # meets no one here (most do): joins every bucket
            joins = Joins(buckets, ())
            if bucket_ids:
                self._join(seq, doc_id, bucket_ids, joins, fingerprints)
            elif seq > self.last:
                self.last = seq
            return Finding(seq, ()), joins
        shared = Counter(chain.from_iterable(lists))  # member -> buckets it shares here (one call)
        if seq < self.last:  # processed late: the later members are no candidates
            shared = Counter({m: n for m, n in shared.items() if m < seq})
        elif seq > self.last:
            self.last = seq
        # most documents that meet anyone here meet one member (a copy of a story)
        ranked = sorted(shared, key=lambda m: (-shared[m], m)) if len(shared) > 1 else list(shared)
        limit = s.max_candidates + s.extra_candidates
        copies = self._copies_on
        checked: dict[int, Checked] = {}
        best = -1.0
        for j, c in enumerate(ranked[:limit]):
            if j >= s.max_candidates and (best < s.floor
                                          or (s.measure == "jaccard" and best >= s.threshold)):
                break
            if len(checked) >= limit:
                break
            if c in checked:
                continue
            best = max(best, self._check(c, fingerprints, checked))
            # a near miss, none accepted: the copies it stands in for (neardup.core.decide)
            sim = checked[c].similarity
            if (copies and max(s.floor, 2 * s.threshold - 1) <= sim < s.threshold
                    and best < s.threshold):
                for m in self._copies(c):
                    if len(checked) >= limit or best >= s.threshold:
                        break
                    if m not in checked and m < seq and seq_time(m) >= floor:
                        best = max(best, self._check(m, fingerprints, checked))
        accepted = {c for c, x in checked.items() if x.similarity >= s.threshold}
        only_new = s.duplicate_buckets == "new" and accepted
        cap = s.max_bucket_size
        joined = [b for b, members in zip(bucket_ids, lists)
                  if len(members) < cap and not (only_new and not accepted.isdisjoint(members))]
        copied: list[int] = []
        if copies and accepted and all(x.jaccard < 1.0 for x in checked.values()):
            held = {m for members in lists for m in members}
            for c, x in checked.items():
                if s.threshold <= x.jaccard < 1.0 and c in held and len(self._copies(c)) < s.max_bucket_size:
                    copied.append(c)
        joins = Joins(np.array(joined, dtype=np.uint64), tuple(copied))
        if joined or copied:
            self._join(seq, doc_id, joined, joins, fingerprints)
        return Finding(seq, tuple(checked.values())), joins

    def add_alone(self, seq: int, bucket_ids: list[int], fingerprints: np.ndarray, doc_id: str = "") -> bool:
        """``add`` for a document that meets no one here (most do), without its objects:
        when the shard keeps no retention window and holds a member in none of
        ``bucket_ids`` (its bucket ids, distinct, at least one), the document joins every
        one of them, as ``add`` would have it do, and True is returned (its ``Finding`` has
        no candidate, its ``Joins`` are all its buckets and no copy bucket); otherwise
        nothing changes and False is returned (``add`` takes it).

        Args:
            seq, fingerprints, doc_id: as ``add``'s.
            bucket_ids: ``buckets.tolist()`` of ``add``.
        """
        if self.retention_ms is not None or self.settings.max_bucket_size <= 0 or not bucket_ids \
                or not self._none_held(bucket_ids):
            return False
        joined = dict.fromkeys(bucket_ids, seq)
        if len(joined) != len(bucket_ids):  # a bucket named twice: ``add`` lists the document twice
            return False
        t = seq >> 96  # ``advance`` without a window
        if t > self.mark:
            self.mark = t
        if seq > self.last:
            self.last = seq
        self.buckets.update(joined)
        self.sets[seq] = fingerprints
        self.ids[seq] = doc_id
        return True

    def apply(self, seq: int, doc_id: str, joins: Joins, fingerprints: np.ndarray) -> None:
        """Add what ``add`` added for a document (also to add it again: a restore, in the
        same order)."""
        self._join(seq, doc_id, joins.buckets.tolist(), joins, fingerprints)

    def _join(self, seq: int, doc_id: str, bucket_ids: list[int], joins: Joins, fingerprints: np.ndarray) -> None:
        if seq > self.last:
            self.last = seq
        buckets = self.buckets
        for b in bucket_ids:
            members = buckets.get(b)
            if members is None:
                buckets[b] = seq
            elif members.__class__ is int:
                buckets[b] = [members, seq]  # type: ignore[list-item]
            else:
                members.append(seq)  # type: ignore[union-attr]
        for c in joins.copies:
            self.copies.setdefault(c, []).append(seq)
        self.sets[seq] = fingerprints
        self.ids[seq] = doc_id
        if self.retention_ms is not None:
            self._joins[seq] = joins
            heapq.heappush(self._by_time, seq)

    # --- the storage: dicts here, a RocksDB store below them in ``StoredShardIndex`` -------
    def prefetch(self, bucket_ids: np.ndarray) -> None:
        """Read ahead the members of ``bucket_ids`` (uint64), for the documents about to be
        added; in memory, nothing to read."""

    def bucket(self, b: int) -> Sequence[int]:
        """The members (seqs) of bucket ``b`` in memory, in the order they joined."""
        members = self.buckets.get(b, ())
        return (members,) if members.__class__ is int else members  # type: ignore[return-value]

    def bucket_entries(self) -> int:
        """How many (bucket, member) entries the buckets in memory hold."""
        return sum(1 if m.__class__ is int else len(m) for m in self.buckets.values())  # type: ignore[arg-type]

    def _none_held(self, buckets: list[int]) -> bool:
        """Whether none of ``buckets`` holds a member (then ``_members`` is all empty)."""
        return self.buckets.keys().isdisjoint(buckets)

    def _members(self, buckets: list[int]) -> list[Sequence[int]]:
        """The members (seqs) of each bucket, in the order they joined."""
        get = self.buckets.get
        out: list[Sequence[int]] = []
        for b in buckets:
            members = get(b)
            out.append(() if members is None else (members,) if members.__class__ is int else members)  # type: ignore[arg-type]
        return out

    def _copies(self, seq: int) -> list[int]:
        """The members (seqs) of the copy bucket of ``seq``."""
        return self.copies.get(seq, [])

    def fingerprints(self, seq: int) -> np.ndarray:
        """uint32, sorted distinct: the shingle set of the member ``seq``."""
        return self.sets[seq]

    def id_of(self, seq: int) -> str:
        """The external id of the member ``seq``."""
        return self.ids[seq]

    def _check(self, c: int, fingerprints: np.ndarray, checked: dict[int, Checked]) -> float:
        s = self.settings
        jac, con, sim = similarities(fingerprints, self.fingerprints(c), s.measure, s.containment_direction)
        checked[c] = Checked(c, jac, con, sim)
        return sim


class StoredShardIndex(ShardIndex):
    """A ``ShardIndex`` whose committed members are in a RocksDB store
    (``neardup.state.shard_store.ShardStore``): the dicts of ``ShardIndex`` hold only the
    members of batches not yet committed (an overlay over the store), ``forget`` drops
    them once the store has them (or their batch failed).

    Expired members are found among the store's (``ShardStore.members_before``) and the
    overlay's; the store drops them when their changelog deletions are applied to it.

    Args:
        settings: the engine settings.
        store: the shard partition's store, restored up to the committed changelog.
        retention_ms: as ``ShardIndex``'s.
    """

    def __init__(self, settings: EngineSettings, store: ShardStore, retention_ms: int | None = None) -> None:
        super().__init__(settings, retention_ms)
        self.store = store
        last = store.last_member()
        self.last = -1 if last is None else order_seq(last)
        self._parsed: dict[int, BandRecord] = {}
        self._removing: set[int] = set()  # removed, the store not told yet (their batch uncommitted)
        self._fetched: dict[int, Sequence[int]] = {}  # bucket id -> its stored members' seqs (``prefetch``)

    def forget(self) -> None:
        """Drop the overlay (the members not in the store, the removals it has not had)
        and what was read from the store before it changed."""
        self.buckets, self.copies, self.sets, self.ids = {}, {}, {}, {}
        self._joins, self._by_time = {}, []
        self._parsed = {}
        self._removing = set()
        self._fetched = {}

    def _expired_below(self, floor: int) -> list[int]:
        stored = [order_seq(o) for o in self.store.members_before(floor)]
        return sorted((set(stored) | set(super()._expired_below(floor))) - self._removing)

    def remove(self, seqs: list[int]) -> None:
        super().remove(seqs)
        self._removing.update(seqs)
        for seq in seqs:
            self._parsed.pop(seq, None)

    def prefetch(self, bucket_ids: np.ndarray) -> None:
        """Look up the stored members of ``bucket_ids`` (uint64; repeats allowed) in one
        call (``ShardStore.held``, one compiled pass over the store's bucket index in
        memory): ``_members`` and ``_none_held`` answer from it until the store changes
        (``forget``)."""
        self._fetch(np.unique(bucket_ids).tolist())

    def _fetch(self, buckets: list[int]) -> None:
        """Look up in the store the members (seqs) of those of ``buckets`` not read yet."""
        fetched = self._fetched
        missing = [b for b in buckets if b not in fetched]
        if missing:
            held = self.store.held(missing)
            fetched.update(dict.fromkeys(missing, ()))
            for b, keys in held.items():
                fetched[b] = [order_seq(o) for o in keys]

    def _stored_members(self, buckets: list[int]) -> list[Sequence[int]]:
        """The stored members (seqs) of each bucket, from ``prefetch`` or else the store (a
        document processed late)."""
        self._fetch(buckets)
        return [self._fetched[b] for b in buckets]

    def _none_held(self, buckets: list[int]) -> bool:
        return self.buckets.keys().isdisjoint(buckets) and not any(self._stored_members(buckets))

    def _members(self, buckets: list[int]) -> list[Sequence[int]]:
        return [[*stored, *self.bucket(b)] if stored else self.bucket(b)
                for stored, b in zip(self._stored_members(buckets), buckets)]

    def _copies(self, seq: int) -> list[int]:
        return [order_seq(o) for o in self.store.copies(seq_order(seq))] + self.copies.get(seq, [])

    def _stored(self, seq: int) -> BandRecord:
        rec = self._parsed.get(seq)
        if rec is None:
            if len(self._parsed) > 10_000:  # a batch's candidates, about 2 kB each
                self._parsed = {}
            order = seq_order(seq)
            value = self.store.member(order)
            if value is None:
                raise KeyError(seq)
            rec = self._parsed[seq] = BandRecord.parse(order, value)
        return rec

    def fingerprints(self, seq: int) -> np.ndarray:
        return self.sets[seq] if seq in self.sets else self._stored(seq).fingerprints

    def id_of(self, seq: int) -> str:
        return self.ids[seq] if seq in self.ids else self._stored(seq).id
