"""Mix metrics over a take log: how well mixed the length diet a drafter ate was.

Torch-free; the trainer, the simulator and the reports call these same functions, so a simulated
and a measured ``mix_efficiency`` are the same computation over the same record fields.

Windows are consecutive, non-overlapping windows of ``W`` items in global take order (a trailing
partial window is dropped). ``mix_efficiency`` divides the mean window entropy by its expectation
under W independent draws from the item mix ``p``, computed exactly: by linearity,
E[H] = sum_b sum_k Binom(k; W, p_b) * (-(k/W) ln(k/W)).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

KL_PSEUDO_COUNT = 0.5  # per bucket with p > 0, so an absent bucket gives a finite KL


def _binom_pmf(n: int, p: float) -> list[float]:
    """Binomial(n, p) pmf via log-gamma (stable for the window sizes used here)."""
    if p <= 0.0:
        return [1.0] + [0.0] * n
    if p >= 1.0:
        return [0.0] * n + [1.0]
    lp, lq = math.log(p), math.log1p(-p)
    lg = math.lgamma
    return [math.exp(lg(n + 1) - lg(k + 1) - lg(n - k + 1) + k * lp + (n - k) * lq) for k in range(n + 1)]


def expected_window_entropy(p: Sequence[float], window: int) -> float:
    """E[H(counts / W)] in nats for counts ~ Multinomial(W, p)."""
    total = 0.0
    for pb in p:
        if pb <= 0:
            continue
        pmf = _binom_pmf(window, pb)
        for k in range(1, window + 1):
            f = k / window
            total -= pmf[k] * f * math.log(f)
    return total


def window_counts(buckets: Sequence[int], window: int, n_buckets: int) -> list[list[int]]:
    """Bucket counts of each full window of ``window`` consecutive taken items."""
    out = []
    for start in range(0, len(buckets) - window + 1, window):
        c = [0] * n_buckets
        for b in buckets[start:start + window]:
            c[b] += 1
        out.append(c)
    return out


def entropy(counts: Sequence[int]) -> float:
    n = sum(counts)
    return -sum((c / n) * math.log(c / n) for c in counts if c > 0) if n else 0.0


def kl_to_mix(counts: Sequence[int], p: Sequence[float], pseudo: float = KL_PSEUDO_COUNT) -> float:
    """KL(window mix || p) over the buckets with p > 0, with a pseudo-count on each."""
    support = [b for b, pb in enumerate(p) if pb > 0]
    n = sum(counts[b] for b in support) + pseudo * len(support)
    kl = 0.0
    for b in support:
        q = (counts[b] + pseudo) / n
        kl += q * math.log(q / p[b])
    return kl


def lag1_autocorr(xs: Sequence[float]) -> float:
    """Lag-1 autocorrelation (0 for well mixed; NaN when undefined: fewer than 3 values or constant)."""
    n = len(xs)
    if n < 3:
        return math.nan
    mean = sum(xs) / n
    var = sum((x - mean) ** 2 for x in xs)
    if var == 0:
        return math.nan
    cov = sum((xs[i] - mean) * (xs[i + 1] - mean) for i in range(n - 1))
    return cov / var


def max_bucket_streak(take_buckets: Sequence[int], limit: int = 1000) -> tuple[int, int]:
    """Longest run of consecutive takes from one bucket in the first n = min(takes, limit) takes."""
    seq = take_buckets[:limit]
    best = cur = 0
    prev = None
    for b in seq:
        cur = cur + 1 if b == prev else 1
        prev = b
        best = max(best, cur)
    return best, len(seq)


@dataclass(frozen=True)
class MixMetrics:
    window: int
    n_windows: int
    n_items: int
    mix_entropy: float
    mix_efficiency: float
    mix_kl: float
    length_autocorr: float
    max_bucket_streak: int
    streak_takes: int
    window_entropies: tuple[float, ...]

    def as_dict(self) -> dict[str, float | int]:
        return {
            "window": self.window, "n_windows": self.n_windows, "n_items": self.n_items,
            "mix_entropy": self.mix_entropy, "mix_efficiency": self.mix_efficiency,
            "mix_kl": self.mix_kl, "length_autocorr": self.length_autocorr,
            "max_bucket_streak": self.max_bucket_streak, "streak_takes": self.streak_takes,
            "mix_efficiency_se": self.efficiency_standard_error(),
        }

    def efficiency_standard_error(self) -> float:
        """Standard error of mix_efficiency from the window-to-window spread (windows as samples)."""
        n = len(self.window_entropies)
        if n < 2 or not math.isfinite(self.mix_efficiency) or self.mix_efficiency == 0:
            return math.nan
        mean = sum(self.window_entropies) / n
        var = sum((h - mean) ** 2 for h in self.window_entropies) / (n - 1)
        return self.mix_efficiency * math.sqrt(var / n) / mean if mean > 0 else math.nan


def mix_metrics(item_buckets: Sequence[int], item_padded_lens: Sequence[float],
                take_buckets: Sequence[int], p: Sequence[float], window: int = 32) -> MixMetrics:
    """All take-log mix metrics of docs/ARCHITECTURE.md.

    ``item_buckets``/``item_padded_lens``: one entry per taken item in global take order;
    ``take_buckets``: one entry per take (a take of several items counts once for streaks).
    """
    if window < 2:
        raise ValueError("window must be >= 2")
    k = sum(1 for pb in p if pb > 0)
    counts = window_counts(item_buckets, window, len(p))
    hs = tuple(entropy(c) for c in counts)
    nan = math.nan
    if hs:
        mean_h = sum(hs) / len(hs)
        expected = expected_window_entropy(p, window)
        mix_entropy = mean_h / math.log(k) if k > 1 else nan
        efficiency = mean_h / expected if expected > 0 else nan
        kl = sum(kl_to_mix(c, p) for c in counts) / len(counts)
    else:
        mix_entropy = efficiency = kl = nan
    streak, n_streak = max_bucket_streak(take_buckets)
    return MixMetrics(window, len(hs), len(item_buckets), mix_entropy, efficiency, kl,
                      lag1_autocorr(item_padded_lens), streak, n_streak, hs)
