"""The ``dflash`` command: the composition root of DESIGN.md's command contract.

Every invocation goes the same way (:func:`validate`): argparse reads the words (converters only
parse), the verb's pure flags (those that are not config keys: paths, counts) are checked, the
config file is loaded and the key flags applied on top of it with one
:func:`dflash.core.config.with_overrides` call, and only then does the verb's handler run with the
validated, frozen config. Any bad input on that path is one line on stderr,

    dflash <verb>: error: <key> (<flag>): <allowed> (got <value>)

(``<key>: ...`` for a key no flag of the verb sets, ``<flag>: ...`` for a pure flag) and exit
status 2, before anything is written.

Plugging a verb in: replace its entry in :data:`HANDLERS` with a function
``handler(args: argparse.Namespace, cfg: DflashConfig) -> int`` that imports what it needs
inside its body (at its top this module imports only the torch-free ``dflash.core.config`` and
``dflash.core.errors``, so ``dflash --help`` and validation stay fast and torch-free). A handler may
raise :class:`~dflash.core.errors.ConfigError` for inputs it validates itself (before writing
anything); it is reported the same way.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from dflash import __version__
from dflash.core.config import (
    FLAG_FOR_KEY,
    GATES,
    POLICIES,
    DflashConfig,
    check_choice,
    check_float,
    check_int,
    load_config,
    with_overrides,
)
from dflash.core.errors import ConfigError, NotBuiltYet

PROG = "dflash"
WANDB_MODES = ("offline", "online", "disabled")

Handler = Callable[[argparse.Namespace, DflashConfig], int]


# --------------------------------------------------------------------------- option table
@dataclass(frozen=True)
class Opt:
    """One option of a verb, and how it is validated.

    ``key`` set: the value overrides that config key and the config's validation judges it (the
    error names the key and this flag). ``key`` None: a pure flag, checked here by ``kind``.
    Kinds: ``int``/``float`` (pure: ``>= lo`` resp. ``> lo``), ``str`` (non-empty),
    ``choice``, ``devices`` (comma-separated list), ``switch`` (store_true; with a key it sets
    ``value``), ``infile``/``indir``/``inpath`` (must exist), ``outfile``/``outdir`` (must not be
    the wrong kind of existing thing).
    """

    flag: str  # "--n-target", or a positional's name ("RUN_DIR")
    kind: str
    help: str
    key: str | None = None
    lo: float | None = None
    choices: tuple[str, ...] = ()
    default: Any = None
    required: bool = False
    repeat: bool = False
    value: Any = None
    metavar: str | None = None

    @property
    def positional(self) -> bool:
        return not self.flag.startswith("-")

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_").lower()


@dataclass(frozen=True)
class Verb:
    help: str
    opts: tuple[Opt, ...] = ()
    queue_flags: bool = False

    def all_opts(self) -> tuple[Opt, ...]:
        return (SEED, *(QUEUE_OPTS if self.queue_flags else ()), *self.opts)

    def flag_for_key(self) -> dict[str, str]:
        return {o.key: o.flag for o in self.all_opts() if o.key is not None}


SEED = Opt("--seed", "int", "random seed of the run (>= 0)", key="seed", metavar="N")
QUEUE_OPTS = (
    Opt(FLAG_FOR_KEY["queue.min_ready"], "int", "min-ready gate: items queued before a drafter takes "
        "(1 <= N <= max depth)", key="queue.min_ready", metavar="N"),
    Opt(FLAG_FOR_KEY["queue.max_depth"], "int", "max-depth cap: producers block at this depth (>= 1)",
        key="queue.max_depth", metavar="N"),
    Opt(FLAG_FOR_KEY["queue.max_bytes"], "int", "optional byte cap on queued items (>= 1)",
        key="queue.max_bytes", metavar="N"),
    Opt(FLAG_FOR_KEY["queue.policy"], "str", "which bucket a drafter takes from next",
        key="queue.policy", metavar="{" + ",".join(POLICIES) + "}"),
    Opt(FLAG_FOR_KEY["queue.items_per_take"], "int", "items one take removes (>= 1)",
        key="queue.items_per_take", metavar="N"),
    Opt(FLAG_FOR_KEY["queue.gate"], "str", "gate rule", key="queue.gate",
        metavar="{" + ",".join(GATES) + "}"),
)
CALIBRATION = Opt("--calibration", "infile", "calibration file written by 'dflash calibrate'", metavar="FILE")

VERBS: dict[str, Verb] = {
    "simulate": Verb("one simulated run", queue_flags=True, opts=(
        Opt("--n-target", "int", "target workers (>= 1)", key="cluster.n_target", metavar="N"),
        Opt("--n-drafter", "int", "drafter workers (>= 1)", key="cluster.n_drafter", metavar="N"),
        Opt("--sim-seconds", "float", "simulated seconds (> 0)", lo=0, metavar="S"),
        CALIBRATION,
        Opt("--json", "outfile", "write the metrics JSON here", metavar="OUT"),
        Opt("--records", "outdir", "write the run records (JSONL) here", metavar="DIR"),
        Opt("--plot", "outfile", "write a plot of the queue here", metavar="OUT"),
    )),
    "sweep": Verb("Optuna study over the simulator", queue_flags=True, opts=(
        Opt("--trials", "int", "complete trials in the study, all workers together (>= 1)", lo=1,
            metavar="N"),
        Opt("--storage", "str", "Optuna storage URL (default: a local storage)", metavar="URL"),
        Opt("--study", "str", "study name", metavar="NAME"),
        Opt("--workers", "int", "worker processes (>= 1)", lo=1, metavar="N"),
        Opt("--grid", "switch", "grid search instead of the configured sampler", key="sweep.sampler",
            value="grid"),
        CALIBRATION,
        Opt("--out", "outdir", "output directory", metavar="DIR"),
    )),
    "train": Verb("real training run", queue_flags=True, opts=(
        Opt("--target", "str", "target model: 'smollm2', a directory, a hub id or a .gguf path",
            key="target.model", metavar="MODEL"),
        Opt("--target-devices", "devices", "target devices, e.g. cuda:0,cuda:1", key="target.devices",
            metavar="LIST"),
        Opt("--drafter-devices", "devices", "drafter devices, e.g. cuda:2,cuda:3", key="drafter.devices",
            metavar="LIST"),
        Opt("--max-steps", "int", "stop after this many steps (>= 1)", key="train.max_steps", metavar="N"),
        Opt("--max-minutes", "float", "stop after this many minutes (> 0)", key="train.max_minutes",
            metavar="M"),
        Opt("--out", "outdir", "run directory", metavar="DIR"),
        Opt("--resume", "indir", "resume the run in this directory", metavar="DIR"),
        Opt("--wandb", "choice", "W&B mode", choices=WANDB_MODES, default="offline",
            metavar="{" + ",".join(WANDB_MODES) + "}"),
    )),
    "tune-live": Verb("change a running trainer's queue knobs", queue_flags=True, opts=(
        Opt("RUN_DIR", "indir", "directory of the running trainer", required=True),
    )),
    "eval": Verb("acceptance length of a drafter", opts=(
        Opt("--drafter", "indir", "drafter checkpoint directory", required=True, metavar="DIR"),
        Opt("--prompts", "int", "prompts to evaluate (>= 1)", lo=1, metavar="N"),
    )),
    "calibrate": Verb("fit the simulator to runs' records", opts=(
        Opt("--run", "inpath", "run directory, or a CSV/Parquet log (repeatable)", required=True,
            repeat=True, metavar="DIR"),
        Opt("--out", "outfile", "calibration file to write", metavar="FILE"),
    )),
    "validate": Verb("run the selection on the real trainer; compare with predictions", opts=(
        Opt("--selection", "infile", "selection file (instead of --study)", metavar="FILE"),
        Opt("--study", "str", "study to select from (instead of --selection)", metavar="NAME"),
        Opt("--storage", "str", "Optuna storage URL of --study", metavar="URL"),
        Opt("--top-k", "int", "configs taken from the study (>= 1)", key="sweep.top_k", metavar="K"),
        CALIBRATION,
        Opt("--takes", "int", "takes per validated config (>= 1)", lo=1, metavar="N"),
        Opt("--out", "outdir", "output directory", metavar="DIR"),
    )),
    "report": Verb("HTML + Markdown comparison report", opts=(
        Opt("INPUT", "inpath", "run directories, records or study files", required=True, repeat=True),
        Opt("--out", "outdir", "output directory", metavar="DIR"),
    )),
    "regenerate": Verb("regenerate the data set's replies with the target (ShareGPT JSONL out)", opts=(
        Opt("--out", "outfile", "ShareGPT-format JSONL to write or extend", required=True, metavar="DATA.jsonl"),
        Opt("--backend", "choice", "who generates: local transformers generate, or an OpenAI-compatible server",
            choices=("transformers", "server"), default="transformers", metavar="{transformers,server}"),
        Opt("--url", "str", "base URL of the OpenAI-compatible server (with --backend server)", metavar="URL"),
        Opt("--server-model", "str", "model name sent to the server (default: the server's first model)",
            metavar="NAME"),
        Opt("--turns", "choice", "which user turns get a regenerated reply", choices=("first", "all"),
            default="first", metavar="{first,all}"),
        Opt("--limit", "int", "only the first N usable records of the data set, done ones included (>= 1)", lo=1,
            metavar="N"),
        Opt("--max-new-tokens", "int", "bound on each reply's new tokens (>= 1)", lo=1, metavar="N"),
        Opt("--temperature", "float", "sampling temperature; 0 = greedy (>= 0)", metavar="T"),
        Opt("--top-p", "float", "nucleus sampling mass (0 < P <= 1)", metavar="P"),
        Opt("--batch-size", "int", "prompts per generate call (transformers back end, >= 1)", lo=1, metavar="N"),
        Opt("--concurrency", "int", "requests in flight (server back end, >= 1)", lo=1, metavar="N"),
        Opt("--retries", "int", "retries of a failed request (server back end, >= 0)", lo=0, metavar="N"),
        Opt("--timeout", "float", "seconds per request (server back end, > 0)", lo=0, metavar="S"),
        Opt("--device", "str", "device of the transformers back end (default: the config's first target device)",
            metavar="DEV"),
    )),
    "lengths": Verb("tokenise the configured data set; print the cached length table and bucket shares"),
    "demo": Verb("the main job, end to end", opts=(
        Opt("--out", "outdir", "output directory (default: dflash-demo)", metavar="DIR"),
        Opt("--takes", "int", "takes per validated config (>= 1; default 100)", lo=1, metavar="N"),
        Opt("--cal-steps", "int", "steps of the calibration run (>= 30; default 120)", lo=30, metavar="N"),
    )),
}


# --------------------------------------------------------------------------- handlers
class NotBuilt:
    """Placeholder handler of a verb whose issue has not landed: it says so, exit status 2."""

    def __init__(self, issue: int) -> None:
        self.issue = issue

    def __call__(self, args: argparse.Namespace, cfg: DflashConfig) -> int:
        raise NotBuiltYet(f"issue #{self.issue}")


def _lengths(args: argparse.Namespace, cfg: DflashConfig) -> int:
    """Tokenise (or read the cache of) the configured data set; print its size and bucket shares."""
    from dflash.core.sampler import bucket_of
    from dflash.data.lengths import cached_lengths

    w = cfg.workload
    table = cached_lengths(w, model=cfg.target.model)
    counts = [0] * len(w.bucket_bounds)
    for n in table.lengths:
        counts[bucket_of(n, w.bucket_bounds)] += 1
    total = len(table)
    longer = sum(n > w.max_len for n in table.lengths)
    print(f"length table: {total} sequences, {sum(table.lengths)} tokens untruncated "
          f"(dataset {w.dataset}, sample {w.sample}, tokenizer {cfg.target.model}, key {table.key})")
    print(f"bucket shares of sequences (max_len {w.max_len}; {longer} longer, truncated into the last):")
    lo = 0
    for hi, c in zip(w.bucket_bounds, counts, strict=True):
        share = 100.0 * c / total if total else 0.0
        print(f"  ({lo}, {hi}]".ljust(16) + f"{share:6.1f}%  {c}")
        lo = hi
    from dflash.core.sampler import Sampler

    sampler = Sampler(table.lengths, w, seed=cfg.seed)
    mix = " / ".join(f"{100 * m:.1f}" for m in sampler.item_mix())
    per_item = f"{w.seqs_per_item} seqs" if w.seqs_per_item else f"{w.tokens_per_item} tokens"
    print(f"item mix p ({per_item} per item, {sampler.items_per_epoch()} items per epoch): {mix} %")
    return 0


def _simulate(args: argparse.Namespace, cfg: DflashConfig) -> int:
    """One simulated run: the trainer's queue and sampler code on SimPy's clock."""
    import json

    from simulator.calibration import apply_calibration
    from simulator.run import simulate
    from simulator.workload import make_sampler

    cfg = apply_calibration(cfg, args.calibration)
    sim_seconds = float(args.sim_seconds) if args.sim_seconds is not None else 3600.0
    sampler = make_sampler(cfg.workload, cfg.target.model, cfg.seed)
    result = simulate(cfg, sampler, sim_seconds=sim_seconds, records_dir=args.records)
    m, s = result.metrics, result.summary
    q = cfg.queue
    print(f"simulated {sim_seconds:g} s in {result.wall_s:.2f} s wall "
          f"({sim_seconds / max(result.wall_s, 1e-9):,.0f}x): {cfg.cluster.n_target} targets, "
          f"{cfg.cluster.n_drafter} drafters ({cfg.cluster.drafter_sync}), min_ready {q.min_ready}, "
          f"max_depth {q.max_depth}, policy {q.policy}, gate {q.gate}")
    if not m.get("steady_state_reached"):
        print("steady state not reached: depth never reached min_ready before the end")
    else:
        print(_format_metrics(m))
    print(f"accounting: produced {s['produced']} = trained {s['trained']} + discarded_at_stop "
          f"{s['discarded_at_stop']}; stranded at stop: {s['stranded']}")
    payload = {"config": cfg.to_dict(), "sim_seconds": sim_seconds, **result.as_json()}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(payload, indent=1, default=str))
        print(f"metrics JSON: {args.json}")
    if args.records:
        print(f"records: {args.records}")
    if args.plot:
        from simulator.plot import plot_queue

        title = (f"min_ready {q.min_ready}, max_depth {q.max_depth}, {q.policy}: "
                 f"mix_efficiency {m.get('mix_efficiency', float('nan')):.3f}")
        plot_queue(result.take, result.bucket_bounds, args.plot, window=cfg.metrics.window, title=title)
        print(f"plot: {args.plot}")
    return 0


def _format_metrics(m: dict[str, Any]) -> str:
    def f(key: str, spec: str = ".3f") -> str:
        v = m.get(key)
        return "n/a" if v is None else format(v, spec)

    return "\n".join([
        f"  throughput_tokens_per_s {f('throughput_tokens_per_s', ',.0f')}   samples_per_s "
        f"{f('samples_per_s', '.2f')}   span {f('steady_state_start_s', '.1f')}-"
        f"{f('steady_state_end_s', '.1f')} s",
        f"  mix_efficiency {f('mix_efficiency')} (+/- {f('mix_efficiency_se')})   mix_entropy "
        f"{f('mix_entropy')}   mix_kl {f('mix_kl')}   length_autocorr {f('length_autocorr')}   "
        f"max_bucket_streak {m.get('max_bucket_streak')} of {m.get('streak_takes')} takes",
        f"  drafter_utilization {f('drafter_utilization')}   target_utilization "
        f"{f('target_utilization')}   drafter_gate_wait_frac {f('drafter_gate_wait_frac')}   "
        f"producer_blocked_frac {f('producer_blocked_frac')}",
        f"  mean_queue_depth {f('mean_queue_depth', '.1f')}   peak_queue_bytes "
        f"{m.get('peak_queue_bytes', 0) / 2**30:.2f} GiB   max_item_age_s "
        f"{[round(a, 1) for a in m.get('max_item_age_s', [])]}",
    ])


DEMO_STEPS = 7


def _demo(args: argparse.Namespace, cfg: DflashConfig) -> int:
    """The main job, in the issue's order: lengths, a real calibration run, simulate the named configs,
    sweep with the calibration, validate the chosen config next to baseline and handpicked, report."""
    out = Path(args.out) if args.out else Path("dflash-demo")
    takes = int(args.takes) if args.takes is not None else 100
    cal_steps = int(args.cal_steps) if args.cal_steps is not None else 120
    t0 = time.perf_counter()

    def stage(k: int, title: str) -> None:
        print(f"\n== {k}/{DEMO_STEPS} {title} ({time.perf_counter() - t0:.0f} s so far) ==", flush=True)

    stage(1, "token lengths of the data set")
    _lengths(args, cfg)
    stage(2, f"a short real CPU run to calibrate ({cal_steps} steps, {cfg.queue.min_ready}/{cfg.queue.max_depth} "
             f"{cfg.queue.policy})")
    cal_run = out / "calibration-run"
    if not (cal_run / "metrics.json").is_file():
        if cal_run.exists():
            import shutil

            shutil.rmtree(cal_run)
        from dflash.pipeline.trainer import Trainer

        Trainer(with_overrides(cfg, {"train.max_steps": cal_steps}), cal_run, wandb_mode="disabled").run()
    stage(3, "calibrate the simulator")
    from simulator.calibration import apply_calibration, calibrate, format_calibration, write_calibration

    cal_path = out / "calibration.json"
    data = calibrate([cal_run], cfg, seed=cfg.seed)
    write_calibration(data, cal_path)
    print(format_calibration(data))
    calibrated = apply_calibration(cfg, cal_path)
    stage(4, "simulate baseline and handpicked with the calibration (one simulated hour each)")
    _demo_simulate(calibrated)
    stage(5, "sweep the queue knobs over the calibrated simulator (Optuna, NSGA-II)")
    selection = _demo_sweep(out, calibrated, str(cal_path))
    stage(6, f"validate the chosen config, baseline and handpicked on the real trainer ({takes} takes each)")
    import json

    from tuning.validate import ValidateArgs, claims_url_for, format_validation, progress_printer, run_validation

    sel = json.loads(Path(selection).read_text())
    keep = [c for c in sel["configs"] if c["name"] in ("tuned-1", "baseline", "handpicked")]
    val_out = out / "validation"
    vargs = ValidateArgs(selection={**sel, "configs": keep}, selection_path=str(selection), takes=takes,
                         out=val_out, calibration=str(cal_path), claims_url=claims_url_for(None, val_out),
                         prompts=cfg.train.eval_prompts)
    payload = run_validation(cfg, vargs, progress=progress_printer)
    if payload is not None:
        print(format_validation(payload))
    stage(7, "write the report")
    from reports.build import build_report

    html, md = build_report([out], out / "report", cfg)
    print(f"\ndone in {time.perf_counter() - t0:.0f} s.\nreport: {html}\n(markdown twin: {md})")
    if payload is not None and payload.get("command"):
        print(f"launch the validated training run:\n  {payload['command']}")
    return 0


def _sweep(args: argparse.Namespace, cfg: DflashConfig) -> int:
    """An Optuna study over the simulator (tuning/)."""
    from simulator.calibration import apply_calibration
    from tuning.sweep import format_result, run_sweep, sweep_args

    cfg = apply_calibration(cfg, args.calibration)
    sargs = sweep_args(args, cfg)
    res = run_sweep(cfg, sargs, progress=sys.stderr.isatty())
    print(format_result(res, sargs.grid, cfg))
    return 0


def _demo_sweep(out: Path, cfg: DflashConfig, calibration: str | None) -> Path:
    from tuning.sweep import SweepArgs, format_result, run_sweep

    # A short study: at most 40 trials x 2 seeds x 30 simulated minutes (less if the config asks for less).
    cfg = with_overrides(cfg, {"sweep.seeds_per_trial": min(cfg.sweep.seeds_per_trial, 2),
                               "sweep.sim_seconds": min(cfg.sweep.sim_seconds, 1800.0)})
    sargs = SweepArgs(trials=min(cfg.sweep.trials, 40), storage=str(out / "sweep" / "study.journal"), study="demo",
                      workers=1, grid=False, out=out / "sweep", calibration=calibration)
    res = run_sweep(cfg, sargs, progress=sys.stderr.isatty())
    print(format_result(res, False, cfg))
    return Path(res["selection"])


def _train(args: argparse.Namespace, cfg: DflashConfig) -> int:
    """A real training run (dflash/trainer.py); ``--resume DIR`` continues one from its checkpoint."""
    if args.resume:
        if args.out and Path(args.out).resolve() != Path(args.resume).resolve():
            raise ConfigError("--out", "a resumed run continues in its own directory; omit --out", args.out)
        out = Path(args.resume)
        if not (out / "checkpoint" / "meta.json").exists() and not (out / ".checkpoint.old" / "meta.json").exists():
            raise ConfigError("--resume", "must be a run directory with a checkpoint", str(out))
    else:
        out = Path(args.out) if args.out else Path("runs") / time.strftime("train-%Y%m%d-%H%M%S")
        if out.exists() and any(out.iterdir()):
            raise ConfigError("--out", "must be a new or empty directory (use --resume to continue a run)", str(out))
    from dflash.pipeline.trainer import Trainer

    res = Trainer(cfg, out, resume=bool(args.resume), wandb_mode=args.wandb).run()
    s, m = res.summary, res.metrics
    print(f"done: {s['steps']} steps in {s['wall_s']:.0f} s (stopped by {s['stopped_by']}); produced "
          f"{s['produced']} = trained {s['trained']} + discarded_at_stop {s['discarded_at_stop']}"
          + (f"; replayed {s['replayed']}" if s.get("replayed") else ""))
    if m.get("steady_state_reached"):
        print(_format_metrics(m))
    print(f"drafter weights: {out / 'drafter'} (load with DFlashDrafter.load(dir, target)); records: {out}")
    return 0


def _tune_live(args: argparse.Namespace, cfg: DflashConfig) -> int:
    """Write a validated queue change into a running trainer's control file (applied between takes)."""
    from dflash.pipeline.checkpoint import read_control, write_control

    run = Path(args.run_dir)
    base = load_run_config(run)
    ctl = read_control(run) or {}
    current = {**base.queue.__dict__, **ctl.get("queue", {})}
    change = {k.removeprefix("queue."): v for k, v in _given_queue_flags(args).items()}
    merged = with_overrides(base, {f"queue.{k}": v for k, v in {**current, **change}.items()})  # validates
    serial = int(ctl.get("serial", 0)) + 1
    write_control(run, {k: getattr(merged.queue, k) for k in {**ctl.get("queue", {}), **change}}, serial)
    print(f"control #{serial} written to {run / 'control.json'}: {change}; the trainer applies it between takes "
          f"and records it as a control record")
    return 0


