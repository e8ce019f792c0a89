"""Typed errors of the state store (as quix-streams' ``RocksDBCorruptedError``): callers
tell a store that another process holds from one that is damaged or incompatible."""

from __future__ import annotations

import os
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


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def write_error(action: str, path: str | os.PathLike[str], exc: BaseException,
                needed: int | None = None) -> StateError:
    """The ``StateError`` of RocksDB failing to ``action`` (e.g. "write the state store")
    in ``path``, in one line; when RocksDB's message says the disk is full (ENOSPC, "No
    space left on device"), the line adds the bytes the write held (``needed``, when
    known) and what is free on the directory's file system (``os.statvfs``), e.g.
    ``...: No space left on device (ENOSPC; the write held 40.2 KiB, 0 bytes free of
    512.0 KiB on the file system of /var/lib/neardup)``."""
    text = " ".join(str(exc).split())
    if "No space left on device" in text or "ENOSPC" in text:
        parts = []
        if needed is not None:
            parts.append(f"the write held {_size(needed)}")
        try:
            fs = os.statvfs(path)
            parts.append(f"{_size(fs.f_bavail * fs.f_frsize)} free of {_size(fs.f_blocks * fs.f_frsize)} "
                         f"on the file system of {path}")
        except OSError:
            pass
        text += " (ENOSPC" + ("; " + ", ".join(parts) if parts else "") + ")"
    return StateError(f"cannot {action} {path}: {text}")
