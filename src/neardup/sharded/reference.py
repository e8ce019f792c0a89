"""The sharded rules run in one process, document by document in order: the reference the
sharded stages are checked against, and the measure of how their verdicts differ from
one process's (``benchmarks/scale_out_agreement.py``)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from neardup.core.retention import NO_TIME, Retention
from neardup.core.settings import EngineSettings
from neardup.core.types import Document, Rejected, Verdict
from neardup.detector import Preparer
from neardup.sharded.decide import decide
from neardup.sharded.records import order_key, order_seq
from neardup.sharded.routing import owned_bands
from neardup.sharded.shard import ShardIndex, seq_time
from neardup.state.decisions import DecisionsTable


class ShardedReference:
    """``shards`` in-memory shard partitions and the decide rule, fed in order.

    Args:
        settings: the engine settings (Jaccard or containment, either cluster policy).
        shards: number of shard partitions, at least 1.
        retention: a retention window by time (``Retention.seconds``), as the stages keep
            it (``neardup.sharded.shard``): a document's seq is then the order seq of its
            time (``Document.time``, seconds; ms in the order key) and its place in the
            input, the shards expire and remove their members, and the decisions of
            documents no shard can report any more are dropped (a lookup of one would
            raise ``KeyError``).

    Raises:
        ValueError: ``shards`` below 1, a window by document count, a window with the
            components cluster policy (a merged cluster's root may be older than the
            window, so the decisions cannot be dropped), or (at ``process``) a document
            without a time under a window.
    """

    def __init__(self, settings: EngineSettings, shards: int, retention: Retention | None = None) -> None:
        if shards < 1:
            raise ValueError(f"shards must be at least 1, not {shards}")
        if retention is not None and retention.documents is not None:
            raise ValueError("the sharded rules keep a retention window by time only")
        if retention is not None and settings.cluster_policy == "components":
            raise ValueError("the sharded rules keep a retention window with the canonical cluster policy only")
        self.settings = settings
        self.retention_ms = retention.millis if retention is not None else None
        self.shards = [ShardIndex(settings, self.retention_ms) for _ in range(shards)]
        self.prepare = Preparer(settings)
        self.ids: dict[int, str] = {}
        self.count = 0  # documents given a seq
        self.clusters: dict[int, int] | DecisionsTable = (
            DecisionsTable(components=True) if settings.cluster_policy == "components" else {})
        self.expired = 0  # members the shards removed
        self._pruned_below = NO_TIME
        self.touched = np.zeros(shards, dtype=np.int64)  # documents that reached each shard

    def process(self, documents: Sequence[Document]) -> list[Verdict | Rejected]:
        """Verdicts of a batch, after every document given before."""
        p = self.prepare(documents)
        out: list[Verdict | Rejected] = []
        buckets = p.buckets
        valid = iter(range(len(p.valid)))
        for doc, reason in zip(documents, p.rejected):
            if reason is not None:
                out.append(Rejected(doc.id, reason))
                continue
            i = next(valid)
            seq = self._seq(doc)
            self.ids[seq] = doc.id
            fp = p.fingerprints[p.fingerprint_offsets[i]:p.fingerprint_offsets[i + 1]]
            findings = []
            held_from = None
            for q, bands in enumerate(owned_bands(buckets[i], len(self.shards))):
                if len(bands):
                    self.touched[q] += 1
                    findings.append(self.shards[q].add(seq, buckets[i][bands], fp, doc.id)[0])
                    if self.retention_ms is not None:
                        held_from = max(held_from or NO_TIME, self.shards[q].floor())
            verdict, cluster, merged = decide(seq, findings, self.clusters, self.settings.threshold,
                                              self.ids.__getitem__, self.settings.cluster_policy, held_from)
            if isinstance(self.clusters, DecisionsTable):
                self.clusters.apply([(seq, cluster, self.ids[cluster], merged)], self.count)
            else:
                self.clusters[seq] = cluster
            out.append(verdict)
            if self.retention_ms is not None:
                self._expire()
        return out

    def _seq(self, doc: Document) -> int:
        self.count += 1
        if self.retention_ms is None:
            return self.count - 1
        if doc.time is None:
            raise ValueError(f"document {doc.id!r} has no time: a retention window needs every document's time")
        return order_seq(order_key(round(1000 * doc.time), 0, self.count - 1))

    def _expire(self) -> None:
        """The shards' removals, and the decisions no shard can report any more: those
        below every shard's floor (a shard reports only members at or above its floor,
        which only grows)."""
        for shard in self.shards:
            gone = shard.expired()
            shard.remove(gone)
            self.expired += len(gone)
        assert self.retention_ms is not None
        floor = min(shard.floor() for shard in self.shards)
        if floor - self._pruned_below >= max(1, self.retention_ms // 8):
            self._pruned_below = floor
            self.clusters = {s: c for s, c in self.clusters.items() if seq_time(s) >= floor}


def run_sharded(documents: Sequence[Document], settings: EngineSettings, shards: int,
                batch_size: int = 2000, retention: Retention | None = None) -> list[Verdict | Rejected]:
    """Every document's verdict under the sharded rules, in input order (``retention``:
    see ``ShardedReference``)."""
    ref = ShardedReference(settings, shards, retention)
    out: list[Verdict | Rejected] = []
    for i in range(0, len(documents), batch_size):
        out += ref.process(documents[i:i + batch_size])
    return out
