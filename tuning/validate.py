"""``dflash validate``: the selection on the real trainer, next to the calibrated simulator's word.

For every configuration of a selection (the sweep's top-k plus ``baseline`` and ``handpicked``)
a worker claims it (:mod:`tuning.claims`), trains it for the same budget of takes, measures
docs/ARCHITECTURE.md's metrics with their own standard errors and tau at the end, and simulates the same
configuration for the same number of steps under the calibration (several seeds: the prediction's
spread). When every configuration is done, the worker that sees it writes ``validation.json``
(prediction, measurement, relative error per metric), picks the validated best by the sweep's own
knee rule on *measured* throughput and ``mix_efficiency``, and writes ``best.toml`` for the full run.
With ``[train] quality_every`` the runs also score their drafters on one shared held-out set, and
held-out tau and loss join the compared objectives at the last step every configuration scored
(:mod:`tuning.quality`); without it the summary says once that this objective is off.

A measurement's standard error comes from its spread over consecutive blocks of the run
(throughput: five time blocks of the steady span; ``mix_efficiency``: the metric's own window
spread; ``loss_roughness``: four step blocks of the run's second half): short runs are noisy, and
a prediction error smaller than the measurement's own noise is not an error we can see.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import math
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from dflash.core.atomic import atomic_write_text
from dflash.core.config import DflashConfig, config_to_toml, with_overrides
from dflash.core.errors import ConfigError
from dflash.core.records import clean_json, read_records
from tuning.claims import ClaimStore, worker_id
from tuning.evidence import (
    OBJECTIVES,
    REFERENCES,
    Comparison,
    HeldoutEstimates,
    Recommendation,
    all_resolved,
    chosen_comparisons,
    heldout_comparisons,
    measured_objectives,
    recommend,
)

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
    block_takes: int = 10


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
    if not any(_valid_queue(c["queue"]) for c in configs):
        raise ConfigError("--selection", "holds no config with a valid queue table "
                          "(see docs/ARCHITECTURE.md's queue keys)", str(path))
    return data


def _valid_queue(queue: dict[str, Any]) -> bool:
    from dflash.core.config import QueueConfig

    try:
        QueueConfig(**{k: v for k, v in queue.items() if v is not None})
    except (ConfigError, TypeError, ValueError):
        return False
    return True


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

    return open_storage(url, create=False)


def claims_url_for(storage: str | None, out: Path) -> str:
    """An SQL URL from ``--storage`` when it is one; else a SQLite file in the output directory."""
    if storage and storage.split("://", 1)[0].split("+")[0] in ("sqlite", "postgresql", "mysql"):
        return storage
    return f"sqlite:///{(out / 'validation.db').resolve()}"


def job_namespace(args: ValidateArgs, base: DflashConfig) -> str:
    ident = {"configs": [(c["name"], c["queue"]) for c in args.selection["configs"]], "takes": args.takes,
             "base": base.to_dict(), "calibration": args.calibration}
    return hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:32]


# --------------------------------------------------------------------------- blocks and rounds
def queue_overrides(queue: dict[str, Any]) -> dict[str, Any]:
    return {f"queue.{k}": v for k, v in queue.items() if v is not None}


def max_looks(takes: int, block_takes: int) -> int:
    """Rounds (looks at the evidence), fixed before the first block: ceil(takes / block_takes)."""
    return math.ceil(takes / block_takes)


def unit_name(config: str, block: int) -> str:
    return f"{config}#{block}"


def split_unit(unit: str) -> tuple[str, int]:
    name, _, k = unit.rpartition("#")
    return name, int(k)


def unit_order(names: list[str], looks: int) -> list[str]:
    """Round-major: every configuration's block k before any block k+1 (ABCABC...)."""
    return [unit_name(n, k) for k in range(looks) for n in names]


