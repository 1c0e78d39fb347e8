"""``dflash validate``: the selection on the real trainer, next to the calibrated simulator's word.

For every configuration of a selection (the sweep's top-k plus ``baseline`` and ``handpicked``)
a worker claims it (:mod:`tuning.claims`), trains it for the same budget of takes, measures
DESIGN.md's metrics with their own standard errors and tau at the end, and simulates the same
configuration for the same number of steps under the calibration (several seeds: the prediction's
spread). When every configuration is done, the worker that sees it writes ``validation.json``
(prediction, measurement, relative error per metric), picks the validated best by the sweep's own
knee rule on *measured* throughput and ``mix_efficiency``, and writes ``best.toml`` for the full run.

A measurement's standard error comes from its spread over consecutive blocks of the run
(throughput: five time blocks of the steady span; ``mix_efficiency``: the metric's own window
spread; ``loss_roughness``: four step blocks of the run's second half): short runs are noisy, and
a prediction error smaller than the measurement's own noise is not an error we can see.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import shutil
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dflash.core.atomic import atomic_write_text
from dflash.core.config import DflashConfig, config_to_toml, with_overrides
from dflash.core.errors import ConfigError
from dflash.core.records import clean_json, read_records
from dflash.core.runmetrics import loss_roughness
from tuning.claims import ClaimStore, worker_id

COMPARED = ("throughput_tokens_per_s", "samples_per_s", "mix_efficiency", "mix_entropy", "mix_kl",
            "length_autocorr", "max_bucket_streak", "drafter_utilization", "target_utilization",
            "drafter_gate_wait_frac", "producer_blocked_frac", "mean_queue_depth", "peak_queue_bytes",
            "loss_roughness")
GOALS = "throughput within 5%; mix_efficiency within max(0.03, 2 SE of the measurement); loss_roughness within 20%"
PREDICTION_SEEDS = 3


@dataclass(frozen=True)
class ValidateArgs:
    selection: dict[str, Any]
    selection_path: str
    takes: int
    out: Path
    calibration: str | None
    claims_url: str
    prompts: int


def read_selection(path: str | Path) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError("--selection", f"must be a readable selection.json ({type(exc).__name__})",
                          str(path)) from None
    configs = data.get("configs") if isinstance(data, dict) else None
    if not isinstance(configs, list) or not configs or not all(
            isinstance(c, dict) and isinstance(c.get("name"), str) and isinstance(c.get("queue"), dict)
            for c in configs):
        raise ConfigError("--selection", "must hold a non-empty 'configs' list of {name, queue} (dflash sweep "
                                         "writes one)", str(path))
    return data


def selection_from_study(study_name: str, storage: str, cfg: DflashConfig) -> dict[str, Any]:
    """Top-k of a stored study plus the named configs, like the sweep's own selection.json."""
    import optuna

    from tuning.select import NAMED, select_top_k, tuned_entries
    from tuning.space import effective_queue

    try:
        study = optuna.load_study(study_name=study_name, storage=_optuna_storage(storage))
    except KeyError:
        raise ConfigError("--study", f"no study of that name in {storage}", study_name) from None
    configs = tuned_entries(select_top_k(study, cfg.sweep.top_k))
    for name, params in NAMED.items():
        configs.append({"name": name, "trial": None, "params": params,
                        "queue": dict(effective_queue(cfg.queue, params).__dict__)})
    return {"study": study_name, "storage": storage, "configs": configs}


def _optuna_storage(url: str) -> Any:
    from tuning.study import open_storage

    return open_storage(url)


def claims_url_for(storage: str | None, out: Path) -> str:
    """An SQL URL from ``--storage`` when it is one; else a SQLite file in the output directory."""
    if storage and storage.split("://", 1)[0].split("+")[0] in ("sqlite", "postgresql", "mysql"):
        return storage
    return f"sqlite:///{(out / 'validation.db').resolve()}"


def job_namespace(args: ValidateArgs, base: DflashConfig) -> str:
    ident = {"configs": [(c["name"], c["queue"]) for c in args.selection["configs"]], "takes": args.takes,
             "base": base.to_dict(), "calibration": args.calibration}
    return hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:32]


# --------------------------------------------------------------------------- one configuration
def queue_overrides(queue: dict[str, Any]) -> dict[str, Any]:
    return {f"queue.{k}": v for k, v in queue.items() if v is not None}


