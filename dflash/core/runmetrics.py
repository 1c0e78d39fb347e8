"""docs/ARCHITECTURE.md's run metrics, computed from the shared records of a real or a simulated run.

One function for both sources is the point: a simulated and a measured ``throughput_tokens_per_s``
or ``mix_efficiency`` are the same computation over the same record fields, so comparing them is a
join. Records are held column-wise in a :class:`RunTrace` (the simulator appends plain tuples, a
real run's JSONL records convert with :meth:`RunTrace.from_records`), and metrics are numpy
reductions over the columns. Torch-free.

The steady-state span runs from max(warmup_s, first time depth >= min_ready) until producers close.
Time fractions are over that span, per worker; intervals are clipped to it.

**Busy** means one thing here and in the calibration (:mod:`simulator.observations`), so a calibrated
simulator's utilisation predicts the measured one (issue #26: 0.87 predicted, 0.47 measured, when
the trainer counted only the drafter's compute but the simulator its whole cycle): a worker is busy
from the start of its work on an item until it is free to start the next one, less the time it is
held at the cap (target) or waits at the gate (drafter). On a drafter that cycle holds the transfer,
the forward and backward, the optimiser step and the ranks' all-reduces; on a target, the
forward plus forming the item and reporting it. A cycle across a hole in the records (a resume) is
its work plus the worker's median time outside it. A simulated take's modelled work already is that
cycle (calibration fits it), so simulated records keep their work as their busy time.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from dflash.core.mixmetrics import mix_metrics

Record = Mapping[str, Any]

PRODUCE_FIELDS = ("t", "item_id", "worker", "bucket", "n_seqs", "real_tokens", "padded_len", "t_start",
                  "t_end", "blocked_s", "bytes")
TAKE_FIELDS = ("t", "drafter", "step", "item_ids", "bucket", "wait_s", "depth_before", "bucket_depths",
               "gate", "compute_s", "tokens", "n_seqs", "anchors")


class RunTrace:
    """The produce and take records of one run as rows of tuples in the field orders above."""

    def __init__(self, real: bool = False) -> None:
        self.produce_rows: list[tuple[Any, ...]] = []
        self.take_rows: list[tuple[Any, ...]] = []
        self.real = real  # a real run's records: busy time is the worker's cycle (module docstring)

    @classmethod
    def from_records(cls, produce: Iterable[Record], take: Iterable[Record]) -> RunTrace:
        produce, take = list(produce), list(take)
        trace = cls(real=any(r.get("source") == "real" for r in (*produce[:1], *take[:1])))
        trace.produce_rows = [tuple(r.get(f) for f in PRODUCE_FIELDS) for r in produce]
        trace.take_rows = [tuple(r.get(f) for f in TAKE_FIELDS) for r in take]
        return trace

    def produce_records(self) -> Iterator[dict[str, Any]]:
        for row in self.produce_rows:
            yield dict(zip(PRODUCE_FIELDS, row))

    def take_records(self) -> Iterator[dict[str, Any]]:
        for row in self.take_rows:
            yield dict(zip(TAKE_FIELDS, row))

    def columns(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """All columns at once (one transpose each, in C)."""
        pc = dict(zip(PRODUCE_FIELDS, zip(*self.produce_rows))) if self.produce_rows else \
            {f: () for f in PRODUCE_FIELDS}
        tc = dict(zip(TAKE_FIELDS, zip(*self.take_rows))) if self.take_rows else \
            {f: () for f in TAKE_FIELDS}
        return pc, tc


class DepthSeries:
    """Queue depth and queued bytes after every put and take (puts first on ties), as arrays."""

    def __init__(self, put_t: np.ndarray, put_bytes: np.ndarray, take_t: np.ndarray,
                 take_items: np.ndarray, take_bytes: np.ndarray, put_after_take: np.ndarray | None = None) -> None:
        n_put, n_take = len(put_t), len(take_t)
        t = np.concatenate([put_t, take_t])
        dd = np.concatenate([np.ones(n_put, dtype=np.int64), -take_items.astype(np.int64)])
        db = np.concatenate([put_bytes.astype(np.int64), -take_bytes.astype(np.int64)])
        # Same-instant order: puts before takes, except the put of a producer that was blocked at the
        # cap, which a take at that instant admitted (it follows the take that freed its slot).
        put_kind = np.zeros(n_put, dtype=np.int8)
        if put_after_take is not None:
            put_kind[put_after_take] = 2
        kind = np.concatenate([put_kind, np.ones(n_take, dtype=np.int8)])
        order = np.lexsort((kind, t))
        self.t = t[order]
        self.depth = np.cumsum(dd[order])
        self.bytes = np.cumsum(db[order])

    def rows(self) -> list[tuple[float, int, int]]:
        return list(zip(self.t.tolist(), self.depth.tolist(), self.bytes.tolist()))

    def first_time_at_least(self, depth: int) -> float | None:
        hit = np.flatnonzero(self.depth >= depth)
        return float(self.t[hit[0]]) if hit.size else None

    def first_time_at_least_schedule(self, schedule: Sequence[tuple[float, int]]) -> float | None:
        """The first time the depth reaches the threshold in force then (``schedule``: (from time, value))."""
        times = np.asarray([t for t, _ in schedule], dtype=np.float64)
        values = np.asarray([v for _, v in schedule], dtype=np.int64)
        k = np.clip(np.searchsorted(times, self.t, side="right") - 1, 0, len(values) - 1)
        hit = np.flatnonzero(self.depth >= values[k])
        return float(self.t[hit[0]]) if hit.size else None

    def time_weighted_mean(self, start: float, end: float, values: np.ndarray) -> float:
        """Mean of the step function (value holds until the next change) over [start, end]."""
        if end <= start:
            return math.nan
        i0 = int(np.searchsorted(self.t, start, side="right"))  # changes up to start set the value
        i1 = int(np.searchsorted(self.t, end, side="left"))
        v0 = values[i0 - 1] if i0 > 0 else 0
        ts = np.concatenate([[start], self.t[i0:i1], [end]])
        vs = np.concatenate([[v0], values[i0:i1]])
        return float(np.dot(np.diff(ts), vs) / (end - start))


MinReady = int | Sequence[tuple[float, int]]  # one value, or (time, value) from the start: the knob in force


def min_ready_in_force(min_ready: MinReady) -> int:
    """The knob in force at the end (what the metrics report as ``min_ready``)."""
    return min_ready if isinstance(min_ready, int) else int(min_ready[-1][1])


def steady_state_span(series: DepthSeries, min_ready: MinReady, warmup_s: float,
                      close_t: float) -> tuple[float, float] | None:
    """(start, end) of the steady state, or None if depth never reached min_ready before close.

    With a schedule (``tune-live`` or the autopilot moved the knob), the span starts the first time the
    depth reaches the min_ready *in force at that time*, as the simulator's streamed metrics judge it."""
    if isinstance(min_ready, int):
        first = series.first_time_at_least(min_ready)
    else:
        first = series.first_time_at_least_schedule(min_ready)
    if first is None:
        return None
    start = max(warmup_s, first)
    return (start, close_t) if close_t > start else None


