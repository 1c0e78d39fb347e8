"""Paired held-out comparisons with run-to-run variance: is one configuration's drafter better?

Every configuration of a validation, and every training seed of each, scores the *same* held-out
sequences (``[train] quality_seed`` pins the set; :mod:`dflash.pipeline.heldout` keeps each score's
per-sequence rows). A sequence that is hard for one drafter is hard for the other, so the difference
of two configurations is measured on each sequence and the sequence-to-sequence spread cancels in
part: a *paired* bootstrap, which resamples one set of sequence indices for every run of both sides.

What it never does: compare different sequence sets (a mismatch of ids is an error, not a warning),
or call a difference from one training run per side a quality claim. The held-out sample is only half
of the noise; the other half is the run itself (seed: initialisation, data order, the anchors drawn).

The interval of ``D = mean_seeds(theta_A) - mean_seeds(theta_B)`` (``theta``: a run's ratio
estimate, e.g. tau = walk tokens / walk blocks summed over sequences) combines two components:

- over sequences: the standard deviation of ``D*`` over paired bootstrap resamples of the sequences
  (each run's ratio recomputed on the resample, averaged over its configuration's seeds);
- between seeds: ``v (1/S_A + 1/S_B)``, ``v`` the variance of a run's estimate between training seeds
  on the same sequences, pooled over every configuration with >= 2 seeds (one run-to-run variance for
  the validation: the seeds, not the queue settings, drive it), with ``sum (S - 1)`` degrees of freedom.

``se^2 = se_seq^2 + v (1/S_A + 1/S_B)``; the interval is ``D +- t(df) se`` with Satterthwaite's
``df = se^4 / ((v (1/S_A + 1/S_B))^2 / df_v)`` (the sequence part has many degrees of freedom). With
no configuration at >= 2 seeds ``v`` is unknown: the comparison is still computed (over sequences)
but is flagged ``claim = False`` and does not decide. The independent interval (each side resampled
on its own) is computed alongside, to report how much the pairing narrows it.

Pure: numpy and scipy, no torch; :mod:`tuning.validation.quality` reads the runs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats

# Row columns (dflash.model.heldout.Row): bucket, CE sum, weight sum, acceptance sum, blocks, walk tokens, walk blocks.
RATIO_COLUMNS = {"heldout_tau": (5, 6), "heldout_loss": (1, 2)}
BOOTSTRAP = 2000  # resamples: the standard error's own relative error is about 1/sqrt(2 * 2000) = 1.6%


@dataclass(frozen=True)
class RunRows:
    """One training run's per-sequence rows at the compared step, in the order of ``ids``."""

    ids: tuple[str, ...]
    rows: tuple[tuple[float, ...], ...]

    def ratio_parts(self, objective: str) -> tuple[np.ndarray, np.ndarray]:
        num, den = RATIO_COLUMNS[objective]
        a = np.asarray(self.rows, dtype=float).reshape(len(self.rows), -1)
        return a[:, num], a[:, den]


@dataclass(frozen=True)
class SeedVariance:
    """The run-to-run variance of a run's estimate, pooled over configurations with >= 2 seeds."""

    var: float
    df: int  # sum over those configurations of (seeds - 1); 0: unknown


@dataclass(frozen=True)
class PairedDiff:
    difference: float  # mean over A's seeds - mean over B's seeds
    ci95: tuple[float, float]
    se: float  # both components
    df: float  # inf: no between-seed component
    se_sequences: float  # paired bootstrap over sequences
    se_seeds: float | None  # between seeds (None: unknown, fewer than 2 seeds everywhere)
    se_independent: float  # the sequence component had the two sides been resampled independently
    seeds: tuple[int, int]
    sequences: int
    claim: bool  # run-to-run variance is in the interval (>= 2 seeds somewhere): a quality claim may rest on it

    @property
    def width_ratio(self) -> float:
        """Paired over independent width of the sequence component (< 1: pairing narrows it)."""
        return self.se_sequences / self.se_independent if self.se_independent > 0 else math.nan

    def as_json(self) -> dict[str, object]:
        return {"difference": self.difference, "ci95": list(self.ci95), "se": self.se,
                "df": None if math.isinf(self.df) else self.df, "se_sequences": self.se_sequences,
                "se_seeds": self.se_seeds, "se_independent": self.se_independent, "seeds": list(self.seeds),
                "sequences": self.sequences, "claim": self.claim,
                "width_ratio": None if math.isnan(self.width_ratio) else self.width_ratio, "paired": True}


