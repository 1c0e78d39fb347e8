"""Calibration: it recovers what generated the records, refuses what it cannot fit, and its loss
model predicts roughness from the take order alone."""

from __future__ import annotations

import json
import math
import random
import shutil
from pathlib import Path

import numpy as np
import pytest

from dflash.cli import main
from dflash.core.config import DflashConfig, LossModelConfig, with_overrides
from dflash.core.errors import ConfigError
from dflash.core.records import read_records
from simulator.calibration import apply_calibration, calibrate
from simulator.loss_model import StepMakeup, fit_loss_model, predict_loss_roughness
from simulator.run import simulate
from simulator.workload import make_sampler

KNOWN = {"target_fixed_s": 0.05, "target_per_token_s": 2.0e-3, "target_per_token2_s": 0.0,
         "drafter_fixed_s": 0.02, "drafter_per_token_s": 1.0e-4, "drafter_per_anchor_s": 5.0e-3}


def known_config(noise: str = "lognormal", **queue: int) -> DflashConfig:
    """A target-bound pipeline on lognormal lengths with known time terms and 5% noise."""
    return with_overrides(DflashConfig(), {
        "workload.lengths": "lognormal", "workload.length_median": 150, "workload.length_sigma": 0.8,
        "workload.n_sequences": 3000, "workload.max_len": 512, "workload.bucket_bounds": (64, 128, 256, 384, 512),
        "workload.seqs_per_item": 1, "cluster.n_target": 1, "cluster.n_drafter": 1,
        "queue.min_ready": queue.get("min_ready", 4), "queue.max_depth": queue.get("max_depth", 12),
        "drafter.anchors": 16, "drafter.block_size": 8,
        **{f"timing.{k}": v for k, v in KNOWN.items()},
        "timing.target_noise": noise, "timing.target_cv": 0.05, "timing.drafter_noise": noise,
        "timing.drafter_cv": 0.05, "timing.response_fraction": 0.5})


@pytest.fixture(scope="module")
def sim_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[DflashConfig, Path]:
    cfg = known_config()
    out = tmp_path_factory.mktemp("sim") / "run"
    simulate(cfg, make_sampler(cfg.workload, seed=0), sim_seconds=1500, records_dir=out)
    return cfg, out


def test_calibration_recovers_the_time_terms_that_generated_the_records(sim_run) -> None:
    _, run = sim_run
    data = calibrate([run], DflashConfig())
    t, fit = data["timing"], data["fit"]
    assert t["target_fixed_s"] == pytest.approx(KNOWN["target_fixed_s"], rel=0.15)
    assert t["target_per_token_s"] == pytest.approx(KNOWN["target_per_token_s"], rel=0.03)
    # Mean drafter time over the run's takes, which is what decides its rate.
    takes = list(read_records(run, "take"))
    mean_true = np.mean([KNOWN["drafter_fixed_s"] + KNOWN["drafter_per_token_s"] * r["tokens"]
                         + KNOWN["drafter_per_anchor_s"] * r["anchors"] for r in takes])
    mean_fit = np.mean([t["drafter_fixed_s"] + t["drafter_per_token_s"] * r["tokens"]
                        + t["drafter_per_anchor_s"] * r["anchors"] for r in takes])
    assert mean_fit == pytest.approx(mean_true, rel=0.02)
    assert fit["target"]["mape"] < 0.06 and fit["drafter"]["mape"] < 0.06  # the noise was 5% CV
    assert 0.03 < fit["target"]["cv"] < 0.07
    assert not fit["burst"]["detected"]
    assert t["target_noise"] == "empirical" and np.mean(t["target_samples"]) == pytest.approx(1.0, abs=0.01)


def test_a_calibrated_simulation_reproduces_the_run_it_was_fitted_to(sim_run, tmp_path: Path) -> None:
    cfg, run = sim_run
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(calibrate([run], DflashConfig())))
    measured = simulate(cfg, make_sampler(cfg.workload, seed=0), sim_seconds=1500).metrics
    calibrated = apply_calibration(with_overrides(cfg, {"timing.target_per_token_s": 1e-4,
                                                        "timing.drafter_fixed_s": 1.0}), path)
    predicted = np.mean([simulate(with_overrides(calibrated, {"seed": s}), make_sampler(cfg.workload, seed=0),
                                  sim_seconds=1500).metrics["throughput_tokens_per_s"] for s in range(3)])
    assert predicted == pytest.approx(measured["throughput_tokens_per_s"], rel=0.03)