def clipped(a: Iterable[float], b: Iterable[float], start: float, end: float) -> float:
    """Total length of the intervals [a_i, b_i] inside [start, end]."""
    lo = np.maximum(np.fromiter(a, dtype=float), start)
    hi = np.minimum(np.fromiter(b, dtype=float), end)
    return float(np.clip(hi - lo, 0.0, None).sum())


def run_metrics(trace: RunTrace, *, p: Sequence[float], min_ready: MinReady, window: int, warmup_s: float,
                close_t: float, n_target: int, n_drafter: int, n_buckets: int,
                open_intervals: Mapping[str, Sequence[tuple[float, float]]] | None = None) -> dict[str, Any]:
    """Every docs/ARCHITECTURE.md metric that the produce and take records determine.

    Take records must carry ``compute_s`` (the drafter's compute time for that take), ``tokens``
    and ``n_seqs``; the trained work of a take counts when its compute ends inside the span.
    ``open_intervals`` adds what no record shows yet at the close: ``target_busy`` (items being
    produced), ``target_blocked`` (items held at the cap), ``drafter_wait`` (drafters waiting at
    the gate), ``drafter_busy``; without them the time fractions of a short run fall short.
    """
    pc, tc = trace.columns()
    f8 = np.float64
    t_start, t_end = np.asarray(pc["t_start"], f8), np.asarray(pc["t_end"], f8)
    blocked = np.asarray(pc["blocked_s"], f8)
    put_t = t_end + blocked
    item_index = {iid: k for k, iid in enumerate(pc["item_id"])}
    nbytes = np.asarray(pc["bytes"], np.int64)
    padded = pc["padded_len"]
    take_t = np.asarray(tc["t"], f8)
    take_ids = tc["item_ids"]
    take_items = np.fromiter(map(len, take_ids), np.int64, len(take_ids))
    take_idx = [[item_index.get(i, -1) for i in ids] for ids in take_ids]
    take_bytes = np.fromiter((sum(int(nbytes[k]) for k in ks if k >= 0) for ks in take_idx), np.int64,
                             len(take_idx))
    series = DepthSeries(put_t, nbytes, take_t, take_items, take_bytes, put_after_take=blocked > 0)
    span = steady_state_span(series, min_ready, warmup_s, close_t)
    out: dict[str, Any] = {"steady_state_start_s": None, "steady_state_end_s": close_t,
                           "window": window, "min_ready": min_ready_in_force(min_ready), "warmup_s": warmup_s}
    if span is None:
        out["steady_state_reached"] = False
        return out
    start, end = span
    length = end - start
    out.update(steady_state_start_s=start, steady_state_end_s=end, steady_state_reached=True,
               span_s=length)

    t_done = take_t + np.asarray(tc["compute_s"], f8)
    in_span = (t_done > start) & (t_done <= end)
    out["throughput_tokens_per_s"] = float(np.asarray(tc["tokens"], f8)[in_span].sum()) / length
    out["samples_per_s"] = float(np.asarray(tc["n_seqs"], f8)[in_span].sum()) / length
    out["items_per_s"] = float(take_items[in_span].sum()) / length
    wait = np.asarray(tc["wait_s"], f8)
    extra = open_intervals or {}

    def share(a: np.ndarray, b: np.ndarray, key: str, n: int) -> float:
        """Time in [start, end] of the recorded intervals plus those still open at the close."""
        opened = extra.get(key, ())
        total = clipped(a, b, start, end) + clipped((x for x, _ in opened), (y for _, y in opened), start, end)
        return total / (n * length)

    drafter_end, target_end = t_done, t_end
    if trace.real:  # free_at: when each take's drafter asked for it, the end of its previous cycle
        drafter_end = take_t + busy_cycles(tc["drafter"], take_t, t_done - take_t, take_t - wait)
        target_end = t_start + busy_cycles(pc["worker"], t_start, t_end - t_start, t_start, less=blocked)
    out["drafter_utilization"] = share(take_t, drafter_end, "drafter_busy", n_drafter)
    out["drafter_gate_wait_frac"] = share(take_t - wait, take_t, "drafter_wait", n_drafter)
    out["target_utilization"] = share(t_start, target_end, "target_busy", n_target)
    out["producer_blocked_frac"] = share(t_end, put_t, "target_blocked", n_target)
    out["mean_queue_depth"] = series.time_weighted_mean(start, end, series.depth)
    out["mean_queue_bytes"] = series.time_weighted_mean(start, end, series.bytes)
    out["peak_queue_bytes"] = int(series.bytes.max()) if series.bytes.size else 0
    out["max_queue_depth"] = int(series.depth.max()) if series.depth.size else 0

    first = int(np.searchsorted(take_t, start, side="left"))  # takes are in time order
    take_buckets = tc["bucket"]
    steady_buckets = take_buckets[first:]
    item_buckets = [b for b, ks in zip(steady_buckets, take_idx[first:]) for _ in ks]
    item_lens = [padded[k] if k >= 0 else 0 for ks in take_idx[first:] for k in ks]
    mm = mix_metrics(item_buckets, item_lens, steady_buckets, p, window)
    out.update(mm.as_dict())
    out["max_item_age_s"] = _max_item_age(put_t, pc["bucket"], take_t, take_buckets, take_idx, close_t,
                                          n_buckets)
    return out


