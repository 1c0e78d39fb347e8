"""The drafter's optimizer and learning rate: one home for both trainers (in-process and ranks).

The optimizer is upstream DFlash's (SpecForge's ``BF16Optimizer`` over ``torch.optim.AdamW``): weight
decay 0 and torch's default betas (0.9, 0.999), eps 1e-8. The learning rate follows
:mod:`dflash.core.schedule` on the run's steps and training time: every drafter rank sets the same
rate for a step because the step and the training time come from the ranks' shared stop agreement
(the host's clock, all-reduced). Training time and the schedule's phase live in the checkpoint, so
a resumed run continues the schedule exactly; a finished run given a larger ``--max-steps`` (or
``--max-minutes``) opens a new phase (a re-warm-up and its own decay).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch

from dflash.core.config import TrainConfig
from dflash.core.schedule import Schedule

BETAS = (0.9, 0.999)  # torch's AdamW defaults, as upstream trains with
WEIGHT_DECAY = 0.0  # upstream's (SpecForge BF16Optimizer default; docs/REFERENCE.md's recipe)
EPS = 1e-8


def build_optimizer(params: Iterable[torch.nn.Parameter], train: TrainConfig) -> torch.optim.AdamW:
    """AdamW at the schedule's peak ``train.lr`` (the schedule scales it per step)."""
    return torch.optim.AdamW(list(params), lr=train.lr, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)


class LrSchedule:
    """``at(step, elapsed_s)`` sets the optimizer's rate; ``get_last_lr``/``step`` as a torch scheduler's."""

    def __init__(self, optimizer: Any, train: TrainConfig) -> None:
        self.optimizer = optimizer
        self.peak = train.lr
        self.schedule = train.lr_schedule()
        self.elapsed_s = 0.0  # training time before this session (from the checkpoint)
        self._lr = self.at(0, 0.0)

    def at(self, step: int, elapsed_s: float) -> float:
        self._lr = self.peak * self.schedule.factor(step, elapsed_s)
        for group in self.optimizer.param_groups:
            group["lr"] = self._lr
        return self._lr

    def get_last_lr(self) -> list[float]:
        return [self._lr]

    def step(self) -> None:
        """The rate is set per step by :meth:`at`."""

    def state_dict(self) -> dict[str, Any]:
        return {"schedule": self.schedule.state_dict(), "peak": self.peak}

    def load_state_dict(self, state: dict[str, Any], *, step: int, elapsed_s: float,
                        train: TrainConfig) -> dict[str, Any] | None:
        """Restore the phase for the run's limits now; returns the new phase when one opens (an extension).

        The same limits continue the phase exactly. A phase that is over (its step limit or time budget
        reached) given limits that leave room opens a new phase from here (its own warm-up and decay);
        changed limits before the phase's end move its end (stretch, shrink, or drop a limit).
        """
        s = Schedule.from_state(state["schedule"])
        self.elapsed_s = elapsed_s
        total = train.schedule_steps or train.max_steps
        budget = None if train.max_minutes is None else 60.0 * train.max_minutes
        if (total, budget) == (s.total_steps, s.budget_s):
            self.schedule = s
            return None
        room = (total is None or total > step) and (budget is None or budget > elapsed_s)
        if s.progress(step, elapsed_s) >= 1.0 and room:
            self.schedule = s.extended(step, elapsed_s, total_steps=total, budget_s=budget)
            return self.schedule.state_dict()
        if not room:  # nothing left to train (the run stops at once): keep the phase as it was
            self.schedule = s
            return None
        self.schedule = dataclasses.replace(s, total_steps=total, budget_s=budget)
        return None
