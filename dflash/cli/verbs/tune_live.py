"""``dflash tune-live``: write a validated queue change into a running trainer's control file (applied between
takes, or at resume when the trainer is down)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from dflash.cli.options import QUEUE_OPTS, Opt, Verb, given_queue_flags
from dflash.cli.runs import load_run_config
from dflash.core.config import DflashConfig, load_config, with_overrides
from dflash.core.errors import ConfigError


def handle(args: argparse.Namespace, cfg: DflashConfig) -> int:
    """Write the change (validated against the run's own config with its earlier live changes)."""
    from dflash.pipeline.checkpoint import read_control, write_control

    run = Path(args.run_dir)
    ctl = read_control(run) or {"serial": 0, "queue": {}}
    earlier = ctl["queue"] if isinstance(ctl.get("queue"), dict) else {}
    change = {k.removeprefix("queue."): v for k, v in given_queue_flags(args).items()}
    merged = cfg.queue  # validated by the command against the run's config and its earlier changes
    serial = int(ctl["serial"]) + 1
    write_control(run, {k: getattr(merged, k) for k in {**earlier, **change}}, serial)
    down = not _running(run)
    print(f"control #{serial} written to {run / 'control.json'}: {change}; "
          + ("the trainer is not running: it is applied at resume and recorded as a control record" if down else
             "the trainer applies it between takes and records it as a control record"))
    return 0


def _running(run: Path) -> bool:
    """A run with rank status files that say neither finished nor failed (or a run without a summary)."""
    statuses = [p.read_text() for p in (run / ".ranks").glob("rank-*.status")]
    if statuses:
        return any("finished" not in s and "failed" not in s for s in statuses)
    return not (run / "summary.jsonl").exists()


def _check(args: argparse.Namespace, overrides: dict[str, Any]) -> None:
    if not any(o.key in overrides for o in QUEUE_OPTS):
        raise ConfigError(", ".join(o.flag for o in QUEUE_OPTS), "give at least one queue flag to change",
                          show_got=False)


def _base_config(args: argparse.Namespace, overrides: dict[str, Any]) -> DflashConfig:
    """The run's own config with the live changes already written (the flags are judged against that).

    A ``--config`` file is checked like on every verb (its values do not apply: a running trainer keeps
    its own configuration).
    """
    from dflash.pipeline.checkpoint import read_control

    if args.config:
        load_config(args.config)
    run = Path(args.run_dir)
    base = load_run_config(run)
    ctl = read_control(run)
    earlier = ctl["queue"] if ctl is not None and isinstance(ctl.get("queue"), dict) else {}
    try:
        return with_overrides(base, {f"queue.{k}": v for k, v in earlier.items()})
    except (ConfigError, TypeError, ValueError):
        return base  # a hand-edited control file the trainer rejects: judge against the run's config


VERB = Verb("change a running trainer's queue knobs", check=_check, base_config=_base_config, queue_flags=True, opts=(
        Opt("RUN_DIR", "indir", "directory of the running trainer", required=True),
    ))
