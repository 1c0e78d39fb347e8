"""``dflash sweep``: An Optuna study over the simulator (tuning/)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from dflash.cli.options import CALIBRATION, Opt, Verb, check_storage_flag
from dflash.core.config import DflashConfig


def handle(args: argparse.Namespace, cfg: DflashConfig) -> int:
    """An Optuna study over the simulator (tuning/)."""
    from dflash.cli.command import one_line
    from simulator.calibration import apply_calibration
    from tuning.sweep import NoFeasibleTrial, format_result, run_sweep, sweep_args

    cfg = apply_calibration(cfg, args.calibration)
    sargs = sweep_args(args, cfg)
    try:
        res = run_sweep(cfg, sargs, progress=sys.stderr.isatty())
    except NoFeasibleTrial as exc:  # the study is kept (it is real work); there is nothing to select
        print(one_line(f"dflash sweep: error: {exc}"), file=sys.stderr)
        return 2
    print(format_result(res, sargs.grid, cfg))
    return 0


def _check(args: argparse.Namespace, overrides: dict[str, Any]) -> None:
    """The storage is reachable and, if new, creatable before any work."""
    if args.storage:
        check_storage_flag(args.storage)


VERB = Verb("Optuna study over the simulator", queue_flags=True, check=_check, pins_data=True, opts=(
        Opt("--trials", "int", "complete trials of distinct configurations in the study, all workers and "
            "restarts together (>= 1; fewer if the space holds fewer)", lo=1, metavar="N"),
        Opt("--storage", "str", "journal file path, sqlite:///FILE or postgresql://URL (default: OUT/study.journal)",
            metavar="URL"),
        Opt("--study", "str", "study name", metavar="NAME"),
        Opt("--workers", "int", "worker processes on this machine, each with its own sampler stream (>= 1)", lo=1,
            metavar="N"),
        Opt("--grid", "switch", "grid search instead of the configured sampler", key="sweep.sampler",
            value="grid"),
        CALIBRATION,
        Opt("--out", "outdir", "output directory (default: sweep-out)", default="sweep-out", metavar="DIR"),
    ))
