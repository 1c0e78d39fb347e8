"""The bootstrap interval of a ratio of sums (tau over prompts)."""

from __future__ import annotations

import random

import pytest

from dflash.core.stats import ratio_bootstrap_ci


def _prompts(n: int, seed: int) -> tuple[list[float], list[float]]:
    rng = random.Random(seed)
    steps = [rng.randint(10, 40) for _ in range(n)]
    produced = [s * rng.uniform(1.0, 2.0) for s in steps]
    return produced, steps


def test_interval_contains_the_point_and_narrows_with_more_prompts():
    widths = []
    for n in (8, 32, 128):
        num, den = _prompts(n, seed=n)
        lo, hi = ratio_bootstrap_ci(num, den, seed=1)
        point = sum(num) / sum(den)
        assert lo <= point <= hi
        widths.append(hi - lo)
    assert widths[0] > widths[1] > widths[2]


def test_interval_covers_the_true_ratio_about_as_often_as_it_says():
    """Prompts drawn from a population with tau 1.5: a 90% interval covers it in roughly 90% of samples."""
    covered = 0
    trials = 200
    for t in range(trials):
        rng = random.Random(1000 + t)
        steps = [rng.randint(10, 40) for _ in range(24)]
        produced = [s * (1.5 + rng.uniform(-0.4, 0.4)) for s in steps]
        lo, hi = ratio_bootstrap_ci(produced, steps, level=0.9, resamples=400, seed=t)
        covered += lo <= 1.5 <= hi
    assert 0.8 <= covered / trials <= 0.97


def test_seeded_and_degenerate_cases():
    num, den = _prompts(10, seed=3)
    assert ratio_bootstrap_ci(num, den, seed=5) == ratio_bootstrap_ci(num, den, seed=5)
    assert ratio_bootstrap_ci([3.0], [2.0]) == (1.5, 1.5)
    assert ratio_bootstrap_ci([0.0, 0.0], [0.0, 0.0]) is None
    with pytest.raises(ValueError):
        ratio_bootstrap_ci([1.0], [1.0, 2.0])
    with pytest.raises(ValueError):
        ratio_bootstrap_ci([1.0], [1.0], level=1.0)
