"""The retention window: which stored documents are still candidates.

A document is *held* while it is among the ``documents`` most recent ones (by arrival
sequence) and its time is later than the *watermark* minus ``seconds``. The watermark is
the latest document time seen so far, in arrival order; it only grows, so a document
that has expired stays expired even when the times arrive out of order (Kafka record
timestamps of several partitions): a late document with an old time is still compared
with what is held, but is itself expired at once if it is older than the window.

Document ``x`` (seq ``x``, watermark ``w_x`` including its own time) is compared only
with the documents ``s < x`` held for it::

    s >= x - documents    and    time[s] >= w_x - seconds

Times are int64 milliseconds since the Unix epoch (Kafka's unit).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np

#: The watermark of a store that has seen no document.
NO_TIME = -(1 << 62)

_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d|w)?\s*$")


def parse_duration(text: str) -> float:
    """Seconds of a duration such as ``72h``, ``7d``, ``30m``, ``45s``, ``500ms``, ``1w``
    or a plain number of seconds.

    Raises:
        ValueError: not a positive duration.
    """
    match = _DURATION.match(str(text))
    if not match:
        raise ValueError(f"not a duration: {text!r} (e.g. 72h, 7d, 30m, 3600)")
    seconds = float(match.group(1)) * _UNITS[match.group(2) or "s"]
    if seconds <= 0:
        raise ValueError(f"a retention of {text!r} keeps nothing; it must be positive")
    return seconds


def format_duration(seconds: float) -> str:
    """``seconds`` in the largest unit that divides it: ``72h``, ``7d``, ``90s``."""
    for unit in ("w", "d", "h", "m", "s"):
        count = seconds / _UNITS[unit]
        if count >= 1 and count == int(count):
            return f"{int(count)}{unit}"
    return f"{seconds:g}s"


@dataclass(frozen=True)
class Retention:
    """How long documents stay candidates; None keeps them (the default keeps all).

    Attributes:
        documents: only the ``documents`` most recent documents are candidates.
        seconds: a document stops being a candidate once it is older than this, in
            seconds, against the watermark (see the module docstring): held while
            its time is at least the watermark minus ``seconds``.

    Raises:
        ValueError: a bound below 1 document or not above 0 seconds.
    """

    documents: int | None = None
    seconds: float | None = None

    def __post_init__(self) -> None:
        if self.documents is not None and self.documents < 1:
            raise ValueError(f"retention of {self.documents} documents: it must be at least 1")
        if self.seconds is not None and not self.seconds > 0:
            raise ValueError(f"retention of {self.seconds} seconds: it must be positive")

    @property
    def active(self) -> bool:
        return self.documents is not None or self.seconds is not None

    @property
    def millis(self) -> int | None:
        return None if self.seconds is None else int(round(self.seconds * 1000))

    def to_dict(self) -> dict[str, Any]:
        return {"documents": self.documents, "seconds": self.seconds}

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> Retention:
        data = data or {}
        return cls(data.get("documents"), data.get("seconds"))

    def describe(self) -> str:
        parts = []
        if self.documents is not None:
            parts.append(f"the last {self.documents:,} documents")
        if self.seconds is not None:
            parts.append(format_duration(self.seconds))
        return " and ".join(parts) if parts else "everything"

    def shorter_than(self, other: Retention) -> bool:
        """Whether some bound of this window is narrower than ``other``'s."""
        def narrower(a: float | None, b: float | None) -> bool:
            return a is not None and (b is None or a < b)
        return narrower(self.documents, other.documents) or narrower(self.seconds, other.seconds)


def watermarks(previous: int, times: np.ndarray) -> np.ndarray:
    """int64, shape (n,): the watermark at each of ``times`` (int64 ms, arrival order),
    starting from ``previous``."""
    out = np.maximum.accumulate(np.asarray(times, dtype=np.int64)) if len(times) else np.zeros(0, np.int64)
    return np.maximum(out, previous)


def until(seqs: np.ndarray, times: np.ndarray, first_seq: int, marks: np.ndarray,
          retention: Retention) -> np.ndarray:
    """For each document ``seqs[i]`` (time ``times[i]``), the first document of a batch
    (0 … n - 1, seqs ``first_seq`` on, watermarks ``marks``) for which it is no longer
    held; ``n`` when it is held for the whole batch.

    Args:
        seqs: uint64 or int64, shape (k,).
        times: int64 ms, shape (k,).
        first_seq: the batch's first seq.
        marks: int64, shape (n,): the batch's watermarks (``watermarks``), ascending.

    Returns:
        int64, shape (k,).
    """
    n = len(marks)
    out = np.full(len(seqs), n, dtype=np.int64)
    if retention.documents is not None:
        by_count = np.asarray(seqs, dtype=np.int64) - first_seq + retention.documents + 1
        np.minimum(out, np.clip(by_count, 0, n), out=out)
    if retention.millis is not None:
        by_time = np.searchsorted(marks, np.asarray(times, dtype=np.int64) + retention.millis, side="right")
        np.minimum(out, by_time, out=out)
    return out


def held(seqs: np.ndarray, times: np.ndarray, next_seq: int, watermark: int,
         retention: Retention) -> np.ndarray:
    """bool, shape (k,): which of ``seqs`` (times ``times``, int64 ms) are held for the
    next document (seq ``next_seq``) before its own time moves the ``watermark``."""
    out = np.ones(len(seqs), dtype=bool)
    if retention.documents is not None:
        out &= np.asarray(seqs, dtype=np.int64) >= next_seq - retention.documents
    if retention.millis is not None:
        out &= np.asarray(times, dtype=np.int64) >= watermark - retention.millis
    return out
