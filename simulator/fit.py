"""Fit the simulator's timing model to what a real pipeline did (``dflash calibrate``).

Observations come from our own run directories (the shared records) or from another trainer's
per-item timing log (:mod:`simulator.timing_log`). Three choices make the fitted simulator predict
the *rates* the real pipeline runs at, which is what throughput and the bucket mix depend on:

- The time fitted is a worker's **cycle**, not its kernel time: from one item's start to the next
  one's minus time blocked at the cap (target), from one take to the next request minus nothing
  (drafter). Tokenising, record writing, optimiser steps and checkpoints are all in it, because
  the simulator has no other place to put them.
- Terms are fitted by non-negative least squares on *relative* error (the goal is a percentage),
  then rescaled so the mean model times the empirical noise reproduces the mean observed time
  exactly; the noise is the observed/fitted ratios themselves (``noise = "empirical"``).
- The drafter's anchor count is the simulator's own (:func:`simulator.timing.anchors_for`), with
  ``response_fraction`` chosen by the fit, so the features at fit time are those the simulator
  computes at run time.
Torch-free.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from scipy.optimize import nnls
from scipy.stats import f as f_dist

from dflash.core.config import DrafterConfig, TimingConfig
from dflash.core.links import TIER_KEYS, TIERS
from simulator.timing import anchors_for

MIN_OBSERVATIONS = 20  # per role, across all runs: fewer cannot separate the terms from the noise
MAX_SAMPLES = 1000  # empirical noise samples kept per role in the calibration file
RESPONSE_FRACTIONS = tuple(round(0.05 * k, 2) for k in range(1, 21))


@dataclass(frozen=True)
class TargetObs:
    """One item a target worker produced."""

    run: int
    worker: int
    t_start: float
    busy_s: float
    n_seqs: int
    padded_len: int
    bucket: int
    bytes: float | None = None


@dataclass(frozen=True)
class DrafterObs:
    """One take a drafter trained on."""

    run: int
    drafter: int
    t: float
    busy_s: float
    tokens: int
    bucket: int
    anchors: float | None = None  # as observed (used when sequence lengths are unknown)
    seq_lengths: tuple[int, ...] | None = None  # to recompute the simulator's anchors
    drafter_cfg: DrafterConfig | None = None
    seq_prompts: tuple[int, ...] | None = None  # where each sequence's response starts
    transfer_s: float | None = None  # of the busy time, moving the take's hidden states to the drafter
    bytes: float | None = None  # hidden-state bytes the take moved
    tier: str | None = None  # where its moves ran (dflash.core.links tiers); None: several tiers or unknown


@dataclass
class Observations:
    target: list[TargetObs] = field(default_factory=list)
    drafter: list[DrafterObs] = field(default_factory=list)
    capture_layers: int | None = None
    dtype_bytes: int | None = None


@dataclass(frozen=True)
class RoleFit:
    coef: tuple[float, ...]  # the linear terms, in the TimingConfig order of that role
    samples: tuple[float, ...]  # observed / fitted, mean 1
    n: int
    mape: float  # mean |observed - fitted| / observed, of the mean model
    cv: float  # of the ratios: how noisy the role is
    bucket_ratio: tuple[float | None, ...]  # mean observed / fitted per bucket (1.0 = unbiased)
    extra: dict[str, Any] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        return {"n": self.n, "mape": self.mape, "cv": self.cv, "bucket_ratio": list(self.bucket_ratio),
                "coef": list(self.coef), **self.extra}


def _relative_nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """min sum((x b - y) / y)^2 with b >= 0; then scaled so the fitted times sum to the observed ones.

    Relative weighting gets the shape right across cheap and dear items; the final scale is by the
    *sums*, because a worker's rate is total work over total time. (Scaling so the ratios average 1
    instead overstated the drafter-bound CPU profile's step time by 11%: its cheap zero-anchor
    steps have large ratios that pulled the scale down only in the mean of ratios.)
    """
    w = 1.0 / y
    b, _ = nnls(x * w[:, None], y * w)
    fitted = x @ b
    if np.any(fitted <= 0):  # a zero column: fall back to a pure fixed cost
        b = np.zeros(x.shape[1])
        b[0] = float(np.mean(y))
        fitted = x @ b
    return b * float(np.sum(y) / np.sum(fitted))


def _role_fit(x: np.ndarray, y: np.ndarray, buckets: np.ndarray, n_buckets: int, rng: random.Random,
              extra: dict[str, Any]) -> RoleFit:
    b = _relative_nnls(x, y)
    fitted = x @ b
    ratio = y / fitted
    per_bucket = tuple(float(np.mean(ratio[buckets == k])) if np.any(buckets == k) else None
                       for k in range(n_buckets))
    samples = list(map(float, ratio))
    if len(samples) > MAX_SAMPLES:
        samples = rng.sample(samples, MAX_SAMPLES)
    sv = np.linalg.svd(x / np.linalg.norm(x, axis=0).clip(1e-300), compute_uv=False)
    extra = {**extra, "separable": bool(sv[-1] / sv[0] > 1e-3) if len(sv) > 1 else True}
    return RoleFit(tuple(map(float, b)), tuple(samples), len(y), float(np.mean(np.abs(y - fitted) / y)),
                   float(np.std(ratio) / np.mean(ratio)), per_bucket, extra)


def fit_target(obs: Sequence[TargetObs], n_buckets: int, rng: random.Random) -> RoleFit:
    """``a + b n L + c n L^2``; the quadratic term only when lengths vary enough to see it."""
    n = np.array([o.n_seqs for o in obs], float)
    length = np.array([o.padded_len for o in obs], float)
    y = np.array([o.busy_s for o in obs], float)
    x = np.column_stack([np.ones_like(y), n * length, n * length * length])
    if np.ptp(length) == 0:
        x = x[:, :2]
    fit = _role_fit(x, y, np.array([o.bucket for o in obs]), n_buckets, rng, {})
    coef = (*fit.coef, 0.0)[:3]
    return replace(fit, coef=coef)


def fit_drafter(obs: Sequence[DrafterObs], timing: TimingConfig, n_buckets: int, rng: random.Random
                ) -> tuple[RoleFit, float]:
    """``a + b tokens + c anchors`` with the simulator's anchors; returns the fit and response_fraction."""
    y = np.array([o.busy_s for o in obs], float)
    tokens = np.array([o.tokens for o in obs], float)
    buckets = np.array([o.bucket for o in obs])
    known = all(o.seq_lengths is not None and o.drafter_cfg is not None for o in obs)
    candidates: list[tuple[float, np.ndarray, str]] = []
    if known and all(o.seq_prompts is not None for o in obs):
        anchors = np.array([anchors_for(o.seq_lengths or (), timing, o.drafter_cfg or DrafterConfig(),
                                        o.seq_prompts) for o in obs], float)
        candidates.append((timing.response_fraction, anchors, "from prompt lengths"))
    elif known:
        for rf in RESPONSE_FRACTIONS:
            t = replace(timing, response_fraction=rf)
            anchors = np.array([anchors_for(o.seq_lengths or (), t, o.drafter_cfg or DrafterConfig())
                                for o in obs], float)
            candidates.append((rf, anchors, "simulated"))
    elif all(o.anchors is not None for o in obs):
        candidates.append((timing.response_fraction, np.array([o.anchors for o in obs], float), "observed"))
    best: tuple[float, RoleFit, float] | None = None
    for rf, anchors, how in candidates or [(timing.response_fraction, np.zeros_like(y), "none")]:
        x = np.column_stack([np.ones_like(y), tokens, anchors])
        if not anchors.any():
            x = x[:, :2]
        fit = _role_fit(x, y, buckets, n_buckets, rng, {"anchors": how, "response_fraction": rf})
        fit = replace(fit, coef=(*fit.coef, 0.0)[:3])
        sse = float(np.sum(((y - x @ np.asarray(fit.coef[:x.shape[1]])) / y) ** 2))
        if best is None or sse < best[0]:
            best = (sse, fit, rf)
    assert best is not None
    return best[1], best[2]


