"""XXH3-64 (seed 0, default secret) of many byte spans at once, compiled with numba; and
the fold of token hashes into n-gram hashes (``ngram_hashes``).

The shingle hash of a word token is xxh3-64 of its UTF-8 bytes (``xxhash.xxh3_64_intdigest``).
Called once per token from Python, the library costs about 50 ns of call overhead per
token; here the short-input paths of XXH3 (inputs of 0 to 128 bytes, which is every word
token but pathological ones) run in one compiled loop over a batch's bytes. Longer spans
are hashed by the ``xxhash`` library, so every span gets exactly the library's value; the
tests compare the two on random inputs of every length class.

Source: Yann Collet, xxHash, XXH3 (``xxhash.h`` v0.8: ``XXH3_len_1to3_64b``,
``XXH3_len_4to8_64b``, ``XXH3_len_9to16_64b``, ``XXH3_len_17to128_64b``, ``XXH3_avalanche``,
``XXH3_rrmxmx``, ``XXH64_avalanche``, and the default secret ``XXH3_kSecret``).
"""

from __future__ import annotations

import numpy as np
import xxhash
from neardup.core.aot import kernel
from neardup.core.arrays import read_only
from neardup.core.hashing import _K as _FOLD_K
from neardup.core.hashing import M1 as _FOLD_M1
from neardup.core.hashing import M2 as _FOLD_M2

#: The compiled paths cover spans up to this many bytes.
MAX_SHORT = 128

_SECRET = np.frombuffer(bytes.fromhex(
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671f"
    "cb79e64eccc0e578825ad07dccff7221b8084674f743248ee03590e6813a264c"
    "3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364"
), dtype=np.uint8)


def _secret_word(offset: int, width: int = 8) -> np.uint64:
    """The ``width``-byte little-endian integer at ``offset`` in the secret: a constant of
    the compiled code (read once here, not specialised per offset by numba)."""
    return np.uint64(int.from_bytes(_SECRET[offset : offset + width].tobytes(), "little"))


#: The secret's words the short paths use, by byte offset.
_K = {offset: _secret_word(offset) for offset in range(0, 128, 8)}
_BITFLIP_1TO3 = np.uint64(int(_secret_word(0, 4)) ^ int(_secret_word(4, 4)))
_BITFLIP_4TO8 = np.uint64(int(_K[8]) ^ int(_K[16]))
_EMPTY = np.uint64(int(_secret_word(56)) ^ int(_secret_word(64)))
_LO_9TO16 = np.uint64(int(_K[24]) ^ int(_K[32]))
_HI_9TO16 = np.uint64(int(_K[40]) ^ int(_K[48]))
_K0, _K8, _K16, _K24, _K32, _K40, _K48, _K56 = (_K[o] for o in range(0, 64, 8))
_K64, _K72, _K80, _K88, _K96, _K104, _K112, _K120 = (_K[o] for o in range(64, 128, 8))

_P32_1 = np.uint64(0x9E3779B1)
_P64_1 = np.uint64(0x9E3779B185EBCA87)
_P64_2 = np.uint64(0xC2B2AE3D27D4EB4F)
_P64_3 = np.uint64(0x165667B19E3779F9)
_MX1 = np.uint64(0x165667919E3779F9)
_MX2 = np.uint64(0x9FB21C651E98DF25)
_M32 = np.uint64(0xFFFFFFFF)


@kernel
def _read(data: np.ndarray, p: int, width: int) -> np.uint64:  # pragma: no cover - compiled
    """The ``width``-byte little-endian integer at ``data[p]``."""
    v = np.uint64(0)
    for k in range(width):
        v |= np.uint64(data[p + k]) << np.uint64(8 * k)
    return v


@kernel
def _swap32(x: np.uint64) -> np.uint64:  # pragma: no cover - compiled
    return (((x & np.uint64(0xFF)) << np.uint64(24)) | ((x & np.uint64(0xFF00)) << np.uint64(8))
            | ((x >> np.uint64(8)) & np.uint64(0xFF00)) | ((x >> np.uint64(24)) & np.uint64(0xFF)))


