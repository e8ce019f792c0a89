"""Does the state match the input? Checked for every partition when it is assigned.

The state knows, per input partition, the next offset to read (its *position*) and, per
input topic, the topic id it was read from. Before a partition is processed these are
compared with what the broker says:

- the topic id differs from the stored one: the topic was deleted and created again
  (same name, offsets from 0); the stored positions belong to the old one.
- the stored position lies beyond the partition's end (high watermark): the same, seen
  without a topic id (a state from before topic ids were stored, or a broker that does
  not describe topics), or a truncated partition.
- the consumer group has committed an offset for a partition the state has never seen,
  or one beyond the stored position: the state directory was deleted, replaced or
  restored from an older copy; the index lacks documents the group has consumed.

Any of these refuses to start (``StateMismatchError``, one line naming the partition)
unless ``--reset-state`` is given: the partition's position is then set to the group's
committed offset (0 if none), the topic id is stored, and it is logged. This module is
the one place where a later changelog restore would step in instead of refusing.

Topic ids are stored in the ``verdicts`` family under ``topic_id_key(topic)``, a key no
verdict key can take (those begin with the topic name, never with NUL).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass


from neardup.kafka.messages import source_name
from neardup.state.base import StateError, StateStore, StateUpdate

log = logging.getLogger(__name__)


class StateMismatchError(StateError):
    """The state does not match the input partitions (the message names them)."""


@dataclass(frozen=True)
class PartitionFacts:
    """What the state and the broker say of one assigned partition.

    Attributes:
        position: the state's next offset to read, None if it never read the partition.
        committed: the consumer group's committed offset, None if none.
        high: the partition's high watermark (its end), None if not known.
        stored_topic_id, topic_id: the topic id kept with the state and the broker's,
            None if not known.
    """

    topic: str
    partition: int
    position: int | None
    committed: int | None
    high: int | None
    stored_topic_id: str | None
    topic_id: str | None

    @property
    def name(self) -> str:
        return f"{self.topic}[{self.partition}]"


def topic_id_key(topic: str) -> bytes:
    """Key of a topic's stored id in the ``verdicts`` family."""
    return b"\0topic-id:" + topic.encode("utf-8")


def mismatch(p: PartitionFacts) -> str | None:
    """Why the state does not match partition ``p``, or None if it does."""
    if p.stored_topic_id and p.topic_id and p.stored_topic_id != p.topic_id:
        return (f"topic {p.topic} was deleted and created again (its id is {p.topic_id}, the "
                f"state read {p.stored_topic_id}), so the offsets stored for it are not its own")
    if p.position is not None and p.high is not None and p.position > p.high:
        return (f"the state has read up to offset {p.position} but the partition ends at "
                f"{p.high} (topic created again, or truncated)")
    if p.committed is not None and p.position is None:
        return (f"the consumer group has committed offset {p.committed} but the state has "
                "never seen this partition (state directory deleted or replaced?)")
    if p.committed is not None and p.position is not None and p.committed > p.position:
        return (f"the consumer group has committed offset {p.committed} but the state has "
                f"read only up to {p.position} (an older copy of the state?)")
    return None


def check(store: StateStore, facts: Sequence[PartitionFacts], reset: bool) -> dict[tuple[str, int], int]:
    """Refuse, or accept (``reset``), assigned partitions whose state does not match;
    store the topic ids not stored yet.

    Returns:
        The new positions written, by (topic, partition).

    Raises:
        StateMismatchError: a partition does not match and ``reset`` is False.
    """
    bad = [(p, why) for p in facts if (why := mismatch(p)) is not None]
    if bad and not reset:
        p, why = bad[0]
        more = f" (and {len(bad) - 1} more partitions)" if len(bad) > 1 else ""
        raise StateMismatchError(
            f"partition {p.name}: {why}{more}; refusing to start. Restore the state, or pass "
            "--reset-state to accept the state as it is (an index without those documents) "
            "and resume at the group's committed offsets"
        )
    positions: dict[tuple[str, int], int] = {}
    for p, why in bad:
        positions[(p.topic, p.partition)] = max(p.committed or 0, 0)
        log.warning("--reset-state: partition %s: %s; accepted, resuming at offset %d",
                    p.name, why, positions[(p.topic, p.partition)])
    ids = {p.topic: p.topic_id for p in facts if p.topic_id and p.stored_topic_id != p.topic_id}
    if positions or ids:
        store.commit(StateUpdate(
            first_seq=store.next_seq(),
            signatures=None,
            ids=[],
            positions={source_name(t, n): pos for (t, n), pos in positions.items()},
            verdicts={topic_id_key(t): i.encode("ascii") for t, i in ids.items()},
        ))
    return positions
