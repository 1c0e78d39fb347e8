"""``dflash sweep``: an Optuna study over the simulator, from arguments to the selection file.

The study's identity (space, objectives, mode, seeds, simulated seconds, calibration, and the
scalar mode's throughput reference) is stored in the study's user attributes when it is created;
a resumed or joined study must match it, so workers on many machines and a sweep restarted after
a kill all score trials the same way. Every trial runs a configuration no other trial of the study
has run (compared as the trial runs it, after clamping); a space with fewer distinct
configurations than ``--trials`` ends when all of them have run. Baseline and handpicked are
evaluated once per study by idle workers and stored with it.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import shutil
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState

from dflash.core.config import DflashConfig, QueueConfig
from dflash.core.errors import ConfigError
from dflash.core.named_configs import named_config_of
from dflash.core.records import clean_json
from tuning.evaluate import ATTR_METRICS, OBJECTIVES, Evaluation, Evaluator, constraint_values
from tuning.select import (
    NAMED,
    SPLIT_KEYS,
    complete_trials,
    feasible_front,
    importances,
    knee_order,
    named_params,
    select_top_k,
    tuned_entries,
    write_selection,
)
from tuning.space import SearchSpace, Split, effective_queue, effective_split, parse_space
from tuning.study import (
    HOST,
    Objective,
    Propose,
    claim_stream,
    counts,
    die_with_parent,
    feasible,
    lock_files,
    make_optuna_sampler,
    open_storage,
    run_worker,
    storage_file,
    storage_url_or_default,
    stream_seed,
    study_lock,
)

COUNT_LIMIT = 200_000  # integer-knob combinations enumerated to count a space's distinct queues


@dataclass(frozen=True)
class SweepArgs:
    trials: int
    storage: str
    study: str
    workers: int
    grid: bool
    out: Path
    calibration: str | None


AUTO_PAIR = "auto"  # the grid's autopilot row (with --queue auto): it starts from the configured pair


def _grid(cfg: DflashConfig) -> dict[str, list[Any]]:
    """The grid: the static pairs, and with ``[queue] mode = "auto"`` (``--queue auto``) an autopilot
    row beside them, each under every grid policy."""
    pairs = [f"{a}/{b}" for a, b in cfg.sweep.grid_pairs] + ([AUTO_PAIR] if cfg.queue.mode == "auto" else [])
    return {"pair": pairs, "policy": list(cfg.sweep.grid_policies)}


def _grid_params(pair: str, policy: str) -> dict[str, Any]:
    if pair == AUTO_PAIR:
        return {"mode": "auto", "policy": policy}
    mr, md = (int(x) for x in pair.split("/"))
    return {"min_ready": mr, "max_depth": md, "policy": policy, "mode": "static"}


def _identity(cfg: DflashConfig, args: SweepArgs) -> dict[str, Any]:
    return {"space": cfg.sweep.space if not args.grid else _grid(cfg), "grid": args.grid,
            "mode": cfg.sweep.mode, "seeds_per_trial": cfg.sweep.seeds_per_trial, "seed": cfg.seed,
            "sim_seconds": cfg.sweep.sim_seconds, "calibration": args.calibration,
            "objectives": list(OBJECTIVES) if cfg.sweep.mode == "pareto" else ["mix_efficiency"],
            "queue_base": dict(cfg.queue.__dict__)}


def _sampler(cfg: DflashConfig, args: SweepArgs, stream: int) -> optuna.samplers.BaseSampler:
    name = "grid" if args.grid else cfg.sweep.sampler
    return make_optuna_sampler(name, stream_seed(cfg.seed, stream), _grid(cfg) if args.grid else None)


def open_study(cfg: DflashConfig, args: SweepArgs) -> optuna.Study:
    """Create or join the study; a stored study made with other settings is refused (one line)."""
    storage = open_storage(args.storage)
    n_obj = 2 if cfg.sweep.mode == "pareto" or args.grid else 1
    with study_lock(args.storage, args.study):  # several workers may open a new study at once
        try:  # load first: create_study(load_if_exists=True) appends a failed create to a journal
            study = optuna.load_study(study_name=args.study, storage=storage, sampler=_sampler(cfg, args, 0))
        except KeyError:
            study = optuna.create_study(storage=storage, study_name=args.study, sampler=_sampler(cfg, args, 0),
                                        directions=["maximize"] * n_obj)
        identity = clean_json(_identity(cfg, args))
        stored = study.user_attrs.get("identity")
        if stored is None:
            study.set_user_attr("identity", identity)
    if stored is not None and stored != identity:
        diff = sorted(k for k in identity if identity.get(k) != stored.get(k))
        raise ConfigError("--study", f"study {args.study!r} in this storage was made with other settings "
                          f"({', '.join(diff)}); use another --study name or the same settings", args.study)
    return study


def join_as_worker(study: optuna.Study, cfg: DflashConfig, args: SweepArgs) -> int:
    """Claim this worker's own sampler stream (see tuning.study) and seed the study's sampler from it."""
    stream = claim_stream(study, args.storage)
    study.sampler = _sampler(cfg, args, stream)
    return stream


def config_key(queue: QueueConfig, split: Split | None = None) -> str:
    """Two trials run the same configuration exactly when their effective queues (and splits) have one key."""
    return json.dumps({**queue.__dict__, **(split.as_json() if split else {})}, sort_keys=True)


def _setting(cfg: DflashConfig, params: dict[str, Any]) -> tuple[QueueConfig, Split | None]:
    """A trial's queue and, when the space varies ``n_target``, its split."""
    return effective_queue(cfg.queue, params), effective_split(cfg.cluster, params) if "n_target" in params else None


