"""Nearest stored documents of a text, read from the state without changing it.

The question an editor asks ("has this story already run?") without adding the draft:
the text is prepared as the detector prepares a document (normalised, shingled,
MinHashed, cut into LSH band buckets, ``neardup.detector.Preparer``), its candidates
are the stored members of its buckets ranked by the buckets they share
(``neardup.core.candidates.batch_candidates``, the detector's first pass, with no
bucket joins) and the copies stored behind them (their copy buckets), and each candidate's similarity is computed from the stored shingle
fingerprints as the detector verifies it (``neardup.core.cluster.pair_similarities``:
exact with ``verify="exact"``, estimated from bottom-k samples with ``"estimate"``).
Nothing is written: the store is only read (Leskovec, Rajaraman, Ullman, *Mining of
Massive Datasets*, §3.4, for the banding; Broder 1997 for the sets).

A document LSH does not make a candidate (one sharing no bucket) is not found, as the
detector would not find it either.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np

from neardup.core.candidates import batch_candidates
from neardup.core.cluster import Sets, pair_similarities
from neardup.core.lsh import copy_bucket_ids
from neardup.core.settings import EngineSettings
from neardup.detector import PreparedBatch, Preparer, measure_code
from neardup.state.errors import StateError
from neardup.state.kv import KeyValueStateStore

__all__ = ["Neighbour", "nearest"]


@dataclass(frozen=True, slots=True)
class Neighbour:
    """A stored document near a query text.

    Attributes:
        id: the stored document's external id.
        similarity: in the configured measure (Jaccard, or containment of the query
            text in the stored document), 0.0 to 1.0.
        jaccard: Jaccard similarity of the two shingle sets.
        containment: share of the query's shingles found in the stored document.
        cluster: external id of the canonical of the stored document's cluster (its own
            id when it is alone).
    """

    id: str
    similarity: float
    jaccard: float
    containment: float
    cluster: str

    def to_dict(self) -> dict[str, object]:
        """The fields as JSON-ready values (similarities rounded to 6 digits)."""
        return {"id": self.id, "similarity": round(self.similarity, 6), "jaccard": round(self.jaccard, 6),
                "containment": round(self.containment, 6), "cluster": self.cluster}


def _clusters(store: KeyValueStateStore, seqs: np.ndarray) -> np.ndarray:
    """int64, shape (len(seqs),): the canonical seq of each seq's cluster (union-find
    roots followed in the committed forest, nothing written)."""
    if not len(seqs):
        return np.empty(0, np.int64)
    reach, _ = store.closure(seqs)
    parent, _, canonical = store.local_nodes(reach, 0)
    at = np.searchsorted(reach, seqs.astype(np.uint64))
    while True:  # one level per step; the trees are shallow
        up = parent[at]
        if np.array_equal(up, at):
            break
        at = up
    roots: np.ndarray = reach[canonical[at]].astype(np.int64)
    return roots


def _with_copies(store: KeyValueStateStore, bounds: np.ndarray, seqs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The candidates (``bounds``, ``seqs`` as ``Candidates`` holds them) and the members
    of their copy buckets: a duplicate stored with ``duplicate_buckets="new"`` joins no
    band bucket that holds its match, only its match's copy bucket
    (``neardup.core.decide.CopyBuckets``), where the detector finds it too. Each text's
    seqs come out distinct and ascending."""
    if not len(seqs):
        return bounds, seqs
    keys = copy_bucket_ids(seqs)
    copies = store.bucket_members(np.unique(keys))
    if not len(copies.seqs):
        return bounds, seqs
    bucket = np.searchsorted(np.unique(keys), keys)
    starts = np.zeros(len(copies.counts), dtype=np.int64)
    np.cumsum(copies.counts[:-1], out=starts[1:])
    n = len(bounds) - 1
    owner = np.repeat(np.arange(n), np.diff(bounds))
    per_pair = copies.counts[bucket]
    first = np.cumsum(per_pair) - per_pair  # each pair's first copy in the expansion
    at = np.arange(int(per_pair.sum())) - np.repeat(first, per_pair) + np.repeat(starts[bucket], per_pair)
    owners = np.concatenate([owner, np.repeat(owner, per_pair)])
    all_seqs = np.concatenate([seqs.astype(np.uint64), copies.seqs[at].astype(np.uint64)])
    order = np.lexsort((all_seqs, owners))
    owners, all_seqs = owners[order], all_seqs[order]
    keep = np.ones(len(order), dtype=bool)
    keep[1:] = (owners[1:] != owners[:-1]) | (all_seqs[1:] != all_seqs[:-1])
    owners, all_seqs = owners[keep], all_seqs[keep]
    return np.searchsorted(owners, np.arange(n + 1)).astype(np.int64), all_seqs


