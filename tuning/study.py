"""Storage, samplers and the worker loop that brings a study to exactly N complete, distinct trials.

Why our own loop rather than ``study.optimize(n_trials=...)``: ``n_trials`` counts per call, so a
killed sweep restarted with the same arguments would overshoot, and concurrent workers would too.
Each worker here, under a study-wide lock, (1) fails trials left RUNNING by dead workers and
re-queues their parameters, (2) counts COMPLETE and live RUNNING trials, and (3) asks for a new
trial only while complete + running < target, and claims it only if no COMPLETE or live RUNNING
trial runs the same configuration. So the study ends with exactly ``target`` complete trials of
distinct configurations, across restarts and across any number of workers and machines, and no
parameter set of a dead worker is lost. The lock is a file lock for the journal and SQLite
storages (one machine) and a PostgreSQL advisory lock for RDB URLs (many machines).

Sampler streams: a seeded sampler restarted with its seed replays its sequence, and two workers
with one seed propose the same pairs. Each worker of each start therefore claims its own stream
index from the storage (:func:`claim_stream`) and seeds its sampler from the study seed and that
index (:func:`stream_seed`); index 0 is the seed itself, so one worker that is never restarted
is bit-reproducible from the seed.

Liveness: each running trial carries its worker's host and pid and a heartbeat time that a
background thread refreshes. A RUNNING trial is stale when its pid is gone on this host, or its
heartbeat is older than ``GRACE_S`` (any host). Optuna's own heartbeats exist only for RDB storages
and only inside ``study.optimize``; this works for every storage. Worker processes end with the
process that started them (:func:`die_with_parent`).

Only public Optuna API is used here (no ``study._storage``, no trial ids).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import math
import os
import signal
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
CONFIG_KEY = "config_key"  # user attribute: the configuration a trial runs, as its key
STUCK_AFTER = 3  # duplicate proposals in a row before the next trial is drawn at random
GIVE_UP_AFTER = 1000  # ... and before the worker stops (the space is exhausted or the key is wrong)
PR_SET_PDEATHSIG = 1  # linux/prctl.h

optuna.logging.set_verbosity(optuna.logging.WARNING)


# --------------------------------------------------------------------------- storage
POSTGRES_PREFIXES = ("postgresql://", "postgresql+psycopg2://")
SQLITE_PREFIX = "sqlite:///"
SCHEMA_LOCK = "dflash-schema"  # the study_lock name that serialises creating a storage's tables
CONNECT_TIMEOUT_S = 10


def storage_url_or_default(url: str | None, out_dir: Path) -> str:
    """None -> a journal file in the output directory (no set-up, safe for several processes)."""
    return url if url else str(out_dir / "study.journal")


def sqlalchemy_url(url: str) -> str:
    """The one home of the PostgreSQL URL rewrite: SQLAlchemy 2.1 maps a bare ``postgresql://`` to
    psycopg 3, and we ship psycopg2 (binary wheels). Other URLs pass unchanged."""
    return "postgresql+psycopg2://" + url.removeprefix("postgresql://") if url.startswith("postgresql://") else url


def libpq_dsn(url: str) -> str:
    """The same PostgreSQL URL as libpq (psycopg2.connect) reads it."""
    return "postgresql://" + url.removeprefix("postgresql+psycopg2://") if url.startswith(POSTGRES_PREFIXES[1]) \
        else url


def storage_file(url: str) -> Path | None:
    """The file a journal or SQLite storage lives in; None for a server (PostgreSQL)."""
    if url.startswith(POSTGRES_PREFIXES):
        return None
    return Path(url.removeprefix(SQLITE_PREFIX)) if url.startswith(SQLITE_PREFIX) else Path(url)


def check_storage(url: str) -> None:
    """Refuse, before any work, a storage that is the wrong kind of thing or cannot be reached.

    Journal and SQLite: an existing file is a readable, writable regular file (SQLite: with
    SQLite's header); whether a new one can be created is the CLI's output-path check
    (``dflash.cli.options.check_out_path``). PostgreSQL: one connection succeeds within
    ``CONNECT_TIMEOUT_S``. Writes nothing.
    """
    if url.startswith(POSTGRES_PREFIXES):
        _check_postgres(url)
        return
    if "://" in url and not url.startswith(SQLITE_PREFIX):
        raise ConfigError("--storage", "must be a journal file path, sqlite:///PATH or postgresql://URL", url)
    path = storage_file(url)
    assert path is not None
    if not str(path) or str(path) in (".", ":memory:"):
        raise ConfigError("--storage", "must name a file that every worker process can open", url)
    if not path.exists():
        return
    if not path.is_file():
        raise ConfigError("--storage", "must be a file, not a directory or other special file", url)
    if not os.access(path, os.R_OK | os.W_OK):
        raise ConfigError("--storage", "is not readable and writable by this user", url)
    if url.startswith(SQLITE_PREFIX) and path.stat().st_size and not _is_sqlite(path):
        raise ConfigError("--storage", "is not an SQLite database", url)


def _is_sqlite(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(16) == b"SQLite format 3\x00"


def _check_postgres(url: str) -> None:
    import psycopg2

    try:
        psycopg2.connect(libpq_dsn(url), connect_timeout=CONNECT_TIMEOUT_S).close()
    except Exception as exc:  # any failure to connect is the user's URL or server
        raise ConfigError("--storage", f"cannot connect ({type(exc).__name__}: "
                          f"{(str(exc).strip().splitlines() or [''])[0][:120]})", url) from None


def open_storage(url: str, create: bool = True) -> optuna.storages.BaseStorage:
    """Open (creating if needed) the storage behind ``url``.

    Creating the tables of a new SQLite file or PostgreSQL database is done under a lock
    (:data:`SCHEMA_LOCK`), so starters racing on a new storage never collide on the schema.
    ``create=False`` (readers such as ``dflash validate --study``): a journal or SQLite file that
    does not exist is a ConfigError, and nothing is created.
    """
    check_storage(url)
    path = storage_file(url)
    if not create and path is not None and not path.is_file():
        raise ConfigError("--storage", "no such storage file (a study is read from an existing one)", url)
    try:
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
        if path is not None and not url.startswith(SQLITE_PREFIX):
            return JournalStorage(JournalFileBackend(str(path)))
    except OSError as exc:
        raise ConfigError("--storage", f"cannot be created ({exc.strerror or exc})", url) from None
    kwargs: dict[str, Any] = ({"connect_args": {"timeout": 60}} if path is not None
                              else {"pool_pre_ping": True, "connect_args": {"connect_timeout": CONNECT_TIMEOUT_S}})
    try:
        with study_lock(url, SCHEMA_LOCK):
            return RDBStorage(sqlalchemy_url(url), engine_kwargs=kwargs)
    except Exception as exc:
        raise ConfigError("--storage", f"cannot open RDB storage ({type(exc).__name__}: "
                          f"{(str(exc).strip().splitlines() or [''])[0][:120]})", url) from None


def lock_files(url: str, study_name: str) -> list[Path]:
    """The lock files :func:`study_lock` keeps beside a file storage (none for PostgreSQL)."""
    path = storage_file(url)
    return [] if path is None else [Path(f"{path}.{name}.lock") for name in (study_name, SCHEMA_LOCK)]


@contextlib.contextmanager
def study_lock(url: str, study_name: str) -> Iterator[None]:
    """Serialises count-then-ask across every worker of one study (and schema creation)."""
    if url.startswith(POSTGRES_PREFIXES):
        import psycopg2

        key = int.from_bytes(hashlib.sha256(study_name.encode()).digest()[:8], "big", signed=True)
        conn = psycopg2.connect(libpq_dsn(url), connect_timeout=CONNECT_TIMEOUT_S)
        try:
            with conn.cursor() as cur:
                cur.execute("SELECT pg_advisory_lock(%s)", (key,))
            yield
        finally:
            with contextlib.suppress(Exception), conn.cursor() as cur:
                cur.execute("SELECT pg_advisory_unlock(%s)", (key,))
            conn.close()
        return
    path = storage_file(url)
    assert path is not None
    with open(f"{path}.{study_name}.lock", "a") as f:
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
            study.tell(t.number, state=TrialState.FAIL)
            study.enqueue_trial(t.params, user_attrs={"requeued_from": t.number}, skip_if_exists=False)
            n += 1
    return n


class Heartbeat:
    """Refreshes a running trial's heartbeat attribute until stopped."""

    def __init__(self, trial: optuna.Trial) -> None:
        self._trial = trial
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            with contextlib.suppress(Exception):  # a transient storage error must not kill the trial
                self._trial.set_user_attr("heartbeat", time.time())

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def die_with_parent(parent_pid: int) -> None:
    """Make this worker process end when the process that started it ends, however that ends.

    Linux: the kernel sends SIGKILL when the parent dies (``PR_SET_PDEATHSIG``). Everywhere: a
    daemon thread that exits when the parent pid is no longer our parent (it was re-parented),
    which also covers a parent that died before the ``prctl`` call.
    """
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="die-with-parent").start()


