"""Sweep throughput: trials per minute, serial versus --workers 2, side by side in one run.

Run: python benchmarks/sweep_speed.py [--trials N]
The drafter-bound example (examples/h200-8b-drafter-bound.toml) with one seed and one simulated
hour per trial, NSGA-II, a fresh journal storage per contender. Goals (issue #6): --workers 2 >=
1.8x serial; 1,000 such trials in under 5 minutes on 2 cores (run with --trials 1000).
Wall time includes everything a user waits for: process start-up of the workers, the study's
storage traffic, the selection's extra evaluations of baseline and handpicked, and the export.
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
from pathlib import Path

from dflash.core.config import load_config, with_overrides
from tuning.sweep import SweepArgs, run_sweep

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "h200-8b-drafter-bound.toml"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=200)
    args = ap.parse_args()
    cfg = with_overrides(load_config(EXAMPLE), {"sweep.seeds_per_trial": 1, "sweep.sim_seconds": 3600.0})
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for workers in (1, 2):
            out = Path(tmp) / f"w{workers}"
            sargs = SweepArgs(trials=args.trials, storage=str(out / "study.journal"), study="bench",
                              workers=workers, grid=False, out=out, calibration=None)
            t0 = time.perf_counter()
            res = run_sweep(cfg, dataclasses.replace(sargs), progress=False)
            wall = time.perf_counter() - t0
            assert res["complete"] == args.trials
            results[workers] = wall
            print(f"workers {workers}: {args.trials} trials in {wall:6.1f} s  "
                  f"({60 * args.trials / wall:6.1f} trials/min)")
    print(f"speed-up --workers 2 / serial: {results[1] / results[2]:.2f}x")


if __name__ == "__main__":
    main()