def _given_queue_flags(args: argparse.Namespace) -> dict[str, Any]:
    return {o.key: _config_value(o, getattr(args, o.dest)) for o in QUEUE_OPTS
            if o.key is not None and getattr(args, o.dest) is not None}


def load_run_config(run: Path) -> DflashConfig:
    """The config a `dflash train` run stored in its directory."""
    import json

    from dflash.core.config import config_from_dict

    path = run / "config.json"
    if not path.is_file():
        raise ConfigError("RUN_DIR", "must be a dflash train run directory (it has no config.json)", str(run))
    data = json.loads(path.read_text())
    return config_from_dict({k: v for k, v in data.items() if v is not None})


def _eval(args: argparse.Namespace, cfg: DflashConfig) -> int:
    """Acceptance length tau of a drafter: real speculative decoding, verified greedily by the target."""
    import json

    from dflash.core.records import clean_json
    from dflash.model.acceptance import evaluate_acceptance, heldout_prompts
    from dflash.model.drafter import CONFIG_FILE, DFlashDrafter
    from dflash.model.target import load_target

    drafter_dir = Path(args.drafter)
    run_dir = drafter_dir if (drafter_dir / "drafter").is_dir() else drafter_dir.parent
    if (drafter_dir / "drafter").is_dir():
        drafter_dir = drafter_dir / "drafter"
    if not (drafter_dir / CONFIG_FILE).is_file():
        raise ConfigError("--drafter", "must be a drafter directory (or a run directory holding one)", args.drafter)
    run_cfg = load_run_config(run_dir) if (run_dir / "config.json").is_file() else cfg
    target = load_target(run_cfg.target.model, device=run_cfg.target.devices[0])
    drafter = DFlashDrafter.load(drafter_dir, target.model)
    n = int(args.prompts) if args.prompts is not None else 8
    used = trained_conversation_ids(run_dir, run_cfg)
    prompts = heldout_prompts(target.tokenizer, n, seed=run_cfg.seed + 1, sample=run_cfg.workload.sample,
                              skip_ids=used, dataset=run_cfg.workload.dataset)
    res = evaluate_acceptance(target, drafter, prompts, max_new_tokens=64)
    rates = ", ".join(f"{r:.2f}" for r in res["acceptance_rate_per_position"])
    print(f"tau {res['tau']:.3f} over {res['steps']} verification steps, {res['num_prompts']} held-out prompts "
          f"({len(used)} training conversations excluded); {res['tokens_per_s']:.1f} tokens/s")
    print(f"acceptance rate per block position 1..{res['block_size'] - 1}: {rates}")
    out = run_dir / "eval.json"
    out.write_text(json.dumps(clean_json(res), indent=1))
    print(f"eval: {out}")
    return 0


