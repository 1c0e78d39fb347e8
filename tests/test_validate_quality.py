"""Held-out quality as an objective of validation (issue #27 item 2): the decision rule.

Held-out tau (higher is better) and held-out loss (lower is better) are compared with the resolve
rule of every other objective (0 outside the interval of the difference) and can decide the
recommendation, which then names them. The real runs behind it: tests/test_validate_held.py (a
held validation with ``[train] quality_every``) and the slow end-to-end test at the bottom.
"""

from __future__ import annotations

import math

import pytest

from tests.test_resume_and_control import run_inputs  # noqa: F401 - the fixture (slow test only)
from tuning.validation.evidence import Estimate, compare_estimates, heldout_comparisons, recommend, resolved
from tuning.validation.metrics import block_table
from tuning.validation.quality import common_step, estimates
from tuning.validation.recommendation import evidence_of


def _rows(tput: dict[str, list[float]], peak: dict[str, float]) -> list[dict]:
    return [{"name": n, "block": k, "throughput_tokens_per_s": v, "mix_efficiency": 0.8 + 0.001 * k,
             "peak_queue_bytes": peak[n]} for n, vs in tput.items() for k, v in enumerate(vs)]


def _est(value: float, half: float, n: int = 48) -> Estimate:
    return Estimate(value, (value - half, value + half), n)


@pytest.mark.parametrize(("a", "b", "clear"), [
    (_est(1.30, 0.02), _est(1.20, 0.02), True),  # 0.10 apart, half-widths 0.02: resolved
    (_est(1.22, 0.02), _est(1.20, 0.02), False),  # 0.02 apart: the combined interval holds 0
    (_est(1.20, 0.0), _est(1.20, 0.0), False),  # no difference at all
])
def test_a_held_out_difference_resolves_by_the_one_rule(a: Estimate, b: Estimate, clear: bool) -> None:
    c = compare_estimates("tuned-1", "baseline", "heldout_tau", a, b)
    lo, hi = c.ci95
    assert c.resolved == clear == resolved(lo, hi) and lo <= c.difference <= hi
    assert math.isclose(c.difference, a.value - b.value) and c.blocks == (48, 48)
    # two intervals of half-width h combine into one of about h * sqrt(2): wider than either, never narrower
    assert hi - c.difference >= max(a.ci95[1] - a.value, b.ci95[1] - b.value) - 1e-12


def test_held_out_tau_decides_when_throughput_cannot() -> None:
    """Equal throughput within the noise; baseline holds the least queue memory, so it would win on
    memory alone; but its held-out tau is resolved worse, so tuned-1 is recommended, named as decided
    by held-out tau."""
    blocks = block_table(_rows({"baseline": [100, 120, 90, 110], "tuned-1": [105, 115, 95, 112]},
                               {"baseline": 1e6, "tuned-1": 4e6}))
    off = evidence_of(blocks, looks=4, block_takes=10)[2]
    assert off is not None and off.name == "baseline" and off.decided_by == ()
    assert "Decided by peak queue memory alone" in off.words and "heldout_tau" not in off.objectives
    held = {"baseline": {"heldout_tau": _est(1.20, 0.02), "heldout_loss": _est(4.00, 0.05)},
            "tuned-1": {"heldout_tau": _est(1.35, 0.02), "heldout_loss": _est(3.98, 0.05)}}
    chosen, comps, rec = evidence_of(blocks, looks=4, block_takes=10, heldout=held)
    assert chosen == "tuned-1" and rec is not None and rec.name == "tuned-1"
    assert rec.objectives == ("throughput_tokens_per_s", "mix_efficiency", "heldout_tau", "heldout_loss")
    assert rec.decided_by == ("heldout_tau",) and rec.candidates == ("tuned-1",)
    assert "Decided by held-out tau (baseline resolved worse)" in rec.words
    assert rec.as_json()["decided_by"] == ["heldout_tau"]
    by = {c.objective: c for c in comps}
    assert by["heldout_tau"].resolved and by["heldout_tau"].difference > 0
    assert not by["heldout_loss"].resolved  # 0.02 apart with half-widths 0.05: not resolved


def test_lower_held_out_loss_is_better() -> None:
    blocks = block_table(_rows({"baseline": [100, 101, 99], "tuned-1": [100, 99, 101]},
                               {"baseline": 1e6, "tuned-1": 2e6}))
    held = {"baseline": {"heldout_tau": _est(1.2, 0.05), "heldout_loss": _est(3.0, 0.02)},
            "tuned-1": {"heldout_tau": _est(1.2, 0.05), "heldout_loss": _est(3.5, 0.02)}}
    rec = recommend(blocks, {"baseline": 1e6, "tuned-1": 2e6}, max_looks=3, block_takes=10, heldout=held)
    assert rec.name == "baseline" and rec.decided_by == ("heldout_loss",)
    worse = next(c for c in rec.against_best if c.objective == "heldout_loss")
    assert worse.config == "tuned-1" and worse.against == "baseline" and worse.resolved and worse.difference > 0


