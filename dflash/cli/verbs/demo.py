"""``dflash demo``: The main job, in the issue's order: lengths, a real calibration run, simulate the named configs,"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from dflash.cli.options import Opt, Verb
from dflash.cli.verbs import lengths
from dflash.core.config import DflashConfig, with_overrides

DEMO_STEPS = 7


def handle(args: argparse.Namespace, cfg: DflashConfig) -> int:
    """The main job, in the issue's order: lengths, a real calibration run, simulate the named configs,
    sweep with the calibration, validate the chosen config next to baseline and handpicked, report."""
    out = Path(args.out) if args.out else Path("dflash-demo")
    takes = int(args.takes) if args.takes is not None else 100
    cal_steps = int(args.cal_steps) if args.cal_steps is not None else 120
    t0 = time.perf_counter()

    def stage(k: int, title: str) -> None:
        print(f"\n== {k}/{DEMO_STEPS} {title} ({time.perf_counter() - t0:.0f} s so far) ==", flush=True)

    from dflash.data.dataset_choice import pin_dataset

    cfg = pin_dataset(cfg, say=lambda _line: None)  # every stage and run reads one file; stage 1 says which
    stage(1, "token lengths of the data set")
    lengths.handle(args, cfg)
    stage(2, f"a short real CPU run to calibrate ({cal_steps} steps, {cfg.queue.min_ready}/{cfg.queue.max_depth} "
             f"{cfg.queue.policy})")
    cal_run = out / "calibration-run"
    if not (cal_run / "metrics.json").is_file():
        if cal_run.exists():
            import shutil

            shutil.rmtree(cal_run)
        from dflash.pipeline.trainer import JobFailed, train

        # the rank job dflash train runs (1 + 1 is two processes): calibration reads the records of ranks
        try:
            train(with_overrides(cfg, {"train.max_steps": cal_steps}), cal_run, quiet=False)
        except JobFailed as exc:  # the failing rank's one line (its traceback is in the run's .ranks)
            print(f"dflash demo: error: {exc}", file=sys.stderr)
            return 1
    stage(3, "calibrate the simulator")
    from simulator.calibration import apply_calibration, calibrate, format_calibration, write_calibration

    cal_path = out / "calibration.json"
    data = calibrate([cal_run], cfg, seed=cfg.seed)
    write_calibration(data, cal_path)
    print(format_calibration(data))
    calibrated = apply_calibration(cfg, cal_path)
    stage(4, "simulate baseline and handpicked with the calibration (one simulated hour each)")
    demo_simulate(calibrated)
    stage(5, "sweep the queue knobs over the calibrated simulator (Optuna, NSGA-II)")
    selection = demo_sweep(out, calibrated, str(cal_path))
    if selection is None:
        return 2
    # a quarter of the budget per block, but never under 10 takes: a shorter block has too few windows of
    # taken items for a mix_efficiency, and a config without one cannot be compared or recommended
    block_takes = max(min(takes, 10), takes // 4)
    stage(6, f"validate the chosen config, baseline and handpicked on the real trainer (blocks of {block_takes} "
             f"takes, alternating, at most {takes} takes each)")
    import json

    from tuning.validate import ValidateArgs, claims_url_for, format_validation, progress_printer, run_validation

    sel = json.loads(Path(selection).read_text())
    keep = [c for c in sel["configs"] if c["name"] in ("tuned-1", "baseline", "handpicked")]
    val_out = out / "validation"
    vargs = ValidateArgs(selection={**sel, "configs": keep}, selection_path=str(selection), takes=takes,
                         out=val_out, calibration=str(cal_path), claims_url=claims_url_for(None, val_out),
                         block_takes=block_takes,
                         prompts=cfg.train.eval_prompts)
    payload = run_validation(cfg, vargs, progress=progress_printer)
    if payload is not None:
        print(format_validation(payload))
    stage(7, "write the report")
    from reports.build import build_report

    html, md = build_report([out], out / "report", cfg)
    print(f"\ndone in {time.perf_counter() - t0:.0f} s.\nreport: {html}\n(markdown twin: {md})")
    if payload is not None:
        print(evidence_summary(payload))
    if payload is not None and payload.get("command"):
        print(f"launch the validated training run:\n  {payload['command']}")
    return 0


def evidence_summary(payload: dict) -> str:
    """Which comparisons the validation resolved, and what it recommends because of it."""
    comps = payload.get("comparisons") or []
    done = [f"{c['against']} on {c['objective']}" for c in comps if c["resolved"]]
    open_ = [f"{c['against']} on {c['objective']}" for c in comps if not c["resolved"]]
    rec = payload.get("recommendation") or {}
    lines = [f"evidence ({payload.get('tested') or 'no tuned config'} tested in {payload.get('rounds')} rounds): "
             f"{len(done)} of {len(comps)} comparisons resolved"
             + (f" ({', '.join(done)})" if done else "") + (f"; not resolved: {', '.join(open_)}" if open_ else "")]
    if rec.get("words"):
        lines.append(f"recommendation: {rec['words']}")
    return "\n".join(lines)


def demo_sweep(out: Path, cfg: DflashConfig, calibration: str | None) -> Path | None:
    """The sweep stage; None (after one line on stderr) when no configuration is feasible: there is
    nothing to validate, and what ran so far stays for a rerun with other limits."""
    from dflash.cli.command import one_line
    from tuning.sweep import NoFeasibleTrial, SweepArgs, format_result, run_sweep

    # A short study: at most 40 trials x 2 seeds x 30 simulated minutes (less if the config asks for less).
    cfg = with_overrides(cfg, {"sweep.seeds_per_trial": min(cfg.sweep.seeds_per_trial, 2),
                               "sweep.sim_seconds": min(cfg.sweep.sim_seconds, 1800.0)})
    sargs = SweepArgs(trials=min(cfg.sweep.trials, 40), storage=str(out / "sweep" / "study.journal"), study="demo",
                      workers=1, grid=False, out=out / "sweep", calibration=calibration)
    try:
        res = run_sweep(cfg, sargs, progress=sys.stderr.isatty())
    except NoFeasibleTrial as exc:
        print(one_line(f"dflash demo: error: {exc}"), file=sys.stderr)
        return None
    print(format_result(res, False, cfg))
    return Path(res["selection"])




def demo_simulate(cfg: DflashConfig) -> None:
    from dflash.core.named_configs import NAMED_CONFIGS
    from simulator.run import simulate
    from simulator.workload import make_sampler

    sampler = make_sampler(cfg.workload, cfg.target.model, cfg.seed, cfg.drafter.block_size)
    rows = []
    for name, knobs in NAMED_CONFIGS.items():
        c = with_overrides(cfg, {f"queue.{k}": v for k, v in knobs.items()})
        m = simulate(c, sampler, sim_seconds=3600.0).metrics
        rows.append((f"{name} {knobs['min_ready']}/{knobs['max_depth']}", m))
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


VERB = Verb("the main job, end to end", cpu_profile=True, opts=(
        Opt("--out", "outdir", "output directory (default: dflash-demo)", metavar="DIR"),
        Opt("--takes", "int", "takes per validated config (>= 1; default 100)", lo=1, metavar="N"),
        Opt("--cal-steps", "int", "steps of the calibration run (>= 30; default 120)", lo=30, metavar="N"),
    ))
