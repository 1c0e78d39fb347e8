"""Sections from a sweep output: the Pareto front, heatmaps, the sensitivity table and importances.

The Pareto front is the *feasible* front exactly as ``tuning.select`` computes it (read from the
study's journal, since trials.parquet carries no constraints), so the report's front is the one the
selection was made from. Without the journal the front is computed here over all complete trials
and the report says that feasibility is unknown.
"""

from __future__ import annotations

import math

import pandas as pd

from dflash.core.named_configs import named_config_of
from reports import figures
from reports.document import Figure, Missing, Section, Table
from reports.fmt import NA, fmt_metric, fmt_pm, num
from reports.inputs import Inputs, SweepInput
from reports.recommend import REFERENCES, chosen_name, predicted_view
from tuning.pareto import nondominated
from tuning.select import split_table

TPUT, MIX = "throughput_tokens_per_s", "mix_efficiency"
OBJECTIVE_COLUMNS = ((f"user_attrs_{TPUT}", "throughput (tokens/s)"), (f"user_attrs_{MIX}", "mix_efficiency"))
NEEDED = ("number", f"user_attrs_{TPUT}", f"user_attrs_{MIX}", "user_attrs_queue_min_ready",
          "user_attrs_queue_max_depth", "user_attrs_queue_policy")
NO_SWEEP = "needs a sweep output directory (selection.json and trials.parquet from `dflash sweep`)"


def complete(sweep: SweepInput | None) -> pd.DataFrame | None:
    """Complete trials with the columns the figures need, or None."""
    if sweep is None or sweep.trials is None:
        return None
    df = sweep.trials
    if any(c not in df.columns for c in NEEDED):
        return None
    if "state" in df.columns:
        df = df[df["state"].astype(str).str.upper().str.endswith("COMPLETE")]
    return df.reset_index(drop=True)


def front_numbers(sweep: SweepInput, df: pd.DataFrame) -> list[int]:
    """The study's feasible front; without the study, the non-dominated complete trials."""
    if sweep.front is not None:
        return list(sweep.front)
    pts = [(int(r.number), num(getattr(r, f"user_attrs_{TPUT}")), num(getattr(r, f"user_attrs_{MIX}")))
           for r in df.itertuples(index=False)]
    pts = [(n, x, y) for n, x, y in pts if x is not None and y is not None]
    if len(sweep.selection.get("objectives") or []) == 1 and pts:  # scalar study: the best mix_efficiency
        return [max(pts, key=lambda p: (p[2], -p[0]))[0]]
    return sorted(pts[i][0] for i in nondominated([(x, y) for _, x, y in pts]))


def pareto_section(inputs: Inputs) -> Section:
    sec = Section("Pareto front: throughput vs mix_efficiency", "pareto")
    sweep, df = inputs.sweep, complete(inputs.sweep)
    if sweep is None or df is None or df.empty:
        sec.blocks.append(Missing(NO_SWEEP if sweep is None else "trials.parquet is missing or has no complete "
                                  "trials with the sweep's metric columns"))
        return sec
    front = front_numbers(sweep, df)
    chosen = chosen_name(inputs)
    marked = []
    for name, marker in ((REFERENCES[0], "s"), (REFERENCES[1], "D"), (chosen, "*")):
        view = predicted_view(inputs, name) if name else None
        if view is None:
            continue
        label = f"{name} (chosen)" if name == chosen and marker != "*" else name
        if marker == "*" and name in REFERENCES:
            continue  # already drawn, labelled as chosen
        marked.append(figures.Marked(label if marker != "*" else f"chosen: {name}", _f(view.mean.get(TPUT)),
                                     _f(view.se.get(TPUT)), _f(view.mean.get(MIX)), _f(view.se.get(MIX)), marker))
    n_feasible = sum(sweep.feasible.values()) if sweep.feasible is not None else None
    scalar = len(sweep.selection.get("objectives") or []) == 1
    front_name = "front (a scalar study's: the best trial by mix_efficiency)" if scalar else "Pareto front"
    scope = (f"the feasible {front_name} of {len(df)} complete trials ({n_feasible} feasible)"
             if n_feasible is not None else
             f"the {front_name} of {len(df)} complete trials (feasibility unknown: no study journal beside the "
             "selection, so constraints could not be read)")
    caption = (f"{len(front)} configuration{'s' if len(front) != 1 else ''} on {scope}; error bars: standard "
               "error over seeds; colour: peak queue memory; baseline, handpicked and the chosen configuration at "
               "their predicted values.")
    sec.blocks.append(Figure("pareto", figures.pareto(df, front, sweep.feasible, marked), caption))
    sec.blocks.append(Table(front_table(sweep, df, front), f"Pareto front: {len(front)} configurations "
                            "(simulated, mean ± standard error over seeds), by throughput."))
    return sec


