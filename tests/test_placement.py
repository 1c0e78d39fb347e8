"""Transfers priced by placement (docs/ARCHITECTURE.md, "Transfers priced by placement"): a hidden-state
move costs its bytes at the rate of the tier its two ranks sit in (one device, one node, two nodes); no
tier is free unless the user says so; a calibration sets a tier's rate only from pairs that ran in it,
and never the NIC's from two ends on one host (a "two-node" rehearsal on one machine)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from dflash.core.config import ClusterConfig, DflashConfig, TimingConfig, config_from_dict, with_overrides
from dflash.core.errors import ConfigError
from dflash.core.links import LINKS, TIER_DEVICE, TIER_NETWORK, TIER_NODE, TIERS, pair_tiers, tier_rates
from dflash.core.records import read_records
from simulator.calibration import calibrate
from simulator.run import simulate
from simulator.workload import make_sampler
from tuning.evaluate import Evaluator
from tuning.space import Split

ONE_SECOND_TAKES = {  # every take costs 1 s of drafter compute plus its moves; targets are 10x faster
    "timing": {"target_fixed_s": 0.05, "target_per_token_s": 0.0, "target_noise": "deterministic",
               "drafter_fixed_s": 1.0, "drafter_per_anchor_s": 0.0, "drafter_noise": "deterministic"},
    "workload": {"lengths": "lognormal", "n_sequences": 400, "seqs_per_item": 1},
    "queue": {"min_ready": 1, "max_depth": 20},
}


def cfg_with(**sections: dict) -> DflashConfig:
    data = {k: dict(v) for k, v in ONE_SECOND_TAKES.items()}
    for name, table in sections.items():
        data.setdefault(name, {}).update(table)
    return config_from_dict(data)


def test_no_tier_is_free_unless_the_user_says_so() -> None:
    rates = tier_rates(ClusterConfig(), TimingConfig())
    assert set(rates) == set(TIERS)
    for tier in TIERS:
        assert rates[tier].s_per_byte > 0, tier
        assert rates[tier].origin == LINKS[rates[tier].origin].name  # a named link, documented with its source
    free = tier_rates(ClusterConfig(), TimingConfig(transfer_device_s_per_byte=0.0))
    assert free[TIER_DEVICE].s_per_byte == 0.0 and free[TIER_DEVICE].origin == "timing.transfer_device_s_per_byte"
    assert free[TIER_NODE].s_per_byte > 0 and free[TIER_NETWORK].s_per_byte > 0


def test_the_named_links_are_the_documented_figures() -> None:
    """Peaks in one direction: NVLink 4/5 are half their both-direction 900 GB/s and 1.8 TB/s; a NIC's
    Gb/s over 8; PCIe x16 at 128b/130b; a device copy reads and writes each byte (half of HBM)."""
    gb = {name: link.gb_per_s for name, link in LINKS.items()}
    assert gb["nvlink4"] == 900 / 2 and gb["nvlink5"] == 1800 / 2
    assert gb["nic200"] == 200 / 8 and gb["nic400"] == 400 / 8
    assert gb["pcie4"] == pytest.approx(16 * 16 * 128 / 130 / 8, rel=0.01)
    assert gb["pcie5"] == pytest.approx(32 * 16 * 128 / 130 / 8, rel=0.01)
    assert gb["hbm3"] == 3350 / 2 and gb["hbm3e"] == 4800 / 2
    reference = (Path(__file__).resolve().parent.parent / "docs/REFERENCE.md").read_text()
    for name in LINKS:
        assert f"`{name}`" in reference, name


def test_ranks_fill_nodes_in_order_targets_first() -> None:
    """Two nodes of 8: 5 targets + 11 drafters put drafters 0-2 on node 0 with every target and
    drafters 3-10 on node 1; with one shared device per node a same-node pair is a same-device pair."""
    tiers = pair_tiers(ClusterConfig(n_target=5, n_drafter=11, gpus_per_node=8))
    assert all(row[:3] == [TIER_NODE] * 3 and row[3:] == [TIER_NETWORK] * 8 for row in tiers)
    sharded = pair_tiers(ClusterConfig(n_target=2, n_drafter=8, gpus_per_target=4, gpus_per_node=8))
    assert sharded == [[TIER_NETWORK] * 8, [TIER_NETWORK] * 8]  # targets fill node 0; every drafter is on node 1
    shared = pair_tiers(ClusterConfig(n_target=1, n_drafter=1, shared_device=True))
    assert shared == [[TIER_DEVICE]]


def test_each_take_costs_its_bytes_at_its_pairs_tier_rate() -> None:
    """Nodes of 3 GPUs: producers on GPUs 0 and 1, drafter 0 on GPU 2 (one node), drafter 1 on GPU 3
    (the next node). No rate is set: the links' own (PCIe 4 within a node, a 200 Gb/s NIC across)."""
    cfg = cfg_with(cluster={"n_target": 2, "n_drafter": 2, "gpus_per_node": 3, "drafter_sync": "none",
                            "node_link": "pcie4", "network_link": "nic200"})
    res = simulate(cfg, make_sampler(cfg.workload, seed=0), sim_seconds=60, keep_records=True)
    nbytes = {r["item_id"]: r["bytes"] for r in res.produce}
    rate = {0: 1 / 31.5e9, 1: 1 / 25e9}
    takes = res.take
    assert {t["drafter"] for t in takes} == {0, 1}
    for t in takes:
        moved = sum(nbytes[i] for i in t["item_ids"])
        assert math.isclose(t["compute_s"], 1.0 + moved * rate[t["drafter"]], rel_tol=1e-12)
    summary = res.summary["transfer"]
    assert summary["pairs"] == {TIER_NODE: 2, TIER_NETWORK: 2}
    assert summary["rates"][TIER_NETWORK]["from"] == "nic200" and summary["rates"][TIER_NODE]["from"] == "pcie4"
    moved_s = sum(t["compute_s"] - 1.0 for t in takes)
    assert summary["seconds"] == pytest.approx(moved_s, rel=1e-9)


