"""A rank's unexpected exception leaves its full traceback, named by the one-line error, kept across --resume.

The first GPU run's crash showed one line and nothing else: the rank's traceback was kept nowhere,
and a resume cleared ``RUN/.ranks``. The end-to-end case is a real 1 + 1 CPU job whose model file is
damaged between a checkpoint and the resume (every rank fails loading it: an unexpected exception,
not a config error); the resume after the repair must keep the failed start's tracebacks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dflash.core.config import DflashConfig
from dflash.core.errors import ConfigError
from dflash.pipeline.rank import RANKS_DIR, RunSpec, _report_failure, archive_tracebacks
from dflash.pipeline.workers import Status
from tests.test_resume_and_control import run_inputs, write_cfg  # noqa: F401 - the fixture

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "DFLASH_WAIT_S": "60", "OMP_NUM_THREADS": "1"}


def dflash(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dflash", *args, "--wandb", "disabled"], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=300)


def _fail(run: Path, exc: BaseException) -> dict:
    (run / RANKS_DIR).mkdir(parents=True, exist_ok=True)
    status = Status(run / RANKS_DIR / "rank-1.status", 1)
    try:
        raise exc
    except BaseException as raised:  # a real traceback, as rank_main has it
        _report_failure(run, 1, RunSpec(DflashConfig(), str(run)), status, raised)
    return json.loads((run / RANKS_DIR / "rank-1.error").read_text())


def test_an_unexpected_error_names_its_traceback_file_and_a_config_error_stays_one_line(tmp_path: Path) -> None:
    err = _fail(tmp_path / "a", RuntimeError("boom"))
    tb = tmp_path / "a" / RANKS_DIR / "rank-1.traceback"
    assert err["line"].endswith(f"RuntimeError: boom (traceback: {tb})") and not err["config"]
    text = tb.read_text()
    assert "Traceback (most recent call last)" in text and "raise exc" in text and text.count("RuntimeError: boom") == 2

    err = _fail(tmp_path / "b", ConfigError("train.lr", "must be > 0", -1))
    assert err["config"] and "traceback" not in err["line"] and "train.lr" in err["line"]
    assert not list((tmp_path / "b" / RANKS_DIR).glob("*.traceback"))


def test_archived_tracebacks_are_never_overwritten(tmp_path: Path) -> None:
    ranks = tmp_path / RANKS_DIR
    ranks.mkdir()
    for attempt in range(3):  # three failed starts within one second: three files
        (ranks / "rank-0.traceback").write_text(f"attempt {attempt}")
        (ranks / "rank-2.traceback").write_text(f"other rank {attempt}")
        archive_tracebacks(ranks, rank=0)  # under torchrun each rank archives its own
    kept = sorted(p.read_text() for p in (ranks / "earlier").iterdir())
    assert kept == ["attempt 0", "attempt 1", "attempt 2"]
    assert (ranks / "rank-2.traceback").read_text() == "other rank 2"


@pytest.mark.slow  # two real jobs (~40-90 s): keeps the default set under 10 minutes
def test_a_failed_rank_leaves_its_traceback_and_a_resume_keeps_it(tmp_path: Path, run_inputs) -> None:  # noqa: F811
    cfg = write_cfg(tmp_path / "cfg.toml", run_inputs, max_steps=2, checkpoint_every=1)
    run = tmp_path / "run"
    assert (res := dflash("train", "--config", str(cfg), "--out", str(run))).returncode == 0, res.stderr
    weights = Path(run_inputs["model"]) / "model.safetensors"
    good = weights.read_bytes()
    try:
        weights.write_bytes(good[: len(good) // 2])  # damaged on disk: loading it raises inside every rank
        failed = dflash("train", "--resume", str(run), "--max-steps", "4")
    finally:
        weights.write_bytes(good)
    assert failed.returncode == 1 and failed.stderr.count("\n") == 1 and "Traceback" not in failed.stderr
    named = Path(failed.stderr.split("(traceback: ")[1].split(")")[0])
    assert named.parent == run / RANKS_DIR and named.name.endswith(".traceback")
    text = named.read_text()
    assert "Traceback (most recent call last)" in text and "safetensors" in text.lower()

    again = dflash("train", "--resume", str(run), "--max-steps", "4")
    assert again.returncode == 0, again.stderr
    kept = list((run / RANKS_DIR / "earlier").glob(f"{named.stem}.*.traceback"))
    assert len(kept) == 1 and kept[0].read_text() == text
    assert not list((run / RANKS_DIR).glob("rank-*.traceback"))  # this start failed nowhere
