"""PNG plot of token hit ratio vs cpu capacity: one line per policy, Belady dashed.

matplotlib is imported here only (Agg backend: no display needed).
"""

from __future__ import annotations

from pathlib import Path

from kvtier.simulate.sweep import SweepResult, policy_label


def write_plot(path: Path, result: SweepResult, title: str) -> None:
    """Draw the sweep to ``path`` (PNG).

    The x axis is log2 when every capacity is positive and they span more than 4×.

    Raises:
        OSError: the file cannot be written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=120)
    gibs = sorted(set(result.spec.cpu_gibs))
    for policy in result.spec.policies:
        rows = result.curve(policy)
        offline = policy == "belady"
        ax.plot([r.cpu_gib for r in rows], [100 * r.token_hit_ratio for r in rows],
                linestyle="--" if offline else "-", marker="o", markersize=4,
                color="black" if offline else None,
                label=policy_label(policy) + (" (offline optimum)" if offline else ""))
    if gibs[0] > 0 and gibs[-1] / gibs[0] > 4:
        ax.set_xscale("log", base=2)
        ax.set_xticks(gibs, [f"{g:g}" for g in gibs])
    ax.set_xlabel("cpu tier capacity (GiB)")
    ax.set_ylabel("prompt tokens not recomputed (%)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)
