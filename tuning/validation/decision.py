"""Decisions with the validated simulator and the hardware together.

What it decides: given, for every pair of validated configurations and every objective, the
simulator's predicted difference and the hardware's measured one, which configuration to use, and
whether that is a *decision* (one configuration is certified within the margins of the best), an
*equivalence* (several are, so they are within the margins of each other and the cheaper in queue
memory wins) or
*undecided* (and what it would take). Pure: no torch, no trainer, no simulator calls, no files;
:mod:`tuning.validation.summary` feeds it numbers and writes :meth:`Decision.as_json` into
``validation.json``, from which :func:`decide_from_json` rebuilds the same decision.

How, per pair (candidate c, reference r) and objective o, oriented so that positive = c better:

- the simulator's difference ``d_sim`` with its seed standard error ``se_sim`` (prediction seeds
  disjoint from the sweep's, so the sweep's pick carries no winner's curse), and the model error on
  a difference, τ_o, fixed in advance (:mod:`tuning.validation.model_error`; never fitted from the
  runs judged here: this module has no parameter through which a judged run could set it);
- the hardware's difference ``d_hw`` with ``se_hw`` from paired rounds (the configurations of one
  round see the same data order, so the per-round differences cancel the data's phase), Student-t
  with n - 1 degrees of freedom; with too few rounds for a spread, the simulator's predicted
  block-to-block spread stands in, and ``hw_se_source`` says so;
- the combination. When the hardware's blocks are steady-state blocks: precision-weighted, w_sim =
  1/(se_sim² + τ²), w_hw = 1/se_hw² (the minimum variance unbiased mix of two unbiased estimates; τ²
  makes the simulator only as precise as it has been shown to be on configurations it never saw).
  When the hardware could afford only the first block (the start-up transient; the demo's one round),
  *bias transfer*: the simulator also predicts that block's difference ``d0_sim ± se0_sim``, over the
  same takes, window and seeds, and the hardware measures ``d0_hw ± se_hw``. Model: the true steady
  difference is dss_sim + b with b ~ N(0, τ²), and d0_hw = d0_sim + b + noise, i.e. **the simulator's
  error is a shift common to the first block and the steady state**. Why that assumption: the error
  comes from the calibration (the timing fit, the workload model), which is the same in both phases,
  while what differs between them (the queue filling from empty, the gate opening) is what the
  simulator models explicitly; it is also the only assumption under which one transient block says
  anything about the steady state. Then k = (τ² + c)/(τ² + se_hw² + se0_sim²), the estimate is
  dss_sim + k·(d0_hw - d0_sim) and its variance se_sim² + τ² - (τ² + c)²/(τ² + se_hw² + se0_sim²),
  where c is the covariance of the simulator's two estimates over its seeds (0 for independent runs:
  the variance is then se_sim² + τ²(1 - k)). Without first-block inputs d0 := dss (c = se_sim²) and
  this is exactly the precision-weighted combination (``tests/test_decision.py`` proves it);
- the gap z = (d0_sim - d0_hw) / sqrt(τ² + se0_sim² + se_hw²) is reported beside it (d0 = dss without a
  first block). Refutation is for the pipeline, not per comparison: when any comparison's |z| >
  ``z_refute``, the simulator is refuted for the whole decision, said once, and every comparison falls
  back to the hardware alone (at one round it rarely certifies anything: then undecided, not false).
  The per-comparison verdict (each comparison judged on its own gap) stays in the JSON for the table;
- the interval d ± q·se at the split level: α = 1 - level is divided over looks × comparisons ×
  objectives (Bonferroni: valid whatever the dependence between the comparisons and the stopping
  rule; conservative by little when the count is small);
- a verdict per comparison: ``equivalent`` when the interval lies inside ±margin_o, else ``better``
  when it lies above 0, ``worse`` when below, else ``unresolved`` (the report's table).

Over the whole set, *within the margin of the best* (multiple comparisons with the best): a
configuration c is *certified* when for every other configuration r and every objective the lower
bound of c - r at the split level is above -margin (no other can be better than c by more than the
margin the user cares about: the issue's "the truly best, or one equivalent to it within δ"). One
certified: ``decided``. Several: they are within the margins of each other (both lower bounds above
-margin), so ``equivalent``, and the one with the least peak queue memory is chosen. None:
``undecided``: the cheapest configuration nobody beats (``better`` on some objective, ``worse`` on
none) is named (a costlier configuration is never preferred on unresolved evidence), with the paired
rounds that would give 80% power at the simulator's predicted difference.

What it never does: look at which blocks the numbers came from; the caller says whether the hardware's
block is the first one (first-block inputs) or steady-state blocks. ``benchmarks/decision_oc.py``
measured what each choice gives at the demo's budget (benchmarks/RESULTS.md).

Usage (numbers from validation; ``sim``: per prediction seed, the same seeds for every
configuration; ``hw``: per paired round)::

    from tuning.validation.decision import DecisionPolicy, decide, pair_evidence, answer_sentences

    policy = DecisionPolicy.from_config(cfg.decision, looks=1, objectives=("throughput_tokens_per_s",
                                                                           "mix_efficiency"))
    ev = [pair_evidence("tuned-1", "baseline", "mix_efficiency",
                        sim_candidate=[0.99, 1.01, 1.00], sim_reference=[0.89, 0.90, 0.88],
                        hw_candidate=[1.02], hw_reference=[0.85], model_block_sd=0.05),
          ...]  # every pair of validated configurations, every objective
    d = decide(ev, {"tuned-1": 3.1e6, "baseline": 1.0e6}, policy)
    d.outcome, d.chosen, d.as_json()
    first, second = answer_sentences(d, pathology)   # the CLI's last lines and the report's first section
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from scipy import stats

from tuning.validation.model_error import MODEL_ERROR, ModelError

SENSE = {"throughput_tokens_per_s": 1, "mix_efficiency": 1, "heldout_tau": 1, "heldout_loss": -1}  # +1: higher wins
LABELS = {"throughput_tokens_per_s": "throughput", "mix_efficiency": "mix_efficiency",
          "heldout_tau": "held-out tau", "heldout_loss": "held-out loss"}
RELATIVE_MARGIN = {"throughput_tokens_per_s": True}  # margins of the others are in their own unit
OUTCOMES = ("decided", "equivalent", "undecided")
VERDICTS = ("better", "worse", "equivalent", "unresolved")
SOURCE_BOTH = "simulator and hardware"
SOURCE_SIM = "simulator, hardware only checked it"
SOURCE_HW_REFUTED = "hardware alone (simulator refuted)"
SOURCE_HW_ONLY = "hardware alone (no simulator prediction)"
SIM_DOMINATES = 0.9  # the simulator's share of the weight above which the hardware only "checked" it
POWER_GOAL = 0.8  # the power the "what it would take" figure asks for
HW_SE_BLOCKS = "paired blocks"
HW_SE_MODEL = "simulator's block-to-block variance"
HW_SE_ESTIMATE = "per-configuration estimates"
HW_SE_PAIRED = "paired over sequences, with the variance between seeds"  # tuning.validation.paired
MIN_ROUNDS_EMPIRICAL = 5  # fewer paired rounds than this: the spread of 4 differences (3 df) is too rough


# --------------------------------------------------------------------------- inputs
@dataclass(frozen=True)
class DecisionPolicy:
    """The margins, the level and the refutation threshold, with the count the level is split over.

    ``margins`` per objective: throughput's is relative (a fraction of the reference's level), the
    others absolute. Built from ``[decision]`` (:class:`dflash.core.config.DecisionConfig`, validated
    there) by :meth:`from_config`; ``looks``: the looks at the evidence fixed before the first block.
    """

    margins: Mapping[str, float]
    level: float = 0.95
    z_refute: float = 2.0
    looks: int = 1
    objectives: tuple[str, ...] = ("throughput_tokens_per_s", "mix_efficiency")

    def __post_init__(self) -> None:
        if not 0 < self.level < 1 or self.z_refute <= 0 or self.looks < 1:
            raise ValueError("level must be in (0, 1), z_refute > 0 and looks >= 1")
        for o in self.objectives:
            if o not in SENSE or not self.margins.get(o, 0) > 0:
                raise ValueError(f"objective {o!r} needs a known sense and a margin > 0")

    @classmethod
    def from_config(cls, dc: Any, *, looks: int, objectives: Sequence[str]) -> DecisionPolicy:
        margins = {"throughput_tokens_per_s": dc.margin_throughput, "mix_efficiency": dc.margin_mix_efficiency,
                   "heldout_tau": dc.margin_heldout_tau, "heldout_loss": dc.margin_heldout_loss}
        return cls(margins={o: margins[o] for o in objectives}, level=dc.level, z_refute=dc.z_refute,
                   looks=looks, objectives=tuple(objectives))

    def as_json(self) -> dict[str, Any]:
        return {"margins": dict(self.margins), "margin_relative": {o: RELATIVE_MARGIN.get(o, False)
                                                                   for o in self.objectives},
                "level": self.level, "z_refute": self.z_refute, "looks": self.looks,
                "objectives": list(self.objectives)}


@dataclass(frozen=True)
class Evidence:
    """One objective, one pair: what the simulator and the hardware say about candidate - reference.

    Differences are raw (the metric's own direction: a lower held-out loss is a negative difference);
    the decision orients them by :data:`SENSE`. ``scale`` is the reference's level (for relative
    margins and τ; throughput). ``sim_diff`` None: the simulator does not predict this objective.
    ``hw_se`` may be inf (no hardware yet); ``hw_df`` inf means a normal interval.
    """

    candidate: str
    reference: str
    objective: str
    sim_diff: float | None
    sim_se: float
    hw_diff: float
    hw_se: float
    hw_df: float
    hw_se_source: str
    hw_rounds: int
    scale: float = 1.0
    sim_first_diff: float | None = None  # the simulator's difference over the hardware's (first) block
    sim_first_se: float = 0.0
    sim_first_cov: float = 0.0  # covariance of the simulator's first-block and steady-state estimates

    def as_json(self) -> dict[str, Any]:
        return _finite({k: getattr(self, k) for k in self.__dataclass_fields__})

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Evidence:
        inf_if_null = ("sim_se", "hw_se", "hw_df", "sim_first_se", "sim_first_cov")
        defaults = {"sim_first_diff": None, "sim_first_se": 0.0, "sim_first_cov": 0.0}
        out = {}
        for k in cls.__dataclass_fields__:
            v = d.get(k, defaults.get(k)) if k in defaults else d[k]
            out[k] = math.inf if v is None and k in inf_if_null else v
        return cls(**out)


def seed_difference(candidate: Sequence[float], reference: Sequence[float]) -> tuple[float, float]:
    """(mean difference, its standard error) of the simulator over prediction seeds.

    Paired by seed when both have the same seeds (common random numbers: the same arrivals and
    noise, so the difference is sharper than either side); the caller passes them in seed order.
    """
    a, b = list(map(float, candidate)), list(map(float, reference))
    if len(a) != len(b) or not a:
        raise ValueError("the simulator's seeds must pair up (the same seeds for every configuration)")
    diffs = [x - y for x, y in zip(a, b, strict=True)]
    return _mean(diffs), (_sd(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else math.inf)


def round_difference(candidate: Sequence[float], reference: Sequence[float], *, model_block_sd: float | None = None,
                     min_rounds: int = MIN_ROUNDS_EMPIRICAL) -> tuple[float, float, float, str, int]:
    """(difference, se, df, se source, rounds) of the hardware from paired rounds.

    Round i of both configurations ran on the same data order, so their difference is the unit.
    With ``min_rounds`` or more rounds the spread of the differences gives se and n - 1 df;
    otherwise ``model_block_sd`` (the simulator's predicted standard deviation of one round's
    difference, at the same block length and window) gives se = sd/sqrt(n) with a normal interval.
    Neither: se is inf (the hardware cannot speak yet).
    """
    a, b = list(map(float, candidate)), list(map(float, reference))
    n = min(len(a), len(b))
    if n == 0:
        return 0.0, math.inf, math.inf, HW_SE_MODEL, 0
    diffs = [x - y for x, y in zip(a[:n], b[:n], strict=True)]
    d = _mean(diffs)
    if n >= max(2, min_rounds):
        return d, _sd(diffs) / math.sqrt(n), float(n - 1), HW_SE_BLOCKS, n
    if model_block_sd is not None and model_block_sd > 0:
        return d, model_block_sd / math.sqrt(n), math.inf, HW_SE_MODEL, n
    return d, math.inf, math.inf, HW_SE_MODEL, n


def pair_evidence(candidate: str, reference: str, objective: str, *, sim_candidate: Sequence[float] | None,
                  sim_reference: Sequence[float] | None, hw_candidate: Sequence[float],
                  hw_reference: Sequence[float], model_block_sd: float | None = None, scale: float | None = None,
                  min_rounds: int = MIN_ROUNDS_EMPIRICAL, sim_first_candidate: Sequence[float] | None = None,
                  sim_first_reference: Sequence[float] | None = None) -> Evidence:
    """:class:`Evidence` from per-seed simulated values and per-round measured values.

    ``sim_candidate``/``sim_reference``: the simulator's steady-state values per prediction seed.
    ``sim_first_candidate``/``sim_first_reference`` (optional, the same seeds in the same order): the
    simulator's values over the *same block* the hardware measured (the first block of takes, same
    window): the decision then transfers the simulator's error from that block to its steady-state
    prediction (:func:`combine`). None: the hardware's blocks are steady-state blocks (today's rule).

    ``scale`` defaults to the reference's simulated mean (else its measured mean): the level that a
    relative margin and τ are fractions of.
    """
    if sim_candidate is not None and sim_reference is not None:
        sd, sse = seed_difference(sim_candidate, sim_reference)
    else:
        sd, sse = None, 0.0
    hd, hse, hdf, src, n = round_difference(hw_candidate, hw_reference, model_block_sd=model_block_sd,
                                            min_rounds=min_rounds)
    if scale is None:
        ref = list(sim_reference) if sim_reference is not None and len(sim_reference) else list(hw_reference)
        scale = abs(_mean(ref)) if ref else 1.0
    first: tuple[float | None, float, float] = (None, 0.0, 0.0)
    if sd is not None and sim_first_candidate is not None and sim_first_reference is not None:
        d0, se0 = seed_difference(sim_first_candidate, sim_first_reference)
        ss = [x - y for x, y in zip(map(float, sim_candidate), map(float, sim_reference), strict=True)]
        s0 = [x - y for x, y in zip(map(float, sim_first_candidate), map(float, sim_first_reference), strict=True)]
        if len(s0) != len(ss):
            raise ValueError("the simulator's first-block and steady-state values must come from the same seeds")
        cov = (sum((a - _mean(s0)) * (b - _mean(ss)) for a, b in zip(s0, ss, strict=True)) / (len(ss) - 1)
               / len(ss)) if len(ss) > 1 else 0.0
        first = (d0, se0, cov)
    return Evidence(candidate, reference, objective, sd, sse, hd, hse, hdf, src, n, float(scale), *first)


def estimate_evidence(candidate: str, reference: str, objective: str, *, hw_candidate: tuple[float, float],
                      hw_reference: tuple[float, float], n: int = 1) -> Evidence:
    """Hardware-only :class:`Evidence` from one (value, se) per configuration (held-out objectives)."""
    d = hw_candidate[0] - hw_reference[0]
    se = math.hypot(hw_candidate[1], hw_reference[1])
    return Evidence(candidate, reference, objective, None, 0.0, d, se, math.inf, HW_SE_ESTIMATE, n,
                    abs(hw_reference[0]) or 1.0)


def paired_evidence(candidate: str, reference: str, objective: str, diff: tuple[float, float, float], *,
                    scale: float, n: int) -> Evidence:
    """Hardware-only :class:`Evidence` from a paired held-out difference ``(difference, se, df)``
    (:mod:`tuning.validation.paired`: over the same sequences, with the variance between seeds)."""
    d, se, df = diff
    return Evidence(candidate, reference, objective, None, 0.0, d, se, df, HW_SE_PAIRED, n, abs(scale) or 1.0)


@dataclass(frozen=True)
class BucketUse:
    """The one-bucket pathology in one configuration's takes (from records: runmetrics/mixmetrics)."""

    longest_streak: int  # max_bucket_streak: consecutive takes from one bucket
    streak_takes: int  # the takes the streak was looked for in
    top_share: float  # share of takes from the most-taken bucket
    top_bucket: str  # its name (e.g. "<=128")