def fit_burst(obs: Sequence[TargetObs], samples_ratio: Sequence[float]) -> dict[str, Any]:
    """A sinusoidal supply rate, kept only if it explains the target's residuals beyond chance.

    The periods tried run from 4 item cycles to a third of the run; the best one must pass an F test
    at p < 0.001 after a Bonferroni correction over the periods and explain >= 10% of the variance.
    """
    out: dict[str, Any] = {"amplitude": 0.0, "period_s": None, "r2": 0.0, "p_value": 1.0, "detected": False}
    t = np.array([o.t_start for o in obs], float)
    r = np.asarray(samples_ratio, float) - 1.0
    if len(t) < 3 * MIN_OBSERVATIONS or np.ptp(t) <= 0:
        return out
    cycle = float(np.median([o.busy_s for o in obs]))
    lo, hi = 4 * cycle, np.ptp(t) / 3
    if hi <= lo:
        return out
    periods = np.geomspace(lo, hi, 60)
    total = float(np.sum((r - r.mean()) ** 2))
    best = (0.0, 0.0, 0.0)
    for period in periods:
        w = 2 * math.pi / period
        x = np.column_stack([np.ones_like(t), np.sin(w * t), np.cos(w * t)])
        coef, *_ = np.linalg.lstsq(x, r, rcond=None)
        explained = total - float(np.sum((r - x @ coef) ** 2))
        if explained > best[0]:
            best = (explained, float(period), float(math.hypot(coef[1], coef[2])))
    r2 = best[0] / total if total > 0 else 0.0
    n = len(t)
    f_stat = (r2 / 2) / max((1 - r2) / (n - 3), 1e-300)
    p = min(1.0, float(f_dist.sf(f_stat, 2, n - 3)) * len(periods))
    out.update(r2=r2, p_value=p, best_period_s=best[1])
    if p < 1e-3 and r2 >= 0.10:
        out.update(amplitude=min(best[2], 0.9), period_s=best[1], detected=True)
    return out


