"""Sequential validation's plan and decisions: blocks alternate ABCABC, a block waits for its round,
the look count is fixed before the first block, and the recommendation follows the evidence."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from dflash.core.config import DflashConfig
from tuning.validation.metrics import block_table
from tuning.validation.plan import (
    ValidateArgs,
    block_steps,
    max_looks,
    split_unit,
    unit_name,
    unit_order,
    unit_ready,
)
from tuning.validation.recommendation import choose_tuned, evidence_of, stop_reason


def _args(takes: int, block_takes: int) -> ValidateArgs:
    return ValidateArgs(selection={"configs": []}, selection_path="sel.json", takes=takes, out=Path("/tmp/x"),
                        calibration=None, claims_url="sqlite://", prompts=1, block_takes=block_takes)


@pytest.mark.parametrize(("takes", "block", "looks"), [(40, 10, 4), (41, 10, 5), (10, 10, 1), (3, 1, 3)])
def test_the_number_of_looks_is_fixed_by_the_budget(takes: int, block: int, looks: int) -> None:
    assert max_looks(takes, block) == looks


def test_blocks_alternate_the_configurations_round_by_round() -> None:
    assert unit_order(["baseline", "handpicked", "tuned-1"], 2) == [
        "baseline#0", "handpicked#0", "tuned-1#0", "baseline#1", "handpicked#1", "tuned-1#1"]
    assert split_unit(unit_name("tuned#1", 3)) == ("tuned#1", 3)  # a '#' in a config name survives


@pytest.mark.parametrize(("statuses", "unit", "ready"), [
    ({"a#0": "pending", "b#0": "pending", "a#1": "pending"}, "a#0", True),
    ({"a#0": "done", "b#0": "running", "a#1": "pending"}, "a#1", False),   # round 0 not over
    ({"a#0": "done", "b#0": "done", "a#1": "pending"}, "a#1", True),
    ({"a#0": "done", "b#0": "failed", "a#1": "pending"}, "a#1", True),    # a failed config does not hold others
    ({"a#0": "failed", "b#0": "done", "a#1": "pending"}, "a#1", False),   # nothing to continue from
])
def test_a_block_waits_for_its_round_and_its_own_previous_block(statuses: dict, unit: str, ready: bool) -> None:
    assert unit_ready(unit, statuses) is ready


def test_block_step_budgets_grow_to_the_whole_budget() -> None:
    cfg = DflashConfig()
    per_step = cfg.cluster.n_drafter
    ends = [block_steps(cfg, _args(40, 15), k)[0] for k in range(max_looks(40, 15))]
    total = math.ceil(40 / per_step)
    assert ends == sorted(ends) and ends[-1] == total and all(0 < e <= total for e in ends)


def _rows(means: dict[str, tuple[list[float], list[float], float]]) -> list[dict]:
    return [{"name": n, "block": k, "throughput_tokens_per_s": t[k], "mix_efficiency": m[k],
             "peak_queue_bytes": peak} for n, (t, m, peak) in means.items() for k in range(len(t))]


def test_a_costlier_config_is_not_recommended_on_unresolvedevidence_of() -> None:
    """tuned is a little faster than baseline within the noise and holds 4x the queue memory: the
    recommendation is baseline, and the comparison says it is not resolved."""
    blocks = block_table(_rows({
        "baseline": ([100, 130, 90, 120], [0.80, 0.82, 0.79, 0.81], 1e6),
        "handpicked": ([95, 125, 100, 110], [0.80, 0.81, 0.80, 0.82], 2e6),
        "tuned-1": ([110, 140, 85, 135], [0.81, 0.80, 0.82, 0.80], 4e6)}))
    chosen, comps, rec = evidence_of(blocks, looks=4, block_takes=10)
    assert chosen == "tuned-1"
    assert {(c.against, c.objective) for c in comps} == {
        (r, o) for r in ("baseline", "handpicked") for o in ("throughput_tokens_per_s", "mix_efficiency")}
    for c in comps:
        lo, hi = c.ci95
        assert c.resolved == (not lo <= 0 <= hi)
    assert not any(c.resolved for c in comps)
    assert rec is not None and rec.name == "baseline" and "tuned-1" in rec.candidates


def test_a_clearly_better_config_is_recommended_and_resolved() -> None:
    blocks = block_table(_rows({
        "baseline": ([100, 101, 99, 100], [0.50, 0.51, 0.50, 0.49], 1e6),
        "handpicked": ([120, 121, 119, 120], [0.60, 0.61, 0.60, 0.59], 1e6),
        "tuned-1": ([200, 201, 199, 200], [0.90, 0.91, 0.90, 0.89], 3e6)}))
    chosen, comps, rec = evidence_of(blocks, looks=4, block_takes=10)
    assert chosen == "tuned-1" and comps and all(c.resolved and c.difference > 0 for c in comps)
    assert rec is not None and rec.name == "tuned-1" and tuple(rec.candidates) == ("tuned-1",)


def test_no_tuned_config_means_nothing_to_test() -> None:
    blocks = block_table(_rows({"baseline": ([1.0, 2.0], [0.5, 0.5], 1.0)}))
    assert choose_tuned(blocks) is None


def test_blocks_too_short_for_a_mix_are_decided_on_throughput_alone() -> None:
    """No mix_efficiency in any block (too few items for a window): the comparisons and the
    recommendation use throughput, and the words say so."""
    rows = [{**r, "mix_efficiency": None} for r in _rows({
        "baseline": ([100, 101, 99, 100], [0, 0, 0, 0], 1e6),
        "tuned-1": ([200, 201, 199, 200], [0, 0, 0, 0], 3e6)})]
    chosen, comps, rec = evidence_of(block_table(rows), looks=4, block_takes=10)
    assert chosen == "tuned-1"
    assert [(c.against, c.objective, c.resolved) for c in comps] == [("baseline", "throughput_tokens_per_s", True)]
    assert rec is not None and rec.name == "tuned-1" and "on throughput" in rec.words


def test_a_config_without_throughput_blocks_is_left_out_of_the_decision() -> None:
    rows = _rows({"baseline": ([100, 101], [0.5, 0.5], 1e6), "tuned-1": ([150, 151], [0.6, 0.6], 2e6)})
    rows.append({"name": "tuned-2", "block": 0, "throughput_tokens_per_s": None, "mix_efficiency": None,
                 "peak_queue_bytes": 1.0})
    chosen, comps, rec = evidence_of(block_table(rows), looks=2, block_takes=10)
    assert chosen == "tuned-1" and {c.objective for c in comps} == {"throughput_tokens_per_s", "mix_efficiency"}
    assert rec is not None and "tuned-2" not in rec.candidates


@pytest.mark.parametrize(("statuses", "resolved", "reason"), [
    (["done", "skipped"], [True, True], "resolved"),  # stopped early
    (["done", "done"], [True, True], "resolved"),  # resolved at the last look
    (["done", "done"], [True, False], "budget"),
    (["done", "failed", "skipped"], [True, True], "failed"),  # skipped because a config failed
    (["done"], [], "budget"),  # nothing to compare
])
def test_the_stop_reason_follows_theevidence_of(statuses: list, resolved: list, reason: str) -> None:
    from tuning.validation.evidence import Comparison

    comps = [Comparison("t", "baseline", "throughput_tokens_per_s", 1.0, (0.5, 1.5) if ok else (-1.0, 2.0),
                        ok, 0.1, (2, 2)) for ok in resolved]
    assert stop_reason([{"status": s} for s in statuses], comps) == reason
