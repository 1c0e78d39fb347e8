"""Simulator fidelity on the CPU with SmolLM2 (issue #7): calibrate, then predict configs not run.

For each CPU profile (target-bound ``cpu-smollm2`` and the drafter-bound variant): one real run with
the profile's own knobs calibrates the simulator; then ``dflash validate`` runs two *other*
configurations (other knobs, two policies) for ``--takes`` takes each on the real trainer and
compares them with the calibrated prediction for the same budget. Prints the table for
benchmarks/RESULTS.md. Every stage is skipped when its output exists, so a killed run resumes.

    python benchmarks/fidelity.py --out fidelity --takes 300 --cal-steps 300   # ~1 h on 2 cores
    python benchmarks/fidelity.py --out fidelity --utilization 2+2 --steps 40   # issue #26: busy agrees
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.stages import sh  # noqa: E402

PROFILES = {
    "target-bound": (ROOT / "examples" / "cpu-smollm2.toml",
                     [{"name": "tb-fullest-10-30", "queue": {"min_ready": 10, "max_depth": 30, "policy": "fullest"}},
                      {"name": "tb-prop-5-60", "queue": {"min_ready": 5, "max_depth": 60,
                                                         "policy": "proportional"}}]),
    "drafter-bound": (ROOT / "examples" / "cpu-smollm2-drafter-bound.toml",
                      [{"name": "db-random-10-30", "queue": {"min_ready": 10, "max_depth": 30,
                                                             "policy": "random_item"}},
                       {"name": "db-fullest-20-60", "queue": {"min_ready": 20, "max_depth": 60,
                                                              "policy": "fullest"}}]),
}


def run_profile(name: str, out: Path, takes: int, cal_steps: int) -> dict:
    profile, configs = PROFILES[name]
    d = out / name
    d.mkdir(parents=True, exist_ok=True)
    log = d / "log.txt"
    cal_run, cal = d / "cal-run", d / "calibration.json"
    if not (cal_run / "metrics.json").exists():
        if cal_run.exists():
            import shutil

            shutil.rmtree(cal_run)
        sh(["dflash", "train", "--config", str(profile), "--max-steps", str(cal_steps), "--out", str(cal_run),
            "--wandb", "disabled"], log)
    if not cal.exists():
        sh(["dflash", "calibrate", "--run", str(cal_run), "--out", str(cal)], log)
    sel = d / "selection.json"
    sel.write_text(json.dumps({"configs": configs}))
    val = d / "validation"
    if not (val / "validation.json").exists():
        sh(["dflash", "validate", "--config", str(profile), "--selection", str(sel), "--calibration", str(cal),
            "--takes", str(takes), "--out", str(val)], log)
    return json.loads((val / "validation.json").read_text())


def repredict(name: str, out: Path) -> dict:
    """Refit the calibration from the same calibration run with the current code and predict the
    validated configs again; the real runs are reused. The earlier files are kept as ``*.v1.json``."""
    from dflash.core.config import load_config
    from simulator.calibration import apply_calibration, calibrate, write_calibration
    from tuning.validation.metrics import rel_errors, within_goals
    from tuning.validation.predict import predict

    profile, _ = PROFILES[name]
    d = out / name
    base = load_config(profile)
    for f in ("calibration.json", "validation/validation.json"):
        old = d / f
        if not old.with_suffix(".v1.json").exists():
            old.with_suffix(".v1.json").write_text(old.read_text())
    write_calibration(calibrate([d / "cal-run"], base), d / "calibration.json")
    calibrated = apply_calibration(base, d / "calibration.json")
    payload = json.loads((d / "validation" / "validation.json").read_text())
    for r in payload["configs"]:
        r["predicted"] = predict(r, calibrated, r["steps"], d / "validation" / "sim" / r["name"])
        r["rel_error"] = rel_errors(r["measured"], r["predicted"])
        r["within_goal"] = within_goals(r["measured"], r["measured_se"], r["predicted"])
    (d / "validation" / "validation.json").write_text(json.dumps(payload, indent=1))
    return payload


def utilization(out: Path, shape: str, steps: int) -> str:
    """Issue #26 item 3: on a calibrated T + D CPU job, predicted and measured utilisations agree.

    A sibling run of the CPU profile with that shape calibrates the simulator; a second run (another
    seed: other items) is measured; the calibrated simulator predicts the second run's config for the
    same number of steps. Both sides count busy the same way (dflash.core.runmetrics)."""
    from dflash.core.config import load_config, with_overrides
    from dflash.pipeline.trainer import train
    from simulator.calibration import apply_calibration, calibrate, write_calibration
    from tuning.validation.predict import predict

    n_t, n_d = (int(x) for x in shape.split("+"))
    base = with_overrides(load_config(PROFILES["target-bound"][0]), {
        "cluster.n_target": n_t, "cluster.n_drafter": n_d, "train.max_steps": steps, "train.log_every": 10**6})
    d = out / f"utilization-{n_t}x{n_d}"
    runs = {}
    for name, seed in (("sibling", base.seed), ("measured", base.seed + 1)):
        run = d / name
        if not (run / "metrics.json").exists():
            if run.exists():
                import shutil

                shutil.rmtree(run)
            train(with_overrides(base, {"seed": seed}), run)
        runs[name] = json.loads((run / "metrics.json").read_text())
    write_calibration(calibrate([d / "sibling"], base, seed=base.seed), d / "calibration.json")
    calibrated = apply_calibration(with_overrides(base, {"seed": base.seed + 1}), d / "calibration.json")
    queue = {k: v for k, v in base.queue.__dict__.items() if k in ("min_ready", "max_depth", "policy")}
    pred = predict({"name": "measured", "queue": queue}, calibrated, steps, d / "sim")
    rows = [f"{n_t} target + {n_d} drafter ranks, {steps} steps, CPU profile; calibrated on the sibling run",
            "| metric | predicted (3 seeds) | measured | difference |", "|---|---|---|---|"]
    for k in ("drafter_utilization", "target_utilization", "drafter_gate_wait_frac", "throughput_tokens_per_s"):
        p, m = pred[k]["mean"], runs["measured"].get(k)
        diff = "n/a" if p is None or m is None else (f"{p - m:+.3f}" if "tokens" not in k else f"{(p - m) / m:+.1%}")
        rows.append(f"| {k} | {_f(p, '.3f')} | {_f(m, '.3f')} | {diff} |")
    text = "\n".join(rows)
    (d / "utilization.md").write_text(text + "\n")
    return text


def table(results: dict[str, dict]) -> str:
    rows = ["| profile | config | metric | predicted | measured | error | measurement SE | goal met |",
            "|---|---|---|---|---|---|---|---|"]
    for prof, payload in results.items():
        for r in payload["configs"]:
            for k, spec in (("throughput_tokens_per_s", ",.0f"), ("mix_efficiency", ".3f"),
                            ("loss_roughness", ".3f")):
                p = r["predicted"][k]["mean"]
                m = r["measured"][k]
                se = r["measured_se"].get(k)
                err = r["rel_error"][k] if k != "mix_efficiency" else (None if p is None or m is None else p - m)
                err_s = "n/a" if err is None else (f"{err:+.3f} abs" if k == "mix_efficiency" else f"{100 * err:+.1f}%")
                rows.append(f"| {prof} | {r['name']} | {k} | {_f(p, spec)} | {_f(m, spec)} | {err_s} | "
                            f"{_f(se, spec)} | {r['within_goal'].get(k)} |")
    rows.append("")
    rows.append("| profile | config | steps | tau | loss_roughness | mix_efficiency |")
    rows.append("|---|---|---|---|---|---|")
    for prof, payload in results.items():
        for r in payload["configs"]:
            m = r["measured"]
            rows.append(f"| {prof} | {r['name']} | {r['steps']} | {_f(m.get('tau'), '.3f')} | "
                        f"{_f(m['loss_roughness'], '.3f')} | {_f(m['mix_efficiency'], '.3f')} |")
    return "\n".join(rows)


def _f(x: float | None, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("fidelity"))
    ap.add_argument("--takes", type=int, default=300)
    ap.add_argument("--cal-steps", type=int, default=300)
    ap.add_argument("--profiles", default="target-bound,drafter-bound")
    ap.add_argument("--repredict", action="store_true",
                    help="reuse the real runs; refit the calibration and predict again with the current code")
    ap.add_argument("--utilization", metavar="T+D", default=None,
                    help="only the utilisation check of issue #26 on a calibrated T+D job (e.g. 2+2)")
    ap.add_argument("--steps", type=int, default=40, help="steps of each run of --utilization")
    a = ap.parse_args()
    if a.utilization:
        print(utilization(a.out, a.utilization, a.steps))
        return
    if a.repredict:
        results = {p: repredict(p, a.out) for p in a.profiles.split(",")}
    else:
        results = {p: run_profile(p, a.out, a.takes, a.cal_steps) for p in a.profiles.split(",")}
    text = table(results)
    (a.out / "fidelity.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
