"""PNG plots of an evaluation: the LSH S-curve and the found/missed pair histogram."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from neardup.core.lsh import LshParams


def write_plots(report: dict[str, Any], out_dir: Path) -> list[Path]:
    """Write ``s_curve.png`` and ``pairs_histogram.png`` into ``out_dir``; return paths."""
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
    return [s_curve, histogram]