def make_propose(cfg: DflashConfig, space: SearchSpace | None, grid: bool) -> Propose:
    """The trial's knobs -> the queue it runs (min_ready clamped, as ``effective_queue`` does) and its key."""
    def propose(trial: optuna.Trial) -> tuple[str, QueueConfig]:
        if grid:
            pair = trial.suggest_categorical("pair", _grid(cfg)["pair"])
            policy = trial.suggest_categorical("policy", _grid(cfg)["policy"])
            params: dict[str, Any] = _grid_params(pair, policy)
        else:
            assert space is not None
            params = space.sample(trial)
        setting = _setting(cfg, params)
        return config_key(*setting), setting

    return propose


def distinct_configurations(cfg: DflashConfig, space: SearchSpace | None, grid: bool) -> int | None:
    """How many distinct queues (after clamping) the space holds; None when too many to count.

    Clamping touches only min_ready, so the integer knobs are enumerated through
    ``effective_queue`` and the choice knobs multiply.
    """
    if grid:
        grid_space = _grid(cfg)
        return len({config_key(effective_queue(cfg.queue, _grid_params(pair, p)))
                    for pair in grid_space["pair"] for p in grid_space["policy"]})
    assert space is not None
    n_int = math.prod(len(r.values()) for r in space.ints.values())
    if n_int > COUNT_LIMIT:
        return None
    names = list(space.ints)
    ints = {config_key(*_setting(cfg, dict(zip(names, combo, strict=True))))
            for combo in itertools.product(*(r.values() for r in space.ints.values()))}
    return len(ints) * math.prod(len(c) for c in space.choices.values())


def make_objective(cfg: DflashConfig, evaluator: Evaluator, grid: bool, reference: float | None) -> Objective:
    def objective(trial: optuna.Trial, setting: tuple[QueueConfig, Split | None]
                  ) -> tuple[list[float], dict[str, float]]:
        queue, split = setting
        ev = evaluator.evaluate(queue, split)
        for key, value in queue.__dict__.items():
            trial.set_user_attr(f"queue_{key}", value)
        for key, value in (ev.split.as_json() if ev.split else {}).items():
            trial.set_user_attr(key, value)
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


