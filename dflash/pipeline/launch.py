"""Starting the ranks: under torchrun the process already is a rank; otherwise torch's own elastic launcher.

``dflash train`` decides here: inside a torchrun (or any torch.distributed launcher that sets
``RANK``/``WORLD_SIZE``) this process runs its rank; with ``--nproc-per-node N``, or plainly with
n_target + n_drafter processes, it starts them through :func:`torch.distributed.launcher.api.elastic_launch`
(the API torchrun itself uses) on this node. The checks that need no model run first, in this process:
the world size against the roles, and the ranks per node against the GPUs. A failed rank becomes one
line (the earliest rank error, naming the rank) and the exit status; the launcher's own traceback
is not shown.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import uuid
from pathlib import Path
from typing import Any

from dflash.core.config import DflashConfig
from dflash.core.signals import STOP_SIGNALS, Terminated, kept_handlers, sigint_ignored
from dflash.pipeline.nodes import RUN_ID as NODES_RUN_ID
from dflash.pipeline.nodes import Nodes
from dflash.pipeline.planes import node_plane
from dflash.pipeline.rank import DATA_PLANE_ENV, LAUNCHED_BY_DFLASH, RANKS_DIR, RunSpec, archive_tracebacks, rank_main
from dflash.pipeline.roles import check_world

ELASTIC_SIGNALS_ENV = "TORCHELASTIC_SIGNALS_TO_HANDLE"  # read by the launcher when it starts the ranks
ONE_NODE = Nodes()
_QUIET_LOGGERS = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing",
                  "torch.distributed.run")


def under_launcher() -> bool:
    """True when a launcher started this process as a rank (torchrun sets these)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ


def check_launch(cfg: DflashConfig, nproc_per_node: int | None, nodes: Nodes = ONE_NODE) -> int:
    """The checks made before any process starts or model loads; returns the ranks to start on this node."""
    n_t, n_d = cfg.cluster.n_target, cfg.cluster.n_drafter
    if under_launcher():
        world = int(os.environ["WORLD_SIZE"])
        check_world(n_t, n_d, world, what="launcher's world size (WORLD_SIZE)")
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    elif nodes.several:  # dflash's own launcher on several nodes (dflash.pipeline.nodes)
        local = nproc_per_node if nproc_per_node is not None else -(-(n_t + n_d) // nodes.count)
        check_world(n_t, n_d, local * nodes.count, what=f"--nnodes {nodes.count} x --nproc-per-node {local}")
    else:
        local = nproc_per_node if nproc_per_node is not None else n_t + n_d
        check_world(n_t, n_d, local, what="--nproc-per-node" if nproc_per_node is not None
                    else "number of processes started on this node")
    node_plane(_cuda_devices(), local, os.environ.get(DATA_PLANE_ENV, "auto"))  # pairs across nodes copy (planes)
    return local


def _cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def launch(spec: RunSpec, nproc_per_node: int | None = None, *, report_stop: bool = True,
           nodes: Nodes = ONE_NODE) -> int:
    """Run the job; returns the exit status (0, 1 for a failed rank, 2 for bad input found by a rank).

    A SIGTERM or SIGINT to this process stops the ranks after their step with a checkpoint, and is 0
    here (``dflash train``'s contract: the run is resumable) with a line that says how to go on; without
    ``report_stop`` (a library caller) it raises :class:`~dflash.core.signals.Terminated` or KeyboardInterrupt."""
    n = check_launch(spec.cfg, nproc_per_node, nodes)
    ranks_dir = Path(spec.out) / RANKS_DIR
    if under_launcher():  # this process is one rank: clear only its own files of an earlier start
        archive_tracebacks(ranks_dir, int(os.environ["RANK"]))
        for f in ranks_dir.glob(f"rank-{os.environ['RANK']}.*"):
            f.unlink(missing_ok=True)
        return rank_main(spec)
    if nodes.several:  # this node's ranks' files only: the other nodes' ranks write theirs beside them
        for rank in nodes.own_ranks(n):
            archive_tracebacks(ranks_dir, rank)
            for f in ranks_dir.glob(f"rank-{rank}.*"):
                f.unlink(missing_ok=True)
    else:
        archive_tracebacks(ranks_dir)  # kept across starts (a resume): the rest of an earlier start is cleared
        for f in ranks_dir.glob("rank-*"):
            f.unlink(missing_ok=True)
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    _quiet_launcher_logs()
    os.environ[LAUNCHED_BY_DFLASH] = "1"
    os.environ.setdefault(ELASTIC_SIGNALS_ENV, _signals_to_handle())
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) // n)))
    config = LaunchConfig(min_nodes=nodes.count, max_nodes=nodes.count, nproc_per_node=n, rdzv_backend="c10d",
                          rdzv_endpoint="localhost:0", run_id=f"dflash-{uuid.uuid4().hex[:8]}", max_restarts=0,
                          monitor_interval=0.1, start_method="spawn")
    if nodes.several:  # a static rendezvous at node 0's endpoint: node R is group rank R (dflash.pipeline.nodes)
        config.rdzv_backend, config.rdzv_endpoint, config.run_id = "static", str(nodes.endpoint), NODES_RUN_ID
        config.rdzv_configs["rank"] = nodes.rank
    try:
        with kept_handlers(*STOP_SIGNALS, signal.SIGHUP, signal.SIGQUIT):  # the launcher never restores them
            elastic_launch(config, rank_main)(spec)
    except ChildFailedError as exc:
        if not ranks_dir.is_dir():  # this node cannot see the run directory: each rank said so in its one line
            return 2 if any(f.exitcode == 2 for f in exc.failures.values()) else 1
        line, config_error = _failure_line(exc, ranks_dir)
        print(f"dflash train: error: {line}", file=sys.stderr)
        return 2 if config_error else 1
    except SignalException as exc:  # SIGTERM/SIGINT to this process: the ranks stop after their step
        if not report_stop:  # a library caller (dflash.pipeline.trainer.train): it stops the way Ctrl-C stops it
            raise (Terminated() if exc.sigval == signal.SIGTERM else KeyboardInterrupt()) from None
        if _stopped_cleanly(Path(spec.out)):
            print(f"stopped by signal {exc.sigval.name}: every rank stopped after its step with a checkpoint; "
                  f"continue with dflash train --resume {spec.out}")
            return 0
        print(f"dflash train: error: stopped by signal {exc.sigval.name} before the ranks could checkpoint",
              file=sys.stderr)
        return 1
    return 0


