"""Exact resume after SIGKILL, and live queue re-tuning of a running trainer."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from dflash.cli import main
from dflash.core.config import load_config
from dflash.core.records import read_records
from dflash.core.sampler import Sampler
from dflash.data.lengths import load_tokenizer
from dflash.pipeline.checkpoint import ItemFeed, write_control
from tests.tiny_models import tiny_llama

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def run_inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A saved tiny Llama (with SmolLM2's tokenizer) and a small real ShareGPT slice as JSONL."""
    from dflash.data.conversations import load_conversations, resolve_dataset

    d = tmp_path_factory.mktemp("inputs")
    tok = load_tokenizer("smollm2")
    tiny_llama(vocab_size=len(tok), layers=6, init_std=0.2).save_pretrained(d / "model")
    tok.save_pretrained(d / "model")
    convs, _ = load_conversations(resolve_dataset("sharegpt"), "first_exchange", 60)
    with open(d / "data.jsonl", "w") as f:
        for c in convs:
            turns = [{"from": "human" if r == "user" else "gpt", "value": v} for r, v in c.messages]
            f.write(json.dumps({"id": c.id, "conversations": turns}) + "\n")
    return {"model": d / "model", "data": d / "data.jsonl"}


def write_cfg(path: Path, inputs: dict[str, Path], **train: object) -> Path:
    extra = "\n".join(f"{k} = {json.dumps(v)}" for k, v in {"lr": 3e-3, "log_every": 1, **train}.items())
    path.write_text(f"""
seed = 3
[workload]
dataset = "{inputs['data']}"
sample = "first_exchange"
max_len = 128
bucket_bounds = [32, 64, 128]
seqs_per_item = 1
order = "length_grouped"
mega_batch = 16
[cluster]
n_target = 1
n_drafter = 1
[queue]
min_ready = 3
max_depth = 6
[target]
model = "{inputs['model']}"
capture_layers = 3
[drafter]
layers = 1
block_size = 8
anchors = 16
[train]
{extra}
""")
    return path


@contextlib.contextmanager
def stopped_by_sigterm(proc: subprocess.Popen) -> Iterator[None]:
    """Run the body against a live job, then stop it with SIGTERM and require a clean exit; whatever
    happens, the job's process group does not outlive the test."""
    try:
        yield
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()


def taken_ids(run: Path) -> list[str]:
    return [i for r in read_records(run, "take") for i in r["item_ids"]]


def newest_meta(run: Path) -> dict | None:
    metas = sorted((run / "checkpoint").glob("step-*/manifest.json"))
    return json.loads((metas[-1].parent / "meta.json").read_text()) if metas else None


