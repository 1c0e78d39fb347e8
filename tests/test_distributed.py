"""The distributed trainer as real processes (gloo on the CPU, tiny random Llama target, real ShareGPT slice).

Each job runs ``python -m dflash train`` in a subprocess (the launcher starts one process per rank) with
``DFLASH_CHECK_TRANSFERS=1``: every received item is checked against its id (a content fingerprint, and
its tokens re-formed from the id on the drafter rank), so a swapped or mismatched transfer fails the run.
Every wait is bounded (``DFLASH_WAIT_S``, process-group timeout <= 60 s) and a job that outlives its
timeout fails as "deadlocked on ranks ..." with what each rank said it was waiting for.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from dflash.core.config import load_config
from dflash.core.records import read_records
from dflash.pipeline.launch import hung_ranks
from dflash.pipeline.ledger import read_ledger
from tests.test_resume_and_control import run_inputs, write_cfg  # noqa: F401 - the fixture

ROOT = Path(__file__).resolve().parent.parent
JOB_TIMEOUT_S = 240
ENV = {**os.environ, "DFLASH_CHECK_TRANSFERS": "1", "DFLASH_WAIT_S": "60", "OMP_NUM_THREADS": "1"}


def dflash(*args: str, timeout: float = JOB_TIMEOUT_S, run: Path | None = None,
           env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``dflash ...``; a job past its timeout is killed and fails naming what its ranks waited for."""
    proc = subprocess.Popen([sys.executable, "-m", "dflash", *args], cwd=ROOT, env={**ENV, **(env or {})}, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"deadlocked on ranks: {hung_ranks(run) if run else 'unknown'}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def epoch_items(cfg_path: Path) -> list[str]:
    from dflash.data.lengths import load_tokenizer
    from dflash.pipeline.training_data import TrainingData

    cfg = load_config(cfg_path)
    data = TrainingData(cfg, load_tokenizer(str(cfg.target.model)))
    return [s.item_id for s in data.sampler.epoch(0)]


def assert_books_balance(run: Path, n_target: int, n_drafter: int, sessions: int = 1) -> dict:
    """docs/ARCHITECTURE.md's identity, no item twice, one producer rank per target and one per drafter, all listed."""
    s = next(read_records(run, "summary"))
    produce = list(read_records(run, "produce"))
    takes = list(read_records(run, "take"))
    taken = [i for r in takes for i in r["item_ids"]]
    assert s["produced"] == s["trained"] + s["skipped_no_anchors"] + s["discarded_at_stop"]
    assert max(Counter(taken).values()) == 1, "an item was trained twice"
    assert len(s["discarded_ids"]) == s["discarded_at_stop"]
    assert len(produce) == s["produced"]  # every produced item has its record
    assert set(taken) | set(s["discarded_ids"]) == {r["item_id"] for r in produce}
    assert {r["rank"] for r in produce} == set(range(n_target))
    assert {r["rank"] for r in takes} == set(range(n_target, n_target + n_drafter))
    pids = {r["pid"] for r in produce} | {r["pid"] for r in takes}
    assert len(pids) == sessions * (n_target + n_drafter), pids  # one process per rank (per start)
    assert all(r["bytes"] > 0 and r["transfer_s"] >= 0 for r in takes)
    here = socket.gethostname()  # where each end ran: calibration prices moves by tier from these
    assert all(r["host"] == here and r["device"] == "cpu" for r in [*produce, *takes])
    ledger = read_ledger(run)
    assert sorted(i for _, ids in ledger for i in ids) == sorted(taken)  # one writer, every trained item
    return s


@pytest.fixture(scope="module")
def one_plus_two(tmp_path_factory: pytest.TempPathFactory, run_inputs) -> tuple[Path, Path]:  # noqa: F811
    d = tmp_path_factory.mktemp("d12")
    cfg = write_cfg(d / "cfg.toml", run_inputs, epochs=1, checkpoint_every=5)
    run = d / "run"
    res = dflash("train", "--config", str(cfg), "--out", str(run), "--n-target", "1", "--n-drafter", "2",
                 "--nproc-per-node", "3", "--wandb", "disabled", run=run)
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("data plane: shm (") == 1  # CPU ranks of one node share memory, said once
    return cfg, run


def test_one_target_two_drafters_train_every_item_once_on_three_processes(one_plus_two) -> None:
    cfg, run = one_plus_two
    s = assert_books_balance(run, 1, 2)
    steps = list(read_records(run, "step"))
    want = {"gate_wait_s", "transfer_s", "drafter_forward_s", "drafter_backward_s", "drafter_compute_s", "optimizer_s"}
    for r in steps:  # every drafter rank's stages, each a time
        assert set(r["rank_stages"]) == {"1", "2"}
        for st in r["rank_stages"].values():
            assert want <= set(st) or "transfer_s" not in st, st  # a rank with an empty take has no transfer
            assert all(v >= 0 for v in st.values())
    assert any(want <= set(st) for r in steps for st in r["rank_stages"].values())
    assert s["stopped_by"] == "data" and s["discarded_at_stop"] == 0
    taken = [i for r in read_records(run, "take") for i in r["item_ids"]]
    assert Counter(taken) == Counter(epoch_items(cfg))  # the whole epoch, each item exactly once
    steps = [r["step"] for r in read_records(run, "step")]
    assert steps == list(range(len(steps)))
    assert (run / "metrics.json").exists() and (run / "drafter").is_dir()


def test_two_targets_two_drafters_balance_their_books(tmp_path: Path, run_inputs) -> None:  # noqa: F811
    cfg = write_cfg(tmp_path / "cfg.toml", run_inputs, max_steps=8, checkpoint_every=4)
    run = tmp_path / "run"
    res = dflash("train", "--config", str(cfg), "--out", str(run), "--n-target", "2", "--n-drafter", "2",
                 "--wandb", "disabled", run=run, env={"DFLASH_DATA_PLANE": "gloo"})  # the copying plane
    assert res.returncode == 0, res.stderr
    assert "data plane: gloo (" in res.stdout
    s = assert_books_balance(run, 2, 2)
    assert s["stopped_by"] == "max_steps" and s["trained"] == 16
    assert "export for serving: dflash export --drafter" in res.stdout

    again = dflash("train", "--resume", str(run), run=run)  # finished: says so, exit 0, nothing changes
    assert again.returncode == 0 and "the run is finished (8 steps" in again.stdout and not again.stderr

    newest = sorted((run / "checkpoint").glob("step-*"))[-1]
    (newest / "state.pt").write_bytes(b"\0" * 2000)  # damaged: the previous verified checkpoint is used
    more = dflash("train", "--resume", str(run), "--max-steps", "12", "--wandb", "disabled", run=run)
    assert more.returncode == 0, more.stderr
    assert "falling back to the previous verified checkpoint step-00000003" in more.stdout
    s = assert_books_balance(run, 2, 2, sessions=2)
    assert s["steps"] == 12 and s["trained"] == 24
    assert [r["step"] for r in read_records(run, "step")] == list(range(12))


def test_a_killed_drafter_rank_resumes_to_the_same_items_each_once(tmp_path: Path, run_inputs,  # noqa: F811
                                                                   one_plus_two) -> None:
    cfg = write_cfg(tmp_path / "cfg.toml", run_inputs, epochs=1, checkpoint_every=5)
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "dflash", "train", "--config", str(cfg), "--out", str(run),
                             "--n-target", "1", "--n-drafter", "2", "--wandb", "disabled"], cwd=ROOT, env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.time() + JOB_TIMEOUT_S
        while time.time() < deadline:
            if len(read_ledger(run)) >= 12 and list((run / "checkpoint").glob("step-*/manifest.json")):
                break
            time.sleep(0.02)
        victim = int((run / ".ranks" / "rank-2.status").read_text().split("pid ")[1].split(")")[0])
        os.kill(victim, signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 1 and err.strip().count("\n") == 0, err
    assert "rank 2" in err and "SIGKILL" in err
    res = dflash("train", "--resume", str(run), "--wandb", "disabled", run=run)
    assert res.returncode == 0, res.stderr
    assert "resumed at step" in res.stdout
    taken = [i for r in read_records(run, "take") for i in r["item_ids"]]
    _, full = one_plus_two
    assert Counter(taken) == Counter(i for r in read_records(full, "take") for i in r["item_ids"])
    assert max(Counter(taken).values()) == 1
    s = next(read_records(run, "summary"))
    assert s["produced"] == s["trained"] + s["skipped_no_anchors"] + s["discarded_at_stop"]
    assert s["discarded_at_stop"] == 0


def test_wrong_world_size_is_one_line_before_any_model_loads(tmp_path: Path, run_inputs) -> None:  # noqa: F811
    cfg = write_cfg(tmp_path / "cfg.toml", run_inputs, max_steps=2)
    run = tmp_path / "run"
    t0 = time.perf_counter()
    res = dflash("train", "--config", str(cfg), "--out", str(run), "--n-target", "1", "--n-drafter", "2",
                 "--nproc-per-node", "2")
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "Traceback" not in res.stderr
    assert "n_target 1 + n_drafter 2 = 3" in res.stderr and "--nproc-per-node (2)" in res.stderr
    assert not run.exists() and time.perf_counter() - t0 < 30
    res = dflash("train", "--config", str(cfg), "--out", str(run), "--drafter-devices", "cuda:1")
    assert res.returncode == 2 and "retired" in res.stderr and "cuda:LOCAL_RANK" in res.stderr


def test_more_cuda_ranks_per_node_than_gpus_is_refused() -> None:
    from dflash.core.errors import ConfigError
    from dflash.pipeline.roles import DATA_GLOO, DATA_HOST, DATA_NCCL, data_plane, device_for

    assert data_plane(0, 3) == DATA_GLOO and data_plane(1, 2) == DATA_HOST and data_plane(4, 3) == DATA_NCCL
    with pytest.raises(ConfigError, match="at most the 2 GPUs"):
        data_plane(2, 3)
    assert device_for(2, 4) == "cuda:2" and device_for(1, 1) == "cuda:0" and device_for(1, 0) == "cpu"


def ddp_cfg(path: Path, inputs: dict[str, Path], n_drafter: int, per_take: int) -> Path:
    """One bucket and FIFO, so drafter 0 takes the oldest item and drafter 1 the next: one process taking two
    items per take trains exactly their union in each step."""
    text = write_cfg(path, inputs, max_steps=3, checkpoint_every=1).read_text()
    text = text.replace("max_len = 128", "max_len = 384").replace("bucket_bounds = [32, 64, 128]",
                                                                   "bucket_bounds = [384]")
    text = text.replace("[queue]\nmin_ready = 3\n", f"[queue]\nmin_ready = 2\npolicy = \"fifo\"\n"
                                                     f"items_per_take = {per_take}\n")
    text = text.replace("n_drafter = 1", f"n_drafter = {n_drafter}")
    path.write_text(text)
    return path


def test_two_ddp_drafter_ranks_equal_one_process_on_the_union(tmp_path: Path, run_inputs) -> None:  # noqa: F811
    import torch

    states, steps = {}, {}
    for name, n_drafter, per_take in (("ddp", 2, 1), ("one", 1, 2)):
        run = tmp_path / name
        res = dflash("train", "--config", str(ddp_cfg(tmp_path / f"{name}.toml", run_inputs, n_drafter, per_take)),
                     "--out", str(run), "--wandb", "disabled", run=run)
        assert res.returncode == 0, res.stderr
        steps[name] = [sorted(i for r in read_records(run, "take") if r["step"] == s for i in r["item_ids"])
                       for s in range(3)]
        states[name] = torch.load(run / "checkpoint" / "step-00000002" / "state.pt", weights_only=False)
    assert steps["ddp"] == steps["one"] and all(len(s) == 2 for s in steps["ddp"])  # the same union each step
    counted = [r["counted_tokens"] for r in read_records(tmp_path / "ddp", "step")]
    assert sum(counted) > 0, "no anchors in any step: the comparison would be vacuous"
    a, b = states["ddp"]["drafter"], states["one"]["drafter"]
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)
    moved = states["ddp"]["optimizer"]["state"]
    assert moved and all(int(s["step"]) == sum(1 for c in counted if c > 0) for s in moved.values())


