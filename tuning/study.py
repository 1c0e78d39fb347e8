"""Storage, samplers and the worker loop that brings a study to exactly N complete trials.

Why our own loop rather than ``study.optimize(n_trials=...)``: ``n_trials`` counts per call, so a
killed sweep restarted with the same arguments would overshoot, and concurrent workers would too.
Each worker here, under a study-wide lock, (1) fails trials left RUNNING by dead workers and
re-queues their parameters, (2) counts COMPLETE and live RUNNING trials, and (3) asks for a new
trial only while complete + running < target. So the study ends with exactly ``target`` complete
trials, across restarts and across any number of workers and machines, and no parameter set of a
dead worker is lost. The lock is a file lock for the journal and SQLite storages (one machine) and
a PostgreSQL advisory lock for RDB URLs (many machines).

Liveness: each running trial carries its worker's host and pid and a heartbeat time that a
background thread refreshes. A RUNNING trial is stale when its pid is gone on this host, or its
heartbeat is older than ``GRACE_S`` (any host). Optuna's own heartbeats exist only for RDB storages
and only inside ``study.optimize``; this works for every storage.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import math
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import optuna
from optuna.storages import JournalStorage, RDBStorage
from optuna.storages.journal import JournalFileBackend
from optuna.trial import TrialState

from dflash.core.errors import ConfigError

HEARTBEAT_S = 5.0
GRACE_S = 60.0
POLL_S = 0.2
HOST = socket.gethostname()

optuna.logging.set_verbosity(optuna.logging.WARNING)


# --------------------------------------------------------------------------- storage
def storage_url_or_default(url: str | None, out_dir: Path) -> str:
    """None -> a journal file in the output directory (no set-up, safe for several processes)."""
    return url if url else str(out_dir / "study.journal")


def open_storage(url: str) -> optuna.storages.BaseStorage:
    if url.startswith(("postgresql://", "postgresql+psycopg2://")):
        # SQLAlchemy 2.1 maps a bare postgresql:// to psycopg 3; we ship psycopg2 (binary wheels).
        engine_url = "postgresql+psycopg2://" + url.removeprefix("postgresql://") \
            if url.startswith("postgresql://") else url
        try:
            # Workers starting together on an empty database would race creating the schema.
            with study_lock(url, "dflash-schema") if url.startswith("postgresql") else contextlib.nullcontext():
                return RDBStorage(engine_url, engine_kwargs={"pool_pre_ping": True})
        except Exception as exc:
            raise ConfigError("--storage", f"cannot open RDB storage ({type(exc).__name__}: "
                              f"{str(exc).splitlines()[0][:120]})", url) from None
    if url.startswith("sqlite:///"):
        return RDBStorage(url)
    if "://" in url:
        raise ConfigError("--storage", "must be a journal file path, sqlite:///PATH or postgresql://URL", url)
    path = Path(url)
    if path.exists() and path.is_dir():
        raise ConfigError("--storage", "a journal storage path must be a file, not a directory", url)
    path.parent.mkdir(parents=True, exist_ok=True)
    return JournalStorage(JournalFileBackend(str(path)))


@contextlib.contextmanager
def study_lock(url: str, study_name: str) -> Iterator[None]:
    """Serialises count-then-ask across every worker of one study."""
    if url.startswith("postgresql"):
        import psycopg2

        dsn = url.replace("postgresql+psycopg2://", "postgresql://")
        key = int.from_bytes(hashlib.sha256(study_name.encode()).digest()[:8], "big", signed=True)
        conn = psycopg2.connect(dsn)
        try:
            with conn.cursor() as cur:
                cur.execute("SELECT pg_advisory_lock(%s)", (key,))
            yield
        finally:
            with contextlib.suppress(Exception), conn.cursor() as cur:
                cur.execute("SELECT pg_advisory_unlock(%s)", (key,))
            conn.close()
        return
    path = url.removeprefix("sqlite:///") + f".{study_name}.lock"
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# --------------------------------------------------------------------------- liveness
def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def is_stale(trial: optuna.trial.FrozenTrial, now: float) -> bool:
    attrs = trial.user_attrs
    host, pid, beat = attrs.get("worker_host"), attrs.get("worker_pid"), attrs.get("heartbeat")
    if host is None or pid is None:  # asked but not yet claimed: give it the grace period
        start = trial.datetime_start.timestamp() if trial.datetime_start else now
        return now - start > GRACE_S
    if host == HOST and not _pid_alive(int(pid)):
        return True
    return beat is not None and now - float(beat) > GRACE_S


def fail_stale_and_requeue(study: optuna.Study) -> int:
    """Fail RUNNING trials of dead workers and queue their parameters again (first in line)."""
    now = time.time()
    n = 0
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if is_stale(t, now):
            study._storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
            study.enqueue_trial(t.params, user_attrs={"requeued_from": t.number}, skip_if_exists=False)
            n += 1
    return n


class Heartbeat:
    """Refreshes a running trial's heartbeat attribute until stopped."""

    def __init__(self, study: optuna.Study, trial: optuna.Trial) -> None:
        self._storage = study._storage
        self._trial_id = trial._trial_id
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            with contextlib.suppress(Exception):  # a transient storage error must not kill the trial
                self._storage.set_trial_user_attr(self._trial_id, "heartbeat", time.time())

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


