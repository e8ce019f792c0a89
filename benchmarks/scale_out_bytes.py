"""Kafka bytes per document of the sharded stages, today's design against alternatives,
computed without a broker from the real documents, the real routing and the real records.

Input: ``--docs`` documents of the replayed Reuters stream (``benchlib.replay_stream``),
each an input record as ``kafka_e2e.py`` and ``scale_out.py`` produce it (key: the id;
value: JSON ``{"id", "text"}``); *input bytes* are its key + value. They are prepared in
batches of ``--batch`` (prepare's default batch size) with the default engine settings
(``neardup.detector.Preparer``), given order keys of 4 input partitions, and routed to
``S`` shard partitions (``neardup.sharded.routing``) for each ``--shards`` count. Every
shard partition runs the real ``neardup.sharded.shard.ShardIndex`` (the stage's rules:
members met, ranking, exact verification, bucket joins), so the findings and the
members each shard writes are the stage's.

Bytes are key + value, as ``scale_out.py`` counts them (record headers and Kafka's own
record and batch framing are left out). Where a layout exists the bytes are those of the
real encoders (``neardup.sharded.records.bands_value``, ``found_value``,
``findings_value``, ``neardup.state.shard_store.member_value``); the others are stated
in ``LAYOUTS`` below. The decisions topic and decide's changelog do not change with the
design: their bytes are taken as measured (``DECISIONS``, ``DECIDE_CHANGELOG``,
``results/scale_out_ab2/new_16_2.json``).

Designs:

- ``A``: today. The band record (one per prepare batch and shard partition) carries each
  document's id, bucket ids on that shard and its whole shingle set; the shard writes a
  member record (``M`` + order key: copies, id, the buckets joined, the set) per
  document that joins there, and a ``P`` record per batch and shard partition; one
  findings entry per (document, shard) to decide, with its verified candidates; the
  input record goes to decide on the findings topic (*document*).
- ``B``: band records of order keys and bucket ids only; the shard's member records keep
  the buckets joined and the copies, no id and no set; each set is written once to a set
  store partitioned by document (``decide_partition`` of the order key over ``S``
  partitions): its record and its changelog record. The shard sends its candidates to the
  set-store partition of the new document (per (document, shard): an entry, with each
  candidate's order key and shared-band count). Candidates are the *candidate pairs*:
  earlier documents sharing at least one band bucket with the document (the real LSH
  over every document, no bucket cap), together with what the shard's rules send
  (the first ``max_candidates + extra_candidates`` members met and their copy buckets),
  one per pair. Verification then needs the two sets in one place, two ways:
  ``B-push``, the new document's set shipped once to each other set-store partition
  holding candidates, the similarities sent back; ``B-pull``, each other partition
  asked for its candidates and answering with their sets. Either way the new
  document's set-store partition then sends decide one findings entry per document with
  today's verified candidates (what decide needs to give today's verdict).
- ``C``: today with the fingerprint columns compressed: ``C-varint``, each set's sorted
  fingerprints as deltas in LEB128 varints (in band and member records); ``C-zlib``, the
  same records with varints and each record batch compressed by zlib level 6 (Kafka's
  gzip codec; ``zstandard`` and ``lz4`` are not installed here): band records one by one,
  member records and findings per (prepare batch, partition), the document records of a
  batch per decide partition.
- ``D``: ``B`` with the cheaper of push and pull per document and two more cuts: the
  set topic is its own changelog (compacted, keyed by order key: written once, as Kafka
  Streams restores a table from its source topic), and a shard sends candidates only
  for documents that met some (the set store learns that a shard had none from the
  shard's progress, as decide learns today how many shards answer).
- ``D2``: ``D`` with the order keys of a band record as varint columns (see ``LAYOUTS``),
  and the shard's member records as one record per (batch, shard partition) in the same
  columns, not one per member.
- ``D3``: ``D2`` with the set topic partitioned as the shards are, by the shard partition
  owning the document's band-0 bucket, and read with it (co-partitioned: one process
  reads shard partition q and set partition q): a near copy shares its band-0 bucket
  with its original more often than not, so both sets are in one place; a shard sends
  candidates to the document's home partition only when it is another, as one record per
  (batch, shard, home partition), the keys as varint columns (``LAYOUTS``).
- ``E``: the set written once to a set topic that every shard process reads whole (as a
  Kafka Streams global table: each process keeps the sets of the documents touching its
  partitions), so that a shard still verifies its own candidates: no exchange with a set
  store, today's findings (``A``) to decide, ``D2``'s band records and member records (each
  member record also naming the set record's offset, 8 bytes), the set topic kept like
  today's band topic (no changelog of its own). Written once (the "set store" column),
  and read once by every shard process.
- ``D-doc``: ``D2`` with the input record's value left off the findings topic (decide
  would read it from the input topic by partition and offset): not proposed, shown to
  say what the copy of the input costs.

Printed: per shard count, candidate pairs per document and the set-store partitions they
fall in; then per design and shard count the bytes per document by topic, the total and
the total over the input bytes; ``--json`` keeps it all.
"""

