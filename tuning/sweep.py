"""``dflash sweep``: an Optuna study over the simulator, from arguments to the selection file.

The study's identity (space, objectives, mode, seeds, simulated seconds, calibration, and the
scalar mode's throughput reference) is stored in the study's user attributes when it is created;
a resumed or joined study must match it, so workers on many machines and a sweep restarted after
a kill all score trials the same way.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState

from dflash.core.config import DflashConfig
from dflash.core.errors import ConfigError
from dflash.core.records import clean_json
from tuning.evaluate import ATTR_METRICS, OBJECTIVES, Evaluator, constraint_values
from tuning.select import (
    NAMED,
    complete_trials,
    feasible_front,
    importances,
    knee_order,
    select_top_k,
    tuned_entries,
    write_selection,
)
from tuning.space import SearchSpace, effective_queue, parse_space
from tuning.study import (
    counts,
    feasible,
    make_optuna_sampler,
    open_storage,
    run_worker,
    storage_url_or_default,
    study_lock,
)


@dataclass(frozen=True)
class SweepArgs:
    trials: int
    storage: str
    study: str
    workers: int
    grid: bool
    out: Path
    calibration: str | None


def _grid(cfg: DflashConfig) -> dict[str, list[Any]]:
    return {"pair": [f"{a}/{b}" for a, b in cfg.sweep.grid_pairs], "policy": list(cfg.sweep.grid_policies)}


def _identity(cfg: DflashConfig, args: SweepArgs) -> dict[str, Any]:
    return {"space": cfg.sweep.space if not args.grid else _grid(cfg), "grid": args.grid,
            "mode": cfg.sweep.mode, "seeds_per_trial": cfg.sweep.seeds_per_trial, "seed": cfg.seed,
            "sim_seconds": cfg.sweep.sim_seconds, "calibration": args.calibration,
            "objectives": list(OBJECTIVES) if cfg.sweep.mode == "pareto" else ["mix_efficiency"],
            "queue_base": dict(cfg.queue.__dict__)}


def open_study(cfg: DflashConfig, args: SweepArgs) -> optuna.Study:
    storage = open_storage(args.storage)
    sampler_name = "grid" if args.grid else cfg.sweep.sampler
    sampler = make_optuna_sampler(sampler_name, cfg.seed, _grid(cfg) if args.grid else None)
    n_obj = 2 if cfg.sweep.mode == "pareto" or args.grid else 1
    with study_lock(args.storage, args.study):  # several workers may open a new study at once
        study = optuna.create_study(storage=storage, study_name=args.study, sampler=sampler,
                                    directions=["maximize"] * n_obj, load_if_exists=True)
        identity = clean_json(_identity(cfg, args))
        stored = study.user_attrs.get("identity")
        if stored is None:
            study.set_user_attr("identity", identity)
    if stored is not None and stored != identity:
        diff = sorted(k for k in identity if identity.get(k) != stored.get(k))
        raise ConfigError("--study", f"study {args.study!r} in this storage was made with other settings "
                          f"({', '.join(diff)}); use another --study name or the same settings", args.study)
    return study


def make_objective(cfg: DflashConfig, evaluator: Evaluator, space: SearchSpace | None, grid: bool,
                   reference: float | None):
    def objective(trial: optuna.Trial) -> tuple[list[float], dict[str, float]]:
        if grid:
            pair = trial.suggest_categorical("pair", _grid(cfg)["pair"])
            policy = trial.suggest_categorical("policy", _grid(cfg)["policy"])
            mr, md = (int(x) for x in pair.split("/"))
            params = {"min_ready": mr, "max_depth": md, "policy": policy}
        else:
            assert space is not None
            params = space.sample(trial)
        queue = effective_queue(cfg.queue, params)
        ev = evaluator.evaluate(queue)
        for key, value in queue.__dict__.items():
            trial.set_user_attr(f"queue_{key}", value)
        for key in ATTR_METRICS:
            trial.set_user_attr(key, _finite(ev.mean[key]))
            trial.set_user_attr(f"{key}_se", _finite(ev.se[key]))
        trial.set_user_attr("steady_state_reached", ev.reached)
        constraints = constraint_values(ev, cfg, reference)
        if cfg.sweep.mode == "scalar" and not grid:
            values = [ev.mean["mix_efficiency"]]
        else:
            values = [ev.mean["throughput_tokens_per_s"], ev.mean["mix_efficiency"]]
        return values, constraints

    return objective


def _finite(x: float) -> float | None:
    return x if isinstance(x, (int, float)) and math.isfinite(x) else None


def _reference_throughput(cfg: DflashConfig, study: optuna.Study, space: SearchSpace | None,
                          evaluator: Evaluator) -> float | None:
    """Scalar mode's fixed reference, measured once before the study and stored with it."""
    if cfg.sweep.mode != "scalar" or space is None:
        return None
    if "reference_throughput" in study.user_attrs:
        return float(study.user_attrs["reference_throughput"])
    ref_queue = effective_queue(cfg.queue, space.largest_queue(cfg.queue))
    ref = evaluator.evaluate(ref_queue).mean["throughput_tokens_per_s"]
    study.set_user_attr("reference_throughput", ref)
    study.set_user_attr("reference_queue", dict(ref_queue.__dict__))
    return ref


