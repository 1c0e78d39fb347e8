"""Find and load the report's inputs: sweep outputs, validations, run records and calibration files.

Each INPUT path is recognised by what it holds, not by its name, so that the main job's output
directory (``dflash-demo/``) can be passed whole: a directory that is none of the kinds is searched
up to :data:`MAX_DEPTH` levels down, without entering a recognised directory (a validation
directory's runs belong to the validation). The kinds:

- sweep output: a directory with ``selection.json`` (``trials.parquet`` and ``study.journal``
  optional), or either file itself;
- validation: a directory with ``validation.json`` (or the file); its ``run_dir``/``sim_dir``
  entries are loaded as runs, relative to it; its ``selection`` and ``calibration`` paths are
  followed when they exist;
- run: a directory with record files (``take.jsonl`` ...) from ``dflash train`` or ``dflash
  simulate --records``, or a trainer's ``metrics.json`` + ``config.json``;
- calibration: a JSON or TOML file with a ``timing`` table that is not a whole run config (a run's
  ``config.json`` has ``workload``/``queue`` tables too).

An INPUT that is none of these, or a sweep/validation file that is not readable JSON/Parquet,
raises :class:`~dflash.core.errors.ConfigError` before anything is written. Missing *keys* inside a
readable file never raise: the report shows "not available" for what depends on them.
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from dflash.core.errors import ConfigError
from reports.runs import RunData, is_run_dir, load_run

MAX_DEPTH = 3
SKIP_DIRS = {"checkpoint", "drafter", "figures", "wandb", "__pycache__", "node_modules"}
ALLOWED = ("must be a sweep output (directory with selection.json), a validation directory (validation.json), "
           "a run directory (take.jsonl/step.jsonl records or metrics.json + config.json), a calibration file "
           "(JSON/TOML with a 'timing' table), or a directory holding some of these")


@dataclass
class SweepInput:
    dir: Path
    selection: dict[str, Any]
    trials: pd.DataFrame | None = None
    feasible: dict[int, bool] | None = None  # by trial number, from the study's constraints
    front: list[int] | None = None  # feasible Pareto front (trial numbers) as tuning.select computes it

    @property
    def configs(self) -> list[dict[str, Any]]:
        return [c for c in self.selection.get("configs") or [] if isinstance(c, dict)]

    def config(self, name: str) -> dict[str, Any] | None:
        return next((c for c in self.configs if c.get("name") == name), None)


@dataclass
class ValidatedConfig:
    name: str
    raw: dict[str, Any]
    run: RunData | None = None  # the real trainer run (measured)
    sim: RunData | None = None  # the simulated run of the same config under the calibration

    def section(self, key: str) -> dict[str, Any]:
        value = self.raw.get(key)
        return value if isinstance(value, dict) else {}

    @property
    def queue(self) -> dict[str, Any] | None:
        q = self.raw.get("queue")
        return q if isinstance(q, dict) else None


@dataclass
class ValidationInput:
    dir: Path
    data: dict[str, Any]
    configs: list[ValidatedConfig] = field(default_factory=list)

    def config(self, name: str | None) -> ValidatedConfig | None:
        return next((c for c in self.configs if c.name == name), None)


@dataclass
class CalibrationInput:
    path: Path
    data: dict[str, Any]


@dataclass
class Inputs:
    sweeps: list[SweepInput] = field(default_factory=list)
    validations: list[ValidationInput] = field(default_factory=list)
    runs: list[RunData] = field(default_factory=list)  # standalone runs (not a validation's)
    calibrations: list[CalibrationInput] = field(default_factory=list)
    found: list[tuple[str, Path]] = field(default_factory=list)  # (kind, path) in the order found

    @property
    def sweep(self) -> SweepInput | None:
        return self.sweeps[0] if self.sweeps else None

    @property
    def validation(self) -> ValidationInput | None:
        return self.validations[0] if self.validations else None


# --------------------------------------------------------------------------- recognition
def find_inputs(paths: list[str | Path]) -> Inputs:
    """Recognise and load every INPUT; ConfigError for a path that is none of the kinds."""
    found: list[tuple[str, Path]] = []
    for raw in paths:
        path = Path(raw)
        kinds = _classify(path)
        if not kinds:
            raise ConfigError("INPUT", ALLOWED, str(raw))
        found += kinds
    seen: set[tuple[str, Path]] = set()
    unique = []
    for kind, p in found:
        key = (kind, p.resolve())
        if key not in seen:
            seen.add(key)
            unique.append((kind, p))
    inputs = Inputs(found=unique)
    for kind, p in unique:
        if kind == "sweep":
            inputs.sweeps.append(load_sweep(p))
        elif kind == "validation":
            inputs.validations.append(load_validation(p))
        elif kind == "calibration":
            inputs.calibrations.append(CalibrationInput(p, _read_calibration(p, strict=True) or {}))
    _follow_references(inputs)
    owned = {r.dir.resolve() for v in inputs.validations for c in v.configs for r in (c.run, c.sim) if r}
    inputs.runs = [load_run(p) for kind, p in unique if kind == "run" and p.resolve() not in owned]
    return inputs


def _classify(path: Path, depth: int = 0) -> list[tuple[str, Path]]:
    """The recognised inputs at ``path``: itself if it is one, else what its subdirectories hold."""
    if path.is_file():
        return _classify_file(path, explicit=depth == 0)
    if not path.is_dir():
        return []
    if (path / "validation.json").is_file():
        return [("validation", path)]
    if (path / "selection.json").is_file():
        return [("sweep", path)]
    if is_run_dir(path):
        return [("run", path)]
    if depth >= MAX_DEPTH:
        return []
    out: list[tuple[str, Path]] = []
    try:
        children = sorted(path.iterdir())
    except OSError:
        return []
    for child in children:
        if child.name.startswith(".") or child.name in SKIP_DIRS:
            continue
        if child.is_file() and child.suffix in (".json", ".toml"):
            out += _classify_file(child, explicit=False)
        elif child.is_dir():
            out += _classify(child, depth + 1)
    return out


def _classify_file(path: Path, explicit: bool) -> list[tuple[str, Path]]:
    if path.name in ("selection.json", "trials.parquet") and (path.parent / "selection.json").is_file():
        return [("sweep", path.parent)]
    if path.name == "validation.json":
        return [("validation", path.parent)]
    if path.name.endswith(".jsonl") and is_run_dir(path.parent):
        return [("run", path.parent)]
    if path.suffix in (".json", ".toml") and _read_calibration(path, strict=False) is not None:
        return [("calibration", path)]
    if explicit and path.name in ("metrics.json", "config.json", "eval.json") and is_run_dir(path.parent):
        return [("run", path.parent)]
    return []


def _read_calibration(path: Path, strict: bool) -> dict[str, Any] | None:
    """A calibration table, or None if the file is not one (strict: unreadable is an error)."""
    try:
        text = path.read_text(encoding="utf-8")
        data = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except (OSError, ValueError) as exc:
        if strict:
            raise ConfigError("INPUT", f"calibration file must be readable JSON or TOML ({exc})", str(path)) from None
        return None
    if isinstance(data, dict) and isinstance(data.get("timing"), dict) and not {"workload", "queue"} & set(data):
        return data
    return None


# --------------------------------------------------------------------------- loaders
def _json_object(path: Path) -> dict[str, Any]:
    """A JSON file that must hold an object; anything else is the INPUT error naming the file."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError("INPUT", f"{path.name} must be readable JSON ({exc})", str(path)) from None
    if not isinstance(data, dict):
        raise ConfigError("INPUT", f"{path.name} must hold a JSON object", str(path))
    return data


