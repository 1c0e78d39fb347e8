"""Sections from runs and validations: queue over time, loss curves, simulated vs measured, calibration.

Which runs go side by side: a validation's configs, the reference configs first (``baseline``,
``handpicked``: docs/ARCHITECTURE.md, "Two named reference configs"; then the chosen one and any
others), each with its simulated records (``sim_dir``) and its real run (``run_dir``). Standalone
run directories join by name (a run whose queue is 10/30 or 30/90 with the default policy is
``baseline``/``handpicked``, others keep their directory name) and by ``source`` (sim or real).
"""

from __future__ import annotations

import math
from typing import Any

import pandas as pd

from reports import figures
from reports.document import Figure, Missing, Section, Table, Text
from reports.fmt import METRICS, NA, fmt_ci, fmt_metric, fmt_pm, fmt_rel, num, queue_text
from reports.inputs import CalibrationInput, Inputs
from reports.recommend import REFERENCES, chosen_name
from reports.runs import RunData, heldout_series

MAX_ROWS = 4  # configs shown side by side in the queue figures


def _order(names: list[str], chosen: str | None) -> list[str]:
    first = [n for n in (*REFERENCES, chosen) if n in names]
    return list(dict.fromkeys([*first, *names]))


def run_rows(inputs: Inputs) -> list[figures.Row]:
    """(label, simulated run, measured run) per config, baseline and handpicked first, then the chosen."""
    chosen = chosen_name(inputs)
    pairs: dict[str, list[RunData | None]] = {}
    val = inputs.validation
    if val is not None:
        for c in val.configs:
            if c.run is not None or c.sim is not None:
                pairs[c.name] = [c.sim, c.run]
    for run in inputs.runs:
        slot = pairs.setdefault(run.name, [None, None])
        idx = 0 if run.source == "sim" else 1
        if slot[idx] is None:
            slot[idx] = run
        else:  # a second run of the same name and source gets its own row
            pairs[f"{run.name} ({run.dir.name})"] = [run, None] if idx == 0 else [None, run]
    # A run without take records (a calibration run read for its timings, a run killed before its
    # first take) has nothing to draw over time: it gets no panel, not an empty one.
    pairs = {n: [r if r is not None and r.takes else None for r in pair] for n, pair in pairs.items()}
    pairs = {n: pair for n, pair in pairs.items() if any(pair)}
    names = _order(list(pairs), chosen)[:MAX_ROWS]
    return [(f"{n} (chosen)" if n == chosen else n, pairs[n][0], pairs[n][1]) for n in names]


def queue_section(inputs: Inputs) -> Section:
    sec = Section("Queue depth and bucket mix over time", "queue")
    rows = run_rows(inputs)
    if not rows:
        sec.blocks.append(Missing("needs take records: a validation directory (runs/ and sim/), or run directories "
                                  "from `dflash train --out` / `dflash simulate --records`"))
        return sec
    sec.blocks.append(Figure("queue_depth", figures.queue_depth(rows),
                             "Queue depth just before each take, stacked by length bucket (black: total); "
                             f"{figures.columns_text(rows)}. Time axes differ: simulated seconds vs wall seconds."))
    sec.blocks.append(Figure("bucket_mix", figures.bucket_mix(rows),
                             "Rolling bucket mix: bucket shares of each consecutive window of W taken items "
                             f"(docs/ARCHITECTURE.md, Metrics: windows); {figures.columns_text(rows)}."))
    sec.blocks.append(Table(_runs_table(rows), "The runs drawn above."))
    return sec


def _runs_table(rows: list[figures.Row]) -> pd.DataFrame:
    out = []
    for label, sim, real in rows:
        for run, kind in ((sim, "simulated"), (real, "measured")):
            if run is None:
                continue
            items = sum(len(r.get("item_ids") or [None]) for r in run.takes)
            span = run.takes[-1]["t"] - run.takes[0]["t"] if len(run.takes) > 1 else None
            out.append({"config": label, "kind": kind, "source": run.source, "takes": str(len(run.takes)),
                        "items taken": str(items), "span (s)": NA if span is None else f"{span:,.1f}",
                        "window W": str(run.window), "directory": str(run.dir)})
    return pd.DataFrame(out)


