"""How much of the target-bound example's mix_efficiency is the metric's window phase (issue #28's done-when).

Run: python benchmarks/window_phase.py [--seeds 0,1,2] [--shifts 16]

Why: the example's length-grouped loader sorts mega-batches of 64 items, twice the metric's window of
32, so the queue's takes carry a sawtooth of period 64 items. ``mix_efficiency`` tiles the takes into
consecutive windows from the first take of its span, and that span starts at ``[metrics] warmup_s``;
where the tiling falls on the sawtooth moves the measured mix of one and the same run. Moving
``warmup_s`` by a few seconds (about one take a second here) moves the tiling and nothing else: the
simulation is the same, only its measurement starts a few takes later.

Printed, on the packaged ShareGPT lengths, one simulated hour:
1. static pairs m/3m (m = 10..26, random_item) at ``warmup_s = 600``: mix_efficiency and mean queue GiB
   per seed (the curve issue #28's done-when picks its cheapest pair from);
2. 15/45, 16/48, 20/60, 25/75 and ``mode = "auto"`` at ``warmup_s = 600 + 4 j`` s for ``shifts`` values of j
   centred on 0: the lowest, mean and highest mix over those starts, and the mean queue GiB at 600.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

from dflash.core.config import load_config, with_overrides
from simulator.run import simulate
from simulator.workload import make_sampler

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "h200-target-bound.toml"
SIM_S = 3600.0
WARMUP_S = 600.0
SHIFT_S = 4.0  # about four takes at the example's ~0.94 items/s: 16 shifts cover two sawtooth periods
CURVE = range(10, 27)
PAIRS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("15/45", {"queue.min_ready": 15, "queue.max_depth": 45}),
    ("16/48", {"queue.min_ready": 16, "queue.max_depth": 48}),  # the most memory within 1.10x of 15/45's
    ("20/60", {"queue.min_ready": 20, "queue.max_depth": 60}),
    ("25/75", {"queue.min_ready": 25, "queue.max_depth": 75}),
    ("auto", {"queue.mode": "auto"}),
)


def metrics(seed: int, warmup_s: float, queue: dict[str, Any], samplers: dict[int, Any]) -> dict[str, Any]:
    cfg = with_overrides(load_config(EXAMPLE), {"seed": seed, "metrics.warmup_s": warmup_s, **queue})
    if seed not in samplers:
        samplers[seed] = make_sampler(cfg.workload, cfg.target.model, cfg.seed, cfg.drafter.block_size)
    return simulate(cfg, samplers[seed], sim_seconds=SIM_S).metrics


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--shifts", type=int, default=16)
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    samplers: dict[int, Any] = {}

    print(f"#### Static pairs m/3m at warmup_s = {WARMUP_S:.0f}: mix_efficiency (mean queue GiB), seeds "
          + ", ".join(map(str, seeds)) + "\n")
    print("| m | " + " | ".join(f"seed {s}" for s in seeds) + " |")
    print("| --- |" + " --- |" * len(seeds))
    for m in CURVE:
        cells = []
        for s in seeds:
            r = metrics(s, WARMUP_S, {"queue.min_ready": m, "queue.max_depth": 3 * m}, samplers)
            cells.append(f"{r['mix_efficiency']:.3f} ({r['mean_queue_bytes'] / 2**30:.1f})")
        print(f"| {m} | " + " | ".join(cells) + " |", flush=True)

    starts = [WARMUP_S + SHIFT_S * j for j in range(-(args.shifts // 2), args.shifts - args.shifts // 2)]
    print(f"\n#### The same runs measured from {len(starts)} starts, warmup_s = {starts[0]:.0f}..{starts[-1]:.0f} "
          f"s in steps of {SHIFT_S:.0f}: mix_efficiency lowest / mean / highest (at 600), mean queue GiB at 600\n")
    print("| config | " + " | ".join(f"seed {s}" for s in seeds) + " |")
    print("| --- |" + " --- |" * len(seeds))
    for label, queue in PAIRS:
        cells = []
        for s in seeds:
            mixes = [metrics(s, w, queue, samplers)["mix_efficiency"] for w in starts]
            at = metrics(s, WARMUP_S, queue, samplers)
            cells.append(f"{min(mixes):.3f} / {statistics.fmean(mixes):.3f} / {max(mixes):.3f} "
                         f"({at['mix_efficiency']:.3f}), {at['mean_queue_bytes'] / 2**30:.1f} GiB")
        print(f"| {label} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
