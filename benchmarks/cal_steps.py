"""How many calibration steps does the demo need? Calibrate on the first N steps of one real run.

``dflash demo`` trains for ``--cal-steps`` steps to calibrate the simulator, and on 2 CPU cores every
step is about a target forward (~0.6 s quiet). This cuts one real run's records at step N (as if the
run had stopped there: takes and steps before N, produce records finished by the last kept take),
calibrates the simulator on each cut, and prints what the decision would see from each: the fitted
rates with their fit errors, and the calibrated simulator's throughput and mix_efficiency for the
demo's reference configurations (baseline 10/30, handpicked 30/90 and a large proportional 92/180)
over seeds, with the differences against baseline. If the differences at N agree with those at the
full run within τ (:mod:`tuning.validation.model_error`), the longer calibration buys the decision
nothing.

    dflash train --config examples/cpu-smollm2.toml --max-steps 120 --out RUN
    python benchmarks/cal_steps.py RUN --steps 30 60 90 120
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import tempfile
from pathlib import Path

from dflash.core.config import DflashConfig, with_overrides
from dflash.core.records import read_records
from dflash.core.run_config import load_run_config

CONFIGS = {"baseline": {"min_ready": 10, "max_depth": 30, "policy": "random_item"},
           "handpicked": {"min_ready": 30, "max_depth": 90, "policy": "random_item"},
           "prop-92-180": {"min_ready": 92, "max_depth": 180, "policy": "proportional"}}
OBJECTIVES = ("throughput_tokens_per_s", "mix_efficiency")


def cut_run(run: Path, steps: int, out: Path) -> Path:
    """A copy of ``run``'s records as if it had stopped after ``steps`` steps."""
    out.mkdir(parents=True)
    shutil.copy(run / "config.json", out / "config.json")
    takes = [r for r in read_records(run, "take") if r["step"] is not None and int(r["step"]) < steps]
    t_cut = max(float(r["t"]) + float(r.get("compute_s") or 0.0) for r in takes)
    kinds = {"take": takes, "step": [r for r in read_records(run, "step") if int(r["step"]) < steps],
             "produce": [r for r in read_records(run, "produce") if float(r["t_end"]) <= t_cut]}
    for kind, rows in kinds.items():
        (out / f"{kind}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


def predictions(cfg: DflashConfig, seeds: int, sim_seconds: float) -> dict[str, dict[str, list[float]]]:
    from simulator.run import simulate
    from simulator.workload import make_sampler

    out: dict[str, dict[str, list[float]]] = {}
    for name, knobs in CONFIGS.items():
        c = with_overrides(cfg, {f"queue.{k}": v for k, v in knobs.items()})
        vals: dict[str, list[float]] = {o: [] for o in OBJECTIVES}
        for s in range(seeds):
            cs = with_overrides(c, {"seed": 1000 + s})
            m = simulate(cs, make_sampler(cs.workload, cs.target.model, cs.seed, cs.drafter.block_size),
                         sim_seconds=sim_seconds).metrics
            for o in OBJECTIVES:
                vals[o].append(float(m[o]))
        out[name] = vals
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path, help="a real run directory (dflash train --out RUN)")
    ap.add_argument("--steps", type=int, nargs="+", default=[30, 60, 90, 120])
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--sim-seconds", type=float, default=1800.0)
    args = ap.parse_args(argv)
    from simulator.calibration import apply_calibration, calibrate, write_calibration

    cfg = load_run_config(args.run, "RUN")
    print(f"{'steps':>5} {'target items':>12} {'target us/token':>15} {'MAPE':>6} {'drafter ms/anchor':>17} "
          f"{'MAPE':>6}  " + "  ".join(f"{n + ' tok/s, mix':>26}" for n in CONFIGS)
          + "  diff vs baseline (tok/s %, mix)")
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.steps:
            cut = cut_run(args.run, n, Path(tmp) / f"cut-{n}")
            data = calibrate([cut], cfg, seed=cfg.seed)
            path = write_calibration(data, Path(tmp) / f"cal-{n}.json")
            t, fit = data["timing"], data["fit"]
            pred = predictions(apply_calibration(cfg, path, warn=False), args.seeds, args.sim_seconds)
            mean = {k: {o: statistics.fmean(v[o]) for o in OBJECTIVES} for k, v in pred.items()}
            cells = "  ".join(f"{mean[k]['throughput_tokens_per_s']:>17,.1f}, {mean[k]['mix_efficiency']:.3f}"
                              for k in CONFIGS)
            b = mean["baseline"]
            diffs = "; ".join(
                f"{k} {100 * (mean[k]['throughput_tokens_per_s'] / b['throughput_tokens_per_s'] - 1):+.1f}%, "
                f"{mean[k]['mix_efficiency'] - b['mix_efficiency']:+.3f}" for k in CONFIGS if k != "baseline")
            print(f"{n:>5} {fit['target']['n']:>12} {t['target_per_token_s'] * 1e6:>15.1f} "
                  f"{100 * fit['target']['mape']:>5.1f}% {t['drafter_per_anchor_s'] * 1e3:>17.2f} "
                  f"{100 * fit['drafter']['mape']:>5.1f}%  {cells}  {diffs}")
            if not all(math.isfinite(x) for v in mean.values() for x in v.values()):
                print("  (a prediction is not finite)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