@dataclass(frozen=True)
class Pathology:
    """Baseline against the recommendation, for the answer's second sentence."""

    baseline: BucketUse
    chosen: BucketUse
    baseline_name: str = "baseline"
    window: int = 32  # [metrics] window: a streak this long fills a whole window from one bucket

    def occurs(self) -> bool:
        """The pathology people tune these knobs for: a whole window of takes from one bucket."""
        return max(self.baseline.longest_streak, self.chosen.longest_streak) >= self.window


# --------------------------------------------------------------------------- outputs
@dataclass(frozen=True)
class Combined:
    """One pair, one objective, decided: oriented so positive = candidate better."""

    evidence: Evidence
    sim: float | None  # the simulator's oriented difference
    hw: float  # the hardware's oriented difference
    tau: float  # τ in the objective's unit (0 without a simulator prediction)
    margin: float  # the margin in the objective's unit
    gap_z: float | None
    refuted: bool
    source: str
    difference: float
    se: float
    interval: tuple[float, float]
    verdict: str
    sim_weight: float  # the simulator's share of the weight (0 when refuted or absent)
    power: float | None  # the hardware alone, at the simulator's predicted difference
    rounds_needed: int | None  # paired rounds for POWER_GOAL at the predicted difference (None: not needed)

    @property
    def candidate(self) -> str:
        return self.evidence.candidate

    @property
    def reference(self) -> str:
        return self.evidence.reference

    @property
    def objective(self) -> str:
        return self.evidence.objective

    def as_json(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "evidence"}
        out["interval"] = list(self.interval)
        return _finite({"candidate": self.candidate, "reference": self.reference, "objective": self.objective,
                        **out})


