"""Drafter memory on the CPU: the loss unchunked (as before issue #25) against chunked, side by side,
and one whole training step against the memory model (:mod:`dflash.core.memory_model`).

Why in child processes: each measurement is the kernel's peak resident size of a fresh process
(``VmHWM``) minus its size once the model is built, so nothing an earlier case allocated (or
the allocator kept) is counted, and a case that needs 13 GB does not stay in the parent.

The case of issue #25: one 3,072-token sequence, 512 anchors, block 16, a 151,936-row vocabulary, a
random-initialised drafter with a small hidden size (the logits do not depend on it).

    python benchmarks/loss_memory.py                 # unchunked vs chunked (default 512 rows)
    python benchmarks/loss_memory.py --skip-unchunked  # the chunked case alone (the unchunked one needs ~14 GB)
    python benchmarks/loss_memory.py --model-check   # a training step against the memory model
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


@dataclass
class Case:
    """A drafter around a random target plus one item's tensors (``[b, S]`` / ``[b, S, K*d]``)."""

    drafter: Any
    ctx: Any
    ids: Any
    loss_mask: Any
    attention_mask: Any
    seed: int = 0
    last_tokens: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def build_case(*, hidden: int = 64, layers: int = 1, heads: int = 2, kv_heads: int | None = None,
               intermediate: int | None = None, vocab: int = 151_936, seq_len: int = 3072, seqs: int = 1,
               anchors: int = 512, block: int = 16, chunk: int = 512, capture: int = 5,
               checkpoint: bool = False) -> Case:
    """A float32 drafter (random weights, the target's tables untied) and one item whose every
    position after the first 16 is a response token, so each sequence gets its full ``anchors``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from dflash.core.config import DrafterConfig
    from dflash.model.drafter import DFlashDrafter, DrafterSpec

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate or 2 * hidden,
                      num_hidden_layers=capture, num_attention_heads=heads, num_key_value_heads=kv_heads or heads,
                      max_position_embeddings=seq_len + block, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(cfg)
    target = skeleton.to_empty(device="cpu")  # only the two tables are used: the layers stay uninitialised
    with torch.no_grad():
        target.get_input_embeddings().weight.normal_(0, 0.02)
        target.get_output_embeddings().weight.normal_(0, 0.02)
    target.requires_grad_(False)
    spec = DrafterSpec.from_target_config(cfg, target_layer_ids=tuple(range(capture)), mask_token_id=3,
                                          drafter=DrafterConfig(layers=layers, block_size=block, anchors=anchors,
                                                                loss_chunk_rows=chunk, checkpoint_layers=checkpoint))
    drafter = DFlashDrafter.from_target(target, spec, dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(4, vocab, (seqs, seq_len), generator=g)
    lm = torch.ones(seqs, seq_len, dtype=torch.bool)
    lm[:, :16] = False
    ctx = torch.randn(seqs, seq_len, capture * hidden, generator=g)
    return Case(drafter, ctx, ids, lm, torch.ones(seqs, seq_len, dtype=torch.long))


def unchunked_loss(drafter: Any, ctx: Any, ids: Any, lm: Any, am: Any, anchors: Any, valid: Any) -> tuple[Any, int]:
    """The loss as it was before chunking (``bb9a71a``): the full ``[rows, vocab]`` logits of every
    counted row, upcast to >= float32, then ``F.cross_entropy``. Returns ``(loss_sum, correct)``."""
    import torch
    import torch.nn.functional as F

    bs, s = drafter.spec.block_size, ids.shape[1]
    hidden = drafter.block_hidden(ctx, ids.gather(1, anchors), anchors, am.bool())
    tpos = anchors[:, :, None] + torch.arange(bs)
    tpos_c = tpos.clamp(max=s - 1)
    b = ids.shape[0]
    tgt = ids.gather(1, tpos_c.view(b, -1)).view(b, -1, bs)
    counted = (tpos < s) & lm.bool().gather(1, tpos_c.view(b, -1)).view(b, -1, bs) & valid[:, :, None]
    counted[:, :, 0] = False
    logits = drafter.logits(hidden[counted])
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    w = drafter.spec.slot_weights(dtype=logits.dtype).expand_as(counted)[counted]
    ce = F.cross_entropy(logits, tgt[counted], reduction="none")
    return (ce * w).sum(), int((logits.detach().argmax(-1) == tgt[counted]).sum())


def run_step(case: Case, mode: str = "chunked") -> None:
    """One forward + backward of the loss (``mode`` ``chunked``: the drafter's own; ``unchunked``:
    :func:`unchunked_loss` on the same anchors)."""
    import torch

    from dflash.model.drafter import sample_anchors

    gen = torch.Generator().manual_seed(case.seed)
    if mode == "chunked":
        out = case.drafter.loss(case.ctx, case.ids, case.loss_mask, case.attention_mask, generator=gen)
        out.loss_sum.backward()
        case.last_tokens = out.tokens
        return
    spec = case.drafter.spec
    anchors, valid = sample_anchors(case.loss_mask, spec.block_size, spec.anchors, gen, case.attention_mask.sum(1))
    loss, _ = unchunked_loss(case.drafter, case.ctx, case.ids, case.loss_mask, case.attention_mask, anchors, valid)
    loss.backward()
    case.last_tokens = int(valid.sum()) * (spec.block_size - 1)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _peak_rss() -> int:
    """This process image's peak resident size (VmHWM). Not ``ru_maxrss``: Linux carries that across
    exec from the forked parent, so a child of a large process (pytest after many tests: 1.2 GB) read
    the parent's size as its own peak."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def child(args: argparse.Namespace) -> dict[str, Any]:
    """Runs in a fresh process: the peak above the built model of one loss step (or a training step)."""
    import torch
    import transformers.models.llama.modeling_llama  # noqa: F401  (imported before the baseline)

    import dflash.model.drafter  # noqa: F401

    torch.set_num_threads(args.threads)
    kw = json.loads(args.case)
    base_process = _rss()
    case = build_case(**kw)
    params = sum(p.numel() for p in case.drafter.trainable_parameters())
    if args.mode == "train":
        opt = torch.optim.AdamW(case.drafter.trainable_parameters(), lr=1e-4)
    base = _rss()
    t0 = time.perf_counter()
    run_step(case, "chunked" if args.mode == "train" else args.mode)
    if args.mode == "train":
        opt.step()
    dt = time.perf_counter() - t0
    peak = _peak_rss()
    return {"mode": args.mode, "peak_above_model": peak - base, "peak_above_start": peak - base_process,
            "model_bytes": base - base_process, "seconds": dt, "tokens": case.last_tokens, "params": params}