def run_config(entry: dict[str, Any], base: DflashConfig, calibrated: DflashConfig, args: ValidateArgs,
               progress: Callable[[str], None]) -> dict[str, Any]:
    """Train one configuration for the budget, measure it, and predict it; the result row."""
    name = entry["name"]
    steps = max(1, math.ceil(args.takes / base.cluster.n_drafter))
    run_cfg = with_overrides(base, {**queue_overrides(entry["queue"]), "train.max_steps": steps,
                                    "train.max_minutes": None, "train.eval_every": None})
    run_dir = args.out / "runs" / name
    if run_dir.exists():  # a dead worker's partial run: its timing would be mixed, start over
        shutil.rmtree(run_dir)
    summary, metrics, tau = train_and_measure(run_cfg, run_dir, args.prompts, progress)
    measured = {k: metrics.get(k) for k in COMPARED}
    measured["tau"] = tau.get("tau")
    (run_dir / "eval.json").write_text(json.dumps(clean_json(tau), indent=1))
    predicted = predict(entry, calibrated, steps, args.out / "sim" / name)
    se = measurement_se(run_dir, metrics)
    return clean_json({
        "name": name, "trial": entry.get("trial"), "params": entry.get("params"), "queue": entry["queue"],
        "run_dir": f"runs/{name}", "sim_dir": f"sim/{name}", "steps": summary.get("steps"),
        "wall_s": summary.get("wall_s"), "ranks": {"n_target": run_cfg.cluster.n_target,
                                                   "n_drafter": run_cfg.cluster.n_drafter},
        "measured": measured, "measured_se": se, "predicted": predicted,
        "rel_error": rel_errors(measured, predicted), "within_goal": within_goals(measured, se, predicted),
        "loss_roughness_steps": metrics.get("loss_roughness_steps"), "tau_prompts": tau.get("num_prompts"),
    })


