"""The report's autopilot and stage panels, and a grid study's auto row, on real inputs.

Inputs are real: a `dflash sweep --grid --queue auto` study, `dflash simulate --records` runs with
the autopilot on and off, and a short real trainer run (the rank job: tiny random Llama, SmolLM2
tokenizer, a ShareGPT slice). Every figure the report prints is recomputed here from those records.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from dflash.cli import main
from dflash.core.config import load_config, with_overrides
from dflash.core.records import read_records
from reports.fmt import parse_md_table
from tests.test_resume_and_control import run_inputs, write_cfg  # noqa: F401 - the fixture
from tests.test_sweep import write_cfg as write_sweep_cfg

ROOT = Path(__file__).resolve().parent.parent


def section(md: str, title: str) -> str:
    start = md.index(f"## {title}")
    end = md.find("\n## ", start + 3)
    return md[start:end if end > 0 else None]


def tables(text: str) -> list[list[dict[str, str]]]:
    """Every Markdown table in ``text``, parsed."""
    out, lines = [], text.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("| "):
            j = i
            while j < len(lines) and lines[j].startswith("|"):
                j += 1
            out.append(parse_md_table("\n".join(lines[i:j])))
            i = j
        else:
            i += 1
    return out


def report(tmp: Path, *inputs: Path) -> str:
    out = tmp / "report"
    assert main(["report", *map(str, inputs), "--out", str(out)]) == 0
    return (out / "report.md").read_text()


# ---------------------------------------------------------------------------------- grid study
def test_a_grid_study_with_the_autopilot_shows_the_auto_row_after_the_static_pairs(tmp_path: Path) -> None:
    cfg = write_sweep_cfg(tmp_path, n_target=1, per_token=8.1e-5, extra='grid_policies = ["random_item"]')
    sweep = tmp_path / "g"
    assert main(["sweep", "--config", str(cfg), "--grid", "--queue", "auto", "--out", str(sweep)]) == 0
    md = report(tmp_path, sweep)
    rows = tables(section(md, "Sensitivity"))[0]
    labels = [r["min_ready/max_depth"] for r in rows]
    assert labels == ["10/30", "20/60", "25/75", "30/90", "40/120", "auto (autopilot, from 30/90)"]
    marked = {r["min_ready/max_depth"]: r["random_item"].rsplit(" (", 1)[-1] for r in rows
              if r["random_item"].endswith(")")}
    assert marked == {"10/30": "baseline)", "30/90": "handpicked)"}  # the named configs are cells, not rows
    import pandas as pd

    trials = pd.read_parquet(sweep / "trials.parquet")
    auto = trials[trials["params_pair"] == "auto"].iloc[0]
    assert rows[-1]["random_item"].startswith(f"{auto['user_attrs_mix_efficiency']:.3f}")
    assert "The auto row is the queue autopilot" in section(md, "Sensitivity")
    heat = section(md, "Objectives over")
    assert "1 autopilot trial left out" in heat
    front = tables(section(md, "Pareto front"))[0]
    on_front = {r["trial"]: r["min_ready/max_depth"] for r in front}
    if str(int(auto["number"])) in on_front:  # the autopilot's trial never poses as its starting pair
        assert on_front[str(int(auto["number"]))] == "auto from 30/90"
    assert all(not v.startswith("auto") for k, v in on_front.items() if k != str(int(auto["number"])))


# ---------------------------------------------------------------------------------- autopilot
@pytest.fixture(scope="module")
def sims(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The drafter-bound example (short lognormal workload) simulated with the autopilot and without."""
    d = tmp_path_factory.mktemp("sims")
    text = (ROOT / "examples" / "h200-8b-drafter-bound.toml").read_text()
    cfg = d / "cfg.toml"
    cfg.write_text(text.replace('dataset = "sharegpt"', 'dataset = "sharegpt"\nlengths = "lognormal"\n'
                                'n_sequences = 3000'))
    out = {}
    for mode in ("auto", "static"):
        out[mode] = d / mode
        assert main(["simulate", "--config", str(cfg), "--sim-seconds", "1800", "--queue", mode,
                     "--records", str(out[mode])]) == 0
    return out


