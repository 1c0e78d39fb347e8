"""Every failure surfaces and nothing hangs: a fault injected at each thread's site (dflash/pipeline/faults.py,
``DFLASH_FAULT=<site>:<n>``) of a real CPU job stops the job within seconds, the launcher's one line names the
failing rank and its traceback file (which holds the injected exception), and ``--resume`` then finishes with
the ledger exact: steps 0..N-1 once each, every item trained once.

The 1 + 1 case of the producer's reader thread (the one that used to die silently) is in the default set;
the other sites and the 1 + 2 job are slow-marked (each case is a failed job plus a resumed one).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash.pipeline.faults import SITES
from dflash.pipeline.ledger import read_ledger
from dflash.pipeline.rank import RANKS_DIR
from tests.test_resume_and_control import run_inputs, write_cfg  # noqa: F401 - the fixture

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "DFLASH_WAIT_S": "60", "OMP_NUM_THREADS": "1"}
STEPS = 5
STOP_S = 30  # from the failing rank's failure to the launcher's exit
CLOCKED = ("status.write", "heartbeat.beat")


def dflash(*args: str, fault: str | None = None) -> subprocess.CompletedProcess:
    env = {**ENV, **({"DFLASH_FAULT": fault} if fault else {})}
    return subprocess.run([sys.executable, "-m", "dflash", *args, "--wandb", "disabled"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def fault_case(tmp_path: Path, inputs: dict, site: str, n: int, n_drafter: int, on: int | None = None) -> dict:
    # a thread that runs on a clock (the status writer, the heartbeat) fails some seconds into the run: a longer run
    steps, every = (40, 4) if site in CLOCKED else (STEPS, 1)
    cfg = write_cfg(tmp_path / "cfg.toml", inputs, max_steps=steps, checkpoint_every=every)
    cfg.write_text(cfg.read_text().replace("n_drafter = 1", f"n_drafter = {n_drafter}"))
    run = tmp_path / "run"
    t0 = time.perf_counter()
    failed = dflash("train", "--config", str(cfg), "--out", str(run), fault=f"{site}:{n}" + (f"@{on}" if on is not None
                                                                                              else ""))
    ended = time.time()
    first_s = time.perf_counter() - t0
    assert failed.returncode == 1, (failed.returncode, failed.stderr[-3000:])
    line = failed.stderr.strip()
    assert "\n" not in line and "Traceback" not in line, line
    assert "(traceback: " in line, line
    tb = Path(line.split("(traceback: ")[1].split(")")[0])
    rank = int(tb.name.split("-")[1].split(".")[0])
    assert tb.parent == run / RANKS_DIR and tb.is_file() and f"rank {rank}" in line
    assert "InjectedFault" in tb.read_text() and site in tb.read_text()
    failed_t = json.loads((run / RANKS_DIR / f"rank-{rank}.error").read_text())["t"]  # when the thread failed
    stop_s = ended - failed_t
    assert stop_s < STOP_S, f"the job took {stop_s:.1f} s to stop after rank {rank} failed"
    t0 = time.perf_counter()
    resumed = (run / "checkpoint").is_dir() and any((run / "checkpoint").iterdir())
    if resumed:
        again = dflash("train", "--resume", str(run), "--max-steps", str(steps))
    else:  # it failed before its first checkpoint (the abort is that fast): the CLI's way is to start again in place
        again = dflash("train", "--config", str(cfg), "--out", str(run))
    resume_s = time.perf_counter() - t0
    assert again.returncode == 0, again.stderr[-3000:]
    ledger = read_ledger(run)
    assert [s for s, _ in ledger] == list(range(steps))
    ids = [i for _, items in ledger for i in items]
    assert len(ids) == len(set(ids)) and ids, "an item was trained twice (or none was)"
    got = {"site": site, "n_drafter": n_drafter, "rank": rank, "stop_s": round(stop_s, 1), "resumed": resumed,
           "failed_job_s": round(first_s, 1), "resume_s": round(resume_s, 1)}
    print(f"fault case {got}")  # the figures the report states (pytest -s)
    return got


def test_a_fault_in_the_producers_reader_thread_stops_the_job_names_the_rank_and_resumes(tmp_path, run_inputs):  # noqa: F811
    got = fault_case(tmp_path, run_inputs, "producer.post_send", 3, 1)
    assert got["rank"] == 0  # the target rank


# (site, pass, drafters, the rank the fault is planned on (None: the site's role decides), the rank that fails)
# In a 1 + 1 job rank 0 is the target and rank 1 the host drafter; in a 1 + 2 job rank 2 is the second drafter.
MATRIX = [
    ("producer.make", 7, 1, None, 0),
    ("producer.send_wait", 3, 1, None, 0),
    ("drafter.step", 3, 1, None, 1),
    ("drafter.release", 2, 1, None, 1),
    ("coordinator.handle", 16, 1, None, 1),
    ("status.write", 12, 1, 0, 0),
    ("heartbeat.beat", 2, 1, 1, 1),
    ("producer.make", 7, 2, None, 0),
    ("producer.post_send", 3, 2, None, 0),
    ("producer.send_wait", 3, 2, None, 0),
    ("drafter.step", 3, 2, 2, 2),
    ("drafter.release", 2, 2, 2, 2),
    ("coordinator.handle", 16, 2, None, 1),
    ("status.write", 12, 2, 2, 2),
    ("heartbeat.beat", 2, 2, 0, 0),
]


@pytest.mark.slow
@pytest.mark.parametrize("site, n, n_drafter, on, rank", MATRIX)
def test_the_fault_matrix(tmp_path, run_inputs, site, n, n_drafter, on, rank):  # noqa: F811
    got = fault_case(tmp_path, run_inputs, site, n, n_drafter, on)
    assert got["rank"] == rank, got


def test_every_site_is_in_the_matrix_and_a_bad_plan_is_refused(monkeypatch):
    from dflash.pipeline import faults

    in_jobs = {"producer.post_send"} | {site for site, *_ in MATRIX}
    assert in_jobs | {"telemetry.sample"} == set(SITES)  # NVML runs on CUDA ranks only: its test is below
    for n_drafter in (1, 2):  # every site that a CPU job passes, in a 1 + 1 and a 1 + 2 job
        assert {site for site, _, d, *_ in MATRIX if d == n_drafter} | {"producer.post_send"} == in_jobs
    monkeypatch.setenv(faults.FAULT_ENV, "nowhere:1")
    with pytest.raises(ValueError, match="DFLASH_FAULT"):
        faults.fault("drafter.step")
