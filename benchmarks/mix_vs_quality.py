"""Mix versus quality (issue #27 item 3): does the better item mix make the better drafter?

The seed's experiment. The same data, the same steps, the same held-out set, four queue settings:
``fullest 10/30``, ``random_item 10/30``, ``random_item 30/90`` (the hand-picked change) and the pick of a
``dflash sweep`` this script runs on the same base configuration (its ``selection.json``'s first entry,
the knee of the simulated front). Each trains through the real rank job (``dflash train``, one process
per rank) with ``[train] quality_every`` set, so every run's step records carry the held-out metric
(:mod:`dflash.model.heldout`): the weighted block loss and the teacher-forced acceptance length, overall
and per length bucket, with 95% bootstrap intervals over sequences. The held-out sequences are chosen by
the seed and are the same in every run (each run's ``heldout.json`` is checked against the first's).

Compared at equal steps: the last step at which every run has a held-out score (the final step when no
run was cut by ``--minutes``). Each configuration trains ``--seeds`` runs (default 2: another seed is
another initialisation, data order and anchor draw; the held-out set stays the first seed's through
``[train] quality_seed``), and configurations are compared *paired* over the same sequences with the
variance between seeds (:mod:`tuning.validation.paired`, as ``dflash validate`` compares them): a
difference *resolves* when its 95% interval excludes 0; "no difference resolved" is a possible answer
and is said with the intervals. The target's held-out states are computed by the first run and linked
into every other (:func:`dflash.pipeline.heldout.adopt_states`). Also reported: each configuration's
figures with their bootstrap intervals (its first seed's run), ``loss_roughness`` (metrics.json) and
mix_efficiency.

    python benchmarks/mix_vs_quality.py                    # --profile cpu: <= 60 minutes on 2 cores
    python benchmarks/mix_vs_quality.py --profile gpu      # examples/gpu-smollm2-learning.toml's data/shape

``--steps N`` sets the steps of every run; ``--minutes M`` bounds the whole benchmark: each run gets its
share of what is left, wall clock, and a run still training then is stopped by SIGTERM (with a checkpoint;
not ``--max-minutes``, whose time-based learning-rate schedule would make the machine's load decide each
run's decay); the comparison step is then the last scored step all runs reached. Prints one
``mix-vs-quality:`` line and writes it, with the resolve verdict, into benchmarks/RESULTS.md
(``--no-record``: print only). Bad flags: one line, exit status 2. Run again with the same ``--out`` and
flags, it reuses the sweep's pick and every run that reached ``--steps`` and trains the others again (a
run cut short is kept aside as ``RUN.cut-TIME``).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from itertools import combinations
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
SECTION = "## Mix versus quality (`benchmarks/mix_vs_quality.py`, issue #27)"


@dataclass(frozen=True)
class Profile:
    """A base configuration and the sizes that fit its time box."""

    config: Path
    steps: int
    quality_points: int  # held-out scores per run (quality_every = steps // quality_points)
    quality_per_bucket: int
    minutes: float | None
    trials: int
    overrides: tuple[tuple[str, Any], ...] = ()


# CPU: the learning profile (SmolLM2, first exchanges <= 512 tokens, 1 item = 1 sequence). Measured
# (2026-12-05, 2 cores shared with other jobs): 200 steps took 23 minutes for all four runs with the sweep,
# 245-426 s per run, of which ~1.5 min is start-up, the held-out states (60 sequences, one target forward
# each) and the 2 scores. 400 steps: ~35-50 minutes; --minutes 60 bounds it whatever the load (a run the
# cap cuts is compared at the last step every run scored, the midpoint).
PROFILES: dict[str, Profile] = {
    "cpu": Profile(config=ROOT / "examples" / "cpu-smollm2-learning.toml", steps=400, quality_points=2,
                   quality_per_bucket=12, minutes=60.0, trials=8,
                   overrides=(("train.checkpoint_every", 10**6), ("train.log_every", 20))),
    "gpu": Profile(config=ROOT / "examples" / "gpu-smollm2-learning.toml", steps=1200, quality_points=6,
                   quality_per_bucket=16, minutes=None, trials=16,
                   overrides=(("train.checkpoint_every", 10**6),)),
}
FIXED: tuple[tuple[str, dict[str, Any]], ...] = (
    ("fullest 10/30", {"policy": "fullest", "min_ready": 10, "max_depth": 30}),
    ("random_item 10/30", {"policy": "random_item", "min_ready": 10, "max_depth": 30}),
    ("random_item 30/90", {"policy": "random_item", "min_ready": 30, "max_depth": 90}),
)
QUEUE_KEYS = ("min_ready", "max_depth", "max_bytes", "policy", "gate", "items_per_take")


class UsageError(Exception):
    """Bad input at the edge: one line naming the flag and what it allows (exit status 2)."""


class RunFailed(Exception):
    """A dflash verb failed: one line naming it and its log (exit status 1)."""


@dataclass(frozen=True)
class Plan:
    profile: str
    base: Path
    steps: int
    quality_every: int
    quality_per_bucket: int
    minutes: float | None
    trials: int
    out: Path
    record: bool
    overrides: tuple[tuple[str, Any], ...]
    seeds: int = 2


def parse_args(argv: list[str] | None = None) -> Plan:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="cpu", help="cpu (default) or gpu")
    ap.add_argument("--config", help="base configuration instead of the profile's (TOML)")
    ap.add_argument("--steps", type=int, help="steps of every run (>= 2; default: the profile's)")
    ap.add_argument("--minutes", type=float, help="bound on the whole benchmark (> 0; default: cpu 60, gpu none)")
    ap.add_argument("--quality-every", type=int, help="held-out score every N steps (>= 1; default steps / points)")
    ap.add_argument("--quality-per-bucket", type=int, help="held-out sequences per length bucket (>= 1)")
    ap.add_argument("--trials", type=int, help="trials of the sweep that picks the fourth configuration (>= 1)")
    ap.add_argument("--seeds", type=int, default=2, help="training seeds per configuration (>= 1; default 2: "
                                                         "a quality claim needs the variance between runs)")
    ap.add_argument("--out", help="work directory (default: a new one under /tmp)")
    ap.add_argument("--no-record", action="store_true", help="print the line; leave benchmarks/RESULTS.md alone")
    ap.error = lambda message: (_ for _ in ()).throw(UsageError(message))  # type: ignore[method-assign]
    a = ap.parse_args(argv)
    if a.profile not in PROFILES:
        raise UsageError(f"--profile must be one of {', '.join(PROFILES)} (got {a.profile})")
    prof = PROFILES[a.profile]
    steps = prof.steps if a.steps is None else a.steps
    if steps < 2:
        raise UsageError(f"--steps must be >= 2 (got {steps})")
    if a.minutes is not None and not a.minutes > 0:
        raise UsageError(f"--minutes must be > 0 (got {a.minutes})")
    every = a.quality_every if a.quality_every is not None else max(1, steps // prof.quality_points)
    if every < 1 or every > steps:
        raise UsageError(f"--quality-every must be between 1 and --steps = {steps} (got {every})")
    per_bucket = prof.quality_per_bucket if a.quality_per_bucket is None else a.quality_per_bucket
    if per_bucket < 1:
        raise UsageError(f"--quality-per-bucket must be >= 1 (got {per_bucket})")
    if a.seeds < 1:
        raise UsageError(f"--seeds must be >= 1 (got {a.seeds})")
    trials = prof.trials if a.trials is None else a.trials
    if trials < 1:
        raise UsageError(f"--trials must be >= 1 (got {trials})")
    base = Path(a.config) if a.config else prof.config
    if not base.is_file():
        raise UsageError(f"--config must be an existing TOML file (got {a.config})")
    from dflash.core.config import load_config
    from dflash.core.errors import ConfigError

    try:
        load_config(base)
    except ConfigError as exc:
        raise UsageError(f"--config {base}: {exc}") from None
    out = Path(a.out) if a.out else Path(f"/tmp/mix-vs-quality-{a.profile}-{os.getpid()}")
    if out.exists() and any(out.iterdir()) and not (out / "sweep.toml").is_file():
        raise UsageError(f"--out must be a new or empty directory, or an earlier run's of this benchmark (got {out})")
    return Plan(profile=a.profile, base=base, steps=steps, quality_every=every, quality_per_bucket=per_bucket,
                minutes=a.minutes if a.minutes is not None else prof.minutes, trials=trials, out=out,
                record=not a.no_record, overrides=prof.overrides, seeds=a.seeds)


# --------------------------------------------------------------------------- the runs
def write_config(plan: Plan, path: Path, queue: dict[str, Any] | None = None,
                 split: dict[str, int] | None = None, replicate: int = 0) -> Path:
    """The base configuration with the profile's overrides, the held-out metric and ``queue``'s knobs;
    ``replicate`` r > 0: trained with seed + r on the base seed's held-out set."""
    from dflash.core.config import UNSET, config_to_toml, load_config, with_overrides

    over: dict[str, Any] = dict(plan.overrides)
    if replicate:
        seed = load_config(plan.base).seed
        over.update({"seed": seed + replicate, "train.quality_seed": seed})
    over.update({"train.quality_every": plan.quality_every, "train.quality_per_bucket": plan.quality_per_bucket})
    over.update({f"queue.{k}": v for k, v in (queue or {}).items() if k in QUEUE_KEYS})
    over.update({f"cluster.{k}": v for k, v in (split or {}).items()})
    # --steps ends every run (the schedule follows it): no epoch, step or time limit of the base file's
    over.update({"train.epochs": UNSET, "train.max_steps": UNSET, "train.max_minutes": UNSET})
    cfg = with_overrides(load_config(plan.base), over)
    path.write_text(config_to_toml(cfg))
    return path


