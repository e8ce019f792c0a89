"""The detector: a batch of documents in, one verdict per document out, in arrival order.

For each batch: normalise, shingle and MinHash every text at once (numpy), cut the
signatures into band buckets, fetch the buckets' earlier members from the store in one
multi-get, then walk the documents in order. A document's candidates are the members of
its buckets, earlier documents of the same batch included; a candidate is accepted when
the share of equal signature slots (the MinHash estimate of Jaccard) reaches the
threshold. Accepted pairs are joined by union-find; a cluster's id is its earliest
document (the canonical). Nothing is written until the caller commits the batch's
``StateUpdate``, in one atomic write.
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from neardup.core.lsh import band_hashes
from neardup.core.minhash import MinHasher
from neardup.core.normalize import normalize
from neardup.core.settings import EngineSettings
from neardup.core.shingle import shingle_batch
from neardup.core.types import Document, Rejected, Verdict
from neardup.core.unionfind import Node, root_node, union
from neardup.state import codec
from neardup.state.base import StateStore, StateUpdate

EMPTY_TEXT = "empty text after normalisation"
NO_TOKENS = "no word tokens after normalisation"


class _StoredNodes(MutableMapping[int, Node]):
    """Union-find nodes: the store's, overlaid with this batch's changes."""

    def __init__(self, store: StateStore) -> None:
        self._store = store
        self._loaded: dict[int, Node | None] = {}
        self.changed: dict[int, Node] = {}

    def prefetch(self, seqs: Sequence[int]) -> None:
        missing = [s for s in seqs if s not in self._loaded]
        for seq, node in zip(missing, self._store.get_nodes(missing)):
            self._loaded[seq] = node

    def __getitem__(self, seq: int) -> Node:
        if seq not in self._loaded:
            self.prefetch([seq])
        node = self._loaded[seq]
        if node is None:
            raise KeyError(seq)
        return node

    def __setitem__(self, seq: int, node: Node) -> None:
        self._loaded[seq] = node
        self.changed[seq] = node

    def __delitem__(self, seq: int) -> None:
        raise TypeError("union-find nodes are never deleted")

    def __iter__(self) -> Iterator[int]:
        return (s for s, n in self._loaded.items() if n is not None)

    def __len__(self) -> int:
        return sum(n is not None for n in self._loaded.values())


@dataclass
class BatchResult:
    """The verdicts of a batch and the state update that records them."""

    results: list[Verdict | Rejected]
    update: StateUpdate
    signatures: np.ndarray = field(repr=False)

    @property
    def verdicts(self) -> list[Verdict]:
        return [r for r in self.results if isinstance(r, Verdict)]


class Detector:
    """Near-duplicate detection over a state store.

    Args:
        settings: the engine settings; their ``state_shape()`` must be the store's.
        store: where buckets, signatures, union-find nodes and ids live.
    """

    def __init__(self, settings: EngineSettings, store: StateStore) -> None:
        self.settings = settings
        self.store = store
        self.hasher = MinHasher(settings.num_perm, settings.seed)

    def detect(self, documents: Sequence[Document]) -> BatchResult:
        """Verdicts for ``documents`` against the committed state, without writing.

        The caller commits ``result.update`` (adding input positions if it tracks them)
        before the next call.
        """
        s = self.settings
        texts = [normalize(d.text, s.norm) for d in documents]
        shingles = shingle_batch(texts, s.shingling)
        valid = np.flatnonzero(shingles.counts > 0)
        signatures = self.hasher.signatures(shingles)[valid]
        keys = codec.bucket_keys(band_hashes(signatures, s.bands))
        first_seq = self.store.next_seq()

        unique_keys = list(dict.fromkeys(k for doc_keys in keys for k in doc_keys))
        buckets = dict(zip(unique_keys, self.store.get_buckets(unique_keys)))
        stored = np.unique(np.concatenate([np.empty(0, np.uint64), *buckets.values()]))
        stored = stored.astype(np.int64)
        stored_sigs = self.store.get_signatures(stored.tolist())
        nodes = _StoredNodes(self.store)
        nodes.prefetch(stored.tolist())

        members: dict[bytes, list[int]] = {k: v.tolist() for k, v in buckets.items()}
        verdicts: list[Verdict] = []
        matches: list[tuple[int, int]] = []  # (match seq, canonical seq) per document
        for i, doc_keys in enumerate(keys):
            seq = first_seq + i
            candidates = np.unique(
                np.fromiter((c for k in doc_keys for c in members[k]), dtype=np.int64)
            )
            old = candidates[candidates < first_seq]
            new = candidates[candidates >= first_seq]
            cand_sigs = np.concatenate(
                [stored_sigs[np.searchsorted(stored, old)], signatures[new - first_seq]]
            )
            similarity = np.mean(cand_sigs == signatures[i], axis=1)
            accepted = similarity >= s.threshold
            match, best = -1, 0.0
            if accepted.any():
                j = int(np.argmax(np.where(accepted, similarity, -1.0)))
                match, best = int(candidates[j]), float(similarity[j])
                for other in candidates[accepted].tolist():
                    union(nodes, other, seq)
            root = root_node(nodes, seq) if match >= 0 else None
            canonical = root.canonical if root is not None else seq
            for k in doc_keys:
                if len(members[k]) < s.max_bucket_size:
                    members[k].append(seq)
            matches.append((match, canonical))
            verdicts.append(
                Verdict(
                    id="",
                    seq=seq,
                    verdict="duplicate" if match >= 0 else "unique",
                    cluster="",
                    match=None,
                    similarity=best,
                    candidates=len(candidates),
                    rejected=int(len(candidates) - accepted.sum()),
                    cluster_size=root.size if root is not None else 1,
                )
            )

        ids = [documents[i].id for i in valid]
        verdicts = self._name(verdicts, matches, ids, first_seq)
        results: list[Verdict | Rejected] = []
        valid_iter = iter(verdicts)
        for doc, text, count in zip(documents, texts, shingles.counts):
            if count > 0:
                results.append(next(valid_iter))
            else:
                results.append(Rejected(doc.id, EMPTY_TEXT if not text else NO_TOKENS))
        update = StateUpdate(
            first_seq=first_seq,
            signatures=signatures,
            ids=ids,
            buckets={
                k: np.asarray(v, dtype=np.uint64)
                for k, v in members.items()
                if len(v) != len(buckets[k])
            },
            nodes=nodes.changed,
        )
        return BatchResult(results=results, update=update, signatures=signatures)

    def _name(
        self,
        verdicts: list[Verdict],
        matches: list[tuple[int, int]],
        ids: list[str],
        first_seq: int,
    ) -> list[Verdict]:
        """Fill in external ids of each verdict's document, match and canonical."""
        wanted = {q for pair in matches for q in pair if 0 <= q < first_seq}
        wanted_list = sorted(wanted)
        names = dict(zip(wanted_list, self.store.get_ids(wanted_list)))
        names.update((first_seq + i, doc_id) for i, doc_id in enumerate(ids))
        out = []
        for v, (match, canonical), doc_id in zip(verdicts, matches, ids):
            out.append(
                Verdict(
                    id=doc_id,
                    seq=v.seq,
                    verdict=v.verdict,
                    cluster=names[canonical],
                    match=names[match] if match >= 0 else None,
                    similarity=v.similarity,
                    candidates=v.candidates,
                    rejected=v.rejected,
                    cluster_size=v.cluster_size,
                )
            )
        return out

    def process(
        self, documents: Sequence[Document], positions: dict[str, int] | None = None
    ) -> list[Verdict | Rejected]:
        """``detect`` then commit, with the input ``positions`` reached, atomically."""
        result = self.detect(documents)
        if positions:
            result.update.positions.update(positions)
        self.store.commit(result.update)
        return result.results
