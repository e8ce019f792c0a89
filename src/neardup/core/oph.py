"""One-permutation hashing with optimal densification: a MinHash signature in one hash
per shingle instead of ``num_perm``.

One-permutation hashing (Li, Owen, Zhang, "One permutation hashing", NIPS 2012) hashes
each shingle once, sends it to one of ``num_perm`` bins by the high bits of its hash, and
keeps the minimum hash in each bin. Bins that no shingle reached are filled by optimal
densification (Shrivastava, "Optimal densification for fast and accurate minwise
hashing", ICML 2017): an empty bin j takes the value of bin probe(j, t) for the first
t = 1, 2, ... whose bin was reached, where probe is a fixed seeded hash of (j, t), the
same for every document. Two documents then agree in a slot with probability equal to
their Jaccard similarity, and the variance is close to that of classic MinHash with as
many permutations, at 1 / num_perm of its hashing cost.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from neardup.core.aot import kernel

from neardup.core.hashing import M1, M2, mix64
from neardup.core.shingle import ShingleBatch

#: A slot no shingle reached; the 63-bit hash values never take it.
EMPTY = np.uint64(np.iinfo(np.uint64).max)
#: Probes tried per empty bin; a bin still empty after them (a document of one or two
#: shingles, with probability about (1 - 1/num_perm)^MAX_PROBES) takes the value of the
#: document's first reached bin.
MAX_PROBES = 4096


@kernel("uint64[:, ::1](uint64[::1], int64[::1], int64[::1], int64)")
def _bin_minima(h: np.ndarray, bins: np.ndarray, offsets: np.ndarray, k: int) -> np.ndarray:  # pragma: no cover - compiled
    """uint64, shape (n_docs, k): the least ``h`` of each document in each bin
    (``EMPTY`` where none), documents being the ranges of ``offsets``."""
    n_docs = len(offsets) - 1
    raw = np.full((n_docs, k), EMPTY, dtype=np.uint64)
    for d in range(n_docs):
        for i in range(offsets[d], offsets[d + 1]):
            if h[i] < raw[d, bins[i]]:
                raw[d, bins[i]] = h[i]
    return raw


@kernel
def _probe(j: int, t: int, salt: np.uint64, k: int) -> int:  # pragma: no cover - compiled
    """The bin that empty bin ``j`` reads at its ``t``-th probe (t = 1, 2, ...):
    SplitMix64's finaliser of ``(j << 32 | t) ^ salt``, modulo ``k``; the scalar form of
    ``hashing.mix64`` (``OnePermutationHasher.probe_table`` is the same in numpy)."""
    x = ((np.uint64(j) << np.uint64(32)) | np.uint64(t)) ^ salt
    x = x ^ (x >> np.uint64(30))
    x = x * M1
    x = x ^ (x >> np.uint64(27))
    x = x * M2
    x = x ^ (x >> np.uint64(31))
    return np.int64(x % np.uint64(k))


@kernel("uint64[:, ::1](uint64[:, ::1], boolean[::1], uint64)")
def _densify(raw: np.ndarray, nonempty: np.ndarray, salt: np.uint64) -> np.ndarray:  # pragma: no cover - compiled
    """Fill each empty bin j of a non-empty document from bin ``_probe(j, t)`` for the
    first t up to ``MAX_PROBES`` that was reached, else from the document's first reached
    bin."""
    out = raw.copy()
    n_docs, k = raw.shape
    for d in range(n_docs):
        if not nonempty[d]:
            continue
        first = -1
        for j in range(k):
            if raw[d, j] != EMPTY:
                first = j
                break
        for j in range(k):
            if raw[d, j] != EMPTY:
                continue
            out[d, j] = raw[d, first]
            for t in range(1, MAX_PROBES + 1):
                src = _probe(j, t, salt, k)
                if raw[d, src] != EMPTY:
                    out[d, j] = raw[d, src]
                    break
    return out


@dataclass(frozen=True)
class OnePermutationHasher:
    """Deterministic one-permutation MinHash with optimal densification.

    Attributes:
        num_perm: signature length (number of bins), at least 1.
        seed: seeds the shingle hash and the densification probes.
    """

    num_perm: int = 128
    seed: int = 1
    _salt: np.uint64 = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.num_perm < 1:
            raise ValueError(f"num_perm must be at least 1, not {self.num_perm}")
        rng = np.random.Generator(np.random.PCG64(self.seed))
        salt = rng.integers(0, np.iinfo(np.uint64).max, dtype=np.uint64, endpoint=True)
        object.__setattr__(self, "_salt", salt)

    def probe_table(self) -> np.ndarray:
        """The densification probes as one table: int64, shape (num_perm, MAX_PROBES),
        row j the bins empty bin j reads in turn (8 * num_perm * MAX_PROBES bytes: the
        kernel computes each probe when it needs it instead)."""
        keys = (np.arange(self.num_perm, dtype=np.uint64)[:, None] << np.uint64(32)) | np.arange(
            1, MAX_PROBES + 1, dtype=np.uint64
        )[None, :]
        return (mix64(keys ^ self._salt) % np.uint64(self.num_perm)).astype(np.int64)

    def signatures(self, batch: ShingleBatch) -> np.ndarray:
        """Signatures of every document of ``batch``.

        Returns:
            uint64, shape (n_docs, num_perm), values below 2^63; a document with no
            shingle gets ``EMPTY`` in every slot.
        """
        k = self.num_perm
        h = mix64(batch.hashes ^ self._salt) >> np.uint64(1)
        bins = ((h >> np.uint64(31)) * np.uint64(k)) >> np.uint64(32)  # Lemire's range map
        raw = _bin_minima(h, bins.astype(np.int64), batch.offsets, k)
        return self._densify(raw, batch.counts > 0)

    def _densify(self, raw: np.ndarray, nonempty: np.ndarray) -> np.ndarray:
        return _densify(raw, nonempty, self._salt)

    def signature(self, shingle_hashes: np.ndarray) -> np.ndarray:
        """The signature (uint64, shape (num_perm,)) of one set of shingle hashes."""
        hashes = np.asarray(shingle_hashes, dtype=np.uint64)
        return self.signatures(ShingleBatch(hashes, np.array([0, len(hashes)], dtype=np.int64)))[0]
