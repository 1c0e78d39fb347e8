"""The decision with the simulator and the hardware together (tuning.validation.decision): pure, fast.

Each test names the property it holds: equivalence is declared exactly when every interval lies inside
the margins; a refuted simulator leaves the hardware alone; τ is fixed in advance, never fitted from
the runs judged; the level is split over looks x comparisons x objectives; the decision rebuilds from
its JSON.
"""

from __future__ import annotations

import inspect
import json
import math
import re
from itertools import combinations
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from dflash.core.config import DecisionConfig
from tuning.validation import decision as dm
from tuning.validation.decision import (
    BucketUse,
    DecisionPolicy,
    Evidence,
    Pathology,
    answer_sentences,
    combine,
    decide,
    decide_from_json,
    pair_evidence,
    round_difference,
    split_alpha,
)
from tuning.validation.model_error import MODEL_ERROR

ROOT = Path(__file__).resolve().parent.parent
OBJ = ("throughput_tokens_per_s", "mix_efficiency")
POLICY = DecisionPolicy.from_config(DecisionConfig(), looks=1, objectives=OBJ)


def hw_only(a: str, b: str, objective: str, d: float, se: float) -> Evidence:
    """Hardware-only evidence with a normal interval (no simulator prediction)."""
    return Evidence(a, b, objective, None, 0.0, d, se, math.inf, dm.HW_SE_BLOCKS, 10, 1.0)


def both(a: str, b: str, objective: str, sim: float, hw: float, *, sim_se: float = 0.001, hw_se: float = 0.05,
         scale: float = 1.0) -> Evidence:
    return Evidence(a, b, objective, sim, sim_se, hw, hw_se, math.inf, dm.HW_SE_MODEL, 1, scale)


# --------------------------------------------------------------------------- equivalence
@pytest.mark.parametrize(("d", "se", "equivalent"), [
    (0.0, 0.01, True),  # half-width 0.0196 at level 0.95 (one comparison): inside +-0.05
    (0.03, 0.01, True),  # [0.0104, 0.0496]: inside, although it excludes 0
    (0.035, 0.01, False),  # [0.0154, 0.0546]: pokes out above
    (-0.035, 0.01, False),  # pokes out below
    (0.0, 0.03, False),  # too wide
])
def test_equivalence_is_declared_exactly_when_the_interval_lies_inside_the_margin(d, se, equivalent):
    policy = DecisionPolicy(margins={"mix_efficiency": 0.05}, objectives=("mix_efficiency",))
    c = combine(hw_only("a", "b", "mix_efficiency", d, se), policy, split_alpha(0.95, 1, 1, 1))
    assert (c.verdict == "equivalent") is equivalent
    assert (c.verdict == "equivalent") == (c.interval[0] > -0.05 and c.interval[1] < 0.05)


@settings(max_examples=200, deadline=None)
@given(st.floats(-0.2, 0.2), st.floats(0.001, 0.1), st.floats(0.01, 0.2))
def test_verdicts_follow_the_interval(d, se, margin):
    policy = DecisionPolicy(margins={"mix_efficiency": margin}, objectives=("mix_efficiency",))
    c = combine(hw_only("a", "b", "mix_efficiency", d, se), policy, 0.01)
    lo, hi = c.interval
    assert hi - lo == pytest.approx(2 * stats.norm.ppf(1 - 0.005) * se)
    expected = ("equivalent" if -margin < lo and hi < margin else "better" if lo > 0 else "worse" if hi < 0
                else "unresolved")
    assert c.verdict == expected


