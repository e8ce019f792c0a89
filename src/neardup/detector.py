"""The detector: a batch of documents in, one verdict per document out, in arrival order.

For each batch:

1. ``Preparer`` (state-free, possibly in another process): normalise, shingle and MinHash
   every text at once (numpy), cut the signatures into LSH band bucket ids.
2. The stored candidates each document can get: the members of its buckets in the
   store's bucket index (``neardup.state.index``), at most ``max_candidates`` +
   ``extra_candidates``, those sharing the most buckets first; then the union-find
   nodes they reach in the store's forest (``neardup.state.forest``) and the sets
   verification needs, read in multi-gets.
3. One compiled pass, document by document in arrival order (``neardup.core.decide``):
   its candidates (those stored members and the earlier documents of the batch in its
   buckets), their verification (the exact Jaccard or containment of the shingle
   fingerprint sets with ``verify="exact"``, the estimate from bottom-k samples of them
   with ``verify="estimate"``; a candidate is accepted when its similarity
   reaches the threshold), clustering on a local copy of the union-find nodes
   (``neardup.core.cluster``), and the buckets it joins: with ``duplicate_buckets="new"``
   a duplicate joins only those holding none of its accepted candidates.

Accepted pairs form clusters through union-find; a cluster's id is its earliest document
(the canonical). With the ``components`` policy every accepted pair is joined, so a chain
A~B, B~C puts A and C together however unlike they are. With the ``canonical`` policy
(default) a document joins a cluster only when it is itself similar enough to that
cluster's canonical; otherwise it is still a duplicate of its match, but starts its own
cluster and records the match's cluster as ``related``.

With a retention window (the store's, ``neardup.core.retention``), each document meets
only the stored members and earlier batch documents held for it: pass 1 and pass 3 get,
for every member, the first document of the batch it has expired for, and a cluster whose
canonical has expired is judged by its held members (``neardup.core.cluster``).

Nothing is written until the caller commits the batch's ``StateUpdate``, atomically.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import numpy as np

from neardup.core.arrays import sorted_unique
from neardup.core.candidates import Window, batch_candidates, bucket_weights
from neardup.core.cluster import (
    CANONICAL,
    COMPONENTS,
    CONTAINMENT,
    CONTAINMENT_EITHER,
    CONTAINMENT_OF_EARLIER,
    JACCARD,
    Clustering,
    Sets,
)
from neardup.core.decide import CopyBuckets, decide_batch
from neardup.core.lsh import band_hashes, bucket_ids, copy_bucket_ids
from neardup.core.minhash import make_hasher
from neardup.core.normalize import normalize
from neardup.core.overlap import bottom_k, fingerprints
from neardup.core.retention import until, watermarks
from neardup.core.settings import SAMPLE_PER_PERM, EngineSettings
from neardup.core.shingle import ShingleBatch, shingle_batch
from neardup.core.types import Document, Rejected, Verdict
from neardup.state.base import StateStore, StateUpdate

log = logging.getLogger(__name__)

#: The sets of the copy-bucket members of a batch's possible candidates are read before
#: its pass when they are at most this many, or no more than the other sets it reads;
#: otherwise the pass reports those it needed and runs again with them. A second pass
#: costs about as much as reading 20,000 sets: on a 200,000-document replayed stream,
#: 168 passes for 100 batches (1.8 s) with the second rule alone, 100 (0.95 s) with
#: this one, the sets' reads 0.24 s and 0.28 s.
COPY_SETS_READ_AHEAD = 20_000

EMPTY_TEXT = "empty text after normalisation"
NO_TOKENS = "no word tokens after normalisation"


class _BucketJoins(NamedTuple):
    """The bucket memberships a batch adds (the ``StateUpdate`` fields of that name)."""

    bucket_ids: np.ndarray
    bucket_seqs: np.ndarray
    largest_bucket: int


def fingerprint_sets(shingles: ShingleBatch, docs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sorted distinct shingle fingerprints (low 32 bits of the hashes) of ``docs``.

    Returns:
        (values uint32, shape (total,); offsets int64, shape (len(docs) + 1,)): the set of
        ``docs[k]`` is ``values[offsets[k]:offsets[k + 1]]`` (``neardup.core.overlap.fingerprints``).
    """
    return fingerprints(shingles.hashes, shingles.offsets, docs)


