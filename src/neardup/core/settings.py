"""The engine's settings: the ones that shape the stored state, and the threshold."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from neardup.core.lsh import LshParams, optimal_params
from neardup.core.normalize import TextNorm
from neardup.core.shingle import Shingling


@dataclass(frozen=True)
class EngineSettings:
    """Everything the detector needs to turn texts into verdicts.

    Attributes:
        norm: text normalisation.
        shingling: word or character n-grams.
        num_perm: MinHash signature length.
        seed: MinHash seed.
        threshold: Jaccard similarity at or above which a candidate is a duplicate.
        lsh: the banding; None chooses ``optimal_params(threshold, num_perm)``.
        max_bucket_size: documents kept per band bucket; later arrivals in a full bucket
            are still compared with its documents but not added (bounds hot buckets made
            by boilerplate).
    """

    norm: TextNorm = TextNorm()
    shingling: Shingling = Shingling()
    num_perm: int = 128
    seed: int = 1
    threshold: float = 0.8
    lsh: LshParams | None = None
    max_bucket_size: int = 256
    _resolved: LshParams = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not 0.0 < self.threshold <= 1.0:
            raise ValueError(f"threshold must lie in (0, 1], not {self.threshold}")
        if self.max_bucket_size < 1:
            raise ValueError("max_bucket_size must be at least 1")
        lsh = self.lsh or optimal_params(min(self.threshold, 0.99), self.num_perm)
        if lsh.bands * lsh.rows > self.num_perm:
            raise ValueError(
                f"{lsh.bands} bands x {lsh.rows} rows need more than num_perm={self.num_perm}"
            )
        object.__setattr__(self, "_resolved", lsh)

    @property
    def bands(self) -> LshParams:
        """The banding in force (given, or optimal for the threshold)."""
        return self._resolved

    def state_shape(self) -> dict[str, Any]:
        """The settings stored with the state; a store refuses any other values."""
        return {
            "normalization": self.norm.to_dict(),
            "shingling": str(self.shingling),
            "num_perm": self.num_perm,
            "seed": self.seed,
            "bands": self.bands.bands,
            "rows": self.bands.rows,
        }
