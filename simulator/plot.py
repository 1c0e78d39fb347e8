"""The simulator's figure: queue depth (total and stacked per bucket) and the rolling bucket mix."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


def bucket_labels(bounds: Sequence[int]) -> list[str]:
    lows = [0, *bounds[:-1]]
    return [f"({lo}, {hi}]" for lo, hi in zip(lows, bounds)]


def plot_queue(take: Sequence[dict[str, Any]], bounds: Sequence[int], out: str | Path, *,
               window: int = 32, title: str = "") -> Path:
    """Top: stacked per-bucket depth seen at each take, total on top. Bottom: mix of each window."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    k = len(bounds)
    labels = bucket_labels(bounds)
    t = [r["t"] for r in take]
    per_bucket = [[r["bucket_depths"][b] for r in take] for b in range(k)]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 6.5), constrained_layout=True)
    if t:
        ax1.stackplot(t, per_bucket, labels=labels, step="post", alpha=0.85)
        ax1.plot(t, [r["depth_before"] for r in take], color="black", lw=0.6, label="total")
    ax1.set_xlabel("time (s)")
    ax1.set_ylabel("queue depth (items)")
    ax1.set_title(title or "queue depth at each take, stacked by length bucket")
    ax1.legend(loc="upper right", fontsize=7, ncol=k + 1)

    items = [r["bucket"] for r in take for _ in r["item_ids"]]
    n_win = len(items) // window
    fractions = [[0.0] * n_win for _ in range(k)]
    for w in range(n_win):
        for b in items[w * window:(w + 1) * window]:
            fractions[b][w] += 1 / window
    if n_win:
        ax2.stackplot(range(n_win), fractions, labels=labels, step="post", alpha=0.85)
    ax2.set_xlim(0, max(n_win - 1, 1))
    ax2.set_ylim(0, 1)
    ax2.set_xlabel(f"window of {window} taken items")
    ax2.set_ylabel("bucket share in window")
    ax2.set_title("rolling bucket mix of what drafters took")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
