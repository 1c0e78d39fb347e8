"""tau of a validated configuration's final drafter, on prompts its run never trained on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dflash.core.config import DflashConfig

NOT_MEASURED = ("not measured: asked for 0 prompts (dflash demo: a drafter trained for one block has tau ~1, and "
                "tau is no objective of the decision)")


def final_tau(cfg: DflashConfig, run_dir: Path, target: Any, prompts: int) -> dict[str, Any]:
    """tau of the configuration's drafter after its last block, on prompts it never trained on; with 0
    prompts nothing is loaded or decoded and the row says why tau is missing."""
    if prompts <= 0:
        return {"tau": None, "num_prompts": 0, "why_missing": NOT_MEASURED}
    from dflash.data.trained import trained_conversation_ids
    from dflash.model.drafter import DFlashDrafter

    drafter = DFlashDrafter.load(run_dir / "drafter", target.model)
    return _tau(target, drafter, trained_conversation_ids(run_dir, cfg), cfg, prompts)


def _tau(target: Any, drafter: Any, trained: set[str], cfg: DflashConfig, n: int) -> dict[str, Any]:
    """Acceptance length of the trained drafter on held-out prompts (the run's conversations excluded)."""
    from dflash.model.acceptance import evaluate_acceptance, heldout_prompts

    prompts = heldout_prompts(target.tokenizer, n, seed=cfg.seed + 1, sample=cfg.workload.sample,
                              skip_ids=trained, dataset=cfg.workload.dataset)
    return evaluate_acceptance(target, drafter, prompts, max_new_tokens=cfg.train.eval_new_tokens)