def busy_cycles(workers: Sequence[Any], start: np.ndarray, work: np.ndarray, free_at: np.ndarray,
                less: np.ndarray | None = None) -> np.ndarray:
    """Each record's busy time: from its ``start`` to the worker's next ``free_at`` (the next record's
    request, or its start), less ``less`` (time held at the cap), never under its ``work``.

    A worker's last record, and a cycle across a hole (time outside the work over five times the
    worker's median plus 2% of the work, as :func:`simulator.observations._busy_times` rules), get
    the work plus the worker's median time outside it."""
    busy = np.array(work, dtype=np.float64, copy=True)
    if not len(busy):
        return busy
    held = np.zeros(len(busy)) if less is None else np.asarray(less, np.float64)
    w = np.asarray(workers)
    for worker in np.unique(w):
        idx = np.flatnonzero(w == worker)
        idx = idx[np.argsort(start[idx], kind="stable")]
        outside = free_at[idx[1:]] - start[idx[:-1]] - held[idx[:-1]] - busy[idx[:-1]]
        typical = max(0.0, float(np.median(outside))) if outside.size else 0.0
        normal = outside <= 5 * typical + 0.02 * busy[idx[:-1]]
        extra = np.where(normal, np.clip(outside, 0.0, None), typical)
        busy[idx[:-1]] += extra
        busy[idx[-1]] += typical
    return busy


