"""GPU check: the distributed trainer on the GPUs present, with only torch, transformers and tokenizers installed.

Builds, in a temporary directory, everything a run needs without a network: a randomly initialised
target of a real 1-8B architecture (weights do not change timing), a word-level tokenizer with a chat
template, and synthetic ShareGPT-style conversations with a long-tailed length mix. Then it runs
``python -m dflash train`` as a real job, one process per GPU: with 2 or more GPUs the first half
are target ranks and the rest drafter ranks (hidden states go NCCL point-to-point GPU to GPU); with
one GPU, 1 target + 1 drafter rank share it (the data plane goes through host memory with gloo).
It samples nvidia-smi while the job runs and prints tokens/s, each rank's utilisation (busy share
of the run from the records) with its pid, the queue depth and the GPUs' memory and utilisation.

Run: bash scripts/gpu_check.sh        (or: python3 scripts/gpu_check.py --minutes 2)
CPU smoke test of the script itself: python3 scripts/gpu_check.py --cpu --arch tiny --minutes 0.3
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ARCHS = {
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                 num_key_value_heads=2),
}
SPECIAL = ["<unk>", "<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|end|>", "<|mask|>"]
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
            "{% if add_generation_prompt %}<|assistant|> {% endif %}")


def build_assets(d: Path, arch: str, vocab: int, n_convs: int, max_len: int) -> tuple[Path, Path]:
    """A random target with a word-level tokenizer, and a JSONL of synthetic conversations."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    words = SPECIAL + [f"w{i}" for i in range(vocab - len(SPECIAL))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", bos_token="<s>",
                                   eos_token="<|end|>", mask_token="<|mask|>")
    fast.chat_template = TEMPLATE
    model_dir = d / "model"
    cfg = LlamaConfig(**ARCHS[arch], vocab_size=vocab, max_position_embeddings=max(4096, max_len),
                      rms_norm_eps=1e-5, tie_word_embeddings=False, pad_token_id=1, bos_token_id=2, eos_token_id=6)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(model_dir)
    fast.save_pretrained(model_dir)
    rng = random.Random(0)
    data = d / "data.jsonl"
    with open(data, "w") as f:
        for i in range(n_convs):
            n_user = rng.randint(8, 64)
            n_reply = min(max_len - n_user - 8, max(16, int(rng.lognormvariate(5.0, 0.9))))
            say = lambda n: " ".join(f"w{rng.randrange(vocab - len(SPECIAL))}" for _ in range(n))  # noqa: E731
            f.write(json.dumps({"id": f"c{i}", "conversations": [{"from": "human", "value": say(n_user)},
                                                                 {"from": "gpt", "value": say(n_reply)}]}) + "\n")
    return model_dir, data


def write_config(d: Path, model: Path, data: Path, args: argparse.Namespace, n_target: int, n_drafter: int) -> Path:
    path = d / "check.toml"
    bounds = [b for b in (128, 256, 512, 1024, 2048) if b < args.max_len] + [args.max_len]
    path.write_text(f"""
seed = 0
[workload]
dataset = "{data}"
sample = "first_exchange"
max_len = {args.max_len}
bucket_bounds = {bounds}
seqs_per_item = {args.seqs_per_item}
order = "length_grouped"
mega_batch = 64
[cluster]
n_target = {n_target}
n_drafter = {n_drafter}
[queue]
min_ready = {args.min_ready}
max_depth = {args.max_depth}
[target]
model = "{model}"
capture_layers = {5 if args.arch != "tiny" else 3}
[drafter]
layers = {args.layers}
block_size = {args.block_size}
anchors = {args.anchors}
[train]
lr = 6e-4
log_every = 10
checkpoint_every = 1000000
""")
    return path


def gpu_sampler(samples: list[dict], stop: threading.Event) -> None:
    """nvidia-smi once a second: per GPU utilisation and memory."""
    while not stop.is_set():
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=index,utilization.gpu,memory.used,memory.total",
                                  "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10).stdout
            for line in out.strip().splitlines():
                i, util, used, total = (float(x) for x in line.split(","))
                samples.append({"gpu": int(i), "util": util, "used": used, "total": total})
        except (OSError, ValueError, subprocess.TimeoutExpired):
            return
        stop.wait(1.0)


def read(run: Path, kind: str) -> list[dict]:
    p = run / f"{kind}.jsonl"
    return [json.loads(line) for line in p.read_text().splitlines()] if p.exists() else []


