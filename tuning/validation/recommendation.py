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
    peak = {n: max(b["peak_queue_bytes"]) if b["peak_queue_bytes"] else math.inf for n, b in measured.items()}
    return chosen, comps, recommend(measured, peak, max_looks=looks, block_takes=block_takes, objectives=objectives,
                                    heldout=held)


def stop_reason(rows: list[dict[str, Any]], comps: list[Comparison]) -> str:
    """Why validation ended, from the evidence: a configuration failed and its blocks were dropped
    (``failed``, whatever else is resolved: its comparisons are missing), every comparison resolved
    (``resolved``, early or at the last look), or the budget spent with differences still open
    (``budget``; also when there was nothing to compare)."""
    if any(r["status"] == "failed" for r in rows):
        return "failed"
    return "resolved" if comps and all_resolved(comps) else "budget"
