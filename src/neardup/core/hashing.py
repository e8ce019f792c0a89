"""64-bit integer mixing shared by shingling and banding (vectorised over numpy arrays).

``mix64`` is the finaliser of SplitMix64 (Steele, Lea, Flood, "Fast splittable
pseudorandom number generators", OOPSLA 2014), a bijection on 64-bit integers with full
avalanche. ``combine`` folds a sequence of hashes into one, order-sensitively.
"""

from __future__ import annotations

import numpy as np

#: SplitMix64's finaliser multipliers (also the scalar kernel ``neardup.core.oph._probe``).
M1 = np.uint64(0xBF58476D1CE4E5B9)
M2 = np.uint64(0x94D049BB133111EB)
_S30 = np.uint64(30)
_S27 = np.uint64(27)
_S31 = np.uint64(31)
# An odd multiplier (the 64-bit golden ratio) so that combine(a, b) != combine(b, a).
_K = np.uint64(0x9E3779B97F4A7C15)


def mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser of ``x`` (uint64, any shape); returns a new uint64 array."""
    x = x ^ (x >> _S30)
    x *= M1
    x ^= x >> _S27
    x *= M2
    x ^= x >> _S31
    return x


def combine(acc: np.ndarray, h: np.ndarray) -> np.ndarray:
    """Fold hash ``h`` into the running hash ``acc`` (uint64 arrays of one shape)."""
    return mix64(acc * _K + h)
