"""The drafter's training step alone, per attention path: step time, model FLOPs, FLOP/s, MFU, peak memory.

Why: issue 34's goal is a drafter MFU of at least 50% on the 8B-class shape (512 anchors x block 16), and
the flex block mask (``[drafter] attention``) is what should get it there; this measures both paths side by
side on one device, in one process, the same items for each. A random-weight drafter at the target's size
(no target model is loaded: only its embedding and LM head shapes matter), one optimizer step per item, in
the trainer's precision (float32 weights, bf16 autocast on CUDA).

    python benchmarks/drafter_mfu.py --shape qwen3-8b            # on a GPU: dense and flex
    python benchmarks/drafter_mfu.py --shape tiny --steps 3      # on the CPU: dense only (no flex backward)

Each step is timed between device synchronisations (a benchmark, not the trainer's hot path). The first
``--warmup`` steps (torch.compile's compilation for flex) are not timed. MFU is ``null`` on the CPU and on
a device the peak table (dflash.model.flops) does not know.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Qwen3-8B's sizes (its config.json) with the drafter of the 8B examples: 5 layers, 5 captured layers.
SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-8b": dict(hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=12288,
                     vocab_size=151936, target_layer_ids=(1, 9, 17, 25, 33), layers=5, block_size=16, anchors=512,
                     seq_len=4096, sequences=1),
    "tiny": dict(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128, vocab_size=256,
                 target_layer_ids=(1, 2), layers=2, block_size=8, anchors=8, seq_len=64, sequences=2),
}


def build(shape: dict[str, Any], attention: str, device: Any) -> Any:
    import torch

    from dflash.model.drafter import DFlashDrafter, DrafterSpec

    spec_kw = {k: v for k, v in shape.items() if k not in ("seq_len", "sequences")}
    spec = DrafterSpec(mask_token_id=4, attention=attention, **spec_kw)
    table_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    embed = torch.nn.Embedding(spec.vocab_size, spec.hidden_size).to(device, table_dtype)
    head = torch.nn.Linear(spec.hidden_size, spec.vocab_size, bias=False).to(device, table_dtype)
    return DFlashDrafter(spec, embed, head).to(device=device, dtype=torch.float32)


def item(shape: dict[str, Any], device: Any, seed: int) -> tuple[Any, ...]:
    """Random tokens and states; the prompt is the first eighth, every later position a response token."""
    import torch

    g = torch.Generator().manual_seed(seed)
    b, s = shape["sequences"], shape["seq_len"]
    k = len(shape["target_layer_ids"])
    ids = torch.randint(5, shape["vocab_size"], (b, s), generator=g).to(device)
    ctx = torch.randn(b, s, k * shape["hidden_size"], generator=g).to(device, torch.bfloat16 if device.type == "cuda"
                                                                          else torch.float32)
    am = torch.ones(b, s, dtype=torch.long, device=device)
    lm = (torch.arange(s, device=device) >= s // 8).expand(b, s).contiguous()
    return ctx, ids, lm, am


def run_backend(shape: dict[str, Any], attention: str, device: Any, steps: int, warmup: int) -> dict[str, Any]:
    import torch

    from dflash.model.flops import StepCounts, peak_for, step_efficiency, train_flops

    drafter = build(shape, attention, device)
    opt = torch.optim.AdamW(drafter.trainable_parameters(), lr=1e-4)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    times, flops = [], []
    for i in range(warmup + steps):
        ctx, ids, lm, am = item(shape, device, seed=i)
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            out = drafter.loss(ctx, ids, lm, am, generator=torch.Generator().manual_seed(i))
        out.loss_sum.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
            flops.append(train_flops(drafter.spec, StepCounts(int(am.sum()), out.anchors, out.context_seen,
                                                              out.tokens)))
    name = torch.cuda.get_device_name(device) if cuda else None
    step_s = statistics.median(times)
    rec = step_efficiency(statistics.median(flops), step_s, peak_for(name))
    return {"attention": attention, "device": str(device), "device_name": name, "steps": steps,
            "step_s_median": step_s, **rec,
            "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None}


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    import torch

    from dflash.model.attention import flex_available

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", type=Path, default=None, help="write the results here as well")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    backends = ["dense"] + (["flex"] if device.type == "cuda" and flex_available() else [])
    if "flex" not in backends:
        print(f"flex: not run on {device.type} (torch's flex_attention has a backward on CUDA only)", flush=True)
    results = []
    for attention in backends:
        res = {"shape": args.shape, **run_backend(SHAPES[args.shape], attention, device, args.steps, args.warmup)}
        print(json.dumps(res), flush=True)
        results.append(res)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
