"""The GPU split: the n_target knob, infeasible splits as constraints, and each split's own costs
(the synchronised drafters' gradient all-reduce, hidden-state moves within and across nodes)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pytest

from dflash.cli import main
from dflash.core.config import ClusterConfig, QueueConfig, config_from_dict, with_overrides
from dflash.core.errors import ConfigError
from simulator.run import simulate
from simulator.workload import make_sampler
from tuning.evaluate import Evaluator, constraint_values
from tuning.space import Split, effective_queue, effective_split, parse_space

FIXED_DRAFTER = {  # every take costs exactly 1 s of drafter compute; targets are 10x faster
    "timing": {"target_fixed_s": 0.05, "target_per_token_s": 0.0, "target_noise": "deterministic",
               "drafter_fixed_s": 1.0, "drafter_per_anchor_s": 0.0, "drafter_noise": "deterministic"},
    "workload": {"lengths": "lognormal", "n_sequences": 400, "seqs_per_item": 1},
    "queue": {"min_ready": 1, "max_depth": 20},
}


def cfg_with(**sections: dict) -> object:
    data = {k: dict(v) for k, v in FIXED_DRAFTER.items()}
    for name, table in sections.items():
        data.setdefault(name, {}).update(table)
    return config_from_dict(data)


def test_n_target_knob_gives_the_rest_of_the_gpus_to_drafters() -> None:
    space = parse_space({"n_target": {"low": 1, "high": 7}, "min_ready": {"low": 1, "high": 9}})
    assert space.ints["n_target"].values() == list(range(1, 8))
    cluster = ClusterConfig(n_target=1, n_drafter=4, gpus=8, gpus_per_target=2)
    assert effective_split(cluster, {"n_target": 3, "min_ready": 5}) == Split(3, 2)
    assert effective_split(cluster, {"n_target": 4}) == Split(4, 0) and not Split(4, 0).feasible
    assert effective_split(cluster, {"min_ready": 5}) == Split(1, 4)  # no knob: the configured split
    # the split knob never leaks into the queue
    assert effective_queue(QueueConfig(), {"n_target": 3, "max_depth": 40}) == QueueConfig(max_depth=40)


def test_split_settings_are_validated_in_one_line() -> None:
    with pytest.raises(ConfigError, match=r"sweep.space.n_target: needs \[cluster\] gpus"):
        config_from_dict({"sweep": {"space": {"n_target": {"low": 1, "high": 3}}}})
    with pytest.raises(ConfigError, match=r"cluster.n_drafter: n_target x gpus_per_target \+ n_drafter = 12 must be "
                                          r"<= cluster.gpus = 8"):
        config_from_dict({"cluster": {"gpus": 8, "n_target": 4, "n_drafter": 4, "gpus_per_target": 2}})
    with pytest.raises(ConfigError, match=r"cluster\.gpus_per_target: must be 1 for train and validate"):
        ClusterConfig(n_target=1, gpus_per_target=4).check_trainable()
    ClusterConfig().check_trainable()


def test_a_split_without_drafters_is_a_constraint_not_a_failure() -> None:
    cfg = with_overrides(cfg_with(cluster={"gpus": 4, "n_target": 2, "n_drafter": 2}), {"sweep.seeds_per_trial": 1})
    ev = Evaluator(cfg, sim_seconds=60).evaluate(cfg.queue, Split(4, 0))
    assert ev.mean["throughput_tokens_per_s"] == 0.0 and ev.mean["mix_efficiency"] == 0.0  # finite: told, not failed
    assert ev.per_seed == ()  # nothing was simulated
    cons = constraint_values(ev, cfg, None)
    assert cons["split"] == 1.0 and ev.as_json()["n_drafter"] == 0
    ok = Evaluator(cfg, sim_seconds=60).evaluate(cfg.queue, Split(3, 1))
    assert constraint_values(ok, cfg, None)["split"] == 0.0 and ok.mean["throughput_tokens_per_s"] > 0


def steps_in(cfg: object, seconds: float = 600.0) -> int:
    return simulate(cfg, make_sampler(cfg.workload, seed=0), sim_seconds=seconds).summary["steps"]  # type: ignore[attr-defined]


def test_the_gradient_all_reduce_lengthens_every_synchronised_step_by_its_ring_time() -> None:
    """Two drafters, 1e9 bf16 parameters: a ring all-reduce moves 2 (n - 1) / n x 2e9 = 2e9 bytes;
    at 1e-10 s per byte that is 0.2 s on a 1 s step, so 1.2 s per step."""
    base = cfg_with(cluster={"n_target": 2, "n_drafter": 2}, memory={"drafter_params": 1e9})
    slow = with_overrides(base, {"timing.allreduce_s_per_byte": 1e-10})
    plain, reduced = steps_in(base), steps_in(slow)
    assert plain == pytest.approx(600 / 1.0, abs=2)
    assert reduced == pytest.approx(600 / 1.2, abs=2)
    independent = with_overrides(slow, {"cluster.drafter_sync": "none"})  # no DDP group, no all-reduce
    assert steps_in(independent) == pytest.approx(2 * 600, abs=4)


def test_hidden_state_moves_cost_their_bytes_within_or_across_nodes() -> None:
    """Nodes of 3 GPUs: producers on ranks 0 and 1, drafter 0 on rank 2 (same node), drafter 1 on
    rank 3 (the next node); every take's compute is 1 s plus its bytes at that pair's rate."""
    cfg = cfg_with(cluster={"n_target": 2, "n_drafter": 2, "gpus_per_node": 3, "drafter_sync": "none"},
                   timing={"transfer_intra_s_per_byte": 1e-9, "transfer_inter_s_per_byte": 1e-8})
    res = simulate(cfg, make_sampler(cfg.workload, seed=0), sim_seconds=120, keep_records=True)
    nbytes = {r["item_id"]: r["bytes"] for r in res.produce}
    takes = res.take
    assert {t["drafter"] for t in takes} == {0, 1}
    for t in takes:
        rate = 1e-9 if t["drafter"] == 0 else 1e-8
        moved = sum(nbytes[i] for i in t["item_ids"])
        assert math.isclose(t["compute_s"], 1.0 + moved * rate, rel_tol=1e-12)


SWEEP_TOML = """
seed = 0
[workload]
lengths = "lognormal"
n_sequences = 2000
[cluster]
gpus = 6
n_target = 3
n_drafter = 3
[timing]
target_noise = "deterministic"
drafter_noise = "deterministic"
[sweep]
seeds_per_trial = 1
sim_seconds = 600
top_k = 2
space = { n_target = { low = 1, high = 6 }, min_ready = { low = 1, high = 30 } }
"""


def test_dflash_sweep_tries_splits_and_names_the_chosen_one(tmp_path: Path) -> None:
    """The issue's "done when": with [cluster] gpus and n_target in the space the sweep tries several
    splits, writes n_target to trials.parquet and names every selected configuration's split."""
    cfg = tmp_path / "split.toml"
    cfg.write_text(SWEEP_TOML)
    out = tmp_path / "out"
    assert main(["sweep", "--config", str(cfg), "--trials", "10", "--out", str(out)]) == 0
    df = pd.read_parquet(out / "trials.parquet")
    done = df[df["state"] == "COMPLETE"]
    assert done["n_target"].nunique() >= 3
    assert ((done["n_target"] + done["n_drafter"]) == 6).all()
    assert not done[done["n_drafter"] == 0]["feasible"].any()  # no drafter: infeasible, not failed
    sel = json.loads((out / "selection.json").read_text())
    for c in sel["configs"]:
        assert c["n_target"] >= 1 and c["n_drafter"] >= 1, c
    tuned = [c for c in sel["configs"] if c["name"].startswith("tuned")]
    assert all(c["n_target"] + c["n_drafter"] == 6 for c in tuned)
    named = {c["name"]: c for c in sel["configs"]}
    assert (named["baseline"]["n_target"], named["baseline"]["n_drafter"]) == (3, 3)  # the configured split