def trained_conversation_ids(run_dir: Path, cfg: DflashConfig) -> set[str]:
    """Conversation ids of every item a run's take records show (to keep evaluation held out)."""
    from dflash.core.records import read_records

    item_ids = [i for r in read_records(run_dir, "take") for i in r["item_ids"]]
    if not item_ids:
        return set()
    from dflash.core.sampler import Sampler
    from dflash.data.lengths import cached_lengths

    table = cached_lengths(cfg.workload, model=cfg.target.model, progress=False)
    sampler = Sampler(table.lengths, cfg.workload, seed=cfg.seed)
    return {table.ids[k] for k in sampler.sequences_of(item_ids)}


REFERENCE_CONFIGS = {"baseline": (10, 30), "handpicked": (30, 90)}  # DESIGN.md's named configs


def _demo_simulate(cfg: DflashConfig) -> None:
    from simulator.run import simulate
    from simulator.workload import make_sampler

    sampler = make_sampler(cfg.workload, cfg.target.model, cfg.seed)
    rows = []
    for name, (min_ready, max_depth) in REFERENCE_CONFIGS.items():
        c = with_overrides(cfg, {"queue.min_ready": min_ready, "queue.max_depth": max_depth})
        m = simulate(c, sampler, sim_seconds=3600.0).metrics
        rows.append((f"{name} {min_ready}/{max_depth}", m))
    print(f"{'config':<18}{'tokens/s':>10}{'mix_eff':>9}{'streak':>8}{'autocorr':>10}{'depth':>7}"
          f"{'peak GiB':>10}")
    for label, m in rows:
        print(f"{label:<18}{m.get('throughput_tokens_per_s', float('nan')):>10,.0f}"
              f"{m.get('mix_efficiency', float('nan')):>9.3f}{m.get('max_bucket_streak', 0):>8}"
              f"{m.get('length_autocorr', float('nan')):>10.3f}"
              f"{m.get('mean_queue_depth', float('nan')):>7.1f}"
              f"{m.get('peak_queue_bytes', 0) / 2**30:>10.1f}")
    c = cfg.cluster
    print(f"({c.n_target} target + {c.n_drafter} drafter workers on {', '.join(cfg.target.devices)}; timing "
          f"{'from the calibration' if cfg.timing.target_noise == 'empirical' else 'as configured'})")