# --------------------------------------------------------------------------- the loop
def counts(study: optuna.Study) -> tuple[int, int]:
    trials = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.RUNNING))
    complete = sum(t.state == TrialState.COMPLETE for t in trials)
    return complete, len(trials) - complete


def run_worker(study: optuna.Study, url: str, target: int,
               objective: Callable[[optuna.Trial], tuple[list[float], dict[str, float]]],
               on_done: Callable[[], None] | None = None) -> int:
    """Run trials until the study has ``target`` complete ones; returns trials this worker completed.

    ``objective`` returns (values, named constraint values); constraints are set on the trial
    (Optuna 5's ``Trial.set_constraint``) before ``tell``, so samplers see them.
    """
    done = 0
    while True:
        with study_lock(url, study.study_name):
            fail_stale_and_requeue(study)
            complete, running = counts(study)
            if complete >= target:
                return done
            trial = study.ask() if complete + running < target else None
            if trial is not None:
                trial.set_user_attr("worker_host", HOST)
                trial.set_user_attr("worker_pid", os.getpid())
                trial.set_user_attr("heartbeat", time.time())
        if trial is None:  # the rest is running elsewhere; wait in case one of them dies
            time.sleep(POLL_S)
            continue
        try:
            with Heartbeat(study, trial):
                values, constraints = objective(trial)
            for name, value in constraints.items():
                trial.set_constraint(name, value)
            if not all(math.isfinite(v) for v in values):
                study.tell(trial, state=TrialState.FAIL)
                continue
            study.tell(trial, values)
            done += 1
            if on_done is not None:
                on_done()
        except optuna.TrialPruned:
            study.tell(trial, state=TrialState.PRUNED)
        except Exception:
            study.tell(trial, state=TrialState.FAIL)
            raise


class _Grid(optuna.samplers.GridSampler):
    """GridSampler without its ``study.stop()`` at the end of the grid: that call only works
    inside ``study.optimize``, and our worker loop stops by counting trials instead."""

    def after_trial(self, study: optuna.Study, trial: optuna.trial.FrozenTrial, state: TrialState,
                    values: Any) -> None:
        return None


def make_optuna_sampler(name: str, seed: int, grid: dict[str, list[Any]] | None = None
                        ) -> optuna.samplers.BaseSampler:
    """Samplers are set explicitly (Optuna 5's multi-objective default changed to TPE)."""
    if name == "grid":
        assert grid is not None
        return _Grid(grid, seed=seed)
    if name == "tpe":
        return optuna.samplers.TPESampler(seed=seed, multivariate=True)
    return optuna.samplers.NSGAIISampler(seed=seed)


def feasible(trial: optuna.trial.FrozenTrial) -> bool:
    """All constraints <= 0; a trial with none recorded (an old or foreign one) is not trusted."""
    values = trial.constraints
    return bool(values) and all(c <= 0 for c in values.values())
