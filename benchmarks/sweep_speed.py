"""Sweep throughput in distinct trials per minute: one worker versus --workers 2, side by side in one run.

Run: python benchmarks/sweep_speed.py [--trials 40] [--calibration FILE] [--workers 2]
The demo's sweep shape (issue #18 item 5): the CPU profile (dflash/profiles/cpu-smollm2.toml),
calibrated when --calibration is given (``dflash demo`` writes one: dflash-demo/calibration.json),
40 trials x 2 seeds x 30 simulated minutes, NSGA-II, a fresh journal storage per contender. Goal:
--workers 2 >= 1.8x one worker on 2 cores, counting only distinct trials (a repeated configuration
is not a trial gained). Wall time is everything a user waits for: worker start-up, storage traffic
and locking, baseline and handpicked for the selection, and the Parquet export. The machine's load
(``os.getloadavg``) is printed before and after: a busy core depresses the ratio, so the CPU
seconds per trial (this process and its workers) and the mean number of trials running at once
are printed too; they show whether running in parallel adds work or only waits for cores.
``--repeat N`` interleaves N pairs and compares the best wall time of each contender.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile
import time
from pathlib import Path

import optuna
from optuna.trial import TrialState

from dflash.core.config import DflashConfig, load_config, with_overrides
from simulator.calibration import apply_calibration
from tuning.study import open_storage
from tuning.sweep import SweepArgs, run_sweep

PROFILE = Path(__file__).resolve().parent.parent / "dflash" / "profiles" / "cpu-smollm2.toml"


def distinct_complete(storage: str, study: str) -> tuple[int, int, float]:
    """(complete trials, distinct effective queues among them, summed trial durations in s)."""
    st = optuna.load_study(study_name=study, storage=open_storage(storage))
    done = st.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    queues = {json.dumps({k: v for k, v in t.user_attrs.items() if k.startswith("queue_")}, sort_keys=True)
              for t in done}
    busy = sum((t.datetime_complete - t.datetime_start).total_seconds() for t in done)
    return len(done), len(queues), busy


def cpu_s() -> float:
    """CPU seconds of this process and its reaped children (the forked workers) so far."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=40)
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--sim-seconds", type=float, default=1800.0)
    ap.add_argument("--workers", type=int, default=2, help="the parallel contender (default 2)")
    ap.add_argument("--config", default=str(PROFILE))
    ap.add_argument("--calibration", default=None, help="calibration JSON (dflash calibrate / dflash demo)")
    ap.add_argument("--repeat", type=int, default=1, help="interleaved pairs; the best wall of each counts")
    args = ap.parse_args()
    cfg = with_overrides(load_config(args.config), {"sweep.seeds_per_trial": args.seeds,
                                                    "sweep.sim_seconds": args.sim_seconds})
    cfg = apply_calibration(cfg, args.calibration)
    print(f"{Path(args.config).name}, calibration {args.calibration or 'none (timing as configured)'}; "
          f"{args.trials} trials x {args.seeds} seeds x {args.sim_seconds:g} simulated s; {os.cpu_count()} CPUs; "
          f"load average {load()}")
    walls: dict[int, list[float]] = {1: [], args.workers: []}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeat):
            for workers in (1, args.workers):
                walls[workers].append(contender(cfg, args, Path(tmp) / f"r{rep}-w{workers}", workers))
    best = {w: min(v) for w, v in walls.items()}
    print(f"speed-up --workers {args.workers} / one worker (distinct trials per second), best wall of "
          f"{args.repeat} each: {best[1] / best[args.workers]:.2f}x")


def contender(cfg: DflashConfig, args: argparse.Namespace, out: Path, workers: int) -> float:
    """One sweep; prints its line and returns its wall time per distinct trial."""
    sargs = SweepArgs(trials=args.trials, storage=str(out / "study.journal"), study="bench",
                      workers=workers, grid=False, out=out, calibration=args.calibration)
    t0, c0 = time.perf_counter(), cpu_s()
    run_sweep(cfg, sargs, progress=False)
    wall, cpu = time.perf_counter() - t0, cpu_s() - c0
    complete, distinct, busy = distinct_complete(sargs.storage, "bench")
    print(f"workers {workers}: {complete} complete, {distinct} distinct trials in {wall:6.1f} s  "
          f"({60 * distinct / wall:6.1f} distinct trials/min); trials running at once on average "
          f"{busy / wall:.2f}; CPU {cpu:.1f} s ({cpu / distinct:.2f} s per trial, {cpu / wall:.2f} cores busy); "
          f"load average {load()}", flush=True)
    return wall / distinct


if __name__ == "__main__":
    main()
