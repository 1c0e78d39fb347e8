"""scripts/gpu_check.py, the one GPU acceptance run: its CPU form writes every key of the issue's JSON
(the slow test runs the whole loop through the real dflash verbs), and bad flags are one line, exit 2."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import load_script as load_script_from

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_check.py"


def load_script():
    return load_script_from(SCRIPT)


@pytest.mark.parametrize("argv, flag", [
    (["--cpu", "--minutes", "0"], "--minutes"),
    (["--cpu", "--target", "no-such-model"], "--target"),
    (["--cpu", "--target", "random-70b"], "--target"),
    (["--cpu", "--arch", "huge"], "--arch"),
    (["--cpu", "--arch", "tiny", "--target", "random-1b"], "--arch"),
    (["--cpu", "--data", "/no/such.jsonl"], "--data"),
    (["--cpu", "--eval-prompts", "1"], "--eval-prompts"),
    (["--cpu", "--minutes", "soon"], "--minutes"),
])
def test_bad_flags_are_one_line_naming_the_flag_with_exit_status_2(argv, flag, capsys, tmp_path):
    out = tmp_path / "never.json"
    assert load_script().main([*argv, "--json", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and flag in err and "Traceback" not in err
    assert not out.exists()  # nothing half-written


def test_fidelity_errors_are_relative_for_throughput_and_absolute_for_mix():
    gc = load_script()
    f = gc.fidelity({"throughput_tokens_per_s": 900.0, "mix_efficiency": 0.95},
                    {"throughput_tokens_per_s": 1000.0, "mix_efficiency": float("nan")}, {"min_ready": 2})
    assert f["throughput_tokens_per_s"]["error"] == pytest.approx(-0.1)
    assert f["mix_efficiency"] == {"predicted": 0.95, "measured": None, "error": None}  # NaN is unknown, not a number
    assert f["configuration"] == {"min_ready": 2}


@pytest.mark.slow
def test_the_cpu_check_writes_every_key_of_the_acceptance_json(tmp_path):
    """The issue's command: regenerate (skipped: random target), train, eval, calibrate, predict a
    second configuration and run it, on the CPU with a tiny random Llama."""
    out = tmp_path / "check.json"
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, str(SCRIPT), "--cpu", "--arch", "tiny", "--minutes", "0.3", "--json",
                           str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())
    gc = load_script()
    assert set(gc.JSON_KEYS) <= set(res)
    assert res["gpu"]["name"] is None and res["gpu"]["reason"] and res["gpu"]["torch"]  # unknowable on the CPU
    assert res["nvml"]["utilisation_pct_mean"] is None and res["nvml"]["power_w_mean"] is None and res["nvml"]["reason"]
    assert res["throughput_tokens_per_s"] > 0 and res["items_per_s"] > 0
    pe = res["pipeline_efficiency"]
    for key in ("vs_target_alone", "vs_drafter_alone", "vs_slower_side"):
        assert 0 < pe[key] <= 1.5, (key, pe)
    assert {"drafter_compute_s", "optimizer_s", "transfer_s", "target_forward_s_per_item"} <= set(res["stages"])
    assert all(isinstance(v, float) and v >= 0 for v in res["stages"].values())
    ranks = res["peak_memory_bytes"]
    assert sorted(ranks) == ["0", "1", "2"] and [ranks[r]["role"] for r in ("0", "1", "2")] == ["target", "drafter",
                                                                                                  "drafter"]
    assert all(m["bytes"] > 50 * 2**20 for m in ranks.values())  # a torch process, measured
    assert res["tau"] >= 1.0 and len(res["tau_ci95"]) == 2 and res["tau_ci95"][0] <= res["tau"] <= res["tau_ci95"][1]
    fid = res["fidelity"]
    for key in ("throughput_tokens_per_s", "mix_efficiency"):
        assert set(fid[key]) == {"predicted", "measured", "error"}
    assert fid["throughput_tokens_per_s"]["predicted"] > 0 and fid["throughput_tokens_per_s"]["measured"] > 0
    assert math.isfinite(fid["throughput_tokens_per_s"]["error"])
    assert isinstance(res["data_plane"], str) and res["data_plane"]
    assert res["regenerated_data"]["path"] is None and "random target" in res["regenerated_data"]["reason"]
    assert wall < 420, f"{wall:.0f} s"  # the goal is < 3 minutes on an idle 2-core machine; this bounds a loaded one


def test_nvidia_smi_samples_are_parsed_per_gpu_and_per_process_and_summarised():
    """The GPU-only readers, on nvidia-smi's csv,noheader,nounits format (N/A where a board cannot say)."""
    gc = load_script()
    samples = gc.parse_gpu_csv("0, 14, 174.32, 26012\n1, 71, [N/A], 30000\n")
    assert samples == [{"gpu": 0, "util": 14.0, "power_w": 174.32, "used_mib": 26012.0},
                       {"gpu": 1, "util": 71.0, "power_w": None, "used_mib": 30000.0}]
    assert gc.parse_apps_csv("4242, 1024\n4243, [N/A]\nNo running processes found\n") == {4242: 2**30}
    sampler = gc.Sampler(gpus=2)
    sampler.gpu_samples = samples + gc.parse_gpu_csv("0, 40, 180.0, 26100\n")
    nv = gc.nvml_summary(sampler, 2, Path("/nonexistent-run"))
    assert nv["utilisation_pct_mean"] == pytest.approx((14 + 71 + 40) / 3) and nv["utilisation_pct_max"] == 71
    assert nv["power_w_mean"] == pytest.approx((174.32 + 180.0) / 2)  # N/A left out, not counted as 0
    assert nv["per_gpu"]["0"]["memory_used_mib_max"] == 26100 and "reason" not in nv