# --------------------------------------------------------------------------- sampler streams
def claim_stream(study: optuna.Study, url: str) -> int:
    """This worker's sampler stream: the next unused index of the study, recorded in the storage
    (``sampler_streams`` counts them; ``sampler_stream_<k>`` says who took stream k and when).

    Every worker of every start takes its own index, so no two draw the same random sequence; the
    first worker of a new study takes 0, which is the study seed itself.
    """
    with study_lock(url, study.study_name):
        k = int(study.user_attrs.get("sampler_streams", 0))
        study.set_user_attr("sampler_streams", k + 1)
        study.set_user_attr(f"sampler_stream_{k}", {"host": HOST, "pid": os.getpid(), "started": time.time()})
    return k


def stream_seed(seed: int, stream: int) -> int:
    """Stream 0 is ``seed`` (a one-worker, never-restarted study is reproducible from its seed);
    stream k > 0 is a hash of both, so streams do not overlap as ``seed + k`` would across studies."""
    if stream == 0:
        return seed
    digest = hashlib.sha256(f"dflash-sampler-stream:{seed}:{stream}".encode()).digest()
    return int.from_bytes(digest[:4], "big")


# --------------------------------------------------------------------------- the loop
def counts(study: optuna.Study) -> tuple[int, int]:
    trials = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.RUNNING))
    complete = sum(t.state == TrialState.COMPLETE for t in trials)
    return complete, len(trials) - complete


