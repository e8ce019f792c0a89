"""``neardup eval``: detection quality against the exact ground truth of a corpus.

The ground truth is computed, not labelled: all-pairs similarity of the same shingle sets
the detector sees (``neardup.groundtruth``, a sparse matrix product). Reported at the
configured threshold and measure:

- pair recall and precision: linked pairs (every candidate the detector accepted) against
  the exact pairs at or above the threshold;
- document recall: documents with an earlier exact partner at or above the threshold that
  were flagged; document precision: flagged documents whose match reaches the threshold;
- scores: each verdict's score (the similarity of its nearest candidate, for unique
  documents too) against the document's exact best similarity to an earlier one;
- cluster agreement: adjusted Rand index of the detector's clusters against the connected
  components of the exact pairs (or against ``label_field`` when given);
- per cluster policy: the largest cluster and the cluster diameter (the lowest exact
  similarity between a cluster's canonical document and one of its members);
- disk bytes per document of the RocksDB state, and timings.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import scipy.sparse as sp
from scipy.sparse.csgraph import connected_components
from sklearn.metrics import adjusted_rand_score

from neardup.config import default
from neardup.core.normalize import normalize
from neardup.core.settings import EngineSettings
from neardup.core.shingle import shingle_batch
from neardup.core.types import Document, Verdict
from neardup.detector import Detector
from neardup.groundtruth import Pairs, all_pairs, best_earlier
from neardup.state.memory import MemoryStateStore
from neardup.state.rocksdb import RocksDBStateStore

#: Exact pairs below this similarity are not kept for the found/missed histogram.
HISTOGRAM_FLOOR = 0.5


@dataclass
class Run:
    """One detector run: per valid document its verdict, and every accepted link."""

    verdicts: list[Verdict]
    links: np.ndarray  # int64, shape (n_links, 2): (earlier, later) document indices
    seconds: float
    disk_bytes: int | None = None


def _run(docs: Sequence[Document], settings: EngineSettings, batch_size: int, on_disk: bool) -> Run:
    with tempfile.TemporaryDirectory(prefix="neardup-eval-") as tmp:
        store = (RocksDBStateStore(tmp, settings.state_shape()) if on_disk
                 else MemoryStateStore(settings.state_shape()))
        detector = Detector(settings, store)
        verdicts: list[Verdict] = []
        links: list[tuple[int, int, float]] = []
        started = time.perf_counter()
        for i in range(0, len(docs), batch_size):
            result = detector.detect(docs[i : i + batch_size])
            store.commit(result.update)
            verdicts += result.verdicts
            links += result.links
        seconds = time.perf_counter() - started
        disk = None
        if isinstance(store, RocksDBStateStore):
            store.flush()
            disk = store.stats()["sst_bytes"]
        store.close()
    pairs = np.array([(a, b) for a, b, _ in links], dtype=np.int64).reshape(-1, 2)
    return Run(verdicts, pairs, seconds, disk)


def _pair_index(earlier: np.ndarray, later: np.ndarray, n: int) -> np.ndarray:
    return earlier.astype(np.int64) * n + later.astype(np.int64)


def _diameter(canonical: np.ndarray, sim: sp.csr_matrix) -> float:
    """Lowest similarity between a canonical and a member of its cluster (1.0 if none)."""
    members = np.flatnonzero(canonical != np.arange(len(canonical)))
    if len(members) == 0:
        return 1.0
    values = np.asarray(sim[canonical[members], members]).ravel()
    return float(values.min())


def evaluate(
    docs: Sequence[Document],
    settings: EngineSettings,
    labels: Sequence[Any] | None = None,
    batch_size: int = default("batch_size"),
) -> dict[str, Any]:
    """Quality report of ``settings`` on ``docs`` (see the module docstring), run in
    batches of ``batch_size`` documents (the ``Settings`` default, as ``neardup eval``).

    Documents that are empty after normalisation are left out of every figure.
    """
    t0 = time.perf_counter()
    texts = [normalize(d.text, settings.norm) for d in docs]
    shingles = shingle_batch(texts, settings.shingling)
    valid = np.flatnonzero(shingles.counts > 0)
    docs = [docs[i] for i in valid]
    n = len(docs)
    kept = shingle_batch([texts[i] for i in valid], settings.shingling)
    floor = min(HISTOGRAM_FLOOR, settings.threshold)
    everything = all_pairs(kept)
    direction = settings.containment_direction
    exact_best, _ = best_earlier(everything, n, settings.measure, direction)
    pairs = everything.select(everything.similarity(settings.measure, direction) >= floor)
    del everything
    sim_values = pairs.similarity(settings.measure, direction)
    truth_seconds = time.perf_counter() - t0
    truth = pairs.select(sim_values >= settings.threshold)
    sim = sp.csr_matrix((sim_values, (pairs.earlier, pairs.later)), shape=(n, n))

    runs = {
        policy: _run(docs, replace(settings, cluster_policy=policy), batch_size,
                     on_disk=policy == settings.cluster_policy)
        for policy in ("canonical", "components")
    }
    main = runs[settings.cluster_policy]

    truth_keys = _pair_index(truth.earlier, truth.later, n)
    link_keys = np.unique(_pair_index(main.links[:, 0], main.links[:, 1], n))
    exact_of_link = np.asarray(sim[main.links[:, 0], main.links[:, 1]]).ravel() if len(main.links) else np.empty(0)
    found = np.isin(truth_keys, link_keys)

    has_partner = np.zeros(n, dtype=bool)
    has_partner[truth.later] = True
    flagged = np.array([v.is_duplicate for v in main.verdicts])
    seq_of = {v.id: v.seq for v in main.verdicts}
    flagged_idx = np.flatnonzero(flagged)
    match_idx = np.array([seq_of[main.verdicts[i].match] for i in flagged_idx], dtype=np.int64)
    match_sim = np.asarray(sim[match_idx, flagged_idx]).ravel() if len(flagged_idx) else np.empty(0)

    if labels is not None:
        reference = np.unique(np.asarray([str(labels[i]) for i in valid]), return_inverse=True)[1]
        reference_name = "labels"
    else:
        graph = sp.coo_matrix((np.ones(len(truth)), (truth.earlier, truth.later)), shape=(n, n))
        reference = connected_components(graph, directed=False)[1]
        reference_name = "exact connected components"

    reported = np.array([v.similarity for v in main.verdicts])
    policies = {}
    for policy, run in runs.items():
        canonical = _final_canonicals(run, policy, seq_of, n)
        _, inverse, counts = np.unique(canonical, return_inverse=True, return_counts=True)
        policies[policy] = {
            "adjusted_rand_index": float(adjusted_rand_score(reference, inverse)),
            "largest_cluster": int(counts.max()),
            "clusters_with_duplicates": int((counts > 1).sum()),
            "cluster_diameter": _diameter(canonical, sim),
            "seconds": round(run.seconds, 3),
        }
    return {
        "documents": n,
        "settings": {**settings.state_shape(), "threshold": settings.threshold,
                     "measure": settings.measure,
                     "containment_direction": direction if settings.measure == "containment" else None,
                     "banding_threshold": settings.banding_threshold},
        "exact_pairs": int(len(truth)),
        "linked_pairs": int(len(link_keys)),
        "pair_recall": _ratio(found.sum(), len(truth)),
        "pair_precision": _ratio((exact_of_link >= settings.threshold).sum(), len(exact_of_link)),
        "documents_with_partner": int(has_partner.sum()),
        "flagged": int(flagged.sum()),
        "document_recall": _ratio((flagged & has_partner).sum(), has_partner.sum()),
        "document_precision": _ratio((match_sim >= settings.threshold).sum(), len(match_sim)),
        "cluster_reference": reference_name,
        "policies": policies,
        "disk_bytes_per_document": round(main.disk_bytes / n, 1) if main.disk_bytes else None,
        "seconds": {"ground_truth": round(truth_seconds, 3), "detector": round(main.seconds, 3)},
        "size_ratios": _by_ratio(truth, found, main.links, exact_of_link, settings.threshold,
                                 pairs.sizes, n) if settings.measure == "containment" else None,
        "scores": _score_summary(reported, exact_best, settings.threshold, settings.floor),
        "score_pairs": {"reported": reported.tolist(), "exact_best": exact_best.tolist()},
        "histogram": {
            "found": sim_values[np.isin(_pair_index(pairs.earlier, pairs.later, n), link_keys)].tolist(),
            "missed": sim_values[~np.isin(_pair_index(pairs.earlier, pairs.later, n), link_keys)].tolist(),
        },
    }


#: Size-ratio bands (larger set over smaller) of the containment report.
RATIO_BANDS = ((1.0, 2.0), (2.0, 4.0), (4.0, 8.0), (8.0, float("inf")))


def _by_ratio(truth: Pairs, found: np.ndarray, links: np.ndarray, exact_of_link: np.ndarray,
              threshold: float, sizes: np.ndarray, n: int) -> list[dict[str, Any]]:
    """Pair recall and precision per size-ratio band (``RATIO_BANDS``, the larger set's
    size over the smaller's, lower bound included): exact pairs at or above the
    threshold linked, and linked pairs whose exact similarity reaches it."""
    truth_ratio = truth.ratio()
    a, b = sizes[links[:, 0]], sizes[links[:, 1]]
    link_ratio = np.maximum(a, b) / np.maximum(np.minimum(a, b), 1)
    _, first = np.unique(_pair_index(links[:, 0], links[:, 1], n), return_index=True)
    out = []
    for low, high in RATIO_BANDS:
        t = (truth_ratio >= low) & (truth_ratio < high)
        linked = np.zeros(len(links), dtype=bool)
        linked[first] = True
        linked &= (link_ratio >= low) & (link_ratio < high)
        out.append({
            "ratio": f"{low:g}-{high:g}x" if high < float("inf") else f">={low:g}x",
            "exact_pairs": int(t.sum()),
            "pair_recall": _ratio(found[t].sum(), t.sum()),
            "linked_pairs": int(linked.sum()),
            "pair_precision": _ratio((exact_of_link[linked] >= threshold).sum(), linked.sum()),
        })
    return out


def _score_summary(reported: np.ndarray, exact_best: np.ndarray, threshold: float,
                   floor: float) -> dict[str, float]:
    """How the score every verdict carries (its nearest candidate's similarity) compares
    with each document's exact best similarity to an earlier one: the share equal (within
    1e-9) of all documents, of those whose exact best reaches ``threshold`` and of those
    whose exact best reaches the score ``floor`` (with their count), and the mean and
    largest shortfall."""
    short = exact_best - reported
    equal = np.abs(short) <= 1e-9
    above = exact_best >= threshold
    reach = exact_best >= floor
    return {
        "equal_to_exact_best": _ratio(equal.sum(), len(short)),
        "equal_at_threshold": _ratio((equal & above).sum(), above.sum()),
        "score_floor": floor,
        "documents_at_floor": int(reach.sum()),
        "equal_at_floor": _ratio((equal & reach).sum(), reach.sum()),
        "mean_shortfall": float(short.mean()) if len(short) else 0.0,
        "largest_shortfall": float(short.max(initial=0.0)),
    }


def _final_canonicals(run: Run, policy: str, seq_of: dict[str, int], n: int) -> np.ndarray:
    """Each document's cluster canonical (index) once the whole corpus is in.

    Under ``canonical`` a document's cluster never changes after its verdict. Under
    ``components`` a later document can merge two clusters, so the final clusters are the
    connected components of all links, each named by its earliest document.
    """
    if policy == "canonical":
        return np.array([seq_of[v.cluster] for v in run.verdicts], dtype=np.int64)
    graph = sp.coo_matrix((np.ones(len(run.links)), (run.links[:, 0], run.links[:, 1])), shape=(n, n))
    labels = connected_components(graph, directed=False)[1]
    first = np.full(labels.max() + 1, n, dtype=np.int64)
    np.minimum.at(first, labels, np.arange(n))
    return first[labels]


def _ratio(num: int | np.integer, den: int | np.integer) -> float:
    return float(num) / float(den) if den else 1.0


def render(report: dict[str, Any]) -> str:
    """A human-readable summary of ``evaluate``'s report."""
    s = report["settings"]
    lines = [
        f"documents {report['documents']:,}  measure {s['measure']}  threshold {s['threshold']}  "
        f"shingles {s['shingling']}  num_perm {s['num_perm']}  bands {s['bands']} x rows {s['rows']} "
        f"(tuned for {s['banding_threshold']:.2f})  verify {s['verify']}",
        f"exact pairs >= threshold   {report['exact_pairs']:>8,}   linked pairs {report['linked_pairs']:,}",
        f"pair recall                {report['pair_recall']:.4f}   pair precision      {report['pair_precision']:.4f}",
        f"document recall            {report['document_recall']:.4f}   document precision  {report['document_precision']:.4f}"
        f"   ({report['flagged']:,} flagged, {report['documents_with_partner']:,} with an exact partner)",
        f"cluster agreement (ARI vs {report['cluster_reference']}):",
    ]
    for policy, p in report["policies"].items():
        lines.append(
            f"  {policy:<11} ARI {p['adjusted_rand_index']:.4f}  largest cluster {p['largest_cluster']}"
            f"  diameter {p['cluster_diameter']:.3f}  clusters {p['clusters_with_duplicates']:,}"
        )
    for band in report.get("size_ratios") or []:
        lines.append(
            f"  size ratio {band['ratio']:<6} exact pairs {band['exact_pairs']:>6,}  recall {band['pair_recall']:.4f}"
            f"  linked {band['linked_pairs']:>6,}  precision {band['pair_precision']:.4f}")
    sc = report["scores"]
    lines.append(
        f"score = exact best          {sc['equal_to_exact_best']:.4f} of documents, "
        f"{sc['equal_at_threshold']:.4f} of those >= threshold, {sc['equal_at_floor']:.4f} of the "
        f"{sc['documents_at_floor']:,} >= the score floor {sc['score_floor']:g}; "
        f"shortfall mean {sc['mean_shortfall']:.4f}, largest {sc['largest_shortfall']:.4f}")
    disk = report["disk_bytes_per_document"]
    lines.append(f"state on disk              {disk:,.0f} bytes/document" if disk else "state on disk: n/a")
    t = report["seconds"]
    lines.append(f"seconds: ground truth {t['ground_truth']:.2f}, detector {t['detector']:.2f}")
    return "\n".join(lines)
