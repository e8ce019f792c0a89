"""An in-memory state store (dicts), for evaluation runs and as a reference backend."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from neardup.core.retention import Retention
from neardup.state import codec
from neardup.state.kv import Deletes, KeyValueStateStore, Puts, Ranges, Record


class MemoryStateStore(KeyValueStateStore):
    """State held in Python dicts; lost when the process ends.

    Args:
        settings: the state-shaping settings (``EngineSettings.state_shape()``).
        set_cache_bytes: size of the set cache in bytes (``neardup.state.setcache``);
            off by default, dict reads being cheap.
        retention: the retention window (``neardup.core.retention``); None: keep all.
        log: the changelog hook (``neardup.state.changelog``); None: no changelog.
    """

    def __init__(self, settings: dict[str, Any], set_cache_bytes: int = 0,
                 retention: Retention | Mapping[str, Any] | None = None,
                 log: Callable[[list[Record]], None] | None = None) -> None:
        self.log = log
        self._data: dict[str, dict[bytes, bytes]] = {
            name: {} for name in ("default", *codec.FAMILIES)
        }
        self._open_settings(settings, set_cache_bytes, retention)

    def _get_many(self, family: str, keys: Sequence[bytes]) -> list[bytes | None]:
        table = self._data[family]
        return [table.get(key) for key in keys]

    def _scan(self, family: str) -> Iterator[tuple[bytes, bytes]]:
        return iter(sorted(self._data[family].items()))

    def _keys(self, family: str, begin: bytes = b"", end: bytes | None = None) -> Iterator[bytes]:
        return iter(sorted(k for k in self._data[family] if begin <= k and (end is None or k < end)))

    def _wipe_all(self) -> None:
        for table in self._data.values():
            table.clear()

    def _write_batch(self, puts: Puts, deletes: Deletes | None = None, ranges: Ranges | None = None) -> None:
        for family, (begin, end) in (ranges or {}).items():
            table = self._data[family]
            for key in list(self._keys(family, begin, end)):
                del table[key]
        for family, keys in (deletes or {}).items():
            for key in keys:
                self._data[family].pop(key, None)
        for family, pairs in puts.items():
            self._data[family].update(pairs)

    def stats(self) -> dict[str, int]:
        out = {"documents": self._next_seq, "max_bucket_size": self._max_bucket,
               "index_entries": len(self.index), "index_bytes": self.index.nbytes,
               "forest_bytes": self.forest.nbytes, **self.retention_stats()}
        for name, table in self._data.items():
            out[f"keys_{name}"] = len(table)
        out["bytes"] = sum(len(k) + len(v) for t in self._data.values() for k, v in t.items())
        return out

    def close(self) -> None:
        pass