def unit_ready(unit: str, statuses: dict[str, str]) -> bool:
    """Block k of a config waits for round k-1 to be over and for its own block k-1 to have worked
    (it continues from that block's checkpoint)."""
    name, k = split_unit(unit)
    if k == 0:
        return True
    prev = [s for u, s in statuses.items() if split_unit(u)[1] == k - 1]
    return statuses.get(unit_name(name, k - 1)) == "done" and all(s in ("done", "failed", "skipped") for s in prev)


def block_steps(cfg: DflashConfig, args: ValidateArgs, block: int) -> tuple[int, int]:
    """(steps at the end of this block, steps of the whole budget): takes are per configuration."""
    per_step = cfg.cluster.n_drafter
    total = max(1, math.ceil(args.takes / per_step))
    return min(total, (block + 1) * max(1, math.ceil(args.block_takes / per_step))), total


def run_block(entry: dict[str, Any], block: int, base: DflashConfig, args: ValidateArgs,
              progress: Callable[[str], None]) -> dict[str, Any]:
    """Train one block of one configuration and measure the block alone; the block's row.

    On the CPU the configuration's rank job stays alive across its blocks, held between them with
    its queue intact (:mod:`dflash.pipeline.hold`: no process start, model load or refill per block).
    On GPUs, where a held job would keep its device memory from the next configuration, block 0
    starts the run and later blocks resume its checkpoint with a larger step budget."""
    name = entry["name"]
    upto, total = block_steps(base, args, block)
    held = keep_alive(base)
    # schedule_steps: the LR schedule is that of the whole budget whatever block we are in.
    run_cfg = with_overrides(base, {**queue_overrides(entry["queue"]), "train.max_steps": total if held else upto,
                                    "train.schedule_steps": total, "train.max_minutes": None,
                                    "train.eval_every": None})
    run_dir = args.out / "runs" / name
    if block == 0 and run_dir.exists():  # a dead worker's partial first block: start over
        _release(run_dir)
        shutil.rmtree(run_dir)
    t_start = time.perf_counter()
    if held:
        hold_block(run_cfg, run_dir, block, upto, total)
        steps = upto
    else:
        steps = train_block(run_cfg, run_dir, resume=block > 0, progress=progress).get("steps")
    wall_s = time.perf_counter() - t_start
    # The block starts after the previous block's last step. Read after the resume: a dead worker's
    # half of this block past the checkpoint was dropped from the records and trained again.
    before = block_steps(base, args, block - 1)[0] if block else 0
    t0 = max((float(r["t"]) for r in read_records(run_dir, "take") if int(r["step"]) < before), default=-math.inf)
    measured = block_metrics(run_dir, run_cfg, t0)
    return clean_json({"name": name, "block": block, "steps": steps, "held": held, "wall_s": wall_s, **measured})


def keep_alive(cfg: DflashConfig) -> bool:
    """Hold each configuration's job between its blocks when every rank runs on the CPU (host memory
    holds several small jobs; a GPU's memory is wanted by the next configuration's job)."""
    return all(d == "cpu" for d in (*cfg.target.devices, *cfg.drafter.devices)) and not _cuda_available()


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


BLOCK_TIMEOUT_S = 3600.0  # a block that shows no end in this long is a hang
_HELD: dict[Path, Any] = {}  # this worker's held jobs (dflash.pipeline.trainer.HeldJob), by run directory


def hold_block(cfg: DflashConfig, run_dir: Path, block: int, upto: int, total: int) -> None:
    """Block ``block`` of a held job: continue this worker's job (or another worker's, through the
    files in its run directory), else start the job (resuming the run after block 0); returns when
    the job holds after the block or, after the last block, has ended."""
    from dflash.pipeline.hold import Block, holding
    from dflash.pipeline.trainer import HeldJob

    nxt = Block(block, upto if upto < total else None)
    job = _HELD.get(run_dir)
    if job is not None and job.alive() and job.serial == block - 1:
        state = job.advance(nxt, BLOCK_TIMEOUT_S)
    elif job is None and block > 0 and holding(run_dir, block - 1):
        state = _drive_foreign(run_dir, nxt)
    else:
        if job is not None:
            job.kill()
        job = _HELD[run_dir] = HeldJob(cfg, run_dir, resume=block > 0, first=nxt)
        state = job.wait(BLOCK_TIMEOUT_S)
    if state == "ended":
        _HELD.pop(run_dir, None)


