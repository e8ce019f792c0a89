"""Byte layouts of the records between the sharded stages (docs/scale-out.md).

Order key (20 bytes, ``ORDER``): big-endian signed (record timestamp in ms, input
partition, offset), so that comparing the bytes compares the keys: the order every shard
processes documents in. ``order_seq`` turns it into one integer with the same order.

Band record (prepare -> shard; key: none; partition: the shard's): the documents of
one prepare batch that touch the shard, in input order, as columns (one Kafka record
per batch and shard partition, not one per document; split above ``BANDS_RECORD_BYTES``):

    ">I" document count n
    n order keys (20 bytes each)
    n × ">HHI" per document: band count k, id length L, fingerprint count f
    the ids (UTF-8), one after the other
    the bucket ids (uint64, little-endian), k of each document, one after the other
    the fingerprints (uint32, little-endian, each document's sorted distinct: its
    shingle set), one after the other

A band record whose documents' sets went once to the set topic (header ``SETS_HEADER``;
prepare without a retention window) has the same layout, every f 0 and no
fingerprints: the header names the set records that hold them.

Set record (prepare -> ``<app>.sets``; key: none; headers ``KIND_HEADER`` ``b"sets"`` and
``ENGINE_HEADER``): the shingle sets of one prepare batch's documents that touch a shard,
each once, however many shard partitions it touches (split above
``BANDS_RECORD_BYTES``):

    ">I" document count n
    n order keys (20 bytes each)
    n × ">I" fingerprint count f
    the fingerprints (uint32, little-endian, each document's sorted distinct), one
    after the other

``SETS_HEADER`` of a band record: ">i" the set topic's partition, then ">q" per set
record of the batch its offset there (``sets_ref``).

Member value (the shard's changelog, ``neardup.state.shard_store``): one document's
entry of a band record on its own:

    ">HHI" band count k, id length L, fingerprint count f
    id (L bytes, UTF-8)
    k bucket ids (uint64, little-endian)
    f fingerprints (uint32, little-endian, sorted distinct: the shingle set)

Watermark record (prepare -> every shard partition; key: none; header ``KIND_HEADER``
``b"watermark"``): how far prepare has sent each input partition it reads, so that a
shard processes a document only once every input partition is past its order key (as
Flink's per-source watermarks; Kafka Streams' stream time over a task's partitions):

    ">H" entry count n, then per entry:
    ">H" topic length T, the input topic (T bytes, UTF-8), ">ii" partition and the
    topic's partition count, the watermark (an order key, 20 bytes): every record of
    that partition whose order key is at or below it has been sent before this record.

Findings record (shard -> decide; key: none; header ``KIND_HEADER`` ``b"findings"``;
partition: the decide partition of every document in it): what a shard process found,
in one batch, for the documents of one decide partition, in release order:

    ">I" count n of (document, shard partition) findings; then per finding:
    the document's order key (20 bytes), ">iHH" the shard partition, candidate count m,
    error length E,
    the error (E bytes, UTF-8, ``kind: reason``: a band record the shard could not read),
    then per verified candidate: its order key (20 bytes), ">ddd" its Jaccard,
    containment (of the document in it) and the measure's similarity, ">H" its id
    length L and its id (L bytes, UTF-8);
    then, as columns, the findings without a candidate or an error (most of them:
    written per finding they were the shard's and decide's largest per-entry cost):
    ">I" count e, the e documents' order keys (20 bytes each), e × ">i" the shard
    partitions. (A record of an earlier version ends after the n findings: e = 0.)

Decisions record (decide -> ``<app>.decisions``, compacted, one partition; key
``DECISIONS_KEY`` + the first document's order key): the documents one decide batch
decided, as columns (one record per batch, split above ``DECISIONS_RECORD_BYTES``,
instead of one JSON record per document: every decide process reads the whole topic, so
each record is read as many times as there are decide processes):

    ">I" count n; the n documents' order keys (20 bytes each); their clusters'
    canonicals' order keys (20 bytes each); n × ">I" the canonicals' id lengths, then
    the ids (UTF-8); n × ">I" the counts of clusters a decision merged (the components
    policy; 0 otherwise), then the merged clusters' roots' order keys (20 bytes each).

(A topic written by an earlier version holds one record per document instead: key its
order key, value JSON ``{"cluster": [ms, partition, offset], "cluster_id", "merged"}``;
``neardup.sharded.decide_stage`` reads both.)

Documents record (prepare -> decide; key: none; headers ``KIND_HEADER``
``b"documents"`` and ``ENGINE_HEADER``; partition: ``decide_partition`` of every order key
in it): the input records of one prepare batch that go to one decide partition, in input
order (one Kafka record per batch and decide partition, split above the findings topic's
``max.message.bytes``, instead of one per document):

    ">I" document count n; ">H" input topic count t, then per topic ">H" its length T
    and the topic (T bytes, UTF-8);
    per document: ``_DOCUMENT``: its order key (20 bytes), ">IHiiIiqH" how many shard
    partitions will answer, its input topic's index in the table, its key's length (-1:
    none), its value's length (-1: none), its id's length, its error's length (-1: it is
    a document), its value's size when sent without it (-1: sent with it), its header
    count h; then the key, the value, the id (UTF-8), the error (``kind: reason``, UTF-8),
    and per header ">Ii" the name's length and the value's length (-1: none), the name
    (UTF-8) and the value.

A record that is no document (bad JSON, no text, no shingles) has its error and 0
shards; one too large for the findings topic goes without its value, its size kept.
(A topic written by an earlier version holds one document record per document instead:
the input record's own key, value and headers, and neardup's headers ``ORDER_HEADER``,
``TOPIC_HEADER``, ``SHARDS_HEADER`` (ASCII decimal), ``ID_HEADER``, ``ENGINE_HEADER``,
``ERROR_HEADER`` and ``VALUE_BYTES_HEADER``; ``KIND_HEADER`` ``b"document"``; decide reads
both.)
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, TypeVar

import numpy as np
import xxhash

ORDER = struct.Struct(">qiq")
#: A document's entry lengths in a member record's band value: bucket count, id bytes, set size.
BAND = struct.Struct(">HHI")
ORDER_HEADER = "neardup-sharded-order"
SHARDS_HEADER = "neardup-sharded-shards"
ID_HEADER = "neardup-sharded-id"
ERROR_HEADER = "neardup-sharded-error"
KIND_HEADER = "neardup-sharded-kind"  # on the findings topic: b"documents", b"findings" (b"document": earlier)
TOPIC_HEADER = "neardup-sharded-topic"  # the input topic of a document record
ENGINE_HEADER = "neardup-sharded-engine"  # the engine settings' digest (``engine_digest``)
VALUE_BYTES_HEADER = "neardup-sharded-value-bytes"  # a document record sent without its value
SETS_HEADER = "neardup-sharded-sets"  # a band record's set records (``sets_ref``)
SHARDED_PREFIX = "neardup-sharded-"
_MARKS = struct.Struct(">H")
_MARK = struct.Struct(">ii")
WATERMARK_KIND = b"watermark"  # the KIND_HEADER of a watermark record
FINDINGS_KIND = b"findings"  # the KIND_HEADER of a findings record
DOCUMENTS_KIND = b"documents"  # the KIND_HEADER of a documents record
SETS_KIND = b"sets"  # the KIND_HEADER of a set record
_DOCUMENT = struct.Struct(">20sIHiiIiqH")
_DOC_HEADER = struct.Struct(">Ii")
#: A documents record's bytes before its topics and documents: the count of each.
DOCUMENTS_FIXED_BYTES = 6
_FINDINGS = struct.Struct(">I")
_FOUND = struct.Struct(">20siHH")
_CANDIDATE = struct.Struct(">20sdddH")
_CANDIDATE_FIELDS = struct.Struct(">qiqdddH")  # the same bytes, the order key's fields apart
#: A verified candidate as a findings record carries it: (timestamp ms, partition,
#: offset) of its order key, its id, Jaccard, containment, similarity.
Candidate = tuple[int, int, int, str, float, float, float]
#: The largest order key of a time: above every key of that millisecond.
_LAST_OF_MS = ((1 << 31) - 1, (1 << 63) - 1)


def time_mark(timestamp_ms: int) -> bytes:
    """The order key at or above every key of ``timestamp_ms`` and below every later one."""
    return ORDER.pack(timestamp_ms, *_LAST_OF_MS)


def watermark_value(marks: dict[tuple[str, int], tuple[int, bytes]]) -> bytes:
    """A watermark record's value (the layout above) of ``marks``:
    (topic, partition) -> (the topic's partition count, watermark order key)."""
    parts = [_MARKS.pack(len(marks))]
    for (topic, partition), (count, mark) in sorted(marks.items()):
        raw = topic.encode("utf-8")
        parts += [_MARKS.pack(len(raw)), raw, _MARK.pack(partition, count), mark]
    return b"".join(parts)


def parse_watermarks(value: bytes) -> dict[tuple[str, int], tuple[int, bytes]]:
    """``watermark_value``'s inverse. Raises: ValueError (struct.error) on another layout."""
    (n,) = _MARKS.unpack_from(value)
    at = _MARKS.size
    out = {}
    for _ in range(n):
        (t,) = _MARKS.unpack_from(value, at)
        topic = value[at + 2:at + 2 + t].decode("utf-8")
        at += 2 + t
        partition, count = _MARK.unpack_from(value, at)
        at += _MARK.size
        mark = value[at:at + ORDER.size]
        if len(mark) != ORDER.size:
            raise ValueError("watermark record cut short")
        at += ORDER.size
        out[(topic, partition)] = (count, mark)
    if at != len(value):
        raise ValueError("watermark record of the wrong length")
    return out


class Watermarks:
    """The watermark records read on one partition of the bands or findings topic: each
    input partition's largest watermark, and the order key up to which every partition
    of every input topic has been sent (``limit``)."""

    def __init__(self) -> None:
        self.marks: dict[tuple[str, int], bytes] = {}  # input partition -> its watermark
        self.counts: dict[str, int] = {}  # input topic -> its partition count

    def take(self, value: bytes) -> None:
        """A watermark record's value. Raises: ValueError (struct.error,
        UnicodeDecodeError): another layout."""
        for tp, (count, mark) in parse_watermarks(value).items():
            self.counts[tp[0]] = max(count, self.counts.get(tp[0], 0))
            if mark > self.marks.get(tp, b""):
                self.marks[tp] = mark

    def limit(self) -> bytes | None:
        """The order key up to which every input partition has been sent (None: a
        partition of an input topic has no watermark yet, or no watermark came at all)."""
        if not self.counts:
            return None
        marks = [self.marks.get((t, i)) for t, n in self.counts.items() for i in range(n)]
        return None if any(m is None for m in marks) else min(marks)  # type: ignore[type-var]


def found_value(order: bytes, shard: int, candidates: list[tuple[bytes, str, float, float, float]],
                error: str | None = None) -> bytes:
    """One finding of a findings record (the layout above).

    Args:
        order: the document's order key (20 bytes).
        shard: the shard partition that found it.
        candidates: per verified candidate, in verification order: (order key, id,
            Jaccard, containment, similarity).
        error: why its band record could not be read (``kind: reason``), or None.
    """
    raw_error = error.encode("utf-8") if error else b""
    parts = [_FOUND.pack(order, shard, len(candidates), len(raw_error)), raw_error]
    for key, cid, jaccard, containment, similarity in candidates:
        raw = cid.encode("utf-8")
        parts += [_CANDIDATE.pack(key, jaccard, containment, similarity, len(raw)), raw]
    return b"".join(parts)


def findings_value(found: list[bytes], empty_orders: Sequence[bytes] = (), empty_shards: Sequence[int] = ()) -> bytes:
    """A findings record's value: ``found_value`` parts, then the findings without a
    candidate or error as columns: their documents' order keys and shard partitions."""
    if len(empty_orders) != len(empty_shards):
        raise ValueError("an order key and a shard partition per finding")
    return b"".join((_FINDINGS.pack(len(found)), *found, _FINDINGS.pack(len(empty_orders)), *empty_orders,
                     struct.pack(f">{len(empty_shards)}i", *empty_shards)))


#: The bytes of a finding without a candidate in a findings record's columns.
EMPTY_FINDING_BYTES = ORDER.size + 4


def parse_findings(value: bytes) -> list[tuple[bytes, int, list[Candidate], str | None]]:
    """``findings_value``'s inverse: per finding (the document's order key, the shard
    partition, its verified candidates, its error or None); those of the columns last.

    Raises:
        ValueError (struct.error, UnicodeDecodeError): a record of another layout.
    """
    found, orders, shards = parse_findings_columns(value)
    return found + [(order, shard, [], None) for order, shard in zip(orders, shards)]


def parse_findings_columns(value: bytes) -> tuple[list[tuple[bytes, int, list[Candidate], str | None]],
                                                  list[bytes], list[int]]:
    """``findings_value``'s inverse: the findings written one by one (as
    ``parse_findings``), and the order keys and shard partitions of the findings
    without a candidate or error.

    Raises:
        ValueError (struct.error, UnicodeDecodeError): a record of another layout.
    """
    (n,) = _FINDINGS.unpack_from(value)
    at = _FINDINGS.size
    out = []
    for _ in range(n):
        order, shard, m, e = _FOUND.unpack_from(value, at)
        at += _FOUND.size
        error = value[at:at + e].decode("utf-8") if e else None
        at += e
        candidates = []
        for _ in range(m):
            ts, partition, offset, jaccard, containment, similarity, n_id = _CANDIDATE_FIELDS.unpack_from(value, at)
            at += _CANDIDATE_FIELDS.size
            candidates.append((ts, partition, offset, value[at:at + n_id].decode("utf-8"),
                               jaccard, containment, similarity))
            at += n_id
        out.append((order, shard, candidates, error))
    orders: list[bytes] = []
    shards: list[int] = []
    if at < len(value):  # the columns (none in a record of an earlier version)
        if len(value) < at + _FINDINGS.size:
            raise ValueError("findings record of the wrong length")
        (e,) = _FINDINGS.unpack_from(value, at)
        at += _FINDINGS.size
        keys_end = at + ORDER.size * e
        if len(value) != keys_end + 4 * e:
            raise ValueError("findings record of the wrong length")
        orders = [value[i:i + ORDER.size] for i in range(at, keys_end, ORDER.size)]
        shards = list(struct.unpack_from(f">{e}i", value, keys_end))
        at = len(value)
    if at != len(value):
        raise ValueError("findings record of the wrong length")
    return out, orders, shards


class DocumentEntry(NamedTuple):
    """One input record as a documents record carries it to decide."""

    order: bytes  # its order key (20 bytes)
    shards: int  # how many shard partitions will answer (0: none, an error)
    key: bytes | None
    value: bytes | None  # None also when sent without it (``value_bytes``)
    carried: list[tuple[str, bytes | None]]  # its headers as they go out (``carried_headers``)
    topic: str  # its input topic
    doc_id: str
    error: str | None  # why it is no document (``kind: reason``)
    value_bytes: int | None  # its value's size when sent without it


def document_entry_bytes(entry: DocumentEntry) -> int:
    """The bytes of ``entry`` in a documents record (the topic table aside)."""
    size = _DOCUMENT.size + len(entry.key or b"") + len(entry.value or b"") + len(entry.doc_id.encode("utf-8"))
    if entry.error is not None:
        size += len(entry.error.encode("utf-8"))
    for name, v in entry.carried:
        size += _DOC_HEADER.size + len(name.encode("utf-8")) + len(v or b"")
    return size


def documents_value(entries: Sequence[DocumentEntry]) -> bytes:
    """A documents record's value (the layout above) of ``entries``, in their order."""
    topics = list(dict.fromkeys(entry.topic for entry in entries))
    at = {topic: i for i, topic in enumerate(topics)}
    parts = [struct.pack(">IH", len(entries), len(topics))]
    for topic in topics:
        raw = topic.encode("utf-8")
        parts += [struct.pack(">H", len(raw)), raw]
    for e in entries:
        raw_id = e.doc_id.encode("utf-8")
        raw_error = None if e.error is None else e.error.encode("utf-8")
        parts.append(_DOCUMENT.pack(e.order, e.shards, at[e.topic], -1 if e.key is None else len(e.key),
                                    -1 if e.value is None else len(e.value), len(raw_id),
                                    -1 if raw_error is None else len(raw_error),
                                    -1 if e.value_bytes is None else e.value_bytes, len(e.carried)))
        parts += [e.key or b"", e.value or b"", raw_id, raw_error or b""]
        for name, v in e.carried:
            raw_name = name.encode("utf-8")
            parts += [_DOC_HEADER.pack(len(raw_name), -1 if v is None else len(v)), raw_name, v or b""]
    return b"".join(parts)


def parse_documents(value: bytes) -> list[DocumentEntry]:
    """``documents_value``'s inverse.

    Raises:
        ValueError (struct.error, UnicodeDecodeError): a record of another layout.
    """
    n, t = struct.unpack_from(">IH", value)
    at = 6
    topics = []
    for _ in range(t):
        (size,) = struct.unpack_from(">H", value, at)
        topics.append(value[at + 2:at + 2 + size].decode("utf-8"))
        at += 2 + size
    out = []
    unpack, fixed = _DOCUMENT.unpack_from, _DOCUMENT.size
    for _ in range(n):
        order, shards, topic, n_key, n_value, n_id, n_error, value_bytes, h = unpack(value, at)
        at += fixed
        key = None if n_key < 0 else value[at:at + n_key]
        at += max(n_key, 0)
        doc = None if n_value < 0 else value[at:at + n_value]
        at += max(n_value, 0)
        doc_id = value[at:at + n_id].decode("utf-8")
        at += n_id
        error = None if n_error < 0 else value[at:at + n_error].decode("utf-8")
        at += max(n_error, 0)
        carried: list[tuple[str, bytes | None]] = []
        for _ in range(h):
            n_name, n_header = _DOC_HEADER.unpack_from(value, at)
            at += _DOC_HEADER.size
            name = value[at:at + n_name].decode("utf-8")
            at += n_name
            carried.append((name, None if n_header < 0 else value[at:at + n_header]))
            at += max(n_header, 0)
        if at > len(value) or topic >= t:
            raise ValueError("documents record of the wrong length")
        out.append(DocumentEntry(order, shards, key, doc, carried, topics[topic], doc_id, error,
                                 None if value_bytes < 0 else value_bytes))
    if at != len(value):
        raise ValueError("documents record of the wrong length")
    return out


def documents_count(value: bytes) -> int:
    """The number of documents in a documents record (its first 4 bytes).

    Raises:
        struct.error: a record shorter than that.
    """
    return struct.unpack_from(">I", value)[0]


def order_key(timestamp_ms: int, partition: int, offset: int) -> bytes:
    """The 20-byte order key of an input record."""
    return ORDER.pack(timestamp_ms, partition, offset)


def order_seq(key: bytes) -> int:
    """The order key as one integer, ordered like the keys (timestamp, partition, offset):
    ``fields_seq`` of its fields, which is its 20 bytes read as one signed big-endian
    integer (the partition and the offset are never negative)."""
    return int.from_bytes(key, "big", signed=True)


def fields_seq(timestamp_ms: int, partition: int, offset: int) -> int:
    """``order_seq`` of the order key of these fields, without packing it."""
    return (timestamp_ms << 96) | (partition << 64) | offset


class EngineMismatchError(ValueError):
    """A record prepared with other engine settings than this stage's."""


class ChangelogLayoutError(ValueError):
    """A stage's changelog record in the layout of an earlier version of neardup (held
    band records, waiting documents, findings logged one by one; a shorter ``P``)."""

    def __init__(self, topic: str, partition: int, what: str) -> None:
        super().__init__(f"{topic}[{partition}] was written by an earlier version of neardup ({what}); "
                         "this version reads it no more: start the deduplication under a new --app")


class BandRecordGoneError(ValueError):
    """A shard changelog's member refers to a band record the band topic no longer holds
    (its retention was set after the member was logged, or the topic was deleted): the
    shard's state cannot be restored."""

    def __init__(self, topic: str, partition: int, offset: int, order: bytes) -> None:
        super().__init__(f"{topic}[{partition}] no longer holds the band record at offset {offset} (member "
                         f"{order.hex()}), or the set topic its set, which the shard changelog refers to: the band "
                         "and set topics must keep their records (retention.ms=-1) while a shard changelog names "
                         "them; start the deduplication under a new --app")


class BandTopicNotKeptError(ValueError):
    """A shard changelog holds members logged as references to their band records, and the
    band topic no longer keeps its records for good: they would be lost once deleted."""

    def __init__(self, bands: str, changelog: str, partition: int) -> None:
        super().__init__(f"{changelog}[{partition}] holds members logged as references to the records of {bands}, "
                         f"which no longer keeps its records for good; set it back with kafka-configs.sh --alter "
                         f"--entity-type topics --entity-name {bands} --add-config retention.ms=-1,retention.bytes=-1 "
                         "before its records are deleted")


def engine_digest(settings: object) -> bytes:
    """The digest (xxh64, hex) of the engine settings' ``repr``: every stage of one
    deduplication must run with the same settings (a band cut with other rows, or a
    threshold of another value, would give wrong verdicts silently)."""
    return xxhash.xxh64_hexdigest(repr(settings).encode("utf-8")).encode("ascii")


def check_engine(headers: list[tuple[str, bytes]] | None, digest: bytes, where: str) -> None:
    """Raises: EngineMismatchError: the record has an ``ENGINE_HEADER`` other than
    ``digest`` (a record without one was not written by prepare: not checked here)."""
    check_engine_value(next((v for k, v in headers or () if k == ENGINE_HEADER), None), digest, where)


def check_engine_value(got: bytes | None, digest: bytes, where: str) -> None:
    """``check_engine`` of a record whose ``ENGINE_HEADER`` value is ``got`` (None: none).

    Raises:
        EngineMismatchError: ``got`` is not None and not ``digest``.
    """
    if got is not None and got != digest:
        raise EngineMismatchError(
            f"{where} was prepared with other engine settings (digest {got.decode()}, "
            f"this stage's {digest.decode()}): every stage of one deduplication needs the same engine settings")


def decide_partition(key: bytes, partitions: int) -> int:
    """The decide partition of a document (xxh64 of its order key, modulo)."""
    return xxhash.xxh64_intdigest(key) % partitions


T = TypeVar("T")


def split_runs(items: list[T], size: Callable[[T], int], limit: int) -> list[list[T]]:
    """``items`` in order, cut into runs of at most ``limit`` bytes (``size`` of each), an
    item larger than that alone in its run: the parts of one record each."""
    runs: list[list[T]] = []
    total = 0
    for item in items:
        n = size(item)
        if runs and total + n <= limit:
            runs[-1].append(item)
            total += n
        else:
            runs.append([item])
            total = n
    return runs


#: The first byte of a decisions record's key (then the first document's order key).
DECISIONS_KEY = b"D"
#: The largest decisions record produced, bytes (a batch's decisions are split above it).
DECISIONS_RECORD_BYTES = 512 << 10
_DECISIONS = struct.Struct(">I")
#: A decision as a decisions record carries it: the document's order key, its cluster's
#: canonical's order key and id, and the roots of the clusters it merged (order keys).
DecisionEntry = tuple[bytes, bytes, str, Sequence[bytes]]


def decisions_value(decisions: Sequence[DecisionEntry]) -> bytes:
    """A decisions record's value (the layout above) of n decisions, in order."""
    ids = [cluster_id.encode("utf-8") for _, _, cluster_id, _ in decisions]
    n = len(decisions)
    return b"".join((_DECISIONS.pack(n), *(order for order, _, _, _ in decisions),
                     *(cluster for _, cluster, _, _ in decisions),
                     struct.pack(f">{n}I", *map(len, ids)), *ids,
                     struct.pack(f">{n}I", *(len(merged) for _, _, _, merged in decisions)),
                     *(root for _, _, _, merged in decisions for root in merged)))


def decisions_entry_bytes(entry: DecisionEntry) -> int:
    """What one decision adds to a decisions record, bytes (to cut records at a size)."""
    return 2 * ORDER.size + 8 + len(entry[2].encode("utf-8")) + ORDER.size * len(entry[3])


def parse_decisions(value: bytes) -> list[DecisionEntry]:
    """``decisions_value``'s inverse.

    Raises:
        ValueError (struct.error, UnicodeDecodeError): a value of another layout.
    """
    (n,) = _DECISIONS.unpack_from(value)
    o = ORDER.size
    at = _DECISIONS.size
    orders = [value[at + o * i:at + o * (i + 1)] for i in range(n)]
    at += o * n
    clusters = [value[at + o * i:at + o * (i + 1)] for i in range(n)]
    at += o * n
    id_lengths = struct.unpack_from(f">{n}I", value, at)
    at += 4 * n
    ids = []
    for length in id_lengths:
        ids.append(value[at:at + length].decode("utf-8"))
        at += length
    merged_counts = struct.unpack_from(f">{n}I", value, at)
    at += 4 * n
    merged = []
    for count in merged_counts:
        merged.append([value[at + o * i:at + o * (i + 1)] for i in range(count)] if count else ())
        at += o * count
    if at != len(value) or (n and len(clusters[-1]) != o):
        raise ValueError("decisions record of the wrong length")
    return list(zip(orders, clusters, ids, merged))


@dataclass(slots=True)  # not frozen: made per document, and a frozen one takes 3.6 times as long
class BandRecord:
    """One document as one shard sees it.

    Attributes:
        order: the 20-byte order key.
        id: the document's external id.
        buckets: uint64, shape (k,): its bucket ids in the bands this shard owns.
        fingerprints: uint32, sorted distinct: its shingle set.
        offset: the band-topic offset of the record it was read from (-1: not read from
            the band topic).
        entry: its index among that record's documents (-1: as ``offset``).
    """

    order: bytes
    id: str
    buckets: np.ndarray
    fingerprints: np.ndarray
    offset: int = -1
    entry: int = -1

    def value(self) -> bytes:
        """The record's value (the layout above)."""
        return band_values(self.id, [self.buckets], self.fingerprints)[0]

    @classmethod
    def parse(cls, key: bytes, value: bytes) -> BandRecord:
        """Raises: ValueError (struct.error) on a record of another layout."""
        if len(key) != ORDER.size:
            raise ValueError(f"an order key has {ORDER.size} bytes, not {len(key)}")
        k, n_id, f = _band_lengths(value)
        at = BAND.size
        raw_id = value[at:at + n_id]
        at += n_id
        # read-only views of ``value`` (no copy on a little-endian machine)
        buckets = np.frombuffer(value, dtype="<u8", count=k, offset=at).astype(np.uint64, copy=False)
        fingerprints = np.frombuffer(value, dtype="<u4", count=f, offset=at + 8 * k).astype(np.uint32, copy=False)
        return cls(key, raw_id.decode("utf-8"), buckets, fingerprints)


def _band_lengths(value: bytes) -> tuple[int, int, int]:
    """(bucket ids, id bytes, fingerprints) of a band record value, its length checked.

    Raises:
        ValueError (struct.error): a value of another layout.
    """
    k, n_id, f = BAND.unpack_from(value)
    if len(value) != BAND.size + n_id + 8 * k + 4 * f:
        raise ValueError("band record of the wrong length")
    return k, n_id, f


def band_buckets(value: bytes) -> list[int]:
    """The bucket ids of a band record value (one document's, the layout above): what
    ``BandRecord.parse(key, value).buckets.tolist()`` gives, without the record.

    Raises:
        ValueError (struct.error): a value of another layout.
    """
    k, n_id, _ = _band_lengths(value)
    return list(struct.unpack_from(f"<{k}Q", value, BAND.size + n_id))


#: The largest band record produced, bytes (a batch's band entries for one shard
#: partition are split above it; librdkafka's message.max.bytes is 1,000,000 by default).
BANDS_RECORD_BYTES = 512 << 10
_COUNT = struct.Struct(">I")
_ENTRY = np.dtype([("k", ">u2"), ("n_id", ">u2"), ("f", ">u4")])
#: A document's bytes in a band record besides its id, bucket ids and set: its order key
#: and its entry lengths.
BAND_ENTRY_BYTES = ORDER.size + _ENTRY.itemsize


def bands_value(orders: list[bytes], ids: list[bytes], buckets: list[np.ndarray],
                fingerprints: list[np.ndarray]) -> bytes:
    """A band record's value (the layout above) of n documents.

    Args:
        orders: their order keys (20 bytes each).
        ids: their ids, UTF-8.
        buckets: per document, uint64, shape (k,): its bucket ids the shard owns.
        fingerprints: per document, uint32, sorted distinct: its shingle set.
    """
    entries = np.empty(len(orders), dtype=_ENTRY)
    entries["k"] = [len(b) for b in buckets]
    entries["n_id"] = [len(i) for i in ids]
    entries["f"] = [len(f) for f in fingerprints]
    return b"".join((_COUNT.pack(len(orders)), *orders, entries.tobytes(), *ids,
                     le_bytes(np.concatenate(buckets), "<u8") if buckets else b"",
                     le_bytes(np.concatenate(fingerprints), "<u4") if fingerprints else b""))


def _ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """int64: the indices ``starts[j]``, ..., ``starts[j] + counts[j] - 1`` of every j, in turn."""
    total = int(counts.sum())
    return np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts - starts, counts)