def loss_section(inputs: Inputs) -> Section:
    sec = Section("Loss curves", "loss")
    chosen = chosen_name(inputs)
    rows: dict[str, dict[str, Any]] = {}
    val = inputs.validation
    if val is not None:
        for c in val.configs:
            meas, pred = c.section("measured"), c.section("predicted")
            lr = pred.get("loss_roughness")
            span = c.raw.get("loss_roughness_steps")
            rows[c.name] = {"run": c.run, "measured": num(meas.get("loss_roughness")), "span_steps": span,
                            "predicted": num(lr.get("mean")) if isinstance(lr, dict) else num(lr),
                            "predicted_se": num(lr.get("se")) if isinstance(lr, dict) else None,
                            "tau": num(meas.get("tau"))}
    for run in inputs.runs:
        if run.source == "real" and run.name not in rows:
            rows[run.name] = {"run": run, "measured": None, "predicted": None, "predicted_se": None, "tau": None}
    for r in rows.values():  # fill from the run's own files what the validation did not state
        run: RunData | None = r["run"]
        if run is not None:
            if r["measured"] is None and run.metrics:
                r["measured"] = num(run.metrics.get("loss_roughness"))
            if r["tau"] is None:
                r["tau"] = num(run.tau)
        span = r.get("span_steps") or ((run.metrics or {}).get("loss_roughness_steps") if run else None)
        r["span"] = f"steps {span[0]}-{span[1]}" if isinstance(span, list) and len(span) == 2 else NA
        if run is not None:
            r["steps"] = str(len(run.steps)) if run.steps else NA
    names = _order(list(rows), chosen)
    curves = [(n, rows[n]["run"]) for n in names
              if rows[n]["run"] is not None and any(num(s.get("loss")) is not None for s in rows[n]["run"].steps)]
    if not rows:
        sec.blocks.append(Missing("needs real runs (a validation directory or `dflash train --out` directories)"))
        return sec
    if curves:
        labels = [(_curve_label(n, chosen, rows[n]), run) for n, run in curves]
        sec.blocks.append(Figure("loss", figures.loss_curves(labels),
                                 "Per-step training loss of the measured runs (thin) and its running mean over "
                                 "10 logged losses (thick)."))
    else:
        sec.blocks.append(Missing("loss curves: no step records with a loss in the given runs (simulated runs have "
                                  "none)"))
    if all(rows[n][k] is None for n in names for k in ("measured", "predicted", "tau")):
        sec.blocks.append(Missing("loss_roughness and tau: neither the validation nor the runs state them"))
        return sec
    table = pd.DataFrame([{
        "config": f"{n} (chosen)" if n == chosen else n, "steps": rows[n].get("steps", NA),
        "loss_roughness measured": fmt_metric("loss_roughness", rows[n]["measured"]),
        "over": rows[n].get("span", NA),
        "loss_roughness predicted": fmt_pm("loss_roughness", rows[n]["predicted"], rows[n]["predicted_se"]),
        "tau measured": fmt_metric("tau", rows[n]["tau"]),
    } for n in names])
    sec.blocks.append(Table(table, "loss_roughness: std of first differences of the per-step loss / mean loss over "
                                   "the stated steps (measured), and the calibrated simulator's prediction; tau: "
                                   "acceptance length of the trained drafter."))
    sec.blocks.extend(heldout_blocks([(f"{n} (chosen)" if n == chosen else n, rows[n]["run"]) for n in names
                                      if rows[n]["run"] is not None]))
    return sec


def heldout_blocks(runs: list[tuple[str, RunData]]) -> list:
    """The held-out quality metric (``[train] quality_every``): tau and loss over steps with their
    intervals, and each run at its last scored step, overall and per length bucket; or one line
    saying it is off and how to turn it on."""
    scored = [(label, run) for label, run in runs if heldout_series(run.steps)]
    if not scored:
        return [Text("Held-out quality: off in these runs (set [train] quality_every = N to score the drafter on a "
                     "held-out set every N steps).")] if runs else []
    rows = []
    for label, run in scored:
        step, h = heldout_series(run.steps)[-1]
        for b in [None, *(h.get("per_bucket") or [])]:
            g = h if b is None else b
            rows.append({"config": label, "after step": str(step + 1),
                         "bucket": "all" if b is None else str(b.get("bucket")),
                         "sequences": str(g.get("sequences", NA)), "blocks": str(g.get("blocks", NA)),
                         "held-out tau": fmt_ci(g, "tau", ".3f"), "acceptance": fmt_ci(g, "acceptance", ".3f"),
                         "held-out loss": fmt_ci(g, "loss", ".4f")})
    return [Figure("heldout", figures.heldout_curves(scored),
                   "Held-out quality over steps (bands: 95% bootstrap intervals over the held-out sequences)."),
            Table(pd.DataFrame(rows), "Held-out quality at each run's last scored step, overall and per length "
                                      "bucket: tau is the serving walk over the window of blocks (what dflash eval "
                                      "measures on greedy data), acceptance the mean over the window's blocks "
                                      "(it overstates serving where errors cluster), loss the weighted block "
                                      "cross-entropy; [95% interval].")]