def same_sequences(runs: Sequence[RunRows]) -> tuple[str, ...]:
    """The one sequence set every run scored; ValueError naming the first run that differs."""
    first = runs[0].ids
    for k, r in enumerate(runs):
        if r.ids != first:
            raise ValueError(f"paired comparison: run {k} scored other held-out sequences ({len(r.ids)} ids, "
                             f"{len(set(r.ids) ^ set(first))} not shared) than run 0: the runs cannot be paired")
        if len(r.rows) != len(r.ids):
            raise ValueError(f"paired comparison: run {k} has {len(r.rows)} rows for {len(r.ids)} ids")
    return first


def run_estimate(run: RunRows, objective: str) -> float:
    num, den = run.ratio_parts(objective)
    return float(num.sum() / den.sum()) if den.sum() > 0 else math.nan


def seed_variance(by_config: Mapping[str, Sequence[RunRows]], objective: str) -> SeedVariance:
    """Pooled between-seed variance of the run estimate (configurations with one seed add nothing)."""
    ss, df = 0.0, 0
    for runs in by_config.values():
        if len(runs) >= 2:
            x = np.array([run_estimate(r, objective) for r in runs])
            ss += float(((x - x.mean()) ** 2).sum())
            df += len(runs) - 1
    return SeedVariance(ss / df if df else math.nan, df)


def _resampled(runs: Sequence[RunRows], objective: str, counts: np.ndarray) -> np.ndarray:
    """Per resample (rows of ``counts``: how often each sequence is drawn), the mean over ``runs`` of the
    run's ratio estimate on that resample."""
    est = []
    for r in runs:
        num, den = r.ratio_parts(objective)
        est.append((counts @ num) / np.maximum(counts @ den, 1e-300))
    return np.mean(est, axis=0)


def paired_difference(a: Sequence[RunRows], b: Sequence[RunRows], objective: str, seeds: SeedVariance, *,
                      resamples: int = BOOTSTRAP, seed: int = 0, level: float = 0.95) -> PairedDiff:
    """``A - B`` on ``objective`` over the same sequences (ValueError if any run's set differs)."""
    if not a or not b:
        raise ValueError("paired comparison: each side needs at least one run")
    n = len(same_sequences([*a, *b]))
    d = float(np.mean([run_estimate(r, objective) for r in a]) - np.mean([run_estimate(r, objective) for r in b]))
    rng = np.random.default_rng(seed)
    p = np.full(n, 1.0 / n)
    shared = rng.multinomial(n, p, size=resamples).astype(float)
    se_seq = float(np.std(_resampled(a, objective, shared) - _resampled(b, objective, shared), ddof=1))
    own = rng.multinomial(n, p, size=resamples).astype(float)
    se_ind = float(np.std(_resampled(a, objective, shared) - _resampled(b, objective, own), ddof=1))
    if seeds.df > 0 and math.isfinite(seeds.var):
        v = seeds.var * (1.0 / len(a) + 1.0 / len(b))
        se = math.sqrt(se_seq ** 2 + v)
        df = se ** 4 / (v ** 2 / seeds.df) if v > 0 else math.inf
        se_seeds: float | None = math.sqrt(v)
    else:
        se, df, se_seeds = se_seq, math.inf, None
    crit = float(stats.norm.ppf(0.5 + level / 2)) if math.isinf(df) else float(stats.t.ppf(0.5 + level / 2, df))
    return PairedDiff(d, (d - crit * se, d + crit * se), se, df, se_seq, se_seeds, se_ind, (len(a), len(b)), n,
                      se_seeds is not None)
