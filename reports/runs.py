"""One run's records (real or simulated) as the report needs them: queue depth, bucket mix, losses.

Both sources share one record schema (docs/ARCHITECTURE.md, "Records"), so one loader serves
``dflash train --out`` directories and ``dflash simulate --records`` directories alike; ``source``
in the records says which.

Queue depth over time is read from the take records' ``bucket_depths`` (the per-bucket depth the
queue itself saw just before each take) rather than rebuilt from produce/take arithmetic: it is the
queue's own view at that instant, so the curve cannot drift from what the queue did (resumes,
discards at stop and blocked producers need no special cases). The rolling bucket mix uses the
windows of docs/ARCHITECTURE.md ("Metrics"): consecutive, non-overlapping windows of W taken items
in global take order.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash.core.mixmetrics import window_counts
from dflash.core.named_configs import named_config_of
from dflash.core.records import read_records

RECORD_FILES = ("take.jsonl", "produce.jsonl", "step.jsonl", "summary.jsonl")
DEFAULT_WINDOW = 32


def is_run_dir(path: Path) -> bool:
    """A run directory holds record files (either source) or a trainer's metrics.json + config.json."""
    return any((path / f).is_file() for f in RECORD_FILES) or (
        (path / "metrics.json").is_file() and (path / "config.json").is_file())


def read_json(path: Path) -> Any:
    """Parsed JSON, or None when the file is missing or unreadable (optional inputs never crash)."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


@dataclass
class RunData:
    dir: Path
    name: str
    source: str  # "real", "sim" or "unknown"
    config: dict[str, Any] | None = None
    metrics: dict[str, Any] | None = None
    eval: dict[str, Any] | None = None
    takes: list[dict[str, Any]] = field(default_factory=list)
    steps: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] | None = None
    controls: list[dict[str, Any]] = field(default_factory=list)  # live queue changes (autopilot, tune-live)
    producer_stages: list[dict[str, float]] = field(default_factory=list)  # produce records' ``stages``, if any

    @property
    def queue(self) -> dict[str, Any] | None:
        """The knobs in force at the run's end (a trainer's summary says them: tune-live and the autopilot
        move them), else the ones its config started with."""
        end = (self.summary or {}).get("queue")
        return end if isinstance(end, dict) else (self.config or {}).get("queue")

    @property
    def bucket_bounds(self) -> list[int] | None:
        return ((self.config or {}).get("workload") or {}).get("bucket_bounds")

    @property
    def n_buckets(self) -> int:
        if self.bucket_bounds:
            return len(self.bucket_bounds)
        return max((len(r.get("bucket_depths") or []) for r in self.takes), default=0)

    @property
    def window(self) -> int:
        w = ((self.config or {}).get("metrics") or {}).get("window")
        return int(w) if isinstance(w, int) and w >= 2 else DEFAULT_WINDOW

    @property
    def tau(self) -> float | None:
        """Acceptance length: eval.json's, else the last one measured during training."""
        if self.eval and self.eval.get("tau") is not None:
            return self.eval["tau"]
        for r in reversed(self.steps):
            ev = r.get("eval")
            if isinstance(ev, dict) and ev.get("tau") is not None:
                return ev["tau"]
        return None


def load_run(path: Path, name: str | None = None) -> RunData:
    """Everything the report reads from one run directory; absent files leave their field empty."""
    takes = list(read_records(path, "take"))
    steps = list(read_records(path, "step"))
    summary = next(reversed(list(read_records(path, "summary"))), None)  # the last session's (after a resume)
    source = next((r.get("source") for r in (*takes[:1], *steps[:1]) if r.get("source")), None)
    if source is None:
        first = next(iter(read_records(path, "produce")), None)
        source = (first or summary or {}).get("source") or "unknown"
    config = read_json(path / "config.json")
    controls = list(read_records(path, "control"))
    producer_stages = [r["stages"] for r in read_records(path, "produce") if isinstance(r.get("stages"), dict)]
    run = RunData(dir=path, name="", source=str(source), config=config if isinstance(config, dict) else None,
                  metrics=_dict_or_none(read_json(path / "metrics.json")),
                  eval=_dict_or_none(read_json(path / "eval.json")), takes=takes, steps=steps, summary=summary,
                  controls=controls, producer_stages=producer_stages)
    run.name = name or named_config_of(run.queue) or path.name
    return run


def _dict_or_none(x: Any) -> dict[str, Any] | None:
    return x if isinstance(x, dict) else None


def depth_series(takes: list[dict[str, Any]], n_buckets: int) -> tuple[list[float], list[int], list[list[int]]]:
    """(t, total depth, per-bucket depths [bucket][take]) just before each take."""
    t = [float(r["t"]) for r in takes]
    total = [int(r.get("depth_before") or 0) for r in takes]
    per = [[int((r.get("bucket_depths") or [])[b]) if b < len(r.get("bucket_depths") or []) else 0
            for r in takes] for b in range(n_buckets)]
    return t, total, per


def rolling_mix(takes: list[dict[str, Any]], window: int, n_buckets: int) -> list[list[float]]:
    """Bucket shares [bucket][window] of each full window of ``window`` taken items, in take order."""
    items = [int(r["bucket"]) for r in takes for _ in (r.get("item_ids") or [None])]
    counts = window_counts(items, window, n_buckets) if n_buckets else []
    return [[c[b] / window for c in counts] for b in range(n_buckets)]


def loss_series(steps: list[dict[str, Any]]) -> tuple[list[int], list[float]]:
    """(step, loss) of the steps that have a finite loss (the first steps of a run may have none)."""
    xs, ys = [], []
    for r in steps:
        loss = r.get("loss")
        if isinstance(loss, (int, float)) and math.isfinite(loss):
            xs.append(int(r["step"]))
            ys.append(float(loss))
    return xs, ys


def bucket_labels(bounds: list[int] | None, n_buckets: int) -> list[str]:
    if bounds and len(bounds) == n_buckets:
        lows = [0, *bounds[:-1]]
        return [f"({lo}, {hi}]" for lo, hi in zip(lows, bounds)]
    return [f"bucket {b}" for b in range(n_buckets)]


def heldout_series(steps: list[dict[str, Any]]) -> list[tuple[int, dict[str, Any]]]:
    """(step, ``heldout`` object) of the step records that carry the held-out metric, in step order."""
    return sorted((int(r["step"]), r["heldout"]) for r in steps
                  if isinstance(r.get("heldout"), dict) and r.get("step") is not None)
