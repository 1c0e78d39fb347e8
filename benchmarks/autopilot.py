"""The queue autopilot against a grid of static pairs, on both H200 examples, 3 seeds (issue #28 item 4).

Run: python benchmarks/autopilot.py [--seeds 0,1,2] [--sim-seconds 3600] [--markdown]

For each example: every static pair min_ready/max_depth = m/3m of the grid (policy random_item, as
the examples), and ``[queue] mode = "auto"`` starting from the example's own 30/90, with
``[metrics] warmup_s = 600``. Reported per configuration: mix_efficiency after the first 10
simulated minutes on each seed, mean and peak queue memory and throughput (means over seeds), and
the time to reach the goal: the first time the mix of the last 10 simulated minutes of takes is at
or above the target (median over seeds). The cheapest static pair that meets the goal on every
seed is marked, and auto's memory and throughput are compared with it.

Then the same under two mid-run changes, from t = 20 simulated minutes:
- ``longer runs``: the loader's length-grouped mega-batches grow 64 -> 128 items (twice as long
  sawtooth runs of one length: longer bursts of long sequences, then of short ones);
- ``cost drift``: target per-item costs drift up 30% (linearly over the next 10 minutes).
Reported: the mix over the last 30 minutes (from 10 minutes after the change) of the baseline's
cheapest static pick and of auto (here allowed up to ``auto_max_depth`` = 240, the room a user
would give it; the steady runs keep the example's 90), its memory, and the recovery time (the
first time after the change when the mix of the last 10 minutes is back at the target).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from dflash.core.config import DflashConfig, load_config, with_overrides
from dflash.core.mixmetrics import entropy, expected_window_entropy
from dflash.core.sampler import ItemSpec, Sampler
from simulator.run import simulate
from simulator.workload import make_sampler

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
NAMES = ("h200-target-bound.toml", "h200-8b-drafter-bound.toml")
GRID = (5, 10, 15, 20, 25, 30, 40)  # static pairs m / 3m
TARGET = 0.95
CHANGE_S = 1200.0  # mid-run changes start here
ROLL_S = 600.0  # "the last 10 simulated minutes"


def rolling_mix(takes: list[dict[str, Any]], p: list[float], window: int = 32) -> list[tuple[float, float]]:
    """(t, mix_efficiency of the windows closed in (t - ROLL_S, t]) at each window's close."""
    eh = expected_window_entropy(p, window)
    closes: list[tuple[float, float]] = []
    counts, n = [0] * len(p), 0
    for r in takes:
        for _ in r["item_ids"]:
            counts[r["bucket"]] += 1
            n += 1
            if n == window:
                closes.append((r["t"], entropy(counts) / eh))
                counts, n = [0] * len(p), 0
    out, lo, total = [], 0, 0.0
    for hi, (t, e) in enumerate(closes):
        total += e
        while closes[lo][0] <= t - ROLL_S:
            total -= closes[lo][1]
            lo += 1
        out.append((t, total / (hi - lo + 1)))
    return out


def mix_between(takes: list[dict[str, Any]], p: list[float], t0: float, t1: float, window: int = 32) -> float:
    """mix_efficiency of the takes in [t0, t1)."""
    eh = expected_window_entropy(p, window)
    effs, counts, n = [], [0] * len(p), 0
    for r in takes:
        if not t0 <= r["t"] < t1:
            continue
        for _ in r["item_ids"]:
            counts[r["bucket"]] += 1
            n += 1
            if n == window:
                effs.append(entropy(counts) / eh)
                counts, n = [0] * len(p), 0
    return statistics.fmean(effs) if effs else float("nan")


def time_to_goal(roll: list[tuple[float, float]], after: float = 0.0) -> float | None:
    """The first time (after ``after`` + ROLL_S) the last 10 minutes' mix is at the target."""
    return next((t for t, e in roll if t >= after + ROLL_S and e >= TARGET), None)


def longer_runs(cfg: DflashConfig, sampler: Sampler, change_item: int) -> Iterator[ItemSpec]:
    """The sampler's stream, and from item ``change_item`` on the stream of a sampler whose
    length-grouped mega-batches are twice as long (same data, same seed)."""
    longer = make_sampler(with_overrides(cfg, {"workload.mega_batch": 2 * cfg.workload.mega_batch}).workload,
                          cfg.target.model, cfg.seed, cfg.drafter.block_size)
    yield from itertools.islice(sampler.iter_items(), change_item)
    yield from itertools.islice(longer.iter_items(), change_item, None)


def cost_drift(t: float) -> float:
    return 1.0 + 0.3 * min(1.0, max(0.0, (t - CHANGE_S) / 600.0))


def run(cfg: DflashConfig, sampler: Sampler, sim_seconds: float, change: str | None, items_per_s: float
        ) -> dict[str, Any]:
    kw: dict[str, Any] = {}
    if change == "longer runs":
        kw["items"] = longer_runs(cfg, sampler, round(items_per_s * CHANGE_S))
    elif change == "cost drift":
        kw["target_cost"] = cost_drift
    res = simulate(cfg, sampler, sim_seconds=sim_seconds, keep_records=True, **kw)
    m, takes = res.metrics, res.take
    roll = rolling_mix(takes, res.item_mix, cfg.metrics.window)
    out = {"mix": m["mix_efficiency"], "mem": m["mean_queue_bytes"] / 2**30, "peak": m["peak_queue_bytes"] / 2**30,
           "tput": m["throughput_tokens_per_s"], "goal_s": time_to_goal(roll), "decisions": len(res.controls),
           "items_per_s": res.summary["produced"] / sim_seconds}
    if change is not None:
        out["mix_after"] = mix_between(takes, res.item_mix, CHANGE_S + ROLL_S, sim_seconds)
        out["recover_s"] = None if (t := time_to_goal(roll, CHANGE_S)) is None else t - CHANGE_S
        out["min_after"] = min((e for t, e in roll if t >= CHANGE_S + ROLL_S), default=float("nan"))
    if res.controls:
        out["end"] = f"{m['final_min_ready']}/{m['final_max_depth']}"
    return out