def train_and_measure(cfg: DflashConfig, run_dir: Path, prompts: int,
                      progress: Callable[[str], None]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Train one configuration (summary, metrics) and measure its drafter's tau.

    One target + one drafter runs in this process (the library trainer: no process start-up per
    configuration); any other shape runs as the distributed job, one process per rank, like
    ``dflash train``.
    """
    if cfg.cluster.n_target == 1 and cfg.cluster.n_drafter == 1:
        from dflash.pipeline.trainer import Trainer

        trainer = Trainer(cfg, run_dir, wandb_mode="disabled", progress=progress)
        res = trainer.run()
        tau = _tau(trainer.target, trainer.drafter, set(trainer.trained_conversations), cfg, prompts)
        return res.summary, res.metrics, tau
    return _train_distributed(cfg, run_dir, prompts, progress)


def _train_distributed(cfg: DflashConfig, run_dir: Path, prompts: int,
                       progress: Callable[[str], None]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    from dflash.model.drafter import DFlashDrafter
    from dflash.model.target import load_target
    from dflash.pipeline.launch import launch
    from dflash.pipeline.rank import RunSpec
    from dflash.pipeline.trainer import TrainingData

    run_dir.mkdir(parents=True, exist_ok=True)
    progress(f"distributed run: {cfg.cluster.n_target} target + {cfg.cluster.n_drafter} drafter ranks")
    if launch(RunSpec(cfg, str(run_dir), wandb="disabled", quiet=True)) != 0:
        raise RuntimeError(f"the distributed run in {run_dir} failed")
    summary = next(read_records(run_dir, "summary"))
    metrics = json.loads((run_dir / "metrics.json").read_text())
    target = load_target(cfg.target.model)
    drafter = DFlashDrafter.load(run_dir / "drafter", target.model)
    data = TrainingData(cfg, target.tokenizer)
    taken = [i for r in read_records(run_dir, "take") for i in r["item_ids"]]
    trained = {data.conversations[k].id for k in data.sampler.sequences_of(taken)}
    return summary, metrics, _tau(target, drafter, trained, cfg, prompts)


def _tau(target: Any, drafter: Any, trained: set[str], cfg: DflashConfig, n: int) -> dict[str, Any]:
    """Acceptance length of the trained drafter on held-out prompts (the run's conversations excluded)."""
    from dflash.model.acceptance import evaluate_acceptance, heldout_prompts

    prompts = heldout_prompts(target.tokenizer, n, seed=cfg.seed + 1, sample=cfg.workload.sample,
                              skip_ids=trained, dataset=cfg.workload.dataset)
    return evaluate_acceptance(target, drafter, prompts, max_new_tokens=cfg.train.eval_new_tokens)


def predict(entry: dict[str, Any], calibrated: DflashConfig, steps: int, records_dir: Path) -> dict[str, Any]:
    """The calibrated simulator's mean and standard error over seeds, for the same step budget."""
    from simulator.run import simulate
    from simulator.workload import make_sampler

    cfg = with_overrides(calibrated, queue_overrides(entry["queue"]))
    runs = []
    for r in range(PREDICTION_SEEDS):
        c = with_overrides(cfg, {"seed": cfg.seed + r})
        res = simulate(c, make_sampler(c.workload, c.target.model, c.seed), sim_seconds=1e9, max_steps=steps,
                       records_dir=records_dir if r == 0 else None)
        runs.append(res.metrics)
    out = {}
    for k in COMPARED:
        xs = [float(m[k]) for m in runs if m.get(k) is not None and math.isfinite(float(m[k]))]
        out[k] = {"mean": float(np.mean(xs)) if xs else None,
                  "se": float(np.std(xs, ddof=1) / math.sqrt(len(xs))) if len(xs) > 1 else None}
    return out


def measurement_se(run_dir: Path, metrics: dict[str, Any], blocks: int = 5) -> dict[str, float | None]:
    """Standard errors of the measured metrics from their spread over consecutive blocks of the run."""
    takes = sorted(read_records(run_dir, "take"), key=lambda r: r["t"])
    lo, hi = metrics.get("steady_state_start_s"), metrics.get("steady_state_end_s")
    se: dict[str, float | None] = {k: None for k in COMPARED}
    if lo is not None and hi is not None and hi > lo:
        edges = np.linspace(lo, hi, blocks + 1)
        tok, smp = np.zeros(blocks), np.zeros(blocks)
        for r in takes:
            k = int(np.searchsorted(edges, r["t"], side="right")) - 1
            if 0 <= k < blocks:
                tok[k] += r.get("tokens") or 0
                smp[k] += r.get("n_seqs") or len(r["item_ids"])
        width = (hi - lo) / blocks
        se["throughput_tokens_per_s"] = float(np.std(tok / width, ddof=1) / math.sqrt(blocks))
        se["samples_per_s"] = float(np.std(smp / width, ddof=1) / math.sqrt(blocks))
    se["mix_efficiency"] = metrics.get("mix_efficiency_se")
    losses = [r.get("loss") for r in sorted(read_records(run_dir, "step"), key=lambda r: r["step"])]
    half = losses[len(losses) // 2:]
    parts = [p for p in np.array_split(np.arange(len(half)), 4) if len(p) >= 4]
    vals = [v for p in parts if (v := loss_roughness([half[i] for i in p])["loss_roughness"]) is not None]
    if len(vals) > 1:
        se["loss_roughness"] = float(np.std(vals, ddof=1) / math.sqrt(len(vals)))
    return se


def rel_errors(measured: dict[str, Any], predicted: dict[str, Any]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for k in COMPARED:
        m, p = measured.get(k), (predicted.get(k) or {}).get("mean")
        out[k] = (p - m) / abs(m) if m not in (None, 0) and p is not None else None
    return out


def within_goals(measured: dict[str, Any], se: dict[str, Any], predicted: dict[str, Any]) -> dict[str, bool | None]:
    def err(k: str) -> float | None:
        m, p = measured.get(k), (predicted.get(k) or {}).get("mean")
        return None if m is None or p is None else p - m

    out: dict[str, bool | None] = {}
    e = err("throughput_tokens_per_s")
    out["throughput_tokens_per_s"] = None if e is None else abs(e) <= 0.05 * abs(measured["throughput_tokens_per_s"])
    e = err("mix_efficiency")
    out["mix_efficiency"] = None if e is None else abs(e) <= max(0.03, 2 * (se.get("mix_efficiency") or 0.0))
    e = err("loss_roughness")
    out["loss_roughness"] = None if e is None else abs(e) <= 0.20 * abs(measured["loss_roughness"])
    return out


# --------------------------------------------------------------------------- the job
def run_validation(base: DflashConfig, args: ValidateArgs, progress: Callable[[str], None] = print
                   ) -> dict[str, Any] | None:
    """Claim and run configurations until none is left; the summary when this worker can write it."""
    from dflash.core.memory_model import check_fits
    from simulator.calibration import apply_calibration

    base.cluster.check_trainable()  # before anything is written: a sharded target is simulator-only
    check_fits(base)
    calibrated = apply_calibration(base, args.calibration)
    args.out.mkdir(parents=True, exist_ok=True)
    store = ClaimStore(args.claims_url, job_namespace(args, base))
    entries = {c["name"]: c for c in args.selection["configs"]}
    store.register(list(entries))
    me = worker_id()
    try:
        while (name := store.claim(me)) is not None:
            progress(f"== validating {name}: {entries[name]['queue']} for {args.takes} takes ==")
            stop = threading.Event()
            beat = threading.Thread(target=_beat, args=(store, name, me, stop), daemon=True)
            beat.start()
            try:
                row = run_config(entries[name], base, calibrated, args, progress)
                status = "done"
            except Exception as exc:
                row, status = {"name": name, "error": f"{type(exc).__name__}: {exc}"}, "failed"
                progress(f"{name} failed: {row['error']}")
            finally:
                stop.set()
                beat.join()
            if not store.finish(name, me, row, status):
                progress(f"{name}: claim lost to another worker (this one was taken for dead); result dropped")
        rows = store.rows()
    finally:
        store.close()
    left = [r["name"] for r in rows if r["status"] not in ("done", "failed")]
    if left:
        progress(f"still running on other workers: {', '.join(left)}; the last worker to finish writes the "
                 "comparison")
        return None
    return write_summary(base, args, [r["result"] for r in rows if r["status"] == "done"],
                         [r["result"] for r in rows if r["status"] == "failed"])


def _beat(store: ClaimStore, name: str, me: str, stop: threading.Event) -> None:
    while not stop.wait(30.0):
        with contextlib.suppress(Exception):  # a missed beat is retried; the run goes on
            store.heartbeat(name, me)


def choose_best(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The sweep's knee rule on measured values: smallest norm of relative shortfalls from the best.

    ``mix_efficiency`` needs at least one full window of takes; runs too short for it are judged on
    throughput alone.
    """
    keys = [k for k in ("throughput_tokens_per_s", "mix_efficiency")
            if all((r["measured"].get(k) or 0) > 0 for r in rows)]
    if not rows or "throughput_tokens_per_s" not in keys:
        return None
    best = {k: max(r["measured"][k] for r in rows) for k in keys}

    def score(r: dict[str, Any]) -> float:
        return math.sqrt(sum((1 - r["measured"][k] / best[k]) ** 2 for k in best))

    return min(rows, key=lambda r: (score(r), r["name"]))


def write_summary(base: DflashConfig, args: ValidateArgs, rows: list[dict[str, Any]],
                  failed: list[dict[str, Any]]) -> dict[str, Any]:
    best = choose_best(rows)
    best_toml = args.out / "best.toml"
    command = None
    if best is not None:
        cfg = with_overrides(base, queue_overrides(best["queue"]))
        atomic_write_text(best_toml, f"# Validated best of {args.selection_path} ({best['name']}), by dflash validate: "
                       f"{args.takes} takes per config.\n# Launch: dflash train --config {best_toml}\n"
                       + config_to_toml(cfg))
        command = f"dflash train --config {best_toml}"
    payload = clean_json({
        "takes": args.takes, "calibration": args.calibration, "selection": args.selection_path,
        "base_config": base.to_dict(), "chosen": best["name"] if best else None,
        "best_toml": "best.toml" if best else None, "command": command,
        "devices": {"target": list(base.target.devices), "drafter": list(base.drafter.devices)},
        "goals": GOALS, "configs": rows, "failed": failed, "claims": args.claims_url,
    })
    atomic_write_text(args.out / "validation.json", json.dumps(payload, indent=1))
    return payload


def format_validation(payload: dict[str, Any]) -> str:
    def pct(x: float | None) -> str:
        return "n/a" if x is None else f"{100 * x:+.1f}%"

    def num(x: Any, spec: str) -> str:
        return "n/a" if x is None else format(x, spec)

    w = max([12, *(len(r["name"]) + 2 for r in payload["configs"])])
    lines = [f"validated {len(payload['configs'])} configs, {payload['takes']} takes each "
             f"(goals: {payload['goals']})",
             f"{'config':<{w}}{'knobs':<26}{'tok/s meas':>16}{'pred':>8}{'err':>8}{'mix_eff meas':>18}{'pred':>7}"
             f"{'err':>8}{'rough meas':>12}{'pred':>7}{'err':>8}{'tau':>7}"]
    for r in payload["configs"]:
        m, se, p, e = r["measured"], r["measured_se"], r["predicted"], r["rel_error"]
        q = r["queue"]
        knobs = f"{q['min_ready']}/{q['max_depth']} {q['policy']}"
        lines.append(
            f"{r['name']:<{w}}{knobs:<26}"
            f"{num(m['throughput_tokens_per_s'], ',.0f'):>9} ±{num(se.get('throughput_tokens_per_s'), '.0f'):<5}"
            f"{num(p['throughput_tokens_per_s']['mean'], ',.0f'):>8}{pct(e['throughput_tokens_per_s']):>8}"
            f"{num(m['mix_efficiency'], '.3f'):>11} ±{num(se.get('mix_efficiency'), '.3f'):<5}"
            f"{num(p['mix_efficiency']['mean'], '.3f'):>7}{pct(e['mix_efficiency']):>8}"
            f"{num(m['loss_roughness'], '.3f'):>12}{num(p['loss_roughness']['mean'], '.3f'):>7}"
            f"{pct(e['loss_roughness']):>8}{num(m.get('tau'), '.3f'):>7}")
    for f in payload.get("failed", []):
        lines.append(f"{f['name']}: FAILED ({f.get('error')})")
    if payload["chosen"]:
        lines.append(f"validated best: {payload['chosen']} (knee of measured throughput and mix_efficiency); "
                     f"launch the full run with:\n  {payload['command']}")
    return "\n".join(lines)


def progress_printer(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
