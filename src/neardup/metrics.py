"""Prometheus metrics of a neardup process, on a registry of its own.

Nothing is created at import time and the default registry is never touched: each
``Metrics`` owns a ``CollectorRegistry``, so several can live in one process (tests).
Names follow the Prometheus conventions: a ``neardup_`` prefix, base units (seconds,
bytes), ``_total`` on counters, ``_info`` on the build information, one label name for
a verdict (``verdict``) in both modes. Every registry also carries prometheus_client's
standard ``process_*`` (memory, CPU, open files) and ``python_*`` (version, garbage
collector) collectors, and no ``_created`` series (``disable_created_metrics``, a
setting of prometheus_client for the whole process, applied when a registry is built).

Feeding it:

- ``observe_batch(stats)`` after every committed Kafka batch (``KafkaDeduplicator``'s
  ``on_batch``); ``observe_results(results, seconds)`` after every batch of the embedded
  mode (``dedup_files``' ``on_batch``).
- ``set_lag(lag)`` with ``KafkaDeduplicator.lag()``; ``set_assignment(partitions)`` on
  rebalances (drops the lag of partitions no longer assigned).
- ``transaction_aborted()`` from ``on_abort``.
- ``watch_progress(progress)`` once: ``neardup_input_waiting_since_timestamp_seconds``
  reads the consumer's ``neardup.kafka.progress.Progress`` at every scrape.
- ``observe_restore(event)`` from a changelog restore's ``on_restore``: True when it
  begins (``neardup_restore_in_progress`` 1), its ``RestoreStats`` when it ends.
- ``refresh_state(store)`` after batches: reads ``store.stats()`` at most every
  ``state_interval`` seconds.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
from prometheus_client import (
    CollectorRegistry,
    Counter,
    GCCollector,
    Gauge,
    Histogram,
    Info,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from neardup import __version__
from neardup.core.types import Rejected, Verdict
from neardup.state import codec

if TYPE_CHECKING:
    from neardup.core.settings import EngineSettings
    from neardup.detector import VerdictColumns
    from neardup.run import BatchStats

VERDICTS = ("unique", "duplicate")
DEAD_LETTER_REASONS = ("tombstone", "too_large", "invalid_utf8", "invalid_json", "missing_field", "empty_text",
                       "output_too_large", "produce_failed")
TRANSACTION_OUTCOMES = ("committed", "aborted")
STATE_FAMILIES = ("default", *codec.FAMILIES)

# Bucket bounds. Latency: a message's age when its batch commits, seconds.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0)
BATCH_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
CANDIDATE_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
SIMILARITY_BUCKETS = (0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9, 0.925, 0.95, 0.975, 0.99, 1.0)
CLUSTER_BUCKETS = (2, 3, 4, 5, 8, 16, 32, 64, 128, 256, 1024, 4096)



def observe_many(histogram: Histogram, amounts: Sequence[float] | np.ndarray) -> None:
    """``histogram.observe(a)`` for every ``a`` of ``amounts`` (float64, shape (n,)), in one
    pass: each bucket's count and the sum incremented once, the buckets found by binary
    search over the upper bounds (an amount belongs to the first bound at or above it, as
    ``observe`` counts it). The collected counts are those of the loop; the sum may differ
    from it in the last bits of a float (another order of additions).

    Reads the histogram's own bucket values (``_upper_bounds``, ``_buckets``, ``_sum``,
    prometheus-client's since 0.4); a histogram without them is observed one amount at a
    time.
    """
    values = np.asarray(amounts, dtype=np.float64)
    if not len(values):
        return
    try:
        bounds, buckets, total = histogram._upper_bounds, histogram._buckets, histogram._sum
    except AttributeError:  # another layout of the library: the loop
        for amount in values.tolist():
            histogram.observe(amount)
        return
    histogram._raise_if_not_observable()
    total.inc(float(values.sum()))
    counts = np.bincount(np.searchsorted(bounds, values, side="left"), minlength=len(bounds))
    for i in np.flatnonzero(counts[: len(bounds)]).tolist():
        buckets[i].inc(int(counts[i]))

class _HasStats(Protocol):
    def stats(self) -> dict[str, int]: ...


def _registry() -> CollectorRegistry:
    """A new registry with the process (``process_*``) and interpreter (``python_info``,
    ``python_gc_*``) collectors on it, and ``_created`` series turned off."""
    disable_created_metrics()
    registry = CollectorRegistry(auto_describe=True)
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    return registry


class StoredCounter(Collector):
    """A counter whose count is kept elsewhere (a state store's statistics) and only read
    here: exposed as ``<name>_total`` with the last value given to ``set``.

    The count survives restarts with the state, so a restarted process goes on from it
    instead of from 0 (no false increase for ``rate``); it goes down only when the
    state is wiped, which Prometheus reads as a counter reset.

    Args:
        name: the name without ``_total``.
        documentation: the HELP text.
        registry: where to register it.
    """

    def __init__(self, name: str, documentation: str, registry: CollectorRegistry) -> None:
        self.name = name
        self.documentation = documentation
        self.value = 0.0
        registry.register(self)

    def set(self, value: float) -> None:
        """The count now (a number >= 0)."""
        self.value = float(value)

    def describe(self) -> list[CounterMetricFamily]:
        return [CounterMetricFamily(self.name, self.documentation)]

    def collect(self) -> list[CounterMetricFamily]:
        return [CounterMetricFamily(self.name, self.documentation, value=self.value)]


class Metrics:
    """The metrics of one neardup process.

    Args:
        state_interval: least seconds between two reads of the state store's statistics
            (RocksDB properties) by ``refresh_state``.
    """

    def __init__(self, state_interval: float = 5.0) -> None:
        self.registry = _registry()
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
        self.value_left_out = Counter(
            "neardup_dead_letter_value_left_out",
            "Dead letters produced without the message's value (and perhaps key and headers): the dead-letter "
            "topic's max.message.bytes is too small for the message; its neardup-source-* headers point at it.",
            registry=r)
        self.future_times = Counter(
            "neardup_future_timestamps",
            "Documents whose time lay beyond now plus --future-tolerance, taken as now (they would have moved "
            "the retention window).", registry=r)
        self.replayed = Counter(
            "neardup_replayed", "Messages produced again from their stored outcome after a restart.", registry=r)
        self.batch_seconds = Histogram(
            "neardup_batch_seconds", "Time to process and commit one batch, seconds.",
            buckets=BATCH_BUCKETS, registry=r)
        self.latency = Histogram(
            "neardup_latency_seconds", "From a message's Kafka timestamp to the commit of its output, seconds.",
            buckets=LATENCY_BUCKETS, registry=r)
        self.candidates = Histogram(
            "neardup_candidates", "LSH candidates (bucket collisions) checked per document.",
            buckets=CANDIDATE_BUCKETS, registry=r)
        self.candidates_rejected = Counter(
            "neardup_candidates_rejected", "Candidates whose estimated Jaccard similarity fell below the threshold.",
            registry=r)
        self.match_similarity = Histogram(
            "neardup_match_similarity", "Similarity of a duplicate to its best accepted match (exact or estimated, per --verify).",
            buckets=SIMILARITY_BUCKETS, registry=r)
        self.cluster_size = Histogram(
            "neardup_cluster_size", "Size of the cluster a duplicate joins, itself included.",
            buckets=CLUSTER_BUCKETS, registry=r)
        self.consumer_lag = Gauge(
            "neardup_consumer_lag", "Messages behind: high watermark minus consumer position, after the last batch.",
            ["topic", "partition"], registry=r)
        self.assigned_partitions = Gauge(
            "neardup_assigned_partitions", "Input partitions assigned to this consumer.", registry=r)
        self.waiting_since = Gauge(
            "neardup_input_waiting_since_timestamp_seconds",
            "Unix time since which input has waited (a batch in hand, or a failed one to retry) with no batch "
            "committed; 0 while nothing waits or a restore runs. time() minus it: how long the consumer has been stuck.",
            registry=r)
        self.transactions = Counter(
            "neardup_transactions", "Kafka transactions, by outcome (committed|aborted).", ["outcome"], registry=r)
        self.state_keys = Gauge(
            "neardup_state_keys", "Estimated keys per column family of the state store.", ["family"], registry=r)
        self.state_bytes = Gauge(
            "neardup_state_bytes", "Bytes of the state, by kind (sst|memtable: RocksDB; bucket_index: the in-memory LSH bucket index; forest: the in-memory union-find forest; set_cache: the in-memory cache of fingerprint sets).", ["kind"], registry=r)
        self.state_documents = Gauge(
            "neardup_state_documents", "Documents stored in the state.", registry=r)
        self.documents_held = Gauge(
            "neardup_documents_held", "Documents still candidates under the retention window (all, without one).",
            registry=r)
        self.documents_expired = StoredCounter(
            "neardup_documents_expired", "Documents expired by the retention window since the state began.", r)
        self.oldest_held_age = Gauge(
            "neardup_oldest_held_age_seconds",
            "Age of the oldest document held (now minus its time: Kafka record timestamp or arrival), seconds.",
            registry=r)
        self.largest_bucket = Gauge(
            "neardup_largest_bucket_size", "Members of the largest LSH band bucket ever written.", registry=r)
        self.restore_records = Counter(
            "neardup_restore_records", "Changelog records read to restore the state.", registry=r)
        self.restore_bytes = Counter(
            "neardup_restore_bytes", "Bytes (keys and values) of the changelog records read to restore the state.",
            registry=r)
        self.restore_seconds = Counter(
            "neardup_restore_seconds", "Time spent restoring the state from the changelog, seconds.", registry=r)
        self.restore_in_progress = Gauge(
            "neardup_restore_in_progress", "1 while the state is being restored from the changelog, else 0.",
            registry=r)
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
        verdicts = list(verdicts)
        self._observe([v.candidates for v in verdicts], [v.is_duplicate for v in verdicts],
                      [v.similarity for v in verdicts], [v.cluster_size for v in verdicts],
                      [v.rejected for v in verdicts])

    def observe_columns(self, columns: VerdictColumns, dead: Sequence[int] = ()) -> None:
        """``observe_verdicts`` of the verdicts of ``columns``, but those at the indices
        ``dead`` (documents whose records went to the dead-letter topic instead)."""
        keep = np.ones(len(columns), dtype=bool)
        keep[np.asarray(dead, dtype=np.int64)] = False
        self._observe(*(np.asarray(c)[keep] for c in (columns.candidates, columns.duplicate, columns.similarity,
                                                     columns.cluster_size, columns.rejected)))

    def _observe(self, candidates: Sequence[int] | np.ndarray, duplicate: Sequence[bool] | np.ndarray,
                 similarity: Sequence[float] | np.ndarray, cluster_size: Sequence[int] | np.ndarray,
                 rejected: Sequence[int] | np.ndarray) -> None:
        """The engine metrics of verdicts given as columns of one length: candidates of
        every one; similarity and cluster size of the duplicates; rejected candidates."""
        duplicate = np.asarray(duplicate, dtype=bool)
        observe_many(self.candidates, np.asarray(candidates, dtype=np.float64))
        observe_many(self.match_similarity, np.asarray(similarity, dtype=np.float64)[duplicate])
        observe_many(self.cluster_size, np.asarray(cluster_size, dtype=np.float64)[duplicate])
        total = int(np.asarray(rejected, dtype=np.int64).sum())
        if total:
            self.candidates_rejected.inc(total)

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
        if stats.value_left_out:
            self.value_left_out.inc(stats.value_left_out)
        if stats.future_times:
            self.future_times.inc(stats.future_times)
        if stats.replayed:
            self.replayed.inc(stats.replayed)
        self.batch_seconds.observe(stats.seconds)
        if len(stats.timestamps_ms):
            latency = now - np.asarray(stats.timestamps_ms, dtype=np.float64) / 1000.0
            observe_many(self.latency, np.maximum(latency, 0.0))
        if stats.columns is not None:
            self.observe_columns(stats.columns, stats.dead_columns)
        self.transactions.labels("committed").inc()

    def observe_restore(self, stats: Any) -> None:
        """A restore from the changelog began (``stats`` True) or ended (``stats`` a
        ``neardup.kafka.changelog.RestoreStats``: records, bytes, seconds)."""
        if stats is True:
            self.restore_in_progress.set(1)
            return
        self.restore_in_progress.set(0)
        self.restore_records.inc(stats.records)
        self.restore_bytes.inc(stats.bytes)
        self.restore_seconds.inc(stats.seconds)

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

    def watch_progress(self, progress: Any) -> None:
        """Read ``progress.waiting_since()`` (a ``neardup.kafka.progress.Progress``) into
        ``neardup_input_waiting_since_timestamp_seconds`` at every scrape."""
        self.waiting_since.set_function(progress.waiting_since)

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
        self.state_bytes.labels("set_cache").set(stats.get("set_cache_bytes", 0))
        self.state_documents.set(stats.get("documents", 0))
        self.largest_bucket.set(stats.get("max_bucket_size", 0))
        self.documents_held.set(stats.get("documents_held", 0))
        self.documents_expired.set(stats.get("documents_expired", 0))
        oldest = stats.get("oldest_held_ms", 0)
        self.oldest_held_age.set(max(time.time() - oldest / 1000, 0.0) if oldest else 0.0)
        return True

    # --- exposition --------------------------------------------------------------------
    def exposition(self) -> bytes:
        """The registry in the Prometheus text format (what /metrics serves)."""
        return generate_latest(self.registry)


#: Lateness of a band record behind the last one its shard released, seconds of record time.
LATENESS_BUCKETS = (0.001, 0.01, 0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 300.0)


class StageMetrics:
    """The metrics of one process of a sharded stage (``neardup stage``), every series
    labelled with its ``stage`` (prepare|shard|decide) so that one dashboard shows them
    side by side. Fed with ``observe`` after every committed batch (the stage's
    ``on_batch``: a ``PrepareWritten``, ``ShardWritten`` or ``DecideWritten``),
    ``set_lag``, ``set_assignment`` and ``transaction_aborted``.

    Args:
        stage: prepare, shard or decide.
    """

    def __init__(self, stage: str) -> None:
        self.stage = stage
        self.registry = _registry()
        r = self.registry
        self._lag_labels: set[tuple[str, str]] = set()
        self.consumed = Counter(
            "neardup_stage_records_consumed", "Records consumed and committed by the stage (input, band or findings records).",
            ["stage"], registry=r)
        self.produced_bytes = Counter(
            "neardup_stage_produced_bytes",
            "Bytes (key + value) the stage produced, by kind (bands|documents: prepare; findings|changelog: shard).",
            ["stage", "kind"], registry=r)
        self.batch_seconds = Histogram(
            "neardup_stage_batch_seconds", "Time to process and commit one batch, seconds.",
            ["stage"], buckets=BATCH_BUCKETS, registry=r)
        self.transactions = Counter(
            "neardup_stage_transactions", "Kafka transactions, by outcome (committed|aborted).",
            ["stage", "outcome"], registry=r)
        self.consumer_lag = Gauge(
            "neardup_stage_consumer_lag", "Records behind: high watermark minus consumer position, after the last batch.",
            ["stage", "topic", "partition"], registry=r)
        self.assigned_partitions = Gauge(
            "neardup_stage_assigned_partitions", "Partitions assigned to this process.", ["stage"], registry=r)
        self.waiting_since = Gauge(
            "neardup_stage_input_waiting_since_timestamp_seconds",
            "Unix time since which input has waited (a batch in hand, or a failed one to retry) with no batch "
            "committed; 0 while nothing waits or a restore runs.", ["stage"], registry=r)
        self.waiting_since.labels(stage).set(0)
        self.restoring = Gauge(
            "neardup_stage_restore_in_progress",
            "1 while this process restores the state of partitions newly assigned (from their changelog), else 0.",
            ["stage"], registry=r)
        self.restoring.labels(stage).set(0)
        self.late = Counter(
            "neardup_reorder_late_records",
            "Documents of band records that came after a later one of their shard was released (past the reorder window), processed at once.",
            ["stage"], registry=r)
        self.lateness = Histogram(
            "neardup_reorder_lateness_seconds",
            "How far a late document of a band record was behind the last one its shard released, seconds of record time.",
            ["stage"], buckets=LATENESS_BUCKETS, registry=r)
        self.held = Gauge(
            "neardup_reorder_held_records", "Documents of band records held in the reorder window after the last batch.",
            ["stage"], registry=r)
        self.expired = Counter(
            "neardup_stage_documents_expired",
            "Members a shard deleted from its state (and changelog) once they left the retention window (--retention).",
            ["stage"], registry=r)
        self.documents = Counter(
            "neardup_stage_documents", "Documents given a verdict by decide, by verdict (unique|duplicate).",
            ["stage", "verdict"], registry=r)
        self.dead_letter = Counter(
            "neardup_stage_dead_letter", "Documents decide sent to the dead-letter topic.", ["stage"], registry=r)
        self.waiting = Gauge(
            "neardup_decide_waiting_documents",
            "Documents decide holds after the last batch: waiting for a shard's finding or an earlier document's cluster.",
            ["stage"], registry=r)
        self.build = Info("neardup_build", "Version and engine settings of this process.", registry=r)
        self.consumed.labels(stage)
        for outcome in TRANSACTION_OUTCOMES:
            self.transactions.labels(stage, outcome)
        if stage == "shard":
            self.late.labels(stage)
            self.lateness.labels(stage)
            self.held.labels(stage).set(0)
            self.expired.labels(stage)
        if stage == "decide":
            for verdict in VERDICTS:
                self.documents.labels(stage, verdict)
            self.dead_letter.labels(stage)
            self.waiting.labels(stage).set(0)

    def set_build_info(self, engine: EngineSettings) -> None:
        """Publish the version, the stage and the engine settings as ``neardup_build_info``."""
        self.build.info({"version": __version__, "stage": self.stage, "num_perm": str(engine.num_perm),
                         "bands": str(engine.bands.bands), "rows": str(engine.bands.rows),
                         "threshold": str(engine.threshold), "shingling": str(engine.shingling)})

    def observe(self, written: Any) -> None:
        """One committed batch of the stage (its ``on_batch`` argument)."""
        s = self.stage
        self.consumed.labels(s).inc(written.messages)
        self.batch_seconds.labels(s).observe(written.seconds)
        self.transactions.labels(s, "committed").inc()
        if s == "prepare":
            self.produced_bytes.labels(s, "bands").inc(written.band_bytes)
            self.produced_bytes.labels(s, "documents").inc(written.document_bytes)
        elif s == "shard":
            self.produced_bytes.labels(s, "findings").inc(written.finding_bytes)
            self.produced_bytes.labels(s, "changelog").inc(written.changelog_bytes)
            self.late.labels(s).inc(written.late)
            for ms in written.lateness_ms:
                self.lateness.labels(s).observe(ms / 1000)
            self.held.labels(s).set(written.held)
            self.expired.labels(s).inc(written.expired)
        else:
            self.documents.labels(s, "unique").inc(written.unique)
            self.documents.labels(s, "duplicate").inc(written.duplicate)
            self.dead_letter.labels(s).inc(written.dead_letter)
            self.waiting.labels(s).set(written.waiting)

    def transaction_aborted(self, *_: Any) -> None:
        """A batch's transaction was aborted (the stage's ``on_abort``)."""
        self.transactions.labels(self.stage, "aborted").inc()

    def set_assignment(self, partitions: Sequence[Any]) -> None:
        """The assigned partitions (objects with ``topic`` and ``partition``)."""
        self.assigned_partitions.labels(self.stage).set(len(partitions))
        keep = {(p.topic, str(p.partition)) for p in partitions}
        for topic, partition in self._lag_labels - keep:
            self.consumer_lag.remove(self.stage, topic, partition)
        self._lag_labels &= keep

    def watch_progress(self, progress: Any) -> None:
        """As ``Metrics.watch_progress``: ``neardup_stage_input_waiting_since_timestamp_seconds``,
        and ``neardup_stage_restore_in_progress`` (``progress.restoring_for``)."""
        self.waiting_since.labels(self.stage).set_function(progress.waiting_since)
        self.restoring.labels(self.stage).set_function(lambda: float(progress.restoring_for() is not None))

    def set_lag(self, lag: dict[tuple[str, int], int]) -> None:
        """Records behind per (topic, partition)."""
        for (topic, partition), value in lag.items():
            self.consumer_lag.labels(self.stage, topic, str(partition)).set(value)
            self._lag_labels.add((topic, str(partition)))

    def exposition(self) -> bytes:
        """The registry in the Prometheus text format (what /metrics serves)."""
        return generate_latest(self.registry)