def measure(mode: str, case: dict[str, Any], threads: int = 1, timeout: float = 900) -> dict[str, Any]:
    """:func:`child` in a fresh interpreter; its JSON result."""
    out = subprocess.run([sys.executable, __file__, "--child", mode, "--case", json.dumps(case),
                          "--threads", str(threads)], capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    if out.returncode != 0:
        raise RuntimeError(f"loss_memory child ({mode}) failed: {out.stderr.strip().splitlines()[-1:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


ISSUE_CASE = dict(hidden=64, layers=1, heads=2, vocab=151_936, seq_len=3072, anchors=512, block=16)
# A case where the draft layers' activations, weights and optimizer are a real share of the step:
# the memory model is held against the whole step, not only the logits.
MODEL_CASE = dict(hidden=256, layers=2, heads=4, kv_heads=2, intermediate=512, vocab=32_000, seq_len=1024, seqs=2,
                  anchors=128, block=16, chunk=512, capture=3)


def model_prediction(case: dict[str, Any], params: int) -> dict[str, float]:
    """The memory model's drafter device for ``case`` in float32 on the CPU, by part."""
    from dflash.core.config import config_from_dict
    from dflash.core.memory_model import drafter_device

    cfg = config_from_dict({
        "workload": {"seqs_per_item": case.get("seqs", 1), "max_len": case["seq_len"],
                     "bucket_bounds": [case["seq_len"]]},
        "target": {"capture_layers": case.get("capture", 5)},
        "drafter": {"layers": case["layers"], "block_size": case["block"], "anchors": case["anchors"],
                    "loss_chunk_rows": case.get("chunk", 512), "checkpoint_layers": case.get("checkpoint", False)},
        "timing": {"hidden_size": case["hidden"], "dtype_bytes": 4},
        "memory": {"drafter_params": float(params), "vocab_size": case["vocab"], "weight_bytes": 4,
                   "optimizer_bytes_per_param": 8, "logits_bytes": 4, "activation_bytes": 4,
                   "intermediate_size": case.get("intermediate") or 2 * case["hidden"],
                   "kv_width": (case.get("kv_heads") or case["heads"]) * case["hidden"] // case["heads"]},
    })
    # the CPU: no CUDA context, no allocator slack; the process before the step is the measurement's base
    return {k: v for k, v in drafter_device(cfg, on_gpu=False).parts if k != "process"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", choices=["chunked", "unchunked", "train"], help=argparse.SUPPRESS)
    ap.add_argument("--case", default=json.dumps(ISSUE_CASE), help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--skip-unchunked", action="store_true")
    ap.add_argument("--model-check", action="store_true")
    args = ap.parse_args()
    if args.child:
        args.mode = args.child
        print(json.dumps(child(args)))
        return
    for case in [MODEL_CASE, {**MODEL_CASE, "checkpoint": True}] if args.model_check else []:
        got = measure("train", case, args.threads)
        parts = model_prediction(case, got["params"])
        total = sum(parts.values())
        print(f"case {case}")
        for name, b in parts.items():
            print(f"  model: {name:28s} {b / 2**20:9.1f} MiB")
        measured = got["peak_above_start"]
        print(f"model total {total / 2**20:.1f} MiB; measured peak above the start {measured / 2**20:.1f} MiB"
              f" (model built {got['model_bytes'] / 2**20:.1f} MiB); model / measured "
              f"{total / measured:.3f}")
    if args.model_check:
        return
    case = {**ISSUE_CASE, "chunk": args.chunk}
    print(f"case {case}; peak resident bytes above the built model, one loss forward + backward, "
          f"{args.threads} thread(s)")
    print("| loss | peak above the model | time s | counted rows |")
    print("| --- | --- | --- | --- |")
    for mode in ([] if args.skip_unchunked else ["unchunked"]) + ["chunked"]:
        r = measure(mode, case, args.threads)
        label = "unchunked (before #25)" if mode == "unchunked" else f"chunked, {args.chunk} rows"
        print(f"| {label} | {r['peak_above_model'] / 1e9:.2f} GB | {r['seconds']:.1f} | {r['tokens']:,} |", flush=True)


if __name__ == "__main__":
    main()
