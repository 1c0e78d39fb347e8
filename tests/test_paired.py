"""Paired held-out comparisons with run-to-run variance, and one copy of the held-out target states
per validation (issue #36 items 1 and 2).

A paired comparison is valid only over one sequence set, so a run that scored other sequences is an
error; pairing narrows the interval where sequences differ in difficulty; a second training seed adds
the variance between runs (and its few degrees of freedom) to it. Pure and tiny: the real runs are in
tests/test_validate_held.py.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from tuning.validation.paired import RunRows, SeedVariance, paired_difference, seed_variance


def run(tau: np.ndarray, ids: list[str] | None = None, blocks: float = 10.0) -> RunRows:
    """Rows whose walk gives ``tau`` per sequence (tokens = tau * blocks) and loss = 2 / tau."""
    ids = ids or [f"s{i}" for i in range(len(tau))]
    return RunRows(tuple(ids), tuple((0, 2.0 / t * blocks, blocks, t * blocks, int(blocks), t * blocks, blocks)
                                     for t in tau))


def test_a_paired_comparison_fails_when_the_sequence_sets_differ() -> None:
    tau = np.linspace(1.2, 3.0, 12)
    a, b = run(tau), run(tau, ids=[f"s{i}" for i in range(11)] + ["other"])
    with pytest.raises(ValueError, match="other held-out sequences"):
        paired_difference([a], [b], "heldout_tau", SeedVariance(math.nan, 0))
    with pytest.raises(ValueError, match="other held-out sequences"):  # the same ids in another order: not paired
        paired_difference([a], [run(tau[::-1], ids=[f"s{i}" for i in range(12)][::-1])], "heldout_tau",
                          SeedVariance(math.nan, 0))


def test_pairing_narrows_the_interval_where_sequences_differ_in_difficulty() -> None:
    rng = np.random.default_rng(3)
    difficulty = rng.uniform(1.2, 4.0, 64)  # shared by both drafters: what pairing cancels
    a, b = run(difficulty + 0.05 + rng.normal(0, 0.02, 64)), run(difficulty)
    d = paired_difference([a], [b], "heldout_tau", SeedVariance(math.nan, 0))
    assert d.ci95[0] <= 0.05 <= d.ci95[1] and d.ci95[0] > 0  # the true shift, resolved
    assert d.width_ratio < 0.1 and d.se_independent > 5 * d.se_sequences
    assert not d.claim and d.se_seeds is None and math.isinf(d.df)  # one seed: no run-to-run variance, no claim
    assert paired_difference([a], [b], "heldout_loss", SeedVariance(math.nan, 0)).difference < 0  # loss = 2 / tau


def test_a_second_seed_adds_the_variance_between_runs_with_its_degrees_of_freedom() -> None:
    rng = np.random.default_rng(4)
    difficulty = rng.uniform(1.2, 4.0, 64)
    runs = {"a": [run(difficulty + 0.05), run(difficulty + 0.15)], "b": [run(difficulty), run(difficulty + 0.02)]}
    var = seed_variance(runs, "heldout_tau")
    assert var.df == 2 and var.var == pytest.approx((0.1 ** 2 / 2 + 0.02 ** 2 / 2) / 2, rel=0.05)
    d = paired_difference(runs["a"], runs["b"], "heldout_tau", var)
    assert d.claim and d.seeds == (2, 2) and d.difference == pytest.approx(0.09, abs=0.005)
    assert d.se > d.se_sequences and d.se_seeds == pytest.approx(math.sqrt(var.var), rel=1e-9)
    assert 2 <= d.df < 3  # nearly all of the variance is between seeds: Satterthwaite gives its 2 df
    half = (d.ci95[1] - d.ci95[0]) / 2
    assert half == pytest.approx(4.303 * d.se, rel=0.2)  # t(2), not the normal 1.96
    assert seed_variance({"a": runs["a"][:1], "b": runs["b"][:1]}, "heldout_tau").df == 0


def test_seed_replicates_are_named_runs_of_their_configuration() -> None:
    from tuning.validation.plan import seed_runs, with_seeds

    sel = {"configs": [{"name": "a", "queue": {"min_ready": 2}}, {"name": "b", "queue": {"min_ready": 3}}]}
    assert with_seeds(sel, 1, 7) is sel
    three = with_seeds(sel, 3, 7)
    assert [c["name"] for c in three["configs"]] == ["a", "b", "a@seed8", "b@seed8", "a@seed9", "b@seed9"]
    assert three["configs"][2] == {"name": "a@seed8", "queue": {"min_ready": 2}, "seed": 8, "replicate_of": "a"}
    assert seed_runs(three["configs"]) == {"a": ["a", "a@seed8", "a@seed9"], "b": ["b", "b@seed8", "b@seed9"]}
    assert with_seeds(three, 2, 7)["configs"] == with_seeds(sel, 2, 7)["configs"]  # idempotent on its own output


def test_the_held_out_states_are_one_file_linked_into_every_run(tmp_path: Path) -> None:
    from dflash.pipeline.heldout import STATES_FILE, adopt_states, publish_states

    shared, first, second = tmp_path / STATES_FILE, tmp_path / "runs" / "a", tmp_path / "runs" / "b"
    assert not adopt_states(shared, second) and not publish_states(first, shared)  # nothing computed yet
    (first / STATES_FILE).parent.mkdir(parents=True)
    (first / STATES_FILE).write_bytes(b"states")
    assert publish_states(first, shared) and shared.read_bytes() == b"states"
    assert adopt_states(shared, second) and (second / STATES_FILE).read_bytes() == b"states"
    assert (second / STATES_FILE).stat().st_ino == (first / STATES_FILE).stat().st_ino  # one copy on disk
    assert not adopt_states(shared, second)  # a run that has its states keeps them
    assert not list(tmp_path.rglob("*.tmp"))  # placed by rename: nothing half-written is left


def test_a_runs_rows_file_keeps_the_last_score_of_a_step_and_skips_a_torn_line(tmp_path: Path) -> None:
    from dflash.pipeline.heldout import ROWS_FILE, append_rows, read_rows

    append_rows(tmp_path, 7, ["x", "y"], [(0, 1.0, 2.0, 3.0, 1, 2, 1), (1, 1.0, 2.0, 3.0, 1, 2, 1)])
    append_rows(tmp_path, 7, ["x", "y"], [(0, 9.0, 2.0, 3.0, 1, 2, 1), (1, 1.0, 2.0, 3.0, 1, 2, 1)])  # a resume
    with (tmp_path / ROWS_FILE).open("a") as f:
        f.write(json.dumps({"step": 15, "ids": ["x"]})[:-3])  # a job killed mid-line
    got = read_rows(tmp_path)
    assert list(got) == [7] and got[7]["ids"] == ["x", "y"] and got[7]["rows"][0][1] == 9.0
