"""Scoring one queue configuration with the simulator: R seeds, means and standard errors.

Every configuration of a study is run on the same R seeds (common random numbers): seed r fixes
the arrival order (the sampler), the policy's random draws and the timing noise, so two trials
differ only by their knobs and comparisons between them are sharper than their own spreads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from dflash.core.config import DflashConfig, QueueConfig, with_overrides
from dflash.core.sampler import Sampler, heldout_per_bucket
from simulator.run import simulate
from simulator.workload import load_lengths_and_prompts
from tuning.space import Split

OBJECTIVES = ("throughput_tokens_per_s", "mix_efficiency")  # both maximised
ATTR_METRICS = (
    "throughput_tokens_per_s", "mix_efficiency", "samples_per_s", "peak_queue_bytes", "mix_kl",
    "mix_entropy", "length_autocorr", "max_bucket_streak", "drafter_utilization", "target_utilization",
    "drafter_gate_wait_frac", "producer_blocked_frac", "mean_queue_depth", "mean_queue_bytes",
    "loss_roughness",  # NaN unless the config carries a calibrated loss model
    "peak_device_bytes", "peak_producer_bytes", "peak_drafter_bytes",  # the per-device memory model's inputs
)
GIB = 2**30


@dataclass(frozen=True)
class Evaluation:
    queue: dict[str, Any]
    mean: dict[str, float]
    se: dict[str, float]
    seeds: tuple[int, ...]
    reached: bool  # every seed reached its steady state (depth >= min_ready) in time
    per_seed: tuple[dict[str, Any], ...] = field(repr=False, default=())
    split: Split | None = None  # None only for evaluations made before splits existed

    def as_json(self) -> dict[str, Any]:
        return {"queue": self.queue, **(self.split.as_json() if self.split else {}), "mean": self.mean,
                "se": self.se, "seeds": list(self.seeds), "steady_state_reached": self.reached}

    def worst(self, key: str) -> float:
        """The largest value over seeds (memory must fit on every seed, not on average)."""
        xs = [float(m[key]) for m in self.per_seed if m.get(key) is not None and math.isfinite(float(m[key]))]
        return max(xs) if xs else math.nan


def sweep_seeds(cfg: DflashConfig, seeds: int | None = None) -> tuple[int, ...]:
    """The seeds a sweep evaluates every configuration on: ``cfg.seed`` and the next ``seeds - 1``
    (default ``[sweep] seeds_per_trial``). Validation predicts on seeds disjoint from these
    (:func:`tuning.validation.predict.prediction_seeds`): the sweep's pick won on them."""
    return tuple(cfg.seed + r for r in range(seeds or cfg.sweep.seeds_per_trial))


class Evaluator:
    """Runs configurations on the simulator; one per worker process (samplers are cached)."""

    def __init__(self, cfg: DflashConfig, seeds: int | None = None, sim_seconds: float | None = None) -> None:
        self.cfg = cfg
        self.seeds = sweep_seeds(cfg, seeds)
        self.sim_seconds = sim_seconds or cfg.sweep.sim_seconds
        self._lengths, self._prompts = load_lengths_and_prompts(cfg.workload, cfg.target.model, cfg.seed)
        self._samplers: dict[int, Sampler] = {}

    def sampler(self, seed: int) -> Sampler:
        if seed not in self._samplers:
            self._samplers[seed] = Sampler(self._lengths, self.cfg.workload, seed=seed,
                                           prompt_lengths=self._prompts, block_size=self.cfg.drafter.block_size,
                                           heldout_per_bucket=heldout_per_bucket(self.cfg))
        return self._samplers[seed]

    def evaluate(self, queue: QueueConfig, split: Split | None = None) -> Evaluation:
        """R seeds of ``queue`` on ``split`` (default: the configured one). A split without a drafter
        is not simulated: it scores 0 on both objectives and its ``split`` constraint is violated."""
        split = split or Split(self.cfg.cluster.n_target, self.cfg.cluster.n_drafter)
        if not split.feasible:
            return _unrunnable(queue, split, self.seeds)
        runs = []
        overrides = {f"queue.{k}": v for k, v in queue.__dict__.items()} | {
            "cluster.n_target": split.n_target, "cluster.n_drafter": split.n_drafter}
        for seed in self.seeds:
            cfg = with_overrides(self.cfg, overrides | {"seed": seed})
            runs.append(simulate(cfg, self.sampler(seed), sim_seconds=self.sim_seconds).metrics)
        return _summarise(queue, split, self.seeds, runs)


def _unrunnable(queue: QueueConfig, split: Split, seeds: tuple[int, ...]) -> Evaluation:
    mean = {key: (0.0 if key in OBJECTIVES else math.nan) for key in ATTR_METRICS}
    return Evaluation(dict(queue.__dict__), mean, dict.fromkeys(ATTR_METRICS, math.nan), seeds, False, (), split)


def _summarise(queue: QueueConfig, split: Split, seeds: tuple[int, ...], runs: list[dict[str, Any]]) -> Evaluation:
    """Means and standard errors over seeds of every attribute metric."""
    reached = all(m.get("steady_state_reached") for m in runs)
    mean, se = {}, {}
    for key in ATTR_METRICS:
        xs = [float(m[key]) for m in runs if m.get(key) is not None and math.isfinite(float(m[key]))]
        if not xs:
            mean[key], se[key] = math.nan, math.nan
            continue
        mu = sum(xs) / len(xs)
        mean[key] = mu
        se[key] = (math.sqrt(sum((x - mu) ** 2 for x in xs) / (len(xs) - 1) / len(xs))
                   if len(xs) > 1 else math.nan)
    return Evaluation(dict(queue.__dict__), mean, se, seeds, reached, tuple(runs), split)


def constraint_values(ev: Evaluation, cfg: DflashConfig, reference_throughput: float | None
                      ) -> dict[str, float]:
    """Optuna's convention: feasible when every value <= 0.

    memory: GiB of the fullest device (the per-device memory model, worst seed) - budget per device;
    split: 1 - drafters (a split must leave at least one drafter); stranded: 1 if some seed never
    reached its steady state (items stranded below min-ready until the end) else -1; starved:
    gate-wait share - bound; and in scalar mode throughput: the relative shortfall from the floor.
    """
    sw = cfg.sweep
    peak = ev.worst("peak_device_bytes")
    values = {
        "memory": (peak / GIB - sw.memory_budget_gib if math.isfinite(peak) else 1.0)
        if sw.memory_budget_gib is not None else -1.0,
        "split": float(1 - ev.split.n_drafter) if ev.split is not None else -1.0,
        "stranded": -1.0 if ev.reached else 1.0,
        "starved": (ev.mean["drafter_gate_wait_frac"] - sw.max_gate_wait_frac
                    if math.isfinite(ev.mean["drafter_gate_wait_frac"]) else 1.0),
    }
    if sw.mode == "scalar" and reference_throughput is not None:
        tput = ev.mean["throughput_tokens_per_s"]
        floor = sw.min_throughput_frac * reference_throughput
        values["throughput"] = (floor - tput) / floor if math.isfinite(tput) else 1.0
    return values
