"""What a rank's loops read, typed and fixed once the rank is set up.

Why: :class:`dflash.pipeline.rank.RankRun` builds a rank step by step (the process group, the data
plane, the models, the coordinator, the control channel), so it is mutable while it sets up. The
loops that run afterwards (the drafter loop, the held-out scorer, the hold between validation
blocks) read a frozen context instead of the builder: each declares the fields it reads, a field
that does not exist fails at construction rather than mid-run, and nothing the loop does can change
what the rank was set up with. The one thing that changes under a running loop, a signal, lives in
:class:`Signals` (written by the handler, read by :class:`StopRule`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dflash.core.config import DflashConfig, TrainConfig
from dflash.pipeline.channel import Channel
from dflash.pipeline.roles import Roles
from dflash.pipeline.workers import STOP_MAX_MINUTES, STOP_MAX_STEPS, STOP_NAMES, STOP_NONE, STOP_SIGNAL, Status

if TYPE_CHECKING:  # types only: the loops receive these objects, built by RankRun
    from dflash.core.sampler import Sampler
    from dflash.model.drafter import DFlashDrafter
    from dflash.model.target import LoadedTarget
    from dflash.pipeline.optim import LrSchedule
    from dflash.pipeline.service import CoordinatorService
    from dflash.pipeline.training_data import TrainingData


class Signals:
    """The signal that asked this rank to stop (SIGTERM, SIGINT), set by the rank's handler; None until then."""

    def __init__(self) -> None:
        self.name: str | None = None


@dataclass(frozen=True)
class StopRule:
    """A rank's own view of whether to stop: a signal, the step limit, or (the host's clock) the time budget.
    The drafter ranks agree on the highest code (``DrafterWorker.agree_stop``)."""

    train: TrainConfig
    is_host: bool
    signals: Signals

    def local(self, step: int, elapsed_s: float) -> int:
        if self.signals.name is not None:
            return STOP_SIGNAL
        if self.train.max_steps is not None and step >= self.train.max_steps:
            return STOP_MAX_STEPS
        if self.train.max_minutes and self.is_host and elapsed_s >= self.train.max_minutes * 60:
            return STOP_MAX_MINUTES
        return STOP_NONE

    def name(self, code: int) -> str:
        """The summary's ``stopped_by``: the limit's name, or the signal's (``signal SIGTERM``)."""
        name = STOP_NAMES[code]
        return (self.signals.name or "signal") if name == "signal" else name


@dataclass(frozen=True)
class RankContext:
    """What every rank loop reads: the run, the rank, its device and plane, its channel and its voices."""

    cfg: DflashConfig
    roles: Roles
    out: Path
    device: torch.device
    plane: str  # the data plane in use (dflash.pipeline.roles)
    channel: Channel
    status: Status  # what this rank does now, in RUN/.ranks/rank-N.status
    progress: Callable[[str], None]  # the host rank's lines on stdout (a no-op elsewhere, or when quiet)
    wait_s: float  # the longest wait for a take, an admit or a round
    stop: StopRule
    gpu_samples: Callable[[], list[dict[str, Any]]]  # this rank's NVML samples since the last call

    @property
    def signal(self) -> str | None:
        return self.stop.signals.name


@dataclass(frozen=True)
class Corpus:
    """The rank's target (a drafter rank: a CPU copy) and data, as every rank forms them from the config."""

    target: LoadedTarget
    data: TrainingData
    sampler: Sampler
    layer_ids: tuple[int, ...]  # the target layers whose hidden states are captured


@dataclass(frozen=True)
class Start:
    """Where this session starts, as the host rank resolved it and broadcast it to every rank."""

    step: int
    run_id: str
    checkpoint: str | None  # the verified checkpoint resumed from (None: a fresh run)


@dataclass(frozen=True)
class DrafterContext:
    """What a drafter rank's loop reads besides :class:`RankContext`: its model, optimizer and schedule,
    where it starts, and on the host rank the coordinator service (None on the other drafter ranks)."""

    rank: RankContext
    corpus: Corpus
    drafter: DFlashDrafter
    optimizer: torch.optim.Optimizer
    scheduler: LrSchedule
    start: Start
    wandb: str  # offline, online or disabled (host rank)
    new_phase: dict[str, Any] | None  # a learning-rate phase opened at resume (an extended run)
    service: CoordinatorService | None

    @property
    def host_service(self) -> CoordinatorService:
        """The coordinator service; only the host rank has one (the loop calls this on the host only)."""
        if self.service is None:
            raise RuntimeError(f"rank {self.rank.roles.rank} is not the host rank: it has no coordinator service")
        return self.service


__all__ = ["Corpus", "DrafterContext", "RankContext", "Signals", "Start", "StopRule"]