def dflash(args: list[str], log: Path, env: dict[str, str], what: str, stop_after_s: float | None = None) -> None:
    """One verb. ``stop_after_s``: a wall-clock cap that stops a training run the way a cluster does (SIGTERM:
    it stops after its step with a checkpoint, exit 143), rather than by ``--max-minutes``, which would also
    give the run a time-based learning-rate schedule: then how loaded the machine was would decide when each
    run's rate decays, and runs at equal steps would not be comparable."""
    cmd = [sys.executable, "-m", "dflash", *args]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        try:
            rc = proc.wait(timeout=stop_after_s)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)
            rc = proc.wait()
            rc = 0 if rc == 143 else rc  # stopped by the cap: compared at the last step every run scored
    if rc != 0:
        tail = [x for x in log.read_text(errors="replace").splitlines() if x.strip()][-1:] or ["(no output)"]
        raise RunFailed(f"mix_vs_quality: {what} failed (exit {rc}): {tail[0]} (log {log})")


def sweep_pick(plan: Plan, env: dict[str, str]) -> tuple[str, dict[str, Any], dict[str, int]]:
    """Run ``dflash sweep`` on the base configuration; its selection's first entry (the knee)."""
    cfg = write_config(plan, plan.out / "sweep.toml")
    sweep_dir = plan.out / "sweep"
    if (sweep_dir / "selection.json").is_file():  # a rerun in the same work directory: its pick stands
        return pick_from_selection(json.loads((sweep_dir / "selection.json").read_text()))
    dflash(["sweep", "--config", str(cfg), "--trials", str(plan.trials), "--out", str(sweep_dir)],
           plan.out / "sweep.log", env, "sweep")
    return pick_from_selection(json.loads((sweep_dir / "selection.json").read_text()))


