"""``dflash demo``: the main job, in the issue's order: lengths, a real calibration run, simulate the
named configs, sweep with the calibration, validate the chosen config next to baseline and handpicked,
report; the answer last.

The budget (issue #32): at most 10 minutes from empty caches and 8 warm on 2 CPU cores. Where the time
goes (benchmarks/RESULTS.md, "demo"): almost all of it is target forwards on the CPU, one rank producing
an item every ~0.6 s on a quiet machine, so every stage is counted in items the target must produce.

- the calibration run: ``min_ready`` = 30 items to fill the queue, then one item per step. The timing fit
  needs >= 20 observations per role (``simulator.fit.MIN_OBSERVATIONS``); 50 steps give ~80 target items
  and 50 drafter takes. Calibrated on the first 30, 40, 50 and 60 steps of one run
  (``benchmarks/cal_steps.py``, RESULTS.md "demo"), the simulated differences the decision uses moved by
  at most 1.7 points of throughput and 0.019 of mix_efficiency over 30-60 steps, and by 0.6 points and
  0.008 from 50 to 60: inside the simulator's τ on a difference (4.9%, 0.011), which the decision adds
  anyway. More steps cost a second each for changes τ already covers;
- the validation: per configuration ``min_ready`` items before its first take (the sweep may pick up to
  120), then its takes; ``CAL_STEPS`` and ``TAKES`` are sized so that three configurations with the largest
  fill still end inside the budget. ``TAKES`` = one ``mega_batch`` (64 takes) per configuration: one paired
  round. At that budget the hardware mostly *checks* the simulator (the decision says so: its confidence
  comes from the simulator, with the hardware's gap z beside it); more takes (``--takes 128``, ...) buy
  paired rounds and hardware power, at ~0.6-1.9 s per take per configuration.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from dflash.cli.options import Opt, Verb
from dflash.cli.verbs import lengths
from dflash.core.config import DflashConfig, with_overrides

DEMO_STEPS = 7
CAL_STEPS = 50  # see the module's docstring: the simulated differences moved <= 0.6 points / 0.008 from 50 to 60
TAKES = 64  # one mega_batch per validated configuration: one paired round (the docstring says why)
VALIDATED = ("tuned-1", "baseline", "handpicked")
# No tau for the validated drafters: a drafter trained for one block of 64 takes has tau ~1 (1.00-1.09 on the
# last measured demo), tau is no objective of the decision, and speculative decoding on the CPU cost ~6 s per
# configuration on one prompt (RESULTS.md "demo"); `dflash eval` measures a drafter that trained long enough.
TAU_PROMPTS = 0


class StageClock:
    """The demo's stage lines with wall and CPU seconds, so a slow run says where its time went.

    CPU is this process plus the children it has waited for (the trainer's ranks and jobs), from
    :func:`os.times`; on a shared machine wall time grows with the others' load, CPU time much less.
    """

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.rows: list[tuple[str, float, float]] = []
        self._open: tuple[str, float, float] | None = None

    @staticmethod
    def cpu() -> float:
        t = os.times()
        return t.user + t.system + t.children_user + t.children_system

    def stage(self, k: int, name: str, title: str) -> None:
        self.close()
        now = time.perf_counter()
        print(f"\n== {k}/{DEMO_STEPS} {title} ({now - self.t0:.0f} s so far, {time.strftime('%H:%M:%S')}) ==",
              flush=True)
        self._open = (name, now, self.cpu())

    def close(self) -> None:
        if self._open is not None:
            name, w, c = self._open
            self.rows.append((name, time.perf_counter() - w, self.cpu() - c))
            self._open = None

    def summary(self) -> str:
        self.close()
        parts = ", ".join(f"{n} {w:.0f} s ({c:.0f} s CPU)" for n, w, c in self.rows)
        return f"stages (wall, CPU of this process and its finished children): {parts}"


def handle(args: argparse.Namespace, cfg: DflashConfig) -> int:
    """The main job, in the issue's order: lengths, a real calibration run, simulate the named configs,
    sweep with the calibration, validate the chosen config next to baseline and handpicked, report; the
    last two lines answer the question (the same two sentences as the report's first section)."""
    out = Path(args.out) if args.out else Path("dflash-demo")
    takes = int(args.takes) if args.takes is not None else TAKES
    cal_steps = int(args.cal_steps) if args.cal_steps is not None else CAL_STEPS
    clock = StageClock()

    from dflash.data.dataset_choice import pin_dataset
    from tuning.validation.job import preflight

    preflight(cfg, force=bool(args.force))  # before any stage: the calibration and validation jobs run here
    cfg = pin_dataset(cfg, say=lambda _line: None)  # every stage and run reads one file; stage 1 says which
    clock.stage(1, "lengths", "token lengths of the data set")
    lengths.handle(args, cfg)
    clock.stage(2, "calibration run", f"a short real CPU run to calibrate ({cal_steps} steps, "
                f"{cfg.queue.min_ready}/{cfg.queue.max_depth} {cfg.queue.policy})")
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
    clock.stage(3, "calibrate", "calibrate the simulator")
    from simulator.calibration import apply_calibration, calibrate, format_calibration, write_calibration

    cal_path = out / "calibration.json"
    data = calibrate([cal_run], cfg, seed=cfg.seed)
    write_calibration(data, cal_path)
    print(format_calibration(data))
    calibrated = apply_calibration(cfg, cal_path)
    clock.stage(4, "simulate", "simulate baseline and handpicked with the calibration (one simulated hour each)")
    demo_simulate(calibrated)
    clock.stage(5, "sweep", "sweep the queue knobs over the calibrated simulator (Optuna, NSGA-II)")
    selection = demo_sweep(out, calibrated, str(cal_path))
    if selection is None:
        return 2
    import json

    from tuning.validation.job import run_validation
    from tuning.validation.plan import ValidateArgs, block_rule, claims_url_for
    from tuning.validation.summary import format_validation, progress_printer

    block_takes, block_reason = block_rule(cfg, takes)  # validate's own rule: whole mega-batches holding a window
    clock.stage(6, "validation", f"validate {', '.join(VALIDATED)} on the real trainer ({takes} takes each in "
                f"paired rounds of {block_takes})")

    sel = json.loads(Path(selection).read_text())
    keep = [c for c in sel["configs"] if c["name"] in VALIDATED]
    val_out = out / "validation"
    vargs = ValidateArgs(selection={**sel, "configs": keep}, selection_path=str(selection), takes=takes,
                         out=val_out, calibration=str(cal_path), claims_url=claims_url_for(None, val_out),
                         block_takes=block_takes, block_reason=block_reason,
                         prompts=TAU_PROMPTS, force=bool(args.force))
    payload = run_validation(cfg, vargs, progress=progress_printer)
    if payload is not None:
        print(format_validation(payload))
    clock.stage(7, "report", "write the report")
    from reports.build import build_report

    html, md = build_report([out], out / "report", cfg)
    print(f"\ndone in {time.perf_counter() - clock.t0:.0f} s.\n{clock.summary()}\nreport: {html}\n"
          f"(markdown twin: {md})")
    if payload is not None and payload.get("command"):
        print(f"launch the validated training run:\n  {payload['command']}")
    if payload is not None:
        print(answer_lines(payload))
    return 0


def answer_lines(payload: dict) -> str:
    """The last lines: the validation's two sentences (:func:`reports.answer.answer_of`, the report's
    first section says the same), or, for a validation without a decision, what it resolved."""
    from reports.answer import answer_of

    answer = answer_of(payload)
    if answer is not None:
        return "\n".join(answer)
    return evidence_summary(payload)


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
        Opt("--takes", "int", f"takes per validated config (>= 1; default {TAKES}, one mega_batch)", lo=1,
            metavar="N"),
        Opt("--cal-steps", "int", f"steps of the calibration run (>= 30; default {CAL_STEPS})", lo=30, metavar="N"),
        Opt("--force", "switch", "run even where the memory model says a device would not hold the jobs"),
    ))