def test_a_killed_run_resumes_and_trains_exactly_the_same_items(tmp_path: Path, run_inputs) -> None:
    """Plain `dflash train` (1 + 1 ranks) killed with SIGKILL: its ranks die with it, resume trains the epoch once.

    A queue change written by tune-live while the trainer is down is applied at resume and recorded.
    """
    cfg = write_cfg(tmp_path / "cfg.toml", run_inputs, epochs=1, checkpoint_every=4)
    run = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "dflash", "train", "--config", str(cfg), "--out", str(run),
                             "--wandb", "disabled"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    while time.time() < deadline:
        steps = (run / "step.jsonl").read_text().count("\n") if (run / "step.jsonl").exists() else 0
        if steps >= 10 and newest_meta(run) is not None:
            break
        time.sleep(0.01)
    pids = [int(p.read_text().split("pid ")[1].split(")")[0]) for p in (run / ".ranks").glob("rank-*.status")]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    time.sleep(1.0)
    assert len(pids) == 2 and not any(Path(f"/proc/{p}").exists() and "zombie" not in _state(p) for p in pids), \
        "the ranks outlived their launcher"
    meta = newest_meta(run)
    assert 0 < meta["step"] < 29, "the kill must land mid-run"
    assert main(["tune-live", str(run), "--hs-min-ready", "2"]) == 0  # while the trainer is down
    resumed = subprocess.run([sys.executable, "-m", "dflash", "train", "--resume", str(run), "--wandb", "disabled"],
                             cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert "replayed" in resumed.stdout or meta["feed"]["pending"] == []
    assert "applied at resume" in resumed.stdout

    ids_run = taken_ids(run)
    assert max(Counter(ids_run).values()) == 1  # each exactly once
    assert Counter(ids_run) == Counter(_epoch_items(cfg))  # the same items as a whole epoch
    steps = [r["step"] for r in read_records(run, "step")]
    assert steps == list(range(len(steps)))  # the loss curve continues, no step twice
    summary = next(read_records(run, "summary"))
    assert summary["produced"] == summary["trained"] + summary["skipped_no_anchors"] + summary["discarded_at_stop"]
    assert summary["replayed"] == len(meta["feed"]["pending"])
    assert len(summary["discarded_ids"]) == summary["discarded_at_stop"]
    lrs = [r["lr"] for r in read_records(run, "step")]
    assert lrs == sorted(lrs, reverse=True) or lrs[0] < lrs[-1]  # warm-up/cosine continues, no restart
    applied = [c for c in read_records(run, "control") if c.get("serial") == 1]
    assert applied and applied[0]["accepted"] and applied[0]["applied"] == "at resume"


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return "zombie"


def _epoch_items(cfg_path: Path) -> list[str]:
    from dflash.pipeline.training_data import TrainingData

    cfg = load_config(cfg_path)
    return [s.item_id for s in TrainingData(cfg, load_tokenizer(str(cfg.target.model))).sampler.epoch(0)]


def _lines(path: Path) -> int:
    return path.read_text().count("\n") if path.exists() else 0


def _wait(what: str, cond, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.time() + timeout
    while not cond():
        assert proc.poll() is None, f"the run ended before {what}"
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


HOSTILE = ['{"serial": 3, "queue": "garbage"}', '[1, 2, 3]', '{"serial": 4, "queue": {"min_ready": [1]}}',
           '{"serial": 5, "queue": {"no_such_knob": 1}}', "\x00\xff not json", '{"serial": 6, "queue": {}}']


def _put(path: Path, text: str) -> None:
    """Replace the file whole, as an operator's tool does: the watcher must never read it half-written (on a
    loaded machine it did, and a torn file is a malformed one, recorded instead of the content under test)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


@pytest.fixture(scope="module")
def live_run(tmp_path_factory: pytest.TempPathFactory, run_inputs) -> Path:
    """`dflash train` (1 + 1 ranks) while an operator re-tunes it: a good change at step 6, a bad one
    (the CLI would refuse it) six steps later, then every kind of hostile control file, each written
    once the one before is recorded; SIGTERM ends the run with a checkpoint."""
    d = tmp_path_factory.mktemp("live")
    cfg = write_cfg(d / "cfg.toml", run_inputs, checkpoint_every=1000)
    out = d / "run"
    proc = subprocess.Popen([sys.executable, "-m", "dflash", "train", "--config", str(cfg), "--out", str(out),
                             "--wandb", "disabled"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    steps, controls = out / "step.jsonl", out / "control.jsonl"

    def recorded(what: str, write) -> None:
        seen = _lines(controls)
        write()
        _wait(f"{what} recorded", lambda: _lines(controls) > seen, proc)

    with stopped_by_sigterm(proc):
        _wait("step 6", lambda: _lines(steps) >= 6, proc, timeout=240)
        recorded("the change", lambda: main(["tune-live", str(out), "--hs-min-ready", "5"]))
        at = _lines(steps)
        _wait("six more steps", lambda: _lines(steps) >= at + 6, proc)
        recorded("the bad change", lambda: write_control(out, {"min_ready": 50}, serial=2))
        for k, text in enumerate(HOSTILE):
            recorded(f"hostile control file {k}", lambda text=text: _put(out / "control.json", text))
        at = _lines(steps)
        _wait("three more steps", lambda: _lines(steps) >= at + 3, proc)
    return out


def test_a_live_change_is_applied_between_takes_and_a_bad_one_is_rejected(live_run: Path) -> None:
    controls = list(read_records(live_run, "control"))
    applied = [c for c in controls if c.get("serial") == 1]
    rejected = [c for c in controls if c.get("serial") == 2]
    assert applied and applied[0]["accepted"] and applied[0]["change"] == {"min_ready": 5}
    assert rejected and not rejected[0]["accepted"] and "queue.min_ready" in rejected[0]["reason"]
    t_apply = applied[0]["t"]
    after = [t for t in read_records(live_run, "take") if t["t"] > t_apply]
    assert after and all(t["depth_before"] >= 5 for t in after)  # the new gate, kept after the bad change
    assert all(t["depth_before"] >= 3 for t in read_records(live_run, "take"))
    assert next(read_records(live_run, "summary"))["stopped_by"] == "signal SIGTERM"  # the run went on


def test_after_a_live_change_the_metrics_summary_and_checkpoint_use_the_knobs_in_force(live_run: Path) -> None:
    """The knobs in force live in one place (the coordinator's queue core): after ``tune-live`` set
    min_ready 5 (the run started at 3), metrics.json, the summary record and the last checkpoint say 5."""
    metrics = json.loads((live_run / "metrics.json").read_text())
    summary = list(read_records(live_run, "summary"))[-1]
    assert metrics["min_ready"] == 5
    assert summary["queue"]["min_ready"] == 5 and summary["queue"]["max_depth"] == 6
    newest = sorted((live_run / "checkpoint").glob("step-*"))[-1]
    assert json.loads((newest / "meta.json").read_text())["queue_config"]["min_ready"] == 5
    from reports.runs import load_run

    assert load_run(live_run).queue["min_ready"] == 5  # the report reads the knobs in force too


def test_tune_live_judges_flags_against_the_runs_own_config_and_survives_any_control_file(
        live_run: Path, capsys: pytest.CaptureFixture) -> None:
    controls = list(read_records(live_run, "control"))
    rejected = [c for c in controls if c.get("serial") and not c["accepted"]]
    assert sorted(c["serial"] for c in rejected) == [2, 3, 4, 5, 6]
    malformed = [c for c in controls if c.get("serial") is None and not c["accepted"]]
    assert len(malformed) == 2 and all("not a JSON object" in c["reason"] for c in malformed)
    # run config: min_ready 3, max_depth 6 (live: min_ready 5); the built-in defaults (min_ready 30) would
    # refuse max depth 5
    (live_run / "control.json").unlink()
    capsys.readouterr()
    assert main(["tune-live", str(live_run), "--hs-max-depth", "5"]) == 0
    assert main(["tune-live", str(live_run), "--hs-min-ready", "5"]) == 0  # judged with the earlier change (5)
    assert main(["tune-live", str(live_run), "--hs-min-ready", "6"]) == 2  # above the live max depth 5
    assert "queue.min_ready (--hs-min-ready)" in capsys.readouterr().err


def test_tune_live_validates_like_any_config(tmp_path: Path, run_inputs, capsys: pytest.CaptureFixture) -> None:
    from dflash.core.run_config import write_run_config

    out = tmp_path / "run"
    out.mkdir()
    write_run_config(out, load_config(write_cfg(tmp_path / "cfg.toml", run_inputs, max_steps=1)))  # what a run has
    capsys.readouterr()
    assert main(["tune-live", str(out), "--hs-min-ready", "7"]) == 2  # max_depth is 6
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "queue.min_ready (--hs-min-ready)" in err
    assert not (out / "control.json").exists()
    assert main(["tune-live", str(tmp_path), "--hs-min-ready", "2"]) == 2
    assert "RUN_DIR" in capsys.readouterr().err


def test_item_feed_replays_pending_items_first_then_continues() -> None:
    from dflash.core.config import WorkloadConfig

    s = Sampler([10, 20, 30, 40, 50, 60, 70, 80], WorkloadConfig(max_len=128, bucket_bounds=(32, 64, 128),
                                                              seqs_per_item=1), seed=0)
    feed = ItemFeed(s, epochs=1)
    drawn = [feed.next().item_id for _ in range(5)]
    feed.trained(drawn[:2])
    state = feed.state()
    assert state["pending"] == drawn[2:]
    again = ItemFeed(s, epochs=1, epoch=state["epoch"], index=state["index"], replay=state["pending"])
    rest = []
    while (spec := again.next()) is not None:
        rest.append(spec.item_id)
    assert rest[:3] == drawn[2:] and again.replayed == 3
    assert sorted(drawn[:2] + rest) == sorted(i.item_id for i in s.epoch(0))


def test_eval_measures_tau_on_held_out_prompts_of_a_run(tmp_path: Path, run_inputs,
                                                         capsys: pytest.CaptureFixture) -> None:
    from dflash.cli import trained_conversation_ids

    cfg_path = write_cfg(tmp_path / "cfg.toml", run_inputs, max_steps=6)
    out = tmp_path / "run"
    assert main(["train", "--config", str(cfg_path), "--out", str(out), "--wandb", "disabled"]) == 0
    capsys.readouterr()
    assert main(["eval", "--drafter", str(out), "--prompts", "3"]) == 0
    printed = capsys.readouterr().out
    res = json.loads((out / "eval.json").read_text())
    assert res["num_prompts"] == 3 and 1.0 <= res["tau"] <= 8.0 and f"tau {res['tau']:.3f}" in printed
    used = trained_conversation_ids(out, load_config(cfg_path))
    assert 1 <= len(used) <= 6  # one sequence per item, at most six steps
    assert main(["eval", "--drafter", str(tmp_path)]) == 2  # not a drafter directory


def test_a_finished_run_extends_when_a_limit_leaves_room() -> None:
    """A finished time-budgeted run given a larger --max-minutes (or --max-steps) continues; limits
    already reached, or none at all, leave it finished."""
    from dflash.cli.verbs.train import has_room

    assert has_room(100, 180.0, None, 5.0)  # 3 minutes trained, budget now 5
    assert not has_room(100, 180.0, None, 3.0)  # budget reached
    assert has_room(100, 180.0, 200, None) and not has_room(100, 180.0, 100, None)
    assert not has_room(100, 180.0, 200, 3.0)  # more steps, but the time budget is spent
    assert not has_room(100, 180.0, None, None)
