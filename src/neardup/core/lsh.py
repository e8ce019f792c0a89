"""LSH banding of MinHash signatures (Leskovec, Rajaraman, Ullman, *Mining of Massive
Datasets*, 3rd ed., §3.4).

A signature of ``bands * rows`` slots is cut into ``bands`` bands of ``rows`` slots; two
documents become candidates when all the rows of at least one band agree. For Jaccard
similarity s the probability of that is the S-curve 1 - (1 - s^rows)^bands.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from neardup.core.hashing import combine


@dataclass(frozen=True)
class LshParams:
    """A banding: ``bands`` bands of ``rows`` rows each (``bands * rows <= num_perm``)."""

    bands: int
    rows: int

    def __post_init__(self) -> None:
        if self.bands < 1 or self.rows < 1:
            raise ValueError(f"bands and rows must be at least 1, not {self.bands}x{self.rows}")

    def probability(self, similarity: float | np.ndarray) -> float | np.ndarray:
        """P(candidate) = 1 - (1 - s^rows)^bands for Jaccard similarity ``s`` in [0, 1]."""
        s = np.asarray(similarity, dtype=np.float64)
        p = 1.0 - (1.0 - s**self.rows) ** self.bands
        return float(p) if p.ndim == 0 else p


_GRID = 2001  # integration points on [0, 1]


def _area(y: np.ndarray, x: np.ndarray) -> float:
    return float(np.sum((y[1:] + y[:-1]) * np.diff(x)) / 2.0) if len(x) > 1 else 0.0


def false_positive_area(threshold: float, params: LshParams) -> float:
    """Integral over s in [0, threshold] of P(candidate | s): weight of false positives."""
    s = np.linspace(0.0, threshold, _GRID)
    return _area(params.probability(s), s)


def false_negative_area(threshold: float, params: LshParams) -> float:
    """Integral over s in [threshold, 1] of 1 - P(candidate | s): weight of false negatives."""
    s = np.linspace(threshold, 1.0, _GRID)
    return _area(1.0 - params.probability(s), s)


@lru_cache(maxsize=64)
def optimal_params(
    threshold: float = 0.8,
    num_perm: int = 128,
    false_positive_weight: float = 0.5,
    false_negative_weight: float = 0.5,
) -> LshParams:
    """The banding that minimises the weighted false-positive and false-negative areas.

    Every (bands, rows) with bands * rows <= num_perm is scored by
    ``fp_weight * false_positive_area + fn_weight * false_negative_area`` (the criterion of
    datasketch's ``MinHashLSH``; here integrated by the trapezoidal rule on 2,001 points).
    The bandings of one row count are scored together: (1 - s^rows)^bands for bands 1, 2,
    ... is a running product over the grid, so no power is taken per banding (about 3x
    faster than a loop over ``LshParams.probability``). The answer is kept per argument
    tuple (``functools.lru_cache``): a process computes it once per setting.

    Raises:
        ValueError: threshold outside (0, 1), num_perm < 1, or weights not summing to 1.
    """
    if not 0.0 < threshold < 1.0:
        raise ValueError(f"threshold must lie in (0, 1), not {threshold}")
    if num_perm < 1:
        raise ValueError(f"num_perm must be at least 1, not {num_perm}")
    if abs(false_positive_weight + false_negative_weight - 1.0) > 1e-9:
        raise ValueError("false-positive and false-negative weights must sum to 1")
    below = np.linspace(0.0, threshold, _GRID)
    above = np.linspace(threshold, 1.0, _GRID)
    best: tuple[float, LshParams] | None = None
    for rows in range(1, num_perm + 1):
        most = num_perm // rows  # bands 1..most; row k of a cumprod holds the (k+1)-th power
        miss_below = np.cumprod(np.broadcast_to(1.0 - below**rows, (most, _GRID)), axis=0)
        miss_above = np.cumprod(np.broadcast_to(1.0 - above**rows, (most, _GRID)), axis=0)
        error = (false_positive_weight * _areas(1.0 - miss_below, below)
                 + false_negative_weight * _areas(miss_above, above))
        k = int(np.argmin(error))
        if best is None or error[k] < best[0] or (error[k] == best[0] and k + 1 < best[1].bands):
            best = (float(error[k]), LshParams(k + 1, rows))
    assert best is not None
    return best[1]


def _areas(y: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Trapezoidal integrals of each row of ``y`` (shape (k, len(x))) over ``x``."""
    return np.sum((y[:, 1:] + y[:, :-1]) * np.diff(x), axis=1) / 2.0


def band_hashes(signatures: np.ndarray, params: LshParams) -> np.ndarray:
    """The bucket of each document in each band.

    Args:
        signatures: uint64, shape (n_docs, num_perm) with num_perm >= bands * rows.

    Returns:
        uint64, shape (n_docs, bands): band j's bucket is the ``combine`` of its rows
        ``signatures[:, j*rows:(j+1)*rows]``; equal rows give equal buckets.

    Raises:
        ValueError: the signatures are shorter than bands * rows.
    """
    width = params.bands * params.rows
    if signatures.shape[1] < width:
        raise ValueError(
            f"signatures of {signatures.shape[1]} slots cannot hold "
            f"{params.bands} bands x {params.rows} rows"
        )
    rows = signatures[:, :width].reshape(len(signatures), params.bands, params.rows)
    acc = rows[:, :, 0].copy()
    for k in range(1, params.rows):
        acc = combine(acc, rows[:, :, k])
    return acc


def bucket_ids(band_hashes: np.ndarray) -> np.ndarray:
    """One id per (document, band) bucket, distinct across bands.

    Args:
        band_hashes: uint64, shape (n_docs, bands), from ``band_hashes``.

    Returns:
        uint64, shape (n_docs, bands): ``combine(band hash, band index)``, so that equal
        rows in two different bands give two different buckets.
    """
    bands = np.arange(band_hashes.shape[1], dtype=np.uint64)
    return combine(band_hashes, np.broadcast_to(bands, band_hashes.shape))


#: Folded into a seq for its copy bucket id; far above any band index, so that a copy
#: bucket and a band bucket share an id only by a 64-bit hash collision.
COPY_TAG = np.uint64(0x636F7079 << 32)  # "copy"


def copy_bucket_ids(seqs: np.ndarray) -> np.ndarray:
    """The id of each document's copy bucket (``neardup.core.decide.CopyBuckets``), in
    the same index as the band buckets.

    Args:
        seqs: uint64, shape (n,): document seqs.

    Returns:
        uint64, shape (n,): ``combine(seq, COPY_TAG)``.
    """
    seqs = np.asarray(seqs, dtype=np.uint64)
    return combine(seqs, np.full(len(seqs), COPY_TAG, dtype=np.uint64))


@lru_cache(maxsize=64)
def recall_params(similarity: float, num_perm: int = 128, recall: float = 0.995) -> LshParams:
    """The banding with the most rows (the fewest false candidates) whose S-curve still
    makes a pair of Jaccard ``similarity`` a candidate with probability at least
    ``recall``, each band as wide as ``num_perm`` allows (bands = num_perm // rows); one
    row per band (every slot a bucket) if none reaches it.

    Used where the Jaccard similarity of the pairs sought is known only from below: the
    score floor (``EngineSettings.score_floor``), and containment: a set A contained to at least t in a set B at most R times larger
    has a Jaccard similarity of at least t / (1 + R - t) (the size-bound conversion of
    LSH Ensemble, Zhu, Nargesian, Pu, Miller, VLDB 2016).

    Raises:
        ValueError: similarity outside (0, 1), num_perm < 1, or recall outside (0, 1).
    """
    if not 0.0 < similarity < 1.0:
        raise ValueError(f"similarity must lie in (0, 1), not {similarity}")
    if num_perm < 1:
        raise ValueError(f"num_perm must be at least 1, not {num_perm}")
    if not 0.0 < recall < 1.0:
        raise ValueError(f"recall must lie in (0, 1), not {recall}")
    for rows in range(num_perm, 1, -1):
        params = LshParams(num_perm // rows, rows)
        if params.probability(similarity) >= recall:
            return params
    return LshParams(num_perm, 1)
