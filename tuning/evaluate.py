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
from dflash.core.sampler import Sampler
from simulator.run import simulate
from simulator.workload import load_lengths_and_prompts

OBJECTIVES = ("throughput_tokens_per_s", "mix_efficiency")  # both maximised
ATTR_METRICS = (
    "throughput_tokens_per_s", "mix_efficiency", "samples_per_s", "peak_queue_bytes", "mix_kl",
    "mix_entropy", "length_autocorr", "max_bucket_streak", "drafter_utilization", "target_utilization",
    "drafter_gate_wait_frac", "producer_blocked_frac", "mean_queue_depth", "mean_queue_bytes",
    "loss_roughness",  # NaN unless the config carries a calibrated loss model
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

    def as_json(self) -> dict[str, Any]:
        return {"queue": self.queue, "mean": self.mean, "se": self.se, "seeds": list(self.seeds),
                "steady_state_reached": self.reached}


class Evaluator:
    """Runs configurations on the simulator; one per worker process (samplers are cached)."""

    def __init__(self, cfg: DflashConfig, seeds: int | None = None, sim_seconds: float | None = None) -> None:
        self.cfg = cfg
        self.seeds = tuple(cfg.seed + r for r in range(seeds or cfg.sweep.seeds_per_trial))
        self.sim_seconds = sim_seconds or cfg.sweep.sim_seconds
        self._lengths, self._prompts = load_lengths_and_prompts(cfg.workload, cfg.target.model, cfg.seed)
        self._samplers: dict[int, Sampler] = {}

    def sampler(self, seed: int) -> Sampler:
        if seed not in self._samplers:
            self._samplers[seed] = Sampler(self._lengths, self.cfg.workload, seed=seed,
                                           prompt_lengths=self._prompts)
        return self._samplers[seed]

    def evaluate(self, queue: QueueConfig) -> Evaluation:
        runs = []
        for seed in self.seeds:
            cfg = with_overrides(self.cfg, {f"queue.{k}": v for k, v in queue.__dict__.items()} | {"seed": seed})
            runs.append(simulate(cfg, self.sampler(seed), sim_seconds=self.sim_seconds).metrics)
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
        return Evaluation(dict(queue.__dict__), mean, se, self.seeds, reached, tuple(runs))


def constraint_values(ev: Evaluation, cfg: DflashConfig, reference_throughput: float | None
                      ) -> dict[str, float]:
    """Optuna's convention: feasible when every value <= 0.

    memory: peak queued GiB - budget; stranded: 1 if some seed never reached its steady state
    (items stranded below min-ready until the end) else -1; starved: gate-wait share - bound;
    and in scalar mode throughput: the relative shortfall from the throughput floor.
    """
    sw = cfg.sweep
    peak = ev.mean["peak_queue_bytes"]
    values = {
        "memory": (peak / GIB - sw.memory_budget_gib if math.isfinite(peak) else 1.0)
        if sw.memory_budget_gib is not None else -1.0,
        "stranded": -1.0 if ev.reached else 1.0,
        "starved": (ev.mean["drafter_gate_wait_frac"] - sw.max_gate_wait_frac
                    if math.isfinite(ev.mean["drafter_gate_wait_frac"]) else 1.0),
    }
    if sw.mode == "scalar" and reference_throughput is not None:
        tput = ev.mean["throughput_tokens_per_s"]
        floor = sw.min_throughput_frac * reference_throughput
        values["throughput"] = (floor - tput) / floor if math.isfinite(tput) else 1.0
    return values
