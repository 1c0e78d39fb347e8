"""Pipeline efficiency: the full target->queue->drafter pipeline against each stage alone, one run.

Run: python benchmarks/pipeline_efficiency.py [--items N] [--config FILE]
With the CPU profile (SmolLM2 + ShareGPT first exchanges), measures in one process:
  (1) the target alone producing N items (same thread allotment as inside the pipeline),
  (2) the drafter alone training N steps on pre-made items,
  (3) the full pipeline training N steps (min-ready 1, so no fill time is charged to it),
and prints pipeline items/s as a fraction of the slower stage alone. Goal (issue #4): >= 0.9 on
the CPU, >= 0.95 on a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
from pathlib import Path

import torch

from dflash.core.config import QueueConfig, load_config, with_overrides
from dflash.pipeline.trainer import Trainer

PROFILE = Path(__file__).resolve().parent.parent / "dflash" / "profiles" / "cpu-smollm2.toml"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--items", type=int, default=40)
    ap.add_argument("--config", default=str(PROFILE))
    args = ap.parse_args()
    n = args.items
    cfg = with_overrides(load_config(args.config), {"train.max_steps": n, "queue.min_ready": 1,
                                                    "queue.max_depth": max(90, n + 1), "train.log_every": 10**6})
    tmp = Path(tempfile.mkdtemp())

    tr = Trainer(cfg, tmp / "alone", progress=None)
    threads = torch.get_num_threads()
    specs = list(tr.sampler.epoch(0)[:n])
    dev = torch.device(cfg.target.devices[0])
    t0 = time.perf_counter()
    items = [tr.make_item(s, dev) for s in specs]
    target_s = time.perf_counter() - t0

    for k, it in enumerate(items):
        tr.queue.put(it, worker=0)
        del k
    t0 = time.perf_counter()
    for step in range(n):
        tr.train_step(step)
    drafter_s = time.perf_counter() - t0
    tr.queue.stop()

    cfg_full = dataclasses.replace(cfg, queue=QueueConfig(**{**cfg.queue.__dict__, "min_ready": 1}))
    full = Trainer(cfg_full, tmp / "full", progress=None, target=tr.target)
    t0 = time.perf_counter()
    res = full.run()
    pipeline_s = time.perf_counter() - t0
    trained = res.summary["trained"]

    rate = {"target alone": n / target_s, "drafter alone": n / drafter_s, "pipeline": trained / pipeline_s}
    slower = min(rate["target alone"], rate["drafter alone"])
    print(f"{n} items, torch threads per role {threads}, profile {Path(args.config).name}")
    for name, r in rate.items():
        print(f"  {name:<14} {r:6.3f} items/s  ({1 / r:5.2f} s/item)")
    print(f"pipeline / slower stage alone: {rate['pipeline'] / slower:.3f}")
    print(f"(pipeline wall {pipeline_s:.1f} s includes its start-up; steady-state items/s from the records: "
          f"{res.metrics.get('items_per_s', float('nan')):.3f})")


if __name__ == "__main__":
    main()
