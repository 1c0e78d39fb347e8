"""Run metadata: versions, devices, data set, calibration, sweep and validation settings, inputs.

Versions come from the installed distributions' metadata (``importlib.metadata``) rather than from
importing the packages: a report must not pay for importing torch to print its version.
"""

from __future__ import annotations

import platform
import time
from importlib import metadata
from typing import Any

import pandas as pd

import dflash
from dflash.core.config import DflashConfig
from reports.document import Section, Table, Text
from reports.fmt import NA, ROUNDING_NOTE
from reports.inputs import Inputs
from reports.run_sections import validation_blocks

PACKAGES = ("torch", "optuna", "simpy", "transformers", "matplotlib", "pandas", "numpy")


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def _workload_text(w: dict[str, Any] | None) -> str | None:
    if not isinstance(w, dict):
        return None
    parts = [str(w.get("dataset", NA))]
    if w.get("lengths") not in (None, "dataset"):
        parts.append(f"lengths {w['lengths']}")
    for key in ("sample", "max_len", "order"):
        if w.get(key) is not None:
            parts.append(f"{key} {w[key]}")
    if w.get("bucket_bounds"):
        parts.append("buckets " + "/".join(str(b) for b in w["bucket_bounds"]))
    return ", ".join(parts)


def _devices(inputs: Inputs) -> str:
    val = inputs.validation
    if val is not None and val.data.get("devices"):
        dev = val.data["devices"]
        if isinstance(dev, dict):  # dflash validate writes {"target": [...], "drafter": [...]}
            return "; ".join(f"{role} {','.join(map(str, d)) if isinstance(d, list) else d}" for role, d in dev.items())
        return str(dev)
    runs = [r for r in inputs.runs if r.source == "real" and r.config]
    if val is not None:
        runs = [c.run for c in val.configs if c.run is not None and c.run.config] + runs
    for run in runs:
        t = (run.config or {}).get("target") or {}
        d = (run.config or {}).get("drafter") or {}
        if t.get("devices") or d.get("devices"):
            return f"target {','.join(t.get('devices') or [])}; drafter {','.join(d.get('devices') or [])}"
    return NA


def _dataset(inputs: Inputs, cfg: DflashConfig) -> str:
    val = inputs.validation
    if val is not None and isinstance(val.data.get("base_config"), dict):
        text = _workload_text(val.data["base_config"].get("workload"))
        if text:
            return text
    runs = ([c.run for c in val.configs if c.run is not None] if val is not None else []) + inputs.runs
    for run in runs:
        text = _workload_text((run.config or {}).get("workload"))
        if text:
            return text
    return f"{_workload_text(cfg.to_dict().get('workload'))} (the report's own configuration; no input states it)"


def _calibration_used(inputs: Inputs) -> str:
    refs = []
    if inputs.validation is not None:
        refs.append(("validation", inputs.validation.data.get("calibration")))
    if inputs.sweep is not None:
        refs.append(("sweep", inputs.sweep.selection.get("calibration")))
    if not refs:
        return NA
    return "; ".join(f"{who}: {ref if ref else 'none (configured timing model)'}" for who, ref in refs)


def section(inputs: Inputs, cfg: DflashConfig) -> Section:
    sec = Section("Run metadata", "metadata")
    rows = [("report generated", time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())),
            ("dflash-tune", dflash.__version__), ("python", platform.python_version())]
    rows += [(p, _version(p)) for p in PACKAGES]
    rows += [("devices", _devices(inputs)), ("data set", _dataset(inputs, cfg)),
             ("calibration used", _calibration_used(inputs))]
    if inputs.sweep is not None:
        s = inputs.sweep.selection
        df = inputs.sweep.trials
        n = NA if df is None else str(int((df["state"].astype(str).str.endswith("COMPLETE")).sum())
                                      if "state" in df.columns else len(df))
        feas = NA if inputs.sweep.feasible is None else str(sum(inputs.sweep.feasible.values()))
        rows += [("sweep", f"study {s.get('study', NA)} in {s.get('storage', NA)}"),
                 ("sweep trials", f"{n} complete, {feas} feasible"),
                 ("sweep seeds per trial", str(len(s.get("seeds") or [])) if s.get("seeds") else NA),
                 ("simulated seconds per run", str(s.get("sim_seconds", NA))),
                 ("objectives", ", ".join(s.get("objectives") or []) or NA)]
    val = inputs.validation
    if val is not None:
        rows += [("validation", str(val.dir)), ("takes per validated config", str(val.data.get("takes", NA))),
                 ("validation chose", str(val.data.get("chosen") or NA))]
        if val.data.get("goals"):
            rows.append(("validation goals", str(val.data["goals"])))
        for f in val.data.get("failed") or []:
            rows.append(("validation failed", ", ".join(f"{k}={v}" for k, v in f.items()) if isinstance(f, dict)
                         else str(f)))
    used = {("sweep", inputs.sweep.dir if inputs.sweep else None),
            ("validation", inputs.validation.dir if inputs.validation else None)}
    for kind, path in inputs.found:
        extra = kind in ("sweep", "validation") and (kind, path) not in used
        rows.append((f"input ({kind})", f"{path} (not reported: one {kind} per report, the first given)" if extra
                     else str(path)))
    sec.blocks.append(Table(pd.DataFrame(rows, columns=["item", "value"])))
    sec.blocks += validation_blocks(inputs)
    sec.blocks.append(Text(ROUNDING_NOTE))
    return sec