def _calibrate(args: argparse.Namespace, cfg: DflashConfig) -> int:
    """Fit the simulator's timing and loss models to runs' records or timing logs (simulator/fit.py)."""
    from simulator.calibration import calibrate, format_calibration, write_calibration

    out = Path(args.out) if args.out else Path("calibration.json")
    if out.suffix != ".json":
        raise ConfigError("--out", "must be a .json file path", str(out))
    data = calibrate(args.run, cfg, seed=cfg.seed)
    print(format_calibration(data))
    write_calibration(data, out)
    print(f"calibration: {out}  (use: dflash simulate --calibration {out}; dflash sweep --calibration {out})")
    return 0


def _validate(args: argparse.Namespace, cfg: DflashConfig) -> int:
    """The selection on the real trainer, compared with the calibrated simulator (tuning/validate.py)."""
    from tuning.validate import (
        ValidateArgs,
        claims_url_for,
        format_validation,
        progress_printer,
        read_selection,
        run_validation,
        selection_from_study,
    )

    out = Path(args.out) if args.out else Path("validation")
    if args.selection:
        selection, sel_path = read_selection(args.selection), str(args.selection)
    else:
        storage = args.storage or "dflash-study.journal"
        selection, sel_path = selection_from_study(args.study, storage, cfg), f"study {args.study} in {storage}"
    takes = int(args.takes) if args.takes is not None else 300
    vargs = ValidateArgs(selection=selection, selection_path=sel_path, takes=takes, out=out,
                         calibration=args.calibration, claims_url=claims_url_for(args.storage, out),
                         prompts=cfg.train.eval_prompts)
    payload = run_validation(cfg, vargs, progress=progress_printer)
    if payload is None:
        return 0
    print(format_validation(payload))
    print(f"validation: {out / 'validation.json'}")
    return 0


