"""Block metrics: docs/ARCHITECTURE.md's metrics on one block's own records, and their means.

A measurement's standard error comes from its spread over the blocks of a configuration (the unit of
replication); ``loss_roughness`` is of the whole run (its second half). ``rel_errors`` and
``within_goals`` set a measurement beside the simulator's prediction.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from dflash.core.config import DflashConfig
from dflash.core.records import read_records
from tuning.validation.evidence import OBJECTIVES

COMPARED = ("throughput_tokens_per_s", "samples_per_s", "mix_efficiency", "mix_entropy", "mix_kl",
            "length_autocorr", "max_bucket_streak", "drafter_utilization", "target_utilization",
            "drafter_gate_wait_frac", "producer_blocked_frac", "mean_queue_depth", "peak_queue_bytes",
            "loss_roughness")
GOALS = "throughput within 5%; mix_efficiency within max(0.03, 2 SE of the measurement); loss_roughness within 20%"


def block_metrics(run_dir: Path, cfg: DflashConfig, t0: float) -> dict[str, Any]:
    """docs/ARCHITECTURE.md's metrics on the block's own records (after ``t0``, the previous block's last take).

    The depth series starts with the items queued at ``t0``. A held job kept them: the steady state
    goes on and the block is measured from ``t0``. A resumed run replays them and its refill is
    excluded: the measurement begins when the queue holds ``min_ready`` items again. ``mix_efficiency`` needs
    windows; a block with fewer than two windows of items is measured with a window of half its
    items (``mix_window`` says which).
    """
    from dflash.core.runmetrics import RunTrace, run_metrics
    from simulator.workload import make_sampler

    all_takes = list(read_records(run_dir, "take"))
    taken_before = {i for r in all_takes if float(r["t"]) <= t0 for i in r["item_ids"]}
    latest: dict[str, dict[str, Any]] = {}  # an item replayed at a resume: its last produce record
    for r in read_records(run_dir, "produce"):
        if r["item_id"] not in taken_before:
            latest[r["item_id"]] = r
    produce = sorted(latest.values(), key=lambda r: float(r["t"]))
    takes = sorted((r for r in all_takes if float(r["t"]) > t0), key=lambda r: r["t"])
    sampler = make_sampler(cfg.workload, cfg.target.model, cfg.seed, cfg.drafter.block_size)
    close_t = max((float(r["t"]) + float(r.get("compute_s") or 0.0) for r in takes), default=0.0)
    window = max(2, min(cfg.metrics.window, sum(len(r["item_ids"]) for r in takes) // 2))
    # Items queued at t0 were kept (a held job): the steady state goes on from t0, whatever the gate
    # did since (with hysteresis the depth may stay under min_ready); after a resume nothing was kept.
    kept = any(float(r["t_end"]) + float(r.get("blocked_s") or 0.0) <= t0 for r in produce)
    m = run_metrics(RunTrace.from_records(produce, takes), p=sampler.item_mix(),
                    min_ready=1 if kept else cfg.queue.min_ready,
                    window=window, warmup_s=max(0.0, t0), close_t=close_t, n_target=cfg.cluster.n_target,
                    n_drafter=cfg.cluster.n_drafter, n_buckets=sampler.n_buckets)
    out = {k: m.get(k) for k in COMPARED if k != "loss_roughness"}
    return {**out, "mix_window": window, "takes": len(takes), "t_start": m.get("steady_state_start_s"),
            "t_end": m.get("steady_state_end_s")}


def rel_errors(measured: dict[str, Any], predicted: dict[str, Any]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for k in COMPARED:
        m, p = measured.get(k), (predicted.get(k) or {}).get("mean")
        out[k] = (p - m) / abs(m) if m not in (None, 0) and p is not None else None
    return out


def within_goals(measured: dict[str, Any], se: dict[str, Any], predicted: dict[str, Any]) -> dict[str, bool | None]:
    def err(k: str) -> float | None:
        m, p = measured.get(k), (predicted.get(k) or {}).get("mean")
        return None if m is None or p is None else p - m

    out: dict[str, bool | None] = {}
    e = err("throughput_tokens_per_s")
    out["throughput_tokens_per_s"] = None if e is None else abs(e) <= 0.05 * abs(measured["throughput_tokens_per_s"])
    e = err("mix_efficiency")
    out["mix_efficiency"] = None if e is None else abs(e) <= max(0.03, 2 * (se.get("mix_efficiency") or 0.0))
    e = err("loss_roughness")
    out["loss_roughness"] = None if e is None else abs(e) <= 0.20 * abs(measured["loss_roughness"])
    return out


def block_table(block_rows: list[dict[str, Any]]) -> dict[str, dict[str, list[float]]]:
    """config -> objective -> per-block values, blocks in order; blocks without a value left out."""
    out: dict[str, dict[str, list[float]]] = {}
    for r in sorted(block_rows, key=lambda r: (r["name"], r["block"])):
        per = out.setdefault(r["name"], {k: [] for k in (*OBJECTIVES, "peak_queue_bytes")})
        for k in per:
            v = r.get(k)
            if v is not None and math.isfinite(float(v)):
                per[k].append(float(v))
    return out


def block_means(blocks: list[dict[str, Any]], metrics: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Every compared metric as the mean over blocks with its standard error from their spread;
    ``peak_queue_bytes`` the highest block; ``loss_roughness`` of the whole run (its second half)."""
    measured: dict[str, Any] = {}
    se: dict[str, Any] = {}
    for k in COMPARED:
        xs = [float(b[k]) for b in blocks if b.get(k) is not None and math.isfinite(float(b[k]))]
        if k == "peak_queue_bytes":
            measured[k], se[k] = (max(xs) if xs else None), None
            continue
        measured[k] = float(np.mean(xs)) if xs else None
        se[k] = float(np.std(xs, ddof=1) / math.sqrt(len(xs))) if len(xs) > 1 else None
    measured["loss_roughness"] = metrics.get("loss_roughness")
    se["loss_roughness"] = None
    return measured, se