def _drive_foreign(run_dir: Path, nxt: Any) -> str:
    """Another worker's job holds in ``run_dir`` (a shared output directory): give it the block by file."""
    from dflash.pipeline.hold import ended, holding, write_block

    write_block(run_dir, nxt)
    deadline = time.monotonic() + BLOCK_TIMEOUT_S
    while not holding(run_dir, nxt.serial):
        if ended(run_dir):
            return "ended"
        if time.monotonic() > deadline:
            raise TimeoutError(f"the held job in {run_dir} showed no end of block {nxt.serial}")
        time.sleep(0.1)
    return "held"


def _release(run_dir: Path | None = None) -> None:
    """End this worker's held jobs (all, or the one of ``run_dir``) the normal way: metrics, drafter."""
    for d in [run_dir] if run_dir is not None else list(_HELD):
        job = _HELD.pop(d, None)
        if job is not None:
            job.stop(BLOCK_TIMEOUT_S)


def _wait_for_held_ends(run_dirs: list[Path]) -> None:
    """Other workers end their held jobs as they finish; their metrics are read only after that."""
    from dflash.pipeline.hold import pending_end

    deadline = time.monotonic() + BLOCK_TIMEOUT_S
    while any(pending_end(d) for d in run_dirs):
        if time.monotonic() > deadline:
            raise TimeoutError("held jobs of other workers did not end")
        time.sleep(0.5)


def train_block(cfg: DflashConfig, run_dir: Path, *, resume: bool, progress: Callable[[str], None]) -> dict[str, Any]:
    """The block as the rank job ``dflash train [--resume]`` runs, one process per rank (1 + 1 is two
    processes): what is validated is what the recommendation will launch. The summary record."""
    from dflash.pipeline.trainer import train

    return train(cfg, run_dir, resume=resume, quiet=True).summary


