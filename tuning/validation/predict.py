"""The calibrated simulator's prediction of one configuration, for the same step budget."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from dflash.core.config import DflashConfig, with_overrides
from tuning.validation.metrics import COMPARED
from tuning.validation.plan import queue_overrides

PREDICTION_SEEDS = 3


def predict(entry: dict[str, Any], calibrated: DflashConfig, steps: int, records_dir: Path) -> dict[str, Any]:
    """The calibrated simulator's mean and standard error over seeds, for the same step budget."""
    from simulator.run import simulate
    from simulator.workload import make_sampler

    cfg = with_overrides(calibrated, queue_overrides(entry["queue"]))
    runs = []
    for r in range(PREDICTION_SEEDS):
        c = with_overrides(cfg, {"seed": cfg.seed + r})
        sampler = make_sampler(c.workload, c.target.model, c.seed, c.drafter.block_size)
        res = simulate(c, sampler, sim_seconds=1e9, max_steps=steps, records_dir=records_dir if r == 0 else None)
        runs.append(res.metrics)
    out = {}
    for k in COMPARED:
        xs = [float(m[k]) for m in runs if m.get(k) is not None and math.isfinite(float(m[k]))]
        out[k] = {"mean": float(np.mean(xs)) if xs else None,
                  "se": float(np.std(xs, ddof=1) / math.sqrt(len(xs))) if len(xs) > 1 else None}
    return out
