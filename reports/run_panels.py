"""Per-run panels: what the queue autopilot did, and where a training step's time goes.

Autopilot: a run (simulated or real) whose control records change ``min_ready``/``max_depth`` gets
the knobs over time, the rolling bucket mix over the same clock and the mix the autopilot measured
at each decision, with a table of every change and its reason (docs/ARCHITECTURE.md, "Queue
autopilot"). Knobs are replayed from where the run started (the first change's ``reason.from``,
else the trainer's ``start`` control record, else config.json), so the step line is the queue's
actual setting, not a guess.

Stages: a real run's step records carry ``stages`` (seconds per step in gate wait, transfer,
drafter forward/backward, peer wait, optimizer) and ``step_s``; the table gives each stage's mean per step and
its share of the mean step, so a reader sees whether a step waits on the queue or computes. The
first step is left out when there are others: its gate wait is the start-up fill, not the steady
state. GPU power and utilisation come from the coordinator's ``telemetry`` (``rank/<r>/gpu/<i>/...``,
NVML means per logging interval); a CPU run has none and gets no GPU panel.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pandas as pd

from reports import figures
from reports.document import Figure, Missing, Section, Table
from reports.fmt import NA, fmt_metric, num
from reports.inputs import Inputs
from reports.runs import RunData

KNOBS = ("min_ready", "max_depth")
MAX_CHANGE_ROWS = 60  # per run; a longer run's table says how many it left out
COMPOUND_STAGES = {"drafter_compute_s"}  # forward + backward: shown, not added into the step again
GPU_KEY = re.compile(r"^rank/(\d+)/gpu/(\d+)/(\w+)$")


def labelled_runs(inputs: Inputs) -> list[tuple[str, RunData]]:
    """Every run the inputs name, once: a validation's measured and simulated runs, then standalone runs."""
    out: list[tuple[str, RunData]] = []
    seen: set[str] = set()
    val = inputs.validation
    pairs = [(f"{c.name} ({kind})", run) for c in (val.configs if val else [])
             for kind, run in (("simulated", c.sim), ("measured", c.run)) if run is not None]
    pairs += [(f"{r.name} ({'simulated' if r.source == 'sim' else 'measured'})", r) for r in inputs.runs]
    for label, run in pairs:
        key = str(run.dir.resolve())
        if key not in seen:
            seen.add(key)
            out.append((label, run))
    return out


# --------------------------------------------------------------------------- autopilot
def knob_changes(run: RunData) -> list[dict[str, Any]]:
    """Control records that change min_ready or max_depth (accepted or refused), in time order.

    A refused live change keeps its value as JSON text (``change.rejected``, one shape for Parquet);
    it is read back here so the table shows what was asked for."""
    rows = []
    for r in run.controls:
        change = r.get("change")
        if isinstance(change, dict) and isinstance(change.get("rejected"), str):
            try:
                asked = json.loads(change["rejected"])
            except ValueError:
                asked = None
            change = asked if isinstance(asked, dict) else None
        if isinstance(change, dict) and any(k in change for k in KNOBS) and r.get("t") is not None:
            rows.append({**r, "change": change})
    return sorted(rows, key=lambda r: float(r["t"]))


def changed_by(r: dict[str, Any]) -> str:
    """Who made a change: the autopilot (``source_of_change``) or a live change (``tune-live``, its serial)."""
    if r.get("source_of_change"):
        return str(r["source_of_change"])
    return f"tune-live #{r['serial']}" if r.get("serial") is not None else NA


def start_knobs(run: RunData, changes: list[dict[str, Any]]) -> dict[str, int | None]:
    """The knobs the run started with."""
    for r in changes:
        frm = r.get("reason", {}).get("from") if isinstance(r.get("reason"), dict) else None
        if isinstance(frm, dict):
            return {k: frm.get(k) for k in KNOBS}
    for r in run.controls:
        start = (r.get("change") or {}).get("start")
        if isinstance(start, dict):
            return {k: start.get(k) for k in KNOBS}
    q = run.queue or {}
    return {k: q.get(k) for k in KNOBS}


def knob_series(run: RunData, changes: list[dict[str, Any]]) -> dict[str, tuple[list[float], list[float]]]:
    """(t, value) steps of each knob: the start at t 0, then each accepted change; held to the run's end."""
    start = start_knobs(run, changes)
    end = max([float(r["t"]) for r in (*run.takes, *changes) if r.get("t") is not None], default=0.0)
    out: dict[str, tuple[list[float], list[float]]] = {}
    for k in KNOBS:
        ts, vs = [], []
        if num(start.get(k)) is not None:
            ts, vs = [0.0], [float(start[k])]
        for r in changes:
            if r.get("accepted", True) and num(r["change"].get(k)) is not None:
                ts.append(float(r["t"]))
                vs.append(float(r["change"][k]))
        if vs:
            ts.append(max(end, ts[-1]))
            vs.append(vs[-1])
        out[k] = (ts, vs)
    return out


