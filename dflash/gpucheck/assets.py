"""What a check runs on: a random target and synthetic conversations where asked for (``--arch``),
and the TOML of each run it starts (sizes small enough for the time box on the device at hand)."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash.gpucheck.plan import ARCHS, LEARNING_PROFILE, Plan

SPECIAL = ["<unk>", "<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|end|>", "<|mask|>"]
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
            "{% if add_generation_prompt %}<|assistant|> {% endif %}")


def build_random_target(d: Path, arch: str, vocab: int = 32000) -> Path:
    """A random Llama of ``arch`` with a word-level tokenizer (words ``w0..``) and a chat template."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = 512 if arch == "tiny" else vocab
    words = SPECIAL + [f"w{i}" for i in range(vocab - len(SPECIAL))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", bos_token="<s>",
                                   eos_token="<|end|>", mask_token="<|mask|>")
    fast.chat_template = TEMPLATE
    model_dir = d / "model"
    cfg = LlamaConfig(**ARCHS[arch], vocab_size=vocab, max_position_embeddings=4096, rms_norm_eps=1e-5,
                      tie_word_embeddings=False, pad_token_id=1, bos_token_id=2, eos_token_id=6)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(model_dir)
    fast.save_pretrained(model_dir)
    return model_dir


def synthetic_conversations(path: Path, vocab: int, n: int, max_len: int) -> Path:
    """ShareGPT-style first exchanges over the random tokenizer's words, with a long-tailed reply length."""
    rng = random.Random(0)
    words = vocab - len(SPECIAL)
    with open(path, "w") as f:
        for i in range(n):
            n_user = rng.randint(8, 48)
            n_reply = min(max_len - n_user - 8, max(16, int(rng.lognormvariate(4.6, 0.8))))
            say = lambda k: " ".join(f"w{rng.randrange(words)}" for _ in range(k))  # noqa: E731
            f.write(json.dumps({"id": f"c{i}", "conversations": [{"from": "human", "value": say(n_user)},
                                                                 {"from": "gpt", "value": say(n_reply)}]}) + "\n")
    return path


@dataclass(frozen=True)
class Shape:
    """The run's sizes: small enough for the time box on the device at hand."""

    max_len: int
    seqs_per_item: int
    anchors: int
    block_size: int
    layers: int
    min_ready: int
    max_depth: int
    window: int
    capture_layers: int
    eval_new_tokens: int
    device: str  # where regenerate and eval run the target ([target] devices; train places ranks itself)


def shape_for(plan: Plan) -> Shape:
    if plan.cpu:
        return Shape(max_len=256, seqs_per_item=4, anchors=16, block_size=8, layers=1, min_ready=4, max_depth=12,
                     window=4, capture_layers=3, eval_new_tokens=16, device="cpu")
    return Shape(max_len=2048, seqs_per_item=4, anchors=512, block_size=16, layers=1, min_ready=8, max_depth=24,
                 window=8, capture_layers=5 if plan.random_arch != "tiny" else 3, eval_new_tokens=48, device="cuda:0")


def write_config(path: Path, *, model: str, data: str, s: Shape, n_target: int, n_drafter: int, min_ready: int,
                 max_depth: int, policy: str, train_conversations: int | None) -> Path:
    """The run's TOML. ``train_conversations``: train on that prefix of the data only, so the rest
    stays held out for eval whatever number of epochs the time box allows."""
    bounds = [b for b in (64, 128, 256, 512, 1024, 2048) if b < s.max_len] + [s.max_len]
    path.write_text(f"""seed = 0
[workload]
dataset = {json.dumps(data)}
sample = "first_exchange"
max_len = {s.max_len}
bucket_bounds = {bounds}
seqs_per_item = {s.seqs_per_item}
order = "length_grouped"
mega_batch = 64
{f"max_conversations = {train_conversations}" if train_conversations else ""}
[cluster]
n_target = {n_target}
n_drafter = {n_drafter}
[queue]
min_ready = {min_ready}
max_depth = {max_depth}
policy = "{policy}"
[target]
model = {json.dumps(model)}
capture_layers = {s.capture_layers}
devices = ["{s.device}"]
[drafter]
layers = {s.layers}
block_size = {s.block_size}
anchors = {s.anchors}
[train]
lr = 6e-4
log_every = 10
checkpoint_every = 1000000
eval_new_tokens = {s.eval_new_tokens}
[metrics]
window = {s.window}
""")
    return path


def learning_config(path: Path, plan: Plan, s: Shape, *, model: str, data: str, n_train: int | None) -> Path:
    """The learning profile (examples/gpu-smollm2-learning.toml) for this check: its drafter shape and held-out
    metric on a GPU, on ``data``'s first ``n_train`` conversations (the rest stay held out for eval), time-boxed
    by ``--minutes`` instead of its epochs; on ``--cpu`` the shape is cut to the tiny random target's size."""
    from dflash.core.config import UNSET, config_to_toml, load_config, with_overrides

    over: dict[str, Any] = {
        "workload.dataset": data, "workload.max_conversations": n_train, "target.model": model,
        "target.devices": [s.device], "drafter.devices": [s.device],
        "train.checkpoint_every": 10**6, "train.quality_every": 100, "train.eval_prompts": plan.eval_prompts}
    if plan.cpu or plan.random_arch == "tiny":
        bounds = [b for b in (64, 128, 256) if b <= s.max_len]
        over.update({"workload.max_len": s.max_len, "workload.bucket_bounds": bounds,
                     "workload.seqs_per_item": s.seqs_per_item, "drafter.layers": s.layers,
                     "drafter.block_size": s.block_size, "drafter.anchors": s.anchors,
                     "target.capture_layers": s.capture_layers, "queue.min_ready": s.min_ready,
                     "queue.max_depth": s.max_depth, "train.quality_every": 5, "train.quality_per_bucket": 2,
                     "train.quality_anchors": 8, "train.eval_new_tokens": s.eval_new_tokens, "train.log_every": 5,
                     "metrics.window": s.window})
    if plan.random_arch:
        over["target.capture_layers"] = s.capture_layers
    cfg = with_overrides(load_config(LEARNING_PROFILE), {**over, "train.epochs": UNSET})
    path.write_text(config_to_toml(cfg))
    return path
