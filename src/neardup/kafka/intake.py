"""Timestamp synchronisation across input partitions: consumed messages are held per
partition and released in order-key order, so that a consumer reading several partitions
processes a backlog in the order of its record times, however unevenly the client fetches
the partitions.

The rule is Kafka Streams' (KIP-353, KIP-695: a task picks the record whose partition head
has the smallest timestamp, and waits up to ``max.task.idle.ms`` for an empty partition
that still has records to fetch):

- The order key of a message is (record timestamp in ms, partition, offset, topic), the
  order key of the sharded mode (``neardup.sharded.records.ORDER``) with the topic last.
- The next message released is the head of the partition whose head has the smallest
  order key, taken only while no assigned partition is *behind*: its buffer empty, and
  neither at its end (the consumer's partition-EOF event, ``enable.partition.eof``) nor
  waited for longer than ``wait_s`` since it became so (since its assignment was
  checked, for a new one). A partition the client knows to have records still to fetch
  (``pending``: its cached high watermark past its position) is waited for up to
  ``PENDING_WAIT_S`` however short ``wait_s`` is, as Kafka Streams waits for a fetch in
  flight. A partition at its end holds nothing back: in a live stream a record that
  arrives later is processed when it arrives (Kafka Streams does the same), so a
  caught-up consumer adds no latency.
- A partition whose buffer holds ``capacity`` messages is paused (the consumer stops
  fetching it) and resumed once its buffer is down to half: what is held stays bounded
  (at most ``capacity`` messages per assigned partition, plus the client's own queue)
  while a partition far behind is read.

Held messages are consumed but in no batch: the caller drops them when their partitions
are revoked or rewound (``drop``), and seeks nowhere for them (the group's committed
offsets, or the rewind's seek, are where they are consumed again).
"""

from __future__ import annotations

import heapq
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable

from confluent_kafka import KafkaError, Message

log = logging.getLogger(__name__)

TP = tuple[str, int]

#: Seconds a partition with records known to be still to fetch is waited for at most.
PENDING_WAIT_S = 60.0


def order_key(m: Message) -> tuple[int, int, int, str]:
    """(record timestamp in ms, partition, offset, topic) of a message; a message without
    a timestamp sorts first (-1)."""
    ts_type, ts = m.timestamp()
    return (ts if ts_type != 0 else -1, m.partition(), m.offset(), m.topic())


class OrderedIntake:
    """Messages held per partition, released in order-key order (see the module docstring).

    Args:
        capacity: messages held per partition before it is paused (>= 1).
        wait_s: longest time, seconds, the other partitions wait for a partition that is
            behind (empty, not at its end).
        pending: whether the client knows a partition to have records still to fetch.
        clock: a monotonic clock, seconds (``time.monotonic``).

    Not thread-safe: call it from the consumer's thread.
    """

    def __init__(self, capacity: int, wait_s: float, pending: Callable[[TP], bool] = lambda tp: False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, not {capacity}")
        self.capacity, self.wait_s, self._pending, self._clock = capacity, wait_s, pending, clock
        self._held: dict[TP, deque[Message]] = {}
        self._at_end: set[TP] = set()
        self._empty_since: dict[TP, float] = {}
        self.paused: set[TP] = set()
        self.waited = 0  # times a wait for a partition ran out (it was then passed over)

    def __len__(self) -> int:
        return sum(len(q) for q in self._held.values())

    def assigned(self, tps: Iterable[TP]) -> None:
        """Partitions newly assigned: held empty, not at their end (until the consumer says
        so), not paused."""
        now = self._clock()
        for tp in tps:
            self._held[tp] = deque()
            self._at_end.discard(tp)
            self._empty_since[tp] = now
            self.paused.discard(tp)

    def drop(self, tps: Iterable[TP]) -> None:
        """Forget what is held of ``tps`` (revoked, or rewound by a seek: consumed again)."""
        now = self._clock()
        for tp in tps:
            if tp in self._held:
                self._held[tp].clear()
                self._at_end.discard(tp)
                self._empty_since[tp] = now

    def revoked(self, tps: Iterable[TP]) -> None:
        """Partitions gone from the assignment."""
        for tp in tps:
            self._held.pop(tp, None)
            self._at_end.discard(tp)
            self._empty_since.pop(tp, None)
            self.paused.discard(tp)

    def add(self, messages: Iterable[Message]) -> None:
        """Hold consumed messages (data messages and partition-EOF events; other errors
        are the caller's). A message of a partition not assigned is ignored."""
        for m in messages:
            tp = (m.topic(), m.partition())
            held = self._held.get(tp)
            if held is None:
                continue
            err = m.error()
            if err is None:
                held.append(m)
                self._at_end.discard(tp)
                self._empty_since.pop(tp, None)
            elif err.code() == KafkaError._PARTITION_EOF:
                self._at_end.add(tp)

    def release(self, limit: int) -> list[Message]:
        """Up to ``limit`` held messages in order-key order, taken while no partition is
        behind (see the module docstring)."""
        now = self._clock()
        behind = self._behind(now)
        heap = [(order_key(q[0]), tp) for tp, q in self._held.items() if q]
        heapq.heapify(heap)
        out: list[Message] = []
        while heap and len(out) < limit and not behind:
            _, tp = heapq.heappop(heap)
            q = self._held[tp]
            out.append(q.popleft())
            if q:
                heapq.heappush(heap, (order_key(q[0]), tp))
            elif tp not in self._at_end:
                self._empty_since[tp] = now
                behind = self._behind(now)
        return out

    def _behind(self, now: float) -> bool:
        """Whether a partition is behind: empty, not at its end, waited for less than
        ``wait_s``. One waited for longer is passed over (counted in ``waited``) until it
        receives a message or reaches its end."""
        behind = False
        for tp, since in self._empty_since.items():
            if tp in self._at_end or self._held[tp]:
                continue
            if now - since < self.wait_s or (now - since < PENDING_WAIT_S and self._pending(tp)):
                behind = True
            else:
                self._at_end.add(tp)
                self.waited += 1
                log.info("%s[%d] passed over after %.1f s without a record: messages of the other partitions "
                         "go ahead of its next one (--partition-wait-ms)", tp[0], tp[1], now - since)
        return behind

    def flow(self) -> tuple[list[TP], list[TP]]:
        """(partitions to pause, partitions to resume) after ``add``/``release``; the caller
        pauses and resumes them on the consumer. ``paused`` is updated."""
        pause = [tp for tp, q in self._held.items() if len(q) >= self.capacity and tp not in self.paused]
        resume = [tp for tp in self.paused if len(self._held.get(tp, ())) <= self.capacity // 2]
        self.paused.update(pause)
        self.paused.difference_update(resume)
        return pause, resume
