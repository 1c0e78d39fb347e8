"""Resolving a resume on the host rank: the newest verified checkpoint, the ledger and records cut back to it.

The checkpoint is valid only together with its ledger step (:func:`dflash.pipeline.checkpoint.verify_checkpoint`
checks both). Ledger commits after it are dropped (those items are in the checkpoint's pending list and are
produced again), as are records after its step; acknowledged ids are never in the replay.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from dflash.core.records import truncate_after_step
from dflash.pipeline.checkpoint import latest_verified
from dflash.pipeline.ledger import acknowledged, read_ledger, truncate_ledger
from dflash.pipeline.service import ResumeState


def resolve_resume(out: Path, progress: Callable[[str], None]) -> tuple[int, str, ResumeState, Path]:
    """(start step, run id, the coordinator's resume state, the checkpoint directory)."""
    steps = {s for s, _ in read_ledger(out)}
    ckpt, meta = latest_verified(out, steps, warn=progress)
    step = int(meta["step"])
    later = truncate_ledger(out, step)
    dropped = truncate_after_step(out, step)
    acked = acknowledged(out, step)
    feed = dict(meta["feed"])
    feed["pending"] = [i for i in feed["pending"] if i not in acked]
    state = ResumeState(feed=feed, t=float(meta["t"]), queue_core=meta["queue_core"],
                        counts={"trained": int(meta["trained"]), "replayed": int(meta.get("replayed", 0)),
                                "skipped_no_anchors": int(meta.get("skipped_no_anchors", 0))},
                        control_serial=int(meta.get("control_serial", 0)), queue_config=meta.get("queue_config"),
                        autopilot=meta.get("autopilot"))
    progress(f"resumed at step {step + 1} from {ckpt}; replaying {len(feed['pending'])} items in flight; "
             f"ledger commits dropped after it: {later}; records dropped: {dropped}")
    return step + 1, str(meta["run_id"]), state, ckpt
