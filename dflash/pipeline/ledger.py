"""The ack ledger: the item ids trained in each optimizer step, committed by one writer (the coordinator).

One JSON line per step (``{"step": s, "item_ids": [...]}``), flushed at once and fsynced before a
checkpoint of that step is written, so a checkpoint is valid only together with its ledger step. On resume the
ledger is cut back to the checkpoint's step; the ids it acknowledges are never produced again, and
everything else drawn before the kill (queued, in flight, assigned) is produced again.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import IO

LEDGER_FILE = "ledger.jsonl"


class Ledger:
    """Append-only writer of ``run_dir/ledger.jsonl``."""

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / LEDGER_FILE
        self._f: IO[str] | None = None
        self.last_step = max((s for s, _ in read_ledger(run_dir)), default=-1)

    def commit(self, step: int, item_ids: Iterable[str]) -> None:
        if step <= self.last_step:
            raise RuntimeError(f"ledger step {step} committed twice (last {self.last_step})")
        if self._f is None:
            self._f = open(self.path, "a", encoding="utf-8")  # noqa: SIM115
        self._f.write(json.dumps({"step": step, "item_ids": list(item_ids)}, separators=(",", ":")) + "\n")
        self._f.flush()  # durable at the next sync(): before the checkpoint of this step is written
        self.last_step = step

    def sync(self) -> None:
        if self._f is not None:
            os.fsync(self._f.fileno())

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def read_ledger(run_dir: Path) -> list[tuple[int, list[str]]]:
    """Committed (step, item ids) in order; a torn last line (a kill mid-write) is not a commit."""
    path = Path(run_dir) / LEDGER_FILE
    if not path.exists():
        return []
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.endswith("\n"):
                break
            rec = json.loads(line)
            out.append((int(rec["step"]), [str(i) for i in rec["item_ids"]]))
    return out


def truncate_ledger(run_dir: Path, step: int) -> int:
    """Keep the commits up to ``step`` (the checkpoint's); returns how many were dropped."""
    rows = read_ledger(run_dir)
    keep = [(s, ids) for s, ids in rows if s <= step]
    path = Path(run_dir) / LEDGER_FILE
    tmp = path.with_suffix(".jsonl.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for s, ids in keep:
            f.write(json.dumps({"step": s, "item_ids": ids}, separators=(",", ":")) + "\n")
    os.replace(tmp, path)
    return len(rows) - len(keep)


def acknowledged(run_dir: Path, upto_step: int) -> set[str]:
    return {i for s, ids in read_ledger(run_dir) if s <= upto_step for i in ids}
