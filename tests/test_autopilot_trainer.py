"""The queue autopilot in the trainer (issue #28 item 2): the coordinator runs the simulator's controller.

``dflash train --queue auto`` hands min_ready/max_depth to :mod:`dflash.core.autopilot` inside the
coordinator (the same code the simulator runs); every change is a control record with its reason, and a
manual ``tune-live`` change switches the run to manual (the rule is in the service's live control).
One real 1 + 1 job on a tiny Llama with SmolLM2's tokenizer and a real ShareGPT slice; the mix window is
2 items so the autopilot's first look (16 windows) comes after 32 takes of this small data set.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dflash.core.records import read_records
from tests.test_resume_and_control import run_inputs, write_cfg  # noqa: F401 - the fixture

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "DFLASH_WAIT_S": "60", "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def auto_run(tmp_path_factory: pytest.TempPathFactory, run_inputs) -> dict:  # noqa: F811
    d = tmp_path_factory.mktemp("auto")
    cfg = write_cfg(d / "cfg.toml", run_inputs, epochs=3, checkpoint_every=1000, log_every=1000)
    text = cfg.read_text().replace("min_ready = 3\nmax_depth = 6", "min_ready = 6\nmax_depth = 12")
    cfg.write_text(text + "[metrics]\nwindow = 2\n")
    run = d / "run"
    res = subprocess.run([sys.executable, "-m", "dflash", "train", "--config", str(cfg), "--out", str(run),
                          "--queue", "auto", "--wandb", "disabled"], cwd=ROOT, env=ENV, capture_output=True,
                         text=True, timeout=400)
    assert res.returncode == 0, res.stderr
    return {"run": run, "stdout": res.stdout}


def test_train_queue_auto_writes_each_change_as_a_control_record_with_its_reason(auto_run) -> None:
    decisions = [r for r in read_records(auto_run["run"], "control") if r.get("source_of_change") == "autopilot"]
    assert decisions, "the autopilot made no change in the run"
    for r in decisions:
        assert r["accepted"] is True and set(r["change"]) <= {"min_ready", "max_depth"} and r["change"]
        assert {"rule"} <= set(r["reason"]) and "mix" in str(r["reason"])
    assert auto_run["stdout"].count("queue autopilot: ") == len(decisions)  # one line each


def test_after_autopilot_decisions_the_metrics_and_summary_use_the_knobs_in_force(auto_run) -> None:
    """metrics.json and the summary record say the knobs the autopilot left in force, not the start's 6/12."""
    run = auto_run["run"]
    knobs = {"min_ready": 6, "max_depth": 12}
    for r in read_records(run, "control"):
        if r.get("source_of_change") == "autopilot":
            knobs.update(r["change"])
    assert knobs != {"min_ready": 6, "max_depth": 12}, "the autopilot moved no knob"
    summary = list(read_records(run, "summary"))[-1]
    assert {k: summary["queue"][k] for k in knobs} == knobs
    assert json.loads((run / "metrics.json").read_text())["min_ready"] == knobs["min_ready"]


def test_the_queue_obeys_the_depth_the_autopilot_set(auto_run) -> None:
    """The coordinator applies each decision before the next take: the queue depth a take sees never
    exceeds the larger of the cap in force before and after the latest decision (a lowered cap drains)."""
    run = auto_run["run"]
    caps = [(0.0, 12)]
    for r in read_records(run, "control"):
        if r.get("source_of_change") == "autopilot" and "max_depth" in r["change"]:
            caps.append((r["t"], r["change"]["max_depth"]))
    assert len(caps) > 1  # it moved the cap on this drafter-bound run (producers block at it)
    for take in read_records(run, "take"):
        k = max(i for i, (t, _) in enumerate(caps) if t <= take["t"])
        allowed = max(caps[k][1], caps[k - 1][1]) if k else caps[0][1]
        assert take["depth_before"] <= allowed, (take, caps[max(0, k - 1):k + 1])
