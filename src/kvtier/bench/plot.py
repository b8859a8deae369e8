"""TTFT CDF of each arm as a PNG (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path


def plot_ttft_cdf(ttfts_by_arm: Mapping[str, Sequence[float]], path: Path, title: str,
                  labels: Mapping[str, str] | None = None) -> Path:
    """Draw one empirical CDF line per arm (x: TTFT in seconds, log scale; y: share of requests)
    and save it to ``path``.  Arms without values are left out.  ``labels``: legend text per arm
    (default: the p50 of the values drawn and their count).  Returns ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(7.0, 4.5), dpi=110)
    for name, values in ttfts_by_arm.items():
        if not values:
            continue
        xs = np.sort(np.asarray(values, dtype=float))
        ys = np.arange(1, len(xs) + 1) / len(xs)
        label = (labels or {}).get(name)
        if label is None:
            label = f"{name} (p50 {float(np.percentile(xs, 50)) * 1000:.0f} ms, n={len(xs)})"
        ax.step(xs, ys, where="post", label=label)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s, log scale)")
    ax.set_ylabel("share of requests")
    ax.set_ylim(0, 1.0)
    ax.grid(True, which="both", alpha=0.3)
    ax.set_title(title)
    ax.legend(loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