def _reason_text(r: dict[str, Any]) -> str:
    reason = r.get("reason")
    if isinstance(reason, dict):
        return str(reason.get("rule") or NA)
    if reason:
        return str(reason)
    return f"applied {r['applied']}" if r.get("applied") else NA


def changes_table(run: RunData, changes: list[dict[str, Any]]) -> pd.DataFrame:
    rows = []
    for r in changes[:MAX_CHANGE_ROWS]:
        reason = r.get("reason") if isinstance(r.get("reason"), dict) else {}
        iv = reason.get("interval")
        mix = fmt_metric("mix_efficiency", reason.get("mix_efficiency"))
        if isinstance(iv, list) and len(iv) == 2:
            mix += f" [{fmt_metric('mix_efficiency', iv[0])}, {fmt_metric('mix_efficiency', iv[1])}]"
        rows.append({
            "t (s)": f"{float(r['t']):,.1f}", "step": NA if r.get("step") is None else str(r["step"]),
            "change": ", ".join(f"{k} {v}" for k, v in r["change"].items()),
            "accepted": "yes" if r.get("accepted", True) else "NO", "by": changed_by(r),
            "bound": str(reason.get("bound", NA)), "mix measured": mix,
            "size needed": str(reason.get("size_needed", NA)), "reason": _reason_text(r),
        })
    df = pd.DataFrame(rows, columns=["t (s)", "step", "change", "accepted", "by", "bound", "mix measured",
                                     "size needed", "reason"])
    # A simulated run has no step; a live change states no autopilot measurement.
    empty = [c for c in ("step", "bound", "mix measured", "size needed") if (df[c] == NA).all()]
    return df.drop(columns=empty)


def autopilot_section(inputs: Inputs) -> Section:
    sec = Section("Queue autopilot: knobs and mix over time", "autopilot")
    shown = 0
    for label, run in labelled_runs(inputs):
        changes = knob_changes(run)
        if not changes:
            continue
        shown += 1
        stem = f"autopilot_{shown}"
        start = start_knobs(run, changes)
        last = knob_series(run, changes)
        end = {k: (int(v[-1]) if v else None) for k, (_, v) in last.items()}
        sec.blocks.append(Figure(stem, figures.autopilot(label, run, last, changes),
                                 f"{label}: min_ready and max_depth over time (from "
                                 f"{start['min_ready']}/{start['max_depth']} to {end['min_ready']}/"
                                 f"{end['max_depth']}, {len(changes)} change records), the rolling bucket mix of "
                                 f"consecutive windows of {run.window} taken items at each window's last take, and "
                                 "the mix_efficiency the autopilot measured at each decision (bars: its interval; "
                                 "dashed: the target). Directory: " + str(run.dir)))
        left = len(changes) - MAX_CHANGE_ROWS
        sec.blocks.append(Table(changes_table(run, changes),
                                f"{label}: every knob change from the control records, with its reason"
                                + (f" (first {MAX_CHANGE_ROWS}; {left} more in control.jsonl)." if left > 0 else ".")))
    if not shown:
        sec.blocks.append(Missing("no run with control records that move min_ready/max_depth (`dflash simulate "
                                  "--queue auto --records DIR`, or a `dflash train` run with [queue] mode = "
                                  "\"auto\" or a tune-live change)"))
    return sec