def _max_item_age(put_t: np.ndarray, put_bucket: Sequence[int], take_t: np.ndarray,
                  take_bucket: Sequence[int], take_idx: list[list[int]], close_t: float,
                  n_buckets: int) -> list[float]:
    """Longest wait per bucket; an item never taken waited at least until the close (starvation)."""
    ages = [0.0] * n_buckets
    taken = np.zeros(len(put_t), dtype=bool)
    for t, b, ks in zip(take_t.tolist(), take_bucket, take_idx):
        for k in ks:
            if k >= 0:
                taken[k] = True
                age = t - put_t[k]
                if age > ages[b]:
                    ages[b] = float(age)
    for k in np.flatnonzero(~taken & (put_t <= close_t)).tolist():
        b = put_bucket[k]
        ages[b] = max(ages[b], float(close_t - put_t[k]))
    return ages


def loss_roughness(losses: Sequence[float | None], first_step: int = 0, last_step: int | None = None
                   ) -> dict[str, Any]:
    """docs/ARCHITECTURE.md's ``loss_roughness``: std of first differences of the per-step loss / mean loss,
    over steps [first_step, last_step] (stated beside it). Steps without a loss (no anchors) are
    skipped; None when fewer than three losses are left."""
    last = len(losses) - 1 if last_step is None else last_step
    xs = [float(x) for x in losses[first_step:last + 1] if x is not None and math.isfinite(float(x))]
    out: dict[str, Any] = {"loss_roughness": None, "loss_roughness_steps": [first_step, last]}
    if len(xs) < 3:
        return out
    diffs = np.diff(np.asarray(xs))
    mean = float(np.mean(xs))
    out["loss_roughness"] = float(np.std(diffs, ddof=1) / mean) if mean else None
    return out
