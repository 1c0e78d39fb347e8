"""``dflash train``: A real training run (dflash/trainer.py); ``--resume DIR`` continues one from its checkpoint."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from dflash.cli.options import WANDB_MODES, Opt, Verb, default_base_config
from dflash.cli.runs import load_run_config
from dflash.cli.verbs.simulate import format_metrics
from dflash.core.config import DflashConfig
from dflash.core.errors import ConfigError


def handle(args: argparse.Namespace, cfg: DflashConfig) -> int:
    """A real training run (dflash/trainer.py); ``--resume DIR`` continues one from its checkpoint."""
    if args.resume:
        if args.out and Path(args.out).resolve() != Path(args.resume).resolve():
            raise ConfigError("--out", "a resumed run continues in its own directory; omit --out", args.out)
        out = Path(args.resume)
        if not (out / "checkpoint" / "meta.json").exists() and not (out / ".checkpoint.old" / "meta.json").exists():
            raise ConfigError("--resume", "must be a run directory with a checkpoint", str(out))
    else:
        out = Path(args.out) if args.out else Path("runs") / time.strftime("train-%Y%m%d-%H%M%S")
        if out.exists() and any(out.iterdir()):
            raise ConfigError("--out", "must be a new or empty directory (use --resume to continue a run)", str(out))
    from dflash.pipeline.trainer import Trainer

    res = Trainer(cfg, out, resume=bool(args.resume), wandb_mode=args.wandb).run()
    s, m = res.summary, res.metrics
    print(f"done: {s['steps']} steps in {s['wall_s']:.0f} s (stopped by {s['stopped_by']}); produced "
          f"{s['produced']} = trained {s['trained']} + discarded_at_stop {s['discarded_at_stop']}"
          + (f"; replayed {s['replayed']}" if s.get("replayed") else ""))
    if m.get("steady_state_reached"):
        print(format_metrics(m))
    print(f"drafter weights: {out / 'drafter'} (load with DFlashDrafter.load(dir, target)); records: {out}")
    return 0


def _base_config(args: argparse.Namespace, overrides: dict[str, Any]) -> DflashConfig:
    """A resumed run keeps its own config (flags still apply); a new one reads --config or the CPU profile."""
    if args.resume:
        return load_run_config(Path(args.resume))
    return default_base_config(args, overrides, cpu_profile=True)


VERB = Verb("real training run", base_config=_base_config, cpu_profile=True, queue_flags=True, opts=(
        Opt("--target", "str", "target model: 'smollm2', a directory, a hub id or a .gguf path",
            key="target.model", metavar="MODEL"),
        Opt("--target-devices", "devices", "target devices, e.g. cuda:0,cuda:1", key="target.devices",
            metavar="LIST"),
        Opt("--drafter-devices", "devices", "drafter devices, e.g. cuda:2,cuda:3", key="drafter.devices",
            metavar="LIST"),
        Opt("--max-steps", "int", "stop after this many steps (>= 1)", key="train.max_steps", metavar="N"),
        Opt("--max-minutes", "float", "stop after this many minutes (> 0)", key="train.max_minutes",
            metavar="M"),
        Opt("--out", "outdir", "run directory", metavar="DIR"),
        Opt("--resume", "indir", "resume the run in this directory", metavar="DIR"),
        Opt("--wandb", "choice", "W&B mode", choices=WANDB_MODES, default="offline",
            metavar="{" + ",".join(WANDB_MODES) + "}"),
    ))