def test_the_autopilot_panel_draws_the_knobs_and_lists_every_change_with_its_reason(
        sims: dict[str, Path], tmp_path: Path) -> None:
    from reports.run_panels import knob_series
    from reports.runs import load_run

    md = report(tmp_path, sims["auto"])
    sec = section(md, "Queue autopilot")
    controls = sorted(read_records(sims["auto"], "control"), key=lambda r: r["t"])
    assert controls
    start, last = controls[0]["reason"]["from"], controls[-1]
    run = load_run(sims["auto"])
    series = knob_series(run, controls)
    final = {k: int(v[-1]) for k, (_, v) in series.items()}
    replayed = dict(start)
    for r in controls:
        replayed.update(r["change"])
    assert final == {k: replayed[k] for k in ("min_ready", "max_depth")}
    assert last["change"].get("max_depth", final["max_depth"]) == final["max_depth"]
    assert (f"from {start['min_ready']}/{start['max_depth']} to {final['min_ready']}/{final['max_depth']}, "
            f"{len(controls)} change records") in sec
    assert "](figures/autopilot_1.png)" in sec
    assert (tmp_path / "report" / "figures" / "autopilot_1.png").stat().st_size > 20_000
    rows = tables(sec)[0]
    assert len(rows) == len(controls)
    for row, rec in zip(rows, controls, strict=True):
        assert row["t (s)"] == f"{rec['t']:,.1f}"
        assert row["change"] == ", ".join(f"{k} {v}" for k, v in rec["change"].items())
        assert row["reason"] == rec["reason"]["rule"] and row["by"] == "autopilot"
        assert row["mix measured"].startswith(f"{rec['reason']['mix_efficiency']:.3f} [")
    assert "step" not in rows[0]  # a simulated run has no training steps


def test_no_autopilot_panel_without_knob_changes(sims: dict[str, Path], tmp_path: Path) -> None:
    assert not list(read_records(sims["static"], "control"))
    md = report(tmp_path, sims["static"])
    sec = section(md, "Queue autopilot")
    assert "Not available: no run with control records" in sec and "figures/autopilot" not in sec
    assert "Not available: no real run whose step records carry `stages`" in section(md, "Where a step goes")


# ---------------------------------------------------------------------------------- stages
@pytest.fixture(scope="module")
def real_run(tmp_path_factory: pytest.TempPathFactory, run_inputs: dict[str, Path]) -> Path:  # noqa: F811
    from dflash.pipeline.trainer import train

    d = tmp_path_factory.mktemp("real")
    cfg = with_overrides(load_config(write_cfg(d / "cfg.toml", run_inputs, max_steps=12, log_every=4)), {})
    train(cfg, d / "run", wait_s=60.0, pg_timeout_s=60.0)
    return d / "run"


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def test_a_real_run_shows_each_stage_per_step_and_its_share(real_run: Path, tmp_path: Path) -> None:
    steps = [s for s in read_records(real_run, "step") if isinstance(s.get("stages"), dict)]
    assert len(steps) == 12
    steady = steps[1:]  # the first step's gate wait is the start-up fill
    md = report(tmp_path, real_run)
    sec = section(md, "Where a step goes")
    assert "](figures/stages.png)" in sec and (tmp_path / "report" / "figures" / "stages.png").is_file()
    rows = {r["stage"]: r for r in tables(sec)[0]}
    step_s = _mean([s["step_s"] for s in steady])
    for stage in ("gate_wait_s", "transfer_s", "drafter_forward_s", "drafter_backward_s", "wait_peers_s",
                  "optimizer_s"):
        mean = _mean([s["stages"][stage] for s in steady])
        assert rows[stage]["mean s/step"] == f"{mean:.4f}"
        assert rows[stage]["share of step"] == f"{100 * mean / step_s:.1f}%"
        assert rows[stage]["steps"] == "11"
    assert rows["step_s"]["mean s/step"] == f"{step_s:.4f}" and rows["step_s"]["share of step"] == "100.0%"
    compute = rows["drafter_compute_s (forward + backward)"]
    assert compute["mean s/step"] == f"{_mean([s['stages']['drafter_compute_s'] for s in steady]):.4f}"
    leaves = sum(float(rows[k]["mean s/step"]) for k in ("gate_wait_s", "transfer_s", "drafter_forward_s",
                                                          "drafter_backward_s", "wait_peers_s", "optimizer_s"))
    other = float(rows["other (step_s - stages)"]["mean s/step"])
    assert abs(leaves + other - step_s) < 1e-3  # the stages and "other" add up to the step
    # A CPU run's records carry no NVML samples: no GPU panel, and the report says why.
    assert not any("/gpu/" in k for s in steps for k in (s.get("telemetry") or {}))
    assert "Not available: GPU power and utilisation" in sec and "figures/gpu" not in sec
    # The trainer's control record of its starting queue alone moves no knob: no autopilot panel.
    assert [r["reason"] for r in read_records(real_run, "control")] == ["initial queue config"]
    assert "figures/autopilot" not in md