def test_a_same_device_move_costs_nothing_only_when_set_so() -> None:
    cfg = cfg_with(cluster={"n_target": 1, "n_drafter": 1, "shared_device": True})
    priced = simulate(cfg, make_sampler(cfg.workload, seed=0), sim_seconds=30, keep_records=True)
    free_cfg = with_overrides(cfg, {"timing.transfer_device_s_per_byte": 0.0})
    free = simulate(free_cfg, make_sampler(cfg.workload, seed=0), sim_seconds=30, keep_records=True)
    assert priced.summary["transfer"]["pairs"] == {TIER_DEVICE: 1}
    assert all(t["compute_s"] > 1.0 for t in priced.take)
    assert all(t["compute_s"] == 1.0 for t in free.take) and free.summary["transfer"]["seconds"] == 0.0


def test_the_split_search_sees_the_network() -> None:
    """The sweep's Evaluator simulates each split with its own placement: 1 target + 7 drafters fit one
    node of 8; on nodes of 4, drafters 3-6 are across the network, and a slow network slows the split."""
    base = with_overrides(cfg_with(cluster={"n_target": 1, "n_drafter": 7, "gpus": 8, "drafter_sync": "none"}),
                          {"sweep.seeds_per_trial": 1, "timing.transfer_inter_s_per_byte": 2e-7})
    four = with_overrides(base, {"cluster.gpus_per_node": 4})
    q = base.queue
    one_node = Evaluator(base, sim_seconds=60).evaluate(q, Split(1, 7)).mean["throughput_tokens_per_s"]
    two_nodes = Evaluator(four, sim_seconds=60).evaluate(q, Split(1, 7)).mean["throughput_tokens_per_s"]
    assert two_nodes < 0.9 * one_node


@pytest.mark.parametrize(("section", "key", "value"), [
    ("timing", "transfer_inter_s_per_byte", -1e-9),
    ("timing", "transfer_device_s_per_byte", "fast"),
    ("cluster", "node_link", "nvlink9"),
    ("cluster", "network_link", "pcie5"),  # a link of another tier
    ("cluster", "device_link", "nic400"),
    ("cluster", "shared_device", "yes"),
])
def test_a_bad_placement_key_is_one_line_naming_it(section: str, key: str, value: object) -> None:
    with pytest.raises(ConfigError) as err:
        config_from_dict({section: {key: value}})
    assert err.value.key == f"{section}.{key}"
    assert "\n" not in str(err.value)


# -- calibration: the tier of a take comes from what its records say of both ends