def batch_bands(orders: Sequence[bytes], ids: Sequence[bytes], grouped: np.ndarray, bounds: np.ndarray,
                 fingerprints: np.ndarray, offsets: np.ndarray, include: np.ndarray,
                 max_bytes: int = BANDS_RECORD_BYTES, with_sets: bool = True) -> list[list[bytes]]:
    """Per shard partition, the band record values of a batch's documents, built as columns:
    what ``bands_value`` gives for the documents touching it in turn (byte for byte),
    a record cut after the document that takes it above ``max_bytes``.

    Every (document, shard partition) entry of the batch is gathered at once, ordered by
    partition then document, so that each record is a run of those columns: the work per
    partition is a few slices, not a pass over the batch (at 1,024 partitions that pass
    cost prepare about 90 µs per document).

    Args:
        orders: n order keys (20 bytes each).
        ids: n ids, UTF-8.
        grouped: uint64, shape (n, bands), and ``bounds``: int64, shape (n, shards + 1):
            each document's bucket ids grouped by shard (``neardup.sharded.routing.shard_bounds``).
        fingerprints: uint32, the documents' shingle sets one after the other;
            ``offsets``: int64, shape (n + 1,): document i's is ``fingerprints[offsets[i]:offsets[i + 1]]``.
        include: bool, shape (n,): the documents to send (the others touch no shard).
        with_sets: False: the records without the sets (every f 0; ``sets_values``
            holds them, once per document).
    """
    n = len(orders)
    shards = bounds.shape[1] - 1
    offsets = np.asarray(offsets, dtype=np.int64)
    out: list[list[bytes]] = [[] for _ in range(shards)]
    counts = (bounds[:, 1:] - bounds[:, :-1]) * np.asarray(include, dtype=bool)[:, None]
    part, doc = np.nonzero(counts.T)  # every entry, by partition then document
    if not len(doc):
        return out
    k = counts[doc, part]
    f = (offsets[1:n + 1] - offsets[:n])[doc] * with_sets  # set sizes (0: the sets sent apart)
    n_id = np.fromiter(map(len, ids), dtype=np.int64, count=n)[doc]
    entries = np.empty(len(doc), dtype=_ENTRY)
    entries["k"], entries["n_id"], entries["f"] = k, n_id, f
    entry_bytes = entries.tobytes()
    bucket_bytes = le_bytes(grouped[np.repeat(doc, k), _ranges(bounds[doc, part], k)], "<u8")
    k_at = np.concatenate(([0], np.cumsum(8 * k))).tolist()
    # each document's set as bytes once, joined into every record it goes to
    raw = le_bytes(fingerprints[offsets[0]:offsets[n]], "<u4")
    cuts = (4 * (offsets[:n + 1] - offsets[0])).tolist()
    sets = [raw[cuts[i]:cuts[i + 1]] if include[i] and with_sets else b"" for i in range(n)]
    size = np.cumsum(BAND_ENTRY_BYTES + n_id + 8 * k + 4 * f)
    docs = doc.tolist()
    cut = np.flatnonzero(np.diff(part)) + 1  # where each partition's entries start and end
    starts, ends = np.concatenate(([0], cut)).tolist(), np.concatenate((cut, [len(doc)])).tolist()
    at_size = size.tolist()
    for first, last in zip(starts, ends):
        q = int(part[first])
        start = first
        while start < last:  # records of at most max_bytes, each cut after the document taking it above
            base = at_size[start - 1] if start else 0
            if at_size[last - 1] - base <= max_bytes:
                end = last
            else:
                end = min(int(np.searchsorted(size[start:last], base + max_bytes, side="right")) + 1 + start, last)
            rows = docs[start:end]
            out[q].append(b"".join((_COUNT.pack(end - start), *(orders[i] for i in rows),
                                    entry_bytes[_ENTRY.itemsize * start:_ENTRY.itemsize * end],
                                    *(ids[i] for i in rows), bucket_bytes[k_at[start]:k_at[end]],
                                    *(sets[i] for i in rows))))
            start = end
    return out


