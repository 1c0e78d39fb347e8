"""The report's first words: the answer to the user's question, then the decision table behind it.

The user asked which ``hs-min-ready``/``hs-max-depth`` configuration to run. The answer is the two
sentences :func:`tuning.validation.decision.answer_sentences` writes (which configuration, by how
much on which objective, what it costs in queue memory; how sure and from what, and whether the
one-bucket pathology occurs). The CLI prints the same two sentences from the same function, so there
is one home for the words: this module only rebuilds the decision from ``validation.json``'s
``decision`` (its ``inputs`` are the whole decision's inputs: :func:`decide_from_json`) and reads the
bucket use the validation measured.

The table under the answer lists *every* validated configuration (the tuned one included), one row
per configuration and objective: the simulator's prediction and the hardware's measurement, then the
recommendation's difference against that configuration as the simulator, the hardware and the
combination saw it (the combination's interval at the split level), τ, the gap z, the margin, the
verdict and the power the hardware alone had at the simulator's predicted difference. A reader can
check every cell against ``validation.json``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import pandas as pd

from reports.document import Block, Bullets, Table, Text
from reports.fmt import NA, fmt_bytes, fmt_pm, queue_text
from tuning.validation.decision import (
    LABELS,
    RELATIVE_MARGIN,
    BucketUse,
    Combined,
    Decision,
    Pathology,
    answer_sentences,
    decide_from_json,
    flip,
)

VERDICT_WORDS = {"better": "better", "worse": "worse", "equivalent": "equivalent", "unresolved": "open"}


def decision_of(data: Mapping[str, Any]) -> Decision | None:
    """The validation's decision, rebuilt from its recorded inputs; None for a validation without one."""
    d = data.get("decision")
    if not isinstance(d, dict) or not isinstance(d.get("inputs"), dict):
        return None
    try:
        return decide_from_json(d)
    except (KeyError, TypeError, ValueError):
        return None


def bucket_use(data: Mapping[str, Any], name: str) -> BucketUse | None:
    """One configuration's bucket use as the validation recorded it (``pathology``: name -> numbers)."""
    per = data.get("pathology")
    raw = per.get(name) if isinstance(per, dict) else None
    if not isinstance(raw, dict):
        return None
    try:
        return BucketUse(longest_streak=int(raw["longest_streak"]), streak_takes=int(raw["streak_takes"]),
                         top_share=float(raw["top_share"]), top_bucket=str(raw["top_bucket"]))
    except (KeyError, TypeError, ValueError):
        return None


def pathology_of(data: Mapping[str, Any], chosen: str | None) -> Pathology | None:
    """Baseline against the recommendation, when the validation measured both."""
    base, mine = bucket_use(data, "baseline"), bucket_use(data, chosen) if chosen else None
    if base is None or mine is None:
        return None
    window = data.get("window")  # the run's [metrics] window: a streak that long fills a window from one bucket
    return Pathology(base, mine, window=int(window)) if isinstance(window, int) else Pathology(base, mine)


def describe(data: Mapping[str, Any]) -> dict[str, str]:
    """name -> its knobs in words, for the answer's first sentence."""
    return {str(c["name"]): queue_text(c.get("queue")) for c in data.get("configs") or []
            if isinstance(c, dict) and c.get("name")}


def answer_of(data: Mapping[str, Any]) -> tuple[str, str] | None:
    """The two sentences of a validation.json (None when it carries no decision): what the CLI prints
    last and what the report says first."""
    d = decision_of(data)
    if d is None:
        return None
    return answer_sentences(d, pathology_of(data, d.chosen), describe(data))


def answer_blocks(data: Mapping[str, Any]) -> list[Block]:
    """The first section's opening: the two sentences, the decision table, the bucket use and the notes."""
    d = decision_of(data)
    if d is None:
        return []
    first, second = answer_sentences(d, pathology_of(data, d.chosen), describe(data))
    blocks: list[Block] = [Text(first, strong=True), Text(second), decision_table(data, d)]
    uses = [(n, bucket_use(data, n)) for n in validated_names(data, d)]
    lines = [f"{n}{' (recommended)' if n == d.chosen else ''}: longest run of takes from one bucket {u.longest_streak} "
             f"of {u.streak_takes}; most-taken bucket {u.top_bucket}, {u.top_share:.0%} of takes"
             for n, u in uses if u is not None]
    if lines:
        blocks.append(Text("Drafters pulling from one bucket (what these knobs are tuned against), measured:"))
        blocks.append(Bullets(tuple(lines)))
    notes = [f"Outcome: {d.outcome} ({d.note})."]
    block = data.get("block_takes")
    if block is not None:
        reason = data.get("block_reason")
        notes.append(f"Blocks of {block} takes{f' ({reason})' if reason else ''}; {data.get('rounds', NA)} paired "
                     f"round(s) measured.")
    blocks.append(Text(" ".join(notes)))
    return blocks


def validated_names(data: Mapping[str, Any], d: Decision) -> list[str]:
    """Every configuration the validation measured, the recommendation first (then the file's order)."""
    names = [str(c["name"]) for c in data.get("configs") or [] if isinstance(c, dict) and c.get("name")]
    for c in d.comparisons:
        for n in (c.candidate, c.reference):
            if n not in names:
                names.append(n)
    return sorted(names, key=lambda n: n != d.chosen)