def _timed_run(tmp_path: Path, where: dict[int, tuple[str, str]], drafter_at: tuple[str, str], rate: float) -> Path:
    """A simulated 1 + 1 run's records, rewritten as a real run's: every producer rank at ``where``
    (host, device), the drafter at ``drafter_at``, every take's moves timed at ``rate`` s/byte."""
    cfg = with_overrides(DflashConfig(), {
        "workload.lengths": "lognormal", "workload.n_sequences": 600, "workload.seqs_per_item": 1,
        "workload.max_len": 512, "workload.bucket_bounds": (128, 256, 512), "cluster.n_target": 1,
        "cluster.n_drafter": 1, "queue.min_ready": 2, "queue.max_depth": 6, "drafter.anchors": 16,
        "drafter.block_size": 8, "timing.target_fixed_s": 0.05, "timing.target_per_token_s": 1e-3,
        "timing.drafter_fixed_s": 0.05, "timing.drafter_per_anchor_s": 1e-3, "timing.hidden_size": 8,
        "timing.dtype_bytes": 1, "target.capture_layers": 1})
    run = tmp_path / f"run-{len(list(tmp_path.iterdir()))}"
    simulate(cfg, make_sampler(cfg.workload, seed=0), sim_seconds=120, records_dir=run)
    produce_path, take_path = next(run.glob("produce*.jsonl")), next(run.glob("take*.jsonl"))
    produce = [json.loads(line) for line in produce_path.read_text().splitlines()]
    ranks = sorted(where)
    for k, r in enumerate(produce):  # producers alternate over the given ranks
        r["rank"] = ranks[k % len(ranks)]
        r["host"], r["device"] = where[r["rank"]]
    produce_path.write_text("".join(json.dumps(r) + "\n" for r in produce))
    by_id = {r["item_id"]: r for r in produce}
    takes = [json.loads(line) for line in take_path.read_text().splitlines()]
    for r in takes:
        r["producers"] = [by_id[i]["rank"] for i in r["item_ids"]]
        r["host"], r["device"] = drafter_at
        r["bytes"] = sum(by_id[i]["bytes"] for i in r["item_ids"])
        r["transfer_s"] = r["bytes"] * rate
    take_path.write_text("".join(json.dumps(r) + "\n" for r in takes))
    assert len(list(read_records(run, "take"))) >= 20
    return run


@pytest.mark.parametrize(("producer_at", "drafter_at", "tier"), [
    (("node-a", "cuda:0"), ("node-a", "cuda:1"), TIER_NODE),
    (("node-a", "cpu"), ("node-a", "cpu"), TIER_DEVICE),
    (("node-a", "cuda:0"), ("node-b", "cuda:0"), TIER_NETWORK),
])
def test_calibration_sets_the_rate_of_the_tier_the_pairs_ran_in(tmp_path: Path, producer_at: tuple[str, str],
                                                               drafter_at: tuple[str, str], tier: str) -> None:
    rate = 2e-6
    data = calibrate([_timed_run(tmp_path, {0: producer_at}, drafter_at, rate)], DflashConfig())
    key = {TIER_DEVICE: "transfer_device_s_per_byte", TIER_NODE: "transfer_intra_s_per_byte",
           TIER_NETWORK: "transfer_inter_s_per_byte"}
    assert data["timing"][key[tier]] == pytest.approx(rate, rel=1e-9)
    assert set(data["fit"]["transfer"]) == {tier}
    assert not {k for t, k in key.items() if t != tier} & set(data["timing"])


def test_a_loopback_rehearsal_of_two_nodes_never_sets_the_nic_rate(tmp_path: Path) -> None:
    """Two "nodes" on one machine: producer ranks 0 and 1, one of them in the drafter's launcher group,
    all on one host. Their moves are within a host, whatever the launcher called the nodes."""
    here = ("the-one-host", "cpu")
    run = _timed_run(tmp_path, {0: here, 1: ("the-one-host", "cpu")}, here, 3e-6)
    data = calibrate([run], DflashConfig())
    assert "transfer_inter_s_per_byte" not in data["timing"]
    assert data["timing"]["transfer_device_s_per_byte"] == pytest.approx(3e-6, rel=1e-9)
    mixed = _timed_run(tmp_path, {0: ("node-a", "cuda:0"), 1: ("node-b", "cuda:0")}, ("node-a", "cuda:1"), 3e-6)
    split = calibrate([mixed], DflashConfig())  # takes of one item each: one tier each
    assert split["fit"]["transfer"][TIER_NETWORK]["n"] > 0 and split["fit"]["transfer"][TIER_NODE]["n"] > 0