@dataclass(frozen=True)
class Decision:
    """The whole decision; :meth:`as_json` carries every input so a reader can rebuild it."""

    outcome: str  # one of OUTCOMES
    chosen: str | None
    survivors: tuple[str, ...]
    decided_by: tuple[str, ...]  # objectives on which the chosen one beat another
    source: str  # where the confidence comes from (see SOURCE_*), over the comparisons that decided
    headline: Combined | None  # chosen against baseline (else the runner-up) on the deciding objective
    comparisons: tuple[Combined, ...]
    policy: DecisionPolicy
    peak_queue_bytes: Mapping[str, float]
    per_interval_level: float
    n_comparisons: int
    rounds_needed: int | None  # undecided: paired rounds for POWER_GOAL power at the predicted difference
    note: str
    model_error: Mapping[str, ModelError] = field(default_factory=dict)
    simulator_refuted: bool = False  # some gap beyond z_refute: every comparison is the hardware's alone
    verdicts_per_comparison: tuple[str, ...] = ()  # each comparison judged on its own gap (the older rule)

    def as_json(self) -> dict[str, Any]:
        return _finite({
            "outcome": self.outcome, "chosen": self.chosen, "survivors": list(self.survivors),
            "decided_by": list(self.decided_by), "source": self.source,
            "headline": self.headline.as_json() if self.headline else None,
            "simulator_refuted": self.simulator_refuted,
            "comparisons": [{**c.as_json(), "verdict_per_comparison": v} for c, v in
                            zip(self.comparisons, self.verdicts_per_comparison or [c.verdict for c in
                                                                                     self.comparisons], strict=True)],
            "per_interval_level": self.per_interval_level, "n_comparisons": self.n_comparisons,
            "rounds_needed": self.rounds_needed, "note": self.note,
            "model_error": {o: m.as_json() for o, m in self.model_error.items()},
            "inputs": {"evidence": [c.evidence.as_json() for c in self.comparisons],
                       "peak_queue_bytes": dict(self.peak_queue_bytes), "policy": self.policy.as_json()},
        })


