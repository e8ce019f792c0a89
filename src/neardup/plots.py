"""PNG plots of an evaluation: the LSH S-curve, the found/missed pair histogram, and each
document's reported score against its exact best similarity."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from neardup.core.lsh import LshParams


def write_plots(report: dict[str, Any], out_dir: Path) -> list[Path]:
    """Write ``s_curve.png``, ``pairs_histogram.png`` and ``scores.png`` into ``out_dir``;
    return their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    s = report["settings"]
    lsh = LshParams(s["bands"], s["rows"])
    x = np.linspace(0, 1, 501)

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ax.plot(x, lsh.probability(x), label=f"{lsh.bands} bands x {lsh.rows} rows")
    ax.axvline(s["threshold"], color="tab:red", linestyle="--", label=f"threshold {s['threshold']}")
    if abs(s["banding_threshold"] - s["threshold"]) > 1e-9:
        ax.axvline(s["banding_threshold"], color="tab:gray", linestyle=":",
                   label=f"banding tuned for {s['banding_threshold']:.2f}")
    ax.set_xlabel("Jaccard similarity s")
    ax.set_ylabel("P(candidate) = 1 - (1 - s^r)^b")
    ax.set_title("LSH S-curve")
    ax.legend(loc="upper left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    s_curve = out_dir / "s_curve.png"
    fig.savefig(s_curve, dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    bins = np.linspace(min(0.5, s["threshold"]), 1.0, 26)
    hist = report["histogram"]
    missed = np.asarray(hist["missed"])
    below = missed < s["threshold"]
    ax.hist([hist["found"], missed[~below], missed[below]], bins=bins, stacked=True,
            label=[f"linked ({len(hist['found']):,})",
                   f"missed: at or above the threshold, not linked ({int((~below).sum()):,})",
                   f"below the threshold, not linked ({int(below.sum()):,})"],
            color=["tab:green", "tab:red", "tab:gray"])
    ax.axvline(s["threshold"], color="tab:red", linestyle="--", label="threshold")
    ax.set_yscale("log")
    ax.set_xlabel(f"exact {s['measure']} of the pair")
    ax.set_ylabel("pairs")
    ax.set_title("Exact pairs linked and missed by the detector")
    ax.legend()
    fig.tight_layout()
    histogram = out_dir / "pairs_histogram.png"
    fig.savefig(histogram, dpi=120)
    plt.close(fig)
    return [s_curve, histogram, _scores(report, out_dir, plt)]


def _scores(report: dict[str, Any], out_dir: Path, plt: Any) -> Path:
    """``scores.png``: per document, the score its verdict carries (the similarity of its
    nearest candidate) against its exact best similarity to an earlier document."""
    s = report["settings"]
    pairs = report["score_pairs"]
    exact, reported = np.asarray(pairs["exact_best"]), np.asarray(pairs["reported"])
    fig, ax = plt.subplots(figsize=(5.6, 5.2))
    ax.scatter(exact, reported, s=8, alpha=0.5, color="tab:blue", linewidths=0,
               label=f"documents ({len(exact):,})")
    ax.plot([0, 1], [0, 1], color="tab:gray", linewidth=0.8, label="score = exact best")
    ax.axvline(s["threshold"], color="tab:red", linestyle="--", linewidth=0.8, label="threshold")
    ax.axhline(s["threshold"], color="tab:red", linestyle="--", linewidth=0.8)
    ax.set_xlim(0, 1.01)
    ax.set_ylim(0, 1.01)
    ax.set_xlabel(f"exact best {s['measure']} to an earlier document")
    ax.set_ylabel(f"reported score ({s['measure']} of the nearest candidate)")
    ax.set_title("Score of every document against the exact best")
    ax.legend(loc="upper left", fontsize="small")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = out_dir / "scores.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
