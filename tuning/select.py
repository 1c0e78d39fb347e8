"""From a finished study to decisions: the Pareto front, importances and the selection file.

Selection rule (documented, deterministic): among feasible complete trials take the Pareto front
of (throughput, mix_efficiency), both maximised. Score each point by its *relative shortfall*
from the best value of each objective on the front, ``1 - value / best``, and take the point with
the smallest Euclidean norm of the two shortfalls: the knee, the configuration that gives up the
least of either objective as a fraction of what is attainable. Top-k are the knee and then the
other front points in order of that score; if the front is shorter than k, the nearest dominated
feasible trials fill in. (Min-max normalisation over the front was tried first and rejected: a
front spanning 12% of throughput and 30% of mix_efficiency made a 10% throughput gain outweigh a
0.2 loss of mix_efficiency and picked a `fullest` config; shortfalls keep both on their own scale.)
In scalar mode the front is the single best feasible trial and the rest follow by mix_efficiency. ``baseline`` and
``handpicked`` are always added, evaluated on the same seeds by the same evaluator.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState

from dflash.core.named_configs import DEFAULT_POLICY, NAMED_CONFIGS
from tuning.pareto import knee_scores, nondominated
from tuning.study import feasible

NAMED = NAMED_CONFIGS  # baseline and handpicked (docs/ARCHITECTURE.md), defined once in dflash.core.named_configs


def named_params(name: str) -> dict[str, Any]:
    """What a named config is, whatever a sweep's base queue says: its knobs, the default policy, static.

    A grid's cell of that pair under the default policy runs exactly these parameters, so the grid and
    the "same seeds" line show one configuration's one number (a base queue of another policy, or
    ``--queue auto``, once made "baseline" below the grid a different configuration from the grid's)."""
    return {**NAMED[name], "policy": DEFAULT_POLICY, "mode": "static"}
SPLIT_KEYS = ("n_target", "n_drafter")  # trial user attributes and selection-entry keys of the split


