"""The one training loop, the rank job, on a tiny random Llama with SmolLM2's tokenizer and real ShareGPT.

Everything that trains runs the job ``dflash train`` launches (issue #26): one process per rank, so
1 + 1 is two processes. Two jobs are shared by the assertions of this module: a whole epoch through
``dflash train`` (with conversations the sampler must drop, W&B offline and telemetry), and a
step-limited run through the library call :func:`dflash.pipeline.trainer.train`.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from dflash.core.config import load_config
from dflash.core.records import read_records
from dflash.data.lengths import load_tokenizer
from dflash.pipeline.training_data import TrainingData
from tests.test_distributed import assert_books_balance
from tests.test_resume_and_control import run_inputs, write_cfg  # noqa: F401 - the fixture

ROOT = Path(__file__).resolve().parent.parent
JOB_TIMEOUT_S = 300
ENV = {**os.environ, "DFLASH_WAIT_S": "60", "OMP_NUM_THREADS": "1"}


def data_with_unusable_conversations(src: Path, dst: Path) -> int:
    """The slice plus conversations that cannot hold an anchor (empty response; a prompt past max_len).
    Returns how many were added."""
    rows = [json.loads(line) for line in src.read_text().splitlines()]
    bad = []
    for i, r in enumerate(rows[:8]):
        ask = r["conversations"][0]["value"]
        bad.append({"id": f"noresp-{i}", "conversations": [{"from": "human", "value": ask},
                                                             {"from": "gpt", "value": ""}]})
        bad.append({"id": f"long-{i}", "conversations": [{"from": "human", "value": ask * 20},
                                                           {"from": "gpt", "value": "ok"}]})
    dst.write_text("".join(json.dumps(r) + "\n" for r in rows + bad))
    return len(bad)


@pytest.fixture(scope="module")
def epoch_run(tmp_path_factory: pytest.TempPathFactory, run_inputs) -> dict:  # noqa: F811
    """One epoch through ``dflash train`` (two processes), W&B offline, telemetry every 4 steps."""
    d = tmp_path_factory.mktemp("epoch")
    added = data_with_unusable_conversations(run_inputs["data"], d / "data.jsonl")
    cfg = write_cfg(d / "cfg.toml", {**run_inputs, "data": d / "data.jsonl"}, epochs=1, checkpoint_every=5,
                    log_every=4)
    cfg.write_text(cfg.read_text() + "[metrics]\nwindow = 8\n")  # a rolling window the epoch fills early
    run = d / "run"
    res = subprocess.run([sys.executable, "-m", "dflash", "train", "--config", str(cfg), "--out", str(run),
                          "--wandb", "offline"], cwd=ROOT, env=ENV, capture_output=True, text=True,
                         timeout=JOB_TIMEOUT_S)
    assert res.returncode == 0, res.stderr
    return {"cfg": cfg, "run": run, "stdout": res.stdout, "added": added}


@pytest.fixture(scope="module")
def step_run(tmp_path_factory: pytest.TempPathFactory, run_inputs):  # noqa: F811
    """Twelve steps through the library call (the rank job, started from this process), with an
    acceptance-length evaluation every 6 steps and the held-out quality metric every 4."""
    from dflash.pipeline.trainer import train

    d = tmp_path_factory.mktemp("steps")
    cfg = load_config(write_cfg(d / "cfg.toml", run_inputs, max_steps=12, log_every=1000, eval_every=6,
                                eval_prompts=2, eval_new_tokens=8, quality_every=4, quality_per_bucket=3,
                                quality_anchors=8))
    return train(cfg, d / "run", wait_s=60.0, pg_timeout_s=60.0)


def test_an_epoch_trains_every_usable_item_once_on_two_processes(epoch_run) -> None:
    run = epoch_run["run"]
    s = assert_books_balance(run, 1, 1)  # produce and take records from two different pids, among others
    cfg = load_config(epoch_run["cfg"])
    data = TrainingData(cfg, load_tokenizer(str(cfg.target.model)))
    assert data.sampler.dropped_no_anchor >= epoch_run["added"]  # dropped before any forward
    epoch = [spec.item_id for spec in data.sampler.epoch(0)]
    taken = [i for r in read_records(run, "take") for i in r["item_ids"]]
    assert Counter(taken) == Counter(epoch)
    assert s["stopped_by"] == "data" and s["discarded_at_stop"] == 0 and s["skipped_no_anchors"] == 0
    assert s["produced"] == s["trained"] == s["steps"] == len(epoch)  # one sequence per item, one drafter
    assert "drain" in {r["gate"] for r in read_records(run, "take")}  # the last items left below min-ready


def test_every_step_trains_anchors_and_the_loss_curve_is_whole(epoch_run) -> None:
    steps = list(read_records(epoch_run["run"], "step"))
    assert [r["step"] for r in steps] == list(range(len(steps)))
    assert all(r["anchors"] > 0 and r["loss"] > 0 for r in steps)
    # model FLOPs and their rate in every step record (dflash.model.flops); no MFU on the CPU (no peak)
    assert all(r["model_flops"] > 0 and r["flops_per_s"] == pytest.approx(r["model_flops"] / r["step_s"])
               and r["mfu"] is None for r in steps)


def test_one_host_sync_per_step_and_stage_times_that_mean_their_names(epoch_run) -> None:
    """Issue 34: each step reads the device once (its stats; counted by dflash.model.hostsync), records
    wait_peers_s apart from optimizer_s, say shared_gpu (false: CPU ranks), and are schema version 2; the
    gpu-check figures read them."""
    from dflash.gpucheck.figures import issue34_figures, pipeline_efficiency

    run = epoch_run["run"]
    steps = list(read_records(run, "step"))
    assert steps and all(r["host_syncs"] == 1 for r in steps), [r["host_syncs"] for r in steps]
    assert all({"wait_peers_s", "optimizer_s", "transfer_s"} <= set(r["stages"]) for r in steps)
    assert all(r["schema_version"] == 2 and r["shared_gpu"] is False for r in steps)
    summary = list(read_records(run, "summary"))[-1]
    assert summary["shared_gpu"] is False and summary["stage_means_s"]["wait_peers_s"] >= 0
    figs = issue34_figures(run)
    assert figs["shared_gpu"]["value"] is False and figs["shared_gpu"]["host_syncs_per_step_max"] == 1
    assert figs["wait_peers_s"]["value"] == summary["stage_means_s"]["wait_peers_s"]
    assert figs["mfu"]["value"] is None and figs["mfu"]["flops_per_s"] > 0 and "n/a" in figs["mfu"]["note"]
    pe = pipeline_efficiency(run, json.loads((run / "metrics.json").read_text()), 1, 1)
    assert pe["ideal_items_per_s"] == min(pe["target_alone_items_per_s"], pe["drafter_alone_items_per_s"])
    assert pe["value"] == pe["vs_slower_side"]  # separate devices: the ideal is the slower side


def test_the_run_leaves_metrics_parquet_and_a_drafter_that_loads_with_one_call(epoch_run) -> None:
    from dflash.model.drafter import DFlashDrafter
    from dflash.model.target import load_target

    run = epoch_run["run"]
    metrics = json.loads((run / "metrics.json").read_text())
    for key in ("throughput_tokens_per_s", "mix_efficiency", "drafter_utilization", "mean_queue_depth"):
        assert key in metrics, key
    assert (run / "take.parquet").exists() and (run / "produce.parquet").exists()
    cfg = load_config(epoch_run["cfg"])
    drafter = DFlashDrafter.load(run / "drafter", load_target(str(cfg.target.model)).model)
    assert drafter.spec.layers == 1 and drafter.spec.block_size == 8


def test_offline_wandb_and_per_rank_telemetry_land_in_the_run_and_its_records(epoch_run) -> None:
    run, out = epoch_run["run"], epoch_run["stdout"]
    assert list((run / "wandb").glob("offline-run-*/*.wandb"))
    assert out.count("wandb sync") == 1
    assert out.count("NVML") <= 1  # a telemetry fact is said once per command, if at all
    logged = [r for r in read_records(run, "step") if r.get("telemetry")]
    assert [r["step"] for r in logged] == [k for k in range(len(logged) * 4) if (k + 1) % 4 == 0]
    keys = {k for r in logged for k in r["telemetry"]}  # the target's interval holds the items it produced
    assert "rank/0/stage/target_forward_mean" in keys and "rank/1/stage/drafter_compute_mean" in keys
    assert all(r["queue"]["depth"] >= 0 for r in logged)


def test_step_lines_show_the_rolling_mix_once_a_window_was_taken_and_never_nan(epoch_run) -> None:
    lines = [line for line in epoch_run["stdout"].splitlines() if line.startswith("step ")]
    assert len(lines) >= 6 and "nan" not in "\n".join(lines).lower()
    early = [line for line in lines if int(line.split()[1]) < 8]  # window W = 8 items, one item per take
    assert early and all("mix_efficiency(rolling) n/a (needs 8 takes)" in line for line in early)
    assert re.search(r"mix_efficiency\(rolling\) \d\.\d{3}", lines[-1]), lines[-1]


def test_the_library_call_runs_the_same_job_to_max_steps_and_lists_what_it_discarded(step_run) -> None:
    s, run = step_run.summary, step_run.out
    assert s["steps"] == 12 and s["stopped_by"] == "max_steps" and s["trained"] == 12
    assert_books_balance(run, 1, 1)
    assert s == list(read_records(run, "summary"))[-1]
    assert [r["step"] for r in read_records(run, "step")] == list(range(12))
    assert step_run.metrics == json.loads((run / "metrics.json").read_text())


def test_a_bad_target_is_one_config_error_before_any_rank_starts(tmp_path: Path, run_inputs) -> None:  # noqa: F811
    """The library call builds (or reads) the converted target once before starting ranks, so a bad
    model is one line naming ``target.model``, and no rank was started."""
    from dflash.core.config import with_overrides
    from dflash.core.errors import ConfigError
    from dflash.pipeline.trainer import train

    cfg = load_config(write_cfg(tmp_path / "cfg.toml", run_inputs, max_steps=2))
    cfg = with_overrides(cfg, {"target.model": str(tmp_path / "no-such-model")})
    with pytest.raises(ConfigError) as err:
        train(cfg, tmp_path / "run", wait_s=60.0, pg_timeout_s=60.0)
    assert err.value.key == "target.model" and "\n" not in str(err.value)
    assert not (tmp_path / "run" / ".ranks").exists()


def test_the_cpu_profile_is_what_train_runs_by_default() -> None:
    from dflash.cli.options import default_config_file

    path = default_config_file(True, {})
    assert path is not None and path.exists()
    assert load_config(ROOT / "examples" / "cpu-smollm2.toml") == load_config(path)
    cfg = load_config(path)
    assert (cfg.drafter.layers, cfg.drafter.block_size, cfg.drafter.anchors) == (1, 8, 48)  # measured: see its header
    assert cfg.workload.sample == "first_exchange" and cfg.workload.max_len == 512
    assert default_config_file(True, {"target.devices": ("cuda:0",)}) is None
    bound = load_config(ROOT / "examples" / "cpu-smollm2-drafter-bound.toml")
    assert bound.drafter.anchors > cfg.drafter.anchors and bound.drafter.layers > cfg.drafter.layers


def test_no_second_training_loop_is_left() -> None:
    """The in-process Trainer and its threaded HSQueue are gone (issue #26); what trains is the rank job."""
    import importlib

    import dflash.pipeline.trainer as trainer

    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("dflash.pipeline.hsqueue")
    assert not hasattr(trainer, "Trainer") and not (ROOT / "dflash" / "pipeline" / "hsqueue.py").exists()
    assert "launch(" in Path(trainer.__file__).read_text()  # the library call starts the job


def test_eval_every_measures_tau_on_conversations_not_trained_into_the_step_record(step_run) -> None:
    """``[train] eval_every``: the host drafter rank runs real speculative decoding between steps."""
    evals = [(r["step"], r["eval"]) for r in read_records(step_run.out, "step") if r.get("eval")]
    assert [s for s, _ in evals] == [5, 11]
    assert all(1.0 <= e["tau"] <= 8.0 and e["prompts"] == 2 for _, e in evals)  # block size 8


def test_quality_every_scores_a_held_out_set_no_item_trains_into_the_step_record(step_run) -> None:
    """``[train] quality_every`` (issue #27): a fixed held-out set, chosen per bucket by seed, scored by
    the drafter every N steps; the sequences are in no item, and the record carries loss and acceptance
    with their intervals, overall and per bucket."""
    from dflash.core.run_config import load_run_config
    from dflash.core.sampler import sampler_for

    run = step_run.out
    held = json.loads((run / "heldout.json").read_text())
    cfg = load_run_config(run)
    assert held["ids"] and held["quality_per_bucket"] == 3 and held["anchors"] == 8
    data = TrainingData(cfg, load_tokenizer(str(cfg.target.model)))
    assert [list(b) for b in data.sampler.heldout] == held["per_bucket"]  # the seed's set, formed again
    trained = data.sampler.sequences_of(i for r in read_records(run, "take") for i in r["item_ids"])
    in_epochs = {k for e in range(3) for it in data.sampler.epoch(e) for k in it.seq_indices}
    assert not trained & {i for b in held["per_bucket"] for i in b}
    assert not in_epochs & {i for b in held["per_bucket"] for i in b}
    assert sampler_for(cfg, data.sampler.lengths, data.sampler.prompt_lengths).heldout == data.sampler.heldout
    scored = [(r["step"], r["heldout"]) for r in read_records(run, "step") if r.get("heldout")]
    assert [s for s, _ in scored] == [3, 7, 11]
    for _, h in scored:
        assert h["sequences"] == len(held["ids"]) and h["blocks"] > 0 and h["block_size"] == 8
        assert 1.0 <= h["acceptance"] <= 8.0 and h["acceptance_ci"][0] <= h["acceptance"] <= h["acceptance_ci"][1]
        assert 1.0 <= h["tau"] <= 8.0 and h["tau_ci"][0] <= h["tau"] <= h["tau_ci"][1]
        assert h["loss"] > 0 and h["loss_ci"][0] <= h["loss"] <= h["loss_ci"][1]
        assert len(h["per_bucket"]) == 3
        assert sum(b["blocks"] for b in h["per_bucket"]) == h["blocks"]
    assert scored[-1][1]["loss"] < scored[0][1]["loss"]  # lr 3e-3 for 8 steps: the held-out loss falls


def test_sigterm_to_eval_is_one_line_143_and_writes_nothing(step_run, tmp_path) -> None:
    """``dflash eval`` stopped the way a cluster stops it (SIGTERM, issue #38): exit 143, the one line, no
    traceback, no process left, no eval.json written or changed (eval keeps no state: run again, it starts
    over, as tests/test_resume_and_control.py runs it)."""
    import signal

    from tests.conftest import left_in_session, wait_until_catching

    run, out = step_run.out, tmp_path / "eval.json"
    before = (run / "eval.json").read_bytes() if (run / "eval.json").is_file() else None
    proc = subprocess.Popen([sys.executable, "-m", "dflash", "eval", "--drafter", str(run), "--prompts", "40",
                             "--json", str(out)], cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        wait_until_catching(proc)
        time.sleep(1.0)  # loading the target or decoding: either way mid-work
        proc.send_signal(signal.SIGTERM)
        stdout, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 143 and err.splitlines()[-1] == "dflash eval: terminated", err
    assert "Traceback" not in err and "tau" not in stdout and not left_in_session(proc.pid, 10)
    assert not out.exists() and ((run / "eval.json").read_bytes() if (run / "eval.json").is_file() else None) == before