def _regenerate(args: argparse.Namespace, cfg: DflashConfig) -> int:
    """Target-regenerated replies for the configured data set (dflash/regenerate.py)."""
    from dflash.regenerate import handle

    return handle(args, cfg)


def _report(args: argparse.Namespace, cfg: DflashConfig) -> int:
    """One self-contained HTML report and its Markdown twin (reports/)."""
    from reports.build import handle

    return handle(args, cfg)


# One entry per verb; replace a NotBuilt(...) with the real handler when its issue lands.
HANDLERS: dict[str, Handler] = {
    "simulate": _simulate,
    "sweep": _sweep,
    "train": _train,
    "tune-live": _tune_live,
    "eval": _eval,
    "calibrate": _calibrate,
    "validate": _validate,
    "report": _report,
    "regenerate": _regenerate,
    "lengths": _lengths,
    "demo": _demo,
}


# --------------------------------------------------------------------------- parsing
class UsageError(Exception):
    """argparse's own complaint (unknown option, missing value), reported as one line."""

    def __init__(self, prog: str, message: str) -> None:
        super().__init__(message)
        self.prog = prog


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(self.prog, message.removeprefix("argument "))


def _lenient(kind: type) -> Callable[[str], Any]:
    """Parse an int/float when the text is one, else keep the text for validation to reject."""

    def convert(text: str) -> Any:
        try:
            return kind(text)
        except ValueError:
            return text

    convert.__name__ = kind.__name__
    return convert


