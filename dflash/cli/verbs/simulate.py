"""``dflash simulate``: One simulated run: the trainer's queue and sampler code on SimPy's clock."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from dflash.cli.options import CALIBRATION, Opt, Verb
from dflash.core.config import DflashConfig


def handle(args: argparse.Namespace, cfg: DflashConfig) -> int:
    """One simulated run: the trainer's queue and sampler code on SimPy's clock."""
    import json

    from dflash.core.sampler import heldout_per_bucket
    from simulator.calibration import apply_calibration
    from simulator.run import simulate
    from simulator.workload import make_sampler

    cfg = apply_calibration(cfg, args.calibration)
    sim_seconds = float(args.sim_seconds) if args.sim_seconds is not None else 3600.0
    sampler = make_sampler(cfg.workload, cfg.target.model, cfg.seed, cfg.drafter.block_size,
                           heldout_per_bucket(cfg))
    bar = Progress(sim_seconds)
    result = simulate(cfg, sampler, sim_seconds=sim_seconds, records_dir=args.records, progress=bar)
    bar.close()
    m, s = result.metrics, result.summary
    q = cfg.queue
    auto = f" (start; autopilot holds mix_efficiency {q.target_mix_efficiency:g})" if q.mode == "auto" else ""
    print(f"simulated {sim_seconds:g} s in {result.wall_s:.2f} s wall "
          f"({sim_seconds / max(result.wall_s, 1e-9):,.0f}x): {cfg.cluster.n_target} targets, "
          f"{cfg.cluster.n_drafter} drafters ({cfg.cluster.drafter_sync}), min_ready {q.min_ready}, "
          f"max_depth {q.max_depth}{auto}, policy {q.policy}, gate {q.gate}")
    if not m.get("steady_state_reached"):
        print("steady state not reached: depth never reached min_ready before the end")
    else:
        print(format_metrics(m))
    print(f"accounting: produced {s['produced']} = trained {s['trained']} + skipped_no_anchors "
          f"{s['skipped_no_anchors']} + discarded_at_stop {s['discarded_at_stop']}; stranded at stop: {s['stranded']}")
    print(format_memory(cfg, m))
    if q.mode == "auto":
        print(format_autopilot(result.controls, m))
    payload = {"config": cfg.to_dict(), "sim_seconds": sim_seconds, **result.as_json()}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(payload, indent=1, default=str))
        print(f"metrics JSON: {args.json}")
    if args.records:
        print(f"records: {args.records}")
    if args.plot:
        from simulator.plot import plot_queue

        knobs = "auto" if q.mode == "auto" else f"min_ready {q.min_ready}, max_depth {q.max_depth}"
        title = (f"{knobs}, {q.policy}: "
                 f"mix_efficiency {m.get('mix_efficiency', float('nan')):.3f}")
        plot_queue(result.series, result.bucket_bounds, args.plot, window=cfg.metrics.window, title=title)
        print(f"plot: {args.plot}")
    return 0


def format_autopilot(controls: list[dict[str, Any]], m: dict[str, Any]) -> str:
    """The autopilot's changes in one line: how many, where it ended, the last reason."""
    end = f"min_ready {m.get('final_min_ready')}, max_depth {m.get('final_max_depth')}"
    if not controls:
        return f"autopilot: no change ({end})"
    last = controls[-1]["reason"]
    knob = "min_ready sets the mix" if last["min_ready_binds"] else "min_ready does not bind, max_depth sets the mix"
    return (f"autopilot: {len(controls)} changes, ended at {end} ({last['bound']}-bound: {knob}"
            f"; last: {last['rule']} at t {controls[-1]['t']:.0f} s); control records with --records")


PROGRESS_AFTER_S = 3.0  # wall seconds before a run starts reporting progress on stderr


class Progress:
    """Simulated time done, wall time and time left, on stderr, once a run has taken a few seconds."""

    def __init__(self, total_s: float, stream: Any = None) -> None:
        self.total, self.t0, self.last = total_s, time.perf_counter(), -1.0
        self.stream = stream or sys.stderr
        self.shown = False

    def __call__(self, sim_t: float) -> None:
        wall = time.perf_counter() - self.t0
        if wall < PROGRESS_AFTER_S or wall - self.last < 1.0:
            return
        self.last, self.shown = wall, True
        left = wall * (self.total - sim_t) / max(sim_t, 1e-9)
        print(f"simulated {sim_t / 3600:,.2f} of {self.total / 3600:,.2f} h ({100 * sim_t / self.total:.0f}%), "
              f"{wall:.0f} s wall, ~{left:.0f} s left", file=self.stream, flush=True)

    def close(self) -> None:
        if self.shown:
            print(f"simulated {self.total / 3600:,.2f} h in {time.perf_counter() - self.t0:.1f} s wall",
                  file=self.stream, flush=True)


def format_memory(cfg: DflashConfig, m: dict[str, Any]) -> str:
    """The per-device memory model at the peaks this run saw."""
    from dflash.core.memory_model import device_memory

    devices = device_memory(cfg, producer_bytes=m.get("peak_producer_bytes"),
                            drafter_bytes=m.get("peak_drafter_bytes"))
    missing = sorted({x for d in devices for x in d.not_counted})
    return "memory per device: " + "; ".join(d.describe() for d in devices) + (
        f"; not counted: {', '.join(missing)}" if missing else "")


def format_metrics(m: dict[str, Any]) -> str:
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


VERB = Verb("one simulated run", queue_flags=True, pins_data=True, opts=(
        Opt("--n-target", "int", "target workers (>= 1)", key="cluster.n_target", metavar="N"),
        Opt("--n-drafter", "int", "drafter workers (>= 1)", key="cluster.n_drafter", metavar="N"),
        Opt("--sim-seconds", "float", "simulated seconds (> 0)", lo=0, metavar="S"),
        CALIBRATION,
        Opt("--json", "outfile", "write the metrics JSON here", metavar="OUT"),
        Opt("--records", "outdir", "write the run records (JSONL) here", metavar="DIR"),
        Opt("--plot", "outfile", "write a plot of the queue here", metavar="OUT"),
    ))
