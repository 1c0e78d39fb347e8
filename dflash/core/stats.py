"""Intervals for the figures we compare configurations by.

Why a bootstrap over prompts for tau: tau is a ratio of sums (tokens produced over verification
steps, all prompts together), prompts differ far more than steps within a prompt, and a prompt's
steps are not independent. Resampling whole prompts keeps that structure; the percentile interval
of the resampled ratio needs no normality. Torch-free and seeded, so a report is reproducible.
"""

from __future__ import annotations

import random
from collections.abc import Sequence


def ratio_bootstrap_ci(numerators: Sequence[float], denominators: Sequence[float], *, level: float = 0.95,
                       resamples: int = 2000, seed: int = 0) -> tuple[float, float] | None:
    """Percentile interval of sum(num)/sum(den) with units (num_i, den_i) resampled with replacement.

    None when there is no unit with a positive denominator. With one unit the interval is the
    point itself (nothing to resample: the interval says nothing about spread then).
    """
    if len(numerators) != len(denominators):
        raise ValueError("numerators and denominators must pair up")
    if not 0 < level < 1 or resamples < 1:
        raise ValueError("level must be in (0, 1) and resamples >= 1")
    units = [(float(n), float(d)) for n, d in zip(numerators, denominators, strict=True)]
    if sum(d for _, d in units) <= 0:
        return None
    rng = random.Random(seed)
    k = len(units)
    ratios = []
    for _ in range(resamples):
        draw = [units[rng.randrange(k)] for _ in range(k)]
        den = sum(d for _, d in draw)
        if den > 0:
            ratios.append(sum(n for n, _ in draw) / den)
    ratios.sort()
    lo_q, hi_q = (1 - level) / 2, 1 - (1 - level) / 2
    return _quantile(ratios, lo_q), _quantile(ratios, hi_q)


def _quantile(sorted_values: Sequence[float], q: float) -> float:
    """Linear interpolation between order statistics (numpy's default), for a sorted list."""
    pos = q * (len(sorted_values) - 1)
    i = int(pos)
    j = min(i + 1, len(sorted_values) - 1)
    return sorted_values[i] + (pos - i) * (sorted_values[j] - sorted_values[i])
