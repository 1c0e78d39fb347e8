"""Streaming run metrics: DESIGN.md's metrics in memory that does not grow with simulated time.

:func:`dflash.core.runmetrics.run_metrics` computes the metrics from every produce and take record,
so a simulation that keeps its records grows by ~100 bytes per item: a simulated week needs
gigabytes. :class:`StreamMetrics` computes the same numbers as the events happen, with running sums
and bounded state: the items in the queue (for their age), the drafters' steps still computing, the
current mix window, the first 1,000 steady-state takes (for the streak) and downsampled series for
plots. The tests hold it to ``run_metrics`` over the records of the same runs; the mix formulas
are :mod:`dflash.core.mixmetrics`'s own.

Why no state before the steady state starts: the span starts at max(warmup_s, first time depth >=
min_ready), never before the current event, so an interval already over when the start is still
unknown cannot overlap the span. Only intervals that end in the future (drafter steps still
computing) are held until they end.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

from dflash.core.mixmetrics import MixMetrics, entropy, expected_window_entropy, kl_to_mix, max_bucket_streak

STREAK_TAKES = 1000  # DESIGN.md: max_bucket_streak over the first n = min(takes, 1,000) steady takes
MAX_POINTS = 1000  # points kept per plotted series


class Downsampled:
    """At most ``MAX_POINTS`` of a stream, evenly strided: the stride doubles whenever it fills."""

    def __init__(self, limit: int = MAX_POINTS) -> None:
        self.limit = limit
        self.points: list[Any] = []
        self.stride = 1
        self._n = 0

    def add(self, point: Any) -> None:
        if self._n % self.stride == 0:
            self.points.append(point)
            if len(self.points) >= self.limit:
                self.points = self.points[::2]
                self.stride *= 2
        self._n += 1


class StreamMetrics:
    """Feed it puts, produced items and takes in simulation order; :meth:`finish` gives the metrics."""

    def __init__(self, *, p: Sequence[float], min_ready: int, window: int, warmup_s: float, n_target: int,
                 n_drafter: int, n_buckets: int) -> None:
        self.p, self.min_ready, self.window, self.warmup_s = list(p), min_ready, window, warmup_s
        self.n_target, self.n_drafter, self.n_buckets = n_target, n_drafter, n_buckets
        self.start: float | None = None  # of the steady state, once known
        # queue level: depth, bytes, their time integrals over the span and their peaks
        self.depth = self.bytes = self.max_depth = self.peak_bytes = 0
        self.last_t = 0.0
        self.depth_area = self.bytes_area = 0.0
        self.queued: dict[str, tuple[float, int]] = {}  # item id -> (put time, bucket)
        self.ages = [0.0] * n_buckets
        # time shares over the span and trained work
        self.busy = {"drafter_busy": 0.0, "drafter_wait": 0.0, "target_busy": 0.0, "target_blocked": 0.0}
        self.computing: deque[tuple[float, float, int, int, int]] = deque()  # (t, t_done, tokens, seqs, items)
        self.tokens = self.seqs = self.items = 0
        # mix: the open window, running sums over closed windows, the streak's takes
        self.win = [0] * n_buckets
        self.win_n = 0
        self.h_sum = self.h_sq = self.kl_sum = 0.0
        self.n_windows = self.n_items = 0
        self.len_n, self.len_s, self.len_s2, self.len_lag = 0, 0.0, 0.0, 0.0
        self.len_first: float | None = None
        self.len_last: float | None = None
        self.streak_buckets: list[int] = []
        self.depth_series = Downsampled()  # (t, depth before, bucket depths) at takes
        self.window_series = Downsampled()  # bucket counts of windows

    # ------------------------------------------------------------------ queue level
    def _level(self, t: float, d_depth: int, d_bytes: int) -> None:
        start = self.start
        if start is not None and t > start:
            dt = t - (self.last_t if self.last_t > start else start)
            self.depth_area += self.depth * dt
            self.bytes_area += self.bytes * dt
        self.last_t = t
        self.depth += d_depth
        self.bytes += d_bytes

    def put(self, t: float, item_id: str, bucket: int, nbytes: int) -> None:
        """An item entered the queue (at the instant, in the order, the queue decided it)."""
        self._level(t, 1, nbytes)
        self.queued[item_id] = (t, bucket)
        if self.depth > self.max_depth:
            self.max_depth = self.depth
        if self.bytes > self.peak_bytes:
            self.peak_bytes = self.bytes
        if self.start is None and self.depth >= self.min_ready:
            self.start = t if t > self.warmup_s else self.warmup_s

    def produced(self, t_start: float, t_end: float, put_t: float) -> None:
        """A producer's finished cycle: busy from t_start to t_end, blocked at the cap until put_t."""
        start = self.start
        if start is not None:
            busy = self.busy
            if t_end > start:
                busy["target_busy"] += t_end - (t_start if t_start > start else start)
            if put_t > start and put_t > t_end:
                busy["target_blocked"] += put_t - (t_end if t_end > start else start)

    def take(self, t: float, items: Sequence[tuple[str, int, int]], bucket: int, wait_s: float, compute_s: float,
             tokens: int, n_seqs: int, depth_before: int, bucket_depths: tuple[int, ...]) -> None:
        """A take of ``items`` = (item id, padded length, bytes) from ``bucket`` at ``t``."""
        self._level(t, -len(items), -sum(it[2] for it in items))
        self.depth_series.add((t, depth_before, bucket_depths))
        ages, queued = self.ages, self.queued
        for item_id, _, _ in items:
            put_t, _b = queued.pop(item_id)
            if t - put_t > ages[bucket]:
                ages[bucket] = t - put_t
        self._settle_computing(t)
        self.computing.append((t, t + compute_s, tokens, n_seqs, len(items)))
        start = self.start
        if start is None or t < start:
            return
        if t - wait_s < t:
            self.busy["drafter_wait"] += t - (t - wait_s if t - wait_s > start else start)
        if len(self.streak_buckets) < STREAK_TAKES:
            self.streak_buckets.append(bucket)
        for _, padded, _ in items:
            self._mix_item(bucket, float(padded))

    def _mix_item(self, bucket: int, padded: float) -> None:
        self.n_items += 1
        self.win[bucket] += 1
        self.win_n += 1
        if self.len_first is None:
            self.len_first = padded
        if self.len_last is not None:
            self.len_lag += self.len_last * padded
        self.len_last = padded
        self.len_n += 1
        self.len_s += padded
        self.len_s2 += padded * padded
        if self.win_n == self.window:
            h = entropy(self.win)
            self.h_sum += h
            self.h_sq += h * h
            self.kl_sum += kl_to_mix(self.win, self.p)
            self.n_windows += 1
            self.window_series.add(tuple(self.win))
            self.win = [0] * self.n_buckets
            self.win_n = 0

    def _settle_computing(self, now: float) -> None:
        """Account the drafter steps that have ended by ``now`` (they end inside the span or before it)."""
        computing = self.computing
        while computing and computing[0][1] <= now:
            self._account_step(*computing.popleft(), end=math.inf)
        if len(computing) > 4 * (self.n_drafter + 1):  # steps end out of order: sweep the rest too
            keep = [c for c in computing if c[1] > now]
            for c in computing:
                if c[1] <= now:
                    self._account_step(*c, end=math.inf)
            computing.clear()
            computing.extend(keep)

    def _account_step(self, t: float, t_done: float, tokens: int, n_seqs: int, n_items: int, *, end: float) -> None:
        start = self.start
        if start is None or t_done <= start:
            return
        done = t_done if t_done < end else end
        if done > start:
            self.busy["drafter_busy"] += done - (t if t > start else start)
        if t_done <= end:
            self.tokens += tokens
            self.seqs += n_seqs
            self.items += n_items

    # ------------------------------------------------------------------ the end
    def finish(self, close_t: float, open_intervals: Mapping[str, Sequence[tuple[float, float]]] | None = None
               ) -> dict[str, Any]:
        """The metrics dict of :func:`dflash.core.runmetrics.run_metrics` for a run closed at ``close_t``."""
        out: dict[str, Any] = {"steady_state_start_s": None, "steady_state_end_s": close_t, "window": self.window,
                               "min_ready": self.min_ready, "warmup_s": self.warmup_s}
        start = self.start
        if start is None or close_t <= start:
            out["steady_state_reached"] = False
            return out
        self._level(close_t, 0, 0)
        for step in self.computing:
            self._account_step(*step, end=close_t)
        self.computing.clear()
        busy = dict(self.busy)
        for key, intervals in (open_intervals or {}).items():
            busy[key] = busy.get(key, 0.0) + sum(max(0.0, min(b, close_t) - max(a, start)) for a, b in intervals)
        length = close_t - start
        out.update(steady_state_start_s=start, steady_state_end_s=close_t, steady_state_reached=True, span_s=length,
                   throughput_tokens_per_s=self.tokens / length, samples_per_s=self.seqs / length,
                   items_per_s=self.items / length,
                   drafter_utilization=busy["drafter_busy"] / (self.n_drafter * length),
                   drafter_gate_wait_frac=busy["drafter_wait"] / (self.n_drafter * length),
                   target_utilization=busy["target_busy"] / (self.n_target * length),
                   producer_blocked_frac=busy["target_blocked"] / (self.n_target * length),
                   mean_queue_depth=self.depth_area / length, mean_queue_bytes=self.bytes_area / length,
                   peak_queue_bytes=self.peak_bytes, max_queue_depth=self.max_depth)
        out.update(self._mix())
        ages = list(self.ages)
        for put_t, b in self.queued.values():
            if put_t <= close_t and close_t - put_t > ages[b]:
                ages[b] = close_t - put_t
        out["max_item_age_s"] = ages
        return out

    def _mix(self) -> dict[str, Any]:
        """The mix metrics of :func:`dflash.core.mixmetrics.mix_metrics`, from the running sums."""
        n = self.n_windows
        k = sum(1 for pb in self.p if pb > 0)
        nan = math.nan
        mean_h = self.h_sum / n if n else nan
        if n:
            expected = expected_window_entropy(self.p, self.window)
            mix_entropy = mean_h / math.log(k) if k > 1 else nan
            efficiency = mean_h / expected if expected > 0 else nan
            kl = self.kl_sum / n
        else:
            mix_entropy = efficiency = kl = nan
        streak, n_streak = max_bucket_streak(self.streak_buckets, STREAK_TAKES)
        out = MixMetrics(self.window, n, self.n_items, mix_entropy, efficiency, kl, self._autocorr(), streak,
                         n_streak, ()).as_dict()
        se = nan
        if n >= 2 and math.isfinite(efficiency) and efficiency != 0 and mean_h > 0:
            var = max(0.0, (self.h_sq - n * mean_h * mean_h) / (n - 1))
            se = efficiency * math.sqrt(var / n) / mean_h
        out["mix_efficiency_se"] = se
        return out

    def _autocorr(self) -> float:
        """Lag-1 autocorrelation of taken items' padded lengths from running sums (as mixmetrics')."""
        n = self.len_n
        if n < 3:
            return math.nan
        m = self.len_s / n
        var = self.len_s2 - n * m * m
        if var <= 1e-12 * max(self.len_s2, 1.0):
            return math.nan
        assert self.len_first is not None and self.len_last is not None
        cov = self.len_lag - m * (self.len_s - self.len_last) - m * (self.len_s - self.len_first) + (n - 1) * m * m
        return cov / var
