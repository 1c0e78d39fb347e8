"""The search space of a study: which queue knobs vary, over what, and how a trial samples them.

Declared in ``[sweep.space]`` of the TOML file; knobs not declared stay at the configured (or
flag) value. ``min_ready`` and ``max_depth`` are coupled by validity (min_ready <= max_depth): the
trial samples both over their declared ranges and the effective min_ready is clamped to max_depth
(the sampled and effective values are both stored). Clamping keeps every distribution fixed, which
Optuna's samplers need, at the price of a plateau where the clamp binds.

The GPU split is a knob too: ``n_target = { low, high }`` (with ``[cluster] gpus = G``) gives each
trial ``n_target`` target workers of ``gpus_per_target`` GPUs and the rest, ``n_drafter = G -
n_target x gpus_per_target``, to drafters, so the queue knobs are searched jointly with the split.
A split that leaves no drafter is not an error: the trial is infeasible (a constraint).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import optuna

from dflash.core.config import GATES, POLICIES, QUEUE_MODES, ClusterConfig, QueueConfig
from dflash.core.errors import ConfigError

INT_KNOBS = {"min_ready": 1, "max_depth": 1, "items_per_take": 1, "n_target": 1}  # knob -> smallest allowed
QUEUE_KNOBS = frozenset(QueueConfig.__dataclass_fields__)
# mode = ["static", "auto"]: auto beside the static pairs (the trial's pair is then where the autopilot starts)
CHOICE_KNOBS = {"policy": POLICIES, "gate": GATES, "mode": QUEUE_MODES}

DEFAULT_SPACE: dict[str, Any] = {
    "min_ready": {"low": 1, "high": 120},
    "max_depth": {"low": 10, "high": 240, "step": 10},
    "policy": list(POLICIES),
    "gate": list(GATES),
}


@dataclass(frozen=True)
class IntRange:
    low: int
    high: int
    step: int = 1

    def values(self) -> list[int]:
        return list(range(self.low, self.high + 1, self.step))


@dataclass(frozen=True)
class SearchSpace:
    ints: dict[str, IntRange]
    choices: dict[str, tuple[str, ...]]

    @property
    def names(self) -> list[str]:
        return [*self.ints, *self.choices]

    def sample(self, trial: optuna.Trial) -> dict[str, Any]:
        """Sample the declared knobs; returns the *effective* queue values (clamped)."""
        params: dict[str, Any] = {}
        for name, r in self.ints.items():
            params[name] = trial.suggest_int(name, r.low, r.high, step=r.step)
        for name, options in self.choices.items():
            params[name] = trial.suggest_categorical(name, list(options))
        return params

    def largest_queue(self, base: QueueConfig) -> dict[str, Any]:
        """The scalar mode's reference: the largest max_depth in the space, with min_ready 1."""
        max_depth = self.ints["max_depth"].high if "max_depth" in self.ints else base.max_depth
        return {"min_ready": 1, "max_depth": max_depth}


@dataclass(frozen=True)
class Split:
    """How a trial shares the GPUs: target workers and drafter workers."""

    n_target: int
    n_drafter: int

    @property
    def feasible(self) -> bool:
        return self.n_drafter >= 1

    def as_json(self) -> dict[str, int]:
        return {"n_target": self.n_target, "n_drafter": self.n_drafter}


def effective_split(cluster: ClusterConfig, params: dict[str, Any]) -> Split:
    """The configured split, or the trial's ``n_target`` with the rest of ``cluster.gpus`` as drafters."""
    if "n_target" not in params:
        return Split(cluster.n_target, cluster.n_drafter)
    n_target = int(params["n_target"])
    assert cluster.gpus is not None  # config validation: n_target in the space needs cluster.gpus
    return Split(n_target, cluster.gpus - n_target * cluster.gpus_per_target)


def effective_queue(base: QueueConfig, params: dict[str, Any]) -> QueueConfig:
    """The queue config a trial runs: base knobs, overridden by the trial's, min_ready clamped."""
    values = {**base.__dict__, **{k: v for k, v in params.items() if k in QUEUE_KNOBS}}
    values["min_ready"] = min(values["min_ready"], values["max_depth"])
    values["auto_min_ready"] = min(values["auto_min_ready"], values["min_ready"])
    if values["auto_max_depth"] is not None:
        values["auto_max_depth"] = max(values["auto_max_depth"], values["max_depth"])
    return QueueConfig(**values)


def parse_space(raw: dict[str, Any] | None) -> SearchSpace:
    """Validate ``[sweep.space]``; every problem is a one-line ConfigError naming the key."""
    raw = raw if raw else DEFAULT_SPACE
    ints: dict[str, IntRange] = {}
    choices: dict[str, tuple[str, ...]] = {}
    allowed = [*INT_KNOBS, *CHOICE_KNOBS]
    for name, spec in raw.items():
        key = f"sweep.space.{name}"
        if name in INT_KNOBS:
            if not isinstance(spec, dict) or set(spec) - {"low", "high", "step"} or not {"low", "high"} <= set(spec):
                raise ConfigError(key, "must be a table {low = N, high = N, step = N (optional)}", spec)
            low, high, step = spec["low"], spec["high"], spec.get("step", 1)
            for part, v in (("low", low), ("high", high), ("step", step)):
                if not isinstance(v, int) or isinstance(v, bool):
                    raise ConfigError(f"{key}.{part}", "must be an integer", v)
            if low < INT_KNOBS[name]:
                raise ConfigError(f"{key}.low", f"must be >= {INT_KNOBS[name]}", low)
            if high < low:
                raise ConfigError(f"{key}.high", f"must be >= low = {low}", high)
            if step < 1:
                raise ConfigError(f"{key}.step", "must be >= 1", step)
            if (high - low) % step:
                raise ConfigError(f"{key}.high", f"must be low + a multiple of step ({low} + k*{step})", high)
            ints[name] = IntRange(low, high, step)
        elif name in CHOICE_KNOBS:
            options = CHOICE_KNOBS[name]
            if not isinstance(spec, list) or not spec:
                raise ConfigError(key, f"must be a non-empty list of {', '.join(options)}", spec)
            for v in spec:
                if v not in options:
                    raise ConfigError(key, f"entries must be among {', '.join(options)}", v)
            if len(set(spec)) != len(spec):
                raise ConfigError(key, "must not repeat an entry", spec)
            choices[name] = tuple(spec)
        else:
            raise ConfigError(key, f"unknown knob; allowed: {', '.join(allowed)}", show_got=False)
    if not ints and not choices:
        raise ConfigError("sweep.space", "must declare at least one knob", raw)
    return SearchSpace(ints, choices)