def _f(x: float | None) -> float:
    return math.nan if x is None else float(x)


def front_table(sweep: SweepInput, df: pd.DataFrame, front: list[int]) -> pd.DataFrame:
    selected = {c.get("trial"): c.get("name") for c in sweep.configs if c.get("trial") is not None}
    sub = df[df["number"].isin(front)].sort_values(f"user_attrs_{TPUT}", ascending=False)
    rows = []
    for _, r in sub.iterrows():
        rows.append({
            "trial": str(int(r["number"])),
            "min_ready/max_depth": _knobs_cell(r),
            "policy": str(r["user_attrs_queue_policy"]), "gate": str(r.get("user_attrs_queue_gate", NA)),
            "per take": str(r.get("user_attrs_queue_items_per_take", NA)),
            "tokens/s": fmt_pm(TPUT, r[f"user_attrs_{TPUT}"], r.get(f"user_attrs_{TPUT}_se")),
            "mix_efficiency": fmt_pm(MIX, r[f"user_attrs_{MIX}"], r.get(f"user_attrs_{MIX}_se")),
            "peak queue memory": fmt_metric("peak_queue_bytes", r.get("user_attrs_peak_queue_bytes")),
            "selected as": str(selected.get(int(r["number"]), "")),
        })
    return pd.DataFrame(rows, columns=["trial", "min_ready/max_depth", "policy", "gate", "per take", "tokens/s",
                                       "mix_efficiency", "peak queue memory", "selected as"])


def heatmap_section(inputs: Inputs) -> Section:
    sec = Section("Objectives over (min_ready, max_depth) per policy", "heatmaps")
    df = complete(inputs.sweep)
    if df is None or df.empty:
        sec.blocks.append(Missing(NO_SWEEP))
        return sec
    static = static_only(df)
    if static.empty:
        sec.blocks.append(Missing("every trial ran the queue autopilot, whose knobs move during a run"))
        return sec
    left_out = len(df) - len(static)
    note = (f" {left_out} autopilot trial{'s' if left_out != 1 else ''} left out (its knobs moved during the run; "
            "see the Pareto and sensitivity tables)." if left_out else "")
    sec.blocks.append(Figure("heatmaps", figures.heatmaps(static, OBJECTIVE_COLUMNS),
                             "Mean of each objective over the complete trials in each (effective min_ready, "
                             "max_depth) bin, one row per policy; blank: no trial there." + note))
    return sec


def sensitivity_section(inputs: Inputs) -> Section:
    """Grid studies: the pair x policy table of ``dflash sweep --grid``. Others: each knob's marginal means."""
    sec = Section("Sensitivity", "sensitivity")
    df = complete(inputs.sweep)
    if df is None or df.empty:
        sec.blocks.append(Missing(NO_SWEEP))
        return sec
    if "params_pair" in df.columns:
        table = df.pivot_table(index="params_pair", columns="user_attrs_queue_policy", aggfunc="first",
                               values=[f"user_attrs_{MIX}", f"user_attrs_{MIX}_se", f"user_attrs_{TPUT}"])
        pairs = sorted(table.index, key=_pair_key)
        policies = sorted(df["user_attrs_queue_policy"].unique())
        starts = _auto_starts(df)
        rows = []
        for pair in pairs:
            row = {"min_ready/max_depth": _pair_label(str(pair), starts)}
            for pol in policies:
                m = table.get((f"user_attrs_{MIX}", pol), pd.Series(dtype=float)).get(pair)
                s = table.get((f"user_attrs_{MIX}_se", pol), pd.Series(dtype=float)).get(pair)
                t = table.get((f"user_attrs_{TPUT}", pol), pd.Series(dtype=float)).get(pair)
                row[pol] = f"{fmt_pm(MIX, m, s)} | {fmt_metric(TPUT, t)}" if num(m) is not None else NA
                named = named_config_of(_pair_queue(str(pair), pol)) if str(pair) not in starts else None
                if named and row[pol] != NA:  # a named config is this one cell, not the row
                    row[pol] += f" ({named})"
            rows.append(row)
        auto = (" The auto row is the queue autopilot (docs/ARCHITECTURE.md, Queue autopilot): it starts from the "
                "pair shown and moves min_ready/max_depth during the run.") if starts else ""
        sec.blocks.append(Table(pd.DataFrame(rows), "Grid study: mix_efficiency ± standard error | tokens/s "
                                "(simulated, mean over seeds) for each (min_ready/max_depth, policy); baseline "
                                "and handpicked are the cells so marked (their pair under the default policy)."
                                + auto))
        return sec
    df, _, _ = figures.binned(static_only(df))
    rows = []
    knobs = [("min_ready", "mr_bin"), ("max_depth", "md_bin"), ("policy", "user_attrs_queue_policy"),
             ("gate", "user_attrs_queue_gate"), ("items_per_take", "user_attrs_queue_items_per_take")]
    for k, (knob, col) in enumerate(knobs):
        if col not in df.columns or df[col].nunique() < 2:
            continue
        for level, g in df.groupby(col, sort=False):
            rows.append({"_knob": k, "knob": knob, "level": str(level), "trials": str(len(g)),
                         "mean tokens/s": fmt_metric(TPUT, g[f"user_attrs_{TPUT}"].mean()),
                         "mean mix_efficiency": fmt_metric(MIX, g[f"user_attrs_{MIX}"].mean()),
                         "mean peak queue memory": fmt_metric("peak_queue_bytes",
                                                              g["user_attrs_peak_queue_bytes"].mean())
                         if "user_attrs_peak_queue_bytes" in g else NA})
    if not rows:
        sec.blocks.append(Missing("the study varied no knob"))
        return sec
    table = pd.DataFrame(rows)
    table["_order"] = table.apply(lambda r: _level_key(r["level"]), axis=1)
    table = table.sort_values(["_knob", "_order"], kind="stable").drop(columns=["_knob", "_order"])
    sec.blocks.append(Table(table.reset_index(drop=True),
                            "Each knob's marginal effect: mean over the complete trials at each level (integer "
                            "knobs binned as in the heatmaps; simulated). A knob whose rows barely differ does "
                            "not matter on this workload."))
    return sec


