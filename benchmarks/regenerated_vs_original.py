"""Does training on target-regenerated replies raise tau? (issue #9)

Two drafters, same CPU profile, same steps, same prompts: one trained on the first N ShareGPT first
exchanges with their original replies, one on the same prompts answered by SmolLM2 itself
(``dflash regenerate``). Both are then measured on the same held-out prompts (ShareGPT first
exchanges neither run trained on) with real speculative decoding against the target's greedy output.
Every stage is skipped when its output exists.

    python benchmarks/regenerated_vs_original.py --out regen-bench --prompts 300 --steps 300
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.stages import sh  # noqa: E402
from dflash.core.config import config_to_toml, load_config, with_overrides  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("regen-bench"))
    ap.add_argument("--prompts", type=int, default=300, help="first N usable ShareGPT records")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--eval-prompts", type=int, default=8)
    a = ap.parse_args()
    out = a.out
    out.mkdir(parents=True, exist_ok=True)
    log = out / "log.txt"
    profile = load_config(ROOT / "examples" / "cpu-smollm2.toml")
    regen = out / "regenerated.jsonl"
    sh(["dflash", "regenerate", "--config", str(ROOT / "examples" / "cpu-smollm2.toml"), "--limit", str(a.prompts),
        "--max-new-tokens", str(a.max_new_tokens), "--out", str(regen)], log)
    n_regen = sum(1 for _ in regen.open())
    runs = {
        "original": with_overrides(profile, {"workload.max_conversations": a.prompts}),
        "regenerated": with_overrides(profile, {"workload.dataset": str(regen.resolve())}),
    }
    for name, cfg in runs.items():
        cfg = with_overrides(cfg, {"train.max_steps": a.steps, "train.schedule_steps": a.steps})
        (out / f"{name}.toml").write_text(config_to_toml(cfg))
        run = out / name
        if not (run / "metrics.json").exists():
            sh(["dflash", "train", "--config", str(out / f"{name}.toml"), "--out", str(run), "--wandb", "disabled"],
               log)

    from dflash.cli import load_run_config, trained_conversation_ids
    from dflash.model.acceptance import evaluate_acceptance, heldout_prompts
    from dflash.model.drafter import DFlashDrafter
    from dflash.model.target import load_target

    used: set[str] = set()
    for name in runs:
        used |= {i.split("#dup")[0] for i in trained_conversation_ids(out / name, load_run_config(out / name))}
    target = load_target("smollm2")
    prompts = heldout_prompts(target.tokenizer, a.eval_prompts, seed=1, sample="first_exchange", skip_ids=used,
                              max_conversations=None)
    rows = {}
    for name in runs:
        drafter = DFlashDrafter.load(out / name / "drafter", target.model)
        res = evaluate_acceptance(target, drafter, prompts, max_new_tokens=64)
        steps = [json.loads(line) for line in (out / name / "step.jsonl").open()]
        tail = [s["loss"] for s in steps[-20:] if s.get("loss") is not None]
        rows[name] = {"tau": res["tau"], "acceptance_per_position": res["acceptance_rate_per_position"],
                      "steps": len(steps), "final_loss": sum(tail) / len(tail) if tail else None,
                      "eval_prompts": res["num_prompts"]}
    (out / "result.json").write_text(json.dumps({"records_regenerated": n_regen, "rows": rows}, indent=1))
    print(f"{n_regen} regenerated records; {len(used)} training conversations excluded from evaluation")
    print("| data | steps | final loss (last 20) | tau | acceptance pos 1..3 |")
    print("|---|---|---|---|---|")
    for name, r in rows.items():
        acc = ", ".join(f"{x:.2f}" for x in r["acceptance_per_position"][:3])
        print(f"| {name} | {r['steps']} | {r['final_loss']:.3f} | {r['tau']:.3f} | {acc} |")


if __name__ == "__main__":
    main()