def test_burstiness_is_found_when_the_supply_has_it(tmp_path: Path) -> None:
    cfg = with_overrides(known_config(noise="deterministic"), {"timing.burst_amplitude": 0.3,
                                                               "timing.burst_period_s": 120.0})
    simulate(cfg, make_sampler(cfg.workload, seed=0), sim_seconds=1500, records_dir=tmp_path / "run")
    burst = calibrate([tmp_path / "run"], DflashConfig())["fit"]["burst"]
    assert burst["detected"]
    assert burst["period_s"] == pytest.approx(120.0, rel=0.1)
    assert burst["amplitude"] == pytest.approx(0.3, rel=0.25)


def test_a_timing_log_from_another_trainer_calibrates_like_our_records(sim_run, tmp_path: Path) -> None:
    _, run = sim_run
    rows = [{"role": "target", "worker": r["worker"], "start": r["t_start"], "end": r["t_end"],
             "tokens": r["real_tokens"], "bucket": r["bucket"], "n_seqs": r["n_seqs"],
             "padded_len": r["padded_len"]} for r in read_records(run, "produce")]
    rows += [{"role": "drafter", "worker": r["drafter"], "start": r["t"], "end": r["t"] + r["compute_s"],
              "tokens": r["tokens"], "bucket": r["bucket"], "anchors": r["anchors"]} for r in read_records(run, "take")]
    import pandas as pd

    for suffix in ("csv", "parquet"):
        path = tmp_path / f"log.{suffix}"
        df = pd.DataFrame(rows)
        df.to_csv(path, index=False) if suffix == "csv" else df.to_parquet(path)
        from_log = calibrate([path], DflashConfig())["timing"]
        from_run = calibrate([run], DflashConfig())["timing"]
        for key in ("target_per_token_s", "drafter_per_anchor_s"):
            assert from_log[key] == pytest.approx(from_run[key], rel=0.02), key


