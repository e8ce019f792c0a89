"""Decide's decisions table (docs/scale-out.md): for every document decided anywhere, the
seq of its cluster's canonical, and the external id of every canonical. It is the view of
the compacted ``<app>.decisions`` topic (one partition), which every decide process reads
in full: a global table in Kafka Streams' terms.

Two kinds, one interface (``clusters[seq]``, ``seq in clusters``, ``name(canonical)``):

- ``DecisionsTable``: in memory (Python dicts, about 138 bytes per document), read from
  the topic's start at every process start;
- ``StoredDecisionsTable``: a RocksDB store (``neardup.state.view``), whose entries and
  position are written together, so a process restarted reads only the topic's newer
  records, and memory does not grow with the documents decided.

Both also hold the decisions *taken* in this process's batches and not yet read back from
the topic (``take``): a batch's later documents need them before its transaction commits.
They leave that overlay when read back (committed), or all at once when a batch is aborted
(``forget_taken``): the batch's retry takes them again, the same, since a decision is a
function of the findings and of earlier decisions.

With the ``components`` cluster policy (``components=True``) the table is a union-find
forest (Tarjan 1975): a document's entry is its parent, a decision may merge clusters
(the roots it names besides its own cluster's), and ``clusters[seq]`` is the root of
``seq``'s cluster, its earliest document. A merge read from the topic is applied as a
union (the later root points at the earlier one), not as an overwrite, so every process
that reads the topic ends with the same clusters whatever the order in which merges
were decided; each record of decisions (a batch's) has a key of its own, so compaction
keeps every merge. The merges of decisions taken here and not yet read back are kept
beside the forest (``_pending``) until they are.

With a retention window (``expire_before``; canonical policy only: a forest's root may
be older than the window), the decisions of documents stamped before a
time are dropped: a shard reports only members held in its window, so once no document
still to decide can have them as candidates their decisions are never looked up. The
caller picks that time (decide: ``neardup.sharded.decide_stage``). A lookup below it that finds
nothing (a document processed far later than its time) gets the document as its own
canonical (``fallbacks`` counts them): its verdict stays right, its cluster may be a new
one. The canonicals' external ids stay while a held decision names them (clusters outlive
their canonical).

Stored key layout (raw bytes; an order key is ``neardup.sharded.records.ORDER``, 20 bytes):

- ``b"K" + order key`` -> the canonical's order key (with the components policy: the
  parent's), followed by the canonical's external id (UTF-8); an entry a merge pointed at
  an earlier root has no id (nor had, before retention, one that was not its own canonical);
- ``b"E"`` -> ``">q"`` the time (ms) before which decisions were dropped;
- ``b"O"`` -> the position: ``">q"`` next offset of the decisions topic's partition 0.
"""

from __future__ import annotations

import logging
import os
import struct
from collections.abc import Sequence

from rocksdict import WriteBatch

from neardup.sharded.records import ORDER, order_seq, seq_order
from neardup.state.view import TopicView

log = logging.getLogger(__name__)
_EXPIRED_KEY = b"E"
_TIME = struct.Struct(">q")
#: no decision dropped yet
_NEVER = -(1 << 62)

#: One decision read from the topic: (document seq, canonical seq, canonical's external id),
#: and with the components policy a fourth item, the roots of the other clusters it merged
#: into the canonical's (a tuple of seqs).
Decision = tuple[int, int, str] | tuple[int, int, str, tuple[int, ...]]