def band_orders(value: bytes) -> list[bytes]:
    """The order keys of a band record (what a record cut short still names).

    Raises:
        ValueError (struct.error): not even those can be read.
    """
    (n,) = _COUNT.unpack_from(value)
    if len(value) < _COUNT.size + ORDER.size * n:
        raise ValueError("band record cut short")
    return [value[_COUNT.size + ORDER.size * i:_COUNT.size + ORDER.size * (i + 1)] for i in range(n)]


def parse_bands(value: bytes, offset: int = -1, sets: dict[bytes, np.ndarray] | None = None) -> list[BandRecord]:
    """``bands_value``'s inverse: one ``BandRecord`` per document, its arrays read-only
    views of ``value``; ``offset``: the band-topic offset of the record (each
    ``BandRecord`` carries it and its index, ``entry``); ``sets``: for a record sent
    without the sets (``SETS_HEADER``), its documents' sets by order key
    (``parse_sets`` of the set records the header names).

    Raises:
        ValueError (struct.error, UnicodeDecodeError): a record of another layout, or
            a document whose set ``sets`` lacks.
    """
    orders = band_orders(value)
    n = len(orders)
    at = _COUNT.size + ORDER.size * n
    entries = np.frombuffer(value, dtype=_ENTRY, count=n, offset=at)
    at += _ENTRY.itemsize * n
    k, n_id, f = (entries[c].astype(np.int64) for c in ("k", "n_id", "f"))
    id_end = at + int(n_id.sum())
    k_total, f_total = int(k.sum()), int(f.sum())
    if len(value) != id_end + 8 * k_total + 4 * f_total:
        raise ValueError("band record of the wrong length")
    buckets = np.frombuffer(value, dtype="<u8", count=k_total, offset=id_end).astype(np.uint64, copy=False)
    fps = np.frombuffer(value, dtype="<u4", count=f_total, offset=id_end + 8 * k_total).astype(np.uint32,
                                                                                            copy=False)
    raw_ids = value[at:id_end]
    i_at, k_at, f_at = ([0, *np.cumsum(c).tolist()] for c in (n_id, k, f))
    if raw_ids.isascii():  # one decode: a character per byte, the byte offsets serve
        text = raw_ids.decode("ascii")
        ids = [text[a:b] for a, b in zip(i_at, i_at[1:])]
    else:
        ids = [raw_ids[a:b].decode("utf-8") for a, b in zip(i_at, i_at[1:])]
    if sets is not None:
        if f_total:
            raise ValueError("band record with sets of its own and a set record's")
        try:
            return [BandRecord(order, doc_id, buckets[ka:kb], sets[order], offset, i)
                    for i, (order, doc_id, ka, kb) in enumerate(zip(orders, ids, k_at, k_at[1:]))]
        except KeyError as exc:
            raise ValueError(f"set of document {ORDER.unpack(exc.args[0])} in none of its set records") from None
    return [BandRecord(order, doc_id, buckets[ka:kb], fps[fa:fb], offset, i)
            for i, (order, doc_id, ka, kb, fa, fb) in enumerate(zip(orders, ids, k_at, k_at[1:], f_at, f_at[1:]))]