def report(run: Path, samples: list[dict], wall: float) -> None:
    metrics = json.loads((run / "metrics.json").read_text())
    summary = read(run, "summary")[-1]
    produce, takes = read(run, "produce"), read(run, "take")
    span = max(r["t"] for r in takes) - min(r["t_start"] for r in produce) if takes and produce else float("nan")
    busy: dict[tuple[str, int, int], float] = defaultdict(float)
    for r in produce:
        busy[("target", r["rank"], r["pid"])] += r["t_end"] - r["t_start"]
    for r in takes:
        busy[("drafter", r["rank"], r["pid"])] += r["compute_s"]
    print(f"job: {summary['steps']} steps, stopped by {summary['stopped_by']}, wall {wall:.0f} s with start-up; "
          f"produced {summary['produced']} = trained {summary['trained']} + skipped_no_anchors "
          f"{summary.get('skipped_no_anchors', 0)} + discarded {summary['discarded_at_stop']}")
    print(f"throughput_tokens_per_s {metrics.get('throughput_tokens_per_s', float('nan')):,.0f}   "
          f"samples_per_s {metrics.get('samples_per_s', float('nan')):.2f}   mean_queue_depth "
          f"{metrics.get('mean_queue_depth', float('nan')):.1f}   peak_queue_bytes "
          f"{metrics.get('peak_queue_bytes', 0) / 2**20:.0f} MiB")
    m = {k: metrics.get(k, float("nan")) for k in ("drafter_utilization", "target_utilization",
                                                   "drafter_gate_wait_frac", "producer_blocked_frac")}
    print(f"drafter_utilization {m['drafter_utilization']:.3f}   target_utilization {m['target_utilization']:.3f}"
          f"   gate wait {m['drafter_gate_wait_frac']:.3f}   producer blocked {m['producer_blocked_frac']:.3f}")
    for (role, rank, pid), s in sorted(busy.items(), key=lambda kv: kv[0][1]):
        print(f"  rank {rank} ({role}, pid {pid}): busy {s / span:.3f} of {span:.0f} s")
    xfer = [r["transfer_s"] / max(r["bytes"], 1) for r in takes if r.get("bytes")]
    if xfer:
        print(f"  transfer: {sum(r['bytes'] for r in takes) / 2**20:.0f} MiB received, "
              f"{1 / (sum(xfer) / len(xfer)) / 2**30:.2f} GiB/s mean per item")
    by_gpu: dict[int, list[dict]] = defaultdict(list)
    for s in samples:
        by_gpu[s["gpu"]].append(s)
    for g, ss in sorted(by_gpu.items()):
        print(f"  GPU {g}: utilisation mean {sum(s['util'] for s in ss) / len(ss):.0f}% (max "
              f"{max(s['util'] for s in ss):.0f}%), memory peak {max(s['used'] for s in ss):,.0f} of "
              f"{ss[0]['total']:,.0f} MiB")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", choices=sorted(ARCHS), default="1b")
    ap.add_argument("--cpu", action="store_true", help="CPU smoke test: 1 target + 2 drafter ranks over gloo")
    ap.add_argument("--minutes", type=float, default=2.0, help="training time of the job")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--conversations", type=int, default=4000)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--seqs-per-item", type=int, default=4)
    ap.add_argument("--anchors", type=int, default=512)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--layers", type=int, default=1, help="draft layers")
    ap.add_argument("--min-ready", type=int, default=8)
    ap.add_argument("--max-depth", type=int, default=24)
    ap.add_argument("--keep", action="store_true", help="keep the run directory")
    args = ap.parse_args()
    import torch

    gpus = 0 if args.cpu else torch.cuda.device_count()
    if not args.cpu and gpus == 0:
        sys.exit("gpu_check: no GPU visible (torch.cuda.device_count() == 0); use --cpu for the smoke test")
    n_target, n_drafter = (1, 2) if gpus == 0 else (1, 1) if gpus == 1 else (gpus // 2, gpus - gpus // 2)
    plane = "gloo (CPU)" if gpus == 0 else "host memory + gloo (one shared GPU)" if gpus == 1 else "NCCL point-to-point"
    print(f"gpu_check: {gpus} GPU(s): {n_target} target + {n_drafter} drafter ranks; data plane {plane}; "
          f"random {args.arch} Llama; torch {torch.__version__}", flush=True)
    d = Path(tempfile.mkdtemp(prefix="dflash-gpu-check-"))
    t0 = time.perf_counter()
    model, data = build_assets(d, args.arch, args.vocab, args.conversations, args.max_len)
    print(f"assets in {time.perf_counter() - t0:.0f} s: {d}", flush=True)
    cfg = write_config(d, model, data, args, n_target, n_drafter)
    run = d / "run"
    samples: list[dict] = []
    stop = threading.Event()
    sampler = threading.Thread(target=gpu_sampler, args=(samples, stop), daemon=True)
    if gpus:
        sampler.start()
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "PYTHONUNBUFFERED": "1"}
    if args.cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    t0 = time.perf_counter()
    rc = subprocess.run([sys.executable, "-m", "dflash", "train", "--config", str(cfg), "--out", str(run),
                         "--max-minutes", str(args.minutes), "--wandb", "disabled",
                         "--nproc-per-node", str(n_target + n_drafter)], cwd=ROOT, env=env).returncode
    wall = time.perf_counter() - t0
    stop.set()
    if rc != 0:
        sys.exit(f"gpu_check: the job failed (exit status {rc}); rank status files: {run / '.ranks'}")
    report(run, samples, wall)
    if not args.keep:
        import shutil

        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