def pick_from_selection(selection: dict[str, Any]) -> tuple[str, dict[str, Any], dict[str, int]]:
    """(label, queue knobs, split) of a ``selection.json``'s first tuned entry."""
    tuned = [c for c in selection["configs"] if str(c.get("name", "")).startswith("tuned-")]
    if not tuned:
        raise RunFailed("mix_vs_quality: the sweep's selection has no tuned configuration")
    c = tuned[0]
    q = c["queue"]
    gate = "" if q.get("gate", "threshold") == "threshold" else f" {q['gate']}"
    take = "" if q.get("items_per_take", 1) == 1 else f" take {q['items_per_take']}"
    label = f"sweep pick {q['policy']} {q['min_ready']}/{q['max_depth']}{gate}{take}"
    split = {k: int(c[k]) for k in ("n_target", "n_drafter") if k in c}
    return label, {k: q[k] for k in QUEUE_KEYS if k in q and q[k] is not None}, split


def train_one(plan: Plan, name: str, cfg: Path, env: dict[str, str], cap_minutes: float | None) -> Path:
    """One run; the held-out target states are the first run's, linked in (one copy for every run)."""
    from dflash.pipeline.heldout import STATES_FILE, adopt_states, publish_states

    run = plan.out / "runs" / name
    if finished(run, plan.steps):  # a rerun in the same work directory keeps every run that reached --steps
        print(f"mix_vs_quality: {name}: reused (it reached {plan.steps} steps)", flush=True)
        return run
    if run.exists():  # cut short (the cap, a kill): kept aside as evidence, trained again from the start
        run.rename(run.with_name(f"{name}.cut-{time.strftime('%Y%m%dT%H%M%S')}"))
    adopt_states(plan.out / STATES_FILE, run)
    args = ["train", "--config", str(cfg), "--out", str(run), "--max-steps", str(plan.steps), "--wandb", "disabled"]
    dflash(args, plan.out / f"train-{name}.log", env, f"train ({name})",
           None if cap_minutes is None else 60.0 * cap_minutes)
    publish_states(run, plan.out / STATES_FILE)
    return run


