"""The engine's settings: the ones that shape the stored state, and the decision rules."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from neardup.core.lsh import LshParams, optimal_params
from neardup.core.normalize import TextNorm
from neardup.core.shingle import Shingling

Measure = Literal["jaccard", "containment"]
Verify = Literal["exact", "estimate"]
ClusterPolicy = Literal["canonical", "components"]
Scheme = Literal["oph", "classic"]
DuplicateBuckets = Literal["new", "all"]

#: How far below the decision threshold the LSH banding is tuned, by (measure, verify).
#: With exact verification more candidates cost little and each is checked exactly, so
#: recall rises while precision stays exact. Containment needs a margin in both modes:
#: a document contained in a longer one has a Jaccard similarity (what banding sees)
#: well below its containment.
CANDIDATE_MARGIN = {
    ("jaccard", "exact"): 0.25,
    ("jaccard", "estimate"): 0.0,
    ("containment", "exact"): 0.3,
    ("containment", "estimate"): 0.3,
}


@dataclass(frozen=True)
class EngineSettings:
    """Everything the detector needs to turn texts into verdicts.

    Attributes:
        norm: text normalisation.
        shingling: word or character n-grams, as sets or multisets.
        num_perm: MinHash signature length.
        seed: MinHash seed.
        minhash: ``"oph"``, one-permutation hashing with optimal densification (one hash
            per shingle; ``neardup.core.oph``), or ``"classic"``, ``num_perm``
            independent hash functions (``neardup.core.minhash``).
        threshold: similarity (``measure``) at or above which a candidate is a duplicate.
        measure: ``"jaccard"`` |A ∩ B| / |A ∪ B|, or ``"containment"`` |A ∩ B| / |A|,
            the share of the new document's shingles found in the earlier one.
        verify: ``"exact"`` keeps every document's shingle fingerprints in the store and
            decides on the exact similarity; ``"estimate"`` keeps signatures only and
            decides on the MinHash estimate (cheaper on disk, noisier).
        cluster_policy: ``"canonical"`` lets a document join a cluster only when its
            similarity to the cluster's canonical (earliest) document reaches the
            threshold, so clusters cannot chain; ``"components"`` joins every verified
            pair (classic union-find connected components).
        candidate_threshold: the Jaccard similarity the LSH banding is tuned for; None
            means ``threshold`` minus ``CANDIDATE_MARGIN[(measure, verify)]``: 0.25 for
            exact Jaccard, 0 for estimated Jaccard, 0.3 for containment.
        lsh: the banding; None chooses ``optimal_params(candidate_threshold, num_perm)``.
        max_bucket_size: documents kept per band bucket; later arrivals in a full bucket
            are still compared with its documents but not added (bounds hot buckets made
            by boilerplate).
        max_candidates: candidates verified per document, at most; when there are more,
            those sharing the most band buckets with it (the likeliest to be similar)
            are kept, earlier ones first among equals. Bounds the work per document as
            a stream of many copies of the same story grows.
        duplicate_buckets: which band buckets a duplicate joins. ``"new"``: only those
            holding none of its accepted candidates, so a story's copies do not pile up
            in its buckets (a later document meets the earlier version there instead;
            ``neardup.core.decide``); ``"all"``: every bucket with room.
    """

    norm: TextNorm = TextNorm()
    shingling: Shingling = Shingling()
    num_perm: int = 128
    seed: int = 1
    minhash: Scheme = "oph"
    threshold: float = 0.8
    measure: Measure = "jaccard"
    verify: Verify = "exact"
    cluster_policy: ClusterPolicy = "canonical"
    candidate_threshold: float | None = None
    lsh: LshParams | None = None
    max_bucket_size: int = 256
    max_candidates: int = 8
    duplicate_buckets: DuplicateBuckets = "new"
    _resolved: LshParams = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not 0.0 < self.threshold <= 1.0:
            raise ValueError(f"threshold must lie in (0, 1], not {self.threshold}")
        if self.minhash not in ("oph", "classic"):
            raise ValueError(f"minhash must be oph or classic, not {self.minhash!r}")
        if self.measure not in ("jaccard", "containment"):
            raise ValueError(f"measure must be jaccard or containment, not {self.measure!r}")
        if self.verify not in ("exact", "estimate"):
            raise ValueError(f"verify must be exact or estimate, not {self.verify!r}")
        if self.cluster_policy not in ("canonical", "components"):
            raise ValueError(
                f"cluster policy must be canonical or components, not {self.cluster_policy!r}"
            )
        if self.duplicate_buckets not in ("new", "all"):
            raise ValueError(f"duplicate_buckets must be new or all, not {self.duplicate_buckets!r}")
        if self.max_bucket_size < 1:
            raise ValueError("max_bucket_size must be at least 1")
        if self.max_candidates < 1:
            raise ValueError("max_candidates must be at least 1")
        lsh = self.lsh or optimal_params(self.banding_threshold, self.num_perm)
        if lsh.bands * lsh.rows > self.num_perm:
            raise ValueError(
                f"{lsh.bands} bands x {lsh.rows} rows need more than num_perm={self.num_perm}"
            )
        object.__setattr__(self, "_resolved", lsh)

    @property
    def banding_threshold(self) -> float:
        """The similarity the banding is tuned for (see ``candidate_threshold``)."""
        if self.candidate_threshold is not None:
            t = self.candidate_threshold
        else:
            t = self.threshold - CANDIDATE_MARGIN[(self.measure, self.verify)]
        return min(max(t, 0.05), 0.99)

    @property
    def bands(self) -> LshParams:
        """The banding in force (given, or optimal for ``banding_threshold``)."""
        return self._resolved

    def state_shape(self) -> dict[str, Any]:
        """The settings stored with the state; a store refuses any other values."""
        return {
            "normalization": self.norm.to_dict(),
            "shingling": str(self.shingling),
            "num_perm": self.num_perm,
            "seed": self.seed,
            "minhash": self.minhash,
            "bands": self.bands.bands,
            "rows": self.bands.rows,
            "verify": self.verify,
            "cluster_policy": self.cluster_policy,
        }
