"""GPU check: the real pipeline pieces on a GPU, with only torch and transformers installed.

Builds a randomly initialised model of a real 1-8B architecture from a config (weights and text do
not change timing), feeds synthetic token ids through target worker threads -> the bucketed
hidden-state queue -> DFlash drafter training steps on the GPU, and prints tokens/s, queue depths
and memory. No simpy, optuna, wandb, data set or network needed; finishes within ~4 minutes.

Run: bash scripts/gpu_check.sh        (or: python scripts/gpu_check.py --seconds 120)
CPU smoke test of the script itself: python scripts/gpu_check.py --device cpu --tiny --seconds 10
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import threading
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dflash.core.config import DrafterConfig, QueueConfig
from dflash.core.queue_core import QueueItem
from dflash.core.sampler import bucket_of
from dflash.model.drafter import DFlashDrafter, DrafterSpec
from dflash.model.target import HiddenStateCapture, capture_layer_ids
from dflash.pipeline.hsqueue import HSQueue

ARCHS = {
    # Llama-3.2-1B-like and Llama-3-8B-like shapes (random weights)
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512),
}
BOUNDS = (128, 256, 512, 1024, 2048)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", choices=sorted(ARCHS), default="1b")
    ap.add_argument("--tiny", action="store_true", help="the tiny architecture (CPU smoke test)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seconds", type=float, default=120.0)
    ap.add_argument("--seqs-per-item", type=int, default=4)
    ap.add_argument("--anchors", type=int, default=512)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--layers", type=int, default=1, help="draft layers")
    ap.add_argument("--min-ready", type=int, default=8)
    ap.add_argument("--max-depth", type=int, default=24)
    args = ap.parse_args()
    arch = "tiny" if args.tiny else args.arch
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    if dev.type == "cuda":
        print(f"device: {torch.cuda.get_device_name(dev)}; torch {torch.__version__}")
    cfg = LlamaConfig(**ARCHS[arch], max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with torch.device(dev):
        target = LlamaForCausalLM(cfg).to(dtype).eval()
    for p in target.parameters():
        p.requires_grad_(False)
    n_params = sum(p.numel() for p in target.parameters())
    print(f"target: random {arch} Llama, {n_params / 1e9:.2f} B params, built in {time.perf_counter() - t0:.1f} s")
    ids = capture_layer_ids(cfg.num_hidden_layers, 5 if cfg.num_hidden_layers >= 8 else 3)
    capture = HiddenStateCapture(target, ids)
    dcfg = DrafterConfig(layers=args.layers, block_size=args.block_size, anchors=args.anchors)
    spec = DrafterSpec.from_target_config(cfg, target_layer_ids=ids, mask_token_id=0, drafter=dcfg)
    drafter = DFlashDrafter.from_target(target, spec, device=dev, dtype=dtype)
    opt = torch.optim.AdamW(drafter.trainable_parameters(), lr=6e-4)
    max_len = 2048 if arch != "tiny" else 256
    bounds = BOUNDS if arch != "tiny" else (32, 64, 128, 256)
    queue = HSQueue(QueueConfig(min_ready=args.min_ready, max_depth=args.max_depth), len(bounds))
    rng = random.Random(0)
    stop = threading.Event()
    produced = [0]
    prod_tokens = [0]

    def producer() -> None:
        k = 0
        while not stop.is_set():
            lens = [min(max_len, max(32, int(rng.lognormvariate(math.log(max_len * 0.4), 0.6))))
                    for _ in range(args.seqs_per_item)]
            s = max(lens)
            input_ids = torch.randint(3, cfg.vocab_size, (len(lens), s), device=dev)
            attn = torch.zeros(len(lens), s, dtype=torch.long, device=dev)
            for r, n in enumerate(lens):
                attn[r, :n] = 1
            loss_mask = attn.bool().clone()
            loss_mask[:, : s // 2] = False  # the second half plays the response
            hidden = capture(input_ids, attn)
            item = QueueItem(f"0:{bucket_of(s, bounds)}:{k}", bucket_of(s, bounds), len(lens), sum(lens), s,
                             hidden.numel() * hidden.element_size(), (hidden, input_ids, attn, loss_mask))
            if queue.put(item, timeout=300) is None:
                return
            produced[0] += 1
            prod_tokens[0] += sum(lens)
            k += 1

    th = threading.Thread(target=producer, daemon=True)
    th.start()
    t_start = time.perf_counter()
    trained = tokens = steps = 0
    depths: list[int] = []
    last = t_start
    gen = torch.Generator().manual_seed(0)
    while time.perf_counter() - t_start < args.seconds:
        items = queue.take(timeout=300)
        if items is None:
            break
        depths.append(queue.qsize())
        loss_sum, counted = 0.0, 0
        for it in items:
            hidden, input_ids, attn, loss_mask = it.payload
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
                out = drafter.loss(hidden, input_ids, loss_mask, attn, generator=gen)
            out.loss_sum.backward()
            loss_sum += float(out.loss_sum.detach())
            counted += out.tokens
        for p in drafter.trainable_parameters():
            if p.grad is not None and counted:
                p.grad.div_(counted)
        torch.nn.utils.clip_grad_norm_(drafter.trainable_parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        queue.task_done(items)
        trained += len(items)
        tokens += sum(i.real_tokens for i in items)
        steps += 1
        now = time.perf_counter()
        if now - last > 15:
            last = now
            mem = f", GPU memory {torch.cuda.memory_allocated(dev) / 2**30:.1f} GiB" if dev.type == "cuda" else ""
            print(f"  {now - t_start:6.1f} s: step {steps}, loss {loss_sum / max(counted, 1):.3f}, "
                  f"trained tokens/s {tokens / (now - t_start):,.0f}, depth {queue.qsize()} "
                  f"{queue.bucket_sizes()}{mem}")
    wall = time.perf_counter() - t_start
    stop.set()
    queue.stop()
    th.join(60)
    s = queue.stats()
    print(f"result: {steps} steps in {wall:.1f} s; trained {trained} items, {tokens / wall:,.0f} tokens/s "
          f"({trained / wall:.2f} items/s); target produced {produced[0]} items "
          f"({prod_tokens[0] / wall:,.0f} tokens/s)")
    print(f"queue: mean depth {sum(depths) / max(len(depths), 1):.1f}, max {s['max_depth_seen']}, peak queued "
          f"{s['peak_queued_bytes'] / 2**30:.2f} GiB, producer blocked {s['producer_blocked_s']:.1f} s, "
          f"drafter gate wait {s['drafter_wait_s']:.1f} s; accounting produced {s['produced']} = trained "
          f"{s['trained']} + discarded_at_stop {s['discarded_at_stop']} + in flight {s['in_flight']}")
    if dev.type == "cuda":
        print(f"GPU peak memory allocated {torch.cuda.max_memory_allocated(dev) / 2**30:.1f} GiB")


if __name__ == "__main__":
    main()