@kernel
def _swap64(x: np.uint64) -> np.uint64:  # pragma: no cover - compiled
    return (_swap32(x & _M32) << np.uint64(32)) | _swap32(x >> np.uint64(32))


@kernel
def _rotl(x: np.uint64, r: int) -> np.uint64:  # pragma: no cover - compiled
    return (x << np.uint64(r)) | (x >> np.uint64(64 - r))


@kernel
def _mul128_fold64(a: np.uint64, b: np.uint64) -> np.uint64:  # pragma: no cover - compiled
    a_lo, a_hi = a & _M32, a >> np.uint64(32)
    b_lo, b_hi = b & _M32, b >> np.uint64(32)
    lo_lo = a_lo * b_lo
    hi_lo = a_hi * b_lo
    lo_hi = a_lo * b_hi
    hi_hi = a_hi * b_hi
    cross = (lo_lo >> np.uint64(32)) + (hi_lo & _M32) + lo_hi
    upper = (hi_lo >> np.uint64(32)) + (cross >> np.uint64(32)) + hi_hi
    lower = (cross << np.uint64(32)) | (lo_lo & _M32)
    return lower ^ upper


@kernel
def _xxh64_avalanche(h: np.uint64) -> np.uint64:  # pragma: no cover - compiled
    h ^= h >> np.uint64(33)
    h *= _P64_2
    h ^= h >> np.uint64(29)
    h *= _P64_3
    h ^= h >> np.uint64(32)
    return h


@kernel
def _avalanche(h: np.uint64) -> np.uint64:  # pragma: no cover - compiled
    h ^= h >> np.uint64(37)
    h *= _MX1
    h ^= h >> np.uint64(32)
    return h


@kernel
def _mix16(data: np.ndarray, p: int, k0: np.uint64, k1: np.uint64) -> np.uint64:  # pragma: no cover - compiled
    """XXH3_mix16B with the secret's two words at its offset, ``k0`` and ``k1``."""
    return _mul128_fold64(_read(data, p, 8) ^ k0, _read(data, p + 8, 8) ^ k1)


@kernel
def _xxh3_short(data: np.ndarray, p: int, n: int) -> np.uint64:  # pragma: no cover - compiled
    length = np.uint64(n)
    if n == 0:
        return _xxh64_avalanche(_EMPTY)
    if n <= 3:
        c1 = np.uint64(data[p])
        c2 = np.uint64(data[p + (n >> 1)])
        c3 = np.uint64(data[p + n - 1])
        combined = (c1 << np.uint64(16)) | (c2 << np.uint64(24)) | c3 | (length << np.uint64(8))
        return _xxh64_avalanche(combined ^ _BITFLIP_1TO3)
    if n <= 8:
        input1 = _read(data, p, 4)
        input2 = _read(data, p + n - 4, 4)
        x = (input2 + (input1 << np.uint64(32))) ^ _BITFLIP_4TO8
        # XXH3_rrmxmx
        x ^= _rotl(x, 49) ^ _rotl(x, 24)
        x *= _MX2
        x ^= (x >> np.uint64(35)) + length
        x *= _MX2
        return x ^ (x >> np.uint64(28))
    if n <= 16:
        lo = _read(data, p, 8) ^ _LO_9TO16
        hi = _read(data, p + n - 8, 8) ^ _HI_9TO16
        return _avalanche(length + _swap64(lo) + hi + _mul128_fold64(lo, hi))
    acc = length * _P64_1
    if n > 32:
        if n > 64:
            if n > 96:
                acc += _mix16(data, p + 48, _K96, _K104)
                acc += _mix16(data, p + n - 64, _K112, _K120)
            acc += _mix16(data, p + 32, _K64, _K72)
            acc += _mix16(data, p + n - 48, _K80, _K88)
        acc += _mix16(data, p + 16, _K32, _K40)
        acc += _mix16(data, p + n - 32, _K48, _K56)
    acc += _mix16(data, p, _K0, _K8)
    acc += _mix16(data, p + n - 16, _K16, _K24)
    return _avalanche(acc)