def _add(parser: argparse.ArgumentParser, opt: Opt) -> None:
    kw: dict[str, Any] = {"help": opt.help + (" (required)" if opt.required else "")}
    if opt.kind == "switch":
        kw["action"] = "store_true"
    else:
        kw["type"] = {"int": _lenient(int), "float": _lenient(float)}.get(opt.kind, str)
        kw["default"] = opt.default
        if opt.metavar:
            kw["metavar"] = opt.metavar
    if opt.positional:
        kw["nargs"] = "*" if opt.repeat else "?"
        parser.add_argument(opt.dest, metavar=opt.flag, **kw)
    else:
        if opt.repeat:
            kw["action"] = "append"
        parser.add_argument(opt.flag, dest=opt.dest, **kw)


def build_parser() -> argparse.ArgumentParser:
    root = _Parser(prog=PROG, allow_abbrev=False,
                   description="Simulate, sweep, train, validate and report the hidden-state queue "
                               "of a decoupled DFlash drafter-training pipeline.")
    root.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = root.add_subparsers(dest="verb", metavar="VERB")
    for name, verb in VERBS.items():
        p = sub.add_parser(name, help=verb.help, description=verb.help, allow_abbrev=False,
                           prog=f"{PROG} {name}")
        p.add_argument("--config", metavar="FILE", help="TOML configuration file (flags override it)")
        for opt in verb.all_opts():
            _add(p, opt)
    return root