# propose(trial) -> (key, config): the configuration the trial will run and the key two trials
# share exactly when they run the same configuration (after any clamping).
Propose = Callable[[optuna.Trial], tuple[str, Any]]
# objective(trial, config) -> (values, named constraint values)
Objective = Callable[[optuna.Trial, Any], tuple[list[float], dict[str, float]]]


class SamplerStuck(RuntimeError):
    """The sampler kept proposing configurations that were already run or running."""


def run_worker(study: optuna.Study, url: str, target: int, propose: Propose, objective: Objective,
               on_done: Callable[[], None] | None = None, idle: Callable[[], bool] | None = None,
               fallback_seed: int = 0) -> int:
    """Run trials until the study has ``target`` complete ones; returns trials this worker completed.

    Under the study lock a new trial is asked for and its configuration proposed; a configuration
    some COMPLETE or live RUNNING trial already has is not run again: that trial is told PRUNED
    (``duplicate_of`` names the earlier one) and another is asked for. After ``STUCK_AFTER``
    duplicates in a row the next trial is drawn by a seeded random sampler, so a sampler that
    keeps proposing its favourite (TPE in a small space) cannot stall the study. ``objective``
    returns (values, named constraint values); constraints are set on the trial (Optuna 5's
    ``Trial.set_constraint``) before ``tell``, so samplers see them. ``idle()`` is called when every
    remaining trial is running elsewhere (other work the caller can do meanwhile; True if it did some).
    """
    done = 0
    own_sampler, fallback = study.sampler, optuna.samplers.RandomSampler(seed=fallback_seed)
    duplicates = 0
    while True:
        with study_lock(url, study.study_name):
            fail_stale_and_requeue(study)
            live = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.RUNNING))
            complete = sum(t.state == TrialState.COMPLETE for t in live)
            if complete >= target:
                return done
            claimed = None
            if len(live) < target:
                study.sampler = fallback if duplicates >= STUCK_AFTER else own_sampler
                try:
                    claimed = _claim(study, live, propose)
                finally:
                    study.sampler = own_sampler
        if claimed is None and len(live) < target:  # a duplicate: ask again at once
            duplicates += 1
            if duplicates >= GIVE_UP_AFTER:
                raise SamplerStuck(f"{duplicates} proposals in a row repeated configurations already run")
            continue
        if claimed is None:  # the rest is running elsewhere; wait in case one of them dies
            if idle is None or not idle():
                time.sleep(POLL_S)
            continue
        duplicates = 0
        if _run_one(study, *claimed, objective):
            done += 1
            if on_done is not None:
                on_done()


def _claim(study: optuna.Study, live: list[optuna.trial.FrozenTrial], propose: Propose
           ) -> tuple[optuna.Trial, Any] | None:
    """Ask for a trial and claim it for this worker; None (trial PRUNED) if its configuration is taken."""
    trial = study.ask()
    key, config = propose(trial)
    taken = {t.user_attrs.get(CONFIG_KEY): t.number for t in live}
    if key in taken:
        trial.set_user_attr("duplicate_of", taken[key])
        study.tell(trial, state=TrialState.PRUNED)
        return None
    trial.set_user_attr(CONFIG_KEY, key)
    trial.set_user_attr("worker_host", HOST)
    trial.set_user_attr("worker_pid", os.getpid())
    trial.set_user_attr("heartbeat", time.time())
    return trial, config


def _run_one(study: optuna.Study, trial: optuna.Trial, config: Any, objective: Objective) -> bool:
    """Run one claimed trial and tell its result; True when it completed.

    ``skip_if_finished``: a trial another worker failed as stale meanwhile (and queued again) keeps
    that state; this worker's result is dropped and the re-queued copy runs instead.
    """
    try:
        with Heartbeat(trial):
            values, constraints = objective(trial, config)
        for name, value in constraints.items():
            trial.set_constraint(name, value)
        if not all(math.isfinite(v) for v in values):
            study.tell(trial, state=TrialState.FAIL, skip_if_finished=True)
            return False
        return study.tell(trial, values, skip_if_finished=True).state == TrialState.COMPLETE
    except optuna.TrialPruned:
        study.tell(trial, state=TrialState.PRUNED, skip_if_finished=True)
        return False
    except Exception:
        study.tell(trial, state=TrialState.FAIL, skip_if_finished=True)
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
