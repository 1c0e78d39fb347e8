"""Machine drift against model error, checked where the answer is known: the "machine" is the
simulator itself, so the queue model is exact and a validated run whose per-item costs were scaled
after calibration must show that scale as drift and no drift-corrected error."""

from __future__ import annotations

from pathlib import Path

import pytest

from dflash.core.config import DflashConfig, with_overrides
from dflash.core.records import read_records
from simulator.calibration import apply_calibration, calibrate, write_calibration
from simulator.run import simulate
from simulator.workload import make_sampler
from tuning.validation.drift import effect, own_calibration, stage_drift, timing_of
from tuning.validation.metrics import rel_errors
from tuning.validation.predict import predict

TERMS = {"target_fixed_s": 0.05, "target_per_token_s": 2.0e-3, "target_per_token2_s": 0.0,
         "drafter_fixed_s": 0.02, "drafter_per_token_s": 1.0e-4, "drafter_per_anchor_s": 5.0e-3}
STEPS = 300


def machine(target_scale: float) -> DflashConfig:
    """A target-bound 1 + 1 pipeline whose target costs ``target_scale`` x the calibrated ones."""
    scaled = {k: v * (target_scale if k.startswith("target_") else 1.0) for k, v in TERMS.items()}
    return with_overrides(DflashConfig(), {
        "workload.lengths": "lognormal", "workload.length_median": 150, "workload.length_sigma": 0.8,
        "workload.n_sequences": 3000, "workload.max_len": 512, "workload.bucket_bounds": (64, 128, 256, 384, 512),
        "workload.seqs_per_item": 1, "cluster.n_target": 1, "cluster.n_drafter": 1,
        "queue.min_ready": 4, "queue.max_depth": 12, "drafter.anchors": 16, "drafter.block_size": 8,
        **{f"timing.{k}": v for k, v in scaled.items()},
        "timing.target_noise": "lognormal", "timing.target_cv": 0.05, "timing.drafter_noise": "lognormal",
        "timing.drafter_cv": 0.05, "timing.response_fraction": 0.5})


def run_on(cfg: DflashConfig, out: Path, seed: int) -> dict:
    c = with_overrides(cfg, {"seed": seed})
    return simulate(c, make_sampler(c.workload, seed=seed), sim_seconds=1e9, max_steps=STEPS, records_dir=out).metrics


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory: pytest.TempPathFactory) -> DflashConfig:
    """The calibration run, on the machine as it was (scale 1), calibrated."""
    tmp = tmp_path_factory.mktemp("cal")
    run_on(machine(1.0), tmp / "run", seed=11)
    write_calibration(calibrate([tmp / "run"], DflashConfig()), tmp / "cal.json")
    return apply_calibration(machine(1.0), str(tmp / "cal.json"))


@pytest.mark.parametrize("scale", [1.0, 1.5])
def test_scaled_target_costs_are_drift_and_the_corrected_prediction_has_no_model_error(
        calibrated: DflashConfig, tmp_path: Path, scale: float) -> None:
    measured = run_on(machine(scale), tmp_path / "run", seed=3)
    own, why = own_calibration(tmp_path / "run", DflashConfig(), tmp_path / "own.json")
    assert own is not None, why
    drift = stage_drift(tmp_path / "run", calibrated.timing, timing_of(DflashConfig(), own["timing"]))
    assert drift["target"] == pytest.approx(scale - 1.0, abs=0.04)
    assert drift["drafter"] == pytest.approx(0.0, abs=0.04)

    entry = {"queue": {}}
    apriori = predict(entry, calibrated, STEPS, tmp_path / "sim-a")
    corrected = predict(entry, with_overrides(calibrated, {f"timing.{k}": v for k, v in own["timing"].items()}),
                        STEPS, tmp_path / "sim-c")
    tput = "throughput_tokens_per_s"
    err_a = rel_errors(measured, apriori)[tput]
    err_c = rel_errors(measured, corrected)[tput]
    summary = effect(apriori[tput]["mean"], corrected[tput]["mean"])
    # Target-bound: throughput scales as 1 / target cost, so the a-priori prediction is off by the
    # drift, the drift-corrected one is not, and the two errors factor through the drift.
    assert err_a == pytest.approx(scale - 1.0, abs=0.06)
    assert abs(err_c) < 0.05
    assert summary == pytest.approx(scale - 1.0, abs=0.06)
    assert 1 + err_a == pytest.approx((1 + summary) * (1 + err_c), rel=1e-9)
    assert len(list(read_records(tmp_path / "run", "take"))) == STEPS