def _worker_main(cfg: DflashConfig, args: SweepArgs) -> None:
    """One worker process: its own evaluator (samplers cached per process), the shared storage."""
    space = None if args.grid else parse_space(cfg.sweep.space)
    study = open_study(cfg, args)
    evaluator = Evaluator(cfg)
    reference = (float(study.user_attrs["reference_throughput"])
                 if "reference_throughput" in study.user_attrs else None)
    run_worker(study, args.storage, args.trials, make_objective(cfg, evaluator, space, args.grid, reference))


def run_sweep(cfg: DflashConfig, args: SweepArgs, progress: bool = True) -> dict[str, Any]:
    space = None if args.grid else parse_space(cfg.sweep.space)  # bad definitions fail before any write
    args.out.mkdir(parents=True, exist_ok=True)
    study = open_study(cfg, args)
    evaluator = Evaluator(cfg)
    reference = _reference_throughput(cfg, study, space, evaluator)
    t0 = time.perf_counter()
    start_complete = counts(study)[0]
    if args.workers == 1:
        bar = _Progress(study, args.trials, start_complete, t0, progress)
        run_worker(study, args.storage, args.trials, make_objective(cfg, evaluator, space, args.grid, reference),
                   on_done=bar.update)
        bar.close()
    else:
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_worker_main, args=(cfg, args), daemon=False) for _ in range(args.workers)]
        for p in procs:
            p.start()
        bar = _Progress(study, args.trials, start_complete, t0, progress)
        while any(p.is_alive() for p in procs):
            bar.update()
            time.sleep(0.5)
        bar.update()
        bar.close()
        failed = [p.exitcode for p in procs if p.exitcode != 0]
        if failed:
            raise RuntimeError(f"{len(failed)} sweep worker(s) failed (exit codes {failed})")
    wall = time.perf_counter() - t0
    return finish(cfg, args, study, evaluator, wall, counts(study)[0] - start_complete)