def _pair_key(pair: object) -> tuple[int, ...]:
    """Static ``min/max`` pairs in numeric order; a non-numeric row (``auto``: the autopilot) after them."""
    parts = str(pair).split("/")
    if all(p.isdigit() for p in parts):
        return (0, *(int(p) for p in parts))
    return (1,)


def _auto_starts(df: pd.DataFrame) -> dict[str, str]:
    """Per non-numeric grid row (the autopilot's), the configured pair its trials started from."""
    starts: dict[str, str] = {}
    for r in df.itertuples(index=False):
        pair = str(r.params_pair)
        if _pair_key(pair)[0] == 1 and pair not in starts:
            starts[pair] = f"{r.user_attrs_queue_min_ready}/{r.user_attrs_queue_max_depth}"
    return starts


def _pair_label(pair: str, starts: dict[str, str]) -> str:
    return f"{pair} (autopilot, from {starts[pair]})" if pair in starts else pair


def _pair_queue(pair: str, policy: str) -> dict[str, object] | None:
    parts = pair.split("/")
    if not all(p.isdigit() for p in parts) or len(parts) != 2:
        return None
    return {"min_ready": int(parts[0]), "max_depth": int(parts[1]), "policy": policy}


def static_only(df: pd.DataFrame) -> pd.DataFrame:
    """Trials whose min_ready/max_depth held all run: an autopilot trial's are only where it started, so
    it has no place on a (min_ready, max_depth) axis."""
    if "user_attrs_queue_mode" not in df.columns:
        return df
    return df[df["user_attrs_queue_mode"].astype(str) != "auto"].reset_index(drop=True)


def _knobs_cell(r: pd.Series) -> str:
    pair = f"{r['user_attrs_queue_min_ready']}/{r['user_attrs_queue_max_depth']}"
    return f"auto from {pair}" if str(r.get("user_attrs_queue_mode")) == "auto" else pair


def _level_key(level: str) -> tuple[float, str]:
    head = level.split("-")[0]
    try:
        return float(head), level
    except ValueError:
        return math.inf, level


def importance_section(inputs: Inputs) -> Section:
    sec = Section("Parameter importances", "importances")
    if inputs.sweep is None:
        sec.blocks.append(Missing(NO_SWEEP))
        return sec
    imps = inputs.sweep.selection.get("importances")
    if not isinstance(imps, dict) or not imps:
        sec.blocks.append(Missing("selection.json has no importances (grid studies and studies of fewer than 4 "
                                  "trials or one varied knob have none)"))
        return sec
    objectives = [o for o, v in imps.items() if isinstance(v, dict)]
    knobs = list(dict.fromkeys(k for o in objectives for k in imps[o]))
    first = objectives[0] if objectives else None
    knobs.sort(key=lambda k: -(num(imps[first].get(k)) or 0.0) if first else 0.0)
    rows = [{"knob": k, **{o: fmt_metric("importance", imps[o].get(k)) for o in objectives}} for k in knobs]
    sec.blocks.append(Table(pd.DataFrame(rows, columns=["knob", *objectives]),
                            "PED-ANOVA importance of each knob for each objective (from selection.json; each "
                            "column sums to about 1)."))
    return sec



