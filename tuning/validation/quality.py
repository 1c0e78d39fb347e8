"""The held-out quality metric of a validation's runs, read for :mod:`tuning.validation.evidence`.

With ``[train] quality_every`` every configuration's run scores its drafter on the held-out set
(:mod:`dflash.pipeline.heldout`) into its step records under ``heldout``. Configurations are compared
at *equal steps*: the last step every one of them scored, since a drafter that trained longer is
better for that reason alone. Every configuration of one validation shares the seed and so the
held-out set; each run's ``heldout.json`` ids are checked against the others', and a disagreement is
said (the comparison is then of different sequences and is left out).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dflash.core.records import read_records
from tuning.validation.evidence import Estimate

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


def heldout_evidence(run_dirs: Mapping[str, Path]) -> dict[str, Any]:
    """What validation.json says under ``heldout``: on/off, the compared step, whether the held-out sets
    agree, each configuration's ``heldout`` object at that step, and a note when nothing can be compared.

    ``estimates`` (config -> objective -> :class:`Estimate`) feeds the decision; empty when off."""
    scores = {n: heldout_by_step(d) for n, d in run_dirs.items()}
    if not any(scores.values()):
        return {"on": False, "note": OFF_NOTE, "step": None, "configs": {}, "estimates": {}}
    ids = {n: heldout_ids(d) for n, d in run_dirs.items()}
    first = next(iter(ids.values()))
    same = all(v is not None and v == first for v in ids.values())
    step = common_step(scores)
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
    return {"on": True, "note": note, "step": step, "same_set": same,
            "sequences": len(first) if first is not None else None, "configs": at,
            "estimates": {n: estimates(h) for n, h in at.items()} if usable else {}}
