"""``dflash calibrate``: Fit the simulator's timing and loss models to runs' records or timing logs
(simulator/fit.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

from dflash.cli.options import Opt, Verb
from dflash.core.config import DflashConfig
from dflash.core.errors import ConfigError


def handle(args: argparse.Namespace, cfg: DflashConfig) -> int:
    """Fit the simulator's timing and loss models to runs' records or timing logs (simulator/fit.py)."""
    from simulator.calibration import calibrate, format_calibration, write_calibration

    out = Path(args.out) if args.out else Path("calibration.json")
    if out.suffix != ".json":
        raise ConfigError("--out", "must be a .json file path", str(out))
    data = calibrate(args.run, cfg, seed=cfg.seed)
    print(format_calibration(data))
    write_calibration(data, out)
    print(f"calibration: {out}  (use: dflash simulate --calibration {out}; dflash sweep --calibration {out})")
    return 0


VERB = Verb("fit the simulator to runs' records", opts=(
        Opt("--run", "inpath", "run directory, or a CSV/Parquet log (repeatable)", required=True,
            repeat=True, metavar="DIR"),
        Opt("--out", "outfile", "calibration file to write", metavar="FILE"),
    ))