def test_a_configuration_without_a_held_out_score_leaves_the_held_out_objectives_out() -> None:
    blocks = block_table(_rows({"baseline": [100, 101, 99], "tuned-1": [100, 99, 101]},
                               {"baseline": 1e6, "tuned-1": 2e6}))
    held = {"tuned-1": {"heldout_tau": _est(1.5, 0.01), "heldout_loss": _est(3.0, 0.01)}}
    _, comps, rec = evidence_of(blocks, looks=3, block_takes=10, heldout=held)
    assert rec is not None and "heldout_tau" not in rec.objectives
    assert all(c.objective not in ("heldout_tau", "heldout_loss") for c in comps)
    assert heldout_comparisons(held, "tuned-1") == []  # no reference scored


def test_the_compared_step_is_the_last_every_configuration_scored() -> None:
    assert common_step({"a": {7: 0, 15: 0, 23: 0}, "b": {7: 0, 15: 0}}) == 15
    assert common_step({"a": {7: 0}, "b": {15: 0}}) is None


def test_a_held_out_object_gives_tau_and_loss_estimates() -> None:
    h = {"tau": 1.3, "tau_ci": [1.25, 1.36], "loss": 4.1, "loss_ci": [4.0, 4.2], "sequences": 9,
         "acceptance": 1.5, "acceptance_ci": [1.4, 1.6]}
    got = estimates(h)
    assert got["heldout_tau"] == Estimate(1.3, (1.25, 1.36), 9) and got["heldout_loss"].value == 4.1
    assert estimates({**h, "tau": None, "tau_ci": None}).keys() == {"heldout_loss"}  # a bucket without blocks


def test_the_off_note_is_said_once() -> None:
    from tuning.validation.quality import OFF_NOTE
    from tuning.validation.summary import heldout_lines

    assert heldout_lines({"on": False, "note": OFF_NOTE, "step": None, "configs": {}}) == [OFF_NOTE]
    assert "[train] quality_every" in OFF_NOTE


@pytest.mark.slow
def test_dflash_validate_compares_held_out_quality_end_to_end(tmp_path, run_inputs, capsys) -> None:  # noqa: F811
    """A real validation (tiny Llama, two configurations, one round) with ``[train] quality_every``:
    two training seeds per configuration by default (issue #36), the held-out metric compared paired
    among the objectives, in the CLI summary and in the report, which say paired and the seeds."""
    import json

    from dflash.cli import main
    from tests.test_resume_and_control import write_cfg

    cfg = write_cfg(tmp_path / "cfg.toml", run_inputs, log_every=1000, checkpoint_every=1000, quality_every=4,
                    quality_per_bucket=3, quality_anchors=8, eval_prompts=1, eval_new_tokens=8)
    sel = tmp_path / "sel.json"
    sel.write_text(json.dumps({"configs": [
        {"name": "baseline", "queue": {"min_ready": 3, "max_depth": 6, "policy": "random_item"}},
        {"name": "tuned-1", "queue": {"min_ready": 2, "max_depth": 4, "policy": "fullest"}}]}))
    val = tmp_path / "val"
    assert main(["validate", "--config", str(cfg), "--selection", str(sel), "--takes", "4", "--block-takes", "4",
                 "--out", str(val)]) == 0
    cli = capsys.readouterr().out
    payload = json.loads((val / "validation.json").read_text())
    assert {"heldout_tau", "heldout_loss"} <= set(payload["objectives"])
    assert payload["heldout"]["on"] and payload["heldout"]["same_set"] and payload["heldout"]["step"] == 3
    assert payload["heldout"]["seeds"] == {"baseline": 2, "tuned-1": 2} and payload["heldout"]["method"] == "paired"
    runs = sorted(p.name for p in (val / "runs").iterdir())
    assert runs == ["baseline", "baseline@seed4", "tuned-1", "tuned-1@seed4"]
    held = [c for c in payload["comparisons"] if c["objective"].startswith("heldout_")]
    assert {(c["config"], c["against"], c["objective"]) for c in held} == {
        ("tuned-1", "baseline", "heldout_tau"), ("tuned-1", "baseline", "heldout_loss")}
    for c in held:
        lo, hi = c["ci95"]
        assert c["paired"] and c["seeds"] == [2, 2]
        assert c["resolved"] == (not lo <= 0 <= hi)
        verdict = "resolved" if c["resolved"] else "NOT resolved"
        assert f"tuned-1 vs baseline on {c['objective']}: {c['difference']:+.4g} (95% interval {lo:+.4g} .. " \
               f"{hi:+.4g}): {verdict}" in cli
    rec = payload["recommendation"]
    assert rec["objectives"] == payload["objectives"] and "Decided by" in rec["words"]
    assert set(rec["decided_by"]) <= set(payload["objectives"])
    assert "held-out (" in cli and "after step 4" in cli and "quality_every = N" not in cli
    assert "baseline - tuned-1, held-out loss: " in cli and "(paired over " in cli and "seeds 2/2" in cli
    for name in ("baseline", "tuned-1"):
        assert f"  {name}: tau " in cli
    assert main(["report", str(val), "--out", str(tmp_path / "report")]) == 0
    md = (tmp_path / "report" / "report.md").read_text()
    assert "held-out tau and loss compared once, after step 4" in md
    assert "paired over the same" in md and "with 2 training seed(s) per configuration" in md
    assert "| held-out tau | held-out loss |" in md  # the recommendation's side-by-side table
    assert (tmp_path / "report" / "figures" / "heldout.png").is_file()
