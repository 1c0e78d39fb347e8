"""``dflash train``: a real training run, one process per device (dflash/pipeline); ``--resume DIR`` continues one.

Plain ``dflash train`` starts n_target + n_drafter ranks on this machine; ``--nproc-per-node N``
starts N through torch's elastic launcher; under ``torchrun ... -m dflash train`` each process is
one rank. Everything checkable without a model is checked here first (one line, exit 2).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from dflash.cli.options import N_DRAFTER, N_TARGET, WANDB_MODES, Opt, Verb, default_base_config
from dflash.cli.runs import load_run_config
from dflash.core.config import DflashConfig
from dflash.core.errors import ConfigError

DEVICE_RULE = ("retired: each rank uses cuda:LOCAL_RANK when CUDA is available, else the CPU; choose the roles "
               "with --n-target/--n-drafter (or [cluster] n_target/n_drafter) and the processes with "
               "--nproc-per-node or torchrun")
# What a run directory holds that a restart in place removes (a run killed before its first checkpoint).
RUN_FILES = ("config.json", "ledger.jsonl", "control.jsonl", "produce.jsonl", "take.jsonl", "step.jsonl",
             "summary.jsonl", "metrics.json", ".ranks", "checkpoint", "drafter", "wandb")


def handle(args: argparse.Namespace, cfg: DflashConfig) -> int:
    """Check the run directory and the launch, then run the ranks (dflash.pipeline.launch)."""
    from dflash.pipeline.launch import check_launch, launch, under_launcher
    from dflash.pipeline.nodes import Nodes
    from dflash.pipeline.rank import RunSpec

    nodes = Nodes.from_flags(args.nnodes, args.node_rank, args.rdzv_endpoint, under_launcher=under_launcher())
    if nodes.several and not (args.out or args.resume):
        raise ConfigError("--out", f"must be given with --nnodes {nodes.count}: the same path on every node "
                          "(storage every node sees)", show_got=False)
    lead = _is_first_rank() if under_launcher() else nodes.rank == 0  # the process that prepares the directory
    if not lead and not args.resume:
        out, resume = _default_out(args), False  # the first rank checks and prepares the directory
    else:
        out, resume = _run_dir(args, cfg)
    if resume == "finished":
        return 0
    said: list[str] = []
    cfg = _pin_data(cfg, said.append)
    local = check_launch(cfg, args.nproc_per_node, nodes)  # world size, GPUs per node: before any model loads
    from dflash.pipeline.hostmem import check_node_fits

    cfg.cluster.check_trainable()  # a sharded target is simulator-only
    node = int(os.environ.get("GROUP_RANK", 0)) if under_launcher() else nodes.rank
    # pre-flight: each device of this node holds the roles placed on it (its own capacity; --force: start anyway)
    check_node_fits(cfg, local, force=args.force, node_rank_offset=node * local)
    if lead:  # the data set and model path, once, before any rank starts
        from dflash.data.preflight import check_data_inputs

        check_data_inputs(cfg.workload, cfg.target.model)
        print(*said, flush=True)  # the data line, once the data proved usable
    if any(d != "cpu" for d in (*cfg.target.devices, *cfg.drafter.devices)) and lead:
        print("note: [target] devices and [drafter] devices are not used by dflash train: each rank uses "
              "cuda:LOCAL_RANK when CUDA is available, else the CPU")
    if lead:
        _prepare(out, cfg, resume=bool(resume))
    spec = RunSpec(cfg, str(out), resume=bool(resume), wandb=args.wandb, **debug_knobs())
    return launch(spec, args.nproc_per_node, nodes=nodes)


def _pin_data(cfg: DflashConfig, say: Any) -> DflashConfig:
    """The data file resolved once (``"auto"``: the regenerated cache if complete), said in one line by the
    first rank, fingerprinted; the run's config.json records it and a resume refuses a changed file."""
    from dflash.data.dataset_choice import pin_dataset
    from dflash.pipeline.launch import under_launcher

    first = not under_launcher() or _is_first_rank()
    return pin_dataset(cfg, say=say if first else (lambda _line: None))


