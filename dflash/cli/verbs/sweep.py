"""``dflash sweep``: An Optuna study over the simulator (tuning/)."""

from __future__ import annotations

import argparse
import sys

from dflash.cli.options import CALIBRATION, Opt, Verb
from dflash.core.config import DflashConfig


def handle(args: argparse.Namespace, cfg: DflashConfig) -> int:
    """An Optuna study over the simulator (tuning/)."""
    from simulator.calibration import apply_calibration
    from tuning.sweep import format_result, run_sweep, sweep_args

    cfg = apply_calibration(cfg, args.calibration)
    sargs = sweep_args(args, cfg)
    res = run_sweep(cfg, sargs, progress=sys.stderr.isatty())
    print(format_result(res, sargs.grid, cfg))
    return 0


VERB = Verb("Optuna study over the simulator", queue_flags=True, opts=(
        Opt("--trials", "int", "complete trials in the study, all workers together (>= 1)", lo=1,
            metavar="N"),
        Opt("--storage", "str", "Optuna storage URL (default: a local storage)", metavar="URL"),
        Opt("--study", "str", "study name", metavar="NAME"),
        Opt("--workers", "int", "worker processes (>= 1)", lo=1, metavar="N"),
        Opt("--grid", "switch", "grid search instead of the configured sampler", key="sweep.sampler",
            value="grid"),
        CALIBRATION,
        Opt("--out", "outdir", "output directory", metavar="DIR"),
    ))