def test_gpu_samples_in_the_telemetry_give_a_power_and_utilisation_panel(real_run: Path, tmp_path: Path) -> None:
    """The coordinator's telemetry as RankTelemetry writes it when NVML samples arrive (no GPU here):
    the same real run's step records, each logged interval given the samples a GPU rank would send."""
    from dflash.pipeline.service import RankTelemetry

    run = tmp_path / "run"
    shutil.copytree(real_run, run)
    lines, expect = [], {"util": [], "power_w": []}
    for k, rec in enumerate(read_records(real_run, "step")):
        if rec.get("telemetry"):
            tel = RankTelemetry()
            sample: dict[str, Any] = {"t": rec["t"], "gpu": 0, "util": 40.0 + 5 * k, "mem_util": 20.0,
                                      "mem_used": 3 * 2**30, "mem_total": 80 * 2**30, "power_w": 150.0 + k,
                                      "temp_c": 50.0, "sm_clock_mhz": 1500.0}
            tel.add(1, rec["stages"], [sample])
            rec["telemetry"] = {**rec["telemetry"], **tel.interval()}
            expect["util"].append(sample["util"])
            expect["power_w"].append(sample["power_w"])
        lines.append(json.dumps(rec))
    (run / "step.jsonl").write_text("\n".join(lines) + "\n")
    assert len(expect["util"]) == 3  # log_every 4 over 12 steps
    sec = section(report(tmp_path, run), "Where a step goes")
    assert "](figures/gpu.png)" in sec
    row = tables(sec)[1][0]
    assert (row["rank"], row["GPU"], row["intervals"]) == ("1", "0", "3")
    assert row["utilisation %"] == f"{_mean(expect['util']):.1f}"
    assert row["power W"] == f"{_mean(expect['power_w']):.1f}"
    assert row["peak memory GiB"] == "3.00"


def test_live_changes_of_a_real_run_are_drawn_and_listed_accepted_or_refused(real_run: Path, tmp_path: Path,
                                                                            run_inputs: dict[str, Path]) -> None:  # noqa: F811
    """`dflash tune-live` while the trainer is down: a good change is applied at resume, a bad one (min_ready
    above max_depth) refused; both are control records, both rows of the table, and the knob line moves."""
    from dflash.pipeline.checkpoint import write_control
    from dflash.pipeline.trainer import train

    run = tmp_path / "run"
    shutil.copytree(real_run, run)
    assert main(["tune-live", str(run), "--hs-min-ready", "2", "--hs-max-depth", "5"]) == 0
    cfg = with_overrides(load_config(write_cfg(tmp_path / "cfg.toml", run_inputs, max_steps=14, log_every=4)), {})
    train(cfg, run, resume=True, wait_s=60.0, pg_timeout_s=60.0)
    write_control(run, {"min_ready": 50}, serial=2)
    cfg = with_overrides(cfg, {"train.max_steps": 15})
    train(cfg, run, resume=True, wait_s=60.0, pg_timeout_s=60.0)
    md = report(tmp_path, run)
    sec = section(md, "Queue autopilot")
    assert "](figures/autopilot_1.png)" in sec and "from 3/6 to 2/5, 2 change records" in sec
    rows = tables(sec)[0]
    assert [(r["change"], r["accepted"], r["by"]) for r in rows] == [
        ("min_ready 2, max_depth 5", "yes", "tune-live #1"), ("min_ready 50", "NO", "tune-live #2")]
    assert rows[0]["reason"] == "applied at resume" and "min_ready" in rows[1]["reason"]
    assert "mix measured" not in rows[0]  # a live change carries no autopilot measurement