# --------------------------------------------------------------------------- validation
def _check_pure(opt: Opt, value: Any) -> None:
    """Validate one value of a flag that is not a config key."""
    flag, kind = opt.flag, opt.kind
    if kind == "int":
        check_int(flag, value, None if opt.lo is None else int(opt.lo))
    elif kind == "float":
        check_float(flag, value, opt.lo, lo_open=True)
    elif kind == "choice":
        check_choice(flag, value, opt.choices)
    elif kind == "str":
        if not value.strip():
            raise ConfigError(flag, "must not be empty", value)
    elif kind in ("infile", "indir", "inpath"):
        p = Path(value)
        ok = {"infile": p.is_file, "indir": p.is_dir, "inpath": p.exists}[kind]()
        what = {"infile": "an existing file", "indir": "an existing directory",
                "inpath": "an existing file or directory"}[kind]
        if not value or not ok:
            raise ConfigError(flag, f"must be {what}", value)
    elif kind == "outfile" and (not value or Path(value).is_dir()):
        raise ConfigError(flag, "must be a file path (not a directory)", value)
    elif kind == "outdir" and (not value or (Path(value).exists() and not Path(value).is_dir())):
        raise ConfigError(flag, "must be a directory path (not an existing file)", value)


def _config_value(opt: Opt, value: Any) -> Any:
    if opt.kind == "devices":
        return tuple(d.strip() for d in value.split(","))
    if opt.kind == "switch":
        return opt.value if value else None
    return value