def finished(run: Path, steps: int) -> bool:
    """Whether ``run`` is a finished run of exactly ``steps`` steps (its last summary says so)."""
    from dflash.core.records import read_records

    if not (run / "summary.jsonl").is_file():
        return False
    last = (list(read_records(run, "summary")) or [{}])[-1]
    return last.get("steps") == steps and last.get("stopped_by") == "max_steps"


def slug(label: str) -> str:
    return "".join(ch if ch.isalnum() else "-" for ch in label).strip("-")


# --------------------------------------------------------------------------- reading and comparing
def heldout_by_step(run: Path) -> dict[int, dict[str, Any]]:
    """The held-out scores of a run's step records, by step."""
    from dflash.core.records import read_records

    return {int(r["step"]): r["heldout"] for r in read_records(run, "step") if r.get("heldout")}


def common_step(scores: list[dict[int, dict[str, Any]]]) -> int | None:
    """The last step every run has a held-out score at (equal steps), or None."""
    steps = set.intersection(*(set(s) for s in scores)) if scores else set()
    return max(steps) if steps else None


def disjoint(a: list[float] | None, b: list[float] | None) -> bool:
    return bool(a and b) and (a[1] < b[0] or b[1] < a[0])


def verdicts(rows: list[dict[str, Any]], key: str) -> list[str]:
    """Pairs whose ``key`` intervals are disjoint, as 'A > B (by D)'; empty when nothing resolves."""
    out = []
    for a, b in combinations(rows, 2):
        if disjoint(a[f"{key}_ci"], b[f"{key}_ci"]):
            hi, lo = (a, b) if a[key] > b[key] else (b, a)
            out.append(f"{hi['config']} > {lo['config']} (by {hi[key] - lo[key]:.3f})")
    return out


def paired_verdict(pairs: list[dict[str, Any]]) -> str:
    """The paired comparisons (validation.json's ``heldout.pairs`` form): the resolved ones, else the widest
    interval, so "no difference resolved" says how small a difference the runs could have resolved."""
    from tuning.validation.evidence import LABELS

    if not pairs:
        return "paired: nothing compared"
    seeds = sorted({s for p in pairs for s in p["seeds"]})
    claim = all(p["claim"] for p in pairs)
    head = f"paired over {pairs[0]['sequences']} sequences, {'/'.join(map(str, seeds))} seed(s) per configuration"
    if not claim:
        head += " (one seed: over sequences only, no quality claim)"
    parts = []
    for obj in dict.fromkeys(p["objective"] for p in pairs):
        ps = [p for p in pairs if p["objective"] == obj]
        done = [p for p in ps if not p["ci95"][0] <= 0.0 <= p["ci95"][1]]
        half = max((p["ci95"][1] - p["ci95"][0]) / 2 for p in ps)
        ratios = [p["width_ratio"] for p in ps if p.get("width_ratio") is not None]
        ratio = f", paired/independent width over sequences {min(ratios):.2f}-{max(ratios):.2f}" if ratios else ""
        if done:
            parts.append(f"{LABELS[obj]}: " + "; ".join(f"{p['config']} - {p['against']} {p['difference']:+.3f} "
                                                         f"[{p['ci95'][0]:+.3f}, {p['ci95'][1]:+.3f}]" for p in done)
                         + f" resolved{ratio}")
        else:
            parts.append(f"{LABELS[obj]}: no difference resolved (largest half-width {half:.3f}: a difference "
                         f"smaller than that could not resolve{ratio})")
    return f"{head}: " + "; ".join(parts)