def ensure_reference(cfg: DflashConfig, args: SweepArgs, study: optuna.Study, space: SearchSpace | None,
                     evaluator: Evaluator) -> float | None:
    """Scalar mode's fixed reference, measured once per study (by the first worker to get the lock,
    while the others wait for it) and stored with the study."""
    if cfg.sweep.mode != "scalar" or space is None:
        return None
    with study_lock(args.storage, args.study):
        if "reference_throughput" not in study.user_attrs:
            ref_queue = effective_queue(cfg.queue, space.largest_queue(cfg.queue))
            study.set_user_attr("reference_throughput", evaluator.evaluate(ref_queue).mean["throughput_tokens_per_s"])
            study.set_user_attr("reference_queue", dict(ref_queue.__dict__))
        return float(study.user_attrs["reference_throughput"])


# --------------------------------------------------------------------------- named configs
def _named_attr(name: str) -> str:
    return f"named_{name}"


def evaluate_next_named(cfg: DflashConfig, args: SweepArgs, study: optuna.Study, evaluator: Evaluator) -> bool:
    """Evaluate one named config (baseline, handpicked) nobody has claimed; False when none is left.

    Workers call this when the study has nothing left for them to run, so the selection's extra
    evaluations run in parallel with the last trials instead of after them; results are stored in
    the study (its identity fixes seeds and settings), so a restart does not repeat them.
    """
    for name in NAMED:
        with study_lock(args.storage, args.study):
            if _named_attr(name) in study.user_attrs:
                continue
            study.set_user_attr(_named_attr(name), {"claimed_by": f"{HOST}:{os.getpid()}"})
        ev = evaluator.evaluate(effective_queue(cfg.queue, named_params(name)))
        study.set_user_attr(_named_attr(name), clean_json(ev.as_json()))
        return True
    return False


def named_evaluations(cfg: DflashConfig, study: optuna.Study, evaluator: Callable[[], Evaluator]
                      ) -> dict[str, Evaluation]:
    """The stored named evaluations; one a dead worker claimed but never stored is run here."""
    out = {}
    for name in NAMED:
        stored = study.user_attrs.get(_named_attr(name), {})
        if "mean" not in stored:
            ev = evaluator().evaluate(effective_queue(cfg.queue, named_params(name)))
            study.set_user_attr(_named_attr(name), clean_json(ev.as_json()))
            out[name] = ev
            continue
        nan = float("nan")
        out[name] = Evaluation(queue=stored["queue"], seeds=tuple(stored["seeds"]),
                               split=Split(stored["n_target"], stored["n_drafter"]) if "n_target" in stored else None,
                               reached=bool(stored["steady_state_reached"]),
                               mean={k: nan if v is None else v for k, v in stored["mean"].items()},
                               se={k: nan if v is None else v for k, v in stored["se"].items()})
    return out


# --------------------------------------------------------------------------- running
def _work(cfg: DflashConfig, args: SweepArgs, study: optuna.Study, evaluator: Evaluator, target: int,
          on_done: Callable[[], None] | None = None) -> int:
    """One worker's share: its sampler stream, the reference, trials until the study has ``target``
    complete, then any named config nobody has evaluated yet."""
    space = None if args.grid else parse_space(cfg.sweep.space)
    stream = join_as_worker(study, cfg, args)
    reference = ensure_reference(cfg, args, study, space, evaluator)
    done = run_worker(study, args.storage, target, make_propose(cfg, space, args.grid),
                      make_objective(cfg, evaluator, args.grid, reference), on_done=on_done,
                      idle=lambda: evaluate_next_named(cfg, args, study, evaluator),
                      fallback_seed=stream_seed(cfg.seed + 1, stream))
    while evaluate_next_named(cfg, args, study, evaluator):
        pass
    return done


def _worker_main(cfg: DflashConfig, args: SweepArgs, target: int, parent_pid: int,
                 evaluator: Evaluator | None) -> None:
    """One worker process: it ends with its parent, opens its own storage connection, and uses the
    evaluator it inherited when forked (or builds one when spawned)."""
    die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the parent decides
    study = open_study(cfg, args)
    _work(cfg, args, study, evaluator or Evaluator(cfg), target)


def _start_method() -> str:
    """Fork where the platform has it: the workers inherit the imported modules and the loaded
    length table (start-up in milliseconds instead of seconds of imports). No thread runs in the
    parent when it forks (the progress bar starts after), the workers open their own storage and
    never touch the parent's, and they end with ``os._exit``, so nothing inherited is closed twice."""
    return "fork" if "fork" in mp.get_all_start_methods() else "spawn"


