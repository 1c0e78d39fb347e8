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


def block_metrics(run_dir: Path, cfg: DflashConfig, first_step: int, upto_step: int | None = None) -> dict[str, Any]:
    """docs/ARCHITECTURE.md's metrics on one block of a run directory's records (steps ``first_step``
    to ``upto_step``, exclusive): :func:`records_block_metrics` on the records a real run wrote."""
    from dflash.core.sampler import heldout_per_bucket
    from simulator.workload import make_sampler

    sampler = make_sampler(cfg.workload, cfg.target.model, cfg.seed, cfg.drafter.block_size,
                           heldout_per_bucket=heldout_per_bucket(cfg))
    return records_block_metrics(list(read_records(run_dir, "produce")), list(read_records(run_dir, "take")), cfg,
                                 p=sampler.item_mix(), n_buckets=sampler.n_buckets, first_step=first_step,
                                 upto_step=upto_step)


def records_block_metrics(produce: list[dict[str, Any]], takes: list[dict[str, Any]], cfg: DflashConfig, *,
                          p: list[float], n_buckets: int, first_step: int, upto_step: int | None = None
                          ) -> dict[str, Any]:
    """The metrics of one block (the takes of steps ``first_step`` .. ``upto_step - 1``) from produce and
    take records: the one computation for a hardware block and a simulated block (like with like).

    The window is the configured ``[metrics] window`` whatever the block's length: the window defines
    the metric and a block is only the unit of replication (a block holding fewer than one window of
    items has no ``mix_efficiency``). The block starts at ``t0``, the previous block's last take. The
    depth series starts with the items queued at ``t0``: a held job (and the simulator, which never
    stops) kept them, so the steady state goes on and the block is measured from ``t0``; a resumed
    run replays them and its refill is excluded (the measurement begins when the queue holds
    ``min_ready`` items again). Items put after the block's close are not the block's.
    """
    from dflash.core.runmetrics import RunTrace, run_metrics

    def in_block(r: dict[str, Any]) -> bool:
        return int(r["step"]) >= first_step and (upto_step is None or int(r["step"]) < upto_step)

    t0 = max((float(r["t"]) for r in takes if int(r["step"]) < first_step), default=-math.inf)
    block = sorted((r for r in takes if in_block(r)), key=lambda r: float(r["t"]))
    close_t = max((float(r["t"]) + float(r.get("compute_s") or 0.0) for r in block), default=0.0)
    taken_before = {i for r in takes if float(r["t"]) <= t0 for i in r["item_ids"]}
    latest: dict[str, dict[str, Any]] = {}  # an item replayed at a resume: its last produce record
    for r in sorted(produce, key=lambda r: float(r["t"])):
        if r["item_id"] not in taken_before and float(r["t_end"]) <= close_t:
            latest[r["item_id"]] = r
    kept_items = sorted(latest.values(), key=lambda r: float(r["t"]))
    window = cfg.metrics.window
    # Items queued at t0 were kept (a held job): the steady state goes on from t0, whatever the gate
    # did since (with hysteresis the depth may stay under min_ready); after a resume nothing was kept.
    kept = any(float(r["t_end"]) + float(r.get("blocked_s") or 0.0) <= t0 for r in kept_items)
    m = run_metrics(RunTrace.from_records(kept_items, block), p=p, min_ready=1 if kept else cfg.queue.min_ready,
                    window=window, warmup_s=max(0.0, t0), close_t=close_t, n_target=cfg.cluster.n_target,
                    n_drafter=cfg.cluster.n_drafter, n_buckets=n_buckets)
    out = {k: m.get(k) for k in COMPARED if k != "loss_roughness"}
    return {**out, "mix_window": window, "takes": len(block), "t_start": m.get("steady_state_start_s"),
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
    """config -> objective -> per-block values, blocks in order; blocks without a value left out, and
    the blocks of a seed replicate (``replicate_of``: its run serves the held-out comparison only)."""
    out: dict[str, dict[str, list[float]]] = {}
    for r in sorted((r for r in block_rows if not r.get("replicate_of")), key=lambda r: (r["name"], r["block"])):
        per = out.setdefault(r["name"], {k: [] for k in (*OBJECTIVES, "peak_queue_bytes")})
        for k in per:
            v = r.get(k)
            if v is not None and math.isfinite(float(v)):
                per[k].append(float(v))
    return out


def peak_bytes(blocks: dict[str, dict[str, list[float]]]) -> dict[str, float]:
    """Each configuration's peak queue memory over its blocks (:func:`block_table`); inf when none was
    recorded, so a configuration of unknown cost is never the cheapest."""
    return {n: max(b["peak_queue_bytes"]) if b["peak_queue_bytes"] else math.inf for n, b in blocks.items()}


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


TRANSIENT_RULE = ("the first block (process start, model load, the queue's first fill) is dropped from the "
                  "measurement and the prediction alike when a configuration has two blocks or more; a single "
                  "block is kept in both (its transient is then in both)")


def kept_blocks(n: int) -> list[int]:
    """The blocks that count, of ``n`` measured (:data:`TRANSIENT_RULE`); the same for the prediction."""
    return list(range(1, n)) if n >= 2 else list(range(n))


def bucket_use(run_dir: Path, cfg: DflashConfig) -> dict[str, Any] | None:
    """The one-bucket pathology in a run's takes: the longest run of consecutive takes from one bucket
    (:func:`dflash.core.mixmetrics.max_bucket_streak`, the metric ``max_bucket_streak``) and the share of
    takes from the most-taken bucket, named by its upper length bound; None without takes."""
    from collections import Counter

    from dflash.core.mixmetrics import max_bucket_streak

    takes = sorted(read_records(run_dir, "take"), key=lambda r: float(r["t"]))
    if not takes:
        return None
    buckets = [int(r["bucket"]) for r in takes]
    streak, n = max_bucket_streak(buckets)
    top, count = Counter(buckets).most_common(1)[0]
    bounds = cfg.workload.bucket_bounds
    name = f"<={bounds[top]}" if 0 <= top < len(bounds) else str(top)
    return {"longest_streak": int(streak), "streak_takes": int(n), "top_share": count / len(buckets),
            "top_bucket": name, "takes": len(buckets)}
