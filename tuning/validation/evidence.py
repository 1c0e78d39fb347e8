"""Decisions by evidence: when a measured difference is resolved, and what to recommend.

Validation measures each configuration in blocks of takes, alternating the configurations
(ABCABC...) so slow machine drift hits all of them alike. After each round it *looks*: for the
chosen configuration against ``handpicked`` and ``baseline``, on each objective, is the interval of
the difference of block means clear of 0? Looking after every round and stopping at the first
clear answer would inflate the error rate, so the number of looks is fixed in advance
(``max_looks``) and each look uses level ``1 - alpha / max_looks`` (Bonferroni over looks: simple,
valid for any stopping rule, a little conservative). The interval is Welch's t interval of the
difference of two independent block samples.

The recommendation follows the evidence: the candidates are the configurations not *resolved*
worse than the measured best on either objective, and among them the one with the lowest peak
queue memory wins. A costlier configuration is never preferred on unresolved evidence.

The held-out quality metric (``[train] quality_every``) enters as two more objectives, held-out tau
(higher is better) and held-out loss (lower is better), read at the last step every configuration
scored (:mod:`tuning.validation.quality`). They are not block means but one estimate per configuration
(the mean over its training seeds); the interval of a difference is the paired one of
:mod:`tuning.validation.paired` (a bootstrap over the *same* sequences for both sides, plus the variance
between training seeds), carried by :class:`Estimate` (``paired``); without it, the normal one from the
two intervals as if independent (:func:`compare_estimates`). They are read once, after the last round, so they take no
share of the per-look level, and they do not stop a validation early. A difference is resolved by
the one rule of :func:`resolved` whatever the objective, and the recommendation names the objectives
that decided (:attr:`Recommendation.decided_by`).

Pure: no torch, no trainer; :mod:`tuning.validation.recommendation` feeds it block measurements.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from scipy import stats

OBJECTIVES = ("throughput_tokens_per_s", "mix_efficiency")  # both maximised
HELDOUT_OBJECTIVES = ("heldout_tau", "heldout_loss")
SENSE = {"throughput_tokens_per_s": 1, "mix_efficiency": 1, "heldout_tau": 1, "heldout_loss": -1}  # +1: higher wins
LABELS = {"throughput_tokens_per_s": "throughput", "mix_efficiency": "mix_efficiency",
          "heldout_tau": "held-out tau", "heldout_loss": "held-out loss"}
REFERENCES = ("handpicked", "baseline")


@dataclass(frozen=True)
class Comparison:
    config: str
    against: str
    objective: str
    difference: float  # mean(config) - mean(against)
    ci95: tuple[float, float]  # at the per-look level that keeps the whole procedure at 95%
    resolved: bool  # exactly: 0 lies outside ci95
    se: float
    blocks: tuple[int, int]
    paired: bool = False  # a held-out comparison over the same sequences (tuning.validation.paired)
    seeds: tuple[int, int] | None = None  # training seeds per side of a held-out comparison

    def as_json(self) -> dict[str, object]:
        out: dict[str, object] = {"config": self.config, "against": self.against, "objective": self.objective,
                                  "difference": self.difference, "ci95": list(self.ci95), "resolved": self.resolved,
                                  "se": self.se, "blocks": list(self.blocks)}
        if self.objective in HELDOUT_OBJECTIVES:
            out |= {"paired": self.paired, "seeds": list(self.seeds) if self.seeds else None}
        return out


def resolved(lo: float, hi: float) -> bool:
    """The one resolve rule of every comparison: 0 lies outside the interval of the difference."""
    return not lo <= 0.0 <= hi


@dataclass(frozen=True)
class Estimate:
    """One configuration's held-out figure at the compared step: the value and its 95% interval."""

    value: float
    ci95: tuple[float, float]
    n: int  # held-out sequences behind it
    # against another configuration: (difference, se, df) of the paired comparison over the same sequences
    # with run-to-run variance (tuning.validation.paired); df inf: a normal interval. Empty: not paired.
    paired: Mapping[str, tuple[float, float, float]] = field(default_factory=dict)
    seeds: int = 1  # training seeds behind ``value`` (their mean)


def compare_estimates(config: str, against: str, objective: str, a: Estimate, b: Estimate, *,
                      level: float = 0.95) -> Comparison:
    """``a - b``: the paired comparison when ``a`` carries one against ``against`` (a t interval on its
    degrees of freedom); else a normal interval, each side's standard error from its 95% interval's
    half-width (as if independent: wider)."""
    if against in a.paired:
        d, se, df = a.paired[against]
        crit = float(stats.norm.ppf(1 - (1 - level) / 2)) if math.isinf(df) else \
            float(stats.t.ppf(1 - (1 - level) / 2, df))
        return Comparison(config, against, objective, d, (d - crit * se, d + crit * se),
                          resolved(d - crit * se, d + crit * se), se, (a.n, b.n), True, (a.seeds, b.seeds))
    z95 = float(stats.norm.ppf(0.975))
    se = math.hypot((a.ci95[1] - a.ci95[0]) / (2 * z95), (b.ci95[1] - b.ci95[0]) / (2 * z95))
    d = a.value - b.value
    h = float(stats.norm.ppf(1 - (1 - level) / 2)) * se
    return Comparison(config, against, objective, d, (d - h, d + h), resolved(d - h, d + h), se, (a.n, b.n))