_SETS_REF = struct.Struct(">i")
_OFFSET = struct.Struct(">q")


def sets_values(orders: Sequence[bytes], fingerprints: np.ndarray, offsets: np.ndarray, include: np.ndarray,
                max_bytes: int = BANDS_RECORD_BYTES) -> list[bytes]:
    """The set records (the layout above) of a batch's documents: each document's set
    once, a record cut after the document that takes it above ``max_bytes``.

    Args:
        orders: n order keys (20 bytes each).
        fingerprints: uint32, the documents' shingle sets one after the other;
            ``offsets``: int64, shape (n + 1,): document i's is
            ``fingerprints[offsets[i]:offsets[i + 1]]``.
        include: bool, shape (n,): the documents sent to the shards.
    """
    rows = np.flatnonzero(np.asarray(include, dtype=bool)).tolist()
    offsets = np.asarray(offsets, dtype=np.int64)
    counts = (offsets[1:] - offsets[:-1])
    raw = le_bytes(fingerprints[offsets[0]:offsets[-1]], "<u4")
    cuts = (4 * (offsets - offsets[0])).tolist()
    entry = (ORDER.size + 4 + 4 * counts).tolist()  # a document's bytes in a set record
    return [_sets_value(orders, counts, raw, cuts, run)
            for run in split_runs(rows, entry.__getitem__, max_bytes - _COUNT.size)]


