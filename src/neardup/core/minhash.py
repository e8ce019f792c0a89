"""MinHash signatures of a batch of shingle sets.

Classic MinHash (Broder, "On the resemblance and containment of documents", 1997) with
``num_perm`` hash functions from the universal family h_i(x) = (a_i * x + b_i) mod p,
p = 2^61 - 1 (Carter and Wegman 1979), the family of datasketch's MinHash before its
2.0 ("legacy" scheme there). Unlike datasketch's uint64 numpy product, which wraps
around 2^64, the products here are computed exactly modulo p (the 61-bit operands are
split into 31- and 30-bit limbs), and the values keep all 61 bits instead of being cut
to 32. A signature depends only on the shingle hashes, ``num_perm`` and ``seed``: the
same on every process and machine. The inputs are 64-bit xxh3 / SplitMix64 shingle
hashes, already well mixed, as a 2-universal family needs.

For two sets A and B, P[min h_i(A) == min h_i(B)] ~= J(A, B), so the share of equal slots
of two signatures is an unbiased estimate of their Jaccard similarity with standard error
sqrt(J (1 - J) / num_perm).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from neardup.core.oph import OnePermutationHasher
from neardup.core.shingle import ShingleBatch

MERSENNE_61 = (1 << 61) - 1
_P = np.uint64(MERSENNE_61)
_LOW31 = np.uint64((1 << 31) - 1)
_LOW30 = np.uint64((1 << 30) - 1)
_U1, _U30, _U31, _U61 = (np.uint64(k) for k in (1, 30, 31, 61))
#: A signature slot no shingle reached (an empty set); never a value of h_i.
EMPTY = np.uint64(MERSENNE_61)
# Shingles hashed per block: a block's (shingles, num_perm) products stay near the cache.
_BLOCK_SHINGLES = 4096


def _mod61(x: np.ndarray) -> np.ndarray:
    """x mod (2^61 - 1) for uint64 ``x`` < 2^64 - 2^61 (one fold, one conditional subtract)."""
    x = (x & _P) + (x >> _U61)
    return np.where(x >= _P, x - _P, x)


def mulmod61_add(a: np.ndarray, x: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(a * x + b) mod (2^61 - 1), exactly, for uint64 arrays with values < 2^61.

    ``a``, ``x`` and ``b`` broadcast against each other. With a = a1 2^31 + a0 and
    x = x1 2^31 + x0, a x = a1 x1 2^62 + (a1 x0 + a0 x1) 2^31 + a0 x0, and 2^61 = 1 mod p
    turns each term into a sum of values below 2^62, so nothing overflows 64 bits.
    """
    a1, a0 = a >> _U31, a & _LOW31
    x1, x0 = x >> _U31, x & _LOW31
    high = (a1 * x1) << _U1  # 2^62 = 2 (mod p); < 2^61
    mid = a1 * x0 + a0 * x1  # < 2^62
    mid = (mid >> _U30) + ((mid & _LOW30) << _U31)  # mid * 2^31 (mod p); < 2^61 + 2^32
    return _mod61(high + mid + a0 * x0 + b)


@dataclass(frozen=True)
class MinHasher:
    """Deterministic classic MinHash with ``num_perm`` permutations.

    Attributes:
        num_perm: signature length (number of hash functions), at least 1.
        seed: seeds the parameters a_i in [1, p) and b_i in [0, p) (numpy PCG64).
    """

    num_perm: int = 128
    seed: int = 1
    a: np.ndarray = field(init=False, repr=False, compare=False)
    b: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.num_perm < 1:
            raise ValueError(f"num_perm must be at least 1, not {self.num_perm}")
        rng = np.random.Generator(np.random.PCG64(self.seed))
        a = rng.integers(1, MERSENNE_61, size=self.num_perm, dtype=np.uint64)
        b = rng.integers(0, MERSENNE_61, size=self.num_perm, dtype=np.uint64)
        object.__setattr__(self, "a", a)
        object.__setattr__(self, "b", b)

    def signatures(self, batch: ShingleBatch) -> np.ndarray:
        """MinHash signatures of every document of ``batch``.

        Returns:
            uint64, shape (n_docs, num_perm), values in [0, 2^61 - 1); a document with no
            shingle gets ``EMPTY`` in every slot.
        """
        n_docs = len(batch)
        out = np.full((n_docs, self.num_perm), EMPTY, dtype=np.uint64)
        x = _mod61(batch.hashes)
        offsets = batch.offsets
        a, b = self.a[None, :], self.b[None, :]
        first = 0
        while first < n_docs:
            # Whole documents, about _BLOCK_SHINGLES shingles (at least one document).
            last = int(np.searchsorted(offsets, offsets[first] + _BLOCK_SHINGLES, "right")) - 1
            last = min(max(last, first + 1), n_docs)
            lo, hi = int(offsets[first]), int(offsets[last])
            if hi > lo:
                h = mulmod61_add(a, x[lo:hi, None], b)
                counts = np.diff(offsets[first : last + 1])
                nonempty = counts > 0
                starts = offsets[first:last][nonempty] - lo
                out[first:last][nonempty] = np.minimum.reduceat(h, starts, axis=0)
            first = last
        return out

    def signature(self, shingle_hashes: np.ndarray) -> np.ndarray:
        """The signature (uint64, shape (num_perm,)) of one set of shingle hashes (uint64)."""
        hashes = np.asarray(shingle_hashes, dtype=np.uint64)
        batch = ShingleBatch(hashes, np.array([0, len(hashes)], dtype=np.int64))
        return self.signatures(batch)[0]


def jaccard_estimate(sig_a: np.ndarray, sig_b: np.ndarray) -> np.ndarray:
    """Share of equal slots: the MinHash estimate of Jaccard similarity.

    Args:
        sig_a, sig_b: uint64 signatures, shapes (..., num_perm) that broadcast.

    Returns:
        float64, the broadcast shape without the last axis, values in [0, 1].
    """
    return np.mean(sig_a == sig_b, axis=-1)


def make_hasher(scheme: str, num_perm: int, seed: int) -> MinHasher | OnePermutationHasher:
    """The signature function of ``scheme``: ``"classic"`` or ``"oph"``.

    Raises:
        ValueError: another scheme.
    """
    if scheme == "classic":
        return MinHasher(num_perm, seed)
    if scheme == "oph":
        return OnePermutationHasher(num_perm, seed)
    raise ValueError(f"unknown MinHash scheme {scheme!r}")