_CONTAINMENTS = {"new-in-earlier": CONTAINMENT, "earlier-in-new": CONTAINMENT_OF_EARLIER,
                 "both": CONTAINMENT_EITHER}


def measure_code(settings: EngineSettings) -> int:
    """The compiled loops' code of the settings' measure (``neardup.core.cluster``)."""
    return _CONTAINMENTS[settings.containment_direction] if settings.measure == "containment" else JACCARD


def nearest_candidates(bounds: np.ndarray, similarity: np.ndarray) -> np.ndarray:
    """Per document, the pair index of its most similar candidate (the first among
    equals), -1 when it has none.

    Args:
        bounds: int64, shape (n + 1,): document i's candidates are the pairs
            ``bounds[i]`` to ``bounds[i + 1]``.
        similarity: float64, shape (n_pairs,).

    Returns:
        int64, shape (n,).
    """
    counts = np.diff(bounds)
    owner = np.repeat(np.arange(len(counts)), counts)
    top = np.full(len(counts), -np.inf)
    if len(similarity):
        starts = bounds[:-1][counts > 0]
        top[counts > 0] = np.maximum.reduceat(similarity, starts)
    hits = np.flatnonzero(similarity == top[owner])
    docs, first = np.unique(owner[hits], return_index=True)
    nearest = np.full(len(counts), -1, dtype=np.int64)
    nearest[docs] = hits[first]
    return nearest


def _at_match(values: np.ndarray, best: np.ndarray, empty: float) -> np.ndarray:
    """``values[best]``, with ``empty`` where ``best`` is -1 (no match)."""
    out = np.full(len(best), empty, dtype=values.dtype)
    hit = best >= 0
    out[hit] = values[best[hit]]
    return out


@dataclass(slots=True)
class VerdictColumns:
    """The verdicts of a batch's valid documents as columns, one entry per document in
    arrival order (``Verdict``'s fields; the similarities not rounded): what a caller
    writing many verdicts reads without making a ``Verdict`` each.

    Attributes:
        ids: the documents' external ids.
        first_seq: the first document's seq; the others follow one by one.
        duplicate: whether each is a duplicate.
        cluster, match, related, nearest: external ids (``match``, ``related`` and
            ``nearest`` None where ``Verdict``'s are).
        similarity, jaccard, containment: as ``Verdict``'s.
        candidates, rejected, cluster_size: as ``Verdict``'s.
    """

    ids: list[str]
    first_seq: int
    duplicate: list[bool]
    cluster: list[str]
    match: list[str | None]
    similarity: list[float]
    jaccard: list[float]
    containment: list[float]
    candidates: list[int]
    rejected: list[int]
    cluster_size: list[int]
    related: list[str | None]
    nearest: list[str | None]

    def __len__(self) -> int:
        return len(self.ids)

    def verdicts(self) -> list[Verdict]:
        """One ``Verdict`` per document."""
        return [
            Verdict(doc_id, seq, "duplicate" if dup else "unique", c, m, sim, k, r, size, j, con, rel, near)
            for doc_id, seq, dup, c, m, sim, k, r, size, j, con, rel, near in zip(
                self.ids, range(self.first_seq, self.first_seq + len(self.ids)), self.duplicate,
                self.cluster, self.match, self.similarity, self.candidates, self.rejected,
                self.cluster_size, self.jaccard, self.containment, self.related, self.nearest)
        ]