# --------------------------------------------------------------------------- the decision
def split_alpha(level: float, looks: int, comparisons: int, objectives: int) -> float:
    """The per-interval α: (1 - level) / (looks × comparisons × objectives), Bonferroni."""
    if not 0 < level < 1 or min(looks, comparisons, objectives) < 1:
        raise ValueError("level must be in (0, 1) and every count >= 1")
    return (1.0 - level) / (looks * comparisons * objectives)


def combine(ev: Evidence, policy: DecisionPolicy, alpha: float, *, hardware_alone: bool = False) -> Combined:
    """One pair, one objective: the combination, the gap, the interval and the verdict.

    ``alpha``: this interval's share of 1 - level (:func:`split_alpha`). ``hardware_alone``: the
    simulator was refuted for the whole decision (:func:`decide`): the hardware decides alone here too.
    Without first-block inputs the hardware's blocks are steady-state blocks and the combination is
    the precision-weighted one; with them the simulator's error on the measured block is transferred to
    its steady-state prediction (the module's docstring); the first reduces to the second exactly.
    """
    sense = SENSE[ev.objective]
    me = MODEL_ERROR.get(ev.objective)
    margin = policy.margins[ev.objective] * (abs(ev.scale) if RELATIVE_MARGIN.get(ev.objective) else 1.0)
    hw, se_hw = sense * ev.hw_diff, ev.hw_se
    sim = None if ev.sim_diff is None or me is None else sense * ev.sim_diff
    tau = me.absolute(ev.scale) if (me is not None and sim is not None) else 0.0
    v_sim = ev.sim_se ** 2 + tau ** 2 if sim is not None else math.inf
    gap_z = None
    if sim is None:
        d, se, df, source, share = hw, se_hw, ev.hw_df, SOURCE_HW_ONLY, 0.0
    else:
        first = ev.sim_first_diff is not None
        d0 = sense * ev.sim_first_diff if first else sim  # the simulator on the block the hardware measured
        v0 = ev.sim_first_se ** 2 if first else ev.sim_se ** 2
        c0 = ev.sim_first_cov if first else ev.sim_se ** 2  # cov(first-block, steady-state simulated estimates)
        v_gap = tau ** 2 + v0 + se_hw ** 2
        gap_z = (d0 - hw) / math.sqrt(v_gap) if math.isfinite(v_gap) and v_gap > 0 else None
        if hardware_alone or (gap_z is not None and abs(gap_z) > policy.z_refute):
            z_text = f"gap z={gap_z:+.1f}" if gap_z is not None else "no gap"
            d, se, df, source, share = hw, se_hw, ev.hw_df, f"{SOURCE_HW_REFUTED[:-1]}, {z_text})", 0.0
        elif first:  # bias transfer: the error measured on the first block shifts the steady prediction
            if math.isfinite(v_gap) and v_gap > 0 and math.isfinite(v_sim) and math.isfinite(c0):
                k = (tau ** 2 + c0) / v_gap
                d, se, share = sim + k * (hw - d0), math.sqrt(max(v_sim - (tau ** 2 + c0) ** 2 / v_gap, 0.0)), 1 - k
            else:  # a side without a spread: nothing is transferred, nothing known beyond the prediction
                d, se, share = sim, math.inf, 1.0
            df = math.inf
            source = SOURCE_SIM if share >= SIM_DOMINATES else SOURCE_BOTH
        else:
            w_sim = 1.0 / v_sim if v_sim > 0 else math.inf
            w_hw = 1.0 / se_hw ** 2 if se_hw > 0 else math.inf
            if math.isinf(w_sim) and math.isinf(w_hw):
                d, se, share = (sim + hw) / 2, 0.0, 0.5
            elif math.isinf(w_sim) or math.isinf(w_hw):
                d, se, share = (sim, 0.0, 1.0) if math.isinf(w_sim) else (hw, 0.0, 0.0)
            elif w_sim + w_hw == 0:  # neither side has a spread: nothing is known
                d, se, share = sim, math.inf, 1.0
            else:
                share = w_sim / (w_sim + w_hw)
                d, se = share * sim + (1 - share) * hw, 1.0 / math.sqrt(w_sim + w_hw)
            df = math.inf
            source = SOURCE_SIM if share >= SIM_DOMINATES else SOURCE_BOTH
    q = _quantile(1 - alpha / 2, df)
    lo, hi = (d - q * se, d + q * se) if math.isfinite(se) else (-math.inf, math.inf)
    verdict = _verdict(lo, hi, margin)
    power = _power(sim, se_hw, _quantile(1 - alpha / 2, ev.hw_df)) if sim is not None else None
    kept = gap_z is not None and abs(gap_z) <= policy.z_refute and not hardware_alone
    needed = _rounds_needed(ev, sim if sim is not None else d, margin, v_sim if kept else math.inf, q) \
        if verdict == "unresolved" else None
    return Combined(ev, sim, hw, tau, margin, gap_z, gap_z is not None and abs(gap_z) > policy.z_refute, source,
                    d, se, (lo, hi), verdict, share, power, needed)