def test_two_configurations_within_the_margins_are_equivalent_and_the_cheaper_wins():
    ev = [hw_only("big", "small", "throughput_tokens_per_s", 0.0, 0.001),
          hw_only("big", "small", "mix_efficiency", 0.01, 0.005)]
    d = decide(ev, {"big": 3e8, "small": 1e8}, POLICY)
    assert (d.outcome, d.chosen, set(d.survivors)) == ("equivalent", "small", {"big", "small"})
    # one interval poking out of its margin below (big - small in [-0.025, +0.065]): small could be worse
    # than big by more than the margin, big not worse than small by more: big alone is certified
    ev[1] = hw_only("big", "small", "mix_efficiency", 0.02, 0.02)
    d = decide(ev, {"big": 3e8, "small": 1e8}, POLICY)
    assert (d.outcome, d.chosen, d.survivors) == ("decided", "big", ("big",))
    # poking out on both sides: neither is certified, undecided, the cheaper named
    ev[1] = hw_only("big", "small", "mix_efficiency", 0.0, 0.04)
    d = decide(ev, {"big": 3e8, "small": 1e8}, POLICY)
    assert d.outcome == "undecided" and d.chosen == "small"
    # poking out and clear of 0: the costlier one is better, and decided
    ev[1] = hw_only("big", "small", "mix_efficiency", 0.04, 0.01)
    d = decide(ev, {"big": 3e8, "small": 1e8}, POLICY)
    assert (d.outcome, d.chosen, d.decided_by) == ("decided", "big", ("mix_efficiency",))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(-0.1, 0.1), st.floats(0.001, 0.05)), min_size=6, max_size=6))
def test_an_equivalence_outcome_has_every_survivor_interval_inside_the_margins(draws):
    names = ("a", "b", "c")
    ev = [hw_only(x, y, o, d, se) for (x, y), o, (d, se) in
          zip([p for p in combinations(names, 2) for _ in OBJ], OBJ * 3, draws, strict=True)]
    d = decide(ev, {"a": 1.0, "b": 2.0, "c": 3.0}, POLICY)
    if d.outcome == "equivalent":
        for c in d.comparisons:
            if {c.candidate, c.reference} <= set(d.survivors):
                assert -c.margin < c.interval[0] and c.interval[1] < c.margin
        assert d.chosen == min(d.survivors, key={"a": 1.0, "b": 2.0, "c": 3.0}.get)
    if d.outcome == "decided":  # the chosen one is beaten by nobody and beats the rest (directly or not)
        assert d.survivors == (d.chosen,)


def test_a_resolved_trade_off_is_undecided_not_a_win():
    ev = [hw_only("a", "b", "throughput_tokens_per_s", 0.5, 0.01), hw_only("a", "b", "mix_efficiency", -0.2, 0.01)]
    d = decide(ev, {"a": 1.0, "b": 2.0}, POLICY)
    assert d.outcome == "undecided" and "trade-off" in d.note


# --------------------------------------------------------------------------- combination and refutation
def test_the_combination_is_precision_weighted():
    tau = MODEL_ERROR["mix_efficiency"].tau
    e = both("a", "b", "mix_efficiency", 0.02, 0.05, sim_se=0.004, hw_se=0.03)
    c = combine(e, POLICY, 0.01)
    w_sim, w_hw = 1 / (0.004 ** 2 + tau ** 2), 1 / 0.03 ** 2
    assert c.difference == pytest.approx((w_sim * 0.02 + w_hw * 0.05) / (w_sim + w_hw))
    assert c.se == pytest.approx((w_sim + w_hw) ** -0.5)
    assert c.tau == tau and not c.refuted and c.source in (dm.SOURCE_BOTH, dm.SOURCE_SIM)


@settings(max_examples=200, deadline=None)
@given(st.floats(-0.5, 0.5), st.floats(-0.5, 0.5), st.floats(0.0, 0.05), st.floats(0.005, 0.2), st.floats(0.5, 4))
def test_a_refuted_simulator_leaves_the_hardware_alone(sim, hw, sim_se, hw_se, z_refute):
    policy = DecisionPolicy(margins={"mix_efficiency": 0.05}, z_refute=z_refute, objectives=("mix_efficiency",))
    c = combine(both("a", "b", "mix_efficiency", sim, hw, sim_se=sim_se, hw_se=hw_se), policy, 0.01)
    tau = MODEL_ERROR["mix_efficiency"].tau
    z = (sim - hw) / math.sqrt(sim_se ** 2 + tau ** 2 + hw_se ** 2)
    assert c.gap_z == pytest.approx(z)
    assert c.refuted == (abs(z) > z_refute)
    if c.refuted:
        assert (c.difference, c.se, c.sim_weight) == (hw, hw_se, 0.0)
        assert c.source.startswith("hardware alone (simulator refuted, gap z=")
    else:
        assert min(sim, hw) - 1e-12 <= c.difference <= max(sim, hw) + 1e-12
        assert c.se <= hw_se


