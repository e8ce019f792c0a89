"""Value types passed between the detector and its callers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple


@dataclass(frozen=True, slots=True)
class Document:
    """One record to deduplicate: its external ``id`` and raw ``text``; ``time``, in
    seconds since the Unix epoch, places it in a retention window (None: its arrival)."""

    id: str
    text: str
    time: float | None = None


@dataclass(frozen=True, slots=True)
class Verdict:
    """The outcome for one document.

    Attributes:
        id: the document's external id.
        seq: its arrival sequence number in the store (0, 1, 2, ...).
        verdict: ``"unique"`` (no earlier near-duplicate) or ``"duplicate"``.
        cluster: external id of the cluster's canonical (earliest) document; the
            document's own id when it starts a cluster.
        match: external id of the most similar accepted candidate, or None.
        similarity: similarity to ``nearest`` in the configured measure, for every
            document, unique or not (0.0 when it had no candidate): exact with
            ``verify="exact"``, the MinHash estimate otherwise. A unique document's score
            says how close it came to the threshold.
        jaccard: Jaccard similarity to ``nearest`` (exact or estimated, as ``similarity``).
        containment: share of this document's shingles found in ``nearest``.
        candidates: number of distinct earlier documents checked (bucket collisions).
        rejected: candidates whose similarity fell below the threshold.
        related: with the canonical cluster policy, the cluster of ``match`` when this
            document did not join it (too far from its canonical); else None.
        cluster_size: documents in the cluster once this one has joined it (the
            union-find root's size); 1 for a unique document.
        nearest: external id of the most similar candidate checked, accepted or not (the
            earliest among equals); ``match`` for a duplicate; None when there was no
            candidate.
    """

    id: str
    seq: int
    verdict: Literal["unique", "duplicate"]
    cluster: str
    match: str | None
    similarity: float
    candidates: int
    rejected: int
    cluster_size: int = 1
    jaccard: float = 0.0
    containment: float = 0.0
    related: str | None = None
    nearest: str | None = None

    @property
    def is_duplicate(self) -> bool:
        return self.verdict == "duplicate"

    def to_dict(self) -> dict[str, object]:
        return {
            "verdict": self.verdict,
            "cluster": self.cluster,
            "match": self.match,
            "similarity": round(self.similarity, 6),
            "jaccard": round(self.jaccard, 6),
            "containment": round(self.containment, 6),
            "related": self.related,
            "nearest": self.nearest,
            "candidates": self.candidates,
            "rejected_candidates": self.rejected,
        }


@dataclass(frozen=True, slots=True)
class Rejected:
    """A record that could not be processed, with the reason (e.g. empty text)."""

    id: str
    reason: str


class Node(NamedTuple):
    """One stored union-find entry (``neardup.core.unionfind``). ``size`` and
    ``canonical`` are meaningful on roots only."""

    parent: int
    size: int
    canonical: int