def complete_trials(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    return [t for t in study.get_trials(deepcopy=False) if t.state == TrialState.COMPLETE]


def pareto_front(trials: list[optuna.trial.FrozenTrial]) -> list[optuna.trial.FrozenTrial]:
    """Non-dominated trials (maximising every value), by trial number (:func:`tuning.pareto.nondominated`)."""
    return sorted((trials[i] for i in nondominated([t.values for t in trials])), key=lambda t: t.number)


def feasible_front(trials: list[optuna.trial.FrozenTrial]) -> list[optuna.trial.FrozenTrial]:
    """The feasible Pareto front; with one objective, the single best feasible trial."""
    ok = [t for t in trials if feasible(t)]
    if not ok:
        return []
    if len(ok[0].values) == 1:
        return [max(ok, key=lambda t: (t.values[0], -t.number))]
    return pareto_front(ok)


def knee_order(front: list[optuna.trial.FrozenTrial], against: list[optuna.trial.FrozenTrial] | None = None
               ) -> list[tuple[optuna.trial.FrozenTrial, float]]:
    """Trials (default: the front) by the norm of their relative shortfalls from the front's best
    (:func:`tuning.pareto.knee_scores`)."""
    if not front:
        return []
    pool = front if against is None else against
    scores = knee_scores([t.values for t in pool], reference=[t.values for t in front])
    return sorted(zip(pool, scores, strict=True), key=lambda p: (p[1], p[0].number))


def select_top_k(study: optuna.Study, k: int) -> list[optuna.trial.FrozenTrial]:
    ok = [t for t in complete_trials(study) if feasible(t)]
    if not ok:
        return []
    if len(ok[0].values) == 1:
        return sorted(ok, key=lambda t: (-t.values[0], t.number))[:k]
    front = pareto_front(ok)
    chosen = [t for t, _ in knee_order(front)][:k]
    if len(chosen) < k:  # fill with the nearest dominated trials
        rest = [t for t in ok if t not in chosen]
        chosen += [t for t, _ in knee_order(front, against=rest)][: k - len(chosen)]
    return chosen


def tuned_entries(top: list[optuna.trial.FrozenTrial]) -> list[dict[str, Any]]:
    """``tuned-1..k`` selection entries: the trial, the full queue it ran (its ``queue_*`` attrs) and
    its split (``n_target``, ``n_drafter``: what ``dflash validate`` must run it on)."""
    return [{"name": f"tuned-{rank}", "trial": t.number, "params": t.params,
             "queue": {k.removeprefix("queue_"): v for k, v in t.user_attrs.items() if k.startswith("queue_")},
             **{k: t.user_attrs[k] for k in SPLIT_KEYS if k in t.user_attrs}}
            for rank, t in enumerate(top, 1)]


@dataclass(frozen=True)
class _Point:
    """A trial as the front functions see it: maximised values and a number for ties."""

    number: int
    values: tuple[float, float]
    n_target: int
    n_drafter: int


def split_table(rows: Iterable[Mapping[str, Any]], gpus: int | None = None, gpus_per_target: int = 1
                ) -> dict[str, Any]:
    """Per split, the queue knobs re-optimised for it; the best split and its gain over an even one.

    ``rows``: complete trials with ``number``, ``n_target``, ``n_drafter``, ``throughput_tokens_per_s``,
    ``mix_efficiency`` and ``feasible``. Each split's choice is the knee of its own feasible front
    (the selection rule, within the split); the best split is the knee of those choices; the even
    split gives targets as many GPUs as drafters (n_target x gpus_per_target = n_drafter).
    """
    by_split: dict[int, list[_Point]] = {}
    drafters: dict[int, int] = {}
    for r in rows:
        n = int(r["n_target"])
        drafters[n] = int(r["n_drafter"])
        by_split.setdefault(n, [])
        tput, mix = r.get("throughput_tokens_per_s"), r.get("mix_efficiency")
        if r.get("feasible") and _finite(tput) and _finite(mix):
            by_split[n].append(_Point(int(r["number"]), (float(tput), float(mix)), n, drafters[n]))
    splits = []
    for n in sorted(by_split):
        pts = by_split[n]
        knee = knee_order(pareto_front(pts))[0][0] if pts else None  # type: ignore[arg-type]
        splits.append({"n_target": n, "n_drafter": drafters[n], "feasible_trials": len(pts),
                       "trial": knee.number if knee else None,
                       "throughput_tokens_per_s": knee.values[0] if knee else None,
                       "mix_efficiency": knee.values[1] if knee else None})
    chosen = [_Point(s["trial"], (s["throughput_tokens_per_s"], s["mix_efficiency"]), s["n_target"], s["n_drafter"])
              for s in splits if s["trial"] is not None]
    best = knee_order(pareto_front(chosen))[0][0] if chosen else None  # type: ignore[arg-type]
    even = next((s for s in splits if s["n_target"] * gpus_per_target == s["n_drafter"]), None)
    out: dict[str, Any] = {"splits": splits, "gpus": gpus, "gpus_per_target": gpus_per_target,
                           "best": None, "even": even, "gain_over_even": None}
    if best is not None:
        out["best"] = next(s for s in splits if s["n_target"] == best.n_target)
        if even is not None and even["throughput_tokens_per_s"]:
            out["gain_over_even"] = best.values[0] / even["throughput_tokens_per_s"] - 1
    return out


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def importances(study: optuna.Study, objective_names: list[str]) -> dict[str, dict[str, float]]:
    """PED-ANOVA importance of each knob for each objective.

    PED-ANOVA assumes minimisation, so each maximised objective is passed negated; it needs at
    least a handful of trials and at least two distinct values of a knob to say anything.
    """
    from optuna.importance import PedAnovaImportanceEvaluator, get_param_importances

    out: dict[str, dict[str, float]] = {}
    trials = complete_trials(study)
    varied = [p for p in (trials[0].params if trials else {}) if len({str(t.params.get(p)) for t in trials}) > 1]
    if len(trials) < 4 or not varied:
        return out
    import warnings

    for i, name in enumerate(objective_names):
        try:
            with warnings.catch_warnings():  # we negate the maximised objectives, as it asks
                warnings.filterwarnings("ignore", message="PedAnovaImportanceEvaluator computes")
                imp = get_param_importances(study, evaluator=PedAnovaImportanceEvaluator(), params=varied,
                                            target=lambda t, i=i: -t.values[i])
        except (RuntimeError, ValueError):
            continue
        out[name] = {k: float(v) for k, v in imp.items()}
    return out


def write_selection(path: Path, payload: dict[str, Any]) -> Path:
    from dflash.core.atomic import atomic_write_text

    # a fixed ".tmp" name let two sweeps writing one selection clobber each other's half-written file
    return atomic_write_text(path, json.dumps(payload, indent=1, default=_jsonable))


def _jsonable(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return str(x)
