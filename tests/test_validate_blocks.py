"""Sequential validation's plan and decisions: blocks alternate ABCABC, a block waits for its round,
the look count is fixed before the first block, and the recommendation follows the evidence."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from dflash.core.config import DflashConfig, with_overrides
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


def test_a_costlier_config_is_not_recommended_on_unresolved_evidence() -> None:
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
    (["done", "skipped"], [True, True], "decided"),  # the decision was an answer at an earlier look
    (["done", "skipped"], [False, False], "decided"),  # ... whatever the hardware alone resolved
    (["done", "done"], [True, True], "resolved"),  # resolved at the last look
    (["done", "done"], [True, False], "budget"),
    (["done", "failed", "skipped"], [True, True], "failed"),  # skipped because a config failed
    (["done"], [], "budget"),  # nothing to compare
])
def test_the_stop_reason_follows_the_evidence(statuses: list, resolved: list, reason: str) -> None:
    from tuning.validation.evidence import Comparison

    comps = [Comparison("t", "baseline", "throughput_tokens_per_s", 1.0, (0.5, 1.5) if ok else (-1.0, 2.0),
                        ok, 0.1, (2, 2)) for ok in resolved]
    assert stop_reason([{"status": s} for s in statuses], comps) == reason


# --------------------------------------------------------------------------- like with like (issue #32 item 1)
def _sim_run(tmp_path: Path, window: int, steps: int = 60):
    from simulator.run import simulate
    from simulator.workload import make_sampler
    from tests.test_drift import machine

    cfg = with_overrides(machine(1.0), {"metrics.window": window, "seed": 5})
    sampler = make_sampler(cfg.workload, seed=cfg.seed, block_size=cfg.drafter.block_size)
    res = simulate(cfg, sampler, sim_seconds=1e9, max_steps=steps, records_dir=tmp_path / "run")
    return cfg, sampler, res


def test_a_hardware_block_and_a_simulated_block_are_one_computation_with_the_configured_window(tmp_path: Path) -> None:
    """A block of 24 takes with W = 16 holds 1.5 windows: it is measured with W (one window), never with a
    window shrunk to the block (min(W, takes // 2) = 12 made the hardware's metric another statistic than
    the prediction's). The run-directory path (hardware) and the in-memory path (prediction) agree."""
    from dflash.core.mixmetrics import mix_metrics
    from tuning.validation.metrics import block_metrics, records_block_metrics

    cfg, sampler, res = _sim_run(tmp_path, window=16)
    hw = block_metrics(tmp_path / "run", cfg, 20, 44)
    sim = records_block_metrics(res.produce, res.take, cfg, p=sampler.item_mix(), n_buckets=sampler.n_buckets,
                                first_step=20, upto_step=44)
    assert hw["mix_window"] == sim["mix_window"] == 16 and hw["takes"] == sim["takes"] == 24
    assert hw == pytest.approx(sim, nan_ok=True)
    block = sorted((t for t in res.take if 20 <= t["step"] < 44 and t["t"] >= hw["t_start"]), key=lambda t: t["t"])
    buckets = [t["bucket"] for t in block for _ in t["item_ids"]]
    assert hw["mix_efficiency"] == pytest.approx(mix_metrics(buckets, [1.0] * len(buckets), buckets,
                                                             sampler.item_mix(), 16).mix_efficiency)
    shrunk = mix_metrics(buckets, [1.0] * len(buckets), buckets, sampler.item_mix(), 12).mix_efficiency
    assert hw["mix_efficiency"] != pytest.approx(shrunk)  # the old statistic is another number here


@pytest.mark.parametrize("seed, per_trial", [(0, 3), (3, 64), (2**31 - 5, 2)])
def test_prediction_seeds_are_disjoint_from_the_sweeps(seed: int, per_trial: int) -> None:
    from tuning.evaluate import sweep_seeds
    from tuning.validation.predict import PREDICTION_SEEDS, prediction_seeds

    cfg = with_overrides(DflashConfig(), {"seed": seed, "sweep.seeds_per_trial": per_trial})
    pred = prediction_seeds(cfg)
    assert len(set(pred)) == PREDICTION_SEEDS and pred == prediction_seeds(cfg)  # fixed by the config
    assert not set(pred) & set(sweep_seeds(cfg)) and not set(pred) & set(range(seed, seed + 64))
    assert all(0 <= s < 2**31 for s in pred)


def test_the_prediction_measures_the_hardwares_blocks_on_its_own_seeds(tmp_path: Path) -> None:
    """predict(blocks=...) cuts each seed's simulated run into the same step ranges, keeps the same blocks,
    and gives the block-to-block spread the decision may use as the hardware's variance."""
    from tuning.evaluate import sweep_seeds
    from tuning.validation.predict import paired_block_sd, predict, prediction_seeds

    cfg, _, _ = _sim_run(tmp_path, window=8, steps=10)
    spans, kept = [(0, 20), (20, 40), (40, 60)], [1, 2]
    a = predict({"queue": {"min_ready": 4, "max_depth": 12}}, cfg, 60, tmp_path / "a", blocks=spans, kept=kept)
    b = predict({"queue": {"min_ready": 2, "max_depth": 4}}, cfg, 60, tmp_path / "b", blocks=spans, kept=kept)
    assert a["seeds"] == b["seeds"] == list(prediction_seeds(cfg)) and not set(a["seeds"]) & set(sweep_seeds(cfg))
    assert a["kept_blocks"] == kept
    m = a["mix_efficiency"]
    assert [len(v) for v in a["blocks"]["mix_efficiency"]] == [2, 2, 2] and len(m["per_seed"]) == 3
    assert m["mean"] == pytest.approx(sum(m["per_seed"]) / 3) and m["sd_block"] > 0
    assert paired_block_sd(a, b, "mix_efficiency") > 0 and paired_block_sd(a, {}, "mix_efficiency") is None
    one, flat = {"blocks": {"m": [[0.9], [0.8], [1.0]]}}, {"blocks": {"m": [[0.7], [0.7], [0.7]]}}
    assert paired_block_sd(one, flat, "m") == pytest.approx(0.1)  # one kept block per seed: spread over seeds


@pytest.mark.parametrize("overrides, takes, requested, block", [
    ({}, 300, None, 64),  # length_grouped, mega_batch 64, W 32: one mega-batch holds two windows
    ({"metrics.window": 100}, 300, None, 128),  # whole mega-batches holding one window of 100
    ({"workload.order": "random"}, 300, None, 32),  # no phase: one window
    ({"queue.items_per_take": 2}, 300, None, 32),  # 64 items at 2 per take
    ({}, 40, None, 40),  # the budget is shorter than one block: one block
    ({}, 300, 10, 10),  # given: as given, the rule's figure said
])
def test_the_block_length_rule(overrides: dict, takes: int, requested: int | None, block: int) -> None:
    from tuning.validation.plan import block_rule

    got, why = block_rule(with_overrides(DflashConfig(), overrides), takes, requested)
    assert got == block and why
    if requested is not None:
        assert "given" in why and "64 takes" in why


def test_the_decision_gets_every_pair_and_objective_from_validation(tmp_path: Path) -> None:
    from tuning.validation.recommendation import decide_validation

    def pred(level: float) -> dict:
        seeds = [[level + 0.01 * s + 0.02 * k for k in range(2)] for s in range(3)]
        return {"mix_efficiency": {"per_seed": [sum(v) / 2 for v in seeds]},
                "throughput_tokens_per_s": {"per_seed": [1000 * level + s for s in range(3)]},
                "blocks": {"mix_efficiency": seeds, "throughput_tokens_per_s": [[1000 * level] * 2] * 3}}

    levels = {"baseline": 0.80, "tuned-1": 1.00, "handpicked": 0.95}
    configs = [{"name": n, "kept_blocks": [1, 2], "predicted": pred(v)} for n, v in levels.items()]
    rows = {n: [{"name": n, "block": k, "mix_efficiency": v + 0.01 * k, "throughput_tokens_per_s": 1000 * v + k}
                for k in range(3)] for n, v in levels.items()}
    d = decide_validation(DflashConfig().decision, 1, configs, rows, {}, {"baseline": 1e6, "tuned-1": 2e6,
                                                                          "handpicked": 3e6})
    assert d is not None and len(d.comparisons) == 3 * 2  # three pairs x two objectives
    assert all(c.evidence.hw_rounds == 2 for c in d.comparisons)  # block 0 dropped, rounds paired
    assert {c.evidence.hw_se_source for c in d.comparisons} == {"simulator's block-to-block variance"}
    rebuilt = d.as_json()["inputs"]["evidence"]
    assert len(rebuilt) == 6 and all(e["sim_diff"] is not None for e in rebuilt)


def test_with_one_block_the_prediction_continues_into_the_steady_state_and_the_decision_transfers(
        tmp_path: Path) -> None:
    """One round: the hardware measured only the first block (the transient). The prediction of that
    block stays like with like, and the same seeds run on for STEADY_BLOCKS more blocks (``steady``);
    the decision gets the steady state as the prediction and the first block as the first-block one."""
    from tuning.validation.predict import FIRST_BLOCK_SEEDS, STEADY_BLOCKS, predict, prediction_seeds
    from tuning.validation.recommendation import decide_validation

    cfg, _, _ = _sim_run(tmp_path, window=8, steps=10)
    queues = {"tuned-1": {"min_ready": 4, "max_depth": 12}, "baseline": {"min_ready": 2, "max_depth": 4}}
    preds = {n: predict({"queue": q}, cfg, 20, tmp_path / n, blocks=[(0, 20)], kept=[0]) for n, q in queues.items()}
    a = preds["tuned-1"]
    assert a["seeds"] == list(prediction_seeds(cfg, FIRST_BLOCK_SEEDS))[:len(a["seeds"])] and len(a["seeds"]) == 8
    assert STEADY_BLOCKS >= 2 and len(a["steady"]["mix_efficiency"]["per_seed"]) == len(a["seeds"])
    assert a["steady"]["mix_efficiency"]["per_seed"] != a["mix_efficiency"]["per_seed"]  # another span
    configs = [{"name": n, "kept_blocks": [0], "predicted": p} for n, p in preds.items()]
    rows = {n: [{"name": n, "block": 0, "mix_efficiency": p["mix_efficiency"]["mean"],
                 "throughput_tokens_per_s": p["throughput_tokens_per_s"]["mean"]}] for n, p in preds.items()}
    d = decide_validation(DflashConfig().decision, 1, configs, rows, {}, {"tuned-1": 2e6, "baseline": 1e6})
    for c in d.comparisons:
        o, e = c.objective, c.evidence
        steady = [x - y for x, y in zip(preds["tuned-1"]["steady"][o]["per_seed"],
                                        preds["baseline"]["steady"][o]["per_seed"], strict=True)]
        first = [x - y for x, y in zip(preds["tuned-1"][o]["per_seed"], preds["baseline"][o]["per_seed"], strict=True)]
        assert e.sim_diff == pytest.approx(sum(steady) / len(steady))
        assert e.sim_first_diff == pytest.approx(sum(first) / len(first))


def test_zero_tau_prompts_load_no_drafter_and_say_why_tau_is_missing(tmp_path):
    """dflash demo validates with 0 tau prompts: nothing is loaded or decoded (no run directory, no
    target is needed) and the row says why its tau is missing."""
    from dflash.core.config import DflashConfig
    from tuning.validation.acceptance import final_tau

    tau = final_tau(DflashConfig(), tmp_path / "no-such-run", None, 0)
    assert tau["tau"] is None and tau["num_prompts"] == 0 and "0 prompts" in tau["why_missing"]


# --------------------------------------------------------------------------- the look after a round (early stop)
def _look_setup(tmp_path: Path):
    from tests.test_drift import machine

    base = with_overrides(machine(1.0), {"metrics.window": 8, "workload.mega_batch": 16})
    # Simulated steady state: tuned-1 about as fast (+2%), mixing far better (+0.21, four margins)
    sel = {"configs": [{"name": "baseline", "queue": {"min_ready": 4, "max_depth": 12, "policy": "fullest"}},
                       {"name": "tuned-1", "queue": {"min_ready": 8, "max_depth": 40, "policy": "random_item"}}]}
    args = ValidateArgs(selection=sel, selection_path="sel.json", takes=48, out=tmp_path, calibration=None,
                        claims_url="sqlite://", prompts=0, block_takes=16)
    return base, args


def _measured_as_predicted(base, args, shift: float = 0.0) -> list[dict]:
    """Block 0 of each configuration measured exactly as the simulator predicts it (tuned-1's mix shifted)."""
    from tuning.validation.summary import predicted_blocks

    rows = []
    for entry in args.selection["configs"]:
        stub = [{"name": entry["name"], "block": 0, "steps": block_steps(base, args, 0)[0]}]
        p = predicted_blocks(entry, stub, base, base, args)[3]
        first = {o: sum(p[o]["per_seed"]) / len(p[o]["per_seed"]) for o in ("throughput_tokens_per_s",
                                                                             "mix_efficiency")}
        rows.append({**stub[0], "throughput_tokens_per_s": first["throughput_tokens_per_s"],
                     "mix_efficiency": first["mix_efficiency"] + (shift if entry["name"] == "tuned-1" else 0.0),
                     "peak_queue_bytes": 1e6 if entry["name"] == "baseline" else 4e6})
    return rows


@pytest.mark.slow  # ~7 s a case: the simulator predicts both configurations (8 seeds, steady blocks)
@pytest.mark.parametrize(("shift", "stops"), [(0.0, True), (-0.6, False)])
def test_the_look_after_a_round_stops_only_on_the_decision_the_summary_would_make(tmp_path, shift, stops):
    """Issue #32: the early stop asks the decision (simulator and hardware together, level split over the
    looks), not the hardware's Welch test: a round that agrees with a simulator predicting a large mix gap
    is an answer, one that refutes the simulator leaves one round of hardware alone: keep measuring."""
    from tuning.validation.job import interim_decision

    base, args = _look_setup(tmp_path)
    looks = max_looks(args.takes, args.block_takes)
    decision = interim_decision(base, base, args, _measured_as_predicted(base, args, shift), looks)
    assert decision is not None and (decision.outcome in ("decided", "equivalent")) is stops, decision.as_json()
    assert interim_decision(base, base, args, _measured_as_predicted(base, args)[:1], looks) is None