def against_chosen(d: Decision, name: str, objective: str) -> Combined | None:
    """The comparison of the recommendation against ``name`` on ``objective``, oriented chosen - name."""
    for c in d.comparisons:
        if c.objective != objective:
            continue
        if (c.candidate, c.reference) == (d.chosen, name):
            return c
        if (c.candidate, c.reference) == (name, d.chosen):
            return flip(c)
    return None


def fmt_diff(c: Combined, x: float | None) -> str:
    """An oriented difference in the objective's unit: throughput in percent of the reference's level."""
    if x is None:
        return NA
    if not math.isfinite(x):
        return "-inf" if x < 0 else "+inf"
    if RELATIVE_MARGIN.get(c.objective):
        scale = abs(c.evidence.scale) or 1.0
        return f"{x / scale:+.1%}"
    return f"{x:+.3f}"


def fmt_size(c: Combined, x: float | None) -> str:
    """τ or a margin (non-negative), in the unit :func:`fmt_diff` uses."""
    if x is None or not math.isfinite(x):
        return NA
    if RELATIVE_MARGIN.get(c.objective):
        return f"{x / (abs(c.evidence.scale) or 1.0):.1%}"
    return f"{x:.3f}"


def _config(data: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    return next((c for c in data.get("configs") or [] if isinstance(c, dict) and c.get("name") == name), {})


def _pm(section: Any, se: Any, objective: str) -> str:
    if not isinstance(section, dict):
        return NA
    v = section.get(objective)
    if isinstance(v, dict):  # predicted: {mean, se}
        return fmt_pm(objective, v.get("mean"), v.get("se"))
    return fmt_pm(objective, v, (se or {}).get(objective) if isinstance(se, dict) else None)


def decision_table(data: Mapping[str, Any], d: Decision) -> Table:
    """Every validated configuration x objective: predicted, measured, and the recommendation against it."""
    rows = []
    objectives = list(d.policy.objectives)
    for name in validated_names(data, d):
        vc = _config(data, name)
        for k, o in enumerate(objectives):
            c = against_chosen(d, name, o) if name != d.chosen else None
            first = k == 0  # the configuration and its knobs once, on its first row
            row = {"config": (name + (" (recommended)" if name == d.chosen else "")) if first else "",
                   "queue": queue_text(vc.get("queue")) if first else "", "objective": LABELS.get(o, o),
                   "predicted": _pm(vc.get("predicted"), None, o),
                   "measured": _pm(vc.get("measured"), vc.get("measured_se"), o)}
            if c is None:
                row |= dict.fromkeys(DIFF_COLUMNS, "—" if name == d.chosen else NA)
            else:
                lo, hi = c.interval
                row |= {"Δ simulated": fmt_diff(c, c.sim), "Δ measured": fmt_diff(c, c.hw),
                        "Δ decided [interval]": f"{fmt_diff(c, c.difference)} [{fmt_diff(c, lo)}, {fmt_diff(c, hi)}]",
                        "τ": fmt_size(c, c.tau) if c.sim is not None else NA,
                        "gap z": NA if c.gap_z is None else f"{c.gap_z:+.1f}" + (" refuted" if c.refuted else ""),
                        "margin": f"±{fmt_size(c, c.margin)}", "verdict": VERDICT_WORDS.get(c.verdict, c.verdict),
                        "power": NA if c.power is None else f"{c.power:.0%}"}
            rows.append(row)
    mem = {n: fmt_bytes(v) for n, v in d.peak_queue_bytes.items()}
    level = f"{d.per_interval_level:.2%}"
    caption = " ".join(part for part in (
        "Every validated configuration. predicted: the calibrated simulator (± standard error over its seeds,",
        "seeds disjoint from the sweep's); measured: the real trainer (± standard error).",
        f"Δ: the recommendation ({d.chosen}) minus this configuration, positive = the recommendation better",
        "(throughput in percent of the pair's reference level). Δ decided: the simulator's and the hardware's",
        "differences combined by precision (the simulator's variance includes τ², its error on a difference, fixed",
        f"in advance from benchmarks/fidelity.py), with its {level} interval (the 95% level split over the looks,",
        "comparisons and objectives). gap z: (simulated − measured) over its standard error; beyond",
        f"±{d.policy.z_refute:g} the simulator is refuted and the hardware decides alone. power: the hardware",
        "alone, at the simulator's predicted difference. verdict: the recommendation's, against the margin",
        "(equivalent: the interval inside ±margin; open: neither resolved nor equivalent).",
        FIRST_BLOCK_NOTE if any(c.evidence.sim_first_diff is not None for c in d.comparisons) else "",
        "Peak queue memory:", ", ".join(f"{n} {m}" for n, m in mem.items()) + "."))
    return Table(pd.DataFrame(rows), caption)


# One round measures only the first block (the queue filling, the start-up transient): the columns then mean
# different blocks, and a reader comparing them needs to be told which (issue #32's bias transfer).
FIRST_BLOCK_NOTE = ("One round: predicted and measured are the first block (start-up: the queue filling), where gap z "
                    "compares them; Δ simulated is the simulator's steady-state difference, which Δ decided shifts by "
                    "the simulator's error on the first block (bias transfer, docs/ARCHITECTURE.md).")

DIFF_COLUMNS = ("Δ simulated", "Δ measured", "Δ decided [interval]", "τ", "gap z", "margin", "verdict", "power")