def run_sweep(cfg: DflashConfig, args: SweepArgs, progress: bool = True) -> dict[str, Any]:
    """Run the study to ``args.trials`` complete distinct trials (fewer if the space holds fewer), then
    :func:`finish`. A failed start (bad space, a study with other settings) leaves nothing behind that
    it created: the output directory and the storage file are removed if this call made them."""
    space = None if args.grid else parse_space(cfg.sweep.space)  # bad definitions fail before any write
    n_distinct = distinct_configurations(cfg, space, args.grid)
    target = args.trials if n_distinct is None else min(args.trials, n_distinct)
    with _removed_if_start_fails(args):
        study = open_study(cfg, args)
        start_complete = counts(study)[0]
    evaluator = Evaluator(cfg)
    t0 = time.perf_counter()
    bar = _Progress(study, target, start_complete, t0, progress)
    if args.workers == 1:
        _work(cfg, args, study, evaluator, target, on_done=bar.update)
    else:
        _run_processes(cfg, args, target, evaluator, bar)
    bar.close()
    wall = time.perf_counter() - t0
    res = finish(cfg, args, study, lambda: evaluator, wall, counts(study)[0] - start_complete)
    res.update(asked=args.trials, distinct=n_distinct)
    return res


def _run_processes(cfg: DflashConfig, args: SweepArgs, target: int, evaluator: Evaluator, bar: _Progress) -> None:
    method = _start_method()
    ctx = mp.get_context(method)
    inherit = evaluator if method == "fork" else None
    procs = [ctx.Process(target=_worker_main, args=(cfg, args, target, os.getpid(), inherit), daemon=False)
             for _ in range(args.workers)]
    try:
        for p in procs:
            p.start()
        bar.start()
        while alive := [p.sentinel for p in procs if p.is_alive()]:
            mp_connection.wait(alive, timeout=0.5)
            bar.update()
    finally:  # interrupted (Ctrl-C) or failed: the workers go too; their trials are re-run on the next start
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    failed = [p.exitcode for p in procs if p.exitcode != 0]
    if failed:
        raise RuntimeError(f"{len(failed)} sweep worker(s) failed (exit codes {failed})")


@contextlib.contextmanager
def _removed_if_start_fails(args: SweepArgs) -> Iterator[None]:
    """On a ConfigError, remove the output directory and storage files this start created."""
    made = [p for p in (args.out, storage_file(args.storage), *lock_files(args.storage, args.study))
            if p is not None and not p.exists()]
    try:
        yield
    except ConfigError:
        for p in reversed(made):
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            elif p.exists():
                p.unlink()
        raise


