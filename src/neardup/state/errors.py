"""Typed errors of the state store (as quix-streams' ``RocksDBCorruptedError``): callers
tell a store that another process holds from one that is damaged or incompatible."""

from __future__ import annotations

from typing import Any


class StateError(Exception):
    """The state store cannot be used (corrupt, locked, or incompatible)."""


class SettingsMismatchError(StateError):
    """The store was built with other state-shaping settings than the ones given."""

    def __init__(self, differences: dict[str, tuple[Any, Any]]) -> None:
        self.differences = differences
        detail = "; ".join(
            f"{name}: stored {stored!r}, requested {requested!r}"
            for name, (stored, requested) in sorted(differences.items())
        )
        super().__init__(
            f"the state was built with other settings ({detail}); use the stored "
            "settings or another state directory"
        )


class StateLockedError(StateError):
    """Another process (or another store in this one) holds the directory's ``LOCK``."""


class StateCorruptedError(StateError):
    """RocksDB reports the store's files as corrupted (checksum mismatch, bad
    ``CURRENT`` or ``MANIFEST``): restore it (from the changelog) or remove it."""