def decide(evidence: Sequence[Evidence], peak_queue_bytes: Mapping[str, float], policy: DecisionPolicy) -> Decision:
    """The decision over every configuration named in ``evidence`` (one entry per pair and objective).

    τ comes from :data:`tuning.validation.model_error.MODEL_ERROR` alone. Objectives of ``evidence``
    outside ``policy.objectives`` are an error (their margin is not stated); the level is split over
    ``policy.looks`` × the pairs × the objectives present.
    """
    if not evidence:
        raise ValueError("no evidence to decide on")
    objectives = sorted({e.objective for e in evidence}, key=lambda o: (o not in policy.objectives, o))
    if any(o not in policy.objectives for o in objectives):
        raise ValueError(f"objectives without a margin: {[o for o in objectives if o not in policy.objectives]}")
    pairs = sorted({frozenset((e.candidate, e.reference)) for e in evidence}, key=sorted)
    names = sorted({n for p in pairs for n in p})
    alpha = split_alpha(policy.level, policy.looks, len(pairs), len(objectives))
    kept = tuple(combine(e, policy, alpha) for e in evidence)  # each comparison on its own gap (the report's table)
    refuted = any(c.refuted for c in kept)  # one gap too large refutes the simulator for the whole decision
    comps = tuple(combine(e, policy, alpha, hardware_alone=True) for e in evidence) if refuted else kept
    verdict = {(c.candidate, c.reference, c.objective): c.verdict for c in comps}
    lower: dict[tuple[str, str, str], tuple[float, float]] = {}  # (a, b, o) -> (lower bound of a - b, margin)
    for c in comps:
        verdict.setdefault((c.reference, c.candidate, c.objective), _FLIP[c.verdict])
        lower[(c.candidate, c.reference, c.objective)] = (c.interval[0], c.margin)
        lower.setdefault((c.reference, c.candidate, c.objective), (-c.interval[1], c.margin))

    def beats(a: str, b: str) -> tuple[str, ...]:
        vs = [verdict.get((a, b, o), "unresolved") for o in objectives]
        return tuple(o for o, v in zip(objectives, vs, strict=True) if v == "better") if "worse" not in vs else ()

    def certified(a: str) -> bool:
        """Not worse than any other by more than the margin, on every objective, at the split level."""
        return all(lower.get((a, m, o), (-math.inf, 0.0))[0] > -lower.get((a, m, o), (0.0, 0.0))[1]
                   for m in names if m != a for o in objectives)

    cost = {n: float(peak_queue_bytes.get(n, math.inf)) for n in names}
    good = tuple(n for n in names if certified(n))
    rounds = None
    if good:  # several certified ones are within the margins of each other (both lower bounds > -margin)
        survivors = good
        outcome, chosen = ("decided" if len(good) == 1 else "equivalent"), min(good, key=lambda n: (cost[n], n))
    else:
        survivors = tuple(n for n in names if not any(beats(m, n) for m in names if m != n))
        outcome, chosen = "undecided", (min(survivors, key=lambda n: (cost[n], n)) if survivors else None)
        open_ = [c for c in comps if c.verdict == "unresolved" and {c.candidate, c.reference} <= set(survivors)]
        rounds = max((c.rounds_needed for c in open_ if c.rounds_needed is not None), default=None)
    decided_by = tuple(o for o in objectives if chosen and any(verdict.get((chosen, m, o)) == "better"
                                                               for m in names if m != chosen))
    headline = _headline(comps, chosen, names, decided_by or tuple(objectives), cost)
    deciding = [c for c in comps if chosen in (c.candidate, c.reference) and c.verdict != "unresolved"]
    if refuted:
        worst = max((c for c in kept if c.gap_z is not None), key=lambda c: abs(c.gap_z or 0.0))
        source = (f"{SOURCE_HW_REFUTED[:-1]}: {sum(c.refuted for c in kept)} of {len(kept)} gaps beyond "
                  f"|z| {policy.z_refute:g}, largest z={worst.gap_z:+.1f} ({worst.candidate} - {worst.reference}, "
                  f"{LABELS.get(worst.objective, worst.objective)}))")
    else:
        source = _overall_source(deciding or [c for c in comps if chosen in (c.candidate, c.reference)])
    note = _note(outcome, survivors, rounds, comps)
    return Decision(outcome, chosen, survivors, decided_by, source, headline, comps, policy,
                    dict(peak_queue_bytes), 1 - alpha, len(pairs), rounds, note,
                    {o: MODEL_ERROR[o] for o in objectives
                     if o in MODEL_ERROR and any(c.objective == o and c.sim is not None for c in comps)},
                    refuted, tuple(c.verdict for c in kept))