def _signals_to_handle() -> str:
    """What the elastic launcher turns into a clean stop of the ranks: SIGTERM always; SIGINT unless it
    was ignored when we were started (a background job keeps ignoring it, as POSIX expects)."""
    return "SIGTERM,SIGHUP,SIGQUIT" if sigint_ignored() else "SIGTERM,SIGINT,SIGHUP,SIGQUIT"


def _quiet_launcher_logs() -> None:
    """The launcher's own log lines (and tracebacks) are not shown: the ranks' one-line errors are."""
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(_QUIET_LOGGERS):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    for name in _QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.CRITICAL)


def _stopped_cleanly(run: Path) -> bool:
    try:
        lines = (run / "summary.jsonl").read_text().splitlines()
        return bool(lines) and str(json.loads(lines[-1]).get("stopped_by", "")).startswith("signal")
    except (OSError, ValueError):
        return False


def _failure_line(exc: Any, ranks_dir: Path) -> tuple[str, bool]:
    """A rank killed by a signal is the cause (its peers then fail on it); else the earliest rank error."""
    for rank, failure in sorted(exc.failures.items()):
        if failure.exitcode < 0 and not (ranks_dir / f"rank-{rank}.error").exists():
            name = signal.Signals(-failure.exitcode).name
            return f"rank {rank} (pid {failure.pid}) was killed by {name}; resume with dflash train --resume", False
    line, config_error = first_rank_error(ranks_dir)
    if line is None:
        rank, failure = min(exc.failures.items())
        line = f"rank {rank} (pid {failure.pid}) exited with status {failure.exitcode}"
    return line, config_error


def first_rank_error(ranks_dir: Path) -> tuple[str | None, bool]:
    """The earliest error a rank wrote (the cause; later ones are usually its peers losing it)."""
    errors = []
    for f in ranks_dir.glob("rank-*.error"):
        try:
            errors.append(json.loads(f.read_text()))
        except (OSError, ValueError):
            continue
    if not errors:
        return None, False
    first = min(errors, key=lambda e: e["t"])
    return first["line"], bool(first.get("config"))


def hung_ranks(run_dir: Path) -> list[str]:
    """What each rank said it was doing last (for a deadlock report)."""
    return sorted(f.read_text().strip() for f in (Path(run_dir) / RANKS_DIR).glob("rank-*.status"))
