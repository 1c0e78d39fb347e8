"""Compute-time models: how long a target forward and a drafter step take, with noise.

The simulator simulates only time; everything else is the trainer's own code. A model is the mean
time from the work's shape times a noise factor of mean 1, so calibration (``dflash calibrate``)
can fit the two halves separately: the linear terms by least squares, the factor from residuals.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from dflash.core.config import DrafterConfig, TimingConfig


class Noise:
    """Multiplicative noise of mean 1: deterministic, exponential, lognormal (given CV), empirical."""

    def __init__(self, kind: str, cv: float, samples: Sequence[float], rng: random.Random) -> None:
        self.kind = kind
        self.rng = rng
        self.draw = self._one  # chosen once: a draw is made for every item and every take
        if kind == "lognormal":
            self.sigma = math.sqrt(math.log1p(cv * cv))
            self.mu = -0.5 * self.sigma * self.sigma
            if self.sigma > 0:
                self.draw = self._lognormal
        if kind == "exponential":
            self.draw = self._exponential
        if kind == "empirical":
            mean = sum(samples) / len(samples)
            self.samples = [s / mean for s in samples]  # rescaled to mean 1
            self.draw = self._empirical

    def _one(self) -> float:
        return 1.0

    def _lognormal(self) -> float:
        return math.exp(self.rng.normalvariate(self.mu, self.sigma))  # random.lognormvariate, one call less

    def _exponential(self) -> float:
        return self.rng.expovariate(1.0)

    def _empirical(self) -> float:
        return self.samples[int(self.rng.random() * len(self.samples))]


@dataclass(frozen=True)
class ItemShape:
    """What the time models need of an item."""

    n_seqs: int
    real_tokens: int
    padded_len: int
    anchors: int


def anchors_for(seq_lengths: Sequence[int], timing: TimingConfig, drafter: DrafterConfig,
                prompt_lengths: Sequence[int] | None = None) -> int:
    """Anchors of one item: per sequence min(drafter.anchors, response positions that can anchor a block).

    The trainer's rule (:func:`dflash.model.drafter.anchor_eligible`, the training reference's): a
    response token followed by another, a block may run past the end; so a response of ``r`` tokens
    offers ``r - 1`` anchors whatever the block size. With ``prompt_lengths`` (from the data set) this
    is the trainer's own count: response tokens inside the (truncated) sequence, exact for a sequence cut
    inside its response and one more than the trainer's where the template closes the turn with an
    unsupervised token after end-of-turn (ChatML's newline; tests/test_sampler.py checks both on real
    encodings); a long prompt truncated past its response gives none, and such items cost the drafter
    almost nothing. Without,
    the response is ``timing.response_fraction`` of the sequence and every sequence gets at least one
    anchor.
    """
    total = 0
    for k, n in enumerate(seq_lengths):
        if prompt_lengths is not None:
            total += max(0, min(drafter.anchors, n - prompt_lengths[k] - 1))
            continue
        response = int(n * timing.response_fraction)
        total += max(1, min(drafter.anchors, response - 1))
    return total


class TargetTime:
    """Seconds one target worker needs to produce an item (a padded micro-batch forward)."""

    def __init__(self, timing: TimingConfig, rng: random.Random) -> None:
        self.a = timing.target_fixed_s
        self.b = timing.target_per_token_s
        self.c = timing.target_per_token2_s
        self.noise = Noise(timing.target_noise, timing.target_cv, timing.target_samples, rng)
        self.burst_a = timing.burst_amplitude
        self.burst_w = 2.0 * math.pi / timing.burst_period_s

    def mean(self, n_seqs: int, padded_len: int) -> float:
        return self.a + n_seqs * padded_len * (self.b + self.c * padded_len)

    def __call__(self, n_seqs: int, padded_len: int, now: float) -> float:
        t = (self.a + n_seqs * padded_len * (self.b + self.c * padded_len)) * self.noise.draw()
        if self.burst_a:
            t *= 1.0 + self.burst_a * math.sin(self.burst_w * now)
        return t


class DrafterTime:
    """Seconds one drafter worker needs for one step on the items of one take."""

    def __init__(self, timing: TimingConfig, rng: random.Random) -> None:
        self.a = timing.drafter_fixed_s
        self.b = timing.drafter_per_token_s
        self.c = timing.drafter_per_anchor_s
        self.noise = Noise(timing.drafter_noise, timing.drafter_cv, timing.drafter_samples, rng)

    def mean(self, tokens: int, anchors: int) -> float:
        return self.a + self.b * tokens + self.c * anchors

    def __call__(self, tokens: int, anchors: int) -> float:
        return (self.a + self.b * tokens + self.c * anchors) * self.noise.draw()
