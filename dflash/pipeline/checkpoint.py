"""Exact resume: the item feed's position, atomic checkpoints, and the live-control file.

What makes resume exact is that no item is lost between "drawn from the sampler" and "trained":
:class:`ItemFeed` remembers every item it handed to a target worker until the drafter reports it
trained. A checkpoint (taken between steps) stores the feed's position plus those pending ids; on
resume they are formed again from their ids and produced first (``replayed``), then the feed
continues where it stopped. A policy that reorders items therefore cannot make resume skip or
repeat one.

Checkpoints are directories written under a temporary name and renamed into place, so a kill
during a write leaves the previous checkpoint intact.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from dflash.core.sampler import ItemSpec, Sampler

CHECKPOINT_DIR = "checkpoint"
CONTROL_FILE = "control.json"


class ItemFeed:
    """The shared data loader of the target workers, with a resumable position."""

    def __init__(self, sampler: Sampler, epochs: int | None, epoch: int = 0, index: int = 0,
                 replay: Iterable[str] = ()) -> None:
        self.sampler = sampler
        self.epochs = epochs
        self.epoch, self.index = epoch, index
        self._replay = [sampler.item(i) for i in replay]
        self.replayed = 0
        self._pending: dict[str, None] = {}  # drawn, not yet trained (insertion = draw order)
        self._lock = threading.Lock()

    def next(self) -> ItemSpec | None:
        with self._lock:
            if self._replay:
                spec = self._replay.pop(0)
                self.replayed += 1
            else:
                spec = self._advance()
                if spec is None:
                    return None
            self._pending[spec.item_id] = None
            return spec

    def _advance(self) -> ItemSpec | None:
        while self.epochs is None or self.epoch < self.epochs:
            items = self.sampler.epoch(self.epoch)
            if self.index < len(items):
                spec = items[self.index]
                self.index += 1
                return spec
            self.epoch, self.index = self.epoch + 1, 0
        return None

    def trained(self, item_ids: Iterable[str]) -> None:
        with self._lock:
            for i in item_ids:
                self._pending.pop(i, None)

    def state(self) -> dict[str, Any]:
        """Position and pending ids (replay first on resume: those not yet replayed, then the rest)."""
        with self._lock:
            pending = [s.item_id for s in self._replay] + [i for i in self._pending]
            return {"epoch": self.epoch, "index": self.index, "pending": pending}


def write_checkpoint(run_dir: Path, tensors: dict[str, Any], meta: dict[str, Any]) -> Path:
    """``run_dir/checkpoint/{state.pt,meta.json}``, replaced atomically (rename of a directory)."""
    import torch

    final = run_dir / CHECKPOINT_DIR
    tmp = run_dir / f".{CHECKPOINT_DIR}.tmp"
    old = run_dir / f".{CHECKPOINT_DIR}.old"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    torch.save(tensors, tmp / "state.pt")
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1, default=str))
    for f in (tmp / "state.pt", tmp / "meta.json"):
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
    return final


def read_checkpoint(run_dir: Path) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """The latest complete checkpoint (falls back to the previous one if a swap was interrupted)."""
    import torch

    for name in (CHECKPOINT_DIR, f".{CHECKPOINT_DIR}.old"):
        d = run_dir / name
        if (d / "meta.json").exists() and (d / "state.pt").exists():
            meta = json.loads((d / "meta.json").read_text())
            return torch.load(d / "state.pt", weights_only=False), meta
    return None


def write_control(run_dir: Path, change: dict[str, Any], serial: int) -> Path:
    """The live-control file ``dflash tune-live`` writes and the trainer polls (atomic replace)."""
    path = run_dir / CONTROL_FILE
    tmp = run_dir / f".{CONTROL_FILE}.tmp"
    tmp.write_text(json.dumps({"serial": serial, "queue": change}))
    os.replace(tmp, path)
    return path


def read_control(run_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((run_dir / CONTROL_FILE).read_text())
    except (OSError, ValueError):
        return None
