"""The detector's state: band buckets, signatures, union-find nodes, document ids, input
positions; behind the ``StateStore`` protocol, with RocksDB and in-memory backends."""

from neardup.state.base import StateStore, StateUpdate
from neardup.state.errors import SettingsMismatchError, StateCorruptedError, StateError, StateLockedError

__all__ = ["SettingsMismatchError", "StateCorruptedError", "StateError", "StateLockedError", "StateStore",
           "StateUpdate"]