def _curve_label(name: str, chosen: str | None, row: dict[str, Any]) -> str:
    label = f"{name} (chosen)" if name == chosen else name
    return (f"{label}: loss_roughness {fmt_metric('loss_roughness', row['measured'])} measured, "
            f"{fmt_metric('loss_roughness', row['predicted'])} predicted; tau {fmt_metric('tau', row['tau'])}")


def comparison_section(inputs: Inputs) -> Section:
    sec = Section("Simulated vs measured", "sim-vs-measured")
    val = inputs.validation
    if val is None:
        sec.blocks.append(Missing("needs a validation directory (validation.json from `dflash validate`)"))
        return sec
    rows = []
    for c in val.configs:
        pred, meas, mse, rel, goal = (c.section(k) for k in ("predicted", "measured", "measured_se", "rel_error",
                                                             "within_goal"))
        keys = [m for m in METRICS if m in pred or m in meas]
        keys += [m for m in (*pred, *meas) if m not in keys]
        for m in keys:
            p = pred.get(m)
            p_mean, p_se = (p.get("mean"), p.get("se")) if isinstance(p, dict) else (p, None)
            rows.append({"config": c.name, "metric": m, "simulated": fmt_pm(m, p_mean, p_se),
                         "measured": fmt_pm(m, meas.get(m), mse.get(m)), "rel. error": fmt_rel(rel.get(m)),
                         "|diff|/SE": _z(p_mean, p_se, meas.get(m), mse.get(m)),
                         "within goal": {True: "yes", False: "NO"}.get(goal.get(m), "")})
    if not rows:
        sec.blocks.append(Missing("validation.json has no configs with predicted or measured metrics"))
        return sec
    df = pd.DataFrame(rows)
    if not (df["within goal"] != "").any():
        df = df.drop(columns="within goal")
    goals = f" Goals (dflash validate): {val.data['goals']}." if val.data.get("goals") else ""
    sec.blocks.append(Table(df, goals + " simulated: the calibrated simulator's prediction (± standard error "
                            "over seeds); measured: the real trainer (± the measurement's standard error); rel. "
                            "error as written by `dflash validate`; |diff|/SE: the difference over the combined "
                            "standard error (above about 2 the difference is beyond noise)."))
    sec.blocks.extend(drift_blocks(val))
    return sec


def drift_blocks(val: Any) -> list:
    """Machine drift separated from model error: per config, the a-priori throughput error, how much
    the measured per-item costs moved since the calibration run, and the error left once the run is
    re-predicted with its own costs (the part that is the queue model's)."""
    tput = "throughput_tokens_per_s"
    rows, effects = [], []
    for c in val.configs:
        raw = c.raw
        if "throughput_error_drift_corrected" not in raw:
            continue
        d = raw.get("drift_detail") or {}
        effects.append((abs(num(raw.get("drift")) or 0.0), c.name, d, raw.get("drift")))
        rows.append({"config": c.name, "a-priori error": fmt_rel((raw.get("rel_error") or {}).get(tput)),
                     "target cost drift": fmt_rel(d.get("target")), "drafter cost drift": fmt_rel(d.get("drafter")),
                     "drift's effect": fmt_rel(raw.get("drift")),
                     "drift-corrected error": fmt_rel(raw.get("throughput_error_drift_corrected"))})
    if not rows:
        return []
    _, name, d, eff = max(effects, key=lambda e: e[0])
    words = (f"Machine drift and model error, separated: the largest drift is {name}'s, whose per-item costs "
             f"moved by {fmt_rel(d.get('target'))} (target) and {fmt_rel(d.get('drafter'))} (drafter) since the "
             f"calibration run, {fmt_rel(eff)} on the predicted throughput. What is left after re-predicting each "
             "run with its own measured costs (queue dynamics still simulated) is the simulator's own error; the "
             "fidelity goals apply to it.")
    return [Text(words), Table(pd.DataFrame(rows), "Throughput: a-priori error = calibrated prediction vs measured; "
                               "cost drift = the run's own per-item costs against the calibration's, on the same "
                               "work; drift-corrected error = the prediction under the run's own costs vs measured.")]