HeldoutEstimates = Mapping[str, Mapping[str, Estimate]]  # config -> held-out objective -> estimate


def per_look_level(level: float, max_looks: int) -> float:
    if not 0 < level < 1 or max_looks < 1:
        raise ValueError("level must be in (0, 1) and max_looks >= 1")
    return 1.0 - (1.0 - level) / max_looks


def difference_interval(a: Sequence[float], b: Sequence[float], *, level: float
                        ) -> tuple[float, tuple[float, float], float, float]:
    """(difference of means, interval, standard error, critical t) of mean(a) - mean(b), Welch.

    Needs two blocks on each side (a spread); with fewer the interval is unbounded.
    """
    d = _mean(a) - _mean(b)
    if len(a) < 2 or len(b) < 2:
        return d, (-math.inf, math.inf), math.inf, math.inf
    va, vb = _var(a) / len(a), _var(b) / len(b)
    se = math.sqrt(va + vb)
    if se == 0:
        return d, (d, d), 0.0, 0.0
    df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
    t = float(stats.t.ppf(1 - (1 - level) / 2, df))
    return d, (d - t * se, d + t * se), se, t


def compare(config: str, against: str, objective: str, a: Sequence[float], b: Sequence[float], *,
            max_looks: int, level: float = 0.95) -> Comparison:
    d, (lo, hi), se, _ = difference_interval(a, b, level=per_look_level(level, max_looks))
    return Comparison(config, against, objective, d, (lo, hi), resolved(lo, hi), se, (len(a), len(b)))


BlockMeans = Mapping[str, Mapping[str, Sequence[float]]]  # config -> objective -> per-block values


def chosen_comparisons(blocks: BlockMeans, chosen: str, *, max_looks: int,
                       objectives: Sequence[str] = OBJECTIVES) -> list[Comparison]:
    """The chosen configuration against each reference that was measured, on each objective."""
    return [compare(chosen, ref, obj, blocks[chosen][obj], blocks[ref][obj], max_looks=max_looks)
            for ref in REFERENCES if ref in blocks and ref != chosen for obj in objectives]


def heldout_comparisons(heldout: HeldoutEstimates, chosen: str) -> list[Comparison]:
    """The chosen configuration against each reference on each held-out objective every one of them has."""
    objs = heldout_objectives(heldout)
    return [compare_estimates(chosen, ref, obj, heldout[chosen][obj], heldout[ref][obj])
            for ref in REFERENCES if ref in heldout and ref != chosen and chosen in heldout for obj in objs]


def heldout_objectives(heldout: HeldoutEstimates) -> tuple[str, ...]:
    """The held-out objectives every configuration has an estimate of (empty: the metric is off)."""
    return tuple(k for k in HELDOUT_OBJECTIVES if heldout and all(k in h for h in heldout.values()))


def measured_objectives(blocks: BlockMeans) -> tuple[str, ...]:
    """The objectives every configuration with a throughput block has block values for.
    ``mix_efficiency`` needs windows of items that a very short block may not fill; then throughput
    alone decides (empty: no configuration has a throughput block, nothing can be decided)."""
    measured = [b for b in blocks.values() if b.get(OBJECTIVES[0])]
    return tuple(k for k in OBJECTIVES if measured and all(b.get(k) for b in measured))


def all_resolved(comparisons: Sequence[Comparison]) -> bool:
    return all(c.resolved for c in comparisons)


@dataclass(frozen=True)
class Recommendation:
    """The pick, and the one home of the figures a person reads about it: the CLI summary, best.toml's
    comment and the report all print ``words`` and read ``takes_to_resolve`` from here (through
    validation.json), never recompute them."""

    name: str
    candidates: tuple[str, ...]
    against_best: tuple[Comparison, ...]  # every other config against the measured best, per objective
    words: str
    takes_to_resolve: int | None = None  # more takes per config that would resolve the open differences
    objectives: tuple[str, ...] = OBJECTIVES  # every objective compared, held-out ones included
    decided_by: tuple[str, ...] = ()  # objectives on which a configuration was resolved worse (empty: memory alone)

    def as_json(self) -> dict[str, object]:
        return {"name": self.name, "candidates": list(self.candidates), "words": self.words,
                "against_best": [c.as_json() for c in self.against_best], "takes_to_resolve": self.takes_to_resolve,
                "objectives": list(self.objectives), "decided_by": list(self.decided_by)}