def load_sweep(path: Path) -> SweepInput:
    """selection.json (required, readable), trials.parquet and the study's constraints (optional)."""
    selection = _json_object(path / "selection.json")
    sweep = SweepInput(path, selection)
    parquet = path / "trials.parquet"
    if parquet.is_file():
        try:
            sweep.trials = pd.read_parquet(parquet)
        except Exception as exc:  # pyarrow raises several unrelated types for a damaged file
            raise ConfigError("INPUT", f"trials.parquet must be a readable Parquet file ({type(exc).__name__})",
                              str(parquet)) from None
    sweep.feasible, sweep.front = _study_feasibility(path, selection)
    if sweep.feasible is None and sweep.trials is not None and "feasible" in sweep.trials.columns:
        sweep.feasible, sweep.front = _parquet_feasibility(sweep.trials)
    return sweep


def _parquet_feasibility(df: pd.DataFrame) -> tuple[dict[int, bool], list[int] | None]:
    """The sweep's own ``feasible`` column (a study in PostgreSQL has no local journal to read)."""
    feasible = {int(n): bool(f) for n, f in zip(df["number"], df["feasible"], strict=True)}
    if not {"values_0", "values_1"} <= set(df.columns):
        return feasible, None
    from tuning.pareto import nondominated

    ok = df[df["feasible"].astype(bool)]
    numbers = [int(n) for n in ok["number"]]
    points = list(zip(ok["values_0"], ok["values_1"], strict=True))
    return feasible, sorted(numbers[i] for i in nondominated(points))


