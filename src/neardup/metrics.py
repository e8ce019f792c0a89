"""Prometheus metrics of a neardup process, on a registry of its own.

Nothing is created at import time and the default registry is never touched: each
``Metrics`` owns a ``CollectorRegistry``, so several can live in one process (tests).
Names follow the Prometheus conventions: a ``neardup_`` prefix, base units (seconds,
bytes), ``_total`` on counters, ``_info`` on the build information.

Feeding it:

- ``observe_batch(stats)`` after every committed Kafka batch (``KafkaDeduplicator``'s
  ``on_batch``); ``observe_results(results, seconds)`` after every batch of the embedded
  mode (``dedup_files``' ``on_batch``).
- ``set_lag(lag)`` with ``KafkaDeduplicator.lag()``; ``set_assignment(partitions)`` on
  rebalances (drops the lag of partitions no longer assigned).
- ``transaction_aborted()`` from ``on_abort``.
- ``refresh_state(store)`` after batches: reads ``store.stats()`` at most every
  ``state_interval`` seconds.

The per-message histograms (latency, candidates, match similarity, cluster size) are
``BatchHistogram``s: a batch's values are counted at once with numpy, for the same series
as prometheus_client's ``Histogram``.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest
from prometheus_client.metrics_core import HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from neardup import __version__
from neardup.core.types import Rejected, Verdict
from neardup.state import codec

if TYPE_CHECKING:
    from neardup.core.settings import EngineSettings
    from neardup.io.kafka import BatchStats

VERDICTS = ("unique", "duplicate")
DEAD_LETTER_REASONS = ("tombstone", "too_large", "invalid_utf8", "invalid_json", "missing_field", "empty_text")
TRANSACTION_OUTCOMES = ("committed", "aborted")
STATE_FAMILIES = ("default", *codec.FAMILIES)

# Bucket bounds. Latency: a message's age when its batch commits, seconds.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0)
BATCH_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
CANDIDATE_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
SIMILARITY_BUCKETS = (0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9, 0.925, 0.95, 0.975, 0.99, 1.0)
CLUSTER_BUCKETS = (2, 3, 4, 5, 8, 16, 32, 64, 128, 256, 1024, 4096)


class BatchHistogram(Collector):
    """A Prometheus histogram fed a batch of observations at a time (``observe_many``).

    prometheus_client's ``Histogram.observe`` takes a lock and walks the buckets in
    Python for every value; for the per-message histograms this one counts a whole batch
    with numpy and takes its lock once. It is a custom collector (the way
    prometheus_client documents for observations counted elsewhere) that exposes the
    same series as a ``Histogram`` without labels: ``_bucket`` (cumulative, ``le`` as
    prometheus_client formats it, ``+Inf`` last), ``_count``, ``_sum`` and, unless
    ``PROMETHEUS_DISABLE_CREATED_SERIES`` is true (read at construction), ``_created``.

    Args:
        name: the metric name, without suffix.
        documentation: its help text.
        buckets: upper bounds, increasing and all >= 0; ``+Inf`` is added if missing.
        registry: where it is registered.

    Raises:
        ValueError: bounds not increasing, a negative bound, or a name already
            registered in ``registry``.
    """

    def __init__(self, name: str, documentation: str, buckets: Sequence[float],
                 registry: CollectorRegistry) -> None:
        bounds = [float(b) for b in buckets]
        if not bounds or bounds[-1] != math.inf:
            bounds.append(math.inf)
        if any(b >= c for b, c in zip(bounds, bounds[1:])) or bounds[0] < 0:
            raise ValueError(f"{name}: buckets must increase from 0 or more, got {buckets}")
        self.name = name
        self.documentation = documentation
        self._bounds = np.array(bounds)
        self._le = [floatToGoString(b) for b in bounds]
        self._counts = np.zeros(len(bounds), dtype=np.int64)
        self._sum = 0.0
        self._created = time.time()
        self._with_created = os.environ.get("PROMETHEUS_DISABLE_CREATED_SERIES", "False").lower() not in (
            "true", "1", "t")
        self._lock = threading.Lock()
        registry.register(self)

    def observe_many(self, values: Sequence[float] | np.ndarray) -> None:
        """Count ``values`` (any numbers, converted to float64): each goes to the first
        bucket whose bound is >= it, as ``Histogram.observe`` does; a NaN only goes to the
        sum (it makes it NaN)."""
        v = np.asarray(values, dtype=np.float64)
        if v.size == 0:
            return
        n = len(self._bounds)
        counts = np.bincount(np.searchsorted(self._bounds, v, side="left"), minlength=n + 1)[:n]
        total = float(v.sum())
        with self._lock:
            self._counts += counts
            self._sum += total

    def describe(self) -> list[Metric]:
        return [HistogramMetricFamily(self.name, self.documentation)]

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            counts, total = self._counts.copy(), self._sum
        family = HistogramMetricFamily(
            self.name, self.documentation, buckets=list(zip(self._le, np.cumsum(counts).tolist())),
            sum_value=total,
        )
        if self._with_created:
            family.samples.append(Sample(self.name + "_created", {}, self._created))
        yield family


class _HasStats(Protocol):
    def stats(self) -> dict[str, int]: ...


class Metrics:
    """The metrics of one neardup process.

    Args:
        state_interval: least seconds between two reads of the state store's statistics
            (RocksDB properties) by ``refresh_state``.
    """

    def __init__(self, state_interval: float = 5.0) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.state_interval = state_interval
        self._state_read_at: float | None = None
        self._lag_labels: set[tuple[str, str]] = set()

        self.documents = Counter(
            "neardup_documents", "Messages or lines produced with a verdict, by verdict (unique|duplicate); replays included.",
            ["verdict"], registry=r)
        self.dead_letter = Counter(
            "neardup_dead_letter", "Messages or lines sent to the dead-letter topic (rejects), by reason.",
            ["reason"], registry=r)
        self.replayed = Counter(
            "neardup_replayed", "Messages produced again from their stored outcome after a restart.", registry=r)
        self.batch_seconds = Histogram(
            "neardup_batch_seconds", "Time to process and commit one batch, seconds.",
            buckets=BATCH_BUCKETS, registry=r)
        self.latency = BatchHistogram(
            "neardup_latency_seconds", "From a message's Kafka timestamp to the commit of its output, seconds.",
            LATENCY_BUCKETS, r)
        self.candidates = BatchHistogram(
            "neardup_candidates", "LSH candidates (bucket collisions) checked per document.",
            CANDIDATE_BUCKETS, r)
        self.candidates_rejected = Counter(
            "neardup_candidates_rejected", "Candidates whose estimated Jaccard similarity fell below the threshold.",
            registry=r)
        self.match_similarity = BatchHistogram(
            "neardup_match_similarity", "Similarity of a duplicate to its best accepted match (exact or estimated, per --verify).",
            SIMILARITY_BUCKETS, r)
        self.cluster_size = BatchHistogram(
            "neardup_cluster_size", "Size of the cluster a duplicate joins, itself included.",
            CLUSTER_BUCKETS, r)
        self.consumer_lag = Gauge(
            "neardup_consumer_lag", "Messages behind: high watermark minus consumer position, after the last batch.",
            ["topic", "partition"], registry=r)
        self.assigned_partitions = Gauge(
            "neardup_assigned_partitions", "Input partitions assigned to this consumer.", registry=r)
        self.transactions = Counter(
            "neardup_transactions", "Kafka transactions, by outcome (committed|aborted).", ["outcome"], registry=r)
        self.state_keys = Gauge(
            "neardup_state_keys", "Estimated keys per column family of the state store.", ["family"], registry=r)
        self.state_bytes = Gauge(
            "neardup_state_bytes", "Bytes of the state, by kind (sst|memtable: RocksDB; bucket_index: the in-memory LSH bucket index; forest: the in-memory union-find forest).", ["kind"], registry=r)
        self.state_documents = Gauge(
            "neardup_state_documents", "Documents stored in the state.", registry=r)
        self.largest_bucket = Gauge(
            "neardup_largest_bucket_size", "Members of the largest LSH band bucket ever written.", registry=r)
        self.build = Info(
            "neardup_build", "Version and engine settings of this process.", registry=r)

        # Every label value known in advance exists from the start, at 0.
        for v in VERDICTS:
            self.documents.labels(v)
        for reason in DEAD_LETTER_REASONS:
            self.dead_letter.labels(reason)
        for outcome in TRANSACTION_OUTCOMES:
            self.transactions.labels(outcome)

    # --- build -------------------------------------------------------------------------
    def set_build_info(self, engine: EngineSettings) -> None:
        """Publish the version and the engine settings as ``neardup_build_info``."""
        self.build.info(
            {
                "version": __version__,
                "num_perm": str(engine.num_perm),
                "bands": str(engine.bands.bands),
                "rows": str(engine.bands.rows),
                "threshold": str(engine.threshold),
                "shingling": str(engine.shingling),
            }
        )

    # --- batches -----------------------------------------------------------------------
    def observe_verdicts(self, verdicts: Iterable[Verdict]) -> None:
        """Per-document engine metrics (candidates, rejected, similarity, cluster size)."""
        if not isinstance(verdicts, (list, tuple)):
            verdicts = list(verdicts)
        self.candidates.observe_many([v.candidates for v in verdicts])
        duplicates = [v for v in verdicts if v.verdict == "duplicate"]
        self.match_similarity.observe_many([v.similarity for v in duplicates])
        self.cluster_size.observe_many([v.cluster_size for v in duplicates])
        rejected = sum([v.rejected for v in verdicts])
        if rejected:
            self.candidates_rejected.inc(rejected)

    def observe_batch(self, stats: BatchStats, now: float | None = None) -> None:
        """One committed Kafka batch (``KafkaDeduplicator``'s ``on_batch``).

        Args:
            stats: the batch; ``timestamps_ms`` are Kafka message timestamps, ms since
                the epoch.
            now: the commit time, seconds since the epoch (default: now).
        """
        now = time.time() if now is None else now
        self.documents.labels("unique").inc(stats.unique)
        self.documents.labels("duplicate").inc(stats.duplicate)
        for reason, count in stats.dead_letter.items():
            self.dead_letter.labels(reason).inc(count)
        if stats.replayed:
            self.replayed.inc(stats.replayed)
        self.batch_seconds.observe(stats.seconds)
        if stats.timestamps_ms:
            ages = now - np.array(stats.timestamps_ms, dtype=np.float64) / 1000.0
            self.latency.observe_many(np.maximum(ages, 0.0))
        self.observe_verdicts(stats.verdicts)
        self.transactions.labels("committed").inc()

    def observe_results(self, results: Sequence[Verdict | Rejected], seconds: float) -> None:
        """One batch of the embedded mode (``dedup_files``' ``on_batch``)."""
        verdicts = [r for r in results if isinstance(r, Verdict)]
        duplicates = sum(v.is_duplicate for v in verdicts)
        self.documents.labels("unique").inc(len(verdicts) - duplicates)
        self.documents.labels("duplicate").inc(duplicates)
        rejected = len(results) - len(verdicts)
        if rejected:
            self.dead_letter.labels("empty_text").inc(rejected)
        self.batch_seconds.observe(seconds)
        self.observe_verdicts(verdicts)

    def transaction_aborted(self, *_: Any) -> None:
        """A batch's transaction was aborted (``KafkaDeduplicator``'s ``on_abort``)."""
        self.transactions.labels("aborted").inc()

    # --- consumer ----------------------------------------------------------------------
    def set_assignment(self, partitions: Sequence[Any]) -> None:
        """The assigned partitions (objects with ``topic`` and ``partition``)."""
        self.assigned_partitions.set(len(partitions))
        keep = {(p.topic, str(p.partition)) for p in partitions}
        for labels in self._lag_labels - keep:
            self.consumer_lag.remove(*labels)
        self._lag_labels &= keep

    def set_lag(self, lag: dict[tuple[str, int], int]) -> None:
        """Messages behind per (topic, partition)."""
        for (topic, partition), value in lag.items():
            labels = (topic, str(partition))
            self.consumer_lag.labels(*labels).set(value)
            self._lag_labels.add(labels)

    # --- state -------------------------------------------------------------------------
    def refresh_state(self, store: _HasStats, force: bool = False) -> bool:
        """Read ``store.stats()`` into the state gauges, unless read less than
        ``state_interval`` seconds ago. Returns whether it read them."""
        now = time.monotonic()
        if not force and self._state_read_at is not None and now - self._state_read_at < self.state_interval:
            return False
        self._state_read_at = now
        stats = store.stats()
        for family in STATE_FAMILIES:
            if f"keys_{family}" in stats:
                self.state_keys.labels(family).set(stats[f"keys_{family}"])
        self.state_bytes.labels("sst").set(stats.get("sst_bytes", 0))
        self.state_bytes.labels("memtable").set(stats.get("memtable_bytes", 0))
        self.state_bytes.labels("bucket_index").set(stats.get("index_bytes", 0))
        self.state_bytes.labels("forest").set(stats.get("forest_bytes", 0))
        self.state_documents.set(stats.get("documents", 0))
        self.largest_bucket.set(stats.get("max_bucket_size", 0))
        return True

    # --- exposition --------------------------------------------------------------------
    def exposition(self) -> bytes:
        """The registry in the Prometheus text format (what /metrics serves)."""
        return generate_latest(self.registry)