def debug_knobs() -> dict[str, Any]:
    """Test and debugging knobs from the environment: DFLASH_CHECK_TRANSFERS=1 checks every received item
    against its id; DFLASH_WAIT_S=S bounds every wait (a take, an admit, a round) and the process-group timeout."""
    import os

    knobs: dict[str, Any] = {"check_transfers": os.environ.get("DFLASH_CHECK_TRANSFERS") == "1"}
    wait = os.environ.get("DFLASH_WAIT_S")
    if wait:
        try:
            knobs["wait_s"] = knobs["pg_timeout_s"] = float(wait)
        except ValueError:
            raise ConfigError("DFLASH_WAIT_S", "must be a number of seconds", wait) from None
    return knobs


def _is_first_rank() -> bool:
    import os

    return os.environ.get("RANK") == "0"


def _default_out(args: argparse.Namespace) -> Path:
    """--out, else runs/train-<time> (under a launcher: named by the launcher's run id, the same on every rank)."""
    import os

    if args.out:
        return Path(args.out)
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    return Path("runs") / (f"train-{run_id}" if run_id else time.strftime("train-%Y%m%d-%H%M%S"))


def _holds_a_run(out: Path) -> bool:
    """Anything in ``out`` but rank status files and held-out target states linked in before the start (a
    validation or benchmark shares one copy of them: :func:`dflash.pipeline.heldout.adopt_states`)."""
    from dflash.pipeline.heldout import STATES_FILE

    adopted = out / STATES_FILE
    return any(p != adopted and ".ranks" not in p.relative_to(out).parts for p in out.rglob("*") if not p.is_dir())


def _run_dir(args: argparse.Namespace, cfg: DflashConfig) -> tuple[Path, str | bool]:
    """The run directory and how to start: False (new), True (resume) or "finished" (nothing to do)."""
    if not args.resume:
        out = _default_out(args)
        if out.exists() and _holds_a_run(out) and not _restartable(out):
            raise ConfigError("--out", "must be a new or empty directory (use --resume to continue a run)", str(out))
        return out, False
    if args.out and Path(args.out).resolve() != Path(args.resume).resolve():
        raise ConfigError("--out", "a resumed run continues in its own directory; omit --out", args.out)
    out = Path(args.resume)
    ckpt = _verified_checkpoint(out)
    finished = _finished(out)
    if finished is not None and not str(finished.get("stopped_by", "")).startswith("signal") and not has_room(
            int(finished["steps"]), _training_s(ckpt), cfg.train.max_steps, cfg.train.max_minutes):
        print(f"{out}: the run is finished ({finished['steps']} steps, stopped by {finished['stopped_by']}); give a "
              f"larger --max-steps or --max-minutes to extend it")
        return out, "finished"
    return out, True


def has_room(steps: int, training_s: float, max_steps: int | None, max_minutes: float | None) -> bool:
    """Whether limits leave a finished run something to train: at least one limit set and none reached
    (an extension then opens a new schedule phase, dflash.pipeline.optim.LrSchedule.load_state_dict)."""
    if max_steps is None and max_minutes is None:
        return False
    return (max_steps is None or max_steps > steps) and (max_minutes is None or 60.0 * max_minutes > training_s)


def _training_s(ckpt: Path) -> float:
    """Training time of every session so far, from the newest checkpoint (memory-mapped: no full load)."""
    import torch

    state = torch.load(ckpt / "state.pt", weights_only=False, map_location="cpu", mmap=True)
    return float(state.get("elapsed_s", 0.0))


def _verified_checkpoint(out: Path) -> Path:
    from dflash.pipeline.checkpoint import CheckpointError, checkpoint_dirs, latest_verified
    from dflash.pipeline.ledger import read_ledger

    if not checkpoint_dirs(out):
        raise ConfigError("--resume", "must be a run directory with a checkpoint; a run killed before its first "
                          f"checkpoint starts again in place with --out {out}", str(out))
    try:
        return latest_verified(out, {s for s, _ in read_ledger(out)}, warn=print)[0]
    except (CheckpointError, ValueError) as exc:
        raise ConfigError("--resume", f"refused: {exc}", show_got=False) from None