def recommend(blocks: BlockMeans, peak_bytes: Mapping[str, float], *, max_looks: int,
              block_takes: int, objectives: Sequence[str] = OBJECTIVES,
              heldout: HeldoutEstimates | None = None) -> Recommendation:
    """Candidates = not resolved worse than the measured best on any objective (the block objectives,
    and the held-out ones every configuration has in ``heldout``); the cheapest in peak queue memory
    wins (ties: the higher mean throughput, then the name)."""
    names = sorted(blocks)
    held = {n: heldout[n] for n in names if heldout and n in heldout}
    held_objs = heldout_objectives(held) if len(held) == len(names) else ()
    against_best: list[Comparison] = []
    worse: dict[str, set[str]] = {}
    for obj in (*objectives, *held_objs):
        sense = SENSE[obj]
        if obj in held_objs:
            best = max(names, key=lambda n: (sense * held[n][obj].value, n))
            comps = [compare_estimates(n, best, obj, held[n][obj], held[best][obj]) for n in names if n != best]
        else:
            best = max(names, key=lambda n: (sense * _mean(blocks[n][obj]), n))
            comps = [compare(n, best, obj, blocks[n][obj], blocks[best][obj], max_looks=max_looks)
                     for n in names if n != best]
        for c in comps:
            against_best.append(c)
            if c.resolved and sense * c.difference < 0:
                worse.setdefault(c.config, set()).add(obj)
    candidates = tuple(n for n in names if n not in worse)
    pick = min(candidates, key=lambda n: (peak_bytes.get(n, math.inf),
                                          -_mean(blocks[n]["throughput_tokens_per_s"]), n))
    # "about N more takes" is a block figure: held-out differences do not shrink with more blocks alike
    more = open_takes_to_resolve([c for c in open_differences(against_best, candidates) if c.objective in objectives],
                                 block_takes)
    compared = (*objectives, *held_objs)
    decided = tuple(o for o in compared if any(o in objs for objs in worse.values()))
    words = _words(pick, candidates, peak_bytes, objectives, more, held_objs) + " " + _decided_words(worse, decided)
    return Recommendation(pick, candidates, tuple(against_best), words, more, compared, decided)


def _decided_words(worse: Mapping[str, set[str]], decided: Sequence[str]) -> str:
    """Which objective decided: those on which a configuration was resolved worse than the best."""
    if not decided:
        return "Decided by peak queue memory alone: no objective resolved a configuration worse than the best."
    parts = [f"{LABELS[o]} ({', '.join(sorted(n for n, objs in worse.items() if o in objs))} resolved worse)"
             for o in decided]
    return f"Decided by {'; '.join(parts)}, then peak queue memory among the rest."


def open_differences(against_best: Sequence[Comparison], candidates: Sequence[str]) -> list[Comparison]:
    """The comparisons the recommendation leaves open: a candidate not resolved apart from the best."""
    return [c for c in against_best if not c.resolved and c.config in candidates]


def open_takes_to_resolve(comparisons: Sequence[Comparison], block_takes: int) -> int | None:
    """The most :func:`takes_to_resolve` over ``comparisons`` (None: nothing to resolve, or no estimate).

    The one computation of the "about N more takes" figure: the recommendation stores it, and every
    place that shows it reads it from there."""
    more = [m for m in (takes_to_resolve(c, block_takes) for c in comparisons) if m is not None]
    return max(more) if more and max(more) > 0 else None


def takes_to_resolve(c: Comparison, block_takes: int) -> int | None:
    """Roughly how many more takes per configuration would put 0 outside the interval, if the
    difference and the per-block noise stay as observed (None: no difference to resolve)."""
    if c.resolved:
        return 0
    if c.difference == 0 or not math.isfinite(c.se):
        return None
    n = min(c.blocks)
    t = (c.ci95[1] - c.difference) / c.se if c.se > 0 else 0.0
    need = n * (t * c.se / abs(c.difference)) ** 2
    return max(1, math.ceil(need - n)) * block_takes


def _words(pick: str, candidates: Sequence[str], peak_bytes: Mapping[str, float], objectives: Sequence[str],
           more: int | None, held_objs: Sequence[str] = ()) -> str:
    others = [n for n in candidates if n != pick]
    on = "on either objective" if len(objectives) > 1 else \
        "on throughput (the blocks were too short to measure a mix efficiency)"
    if held_objs:
        on = f"on any of {', '.join(LABELS[o] for o in (*objectives, *held_objs))}" if len(objectives) > 1 else \
            f"on any of throughput, {', '.join(LABELS[o] for o in held_objs)} (the blocks were too short to " \
            f"measure a mix efficiency)"
    text = f"{pick}: the lowest peak queue memory ({peak_bytes.get(pick, math.nan) / 2**30:.2f} GiB) among the " \
           f"configurations not resolved worse than the measured best {on}"
    if others:
        text += f" ({', '.join(others)} {'is' if len(others) == 1 else 'are'} not resolved apart from it)"
    if more is not None:
        text += f"; about {more:,} more takes per configuration would resolve the remaining differences " \
                f"at the observed noise (dflash validate --takes)"
    return text + "."


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan


def _var(xs: Sequence[float]) -> float:
    m = _mean(xs)
    return sum((x - m) ** 2 for x in xs) / (len(xs) - 1)
