"""Validation: workers share one claim table (no config twice, none skipped, dead claims return),
the validated best follows the knee rule on measured values, and the real thing end to end (slow)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import tomllib
from pathlib import Path

import pytest

from dflash.cli import main
from dflash.core.config import config_from_dict, load_config, with_overrides
from dflash.core.records import read_records
from dflash.data.dataset_choice import pin_dataset
from tuning.validation.claims import ClaimStore
from tuning.validation.metrics import within_goals

ROOT = Path(__file__).resolve().parent.parent
NAMES = [f"cfg-{k}" for k in range(12)]

WORKER = textwrap.dedent("""
    import sys, time
    from tuning.validation.claims import ClaimStore
    url, ns, tag = sys.argv[1], sys.argv[2], sys.argv[3]
    store = ClaimStore(url, ns)
    store.register({names!r})
    while (name := store.claim(tag)) is not None:
        time.sleep(0.05)  # "run" it
        assert store.finish(name, tag, {{"ran_by": tag}})
""").format(names=NAMES)


def claim_urls(tmp_path: Path) -> list[str]:
    urls = [f"sqlite:///{tmp_path / 'claims.db'}"]
    if os.environ.get("DFLASH_TEST_POSTGRES_URL"):
        urls.append(os.environ["DFLASH_TEST_POSTGRES_URL"])
    return urls


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_two_worker_processes_run_every_config_exactly_once(tmp_path: Path, backend: str) -> None:
    urls = {u.split(":")[0].split("+")[0]: u for u in claim_urls(tmp_path)}
    if backend not in urls:
        pytest.skip("no PostgreSQL server: set DFLASH_TEST_POSTGRES_URL (.ci/run starts one)")
    ns = f"test-{backend}-{time.time_ns()}"
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, urls[backend], ns, f"w{k}"], cwd=ROOT)
             for k in range(2)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    rows = ClaimStore(urls[backend], ns).rows()
    assert [r["name"] for r in rows] == NAMES  # none skipped, none added
    assert all(r["status"] == "done" and r["attempts"] == 1 for r in rows)  # none run twice
    assert {r["result"]["ran_by"] for r in rows} == {"w0", "w1"}  # both took part
    assert all(r["result"]["ran_by"] == r["worker"] for r in rows)


def test_a_dead_workers_claim_returns_and_its_late_result_is_dropped(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'c.db'}"
    store = ClaimStore(url, "ns", stale_s=0.2)
    store.register(["only"])
    assert store.claim("dead") == "only"
    assert store.claim("alive") is None  # still fresh: nobody else may take it
    time.sleep(0.3)
    assert store.claim("alive") == "only"
    assert not store.finish("only", "dead", {"late": True})
    assert store.finish("only", "alive", {"ok": True})
    row = store.rows()[0]
    assert row["attempts"] == 2 and row["result"] == {"ok": True} and row["worker"] == "alive"
    assert store.claim("third") is None


@pytest.mark.parametrize("pred, meas, se, ok", [
    ({"throughput_tokens_per_s": 104, "mix_efficiency": 0.95, "loss_roughness": 0.11},
     {"throughput_tokens_per_s": 100, "mix_efficiency": 0.93, "loss_roughness": 0.10}, 0.01,
     {"throughput_tokens_per_s": True, "mix_efficiency": True, "loss_roughness": True}),
    ({"throughput_tokens_per_s": 106, "mix_efficiency": 0.85, "loss_roughness": 0.13},
     {"throughput_tokens_per_s": 100, "mix_efficiency": 0.93, "loss_roughness": 0.10}, 0.01,
     {"throughput_tokens_per_s": False, "mix_efficiency": False, "loss_roughness": False}),
    ({"throughput_tokens_per_s": 100, "mix_efficiency": 0.85, "loss_roughness": 0.10},
     {"throughput_tokens_per_s": 100, "mix_efficiency": 0.93, "loss_roughness": 0.10}, 0.05,
     {"throughput_tokens_per_s": True, "mix_efficiency": True, "loss_roughness": True}),  # 2 SE = 0.1
])
def test_goals_follow_the_issue(pred: dict, meas: dict, se: float, ok: dict) -> None:
    predicted = {k: {"mean": v} for k, v in pred.items()}
    assert within_goals(meas, {"mix_efficiency": se}, predicted) == ok


@pytest.mark.parametrize("argv, names", [
    (["--selection", "sel.json"], ["--selection", "configs"]),
    (["--selection", "good.json", "--takes", "0"], ["--takes"]),
    (["--selection", "good.json", "--block-takes", "0"], ["--block-takes"]),  # a block shorter than one take
    (["--selection", "good.json", "--storage", "redis://x"], ["--storage"]),
    (["--selection", "good.json", "--calibration", "nope.json"], ["--calibration"]),
])
def test_bad_validate_input_is_one_line(tmp_path: Path, monkeypatch, capsys, argv: list, names: list) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sel.json").write_text('{"configs": []}')
    (tmp_path / "good.json").write_text('{"configs": [{"name": "a", "queue": {"min_ready": 2}}]}')
    assert main(["validate", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and all(n in err for n in names), err
    assert not (tmp_path / "validation").exists()


@pytest.mark.slow
def test_validate_runs_the_selection_on_the_real_trainer_and_writes_best_toml(tmp_path: Path, capsys) -> None:
    """SmolLM2 on the CPU, two tiny configs, 12 takes each: every field the report reads is there.
    The profile's metrics window is 4 here, so a block of 6 takes holds a window (the window is never
    shrunk to the block: blocks and predictions use the configured one)."""
    text = (ROOT / "examples" / "cpu-smollm2.toml").read_text()
    assert "window = 32" in text
    profile = tmp_path / "cpu-smollm2-w4.toml"
    # tau on one prompt (the profile's 4 were a third of this test's time): the test checks tau is scored
    profile.write_text(text.replace("window = 32", "window = 4")
                       .replace("log_every = 10", "log_every = 10\neval_prompts = 1"))
    sel = tmp_path / "sel.json"
    sel.write_text(json.dumps({"configs": [
        {"name": "baseline", "queue": {"min_ready": 4, "max_depth": 12, "policy": "random_item"}},
        {"name": "tuned-1", "queue": {"min_ready": 2, "max_depth": 8, "policy": "fullest"}}]}))
    out = tmp_path / "val"
    argv = ["validate", "--config", str(profile), "--selection", str(sel), "--takes", "12", "--block-takes", "6",
            "--out", str(out)]
    assert main(argv) == 0
    payload = json.loads((out / "validation.json").read_text())
    assert [r["name"] for r in payload["configs"]] == ["baseline", "tuned-1"]
    assert payload["max_looks"] == 2 and payload["rounds"] == 2  # one block of each cannot resolve anything
    assert [(r["block"], r["name"]) for r in payload["block_rows"]] == [
        (0, "baseline"), (0, "tuned-1"), (1, "baseline"), (1, "tuned-1")]  # ABAB: drift hits both alike
    assert payload["tested"] == "tuned-1"
    assert {(c["against"], c["objective"]) for c in payload["comparisons"]} == {
        ("baseline", "throughput_tokens_per_s"), ("baseline", "mix_efficiency")}
    for c in payload["comparisons"]:
        lo, hi = c["ci95"]
        assert c["config"] == "tuned-1" and c["resolved"] == (not lo <= 0 <= hi) and lo <= c["difference"] <= hi
    # The decision (simulator and hardware together) picks; validation.json carries its inputs.
    from reports.answer import answer_of
    from tuning.evaluate import sweep_seeds
    from tuning.validation.decision import decide_from_json

    d = decide_from_json(payload["decision"])
    assert d.chosen == payload["chosen"] == payload["decision"]["chosen"]
    assert d.outcome == payload["decision"]["outcome"]
    assert {(c["candidate"], c["reference"]) for c in payload["decision"]["comparisons"]} == {("baseline", "tuned-1")}
    assert {c["objective"] for c in payload["decision"]["comparisons"]} == {"throughput_tokens_per_s", "mix_efficiency"}
    assert all(e["hw_rounds"] == 1 for e in payload["decision"]["inputs"]["evidence"])  # block 0 dropped: 1 round
    assert payload["block_takes"] == 6 and payload["block_reason"].startswith("given (--block-takes 6)")
    assert payload["window"] == 4 and all(r["mix_window"] == 4 for r in payload["block_rows"])
    assert not set(payload["prediction_seeds"]) & set(payload["sweep_seeds"])
    assert set(payload["pathology"]) == {"baseline", "tuned-1"}
    assert all(0 < u["top_share"] <= 1 and 1 <= u["longest_streak"] <= u["streak_takes"] == 12
               for u in payload["pathology"].values())
    cli_lines = capsys.readouterr().out.strip().splitlines()
    assert cli_lines[-2:] == list(answer_of(payload))  # the answer is the last two lines
    assert payload["sweep_seeds"] == list(sweep_seeds(load_config(profile)))
    for r in payload["configs"]:
        assert r["steps"] == 12 and r["blocks"] == 2 and r["measured"]["tau"] >= 1.0 and r["kept_blocks"] == [1]
        assert r["predicted"]["throughput_tokens_per_s"]["mean"] > 0
        assert r["predicted"]["seeds"] == payload["prediction_seeds"]
        kept = [b for b in payload["block_rows"] if b["name"] == r["name"] and b["block"] == 1]
        assert r["measured"]["mix_efficiency"] == pytest.approx(kept[0]["mix_efficiency"])  # block 0 dropped
        # 12 takes are too few to calibrate a run alone (calibrate wants >= 20 items): drift says why
        assert isinstance(r["drift"], float) or (r["drift"] is None and r["drift_detail"]["why_missing"])
        assert "throughput_error_drift_corrected" in r
        assert (out / r["run_dir"] / "take.jsonl").is_file() and (out / r["sim_dir"] / "take.jsonl").is_file()
    steps = [s["step"] for s in read_records(out / "runs" / "tuned-1", "step")]
    assert steps == list(range(12))  # block 2 continued block 1's run: every step once, in order
    best = load_config(out / "best.toml")
    chosen = next(r for r in payload["configs"] if r["name"] == payload["chosen"])
    # the full run trains on the data the recommendation was measured on: best.toml carries the pin
    validated = pin_dataset(load_config(profile), say=lambda _line: None)
    assert best.workload.dataset_fingerprint == validated.workload.dataset_fingerprint is not None
    assert best == with_overrides(validated, {f"queue.{k}": v for k, v in chosen["queue"].items()})
    assert f"dflash train --config {out / 'best.toml'}" in "\n".join(cli_lines)
    # The same job again: every config is done, nothing runs twice, the summary is the same.
    mtimes = {p: p.stat().st_mtime for p in (out / "runs").rglob("metrics.json")}
    assert main(argv) == 0
    assert {p: p.stat().st_mtime for p in (out / "runs").rglob("metrics.json")} == mtimes
    assert config_from_dict(tomllib.loads((out / "best.toml").read_text())) == best
