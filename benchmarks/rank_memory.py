"""The memory model against the ranks of a real ``dflash train`` job on the CPU (issue 33 item 4).

Per rank, the measured figure is the process's ``VmHWM`` at its peak over the steps (a drafter rank
records it after each step; a target rank after its loop) minus its ``VmHWM`` just before the first step
(``RUN/.ranks/rank-N.memory.json``, dflash/pipeline/hostmem.py); the model's figure is
:func:`dflash.core.memory_model.loop_bytes` of that rank's device with the CPU's sizes (float32, no CUDA
context, AdamW's two float32 moments): everything but what exists before the first step (the weights
the loop never reads, the process). One target + one drafter rank, a random Llama of each shape with a
word-level tokenizer, conversations long enough that every sequence fills ``max_len`` (the model's
assumption: every item as large as the workload allows), a queue deep enough to fill.
``RANK_MEMORY_TRACE=1`` also samples every rank's ``/proc/PID/status`` every 20 ms into ``trace.json``
beside the run (the path is printed).

    python benchmarks/rank_memory.py                 # the three shapes, a table
    python benchmarks/rank_memory.py --shape small   # one
    python benchmarks/rank_memory.py --plane gloo    # the copying plane (default: the job's own, shm)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SHAPES: dict[str, dict[str, int]] = {
    # hidden, layers, heads, kv heads, MLP width, vocab; item: seqs x max_len; drafter: anchors, block, layers
    "small": dict(hidden=128, layers=6, heads=4, kv=2, inter=384, vocab=4000, seqs=2, max_len=256, anchors=32,
                  block=8, dlayers=1, capture=3, depth=6),
    "wide": dict(hidden=384, layers=6, heads=6, kv=2, inter=1024, vocab=8000, seqs=2, max_len=384, anchors=64,
                 block=8, dlayers=2, capture=3, depth=6),
    "long": dict(hidden=192, layers=8, heads=6, kv=3, inter=512, vocab=16000, seqs=1, max_len=1024, anchors=96,
                 block=16, dlayers=1, capture=4, depth=8),
}
SPECIAL = ["<unk>", "<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|end|>", "<|mask|>"]
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
            "{% if add_generation_prompt %}<|assistant|> {% endif %}")


def build_target(d: Path, s: dict[str, int]) -> Path:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    words = SPECIAL + [f"w{i}" for i in range(s["vocab"] - len(SPECIAL))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", bos_token="<s>",
                                   eos_token="<|end|>", mask_token="<|mask|>")
    fast.chat_template = TEMPLATE
    cfg = LlamaConfig(vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["inter"],
                      num_hidden_layers=s["layers"], num_attention_heads=s["heads"], num_key_value_heads=s["kv"],
                      max_position_embeddings=4096, tie_word_embeddings=False, pad_token_id=1, bos_token_id=2,
                      eos_token_id=6)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(d / "model")
    fast.save_pretrained(d / "model")
    return d / "model"


def target_params(s: dict[str, int]) -> int:
    """Parameters of the random target the job loads (``memory.target_params``)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["inter"],
                      num_hidden_layers=s["layers"], num_attention_heads=s["heads"], num_key_value_heads=s["kv"],
                      tie_word_embeddings=False)
    with torch.device("meta"):
        return sum(p.numel() for p in LlamaForCausalLM(cfg).parameters())


def conversations(path: Path, s: dict[str, int], n: int = 200) -> Path:
    rng = random.Random(0)
    with open(path, "w") as f:
        for i in range(n):
            say = lambda k: " ".join(f"w{rng.randrange(s['vocab'] - len(SPECIAL))}" for _ in range(k))  # noqa: E731
            f.write(json.dumps({"id": f"c{i}", "conversations": [
                {"from": "human", "value": say(16)}, {"from": "gpt", "value": say(s["max_len"] + 64)}]}) + "\n")
    return path


def drafter_params(s: dict[str, int]) -> int:
    """Trainable parameters of the drafter the job builds (the draft layers and the fusion projection)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from dflash.core.config import DrafterConfig
    from dflash.model.drafter import DFlashDrafter, DrafterSpec

    cfg = LlamaConfig(vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["inter"],
                      num_hidden_layers=s["layers"], num_attention_heads=s["heads"], num_key_value_heads=s["kv"],
                      tie_word_embeddings=False)
    target = LlamaForCausalLM(cfg)
    spec = DrafterSpec.from_target_config(cfg, target_layer_ids=tuple(range(s["capture"])), mask_token_id=7,
                                          drafter=DrafterConfig(layers=s["dlayers"], block_size=s["block"],
                                                                anchors=s["anchors"]))
    d = DFlashDrafter.from_target(target, spec, dtype=torch.float32)
    return sum(p.numel() for p in d.trainable_parameters())


def config_text(s: dict[str, int], model: Path, data: Path, params: int, t_params: int) -> str:
    head = s["hidden"] // s["heads"]
    return f"""seed = 0
