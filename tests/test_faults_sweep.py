"""Sweep faults (issue #20 items 1 and 7): concurrent starters, restarts, killed parents, duplicates.

Contracts held here: N workers and any number of restarts produce only distinct configurations;
one worker that is never restarted is bit-reproducible from the seed; a configuration already run
(compared after clamping) is not run again; starters racing on a new storage (journal, SQLite,
PostgreSQL) all succeed; killing a sweep's parent kills its workers, and the next start finishes
the study with the dead trials re-run.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from dflash.cli import main
from dflash.core.config import load_config
from tests.conftest import left_in_session, sigint_default
from tuning.study import open_storage
from tuning.sweep import SweepArgs, join_as_worker, open_study, run_sweep

ROOT = Path(__file__).resolve().parent.parent
PG_URL = os.environ.get("DFLASH_TEST_POSTGRES_URL")

TOML = """
seed = {seed}
[workload]
lengths = "lognormal"
n_sequences = 800
[cluster]
n_target = 4
n_drafter = 4
[timing]
target_per_token_s = 3.7e-5
target_noise = "deterministic"
drafter_noise = "deterministic"
[sweep]
seeds_per_trial = 1
sim_seconds = {sim_seconds}
{extra}
"""
SPACE = "space = { min_ready = { low = 1, high = 60 }, policy = [\"random_item\", \"fifo\"] }"


def write_cfg(d: Path, *, seed: int = 0, sim_seconds: float = 300, extra: str = SPACE) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    p = d / "sweep.toml"
    p.write_text(TOML.format(seed=seed, sim_seconds=sim_seconds, extra=extra))
    return p


def sweep(cfg: Path, out: Path, trials: int, workers: int = 1, storage: str | None = None) -> dict:
    args = SweepArgs(trials=trials, storage=storage or str(out / "study.journal"), study="s", workers=workers,
                     grid=False, out=out, calibration=None)
    return run_sweep(load_config(cfg), args, progress=False)


def trials_of(storage: str, study: str = "s") -> list[optuna.trial.FrozenTrial]:
    return optuna.load_study(study_name=study, storage=open_storage(storage)).get_trials(deepcopy=False)


def queues(trials: list[optuna.trial.FrozenTrial]) -> list[str]:
    """The effective queue each COMPLETE trial ran, as comparable text."""
    return [json.dumps({k: v for k, v in t.user_attrs.items() if k.startswith("queue_")}, sort_keys=True)
            for t in trials if t.state == TrialState.COMPLETE]


def assert_distinct(storage: str, complete: int) -> list[optuna.trial.FrozenTrial]:
    trials = trials_of(storage)
    runs = queues(trials)
    assert len(runs) == complete and len(set(runs)) == complete, "a configuration was run twice"
    for t in trials:  # a PRUNED trial is a proposal that repeated one already run or running
        if t.state == TrialState.PRUNED:
            assert t.user_attrs["duplicate_of"] in {u.number for u in trials}
    return trials


def test_two_workers_then_a_restart_run_only_distinct_configurations(tmp_path: Path) -> None:
    cfg = write_cfg(tmp_path)
    out = tmp_path / "out"
    assert sweep(cfg, out, trials=8, workers=2)["complete"] == 8
    assert sweep(cfg, out, trials=14)["complete"] == 14
    trials = assert_distinct(str(out / "study.journal"), 14)
    study = optuna.load_study(study_name="s", storage=open_storage(str(out / "study.journal")))
    assert study.user_attrs["sampler_streams"] == 3  # two workers, then one restart: three streams
    pids = {study.user_attrs[f"sampler_stream_{k}"]["pid"] for k in range(3)}
    assert len(pids) == 3
    assert len({t.user_attrs["worker_pid"] for t in trials if t.state == TrialState.COMPLETE}) == 3
    tuned = [c["queue"] for c in json.loads((out / "selection.json").read_text())["configs"]
             if c["name"].startswith("tuned-")]
    assert len(tuned) == 3 and len({json.dumps(q, sort_keys=True) for q in tuned}) == 3  # no tuned-1 == tuned-2


def test_one_worker_without_restart_is_bit_reproducible_from_the_seed(tmp_path: Path) -> None:
    def run(d: Path, seed: int) -> list[tuple]:
        out = d / "out"
        sweep(write_cfg(d, seed=seed), out, trials=6)
        return [(t.number, t.state, t.params, t.values) for t in trials_of(str(out / "study.journal"))]

    first, again, other = run(tmp_path / "a", 0), run(tmp_path / "b", 0), run(tmp_path / "c", 1)
    assert first == again
    assert [p for _, _, p, _ in first] != [p for _, _, p, _ in other]


def test_a_configuration_repeated_after_clamping_is_not_run_again(tmp_path: Path, capsys: pytest.CaptureFixture
                                                                  ) -> None:
    """max_depth fixed at 5: min_ready 1..40 clamps to 1..5, so the space holds 5 distinct queues. TPE
    in a space this small keeps proposing its favourite; the study still ends with all 5, each once."""
    cfg = write_cfg(tmp_path, extra='sampler = "tpe"\nspace = { min_ready = { low = 1, high = 40 }, '
                                    "max_depth = { low = 5, high = 5 } }")
    assert main(["sweep", "--config", str(cfg), "--trials", "9", "--study", "s", "--out", str(tmp_path / "o")]) == 0
    assert "holds only 5 distinct configurations" in capsys.readouterr().out
    trials = assert_distinct(str(tmp_path / "o" / "study.journal"), 5)
    assert sorted(t.user_attrs["queue_min_ready"] for t in trials if t.state == TrialState.COMPLETE) == [1, 2, 3, 4, 5]


def _open_at_once(cfg_path: str, storage: str, study: str, barrier: mp.synchronize.Barrier,
                  results: mp.Queue) -> None:
    cfg = load_config(cfg_path)
    args = SweepArgs(trials=1, storage=storage, study=study, workers=1, grid=False, out=Path(cfg_path).parent,
                     calibration=None)
    barrier.wait()
    try:
        results.put(join_as_worker(open_study(cfg, args), cfg, args))
    except Exception as exc:  # reported to the test, which names it
        results.put(f"{type(exc).__name__}: {exc}")


@contextlib.contextmanager
def fresh_postgres_database(url: str) -> Iterator[str]:
    """A new, empty database on the test server (no Optuna tables yet), dropped afterwards."""
    import psycopg2

    from tuning.study import libpq_dsn

    name = f"dflash_race_{os.getpid()}_{time.time_ns() % 10**9}"
    admin = psycopg2.connect(libpq_dsn(url))
    admin.autocommit = True
    with admin.cursor() as cur:
        cur.execute(f"CREATE DATABASE {name}")
    try:
        yield url.rsplit("/", 1)[0] + "/" + name
    finally:
        with admin.cursor() as cur:
            cur.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        admin.close()


@pytest.mark.parametrize("backend", ["journal", "sqlite", pytest.param("postgresql", marks=pytest.mark.skipif(
    not PG_URL, reason="needs DFLASH_TEST_POSTGRES_URL (.ci/run starts PostgreSQL and sets it)"))])
def test_starters_racing_on_a_new_storage_all_succeed_with_their_own_streams(tmp_path: Path, backend: str) -> None:
    """Four processes released by one barrier create the storage, its schema and the study at once
    (PostgreSQL: in a database created empty for the test), and each gets a stream of its own."""
    cfg = write_cfg(tmp_path)
    with (fresh_postgres_database(PG_URL) if backend == "postgresql" else contextlib.nullcontext("")) as pg:
        storage = {"journal": str(tmp_path / "new" / "s.journal"), "sqlite": f"sqlite:///{tmp_path / 'new' / 's.db'}",
                   "postgresql": pg}[backend]
        ctx = mp.get_context("fork")
        barrier, results = ctx.Barrier(4), ctx.Queue()
        procs = [ctx.Process(target=_open_at_once, args=(str(cfg), storage, "s", barrier, results)) for _ in range(4)]
        for p in procs:
            p.start()
        got = [results.get(timeout=120) for _ in procs]
        for p in procs:
            p.join(30)
    assert sorted(got, key=str) == [0, 1, 2, 3], got


def test_two_sweep_processes_on_a_new_sqlite_file_share_one_study(tmp_path: Path) -> None:
    cfg = write_cfg(tmp_path)
    url = f"sqlite:///{tmp_path / 'study.db'}"
    cmd = [sys.executable, "-m", "dflash", "sweep", "--config", str(cfg), "--trials", "8", "--study", "s",
           "--storage", url]
    procs = [subprocess.Popen([*cmd, "--out", str(tmp_path / f"o{i}")], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0 and "Traceback" not in err, err
    assert_distinct(url, 8)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead, only not yet reaped
        return f.read().split(")")[-1].split()[0] != "Z"


def _start_and_wait_for_two_workers(cmd: list[str], storage: str, **popen: object) -> tuple[subprocess.Popen, set[int]]:
    parent = subprocess.Popen(cmd, cwd=ROOT, **popen)  # type: ignore[call-overload]
    workers: set[int] = set()
    deadline = time.time() + 120
    while time.time() < deadline and len(workers) < 2:
        time.sleep(0.1)
        try:
            workers = {t.user_attrs["worker_pid"] for t in trials_of(storage)
                       if t.state == TrialState.RUNNING and "worker_pid" in t.user_attrs}
        except (KeyError, ValueError):  # the study is not in the journal yet
            continue
    assert len(workers) == 2, "never saw both workers running a trial"
    return parent, workers


def _gone(pids: set[int], within_s: float) -> bool:
    deadline = time.time() + within_s
    while time.time() < deadline and any(_alive(pid) for pid in pids):
        time.sleep(0.1)
    return not any(_alive(pid) for pid in pids)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_killing_the_parent_kills_its_workers_and_a_restart_finishes_distinct(tmp_path: Path) -> None:
    cfg = write_cfg(tmp_path, sim_seconds=3600)
    out = tmp_path / "out"
    storage = str(out / "study.journal")
    cmd = [sys.executable, "-m", "dflash", "sweep", "--config", str(cfg), "--trials", "6", "--study", "s",
           "--workers", "2", "--out", str(out)]
    parent, workers = _start_and_wait_for_two_workers(cmd, storage, stdout=subprocess.DEVNULL,
                                                      stderr=subprocess.DEVNULL)
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    assert _gone(workers, 10), "workers outlived their parent"
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    trials = assert_distinct(storage, 6)
    failed = [t for t in trials if t.state == TrialState.FAIL]
    assert len(failed) >= 2 and all(t.user_attrs["worker_pid"] in workers for t in failed)
    requeued = {t.user_attrs["requeued_from"] for t in trials if "requeued_from" in t.user_attrs}
    assert {t.number for t in failed} <= requeued


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_ctrl_c_stops_parent_and_workers_in_one_line(tmp_path: Path) -> None:
    """SIGINT to the whole process group (what a terminal's Ctrl-C does): exit 130, one line, no
    traceback from the parent or either worker, and no worker left running."""
    cfg = write_cfg(tmp_path, sim_seconds=3600)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "dflash", "sweep", "--config", str(cfg), "--trials", "6", "--study", "s",
           "--workers", "2", "--out", str(out)]
    parent, workers = _start_and_wait_for_two_workers(cmd, str(out / "study.journal"), stdout=subprocess.DEVNULL,
                                                      stderr=subprocess.PIPE, text=True, start_new_session=True,
                                                      preexec_fn=sigint_default)
    os.killpg(parent.pid, signal.SIGINT)
    _, err = parent.communicate(timeout=30)
    assert parent.returncode == 130 and err == "dflash sweep: interrupted\n", err
    assert _gone(workers, 10), "workers outlived an interrupted parent"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("to", ["parent", "group", pytest.param("parent, then restart", marks=pytest.mark.slow)])
def test_sigterm_stops_parent_and_workers_in_one_line_and_a_restart_completes_the_exact_count(tmp_path: Path,
                                                                                             to: str) -> None:
    """SIGTERM, as a cluster stops a job (issue #38): to the parent alone (``kill PID``, Slurm's
    ``--signal=B:TERM``), which forwards it to its workers, or to the whole process group (``scancel``,
    ``kill -TERM -PGID``). Exit 143, the one line, no traceback from anyone, nothing of the sweep left
    running; the next start finishes the study with exactly the trials asked for, each configuration once
    (the slow case: after the harder stop, the parent alone, which must forward it)."""
    cfg = write_cfg(tmp_path, sim_seconds=1200)
    out = tmp_path / "out"
    storage = str(out / "study.journal")
    cmd = [sys.executable, "-m", "dflash", "sweep", "--config", str(cfg), "--trials", "6", "--study", "s",
           "--workers", "2", "--out", str(out)]
    parent, workers = _start_and_wait_for_two_workers(cmd, storage, stdout=subprocess.DEVNULL,
                                                      stderr=subprocess.PIPE, text=True, start_new_session=True)
    if to.startswith("parent"):
        parent.send_signal(signal.SIGTERM)
    else:
        os.killpg(parent.pid, signal.SIGTERM)
    _, err = parent.communicate(timeout=60)
    assert parent.returncode == 143 and err == "dflash sweep: terminated\n", err
    assert not left_in_session(parent.pid, 10), "sweep processes outlived a terminated parent"
    if not to.endswith("restart"):
        return
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    trials = assert_distinct(storage, 6)  # exactly 6 complete, none run twice
    stopped = [t for t in trials if t.state == TrialState.FAIL]
    assert stopped and all(t.user_attrs["worker_pid"] in workers for t in stopped)
    assert {t.number for t in stopped} <= {t.user_attrs.get("requeued_from") for t in trials}


def test_no_feasible_configuration_is_exit_2_without_a_selection(tmp_path: Path, capsys: pytest.CaptureFixture
                                                                 ) -> None:
    """Drafters that must never wait at the gate: no configuration qualifies, so nothing is selected."""
    cfg = write_cfg(tmp_path, extra=f"max_gate_wait_frac = 1e-9\n{SPACE}")
    out = tmp_path / "o"
    assert main(["sweep", "--config", str(cfg), "--trials", "3", "--study", "s", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no feasible configuration among 3" in err and "starved in 3" in err
    assert not (out / "selection.json").exists() and (out / "trials.parquet").is_file()


def test_a_worker_whose_trial_was_taken_over_as_stale_keeps_going(tmp_path: Path) -> None:
    """Another worker failed our running trial as stale (a long pause, a slow network) and queued it
    again: our late result is dropped without an error, and the re-queued copy is what counts."""
    from tuning.study import run_worker

    study = optuna.create_study(storage=open_storage(str(tmp_path / "s.journal")), study_name="s")
    url = str(tmp_path / "s.journal")

    def propose(trial: optuna.Trial) -> tuple[str, int]:
        x = trial.suggest_int("x", 0, 1000)
        return str(x), x

    def objective(trial: optuna.Trial, x: int) -> tuple[list[float], dict[str, float]]:
        if trial.number == 0:  # what the other worker does meanwhile
            study.tell(trial.number, state=TrialState.FAIL)
            study.enqueue_trial(trial.params, user_attrs={"requeued_from": trial.number})
        return [float(x)], {}

    assert run_worker(study, url, 3, propose, objective) == 3
    trials = study.get_trials(deepcopy=False)
    assert trials[0].state == TrialState.FAIL and trials[1].user_attrs["requeued_from"] == 0
    assert trials[1].params == trials[0].params and trials[1].state == TrialState.COMPLETE
    assert sum(t.state == TrialState.COMPLETE for t in trials) == 3


@pytest.mark.parametrize("url", ["missing/s.journal", "sqlite:///missing/s.db"])
def test_a_reader_opening_a_missing_storage_creates_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            url: str) -> None:
    from dflash.core.errors import ConfigError

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as err:
        open_storage(url, create=False)
    assert err.value.key == "--storage" and list(tmp_path.iterdir()) == []