def validate(verb_name: str, args: argparse.Namespace) -> DflashConfig:
    """Config file + flags -> the full, frozen config; pure flags checked. Raises ConfigError."""
    verb = VERBS[verb_name]
    overrides: dict[str, Any] = {}
    for opt in verb.all_opts():
        value = getattr(args, opt.dest)
        if value is None or value == []:
            if opt.required:
                raise ConfigError(opt.flag, f"required: {opt.help}", show_got=False)
            continue
        if opt.key is not None:
            overrides[opt.key] = _config_value(opt, value)
        else:
            for v in value if opt.repeat else (value,):
                _check_pure(opt, v)
    if verb_name == "tune-live" and not any(o.key in overrides for o in QUEUE_OPTS):
        raise ConfigError(", ".join(o.flag for o in QUEUE_OPTS), "give at least one queue flag to change",
                          show_got=False)
    if verb_name == "validate" and (args.selection is None) == (args.study is None):
        raise ConfigError("--selection/--study", "give exactly one of --selection FILE or --study NAME",
                          show_got=False)
    if verb_name == "validate" and args.storage is not None and args.study is None and \
            args.storage.split("://", 1)[0].split("+")[0] not in ("sqlite", "postgresql", "mysql"):
        raise ConfigError("--storage", "with --selection: an SQL URL (sqlite:///PATH or postgresql://...) shared "
                                       "by validation workers", args.storage)
    if verb_name == "train" and getattr(args, "resume", None):
        base = load_run_config(Path(args.resume))  # a resumed run keeps its own config; flags still apply
    elif verb_name == "tune-live":
        # The values themselves first (and a --config file like anywhere), then against the run's own config.
        with_overrides(load_config(args.config), overrides)
        base = load_run_config(Path(args.run_dir))
    else:
        base = load_config(args.config or _default_config_file(verb_name, overrides))
    return with_overrides(base, overrides)


def _default_config_file(verb_name: str, overrides: dict[str, Any]) -> Path | None:
    """`dflash train` with no --config on the CPU runs the packaged CPU profile (the built-in defaults
    are the published GPU sizes: 5 draft layers, blocks of 16, 512 anchors, 2048 tokens)."""
    devices = (*overrides.get("target.devices", ("cpu",)), *overrides.get("drafter.devices", ("cpu",)))
    if verb_name in ("train", "validate", "demo") and all(d == "cpu" for d in devices):
        return Path(__file__).with_name("profiles") / "cpu-smollm2.toml"
    return None


def error_line(prog: str, exc: ConfigError, flag_for_key: dict[str, str]) -> str:
    """``<prog>: error: <key> (<flag>): <allowed> (got <value>)`` on one line."""
    flag = flag_for_key.get(exc.key)
    head = f"{exc.key} ({flag})" if flag and flag != exc.key else exc.key
    got = f" (got {exc.got!r})" if exc.show_got else ""
    return _one_line(f"{prog}: error: {head}: {exc.allowed}{got}")


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _prog_from_argv(argv: Sequence[str]) -> str:
    verb = next((a for a in argv if a in VERBS), None)
    return f"{PROG} {verb}" if verb else PROG


# --------------------------------------------------------------------------- entry point
def main(argv: Sequence[str] | None = None) -> int:
    """Run one ``dflash`` command; returns the exit status (0 ok, 2 bad input or not built yet)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    prog, verb_name = PROG, None
    try:
        try:
            args, extras = build_parser().parse_known_args(argv)
        except SystemExit as exc:  # --help, --version
            return exc.code if isinstance(exc.code, int) else 0
        verb_name = args.verb
        if verb_name is None:
            raise UsageError(PROG, f"VERB: required, one of {', '.join(VERBS)} (see dflash --help)")
        prog = f"{PROG} {verb_name}"
        if extras:
            raise UsageError(prog, f"unrecognized arguments: {' '.join(extras)}")
        cfg = validate(verb_name, args)
        return HANDLERS[verb_name](args, cfg)
    except UsageError as exc:
        where = exc.prog if exc.prog != PROG else _prog_from_argv(argv)
        print(_one_line(f"{where}: error: {exc}"), file=sys.stderr)
    except ConfigError as exc:
        keys = VERBS[verb_name].flag_for_key() if verb_name else {}
        print(error_line(prog, exc, keys), file=sys.stderr)
    except NotBuiltYet as exc:
        print(_one_line(f"{prog}: not built yet ({exc})"), file=sys.stderr)
    return 2
