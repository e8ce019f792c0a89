"""Shingles of a batch of documents, hashed to 64 bits without per-shingle strings.

A document's shingles are its word n-grams over Unicode word tokens (``\\w+``) or its
character n-grams. Word tokens are found for the whole batch at once (a table of the
code points ``\\w`` matches, applied with numpy) and hashed once each with xxh3-64 of
their UTF-8 bytes (compiled, ``neardup.core.xxh3``); character shingles use the code points. An n-gram's hash is the
order-sensitive ``combine`` of its n token hashes, folded left, in one compiled pass over
the whole batch (``neardup.core.xxh3.ngram_hashes``). A document with fewer than n
tokens gives one shingle of all its tokens; a document with no token gives none (callers
reject it).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from neardup.core.hashing import combine, mix64

_WORD = re.compile(r"\w+")


@dataclass(frozen=True)
class Shingling:
    """How a normalised text is cut into shingles: word or character n-grams.

    Attributes:
        kind: ``"word"`` (n consecutive Unicode word tokens) or ``"char"`` (n consecutive
            characters, white space included).
        n: the n-gram length, at least 1.
        multiset: count shingles with repeats (a bag): the k-th repeat of a shingle is
            a distinct element, hashed as ``combine(hash, k)``. Off: a set.
    """

    kind: Literal["word", "char"] = "word"
    n: int = 5
    multiset: bool = False

    def __post_init__(self) -> None:
        if self.kind not in ("word", "char"):
            raise ValueError(f"shingling kind must be 'word' or 'char', not {self.kind!r}")
        if self.n < 1:
            raise ValueError(f"shingle length must be at least 1, not {self.n}")

    @classmethod
    def parse(cls, spec: str) -> Shingling:
        """Parse ``"word:5"``, ``"char:5"`` or a bare ``"5"`` (word n-grams), with an
        optional ``"+multiset"`` suffix.

        Raises:
            ValueError: the spec has another form.
        """
        body, plus, suffix = spec.strip().partition("+")
        kind, _, n = body.rpartition(":")
        try:
            if plus and suffix != "multiset":
                raise ValueError(f"unknown option {suffix!r}")
            return cls(kind=kind or "word", n=int(n), multiset=bool(plus))  # type: ignore[arg-type]
        except ValueError as exc:
            raise ValueError(
                f"bad shingling {spec!r}: expected 'word:N' or 'char:N', optionally "
                f"followed by '+multiset' ({exc})"
            ) from None

    def __str__(self) -> str:
        return f"{self.kind}:{self.n}" + ("+multiset" if self.multiset else "")


@dataclass(frozen=True)
class ShingleBatch:
    """The shingle hashes of a batch of documents.

    Attributes:
        hashes: uint64, shape (total_shingles,): document after document; a document's
            shingles in text order, repeats kept.
        offsets: int64, shape (n_docs + 1,): document ``d`` owns
            ``hashes[offsets[d]:offsets[d + 1]]``.
    """

    hashes: np.ndarray
    offsets: np.ndarray

    @property
    def counts(self) -> np.ndarray:
        """int64, shape (n_docs,): the number of shingles of each document."""
        return np.diff(self.offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1


#: Which code points ``\w`` matches (bool, shape (sys.maxunicode + 1,)), classified a
#: block of 256 at a time the first time a text uses the block (``_word_characters``):
#: the whole table takes 0.2 s to build, a start-up cost of every run.
_WORD_TABLE = np.zeros(sys.maxunicode + 1, dtype=bool)
_WORD_BLOCK = 256
_WORD_BLOCKS_DONE = np.zeros(len(_WORD_TABLE) // _WORD_BLOCK, dtype=bool)


def _word_characters(points: np.ndarray | None = None) -> np.ndarray:
    """bool, shape (sys.maxunicode + 1,): which code points ``\\w`` matches, at least
    for the blocks of 256 code points of ``points`` (uint32; None: the ASCII block only).
    The other entries may still be False."""
    used = np.zeros(len(_WORD_BLOCKS_DONE), dtype=bool)
    used[0 if points is None else points // _WORD_BLOCK] = True
    for block in np.flatnonzero(used & ~_WORD_BLOCKS_DONE).tolist():
        low = block * _WORD_BLOCK
        for match in _WORD.finditer("".join(map(chr, range(low, low + _WORD_BLOCK)))):
            _WORD_TABLE[low + match.start():low + match.end()] = True
        _WORD_BLOCKS_DONE[block] = True
    return _WORD_TABLE


def _word_spans(texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Where the ``\\w+`` tokens of ``texts`` lie in their UTF-8 bytes, all at once.

    One pass over the batch instead of a regex per text: the texts are joined by spaces
    (no word character, so no token spans two texts) and encoded once; each byte of a
    multi-byte character takes its character's class from a table of the code points
    ``\\w`` matches.

    Returns:
        (data, starts, ends, counts): the joined UTF-8 bytes (uint8); each token's byte
        span (int64 starts and ends, text order); the number of tokens of each text
        (int64, shape (n_texts,)).
    """
    joined = " ".join(texts)
    lengths = np.fromiter(map(len, texts), dtype=np.int64, count=len(texts)) + 1
    text_starts = np.zeros(len(texts), dtype=np.int64)
    np.cumsum(lengths[:-1], out=text_starts[1:])
    if joined.isascii():
        data = np.frombuffer(joined.encode("ascii"), dtype=np.uint8)
        word = _word_characters()[data]
    else:
        points = np.frombuffer(joined.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
        widths = 1 + (points >= 0x80) + (points >= 0x800) + (points >= 0x10000)
        byte_starts = np.zeros(len(points) + 1, dtype=np.int64)
        np.cumsum(widths, out=byte_starts[1:])
        text_starts = byte_starts[text_starts]
        data = np.frombuffer(joined.encode("utf-8", "surrogatepass"), dtype=np.uint8)
        word = np.repeat(_word_characters(points)[points], widths)
    edges = np.flatnonzero(np.diff(word, prepend=False, append=False))  # starts, ends alternate
    starts, ends = edges[0::2], edges[1::2]
    counts = np.diff(np.searchsorted(starts, text_starts), append=len(starts))
    return data, starts, ends, counts


def _token_hashes(texts: Sequence[str], shingling: Shingling) -> tuple[np.ndarray, np.ndarray]:
    """Token hashes (uint64, shape (n_tokens,)) and per-document token offsets."""
    if shingling.kind == "word":
        data, starts, ends, counts = _word_spans(texts)
        from neardup.core.xxh3 import xxh3_spans  # here: numba is imported where a text is hashed (0.2 s)

        hashes = xxh3_spans(data, starts, ends)  # = xxhash.xxh3_64_intdigest of each token
    else:
        counts = np.fromiter(map(len, texts), dtype=np.int64, count=len(texts))
        codepoints = np.frombuffer("".join(texts).encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
        hashes = mix64(codepoints.astype(np.uint64) + np.uint64(0x632BE59BD9B4E019))
    offsets = np.zeros(len(texts) + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    return hashes, offsets


def shingle_batch(texts: Sequence[str], shingling: Shingling = Shingling()) -> ShingleBatch:
    """Hash the shingles of normalised ``texts`` in one vectorised pass.

    Args:
        texts: normalised documents (see ``neardup.core.normalize``).
        shingling: word or character n-grams.

    Returns:
        A ``ShingleBatch``; a text without any token has zero shingles.
    """
    from neardup.core.xxh3 import ngram_hashes  # as in _token_hashes: numba only where text is hashed

    tokens, toff = _token_hashes(texts, shingling)
    n = shingling.n
    m = np.diff(toff)  # tokens per document
    n_shingles = np.where(m >= n, m - n + 1, np.minimum(m, 1))
    offsets = np.zeros(len(texts) + 1, dtype=np.int64)
    np.cumsum(n_shingles, out=offsets[1:])
    out = ngram_hashes(tokens, toff, offsets, n)
    if shingling.multiset:
        out = _number_repeats(out, np.repeat(np.arange(len(texts)), n_shingles))
    return ShingleBatch(hashes=out, offsets=offsets)


def _number_repeats(hashes: np.ndarray, doc_of_slot: np.ndarray) -> np.ndarray:
    """Make the k-th repeat (k >= 1) of a hash within its document ``combine(hash, k)``."""
    order = np.lexsort((hashes, doc_of_slot))  # stable: text order within equal hashes
    h, d = hashes[order], doc_of_slot[order]
    starts = np.ones(len(h), dtype=bool)
    starts[1:] = (h[1:] != h[:-1]) | (d[1:] != d[:-1])
    run_start = np.maximum.accumulate(np.where(starts, np.arange(len(h)), 0))
    repeat = (np.arange(len(h)) - run_start).astype(np.uint64)
    numbered = np.where(repeat > 0, combine(h, repeat), h)
    out = np.empty_like(hashes)
    out[order] = numbered
    return out