@dataclass
class BatchResult:
    """The verdicts of a batch and the state update that records them.

    Attributes:
        columns: the valid documents' verdicts (``VerdictColumns``).
        reasons: per input document, in input order, why it was rejected (the reason of
            its ``Rejected``), or None for a valid one (whose verdict is the next of
            ``columns``).
        update: the state changes; the caller commits it.
        accepted: every accepted pair as three arrays of one length: earlier seq and
            later seq (uint64), similarity (float64); see ``links``.
        future_times: documents whose time lay beyond now plus the future tolerance,
            taken as now (``document_times``).
    """

    columns: VerdictColumns
    reasons: list[str | None]
    rejected_ids: list[str]  # the ids of the rejected documents, in input order
    update: StateUpdate
    accepted: tuple[np.ndarray, np.ndarray, np.ndarray] = field(
        default_factory=lambda: (np.empty(0, np.uint64), np.empty(0, np.uint64), np.empty(0)),
        repr=False)
    future_times: int = 0

    @property
    def results(self) -> list[Verdict | Rejected]:
        """One ``Verdict`` or ``Rejected`` per input document, in input order (made at
        each call)."""
        named = iter(self.columns.verdicts())
        rejected = iter(self.rejected_ids)
        return [next(named) if reason is None else Rejected(next(rejected), reason) for reason in self.reasons]

    @property
    def verdicts(self) -> list[Verdict]:
        return self.columns.verdicts()

    @property
    def links(self) -> list[tuple[int, int, float]]:
        """Every accepted pair as (earlier seq, later seq, similarity), built on demand."""
        earlier, later, similarity = self.accepted
        return list(zip(earlier.tolist(), later.tolist(), similarity.tolist()))


@dataclass
class PreparedBatch:
    """The state-free half of a batch: everything computed from the texts alone.

    Attributes:
        rejected: reason per input document, None for a valid one.
        valid: int64, shape (n_valid,): indices of the valid documents.
        fingerprints, fingerprint_offsets: the valid documents' sorted shingle
            fingerprints as one array (``fingerprint_sets``); with ``verify="estimate"``
            only the ``SAMPLE_PER_PERM * num_perm`` smallest of each (a bottom-k sample).
        sizes: int64, shape (n_valid,): shingle-set sizes (of the whole sets).
        bucket_keys: uint64, shape (n_buckets,): the distinct bucket ids of the batch
            (``neardup.core.lsh.bucket_ids`` of the MinHash signatures, which are not
            kept: nothing reads them after the banding), ascending.
        bucket_entries: int64, shape (n_valid, bands): each document's bucket in each
            band, as an index into ``bucket_keys``.
    """

    rejected: list[str | None]
    valid: np.ndarray
    fingerprints: np.ndarray
    fingerprint_offsets: np.ndarray
    sizes: np.ndarray
    bucket_keys: np.ndarray
    bucket_entries: np.ndarray

    @property
    def buckets(self) -> np.ndarray:
        """uint64, shape (n_valid, bands): each document's bucket id in each band."""
        return self.bucket_keys[self.bucket_entries]


class Preparer:
    """Normalise, shingle, MinHash and band a batch: pure, no state, so it can run in
    another process while the detector works on the previous batch."""

    def __init__(self, settings: EngineSettings) -> None:
        self.settings = settings
        self.hasher = make_hasher(settings.minhash, settings.num_perm, settings.seed)
        norm = settings.norm
        if settings.shingling.kind == "word" and norm.collapse_whitespace:
            # No white space is a word character, so collapsing it changes no word
            # shingle: skipped (6 of 7 us per Reuters story of normalisation).
            norm = replace(norm, collapse_whitespace=False)
        self._norm = norm

    def __call__(self, documents: Sequence[Document]) -> PreparedBatch:
        return self.texts([d.text for d in documents])

    def texts(self, raw: Sequence[str]) -> PreparedBatch:
        """The ``PreparedBatch`` of documents with texts ``raw``."""
        s = self.settings
        norm = self._norm
        texts = [normalize(text, norm) for text in raw]
        shingles = shingle_batch(texts, s.shingling)
        counts = shingles.counts
        valid = np.flatnonzero(counts > 0)
        signatures = self.hasher.signatures(shingles)[valid]  # banded here, not kept
        fingerprints, offsets = fingerprint_sets(shingles, valid)
        sizes = np.diff(offsets)
        if s.verify == "estimate":  # a bottom-k sample of each set (neardup.core.overlap)
            fingerprints, offsets = bottom_k(fingerprints, offsets, SAMPLE_PER_PERM * s.num_perm)
        buckets = bucket_ids(band_hashes(signatures, s.bands))
        keys, entries = np.unique(buckets, return_inverse=True)  # grouped here, off the state's path
        rejected = [
            None if n > 0 else (EMPTY_TEXT if text.isspace() or not text else NO_TOKENS)
            for text, n in zip(texts, counts.tolist())
        ]
        return PreparedBatch(
            rejected=rejected,
            valid=valid,
            fingerprints=fingerprints,
            fingerprint_offsets=offsets,
            sizes=sizes,
            bucket_keys=keys,
            bucket_entries=entries.ravel().reshape(buckets.shape),
        )


