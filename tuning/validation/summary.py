"""The summary: validation.json, best.toml and the CLI's text, once every block is over.

One row per configuration (measured block means with their standard errors, tau, the a-priori
prediction, the run calibrated alone and the drift-corrected prediction), the comparisons and the
recommendation (:mod:`tuning.validation.recommendation`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from dflash.core.atomic import atomic_write_text
from dflash.core.config import DflashConfig, config_to_toml, with_overrides
from dflash.core.records import clean_json
from tuning.validation.acceptance import final_tau
from tuning.validation.evidence import measured_objectives
from tuning.validation.metrics import (
    COMPARED,
    GOALS,
    TRANSIENT_RULE,
    block_means,
    block_table,
    bucket_use,
    kept_blocks,
    peak_bytes,
    rel_errors,
    within_goals,
)
from tuning.validation.plan import ValidateArgs, block_steps, max_looks, queue_overrides, seed_runs
from tuning.validation.predict import predict, prediction_seeds
from tuning.validation.recommendation import decide_validation, evidence_of, stop_reason
from tuning.validation.runner import wait_for_held_ends


def predicted_blocks(entry: dict[str, Any], blocks: list[dict[str, Any]], base: DflashConfig,
                     calibrated: DflashConfig, args: ValidateArgs
                     ) -> tuple[int, list[int], list[tuple[int, int]], dict[str, Any]]:
    """Steps, kept blocks, their step spans and the a-priori prediction of one configuration's blocks
    so far: the prediction's blocks are the hardware's (the same step ranges, the same kept blocks), so
    the summary and the look after each round (:func:`tuning.validation.job.look_after_round`) judge
    the same statistic."""
    steps = max(int(b.get("steps") or 0) for b in blocks)
    n = max(int(b["block"]) for b in blocks) + 1
    kept = [k for k in kept_blocks(n) if any(int(b["block"]) == k for b in blocks)]
    spans = [(block_steps(base, args, k - 1)[0] if k else 0, block_steps(base, args, k)[0]) for k in range(n)]
    predicted = predict(entry, calibrated, steps, args.out / "sim" / entry["name"], blocks=spans, kept=kept)
    return steps, kept, spans, predicted


def config_row(entry: dict[str, Any], blocks: list[dict[str, Any]], base: DflashConfig, calibrated: DflashConfig,
               args: ValidateArgs, target: Any) -> dict[str, Any]:
    """Measured (block means and their standard errors), tau, the a-priori prediction, the run
    calibrated alone (drift) and the drift-corrected prediction of one configuration.

    ``drift`` is one number, the machine drift's effect on the predicted throughput (a-priori over
    drift-corrected prediction, minus 1; :func:`tuning.validation.drift.effect`); ``drift_detail`` has the
    per-stage changes (target seconds per item, drafter seconds per take) behind it."""
    from tuning.validation.drift import effect, own_calibration, stage_drift, timing_of

    name = entry["name"]
    run_dir = args.out / "runs" / name
    run_cfg = with_overrides(base, queue_overrides(entry["queue"]))
    metrics = json.loads((run_dir / "metrics.json").read_text())
    steps, kept, spans, predicted = predicted_blocks(entry, blocks, base, calibrated, args)
    measured, se = block_means([b for b in blocks if int(b["block"]) in kept], metrics)
    tau = final_tau(run_cfg, run_dir, target, args.prompts)
    measured["tau"] = tau.get("tau")
    (run_dir / "eval.json").write_text(json.dumps(clean_json(tau), indent=1))
    own, why = own_calibration(run_dir, base, args.out / "sim" / name / "own-calibration.json")
    drift: dict[str, Any] = {"why_missing": why}
    corrected = None
    if own is not None:
        drift = stage_drift(run_dir, calibrated.timing, timing_of(base, own["timing"]))
        corrected = predict(entry, with_overrides(calibrated, {f"timing.{k}": v for k, v in own["timing"].items()}),
                            steps, args.out / "sim" / f"{name}-drift-corrected", blocks=spans, kept=kept)
    tput = "throughput_tokens_per_s"
    pa, pc = predicted[tput]["mean"], (corrected or {}).get(tput, {}).get("mean")
    drift["summary"] = effect(pa, pc)
    err_c = rel_errors(measured, corrected) if corrected else {k: None for k in COMPARED}
    return clean_json({
        "name": name, "trial": entry.get("trial"), "params": entry.get("params"), "queue": entry["queue"],
        "run_dir": f"runs/{name}", "sim_dir": f"sim/{name}", "steps": steps, "blocks": len(blocks),
        "kept_blocks": kept, "bucket_use": bucket_use(run_dir, run_cfg),
        "ranks": {"n_target": run_cfg.cluster.n_target, "n_drafter": run_cfg.cluster.n_drafter},
        "measured": measured, "measured_se": se, "predicted": predicted, "predicted_drift_corrected": corrected,
        "rel_error": rel_errors(measured, predicted), "rel_error_drift_corrected": err_c,
        "throughput_error_drift_corrected": err_c.get(tput), "drift": drift["summary"], "drift_detail": drift,
        "within_goal": within_goals(measured, se, corrected or predicted), "within_goal_basis":
            "drift-corrected prediction" if corrected else "a-priori prediction (the run could not be calibrated)",
        "loss_roughness_steps": metrics.get("loss_roughness_steps"), "tau_prompts": tau.get("num_prompts"),
    })


def write_summary(base: DflashConfig, calibrated: DflashConfig, args: ValidateArgs, rows: list[dict[str, Any]],
                  progress: Callable[[str], None]) -> dict[str, Any] | None:
    """validation.json and best.toml (for the recommendation), once every block is over."""
    if any(r["status"] in ("pending", "running") for r in rows):
        progress("blocks still running on other workers; the last worker to finish writes the comparison")
        return None
    from dflash.model.target import load_target

    looks = max_looks(args.takes, args.block_takes)
    done = [r["result"] for r in rows if r["status"] == "done"]
    failed_names = sorted({r["result"]["name"] for r in rows if r["status"] == "failed" and r["result"]})
    failed = [next(r["result"] for r in rows if r["status"] == "failed" and r["result"]["name"] == n)
              for n in failed_names]
    blocks = block_table([r for r in done if r["name"] not in failed_names])
    entries = {c["name"]: c for c in args.selection["configs"]}
    runs_of = seed_runs(args.selection["configs"])  # config -> its runs, one per training seed
    wait_for_held_ends([args.out / "runs" / r for n in entries if n in blocks for r in runs_of.get(n, [n])])
    from tuning.evaluate import sweep_seeds
    from tuning.validation.decision import answer_sentences
    from tuning.validation.quality import heldout_evidence

    held = heldout_evidence({n: [args.out / "runs" / r for r in runs_of.get(n, [n])] for n in entries if n in blocks})
    estimates = held.pop("estimates")
    chosen, comps, rec = evidence_of(blocks, looks, args.block_takes, estimates)  # its note: printed once
    target = load_target(base.target.model) if blocks and args.prompts > 0 else None  # only tau needs it
    configs = [config_row(entries[n], [r for r in done if r["name"] == n], base, calibrated, args, target)
               for n in entries if n in blocks]
    peak = peak_bytes(blocks)
    decision = decide_validation(base.decision, looks, configs, {n: [r for r in done if r["name"] == n]
                                                                 for n in blocks}, estimates, peak)
    # The decision picks (simulator and hardware together); without one, the hardware's evidence alone.
    pick = decision.chosen if decision is not None and decision.chosen else (rec.name if rec else None)
    why = " ".join(answer_sentences(decision, None)) if decision is not None else (rec.words if rec else "")
    best = entries.get(pick) if pick else None
    best_toml = args.out / "best.toml"
    command = None
    if best is not None:
        cfg = with_overrides(base, queue_overrides(best["queue"]))
        atomic_write_text(best_toml, f"# Recommended by dflash validate from {args.selection_path} ({best['name']}): "
                                     f"{one_line(why)}\n# Launch: dflash train --config {best_toml}\n"
                                     + config_to_toml(cfg))
        command = f"dflash train --config {best_toml}"
    payload = clean_json({
        "takes": args.takes, "block_takes": args.block_takes, "block_reason": args.block_reason,
        "window": base.metrics.window, "transient": TRANSIENT_RULE, "max_looks": looks,
        "prediction_seeds": list(prediction_seeds(calibrated)), "sweep_seeds": list(sweep_seeds(calibrated)),
        "data_order": {"seed": base.seed, "order": base.workload.order, "mega_batch": base.workload.mega_batch,
                       "why": "every configuration's run samples with the same seed, so block k of each sees the "
                              "same part of the data order (paired rounds)"},
        "decision": None if decision is None else decision.as_json(),
        "pathology": {r["name"]: r["bucket_use"] for r in configs if r.get("bucket_use")},
        "rounds": max((r["block"] + 1 for r in done), default=0),
        "stopped": stop_reason(rows, comps),
        "objectives": list(rec.objectives) if rec else list(measured_objectives(blocks)), "heldout": held,
        "calibration": args.calibration, "selection": args.selection_path,
        "base_config": base.to_dict(), "chosen": pick, "tested": chosen,
        "comparisons": [c.as_json() for c in comps],
        "recommendation": None if rec is None else rec.as_json(),  # its takes_to_resolve is the printed one
        "best_toml": "best.toml" if best else None, "command": command,
        "devices": {"target": list(base.target.devices), "drafter": list(base.drafter.devices)},
        "goals": GOALS, "configs": configs, "failed": failed, "claims": args.claims_url,
        "block_rows": sorted(done, key=lambda r: (r["block"], list(entries).index(r["name"]))),
    })
    atomic_write_text(args.out / "validation.json", json.dumps(payload, indent=1))
    return payload


def format_validation(payload: dict[str, Any]) -> str:
    def pct(x: float | None) -> str:
        return "n/a" if x is None else f"{100 * x:+.1f}%"

    def num(x: Any, spec: str) -> str:
        return "n/a" if x is None else format(x, spec)

    w = max([12, *(len(r["name"]) + 2 for r in payload["configs"])])
    lines = [f"validated {len(payload['configs'])} configs in {payload.get('rounds')} rounds of "
             f"{payload.get('block_takes')} takes (at most {payload['takes']} each; stopped: {payload.get('stopped')}) "
             f"(goals: {payload['goals']})",
             f"{'config':<{w}}{'knobs':<26}{'tok/s meas':>16}{'pred':>8}{'err':>8}{'mix_eff meas':>18}{'pred':>7}"
             f"{'err':>8}{'rough meas':>12}{'pred':>7}{'err':>8}{'tau':>7}"]
    for r in payload["configs"]:
        m, se, p, e = r["measured"], r["measured_se"], r["predicted"], r["rel_error"]
        q = r["queue"]
        knobs = f"{q['min_ready']}/{q['max_depth']} {q['policy']}"
        lines.append(
            f"{r['name']:<{w}}{knobs:<26}"
            f"{num(m['throughput_tokens_per_s'], ',.0f'):>9} ±{num(se.get('throughput_tokens_per_s'), '.0f'):<5}"
            f"{num(p['throughput_tokens_per_s']['mean'], ',.0f'):>8}{pct(e['throughput_tokens_per_s']):>8}"
            f"{num(m['mix_efficiency'], '.3f'):>11} ±{num(se.get('mix_efficiency'), '.3f'):<5}"
            f"{num(p['mix_efficiency']['mean'], '.3f'):>7}{pct(e['mix_efficiency']):>8}"
            f"{num(m['loss_roughness'], '.3f'):>12}{num(p['loss_roughness']['mean'], '.3f'):>7}"
            f"{pct(e['loss_roughness']):>8}{num(m.get('tau'), '.3f'):>7}")
    for f in payload.get("failed", []):
        lines.append(f"{f['name']}: FAILED ({f.get('error')})")
    lines += heldout_lines(payload.get("heldout"))
    for c in payload.get("comparisons", []):
        lo, hi = (num(x, "+.4g") for x in c["ci95"])
        lines.append(f"{c['config']} vs {c['against']} on {c['objective']}: {num(c['difference'], '+.4g')} "
                     f"(95% interval {lo} .. {hi}): {'resolved' if c['resolved'] else 'NOT resolved'}")
    for r in payload["configs"]:
        d = r.get("drift_detail") or {}
        lines.append(f"{r['name']}: drift target {pct(d.get('target'))}, drafter {pct(d.get('drafter'))}, effect on "
                     f"predicted throughput {pct(d.get('summary'))}; throughput error a priori "
                     f"{pct(r['rel_error']['throughput_tokens_per_s'])}, drift-corrected "
                     f"{pct(r.get('throughput_error_drift_corrected'))}")
    rec = payload.get("recommendation")
    if rec:
        lines.append(f"note, the hardware's block evidence alone (Welch intervals; the decision below decides):\n"
                     f"recommended: {rec['words']}")
    lines += decision_lines(payload)
    if payload.get("command"):
        lines.append(f"launch the full run with:\n  {payload['command']}")
    return "\n".join(lines)


def decision_lines(payload: dict[str, Any]) -> list[str]:
    """How the decision was reached, for the CLI: the blocks and their reason, the outcome with its note,
    and per comparison of the pick the power the hardware alone had at the simulator's predicted
    difference (the answer's two sentences come last, from :mod:`reports.answer`)."""
    d = payload.get("decision")
    if not d:
        return []
    lines = [f"blocks: {payload.get('block_takes')} takes ({payload.get('block_reason')}); window W = "
             f"{payload.get('window')} items in blocks and predictions alike; {payload.get('transient')}",
             f"decision: {d.get('outcome')} ({d.get('note')})"]
    for c in d.get("comparisons") or []:
        if d.get("chosen") not in (c.get("candidate"), c.get("reference")) or c.get("power") is None:
            continue
        lines.append(f"  {c['candidate']} vs {c['reference']} on {c['objective']}: simulated {_g(c.get('sim'))}, "
                     f"measured {_g(c.get('hw'))}, gap z {_z(c.get('gap_z'))}, verdict {c.get('verdict')}; power of "
                     f"the hardware alone at the simulator's predicted difference {c['power']:.0%}")
    return lines


def _g(x: float | None) -> str:
    return "n/a" if x is None else f"{x:+.4g}"


def _z(z: float | None) -> str:
    return "n/a" if z is None else f"{z:+.1f}"


def heldout_lines(held: dict[str, Any] | None) -> list[str]:
    """The held-out objective: the off note once, or each configuration's figures at the compared step."""
    from dflash.pipeline.heldout import heldout_line

    if not held:
        return []
    if not held.get("on"):
        return [held["note"]]
    lines = [f"held-out ({held.get('sequences')} sequences, the same set in every configuration: "
             f"{'yes' if held.get('same_set') else 'NO'}) after step {held['step'] + 1}:"
             if held.get("step") is not None else "held-out:"]
    seeds = held.get("seeds") or {}
    lines += [f"  {n}: {heldout_line(h)}" + (f"  (first of {seeds[n]} seeds)" if seeds.get(n, 1) > 1 else "")
              for n, h in held.get("configs", {}).items()]
    lines += [paired_line(p) for p in held.get("pairs") or []]
    return lines + ([held["note"]] if held.get("note") else [])


def paired_line(p: dict[str, Any]) -> str:
    """One paired held-out comparison: the difference, its interval, the seeds and the width ratio."""
    from tuning.validation.evidence import LABELS

    lo, hi = p["ci95"]
    seeds = "/".join(str(s) for s in p["seeds"])
    between = "between-seed variance included" if p["claim"] else "over sequences only: 1 seed, no claim"
    ratio = p.get("width_ratio")  # None (JSON null): no spread over sequences on either side
    return (f"  {p['config']} - {p['against']}, {LABELS[p['objective']]}: {p['difference']:+.4f} [{lo:+.4f}, "
            f"{hi:+.4f}] (paired over {p['sequences']} sequences, seeds {seeds}, {between}; paired/independent "
            f"width over sequences {'n/a' if ratio is None or ratio != ratio else f'{ratio:.2f}'})")


def progress_printer(msg: str) -> None:
    """Progress goes to stdout with the rest of the command's output (stderr carries only errors)."""
    print(msg, flush=True)


def one_line(text: str) -> str:
    return " ".join(text.split())