@kernel("uint64[::1](Array(uint8, 1, 'C', readonly=True), int64[::1], int64[::1])")
def _hash_spans(data: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:  # pragma: no cover - compiled
    out = np.zeros(len(starts), dtype=np.uint64)
    for i in range(len(starts)):
        n = ends[i] - starts[i]
        if n <= MAX_SHORT:
            out[i] = _xxh3_short(data, starts[i], n)
    return out


def xxh3_spans(data: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """xxh3-64 (seed 0) of the byte spans ``data[starts[i]:ends[i]]``.

    Args:
        data: uint8, shape (n_bytes,).
        starts, ends: int64, shape (n_spans,), with 0 <= start <= end <= n_bytes.

    Returns:
        uint64, shape (n_spans,): ``xxhash.xxh3_64_intdigest`` of each span.

    Raises:
        ValueError: a span lies outside ``data`` or ends before it starts.
    """
    # One layout whatever the caller passes (a strided or a one-element view, a writable or a
    # read-only buffer), so that one compiled kernel serves every call, the prebuilt one too.
    data = read_only(np.ascontiguousarray(data, dtype=np.uint8))
    starts = np.ascontiguousarray(starts, dtype=np.int64)
    ends = np.ascontiguousarray(ends, dtype=np.int64)
    if len(starts) != len(ends):
        raise ValueError(f"{len(starts)} starts and {len(ends)} ends")
    if len(starts) and (starts.min() < 0 or (ends < starts).any() or ends.max() > len(data)):
        raise ValueError("a span lies outside the data or ends before it starts")
    out = _hash_spans(data, starts, ends)
    for i in np.flatnonzero(ends - starts > MAX_SHORT).tolist():
        out[i] = xxhash.xxh3_64_intdigest(data[starts[i] : ends[i]].tobytes())
    return out


@kernel
def _fold(acc: np.uint64, h: np.uint64) -> np.uint64:  # pragma: no cover - compiled
    """``neardup.core.hashing.combine`` of two scalars: SplitMix64's finaliser of
    ``acc * K + h``."""
    x = acc * _FOLD_K + h
    x = x ^ (x >> np.uint64(30))
    x = x * _FOLD_M1
    x = x ^ (x >> np.uint64(27))
    x = x * _FOLD_M2
    return x ^ (x >> np.uint64(31))


@kernel("uint64[::1](uint64[::1], int64[::1], int64[::1], int64)")
def _ngram_hashes(tokens: np.ndarray, token_offsets: np.ndarray, offsets: np.ndarray,
                  n: int) -> np.ndarray:  # pragma: no cover - compiled
    out = np.empty(offsets[-1], dtype=np.uint64)
    for d in range(len(token_offsets) - 1):
        start = token_offsets[d]
        m = token_offsets[d + 1] - start
        at = offsets[d]
        width = n if m >= n else m  # a text shorter than n: its one shingle is all its tokens
        for i in range(m - width + 1 if m > 0 else 0):
            acc = tokens[start + i]
            for k in range(1, width):
                acc = _fold(acc, tokens[start + i + k])
            out[at + i] = acc
    return out


def ngram_hashes(tokens: np.ndarray, token_offsets: np.ndarray, offsets: np.ndarray, n: int) -> np.ndarray:
    """The hashes of every text's token n-grams, in one compiled pass: each n-gram's hash
    is its token hashes folded left by ``neardup.core.hashing.combine`` (the first token's
    hash alone for n = 1); a text of 1 to n - 1 tokens has one shingle, all its tokens
    folded; a text of none has none.

    Args:
        tokens: uint64, shape (n_tokens,): the token hashes of all the texts, in order.
        token_offsets: int64, shape (n_texts + 1,): text d's tokens are
            ``tokens[token_offsets[d]:token_offsets[d + 1]]``.
        offsets: int64, shape (n_texts + 1,): where each text's shingles go in the result
            (``max(m - n + 1, min(m, 1))`` for a text of m tokens).
        n: the n-gram length, at least 1.

    Returns:
        uint64, shape (offsets[-1],).
    """
    return _ngram_hashes(np.ascontiguousarray(tokens, dtype=np.uint64),
                         np.ascontiguousarray(token_offsets, dtype=np.int64),
                         np.ascontiguousarray(offsets, dtype=np.int64), int(n))