def test_objectives_the_simulator_does_not_predict_are_the_hardwares():
    policy = DecisionPolicy.from_config(DecisionConfig(), looks=1, objectives=("heldout_loss",))
    e = dm.estimate_evidence("a", "b", "heldout_loss", hw_candidate=(6.0, 0.02), hw_reference=(7.0, 0.02))
    c = combine(e, policy, 0.05)
    assert c.source == dm.SOURCE_HW_ONLY and c.tau == 0.0 and c.difference == pytest.approx(1.0)  # lower loss wins
    assert c.verdict == "better"


# --------------------------------------------------------------------------- tau is fixed in advance
def test_tau_is_never_fitted_from_the_judged_runs():
    """Two validations with very different hardware (and one where the hardware contradicts the
    simulator) get the same τ: it comes from the fixed table, and no parameter can set it."""
    def evidence(hw_shift: float, hw_se: float, r: int) -> list[Evidence]:
        return [pair_evidence("a", "b", o, sim_candidate=[1.1, 1.0, 1.05], sim_reference=[1.0, 0.95, 1.0],
                              hw_candidate=[1.0 + hw_shift + 0.01 * k for k in range(r)],
                              hw_reference=[1.0 + 0.02 * k for k in range(r)], model_block_sd=hw_se, scale=1.0)
                for o in OBJ]
    taus = []
    for shift, se, rounds in ((0.0, 0.01, 1), (0.5, 0.3, 6), (-2.0, 0.001, 3)):
        d = decide(evidence(shift, se, rounds), {"a": 1.0, "b": 1.0}, POLICY)
        taus.append({c.objective: c.tau for c in d.comparisons})
        assert {o: m.tau for o, m in d.model_error.items()} == {o: MODEL_ERROR[o].tau for o in OBJ}
    assert taus[0] == taus[1] == taus[2]
    assert taus[0]["mix_efficiency"] == MODEL_ERROR["mix_efficiency"].tau
    for fn in (decide, combine, pair_evidence, decide_from_json):
        assert not any("tau" in p or "model_error" in p for p in inspect.signature(fn).parameters), fn


def test_tau_is_the_rms_of_the_fidelity_benchmarks_error_differences():
    """The provenance holds: recomputed from benchmarks/RESULTS.md's fidelity table (held-out configs)."""
    text = (ROOT / "benchmarks" / "RESULTS.md").read_text()
    table = text[text.index("| profile | config | metric | predicted | measured | error |"):]
    errors: dict[tuple[str, str], list[float]] = {}
    for line in table.splitlines()[2:]:
        if not line.startswith("|"):
            break
        prof, _, metric, _, _, err = [c.strip() for c in line.strip("|").split("|")][:6]
        if metric in OBJ:
            v = float(re.match(r"[-+]?[\d.]+", err).group())
            errors.setdefault((prof, metric), []).append(v / 100 if err.endswith("%") else v)
    for o in OBJ:
        diffs = [a - b for (p, m), (a, b) in errors.items() if m == o]
        assert len(diffs) == 2
        assert MODEL_ERROR[o].tau == pytest.approx(math.sqrt(sum(x * x for x in diffs) / len(diffs)), abs=1e-4)
        assert sorted(abs(x) for x in MODEL_ERROR[o].pair_errors) == pytest.approx(sorted(abs(x) for x in diffs))


