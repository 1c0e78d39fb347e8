"""The run-record schema shared by real and simulated runs (docs/ARCHITECTURE.md "Records").

Append-only JSONL, one file per kind, flushed per write so a killed run keeps what it wrote.
Mix metrics, calibration and reports read either source through :func:`read_records`, which is
what makes "simulated versus measured" a join rather than a port. Torch-free.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

# 2 (issue 34): stage times mean their names (``wait_peers_s`` apart from ``optimizer_s``; ``transfer_s`` the
# receive alone, not the producer's forward), step and summary records say ``shared_gpu``, step records carry
# ``host_syncs``. Calibration reads 1 and 2 (:data:`READABLE_VERSIONS`) and refuses any other in one line.
SCHEMA_VERSION = 2
READABLE_VERSIONS = (1, 2)
KINDS = ("produce", "take", "step", "control", "summary")
SOURCES = ("real", "sim")

# Fields each kind must carry besides the common ones (run_id, source, schema_version, t).
REQUIRED_FIELDS: dict[str, tuple[str, ...]] = {
    "produce": ("item_id", "worker", "bucket", "n_seqs", "real_tokens", "padded_len",
                "t_start", "t_end", "blocked_s", "bytes"),
    "take": ("drafter", "step", "item_ids", "bucket", "wait_s", "depth_before", "bucket_depths"),
    "step": ("step", "loss", "lr", "anchors", "tokens"),
    "control": ("accepted", "change"),
    "summary": ("produced", "trained", "discarded_at_stop"),
}


def clean_json(value: Any) -> Any:
    """JSON has no NaN/inf: write them as null so every reader parses the file."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: clean_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean_json(v) for v in value]
    return value


class RecordWriter:
    """Writes records of one run into ``out_dir/<kind>.jsonl``."""

    def __init__(self, out_dir: str | Path, run_id: str, source: str) -> None:
        if source not in SOURCES:
            raise ValueError(f"source must be one of {SOURCES}")
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.run_id = run_id
        self.source = source
        self._files: dict[str, IO[str]] = {}

    def write(self, kind: str, t: float, **fields: Any) -> dict[str, Any]:
        if kind not in KINDS:
            raise ValueError(f"unknown record kind {kind!r}")
        missing = [f for f in REQUIRED_FIELDS[kind] if f not in fields]
        if missing:
            raise ValueError(f"{kind} record lacks {missing}")
        rec = {"kind": kind, "run_id": self.run_id, "source": self.source,
               "schema_version": SCHEMA_VERSION, "t": t, **fields}
        f = self._files.get(kind)
        if f is None:
            f = self._files[kind] = open(self.dir / f"{kind}.jsonl", "a", encoding="utf-8")  # noqa: SIM115
        f.write(json.dumps(clean_json(rec), separators=(",", ":")) + "\n")
        f.flush()
        return rec

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    def __enter__(self) -> RecordWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_records(run_dir: str | Path, kind: str) -> Iterator[dict[str, Any]]:
    """Records of one kind; a torn last line (a kill mid-write) is skipped, not fatal."""
    path = Path(run_dir) / f"{kind}.jsonl"
    if not path.exists():
        return
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.endswith("\n"):
                break
            yield json.loads(line)


def truncate_after_step(run_dir: str | Path, step: int) -> dict[str, int]:
    """On resume: drop records after the checkpoint's step so nothing appears twice.

    ``take`` and ``step`` records carry a step; ``produce`` records of items not taken by then are
    dropped too (they are produced again), as is everything with ``t`` after the last kept step.
    Files are rewritten atomically. Returns how many records each kind lost.
    """
    run_dir = Path(run_dir)
    kept_steps = [r for r in read_records(run_dir, "step") if r["step"] <= step]
    t_cut = max((r["t"] for r in kept_steps), default=0.0)
    taken_ids = {i for r in read_records(run_dir, "take")
                 if r["step"] is not None and r["step"] <= step for i in r["item_ids"]}
    dropped: dict[str, int] = {}
    for kind in KINDS:
        path = run_dir / f"{kind}.jsonl"
        if not path.exists():
            continue
        keep, lost = [], 0
        for r in read_records(run_dir, kind):
            if kind in ("take", "step"):
                ok = r["step"] is not None and r["step"] <= step
            elif kind == "produce":
                ok = r["item_id"] in taken_ids
            elif kind == "summary":
                ok = False
            else:
                ok = r["t"] <= t_cut
            if ok:
                keep.append(r)
            else:
                lost += 1
        tmp = path.with_suffix(".jsonl.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            for r in keep:
                f.write(json.dumps(r, separators=(",", ":")) + "\n")
        os.replace(tmp, path)
        dropped[kind] = lost
    return dropped


def export_parquet(run_dir: str | Path) -> list[Path]:
    """Write ``<kind>.parquet`` beside each JSONL file (at the end of a run)."""
    import pandas as pd

    out = []
    for kind in KINDS:
        rows = list(read_records(run_dir, kind))
        if not rows:
            continue
        path = Path(run_dir) / f"{kind}.parquet"
        pd.DataFrame(_one_type_per_column(rows)).to_parquet(path, index=False)
        out.append(path)
    return out


def _one_type_per_column(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Parquet wants one type per column; a field whose records disagree (a control record's ``reason`` is
    a sentence for a rejected change and a table for an autopilot decision) is stored as JSON text, and so
    is one holding an empty table anywhere (a summary's ``stage_means_s`` of a run resumed and stopped
    before its first step): Parquet has no struct without a field."""
    kinds: dict[str, set[str]] = {}
    empty: set[str] = set()
    for r in rows:
        for k, v in r.items():
            if v is not None:
                kinds.setdefault(k, set()).add("number" if isinstance(v, int | float) and not isinstance(v, bool)
                                               else type(v).__name__)
                if _holds_empty_table(v):
                    empty.add(k)
    mixed = {k for k, ts in kinds.items() if len(ts) > 1} | empty
    if not mixed:
        return rows
    return [{k: json.dumps(v) if k in mixed and v is not None else v for k, v in r.items()} for r in rows]


def _holds_empty_table(v: Any) -> bool:
    if isinstance(v, dict):
        return not v or any(_holds_empty_table(x) for x in v.values())
    if isinstance(v, list):
        return any(_holds_empty_table(x) for x in v)
    return False
