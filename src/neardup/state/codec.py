"""Byte layouts of every stored key and value, in one place.

Column families and their records (all integers unsigned):

========== ========================================= ==================================
family     key                                       value
========== ========================================= ==================================
default    b"settings"                               JSON of the state-shaping settings
default    b"next_seq"                               u64 LE: documents stored (absent: 0)
default    b"max_bucket"                             u64 LE: largest bucket length seen
default    b"retention"                              JSON of the retention window
                                                     (``neardup.core.retention.Retention``)
default    b"watermark"                              i64 LE: latest document time, ms
default    b"expired_below"                          u64 LE: documents below this seq have
                                                     expired and been removed
default    b"meta:" + name                           caller-defined bytes
                                                     (``StateUpdate.meta``)
default    b"changelog_unconfirmed"                  the changelog keys written since the
                                                     last ``confirm()``: zlib of the sorted
                                                     keys, each u16 LE length + key; never
                                                     logged
default    b"restoring"                              empty: a restore is under way (wiped,
                                                     records being applied); never logged
times      first seq of a batch u64 BE               the batch's document times, i64 LE ms
buckets    first seq of a batch u64 BE               the batch's bucket memberships: pairs
                                                     (bucket id u64 LE, seq u64 LE)
signatures seq u64 BE (8 B)                          num_perm x u64 LE (8 * num_perm B); written
                                                     only with verify="estimate"
nodes      seq u64 BE                                parent, size, canonical: 3 x u64 LE
documents  seq u64 BE                                shingle-set size u32 LE + external id, UTF-8
shingles   seq u64 BE                                sorted distinct shingle fingerprints
                                                     (low 32 bits of the hashes), u32 LE
positions  source name, UTF-8                        next position, u64 LE
verdicts   caller-defined bytes                      caller-defined bytes (Kafka: the
                                                     ``Outcome`` record, neardup.kafka.messages;
                                                     under NUL "topic-id:" topic, the
                                                     topic's id, neardup.kafka.state_check;
                                                     files: outputs' lengths and the inputs
                                                     read per path, neardup.embedded)
========== ========================================= ==================================

Big-endian keys sort numerically, so a scan of ``buckets`` or ``signatures`` runs in
arrival order, and the records of expired documents (below ``expired_below``) are
removed with one range delete per family. A ``documents`` record below it is kept
while it is the canonical of a cluster with a held member (its id is the cluster id).
A store written before ``times`` existed reads its documents as of time 0. ``LAYOUT``
is stored with the settings: a store of another layout is refused rather than misread.

Changelog records (a compacted Kafka topic, the state's source of truth; as Kafka Streams'
and quix-streams' changelogs): one record per stored key written,

========================================= ============================================
record key                                record value
========================================= ============================================
family tag (1 B) + the stored key         the stored value; None (a tombstone) for a
                                          deleted key
========================================= ============================================

the tag being the family's index in ``CHANGELOG_FAMILIES`` ("default" 0, "buckets" 1,
…, "times" 8). A range delete is logged as one tombstone per key it removes. Replayed in
order (a later record of a key wins), or after compaction (the last record per key,
tombstoned keys dropped), the records rebuild exactly the live state.
"""

from __future__ import annotations

import json
import struct
import zlib
from typing import Any

import numpy as np


FAMILIES = ("buckets", "signatures", "nodes", "documents", "shingles", "positions", "verdicts", "times")
#: Families keyed by the seq of a document, and by the first seq of a batch.
SEQ_FAMILIES = ("signatures", "nodes", "documents", "shingles")
BATCH_FAMILIES = ("buckets", "times")
SETTINGS_KEY = b"settings"
RETENTION_KEY = b"retention"
WATERMARK_KEY = b"watermark"
EXPIRED_BELOW_KEY = b"expired_below"
NEXT_SEQ_KEY = b"next_seq"
MAX_BUCKET_KEY = b"max_bucket"
META_PREFIX = b"meta:"
UNCONFIRMED_KEY = b"changelog_unconfirmed"
RESTORING_KEY = b"restoring"
#: Default-family keys never written to the changelog.
UNLOGGED_KEYS = frozenset({UNCONFIRMED_KEY, RESTORING_KEY})
#: Families in the order of their changelog tags.
CHANGELOG_FAMILIES = ("default", *FAMILIES)
_TAGS = {family: bytes([tag]) for tag, family in enumerate(CHANGELOG_FAMILIES)}
#: Version of these layouts, stored with the state-shaping settings.
LAYOUT = 2

_SEQ = struct.Struct(">Q")
_U64 = struct.Struct("<Q")
_NODE_BYTES = 24  # parent, size, canonical: 3 x u64 LE


def seq_key(seq: int) -> bytes:
    return _SEQ.pack(seq)


def seq_keys(seqs: np.ndarray | list[int]) -> list[bytes]:
    raw = np.asarray(seqs, dtype=">u8").tobytes()
    return [raw[i : i + 8] for i in range(0, len(raw), 8)]


def encode_u64(value: int) -> bytes:
    return _U64.pack(value)


def decode_u64(raw: bytes) -> int:
    return _U64.unpack(raw)[0]


