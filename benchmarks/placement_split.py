"""The recommended GPU split for an 8B target on 1, 2 and 4 nodes of 8 GPUs, at two NIC speeds.

Run: python benchmarks/placement_split.py [--sim-seconds 300] [--seeds 1] [--what-if 100,25,10,5] [--no-write]

The shape is examples/h200-8b-drafter-bound.toml (Qwen3-8B-like target, ~1B drafter, items of 8
sequences of up to 2,048 tokens, 40 KB of hidden states per token, its timing from docs/REFERENCE.md's
H200 figures) with its queue (min_ready 30, max_depth 90). For each node count every split
``n_target + n_drafter = 8 x nodes`` is simulated with its own placement (ranks fill nodes in order,
targets first; dflash.core.links), moves priced by tier: NVLink 4 within a node, the NIC across
(`nic200`, `nic400`). The recommendation is the split search's own rule (tuning.select.split_table: the
knee of the splits' throughput/mix_efficiency front), beside the split of highest throughput.

A second table answers "where would the advice change?": on 2 nodes, NICs slower than any real one
(``--what-if`` Gb/s, set as timing.transfer_inter_s_per_byte) until the recommendation moves. The
table is written into benchmarks/RESULTS.md between its markers (replaced on a rerun).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

from dflash.core.config import DflashConfig, load_config, with_overrides
from dflash.core.links import LINKS, TIER_NETWORK, pair_tiers
from simulator.run import simulate
from tuning.evaluate import Evaluator
from tuning.select import split_table
from tuning.space import Split

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "h200-8b-drafter-bound.toml"
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
SECTION = "## Transfers priced by placement: the GPU split on 1, 2 and 4 nodes (`benchmarks/placement_split.py`)"
BEGIN, END = "<!-- placement-split -->", "<!-- /placement-split -->"
NODES = (1, 2, 4)
NICS = ("nic200", "nic400")


def cluster_cfg(base: DflashConfig, nodes: int, seeds: int, overrides: dict[str, Any]) -> DflashConfig:
    gpus = 8 * nodes
    return with_overrides(base, {"cluster.gpus": gpus, "cluster.gpus_per_node": 8, "cluster.n_target": 1,
                                 "cluster.n_drafter": gpus - 1, "sweep.seeds_per_trial": seeds, **overrides})


def scan(cfg: DflashConfig, sim_seconds: float) -> dict[str, Any]:
    """Every split of ``cfg.cluster.gpus`` simulated with the configured queue; the search's pick."""
    gpus = cfg.cluster.gpus
    assert gpus is not None
    ev = Evaluator(cfg, sim_seconds=sim_seconds)
    rows = []
    for n_target in range(1, gpus):
        e = ev.evaluate(cfg.queue, Split(n_target, gpus - n_target))
        rows.append({"number": n_target, "n_target": n_target, "n_drafter": gpus - n_target, "feasible": True,
                     "throughput_tokens_per_s": e.mean["throughput_tokens_per_s"],
                     "mix_efficiency": e.mean["mix_efficiency"]})
    table = split_table(rows, gpus=gpus)
    ranked = sorted(rows, key=lambda r: -r["throughput_tokens_per_s"])
    fastest, second = ranked[0], ranked[1]
    best = table["best"]
    return {"best": (best["n_target"], best["n_drafter"]), "best_tput": best["throughput_tokens_per_s"],
            "best_mix": best["mix_efficiency"], "fastest": (fastest["n_target"], fastest["n_drafter"]),
            "fastest_tput": fastest["throughput_tokens_per_s"], "rows": rows,
            "runner_up": (second["n_target"], second["n_drafter"]),
            "runner_up_gap": 1 - second["throughput_tokens_per_s"] / fastest["throughput_tokens_per_s"]}


def moves(cfg: DflashConfig, split: tuple[int, int], sim_seconds: float) -> dict[str, float]:
    """For one split: the share of drafter pairs across nodes, and the moves' share of the drafters' busy time."""
    c = with_overrides(cfg, {"cluster.n_target": split[0], "cluster.n_drafter": split[1]})
    from simulator.workload import make_sampler

    res = simulate(c, make_sampler(c.workload, seed=c.seed), sim_seconds=sim_seconds)
    tiers = [t for row in pair_tiers(c.cluster) for t in row]
    busy = res.metrics["drafter_utilization"] * sim_seconds * split[1]
    tr = res.summary["transfer"]
    return {"cross": tiers.count(TIER_NETWORK) / len(tiers), "move_share": tr["seconds"] / busy if busy else 0.0,
            "ms_per_take": 1e3 * tr["seconds"] / max(res.summary["takes"], 1),
            "mb_per_take": tr["bytes"] / 1e6 / max(res.summary["takes"], 1)}