def _sets_value(orders: Sequence[bytes], counts: np.ndarray, raw: bytes, cuts: list[int], rows: list[int]) -> bytes:
    return b"".join((_COUNT.pack(len(rows)), *(orders[i] for i in rows), counts[rows].astype(">u4").tobytes(),
                     *(raw[cuts[i]:cuts[i + 1]] for i in rows)))


def parse_sets(value: bytes) -> dict[bytes, np.ndarray]:
    """``sets_values``' inverse: order key -> uint32 shingle set (a read-only view of
    ``value``).

    Raises:
        ValueError (struct.error): a record of another layout.
    """
    orders = band_orders(value)
    n = len(orders)
    at = _COUNT.size + ORDER.size * n
    counts = np.frombuffer(value, dtype=">u4", count=n, offset=at).astype(np.int64)
    at += 4 * n
    total = int(counts.sum())
    if len(value) != at + 4 * total:
        raise ValueError("set record of the wrong length")
    fps = np.frombuffer(value, dtype="<u4", count=total, offset=at).astype(np.uint32, copy=False)
    bounds = [0, *np.cumsum(counts).tolist()]
    return {order: fps[a:b] for order, a, b in zip(orders, bounds, bounds[1:])}


def sets_ref(partition: int, offsets: Sequence[int]) -> bytes:
    """``SETS_HEADER``'s value: the set topic's partition and the offsets there of a
    band record's set records."""
    return _SETS_REF.pack(partition) + b"".join(map(_OFFSET.pack, offsets))


