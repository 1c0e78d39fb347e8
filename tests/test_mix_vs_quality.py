"""benchmarks/mix_vs_quality.py, the seed's experiment as a benchmark (issue #27 item 3): its flags, how it
compares configurations at equal steps (intervals disjoint or "no difference resolved"), the exact
``mix-vs-quality:`` line and its place in RESULTS.md; the slow test runs the whole thing, tiny, through the
real sweep and rank jobs."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import load_script

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "mix_vs_quality.py"
LINE = re.compile(r"^mix-vs-quality: (?:[^;]+ loss \d+\.\d{3} \[\d+\.\d{3}, \d+\.\d{3}\] acc \d+\.\d{3} "
                  r"\[\d+\.\d{3}, \d+\.\d{3}\]; )+\d+ steps, \d+ min, python benchmarks/mix_vs_quality\.py.*$")


def load():
    return load_script(SCRIPT)


@pytest.mark.parametrize("argv, flag", [
    (["--profile", "tpu"], "--profile"),
    (["--steps", "1"], "--steps"),
    (["--steps", "many"], "--steps"),
    (["--minutes", "0"], "--minutes"),
    (["--steps", "10", "--quality-every", "11"], "--quality-every"),
    (["--quality-per-bucket", "0"], "--quality-per-bucket"),
    (["--trials", "0"], "--trials"),
    (["--seeds", "0"], "--seeds"),
    (["--config", "/no/such.toml"], "--config"),
    (["--bogus"], "--bogus"),
])
def test_bad_flags_are_one_line_naming_the_flag_with_exit_status_2_and_nothing_written(argv, flag, capsys, tmp_path):
    before = (ROOT / "benchmarks" / "RESULTS.md").read_text()
    assert load().main([*argv, "--out", str(tmp_path / "w")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and flag in err and "Traceback" not in err
    assert not (tmp_path / "w").exists() and (ROOT / "benchmarks" / "RESULTS.md").read_text() == before


def test_the_profiles_fit_their_boxes_and_score_the_final_step():
    m = load()
    cpu, gpu = m.parse_args([]), m.parse_args(["--profile", "gpu"])
    assert cpu.minutes == 60 and cpu.steps % cpu.quality_every == 0  # the last step is scored: equal steps
    assert gpu.base.name == "gpu-smollm2-learning.toml" and gpu.steps % gpu.quality_every == 0
    assert m.parse_args(["--steps", "30", "--minutes", "5"]).quality_every == 15  # the profile's 2 scores


def _h(acc, lo, hi, loss=3.0):
    return {"acceptance": acc, "acceptance_ci": [lo, hi], "loss": loss, "loss_ci": [loss - 0.1, loss + 0.1],
            "sequences": 80, "blocks": 2560,
            "per_bucket": [{"bucket": 0, "sequences": 16, "blocks": 512, "loss": loss, "loss_ci": [2.9, 3.1],
                            "acceptance": acc, "acceptance_ci": [lo, hi]}]}


def test_configurations_are_compared_at_the_last_step_every_run_scored():
    m = load()
    assert m.common_step([{49: {}, 99: {}, 149: {}}, {49: {}, 99: {}}, {49: {}, 99: {}, 149: {}}]) == 99
    assert m.common_step([{49: {}}, {}]) is None


def test_a_difference_resolves_only_when_the_intervals_are_disjoint(tmp_path):
    m = load()
    rows = [m.row_of(name, tmp_path, 9, {9: h}) for name, h in (
        ("fullest 10/30", _h(1.10, 1.08, 1.12, loss=4.0)), ("random_item 10/30", _h(1.16, 1.14, 1.18, loss=3.5)),
        ("random_item 30/90", _h(1.15, 1.11, 1.19, loss=3.45)))]
    # 30/90's interval [1.11, 1.19] overlaps fullest's [1.08, 1.12]: a larger mean alone does not resolve
    assert m.verdicts(rows, "acceptance") == ["random_item 10/30 > fullest 10/30 (by 0.060)"]
    assert "acceptance: random_item 10/30 > fullest 10/30" in m.summarise(rows)
    close = [m.row_of("a", tmp_path, 9, {9: _h(1.10, 1.05, 1.15)}),
             m.row_of("b", tmp_path, 9, {9: _h(1.12, 1.07, 1.17)})]
    assert m.summarise(close).startswith("acceptance: no difference resolved (acceptance half-widths 0.050-0.050)")


def test_the_line_has_the_issues_form_and_replaces_its_own_block_in_results(tmp_path):
    m = load()
    rows = [m.row_of(n, tmp_path, 239, {239: _h(1.1 + k / 100, 1.05, 1.2)}) for k, n in enumerate(
        ("fullest 10/30", "random_item 10/30", "random_item 30/90", "sweep pick random_item 47/200 hysteresis"))]
    line = m.result_line(rows, 240, 47.4, "python benchmarks/mix_vs_quality.py --steps 240")
    assert LINE.match(line), line
    assert line.endswith("; 240 steps, 47 min, python benchmarks/mix_vs_quality.py --steps 240")
    results = tmp_path / "RESULTS.md"
    results.write_text("# Benchmark results\n\n## Earlier\n\nkeep me\n\n## Later\n\nme too\n")
    m.record(line, "acceptance: no difference resolved", rows, "cpu", results)
    m.record(line.replace("240 steps", "480 steps"), "acceptance: x > y", rows, "gpu", results)
    m.record(line.replace("240 steps", "300 steps"), "acceptance: no difference resolved", rows, "cpu", results)
    text = results.read_text()
    assert "keep me" in text and "me too" in text and text.count(m.SECTION) == 1
    assert [ln for ln in text.splitlines() if ln.startswith("mix-vs-quality: ")] == [
        line.replace("240 steps", "300 steps"), line.replace("240 steps", "480 steps")]  # cpu replaced in place
    assert "b0 1.100 [1.050, 1.200]" in text and "Resolved (95% interval of the paired difference excludes 0" in text


def test_the_verdict_is_the_paired_comparisons_and_bounds_what_did_not_resolve():
    m = load()
    pair = {"config": "a", "against": "b", "objective": "heldout_tau", "difference": 0.04, "ci95": [0.01, 0.07],
            "seeds": [2, 2], "sequences": 60, "claim": True, "width_ratio": 0.7}
    open_ = {**pair, "against": "c", "difference": 0.01, "ci95": [-0.02, 0.04], "width_ratio": 0.6}
    got = m.paired_verdict([pair, open_])
    assert got.startswith("paired over 60 sequences, 2 seed(s) per configuration: held-out tau: a - b +0.040")
    assert "resolved, paired/independent width over sequences 0.60-0.70" in got
    assert "no difference resolved (largest half-width 0.030" in m.paired_verdict([open_])
    assert "one seed: over sequences only, no quality claim" in m.paired_verdict([{**open_, "claim": False}])


@pytest.mark.slow
def test_the_benchmark_runs_the_sweep_and_four_real_rank_jobs_on_one_heldout_set(tmp_path):
    """Tiny (4 steps, 1 held-out sequence per bucket): the sweep really picks the fourth configuration, every
    run's step records carry ``heldout`` at the compared step, the held-out ids agree, the line prints."""
    out = tmp_path / "w"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--steps", "4", "--quality-every", "2",
                           "--quality-per-bucket", "1", "--trials", "2", "--seeds", "1", "--no-record", "--out",
                           str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("mix-vs-quality: ")]
    assert len(lines) == 1 and LINE.match(lines[0]) and " 4 steps, " in lines[0]
    res = json.loads((out / "mix_vs_quality.json").read_text())
    sel = json.loads((out / "sweep" / "selection.json").read_text())
    pick = next(c for c in sel["configs"] if c["name"] == "tuned-1")["queue"]
    assert res["sweep_pick"]["queue"]["min_ready"] == pick["min_ready"] and res["rows"][3]["config"].startswith(
        f"sweep pick {pick['policy']} {pick['min_ready']}/{pick['max_depth']}")
    assert [r["config"] for r in res["rows"][:3]] == ["fullest 10/30", "random_item 10/30", "random_item 30/90"]
    for r in res["rows"]:
        cfg = json.loads((Path(r["run"]) / "config.json").read_text())
        assert cfg["train"]["quality_every"] == 2 and r["step"] == 3
        assert r["acceptance"] >= 1.0 and r["acceptance_ci"][0] <= r["acceptance"] <= r["acceptance_ci"][1]
        assert r["per_bucket"] and "loss_roughness" in r and "mix_efficiency" in r
    assert "resolved: paired over " in proc.stdout and "per configuration, acceptance: " in proc.stdout
    assert res["seeds"] == 1 and res["pairs"] and all(p["seeds"] == [1, 1] for p in res["pairs"])
    # Again in the same work directory, one run cut short: the sweep's pick and the finished runs are reused,
    # the cut run is kept aside and trained again, and the comparison is the same.
    cut = Path(res["rows"][1]["run"])
    (cut / "summary.jsonl").write_text("")
    again = subprocess.run(proc.args, cwd=ROOT, capture_output=True, text=True, timeout=1500)
    assert again.returncode == 0, again.stderr[-2000:]
    assert again.stdout.count(": reused (it reached 4 steps)") == 3 and list(cut.parent.glob(f"{cut.name}.cut-*"))
    assert json.loads((out / "mix_vs_quality.json").read_text())["rows"][0] == res["rows"][0]
