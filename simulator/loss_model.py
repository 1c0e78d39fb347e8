"""Loss roughness from the bucket order: fitted on a real run, replayed on a simulated one.

Why this works without a model in the loop: over a short span the drafter's loss is a slow trend
times a factor that depends on *what* the step trained on (short chats and long documents do not
have the same loss) times noise. The queue decides only the second factor's order. Fit the trend,
the per-bucket factor and the noise once (:func:`fit_loss_model`), and any take order, real or
simulated, gives a predicted loss series whose roughness is computed by the trainer's own
:func:`dflash.core.runmetrics.loss_roughness` (:func:`predict_loss_roughness`).

The fit is ordinary least squares on ``log loss``: the trend is a cubic in ``log(step + 1)``, the
bucket effects enter through each step's token shares (so multi-item steps need no special case),
and bucket effects are centred on the item mix so the trend carries the level. Torch-free.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dflash.core.config import LossModelConfig
from dflash.core.runmetrics import loss_roughness

TREND_DEGREE = 3
MIN_STEPS = 30  # below this the trend and five bucket effects are not separable


@dataclass(frozen=True)
class StepMakeup:
    """One step as the loss model sees it: its loss (None without anchors) and tokens per bucket."""

    step: int
    loss: float | None
    bucket_tokens: tuple[float, ...]


@dataclass(frozen=True)
class LossFit:
    model: LossModelConfig
    steps: int
    r2: float  # share of log-loss variance the trend + buckets explain
    bucket_steps: tuple[int, ...]  # steps dominated (> 50% of tokens) by each bucket
    measured_roughness: float | None
    refit_roughness: float | None  # the model replayed on the run's own take order

    def as_json(self) -> dict[str, object]:
        return {"steps": self.steps, "r2": self.r2, "bucket_steps": list(self.bucket_steps),
                "measured_loss_roughness": self.measured_roughness,
                "replayed_loss_roughness": self.refit_roughness}


def _shares(makeup: Sequence[StepMakeup], n_buckets: int) -> np.ndarray:
    f = np.zeros((len(makeup), n_buckets))
    for i, s in enumerate(makeup):
        total = sum(s.bucket_tokens)
        if total > 0:
            f[i, :len(s.bucket_tokens)] = np.asarray(s.bucket_tokens) / total
    return f


def fit_loss_model(makeup: Sequence[StepMakeup], item_mix: Sequence[float]) -> LossFit | None:
    """Fit the loss model to one run's steps; None when there are too few steps with a loss."""
    n_b = len(item_mix)
    rows = [s for s in makeup if s.loss is not None and math.isfinite(s.loss) and s.loss > 0
            and sum(s.bucket_tokens) > 0]
    if len(rows) < MIN_STEPS:
        return None
    y = np.log([s.loss for s in rows])
    x = np.log1p([s.step for s in rows])
    f = _shares(rows, n_b)
    design = np.hstack([np.vander(x, TREND_DEGREE + 1)[:, :-1], f])  # trend without constant + bucket levels
    seen = f.sum(axis=0) > 0
    coef, *_ = np.linalg.lstsq(design[:, np.r_[np.ones(TREND_DEGREE, bool), seen]], y, rcond=None)
    trend = np.append(coef[:TREND_DEGREE], 0.0)
    beta = np.zeros(n_b)
    beta[seen] = coef[TREND_DEGREE:]
    p = np.asarray(item_mix, dtype=float)
    level = float(np.dot(p[seen], beta[seen]) / p[seen].sum()) if p[seen].sum() > 0 else 0.0
    beta[seen] -= level  # centred on the mix: a perfect shuffle's mean effect is zero
    beta[~seen] = 0.0  # a bucket the run never trained on is assumed average
    trend[-1] = level
    resid = y - (np.polyval(trend, x) + f @ beta)
    dominant = np.argmax(f, axis=1)
    # The noise shrinks as training settles; roughness is judged over a run's second half, so the
    # spread and its autocorrelation are taken there (the trend and bucket levels from every step).
    late = np.arange(len(rows)) >= len(rows) // 2
    pooled = float(np.std(resid[late], ddof=1))
    sd = np.full(n_b, pooled)
    counts = []
    for b in range(n_b):
        mask = late & (dominant == b) & (f[np.arange(len(f)), dominant] > 0.5)
        counts.append(int(mask.sum()))
        if mask.sum() >= 5:
            sd[b] = float(np.std(resid[mask], ddof=1))
    z = resid[late] / sd[dominant[late]]
    phi = float(np.corrcoef(z[:-1], z[1:])[0, 1]) if len(z) > 3 and np.std(z) > 0 else 0.0
    phi = max(-0.95, min(0.95, phi if math.isfinite(phi) else 0.0))
    model = LossModelConfig(bucket_log_mean=tuple(beta), bucket_log_sd=tuple(sd), trend_coef=tuple(trend),
                            trend_last_step=int(max(s.step for s in rows)), autocorr=phi)
    r2 = 1.0 - float(np.var(resid)) / float(np.var(y)) if np.var(y) > 0 else 0.0
    losses = _losses_by_step(makeup)
    measured = loss_roughness(losses, first_step=len(losses) // 2)["loss_roughness"]
    replayed = predict_loss_roughness(makeup, model, seed=0)["loss_roughness"]
    return LossFit(model, len(rows), r2, tuple(counts), measured, replayed)


def _losses_by_step(makeup: Sequence[StepMakeup]) -> list[float | None]:
    return [s.loss for s in sorted(makeup, key=lambda s: s.step)]


def predict_loss_roughness(makeup: Sequence[StepMakeup], model: LossModelConfig, seed: int = 0
                           ) -> dict[str, object]:
    """Mean ``loss_roughness`` of ``model.draws`` loss series generated for this step sequence.

    Only the steps' bucket make-up is used (their ``loss`` is ignored), so a simulated run's take
    records predict the roughness a real run with the same take order would show. The span is the
    trainer's: the second half of the steps.
    """
    steps = sorted(makeup, key=lambda s: s.step)
    out: dict[str, object] = {"loss_roughness": None, "loss_roughness_steps": [len(steps) // 2, len(steps) - 1],
                              "loss_roughness_se": None}
    if not model.fitted or len(steps) < 6:
        return out
    n_b = len(model.bucket_log_mean)
    if any(len(s.bucket_tokens) > n_b for s in steps):
        raise ValueError(f"the loss model has {n_b} buckets, the run more: calibrate on the same bucketing")
    f = _shares(steps, n_b)
    beta, sd = np.asarray(model.bucket_log_mean), np.asarray(model.bucket_log_sd)
    x = np.log1p(np.minimum([s.step for s in steps], model.trend_last_step))
    mean_log = np.polyval(model.trend_coef, x) + f @ beta
    spread = np.sqrt(f @ (sd * sd))  # a step's noise: its buckets' spreads, weighted by token share
    rng = np.random.default_rng(random.Random(seed).getrandbits(63))
    phi = model.autocorr
    values = []
    empty = f.sum(axis=1) == 0
    for _ in range(model.draws):
        eps = rng.standard_normal(len(steps))
        z = np.empty_like(eps)
        z[0] = eps[0]
        scale = math.sqrt(1.0 - phi * phi)
        for i in range(1, len(eps)):
            z[i] = phi * z[i - 1] + scale * eps[i]
        loss = np.exp(mean_log + spread * z)
        series: list[float | None] = [None if e else float(v) for v, e in zip(loss, empty, strict=True)]
        r = loss_roughness(series, first_step=len(series) // 2)["loss_roughness"]
        if r is not None:
            values.append(r)
    if values:
        out["loss_roughness"] = float(np.mean(values))
        out["loss_roughness_se"] = float(np.std(values, ddof=1) / math.sqrt(len(values))) if len(values) > 1 \
            else None
    return out


def makeup_from_takes(takes: Sequence[dict[str, object]], losses: dict[int, float | None] | None = None
                      ) -> list[StepMakeup]:
    """Steps from take records (several takes per step with synchronised drafters); a take's tokens
    all count for its own ``bucket``, since every policy takes one take's items from one bucket."""
    by_step: dict[int, dict[int, float]] = {}
    for r in takes:
        step = int(r["step"])  # type: ignore[arg-type]
        acc = by_step.setdefault(step, {})
        ids = list(r.get("item_ids") or [])  # type: ignore[call-overload]
        b = int(r["bucket"])  # type: ignore[arg-type]
        acc[b] = acc.get(b, 0.0) + float(r.get("tokens") or max(len(ids), 1))  # type: ignore[arg-type]
    out = []
    for step in sorted(by_step):
        acc = by_step[step]
        n = max(acc) + 1
        out.append(StepMakeup(step, (losses or {}).get(step), tuple(acc.get(b, 0.0) for b in range(n))))
    return out
