"""``dflash validate``: The selection on the real trainer, compared with the calibrated simulator
(tuning/validation/)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from dflash.cli.options import CALIBRATION, N_DRAFTER, N_TARGET, Opt, Verb
from dflash.core.config import DflashConfig
from dflash.core.errors import ConfigError


def handle(args: argparse.Namespace, cfg: DflashConfig) -> int:
    """The selection on the real trainer, compared with the calibrated simulator (tuning/validation/)."""
    from reports.answer import answer_of
    from tuning.validation.job import run_validation
    from tuning.validation.plan import (
        ValidateArgs,
        block_rule,
        claims_url_for,
        read_selection,
        selection_from_study,
        with_seeds,
    )
    from tuning.validation.summary import format_validation, progress_printer

    out = Path(args.out) if args.out else Path("validation")
    if args.selection:
        selection, sel_path = read_selection(args.selection), str(args.selection)
    else:
        storage = args.storage or "dflash-study.journal"
        selection, sel_path = selection_from_study(args.study, storage, cfg), f"study {args.study} in {storage}"
    takes = int(args.takes) if args.takes is not None else 300
    block, reason = block_rule(cfg, takes, int(args.block_takes) if args.block_takes is not None else None)
    seeds = int(args.seeds) if args.seeds is not None else (2 if cfg.train.quality_every is not None else 1)
    selection = with_seeds(selection, seeds, cfg.seed)  # held-out quality claims need >= 2 training seeds
    vargs = ValidateArgs(selection=selection, selection_path=sel_path, takes=takes, block_takes=block,
                         block_reason=reason, out=out,
                         calibration=args.calibration, claims_url=claims_url_for(args.storage, out),
                         prompts=cfg.train.eval_prompts, force=bool(args.force))
    payload = run_validation(cfg, vargs, progress=progress_printer)
    if payload is None:
        return 0
    print(format_validation(payload))
    print(f"validation: {out / 'validation.json'}")
    answer = answer_of(payload)  # the last two lines: the answer (the report's first section says the same)
    if answer is not None:
        print("\n".join(answer))
    return 0


def _check(args: argparse.Namespace, overrides: dict[str, Any]) -> None:
    if (args.selection is None) == (args.study is None):
        raise ConfigError("--selection/--study", "give exactly one of --selection FILE or --study NAME",
                          show_got=False)
    if args.block_takes is not None and args.takes is not None and args.block_takes > args.takes:
        raise ConfigError("--block-takes", f"must be <= --takes ({args.takes})", args.block_takes)
    if args.storage is not None and args.study is not None:
        from dflash.cli.options import check_storage_flag

        check_storage_flag(args.storage)
    if args.storage is not None and args.study is None and \
            args.storage.split("://", 1)[0].split("+")[0] not in ("sqlite", "postgresql", "mysql"):
        raise ConfigError("--storage", "with --selection: an SQL URL (sqlite:///PATH or postgresql://...) shared "
                                       "by validation workers", args.storage)


VERB = Verb("run the selection on the real trainer; compare with predictions", check=_check, cpu_profile=True,
            pins_data=True, opts=(
        Opt("--selection", "infile", "selection file (instead of --study)", metavar="FILE"),
        Opt("--study", "str", "study to select from (instead of --selection)", metavar="NAME"),
        Opt("--storage", "str", "Optuna storage URL of --study", metavar="URL"),
        Opt("--top-k", "int", "configs taken from the study (>= 1)", key="sweep.top_k", metavar="K"),
        CALIBRATION,
        N_TARGET,
        N_DRAFTER,
        Opt("--takes", "int", "most takes per validated config (>= 1; default 300)", lo=1, metavar="N"),
        Opt("--seeds", "int", "training seeds per config for the held-out quality comparison (>= 1; default 2 "
            "with [train] quality_every, else 1)", lo=1, metavar="N"),
        Opt("--block-takes", "int", "takes per config per round; rounds alternate the configs and stop when "
                                    "every comparison is resolved (>= 1; default: whole mega-batches holding one "
                                    "metrics window, see docs/guide/validate.md)", lo=1, metavar="N"),
        Opt("--force", "switch", "run even where the memory model says a device would not hold the jobs"),
        Opt("--out", "outdir", "output directory", metavar="DIR"),
    ))
