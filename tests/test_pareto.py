"""The Pareto rules and the named configs have one home each; these are their specifications."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dflash.core.named_configs import NAMED_CONFIGS, named_config_of
from tuning.pareto import dominates, knee_scores, nondominated

points2 = st.lists(st.tuples(st.floats(0, 10, allow_nan=False), st.floats(0, 10, allow_nan=False)), max_size=25)


@given(points2)
def test_front_is_exactly_the_undominated_points(points):
    front = set(nondominated(points))
    for i, p in enumerate(points):
        beaten = any(dominates(q, p) for q in points)
        assert (i in front) == (not beaten)


@given(points2)
def test_every_point_off_the_front_is_dominated_by_one_on_it(points):
    front = nondominated(points)
    for i, p in enumerate(points):
        if i not in front:
            assert any(dominates(points[j], p) for j in front)


@pytest.mark.parametrize(("a", "b", "expected"), [
    ((1, 1), (1, 1), False), ((2, 1), (1, 1), True), ((1, 1), (2, 1), False), ((2, 0), (1, 1), False)])
def test_dominates(a, b, expected):
    assert dominates(a, b) is expected


def test_knee_scores_are_relative_shortfalls_from_the_best():
    scores = knee_scores([(100.0, 1.0), (50.0, 1.0), (100.0, 0.5)])
    assert scores[0] == 0.0
    assert scores[1] == pytest.approx(0.5) and scores[2] == pytest.approx(0.5)
    assert knee_scores([(50.0, 0.5)], reference=[(100.0, 1.0)]) == [pytest.approx(math.sqrt(0.5))]
    assert knee_scores([(3.0, 0.0)]) == [0.0]  # a best of 0 carries no shortfall


@pytest.mark.parametrize(("queue", "name"), [
    ({"min_ready": 10, "max_depth": 30}, "baseline"),
    ({"min_ready": 30, "max_depth": 90, "policy": "random_item"}, "handpicked"),
    ({"min_ready": 30, "max_depth": 90, "policy": "fifo"}, None),
    ({"min_ready": 10, "max_depth": 31}, None),
    (None, None),
])
def test_named_config_of(queue, name):
    assert named_config_of(queue) == name


def test_named_configs_are_designs_and_a_pair_alone_under_another_policy_is_not_one():
    assert NAMED_CONFIGS == {"baseline": {"min_ready": 10, "max_depth": 30},
                             "handpicked": {"min_ready": 30, "max_depth": 90}}
    assert named_config_of({"min_ready": 10, "max_depth": 30, "policy": "fullest"}) is None
