"""The store's side of a changelog: a compacted Kafka topic holding every change the store
writes, the state's source of truth (as Kafka Streams' and quix-streams' changelogs).
Record layout: ``neardup.state.codec`` (a family tag + the stored key; the stored value,
None for a deleted key).

Logging. With ``store.log`` set, every write of the store (a batch's commit, the removal
of expired documents, the settings and retention written at open, ``expire()``) first
passes its records to ``log``, then is applied; if ``log`` raises, it is not. The records
come in the order the write applies them: a range delete's tombstones (one per key it
removes, read before the write), then the deletes, then the puts; a later record of a key
wins. The caller produces them inside the batch's Kafka transaction. A commit with
``StateUpdate.local_verdicts`` leaves its ``verdicts`` records out (applied, not logged):
each message's outcome, kept for a replay from this store only.

Unconfirmed keys (an outbox). The changelog keys written since the last ``confirm()`` are
stored in the same atomic write as the data (``codec.UNCONFIRMED_KEY``). The caller calls
``confirm()`` once the transaction holding those records has committed; after a crash or
an aborted transaction it re-sends ``unconfirmed_records()`` (the keys' current values),
which is idempotent.

Restore, in this order (a crash anywhere leaves ``restoring()`` true at the next open:
start over from step 1):

1. ``wipe()``: drop everything, write the ``restoring`` marker;
2. ``apply(records)`` for each chunk of the topic, from its first offset to its end;
3. ``finish_restore()``: remove the marker, load the state as at open (checking the
   settings), then write what opening writes (settings of a fresh store, a changed
   retention window, expired documents' removal), logged if ``log`` is set.

``snapshot_records()`` gives every record of an existing store, to seed an empty topic.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from neardup.state import codec

if TYPE_CHECKING:
    from neardup.state.kv import Deletes, Puts, Ranges, Record

F = TypeVar("F", bound=Callable[..., Any])


def exclusive(method: F) -> F:
    """``method`` under the store's ``lock``: the writes of a store (commit, expiry, wipe,
    restore, close) exclude the readers of another thread (``neardup.query.nearest``
    with ``shared``), so that those see the state between two writes."""
    @functools.wraps(method)
    def locked(self: Any, *args: Any, **kwargs: Any) -> Any:
        with self.lock:
            return method(self, *args, **kwargs)
    return locked  # type: ignore[return-value]


class ChangelogMixin:
    """Changelog methods of ``neardup.state.kv.KeyValueStateStore`` (which provides the
    backend primitives and the loading code used here)."""

    _unconfirmed: set[bytes]
    _ready: bool
    #: Held by every write (``exclusive``) and by readers in other threads.
    lock: threading.RLock

    def _records(self, puts: Puts, deletes: Deletes, ranges: Ranges) -> list[Record]:
        """The changelog records of a write (``puts`` and ``deletes`` as lists), in the
        order it applies them; the store's own bookkeeping keys are left out."""
        records: list[Record] = []
        for family, (begin, end) in ranges.items():
            records += [(codec.changelog_key(family, key), None) for key in self._keys(family, begin, end)]
        for family, keys in deletes.items():
            records += [(codec.changelog_key(family, key), None) for key in keys]  # type: ignore[union-attr]
        for family, pairs in puts.items():
            records += [(codec.changelog_key(family, key), value) for key, value in pairs  # type: ignore[union-attr]
                        if family != "default" or key not in codec.UNLOGGED_KEYS]
        return records

    def confirm(self) -> None:
        """The records logged so far are committed in the changelog: forget their keys,
        at once on disk too (a small write), so that a restart does not produce the last
        batch's records again."""
        if self._unconfirmed:
            self._unconfirmed = set()
            self._write_batch({"default": [(codec.UNCONFIRMED_KEY, codec.encode_key_set(set()))]})

    def unconfirmed_records(self) -> list[Record]:
        """(changelog key, current value or None if deleted) of every key logged since the
        last ``confirm()`` (kept across a reopen), sorted by changelog key: to re-send
        after a crash or an aborted transaction."""
        keys = sorted(self._unconfirmed)
        by_family: dict[str, list[tuple[bytes, bytes]]] = {}
        for raw in keys:
            family, key = codec.split_changelog_key(raw)
            by_family.setdefault(family, []).append((raw, key))
        out: list[Record] = []
        for family, items in by_family.items():
            values = self._get_many(family, [key for _, key in items])
            out += [(raw, value) for (raw, _), value in zip(items, values)]
        return out

    def _any(self, family: str, begin: bytes = b"", end: bytes | None = None) -> bool:
        for _ in self._keys(family, begin, end):
            return True
        return False

    def is_empty(self) -> bool:
        """No documents (stored or counted), no positions, no verdicts, no metadata."""
        raw = self._get_many("default", [codec.NEXT_SEQ_KEY])[0]
        if raw is not None and codec.decode_u64(raw) > 0:
            return False
        if any(self._any(family) for family in ("documents", "positions", "verdicts")):
            return False
        prefix = codec.META_PREFIX
        return not self._any("default", prefix, prefix[:-1] + bytes([prefix[-1] + 1]))

    def restoring(self) -> bool:
        """A restore was started (``wipe``) and not finished: start it over."""
        return self._get_many("default", [codec.RESTORING_KEY])[0] is not None

    @exclusive
    def wipe(self) -> None:
        """Drop every record of every family (nothing logged), then write the
        ``restoring`` marker. The store takes no commit until ``finish_restore``.

        Raises:
            StateError: the backend cannot be wiped or reopened.
        """
        self._ready = False
        self._unconfirmed = set()
        self._wipe_all()
        self._write_batch({"default": [(codec.RESTORING_KEY, b"")]})

    @exclusive
    def apply(self, records: list[Record]) -> None:
        """Write a chunk of changelog records atomically, without logging them: the last
        record of a key wins, a tombstone (None) deletes. Call ``finish_restore`` after
        the last chunk.

        Raises:
            ValueError: a record key that is not a changelog key.
        """
        latest: dict[str, dict[bytes, bytes | None]] = {}
        for raw, value in records:
            family, key = codec.split_changelog_key(raw)
            if family == "default" and key in codec.UNLOGGED_KEYS:
                continue
            latest.setdefault(family, {})[key] = value
        puts = {family: [(k, v) for k, v in table.items() if v is not None] for family, table in latest.items()}
        deletes = {family: [k for k, v in table.items() if v is None] for family, table in latest.items()}
        self._ready = False
        self._write_batch(puts, deletes)  # type: ignore[arg-type]

    @exclusive
    def finish_restore(self) -> None:
        """Remove the ``restoring`` marker and load the state as at open (see the module
        docstring).

        Raises:
            SettingsMismatchError: the restored state was built with other settings (the
                store is closed).
        """
        self._write_batch({}, {"default": [codec.RESTORING_KEY]})
        self._load()

    def snapshot_records(self, chunk: int = 10_000) -> Iterator[list[Record]]:
        """Every record of every family as changelog records, ``chunk`` at a time, in
        changelog-key order (to seed an empty changelog). Read it to the end before
        writing to or closing the store."""
        out: list[Record] = []
        for family in codec.CHANGELOG_FAMILIES:
            for key, value in self._scan(family):
                if family == "default" and key in codec.UNLOGGED_KEYS:
                    continue
                out.append((codec.changelog_key(family, key), value))
                if len(out) >= chunk:
                    yield out
                    out = []
        if out:
            yield out

    # provided by KeyValueStateStore and the backends
    if TYPE_CHECKING:
        def _get_many(self, family: str, keys: list[bytes]) -> list[bytes | None]: ...
        def _keys(self, family: str, begin: bytes = b"", end: bytes | None = None) -> Iterator[bytes]: ...
        def _scan(self, family: str) -> Iterator[tuple[bytes, bytes]]: ...
        def _write_batch(self, puts: Puts, deletes: Deletes | None = None, ranges: Ranges | None = None) -> None: ...
        def _wipe_all(self) -> None: ...
        def _load(self) -> None: ...