def encode_memberships(buckets: np.ndarray, seqs: np.ndarray) -> bytes:
    """Bucket memberships (uint64 arrays of one length) as (bucket, seq) u64 LE pairs."""
    return np.column_stack([buckets, seqs]).astype("<u8").tobytes()


def decode_memberships(raw: bytes) -> tuple[np.ndarray, np.ndarray]:
    """(bucket ids, seqs): uint64 arrays of one length."""
    pairs = np.frombuffer(raw, dtype="<u8").reshape(-1, 2).astype(np.uint64)
    return pairs[:, 0].copy(), pairs[:, 1].copy()


_I64 = struct.Struct("<q")


def encode_i64(value: int) -> bytes:
    return _I64.pack(value)


def decode_i64(raw: bytes) -> int:
    return _I64.unpack(raw)[0]


def encode_times(times: np.ndarray) -> bytes:
    """int64 ms times as i64 LE."""
    return np.asarray(times, dtype="<i8").tobytes()


def decode_times(raw: bytes) -> np.ndarray:
    """int64, shape (k,)."""
    return np.frombuffer(raw, dtype="<i8").astype(np.int64)


def encode_signature(signature: np.ndarray) -> bytes:
    return np.asarray(signature, dtype="<u8").tobytes()


def decode_signatures(raws: list[bytes], num_perm: int) -> np.ndarray:
    """uint64, shape (len(raws), num_perm)."""
    if not raws:
        return np.empty((0, num_perm), dtype=np.uint64)
    return np.frombuffer(b"".join(raws), dtype="<u8").astype(np.uint64).reshape(-1, num_perm)


def encode_nodes(nodes: np.ndarray) -> list[bytes]:
    """Node values of ``nodes`` (integers, shape (k, 3): parent, size, canonical)."""
    raw = np.ascontiguousarray(nodes, dtype="<u8").tobytes()
    width = _NODE_BYTES
    return [raw[i : i + width] for i in range(0, len(raw), width)]


def decode_nodes(keys: list[bytes], values: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """(seqs uint64 shape (k,), nodes uint64 shape (k, 3)) of ``nodes`` records."""
    seqs = np.frombuffer(b"".join(keys), dtype=">u8").astype(np.uint64)
    nodes = np.frombuffer(b"".join(values), dtype="<u8").astype(np.uint64).reshape(-1, 3)
    return seqs, nodes


_SIZE = struct.Struct("<I")


def encode_document(size: int, doc_id: str) -> bytes:
    return _SIZE.pack(size) + doc_id.encode("utf-8")


def decode_document(raw: bytes) -> tuple[int, str]:
    """(shingle-set size, external id)."""
    return _SIZE.unpack_from(raw)[0], raw[_SIZE.size :].decode("utf-8")


def encode_fingerprint_sets(values: np.ndarray, offsets: np.ndarray) -> list[bytes]:
    """One ``shingles`` value per set of ``values`` (uint32) cut at ``offsets`` (int64,
    shape (n_sets + 1,))."""
    raw = np.asarray(values, dtype="<u4").tobytes()
    ends = (4 * np.asarray(offsets, dtype=np.int64)).tolist()
    return [raw[a:b] for a, b in zip(ends[:-1], ends[1:])]


def decode_fingerprint_sets(raws: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """Several ``shingles`` values as one array: (values uint32, shape (total,); offsets
    int64, shape (len(raws) + 1,)), set k being ``values[offsets[k]:offsets[k + 1]]``."""
    offsets = np.zeros(len(raws) + 1, dtype=np.int64)
    np.cumsum(np.fromiter(map(len, raws), dtype=np.int64, count=len(raws)) // 4, out=offsets[1:])
    return np.frombuffer(b"".join(raws), dtype="<u4").astype(np.uint32), offsets


def encode_settings(settings: dict[str, Any]) -> bytes:
    return json.dumps(settings, sort_keys=True).encode("utf-8")


def decode_settings(raw: bytes) -> dict[str, Any]:
    return json.loads(raw)


def meta_key(name: bytes) -> bytes:
    return META_PREFIX + name


def changelog_key(family: str, key: bytes) -> bytes:
    """The changelog record key of ``key`` in ``family``: its 1-byte tag + ``key``.

    Raises:
        KeyError: an unknown family.
    """
    return _TAGS[family] + key


def split_changelog_key(raw: bytes) -> tuple[str, bytes]:
    """(family, stored key) of a changelog record key.

    Raises:
        ValueError: an empty key or an unknown tag.
    """
    if not raw or raw[0] >= len(CHANGELOG_FAMILIES):
        raise ValueError(f"not a changelog key: {raw[:16]!r}")
    return CHANGELOG_FAMILIES[raw[0]], raw[1:]


_LEN = struct.Struct("<H")


def encode_key_set(keys: set[bytes]) -> bytes:
    """A set of keys (each under 64 KiB) as zlib of the sorted keys, each u16 LE length +
    key (consecutive seq keys share their prefixes, which zlib folds)."""
    return zlib.compress(b"".join(_LEN.pack(len(key)) + key for key in sorted(keys)), 1)


def decode_key_set(raw: bytes) -> set[bytes]:
    data = zlib.decompress(raw)
    keys, at = set(), 0
    while at < len(data):
        (length,) = _LEN.unpack_from(data, at)
        keys.add(data[at + 2 : at + 2 + length])
        at += 2 + length
    return keys