def _study_feasibility(path: Path, selection: dict[str, Any]) -> tuple[dict[int, bool] | None, list[int] | None]:
    """Feasibility and the feasible front from the study itself (trials.parquet has no constraints).

    Read from the sweep's own journal file when it is there; a study elsewhere (PostgreSQL) is not
    contacted by a report, and the report then says feasibility is unknown.
    """
    journal = path / "study.journal"
    name = selection.get("study")
    if not journal.is_file() or not isinstance(name, str):
        return None, None
    try:
        import optuna
        from optuna.storages import JournalStorage
        from optuna.storages.journal import JournalFileBackend

        from tuning.select import complete_trials, feasible_front
        from tuning.study import feasible

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        study = optuna.load_study(study_name=name, storage=JournalStorage(JournalFileBackend(str(journal))))
        trials = complete_trials(study)
        return {t.number: feasible(t) for t in trials}, [t.number for t in feasible_front(trials)]
    except Exception:  # an unreadable or foreign journal only costs the feasibility marks
        return None, None


def load_validation(path: Path) -> ValidationInput:
    data = _json_object(path / "validation.json")
    val = ValidationInput(path, data)
    base = data.get("base_config") if isinstance(data.get("base_config"), dict) else None
    for i, raw in enumerate(data.get("configs") or []):
        if not isinstance(raw, dict):
            continue
        name = str(raw.get("name") or f"config-{i + 1}")
        cfg = ValidatedConfig(name, raw)
        for key, attr in (("run_dir", "run"), ("sim_dir", "sim")):
            rel = raw.get(key)
            if isinstance(rel, str) and rel:
                p = _resolve(rel, path)
                if p is not None and p.is_dir():
                    run = load_run(p, name=name)
                    if run.config is None and base is not None:  # simulator records carry no config.json:
                        run.config = {**base, "queue": cfg.queue or base.get("queue")}  # buckets, window
                    setattr(cfg, attr, run)
        val.configs.append(cfg)
    return val


def _resolve(ref: str, base: Path) -> Path | None:
    """A path from an input file: absolute, relative to the file's directory, or to the working directory."""
    p = Path(ref)
    for cand in ((p,) if p.is_absolute() else (base / p, p)):
        if cand.exists():
            return cand
    return None


def _follow_references(inputs: Inputs) -> None:
    """Load the selection and calibration a validation (or a sweep) names, unless given already."""
    have_sweeps = {s.dir.resolve() for s in inputs.sweeps}
    have_cals = {c.path.resolve() for c in inputs.calibrations}
    for val in inputs.validations:
        ref = val.data.get("selection")
        p = _resolve(ref, val.dir) if isinstance(ref, str) and ref else None
        if p is not None:
            d = p.parent if p.is_file() else p
            if (d / "selection.json").is_file() and d.resolve() not in have_sweeps:
                try:
                    inputs.sweeps.append(load_sweep(d))
                    have_sweeps.add(d.resolve())
                except ConfigError:
                    pass  # a referenced (not given) file that is unreadable is shown as not available
            # the sweep the (first) validation was made from is the one reported
            ours = [sw for sw in inputs.sweeps if sw.dir.resolve() == d.resolve()]
            if ours and val is inputs.validation:
                inputs.sweeps.remove(ours[0])
                inputs.sweeps.insert(0, ours[0])
    refs = [(v.data.get("calibration"), v.dir) for v in inputs.validations]
    refs += [(s.selection.get("calibration"), s.dir) for s in inputs.sweeps]
    for ref, base in refs:
        p = _resolve(ref, base) if isinstance(ref, str) and ref else None
        if p is not None and p.is_file() and p.resolve() not in have_cals:
            data = _read_calibration(p, strict=False)
            if data is not None:
                inputs.calibrations.append(CalibrationInput(p, data))
                have_cals.add(p.resolve())