class Detector:
    """Near-duplicate detection over a state store.

    Args:
        settings: the engine settings; their ``state_shape()`` must be the store's.
        store: where buckets, signatures, fingerprints, union-find nodes and ids live.
    """

    def __init__(self, settings: EngineSettings, store: StateStore) -> None:
        self.settings = settings
        self.store = store
        self.prepare = Preparer(settings)

    @property
    def hasher(self):  # noqa: ANN201 - MinHasher or OnePermutationHasher
        """The signature function in use."""
        return self.prepare.hasher

    def detect(self, documents: Sequence[Document], prepared: PreparedBatch | None = None) -> BatchResult:
        """Verdicts for ``documents`` against the committed state, without writing.

        Args:
            prepared: ``Preparer(settings)(documents)``, if already computed (e.g. in
                another process); computed here otherwise.

        The caller commits ``result.update`` (adding input positions if it tracks them)
        before the next call.
        """
        p = prepared if prepared is not None else self.prepare(documents)
        return self.detect_prepared([d.id for d in documents], [d.time for d in documents], p)

    def detect_prepared(self, ids: list[str], stamps: list[float | None], p: PreparedBatch) -> BatchResult:
        """``detect`` for documents given by their ids and times (``Document.id``,
        ``Document.time``: seconds since the Unix epoch, or None), their texts prepared
        already (``p``): the texts themselves are not needed."""
        s = self.settings
        n = len(p.valid)
        first_seq = self.store.next_seq()

        # Pass 1: the stored candidates each document can get (``neardup.core.decide``).
        bands = p.bucket_entries.shape[1]
        entries = p.bucket_entries.ravel()
        members = self.store.bucket_members(p.bucket_keys)
        times, future = document_times(stamps, p.valid, s.future_tolerance_s)
        if future:
            log.warning("%d document(s) stamped more than %gs after now (the latest %s, at seq %d or later) "
                        "taken as now: their times would move the retention window (--future-tolerance)",
                        future, s.future_tolerance_s,
                        max((t for t in stamps if t is not None), default=None), first_seq)
        retention = self.store.retention
        window = None
        if retention.active:  # which members each document may meet (neardup.core.retention)
            marks = watermarks(self.store.watermark(), times)
            batch_seqs = np.arange(first_seq, first_seq + n, dtype=np.int64)
            window = Window(until(members.seqs, self.store.get_times(members.seqs), first_seq, marks, retention),
                            until(batch_seqs, times, first_seq, marks, retention))
        starts = _starts(members.counts)
        # containment: rare shared buckets rank first (a short text inside a long one
        # shares few slots with it, fewer than unrelated texts share common shingles)
        weights = bucket_weights(members.counts, entries) if s.measure == "containment" else None
        possible = batch_candidates(entries, bands, starts, members.counts, members.seqs,
                                    0, first_seq, s.max_candidates + s.extra_candidates,
                                    window, weights)  # 0: no batch joins, stored only
        stored = sorted_unique(possible.seqs)

        # The copy buckets of the possible candidates and of the batch's documents, after
        # the band buckets in the member arrays (``neardup.core.decide.CopyBuckets``).
        keys, counts, seqs = p.bucket_keys, members.counts, members.seqs
        copy_keys = np.empty(0, np.uint64)
        with_copies = s.duplicate_buckets == "new" and s.measure == "jaccard"
        if with_copies:
            copy_keys = copy_bucket_ids(np.concatenate([stored, np.arange(first_seq, first_seq + n, dtype=np.uint64)]))
            copied = self.store.bucket_members(copy_keys)
            keys = np.concatenate([keys, copy_keys])
            counts = np.concatenate([counts, copied.counts])
            seqs = np.concatenate([seqs, copied.seqs])
            if window is not None:
                window = Window(np.concatenate([window.member_until, until(
                    copied.seqs, self.store.get_times(copied.seqs), first_seq, marks, retention)]),
                    window.batch_until)
            starts = _starts(counts)
            copy_members = sorted_unique(copied.seqs)
        else:
            copy_members = np.empty(0, np.uint64)

        # Pass 2: the union-find nodes the batch can reach, as local ids ordered like the
        # seqs (the stored ones, then the batch), and the sets verification needs (those
        # of the copies too when they are few, else only those the pass asks for).
        reach, canonicals = self.store.closure(sorted_unique(np.concatenate([stored, copy_members])))
        local = np.concatenate([reach, np.arange(first_seq, first_seq + n, dtype=np.uint64)])
        first = len(reach)
        parent, size, canonical = self.store.local_nodes(reach, n)
        before = parent.copy(), size.copy(), canonical.copy()
        local_until = None
        if window is not None:
            local_until = np.concatenate([until(reach, self.store.get_times(reach), first_seq, marks, retention),
                                          window.batch_until])
            # a canonical expired for the whole batch is never read (its set may be gone)
            canonicals = canonicals[local_until[np.searchsorted(reach, canonicals)] > 0]
        needed = stored if s.cluster_policy == "components" else sorted_unique(np.concatenate([stored, canonicals]))
        if len(copy_members) <= max(len(needed), COPY_SETS_READ_AHEAD):  # read with the rest
            needed = sorted_unique(np.concatenate([needed, copy_members]))
        copies = None
        if with_copies:
            bucket = np.full(len(local), -1, dtype=np.int64)
            bucket[np.searchsorted(reach, stored)] = len(p.bucket_keys) + np.arange(len(stored))
            bucket[first:] = len(p.bucket_keys) + len(stored) + np.arange(n)
            copies = CopyBuckets(bucket, np.zeros(len(local), dtype=bool))

        # Pass 3, document by document: candidates, verification, clustering on the local
        # nodes, bucket joins; again with the sets of the copies it asked for, if any.
        # The changed nodes are stored.
        while True:
            sets = self._sets(p, local, first, needed)
            if copies is not None:
                copies.loaded[:] = False
                copies.loaded[np.searchsorted(local[:first], needed)] = True
                copies.loaded[first:] = True
            decisions = decide_batch(
                entries, bands, starts, counts, seqs, s.max_bucket_size, first_seq,
                s.max_candidates, reach, parent, size, canonical, s.threshold,
                COMPONENTS if s.cluster_policy == "components" else CANONICAL,
                measure_code(s), s.duplicate_buckets == "new", sets, s.extra_candidates, s.floor,
                window, local_until, copies, weights)
            if not decisions.missing.any():
                break
            needed = sorted_unique(np.concatenate([needed, local[np.flatnonzero(decisions.missing)]]))
            for node, was in zip((parent, size, canonical), before):
                node[:] = was
        bounds, candidates, jaccard, containment = (decisions.bounds, decisions.seqs,
                                                    decisions.jaccard, decisions.containment)
        similarity = containment if s.measure == "containment" else jaccard
        decided = decisions.clustering
        doc_local = first + np.repeat(np.arange(n), np.diff(bounds))
        joins = np.flatnonzero(decisions.joined)  # document-major: seqs ascending per bucket
        added = np.bincount(entries[joins], minlength=len(p.bucket_keys))
        joined = _BucketJoins(
            bucket_ids=np.concatenate([p.bucket_keys[entries[joins]], keys[decisions.copy_buckets]]),
            bucket_seqs=first_seq + np.concatenate([joins // bands, decisions.copy_docs]).astype(np.uint64),
            largest_bucket=int((members.counts + added).max(initial=0)),
        )
        changed = np.flatnonzero((parent != before[0]) | (size != before[1]) | (canonical != before[2]))
        nodes = np.column_stack([local[changed], local[parent[changed]],
                                 size[changed].astype(np.uint64), local[canonical[changed]]])
        accepted = similarity >= s.threshold
        links = (candidates[accepted], local[doc_local[accepted]], similarity[accepted])

        rejected_ids = [doc_id for doc_id, reason in zip(ids, p.rejected) if reason is not None]
        ids = [ids[i] for i in p.valid.tolist()] if rejected_ids else list(ids)
        columns = self._name(decided, bounds, candidates, local, similarity, jaccard, containment, ids, first_seq)
        update = StateUpdate(
            first_seq=first_seq,
            signatures=None,
            ids=ids,
            times=times,
            sizes=p.sizes,
            fingerprints=p.fingerprints,
            fingerprint_offsets=p.fingerprint_offsets,
            bucket_ids=joined.bucket_ids,
            bucket_seqs=joined.bucket_seqs,
            largest_bucket=joined.largest_bucket,
            nodes=nodes,
        )
        return BatchResult(columns=columns, reasons=p.rejected, rejected_ids=rejected_ids, update=update,
                           accepted=links, future_times=future)

    def _sets(self, p: PreparedBatch, local: np.ndarray, first: int, needed: np.ndarray) -> Sets:
        """The sets (or bottom-k samples) of the batch's documents (local ids ``first``
        on) and of the stored documents ``needed`` (a sorted subset of
        ``local[:first]``), read in multi-gets; the other stored local ids get empty
        sets."""
        at = np.searchsorted(local[:first], needed)
        values, offsets = self.store.get_fingerprints(needed.tolist())
        kept = np.zeros(len(local), dtype=np.int64)
        kept[at] = np.diff(offsets)
        kept[first:] = np.diff(p.fingerprint_offsets)
        all_offsets = np.zeros(len(local) + 1, dtype=np.int64)
        np.cumsum(kept, out=all_offsets[1:])
        sizes = kept.copy()
        sizes[first:] = p.sizes
        if self.settings.verify == "estimate":  # samples: the whole sets' sizes are stored
            sizes[at] = self.store.get_sizes(needed.tolist())
        return Sets(sizes, np.concatenate([values, p.fingerprints]), all_offsets)

    def _name(self, decided: Clustering, bounds: np.ndarray, candidates: np.ndarray,
              local: np.ndarray, similarity: np.ndarray, jaccard: np.ndarray,
              containment: np.ndarray, ids: list[str], first_seq: int) -> VerdictColumns:
        """The verdicts as columns, with the external ids of each document, match,
        cluster, related and nearest."""
        match = _at_match(candidates.astype(np.int64), decided.match, -1)
        # the most similar candidate, accepted or not: the match itself for a duplicate
        # (accepted candidates are the most similar, the first among equals in both)
        best = nearest_candidates(bounds, similarity)
        nearest = _at_match(candidates.astype(np.int64), best, -1)
        cluster = local[decided.canonical].astype(np.int64)
        related = np.where(decided.related >= 0, local[np.maximum(decided.related, 0)].astype(np.int64), -1)
        wanted = sorted_unique(np.concatenate([match, nearest, cluster, related]))
        wanted = wanted[(wanted >= 0) & (wanted < first_seq)].tolist()
        known: dict[int, str | None] = dict(zip(wanted, self.store.get_ids(wanted)))
        known.update(zip(range(first_seq, first_seq + len(ids)), ids))
        known[-1] = None
        name = known.__getitem__
        counts = np.diff(bounds)
        return VerdictColumns(
            ids=ids, first_seq=first_seq, duplicate=(decided.match >= 0).tolist(),
            cluster=list(map(name, cluster.tolist())),  # type: ignore[arg-type]
            match=list(map(name, match.tolist())),
            similarity=_at_match(similarity, best, 0.0).tolist(),
            jaccard=_at_match(jaccard, best, 0.0).tolist(),
            containment=_at_match(containment, best, 0.0).tolist(),
            candidates=counts.tolist(), rejected=(counts - decided.accepted).tolist(),
            cluster_size=decided.cluster_size.tolist(),
            related=list(map(name, related.tolist())), nearest=list(map(name, nearest.tolist())))

    def process(
        self, documents: Sequence[Document], positions: dict[str, int] | None = None
    ) -> list[Verdict | Rejected]:
        """``detect`` then commit, with the input ``positions`` reached, atomically."""
        result = self.detect(documents)
        if positions:
            result.update.positions.update(positions)
        self.store.commit(result.update)
        return result.results


def _starts(counts: np.ndarray) -> np.ndarray:
    """int64, shape (n,): where each bucket's members start in the member arrays."""
    starts = np.zeros(len(counts), dtype=np.int64)
    np.cumsum(counts[:-1], out=starts[1:])
    return starts


def document_times(stamps: Sequence[float | None], valid: np.ndarray,
                   tolerance_s: float = float("inf")) -> tuple[np.ndarray, int]:
    """The times of the documents ``valid`` of a batch whose times are ``stamps``
    (seconds since the Unix epoch, or None; ``Document.time``): int64, shape
    (len(valid),), ms since the Unix epoch, and how many lay beyond now plus
    ``tolerance_s`` (seconds).

    A document without a time gets the time now (its arrival), and so does one whose time
    lies more than ``tolerance_s`` after now (a clock gone wrong, a bad timestamp field):
    its time would become the retention window's watermark, which only grows, and expire
    every document held before it (``neardup.core.retention``).
    """
    now = time.time()
    latest = now + tolerance_s
    future = 0
    out = np.empty(len(valid), dtype=np.int64)
    for k, i in enumerate(valid.tolist()):
        t = stamps[i]
        if t is None:
            t = now
        elif t > latest:
            t = now
            future += 1
        out[k] = round(1000 * t)
    return out, future


def warm_up(settings: EngineSettings) -> None:
    """Load the compiled kernels (numba: from its on-disk cache, or compiled on the very
    first run) by passing a story and its copy through a ``Detector`` over a throwaway
    in-memory store. About 0.5 s with the cache; a caller can overlap it with other
    start-up work in a thread (the kernels are process-wide)."""
    from neardup.state.memory import MemoryStateStore  # noqa: PLC0415 - only here

    # with a set cache, so that the RocksDB store's set cache kernels load too
    detector = Detector(settings, MemoryStateStore(settings.state_shape(), set_cache_bytes=1 << 12))
    text = "the quick brown fox jumps over the lazy dog near the river bank at dawn"
    detector.store.commit(detector.detect([Document("original", text)]).update)
    detector.detect([Document("copy", text)])


def kernels_cached() -> bool:
    """Whether numba's on-disk cache holds an up-to-date build of the kernels, i.e.
    whether this run loads them (about a second) rather than compiling them (a minute or
    more on a busy machine): False when a kernel module has no cache index at all, or an
    index is stale (its source changed). Kernels only ever called from other kernels
    have no index of their own. Reads the indexes only; True when it cannot tell, and when
    the process runs the kernels built ahead of time at install (``neardup.core.aot``).
    """
    import importlib  # noqa: PLC0415 - only here
    import os  # noqa: PLC0415

    from neardup.core.aot import KERNEL_MODULES, ahead_of_time  # noqa: PLC0415

    if ahead_of_time():
        return True
    from numba.core.registry import CPUDispatcher  # noqa: PLC0415

    for name in KERNEL_MODULES:
        indexed = False
        for kernel in vars(importlib.import_module(name)).values():
            if not isinstance(kernel, CPUDispatcher) or kernel.__module__ != name:
                continue
            try:
                cache = kernel._cache._cache_file
                if not os.path.exists(cache._index_path):
                    continue
                if not cache._load_index():  # numba's own freshness check
                    return False
            except (AttributeError, OSError, EOFError, ValueError):
                return True
            indexed = True
        if not indexed:
            return False
    return True
