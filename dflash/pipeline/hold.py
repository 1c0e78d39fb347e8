"""Holding a rank job between validation blocks: two small files in the run directory.

Validation trains each configuration in blocks, round by round (A B C A B C ...). Restarting a
job per block cost a process start, a model load and a refill of the queue, whose up to
``max_depth`` in-flight items were produced again (issue #26: ~1.3 s of target forward each on two
cores). Instead the job stays alive across its blocks, paused, its queue intact:

- ``block.json`` (written by whoever drives the validation): ``{"serial": k, "until_step": S}``
  lets the job train up to step S and hold there; ``{"serial": k, "stop": true}`` ends it (the
  normal end: checkpoint, metrics, drafter); ``until_step`` null runs it to its own limits.
- ``held.json`` (written by the job's host rank): ``{"serial": k, "step": S, "beat": wall time}``
  says block k is over: every record of it is on disk and a checkpoint at step S - 1 exists. The
  beat is renewed while the job holds, so a driver (this worker or another sharing the directory)
  can tell a holding job from a dead one.

A held job stops its producers (no admits while paused) so it takes no CPU from the block being
measured, and its coordinator's clock skips the pause, so the records read as one continuous run.
Torch-free; the clock and the sleeping are the callers'.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash.core.atomic import atomic_write_text

BLOCK_FILE = "block.json"
HELD_FILE = "held.json"
HOLD_ENV = "DFLASH_HOLD_BLOCKS"  # "1": the job reads block.json (set only by validation's held jobs)
BEAT_S = 1.0  # a holding job renews held.json this often
STALE_S = 30.0  # a held.json older than this belongs to a job that is gone
HOLD_TIMEOUT_S = 3600.0  # a job held this long with no word from its driver ends itself (cleanly)


@dataclass(frozen=True)
class Block:
    serial: int
    until_step: int | None = None  # hold once this many steps are trained (None: the job's own limits)
    stop: bool = False  # end the job now


def write_block(run: Path, block: Block) -> None:
    atomic_write_text(Path(run) / BLOCK_FILE, json.dumps(
        {"serial": block.serial, "until_step": block.until_step, "stop": block.stop}))


def read_block(run: Path) -> Block | None:
    data = _read(Path(run) / BLOCK_FILE)
    if data is None or type(data.get("serial")) is not int:
        return None
    until = data.get("until_step")
    return Block(data["serial"], until if type(until) is int else None, bool(data.get("stop")))


def write_held(run: Path, serial: int, step: int, ended: bool = False) -> None:
    """The host rank holds after block ``serial`` at ``step`` (or, ``ended``, the job has finished)."""
    atomic_write_text(Path(run) / HELD_FILE, json.dumps({"serial": serial, "step": step, "beat": time.time(),
                                                         "ended": ended}))


def read_held(run: Path) -> dict[str, Any] | None:
    return _read(Path(run) / HELD_FILE)


def holding(run: Path, serial: int, now: float | None = None) -> bool:
    """The job in ``run`` holds after block ``serial`` and is alive (its beat is fresh)."""
    held = read_held(run)
    now = time.time() if now is None else now
    return held is not None and held.get("serial") == serial and not held.get("ended") and \
        now - float(held.get("beat", 0.0)) < STALE_S


def ended(run: Path) -> bool:
    """The held job in ``run`` has finished (its metrics, drafter and final checkpoint are written)."""
    held = read_held(run)
    return held is not None and bool(held.get("ended"))


def pending_end(run: Path, now: float | None = None) -> bool:
    """A held job of ``run`` is alive and has not finished yet (someone still has to stop it)."""
    held = read_held(run)
    now = time.time() if now is None else now
    return held is not None and not held.get("ended") and now - float(held.get("beat", 0.0)) < STALE_S


def _read(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


class HoldWatch:
    """The host rank's view of ``block.json``: is the job due to hold at this step, and what next."""

    def __init__(self, run: Path) -> None:
        self.run = Path(run)
        self.block = read_block(self.run) or Block(serial=-1)

    def due(self, step: int) -> bool:
        """Before training ``step``: the current block ends here (its steps are trained) or says stop."""
        b = self.block
        return b.stop or (b.until_step is not None and step >= b.until_step)

    def next_block(self) -> Block | None:
        """A newer block than the one held, or None (keep holding)."""
        b = read_block(self.run)
        if b is not None and b.serial > self.block.serial:
            self.block = b
            return b
        return None
