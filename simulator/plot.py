"""The simulator's figure: queue depth (total and stacked per bucket) and the rolling bucket mix.

It draws the run's downsampled series (``SimResult.series``: at most 1,000 points each), so a
figure of a simulated week costs what a figure of an hour costs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def bucket_labels(bounds: Sequence[int]) -> list[str]:
    lows = [0, *bounds[:-1]]
    return [f"({lo}, {hi}]" for lo, hi in zip(lows, bounds)]


def plot_queue(series: Mapping[str, Sequence[Any]], bounds: Sequence[int], out: str | Path, *,
               window: int = 32, title: str = "") -> Path:
    """Top: stacked per-bucket depth seen at takes, total on top. Bottom: bucket mix of windows.

    ``series["depth"]``: (t, depth before the take, bucket depths) samples; ``series["windows"]``:
    bucket counts of sampled windows of ``window`` taken items, in take order; ``series["knobs"]``
    (with ``[queue] mode = "auto"``): (t, min_ready, max_depth) at each autopilot change, drawn on top.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    k = len(bounds)
    labels = bucket_labels(bounds)
    depth = list(series.get("depth", ()))
    t = [row[0] for row in depth]
    per_bucket = [[row[2][b] for row in depth] for b in range(k)]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 6.5), constrained_layout=True)
    if t:
        ax1.stackplot(t, per_bucket, labels=labels, step="post", alpha=0.85)
        ax1.plot(t, [row[1] for row in depth], color="black", lw=0.6, label="total")
    knobs = list(series.get("knobs", ()))  # (t, min_ready, max_depth) at each autopilot change
    if knobs:
        kt = [row[0] for row in knobs]
        ax1.step(kt, [row[1] for row in knobs], where="post", color="red", lw=1.2, label="min_ready (auto)")
        ax1.step(kt, [row[2] for row in knobs], where="post", color="red", lw=1.2, ls="--",
                 label="max_depth (auto)")
    ax1.set_xlabel("time (s)")
    ax1.set_ylabel("queue depth (items)")
    ax1.set_title(title or "queue depth at takes, stacked by length bucket")
    ax1.legend(loc="upper right", fontsize=7, ncol=k + 1)

    windows = list(series.get("windows", ()))
    n_win = len(windows)
    fractions = [[w[b] / window for w in windows] for b in range(k)]
    if n_win:
        ax2.stackplot(range(n_win), fractions, labels=labels, step="post", alpha=0.85)
    ax2.set_xlim(0, max(n_win - 1, 1))
    ax2.set_ylim(0, 1)
    ax2.set_xlabel(f"sampled window of {window} taken items (in take order)")
    ax2.set_ylabel("bucket share in window")
    ax2.set_title("rolling bucket mix of what drafters took")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
