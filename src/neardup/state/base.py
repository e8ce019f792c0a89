"""The state-store protocol and the update a batch writes atomically. The errors live in
``neardup.state.errors`` (importable from here too)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np

from neardup.core.types import Node
from neardup.state.errors import SettingsMismatchError, StateError

if TYPE_CHECKING:
    from neardup.core.retention import Retention
    from neardup.state.index import BucketMembers

__all__ = ["SettingsMismatchError", "StateError", "StateStore", "StateUpdate"]


@dataclass
class StateUpdate:
    """Everything one batch changes, written in one atomic write.

    Attributes:
        first_seq: sequence number of the first new document (``ids[0]``).
        signatures: uint64, shape (n_new, num_perm): the new documents' signatures, to
            store; None stores none (the detector's case: nothing reads them back, the
            bucket ids being made from them before the update).
        ids: external ids of the new documents, in sequence order.
        times: int64, shape (n_new,): their times, ms since the Unix epoch (the retention
            window's clock, ``neardup.core.retention``); None: now.
        sizes: int64, shape (n_new,): their shingle-set sizes (0s if not given).
        fingerprints, fingerprint_offsets: their sorted shingle fingerprints, kept for
            exact verification, as one uint32 array and int64 offsets of shape
            (n_new + 1,) (document k's are ``fingerprints[offsets[k]:offsets[k + 1]]``);
            None when the store keeps signatures only.
        bucket_ids, bucket_seqs: uint64, shape (k,) each: the batch's new bucket
            memberships, document ``bucket_seqs[i]`` in bucket ``bucket_ids[i]``, seqs
            ascending among equal bucket ids.
        largest_bucket: members of the fullest bucket the batch added to.
        nodes: uint64, shape (k, 4): the union-find entries that changed, one row
            (seq, parent, size, canonical) each.
        positions: input source -> next position to read (line, offset, ...).
        verdicts: opaque per-input records (key -> bytes) kept for replay after a crash.
        verdict_deletes: keys of ``verdicts`` records no longer needed.
        local_verdicts: ``verdicts`` and ``verdict_deletes`` are written to this store
            only, never to its changelog: records that answer the replay of a batch whose
            Kafka transaction did not commit. A restore from the changelog never needs
            them, since it holds the state of committed transactions only (the
            changelog's records go into the batch's own transaction), and after one no
            message of theirs is read again.
        meta: the runtime's metadata (name -> bytes), in the default family under
            ``b"meta:" + name``; read back with ``get_meta``.
    """

    first_seq: int
    signatures: np.ndarray | None
    ids: list[str]
    times: np.ndarray | None = None
    sizes: np.ndarray | None = None
    fingerprints: np.ndarray | None = None
    fingerprint_offsets: np.ndarray | None = None
    bucket_ids: np.ndarray = field(default_factory=lambda: np.empty(0, np.uint64))
    bucket_seqs: np.ndarray = field(default_factory=lambda: np.empty(0, np.uint64))
    largest_bucket: int = 0
    nodes: np.ndarray = field(default_factory=lambda: np.empty((0, 4), np.uint64))
    positions: dict[str, int] = field(default_factory=dict)
    verdicts: dict[bytes, bytes] = field(default_factory=dict)
    verdict_deletes: list[bytes] = field(default_factory=list)
    local_verdicts: bool = False
    meta: dict[bytes, bytes] = field(default_factory=dict)

    @property
    def next_seq(self) -> int:
        return self.first_seq + len(self.ids)


class StateStore(Protocol):
    """What the detector needs from its state. Reads see only committed writes."""

    def next_seq(self) -> int:
        """Sequence number the next document will get (the number of documents stored)."""
        ...

    def bucket_members(self, bucket_ids: np.ndarray) -> BucketMembers:
        """The committed members of each bucket of ``bucket_ids`` (uint64, shape (n,),
        distinct); see ``neardup.state.index``."""
        ...

    @property
    def retention(self) -> Retention:
        """The retention window in force (stored with the state)."""
        ...

    def watermark(self) -> int:
        """The latest document time committed, ms (``neardup.core.retention``)."""
        ...

    def get_times(self, seqs: np.ndarray) -> np.ndarray:
        """int64 ms, shape (len(seqs),): the documents' times; a very old time for a
        document no longer stored."""
        ...

    def get_signatures(self, seqs: Sequence[int]) -> np.ndarray:
        """uint64, shape (len(seqs), num_perm). Raises KeyError for an unknown seq."""
        ...

    def closure(self, seqs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Every committed union-find node clustering ``seqs`` (int, shape (n,)) can
        touch, and the canonicals of their clusters: (reach, canonicals), uint64 sorted
        distinct arrays (``neardup.state.forest.Forest.closure``)."""
        ...

    def local_nodes(self, reach: np.ndarray, n_new: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A copy of the committed nodes of ``reach`` (a ``closure``) followed by ``n_new``
        singletons, over local ids: (parent, size, canonical), int64, shape
        (len(reach) + n_new,) each (``neardup.state.forest.Forest.local_copy``)."""
        ...

    def get_nodes(self, seqs: Sequence[int]) -> list[Node | None]:
        """Union-find entries; None for a document never linked (a singleton)."""
        ...

    def get_ids(self, seqs: Sequence[int]) -> list[str]:
        """External ids. Raises KeyError for an unknown seq."""
        ...

    def get_sizes(self, seqs: Sequence[int]) -> np.ndarray:
        """int64, shape (len(seqs),): shingle-set sizes. Raises KeyError if unknown."""
        ...

    def get_fingerprints(self, seqs: Sequence[int], cache: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """The sorted shingle fingerprints of each document, as one array: (values
        uint32, shape (total,); offsets int64, shape (len(seqs) + 1,)), document k's
        being ``values[offsets[k]:offsets[k + 1]]``; ``cache`` False: read past any
        cache, leaving it unchanged. Raises KeyError if a document has none stored
        (unknown, or a store without exact verification)."""
        ...

    def get_position(self, source: str) -> int | None:
        """The next position to read from ``source``, None if never read."""
        ...

    def verdict_keys(self, begin: bytes, end: bytes) -> list[bytes]:
        """The keys of the ``verdicts`` records in [begin, end), in order."""
        ...

    def get_verdicts(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """Stored per-input records (see ``StateUpdate.verdicts``)."""
        ...

    def commit(self, update: StateUpdate) -> None:
        """Apply ``update`` atomically: all of it or, after a crash, none of it.

        Raises:
            StateError: ``update.first_seq`` is not ``next_seq()``.
        """
        ...

    def stats(self) -> dict[str, int]:
        """Sizes: documents, keys per family, bytes on disk, the largest bucket seen."""
        ...

    def close(self) -> None: ...
