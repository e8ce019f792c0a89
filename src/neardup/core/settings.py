"""The engine's settings: the ones that shape the stored state, and the decision rules."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from neardup.core.lsh import LshParams, optimal_params, recall_params
from neardup.core.normalize import TextNorm
from neardup.core.shingle import Shingling

Measure = Literal["jaccard", "containment"]
Verify = Literal["exact", "estimate"]
ClusterPolicy = Literal["canonical", "components"]
Scheme = Literal["oph", "classic"]
DuplicateBuckets = Literal["new", "all"]
Direction = Literal["new-in-earlier", "earlier-in-new", "both"]

#: How far below the Jaccard threshold the LSH banding is tuned. More candidates cost
#: little and each is checked (exactly, or on bottom-k samples that are exact for sets of
#: up to ``SAMPLE_PER_PERM * num_perm`` shingles), so recall rises while precision holds.
#: A banding tuned at the threshold itself would miss most pairs just above it (9 bands
#: of 13 rows make a pair at 0.8 a candidate with probability 0.40); 0.1 below it
#: (14 x 9) still misses a pair at 0.83 with probability 0.055: 9 of 658 documents of
#: Reuters char:5 at 0.8. (Containment is banded from its size bound instead:
#: ``containment_jaccard``.)
CANDIDATE_MARGIN = 0.25
#: The share of the pairs at the score floor that the Jaccard banding makes candidates
#: (``neardup.core.lsh.recall_params``): at the default floor of threshold 0.8, 0.55, it
#: gives 32 bands x 4 rows (0.954; the banding optimised for 0.55, 21 x 6, gives 0.445).
#: On Reuters-21578 at threshold 0.8, of the documents whose best earlier document lies at
#: or above 0.55, 674 of 674 (word:5) and 1,390 of 1,409 (char:5) then report it as
#: ``nearest`` with its exact similarity (21 x 6: 640 and 1,227).
SCORE_RECALL = 0.95
#: ``verify="estimate"`` keeps this many of a set's smallest fingerprints per MinHash slot
#: (``neardup.core.overlap.bottom_k``): 2 × 4 bytes, the bytes of a uint64 signature slot.
SAMPLE_PER_PERM = 2
#: ``extra_candidates`` when none is given, by measure. A text inside one several times
#: longer shares few slots with it (about 128 / ratio times the containment), and with
#: character shingles unrelated texts share as many through common shingles, so the
#: container can rank far down the list even with the bucket weights
#: (``neardup.core.candidates.bucket_weights``): on composite articles (char:5, 4-8x,
#: containment 0.5; benchmarks/containment_quality.py) 0.93 of the contained pairs are
#: found with 56 and 0.985 with 248.
EXTRA_CANDIDATES = {"jaccard": 56, "containment": 248}
#: The share of the pairs at the containment bound that the containment banding makes
#: candidates (``neardup.core.lsh.recall_params``).
CONTAINMENT_RECALL = 0.995


def containment_jaccard(threshold: float, ratio: float) -> float:
    """The lowest Jaccard similarity of two sets, one contained in the other to at least
    ``threshold``, the larger at most ``ratio`` times the smaller: t / (1 + R - t)
    (|A ∩ B| >= t |A| and |B| <= R |A|; Zhu et al., LSH Ensemble, VLDB 2016)."""
    return threshold / (1.0 + ratio - threshold)


@dataclass(frozen=True)
class EngineSettings:
    """Everything the detector needs to turn texts into verdicts.

    The defaults are those of ``neardup.config.Settings``, where they are chosen
    (``Settings.engine()`` builds these settings for the commands); the core imports
    nothing above it, so they are written here too, and tests/test_config.py checks that
    the two agree.

    Attributes:
        norm: text normalisation.
        shingling: word or character n-grams, as sets or multisets.
        num_perm: MinHash signature length.
        seed: MinHash seed.
        minhash: ``"oph"``, one-permutation hashing with optimal densification (one hash
            per shingle; ``neardup.core.oph``), or ``"classic"``, ``num_perm``
            independent hash functions (``neardup.core.minhash``).
        threshold: similarity (``measure``) at or above which a candidate is a duplicate.
        measure: ``"jaccard"`` |A ∩ B| / |A ∪ B|, or ``"containment"``: by default
            |A ∩ B| / |A|, the share of the new document's shingles found in the
            earlier one (see ``containment_direction``).
        containment_direction: which text is contained in which: ``"new-in-earlier"``
            (a new short text inside an earlier long one), ``"earlier-in-new"`` (an
            earlier short text, e.g. a wire story, inside a new long one: |A ∩ B| / |B|),
            or ``"both"``, the larger of the two, |A ∩ B| / min(|A|, |B|).
        containment_ratio: the largest size ratio between a contained text and the one
            containing it that the containment banding is tuned for: it makes a
            candidate of a pair at the lowest Jaccard such a pair can have
            (``containment_jaccard``) with probability ``CONTAINMENT_RECALL``; texts
            more unequal than that are found less surely.
        verify: ``"exact"`` keeps every document's shingle fingerprints in the store and
            decides on the exact similarity; ``"estimate"`` keeps a bottom-k sample of
            them (the ``SAMPLE_PER_PERM * num_perm`` smallest, Broder 1997) and decides
            on the estimate from the samples: exact for sets no larger than that,
            bounded bytes per document for long texts, noisier.
        future_tolerance_s: a document time more than this many seconds after now
            (the wall clock) is taken as now instead (``Detector.detect``), so that one
            record stamped far in the future cannot move the retention window's
            watermark and expire every document before it.
        cluster_policy: ``"canonical"`` lets a document join a cluster only when its
            similarity to the cluster's canonical (earliest) document reaches the
            threshold, so clusters cannot chain; ``"components"`` joins every verified
            pair (classic union-find connected components).
        score_floor: the Jaccard similarity down to which each document's score (its
            ``nearest`` earlier document and their similarity) reaches: the banding makes
            a pair at the floor a candidate with probability at least ``SCORE_RECALL``,
            and a candidate at or above it counts as a near miss (see
            ``extra_candidates``). None means ``threshold`` minus ``CANDIDATE_MARGIN``
            (0.25). A lower floor costs more candidates per document. Jaccard only: with
            containment the banding reaches the containment bound.
        candidate_threshold: the Jaccard similarity the LSH banding is optimised for
            (``optimal_params``) instead of reaching ``score_floor``; None means the
            score floor for Jaccard, ``containment_jaccard(threshold, containment_ratio)``
            for containment.
        lsh: the banding; None chooses ``recall_params(score_floor, num_perm,
            SCORE_RECALL)`` for Jaccard (``optimal_params(candidate_threshold, num_perm)``
            when ``candidate_threshold`` is given), ``recall_params(candidate_threshold,
            num_perm, CONTAINMENT_RECALL)`` for containment.
        max_bucket_size: documents kept per band bucket; later arrivals in a full bucket
            are still compared with its documents but not added (bounds hot buckets made
            by boilerplate).
        max_candidates: candidates verified per document; when there are more, those
            sharing the most band buckets with it (the likeliest to be similar) first,
            earlier ones first among equals. Bounds the work per document as a stream
            of many copies of the same story grows.
        extra_candidates: candidates verified beyond ``max_candidates``, next in the
            same order, one at a time once the most similar so far is a near miss (at
            least ``floor``), and for Jaccard only while none is accepted: on
            templated text the true match can rank below ``max_candidates`` others of
            the same template. A copy of a story republished many times is accepted
            among its first candidates and stops there, so the protection of the cap is
            kept. With containment, a long text can contain several earlier ones, so an
            accepted one does not stop the verification. None: ``EXTRA_CANDIDATES`` of
            the measure (56 for Jaccard, 248 for containment).
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
    containment_direction: Direction = "new-in-earlier"
    containment_ratio: float = 8.0
    verify: Verify = "exact"
    cluster_policy: ClusterPolicy = "canonical"
    score_floor: float | None = None
    candidate_threshold: float | None = None
    lsh: LshParams | None = None
    max_bucket_size: int = 256
    max_candidates: int = 8
    extra_candidates: int | None = None
    duplicate_buckets: DuplicateBuckets = "new"
    future_tolerance_s: float = 3600.0
    _resolved: LshParams = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.future_tolerance_s >= 0.0:
            raise ValueError(f"future tolerance must be at least 0 seconds, not {self.future_tolerance_s}")
        if not 0.0 < self.threshold <= 1.0:
            raise ValueError(f"threshold must lie in (0, 1], not {self.threshold}")
        if self.minhash not in ("oph", "classic"):
            raise ValueError(f"minhash must be oph or classic, not {self.minhash!r}")
        if self.measure not in ("jaccard", "containment"):
            raise ValueError(f"measure must be jaccard or containment, not {self.measure!r}")
        if self.containment_direction not in ("new-in-earlier", "earlier-in-new", "both"):
            raise ValueError("containment direction must be new-in-earlier, earlier-in-new or "
                             f"both, not {self.containment_direction!r}")
        if not self.containment_ratio >= 1.0:
            raise ValueError(f"containment ratio must be at least 1, not {self.containment_ratio}")
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
        if self.extra_candidates is None:
            object.__setattr__(self, "extra_candidates", EXTRA_CANDIDATES[self.measure])
        if self.extra_candidates < 0:
            raise ValueError("extra_candidates must be at least 0")
        if self.score_floor is not None and not 0.0 < self.score_floor <= self.threshold:
            raise ValueError(f"score floor must lie in (0, threshold={self.threshold}], not {self.score_floor}")
        if self.lsh is not None:
            lsh = self.lsh
        elif self.measure == "containment":
            lsh = recall_params(self.banding_threshold, self.num_perm, CONTAINMENT_RECALL)
        elif self.candidate_threshold is not None:
            lsh = optimal_params(self.banding_threshold, self.num_perm)
        else:
            lsh = recall_params(self.banding_threshold, self.num_perm, SCORE_RECALL)
        if lsh.bands * lsh.rows > self.num_perm:
            raise ValueError(
                f"{lsh.bands} bands x {lsh.rows} rows need more than num_perm={self.num_perm}"
            )
        object.__setattr__(self, "_resolved", lsh)

    @property
    def banding_threshold(self) -> float:
        """The Jaccard similarity the banding is tuned for: ``candidate_threshold`` if
        given, else the containment bound (containment) or the score floor (Jaccard)."""
        if self.candidate_threshold is not None:
            t = self.candidate_threshold
        elif self.measure == "containment":
            return min(max(containment_jaccard(self.threshold, self.containment_ratio), 0.01), 0.99)
        else:
            t = self.floor
        return min(max(t, 0.05), 0.99)

    @property
    def floor(self) -> float:
        """The score floor in force: ``score_floor``, else ``threshold`` minus
        ``CANDIDATE_MARGIN`` (at least 0.05). Also the similarity (``measure``) of a near
        miss, which keeps the verification going past ``max_candidates`` (see
        ``extra_candidates``)."""
        return self.score_floor if self.score_floor is not None else max(self.threshold - CANDIDATE_MARGIN, 0.05)

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
            # what an estimate compares: older stores of this mode kept signatures
            **({"estimate_sample": f"bottom-{SAMPLE_PER_PERM * self.num_perm}"} if self.verify == "estimate" else {}),
        }
