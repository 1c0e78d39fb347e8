"""The sweep through the real simulator: front, constraints, exact trial counts, resume, grid, bad spaces."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pandas as pd
import pytest
from optuna.trial import TrialState

from dflash.cli import main
from dflash.core.config import load_config
from tuning.study import open_storage
from tuning.sweep import SweepArgs, run_sweep

ROOT = Path(__file__).resolve().parent.parent

BASE = """
seed = 0
[workload]
lengths = "lognormal"
n_sequences = 3000
order = "length_grouped"
[cluster]
n_target = {n_target}
n_drafter = 4
[timing]
target_per_token_s = {per_token}
target_noise = "deterministic"
drafter_noise = "deterministic"
[metrics]
warmup_s = 300.0
[sweep]
seeds_per_trial = {seeds}
sim_seconds = {sim_seconds}
{extra}
"""


def write_cfg(tmp_path: Path, *, n_target: int = 4, per_token: float = 3.7e-5, seeds: int = 1,
              sim_seconds: float = 1800, extra: str = "") -> Path:
    path = tmp_path / "sweep.toml"
    path.write_text(BASE.format(n_target=n_target, per_token=per_token, seeds=seeds, sim_seconds=sim_seconds,
                                extra=extra))
    return path


def sweep(cfg_path: Path, out: Path, trials: int, *, workers: int = 1, grid: bool = False) -> dict:
    cfg = load_config(cfg_path)
    args = SweepArgs(trials=trials, storage=str(out / "study.journal"), study="s", workers=workers, grid=grid,
                     out=out, calibration=None)
    return run_sweep(cfg, args, progress=False)


def states(out: Path, study: str = "s") -> dict[TrialState, int]:
    """Trial states, duplicates (PRUNED with ``duplicate_of``: proposed, never run) left out."""
    st = optuna.load_study(study_name=study, storage=open_storage(str(out / "study.journal")))
    res: dict[TrialState, int] = {}
    for t in st.get_trials(deepcopy=False):
        if t.state == TrialState.PRUNED and "duplicate_of" in t.user_attrs:
            continue
        res[t.state] = res.get(t.state, 0) + 1
    return res


def distinct_complete(out: Path, study: str = "s") -> tuple[int, int]:
    """(complete trials, distinct effective queues among them)."""
    st = optuna.load_study(study_name=study, storage=open_storage(str(out / "study.journal")))
    done = st.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    queues = {tuple(sorted((k, v) for k, v in t.user_attrs.items() if k.startswith("queue_"))) for t in done}
    return len(done), len(queues)


def test_known_answer_proportional_mixes_best_when_drafters_are_the_bottleneck(tmp_path: Path) -> None:
    """Drafter-bound, deterministic timing, queue at its cap: the policy decides the mix and the
    stratified `proportional` policy must top mix_efficiency, with fullest and fifo far behind."""
    cfg = write_cfg(tmp_path, extra='space = { policy = ["fullest", "fifo", "random_item", "proportional"] }\n'
                                   "top_k = 1")
    res = sweep(cfg, tmp_path / "out", trials=12)
    assert res["complete"] == 4 and res["distinct"] == 4  # four policies: four distinct configurations
    best = max((t for t in res["front"]), key=lambda t: t.values[1])
    assert best.params["policy"] == "proportional"
    by_policy: dict[str, list[float]] = {}
    for t in res["study"].get_trials(states=(TrialState.COMPLETE,)):
        by_policy.setdefault(t.params["policy"], []).append(t.values[1])
    assert {"proportional", "fullest", "fifo"} <= set(by_policy)
    worst_prop = min(by_policy["proportional"])
    assert all(v < worst_prop - 0.05 for pol in ("fullest", "fifo") for v in by_policy[pol])
    sel = json.loads((tmp_path / "out" / "selection.json").read_text())
    names = [c["name"] for c in sel["configs"]]  # top_k = 1
    assert names == ["tuned-1", "baseline", "handpicked"]
    assert sel["configs"][0]["trial"] in {t.number for t in res["front"]}  # the knee is on the front
    df = pd.read_parquet(tmp_path / "out" / "trials.parquet")
    assert (df["state"] == "COMPLETE").sum() == 4 and "user_attrs_peak_queue_bytes" in df.columns


def test_memory_constraint_excludes_over_budget_trials(tmp_path: Path) -> None:
    """The budget is per device (the memory model's fullest device, worst seed): drafter-bound, the
    queue sits at max_depth, so the fullest device's peak grows with it (~0.15 GiB per item here)."""
    cfg = write_cfg(tmp_path, extra="memory_budget_gib = 12.0\ntop_k = 3\n"
                                   "space = { max_depth = { low = 10, high = 120, step = 10 }, "
                                   "min_ready = { low = 1, high = 10 } }")
    res = sweep(cfg, tmp_path / "out", trials=12)
    trials = res["study"].get_trials(states=(TrialState.COMPLETE,))
    over = [t for t in trials if t.user_attrs["peak_device_bytes"] / 2**30 > 12.0]
    assert over, "the space must contain over-budget configurations for this test to mean anything"
    assert all(t.constraints["memory"] > 0 for t in over)
    assert res["top"] and all(t.user_attrs["peak_device_bytes"] / 2**30 <= 12.0 for t in res["front"] + res["top"])


def test_resume_continues_to_exactly_the_asked_trials(tmp_path: Path) -> None:
    cfg = write_cfg(tmp_path, extra="space = { min_ready = { low = 1, high = 40 } }")
    out = tmp_path / "out"
    first = sweep(cfg, out, trials=3)
    assert first["complete"] == 3
    again = sweep(cfg, out, trials=7)
    assert again["complete"] == 7 and again["new_trials"] == 4
    assert states(out) == {TrialState.COMPLETE: 7}
    assert distinct_complete(out) == (7, 7)  # the restart drew its own stream: no repeats
    done = sweep(cfg, out, trials=7)
    assert done["new_trials"] == 0


def test_a_killed_sweep_requeues_the_dead_workers_trial_and_ends_exact(tmp_path: Path) -> None:
    cfg = write_cfg(tmp_path, seeds=3, sim_seconds=7200, extra="space = { min_ready = { low = 1, high = 40 } }")
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "dflash", "sweep", "--config", str(cfg), "--trials", "5", "--study", "s",
           "--out", str(out)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    storage = str(out / "study.journal")
    deadline = time.time() + 120
    killed_params = None
    while time.time() < deadline:
        time.sleep(0.05)
        if not Path(storage).exists():
            continue
        try:
            st = optuna.load_study(study_name="s", storage=open_storage(storage))
        except KeyError:  # the journal exists but the study is not in it yet
            continue
        trials = st.get_trials(deepcopy=False)
        running = [t for t in trials if t.state == TrialState.RUNNING and "worker_pid" in t.user_attrs and t.params]
        if sum(t.state == TrialState.COMPLETE for t in trials) >= 1 and running:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            killed_params = running[0].params
            break
    assert killed_params is not None, "never caught the sweep mid-trial"
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    st = optuna.load_study(study_name="s", storage=open_storage(storage))
    trials = st.get_trials(deepcopy=False)
    assert sum(t.state == TrialState.COMPLETE for t in trials) == 5
    failed = [t for t in trials if t.state == TrialState.FAIL]
    assert len(failed) == 1 and failed[0].params == killed_params
    requeued = [t for t in trials if t.user_attrs.get("requeued_from") == failed[0].number]
    assert len(requeued) == 1 and requeued[0].params == killed_params
    assert requeued[0].state == TrialState.COMPLETE


def test_two_worker_processes_end_with_exactly_the_asked_trials(tmp_path: Path) -> None:
    cfg = write_cfg(tmp_path, extra="space = { min_ready = { low = 1, high = 40 } }")
    res = sweep(cfg, tmp_path / "out", trials=9, workers=2)
    assert res["complete"] == 9
    assert states(tmp_path / "out") == {TrialState.COMPLETE: 9}
    assert distinct_complete(tmp_path / "out") == (9, 9)
    pids = {t.user_attrs["worker_pid"] for t in res["study"].get_trials(states=(TrialState.COMPLETE,))}
    assert len(pids) == 2


def test_grid_prints_the_sensitivity_table_with_named_rows(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    cfg = write_cfg(tmp_path, n_target=1, per_token=8.1e-5, extra='grid_policies = ["fullest", "random_item"]')
    assert main(["sweep", "--config", str(cfg), "--grid", "--out", str(tmp_path / "g")]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.strip()[:2].isdigit() and "/" in line.split()[0]]
    assert [r.split()[0] for r in rows] == ["10/30", "20/60", "25/75", "30/90", "40/120"]
    assert all(len(r.split("|")) == 3 for r in rows)  # two policy cells per row
    assert "study: 10 complete trials" in out
    # a named config is one cell (its pair under the default policy), never a whole row: the fullest
    # column's 10/30 is not baseline, and baseline's cell shows the number of the "same seeds" line below
    assert rows[0].count("*b") == 1 and rows[0].rstrip().endswith("*b") and rows[3].rstrip().endswith("*h")
    assert "marked cells: *b baseline (10/30 random_item); *h handpicked (30/90 random_item)" in out
    for row, name in ((rows[0], "baseline"), (rows[3], "handpicked")):
        cell_mix = row.split("|")[1].split()[-3]  # the random_item cell: "<mix> ± <se>"
        line = next(x for x in out.splitlines() if x.strip().startswith(name) and "mix_efficiency" in x)
        assert f"mix_efficiency {cell_mix} " in line, (row, line)


def test_grid_offers_the_autopilot_beside_the_static_pairs(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """``--queue auto`` on a grid sweep adds an autopilot row (starting from the configured pair) to the
    static pairs, which stay static; its trial runs the simulator with the autopilot on."""
    cfg = write_cfg(tmp_path, n_target=1, per_token=8.1e-5, extra='grid_policies = ["random_item"]')
    assert main(["sweep", "--config", str(cfg), "--grid", "--queue", "auto", "--out", str(tmp_path / "g")]) == 0
    out = capsys.readouterr().out
    assert "auto (autopilot)" in out and "study: 6 complete trials" in out
    st = optuna.load_study(study_name="dflash", storage=open_storage(str(tmp_path / "g" / "study.journal")))
    modes = {t.params["pair"]: t.user_attrs["queue_mode"] for t in st.get_trials(states=(TrialState.COMPLETE,))}
    assert modes == {"10/30": "static", "20/60": "static", "25/75": "static", "30/90": "static",
                     "40/120": "static", "auto": "auto"}
    auto = next(t for t in st.get_trials(states=(TrialState.COMPLETE,)) if t.params["pair"] == "auto")
    assert 0 < auto.user_attrs["mix_efficiency"] <= 1.2


def test_a_search_space_may_choose_the_autopilot(tmp_path: Path) -> None:
    cfg = write_cfg(tmp_path, n_target=1, per_token=8.1e-5,
                    extra='sampler = "tpe"\nspace = { min_ready = { low = 5, high = 30 }, mode = ["static", "auto"] }')
    sweep(cfg, tmp_path / "s", 6)
    st = optuna.load_study(study_name="s", storage=open_storage(str(tmp_path / "s" / "study.journal")))
    done = st.get_trials(states=(TrialState.COMPLETE,))
    assert {t.params["mode"] for t in done} <= {"static", "auto"}
    assert all(t.user_attrs["queue_mode"] == t.params["mode"] for t in done)


def test_scalar_mode_keeps_throughput_above_the_fixed_reference(tmp_path: Path) -> None:
    cfg = write_cfg(tmp_path, n_target=1, per_token=8.1e-5, extra='mode = "scalar"\nsampler = "tpe"\n'
                    "min_throughput_frac = 0.98\nspace = { min_ready = { low = 1, high = 90 }, "
                    "max_depth = { low = 90, high = 90 } }")
    res = sweep(cfg, tmp_path / "out", trials=10)
    study = res["study"]
    ref = study.user_attrs["reference_throughput"]
    assert study.user_attrs["reference_queue"]["min_ready"] == 1
    assert study.user_attrs["reference_queue"]["max_depth"] == 90
    for t in res["top"]:
        assert t.user_attrs["throughput_tokens_per_s"] >= 0.98 * ref
    assert res["objective_names"] == ["mix_efficiency"]


def test_study_opens_in_optuna_dashboard(tmp_path: Path) -> None:
    from wsgiref.util import setup_testing_defaults

    import optuna_dashboard

    cfg = write_cfg(tmp_path, extra="space = { min_ready = { low = 1, high = 20 } }")
    sweep(cfg, tmp_path / "out", trials=2)
    app = optuna_dashboard.wsgi(open_storage(str(tmp_path / "out" / "study.journal")))

    def get(path: str) -> dict:
        environ: dict = {"PATH_INFO": path, "REQUEST_METHOD": "GET"}
        setup_testing_defaults(environ)
        status: list[str] = []
        body = b"".join(app(environ, lambda s, h, *a: status.append(s)))
        assert status[0].startswith("200"), status
        return json.loads(body)

    summary = next(s for s in get("/api/studies")["study_summaries"] if s["study_name"] == "s")
    detail = get(f"/api/studies/{summary['study_id']}")
    assert len(detail["trials"]) == 2


@pytest.mark.parametrize(("space", "needle"), [
    ("{ min_ready = { low = 5, high = 2 } }", "sweep.space.min_ready.high"),
    ("{ min_ready = { low = 0, high = 2 } }", "sweep.space.min_ready.low"),
    ("{ max_depth = { low = 10, high = 95, step = 10 } }", "sweep.space.max_depth.high"),
    ("{ max_depth = { low = 10, high = 90, step = 0 } }", "sweep.space.max_depth.step"),
    ('{ policy = ["random_item", "nope"] }', "sweep.space.policy"),
    ('{ policy = [] }', "sweep.space.policy"),
    ("{ colour = [1, 2] }", "sweep.space.colour"),
    ("{ min_ready = 5 }", "sweep.space.min_ready"),
    ("{ min_ready = { low = 1.5, high = 4 } }", "sweep.space.min_ready.low"),
])
def test_bad_search_space_is_one_line_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture, space: str,
                                              needle: str) -> None:
    cfg = write_cfg(tmp_path, extra=f"space = {space}")
    out = tmp_path / "out"
    assert main(["sweep", "--config", str(cfg), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err and "Traceback" not in err
    assert not out.exists()


def test_a_study_with_other_settings_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    cfg = write_cfg(tmp_path, extra="space = { min_ready = { low = 1, high = 20 } }")
    out = tmp_path / "out"
    assert main(["sweep", "--config", str(cfg), "--trials", "1", "--study", "s", "--out", str(out)]) == 0
    cfg2 = write_cfg(tmp_path, seeds=2, extra="space = { min_ready = { low = 1, high = 20 } }")
    capsys.readouterr()
    assert main(["sweep", "--config", str(cfg2), "--trials", "2", "--study", "s", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--study" in err and "seeds_per_trial" in err


@pytest.mark.skipif(not os.environ.get("DFLASH_TEST_POSTGRES_URL"),
                    reason="needs DFLASH_TEST_POSTGRES_URL (.ci/run starts PostgreSQL and sets it)")
def test_two_workers_share_one_postgresql_study(tmp_path: Path) -> None:
    url = os.environ["DFLASH_TEST_POSTGRES_URL"]
    name = f"pg-{os.getpid()}-{int(time.time())}"
    cfg = write_cfg(tmp_path, extra="space = { min_ready = { low = 1, high = 40 } }")
    cmd = [sys.executable, "-m", "dflash", "sweep", "--config", str(cfg), "--trials", "8", "--study", name,
           "--storage", url]
    procs = [subprocess.Popen([*cmd, "--out", str(tmp_path / f"w{i}")], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
    st = optuna.load_study(study_name=name, storage=open_storage(url))
    trials = st.get_trials(deepcopy=False)
    done = [t for t in trials if t.state == TrialState.COMPLETE]
    assert len(done) == 8
    assert all(t.state == TrialState.COMPLETE or "duplicate_of" in t.user_attrs for t in trials)
    assert len({json.dumps(t.params, sort_keys=True) for t in done}) == 8  # one stream each: no pairs
    assert len({t.user_attrs["worker_pid"] for t in done}) == 2
