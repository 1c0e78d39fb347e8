"""Exact resume: the item feed's position, atomic checkpoints, and the live-control file.

What makes resume exact is that no item is lost between "drawn from the sampler" and "trained":
:class:`ItemFeed` remembers every item it handed to a target worker until the drafter reports it
trained. A checkpoint (taken between steps) stores the feed's position plus those pending ids; on
resume they are formed again from their ids and produced first (``replayed``), then the feed
continues where it stopped. A policy that reorders items therefore cannot make resume skip or
repeat one.

Checkpoints fail closed: each is a directory whose ``manifest.json`` (written last) lists every
file with its size and sha256, the step and the ledger step. Resume loads only a checkpoint that
verifies, falls back to the previous one when the newest does not (saying so), and otherwise
refuses in one line naming the file and what is wrong.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from collections.abc import Callable, Iterable
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


MANIFEST = "manifest.json"
KEEP_CHECKPOINTS = 2  # the newest and the one before it (the fallback when the newest does not verify)


class CheckpointError(RuntimeError):
    """No checkpoint of a run verifies: one line naming the file and what is wrong."""


def _sha256(path: Path) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_checkpoint(run_dir: Path, tensors: dict[str, Any], meta: dict[str, Any]) -> Path:
    """``run_dir/checkpoint/step-NNNNNNNN/{state.pt,meta.json,manifest.json}``; the manifest is written last.

    The manifest lists each file's relative path, size and sha256, the step and the ledger step; a
    directory without a manifest (a kill during the write) is never resumed from. The newest
    :data:`KEEP_CHECKPOINTS` are kept.
    """
    import torch

    root = run_dir / CHECKPOINT_DIR
    final = root / f"step-{int(meta['step']):08d}"
    tmp = root / f".{final.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    torch.save(tensors, tmp / "state.pt")
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1, default=str))
    files = []
    for name in ("state.pt", "meta.json"):
        with open(tmp / name, "rb") as fh:
            os.fsync(fh.fileno())
        files.append({"path": name, "size": (tmp / name).stat().st_size, "sha256": _sha256(tmp / name)})
    manifest = {"step": int(meta["step"]), "ledger_step": meta.get("ledger_step", int(meta["step"])),
                "records": meta.get("records", {}), "files": files}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
    with open(tmp / MANIFEST, "rb") as fh:
        os.fsync(fh.fileno())
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    for old in checkpoint_dirs(run_dir)[:-KEEP_CHECKPOINTS]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def checkpoint_dirs(run_dir: Path) -> list[Path]:
    """Checkpoint directories, oldest first (those being written, ``.step-*.tmp``, are not listed)."""
    root = Path(run_dir) / CHECKPOINT_DIR
    return sorted(p for p in root.glob("step-*") if p.is_dir()) if root.is_dir() else []


def verify_checkpoint(d: Path, ledger_steps: set[int] | None = None) -> str | None:
    """None when ``d`` verifies; else what is wrong, naming the file."""
    try:
        manifest = json.loads((d / MANIFEST).read_text())
        files, step = manifest["files"], int(manifest["step"])
    except FileNotFoundError:
        return f"{d / MANIFEST}: missing (the checkpoint was not finished)"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"{d / MANIFEST}: not a valid manifest ({type(exc).__name__}: {exc})"
    for entry in files:
        f = d / str(entry.get("path"))
        if not f.is_file():
            return f"{f}: missing"
        if f.stat().st_size != entry.get("size"):
            return f"{f}: {f.stat().st_size} bytes, the manifest says {entry.get('size')}"
        if _sha256(f) != entry.get("sha256"):
            return f"{f}: content does not match its sha256 in the manifest"
    try:
        meta = json.loads((d / "meta.json").read_text())
    except ValueError as exc:
        return f"{d / 'meta.json'}: not JSON ({exc})"
    if meta.get("step") != step:
        return f"{d / 'meta.json'}: step {meta.get('step')!r} disagrees with the manifest's {step}"
    if ledger_steps is not None and manifest.get("ledger_step", step) not in ledger_steps:
        return f"{d}: its ledger step {manifest.get('ledger_step', step)} is not in the run's ledger"
    return None


def latest_verified(run_dir: Path, ledger_steps: set[int] | None = None,
                    warn: Callable[[str], None] | None = None) -> tuple[Path, dict[str, Any]]:
    """The newest checkpoint that verifies and its meta; falls back to the previous one, saying so.

    Raises CheckpointError (one line) when none verifies or there is none. Load its tensors with
    :func:`load_state` (never an unverified file).
    """
    dirs = checkpoint_dirs(run_dir)
    if not dirs:
        raise CheckpointError(f"{Path(run_dir) / CHECKPOINT_DIR}: no checkpoint yet")
    problems = []
    for d in reversed(dirs):
        problem = verify_checkpoint(d, ledger_steps)
        if problem is None:
            if problems and warn is not None:
                warn(f"checkpoint {problems[0]}; falling back to the previous verified checkpoint {d.name}")
            return d, json.loads((d / "meta.json").read_text())
        problems.append(problem)
    raise CheckpointError(f"no checkpoint verifies: {problems[0]}"
                          + (f" (and {len(problems) - 1} older)" if len(problems) > 1 else ""))


def load_state(d: Path) -> dict[str, Any]:
    import torch

    return torch.load(d / "state.pt", weights_only=False, map_location="cpu")


def write_control(run_dir: Path, change: dict[str, Any], serial: int) -> Path:
    """The live-control file ``dflash tune-live`` writes and the trainer polls (atomic replace)."""
    path = run_dir / CONTROL_FILE
    tmp = run_dir / f".{CONTROL_FILE}.tmp"
    tmp.write_text(json.dumps({"serial": serial, "queue": change}))
    os.replace(tmp, path)
    return path


class ControlWatch:
    """Sees each new version of the control file once: a change with a new serial, or what is wrong with it.

    The trainer polls it between takes; whatever a person writes there, ``poll`` returns (change, None),
    (None, problem) or (None, None) and never raises, so a hostile file is recorded and the run goes on.
    """

    def __init__(self, run_dir: Path, serial: int = 0) -> None:
        self.path = Path(run_dir) / CONTROL_FILE
        self.serial = serial
        self._seen: tuple[int, int] | None = None

    def poll(self) -> tuple[dict[str, Any] | None, str | None]:
        try:
            st = self.path.stat()
        except OSError:
            return None, None
        key = (st.st_mtime_ns, st.st_size)
        if key == self._seen:
            return None, None
        self._seen = key
        ctl = read_control(self.path.parent)
        if ctl is None:
            return None, f"{CONTROL_FILE} is not a JSON object with an integer 'serial' (use dflash tune-live)"
        if ctl["serial"] <= self.serial:
            return None, None
        self.serial = ctl["serial"]
        return ctl, None


def read_control(run_dir: Path) -> dict[str, Any] | None:
    """The control file as written by ``write_control``; None when absent or not of that shape.

    Whatever a person puts there, the caller gets either None or ``{"serial": int, "queue": ...}``
    (the queue part is validated by the caller like any config).
    """
    try:
        ctl = json.loads((run_dir / CONTROL_FILE).read_text())
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(ctl, dict) or type(ctl.get("serial")) is not int:
        return None
    return {"serial": ctl["serial"], "queue": ctl.get("queue")}


def rejected_change(value: Any) -> dict[str, str]:
    """A rejected control value as a record field: whatever it was, as JSON text under one key.

    (One shape for every rejected value, so the records' Parquet export can type the column.)
    """
    import json

    try:
        text = json.dumps(value, allow_nan=False, default=repr)
    except (TypeError, ValueError, RecursionError):
        text = repr(value)
    return {"rejected": text[:500]}