class _Progress:
    """Trials done, trials per second and the current front size; reads the storage only when shown."""

    def __init__(self, study: optuna.Study, target: int, start: int, t0: float, enabled: bool) -> None:
        self.study, self.t0, self.start_n, self.enabled, self.target = study, t0, start, enabled, target
        self.bar: Any = None
        self._front_t, self._front = -1e9, 0

    def start(self) -> None:
        """Create the bar (tqdm starts a monitor thread, so never before the workers are forked)."""
        if self.enabled and self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=self.target, initial=self.start_n, desc="trials", unit="trial",
                            dynamic_ncols=True)

    def update(self) -> None:
        """Trials done on every call; the front size (a quadratic pass) at most every 2 s."""
        if not self.enabled:
            return
        self.start()
        now = time.perf_counter()
        trials = complete_trials(self.study)
        if now - self._front_t >= 2.0 or len(trials) >= self.bar.total:
            self._front_t, self._front = now, len(feasible_front(trials))
        rate = (len(trials) - self.start_n) / max(now - self.t0, 1e-9)
        self.bar.n = len(trials)
        self.bar.set_postfix(trials_per_s=f"{rate:.2f}", front=self._front, refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def finish(cfg: DflashConfig, args: SweepArgs, study: optuna.Study, evaluator: Callable[[], Evaluator],
           wall_s: float, new_trials: int) -> dict[str, Any]:
    """Front, importances, grid table, selection file and Parquet export.

    The trial table is written first; with no feasible trial there is nothing to select, so
    :class:`NoFeasibleTrial` is raised and no selection file is written.
    """
    trials = complete_trials(study)
    objective_names = list(OBJECTIVES) if len((trials and trials[0].values) or [0, 0]) == 2 else ["mix_efficiency"]
    ok = [t for t in trials if feasible(t)]
    parquet = _write_trials_table(study, args, objective_names)
    if not ok:
        raise NoFeasibleTrial(trials, parquet)
    front = feasible_front(trials)
    top = select_top_k(study, cfg.sweep.top_k)
    named = named_evaluations(cfg, study, evaluator)
    configs = [{**entry, "predicted": _predicted(t)} for entry, t in zip(tuned_entries(top), top, strict=True)]
    for name, ev in named.items():
        configs.append({"name": name, "trial": None, "params": NAMED[name], "queue": ev.queue,
                        **(ev.split.as_json() if ev.split else {}),
                        "predicted": {k: {"mean": ev.mean[k], "se": ev.se[k]} for k in ATTR_METRICS}})
    imps = importances(study, objective_names) if not args.grid else {}
    selection = {
        "study": args.study, "storage": args.storage, "rule": "knee of the feasible Pareto front "
        "(smallest norm of the relative shortfalls 1 - value/best of both objectives), then the other "
        "front points by that score; baseline and handpicked always included", "objectives": objective_names,
        "seeds": list(named["baseline"].seeds), "sim_seconds": cfg.sweep.sim_seconds, "calibration": args.calibration,
        "configs": configs, "importances": imps,
        "reference_throughput": study.user_attrs.get("reference_throughput"),
    }
    sel_path = write_selection(args.out / "selection.json", clean_json(selection))
    return {"study": study, "front": front, "top": top, "named": named, "importances": imps,
            "selection": sel_path, "parquet": parquet, "wall_s": wall_s, "new_trials": new_trials,
            "complete": len(trials), "feasible": len(ok),
            "failed": sum(t.state == TrialState.FAIL for t in study.get_trials(deepcopy=False)),
            "objective_names": objective_names}


def _write_trials_table(study: optuna.Study, args: SweepArgs, objective_names: list[str]) -> Path:
    """Every trial (duplicates too, as PRUNED with ``duplicate_of``) with its feasibility, as Parquet."""
    df = study.trials_dataframe(attrs=("number", "value" if len(objective_names) == 1 else "values",
                                       "params", "user_attrs", "state", "duration"))
    by_number = {t.number: t for t in study.get_trials(deepcopy=False)}
    df["feasible"] = [by_number[n].state == TrialState.COMPLETE and feasible(by_number[n]) for n in df["number"]]
    for key in SPLIT_KEYS:  # the split of every trial, under its own name
        if f"user_attrs_{key}" in df:
            df[key] = df[f"user_attrs_{key}"]
    args.out.mkdir(parents=True, exist_ok=True)
    parquet = args.out / "trials.parquet"
    tmp = parquet.with_name(f".{parquet.name}.{os.getpid()}.tmp")  # whole or not at all, as atomic_write_text
    df.to_parquet(tmp, index=False)
    os.replace(tmp, parquet)
    return parquet


class NoFeasibleTrial(Exception):
    """The study holds no feasible trial, so there is no configuration to select."""

    def __init__(self, trials: list[optuna.trial.FrozenTrial], parquet: Path) -> None:
        violated: dict[str, int] = {}
        for t in trials:
            for name, value in t.constraints.items():
                if value > 0:
                    violated[name] = violated.get(name, 0) + 1
        why = ", ".join(f"{name} in {n}" for name, n in sorted(violated.items())) or "none recorded"
        super().__init__(f"no feasible configuration among {len(trials)} complete trials (constraints violated: "
                         f"{why}); no selection written (relax [sweep] memory_budget_gib, max_gate_wait_frac or "
                         f"min_throughput_frac, or widen [sweep.space]); trials table: {parquet}")
        self.parquet = parquet


def _predicted(t: optuna.trial.FrozenTrial) -> dict[str, dict[str, Any]]:
    return {k: {"mean": t.user_attrs.get(k), "se": t.user_attrs.get(f"{k}_se")} for k in ATTR_METRICS}


# --------------------------------------------------------------------------- printing
def format_result(res: dict[str, Any], grid: bool, cfg: DflashConfig) -> str:
    lines = [f"study: {res['complete']} complete trials ({res['feasible']} feasible, {res['failed']} failed); "
             f"{res['new_trials']} run now in {res['wall_s']:.1f} s"]
    if res.get("distinct") is not None and res["distinct"] < res["asked"]:
        lines.append(f"the space holds only {res['distinct']} distinct configurations (min_ready clamped to "
                     f"max_depth), so the study stops there instead of at {res['asked']} trials")
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
        auto = a.get("queue_mode") == "auto"  # the pair is where the autopilot started
        rows.append(
            f"  {t.number:>4} {a['queue_min_ready']:>4}{'*' if auto else ' '}{a['queue_max_depth']:>4} "
            f"{a['queue_policy']:<13} "
            f"{a['queue_gate']:<10} {a['queue_items_per_take']:>4} "
            f"{a['throughput_tokens_per_s']:>10,.0f} ± {_se(a.get('throughput_tokens_per_s_se')):>6} "
            f"{a['mix_efficiency']:>7.3f} ± {_se(a.get('mix_efficiency_se'), 3):>5} "
            f"{(a['peak_queue_bytes'] or 0) / 2**30:>8.1f} {a['max_bucket_streak'] or 0:>6.0f}")
    if any(t.user_attrs.get("queue_mode") == "auto" for t in trials):
        rows.append("  * queue mode auto: min/max is where the autopilot started")
    return "\n".join(rows)


def format_grid(study: optuna.Study, cfg: DflashConfig) -> str:
    """The sensitivity table: rows (min_ready, max_depth), columns policies.

    A named config is one cell, not a row: baseline is 10/30 under the default policy only, so the mark
    sits on that cell (``*b``, ``*h``) and a legend says so; the row's other cells are other policies'."""
    cell: dict[tuple[str, str], optuna.trial.FrozenTrial] = {}
    for t in complete_trials(study):
        cell[(t.params["pair"], t.params["policy"])] = t
    pairs = _grid(cfg)["pair"]
    policies = list(cfg.sweep.grid_policies)
    out = ["sensitivity table: mix_efficiency ± se | tokens/s (mean over seeds)",
           f"  {'min/max':<18}" + "".join(f"{p:>29}" for p in policies)]
    marked = []
    for pair in pairs:
        label = "auto (autopilot)" if pair == AUTO_PAIR else pair
        row = f"  {label:<18}"
        for pol in policies:
            t = cell.get((pair, pol))
            name = None if pair == AUTO_PAIR else named_config_of({**_grid_params(pair, pol)})
            mark = f" *{name[0]}" if name else "   "
            if name and t is not None:
                marked.append(f"*{name[0]} {name} ({pair} {pol})")
            if t is None:
                row += f"{'-':>26}{mark}"
            else:
                a = t.user_attrs
                row += f"{a['mix_efficiency']:>9.3f} ± {_se(a.get('mix_efficiency_se'), 3):>5} | " \
                       f"{a['throughput_tokens_per_s']:>7,.0f}{mark}"
        out.append(row)
    if marked:
        out.append(f"  marked cells: {'; '.join(marked)}: the same runs as the lines below")
    return "\n".join(out)


def sweep_args(args: Any, cfg: DflashConfig) -> SweepArgs:
    out = Path(args.out) if args.out else Path("sweep-out")
    grid = bool(args.grid) or cfg.sweep.sampler == "grid"
    cells = len(_grid(cfg)["pair"]) * len(cfg.sweep.grid_policies)
    trials = int(args.trials) if args.trials is not None else (cells if grid else cfg.sweep.trials)
    if grid:
        trials = min(trials, cells)
    return SweepArgs(trials=trials, storage=storage_url_or_default(args.storage, out),
                     study=args.study or "dflash", workers=int(args.workers or 1), grid=grid, out=out,
                     calibration=args.calibration)
