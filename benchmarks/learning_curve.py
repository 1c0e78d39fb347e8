"""The drafter's learning curve: one time-budgeted ``dflash train`` run, drafter snapshots at evenly
spaced points of it, then tau (with its bootstrap interval) at every point on the same held-out prompts.

    python benchmarks/learning_curve.py run  --config examples/cpu-smollm2-learning.toml --minutes 60 \\
        --out /work/notes/learning-run
    python benchmarks/learning_curve.py eval --out /work/notes/learning-run --prompts 32

``run`` starts the training run (``dflash train --max-minutes M``) and, while it trains, copies the
newest checkpoint's drafter state at each k/points of the budget (counted from the first step
record, so model loading is not in it); the last point is the run's own final drafter. It does no
evaluation while the run trains: on 2 CPU cores evaluating would starve the run. ``eval`` measures
every point with the library calls ``dflash eval`` makes (:func:`dflash.model.acceptance.heldout_prompts`,
:func:`~dflash.model.acceptance.evaluate_acceptance`), holding out every conversation the whole run
trained on (item ids read through :func:`dflash.core.sampler.sampler_for`, the run's own sampler),
so the points differ only in the drafter's weights. It writes ``curve.json`` and the lines for
benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

POLL_S = 10.0


def run(config: str, minutes: float, out: Path, points: int) -> int:
    """The training run plus snapshots at k/points of its budget; returns the run's exit status."""
    from dflash.pipeline.checkpoint import checkpoint_dirs  # imported now: the code may change while it runs

    run_dir, snaps = out / "run", out / "snapshots"
    snaps.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "dflash", "train", "--config", config, "--max-minutes", str(minutes),
           "--out", str(run_dir)]
    (out / "command.txt").write_text(" ".join(cmd) + "\n")
    with open(out / "train.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        t0, taken = None, 0
        while proc.poll() is None:
            time.sleep(POLL_S)
            if t0 is None and (run_dir / "step.jsonl").is_file():
                t0 = time.time()
            if t0 is None or taken >= points - 1:
                continue
            due = time.time() - t0 >= (taken + 1) * minutes * 60 / points
            if due and _snapshot(checkpoint_dirs(run_dir), snaps, taken + 1, t0):
                taken += 1
    if (run_dir / "drafter").is_dir():
        final = snaps / f"p{points}"
        shutil.rmtree(final, ignore_errors=True)
        shutil.copytree(run_dir / "drafter", final / "drafter")
        (final / "point.json").write_text(json.dumps({"point": points, "final": True, "minutes": minutes}))
    return proc.returncode


def _snapshot(ckpts: list[Path], snaps: Path, k: int, t0: float) -> bool:
    """Copy the newest complete checkpoint's state (a checkpoint may be replaced while we copy: retry)."""
    for ckpt in reversed(ckpts):
        dest = snaps / f"p{k}"
        try:
            dest.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ckpt / "state.pt", dest / "state.pt")
            meta = json.loads((ckpt / "meta.json").read_text())
        except (OSError, ValueError):
            continue
        (dest / "point.json").write_text(json.dumps({"point": k, "step": meta["step"],
                                                     "wall_min": round((time.time() - t0) / 60, 2)}))
        return True
    return False


def evaluate(out: Path, prompts: int) -> dict:
    """tau at every snapshot on one set of held-out prompts; writes curve.json."""
    import torch

    from dflash.cli.runs import load_run_config
    from dflash.core.records import read_records
    from dflash.data.trained import trained_conversation_ids
    from dflash.model.acceptance import evaluate_acceptance, heldout_prompts
    from dflash.model.drafter import DFlashDrafter
    from dflash.model.target import load_target

    run_dir = out / "run"
    cfg = load_run_config(run_dir)
    used = trained_conversation_ids(run_dir, cfg)
    target = load_target(cfg.target.model, device="cpu")
    held = heldout_prompts(target.tokenizer, prompts, seed=cfg.seed + 1, sample=cfg.workload.sample,
                           skip_ids=used, dataset=cfg.workload.dataset)
    steps = list(read_records(run_dir, "step"))
    results = []
    for snap in sorted((out / "snapshots").glob("p*"), key=lambda p: int(p.name[1:])):
        point = json.loads((snap / "point.json").read_text())
        drafter = DFlashDrafter.load(run_dir / "drafter", target.model)
        if (snap / "state.pt").is_file():
            drafter.load_state_dict(torch.load(snap / "state.pt", weights_only=False, map_location="cpu")["drafter"])
            step = int(point["step"])
        else:
            step = len(steps) - 1
        t = time.perf_counter()
        res = evaluate_acceptance(target, drafter.eval(), held, max_new_tokens=cfg.train.eval_new_tokens)
        rec = {"point": point["point"], "step": step, "minutes": point.get("wall_min", point.get("minutes")),
               "tau": res["tau"], "tau_ci95": res["tau_ci95"], "prompts": res["num_prompts"],
               "acceptance_rate_per_position": res["acceptance_rate_per_position"],
               "train_loss_near": _loss_near(steps, step), "eval_s": round(time.perf_counter() - t, 1)}
        results.append(rec)
        print(json.dumps(rec), flush=True)
    curve = {"held_out_excluded": len(used), "points": results,
             "command": (out / "command.txt").read_text().strip() if (out / "command.txt").is_file() else None}
    (out / "curve.json").write_text(json.dumps(curve, indent=1))
    return curve


def _loss_near(steps: list[dict], step: int, window: int = 50) -> float | None:
    """Mean training loss over the ``window`` steps up to ``step`` (the curve's loss column)."""
    vals = [r["loss"] for r in steps if step - window < r["step"] <= step and r.get("loss") is not None]
    return round(sum(vals) / len(vals), 4) if vals else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="what", required=True)
    r = sub.add_parser("run")
    r.add_argument("--config", required=True)
    r.add_argument("--minutes", type=float, default=60.0)
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--points", type=int, default=4)
    e = sub.add_parser("eval")
    e.add_argument("--out", type=Path, required=True)
    e.add_argument("--prompts", type=int, default=32)
    args = ap.parse_args()
    if args.what == "run":
        return run(args.config, args.minutes, args.out, args.points)
    evaluate(args.out, args.prompts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
