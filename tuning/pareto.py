"""The Pareto rules, on plain value vectors: which points are non-dominated, and the knee score.

One home for both, used by the sweep's selection (Optuna trials), validation (measured values) and
the report (trials.parquet rows), so the front a report draws is the front the selection was made
from. Every coordinate is maximised. Pure Python: no Optuna, no pandas.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

Point = Sequence[float]


def dominates(a: Point, b: Point) -> bool:
    """``a`` is at least as good as ``b`` everywhere and better somewhere."""
    return all(x >= y for x, y in zip(a, b, strict=True)) and any(x > y for x, y in zip(a, b, strict=True))


def nondominated(points: Sequence[Point]) -> list[int]:
    """Indices (ascending) of the points no other point dominates."""
    return [i for i, p in enumerate(points) if not any(dominates(q, p) for q in points)]


def knee_scores(points: Sequence[Point], reference: Sequence[Point] | None = None) -> list[float]:
    """Per point, the norm of its relative shortfalls from the best of ``reference`` (default: the
    points) on each coordinate: 0 for a point best everywhere. A coordinate whose best is not
    positive carries no shortfall (a relative shortfall from 0 means nothing)."""
    ref = points if reference is None else reference
    if not ref:
        return [0.0] * len(points)
    best = [max(p[i] for p in ref) for i in range(len(ref[0]))]
    return [math.sqrt(sum((1 - p[i] / b) ** 2 if b > 0 else 0.0 for i, b in enumerate(best))) for p in points]
