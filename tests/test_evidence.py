"""Validation decides by evidence (tuning/validation/evidence.py): intervals, looks, the recommendation."""

from __future__ import annotations

import random

import pytest
from scipy import stats

from tuning.validation.evidence import (
    Comparison,
    chosen_comparisons,
    compare,
    difference_interval,
    per_look_level,
    recommend,
    takes_to_resolve,
)


def test_interval_is_welchs():
    rng = random.Random(0)
    a = [rng.gauss(10, 2) for _ in range(6)]
    b = [rng.gauss(9, 1) for _ in range(5)]
    d, (lo, hi), _, _ = difference_interval(a, b, level=0.95)
    ref = stats.ttest_ind(a, b, equal_var=False).confidence_interval(0.95)
    assert (lo, hi) == pytest.approx((ref.low, ref.high))
    assert d == pytest.approx(sum(a) / 6 - sum(b) / 5)


@pytest.mark.parametrize(("a", "b", "resolved"), [
    ([10.0, 10.2, 9.9, 10.1], [5.0, 5.1, 4.9, 5.2], True),
    ([10.0, 12.0, 8.0, 11.0], [9.5, 12.5, 7.0, 10.0], False),
    ([10.0], [5.0], False),  # one block: no spread, nothing resolved
])
def test_resolved_exactly_when_zero_is_outside_the_interval(a, b, resolved):
    c = compare("x", "y", "mix_efficiency", a, b, max_looks=3)
    assert c.resolved is resolved
    assert c.resolved == (not c.ci95[0] <= 0 <= c.ci95[1])


def test_more_looks_mean_wider_intervals():
    a, b = [1.0, 1.2, 0.9, 1.1], [0.8, 0.9, 1.0, 0.7]
    widths = [compare("x", "y", "o", a, b, max_looks=k).ci95 for k in (1, 3, 10)]
    spans = [hi - lo for lo, hi in widths]
    assert spans[0] < spans[1] < spans[2]
    assert per_look_level(0.95, 5) == pytest.approx(0.99)


def test_sequential_looks_keep_the_false_resolution_rate_at_most_five_percent():
    """Same distribution for both: stopping at the first resolved look of at most 6 errs <= ~5%."""
    rng = random.Random(7)
    false = 0
    runs = 400
    for _ in range(runs):
        a, b = [], []
        for _look in range(6):
            a.append(rng.gauss(0, 1))
            b.append(rng.gauss(0, 1))
            if len(a) >= 2 and compare("x", "y", "o", a, b, max_looks=6).resolved:
                false += 1
                break
    assert false / runs <= 0.07


def _blocks(means: dict[str, tuple[float, float]], n: int, spread: tuple[float, float], seed: int = 0):
    rng = random.Random(seed)
    return {name: {"throughput_tokens_per_s": [rng.gauss(t, spread[0]) for _ in range(n)],
                   "mix_efficiency": [rng.gauss(m, spread[1]) for _ in range(n)]}
            for name, (t, m) in means.items()}


def test_a_costlier_config_is_not_preferred_on_unresolved_evidence():
    blocks = _blocks({"tuned-1": (560, 1.00), "handpicked": (550, 0.98), "baseline": (540, 0.97)}, 4, (80, 0.1))
    peak = {"tuned-1": 4e9, "handpicked": 2e9, "baseline": 1e9}
    rec = recommend(blocks, peak, max_looks=4, block_takes=20)
    assert rec.name == "baseline" and set(rec.candidates) == {"tuned-1", "handpicked", "baseline"}
    assert "more takes" in rec.words


def test_a_config_resolved_worse_is_out_even_when_cheapest():
    blocks = _blocks({"tuned-1": (560, 1.00), "handpicked": (555, 0.99), "baseline": (300, 0.60)}, 6, (5, 0.01))
    peak = {"tuned-1": 4e9, "handpicked": 2e9, "baseline": 1e9}
    rec = recommend(blocks, peak, max_looks=4, block_takes=20)
    assert "baseline" not in rec.candidates
    assert rec.name == "handpicked"


def test_chosen_comparisons_cover_both_references_and_objectives():
    blocks = _blocks({"tuned-1": (560, 1.0), "handpicked": (550, 0.9), "baseline": (540, 0.8)}, 3, (10, 0.02))
    cs = chosen_comparisons(blocks, "tuned-1", max_looks=3)
    assert {(c.against, c.objective) for c in cs} == {(r, o) for r in ("handpicked", "baseline")
                                                      for o in ("throughput_tokens_per_s", "mix_efficiency")}
    assert all(isinstance(c.as_json()["ci95"], list) for c in cs)


def test_takes_to_resolve_is_enough_at_the_observed_noise():
    a, b = [10.0, 12.0, 8.0, 11.0], [9.0, 11.0, 7.0, 10.0]
    c = compare("x", "y", "o", a, b, max_looks=1)
    assert not c.resolved
    more = takes_to_resolve(c, block_takes=10)
    assert more is not None and more > 0
    k = 4 + more // 10  # the same blocks repeated: same means and spread, more of them
    reps = -(-k // 4)
    bigger = compare("x", "y", "o", (a * reps)[:k], (b * reps)[:k], max_looks=1)
    assert bigger.resolved
    assert takes_to_resolve(Comparison("x", "y", "o", 0.0, (-1.0, 1.0), False, 0.5, (3, 3)), 10) is None