from __future__ import annotations

import argparse
import json
import time
import zlib
from collections import defaultdict
from pathlib import Path

import numpy as np

import benchlib

from neardup.core.settings import EngineSettings
from neardup.core.types import Document
from neardup.detector import Preparer
from neardup.sharded.records import (ORDER, band_values, bands_value, decide_partition, findings_value,
                                     found_value, order_key, order_seq)
from neardup.sharded.routing import group_by_shard, shard_of
from neardup.sharded.shard import ShardIndex
from neardup.state.shard_store import member_value

#: Measured at 16 shards (``results/scale_out_ab2/new_16_2.json``; decisions as one record
#: per batch, 74.2 bytes with a JSON record per document before), the same at 4: the
#: decisions topic and decide's changelog, bytes per document; they do not depend on
#: how the shards get the sets.
DECISIONS, DECIDE_CHANGELOG = 52.0, 42.1
#: A ``P`` record of the shard changelog: key ``b"P"``, value ">qq" + the last order key.
P_RECORD = 1 + 16 + ORDER.size
#: The layouts of the records that do not exist yet (bytes, key + value).
LAYOUTS = {
    "B band record": '">I" n; n order keys (20 B); n × ">B" bucket count k; the bucket ids (uint64): '
                     "4 + Σ (21 + 8k)",
    "B member record": 'key "M" + order key (21 B); value ">I" copies c, c order keys, ">H" k, k bucket ids '
                       "(uint64): 21 + 6 + 20c + 8k",
    "B set record": 'key order key (20 B); value ">BHI" shards touched, id length L, fingerprint count f; '
                    "id; f × uint32: 27 + L + 4f (and the same again on its changelog)",
    "B candidates entry": "shard -> the new document's set partition, per (document, shard): order key, "
                          '">HH" shard, count m, then m × (order key, ">B" bands shared): 24 + 21m',
    "B-push set": "to each other partition holding candidates: order key, \">I\" f, the set, \">H\" m, "
                  "m candidate order keys: 26 + 4f + 20m; back per candidate: two order keys and "
                  '">ddd" Jaccard, containment, similarity: 64',
    "B-pull request": 'to each other partition holding candidates: order key, ">H" m, m order keys: 22 + 20m; '
                      'back per candidate: two order keys, ">HI" id length, f, id, the set: 46 + L + 4f',
    "D2 band record": '">I" n; the n order keys as varint columns (timestamp minus the one before, zigzag; '
                      "input partition; offset minus the partition's one before, zigzag); n × \">B\" k; "
                      "the bucket ids (uint64)",
    "D2 member record": 'one per (batch, shard partition): key "M" + the first order key (21 B); value ">I" n, '
                        'the order keys as in a D2 band record, n × ">BB" buckets joined k and copies c, the '
                        "copies' order keys (20 B each), the bucket ids joined (uint64)",
    "D3 candidates record": "one per (batch, shard partition, home partition): \">I\" n; the n order keys as "
                            "in a D2 band record; per document \">B\" m, then m × (the candidate's order key as "
                            "varints: timestamp difference, zigzag; partition; offset; \">B\" bands shared)",
    "E set record": "as the B set record, written once to a topic every shard process reads; an E member "
                    "record is a D2 member record and the set record's offset (8 B)",
    "B findings entry": "to decide, per document: order key, \">H\" count, then per verified candidate: "
                        "order key, \">ddd\", \">H\" id length, id (46 + L): 22 + Σ (46 + L)",
}


