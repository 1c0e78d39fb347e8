"""``dflash eval``: acceptance length tau of a drafter, by real speculative decoding verified greedily by the
target, with a bootstrap interval over prompts so two configurations can be told apart (or not)."""

from __future__ import annotations

import argparse
from pathlib import Path

from dflash.cli.options import Opt, Verb
from dflash.cli.runs import drafter_dirs, load_run_config, trained_conversation_ids
from dflash.core.config import DflashConfig

DEFAULT_PROMPTS = 16  # fewer held-out prompts leave tau's interval too wide to rank drafters


def handle(args: argparse.Namespace, cfg: DflashConfig) -> int:
    """Acceptance length tau of a drafter: real speculative decoding, verified greedily by the target."""
    import json

    from dflash.core.atomic import atomic_write_text
    from dflash.core.records import clean_json
    from dflash.data.dataset_choice import pin_dataset
    from dflash.model.acceptance import evaluate_acceptance, heldout_prompts
    from dflash.model.drafter import DFlashDrafter
    from dflash.model.target import load_target

    run_dir, drafter_dir = drafter_dirs(Path(args.drafter))
    run_cfg = load_run_config(run_dir) if (run_dir / "config.json").is_file() else cfg
    run_cfg = pin_dataset(run_cfg)  # held-out prompts come from the file the run trained on (a changed one: refused)
    target = load_target(run_cfg.target.model, device=run_cfg.target.devices[0])
    drafter = DFlashDrafter.load(drafter_dir, target.model)
    n = int(args.prompts) if args.prompts is not None else DEFAULT_PROMPTS
    used = trained_conversation_ids(run_dir, run_cfg)
    prompts = heldout_prompts(target.tokenizer, n, seed=run_cfg.seed + 1, sample=run_cfg.workload.sample,
                              skip_ids=used, dataset=run_cfg.workload.dataset)
    res = evaluate_acceptance(target, drafter, prompts, max_new_tokens=run_cfg.train.eval_new_tokens)
    rates = ", ".join(f"{r:.2f}" for r in res["acceptance_rate_per_position"])
    ci = res.get("tau_ci95") or [float("nan"), float("nan")]
    print(f"tau {res['tau']:.3f} [{ci[0]:.3f}, {ci[1]:.3f}] (95%, bootstrap over prompts) over {res['steps']} "
          f"verification steps, {res['num_prompts']} held-out prompts "
          f"({len(used)} training conversations excluded); {res['tokens_per_s']:.1f} tokens/s")
    print(f"acceptance rate per block position 1..{res['block_size'] - 1}: {rates}")
    held = heldout_score(run_dir, run_cfg, target, drafter)
    if held is not None:
        from dflash.pipeline.heldout import heldout_line

        res["heldout"] = held
        print(f"held-out ({held['states']} target states, run's heldout.json): {heldout_line(held)}")
    text = json.dumps(clean_json(res), indent=1)
    for out in dict.fromkeys([run_dir / "eval.json", *([Path(args.json)] if args.json else [])]):
        print(f"eval: {atomic_write_text(out, text)}")
    return 0


def heldout_score(run_dir: Path, cfg: DflashConfig, target: object, drafter: object) -> dict | None:
    """The held-out metric (dflash.model.heldout) of this drafter on the run's held-out set, or None when
    the run has no ``heldout.json`` ([train] quality_every was off).

    The target's side is the run's kept ``heldout/states.pt`` when its fingerprint (sequences, model,
    captured layers) matches; else it is computed here from the run's data, as the first target rank
    computes it. The score itself is always fresh, for the drafter given."""
    import json

    import torch

    from dflash.core.precision import state_dtype_name
    from dflash.model.heldout import score_heldout
    from dflash.model.target import HiddenStateCapture
    from dflash.pipeline.heldout import HELDOUT_JSON, STATES_FILE, ensure_states
    from dflash.pipeline.training_data import TrainingData

    path = run_dir / HELDOUT_JSON
    if not path.is_file():
        return None
    desc = json.loads(path.read_text())
    per_bucket = [list(b) for b in desc["per_bucket"]]
    layers = list(drafter.spec.target_layer_ids)  # type: ignore[attr-defined]
    device = next(target.model.parameters()).device  # type: ignore[attr-defined]
    states, how = ensure_states(run_dir / STATES_FILE, per_bucket, cfg.target.model, layers,
                                data=lambda: TrainingData(cfg, target.tokenizer),  # type: ignore[attr-defined]
                                target_model=target.model,  # type: ignore[attr-defined]
                                capture=HiddenStateCapture(target.model, layers),  # type: ignore[attr-defined]
                                device=device, state_dtype=getattr(torch, state_dtype_name(device.type)), keep=False)
    res = score_heldout(drafter, states, anchors=int(desc.get("anchors") or cfg.train.quality_anchors),
                        seed=cfg.seed)  # seed: the intervals' bootstrap, as the rank's scorer seeds it
    return {**res, "states": how, "ids": len(desc.get("ids") or [])}


VERB = Verb("acceptance length of a drafter", opts=(
        Opt("--drafter", "indir", "drafter checkpoint directory", required=True, metavar="DIR"),
        Opt("--prompts", "int", f"held-out prompts to evaluate (>= 1; default {DEFAULT_PROMPTS})", lo=1, metavar="N"),
        Opt("--json", "outfile", "also write the result here: tau, tau_ci95, per-position acceptance, prompts, "
            "and heldout (the held-out metric) when the run has heldout.json",
            metavar="FILE"),
    ))