def parse_sets_ref(value: bytes) -> tuple[int, list[int]]:
    """``sets_ref``'s inverse.

    Raises:
        ValueError (struct.error): a value of another layout.
    """
    if len(value) < _SETS_REF.size or (len(value) - _SETS_REF.size) % _OFFSET.size:
        raise ValueError(f"a set reference of {len(value)} bytes")
    (partition,) = _SETS_REF.unpack_from(value)
    return partition, [o for (o,) in _OFFSET.iter_unpack(value[_SETS_REF.size:])]


def le_bytes(values: np.ndarray, dtype: str) -> bytes:
    """The bytes of ``values`` as ``dtype`` (``"<u8"`` or ``"<u4"``: little-endian): the
    array's own when it has that type already (a native one on a little-endian machine)."""
    return (values if values.dtype.str == dtype else values.astype(dtype)).tobytes()


def band_values(doc_id: str, buckets: list[np.ndarray], fingerprints: np.ndarray) -> list[bytes]:
    """The band record values (the layout above) of one document for several shard
    partitions, its id and set encoded once.

    Args:
        doc_id: the document's id.
        buckets: per shard partition, uint64, shape (k,): its bucket ids there.
        fingerprints: uint32, sorted distinct: its shingle set.
    """
    raw_id = doc_id.encode("utf-8")
    fp = le_bytes(fingerprints, "<u4")
    f = len(fingerprints)
    return [b"".join((BAND.pack(len(b), len(raw_id), f), raw_id, le_bytes(b, "<u8"), fp)) for b in buckets]


def seq_order(seq: int) -> bytes:
    """The order key of ``order_seq``'s integer."""
    return ORDER.pack(seq >> 96, (seq >> 64) & 0xFFFFFFFF, seq & 0xFFFFFFFFFFFFFFFF)


def order_time(key: bytes) -> int:
    """The record timestamp (ms) of an order key."""
    return ORDER.unpack(key)[0]
