"""``dflash tune-live``: Write a validated queue change into a running trainer's control file (applied between
takes)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from dflash.cli.options import QUEUE_OPTS, Opt, Verb, given_queue_flags
from dflash.cli.runs import load_run_config
from dflash.core.config import DflashConfig, load_config, with_overrides
from dflash.core.errors import ConfigError


def handle(args: argparse.Namespace, cfg: DflashConfig) -> int:
    """Write a validated queue change into a running trainer's control file (applied between takes)."""
    from dflash.pipeline.checkpoint import read_control, write_control

    run = Path(args.run_dir)
    base = load_run_config(run)
    ctl = read_control(run) or {}
    current = {**base.queue.__dict__, **ctl.get("queue", {})}
    change = {k.removeprefix("queue."): v for k, v in given_queue_flags(args).items()}
    merged = with_overrides(base, {f"queue.{k}": v for k, v in {**current, **change}.items()})  # validates
    serial = int(ctl.get("serial", 0)) + 1
    write_control(run, {k: getattr(merged.queue, k) for k in {**ctl.get("queue", {}), **change}}, serial)
    print(f"control #{serial} written to {run / 'control.json'}: {change}; the trainer applies it between takes "
          f"and records it as a control record")
    return 0


def _check(args: argparse.Namespace, overrides: dict[str, Any]) -> None:
    if not any(o.key in overrides for o in QUEUE_OPTS):
        raise ConfigError(", ".join(o.flag for o in QUEUE_OPTS), "give at least one queue flag to change",
                          show_got=False)


def _base_config(args: argparse.Namespace, overrides: dict[str, Any]) -> DflashConfig:
    # The values themselves first (and a --config file like anywhere), then against the run's own config.
    with_overrides(load_config(args.config), overrides)
    return load_run_config(Path(args.run_dir))


VERB = Verb("change a running trainer's queue knobs", check=_check, base_config=_base_config, queue_flags=True, opts=(
        Opt("RUN_DIR", "indir", "directory of the running trainer", required=True),
    ))