def summarise(rows: list[dict[str, Any]]) -> str:
    """The resolve verdict on acceptance (the objective) and on loss."""
    acc, loss = verdicts(rows, "acceptance"), verdicts(rows, "loss")
    widths = [(r["acceptance_ci"][1] - r["acceptance_ci"][0]) / 2 for r in rows if r["acceptance_ci"]]
    hw = f"acceptance half-widths {min(widths):.3f}-{max(widths):.3f}" if widths else "no acceptance interval"
    parts = [f"acceptance: {'; '.join(acc)} resolved" if acc else f"acceptance: no difference resolved ({hw})"]
    parts.append(f"loss: higher is worse, {'; '.join(loss)} resolved" if loss else "loss: no difference resolved")
    return "; ".join(parts)


def _ci(v: list[float] | None, spec: str) -> str:
    return f"[{v[0]:{spec}}, {v[1]:{spec}}]" if v else "[n/a]"


def result_line(rows: list[dict[str, Any]], steps: int, minutes: float, command: str) -> str:
    """``mix-vs-quality: <config> loss X [LO, HI] acc Y [LO, HI]; ... N steps, M min, <command>``."""
    parts = [f"{r['config']} loss {r['loss']:.3f} {_ci(r['loss_ci'], '.3f')} acc {r['acceptance']:.3f} "
             f"{_ci(r['acceptance_ci'], '.3f')}" for r in rows]
    return f"mix-vs-quality: {'; '.join(parts)}; {steps} steps, {minutes:.0f} min, {command}"


def row_of(label: str, run: Path, step: int, scores: dict[int, dict[str, Any]]) -> dict[str, Any]:
    h = scores[step]
    metrics = json.loads((run / "metrics.json").read_text()) if (run / "metrics.json").is_file() else {}
    return {"config": label, "run": str(run), "step": step,
            "loss": h["loss"], "loss_ci": h.get("loss_ci"), "acceptance": h["acceptance"],
            "acceptance_ci": h.get("acceptance_ci"), "sequences": h.get("sequences"), "blocks": h.get("blocks"),
            "per_bucket": [{k: b.get(k) for k in ("bucket", "sequences", "blocks", "loss", "loss_ci", "acceptance",
                                                  "acceptance_ci")} for b in h.get("per_bucket", [])],
            "loss_roughness": metrics.get("loss_roughness"), "mix_efficiency": metrics.get("mix_efficiency")}


def print_table(rows: list[dict[str, Any]]) -> None:
    def f(x: Any, spec: str = ".3f") -> str:
        return "n/a" if x is None else format(x, spec)

    for r in rows:
        per = "  ".join(f"b{b['bucket']} {f(b['acceptance'])} {_ci(b['acceptance_ci'], '.3f')}"
                        for b in r["per_bucket"])
        print(f"  {r['config']:<40} acc {f(r['acceptance'])} {_ci(r['acceptance_ci'], '.3f')}  loss {f(r['loss'])} "
              f"{_ci(r['loss_ci'], '.3f')}  loss_roughness {f(r['loss_roughness'])}  mix_efficiency "
              f"{f(r['mix_efficiency'])}")
        print(f"  {'':<40} per bucket: {per}")


def bucket_text(r: dict[str, Any]) -> str:
    """One configuration's per-bucket acceptance with intervals, and its loss_roughness."""
    per = ", ".join(f"b{b['bucket']} {b['acceptance']:.3f} {_ci(b['acceptance_ci'], '.3f')}"
                    if b["acceptance"] is not None else f"b{b['bucket']} n/a" for b in r["per_bucket"])
    rough = "n/a" if r["loss_roughness"] is None else f"{r['loss_roughness']:.4f}"
    mix = "n/a" if r.get("mix_efficiency") is None else f"{r['mix_efficiency']:.3f}"
    return f"acceptance per bucket {per}; loss_roughness {rough}; mix_efficiency {mix}"


def record(line: str, verdict: str, rows: list[dict[str, Any]], profile: str, path: Path = RESULTS) -> None:
    """Put this profile's block into RESULTS.md's section (replacing the profile's earlier block)."""
    begin, end = f"<!-- mix-vs-quality {profile} -->", f"<!-- /mix-vs-quality {profile} -->"
    per = "\n".join(f"- {r['config']}: {bucket_text(r)}" for r in rows)
    block = (f"{begin}\nProfile `{profile}` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}):\n\n{line}\n\n"
             f"Resolved (95% interval of the paired difference excludes 0, at equal steps): {verdict}.\n\n{per}\n{end}")
    text = path.read_text() if path.is_file() else "# Benchmark results\n"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1]
    elif SECTION in text:
        head, rest = text.split(SECTION, 1)
        nxt = rest.find("\n## ")
        body, tail = (rest, "") if nxt < 0 else (rest[:nxt], rest[nxt:])
        text = head + SECTION + body.rstrip("\n") + "\n\n" + block + "\n" + tail
    else:
        text = text.rstrip("\n") + f"\n\n{SECTION}\n\n{block}\n"
    tmp = path.with_name(f".{path.name}.partial")
    tmp.write_text(text)
    os.replace(tmp, path)


