"""The block runner: train one block of one configuration on the real trainer, measure it alone.

On the CPU a configuration's rank job stays alive across its blocks, held between them with its
queue intact (:mod:`dflash.pipeline.hold`); on GPUs block 0 starts the run and later blocks resume
its checkpoint. This is the one module of :mod:`tuning.validation` that starts trainer processes.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dflash.core.config import UNSET, DflashConfig, with_overrides
from dflash.core.records import clean_json
from tuning.validation.metrics import block_metrics
from tuning.validation.plan import ValidateArgs, block_steps, queue_overrides


def run_block(entry: dict[str, Any], block: int, base: DflashConfig, args: ValidateArgs,
              progress: Callable[[str], None]) -> dict[str, Any]:
    """Train one block of one configuration and measure the block alone; the block's row.

    On the CPU the configuration's rank job stays alive across its blocks, held between them with
    its queue intact (:mod:`dflash.pipeline.hold`: no process start, model load or refill per block).
    On GPUs, where a held job would keep its device memory from the next configuration, block 0
    starts the run and later blocks resume its checkpoint with a larger step budget."""
    from dflash.pipeline.heldout import adopt_states, publish_states

    name = entry["name"]
    upto, total = block_steps(base, args, block)
    held = keep_alive(base)
    # schedule_steps: the LR schedule is that of the whole budget whatever block we are in.
    run_cfg = with_overrides(base, {**queue_overrides(entry["queue"]), "train.max_steps": total if held else upto,
                                    "train.schedule_steps": total, "train.max_minutes": UNSET,
                                    "train.eval_every": UNSET, **seed_overrides(entry, base)})
    run_dir = args.out / "runs" / name
    if block == 0 and run_dir.exists():  # a dead worker's partial first block: start over
        release(run_dir)
        shutil.rmtree(run_dir)
    shared = shared_states(run_cfg, args.out)
    if shared is not None and block == 0:
        adopt_states(shared, run_dir)  # the held-out target states, computed once per validation
    t_start = time.perf_counter()
    if held:
        hold_block(run_cfg, run_dir, block, upto, total)
        steps = upto
    else:
        steps = train_block(run_cfg, run_dir, resume=block > 0, progress=progress).get("steps")
    wall_s = time.perf_counter() - t_start
    if shared is not None:
        publish_states(run_dir, shared)
    # The block starts after the previous block's last step. Read after the resume: a dead worker's
    # half of this block past the checkpoint was dropped from the records and trained again.
    before = block_steps(base, args, block - 1)[0] if block else 0
    measured = block_metrics(run_dir, run_cfg, before, upto)
    replicate = {"replicate_of": entry["replicate_of"], "seed": entry["seed"]} if entry.get("replicate_of") else {}
    return clean_json({"name": name, "block": block, "steps": steps, "held": held, "wall_s": wall_s, **measured,
                       **replicate})


def seed_overrides(entry: dict[str, Any], base: DflashConfig) -> dict[str, Any]:
    """A seed replicate (:func:`tuning.validation.plan.with_seeds`) trains with its own seed and scores the
    base seed's held-out set."""
    held_out = base.seed if base.train.quality_seed is None else base.train.quality_seed
    return {"seed": int(entry["seed"]), "train.quality_seed": held_out} if entry.get("replicate_of") else {}


def shared_states(cfg: DflashConfig, out: Path) -> Path | None:
    """The validation's one copy of the held-out target states (None: the held-out metric is off)."""
    from dflash.pipeline.heldout import STATES_FILE

    return out / STATES_FILE if cfg.train.quality_every is not None else None


def keep_alive(cfg: DflashConfig) -> bool:
    """Hold each configuration's job between its blocks when every rank runs on the CPU (host memory
    holds several small jobs; a GPU's memory is wanted by the next configuration's job)."""
    return all(d == "cpu" for d in (*cfg.target.devices, *cfg.drafter.devices)) and not _cuda_available()


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


BLOCK_TIMEOUT_S = 3600.0  # a block that shows no end in this long is a hang
HELD: dict[Path, Any] = {}  # this worker's held jobs (dflash.pipeline.trainer.HeldJob), by run directory


def hold_block(cfg: DflashConfig, run_dir: Path, block: int, upto: int, total: int) -> None:
    """Block ``block`` of a held job: continue this worker's job (or another worker's, through the
    files in its run directory), else start the job (resuming the run after block 0); returns when
    the job holds after the block or, after the last block, has ended."""
    from dflash.pipeline.hold import Block, holding
    from dflash.pipeline.trainer import HeldJob

    nxt = Block(block, upto if upto < total else None)
    job = HELD.get(run_dir)
    if job is not None and job.alive() and job.serial == block - 1:
        state = job.advance(nxt, BLOCK_TIMEOUT_S)
    elif job is None and block > 0 and holding(run_dir, block - 1):
        state = _drive_foreign(run_dir, nxt)
    else:
        if job is not None:
            job.kill()
        job = HELD[run_dir] = HeldJob(cfg, run_dir, resume=block > 0, first=nxt)
        state = job.wait(BLOCK_TIMEOUT_S)
    if state == "ended":
        HELD.pop(run_dir, None)


def _drive_foreign(run_dir: Path, nxt: Any) -> str:
    """Another worker's job holds in ``run_dir`` (a shared output directory): give it the block by file."""
    from dflash.pipeline.hold import ended, holding, write_block

    write_block(run_dir, nxt)
    deadline = time.monotonic() + BLOCK_TIMEOUT_S
    while not holding(run_dir, nxt.serial):
        if ended(run_dir):
            return "ended"
        if time.monotonic() > deadline:
            raise TimeoutError(f"the held job in {run_dir} showed no end of block {nxt.serial}")
        time.sleep(0.1)
    return "held"


def release(run_dir: Path | None = None) -> None:
    """End this worker's held jobs (all, or the one of ``run_dir``) the normal way: metrics, drafter."""
    for d in [run_dir] if run_dir is not None else list(HELD):
        job = HELD.pop(d, None)
        if job is not None:
            job.stop(BLOCK_TIMEOUT_S)


def wait_for_held_ends(run_dirs: list[Path]) -> None:
    """Other workers end their held jobs as they finish; their metrics are read only after that."""
    from dflash.pipeline.hold import pending_end

    deadline = time.monotonic() + BLOCK_TIMEOUT_S
    while any(pending_end(d) for d in run_dirs):
        if time.monotonic() > deadline:
            raise TimeoutError("held jobs of other workers did not end")
        time.sleep(0.5)


def train_block(cfg: DflashConfig, run_dir: Path, *, resume: bool, progress: Callable[[str], None]) -> dict[str, Any]:
    """The block as the rank job ``dflash train [--resume]`` runs, one process per rank (1 + 1 is two
    processes): what is validated is what the recommendation will launch. The summary record."""
    from dflash.pipeline.trainer import train

    return train(cfg, run_dir, resume=resume, quiet=True).summary
