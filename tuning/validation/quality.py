"""The held-out quality metric of a validation's runs, read for :mod:`tuning.validation.evidence`.

With ``[train] quality_every`` every configuration's run scores its drafter on the held-out set
(:mod:`dflash.pipeline.heldout`) into its step records under ``heldout``. Configurations are compared
at *equal steps*: the last step every one of them scored, since a drafter that trained longer is
better for that reason alone. Every configuration of one validation shares the seed and so the
held-out set; each run's ``heldout.json`` ids are checked against the others', and a disagreement is
said (the comparison is then of different sequences and is left out). A configuration may have
several runs, one per training seed (``dflash validate --seeds``); configurations are compared by the
paired bootstrap of :mod:`tuning.validation.paired` on each run's per-sequence rows.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from dflash.core.records import read_records
from tuning.validation.evidence import Estimate
from tuning.validation.paired import RunRows, paired_difference, run_estimate, seed_variance

OFF_NOTE = ("held-out quality objective: off (set [train] quality_every = N, a divisor of the block's steps, to "
            "compare configurations on held-out tau and loss at equal steps)")
KEYS = {"heldout_tau": "tau", "heldout_loss": "loss"}


def heldout_by_step(run_dir: Path) -> dict[int, dict[str, Any]]:
    """A run's held-out scores by step (the step record's ``step``)."""
    return {int(r["step"]): r["heldout"] for r in read_records(run_dir, "step") if r.get("heldout")}


def common_step(scores: Mapping[str, Mapping[int, Any]]) -> int | None:
    """The last step every configuration has a held-out score at, or None."""
    steps = set.intersection(*(set(s) for s in scores.values())) if scores else set()
    return max(steps) if steps else None


def heldout_ids(run_dir: Path) -> list[str] | None:
    try:
        return list(json.loads((run_dir / "heldout.json").read_text())["ids"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def estimates(h: Mapping[str, Any]) -> dict[str, Estimate]:
    """The held-out objectives of one ``heldout`` object that have a value and an interval."""
    out = {}
    for obj, key in KEYS.items():
        v, ci = h.get(key), h.get(f"{key}_ci")
        if v is not None and ci is not None and None not in ci:
            out[obj] = Estimate(float(v), (float(ci[0]), float(ci[1])), int(h.get("sequences") or 0))
    return out


RunDirs = Mapping[str, "Path | Sequence[Path]"]  # config -> its run directory, or one per training seed


def heldout_evidence(run_dirs: RunDirs) -> dict[str, Any]:
    """What validation.json says under ``heldout``: on/off, the compared step, whether the held-out sets
    agree, each configuration's ``heldout`` object at that step (its first seed's run), the seeds per
    configuration, the paired comparisons (:mod:`tuning.validation.paired`) and a note when nothing can
    be compared or no claim can rest on it.

    ``estimates`` (config -> objective -> :class:`Estimate`, each carrying its paired differences) feeds the
    decision; empty when off, when the sets differ, and when no configuration has >= 2 seeds (the
    run-to-run variance is then unknown: the comparison is shown but decides nothing)."""
    from dflash.pipeline.heldout import read_rows  # the pipeline's file format; torch only on use

    runs = {n: [d] if isinstance(d, Path) else list(d) for n, d in run_dirs.items()}
    scores = {n: heldout_by_step(ds[0]) for n, ds in runs.items()}
    if not any(scores.values()):
        return {"on": False, "note": OFF_NOTE, "step": None, "configs": {}, "estimates": {}}
    ids = {f"{n}[{k}]": heldout_ids(d) for n, ds in runs.items() for k, d in enumerate(ds)}
    first = next(iter(ids.values()))
    same = all(v is not None and v == first for v in ids.values())
    rows = {n: [read_rows(d) for d in ds] for n, ds in runs.items()}
    step = common_step({**scores, **{f"{n}[{k}]": r for n, rs in rows.items() for k, r in enumerate(rs)}})
    seeds = {n: len(ds) for n, ds in runs.items()}
    note = None
    if not same:
        differ = sorted(n for n, v in ids.items() if v != first)
        note = (f"held-out sets differ between configurations ({', '.join(differ)} against "
                f"{next(iter(ids))}; heldout.json ids): not compared")
    elif step is None:
        note = "no step at which every configuration has a held-out score: not compared (set quality_every " \
               "to a divisor of the block's steps)"
    at = {n: s[step] for n, s in scores.items()} if step is not None else {}
    usable = same and step is not None
    out: dict[str, Any] = {"on": True, "note": note, "step": step, "same_set": same,
                           "sequences": len(first) if first is not None else None, "configs": at,
                           "method": "paired", "seeds": seeds, "pairs": [], "estimates": {}}
    if not usable:
        return out
    runs_at = {n: [RunRows(tuple(r[step]["ids"]), tuple(tuple(x) for x in r[step]["rows"])) for r in rs]
               for n, rs in rows.items()}
    pairs, est = paired_estimates(runs_at, at)
    out["pairs"] = pairs
    claim = all(p["claim"] for p in pairs)
    if not claim:
        out["note"] = (f"held-out: {max(seeds.values())} training seed per configuration, so the run-to-run variance "
                       f"is unknown: the paired comparison over sequences is shown but decides nothing (dflash "
                       f"validate --seeds 2 or more for a quality claim)")
    out["estimates"] = est if claim else {}
    return out


def paired_estimates(runs: Mapping[str, list[RunRows]], at: Mapping[str, Mapping[str, Any]]
                     ) -> tuple[list[dict[str, Any]], dict[str, dict[str, Estimate]]]:
    """Every pair of configurations, on each held-out objective: the paired comparison (JSON rows) and
    each configuration's :class:`Estimate` (the mean over its seeds) carrying its differences."""
    from itertools import permutations

    names = list(runs)
    pairs: list[dict[str, Any]] = []
    est: dict[str, dict[str, Estimate]] = {n: {} for n in names}
    for obj in KEYS:
        if not all(obj in estimates(at[n]) for n in names):
            continue
        var = seed_variance(runs, obj)
        diffs = {(a, b): paired_difference(runs[a], runs[b], obj, var) for a, b in permutations(names, 2)}
        for n in names:
            one = estimates(at[n])[obj]
            value = sum(run_estimate(r, obj) for r in runs[n]) / len(runs[n])
            est[n][obj] = Estimate(value, one.ci95, one.n, {b: (d.difference, d.se, d.df) for (a, b), d in diffs.items()
                                                            if a == n}, len(runs[n]))
        pairs += [{"config": a, "against": b, "objective": obj, **d.as_json(), "seed_variance": var.var,
                   "seed_df": var.df} for (a, b), d in diffs.items() if names.index(a) < names.index(b)]
    return pairs, est