def split_text(s: tuple[int, int]) -> str:
    return f"{s[0]} + {s[1]}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sim-seconds", type=float, default=300.0)
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--what-if", default="100,25,10,5", help="slower NICs (Gb/s) tried on 2 nodes")
    ap.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md alone")
    args = ap.parse_args(argv)
    t0 = time.time()
    load0 = os.getloadavg()[0]
    base = load_config(EXAMPLE)
    lines = ["| nodes x GPUs | NIC | recommended split (targets + drafters) | tokens/s | highest-throughput split "
             "| tokens/s | next split (its deficit) | drafter pairs across nodes | moves per take "
             "| moves' share of drafter time |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    found: dict[tuple[int, str], dict[str, Any]] = {}
    for nodes in NODES:
        for nic in NICS:
            cfg = cluster_cfg(base, nodes, args.seeds, {"cluster.network_link": nic})
            r = scan(cfg, args.sim_seconds)
            m = moves(cfg, r["best"], args.sim_seconds)
            found[(nodes, nic)] = r
            lines.append(f"| {nodes} x 8 | {LINKS[nic].gb_per_s * 8:.0f} Gb/s | **{split_text(r['best'])}** "
                         f"| {r['best_tput']:,.0f} | {split_text(r['fastest'])} | {r['fastest_tput']:,.0f} "
                         f"| {split_text(r['runner_up'])} (-{100 * r['runner_up_gap']:.1f}%) | {100 * m['cross']:.0f}% "
                         f"| {m['mb_per_take']:.0f} MB, {m['ms_per_take']:.1f} ms "
                         f"| {100 * m['move_share']:.2f}% |")
            print(lines[-1], flush=True)
    changes = [n for n in NODES if found[(n, "nic200")]["best"] != found[(n, "nic400")]["best"]]
    what_if = ["| NIC (2 nodes x 8) | recommended split | tokens/s | moves' share of drafter time |",
               "| --- | --- | --- | --- |"]
    moved_at = None
    ref = found[(2, "nic400")]["best"]
    for gbps in [float(x) for x in args.what_if.split(",") if x.strip()]:
        cfg = cluster_cfg(base, 2, args.seeds, {"timing.transfer_inter_s_per_byte": 8 / (gbps * 1e9)})
        r = scan(cfg, args.sim_seconds)
        m = moves(cfg, r["best"], args.sim_seconds)
        what_if.append(f"| {gbps:g} Gb/s | **{split_text(r['best'])}** | {r['best_tput']:,.0f} "
                       f"| {100 * m['move_share']:.2f}% |")
        print(what_if[-1], flush=True)
        if moved_at is None and r["best"] != ref:
            moved_at = gbps
    wall = time.time() - t0
    verdict = ("the recommendation differs between 200 and 400 Gb/s on " + ", ".join(f"{n} node(s)" for n in changes)
               if changes else "the recommendation is the same at 200 and 400 Gb/s on 1, 2 and 4 nodes")
    verdict += (f"; on 2 nodes it first moves at {moved_at:g} Gb/s" if moved_at is not None
                else "; on 2 nodes it does not move even at the slowest NIC tried")
    block = "\n".join([
        BEGIN,
        f"`python benchmarks/placement_split.py --sim-seconds {args.sim_seconds:g} --seeds {args.seeds} "
        f"--what-if {args.what_if}` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {wall:.0f} s wall on the "
        f"shared 2-core machine, load average {load0:.1f} at the start; simulated, {args.sim_seconds:g} s per split "
        f"and seed; examples/h200-8b-drafter-bound.toml, NVLink 4 within a node):", "", *lines, "",
        f"**{verdict[0].upper() + verdict[1:]}.**", "", *what_if, END])
    print(block)
    if not args.no_write:
        write_block(block)
    return 0


def write_block(block: str, path: Path = RESULTS) -> None:
    """Replace the marked block, or append the section with it; atomically."""
    text = path.read_text() if path.is_file() else "# Benchmark results\n"
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        text = head + block + rest.split(END, 1)[1]
    else:
        text = text.rstrip("\n") + f"\n\n{SECTION}\n\n{block}\n"
    tmp = path.with_name(f".{path.name}.partial")
    tmp.write_text(text)
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main())
