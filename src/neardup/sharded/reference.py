"""The sharded rules run in one process, document by document in order: the reference the
sharded stages are checked against, and the measure of how their verdicts differ from
one process's (``benchmarks/scale_out_agreement.py``)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from neardup.core.settings import EngineSettings
from neardup.core.types import Document, Rejected, Verdict
from neardup.detector import Preparer
from neardup.sharded.decide import decide
from neardup.sharded.routing import owned_bands
from neardup.sharded.shard import ShardIndex
from neardup.state.decisions import DecisionsTable


class ShardedReference:
    """``shards`` in-memory shard partitions and the decide rule, fed in order.

    Args:
        settings: the engine settings (Jaccard or containment, either cluster policy).
        shards: number of shard partitions, at least 1.

    Raises:
        ValueError: ``shards`` below 1.
    """

    def __init__(self, settings: EngineSettings, shards: int) -> None:
        if shards < 1:
            raise ValueError(f"shards must be at least 1, not {shards}")
        self.settings = settings
        self.shards = [ShardIndex(settings) for _ in range(shards)]
        self.prepare = Preparer(settings)
        self.ids: list[str] = []
        self.clusters = DecisionsTable(components=settings.cluster_policy == "components")
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
            seq = len(self.ids)
            self.ids.append(doc.id)
            fp = p.fingerprints[p.fingerprint_offsets[i]:p.fingerprint_offsets[i + 1]]
            findings = []
            for q, bands in enumerate(owned_bands(buckets[i], len(self.shards))):
                if len(bands):
                    self.touched[q] += 1
                    findings.append(self.shards[q].add(seq, buckets[i][bands], fp, doc.id)[0])
            verdict, cluster, merged = decide(seq, findings, self.clusters, self.settings.threshold,
                                              self.ids.__getitem__, self.settings.cluster_policy)
            self.clusters.apply([(seq, cluster, self.ids[cluster], merged)], seq + 1)
            out.append(verdict)
        return out


def run_sharded(documents: Sequence[Document], settings: EngineSettings, shards: int,
                batch_size: int = 2000) -> list[Verdict | Rejected]:
    """Every document's verdict under the sharded rules, in input order."""
    ref = ShardedReference(settings, shards)
    out: list[Verdict | Rejected] = []
    for i in range(0, len(documents), batch_size):
        out += ref.process(documents[i:i + batch_size])
    return out