class DecisionsTable:
    """The decisions table in memory: seq -> canonical seq, canonical seq -> external id.

    Args:
        components: the components cluster policy: entries are parents in a union-find
            forest and decisions may merge clusters (see the module's docstring).
    """

    def __init__(self, components: bool = False) -> None:
        self.components = components
        self._clusters: dict[int, int] = {}
        self._names: dict[int, str] = {}
        self._taken: dict[int, tuple[int, str]] = {}
        self._pending: dict[int, int] = {}  # merges taken, not read back: root -> earlier root
        self._position: int | None = None
        self._expired_below = _NEVER  # decisions of documents stamped before this (ms) dropped
        self.fallbacks = 0  # lookups below it that found nothing

    def expired_below(self) -> int:
        """The time (ms) before which decisions are dropped (very negative: none)."""
        return self._expired_below

    def _fallback(self, seq: int) -> bool:
        """Whether ``seq`` (not found) lies below the dropped decisions: counted, logged."""
        if seq >> 96 >= self._expired_below:
            return False
        self.fallbacks += 1
        if self.fallbacks & (self.fallbacks - 1) == 0:  # the 1st, 2nd, 4th...
            log.warning("%d lookup(s) of a decision dropped from the retention window (a document processed "
                        "long after its time): taken as its own cluster", self.fallbacks)
        return True

    # --- lookups --------------------------------------------------------------------------
    def __getitem__(self, seq: int) -> int:
        """The canonical seq of document ``seq``'s cluster.

        Raises:
            KeyError: ``seq`` is not decided (or not read yet).
        """
        taken = self._taken.get(seq)
        found = taken[0] if taken is not None else self._committed(seq)
        if found is None:
            if self._fallback(seq):
                return seq
            raise KeyError(seq)
        return self._root(found) if self.components else found

    def _root(self, x: int) -> int:
        """The root of ``x`` through the pending merges, the decisions taken and the
        committed forest."""
        while True:
            up = self._pending.get(x)
            if up is None:
                taken = self._taken.get(x)
                up = taken[0] if taken is not None else self._committed(x)
                if up is None or up == x:
                    return x
            x = up

    def __contains__(self, seq: object) -> bool:
        return seq in self._taken or (isinstance(seq, int) and (
            self._committed(seq) is not None or seq >> 96 < self._expired_below))

    def name(self, canonical: int) -> str:
        """The external id of the canonical ``canonical`` ("" if unknown)."""
        taken = self._taken.get(canonical)
        if taken is not None and taken[0] == canonical:
            return taken[1]
        return self._committed_name(canonical)

    def _committed(self, seq: int) -> int | None:
        return self._clusters.get(seq)

    def _committed_name(self, canonical: int) -> str:
        return self._names.get(canonical, "")

    # --- changes --------------------------------------------------------------------------
    def take(self, seq: int, canonical: int, name: str, merged: Sequence[int] = ()) -> None:
        """A decision taken in this process's current batch (to the topic when it commits):
        document ``seq`` is in the cluster of ``canonical``, whose external id is ``name``;
        with the components policy, ``merged`` are the roots of the other clusters it joins
        to that one."""
        self._taken[seq] = (canonical, name)
        for other in merged:
            a, b = self[other], self[canonical]
            if a != b:
                self._pending[max(a, b)] = min(a, b)

    def forget_taken(self) -> None:
        """Drop the decisions taken and not yet read back (a batch was aborted)."""
        self._taken.clear()
        self._pending.clear()

    def _writes(self, decisions: Sequence[Decision]) -> dict[int, tuple[int, str | None]]:
        """The entries that committed ``decisions`` set, in the topic's order: seq ->
        (parent, the canonical's external id; None for a root a merge pointed elsewhere). A merge is a union of the
        forest as it stands with the earlier writes: the later root points at the earlier."""
        writes: dict[int, tuple[int, str | None]] = {}

        def root(x: int) -> int:
            while True:
                w = writes.get(x)
                up = w[0] if w is not None else self._committed(x)
                if up is None or up == x:
                    return x
                x = up

        for seq, canonical, name, *rest in decisions:
            self._taken.pop(seq, None)
            if seq >> 96 < self._expired_below:
                continue
            writes[seq] = (canonical, name)
            for other in rest[0] if rest else ():
                a, b = root(other), root(canonical)
                if a != b:
                    writes[max(a, b)] = (min(a, b), None)
        if not self._taken:
            self._pending.clear()  # every merge taken here is in the forest now
        return writes

    def apply(self, decisions: Sequence[Decision], position: int) -> None:
        """Committed decisions read from the topic (in its order), and the offset after the
        last of them: the table's new position. Those below ``expired_below`` are not kept."""
        for seq, canonical, name, *_ in decisions:
            if seq >> 96 >= self._expired_below:
                self._names[canonical] = name
        for seq, (parent, _) in self._writes(decisions).items():
            self._clusters[seq] = parent
        self._position = position

    def expire_before(self, time_ms: int) -> int:
        """Drop the decisions of the documents stamped before ``time_ms`` (ms; at or below
        ``expired_below``: nothing to do); how many were dropped."""
        if time_ms <= self._expired_below:
            return 0
        self._expired_below = time_ms
        before = len(self._clusters)
        self._clusters = {seq: c for seq, c in self._clusters.items() if seq >> 96 >= time_ms}
        named = set(self._clusters.values())
        self._names = {c: name for c, name in self._names.items() if c in named}
        return before - len(self._clusters)

    def position(self) -> int | None:
        """The next offset of the topic to read; None: from its start."""
        return self._position

    def position_age_ms(self) -> int | None:
        """None: a table in memory is never older than its process."""
        return None

    def taken(self) -> int:
        """How many decisions taken here are not yet read back."""
        return len(self._taken)

    def wipe(self) -> None:
        """Drop everything (the topic will be read from its start)."""
        self._clusters.clear()
        self._names.clear()
        self._taken.clear()
        self._pending.clear()
        self._position = None
        self._expired_below = _NEVER

    def close(self) -> None:
        pass


