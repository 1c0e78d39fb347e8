"""The learning-rate schedule, right for every way a run ends.

A run ends at ``max_steps``, at ``max_minutes`` of training time, or at whichever comes first. The
schedule follows that end: its *progress* is the larger of the step fraction and the time fraction
(of those limits that are set), so a time-budgeted run decays at the end of its budget instead of at
a guessed step count (the old behaviour: a cosine over an assumed 1,000 steps that sat at 0 after
step 1,000 of a longer run). Two shapes:

- ``cosine``: warm-up, then a cosine from the peak to ``min_ratio`` at progress 1;
- ``wsd`` (warm-up, stable, decay; reported better than cosine for DFlash by TorchSpec): the peak
  holds until the last ``decay_frac`` of the run, then decays linearly to ``min_ratio``.

A run with neither limit (it ends with its data or a signal) warms up over ``OPEN_WARMUP_STEPS``
steps and then holds the peak. Neither shape reaches ``min_ratio`` before progress 1, and with
``min_ratio = 0`` the factor is still > 0 on every step that runs (the last step starts before
progress 1). Time is training time counted across resumes (the checkpoint keeps it), so resume
continues the schedule exactly. Extending a finished run opens a new *phase*: progress restarts from
the extension's first step and time, with a short re-warm-up, and the extension decays at its own
end. Pure and torch-free: the trainer wraps it in a LambdaLR-like step, tests drive it with a stub
clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dflash.core.errors import ConfigError

SHAPES = ("cosine", "wsd")
OPEN_WARMUP_STEPS = 100  # warm-up of a run with no step limit and no time budget (its peak then holds)


@dataclass(frozen=True)
class Schedule:
    shape: str = "wsd"
    total_steps: int | None = None  # the run's step limit (or schedule_steps), if any
    budget_s: float | None = None  # the run's training-time limit, if any
    warmup_ratio: float = 0.04  # of the run's progress
    decay_frac: float = 0.2  # wsd: the last fraction of the run spent decaying
    min_ratio: float = 0.0  # the factor at progress 1
    start_step: int = 0  # this phase's first step (0, or where an extension began)
    start_s: float = 0.0  # training time at this phase's start

    def __post_init__(self) -> None:
        if self.shape not in SHAPES:
            raise ConfigError("train.schedule", f"must be one of {', '.join(SHAPES)}", self.shape)
        if self.total_steps is not None and self.total_steps <= self.start_step:
            raise ConfigError("train.max_steps", f"must be > the phase's first step {self.start_step}",
                              self.total_steps)
        if self.budget_s is not None and self.budget_s <= self.start_s:
            raise ConfigError("train.max_minutes", "must leave training time after the phase's start", self.budget_s)
        for key, v, lo, hi in (("train.warmup_ratio", self.warmup_ratio, 0.0, 0.5),
                               ("train.decay_frac", self.decay_frac, 0.0, 1.0),
                               ("train.min_lr_ratio", self.min_ratio, 0.0, 1.0)):
            if not lo <= v <= hi or (key == "train.decay_frac" and v == 0.0):
                raise ConfigError(key, f"must be in {'(' if key == 'train.decay_frac' else '['}{lo}, {hi}]", v)

    @property
    def open_ended(self) -> bool:
        """No step limit and no time budget (a run that ends with its data or a signal): no decay."""
        return self.total_steps is None and self.budget_s is None

    def progress(self, step: int, elapsed_s: float) -> float:
        """How far this phase is towards its end, in [0, 1]: the limit nearest to being reached decides."""
        if self.open_ended:
            return 0.0
        fractions = []
        if self.total_steps is not None:
            fractions.append((step - self.start_step) / (self.total_steps - self.start_step))
        if self.budget_s is not None:
            fractions.append((elapsed_s - self.start_s) / (self.budget_s - self.start_s))
        return min(1.0, max(0.0, *fractions))

    def factor(self, step: int, elapsed_s: float) -> float:
        """The learning rate of ``step`` (started at training time ``elapsed_s``) over the peak."""
        if self.open_ended:  # warm-up by steps, then the peak holds: there is no end to decay towards
            return min(1.0, (step - self.start_step + 1) / OPEN_WARMUP_STEPS) if self.warmup_ratio > 0 else 1.0
        p = self.progress(step, elapsed_s)
        warm = self._warmup(p)
        if warm < 1.0:
            return warm
        if self.shape == "cosine":
            span = 1.0 - self.warmup_ratio
            q = (p - self.warmup_ratio) / span if span > 0 else 1.0
            return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * q))
        decay_start = 1.0 - self.decay_frac
        if p <= decay_start:
            return 1.0
        return self.min_ratio + (1 - self.min_ratio) * (1.0 - (p - decay_start) / self.decay_frac)

    def _warmup(self, p: float) -> float:
        """Linear warm-up over the first ``warmup_ratio`` of progress. The first step gets one step's
        share (with a step limit, exactly a step-counted warm-up: (k+1) / warm-up steps), never 0."""
        if self.warmup_ratio <= 0 or p >= self.warmup_ratio:
            return 1.0
        if self.total_steps is not None:
            return min(1.0, (p + 1.0 / (self.total_steps - self.start_step)) / self.warmup_ratio)
        return min(1.0, max(p / self.warmup_ratio, 0.01))

    def extended(self, step: int, elapsed_s: float, *, total_steps: int | None,
                 budget_s: float | None) -> Schedule:
        """A new phase from ``step``/``elapsed_s`` to the new limits (a finished run given more steps)."""
        return Schedule(self.shape, total_steps, budget_s, self.warmup_ratio, self.decay_frac, self.min_ratio,
                        start_step=step, start_s=elapsed_s)

    def state_dict(self) -> dict[str, object]:
        return dict(self.__dict__)

    @classmethod
    def from_state(cls, state: dict[str, object]) -> Schedule:
        return cls(**state)  # type: ignore[arg-type]


def schedule_for(*, shape: str, max_steps: int | None, schedule_steps: int | None, max_minutes: float | None,
                 warmup_ratio: float, decay_frac: float, min_ratio: float) -> Schedule:
    """The schedule of a run from its ``[train]`` limits; a schedule that would end before the run is refused."""
    if schedule_steps is not None and max_steps is not None and schedule_steps < max_steps:
        raise ConfigError("train.schedule_steps", f"must be >= train.max_steps ({max_steps}): the learning rate "
                          "would reach its end before the run does", schedule_steps)
    return Schedule(shape, schedule_steps or max_steps, None if max_minutes is None else 60.0 * max_minutes,
                    warmup_ratio, decay_frac, min_ratio)