# --------------------------------------------------------------------------- main
def run_benchmark(plan: Plan, command: str) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled"}
    if plan.profile == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    plan.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    label, queue, split = sweep_pick(plan, env)
    print(f"mix_vs_quality: the sweep ({plan.trials} trials, {time.perf_counter() - t0:.0f} s) picked {label}",
          flush=True)
    configs = [(n, q, {}) for n, q in FIXED] + [(label, queue, split)]
    jobs = [(c, r) for r in range(plan.seeds) for c in configs]  # every configuration's first seed first
    runs: list[tuple[str, Path]] = []
    replicas: dict[str, list[Path]] = {}
    for k, ((name, q, sp), r) in enumerate(jobs):
        cap = None
        if plan.minutes is not None:
            left = plan.minutes - (time.perf_counter() - t0) / 60
            cap = max(0.5, left / (len(jobs) - k))  # wall clock: start-up and the held-out states included
        tag = slug(name) + (f"-seed{r}" if r else "")
        before = (plan.out / f"{tag}.toml").read_text() if (plan.out / f"{tag}.toml").is_file() else None
        cfg = write_config(plan, plan.out / f"{tag}.toml", q, sp, replicate=r)
        if before is not None and before != cfg.read_text():
            raise RunFailed(f"mix_vs_quality: {plan.out} holds runs of other settings ({cfg.name} differs): "
                            "use a new --out")
        t = time.perf_counter()
        run = train_one(plan, tag, cfg, env, cap)
        print(f"mix_vs_quality: {name}{f' (seed +{r})' if r else ''}: {time.perf_counter() - t:.0f} s", flush=True)
        if not r:
            runs.append((name, run))
        replicas.setdefault(name, []).append(run)
    ids = [json.loads((r / "heldout.json").read_text())["ids"] for _, r in runs]
    if any(i != ids[0] for i in ids):
        raise RunFailed("mix_vs_quality: the runs' held-out sets differ (heldout.json ids): not comparable")
    scores = [heldout_by_step(r) for _, r in runs]
    step = common_step(scores)
    if step is None:
        raise RunFailed("mix_vs_quality: no step with a held-out score in every run (raise --minutes or lower "
                        "--quality-every)")
    rows = [row_of(name, run, step, s) for (name, run), s in zip(runs, scores, strict=True)]
    minutes = (time.perf_counter() - t0) / 60
    line = result_line(rows, step + 1, minutes, command)
    from tuning.validation.quality import heldout_evidence

    held = heldout_evidence(replicas)  # paired over the same sequences, with the variance between seeds
    verdict = paired_verdict(held.get("pairs") or []) + "; per configuration, " + summarise(rows)
    res = {"line": line, "verdict": verdict, "rows": rows, "step": step + 1, "minutes": minutes,
           "seeds": plan.seeds, "pairs": held.get("pairs") or [], "paired_step": held.get("step"),
           "heldout_sequences": len(ids[0]), "sweep_pick": {"label": label, "queue": queue, "split": split}}
    (plan.out / "mix_vs_quality.json").write_text(json.dumps(res, indent=1))
    return res


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        plan = parse_args(argv)
    except UsageError as exc:
        print(f"mix_vs_quality: {exc}", file=sys.stderr)
        return 2
    command = "python benchmarks/mix_vs_quality.py" + "".join(f" {shlex.quote(a)}" for a in argv)
    try:
        res = run_benchmark(plan, command)
    except RunFailed as exc:
        print(str(exc), file=sys.stderr)
        return 1
    print_table(res["rows"])
    print(res["line"])
    print(f"resolved: {res['verdict']}")
    if plan.record:
        record(res["line"], res["verdict"], res["rows"], plan.profile)
        print(f"mix_vs_quality: recorded in {RESULTS.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