@pytest.mark.parametrize("content, allowed", [
    ("role,start,end\ntarget,0,1\n", "needs columns"),
    ("role,start,end,tokens,bucket\nteacher,0,1,5,0\n", "'role' must be"),
    ("role,start,end,tokens,bucket\ntarget,2,1,5,0\n", "end >= start"),
])
def test_a_bad_timing_log_is_one_line_naming_run(tmp_path: Path, capsys, content: str, allowed: str) -> None:
    log = tmp_path / "log.csv"
    log.write_text(content)
    assert main(["calibrate", "--run", str(log), "--out", str(tmp_path / "c.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--run" in err and allowed in err
    assert not (tmp_path / "c.json").exists()


def test_runs_too_short_to_fit_are_refused_with_one_line(tmp_path: Path, capsys) -> None:
    cfg = known_config()
    simulate(cfg, make_sampler(cfg.workload, seed=0), sim_seconds=12, records_dir=tmp_path / "short")
    assert main(["calibrate", "--run", str(tmp_path / "short"), "--out", str(tmp_path / "c.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "too short to fit" in err and "need >= 20" in err
    assert not (tmp_path / "c.json").exists()


def test_calibrate_cli_writes_a_file_simulate_and_sweep_accept(sim_run, tmp_path: Path, capsys) -> None:
    _, run = sim_run
    out = tmp_path / "cal.json"
    assert main(["calibrate", "--run", str(run), "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert "MAPE" in said and str(out) in said
    assert main(["simulate", "--calibration", str(out), "--sim-seconds", "60", "--json", str(tmp_path / "m.json"),
                 "--config", str(_toml(tmp_path, known_config()))]) == 0


def _toml(tmp_path: Path, cfg: DflashConfig) -> Path:
    w = cfg.workload
    p = tmp_path / "cfg.toml"
    p.write_text(f"""[workload]
lengths = "lognormal"
length_median = {w.length_median}
n_sequences = {w.n_sequences}
max_len = {w.max_len}
bucket_bounds = {list(w.bucket_bounds)}
seqs_per_item = 1
[cluster]
n_target = 1
n_drafter = 1
""")
    return p


# --------------------------------------------------------------------------- the loss model
def synthetic_steps(order: list[int], beta: list[float], sd: list[float], seed: int = 0) -> list[StepMakeup]:
    """Losses from the model itself: a decaying trend x bucket factor x lognormal noise."""
    rng = random.Random(seed)
    out = []
    for step, b in enumerate(order):
        trend = 2.0 + 3.0 / math.sqrt(step + 1)
        loss = trend * math.exp(beta[b] + rng.gauss(0.0, sd[b]))
        tokens = [0.0] * len(beta)
        tokens[b] = 100.0
        out.append(StepMakeup(step, loss, tuple(tokens)))
    return out


BETA = [-0.3, -0.1, 0.0, 0.1, 0.2]
SD = [0.05, 0.04, 0.03, 0.03, 0.02]
MIX = [0.1, 0.15, 0.2, 0.25, 0.3]


def test_the_loss_model_recovers_bucket_levels_and_spreads() -> None:
    rng = random.Random(1)
    order = rng.choices(range(5), weights=MIX, k=1200)
    fit = fit_loss_model(synthetic_steps(order, BETA, SD), MIX)
    assert fit is not None and fit.r2 > 0.8
    beta = np.asarray(fit.model.bucket_log_mean)
    true = np.asarray(BETA) - np.dot(MIX, BETA)  # centred on the mix
    assert np.allclose(beta, true, atol=0.02)
    assert np.allclose(fit.model.bucket_log_sd, SD, rtol=0.25)
    assert abs(fit.model.autocorr) < 0.1


def test_predicted_roughness_matches_measured_for_a_take_order_it_was_not_fitted_on() -> None:
    rng = random.Random(2)
    shuffled = rng.choices(range(5), weights=MIX, k=800)
    streaky = [b for b in rng.choices(range(5), weights=MIX, k=80) for _ in range(10)]
    fit = fit_loss_model(synthetic_steps(shuffled, BETA, SD, seed=3), MIX)
    assert fit is not None
    from dflash.core.runmetrics import loss_roughness

    for order in (shuffled, streaky):
        truth = np.mean([loss_roughness([s.loss for s in synthetic_steps(order, BETA, SD, seed=k)],
                                        first_step=len(order) // 2)["loss_roughness"] for k in range(10, 20)])
        predicted = predict_loss_roughness(synthetic_steps(order, BETA, SD), fit.model)["loss_roughness"]
        assert predicted == pytest.approx(truth, rel=0.1)
    # Streaks of one bucket switch levels rarely: a smoother loss, and the model knows it.
    rough = {name: predict_loss_roughness(synthetic_steps(o, BETA, SD), fit.model)["loss_roughness"]
             for name, o in (("shuffled", shuffled), ("streaky", streaky))}
    assert rough["streaky"] < 0.7 * rough["shuffled"]


def test_a_calibrated_simulator_reports_predicted_loss_roughness(sim_run) -> None:
    cfg, _ = sim_run
    model = LossModelConfig(bucket_log_mean=tuple(BETA), bucket_log_sd=tuple(SD), trend_coef=(0.0, 1.0),
                            trend_last_step=100)
    plain = simulate(cfg, make_sampler(cfg.workload, seed=0), sim_seconds=300).metrics
    assert plain["loss_roughness"] is None
    calibrated = with_overrides(cfg, {f"loss_model.{k}": v for k, v in model.__dict__.items()})
    m = simulate(calibrated, make_sampler(cfg.workload, seed=0), sim_seconds=300).metrics
    assert m["loss_roughness"] > 0 and m["loss_roughness_steps"][0] > 0


@pytest.mark.parametrize("table, key", [
    ({"bucket_log_mean": [0.0, 0.1], "bucket_log_sd": [0.1], "trend_coef": [1.0]}, "loss_model.bucket_log_sd"),
    ({"bucket_log_mean": [0.0], "bucket_log_sd": [-0.1], "trend_coef": [1.0]}, "loss_model.bucket_log_sd"),
    ({"bucket_log_mean": [0.0], "bucket_log_sd": [0.1]}, "loss_model.trend_coef"),
    ({"autocorr": 1.5}, "loss_model.autocorr"),
])
def test_a_bad_loss_model_table_names_its_key(table: dict, key: str) -> None:
    with pytest.raises(ConfigError) as err:
        with_overrides(DflashConfig(), {f"loss_model.{k}": v for k, v in table.items()})
    assert err.value.key == key


def test_calibration_learns_a_per_byte_transfer_cost_from_timed_takes(tmp_path: Path) -> None:
    """Takes that record ``transfer_s`` and ``bytes`` (the distributed trainer's) give the per-byte
    move cost; it is taken off the drafter's busy time, so the drafter's own terms stay unbiased.
    Without those fields (older records) nothing changes."""
    rate = 1e-5  # seconds per byte: ~10% of a drafter step here (~1,200 bytes per item)
    cfg = with_overrides(known_config(), {"timing.transfer_intra_s_per_byte": rate, "timing.dtype_bytes": 1,
                                          "timing.hidden_size": 8, "target.capture_layers": 1})
    run = tmp_path / "run"
    simulate(cfg, make_sampler(cfg.workload, seed=0), sim_seconds=1500, records_dir=run)
    plain = calibrate([run], DflashConfig())
    assert "transfer" not in plain["fit"] and "transfer_intra_s_per_byte" not in plain["timing"]
    nbytes = {r["item_id"]: r["bytes"] for r in read_records(run, "produce")}
    path = next(run.glob("take*.jsonl"))
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for r in rows:
        r["bytes"] = sum(nbytes[i] for i in r["item_ids"])
        r["transfer_s"] = r["bytes"] * rate
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = calibrate([run], DflashConfig())
    assert data["timing"]["transfer_intra_s_per_byte"] == pytest.approx(rate, rel=1e-9)
    assert data["fit"]["transfer"]["node"]["n"] == len(rows)  # records without host or device: the node tier
    mean_true = np.mean([KNOWN["drafter_fixed_s"] + KNOWN["drafter_per_token_s"] * r["tokens"]
                         + KNOWN["drafter_per_anchor_s"] * r["anchors"] for r in rows])
    t = data["timing"]
    mean_fit = np.mean([t["drafter_fixed_s"] + t["drafter_per_token_s"] * r["tokens"]
                        + t["drafter_per_anchor_s"] * r["anchors"] for r in rows])
    assert mean_fit == pytest.approx(mean_true, rel=0.02)  # the transfer is not in the drafter's terms
    p = plain["timing"]
    plain_fit = np.mean([p["drafter_fixed_s"] + p["drafter_per_token_s"] * r["tokens"]
                         + p["drafter_per_anchor_s"] * r["anchors"] for r in rows])
    assert plain_fit > 1.05 * mean_true  # without the timed moves, the drafter absorbs them


def test_records_of_an_unknown_schema_are_refused_in_one_line_and_v1_gpu_transfers_are_left_out(
        sim_run, tmp_path: Path, capsys) -> None:
    """Issue 34 changed what ``transfer_s`` means (schema 2); calibration reads 1 and 2 and refuses others.
    A version-1 GPU take's ``transfer_s`` (timed behind the producer's forward) is not used."""
    from simulator.observations import v1_transfer

    run = tmp_path / "run"
    shutil.copytree(sim_run[1], run)
    path = run / "take.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    path.write_text("".join(json.dumps({**r, "schema_version": 3}) + "\n" for r in rows))
    assert main(["calibrate", "--run", str(run), "--out", str(tmp_path / "c.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--run" in err and "schema version 1 or 2" in err and "version 3" in err
    assert not (tmp_path / "c.json").exists()
    take = {"transfer_s": 0.5, "device": "cuda:0"}
    assert v1_transfer({**take, "schema_version": 1}) is None and v1_transfer(take) is None
    assert v1_transfer({**take, "schema_version": 2}) == 0.5 and v1_transfer({**take, "device": "cpu"}) == 0.5


def test_produce_records_dropped_at_a_resume_do_not_inflate_the_target_costs(sim_run, tmp_path: Path) -> None:
    """A resumed run keeps the produce records of taken items only (the rest are produced again), so
    a worker's records have holes; the fit through them must equal the fit of the whole stream."""
    _, run = sim_run
    holed = tmp_path / "run"
    shutil.copytree(run, holed)
    path = holed / "produce.jsonl"
    rows = path.read_text().splitlines()
    keep = random.Random(5).sample(range(len(rows)), k=int(0.6 * len(rows)))
    path.write_text("".join(rows[i] + "\n" for i in sorted(keep)))
    whole, cut = calibrate([run], DflashConfig())["timing"], calibrate([holed], DflashConfig())["timing"]
    assert cut["target_per_token_s"] == pytest.approx(whole["target_per_token_s"], rel=0.05)
    lengths = [r["padded_len"] for r in read_records(run, "produce")]
    mean = [np.mean([t["target_fixed_s"] + t["target_per_token_s"] * n + t["target_per_token2_s"] * n * n
                     for n in lengths]) for t in (whole, cut)]
    assert mean[1] == pytest.approx(mean[0], rel=0.02)


# --------------------------------------------------------------------------- fitted to which data
FP_A, FP_B = "0123456789abcdef", "fedcba9876543210"


@pytest.mark.parametrize(("fitted", "ours", "differs"), [
    ({"dataset": "auto", "dataset_fingerprint": FP_A}, {"dataset": "sharegpt", "dataset_fingerprint": FP_A}, False),
    ({"dataset": "sharegpt", "dataset_fingerprint": FP_A}, {"dataset": "sharegpt", "dataset_fingerprint": FP_B}, True),
    ({"dataset": "auto"}, {"dataset": "sharegpt", "dataset_fingerprint": FP_A}, False),  # before pinning
    ({"dataset": "sharegpt"}, {"dataset": "/data/mine.jsonl", "dataset_fingerprint": FP_A}, True),
    ({"dataset": "sharegpt"}, {"dataset": "sharegpt", "dataset_fingerprint": FP_A}, False),
])
def test_the_data_a_calibration_was_fitted_on_is_compared_by_content(fitted, ours, differs) -> None:
    from simulator.calibration import profile_differences

    diff = profile_differences({"target": "smollm2", **fitted}, {"target": "smollm2", **ours})
    assert bool(diff) is differs, diff
    if differs:
        assert len(diff) == 1 and ("fingerprint" in diff[0] or "dataset" in diff[0])


def test_busy_is_the_workers_cycle_in_the_trainer_as_in_the_calibration() -> None:
    """One meaning of busy (issue #26): a real drafter is busy from its take until it asks again, a real
    target from an item's start to the next, less time at the cap; a hole (resume) counts the median
    cycle; simulated records keep their modelled work (calibration fitted it to those cycles)."""
    import numpy as np

    from dflash.core.runmetrics import busy_cycles

    start = np.array([0.0, 1.0, 2.0, 3.0, 100.0])
    work = np.array([0.5, 0.5, 0.5, 0.5, 0.5])
    asked = np.array([0.0, 0.9, 1.9, 2.9, 99.9])  # the next take's request: 0.4 s after the work ends
    got = busy_cycles([0] * 5, start, work, asked)
    assert got.tolist() == pytest.approx([0.9] * 5)  # the hole (3 -> 99.9) and the last: the median cycle
    blocked = np.array([0.2, 0.0, 0.0, 0.0, 0.0])  # the first item waited 0.2 s at the cap
    t_start = np.array([0.0, 0.8, 1.6, 2.4, 3.2])
    assert busy_cycles([0] * 5, t_start, work, t_start, less=blocked)[:2].tolist() == pytest.approx([0.6, 0.8])
    two = busy_cycles([0, 1, 0, 1], np.array([0.0, 0.0, 1.0, 2.0]), np.full(4, 0.5), np.array([0, 0, 0.7, 1.5]))
    assert two.tolist() == pytest.approx([0.7, 1.5, 0.7, 1.5])  # per worker


def test_a_real_runs_utilizations_are_measured_on_cycles_and_a_simulated_ones_on_work(tmp_path: Path) -> None:
    from dflash.core.runmetrics import RunTrace, run_metrics

    produce = [{"source": "real", "t": 0.5 + k, "item_id": f"i{k}", "worker": 0, "bucket": 0, "n_seqs": 1,
                "real_tokens": 10, "padded_len": 10, "t_start": float(k), "t_end": k + 0.5, "blocked_s": 0.0,
                "bytes": 1} for k in range(10)]
    takes = [{"source": "real", "t": k + 0.6, "drafter": 0, "step": k, "item_ids": [f"i{k}"], "bucket": 0,
              "wait_s": 0.1 if k else 0.0, "depth_before": 1, "bucket_depths": [1], "gate": "ready",
              "compute_s": 0.3, "tokens": 10, "n_seqs": 1, "anchors": 1} for k in range(10)]
    kw = {"p": [1.0], "min_ready": 1, "window": 2, "warmup_s": 0.0, "close_t": 9.9, "n_target": 1, "n_drafter": 1,
          "n_buckets": 1}
    real = run_metrics(RunTrace.from_records(produce, takes), **kw)
    sim = run_metrics(RunTrace.from_records([{**r, "source": "sim"} for r in produce],
                                            [{**r, "source": "sim"} for r in takes]), **kw)
    # the drafter asks again 0.9 s after each take (0.1 s at the gate): busy 0.9 of each second, not 0.3
    assert real["drafter_utilization"] == pytest.approx(0.9, abs=0.03)
    assert sim["drafter_utilization"] == pytest.approx(0.3, abs=0.03)
    assert real["target_utilization"] == pytest.approx(1.0, abs=0.03) and sim["target_utilization"] < 0.55
