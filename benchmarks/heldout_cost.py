"""What the held-out quality metric (``[train] quality_every``) costs on the CPU profile.

The target's side runs once per run (one full forward per held-out sequence, on the first target
rank); each score is one drafter forward over the set. Both are timed here on the packaged SmolLM2
target and data, with the CPU profile's buckets and drafter, one thread (a rank's share of 2 cores),
against a freshly initialised drafter (the cost does not depend on what it learnt).

    python benchmarks/heldout_cost.py                      # 16 per bucket, windows of 16 and 32 anchors
    python benchmarks/heldout_cost.py --per-bucket 8 --anchors 32
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def cpu_heldout_setup(per_bucket: int, threads: int) -> tuple[Any, Any, list[int], Any, Any]:
    """The CPU profile's held-out set on the packaged SmolLM2 target, as a rank sees it: (config, target,
    captured layer ids, training data, held-out ids per bucket); ``threads`` intra-op threads."""
    import torch

    from dflash.cli.options import PROFILES
    from dflash.core.config import load_config, with_overrides
    from dflash.model.target import capture_layer_ids, load_target
    from dflash.pipeline.training_data import TrainingData

    torch.set_num_threads(threads)
    cfg = with_overrides(load_config(PROFILES / "cpu-smollm2.toml"), {"train.quality_every": 50,
                                                            "train.quality_per_bucket": per_bucket})
    target = load_target(cfg.target.model)
    layer_ids = capture_layer_ids(target.num_layers, cfg.target.capture_layers)
    data = TrainingData(cfg, target.tokenizer)
    return cfg, target, layer_ids, data, data.sampler.heldout


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--per-bucket", type=int, default=16, help="held-out sequences per bucket (>= 1)")
    ap.add_argument("--anchors", type=int, nargs="+", default=[16, 32], help="window sizes to score (>= 1)")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads (>= 1)")
    args = ap.parse_args(argv)
    for name, v in (("--per-bucket", [args.per_bucket]), ("--anchors", args.anchors), ("--threads", [args.threads])):
        if any(x < 1 for x in v):
            ap.exit(2, f"heldout_cost.py: error: {name} must be >= 1\n")

    import torch

    from dflash.model.drafter import DFlashDrafter, DrafterSpec, default_mask_token_id
    from dflash.model.heldout import prepare_heldout, score_heldout
    from dflash.model.target import HiddenStateCapture
    from dflash.pipeline.heldout import heldout_sequences

    cfg, target, layer_ids, data, held = cpu_heldout_setup(args.per_bucket, args.threads)
    t0 = time.perf_counter()
    states = prepare_heldout(target.model, HiddenStateCapture(target.model, layer_ids),
                             heldout_sequences(data, held), len(held), "cpu", torch.float32)
    prepare_s = time.perf_counter() - t0
    spec = DrafterSpec.from_target_config(target.config, target_layer_ids=layer_ids,
                                          mask_token_id=default_mask_token_id(target.tokenizer), drafter=cfg.drafter)
    drafter = DFlashDrafter.from_target(target.model, spec)
    scores = []
    for n in args.anchors:
        t0 = time.perf_counter()
        h = score_heldout(drafter, states, anchors=n)
        scores.append(f"{n} anchors {time.perf_counter() - t0:.1f} s ({h['blocks']} blocks)")
    print(f"heldout-cost: {len(states.sequences)} sequences ({[len(b) for b in held]} per bucket), target side "
          f"{prepare_s:.1f} s once; score: {'; '.join(scores)}; {args.threads} thread(s); "
          f"`python benchmarks/heldout_cost.py --per-bucket {args.per_bucket} --anchors "
          f"{' '.join(map(str, args.anchors))}`")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