# --------------------------------------------------------------------------- stages
def _steady(steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    timed = [s for s in steps if isinstance(s.get("stages"), dict)]
    return timed[1:] if len(timed) > 1 else timed


def stage_means(steps: list[dict[str, Any]]) -> tuple[dict[str, float], float | None, int]:
    """(mean seconds per step of each stage, mean step_s, steps counted) over the steady steps."""
    steady = _steady(steps)
    sums: dict[str, list[float]] = {}
    for s in steady:
        for k, v in s["stages"].items():
            if num(v) is not None:
                sums.setdefault(k, []).append(float(v))
    means = {k: sum(v) / len(v) for k, v in sums.items()}
    step_s = [float(s["step_s"]) for s in steady if num(s.get("step_s")) is not None]
    return means, (sum(step_s) / len(step_s) if step_s else None), len(steady)


def rank_spread(steps: list[dict[str, Any]]) -> dict[str, tuple[float, float]]:
    """Per stage, (lowest, highest) of the drafter ranks' own means: a slow rank shows as a wide spread."""
    per: dict[str, dict[str, list[float]]] = {}
    for s in _steady(steps):
        for rank, stages in (s.get("rank_stages") or {}).items():
            for k, v in (stages or {}).items():
                if num(v) is not None:
                    per.setdefault(k, {}).setdefault(rank, []).append(float(v))
    return {k: (min(m := [sum(v) / len(v) for v in ranks.values()]), max(m)) for k, ranks in per.items()
            if len(ranks) > 1}


def stages_table(runs: list[tuple[str, RunData]]) -> pd.DataFrame:
    rows = []
    for label, run in runs:
        means, step_s, n = stage_means(run.steps)
        spread = rank_spread(run.steps)
        leaves = sum(v for k, v in means.items() if k not in COMPOUND_STAGES)
        items = [(k, v) for k, v in means.items()]
        if step_s is not None:
            items.append(("other (step_s - stages)", step_s - leaves))
            items.append(("step_s", step_s))
        for k, v in items:
            lo_hi = spread.get(k)
            rows.append({"run": label, "stage": k + (" (forward + backward)" if k in COMPOUND_STAGES else ""),
                         "mean s/step": f"{v:.4f}",
                         "share of step": NA if not step_s else f"{100 * v / step_s:.1f}%",
                         "drafter ranks (min-max)": NA if lo_hi is None else f"{lo_hi[0]:.4f}-{lo_hi[1]:.4f}",
                         "steps": str(n)})
        if run.producer_stages:
            keys = list(dict.fromkeys(k for s in run.producer_stages for k in s))
            for k in keys:
                vals = [float(s[k]) for s in run.producer_stages if num(s.get(k)) is not None]
                if vals:
                    rows.append({"run": label, "stage": f"producer {k} (per item)",
                                 "mean s/step": f"{sum(vals) / len(vals):.4f}", "share of step": NA,
                                 "drafter ranks (min-max)": NA, "steps": f"{len(vals)} items"})
    return pd.DataFrame(rows, columns=["run", "stage", "mean s/step", "share of step", "drafter ranks (min-max)",
                                       "steps"])


def gpu_samples(run: RunData) -> pd.DataFrame:
    """One row per (step record with telemetry, rank, GPU): t and the NVML interval means it carries."""
    rows: dict[tuple[float, int, int], dict[str, Any]] = {}
    for s in run.steps:
        tel = s.get("telemetry")
        if not isinstance(tel, dict):
            continue
        for key, v in tel.items():
            m = GPU_KEY.match(key)
            if m and num(v) is not None:
                rows.setdefault((float(s["t"]), int(m[1]), int(m[2])), {})[m[3]] = float(v)
    return pd.DataFrame([{"t": t, "rank": r, "gpu": g, **vals} for (t, r, g), vals in sorted(rows.items())])


def gpu_table(runs: list[tuple[str, RunData, pd.DataFrame]]) -> pd.DataFrame:
    rows = []
    for label, _, df in runs:
        for (rank, gpu), g in df.groupby(["rank", "gpu"]):
            def mean(col: str, fmt: str, g: pd.DataFrame = g) -> str:
                return format(g[col].mean(), fmt) if col in g and g[col].notna().any() else NA

            def peak(col: str, fmt: str, g: pd.DataFrame = g) -> str:
                return format(g[col].max(), fmt) if col in g and g[col].notna().any() else NA

            rows.append({"run": label, "rank": str(rank), "GPU": str(gpu), "intervals": str(len(g)),
                         "utilisation %": mean("util", ".1f"), "memory-bus %": mean("mem_util", ".1f"),
                         "power W": mean("power_w", ".1f"), "SM clock MHz": mean("sm_clock_mhz", ".0f"),
                         "peak memory GiB": peak("mem_used_gib", ".2f"), "peak temp C": peak("temp_c", ".0f")})
    return pd.DataFrame(rows)


def stages_section(inputs: Inputs) -> Section:
    sec = Section("Where a step goes: stage timings and GPU", "stages")
    runs = [(label, run) for label, run in labelled_runs(inputs)
            if run.source == "real" and any(isinstance(s.get("stages"), dict) for s in run.steps)]
    if not runs:
        sec.blocks.append(Missing("no real run whose step records carry `stages` (a `dflash train --out` "
                                  "directory from a trainer that times stages)"))
        return sec
    sec.blocks.append(Figure("stages", figures.stages([(label, *stage_means(run.steps)[:2]) for label, run in runs],
                                                      COMPOUND_STAGES),
                             "Mean seconds per training step in each stage (the first step, whose gate wait is "
                             "the start-up fill, left out); the drafter's compute is its forward + backward."))
    sec.blocks.append(Table(stages_table(runs),
                            "Per-stage mean seconds per step and share of the mean step (step_s) over the steps "
                            "after the first, the first drafter's own timings (the step record's `stages`); other: "
                            "step time no stage accounts for; drafter ranks: the spread of the drafter ranks' means "
                            "(several drafters only); producer rows: per produced item."))
    gpus = [(label, run, df) for label, run in runs if not (df := gpu_samples(run)).empty]
    if gpus:
        sec.blocks.append(Figure("gpu", figures.gpu(gpus),
                                 "GPU utilisation and power per rank over time: NVML samples averaged over each "
                                 "logging interval (the step records' telemetry)."))
        sec.blocks.append(Table(gpu_table(gpus), "NVML over the run: means of the interval means (utilisation, "
                                "power, clock), peaks of memory and temperature."))
    else:
        sec.blocks.append(Missing("GPU power and utilisation: the step records carry no NVML samples (a CPU run, "
                                  "or NVML unavailable)"))
    return sec