def varint_bytes(values: np.ndarray) -> int:
    """Bytes of ``values`` (non-negative) as LEB128 varints."""
    v = values.astype(np.uint64)
    n = np.ones(len(v), dtype=np.int64)
    for bits in (7, 14, 21, 28, 35):
        n += v >= np.uint64(1 << bits)
    return int(n.sum())


def delta_varint(fp: np.ndarray) -> int:
    """A sorted set of uint32 fingerprints as a varint count, then deltas as varints."""
    if not len(fp):
        return 1
    deltas = np.diff(fp.astype(np.int64), prepend=0)
    return varint_bytes(np.array([len(fp)])) + varint_bytes(deltas)


def zigzag(x: np.ndarray) -> np.ndarray:
    return np.where(x >= 0, 2 * x, -2 * x - 1)


def order_column_bytes(orders: list[bytes]) -> int:
    """Bytes of ``orders`` (order keys, in a record's order) as columns of varints: the
    timestamp's delta from the one before (zigzag), the input partition, and the offset's
    delta from the last one of that partition (zigzag; the first of a partition in full)."""
    keys = [ORDER.unpack(o) for o in orders]
    ts = np.array([k[0] for k in keys], dtype=np.int64)
    part = np.array([k[1] for k in keys], dtype=np.int64)
    off = np.array([k[2] for k in keys], dtype=np.int64)
    dts = zigzag(np.diff(ts, prepend=0))
    doff = np.empty_like(off)
    last: dict[int, int] = {}
    for j, (p, o) in enumerate(zip(part.tolist(), off.tolist())):
        doff[j] = o - last.get(p, 0)
        last[p] = o
    return varint_bytes(dts) + varint_bytes(part) + varint_bytes(zigzag(doff))


def relative_key_bytes(order: bytes, earlier: bytes) -> int:
    """Bytes of an earlier document's order key written against ``order``'s: varints of
    the timestamp difference (zigzag), its input partition and its offset."""
    ts, _, _ = ORDER.unpack(order)
    ts_c, p_c, off_c = ORDER.unpack(earlier)
    return varint_bytes(np.array([2 * (ts - ts_c) if ts >= ts_c else 2 * (ts_c - ts) - 1, p_c, off_c]))


def delta_varint_raw(fp: np.ndarray) -> bytes:
    """``delta_varint``'s actual bytes (for the zlib variant)."""
    out = bytearray()
    for x in np.diff(fp.astype(np.int64), prepend=0).tolist():
        while x >= 0x80:
            out.append((x & 0x7F) | 0x80)
            x >>= 7
        out.append(x)
    return bytes(out)