def fit_transfer(obs: Sequence[DrafterObs]) -> dict[str, dict[str, Any]]:
    """Seconds per byte of moving hidden states producer -> drafter, per placement tier, from takes
    that timed it.

    Per tier the ratio of sums (total transfer time over total bytes), the rate a drafter sees over a
    run, as the other terms are scaled. A take counts for the tier all its moves ran in
    (:func:`simulator.observations.take_tier`): the network tier only from pairs whose records name two
    hosts, so a rehearsal of several "nodes" on one machine never sets the NIC's rate; a take whose
    moves spanned tiers counts for none. Empty when no take carries ``transfer_s``, ``bytes`` and a tier.
    """
    out: dict[str, dict[str, Any]] = {}
    for tier in TIERS:
        timed = [(o.transfer_s, o.bytes) for o in obs
                 if o.tier == tier and o.transfer_s is not None and o.bytes]
        if not timed:
            continue
        seconds, nbytes = sum(s for s, _ in timed), sum(b for _, b in timed)
        rate = seconds / nbytes
        out[tier] = {"s_per_byte": rate, "n": len(timed), "bytes": nbytes,
                     "gb_per_s": (1 / rate / 1e9) if rate > 0 else None}
    return out


def without_transfer(obs: Sequence[DrafterObs]) -> list[DrafterObs]:
    """The takes with their measured transfer time taken off their busy time: the simulator adds
    transfers per byte itself, so the drafter's own terms must not count them twice."""
    return [replace(o, busy_s=o.busy_s - o.transfer_s) if o.transfer_s and o.busy_s > o.transfer_s else o
            for o in obs]


def fit_timing(obs: Observations, base: TimingConfig, n_buckets: int, seed: int = 0
               ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The ``timing`` table of a calibration file and the fit report. Caller checks the counts."""
    rng = random.Random(seed)
    target = fit_target(obs.target, n_buckets, rng)
    transfer = fit_transfer(obs.drafter)
    drafter, rf = fit_drafter(without_transfer(obs.drafter), base, n_buckets, rng)  # the simulator adds moves itself
    ratios = _ratios_in_time_order(obs.target, target)  # all of them: the fit kept a sample
    burst = fit_burst(obs.target, ratios)
    target_samples = list(target.samples)
    if burst["detected"]:
        w = 2 * math.pi / burst["period_s"]
        target_samples = [s / (1 + burst["amplitude"] * math.sin(w * o.t_start))
                          for s, o in zip(ratios, obs.target, strict=True)]
        if len(target_samples) > MAX_SAMPLES:
            target_samples = rng.sample(target_samples, MAX_SAMPLES)
    timing: dict[str, Any] = {
        "target_fixed_s": target.coef[0], "target_per_token_s": target.coef[1],
        "target_per_token2_s": target.coef[2], "target_noise": "empirical", "target_samples": target_samples,
        "drafter_fixed_s": drafter.coef[0], "drafter_per_token_s": drafter.coef[1],
        "drafter_per_anchor_s": drafter.coef[2], "drafter_noise": "empirical",
        "drafter_samples": list(drafter.samples), "response_fraction": rf,
        "burst_amplitude": burst["amplitude"], "burst_period_s": burst["period_s"] or base.burst_period_s,
    }
    report: dict[str, Any] = {"target": target.as_json(), "drafter": drafter.as_json(), "burst": burst}
    for tier, tr in transfer.items():
        timing[TIER_KEYS[tier]] = tr["s_per_byte"]
    if transfer:
        report["transfer"] = transfer
    per_token = [o.bytes / (o.n_seqs * o.padded_len) for o in obs.target if o.bytes]
    if per_token:
        bpt = float(np.median(per_token))
        report["memory"] = {"bytes_per_token": bpt, "items": len(per_token)}
        layers, dtype = obs.capture_layers, obs.dtype_bytes or base.dtype_bytes
        if layers and bpt % (layers * dtype) == 0:
            timing["hidden_size"] = int(bpt // (layers * dtype))
            timing["dtype_bytes"] = dtype
    return timing, report


def _ratios_in_time_order(obs: Sequence[TargetObs], fit: RoleFit) -> list[float]:
    a, b, c = fit.coef
    return [o.busy_s / (a + o.n_seqs * o.padded_len * (b + c * o.padded_len)) for o in obs]
