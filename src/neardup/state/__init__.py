"""The detector's state: band buckets, signatures, union-find nodes, document ids, input
positions; behind the ``StateStore`` protocol, with RocksDB and in-memory backends."""

from neardup.state.base import SettingsMismatchError, StateError, StateStore, StateUpdate

__all__ = ["SettingsMismatchError", "StateError", "StateStore", "StateUpdate"]