def evaluate(name: str, seeds: list[int], sim_seconds: float, change: str | None,
             configs: list[tuple[str, dict[str, Any]]], rates: dict[int, float], say: Callable[[str], None]
             ) -> dict[str, list[dict[str, Any]]]:
    base = with_overrides(load_config(EXAMPLES / name), {"metrics.warmup_s": 600.0})
    out: dict[str, list[dict[str, Any]]] = {}
    for label, ov in configs:
        rows = []
        for seed in seeds:
            cfg = with_overrides(base, {"seed": seed, **ov})
            sampler = make_sampler(cfg.workload, cfg.target.model, cfg.seed, cfg.drafter.block_size)
            rows.append(run(cfg, sampler, sim_seconds, change, rates.get(seed, 1.0)))
            rates.setdefault(seed, rows[-1]["items_per_s"])
        out[label] = rows
        say(f"  {name} {change or 'steady'} {label}: " + " ".join(f"{r['mix']:.3f}" for r in rows))
    return out


def fmt(x: float | None, spec: str = ".0f") -> str:
    return "n/a" if x is None or x != x else format(x, spec)


def median_or_none(xs: list[float | None]) -> float | None:
    """The median of the seeds' times, or None ("never") when most seeds never reached it."""
    known = [x for x in xs if x is not None]
    return statistics.median(known) if len(known) * 2 > len(xs) else None


def table(results: dict[str, list[dict[str, Any]]], cheapest: str | None) -> list[str]:
    lines = ["| config | mix_efficiency after 10 min (per seed) | mean queue GiB | peak GiB | tokens/s | "
             "time to goal (median) | autopilot decisions, end |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for label, rows in results.items():
        mark = " (cheapest static meeting 0.95 on every seed)" if label == cheapest else ""
        end = f"{statistics.fmean(r['decisions'] for r in rows):.0f}, " + "/".join(
            sorted({r['end'] for r in rows if 'end' in r})) if label == "auto" else ""
        mixes = " / ".join(f"{r['mix']:.3f}" for r in rows)
        lines.append(
            f"| {label}{mark} | {mixes} | "
            f"{statistics.fmean(r['mem'] for r in rows):.1f} | {max(r['peak'] for r in rows):.1f} | "
            f"{statistics.fmean(r['tput'] for r in rows):,.0f} | "
            f"{fmt(median_or_none([r['goal_s'] for r in rows]))} s | {end} |")
    return lines


def change_table(results: dict[str, list[dict[str, Any]]]) -> list[str]:
    lines = ["| config | mix from 10 min after the change (per seed) | lowest 10-min mix after it | "
             "mean queue GiB | tokens/s | back at the goal after the change |",
             "| --- | --- | --- | --- | --- | --- |"]
    for label, rows in results.items():
        mixes = " / ".join(f"{r['mix_after']:.3f}" for r in rows)
        lines.append(
            f"| {label} | {mixes} | "
            f"{min(r['min_after'] for r in rows):.3f} | {statistics.fmean(r['mem'] for r in rows):.1f} | "
            f"{statistics.fmean(r['tput'] for r in rows):,.0f} | "
            f"{' / '.join(fmt(r['recover_s']) + ' s' for r in rows)} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--sim-seconds", type=float, default=3600.0)
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    say = print
    statics = [(f"{m}/{3 * m}", {"queue.min_ready": m, "queue.max_depth": 3 * m}) for m in GRID]
    auto = [("auto", {"queue.mode": "auto"})]
    auto_room = [("auto (auto_max_depth 240)", {"queue.mode": "auto", "queue.auto_max_depth": 240})]
    for name in NAMES:
        rates: dict[int, float] = {}
        steady = evaluate(name, seeds, args.sim_seconds, None, statics + auto, rates, say)
        meets = [label for label, rows in steady.items() if label != "auto" and all(r["mix"] >= TARGET for r in rows)]
        cheapest = min(meets, key=lambda lb: statistics.fmean(r["mem"] for r in steady[lb])) if meets else None
        print(f"\n### {name}: steady, {args.sim_seconds:g} simulated s, seeds {args.seeds}, warmup_s 600\n")
        print("\n".join(table(steady, cheapest)))
        if cheapest is not None:
            a, c = steady["auto"], steady[cheapest]
            mem = statistics.fmean(r["mem"] for r in a) / statistics.fmean(r["mem"] for r in c)
            per_seed = " / ".join(f"{x['mem'] / y['mem']:.3f}" for x, y in zip(a, c, strict=True))
            tput = statistics.fmean(r["tput"] for r in a) / statistics.fmean(r["tput"] for r in c) - 1
            print(f"\nauto / {cheapest}: mean queue memory {mem:.3f}x (per seed {per_seed}), throughput {tput:+.2%}")
        pick = [(cheapest, dict(statics)[cheapest])] if cheapest else []
        for change in ("longer runs", "cost drift"):
            res = evaluate(name, seeds, args.sim_seconds, change, pick + auto_room, rates, say)
            print(f"\n### {name}: {change} from t = {CHANGE_S:g} s\n")
            print("\n".join(change_table(res)))


if __name__ == "__main__":
    main()
