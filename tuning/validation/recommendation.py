"""The recommendation: which tuned configuration is tested, the evidence about it, why the job stopped.

Reads block values (:func:`tuning.validation.metrics.block_table`) and the held-out estimates, and
asks :mod:`tuning.validation.evidence` for the comparisons and the pick.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from tuning.validation.evidence import (
    OBJECTIVES,
    REFERENCES,
    Comparison,
    HeldoutEstimates,
    Recommendation,
    all_resolved,
    chosen_comparisons,
    heldout_comparisons,
    measured_objectives,
    recommend,
)
from tuning.validation.metrics import peak_bytes


def choose_tuned(blocks: dict[str, dict[str, list[float]]], objectives: Sequence[str] = OBJECTIVES) -> str | None:
    """The tuned configuration under test: the knee (tuning.pareto) of the measured block means of
    the configurations other than ``baseline``/``handpicked``; None when there is none."""
    from tuning.pareto import knee_scores

    tuned = sorted(n for n in blocks if n not in REFERENCES and objectives and all(blocks[n][k] for k in objectives))
    if not tuned:
        return None
    points = [[float(np.mean(blocks[n][k])) for k in objectives] for n in tuned]
    scores = knee_scores(points)
    return min(zip(scores, tuned))[1]


def evidence_of(blocks: dict[str, dict[str, list[float]]], looks: int, block_takes: int,
              heldout: HeldoutEstimates | None = None) -> tuple[str | None, list[Comparison], Recommendation | None]:
    """(the tuned config under test, its comparisons, the recommendation) on the objectives every
    measured configuration has (:func:`tuning.validation.evidence.measured_objectives`), plus the held-out
    objectives when ``heldout`` has them (after the last round: :mod:`tuning.validation.quality`); configurations
    without a throughput block are left out."""
    measured = {n: b for n, b in blocks.items() if b["throughput_tokens_per_s"]}
    objectives = measured_objectives(measured)
    if not objectives:
        return None, [], None
    held = {n: h for n, h in (heldout or {}).items() if n in measured}
    chosen = choose_tuned(measured, objectives)
    comps = chosen_comparisons(measured, chosen, max_looks=looks, objectives=objectives) if chosen else []
    comps += heldout_comparisons(held, chosen) if chosen and len(held) == len(measured) else []
    peak = peak_bytes(measured)
    return chosen, comps, recommend(measured, peak, max_looks=looks, block_takes=block_takes, objectives=objectives,
                                    heldout=held)


def stop_reason(rows: list[dict[str, Any]], comps: list[Comparison]) -> str:
    """Why validation ended: a configuration failed and its blocks were dropped (``failed``, whatever else
    is resolved: its comparisons are missing), the decision was an answer at an earlier look and the
    remaining blocks were skipped (``decided``), every comparison resolved on the hardware alone
    (``resolved``), or the budget spent (``budget``; also when there was nothing to compare)."""
    if any(r["status"] == "failed" for r in rows):
        return "failed"
    if any(r["status"] == "skipped" for r in rows):
        return "decided"
    return "resolved" if comps and all_resolved(comps) else "budget"


def round_values(rows: list[dict[str, Any]], kept: list[int], objective: str) -> dict[int, float]:
    """One configuration's kept blocks' values of ``objective``, by block (round) index."""
    out = {}
    for r in rows:
        v = r.get(objective)
        if r["block"] in kept and v is not None and math.isfinite(float(v)):
            out[int(r["block"])] = float(v)
    return out


def decision_objectives(rounds: dict[str, dict[str, dict[int, float]]], held: HeldoutEstimates) -> tuple[str, ...]:
    """The block objectives every configuration has kept-block values of, then the held-out objectives
    every configuration has an estimate of."""
    from tuning.validation.evidence import heldout_objectives

    block = tuple(o for o in OBJECTIVES if rounds and all(r.get(o) for r in rounds.values()))
    held_all = {n: held[n] for n in rounds if n in held}
    return block + (heldout_objectives(held_all) if len(held_all) == len(rounds) else ())


def decide_validation(decision_cfg: Any, looks: int, configs: list[dict[str, Any]],
                      rows: dict[str, list[dict[str, Any]]], held: HeldoutEstimates,
                      peak_bytes: dict[str, float]) -> Any:
    """The decision (:func:`tuning.validation.decision.decide`) over every validated configuration:
    every pair, every objective. Block objectives pair the configurations round by round (the same
    block index: the same data order) on the kept blocks, with the simulator's per-seed kept-block
    means (the same prediction seeds for every configuration: paired by seed) and its block-to-block
    standard deviation of a round's difference (:func:`tuning.validation.predict.paired_block_sd`).
    With only the first block measured (one round: the start-up transient), the simulator's steady
    state (``predicted[...]["steady"]``) is the prediction and its first block is passed as the
    first-block prediction: the decision transfers the simulator's error there to the steady state.
    Held-out objectives are the hardware's alone, paired over the same sequences with the run-to-run
    variance when the estimates carry it. None when nothing can be compared."""
    from itertools import combinations

    from tuning.validation.decision import DecisionPolicy, decide, estimate_evidence, pair_evidence, paired_evidence
    from tuning.validation.predict import paired_block_sd

    by = {c["name"]: c for c in configs}
    rounds = {n: {o: round_values(rows[n], list(by[n].get("kept_blocks") or []), o) for o in OBJECTIVES}
              for n in by}
    objectives = decision_objectives(rounds, held)
    if len(by) < 2 or not objectives:
        return None
    policy = DecisionPolicy.from_config(decision_cfg, looks=looks, objectives=objectives)
    z95 = 1.959963984540054
    evidence = []
    for a, b in combinations(list(by), 2):
        for o in objectives:
            if o not in OBJECTIVES:
                ea, eb = held[a][o], held[b][o]
                if b in ea.paired:  # over the same sequences, with run-to-run variance (tuning.validation.paired)
                    evidence.append(paired_evidence(a, b, o, ea.paired[b], scale=eb.value, n=min(ea.n, eb.n)))
                    continue
                se_a, se_b = ((e.ci95[1] - e.ci95[0]) / (2 * z95) for e in (ea, eb))
                evidence.append(estimate_evidence(a, b, o, hw_candidate=(ea.value, se_a),
                                                  hw_reference=(eb.value, se_b), n=min(ea.n, eb.n)))
                continue
            common = sorted(set(rounds[a][o]) & set(rounds[b][o]))
            pa, pb = by[a]["predicted"].get(o) or {}, by[b]["predicted"].get(o) or {}
            sa, sb = pa.get("per_seed"), pb.get("per_seed")
            sim = sa is not None and sb is not None and len(sa) == len(sb)
            # Only the first block measured: the simulator's steady state, with its first block for the transfer
            ta, tb = ((by[x]["predicted"].get("steady") or {}).get(o, {}).get("per_seed") for x in (a, b))
            steady = sim and ta is not None and tb is not None and len(ta) == len(tb) == len(sa) and common == [0]
            first = {"sim_first_candidate": sa, "sim_first_reference": sb} if steady else {}
            evidence.append(pair_evidence(a, b, o, sim_candidate=(ta if steady else sa) if sim else None,
                                          sim_reference=(tb if steady else sb) if sim else None,
                                          hw_candidate=[rounds[a][o][k] for k in common],
                                          hw_reference=[rounds[b][o][k] for k in common],
                                          model_block_sd=paired_block_sd(by[a]["predicted"], by[b]["predicted"], o),
                                          **first))
    return decide(evidence, {n: peak_bytes.get(n, math.inf) for n in by}, policy)