class StoredDecisionsTable(DecisionsTable):
    """The decisions table in a RocksDB directory (its own: one per decide process).

    Args:
        path: the directory, created when missing.

    Raises:
        StateError: the directory cannot be created, opened or written (permissions, a
            full disk, another process holding it).
    """

    def __init__(self, path: str | os.PathLike[str], components: bool = False) -> None:
        super().__init__(components)
        self._view = TopicView(path, "the decisions table")
        self.path = self._view.path
        raw = self._view.get(_EXPIRED_KEY)
        self._expired_below = _NEVER if raw is None else _TIME.unpack(raw)[0]
        self._named: dict[int, str] = {}  # canonical -> its id, from the decisions looked up

    def _committed(self, seq: int) -> int | None:
        raw = self._view.get(b"K" + seq_order(seq))
        if raw is None:
            return None
        canonical = order_seq(raw[:ORDER.size])
        if len(raw) > ORDER.size:  # its canonical's id: kept for its name (the canonical may be dropped)
            if len(self._named) > 100_000:
                self._named = {}
            self._named[canonical] = raw[ORDER.size:].decode("utf-8")
        return canonical

    def _committed_name(self, canonical: int) -> str:
        raw = self._view.get(b"K" + seq_order(canonical))
        if raw is not None and len(raw) > ORDER.size:
            return raw[ORDER.size:].decode("utf-8")
        return self._named.get(canonical, "")

    def apply(self, decisions: Sequence[Decision], position: int) -> None:
        """As ``DecisionsTable.apply``, in one atomic write with the position.

        Raises:
            StateError: the write failed (a full disk).
        """
        batch = WriteBatch(raw_mode=True)
        for seq, (parent, name) in self._writes(decisions).items():
            order = seq_order(parent)
            batch.put(b"K" + seq_order(seq), order + name.encode("utf-8") if name is not None else order)
        self._view.write(batch, position)

    def expire_before(self, time_ms: int) -> int:
        """As ``DecisionsTable.expire_before``, in one atomic write (range deletes) with
        the time; returns 0 (the count is not read).

        Raises:
            StateError: the write failed (a full disk).
        """
        if time_ms <= self._expired_below:
            return 0
        batch = WriteBatch(raw_mode=True)
        if time_ms > 0:
            batch.delete_range(b"K", b"K" + ORDER.pack(time_ms, 0, 0))
            batch.delete_range(b"K\x80", b"L")  # stamped before 1970 (sign bit set): all before it
        else:
            batch.delete_range(b"K\x80", b"K" + ORDER.pack(time_ms, 0, 0))
        batch.put(_EXPIRED_KEY, _TIME.pack(time_ms))
        self._view.write(batch, None)
        self._expired_below = time_ms
        return 0

    def position(self) -> int | None:
        return self._view.position()

    def position_age_ms(self) -> int | None:
        """Milliseconds since the position was last written (``TopicView``)."""
        return self._view.position_age_ms()

    def wipe(self) -> None:
        """Drop everything (the directory is removed and created again).

        Raises:
            StateError: it cannot be removed or created.
        """
        self._taken.clear()
        self._pending.clear()
        self._view.wipe()
        self._expired_below = _NEVER

    def close(self) -> None:
        self._view.close()