def test_sigterm_stops_every_rank_with_a_checkpoint_and_the_run_resumes(tmp_path: Path, run_inputs) -> None:  # noqa: F811
    cfg = write_cfg(tmp_path / "cfg.toml", run_inputs, max_steps=10_000, checkpoint_every=1000)
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "dflash", "train", "--config", str(cfg), "--out", str(run),
                             "--n-drafter", "2", "--wandb", "disabled"], cwd=ROOT, env=ENV, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.time() + JOB_TIMEOUT_S
        while time.time() < deadline and len(read_ledger(run)) < 6:
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0 and "stopped by signal SIGTERM" in out and not err, err
    s = assert_books_balance(run, 1, 2)
    assert s["stopped_by"] == "signal SIGTERM"
    last = sorted((run / "checkpoint").glob("step-*"))[-1]
    assert last.name == f"step-{s['steps'] - 1:08d}"  # checkpointed at the step it stopped after


def test_a_run_killed_before_its_first_checkpoint_starts_again_in_place(tmp_path: Path, run_inputs) -> None:  # noqa: F811
    cfg = write_cfg(tmp_path / "cfg.toml", run_inputs, max_steps=3)
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"seed": 3}))  # what a start leaves before its first checkpoint
    (run / "produce.jsonl").write_text('{"kind": "produce", "item_id": "0:0:0"}\n')
    (run / "ledger.jsonl").write_text('{"step": 0, "item_ids": ["0:0:0"]}\n')
    res = dflash("train", "--resume", str(run))
    assert res.returncode == 2 and res.stderr.count("\n") == 1
    assert f"starts again in place with --out {run}" in res.stderr
    res = dflash("train", "--config", str(cfg), "--out", str(run), "--wandb", "disabled", run=run)
    assert res.returncode == 0, res.stderr
    assert "starting it again in place" in res.stdout
    s = assert_books_balance(run, 1, 1)
    assert s["steps"] == 3 and len(read_ledger(run)) == 3
