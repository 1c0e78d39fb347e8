"""DESIGN.md's run metrics, computed from the shared records of a real or a simulated run.

One function for both sources is the point: a simulated and a measured ``throughput_tokens_per_s``
or ``mix_efficiency`` are the same computation over the same record fields, so comparing them is a
join. Torch-free.

The steady-state span runs from max(warmup_s, first time depth >= min_ready) until producers close.
Time fractions are over that span, per worker; intervals are clipped to it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from dflash.mixmetrics import mix_metrics

Record = Mapping[str, Any]


def depth_series(produce: Sequence[Record], take: Sequence[Record]) -> list[tuple[float, int, int]]:
    """(t, depth, queued_bytes) after every put and take, in time order (puts first on ties)."""
    events: list[tuple[float, int, int, int]] = []
    size: dict[str, int] = {}
    for r in produce:
        put_t = r["t_end"] + r["blocked_s"]
        size[r["item_id"]] = r["bytes"]
        events.append((put_t, 0, 1, r["bytes"]))
    for r in take:
        nb = sum(size.get(i, 0) for i in r["item_ids"])
        events.append((r["t"], 1, -len(r["item_ids"]), -nb))
    events.sort(key=lambda e: (e[0], e[1]))
    out = []
    depth = qbytes = 0
    for t, _, dd, db in events:
        depth += dd
        qbytes += db
        out.append((t, depth, qbytes))
    return out


def steady_state_span(series: Sequence[tuple[float, int, int]], min_ready: int, warmup_s: float,
                      close_t: float) -> tuple[float, float] | None:
    """(start, end) of the steady state, or None if depth never reached min_ready before close."""
    first = next((t for t, d, _ in series if d >= min_ready), None)
    if first is None:
        return None
    start = max(warmup_s, first)
    return (start, close_t) if close_t > start else None


def clipped(intervals: Iterable[tuple[float, float]], start: float, end: float) -> float:
    """Total length of the intervals inside [start, end]."""
    total = 0.0
    for a, b in intervals:
        lo, hi = max(a, start), min(b, end)
        if hi > lo:
            total += hi - lo
    return total


def time_weighted_mean(series: Sequence[tuple[float, int, int]], start: float, end: float,
                       field: int = 1) -> float:
    """Mean of a step function (value holds until the next change) over [start, end]."""
    if end <= start:
        return math.nan
    area, prev_t, prev_v = 0.0, start, 0
    for row in series:
        t, v = row[0], row[field]
        if t <= start:
            prev_v = v
            continue
        if t >= end:
            break
        area += prev_v * (t - prev_t)
        prev_t, prev_v = t, v
    area += prev_v * (end - prev_t)
    return area / (end - start)


def run_metrics(produce: Sequence[Record], take: Sequence[Record], *, p: Sequence[float],
                min_ready: int, window: int, warmup_s: float, close_t: float, n_target: int,
                n_drafter: int, n_buckets: int) -> dict[str, Any]:
    """Every DESIGN.md metric that the produce and take records determine.

    Take records must carry ``compute_s`` (the drafter's compute time for that take), ``tokens``
    and ``n_seqs``; the trained work of a take counts when its compute ends inside the span.
    """
    series = depth_series(produce, take)
    span = steady_state_span(series, min_ready, warmup_s, close_t)
    out: dict[str, Any] = {"steady_state_start_s": None, "steady_state_end_s": close_t,
                           "window": window, "min_ready": min_ready, "warmup_s": warmup_s}
    if span is None:
        out["steady_state_reached"] = False
        return out
    start, end = span
    length = end - start
    out.update(steady_state_start_s=start, steady_state_end_s=end, steady_state_reached=True,
               span_s=length)

    done = [(r["t"] + r["compute_s"], r) for r in take]
    in_span = [(t_done, r) for t_done, r in done if start < t_done <= end]
    out["throughput_tokens_per_s"] = sum(r["tokens"] for _, r in in_span) / length
    out["samples_per_s"] = sum(r["n_seqs"] for _, r in in_span) / length
    out["items_per_s"] = sum(len(r["item_ids"]) for _, r in in_span) / length
    out["drafter_utilization"] = clipped(((r["t"], t) for t, r in done), start, end) / (n_drafter * length)
    out["drafter_gate_wait_frac"] = clipped(((r["t"] - r["wait_s"], r["t"]) for r in take),
                                            start, end) / (n_drafter * length)
    out["target_utilization"] = clipped(((r["t_start"], r["t_end"]) for r in produce),
                                        start, end) / (n_target * length)
    out["producer_blocked_frac"] = clipped(((r["t_end"], r["t_end"] + r["blocked_s"]) for r in produce),
                                           start, end) / (n_target * length)
    out["mean_queue_depth"] = time_weighted_mean(series, start, end, 1)
    out["mean_queue_bytes"] = time_weighted_mean(series, start, end, 2)
    out["peak_queue_bytes"] = max((b for _, _, b in series), default=0)
    out["max_queue_depth"] = max((d for _, d, _ in series), default=0)

    padded = {r["item_id"]: r["padded_len"] for r in produce}
    put_t = {r["item_id"]: r["t_end"] + r["blocked_s"] for r in produce}
    steady_takes = [r for r in take if r["t"] >= start]
    item_buckets = [r["bucket"] for r in steady_takes for _ in r["item_ids"]]
    item_lens = [padded.get(i, 0) for r in steady_takes for i in r["item_ids"]]
    mm = mix_metrics(item_buckets, item_lens, [r["bucket"] for r in steady_takes], p, window)
    out.update(mm.as_dict())
    ages = [0.0] * n_buckets
    taken_ids = set()
    for r in take:
        for i in r["item_ids"]:
            taken_ids.add(i)
            if i in put_t:
                ages[r["bucket"]] = max(ages[r["bucket"]], r["t"] - put_t[i])
    for r in produce:  # never taken: it waited at least until the close (starvation shows here)
        if r["item_id"] not in taken_ids and put_t[r["item_id"]] <= close_t:
            ages[r["bucket"]] = max(ages[r["bucket"]], close_t - put_t[r["item_id"]])
    out["max_item_age_s"] = ages
    return out