def _z(p: Any, p_se: Any, m: Any, m_se: Any) -> str:
    p, p_se, m, m_se = num(p), num(p_se), num(m), num(m_se)
    if None in (p, p_se, m, m_se) or math.hypot(p_se, m_se) == 0:
        return NA
    return f"{abs(p - m) / math.hypot(p_se, m_se):.1f}"


def calibration_section(inputs: Inputs) -> Section:
    sec = Section("Calibration", "calibration")
    if not inputs.calibrations:
        sec.blocks.append(Missing("no calibration file given or referenced: simulations use the configured timing "
                                  "model"))
        return sec
    for cal in inputs.calibrations:
        sec.blocks += calibration_blocks(cal)
    return sec


def calibration_blocks(cal: CalibrationInput) -> list:
    """The calibration file as small tables: a headline of the fit errors, then each table as it is.

    A table of per-role tables with the same fields (``fit.target``/``fit.drafter``) is one wide table;
    differing fields go long (role, key, value) so no column is mostly empty; a list of records
    (``runs``) is a table of its records; scalars are one line each.
    """
    blocks: list = [Text(f"Calibration file: {cal.path}")]
    fit = cal.data.get("fit") if isinstance(cal.data.get("fit"), dict) else {}
    heads = [f"{role} MAPE {fmt_rel(v['mape']).lstrip('+')} (n {v.get('n', NA)})" for role, v in fit.items()
             if isinstance(v, dict) and num(v.get("mape")) is not None]
    if heads:
        blocks.append(Text("Timing fit: " + ", ".join(heads) + "."))
    for key, value in cal.data.items():
        if isinstance(value, dict) and value:
            subs = [v for v in value.values() if isinstance(v, dict)]
            if len(subs) == len(value) and len({tuple(v) for v in subs}) == 1:
                cols = list(subs[0])
                df = pd.DataFrame([{key: role, **{c: _cell(v.get(c)) for c in cols}} for role, v in value.items()],
                                  columns=[key, *cols])
            elif len(subs) == len(value):
                df = pd.DataFrame([{key: role, "key": k, "value": _cell(x)} for role, v in value.items()
                                   for k, x in v.items()], columns=[key, "key", "value"])
            else:
                df = pd.DataFrame([{"key": k, "value": _cell(v)} for k, v in value.items()], columns=["key", "value"])
            blocks.append(Table(df, f"calibration table '{key}'"))
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            cols = list(dict.fromkeys(k for v in value for k in v))
            blocks.append(Table(pd.DataFrame([{c: _cell(v.get(c)) for c in cols} for v in value], columns=cols),
                                f"calibration '{key}'"))
        elif not isinstance(value, dict):
            blocks.append(Text(f"{key}: {_cell(value)}"))
    return blocks


def _cell(v: Any) -> str:
    x = num(v)
    if x is not None and not isinstance(v, bool):
        return f"{x:.6g}"
    if isinstance(v, (list, tuple)):
        head = ", ".join(_cell(i) for i in v[:8])
        return f"[{len(v)} values] {head} ..." if len(v) > 8 else head
    if isinstance(v, dict):
        return ", ".join(f"{k}={_cell(i)}" for k, i in v.items())
    return NA if v is None else str(v)


def validation_blocks(inputs: Inputs) -> list:
    """Per validated config: queue, steps, takes and wall time, with the note on short runs."""
    val = inputs.validation
    if val is None:
        return []
    rows = []
    for c in val.configs:
        takes = len(c.run.takes) if c.run is not None else None
        rows.append({"config": c.name, "queue": queue_text(c.queue), "steps": fmt_metric("steps", c.raw.get("steps")),
                     "takes recorded": NA if takes is None else str(takes),
                     "wall (s)": NA if num(c.raw.get("wall_s")) is None else f"{num(c.raw.get('wall_s')):,.1f}",
                     "run": str(c.run.dir) if c.run else NA, "simulated": str(c.sim.dir) if c.sim else NA})
    blocks: list = []
    takes = val.data.get("takes")
    note = (f"Each validated config ran {takes} takes on the real trainer. " if takes is not None else "") + \
        ("Short runs have wide standard errors: mix_efficiency's comes from windows of W taken items (about "
         "takes/W windows), so read measured numbers with their ± and the |diff|/SE column.")
    blocks.append(Text(note))
    if rows:
        blocks.append(Table(pd.DataFrame(rows), "Validated configurations."))
    return blocks
