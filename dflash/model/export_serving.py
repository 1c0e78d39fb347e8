"""The commands that serve an exported drafter next to its target (SGLang, vLLM): one home for their
text, printed by ``dflash export`` and shown in the report's launch section. Torch-free.

The z-lab layout is what SGLang's ``--speculative-algorithm DFLASH`` and vLLM's ``dflash``
speculative method load; the speculators layout is served by vLLM from the export directory alone
(its config names the verifier). A drafter of block size B proposes B - 1 tokens per step
(slot 0 is the last accepted token), and SGLang counts the block, so it gets B.
"""

from __future__ import annotations

import json
import shlex

# Targets the run names by a packaged alias serve from the model they quantise.
SERVING_TARGETS = {"smollm2": "HuggingFaceTB/SmolLM2-135M-Instruct"}


def serving_target(target_model: str) -> str:
    """The id a serving engine loads for the run's ``target.model`` (a local path stays a path)."""
    return SERVING_TARGETS.get(target_model, target_model)


def export_command(run_dir: str, out: str, fmt: str = "zlab") -> str:
    cmd = f"dflash export --drafter {shlex.quote(run_dir)} --out {shlex.quote(out)}"
    return cmd if fmt == "zlab" else cmd + f" --format {fmt}"


def serving_commands(export_dir: str, target_model: str, block_size: int, fmt: str = "zlab") -> dict[str, str]:
    """``{engine: command}`` serving the export at ``export_dir`` with its target."""
    target, draft = shlex.quote(serving_target(target_model)), shlex.quote(export_dir)
    if fmt == "speculators":
        return {"vLLM": f"vllm serve {draft}"}
    spec = json.dumps({"method": "dflash", "model": export_dir, "num_speculative_tokens": block_size - 1})
    return {
        "SGLang": (f"python -m sglang.launch_server --model-path {target} --speculative-algorithm DFLASH "
                   f"--speculative-draft-model-path {draft} --speculative-num-draft-tokens {block_size}"),
        "vLLM": f"vllm serve {target} --speculative-config {shlex.quote(spec)}",
    }


__all__ = ["SERVING_TARGETS", "export_command", "serving_commands", "serving_target"]