def decide_from_json(payload: Mapping[str, Any]) -> Decision:
    """Rebuild a decision from :meth:`Decision.as_json` (its ``inputs``)."""
    inputs = payload["inputs"]
    p = inputs["policy"]
    policy = DecisionPolicy(margins=p["margins"], level=p["level"], z_refute=p["z_refute"], looks=p["looks"],
                            objectives=tuple(p["objectives"]))
    return decide([Evidence.from_json(e) for e in inputs["evidence"]], inputs["peak_queue_bytes"], policy)


def answer_sentences(decision: Decision, pathology: Pathology | None,
                     describe: Mapping[str, str] | None = None) -> tuple[str, str]:
    """The two sentences that answer the user (the CLI's last lines, the report's first section).

    First: which configuration, how much better on which objective, its queue memory cost (undecided:
    the cheapest configuration nobody beats, and the hardware's power at the simulator's predicted
    difference that kept it open). Second: how sure and from what (simulator, hardware or both, with
    τ and the gap), and whether the one-bucket pathology occurs (baseline against the choice).
    ``describe``: name -> its knobs in words.
    """
    d, h = decision, decision.headline
    name = d.chosen or "none"
    knobs = f" ({describe[name]})" if describe and name in describe else ""
    mem = _mib(d.peak_queue_bytes.get(name))
    diff = f"{_what(h)} against {h.reference}" if h is not None else ""
    if d.outcome == "decided":
        first = (f"Use {name}{knobs}: {diff}, resolved better on "
                 f"{', '.join(LABELS.get(o, o) for o in d.decided_by)}; it holds {mem} of queue memory at peak"
                 + (f" ({h.reference}: {_mib(d.peak_queue_bytes.get(h.reference))})." if h is not None else "."))
    elif d.outcome == "equivalent":
        first = (f"Use {name}{knobs}: {', '.join(d.survivors)} are equivalent within the margins on every objective "
                 f"({_margins(d)}), and {name} holds the least queue memory, {mem} at peak.")
    else:
        first = (f"Undecided at this budget: {name}{knobs} is the cheapest configuration no other beats ({mem} of "
                 f"queue memory at peak)" + (f", {diff}" if diff else "") + _open_text(d) + ".")
    level = f"{d.policy.level:.0%}"
    split = (f"split over {d.policy.looks} look(s) x {d.n_comparisons} comparison(s) x {len(_objectives(d))} "
             f"objective(s)")
    taus = ", ".join(f"{LABELS.get(o, o)} {_tau_text(m)}" for o, m in d.model_error.items())
    gap = f", gap z = {h.gap_z:+.1f}" if h is not None and h.gap_z is not None else ""
    basis = f"from the {d.source}" + (f" (the simulator's tau: {taus}{gap})" if taus else "")
    second = (f"Sure at {level} overall ({split}), {basis}; " if d.outcome != "undecided" else
              f"Not resolved at {level} overall ({split}), {basis}; ")
    if pathology is None:
        second += "the one-bucket pathology was not measured."
    else:
        b, c = pathology.baseline, pathology.chosen
        second += (f"the one-bucket pathology (drafters pulling from one bucket for a whole window of "
                   f"{pathology.window} takes) {'occurs' if pathology.occurs() else 'does not occur'} here: longest "
                   f"bucket streak {b.longest_streak} of {b.streak_takes} takes ({pathology.baseline_name}) against "
                   f"{c.longest_streak} of {c.streak_takes} ({name}), most-taken bucket {b.top_bucket} "
                   f"{b.top_share:.0%} against {c.top_bucket} {c.top_share:.0%} of takes.")
    return first, second


