"""Pipeline efficiency: the rank job against each side's capacity alone, one run.

Run: python benchmarks/pipeline_efficiency.py [--items N] [--config FILE] [--ranks T+D]
With the CPU profile (SmolLM2 + ShareGPT first exchanges) and ``--ranks T+D`` (default ``1+1``:
two processes, as ``dflash train`` runs it; issues #4, #14, #26): one target rank's item time and
one drafter rank's step time alone in this process (each with one rank's thread allotment:
cores // (T + D)), the sides' capacities T / target s/item and D / drafter s/item, then the real job
on T + D processes (min-ready 1, so no fill time is charged to it); pipeline items/s comes from its
take records over the span after the queue first reached min-ready. Goal (issue #4): >= 0.9 of the
slower side on the CPU, >= 0.95 on a GPU.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from dflash.core.config import load_config, with_overrides

PROFILE = Path(__file__).resolve().parent.parent / "dflash" / "profiles" / "cpu-smollm2.toml"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--items", type=int, default=40)
    ap.add_argument("--config", default=str(PROFILE))
    ap.add_argument("--ranks", default="1+1", help="T+D: T target and D drafter ranks (default 1+1)")
    distributed(ap.parse_args())


def distributed(args: argparse.Namespace) -> None:
    import os

    from dflash.core.records import read_records
    from dflash.model.drafter import DFlashDrafter, DrafterSpec, default_mask_token_id
    from dflash.model.target import HiddenStateCapture, capture_layer_ids, load_target
    from dflash.pipeline.trainer import train
    from dflash.pipeline.training_data import TrainingData
    from dflash.pipeline.workers import capture_item, item_generator

    n_t, n_d = (int(x) for x in args.ranks.split("+"))
    n = args.items
    steps = max(2, n // n_d)
    cfg = with_overrides(load_config(args.config), {
        "cluster.n_target": n_t, "cluster.n_drafter": n_d, "train.max_steps": steps, "queue.min_ready": 1,
        "queue.max_depth": max(90, n + 1), "train.log_every": 10**6, "train.checkpoint_every": 10**6})
    threads = cfg.train.cpu_threads or max(1, (os.cpu_count() or 2) // (n_t + n_d))
    torch.set_num_threads(threads)
    target = load_target(cfg.target.model)
    layers = capture_layer_ids(target.num_layers, cfg.target.capture_layers)
    capture = HiddenStateCapture(target.model, layers)
    data = TrainingData(cfg, target.tokenizer)
    specs = list(data.sampler.epoch(0)[:n])

    def target_alone() -> tuple[float, list]:
        t0 = time.perf_counter()
        made = [capture_item(data, target, capture, s, torch.device("cpu"), torch.float32) for s in specs]
        return (time.perf_counter() - t0) / n, made

    target_alone()  # tokenisation cached, caches warm
    target_s, items = target_alone()
    spec = DrafterSpec.from_target_config(target.config, target_layer_ids=layers,
                                          mask_token_id=default_mask_token_id(target.tokenizer), drafter=cfg.drafter)
    drafter = DFlashDrafter.from_target(target.model, spec, device="cpu", dtype=torch.float32)
    opt = torch.optim.AdamW(drafter.trainable_parameters(), lr=cfg.train.lr)
    t0 = time.perf_counter()
    for s, (hidden, ids, mask, loss_mask) in zip(specs, items, strict=True):
        drafter.loss(hidden, ids, loss_mask, mask, generator=item_generator(cfg.seed, s.item_id)).loss_sum.backward()
        opt.step()
        opt.zero_grad()
    drafter_s = (time.perf_counter() - t0) / n
    del items
    out = Path(tempfile.mkdtemp()) / "run"
    t0 = time.perf_counter()
    train(cfg, out)
    wall = time.perf_counter() - t0
    target_after, _ = target_alone()  # again after the job: load drift on a shared machine shows
    target_s = (target_s + target_after) / 2
    takes = sorted(read_records(out, "take"), key=lambda r: r["t"])
    ready = next((k for k, r in enumerate(takes) if r["depth_before"] >= cfg.queue.min_ready), 0)
    span = takes[-1]["t"] + takes[-1]["compute_s"] - takes[ready]["t"]
    rate = sum(len(r["item_ids"]) for r in takes[ready:]) / span
    cap = {"target side": n_t / target_s, "drafter side": n_d / drafter_s}
    print(f"{n} items, {n_t} target + {n_d} drafter ranks, {threads} torch thread(s) per rank, "
          f"profile {Path(args.config).name}, job wall {wall:.0f} s with start-up")
    print(f"  target rank alone   {1 / target_s:6.3f} items/s  ({target_s:5.2f} s/item; mean of before and after "
          f"the job) -> side capacity {cap['target side']:.3f} items/s")
    print(f"  drafter rank alone  {1 / drafter_s:6.3f} items/s  ({drafter_s:5.2f} s/item) -> side capacity "
          f"{cap['drafter side']:.3f} items/s")
    print(f"  distributed job     {rate:6.3f} items/s over {span:.1f} s of takes")
    print(f"pipeline / slower side's capacity: {rate / min(cap.values()):.3f}  (goal >= 0.9)")


if __name__ == "__main__":
    main()
