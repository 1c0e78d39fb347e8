"""``dflash eval``: Acceptance length tau of a drafter: real speculative decoding, verified greedily by the target."""

from __future__ import annotations

import argparse
from pathlib import Path

from dflash.cli.options import Opt, Verb
from dflash.cli.runs import drafter_dirs, load_run_config, trained_conversation_ids
from dflash.core.config import DflashConfig


def handle(args: argparse.Namespace, cfg: DflashConfig) -> int:
    """Acceptance length tau of a drafter: real speculative decoding, verified greedily by the target."""
    import json

    from dflash.core.atomic import atomic_write_text
    from dflash.core.records import clean_json
    from dflash.model.acceptance import evaluate_acceptance, heldout_prompts
    from dflash.model.drafter import DFlashDrafter
    from dflash.model.target import load_target

    run_dir, drafter_dir = drafter_dirs(Path(args.drafter))
    run_cfg = load_run_config(run_dir) if (run_dir / "config.json").is_file() else cfg
    target = load_target(run_cfg.target.model, device=run_cfg.target.devices[0])
    drafter = DFlashDrafter.load(drafter_dir, target.model)
    n = int(args.prompts) if args.prompts is not None else 8
    used = trained_conversation_ids(run_dir, run_cfg)
    prompts = heldout_prompts(target.tokenizer, n, seed=run_cfg.seed + 1, sample=run_cfg.workload.sample,
                              skip_ids=used, dataset=run_cfg.workload.dataset)
    res = evaluate_acceptance(target, drafter, prompts, max_new_tokens=64)
    rates = ", ".join(f"{r:.2f}" for r in res["acceptance_rate_per_position"])
    print(f"tau {res['tau']:.3f} over {res['steps']} verification steps, {res['num_prompts']} held-out prompts "
          f"({len(used)} training conversations excluded); {res['tokens_per_s']:.1f} tokens/s")
    print(f"acceptance rate per block position 1..{res['block_size'] - 1}: {rates}")
    out = atomic_write_text(run_dir / "eval.json", json.dumps(clean_json(res), indent=1))
    print(f"eval: {out}")
    return 0


VERB = Verb("acceptance length of a drafter", opts=(
        Opt("--drafter", "indir", "drafter checkpoint directory", required=True, metavar="DIR"),
        Opt("--prompts", "int", "prompts to evaluate (>= 1)", lo=1, metavar="N"),
    ))