def _restartable(out: Path) -> bool:
    """A run directory killed before its first checkpoint (it can start again in place)."""
    from dflash.pipeline.checkpoint import checkpoint_dirs

    if not any(p.name != ".ranks" for p in out.iterdir()):
        return True  # only the rank status files of ranks that are starting
    return (out / "config.json").is_file() and not checkpoint_dirs(out) and not (out / "summary.jsonl").exists()


def _finished(out: Path) -> dict[str, Any] | None:
    try:
        lines = (out / "summary.jsonl").read_text().splitlines()
        return json.loads(lines[-1]) if lines else None
    except (OSError, ValueError):
        return None


def _prepare(out: Path, cfg: DflashConfig, *, resume: bool) -> None:
    """A new run: the directory, emptied of a run killed before its first checkpoint, and its config."""
    from dflash.core.run_config import write_run_config

    if not resume:
        if out.exists() and (out / "config.json").exists() and _restartable(out):
            print(f"{out}: a run killed before its first checkpoint; starting it again in place")
            for name in RUN_FILES:
                p = out / name
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
            for p in out.glob("*.parquet"):
                p.unlink()
        out.mkdir(parents=True, exist_ok=True)
        write_run_config(out, cfg)


def _check(args: argparse.Namespace, overrides: dict[str, Any]) -> None:
    for flag in ("target_devices", "drafter_devices"):
        if getattr(args, flag) is not None:
            raise ConfigError("--" + flag.replace("_", "-"), DEVICE_RULE, show_got=False)


def _base_config(args: argparse.Namespace, overrides: dict[str, Any]) -> DflashConfig:
    """A resumed run keeps its own config (flags still apply); a new one reads --config or the CPU profile."""
    if args.resume:
        return load_run_config(Path(args.resume))
    return default_base_config(args, overrides, cpu_profile=True)


VERB = Verb("real training run, one process per device", base_config=_base_config, check=_check, cpu_profile=True,
            queue_flags=True, opts=(
        Opt("--target", "str", "target model: 'smollm2', a directory, a hub id or a .gguf path",
            key="target.model", metavar="MODEL"),
        N_TARGET,
        N_DRAFTER,
        Opt("--nproc-per-node", "int", "processes to start on this node (>= 1; default n_target + n_drafter)",
            lo=1, metavar="N"),
        Opt("--nnodes", "int", "nodes of the job, each started with this command (>= 1; above 1 needs "
            "--node-rank and --rdzv-endpoint; under torchrun give them to torchrun)", lo=1, metavar="N"),
        Opt("--node-rank", "int", "this node's number, 0 .. nnodes - 1 (node 0 prepares the run directory)",
            lo=0, metavar="R"),
        Opt("--rdzv-endpoint", "str", "where node 0 meets the other nodes, the same on every node",
            metavar="HOST:PORT"),
        Opt("--target-devices", "str", "retired (see the device rule in --help of --nproc-per-node)", metavar="LIST"),
        Opt("--drafter-devices", "str", "retired (see the device rule)", metavar="LIST"),
        Opt("--max-steps", "int", "stop after this many steps (>= 1)", key="train.max_steps", metavar="N"),
        Opt("--max-minutes", "float", "stop after this many minutes (> 0)", key="train.max_minutes",
            metavar="M"),
        Opt("--quality-every", "int", "score the drafter on a held-out set every N steps (>= 1; the step "
            "records' heldout: loss, acceptance and tau with intervals)", key="train.quality_every", metavar="N"),
        Opt("--force", "switch", "start even where the memory model says a device would not hold the run"),
        Opt("--out", "outdir", "run directory", metavar="DIR"),
        Opt("--resume", "indir", "resume the run in this directory", metavar="DIR"),
        Opt("--wandb", "choice", "W&B mode", choices=WANDB_MODES, default="offline",
            metavar="{" + ",".join(WANDB_MODES) + "}"),
    ))