@pytest.mark.parametrize("argv, flag", [
    (["--cpu", "--learning", "--regenerate-prompts", "0"], "--regenerate-prompts"),
    (["--cpu", "--learning", "--minutes", "-1"], "--minutes"),
    (["--cpu", "--learning", "--eval-prompts", "1"], "--eval-prompts"),
])
def test_learning_flags_are_checked_like_the_others(argv, flag, capsys, tmp_path):
    out = tmp_path / "never.json"
    assert load_script().main([*argv, "--json", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and flag in err and not out.exists()


def test_learning_defaults_fit_five_minutes_at_twenty_prompts_per_second():
    gc = load_script()
    plan = gc.parse_args(["--cpu", "--learning"])
    assert plan.learning and plan.regenerate_prompts == gc.LEARNING_PROMPTS and plan.minutes == 1.5
    regenerate_s = (plan.regenerate_prompts + 2 * 32) / 20  # the GPU's eval prompts are regenerated too
    assert regenerate_s + plan.minutes * 60 <= 200  # leaves >= 100 s of the 5 minutes for loads and eval
    assert gc.parse_args(["--cpu"]).regenerate_prompts == 256 and not gc.parse_args(["--cpu"]).learning


def test_the_learning_config_is_the_learning_profile_on_the_regenerated_prefix(tmp_path):
    """On a GPU: the profile's drafter shape with the held-out metric, trained on the first N conversations."""
    from dflash.core.config import load_config

    gc = load_script()
    plan = gc.Plan(target="smollm2", data=None, cpu=False, minutes=1.5, gpus=1, json_out=None, keep=False,
                   regenerate_prompts=1600, eval_prompts=32, learning=True)
    path = gc.learning_config(tmp_path / "l.toml", plan, gc.shape_for(plan), model="smollm2",
                              data=str(tmp_path / "regenerated.jsonl"), n_train=1600)
    cfg, profile = load_config(path), load_config(gc.LEARNING_PROFILE)
    assert cfg.drafter == profile.drafter and cfg.target.capture_layers == profile.target.capture_layers
    assert cfg.train.quality_every and cfg.train.quality_per_bucket == profile.train.quality_per_bucket
    assert cfg.workload.max_conversations == 1600 and cfg.workload.dataset.endswith("regenerated.jsonl")
    assert cfg.train.epochs is None and cfg.train.eval_prompts == 32  # time-boxed by --minutes


@pytest.mark.slow
def test_the_cpu_learning_check_regenerates_trains_with_the_heldout_metric_and_evals(tmp_path):
    """The --learning loop on the CPU with a tiny random Llama: its greedy replies are the data."""
    out = tmp_path / "learning.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--cpu", "--arch", "tiny", "--learning",
                           "--regenerate-prompts", "24", "--minutes", "0.3", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())
    assert set(load_script().LEARNING_KEYS) <= set(res) and res["mode"] == "learning" and not res["failed_steps"]
    assert res["regenerated_data"]["prompts"] == 24 + 2 * 6 and res["regenerated_data"]["prompts_per_s"] > 0
    h = res["heldout"]
    assert h["acceptance"] >= 1.0 and h["acceptance_ci"][0] <= h["acceptance"] <= h["acceptance_ci"][1]
    assert h["per_bucket"] and res["heldout_curve"][-1]["acceptance"] == h["acceptance"]
    assert res["tau"] >= 1.0 and res["tau_ci95"][0] <= res["tau"] <= res["tau_ci95"][1]
    assert all(res["wall_s_by_step"][k] > 0 for k in ("regenerate", "train", "eval"))
    assert res["train"]["steps"] >= 5 and res["train"]["epochs"] > 0
