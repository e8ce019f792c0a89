"""The Python API: a near-duplicate index to add documents to and query, in a program.

``Deduplicator`` is the engine of ``neardup dedup`` (``neardup.detector.Detector``) over
a state in memory or in a RocksDB state directory, with the same settings: a document
added gets the verdict ``neardup dedup`` gives it. ``query`` asks for the nearest stored
documents of a text without adding it (``neardup.query``). As datasketch's
``MinHashLSH`` (``insert``/``query``), but with verification, clusters and a durable
state::

    from neardup import Deduplicator

    with Deduplicator(threshold=0.8) as index:
        index.add("a", "the quick brown fox jumps over the lazy dog by the river")
        verdict = index.add("b", "the quick brown fox jumps over the lazy dog by the river!")
        verdict.verdict, verdict.match        # ("duplicate", "a")
        index.query("quick brown fox jumps over the lazy dog by the river")
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import xxhash

from neardup.config import Settings, library_settings, retention_changes
from neardup.core.settings import EngineSettings
from neardup.core.types import Document, Rejected, Verdict
from neardup.detector import Detector
from neardup.errors import ClosedError, DocumentTypeError, DuplicateIdError, ReadOnlyError
from neardup.query import Neighbour, nearest
from neardup.state.errors import StateError
from neardup.state.kv import KeyValueStateStore

__all__ = ["Deduplicator", "Neighbour", "Rejected", "Verdict", "SETTINGS"]

#: The settings a ``Deduplicator`` takes as keyword arguments (``neardup.config.Settings``
#: fields, the flags of ``neardup dedup`` with underscores): the engine's, the retention
#: window's and the batch size.
SETTINGS = frozenset({
    "shingle", "num_perm", "seed", "minhash", "threshold", "bands", "rows", "nfkc", "casefold",
    "strip_punctuation", "max_bucket_size", "max_candidates", "extra_candidates", "duplicate_buckets",
    "measure", "containment_direction", "containment_ratio", "verify", "cluster_policy",
    "candidate_threshold", "multiset", "retention", "retention_documents", "batch_size",
})

#: The settings a read-only ``Deduplicator`` may still choose (the others are the state's).
QUERY_SETTINGS = frozenset({"measure", "containment_direction", "max_candidates", "extra_candidates"})


def _hash64(text: str) -> int:
    return xxhash.xxh3_64_intdigest(text.encode("utf-8", "surrogatepass"))


def stored_engine(shape: dict[str, Any], options: dict[str, Any] | None = None) -> EngineSettings:
    """The engine settings of a state whose stored settings are ``shape``
    (``EngineSettings.state_shape()``, as ``RocksDBStateStore.settings`` reads it),
    with ``options`` (``QUERY_SETTINGS``) for what the state does not fix.

    Raises:
        StateError: the stored settings are not ones this version writes.
    """
    try:
        norm = shape["normalization"]
        settings = library_settings({
            "shingle": shape["shingling"], "num_perm": shape["num_perm"], "seed": shape["seed"],
            "minhash": shape["minhash"], "bands": shape["bands"], "rows": shape["rows"],
            "nfkc": norm["nfkc"], "casefold": norm["casefold"], "strip_punctuation": norm["strip_punctuation"],
            "verify": shape["verify"], "cluster_policy": shape["cluster_policy"], **(options or {})})
        engine = settings.engine()
    except (KeyError, TypeError, ValueError) as exc:
        raise StateError(f"the state's stored settings are not understood ({exc})") from None
    if engine.state_shape() != {k: v for k, v in shape.items() if k != "layout"}:
        raise StateError("the state's stored settings are not understood (another neardup version?)")
    return engine


class Deduplicator:
    """A near-duplicate index: add documents, get verdicts; query texts, get neighbours.

    The engine and the verdicts are those of ``neardup dedup`` with the same settings
    (MinHash, Broder 1997; LSH banding, Leskovec, Rajaraman, Ullman, *Mining of Massive
    Datasets*, §3.4; verification and union-find clustering, ``neardup.detector``).

    Args:
        state_dir: a RocksDB state directory (created when missing), kept between runs
            and shared with ``neardup dedup --state-dir`` (never with a running writer:
            ``StateLockedError``); None: the state lives in memory and ends with the
            object.
        config: a TOML settings file, as ``neardup --config`` reads it (keyword
            arguments win over it). The ``NEARDUP_*`` variables are not read.
        read_only: open an existing ``state_dir`` to query only, beside a running
            writer if need be (no lock taken; it sees what was committed before the
            open): the settings are the state's, ``add`` raises ``ReadOnlyError``.
        **settings: any of ``SETTINGS`` (``neardup.config.Settings`` fields, e.g.
            ``threshold=0.9``, ``shingle="char:5"``, ``retention="7d"``); with
            ``read_only``, only ``QUERY_SETTINGS``.

    Thread safety: every method holds one lock, so threads may share the object; their
    calls run one at a time. Use one ``Deduplicator`` per state directory and process.

    Raises:
        pydantic.ValidationError: a setting's value is invalid (the message names it).
        TypeError: a keyword that is no setting of ``SETTINGS``.
        ValueError: an invalid combination (``bands`` without ``rows``), or a
            ``config`` file with an unknown key.
        SettingsMismatchError: ``state_dir`` holds a state built with other settings.
        StateLockedError: another process holds ``state_dir``.
        StateError: ``state_dir`` cannot be opened (with ``read_only``: missing or not
            a neardup state).
    """

    def __init__(self, state_dir: str | os.PathLike[str] | None = None, *,
                 config: str | os.PathLike[str] | None = None, read_only: bool = False,
                 **settings: Any) -> None:
        allowed = QUERY_SETTINGS if read_only else SETTINGS
        unknown = sorted(set(settings) - allowed)
        if unknown:
            raise TypeError(f"Deduplicator() got settings it does not take: {', '.join(unknown)} "
                            f"(it takes {', '.join(sorted(allowed))})")
        if read_only and state_dir is None:
            raise ValueError("read_only needs a state_dir")
        self._lock = threading.Lock()
        self._closed = True
        self._settings: Settings = library_settings(settings, Path(config) if config is not None else None)
        self.state_dir = Path(state_dir) if state_dir is not None else None
        self.read_only = read_only
        store: KeyValueStateStore
        if read_only:
            from neardup.state.rocksdb import RocksDBStateStore  # noqa: PLC0415 - rocksdict on demand

            store = RocksDBStateStore(state_dir, None, read_only=True)  # type: ignore[arg-type]
            try:
                engine = stored_engine(store.settings, settings)
            except BaseException:
                store.close()
                raise
        else:
            engine = self._settings.engine()
            retention = retention_changes(self._settings)
            if state_dir is None:
                from neardup.state.memory import MemoryStateStore  # noqa: PLC0415

                store = MemoryStateStore(engine.state_shape(), retention=retention)
            else:
                from neardup.state.rocksdb import RocksDBStateStore  # noqa: PLC0415

                store = RocksDBStateStore(state_dir, engine.state_shape(), retention=retention)
        self._engine = engine
        self._store = store
        self._detector = Detector(engine, store)
        try:
            self._ids = self._stored_ids() if not read_only else set()
        except BaseException:
            store.close()
            raise
        self._closed = False

    def _stored_ids(self, chunk: int = 1 << 16) -> set[int]:
        """XXH3-64 hashes of the ids stored (a false "seen before" needs a 64-bit
        collision: about 3 in a million for ten million ids)."""
        n = self._store.next_seq()
        seen: set[int] = set()
        for first in range(0, n, chunk):
            seen.update(_hash64(i) for i in self._store.get_ids(range(first, min(n, first + chunk))))
        return seen

    @property
    def settings(self) -> EngineSettings:
        """The engine settings in force (for a read-only index, the state's)."""
        return self._engine

    @property
    def batch_size(self) -> int:
        """Documents per committed batch in ``add_many``."""
        return self._settings.batch_size

    def __len__(self) -> int:
        """Documents stored (added and not rejected, over every run on the state)."""
        with self._lock:
            self._check_open()
            return self._store.next_seq()

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("the Deduplicator is closed")

    def add(self, id: str, text: str, time: float | None = None) -> Verdict | Rejected:  # noqa: A002 - the field's name
        """Add one document; return its verdict (``add_many`` of one document).

        Args:
            id: the document's id, distinct from every id stored.
            text: its text.
            time: its time in seconds since the Unix epoch, for a retention window
                (None: now).

        Returns:
            ``Verdict`` (``verdict`` "unique" or "duplicate", ``cluster``, ``match``,
            ``similarity``, ``nearest``, …), or ``Rejected`` (``reason``) for a text
            with no word left after normalisation (nothing is stored then).

        Raises:
            DuplicateIdError, DocumentTypeError, ClosedError, ReadOnlyError: as ``add_many``.
            StateError: the state cannot be written (full disk).
        """
        return self.add_many([id], [text], None if time is None else [time])[0]

    def add_many(self, ids: Sequence[str], texts: Sequence[str],
                 times: Sequence[float | None] | None = None) -> list[Verdict | Rejected]:
        """Add documents in order; return one result per document, in order.

        Documents are decided one after another, each against the stored ones and the
        earlier ones of the call, and committed in batches of ``batch_size`` (each batch
        atomically; the batch size does not change the verdicts). All the input is
        checked before anything is added.

        Args:
            ids: the documents' ids: ``str``, distinct, and distinct from every id
                stored.
            texts: their texts (``str``), as many as ``ids``.
            times: their times in seconds since the Unix epoch (None: now), as many as
                ``ids``; None: all now.

        Returns:
            ``Verdict`` or ``Rejected`` per document (see ``add``).

        Raises:
            DuplicateIdError: an id is stored already or given twice.
            DocumentTypeError: an id or text is not a ``str``, a time not a number.
            ValueError: ``texts`` or ``times`` is not as long as ``ids``.
            ClosedError: the object is closed.
            ReadOnlyError: the object was opened read-only.
            StateError: the state cannot be written (full disk).
        """
        if isinstance(ids, str) or isinstance(texts, str):
            raise DocumentTypeError("add_many takes sequences of ids and texts; use add for one document")
        times_list = [None] * len(ids) if times is None else list(times)
        if len(texts) != len(ids) or len(times_list) != len(ids):
            raise ValueError(f"{len(ids)} ids, {len(texts)} texts and {len(times_list)} times: give as many of each")
        docs: list[Document] = []
        for i, (doc_id, text, t) in enumerate(zip(ids, texts, times_list)):
            if not isinstance(doc_id, str):
                raise DocumentTypeError(f"document {i}: the id must be a str, not {type(doc_id).__name__}")
            if not isinstance(text, str):
                raise DocumentTypeError(f"document {i} ({doc_id!r}): the text must be a str, not {type(text).__name__}")
            if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float))):
                raise DocumentTypeError(f"document {i} ({doc_id!r}): the time must be seconds as a number, "
                                        f"not {type(t).__name__}")
            docs.append(Document(doc_id, text, None if t is None else float(t)))
        with self._lock:
            self._check_open()
            if self.read_only:
                raise ReadOnlyError(f"the Deduplicator on {self.state_dir} is read-only")
            hashes = [_hash64(d.id) for d in docs]
            seen: set[int] = set()
            for doc, h in zip(docs, hashes):
                if h in self._ids or h in seen:
                    where = "given twice" if h in seen else "stored already"
                    raise DuplicateIdError(f"document id {doc.id!r} is {where}; ids must be distinct")
                seen.add(h)
            out: list[Verdict | Rejected] = []
            size = self._settings.batch_size
            for start in range(0, len(docs), size):
                results = self._detector.process(docs[start:start + size])
                self._ids.update(_hash64(r.id) for r in results if isinstance(r, Verdict))
                out += results
            return out

    def query(self, text: str, k: int = 5) -> list[Neighbour]:
        """The ``k`` stored documents nearest ``text``, most similar first, without
        adding it or changing the state (``neardup.query.nearest``).

        Returns:
            At most ``k`` ``Neighbour`` (``id``, ``similarity``, ``jaccard``,
            ``containment``, ``cluster``); empty when LSH finds no candidate.

        Raises:
            DocumentTypeError: ``text`` is not a ``str``.
            ValueError: ``k`` is below 1.
            ClosedError: the object is closed.
        """
        return self.query_many([text], k)[0]

    def query_many(self, texts: Sequence[str], k: int = 5) -> list[list[Neighbour]]:
        """``query`` for each of ``texts``, in one pass; the texts do not meet one
        another.

        Raises:
            DocumentTypeError: a text is not a ``str`` (or ``texts`` is one).
            ValueError: ``k`` is below 1.
            ClosedError: the object is closed.
        """
        if isinstance(texts, str):
            raise DocumentTypeError("query_many takes a sequence of texts; use query for one text")
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise DocumentTypeError(f"query text {i}: must be a str, not {type(text).__name__}")
        with self._lock:
            self._check_open()
            return nearest(self._store, self._engine, texts, k, self._detector.prepare)

    def close(self) -> None:
        """Close the state (a state directory's files are then complete); calling it
        again does nothing.

        Raises:
            StateError: the state store failed to close (e.g. a full disk).
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._store.close()

    def __enter__(self) -> Deduplicator:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        where = str(self.state_dir) if self.state_dir is not None else "memory"
        state = "closed" if self._closed else f"{self._store.next_seq()} documents"
        return f"Deduplicator({where}, {state})"