def block_metrics(run_dir: Path, cfg: DflashConfig, t0: float) -> dict[str, Any]:
    """docs/ARCHITECTURE.md's metrics on the block's own records (after ``t0``, the previous block's last take).

    The depth series starts with the items queued at ``t0``. A held job kept them: the steady state
    goes on and the block is measured from ``t0``. A resumed run replays them and its refill is
    excluded: the measurement begins when the queue holds ``min_ready`` items again. ``mix_efficiency`` needs
    windows; a block with fewer than two windows of items is measured with a window of half its
    items (``mix_window`` says which).
    """
    from dflash.core.runmetrics import RunTrace, run_metrics
    from simulator.workload import make_sampler

    all_takes = list(read_records(run_dir, "take"))
    taken_before = {i for r in all_takes if float(r["t"]) <= t0 for i in r["item_ids"]}
    latest: dict[str, dict[str, Any]] = {}  # an item replayed at a resume: its last produce record
    for r in read_records(run_dir, "produce"):
        if r["item_id"] not in taken_before:
            latest[r["item_id"]] = r
    produce = sorted(latest.values(), key=lambda r: float(r["t"]))
    takes = sorted((r for r in all_takes if float(r["t"]) > t0), key=lambda r: r["t"])
    sampler = make_sampler(cfg.workload, cfg.target.model, cfg.seed, cfg.drafter.block_size)
    close_t = max((float(r["t"]) + float(r.get("compute_s") or 0.0) for r in takes), default=0.0)
    window = max(2, min(cfg.metrics.window, sum(len(r["item_ids"]) for r in takes) // 2))
    # Items queued at t0 were kept (a held job): the steady state goes on from t0, whatever the gate
    # did since (with hysteresis the depth may stay under min_ready); after a resume nothing was kept.
    kept = any(float(r["t_end"]) + float(r.get("blocked_s") or 0.0) <= t0 for r in produce)
    m = run_metrics(RunTrace.from_records(produce, takes), p=sampler.item_mix(),
                    min_ready=1 if kept else cfg.queue.min_ready,
                    window=window, warmup_s=max(0.0, t0), close_t=close_t, n_target=cfg.cluster.n_target,
                    n_drafter=cfg.cluster.n_drafter, n_buckets=sampler.n_buckets)
    out = {k: m.get(k) for k in COMPARED if k != "loss_roughness"}
    return {**out, "mix_window": window, "takes": len(takes), "t_start": m.get("steady_state_start_s"),
            "t_end": m.get("steady_state_end_s")}


def _tau(target: Any, drafter: Any, trained: set[str], cfg: DflashConfig, n: int) -> dict[str, Any]:
    """Acceptance length of the trained drafter on held-out prompts (the run's conversations excluded)."""
    from dflash.model.acceptance import evaluate_acceptance, heldout_prompts

    with contextlib.redirect_stderr(io.StringIO()):  # the data set's damaged-record count: said once, by the command
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
        sampler = make_sampler(c.workload, c.target.model, c.seed, c.drafter.block_size)
        res = simulate(c, sampler, sim_seconds=1e9, max_steps=steps, records_dir=records_dir if r == 0 else None)
        runs.append(res.metrics)
    out = {}
    for k in COMPARED:
        xs = [float(m[k]) for m in runs if m.get(k) is not None and math.isfinite(float(m[k]))]
        out[k] = {"mean": float(np.mean(xs)) if xs else None,
                  "se": float(np.std(xs, ddof=1) / math.sqrt(len(xs))) if len(xs) > 1 else None}
    return out


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
    """Claim and run blocks, round by round, until the evidence is in or the budget is spent; the
    summary when this worker is the one to write it.

    Several workers share the claim table *per (configuration, block)*: block k of every config is
    claimable once round k-1 is over, so the rounds stay ABC ABC... whoever runs them (the output
    directory must be shared: a block continues its config's checkpoint). The worker that finishes
    a round looks at the evidence and, when every comparison is resolved, skips what is left.
    """
    from dflash.core.memory_model import check_fits
    from simulator.calibration import apply_calibration

    base.cluster.check_trainable()  # before anything is written: a sharded target is simulator-only
    check_fits(base)
    calibrated = apply_calibration(base, args.calibration)
    args.out.mkdir(parents=True, exist_ok=True)
    store = ClaimStore(args.claims_url, job_namespace(args, base))
    entries = {c["name"]: c for c in args.selection["configs"]}
    looks = max_looks(args.takes, args.block_takes)
    store.register(unit_order(list(entries), looks))
    me = worker_id()
    unit = None
    try:
        while (unit := _next_unit(store, me)) is not None:
            name, block = split_unit(unit)
            row, status = _run_claimed(store, unit, me, partial(run_block, entries[name], block, base, args, progress))
            kept = store.finish(unit, me, row, status)
            rows = store.rows()
            finished = sum(r["status"] in ("done", "failed", "skipped") for r in rows)
            progress(block_line(row, entries[name]["queue"], looks, finished, len(rows)))
            if not kept:
                progress(f"{unit}: claim lost to another worker (this one was taken for dead); result dropped")
            _look_after_round(store, block, looks, progress)
        rows = store.rows()
        _release()  # held jobs end the normal way: their metrics.json and drafter are read below
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the jobs checkpoint first, then the block is given back
        _kill_held()
        if unit is not None:
            store.release(unit, me)  # a rerun runs it again at once (resuming the checkpoint)
        raise
    finally:
        store.close()
        _kill_held()  # an error: stop with a checkpoint (a rerun resumes it)
    return write_summary(base, calibrated, args, rows, progress)


def _kill_held() -> None:
    """Every held job stopped with a checkpoint: all are told at once, then each is waited for (a
    scheduler's grace period covers one checkpoint, not one per configuration)."""
    for job in list(_HELD.values()):
        job.terminate()
    for job in list(_HELD.values()):
        job.kill()
    _HELD.clear()


def block_line(row: dict[str, Any], queue: dict[str, Any], looks: int, done: int, total: int, width: int = 20
               ) -> str:
    """One line per block: a bar over the whole validation, the config, its block, steps, tokens/s and
    queue depth (or why the block failed)."""
    filled = round(width * done / total) if total else width
    bar = f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total}"
    knobs = f"{queue.get('min_ready')}/{queue.get('max_depth')} {queue.get('policy') or ''}".rstrip()
    head = f"{bar} {row['name']} ({knobs}) block {row['block'] + 1}/{looks}"
    if "error" in row:
        return f"{head}: FAILED ({row['error']})"

    def num(key: str, spec: str) -> str:
        v = row.get(key)
        return "n/a" if v is None else format(v, spec)

    return (f"{head}: steps {row.get('steps')}, tokens/s {num('throughput_tokens_per_s', ',.0f')}, queue depth "
            f"{num('mean_queue_depth', '.1f')} (mean), mix_efficiency {num('mix_efficiency', '.3f')}")


def _next_unit(store: ClaimStore, me: str, poll_s: float = 2.0) -> str | None:
    """The next claimable block; waits while other workers finish the round it depends on."""
    while True:
        unit = store.claim(me, ready=unit_ready)
        if unit is not None:
            return unit
        rows = store.rows()
        if not any(r["status"] == "running" for r in rows):
            store.skip_pending()  # nothing runs and nothing is ready: a config failed before its turn
            return None
        time.sleep(poll_s)


def _run_claimed(store: ClaimStore, unit: str, me: str, work: Callable[[], dict[str, Any]]
                 ) -> tuple[dict[str, Any], str]:
    stop = threading.Event()
    beat = threading.Thread(target=_beat, args=(store, unit, me, stop), daemon=True)
    beat.start()
    try:
        return work(), "done"
    except Exception as exc:
        return {"name": split_unit(unit)[0], "block": split_unit(unit)[1],
                "error": f"{type(exc).__name__}: {exc}"}, "failed"
    finally:
        stop.set()
        beat.join()


def _look_after_round(store: ClaimStore, block: int, looks: int, progress: Callable[[str], None]) -> None:
    """After the last block of a round: stop early when every comparison is resolved."""
    rows = store.rows()
    if any(split_unit(r["name"])[1] == block and r["status"] in ("pending", "running") for r in rows):
        return
    blocks = block_table([r["result"] for r in rows if r["status"] == "done"])
    chosen, comps, _ = _evidence(blocks, looks, 1)
    if comps and all_resolved(comps) and (n := store.skip_pending()):
        progress(f"look {block + 1}/{looks}: every comparison of {chosen} is resolved; {n} blocks skipped")


def _beat(store: ClaimStore, name: str, me: str, stop: threading.Event) -> None:
    while not stop.wait(30.0):
        with contextlib.suppress(Exception):  # a missed beat is retried; the run goes on
            store.heartbeat(name, me)


# --------------------------------------------------------------------------- decisions
def block_table(block_rows: list[dict[str, Any]]) -> dict[str, dict[str, list[float]]]:
    """config -> objective -> per-block values, blocks in order; blocks without a value left out."""
    out: dict[str, dict[str, list[float]]] = {}
    for r in sorted(block_rows, key=lambda r: (r["name"], r["block"])):
        per = out.setdefault(r["name"], {k: [] for k in (*OBJECTIVES, "peak_queue_bytes")})
        for k in per:
            v = r.get(k)
            if v is not None and math.isfinite(float(v)):
                per[k].append(float(v))
    return out


def choose_tuned(blocks: dict[str, dict[str, list[float]]], objectives: Sequence[str] = OBJECTIVES) -> str | None:
    """The tuned configuration under test: the knee (tuning.pareto) of the measured block means of
    the configurations other than ``baseline``/``handpicked``; None when there is none."""
    from tuning.pareto import knee_scores

    tuned = sorted(n for n in blocks if n not in REFERENCES and objectives and all(blocks[n][k] for k in objectives))
    if not tuned:
        return None
    points = [[float(np.mean(blocks[n][k])) for k in objectives] for n in tuned]
    scores = knee_scores(points)
    return min(zip(scores, tuned))[1]


def _evidence(blocks: dict[str, dict[str, list[float]]], looks: int, block_takes: int,
              heldout: HeldoutEstimates | None = None) -> tuple[str | None, list[Comparison], Recommendation | None]:
    """(the tuned config under test, its comparisons, the recommendation) on the objectives every
    measured configuration has (:func:`tuning.evidence.measured_objectives`), plus the held-out
    objectives when ``heldout`` has them (after the last round: :mod:`tuning.quality`); configurations
    without a throughput block are left out."""
    measured = {n: b for n, b in blocks.items() if b["throughput_tokens_per_s"]}
    objectives = measured_objectives(measured)
    if not objectives:
        return None, [], None
    held = {n: h for n, h in (heldout or {}).items() if n in measured}
    chosen = choose_tuned(measured, objectives)
    comps = chosen_comparisons(measured, chosen, max_looks=looks, objectives=objectives) if chosen else []
    comps += heldout_comparisons(held, chosen) if chosen and len(held) == len(measured) else []
    peak = {n: max(b["peak_queue_bytes"]) if b["peak_queue_bytes"] else math.inf for n, b in measured.items()}
    return chosen, comps, recommend(measured, peak, max_looks=looks, block_takes=block_takes, objectives=objectives,
                                    heldout=held)


def stop_reason(rows: list[dict[str, Any]], comps: list[Comparison]) -> str:
    """Why validation ended, from the evidence: a configuration failed and its blocks were dropped
    (``failed``, whatever else is resolved: its comparisons are missing), every comparison resolved
    (``resolved``, early or at the last look), or the budget spent with differences still open
    (``budget``; also when there was nothing to compare)."""
    if any(r["status"] == "failed" for r in rows):
        return "failed"
    return "resolved" if comps and all_resolved(comps) else "budget"


# --------------------------------------------------------------------------- one configuration's row
def config_row(entry: dict[str, Any], blocks: list[dict[str, Any]], base: DflashConfig, calibrated: DflashConfig,
               args: ValidateArgs, target: Any) -> dict[str, Any]:
    """Measured (block means and their standard errors), tau, the a-priori prediction, the run
    calibrated alone (drift) and the drift-corrected prediction of one configuration.

    ``drift`` is one number, the machine drift's effect on the predicted throughput (a-priori over
    drift-corrected prediction, minus 1; :func:`tuning.drift.effect`); ``drift_detail`` has the
    per-stage changes (target seconds per item, drafter seconds per take) behind it."""
    from tuning.drift import effect, own_calibration, stage_drift, timing_of

    name = entry["name"]
    run_dir = args.out / "runs" / name
    steps = max(int(b.get("steps") or 0) for b in blocks)
    run_cfg = with_overrides(base, queue_overrides(entry["queue"]))
    metrics = json.loads((run_dir / "metrics.json").read_text())
    measured, se = _block_means(blocks, metrics)
    tau = _final_tau(run_cfg, run_dir, target, args.prompts)
    measured["tau"] = tau.get("tau")
    (run_dir / "eval.json").write_text(json.dumps(clean_json(tau), indent=1))
    predicted = predict(entry, calibrated, steps, args.out / "sim" / name)
    own, why = own_calibration(run_dir, base, args.out / "sim" / name / "own-calibration.json")
    drift: dict[str, Any] = {"why_missing": why}
    corrected = None
    if own is not None:
        drift = stage_drift(run_dir, calibrated.timing, timing_of(base, own["timing"]))
        corrected = predict(entry, with_overrides(calibrated, {f"timing.{k}": v for k, v in own["timing"].items()}),
                            steps, args.out / "sim" / f"{name}-drift-corrected")
    tput = "throughput_tokens_per_s"
    pa, pc = predicted[tput]["mean"], (corrected or {}).get(tput, {}).get("mean")
    drift["summary"] = effect(pa, pc)
    err_c = rel_errors(measured, corrected) if corrected else {k: None for k in COMPARED}
    return clean_json({
        "name": name, "trial": entry.get("trial"), "params": entry.get("params"), "queue": entry["queue"],
        "run_dir": f"runs/{name}", "sim_dir": f"sim/{name}", "steps": steps, "blocks": len(blocks),
        "ranks": {"n_target": run_cfg.cluster.n_target, "n_drafter": run_cfg.cluster.n_drafter},
        "measured": measured, "measured_se": se, "predicted": predicted, "predicted_drift_corrected": corrected,
        "rel_error": rel_errors(measured, predicted), "rel_error_drift_corrected": err_c,
        "throughput_error_drift_corrected": err_c.get(tput), "drift": drift["summary"], "drift_detail": drift,
        "within_goal": within_goals(measured, se, corrected or predicted), "within_goal_basis":
            "drift-corrected prediction" if corrected else "a-priori prediction (the run could not be calibrated)",
        "loss_roughness_steps": metrics.get("loss_roughness_steps"), "tau_prompts": tau.get("num_prompts"),
    })


def _block_means(blocks: list[dict[str, Any]], metrics: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Every compared metric as the mean over blocks with its standard error from their spread;
    ``peak_queue_bytes`` the highest block; ``loss_roughness`` of the whole run (its second half)."""
    measured: dict[str, Any] = {}
    se: dict[str, Any] = {}
    for k in COMPARED:
        xs = [float(b[k]) for b in blocks if b.get(k) is not None and math.isfinite(float(b[k]))]
        if k == "peak_queue_bytes":
            measured[k], se[k] = (max(xs) if xs else None), None
            continue
        measured[k] = float(np.mean(xs)) if xs else None
        se[k] = float(np.std(xs, ddof=1) / math.sqrt(len(xs))) if len(xs) > 1 else None
    measured["loss_roughness"] = metrics.get("loss_roughness")
    se["loss_roughness"] = None
    return measured, se


def _final_tau(cfg: DflashConfig, run_dir: Path, target: Any, prompts: int) -> dict[str, Any]:
    """tau of the configuration's drafter after its last block, on prompts it never trained on."""
    from dflash.model.drafter import DFlashDrafter
    from dflash.pipeline.training_data import TrainingData

    drafter = DFlashDrafter.load(run_dir / "drafter", target.model)
    data = TrainingData(cfg, target.tokenizer)
    taken = [i for r in read_records(run_dir, "take") for i in r["item_ids"]]
    trained = {data.conversations[k].id for k in data.sampler.sequences_of(taken)}
    return _tau(target, drafter, trained, cfg, prompts)


def write_summary(base: DflashConfig, calibrated: DflashConfig, args: ValidateArgs, rows: list[dict[str, Any]],
                  progress: Callable[[str], None]) -> dict[str, Any] | None:
    """validation.json and best.toml (for the recommendation), once every block is over."""
    if any(r["status"] in ("pending", "running") for r in rows):
        progress("blocks still running on other workers; the last worker to finish writes the comparison")
        return None
    from dflash.model.target import load_target

    looks = max_looks(args.takes, args.block_takes)
    done = [r["result"] for r in rows if r["status"] == "done"]
    failed_names = sorted({r["result"]["name"] for r in rows if r["status"] == "failed" and r["result"]})
    failed = [next(r["result"] for r in rows if r["status"] == "failed" and r["result"]["name"] == n)
              for n in failed_names]
    blocks = block_table([r for r in done if r["name"] not in failed_names])
    entries = {c["name"]: c for c in args.selection["configs"]}
    _wait_for_held_ends([args.out / "runs" / n for n in entries if n in blocks])
    from tuning.quality import heldout_evidence

    held = heldout_evidence({n: args.out / "runs" / n for n in entries if n in blocks})
    chosen, comps, rec = _evidence(blocks, looks, args.block_takes, held.pop("estimates"))  # its note: printed once
    target = load_target(base.target.model) if blocks else None
    configs = [config_row(entries[n], [r for r in done if r["name"] == n], base, calibrated, args, target)
               for n in entries if n in blocks]
    best = entries.get(rec.name) if rec else None
    best_toml = args.out / "best.toml"
    command = None
    if best is not None:
        cfg = with_overrides(base, queue_overrides(best["queue"]))
        atomic_write_text(best_toml, f"# Recommended by dflash validate from {args.selection_path} ({best['name']}): "
                                     f"{rec.words}\n# Launch: dflash train --config {best_toml}\n"
                                     + config_to_toml(cfg))
        command = f"dflash train --config {best_toml}"
    payload = clean_json({
        "takes": args.takes, "block_takes": args.block_takes, "max_looks": looks,
        "rounds": max((r["block"] + 1 for r in done), default=0),
        "stopped": stop_reason(rows, comps),
        "objectives": list(rec.objectives) if rec else list(measured_objectives(blocks)), "heldout": held,
        "calibration": args.calibration, "selection": args.selection_path,
        "base_config": base.to_dict(), "chosen": rec.name if rec else None, "tested": chosen,
        "comparisons": [c.as_json() for c in comps],
        "recommendation": None if rec is None else rec.as_json(),  # its takes_to_resolve is the printed one
        "best_toml": "best.toml" if best else None, "command": command,
        "devices": {"target": list(base.target.devices), "drafter": list(base.drafter.devices)},
        "goals": GOALS, "configs": configs, "failed": failed, "claims": args.claims_url,
        "block_rows": sorted(done, key=lambda r: (r["block"], list(entries).index(r["name"]))),
    })
    atomic_write_text(args.out / "validation.json", json.dumps(payload, indent=1))
    return payload


def format_validation(payload: dict[str, Any]) -> str:
    def pct(x: float | None) -> str:
        return "n/a" if x is None else f"{100 * x:+.1f}%"

    def num(x: Any, spec: str) -> str:
        return "n/a" if x is None else format(x, spec)

    w = max([12, *(len(r["name"]) + 2 for r in payload["configs"])])
    lines = [f"validated {len(payload['configs'])} configs in {payload.get('rounds')} rounds of "
             f"{payload.get('block_takes')} takes (at most {payload['takes']} each; stopped: {payload.get('stopped')}) "
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
    lines += heldout_lines(payload.get("heldout"))
    for c in payload.get("comparisons", []):
        lo, hi = (num(x, "+.4g") for x in c["ci95"])
        lines.append(f"{c['config']} vs {c['against']} on {c['objective']}: {num(c['difference'], '+.4g')} "
                     f"(95% interval {lo} .. {hi}): {'resolved' if c['resolved'] else 'NOT resolved'}")
    for r in payload["configs"]:
        d = r.get("drift_detail") or {}
        lines.append(f"{r['name']}: drift target {pct(d.get('target'))}, drafter {pct(d.get('drafter'))}, effect on "
                     f"predicted throughput {pct(d.get('summary'))}; throughput error a priori "
                     f"{pct(r['rel_error']['throughput_tokens_per_s'])}, drift-corrected "
                     f"{pct(r.get('throughput_error_drift_corrected'))}")
    rec = payload.get("recommendation")
    if rec:
        lines.append(f"recommended: {rec['words']}\nlaunch the full run with:\n  {payload['command']}")
    return "\n".join(lines)


def heldout_lines(held: dict[str, Any] | None) -> list[str]:
    """The held-out objective: the off note once, or each configuration's figures at the compared step."""
    from dflash.pipeline.quality import quality_line

    if not held:
        return []
    if not held.get("on"):
        return [held["note"]]
    lines = [f"held-out ({held.get('sequences')} sequences, the same set in every configuration: "
             f"{'yes' if held.get('same_set') else 'NO'}) after step {held['step'] + 1}:"
             if held.get("step") is not None else "held-out:"]
    lines += [f"  {n}: {quality_line(h)}" for n, h in held.get("configs", {}).items()]
    return lines + ([held["note"]] if held.get("note") else [])


def progress_printer(msg: str) -> None:
    """Progress goes to stdout with the rest of the command's output (stderr carries only errors)."""
    print(msg, flush=True)
