"""One-permutation hashing with optimal densification, against exact Jaccard and classic MinHash."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from neardup.core.hashing import mix64
from neardup.core.minhash import MinHasher, jaccard_estimate, make_hasher
from neardup.core.oph import EMPTY, OnePermutationHasher
from neardup.core.shingle import ShingleBatch


def _pair(rng: np.random.Generator, size: int) -> tuple[np.ndarray, np.ndarray, float]:
    universe = rng.integers(0, 2**63, size=3 * size, dtype=np.uint64)
    shift = int(rng.integers(0, size + 1))
    a, b = universe[:size], universe[shift : shift + size]
    sa, sb = set(a.tolist()), set(b.tolist())
    return a, b, len(sa & sb) / len(sa | sb)


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_mean_absolute_error_at_most_003_like_classic(seed):
    rng = np.random.default_rng(seed)
    oph, classic = OnePermutationHasher(128, 1), MinHasher(128, 1)
    errors = {"oph": [], "classic": []}
    for _ in range(200):
        a, b, exact = _pair(rng, int(rng.integers(100, 600)))
        errors["oph"].append(abs(jaccard_estimate(oph.signature(a), oph.signature(b)) - exact))
        errors["classic"].append(abs(jaccard_estimate(classic.signature(a), classic.signature(b)) - exact))
    assert np.mean(errors["oph"]) <= 0.03
    assert np.mean(errors["oph"]) <= np.mean(errors["classic"]) + 0.01


def test_unbiased_on_small_sets():
    """Densification fills most slots of a 10-shingle document; the estimate stays unbiased."""
    rng = np.random.default_rng(5)
    oph = OnePermutationHasher(128, 1)
    errors = []
    for _ in range(2000):
        a, b, exact = _pair(rng, 10)
        errors.append(jaccard_estimate(oph.signature(a), oph.signature(b)) - exact)
    assert abs(np.mean(errors)) < 0.01


def test_deterministic_and_seeded():
    hashes = np.random.default_rng(1).integers(0, 2**63, size=300, dtype=np.uint64)
    a = OnePermutationHasher(128, 7).signature(hashes)
    assert np.array_equal(a, OnePermutationHasher(128, 7).signature(hashes))
    assert np.array_equal(a, OnePermutationHasher(128, 7).signature(hashes[::-1]))  # order-free
    assert not np.array_equal(a, OnePermutationHasher(128, 8).signature(hashes))
    assert a.dtype == np.uint64 and a.shape == (128,) and not (a == EMPTY).any()


def test_batch_equals_single_and_empty_documents_stay_empty():
    rng = np.random.default_rng(2)
    docs = [rng.integers(0, 2**63, size=n, dtype=np.uint64) for n in (1, 0, 5, 400)]
    offsets = np.concatenate([[0], np.cumsum([len(d) for d in docs])]).astype(np.int64)
    oph = OnePermutationHasher(64, 3)
    batch = oph.signatures(ShingleBatch(np.concatenate(docs), offsets))
    assert batch.shape == (4, 64)
    assert (batch[1] == EMPTY).all()
    for i in (0, 2, 3):
        assert np.array_equal(batch[i], oph.signature(docs[i]))
    assert len(set(batch[0].tolist())) == 1  # one shingle fills every slot with its value


def test_make_hasher():
    assert isinstance(make_hasher("oph", 32, 1), OnePermutationHasher)
    assert isinstance(make_hasher("classic", 32, 1), MinHasher)


def _reference_signatures(hasher: OnePermutationHasher, batch: ShingleBatch) -> np.ndarray:
    """The definition in plain numpy: least hash per bin, then each empty bin of a
    non-empty document from its first reached probe, else from the first reached bin."""
    k = hasher.num_perm
    h = mix64(batch.hashes ^ hasher._salt) >> np.uint64(1)
    bins = (((h >> np.uint64(31)) * np.uint64(k)) >> np.uint64(32)).astype(np.int64)
    docs = np.repeat(np.arange(len(batch)), batch.counts)
    raw = np.full(len(batch) * k, EMPTY, dtype=np.uint64)
    np.minimum.at(raw, docs * k + bins, h)
    raw = raw.reshape(len(batch), k)
    out = raw.copy()
    table = hasher.probe_table()
    for d in np.flatnonzero(batch.counts > 0):
        reached = np.flatnonzero(raw[d] != EMPTY)
        for j in np.flatnonzero(raw[d] == EMPTY):
            probes = table[j]
            hit = probes[raw[d, probes] != EMPTY]
            out[d, j] = raw[d, hit[0] if len(hit) else reached[0]]
    return out


@pytest.mark.parametrize("num_perm", [1, 16, 128])
def test_signatures_follow_the_definition(num_perm: int) -> None:
    rng = np.random.default_rng(num_perm)
    counts = np.array([0, 1, 2, 3, 50, 0, 400, 128, 5])
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    batch = ShingleBatch(rng.integers(0, 2**64, int(offsets[-1]), dtype=np.uint64), offsets)
    hasher = OnePermutationHasher(num_perm, seed=5)
    assert np.array_equal(hasher.signatures(batch), _reference_signatures(hasher, batch))