def split_rows(sweep: SweepInput, df: pd.DataFrame) -> pd.DataFrame | None:
    """Complete trials with their split (``split_targets``, ``split_drafters``) and feasibility, or None when
    the trials carry no split."""
    cols = [c for c in ("n_target", "user_attrssplit_targets") if c in df.columns]
    dcols = [c for c in ("n_drafter", "user_attrssplit_drafters") if c in df.columns]
    if not cols or not dcols:
        return None
    out = df[df[cols[0]].notna() & df[dcols[0]].notna()].copy()
    out["split_targets"] = out[cols[0]].astype(int)
    out["split_drafters"] = out[dcols[0]].astype(int)
    feas = sweep.feasible
    out["split_feasible"] = out["number"].map(lambda n: True if feas is None else bool(feas.get(int(n), False)))
    return out


def _gpus(rows: pd.DataFrame) -> tuple[int | None, int]:
    """(GPU budget, GPUs per target) from the splits themselves: n_target x g + n_drafter is the same
    for every split of one budget."""
    pairs = sorted(set(zip(rows["split_targets"], rows["split_drafters"])))
    if len(pairs) < 2:
        return None, 1
    (t0, d0), (t1, d1) = pairs[0], pairs[-1]
    per = max(1, round((d0 - d1) / (t1 - t0)))
    return int(t0 * per + d0), per


def split_section(inputs: Inputs) -> Section:
    """Predicted throughput and mix against the GPU split, knobs re-optimised per split; best vs even."""
    sec = Section("GPU split: target vs drafter workers", "split")
    sweep, df = inputs.sweep, complete(inputs.sweep)
    rows = split_rows(sweep, df) if sweep is not None and df is not None else None
    if rows is None or rows["split_targets"].nunique() < 2:
        sec.blocks.append(Missing(NO_SWEEP if sweep is None else "the sweep did not vary the split (declare "
                                  "n_target = { low, high } in [sweep.space] with [cluster] gpus = G)"))
        return sec
    gpus, per = _gpus(rows)
    records = [{"number": int(r.number), "n_target": int(r.split_targets), "n_drafter": int(r.split_drafters),
                TPUT: num(getattr(r, f"user_attrs_{TPUT}")), MIX: num(getattr(r, f"user_attrs_{MIX}")),
                "feasible": bool(r.split_feasible)} for r in rows.itertuples(index=False)]
    table = split_table(records, gpus, per)
    device = dict(zip(rows["number"].astype(int), rows.get("user_attrs_peak_device_bytes", pd.Series(
        [None] * len(rows), index=rows.index)), strict=True))
    sec.blocks.append(Figure("split", figures.split(rows, table), _split_caption(table)))
    sec.blocks.append(Table(pd.DataFrame([{
        "split (targets/drafters)": f"{s['n_target']}/{s['n_drafter']}", "feasible trials": str(s["feasible_trials"]),
        "chosen trial": NA if s["trial"] is None else str(s["trial"]),
        "tokens/s": fmt_metric(TPUT, s[TPUT]), "mix_efficiency": fmt_metric(MIX, s[MIX]),
        "fullest device": NA if s["trial"] is None else fmt_metric("peak_queue_bytes", device.get(s["trial"])),
        "": ("best" if table["best"] is s else "") + (" even" if table["even"] is s else "")}
        for s in table["splits"]]), "Each split's choice: the knee of that split's own feasible front "
        "(the selection rule, within the split; simulated, mean over seeds); fullest device: the per-device "
        "memory model at the run's peaks (what [memory] sizes it knows)."))
    return sec


def _split_caption(table: dict) -> str:
    best, even, gain = table["best"], table["even"], table["gain_over_even"]
    budget = f"{table['gpus']} GPUs" if table["gpus"] else "the GPU budget"
    if best is None:
        return f"No split of {budget} has a feasible trial."
    text = (f"Best split of {budget}: {best['n_target']} target worker(s) x {table['gpus_per_target']} GPU(s) and "
            f"{best['n_drafter']} drafters, {fmt_metric(TPUT, best[TPUT])} tokens/s at mix_efficiency "
            f"{fmt_metric(MIX, best[MIX])}")
    if even is None:
        return text + "; the even split was not tried."
    if gain is None:
        return text + f"; the even split ({even['n_target']}/{even['n_drafter']}) has no feasible trial."
    return text + f", {100 * gain:+.1f}% throughput over the even split ({even['n_target']}/{even['n_drafter']})."
