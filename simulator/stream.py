"""Streaming run metrics: docs/ARCHITECTURE.md's metrics in memory that does not grow with simulated time.

:func:`dflash.core.runmetrics.run_metrics` computes the metrics from every produce and take record,
so a simulation that keeps its records grows by ~100 bytes per item: a simulated week needs
gigabytes. :class:`StreamMetrics` computes the same numbers as the events happen, with running sums
and bounded state: each drafter's latest take, the items of the current mix window, the first
1,000 steady-state takes (for the streak) and downsampled series for plots; what the queue core
already counts (longest waits, deepest queue, most bytes) is read from it. The tests hold it to
``run_metrics`` over the records of the same runs; the mix formulas are
:mod:`dflash.core.mixmetrics`'s own.

Why no state before the steady state starts: the span starts at max(warmup_s, first time depth >=
min_ready), never before the current event, so work already over when the start is still unknown
cannot overlap the span; only each drafter's latest take can still be computing then.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from dflash.core.mixmetrics import MixMetrics, entropy, expected_window_entropy, kl_to_mix, max_bucket_streak
from dflash.core.queue_core import QueueCore

STREAK_TAKES = 1000  # docs/ARCHITECTURE.md: max_bucket_streak over the first n = min(takes, 1,000) steady takes
MAX_POINTS = 1000  # points kept per plotted series


class Downsampled:
    """At most ``MAX_POINTS`` of a stream, evenly strided: the stride doubles whenever it fills."""

    def __init__(self, limit: int = MAX_POINTS) -> None:
        self.limit = limit
        self.points: list[Any] = []
        self.stride = 1
        self.n = 0  # points offered so far

    def add(self, point: Any) -> None:
        if self.n % self.stride == 0:
            self.points.append(point)
            if len(self.points) >= self.limit:
                self.points = self.points[::2]
                self.stride *= 2
        self.n += 1


class StreamMetrics:
    """Feed it puts, produced items and takes in simulation order; :meth:`finish` gives the metrics.

    What the queue core already counts in the same way (the longest wait of taken items per bucket,
    the deepest queue, the most queued bytes) is read from it at the end, not counted twice.
    """

    def __init__(self, *, p: Sequence[float], min_ready: int, window: int, warmup_s: float, n_target: int,
                 n_drafter: int, n_buckets: int) -> None:
        self.p, self.min_ready, self.window, self.warmup_s = list(p), min_ready, window, warmup_s
        self.n_target, self.n_drafter, self.n_buckets = n_target, n_drafter, n_buckets
        self.start: float | None = None  # of the steady state, once known
        # queue level: depth, bytes and their time integrals over the span
        self.depth = self.bytes = 0
        self.last_t = 0.0
        self.depth_area = self.bytes_area = 0.0
        # time shares over the span and trained work
        self.drafter_busy = self.drafter_wait = self.target_busy = self.target_blocked = 0.0
        self.last_take: dict[int, tuple[float, float, int, int, int]] = {}  # drafter -> (t, t_done, tokens, ...)
        self.tokens = self.seqs = self.items = 0
        # mix: items not yet in the sums or a closed window, running sums over closed windows, the streak
        self.mix_buf: list[float] = []  # padded lengths of steady-state items not yet summed
        self.mix_buckets: list[tuple[int, int]] = []  # (bucket, items) of takes not yet in a closed window
        self.h_sum = self.h_sq = self.kl_sum = 0.0
        self.n_windows = self.n_items = 0
        self.len_n, self.len_s, self.len_s2, self.len_lag = 0, 0.0, 0.0, 0.0
        self.len_first: float | None = None
        self.len_last: float | None = None
        self.streak_buckets: list[int] = []
        self.streak_left = STREAK_TAKES
        self.depth_series = Downsampled()  # (t, depth before, bucket depths) at takes
        self.window_series = Downsampled()  # bucket counts of windows

    # ------------------------------------------------------------------ events
    def put(self, t: float, item: Any) -> None:
        """An item entered the queue at ``t`` (at the instant, in the order, the queue decided it).

        ``item.payload`` is the simulator's (producer, anchors, t_start, t_end): its producer was busy
        from t_start to t_end and blocked at the cap from t_end to ``t``."""
        start = self.start
        if start is None:
            self.depth += 1
            self.bytes += item.nbytes
            if self.depth < self.min_ready:
                return
            start = t if t > self.warmup_s else self.warmup_s
            self._started(start)
        else:
            if t > start:
                lt = self.last_t
                dt = t - (lt if lt > start else start)
                self.depth_area += self.depth * dt
                self.bytes_area += self.bytes * dt
            self.depth += 1
            self.bytes += item.nbytes
        self.last_t = t
        _, _, t_start, t_end = item.payload
        if t_end > start:
            self.target_busy += t_end - (t_start if t_start > start else start)
        if t > start and t > t_end:
            self.target_blocked += t - (t_end if t_end > start else start)

    def take(self, t: float, drafter: int, items: Sequence[Any], bucket: int, wait_s: float, compute_s: float,
             tokens: int, n_seqs: int, nbytes: int, depth_before: int, bucket_depths: tuple[int, ...]) -> None:
        """A take of ``items`` (with ``padded_len``) by ``drafter`` from ``bucket`` at ``t``, computing
        for ``compute_s``; ``nbytes`` their bytes. Its trained work counts when its compute ends in the
        span: assumed at once, and taken back at the close for the (at most one per drafter) take whose
        compute has not ended by then."""
        start = self.start
        n = len(items)
        if start is not None and t > start:
            lt = self.last_t
            dt = t - (lt if lt > start else start)
            self.depth_area += self.depth * dt
            self.bytes_area += self.bytes * dt
        self.last_t = t
        self.depth -= n
        self.bytes -= nbytes
        t_done = t + compute_s
        self.last_take[drafter] = (t, t_done, tokens, n_seqs, n)
        ds = self.depth_series
        if ds.n % ds.stride == 0:
            ds.add((t, depth_before, bucket_depths))
        else:
            ds.n += 1
        if start is None:
            return  # its work is accounted when the span's start is known, if it is still computing then
        if t_done > start:
            self.drafter_busy += t_done - (t if t > start else start)
            self.tokens += tokens
            self.seqs += n_seqs
            self.items += n
        if t < start:
            return
        if wait_s > 0:
            self.drafter_wait += t - (t - wait_s if t - wait_s > start else start)
        if self.streak_left:
            self.streak_buckets.append(bucket)
            self.streak_left -= 1
        buf = self.mix_buf
        for it in items:
            buf.append(it.padded_len)
        self.mix_buckets.append((bucket, n))
        if len(buf) >= self.window:
            self._windows()

    def _started(self, start: float) -> None:
        """The span's start is known: account the takes still computing at it (one per drafter at most)."""
        self.start = start
        for t, t_done, tokens, n_seqs, n in self.last_take.values():
            if t_done > start:
                self.drafter_busy += t_done - (t if t > start else start)
                self.tokens += tokens
                self.seqs += n_seqs
                self.items += n

    def _windows(self) -> None:
        """Close every full window of the buffered steady-state items (take order): entropies, KL,
        and the running sums of the padded lengths' lag-1 autocorrelation."""
        lens, takes, w, k = self.mix_buf, self.mix_buckets, self.window, self.n_buckets
        buckets = [b for b, n in takes for _ in range(n)]
        last = self.len_last
        s = s2 = lag = 0.0
        for x in lens:
            if last is None:
                self.len_first = x
            else:
                lag += last * x
            last = x
            s += x
            s2 += x * x
        self.len_last = last
        self.len_n += len(lens)
        self.len_s += s
        self.len_s2 += s2
        self.len_lag += lag
        self.n_items += len(lens)
        full = len(buckets) - len(buckets) % w
        for i in range(0, full, w):
            win = [0] * k
            for b in buckets[i:i + w]:
                win[b] += 1
            h = entropy(win)
            self.h_sum += h
            self.h_sq += h * h
            self.kl_sum += kl_to_mix(win, self.p)
            self.n_windows += 1
            self.window_series.add(tuple(win))
        self.mix_buf = []
        self.mix_buckets = [(b, 1) for b in buckets[full:]]

    # ------------------------------------------------------------------ the end
    def finish(self, close_t: float, queue: QueueCore,
               open_intervals: Mapping[str, Sequence[tuple[float, float]]] | None = None) -> dict[str, Any]:
        """The metrics dict of :func:`dflash.core.runmetrics.run_metrics` for a run closed at ``close_t``;
        ``queue`` is the run's queue core before its items are discarded."""
        out: dict[str, Any] = {"steady_state_start_s": None, "steady_state_end_s": close_t, "window": self.window,
                               "min_ready": self.min_ready, "warmup_s": self.warmup_s}
        start = self.start
        if start is None or close_t <= start:
            out["steady_state_reached"] = False
            return out
        dt = close_t - (self.last_t if self.last_t > start else start)  # the level holds until the close
        self.depth_area += self.depth * dt
        self.bytes_area += self.bytes * dt
        for _, t_done, tokens, n_seqs, n in self.last_take.values():  # still computing at the close
            if t_done > close_t and t_done > start:
                self.drafter_busy -= t_done - close_t
                self.tokens -= tokens
                self.seqs -= n_seqs
                self.items -= n
        self._windows()
        busy = {"drafter_busy": self.drafter_busy, "drafter_wait": self.drafter_wait,
                "target_busy": self.target_busy, "target_blocked": self.target_blocked}
        for key, intervals in (open_intervals or {}).items():
            busy[key] = busy.get(key, 0.0) + sum(max(0.0, min(b, close_t) - max(a, start)) for a, b in intervals)
        length = close_t - start
        c = queue.counters
        out.update(steady_state_start_s=start, steady_state_end_s=close_t, steady_state_reached=True, span_s=length,
                   throughput_tokens_per_s=self.tokens / length, samples_per_s=self.seqs / length,
                   items_per_s=self.items / length,
                   drafter_utilization=busy["drafter_busy"] / (self.n_drafter * length),
                   drafter_gate_wait_frac=busy["drafter_wait"] / (self.n_drafter * length),
                   target_utilization=busy["target_busy"] / (self.n_target * length),
                   producer_blocked_frac=busy["target_blocked"] / (self.n_target * length),
                   mean_queue_depth=self.depth_area / length, mean_queue_bytes=self.bytes_area / length,
                   peak_queue_bytes=c.peak_queued_bytes, max_queue_depth=c.max_depth_seen)
        out.update(self._mix())
        ages = [float(a) for a in c.per_bucket_max_age_s]  # of taken items, as the core counts them
        for entries in queue.buckets:  # items never taken waited at least until the close
            for _, put_t, item in entries:
                if put_t <= close_t and close_t - put_t > ages[item.bucket]:
                    ages[item.bucket] = close_t - put_t
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
