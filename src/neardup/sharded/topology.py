"""The topics of a sharded deduplication (docs/scale-out.md): their names, partition
counts and cleanup policies, created when missing and checked when present."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from confluent_kafka.admin import AdminClient

from neardup.config import Settings
from neardup.kafka.bounded import discard
from neardup.kafka.clients import admin_config
from neardup.kafka.limits import TopicLimits, input_limits, internal_max_bytes
from neardup.kafka.topics import BROKER_DEFAULT, create_missing, new_topic

log = logging.getLogger(__name__)

#: ``max.message.bytes`` of the internal topics when they are created, bytes.
INTERNAL_MAX_BYTES = 64 << 20
#: The stages' producers compress their record batches (``-X compression.type=...``
#: sets another, ``none`` none): the internal records' order keys, ids, findings and
#: changelog records, and the input copied to decide, shrink to about a third to a half;
#: the shingle sets and bucket ids, hashes, hardly (docs/scale-out.md, "Bytes per document").
STAGE_PRODUCER = {"compression.type": "lz4"}


class TopologyMismatchError(ValueError):
    """An existing topic of the topology has another partition count than asked: the
    bucket-to-shard and document-to-decide mappings would change under the state."""


@dataclass(frozen=True)
class Topology:
    """Names and partition counts of one sharded deduplication.

    Attributes:
        app: the prefix of its internal topics (and its consumer groups).
        shards: partitions of the band topic and of the shards' changelog (partition p's
            state is logged to changelog partition p): the number of shard partitions,
            fixed for the life of the state.
        decide_partitions: partitions of the findings topic and of decide's changelog.
        sources: the input topics the prepare stage reads (``--input-topic``): the
            internal topics are created large enough for their records' shingle sets.
        keep_bands: create the band and set topics keeping their records for good (``retention.ms``
            and ``retention.bytes`` -1; the stages do): the shards' changelog then refers
            to the band records instead of copying each member's set, and shards with a
            retention window delete the band records their members no longer need
            (``neardup.sharded.shard_stage``). Without it the band topic keeps the
            broker's default retention, and the changelog the members' sets.
    """

    app: str
    shards: int
    decide_partitions: int
    sources: tuple[str, ...] = ()
    keep_bands: bool = False

    def __post_init__(self) -> None:
        if self.shards < 1 or self.decide_partitions < 1:
            raise ValueError("shard and decide partition counts must be at least 1")

    @property
    def bands(self) -> str:
        return f"{self.app}.bands"

    @property
    def sets(self) -> str:
        """The set topic: each document's shingle set once (prepare without a retention
        window), read by every shard process (``neardup.sharded.sets``)."""
        return f"{self.app}.sets"

    @property
    def findings(self) -> str:
        return f"{self.app}.findings"

    @property
    def decisions(self) -> str:
        return f"{self.app}.decisions"

    @property
    def shard_changelog(self) -> str:
        return f"{self.app}.shard-changelog"

    @property
    def decide_changelog(self) -> str:
        return f"{self.app}.decide-changelog"

    def topics(self, max_bytes: int = INTERNAL_MAX_BYTES) -> dict[str, tuple[int, dict[str, str]]]:
        """Every internal topic: (partitions, topic config), ``max_bytes`` its
        ``max.message.bytes`` when created."""
        # A band record and a member's changelog record hold a shingle set (about 4 bytes a
        # character of text); a document record and a waiting document hold the input value.
        large = {"max.message.bytes": str(max_bytes)}
        deleted = {"cleanup.policy": "delete", **large}
        compacted = {"cleanup.policy": "compact", **large}
        kept = {"retention.ms": "-1", "retention.bytes": "-1"} if self.keep_bands else {}
        return {
            self.bands: (self.shards, {**deleted, **kept}),
            self.sets: (self.shards, {**deleted, **kept}),
            self.findings: (self.decide_partitions, deleted),
            self.decisions: (1, compacted),
            self.shard_changelog: (self.shards, compacted),
            self.decide_changelog: (self.decide_partitions, compacted),
        }

    def ensure(self, admin: AdminClient, timeout_s: float = 30.0, replication_factor: int = BROKER_DEFAULT,
               max_bytes: int = INTERNAL_MAX_BYTES) -> list[str]:
        """Create the missing topics (``replication_factor`` replicas, -1: the broker's
        default; ``max_bytes`` their ``max.message.bytes``); check the partition counts
        of the others.

        Returns:
            The names of the topics created.

        Raises:
            TopologyMismatchError: an existing topic has another partition count.
            TopicCreationError: the broker refused a creation for what was asked.
            KafkaException: the broker could not be asked, or failed a creation.
        """
        wanted = self.topics(max_bytes)
        existing = admin.list_topics(timeout=timeout_s).topics
        for name, (partitions, _) in wanted.items():
            meta = existing.get(name)
            if meta is not None and meta.error is None and len(meta.partitions) != partitions:
                raise TopologyMismatchError(
                    f"topic {name} has {len(meta.partitions)} partitions, the topology asks for "
                    f"{partitions}; a sharded state cannot change its partition counts")
        missing = [new_topic(name, p, replication_factor, config)
                   for name, (p, config) in wanted.items() if name not in existing]
        created = create_missing(admin, missing, timeout_s)
        if len(created) < len(missing):  # created meanwhile by another process: check it
            return created + self.ensure(admin, timeout_s, replication_factor, max_bytes)
        return created

    def ensure_with(self, settings: Settings) -> list[str]:
        """``ensure`` with an admin client of ``settings`` (closed after), its
        ``topic_replication_factor``, and a ``max.message.bytes`` that takes the shingle
        set of any record of ``sources`` (``internal_max_bytes``; the topics a regex
        matches are not known here: 64 MiB holds the sets of a 16 MiB text).

        Raises:
            TopologyMismatchError, TopicCreationError, KafkaException: as ``ensure``.
        """
        admin = AdminClient(admin_config(settings))
        try:
            largest = input_limits(TopicLimits(admin_config(settings)), self.sources)
            return self.ensure(admin, replication_factor=settings.topic_replication_factor,
                               max_bytes=internal_max_bytes(largest, INTERNAL_MAX_BYTES))
        finally:
            discard(admin)
