"""The prepare stage of a sharded deduplication (docs/scale-out.md): a stateless
``Processor`` on the stage runtime (``neardup.io.stage``).

Per batch: decode the input messages, normalise, shingle, MinHash and band the documents
(``neardup.detector.Preparer``, as in one process), then produce, in the batch's
transaction, for each document one band record to every shard partition owning one of
its buckets (``neardup.sharded.routing``) and its document record to its decide
partition (``neardup.sharded.records``). A message that is no document (``MessageError``,
or no shingles after normalisation) gets a document record with its error and no band
record, so that decide sends it to the dead-letter topic and every input message leaves
through decide exactly once.

Nothing is stored: a batch whose transaction fails is consumed again from the group's
committed offsets and gives the same records (the preparation is a pure function of the
messages), so exactly once needs no state here.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import Consumer, Message, Producer, TopicPartition

from neardup.config import Settings
from neardup.core.types import Document
from neardup.detector import Preparer, warm_up
from neardup.io.clients import admin_config
from neardup.io.limits import TopicLimits
from neardup.io.messages import MessageError, carried_headers, record_size, to_document
from neardup.io.stage import StageHooks, StageRuntime, TP, next_offsets, produce
from neardup.io.topology import Topology
from neardup.sharded.records import (
    ENGINE_HEADER,
    ERROR_HEADER,
    ID_HEADER,
    KIND_HEADER,
    ORDER_HEADER,
    SHARDS_HEADER,
    TOPIC_HEADER,
    VALUE_BYTES_HEADER,
    BandRecord,
    decide_partition,
    engine_digest,
    order_key,
)
from neardup.sharded.routing import owned_bands

log = logging.getLogger(__name__)

#: A record to produce: (topic, partition, key, value, headers).
Record = tuple[str, int, bytes | None, bytes | None, list[tuple[str, bytes]]]


@dataclass
class PrepareBatch:
    messages: list[Message]
    full: bool
    documents: list[Document] = field(default_factory=list)
    decoded: list[Message] = field(default_factory=list)  # the messages of ``documents``
    errors: dict[int, str] = field(default_factory=dict)  # message index -> "kind: reason"


@dataclass
class PrepareWritten:
    offsets: list[TopicPartition]
    messages: int
    band_records: int
    band_bytes: int
    document_bytes: int
    seconds: float = 0.0


class PrepareProcessor(StageHooks):
    """The prepare stage's ``Processor``.

    Args:
        settings: record and engine settings (``text_field``, ``id_field``, ...).
        topology: the sharded topics.
    """

    def __init__(self, settings: Settings, topology: Topology) -> None:
        self.settings = settings
        self.topology = topology
        self.preparer = Preparer(settings.engine())
        self.digest = engine_digest(settings.engine())
        self._ensured = False
        self._limit: int | None = None

    def open(self) -> None:
        threading.Thread(target=warm_up, args=(self.preparer.settings,), name="neardup-warm-up",
                         daemon=True).start()


    def is_output(self, topic: str) -> bool:
        return topic in (self.topology.bands, self.topology.findings)

    def check(self, consumer: Consumer, partitions: list[TP]) -> None:
        """Create the topology's topics (once), before anything is produced to them.

        Raises:
            TopologyMismatchError: an existing topic has another partition count.
        """
        if not self._ensured:
            self.topology.ensure_with(self.settings)
            self._ensured = True


    def read(self, messages: list[Message], full: bool) -> PrepareBatch:
        s = self.settings
        batch = PrepareBatch(messages, full)
        for i, m in enumerate(messages):
            try:
                doc = to_document(m.value(), m.key(), m.topic(), m.partition(), m.offset(),
                                  s.text_field, s.id_field, s.max_message_bytes)
            except MessageError as exc:
                batch.errors[i] = f"{exc.kind}: {exc}"
                continue
            batch.documents.append(doc)
            batch.decoded.append(m)
        return batch



    def compute(self, batch: PrepareBatch) -> tuple[PrepareBatch, list[Record]]:
        """Every record of the batch, in input order (nothing produced)."""
        t = self.topology
        p = self.preparer(batch.documents)
        buckets = p.buckets
        offsets = p.fingerprint_offsets
        by_message: dict[int, tuple[str, list[Record]]] = {}
        valid = iter(range(len(p.valid)))
        at = {id(m): i for i, m in enumerate(batch.messages)}
        for doc, m, reason in zip(batch.documents, batch.decoded, p.rejected):
            i = at[id(m)]
            if reason is not None:
                batch.errors[i] = f"empty_text: {reason}"
                continue
            size = record_size(m.key(), m.value(), m.headers() or [])
            if size > self._findings_limit():
                batch.errors[i] = (f"too_large: a record of {size} bytes does not fit max.message.bytes "
                                   f"{self._findings_limit()} of topic {t.findings}")
                next(valid)
                continue
            v = next(valid)
            key = self._order(m)
            fp = p.fingerprints[offsets[v]:offsets[v + 1]]
            bands = [(q, b) for q, b in enumerate(owned_bands(buckets[v], t.shards)) if len(b)]
            records = [(t.bands, q, key, BandRecord(key, doc.id, buckets[v][b], fp).value(),
                        [(ENGINE_HEADER, self.digest)]) for q, b in bands]
            by_message[i] = (doc.id, records)
        out: list[Record] = []
        for i, m in enumerate(batch.messages):
            key = self._order(m)
            headers = carried_headers(m.headers()) + [(KIND_HEADER, b"document"), (ORDER_HEADER, key),
                                                      (TOPIC_HEADER, m.topic().encode("utf-8")),
                                                      (ENGINE_HEADER, self.digest)]
            if i in by_message:
                doc_id, records = by_message[i]
                out += records
                headers += [(SHARDS_HEADER, str(len(records)).encode()), (ID_HEADER, doc_id.encode("utf-8"))]
            else:
                headers += [(SHARDS_HEADER, b"0"), (ERROR_HEADER, batch.errors[i].encode("utf-8"))]
            value = m.value()
            if record_size(m.key(), value, headers) > self._findings_limit():  # its dead letter goes without it
                headers.append((VALUE_BYTES_HEADER, str(len(value or b"")).encode()))
                value = None
            out.append((t.findings, decide_partition(key, t.decide_partitions), m.key(), value, headers))
        return batch, out

    def _findings_limit(self) -> int:
        """The largest record the findings topic takes, bytes (read once)."""
        if self._limit is None:
            self._limit = TopicLimits(admin_config(self.settings)).get(self.topology.findings)
        return self._limit

    @staticmethod
    def _order(m: Message) -> bytes:
        ts_type, ts = m.timestamp()
        return order_key(ts if ts_type != 0 else -1, m.partition(), m.offset())

    def write(self, work: tuple[PrepareBatch, list[Record]], producer: Producer) -> PrepareWritten:
        """Produce the batch's records into the open transaction.

        Raises:
            KafkaException: a produce error (the transaction is aborted and retried).
        """
        batch, records = work
        band_records = band_bytes = document_bytes = 0
        for topic, partition, key, value, headers in records:
            produce(producer, topic, key, value, headers, partition)
            size = len(value or b"") + len(key or b"")
            if topic == self.topology.bands:
                band_records += 1
                band_bytes += size
            else:
                document_bytes += size
        return PrepareWritten(next_offsets(batch.messages), len(batch.messages), band_records, band_bytes,
                              document_bytes)







class PrepareStage(StageRuntime):
    """The prepare stage: ``PrepareProcessor`` on the stage runtime.

    Args:
        settings: as ``StageRuntime``'s; its ``group_id`` is the stage's consumer group
            and, with ``instance``, its transactional id.
        topology: the sharded topics.
        instance: this process's name among the stage's instances (each needs its own
            transactional id).
        **callbacks: ``on_batch``, ``on_assignment``, ``on_abort``, ``on_broker``.
    """

    def __init__(self, settings: Settings, topology: Topology, instance: str = "0", **callbacks: Any) -> None:
        settings = settings.model_copy(update={"transactional_id": f"neardup-{settings.group_id}-{instance}"})
        super().__init__(settings, PrepareProcessor(settings, topology), **callbacks)