def load(docs: int, batch: int, count_from: int = 0) -> dict[str, object]:
    """The documents prepared: per valid document its order key, id, bucket ids and set;
    the input bytes and order key of every document."""
    corpus = benchlib.load_corpus(benchlib.default_corpus())
    stream = list(benchlib.replay_stream(corpus, docs))
    # kafka_e2e.encode: key the id, value JSON {"id", "text"}
    inputs = [(i.encode("utf-8"), json.dumps({"id": i, "text": t}, ensure_ascii=False).encode("utf-8"))
              for i, t in stream]
    orders = [order_key(1_700_000_000_000 + n, n % 4, n // 4) for n in range(len(stream))]
    prepare = Preparer(EngineSettings())
    batches = []
    starts = [*range(0, min(count_from, len(stream)), batch), *range(count_from, len(stream), batch)]
    for start in starts:
        end = min(start + batch, count_from if start < count_from else len(stream))
        chunk = [Document(i, t) for i, t in stream[start:end]]
        p = prepare(chunk)
        idx = [start + j for j, reason in enumerate(p.rejected) if reason is None]
        fps = [p.fingerprints[p.fingerprint_offsets[v]:p.fingerprint_offsets[v + 1]].copy() for v in range(len(idx))]
        batches.append({"docs": idx, "all": list(range(start, start + len(chunk))), "buckets": p.buckets, "fps": fps,
                        "counted": start >= count_from})
    return {"inputs": inputs, "orders": orders, "ids": [i for i, _ in stream], "batches": batches}


def measure(data: dict, shards: int, settings: EngineSettings) -> dict[str, object]:
    inputs, orders, ids = data["inputs"], data["orders"], data["ids"]
    counted = [b for b in data["batches"] if b["counted"]]
    n_docs = sum(len(b["all"]) for b in counted)
    raw_ids = [i.encode("utf-8") for i in ids]
    setp = [decide_partition(o, shards) for o in orders]  # the set-store partition of each document
    decide_parts = 4
    index = [ShardIndex(settings) for _ in range(shards)]
    home3: dict[int, int] = {}
    lsh: dict[int, list[int]] = defaultdict(list)  # bucket id -> every earlier document (no cap)
    fsize: dict[int, int] = {}
    limit = settings.max_candidates + settings.extra_candidates
    t: dict[str, dict[str, float]] = {d: defaultdict(float) for d in
                                      ("A", "B-push", "B-pull", "C-varint", "C-zlib", "D", "D2", "D3", "E", "D-doc")}
    stats = defaultdict(float)
    touched_total = 0
    for b in data["batches"]:
        if not b["counted"]:  # a batch before --count-from: into the state, its bytes not counted
            kept = ({d: dict(x) for d, x in t.items()}, dict(stats), touched_total)
        docs = b["docs"]
        # the input records, on the findings topic to decide (today's document record: key + value)
        doc_bytes = sum(len(inputs[i][0]) + len(inputs[i][1]) for i in b["all"])
        for d in ("A", "B-push", "B-pull", "C-varint", "D", "D2", "D3", "E"):
            t[d]["document"] += doc_bytes
        t["D-doc"]["document"] += sum(len(inputs[i][0]) + ORDER.size for i in b["all"])  # key and order key
        per_dp = defaultdict(list)
        for i in b["all"]:
            per_dp[decide_partition(orders[i], decide_parts)].append(inputs[i][0] + inputs[i][1])
        t["C-zlib"]["document"] += sum(len(zlib.compress(b"".join(v), 6)) for v in per_dp.values())
        if not docs:
            continue
        grouped, bounds = group_by_shard(b["buckets"], shards)
        fps = b["fps"]
        varints = [delta_varint(fp) for fp in fps]
        # --- band records: one per (batch, shard partition), today's layout, real bytes
        entries = defaultdict(list)
        for v, i in enumerate(docs):
            cut = bounds[v]
            for q in range(shards):
                if cut[q + 1] > cut[q]:
                    entries[q].append((v, i, grouped[v, cut[q]:cut[q + 1]]))
        for q, es in entries.items():
            value = bands_value([orders[i] for _, i, _ in es], [raw_ids[i] for _, i, _ in es],
                                [bk for _, _, bk in es], [fps[v] for v, _, _ in es])
            t["A"]["bands"] += len(value)
            saved = sum(4 * len(fps[v]) - varints[v] for v, _, _ in es)
            t["C-varint"]["bands"] += len(value) - saved
            head = value[:len(value) - 4 * sum(len(fps[v]) for v, _, _ in es)]
            t["C-zlib"]["bands"] += len(zlib.compress(
                head + b"".join(delta_varint_raw(fps[v]) for v, _, _ in es), 6))
            b_band = 4 + sum(21 + 8 * len(bk) for _, _, bk in es)
            for d in ("B-push", "B-pull", "D", "D-doc"):
                t[d]["bands"] += b_band
            t["D2"]["bands"] += 4 + order_column_bytes([orders[i] for _, i, _ in es]) + sum(
                1 + 8 * len(bk) for _, _, bk in es)
            touched_total += len(es)
        # --- the shards, document by document in order
        members_by_q = defaultdict(list)  # (C-zlib) member records of this batch per shard partition
        joined_by_q = defaultdict(list)  # (D2) (order key, copies, buckets joined) per shard partition
        entries3 = defaultdict(list)  # (D3) per (shard partition, home partition): (order key, candidates)
        found_by_dp = defaultdict(list)
        for v, i in enumerate(docs):
            seq = order_seq(orders[i])
            fp = fps[v]
            fsize[i] = len(fp)
            cut = bounds[v]
            my_part = setp[i]
            pairs: dict[int, int] = {}  # candidate document -> bands shared (all shards)
            checked: dict[int, tuple[float, float, float]] = {}
            entries_b = []  # per shard touched: candidates sent
            home3[i] = shard_of(b["buckets"][v][:1], shards)[0].item()  # D3: the shard of its band-0 bucket
            for q in range(shards):
                if cut[q + 1] == cut[q]:
                    continue
                bk = grouped[v, cut[q]:cut[q + 1]]
                # candidates: every earlier document sharing a bucket here (the LSH, no cap) ...
                met: dict[int, int] = {}
                for x in bk.tolist():
                    for c in lsh.get(x, ()):
                        met[c] = met.get(c, 0) + 1
                # ... and what the shard's rules send: the first `limit` members met, their copies
                lists = index[q]._members(bk.tolist())
                shared: dict[int, int] = {}
                for members in lists:
                    for m in members:
                        shared[m] = shared.get(m, 0) + 1
                ranked = sorted(shared, key=lambda m: (-shared[m], m))[:limit]
                for m in ranked:
                    met.setdefault(_doc_of(m), 0)
                    for c in index[q]._copies(m):
                        met.setdefault(_doc_of(c), 0)
                entries_b.append(len(met))
                if met and q != home3[i]:
                    entries3[(q, home3[i])].append((orders[i], list(met)))
                for c, k in met.items():
                    pairs[c] = pairs.get(c, 0) + k
                finding, joins = index[q].add(seq, bk, fp, ids[i])
                cands = []
                for x in finding.checked:
                    c = _doc_of(x.seq)
                    cands.append((orders[c], ids[c], x.jaccard, x.containment, x.similarity))
                    checked[c] = (x.jaccard, x.containment, x.similarity)
                f = found_value(orders[i], q, cands)
                t["A"]["findings"] += len(f)
                t["E"]["findings"] += len(f)
                t["C-varint"]["findings"] += len(f)
                found_by_dp[decide_partition(orders[i], decide_parts)].append(f)
                if not joins.empty:
                    copies = [orders[_doc_of(c)] for c in joins.copies]
                    band = band_values(ids[i], [joins.buckets], fp)[0]  # the stage's member band
                    member = member_value(copies, band)
                    key = 1 + ORDER.size
                    t["A"]["shard changelog"] += key + len(member)
                    t["C-varint"]["shard changelog"] += key + len(member) - 4 * len(fp) + varints[v]
                    members_by_q[q].append(b"M" + orders[i] + member[:len(member) - 4 * len(fp)]
                                           + delta_varint_raw(fp))
                    b_member = key + 6 + ORDER.size * len(copies) + 8 * len(joins.buckets)
                    for d in ("B-push", "B-pull", "D", "D-doc"):
                        t[d]["shard changelog"] += b_member
                    joined_by_q[q].append((orders[i], len(copies), len(joins.buckets)))
            for k in entries_b:  # B: candidates entries, per (document, shard)
                for d in ("B-push", "B-pull"):
                    t[d]["exchange"] += 24 + 21 * k
                if k:  # D: only from shards that met some
                    for d in ("D", "D2", "D-doc"):
                        t[d]["exchange"] += 24 + 21 * k
            remote: dict[int, list[int]] = defaultdict(list)
            for c in pairs:
                if setp[c] != my_part:
                    remote[setp[c]].append(c)
            push = sum(26 + 4 * len(fp) + 20 * len(cs) + 64 * len(cs) for cs in remote.values())
            pull = sum(22 + 20 * len(cs) + sum(46 + len(raw_ids[c]) + 4 * fsize[c] for c in cs)
                       for cs in remote.values())
            t["B-push"]["exchange"] += push
            t["B-pull"]["exchange"] += pull
            for d in ("D", "D2", "D-doc"):
                t[d]["exchange"] += min(push, pull)
            remote3: dict[int, list[int]] = defaultdict(list)
            for c in pairs:
                if home3[c] != home3[i]:
                    remote3[home3[c]].append(c)
            push3 = sum(26 + 4 * len(fp) + 20 * len(cs) + 64 * len(cs) for cs in remote3.values())
            pull3 = sum(22 + 20 * len(cs) + sum(46 + len(raw_ids[c]) + 4 * fsize[c] for c in cs)
                        for cs in remote3.values())
            t["D3"]["exchange"] += min(push3, pull3)
            stats["remote_partitions_first_bucket"] += len(remote3)
            stats["push"] += push
            stats["pull"] += pull
            stats["pairs"] += len(pairs)
            stats["pairs_lsh"] += sum(1 for c, k in pairs.items() if k)
            stats["with_pairs"] += bool(pairs)
            stats["partitions"] += len({setp[c] for c in pairs})
            stats["remote_partitions"] += len(remote)
            stats["checked"] += len(checked)
            stats["shard_findings"] += len(entries_b)
            # B and D: the set once (its record; B also its changelog), findings once per document
            set_record = 27 + len(raw_ids[i]) + 4 * len(fp)
            findings_b = 22 + sum(46 + len(raw_ids[c]) for c in checked)
            for d in ("B-push", "B-pull"):
                t[d]["set store"] += 2 * set_record
                t[d]["findings"] += findings_b
            for d in ("D", "D2", "D3", "D-doc"):
                t[d]["set store"] += set_record
                t[d]["findings"] += findings_b
            t["E"]["set store"] += set_record
            for x in b["buckets"][v].tolist():  # now an earlier document in all its buckets
                lsh[x].append(i)
        # P records: one per shard partition touched by the batch (a shard batch taken as a prepare batch)
        for d in t:
            t[d]["shard changelog"] += P_RECORD * len(entries)
        for es in entries3.values():  # D3: one candidates record per (batch, shard, home partition)
            t["D3"]["exchange"] += 4 + order_column_bytes([o for o, _ in es]) + sum(
                1 + sum(1 + relative_key_bytes(o, orders[c]) for c in cs) for o, cs in es)
        stats["member_records"] += len(joined_by_q)
        for ms in joined_by_q.values():  # D2: one member record per (batch, shard partition)
            t["D2"]["shard changelog"] += 1 + ORDER.size + 4 + order_column_bytes([o for o, _, _ in ms]) + sum(
                2 + ORDER.size * c + 8 * k for _, c, k in ms)
        t["C-zlib"]["shard changelog"] += sum(len(zlib.compress(b"".join(ms), 6)) for ms in members_by_q.values())
        t["C-zlib"]["findings"] += sum(len(zlib.compress(findings_value(fs), 6)) for fs in found_by_dp.values())
        t["A"]["findings"] += 4 * len(found_by_dp)  # the findings records' counts
        t["E"]["findings"] += 4 * len(found_by_dp)
        t["C-varint"]["findings"] += 4 * len(found_by_dp)
        if not b["counted"]:
            t = {d: defaultdict(float, x) for d, x in kept[0].items()}
            stats, touched_total = defaultdict(float, kept[1]), kept[2]
    input_bytes = sum(len(inputs[i][0]) + len(inputs[i][1]) for b in counted for i in b["all"]) / n_docs
    for topic in ("bands", "shard changelog"):
        t["D3"][topic] = t["D2"][topic]
    t["E"]["bands"] = t["D2"]["bands"]
    t["E"]["shard changelog"] = t["D2"]["shard changelog"] + 8 * stats["member_records"]
    t["D-doc"] = {**t["D2"], "document": t["D-doc"]["document"]}  # D2 without the input's value to decide
    designs = {}
    for d, topics in t.items():
        per_doc = {k: v / n_docs for k, v in topics.items()}
        per_doc["decisions + decide changelog"] = DECISIONS + DECIDE_CHANGELOG
        total = sum(per_doc.values())
        designs[d] = {"bytes_per_document": per_doc, "total": total, "x_input": total / input_bytes}
    valid = sum(len(b["docs"]) for b in counted)
    return {"shards": shards, "input_bytes": input_bytes, "documents": n_docs, "valid": valid,
            "shards_touched_per_document": touched_total / valid,
            "candidate_pairs_per_document": stats["pairs"] / valid,
            "candidate_pairs_lsh_per_document": stats["pairs_lsh"] / valid,
            "documents_with_candidates": stats["with_pairs"] / valid,
            "set_partitions_holding_candidates_per_document": stats["partitions"] / valid,
            "other_set_partitions_per_document": stats["remote_partitions"] / valid,
            "other_first_bucket_partitions_per_document": stats["remote_partitions_first_bucket"] / valid,
            "verified_today_per_document": stats["checked"] / valid,
            "push_bytes_per_document": stats["push"] / n_docs, "pull_bytes_per_document": stats["pull"] / n_docs,
            "designs": designs}


_BASE = 1_700_000_000_000


def _doc_of(seq: int) -> int:
    """The document number of an order seq (``load``'s order keys: time = base + number)."""
    return (seq >> 96) - _BASE


TOPIC_ORDER = ("document", "findings", "bands", "shard changelog", "set store", "exchange",
               "decisions + decide changelog")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", type=int, default=20_000, help="documents of the replayed Reuters stream")
    ap.add_argument("--shards", type=int, nargs="+", default=[4, 16, 64])
    ap.add_argument("--batch", type=int, default=2000, help="prepare's batch (documents)")
    ap.add_argument("--count-from", type=int, default=0,
                    help="documents before this one go into the state, their bytes not counted")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    git = benchlib.git_state()
    print(f"{benchlib.describe_git(git)}; load average {' '.join(open('/proc/loadavg').read().split()[:3])}")
    started = time.perf_counter()
    data = load(args.docs, args.batch, args.count_from)
    settings = EngineSettings()
    runs = []
    for s in args.shards:
        runs.append(measure(data, s, settings))
    n = runs[0]["documents"]
    print(f"{n:,} documents counted (from document {args.count_from:,}; {runs[0]['valid']:,} with a shingle set), input {runs[0]['input_bytes']:,.0f} B per "
          f"document (key + value); bytes are key + value per input document\n")
    print(benchlib.table(
        ["shards", "shards touched", "candidate pairs", "of them by the LSH", "docs with any",
         "set partitions holding them", "other than its own", "other (by first bucket)", "verified today"],
        [[r["shards"], f"{r['shards_touched_per_document']:.2f}", f"{r['candidate_pairs_per_document']:.2f}",
          f"{r['candidate_pairs_lsh_per_document']:.2f}", f"{r['documents_with_candidates']:.3f}",
          f"{r['set_partitions_holding_candidates_per_document']:.2f}",
          f"{r['other_set_partitions_per_document']:.2f}",
          f"{r['other_first_bucket_partitions_per_document']:.2f}", f"{r['verified_today_per_document']:.2f}"]
         for r in runs]))
    print("(per document with a set; candidate pairs deduplicated per pair)\n")
    rows = []
    for d in runs[0]["designs"]:
        for r in runs:
            x = r["designs"][d]
            rows.append([d, r["shards"], *(f"{x['bytes_per_document'].get(k, 0):,.0f}" for k in TOPIC_ORDER),
                         f"{x['total']:,.0f}", f"{x['x_input']:.2f}"])
    print(benchlib.table(["design", "shards", *TOPIC_ORDER, "total", "× input"], rows, left=1))
    print("\nlayouts of the records that do not exist yet:")
    for k, v in LAYOUTS.items():
        print(f"  {k}: {v}")
    seconds = time.perf_counter() - started
    print(f"\n{seconds:.0f} s; load average {' '.join(open('/proc/loadavg').read().split()[:3])}")
    if args.json:
        benchlib.write_json(args.json, {"environment": benchlib.environment(), "git": git, "args": {
            "docs": args.docs, "shards": args.shards, "batch": args.batch, "count_from": args.count_from}, "layouts": LAYOUTS,
            "decisions_and_decide_changelog_measured": [DECISIONS, DECIDE_CHANGELOG],
            "seconds": seconds, "runs": runs})


if __name__ == "__main__":
    main()