def _what(c: Combined) -> str:
    return (f"{LABELS.get(c.objective, c.objective)} {_signed(c.difference, c)} "
            f"[{_signed(c.interval[0], c)}, {_signed(c.interval[1], c)}]")


def _open_text(d: Decision) -> str:
    """Why it stays open: the unresolved comparison among the survivors that needs the most rounds."""
    open_ = [c for c in d.comparisons if c.verdict == "unresolved" and {c.candidate, c.reference} <= set(d.survivors)]
    if not open_:
        return ""
    c = max(open_, key=lambda c: (c.rounds_needed or 0, c.power is not None))
    if c.sim is None or c.power is None:
        return f"; {c.candidate} against {c.reference} on {LABELS.get(c.objective, c.objective)} is not resolved"
    more = (f" (about {c.rounds_needed} paired rounds would resolve it, simulator included, with {POWER_GOAL:.0%} "
            "power)") if c.rounds_needed else ""
    return (f"; the simulator predicts {c.candidate} {_signed(c.sim, c)} on {LABELS.get(c.objective, c.objective)} "
            f"against {c.reference}, which the hardware alone resolves with {c.power:.0%} power at this budget{more}")


def _objectives(d: Decision) -> list[str]:
    return sorted({c.objective for c in d.comparisons})


def _margins(d: Decision) -> str:
    return ", ".join(f"{LABELS.get(o, o)} ±{d.policy.margins[o]:.0%}" if RELATIVE_MARGIN.get(o)
                     else f"{LABELS.get(o, o)} ±{d.policy.margins[o]:g}" for o in _objectives(d))


def _tau_text(m: ModelError) -> str:
    return f"{m.tau:.1%} of the level" if m.relative else f"{m.tau:g}"


def _signed(x: float, c: Combined) -> str:
    """An oriented difference in the objective's words (throughput as a percentage of the reference)."""
    if not math.isfinite(x):
        return "-inf" if x < 0 else "+inf"
    if RELATIVE_MARGIN.get(c.objective):
        return f"{x / abs(c.evidence.scale):+.1%}"
    return f"{x:+.3f}"


def _mib(b: float | None) -> str:
    return "n/a" if b is None or not math.isfinite(float(b)) else f"{float(b) / 2**20:.1f} MiB"


# --------------------------------------------------------------------------- helpers
_FLIP = {"better": "worse", "worse": "better", "equivalent": "equivalent", "unresolved": "unresolved"}