class _Progress:
    """Trials done, trials per second and the current front size."""

    def __init__(self, study: optuna.Study, target: int, start: int, t0: float, enabled: bool) -> None:
        from tqdm import tqdm

        self.study, self.t0, self.start = study, t0, start
        self.bar = tqdm(total=target, initial=start, desc="trials", unit="trial", disable=not enabled,
                        dynamic_ncols=True)
        self._front_t, self._front = -1e9, 0

    def update(self) -> None:
        """Trials done on every call; the front size (a quadratic pass) at most every 2 s."""
        now = time.perf_counter()
        trials = complete_trials(self.study)
        if now - self._front_t >= 2.0 or len(trials) >= self.bar.total:
            self._front_t, self._front = now, len(feasible_front(trials))
        rate = (len(trials) - self.start) / max(now - self.t0, 1e-9)
        self.bar.n = len(trials)
        self.bar.set_postfix(trials_per_s=f"{rate:.2f}", front=self._front, refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        self.bar.close()


def finish(cfg: DflashConfig, args: SweepArgs, study: optuna.Study, evaluator: Evaluator, wall_s: float,
           new_trials: int) -> dict[str, Any]:
    """Front, importances, grid table, selection file and Parquet export."""
    trials = complete_trials(study)
    objective_names = list(OBJECTIVES) if len((trials and trials[0].values) or [0, 0]) == 2 else ["mix_efficiency"]
    ok = [t for t in trials if feasible(t)]
    front = feasible_front(trials)
    top = select_top_k(study, cfg.sweep.top_k)
    named = {name: evaluator.evaluate(effective_queue(cfg.queue, params)) for name, params in NAMED.items()}
    configs = [{**entry, "predicted": _predicted(t)} for entry, t in zip(tuned_entries(top), top, strict=True)]
    for name, ev in named.items():
        configs.append({"name": name, "trial": None, "params": NAMED[name], "queue": ev.queue,
                        "predicted": {k: {"mean": ev.mean[k], "se": ev.se[k]} for k in ATTR_METRICS}})
    imps = importances(study, objective_names) if not args.grid else {}
    selection = {
        "study": args.study, "storage": args.storage, "rule": "knee of the feasible Pareto front "
        "(smallest norm of the relative shortfalls 1 - value/best of both objectives), then the other "
        "front points by that score; baseline and handpicked always included", "objectives": objective_names,
        "seeds": list(evaluator.seeds), "sim_seconds": evaluator.sim_seconds, "calibration": args.calibration,
        "configs": configs, "importances": imps,
        "reference_throughput": study.user_attrs.get("reference_throughput"),
    }
    sel_path = write_selection(args.out / "selection.json", clean_json(selection))
    df = study.trials_dataframe(attrs=("number", "value" if len(objective_names) == 1 else "values",
                                       "params", "user_attrs", "state", "duration"))
    by_number = {t.number: t for t in study.get_trials(deepcopy=False)}
    df["feasible"] = [by_number[n].state == TrialState.COMPLETE and feasible(by_number[n]) for n in df["number"]]
    parquet = args.out / "trials.parquet"
    df.to_parquet(parquet, index=False)
    return {"study": study, "front": front, "top": top, "named": named, "importances": imps,
            "selection": sel_path, "parquet": parquet, "wall_s": wall_s, "new_trials": new_trials,
            "complete": len(trials), "feasible": len(ok),
            "failed": sum(t.state == TrialState.FAIL for t in study.get_trials(deepcopy=False)),
            "objective_names": objective_names}


def _predicted(t: optuna.trial.FrozenTrial) -> dict[str, dict[str, Any]]:
    return {k: {"mean": t.user_attrs.get(k), "se": t.user_attrs.get(f"{k}_se")} for k in ATTR_METRICS}


# --------------------------------------------------------------------------- printing
def format_result(res: dict[str, Any], grid: bool, cfg: DflashConfig) -> str:
    lines = [f"study: {res['complete']} complete trials ({res['feasible']} feasible, {res['failed']} failed); "
             f"{res['new_trials']} run now in {res['wall_s']:.1f} s"]
    if grid:
        lines.append(format_grid(res["study"], cfg))
    else:
        lines.append(f"Pareto front ({len(res['front'])} configs; mean ± standard error over seeds):")
        lines.append(_table([t for t, _ in knee_order(res["front"])] if len(res["objective_names"]) > 1
                            else res["front"]))
    lines.append("baseline and handpicked on the same seeds:")
    for name, ev in res["named"].items():
        lines.append(f"  {name:<11} {ev.queue['min_ready']}/{ev.queue['max_depth']} {ev.queue['policy']:<13} "
                     f"tokens/s {ev.mean['throughput_tokens_per_s']:>10,.0f} ± {_se(ev.se['throughput_tokens_per_s'])}"
                     f"   mix_efficiency {ev.mean['mix_efficiency']:.3f} ± {_se(ev.se['mix_efficiency'], 3)}")
    if res["importances"]:
        lines.append("importances (PED-ANOVA):")
        for obj, imp in res["importances"].items():
            lines.append(f"  {obj}: " + ", ".join(f"{k} {v:.2f}" for k, v in imp.items()))
    names = ", ".join(f"tuned-{i}" for i in range(1, len(res["top"]) + 1))
    lines.append(f"selection ({names}, baseline, handpicked): {res['selection']}")
    lines.append(f"trials table: {res['parquet']}")
    return "\n".join(lines)


def _se(x: float | None, digits: int = 0) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{x:,.{digits}f}"


def _table(trials: list[optuna.trial.FrozenTrial]) -> str:
    head = (f"  {'#':>4} {'min':>4} {'max':>4} {'policy':<13} {'gate':<10} {'take':>4} {'tokens/s':>19} "
            f"{'mix_efficiency':>15} {'peak GiB':>8} {'streak':>6}")
    rows = [head]
    for t in trials:
        a = t.user_attrs
        rows.append(
            f"  {t.number:>4} {a['queue_min_ready']:>4} {a['queue_max_depth']:>4} {a['queue_policy']:<13} "
            f"{a['queue_gate']:<10} {a['queue_items_per_take']:>4} "
            f"{a['throughput_tokens_per_s']:>10,.0f} ± {_se(a.get('throughput_tokens_per_s_se')):>6} "
            f"{a['mix_efficiency']:>7.3f} ± {_se(a.get('mix_efficiency_se'), 3):>5} "
            f"{(a['peak_queue_bytes'] or 0) / 2**30:>8.1f} {a['max_bucket_streak'] or 0:>6.0f}")
    return "\n".join(rows)


def format_grid(study: optuna.Study, cfg: DflashConfig) -> str:
    """The sensitivity table: rows (min_ready, max_depth), columns policies; baseline/handpicked marked."""
    cell: dict[tuple[str, str], optuna.trial.FrozenTrial] = {}
    for t in complete_trials(study):
        cell[(t.params["pair"], t.params["policy"])] = t
    pairs = [f"{a}/{b}" for a, b in cfg.sweep.grid_pairs]
    policies = list(cfg.sweep.grid_policies)
    marks = {"10/30": " (baseline)", "30/90": " (handpicked)"}
    out = ["sensitivity table: mix_efficiency ± se | tokens/s (mean over seeds)",
           f"  {'min/max':<18}" + "".join(f"{p:>26}" for p in policies)]
    for pair in pairs:
        row = f"  {pair + marks.get(pair, ''):<18}"
        for pol in policies:
            t = cell.get((pair, pol))
            if t is None:
                row += f"{'-':>26}"
            else:
                a = t.user_attrs
                row += f"{a['mix_efficiency']:>9.3f} ± {_se(a.get('mix_efficiency_se'), 3):>5} | " \
                       f"{a['throughput_tokens_per_s']:>7,.0f}"
        out.append(row)
    return "\n".join(out)


def sweep_args(args: Any, cfg: DflashConfig) -> SweepArgs:
    out = Path(args.out) if args.out else Path("sweep-out")
    grid = bool(args.grid) or cfg.sweep.sampler == "grid"
    trials = int(args.trials) if args.trials is not None else (
        len(cfg.sweep.grid_pairs) * len(cfg.sweep.grid_policies) if grid else cfg.sweep.trials)
    if grid:
        trials = min(trials, len(cfg.sweep.grid_pairs) * len(cfg.sweep.grid_policies))
    return SweepArgs(trials=trials, storage=storage_url_or_default(args.storage, out),
                     study=args.study or "dflash", workers=int(args.workers or 1), grid=grid, out=out,
                     calibration=args.calibration)