def nearest(store: KeyValueStateStore, settings: EngineSettings, texts: Sequence[str],
            k: int = 5, prepare: Preparer | None = None, shared: bool = False) -> list[list[Neighbour]]:
    """The ``k`` stored documents most similar to each text, most similar first (the
    earliest first among equals); an empty list for a text with no candidate or no
    shingle. Reads ``store`` only.

    Args:
        store: an open state store (``RocksDBStateStore``, read-only or not, or
            ``MemoryStateStore``) built with ``settings.state_shape()``.
        settings: the engine settings (shingling, MinHash, banding, measure, verify).
        texts: the query texts.
        k: neighbours per text, at least 1. At most ``max(k, settings.max_candidates +
            settings.extra_candidates)`` candidates are verified per text, those sharing
            the most buckets first.
        prepare: ``Preparer(settings)``, kept by a caller that queries often (building
            one costs about 10 ms: the hash functions' constants).
        shared: ``store`` is written meanwhile by another thread (``neardup run``'s
            consumer): the texts are prepared first, then the store is read under its
            ``lock``, which its writes take too (a commit waits for at most one read),
            and the set cache is left alone; the answer is the state between two
            commits.

    Returns:
        One list of at most ``k`` ``Neighbour`` per text, in the order of ``texts``.

    Raises:
        ValueError: ``k`` is below 1.
        StateError: the store is being restored from its changelog.
    """
    if k < 1:
        raise ValueError(f"k must be at least 1, not {k}")
    out: list[list[Neighbour]] = [[] for _ in texts]
    if not texts:
        return out
    p = (prepare if prepare is not None else Preparer(settings)).texts(list(texts))
    if not len(p.valid):
        return out
    with store.lock if shared else nullcontext():
        if not store.ready():
            raise StateError("the state is being restored from its changelog")
        _lookup(store, settings, p, k, out, cache=not shared)
    return out


def _lookup(store: KeyValueStateStore, settings: EngineSettings, p: PreparedBatch, k: int,
            out: list[list[Neighbour]], cache: bool) -> None:
    """``nearest``'s reading of the store for the prepared texts ``p``, into ``out``."""
    n = len(p.valid)
    if not store.next_seq():
        return
    bands = p.bucket_entries.shape[1]
    entries = p.bucket_entries.ravel()
    members = store.bucket_members(p.bucket_keys)
    starts = np.zeros(len(members.counts), dtype=np.int64)
    np.cumsum(members.counts[:-1], out=starts[1:])
    limit = max(k, settings.max_candidates + (settings.extra_candidates or 0))
    # max_bucket_size 0: the texts join no bucket, so they do not meet one another
    found = batch_candidates(entries, bands, starts, members.counts, members.seqs, 0,
                             store.next_seq(), limit)
    bounds, seqs = _with_copies(store, found.bounds, found.seqs)
    stored = np.unique(seqs)
    if not len(stored):
        return
    values, offsets = store.get_fingerprints(stored.tolist(), cache=cache)
    sizes = np.diff(offsets)
    if settings.verify == "estimate":  # samples: the whole sets' sizes are stored
        sizes = np.asarray(store.get_sizes(stored.tolist()), dtype=np.int64)
    m = len(stored)
    all_offsets = np.concatenate([offsets, offsets[-1] + p.fingerprint_offsets[1:]])
    sets = Sets(np.concatenate([sizes, p.sizes]).astype(np.int64),
                np.concatenate([values, p.fingerprints]), all_offsets.astype(np.int64))
    owner = np.repeat(np.arange(n), np.diff(bounds))
    jaccard, containment = pair_similarities(sets, m + owner, np.searchsorted(stored, seqs),
                                             measure_code(settings))
    similarity = containment if settings.measure == "containment" else jaccard
    clusters = _clusters(store, stored)
    wanted = np.unique(np.concatenate([stored.astype(np.int64), clusters])).tolist()
    ids = dict(zip(wanted, store.get_ids(wanted)))
    for i in range(n):
        lo, hi = int(bounds[i]), int(bounds[i + 1])
        order = lo + np.lexsort((seqs[lo:hi], -similarity[lo:hi]))[:k]
        at = np.searchsorted(stored, seqs[order])
        out[int(p.valid[i])] = [
            Neighbour(ids[int(stored[a])], float(similarity[j]), float(jaccard[j]), float(containment[j]),
                      ids[int(clusters[a])])
            for j, a in zip(order.tolist(), at.tolist())
        ]
