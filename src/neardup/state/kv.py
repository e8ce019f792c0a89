"""The state store over any ordered key-value backend with atomic multi-family writes.

Backends implement three primitives (multi-get, atomic write, close); this class turns
them into the ``StateStore`` protocol with the layouts of ``neardup.state.codec``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from neardup.core.arrays import sorted_unique
from neardup.core.unionfind import Node
from neardup.state import codec
from neardup.state.base import SettingsMismatchError, StateError, StateUpdate
from neardup.state.forest import Forest
from neardup.state.index import MAX_SEQ, BucketIndex, BucketMembers
from neardup.state.setcache import SetCache, merge_sets, select_sets

Puts = dict[str, Iterable[tuple[bytes, bytes]]]  # family -> (key, value) pairs
Deletes = dict[str, Iterable[bytes]]  # family -> keys


class KeyValueStateStore:
    """``StateStore`` logic shared by the backends. Subclasses call ``_open_settings``."""

    num_perm: int
    settings: dict[str, Any]

    # --- backend primitives -------------------------------------------------------
    def _get_many(self, family: str, keys: Sequence[bytes]) -> list[bytes | None]:
        raise NotImplementedError

    def _write(self, puts: Puts, deletes: Deletes | None = None) -> None:
        """Apply ``deletes`` then ``puts`` atomically."""
        raise NotImplementedError

    def _scan(self, family: str) -> Iterator[tuple[bytes, bytes]]:
        """Every (key, value) of ``family``, in key order."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def stats(self) -> dict[str, int]:
        raise NotImplementedError

    # --- shared logic --------------------------------------------------------------
    def _get(self, family: str, key: bytes) -> bytes | None:
        return self._get_many(family, [key])[0]

    def _open_settings(self, requested: dict[str, Any], set_cache_bytes: int = 0) -> None:
        """Store or check the settings, then load the counters and the bucket index, and
        start an empty set cache of ``set_cache_bytes`` (``neardup.state.setcache``).

        Raises:
            SettingsMismatchError: the store holds other settings (or another layout).
        """
        requested = {**requested, "layout": codec.LAYOUT}
        raw = self._get("default", codec.SETTINGS_KEY)
        if raw is None:
            self._write({"default": [(codec.SETTINGS_KEY, codec.encode_settings(requested)),
                                     (codec.NEXT_SEQ_KEY, codec.encode_u64(0))]})
            stored = requested
        else:
            stored = codec.decode_settings(raw)
            differences = {
                name: (stored.get(name), requested.get(name))
                for name in set(stored) | set(requested)
                if stored.get(name) != requested.get(name)
            }
            if differences:
                self.close()
                raise SettingsMismatchError(differences)
        self.settings = stored
        self.num_perm = int(stored["num_perm"])
        self._next_seq = codec.decode_u64(self._get("default", codec.NEXT_SEQ_KEY) or b"\0" * 8)
        max_bucket = self._get("default", codec.MAX_BUCKET_KEY)
        self._max_bucket = codec.decode_u64(max_bucket) if max_bucket else 0
        self.index = BucketIndex()
        for _, raw in self._scan("buckets"):
            self.index.add(*codec.decode_memberships(raw))
        self._forest = Forest()
        self._forest.grow(self._next_seq)
        keys, values = [], []
        for key, raw in self._scan("nodes"):
            keys.append(key)
            values.append(raw)
        seqs, nodes = codec.decode_nodes(keys, values)
        self._forest.set(seqs, nodes[:, 0], nodes[:, 1], nodes[:, 2])
        self.sets = SetCache(set_cache_bytes)

    @property
    def forest(self) -> Forest:
        return self._forest

    def next_seq(self) -> int:
        return self._next_seq

    def max_bucket_size(self) -> int:
        """Length of the largest band bucket ever written."""
        return self._max_bucket

    def bucket_members(self, bucket_ids: np.ndarray) -> BucketMembers:
        return self.index.lookup(bucket_ids)

    def get_signatures(self, seqs: Sequence[int]) -> np.ndarray:
        raws = self._get_many("signatures", codec.seq_keys(list(seqs)))
        missing = [s for s, raw in zip(seqs, raws) if raw is None]
        if missing:
            raise KeyError(f"no signature stored for documents {missing[:5]}")
        return codec.decode_signatures(raws, self.num_perm)  # type: ignore[arg-type]

    def get_nodes(self, seqs: Sequence[int]) -> list[Node | None]:
        return [self._forest.node(seq) for seq in seqs]

    def _documents(self, seqs: Sequence[int]) -> list[tuple[int, str]]:
        raws = self._get_many("documents", codec.seq_keys(list(seqs)))
        if None in raws:
            raise KeyError("unknown document sequence number")
        return [codec.decode_document(raw) for raw in raws]  # type: ignore[arg-type]

    def get_ids(self, seqs: Sequence[int]) -> list[str]:
        return [doc_id for _, doc_id in self._documents(seqs)]

    def get_sizes(self, seqs: Sequence[int]) -> np.ndarray:
        return np.array([size for size, _ in self._documents(seqs)], dtype=np.int64)

    def get_fingerprints(self, seqs: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """Read through the set cache: the sets it lacks come from the store in one
        multi-get and are added to it."""
        seqs = np.asarray(seqs, dtype=np.int64)
        hit, values, offsets = self.sets.lookup(seqs)
        if hit.all():
            return values, offsets
        missing = seqs[~hit]
        raws = self._get_many("shingles", codec.seq_keys(missing))
        if None in raws:
            raise KeyError("no shingle fingerprints stored for a document")
        read = codec.decode_fingerprint_sets(raws)  # type: ignore[arg-type]
        self.sets.add(missing, *read)
        return merge_sets(hit, (values, offsets), read)

    def get_position(self, source: str) -> int | None:
        raw = self._get("positions", source.encode("utf-8"))
        return None if raw is None else codec.decode_u64(raw)

    def get_verdicts(self, keys: Sequence[bytes]) -> list[bytes | None]:
        return self._get_many("verdicts", keys)

    def commit(self, update: StateUpdate) -> None:
        if update.first_seq != self._next_seq:
            raise StateError(
                f"update starts at document {update.first_seq}, the store at {self._next_seq}"
            )
        if update.signatures.shape != (len(update.ids), self.num_perm):
            raise StateError(
                f"signatures of shape {update.signatures.shape} for {len(update.ids)} "
                f"documents of {self.num_perm} permutations"
            )
        if update.next_seq > MAX_SEQ + 1:
            raise StateError(f"the store holds at most {MAX_SEQ + 1:,} documents")
        keys = codec.seq_keys(np.arange(update.first_seq, update.next_seq))
        sig_bytes = np.ascontiguousarray(update.signatures, dtype="<u8").tobytes()
        width = 8 * self.num_perm
        sizes = update.sizes.tolist() if update.sizes is not None else [0] * len(keys)
        puts: Puts = {"documents": zip(keys, map(codec.encode_document, sizes, update.ids))}
        if update.store_signatures:
            puts["signatures"] = ((key, sig_bytes[i * width : (i + 1) * width]) for i, key in enumerate(keys))
        if update.fingerprints is not None:
            puts["shingles"] = zip(keys, codec.encode_fingerprint_sets(update.fingerprints,
                                                                        update.fingerprint_offsets))
        if len(update.bucket_ids):
            puts["buckets"] = [(codec.seq_key(update.first_seq),
                                codec.encode_memberships(update.bucket_ids, update.bucket_seqs))]
        max_bucket = max(self._max_bucket, update.largest_bucket)
        nodes = np.asarray(update.nodes, dtype=np.uint64).reshape(-1, 4)
        puts["nodes"] = zip(codec.seq_keys(nodes[:, 0]), codec.encode_nodes(nodes[:, 1:]))
        puts["positions"] = [(source.encode("utf-8"), codec.encode_u64(position))
                             for source, position in update.positions.items()]
        puts["verdicts"] = update.verdicts.items()
        puts["default"] = [(codec.NEXT_SEQ_KEY, codec.encode_u64(update.next_seq)),
                           (codec.MAX_BUCKET_KEY, codec.encode_u64(max_bucket))]
        self._write(puts, {"verdicts": update.verdict_deletes})
        self._next_seq = update.next_seq
        self._max_bucket = max_bucket
        self.index.add(update.bucket_ids, update.bucket_seqs)
        self._forest.grow(update.next_seq)
        self._forest.set(nodes[:, 0], nodes[:, 1], nodes[:, 2], nodes[:, 3])
        if update.fingerprints is not None:
            # The newest sets that can be read again, those of the documents in a bucket (a
            # document in none is never a candidate): their copies may come soon.
            joined = sorted_unique(update.bucket_seqs).astype(np.int64)
            self.sets.add(joined, *select_sets(update.fingerprints, update.fingerprint_offsets,
                                               joined - update.first_seq))