[workload]
dataset = {json.dumps(str(data))}
sample = "first_exchange"
max_len = {s["max_len"]}
bucket_bounds = [{s["max_len"]}]
seqs_per_item = {s["seqs"]}
[cluster]
n_target = 1
n_drafter = 1
[queue]
min_ready = 2
max_depth = {s["depth"]}
[target]
model = {json.dumps(str(model))}
capture_layers = {s["capture"]}
[drafter]
layers = {s["dlayers"]}
block_size = {s["block"]}
anchors = {s["anchors"]}
[train]
log_every = 1000
checkpoint_every = 1000000
cpu_threads = 1
[timing]
hidden_size = {s["hidden"]}
dtype_bytes = 4
[memory]
target_params = {t_params}
drafter_params = {params}
vocab_size = {s["vocab"]}
intermediate_size = {s["inter"]}
attention_width = {s["heads"] * head}
kv_width = {s["kv"] * head}
weight_bytes = 4
optimizer_bytes_per_param = 8
logits_bytes = 8
activation_bytes = 4
"""


def run_shape(name: str, steps: int, plane: str | None, root: Path | None = None) -> dict[str, Any]:
    from dflash.core.config import load_config
    from dflash.core.memory_model import drafter_device, loop_bytes, target_device

    s = SHAPES[name]
    work = Path(tempfile.mkdtemp(prefix=f"rank-memory-{name}-", dir=root))
    model = build_target(work, s)
    data = conversations(work / "data.jsonl", s)
    cfg_path = work / "run.toml"
    cfg_path.write_text(config_text(s, model, data, drafter_params(s), target_params(s)))
    path = f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    # freed tensors go back to the system, so a rank's peak follows what its step holds (hostmem.return_freed_memory;
    # off by default in the trainer: it costs ~20% CPU time per step)
    env = {**os.environ, "WANDB_MODE": "disabled", "PYTHONPATH": path, "DFLASH_RETURN_FREED_MEMORY": "1"}
    if plane:
        env["DFLASH_DATA_PLANE"] = plane
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "dflash", "train", "--config", str(cfg_path), "--out",
                             str(work / "run"), "--max-steps", str(steps), "--nproc-per-node", "2", "--wandb",
                             "disabled"], cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    trace = _trace(proc) if os.environ.get("RANK_MEMORY_TRACE") else None
    _, err = proc.communicate(timeout=1800)
    if trace is not None:
        trace.stop = True
        (work / "trace.json").write_text(json.dumps(trace.rows))
        print(f"trace: {work / 'trace.json'}", file=sys.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"{name}: dflash train failed: {err.strip().splitlines()[-1:]} ({work})")
    cfg = load_config(cfg_path)
    sharing = (plane or "shm") == "shm"
    model_by_role = {"target": target_device(cfg, on_gpu=False, sharing=sharing),
                     "drafter": drafter_device(cfg, on_gpu=False, sharing=sharing)}
    out: dict[str, Any] = {"shape": name, "seconds": time.perf_counter() - t0, "plane": plane or "shm (default)"}
    for f in sorted((work / "run" / ".ranks").glob("rank-*.memory.json")):
        rec = json.loads(f.read_text())
        dev = model_by_role[rec["role"]]
        out[rec["role"]] = {"measured": rec["loop_peak_bytes"], "model": loop_bytes(dev),
                            "parts": {k: v for k, v in dev.parts}}
    return out


class _Tracer:
    stop = False
    rows: list[Any]


def _trace(proc: subprocess.Popen[str]) -> _Tracer:
    """Samples every descendant's /proc/PID/status (VmHWM, VmRSS, RssAnon, RssFile, RssShmem) every 20 ms."""
    import threading

    import psutil

    tr = _Tracer()
    tr.rows = []
    keys = ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem")

    def loop() -> None:
        root = psutil.Process(proc.pid)
        t0 = time.perf_counter()
        while not tr.stop and proc.poll() is None:
            try:
                kids = root.children(recursive=True)
            except psutil.Error:
                break
            for k in kids:
                try:
                    with open(f"/proc/{k.pid}/status") as f:
                        rec = {ln.split(":")[0]: int(ln.split()[1]) for ln in f if ln.split(":")[0] in keys}
                    tr.rows.append([round(time.perf_counter() - t0, 3), k.pid, rec])
                except (OSError, ValueError, IndexError):
                    pass
            time.sleep(0.02)

    threading.Thread(target=loop, daemon=True).start()
    return tr


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=list(SHAPES), action="append")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--plane", choices=["shm", "gloo"])
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args()
    rows = []
    print("| shape | rank | model MiB | measured MiB | model / measured |")
    print("| --- | --- | --- | --- | --- |")
    for name in a.shape or list(SHAPES):
        r = run_shape(name, a.steps, a.plane)
        rows.append(r)
        for role in ("target", "drafter"):
            m, got = r[role]["model"], r[role]["measured"]
            print(f"| {name} | {role} | {m / 2**20:.1f} | {got / 2**20:.1f} | {m / got:.3f} |", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