def _verdict(lo: float, hi: float, margin: float) -> str:
    if -margin < lo and hi < margin:
        return "equivalent"
    if lo > 0:
        return "better"
    if hi < 0:
        return "worse"
    return "unresolved"


def _quantile(p: float, df: float) -> float:
    return float(stats.norm.ppf(p)) if not math.isfinite(df) else float(stats.t.ppf(p, df))


def _power(sim: float, se_hw: float, q: float) -> float | None:
    """Power of the hardware alone to resolve the simulator's predicted difference (two-sided)."""
    if not math.isfinite(se_hw) or not math.isfinite(q):
        return None
    if se_hw <= 0:
        return 1.0
    z = abs(sim) / se_hw
    return float(stats.norm.cdf(z - q) + stats.norm.cdf(-z - q))


def _rounds_needed(ev: Evidence, d_pred: float, margin: float, v_sim: float, q: float) -> int | None:
    """Paired rounds for POWER_GOAL power at the predicted difference: to resolve it when it is at
    least half the margin, else to show equivalence; None when the hardware's spread is unknown."""
    if ev.hw_rounds < 1 or not math.isfinite(ev.hw_se) or ev.hw_se <= 0:
        return None
    target = abs(d_pred) if abs(d_pred) >= margin / 2 else margin - abs(d_pred)
    s_star = target / (q + float(stats.norm.ppf(POWER_GOAL)))
    w_needed = 1.0 / s_star ** 2 - (1.0 / v_sim if v_sim > 0 and math.isfinite(v_sim) else 0.0)
    per_round = ev.hw_se ** 2 * ev.hw_rounds
    return max(ev.hw_rounds + 1, math.ceil(w_needed * per_round)) if w_needed > 0 else ev.hw_rounds + 1


def flip(c: Combined) -> Combined:
    """The same comparison seen from the other side (reference - candidate)."""
    e = c.evidence
    ev = Evidence(e.reference, e.candidate, e.objective, None if e.sim_diff is None else -e.sim_diff, e.sim_se,
                  -e.hw_diff, e.hw_se, e.hw_df, e.hw_se_source, e.hw_rounds, e.scale)
    return Combined(ev, None if c.sim is None else -c.sim, -c.hw, c.tau, c.margin,
                    None if c.gap_z is None else -c.gap_z, c.refuted, c.source, -c.difference, c.se,
                    (-c.interval[1], -c.interval[0]), _FLIP[c.verdict], c.sim_weight, c.power, c.rounds_needed)


def _headline(comps: Sequence[Combined], chosen: str | None, names: Sequence[str], objectives: Sequence[str],
              cost: Mapping[str, float]) -> Combined | None:
    """Chosen against baseline (else the closest other) on the first deciding objective, chosen - other."""
    if chosen is None or len(names) < 2:
        return None
    mine = [c if c.candidate == chosen else flip(c) for c in comps
            if chosen in (c.candidate, c.reference) and c.objective == objectives[0]]
    if not mine:
        return None
    base = [c for c in mine if c.reference == "baseline"]
    return base[0] if base else min(mine, key=lambda c: (c.difference, cost.get(c.reference, math.inf)))


def _overall_source(comps: Sequence[Combined]) -> str:
    refuted = [c for c in comps if c.refuted]
    if refuted:
        worst = max(refuted, key=lambda c: abs(c.gap_z or 0.0))
        return f"{SOURCE_HW_REFUTED[:-1]} on {len(refuted)} comparison(s), largest gap z={worst.gap_z:+.1f})"
    kinds = {c.source for c in comps}
    if kinds == {SOURCE_HW_ONLY}:
        return SOURCE_HW_ONLY
    if kinds <= {SOURCE_SIM, SOURCE_HW_ONLY} and SOURCE_SIM in kinds:
        return SOURCE_SIM
    return SOURCE_BOTH


def _note(outcome: str, survivors: Sequence[str], rounds: int | None, comps: Sequence[Combined]) -> str:
    if outcome == "decided":
        return "one configuration is certified: no other is better than it by more than a margin on any objective"
    if outcome == "equivalent":
        return (f"{', '.join(survivors)} are certified (no other is better by more than a margin on any objective), "
                "so within the margins of each other; the cheapest wins")
    trade = any(c.verdict in ("better", "worse") for c in comps if {c.candidate, c.reference} <= set(survivors))
    why = "a resolved trade-off between objectives" if trade else "differences neither resolved nor inside the margins"
    more = f"; about {rounds} paired rounds would give {POWER_GOAL:.0%} power at the simulator's predicted difference" \
        if rounds else ""
    return f"undecided among {', '.join(survivors)}: {why}{more}"


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs)


def _sd(xs: Sequence[float]) -> float:
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def _finite(d: dict[str, Any]) -> dict[str, Any]:
    """JSON has no inf/nan: they become None, in lists too (``Evidence.from_json`` reads them back as inf)."""
    def clean(v: Any) -> Any:
        if isinstance(v, float) and not math.isfinite(v):
            return None
        return [clean(x) for x in v] if isinstance(v, (list, tuple)) else v
    return {k: clean(v) for k, v in d.items()}

