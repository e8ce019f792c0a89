"""A document's verdict from the findings of every shard partition it touched.

The rule across shards (canonical policy):

- The candidates checked are the union of the shards' checked candidates (a candidate met
  on several shards has the same exact similarity on each). The best is the most
  similar, the earliest among equals; it is the match when it reaches the threshold.
- A duplicate joins, among the clusters of its accepted candidates, the one whose
  canonical is most similar to it, provided that similarity reaches the threshold and
  the canonical is itself among the candidates checked: a shard knows the sets of its
  own members only, so a canonical that no shard put in front of the document cannot be
  compared with it. Otherwise the document starts its own cluster and records its
  match's cluster as ``related``, as one process does when the canonical is too far.

One process computes the similarity to a canonical it did not meet from the stored sets;
that is the one place where the sharded rule can differ from it on the same candidates.

With the components policy (classic union-find, ``neardup.core.cluster``) a duplicate
joins the clusters of all its accepted candidates: its cluster is the earliest of their
roots, and it merges the others into it. That needs no canonical's set, so the rule is
one process's on the same candidates. Through Kafka, the clusters a document sees are
those of the decisions read or taken before it: a merge decided by a later document
that is already known can give an earlier root than one process gave at that point, and
one decided by an earlier document not yet read gives a later one; the decisions table
converges to the same clusters either way (``neardup.state.decisions``).

With a retention window, a cluster whose canonical has expired for the document (its time,
an order seq's high bits, below ``held_from``) is judged, as in one process
(``neardup.core.cluster``), by its most similar accepted member, and joined through it: the
cluster keeps its canonical (clusters outlive their canonical).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from neardup.sharded.shard import Checked, Finding
from neardup.core.types import Verdict


def decide(seq: int, findings: Sequence[Finding], clusters: Mapping[int, int], threshold: float,
           name: Callable[[int], str], policy: str = "canonical",
           held_from: int | None = None) -> tuple[Verdict, int, tuple[int, ...]]:
    """The verdict of document ``seq``, its cluster's canonical seq, and the roots of the
    other clusters it merges into that one (components policy; empty otherwise).

    Args:
        seq: the document's seq.
        findings: one per shard partition the document touched (none: it touched no
            bucket that held anyone, or has no valid shingles).
        clusters: the canonical seq of every earlier document's cluster, by seq (with
            the components policy: its root).
        threshold: the similarity at or above which a candidate is accepted.
        name: the external id of a seq.
        policy: ``"canonical"`` or ``"components"`` (``EngineSettings.cluster_policy``).
        held_from: with a retention window, the earliest time (ms) held for the document
            (``neardup.sharded.shard.ShardIndex.floor``); None: no window. The
            components policy needs no canonical's set, so it ignores it.

    Raises:
        ValueError: another policy.
        KeyError: an accepted candidate whose cluster is not in ``clusters`` (decided
            later than the document: the caller's order is wrong).
    """
    checked: dict[int, Checked] = {}
    for f in findings:
        for c in f.checked:
            checked[c.seq] = c
    nearest = max(checked.values(), key=lambda c: (c.similarity, -c.seq), default=None)
    accepted = [c for c in checked.values() if c.similarity >= threshold]
    own = name(seq)
    if nearest is None or nearest.similarity < threshold:
        verdict = Verdict(
            id=own, seq=seq, verdict="unique", cluster=own, match=None,
            similarity=nearest.similarity if nearest else 0.0,
            jaccard=nearest.jaccard if nearest else 0.0,
            containment=nearest.containment if nearest else 0.0,
            candidates=len(checked), rejected=len(checked),
            nearest=name(nearest.seq) if nearest else None)
        return verdict, seq, ()
    if policy == "components":
        roots = sorted({clusters[c.seq] for c in accepted})
        verdict = Verdict(
            id=own, seq=seq, verdict="duplicate", cluster=name(roots[0]), match=name(nearest.seq),
            similarity=nearest.similarity, jaccard=nearest.jaccard, containment=nearest.containment,
            candidates=len(checked), rejected=len(checked) - len(accepted), nearest=name(nearest.seq))
        return verdict, roots[0], tuple(roots[1:])
    if policy != "canonical":
        raise ValueError(f"cluster policy must be canonical or components, not {policy!r}")
    target, target_similarity = -1, -1.0
    for canonical in sorted({clusters[c.seq] for c in accepted}):
        if held_from is not None and canonical >> 96 < held_from:  # expired: its best member stands in
            similarity = max(c.similarity for c in accepted if clusters[c.seq] == canonical)
            if similarity > target_similarity:
                target, target_similarity = canonical, similarity
            continue
        known = checked.get(canonical)
        if known is not None and known.similarity > target_similarity:
            target, target_similarity = canonical, known.similarity
    joins = target_similarity >= threshold
    cluster = target if joins else seq
    verdict = Verdict(
        id=own, seq=seq, verdict="duplicate", cluster=name(cluster), match=name(nearest.seq),
        similarity=nearest.similarity, jaccard=nearest.jaccard, containment=nearest.containment,
        candidates=len(checked), rejected=len(checked) - len(accepted),
        related=None if joins else name(clusters[nearest.seq]), nearest=name(nearest.seq))
    return verdict, cluster, ()


def waiting_for(findings: Sequence[Finding], clusters: Mapping[int, int], threshold: float) -> list[int]:
    """The accepted candidates whose cluster is not known yet (``decide`` needs them):
    earlier documents not yet decided, or decided elsewhere and not yet read."""
    return sorted({c.seq for f in findings for c in f.checked if c.similarity >= threshold and c.seq not in clusters})