# --------------------------------------------------------------------------- the level is split
@pytest.mark.parametrize(("looks", "k", "objectives"), [(1, 2, 1), (1, 3, 2), (4, 3, 2), (2, 5, 2)])
def test_the_level_is_split_over_looks_comparisons_and_objectives(looks, k, objectives):
    objs = OBJ[:objectives]
    policy = DecisionPolicy.from_config(DecisionConfig(), looks=looks, objectives=objs)
    names = [f"c{i}" for i in range(k)]
    ev = [hw_only(a, b, o, 0.0, 0.01) for a, b in combinations(names, 2) for o in objs]
    d = decide(ev, {n: 1.0 for n in names}, policy)
    alpha = 0.05 / (looks * k * (k - 1) // 2 * objectives)
    assert d.n_comparisons == k * (k - 1) // 2
    assert d.per_interval_level == pytest.approx(1 - alpha)
    half = stats.norm.ppf(1 - alpha / 2) * 0.01
    assert all(c.interval[1] - c.difference == pytest.approx(half) for c in d.comparisons)
    assert split_alpha(0.95, looks, k * (k - 1) // 2, objectives) == pytest.approx(alpha)


# --------------------------------------------------------------------------- hardware's spread
def test_paired_rounds_give_a_t_interval_and_few_rounds_the_simulators_spread():
    d, se, df, src, n = round_difference([1.0, 1.2, 0.9, 1.1, 1.0, 1.3], [0.9, 1.0, 1.0, 1.0, 0.8, 1.1])
    diffs = [0.1, 0.2, -0.1, 0.1, 0.2, 0.2]
    assert (df, src, n) == (5.0, dm.HW_SE_BLOCKS, 6)
    assert d == pytest.approx(sum(diffs) / 6) and se == pytest.approx(stats.tstd(diffs) / math.sqrt(6))
    d, se, df, src, n = round_difference([1.0, 1.2], [0.9, 1.0], model_block_sd=0.3)
    assert (se, df, src, n) == (pytest.approx(0.3 / math.sqrt(2)), math.inf, dm.HW_SE_MODEL, 2)
    assert round_difference([1.0], [0.9])[1] == math.inf  # neither: the hardware cannot speak yet


# --------------------------------------------------------------------------- JSON and sentences
def three_configs() -> list[Evidence]:
    sims = {"tuned-1": (266.0, 0.99), "baseline": (245.0, 0.92), "handpicked": (246.0, 0.99)}
    hws = {"tuned-1": (270.0, 1.01), "baseline": (240.0, 0.90), "handpicked": (250.0, 0.97)}
    out = []
    for a, b in combinations(sims, 2):
        for j, o in enumerate(OBJ):
            out.append(pair_evidence(a, b, o, sim_candidate=[sims[a][j] * (1 + 0.001 * s) for s in range(4)],
                                     sim_reference=[sims[b][j] * (1 - 0.001 * s) for s in range(4)],
                                     hw_candidate=[hws[a][j]], hw_reference=[hws[b][j]],
                                     model_block_sd=(16.0, 0.06)[j]))
    return out


PEAK = {"tuned-1": 482 * 2**20, "baseline": 101 * 2**20, "handpicked": 204 * 2**20}


def test_the_decision_rebuilds_from_its_json():
    d = decide(three_configs(), PEAK, POLICY)
    payload = json.loads(json.dumps(d.as_json(), allow_nan=False))
    assert decide_from_json(payload).as_json() == d.as_json()
    assert payload["inputs"]["policy"]["margins"]["mix_efficiency"] == DecisionConfig().margin_mix_efficiency
    assert {c["objective"] for c in payload["comparisons"]} == set(OBJ)
    assert all("gap_z" in c and "tau" in c and "power" in c for c in payload["comparisons"])


def test_a_decision_without_a_spread_still_rebuilds_from_strict_json():
    """One prediction seed (no seed spread) and no hardware round: infinities travel as null."""
    ev = [pair_evidence("a", "b", o, sim_candidate=[1.0], sim_reference=[0.9], hw_candidate=[], hw_reference=[])
          for o in OBJ]
    d = decide(ev, {"a": 1.0, "b": 2.0}, POLICY)
    payload = json.loads(json.dumps(d.as_json(), allow_nan=False))
    assert decide_from_json(payload).as_json() == d.as_json()
    assert d.outcome == "undecided"


def test_the_answer_is_two_sentences_that_name_the_choice_its_cost_its_source_and_the_pathology():
    d = decide(three_configs(), PEAK, POLICY)
    path = Pathology(BucketUse(64, 400, 0.62, "<=512"), BucketUse(9, 400, 0.44, "<=512"))
    first, second = answer_sentences(d, path, {"handpicked": "min-ready 30, max-depth 90"})
    assert d.chosen in first and "MiB" in first and first.endswith(".")
    assert d.outcome != "undecided" or "paired rounds" in first or d.rounds_needed is None
    assert "tau" in second and "0.0112" in second and "longest bucket streak 64" in second and "62%" in second
    assert d.source.split(" (")[0] in second
    assert answer_sentences(d, None)[1].endswith("was not measured.")


def test_an_undecided_answer_says_what_it_would_take():
    """The demo's shape: tuned-1 predicted 8% faster than handpicked, one round of hardware; with a 1%
    throughput margin nobody is certified within it."""
    policy = DecisionPolicy.from_config(DecisionConfig(margin_throughput=0.01), looks=1, objectives=OBJ)
    d = decide(three_configs(), PEAK, policy)
    assert d.outcome == "undecided" and set(d.survivors) == {"tuned-1", "handpicked"}
    assert d.chosen == "handpicked"  # the cheaper survivor: never a costlier one on unresolved evidence
    assert d.rounds_needed is not None and d.rounds_needed > 1
    first, second = answer_sentences(d, None)
    assert f"about {d.rounds_needed} paired rounds" in first
    assert "the simulator predicts tuned-1 +8" in first and "power at this budget" in first  # the power, stated
    assert second.startswith("Not resolved at 95% overall")


@pytest.mark.parametrize(("base_streak", "chosen_streak", "occurs"), [(64, 9, True), (9, 40, True), (31, 12, False)])
def test_the_pathology_is_a_whole_window_from_one_bucket(base_streak, chosen_streak, occurs):
    p = Pathology(BucketUse(base_streak, 400, 0.5, "<=512"), BucketUse(chosen_streak, 400, 0.3, "<=512"), window=32)
    assert p.occurs() is occurs
    d = decide(three_configs(), PEAK, POLICY)
    assert ("pathology (drafters pulling from one bucket for a whole window of 32 takes) "
            + ("occurs" if occurs else "does not occur")) in answer_sentences(d, p)[1]


# --------------------------------------------------------------------------- the first block: bias transfer
def test_without_a_first_block_the_transfer_reduces_to_the_precision_weighted_combination():
    """d0 := dss (the same estimate: se0 = se_sim, cov = se_sim^2): k·(d_hw - d0) is the old weighting."""
    for sim, hw, sim_se, hw_se in ((0.02, 0.05, 0.004, 0.03), (-0.1, 0.2, 0.02, 0.01), (0.0, 0.0, 0.001, 0.2)):
        e = both("a", "b", "mix_efficiency", sim, hw, sim_se=sim_se, hw_se=hw_se)
        e1 = dm.Evidence(**{**e.__dict__, "sim_first_diff": sim, "sim_first_se": sim_se, "sim_first_cov": sim_se ** 2})
        old, new = combine(e, POLICY, 0.01), combine(e1, POLICY, 0.01)
        assert new.difference == pytest.approx(old.difference) and new.se == pytest.approx(old.se)
        assert new.gap_z == pytest.approx(old.gap_z) and new.verdict == old.verdict
    # and through pair_evidence: the first block given as the steady-state values themselves
    kw = dict(sim_candidate=[1.0, 1.04, 0.98, 1.01], sim_reference=[0.95, 0.96, 0.97, 0.93], hw_candidate=[1.0],
              hw_reference=[0.9], model_block_sd=0.04)
    plain = combine(pair_evidence("a", "b", "mix_efficiency", **kw), POLICY, 0.01)
    same = combine(pair_evidence("a", "b", "mix_efficiency", sim_first_candidate=kw["sim_candidate"],
                                 sim_first_reference=kw["sim_reference"], **kw), POLICY, 0.01)
    assert same.difference == pytest.approx(plain.difference) and same.se == pytest.approx(plain.se)


def test_the_first_blocks_error_is_transferred_to_the_steady_state_prediction():
    """k = tau^2/(tau^2 + se_hw^2 + se0^2); estimate dss + k(d0_hw - d0_sim); variance se^2 + tau^2(1 - k)."""
    tau = MODEL_ERROR["mix_efficiency"].tau
    e = Evidence("a", "b", "mix_efficiency", 0.0, 0.003, 0.06, 0.02, math.inf, dm.HW_SE_MODEL, 1, 1.0,
                 sim_first_diff=0.08, sim_first_se=0.004, sim_first_cov=0.0)
    c = combine(e, POLICY, 0.01)
    v = tau ** 2 + 0.02 ** 2 + 0.004 ** 2
    k = tau ** 2 / v
    assert c.difference == pytest.approx(0.0 + k * (0.06 - 0.08))  # the transient's +0.08 is not the steady state's
    assert c.se == pytest.approx(math.sqrt(0.003 ** 2 + tau ** 2 * (1 - k)))
    assert c.gap_z == pytest.approx((0.08 - 0.06) / math.sqrt(v))
    payload = json.loads(json.dumps(decide([e], {"a": 1.0, "b": 1.0}, POLICY).as_json(), allow_nan=False))
    assert payload["inputs"]["evidence"][0]["sim_first_diff"] == 0.08
    assert decide_from_json(payload).comparisons[0].difference == pytest.approx(c.difference)


# --------------------------------------------------------------------------- certification and global refutation
@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.floats(-0.15, 0.15), st.floats(0.001, 0.05)), min_size=6, max_size=6))
def test_a_configuration_is_chosen_only_when_every_lower_bound_clears_minus_the_margin(draws):
    names = ("a", "b", "c")
    ev = [hw_only(x, y, o, d, se) for (x, y), o, (d, se) in
          zip([p for p in combinations(names, 2) for _ in OBJ], OBJ * 3, draws, strict=True)]
    d = decide(ev, {"a": 1.0, "b": 2.0, "c": 3.0}, POLICY)

    def lower(x: str, y: str, o: str) -> tuple[float, float]:
        c = next(c for c in d.comparisons if {c.candidate, c.reference} == {x, y} and c.objective == o)
        return (c.interval[0] if c.candidate == x else -c.interval[1]), c.margin

    def certified(x: str) -> bool:
        return all(lower(x, y, o)[0] > -lower(x, y, o)[1] for y in names if y != x for o in OBJ)

    good = [n for n in names if certified(n)]
    assert (d.outcome == "undecided") == (not good)
    if good:
        assert set(d.survivors) == set(good) and d.chosen == min(good, key={"a": 1.0, "b": 2.0, "c": 3.0}.get)
        assert d.outcome == ("decided" if len(good) == 1 else "equivalent")


def test_one_gap_beyond_z_refute_refutes_the_simulator_for_every_comparison():
    ev = three_configs()
    d = decide(ev, PEAK, POLICY)
    assert not d.simulator_refuted and any(c.sim_weight > 0 for c in d.comparisons)
    # the measured tuned-1 - baseline throughput contradicts the simulator on one comparison only
    bad = [e if (e.candidate, e.reference, e.objective) != ("tuned-1", "baseline", OBJ[0]) else
           Evidence(**{**e.__dict__, "hw_diff": -200.0}) for e in ev]
    d = decide(bad, PEAK, POLICY)
    assert d.simulator_refuted and sum(abs(c.gap_z) > POLICY.z_refute for c in d.comparisons) == 1
    for c in d.comparisons:  # every comparison, not only the refuted one, is the hardware's alone
        assert (c.difference, c.se, c.sim_weight) == (c.hw, c.evidence.hw_se, 0.0)
        assert c.source.startswith(dm.SOURCE_HW_REFUTED[:-1])
    assert d.source.startswith(dm.SOURCE_HW_REFUTED[:-1]) and "1 of 6 gaps" in d.source
    payload = json.loads(json.dumps(d.as_json(), allow_nan=False))
    assert payload["simulator_refuted"] is True
    kept = [c["verdict_per_comparison"] for c in payload["comparisons"]]
    assert kept != [c["verdict"] for c in payload["comparisons"]]  # the per-comparison verdicts stay for the table
    assert decide_from_json(payload).as_json() == d.as_json()
