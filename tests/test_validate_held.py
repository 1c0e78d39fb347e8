"""Validation blocks do not pay for a restart: on the CPU each configuration's rank job stays alive
across its blocks, held between them with its queue intact (issue #26 item 2).

Two tiny configurations alternate A B A B through validate's own ``run_block``, as the claim loop
runs them; one module-scoped pass is shared by the assertions. The base config scores the held-out
metric at every block's end (``[train] quality_every``, issue #27): the same pass shows validation,
the report and ``dflash eval`` reading it. A third job, a second training seed of ``a`` (``validate
--seeds``), shows the held-out target states computed once for the three jobs and the paired comparison
with run-to-run variance (issue #36).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from dflash.core.config import load_config
from dflash.core.records import read_records
from tests.test_resume_and_control import run_inputs, write_cfg  # noqa: F401 - the fixture
from tuning.validation.metrics import bucket_use
from tuning.validation.plan import ValidateArgs, block_steps, with_seeds
from tuning.validation.runner import release, run_block

ENTRIES = [{"name": "a", "queue": {"min_ready": 3, "max_depth": 6, "policy": "random_item"}},
           {"name": "b", "queue": {"min_ready": 2, "max_depth": 4, "policy": "fifo"}}]
TAKES, BLOCK = 15, 5  # three blocks a job; 3 jobs x 15 steps (2 jobs x 24 before the seed replicate)


@pytest.fixture(scope="module")
def held(tmp_path_factory: pytest.TempPathFactory, run_inputs) -> dict:  # noqa: F811
    d = tmp_path_factory.mktemp("held")
    base = load_config(write_cfg(d / "cfg.toml", run_inputs, log_every=1000, checkpoint_every=1000,
                                 quality_every=BLOCK, quality_per_bucket=3, quality_anchors=8))
    selection = with_seeds({"configs": ENTRIES}, 2, base.seed)
    selection["configs"] = [c for c in selection["configs"] if c["name"] != "b@seed4"]  # a: 2 seeds, b: 1
    args = ValidateArgs(selection=selection, selection_path="sel.json", takes=TAKES, out=d / "val",
                        calibration=None, claims_url="sqlite://", prompts=1, block_takes=BLOCK)
    rows = []
    try:
        for block in range(3):
            for entry in selection["configs"]:
                rows.append(run_block(entry, block, base, args, progress=lambda _m: None))
        release()
    finally:
        from tuning.validation.runner import HELD

        for job in list(HELD.values()):
            job.kill()
        HELD.clear()
    return {"rows": rows, "out": args.out, "base": base, "args": args}


def test_each_configuration_trains_all_its_blocks_in_one_job_of_two_processes(held) -> None:
    for entry in ENTRIES:
        run = held["out"] / "runs" / entry["name"]
        produce, takes = list(read_records(run, "produce")), list(read_records(run, "take"))
        pids = {r["pid"] for r in produce} | {r["pid"] for r in takes}
        assert len({r["pid"] for r in produce}) == 1 and len({r["pid"] for r in takes}) == 1 and len(pids) == 2
        s = list(read_records(run, "summary"))
        assert len(s) == 1 and s[0]["steps"] == TAKES and s[0]["replayed"] == 0  # one session, nothing produced again
        assert max(Counter(r["item_id"] for r in produce).values()) == 1
        assert [r["step"] for r in read_records(run, "step")] == list(range(TAKES))
        assert json.loads((run / "held.json").read_text())["ended"] and (run / "metrics.json").is_file()
        use = bucket_use(run, held["base"])  # the one-bucket pathology, from the takes
        buckets = [t["bucket"] for t in sorted(takes, key=lambda t: t["t"])]
        assert use["streak_takes"] == use["takes"] == TAKES and 1 <= use["longest_streak"] <= TAKES
        assert use["top_share"] == max(Counter(buckets).values()) / TAKES


def test_a_held_block_starts_with_the_queue_it_left_and_is_measured_from_its_own_start(held) -> None:
    base, args = held["base"], held["args"]
    for entry in ENTRIES:
        run = held["out"] / "runs" / entry["name"]
        takes = sorted(read_records(run, "take"), key=lambda r: r["t"])
        rows = [r for r in held["rows"] if r["name"] == entry["name"]]
        assert [r["held"] for r in rows] == [True, True, True]
        for block in (1, 2):
            first_step = block_steps(base, args, block - 1)[0]
            first = next(t for t in takes if t["step"] == first_step)
            last_before = max(t["t"] for t in takes if t["step"] < first_step)
            assert first["depth_before"] >= entry["queue"]["min_ready"]  # no refill: the queue was kept
            assert rows[block]["t_start"] >= last_before  # the block's span is its own
            assert rows[block]["throughput_tokens_per_s"] > 0 and rows[block]["takes"] == BLOCK
            assert rows[block]["mix_window"] == base.metrics.window  # the configured window, never the block's


def test_a_held_job_computes_nothing_while_another_configuration_trains(held) -> None:
    """Producers get no admit while their job holds: between a block's last take and the next block's
    first take (the clock skips the pause) a producer finishes at most the item it had in hand."""
    runs = {e["name"]: held["out"] / "runs" / e["name"] for e in ENTRIES}
    for n, run in runs.items():  # produced after the job's last take of a block, before its next block:
        produce = sorted(read_records(run, "produce"), key=lambda r: r["t_start"])
        takes = sorted(read_records(run, "take"), key=lambda r: r["t"])
        for block in (1, 2):
            edge = block_steps(held["base"], held["args"], block - 1)[0]
            end = max(t["t"] for t in takes if t["step"] < edge)
            start = min(t["t"] for t in takes if t["step"] >= edge)
            inside = [p for p in produce if end < p["t_start"] < start]
            assert len(inside) <= 1, (n, block, inside)  # at most the item in hand when the hold began


def test_the_block_start_cost_is_measured(held) -> None:
    """Block 0 pays process start, model load and the first fill; held blocks pay none of them."""
    by = {(r["name"], r["block"]): r["wall_s"] for r in held["rows"]}
    for entry in ENTRIES:
        assert by[(entry["name"], 0)] > 0 and all(by[(entry["name"], k)] > 0 for k in (1, 2))


def test_the_driver_gone_a_held_job_ends_itself_cleanly(tmp_path: Path) -> None:
    """The hold files: a block says where to hold, a newer block where to go on, stop ends the job."""
    from dflash.pipeline.hold import Block, HoldWatch, ended, holding, pending_end, write_block, write_held

    write_block(tmp_path, Block(0, until_step=4))
    w = HoldWatch(tmp_path)
    assert not w.due(3) and w.due(4)
    assert w.next_block() is None  # the same block: keep holding
    write_held(tmp_path, 0, 4)
    assert holding(tmp_path, 0) and not holding(tmp_path, 1) and pending_end(tmp_path)
    assert not holding(tmp_path, 0, now=10**12)  # a stale beat: the job is gone
    write_block(tmp_path, Block(1, until_step=8))
    assert w.next_block() == Block(1, 8) and not w.due(4) and w.due(8)
    write_block(tmp_path, Block(2, stop=True))
    assert w.next_block().stop and w.due(5)
    write_held(tmp_path, 2, 8, ended=True)
    assert ended(tmp_path) and not pending_end(tmp_path) and not holding(tmp_path, 2)


# --------------------------------------------------------------------------- the held-out objective (issue #27)
def test_every_block_end_is_scored_on_one_held_out_set_and_validation_compares_it(held) -> None:
    from tuning.validation.metrics import block_table
    from tuning.validation.quality import heldout_evidence
    from tuning.validation.recommendation import evidence_of

    runs = {e["name"]: held["out"] / "runs" / e["name"] for e in ENTRIES}
    for run in runs.values():
        scored = [r["step"] for r in read_records(run, "step") if r.get("heldout")]
        assert scored == [BLOCK - 1, 2 * BLOCK - 1, 3 * BLOCK - 1]  # block ends
    ev = heldout_evidence(runs)
    assert ev["on"] and ev["same_set"] and ev["step"] == TAKES - 1
    assert "decides nothing" in ev["note"] and ev["estimates"] == {}  # one seed each: no quality claim
    ev = heldout_evidence({**runs, "a": [runs["a"], held["out"] / "runs" / "a@seed4"]})
    assert ev["note"] is None and ev["seeds"] == {"a": 2, "b": 1}
    n_seq = len(json.loads((runs["a"] / "heldout.json").read_text())["ids"])
    assert ev["sequences"] == n_seq >= 3  # quality_per_bucket = 3 of each bucket that has eligible sequences
    for n in runs:
        h = ev["configs"][n]
        assert h["sequences"] == n_seq and h["tau"] >= 1.0 and h["tau_ci"][0] <= h["tau"] <= h["tau_ci"][1]
        assert set(ev["estimates"][n]) == {"heldout_tau", "heldout_loss"}
    _, _, rec = evidence_of(block_table(held["rows"]), looks=3, block_takes=BLOCK, heldout=ev["estimates"])
    assert rec is not None and {"heldout_tau", "heldout_loss"} <= set(rec.objectives)
    held_comps = [c for c in rec.against_best if c.objective in ("heldout_tau", "heldout_loss")]
    assert len(held_comps) == 2 and all(c.blocks == (n_seq, n_seq) and c.paired for c in held_comps)
    assert "Decided by" in rec.words
    off = heldout_evidence({n: held["out"] / "nowhere" for n in runs})  # runs without the metric
    assert not off["on"] and "quality_every" in off["note"] and off["estimates"] == {}


def test_the_reports_loss_section_shows_the_held_out_metric(held) -> None:
    from reports.document import Figure, Table
    from reports.run_sections import heldout_blocks
    from reports.runs import load_run

    runs = [(e["name"], load_run(held["out"] / "runs" / e["name"], e["name"])) for e in ENTRIES]
    fig, table = heldout_blocks(runs)
    assert isinstance(fig, Figure) and fig.png[:4] == b"\x89PNG" and isinstance(table, Table)
    df = table.df
    assert list(df["config"].unique()) == ["a", "b"] and set(df["after step"]) == {str(TAKES)}
    assert list(df[df["config"] == "a"]["bucket"]) == ["all", "0", "1", "2"]  # overall, then per length bucket
    last = [r for r in read_records(held["out"] / "runs" / "a", "step") if r.get("heldout")][-1]["heldout"]
    assert df.iloc[0]["held-out tau"].startswith(f"{last['tau']:.3f} [{last['tau_ci'][0]:.3f}, ")
    assert "off in these runs" in heldout_blocks([("x", load_run(held["out"] / "nowhere", "x"))])[0].text


def test_eval_json_scores_the_runs_drafter_on_its_held_out_set(held, tmp_path: Path, capsys) -> None:
    """The final drafter is the one the last step record scored: dflash eval's fresh score of it equals
    that record, from the kept target states and from states computed again without them."""
    import shutil

    from dflash.cli import main
    from dflash.cli.verbs.eval import heldout_score
    from dflash.core.config import with_overrides
    from dflash.model.drafter import DFlashDrafter
    from dflash.model.target import load_target

    run = held["out"] / "runs" / "a"
    last = [r for r in read_records(run, "step") if r.get("heldout")][-1]["heldout"]
    out = tmp_path / "eval.json"
    assert main(["eval", "--drafter", str(run / "drafter"), "--prompts", "1", "--json", str(out)]) == 0
    got = json.loads(out.read_text())["heldout"]
    assert got["states"] == "kept" and got["ids"] == last["sequences"]
    for k in ("tau", "acceptance", "loss", "sequences", "blocks"):
        assert got[k] == pytest.approx(last[k], rel=1e-5), k
    assert "held-out (kept target states" in capsys.readouterr().out
    bare = tmp_path / "run"
    shutil.copytree(run, bare, ignore=shutil.ignore_patterns("states.pt"))
    cfg = with_overrides(held["base"], {f"queue.{k}": v for k, v in ENTRIES[0]["queue"].items()})
    target = load_target(str(cfg.target.model))
    fresh = heldout_score(bare, cfg, target, DFlashDrafter.load(run / "drafter", target.model))
    assert fresh is not None and fresh["states"] == "computed"
    assert fresh["tau"] == pytest.approx(last["tau"], rel=1e-4)
    assert fresh["loss"] == pytest.approx(last["loss"], rel=1e-3)


# --------------------------------------------------------------------------- paired, shared states (issue #36)
def test_three_jobs_compute_the_held_out_target_states_once(held) -> None:
    """a, b and a's second seed: the first job computes the target's held-out states, the validation
    keeps that one copy, and the other two jobs' target ranks find it kept (one file on disk)."""
    from dflash.pipeline.heldout import STATES_FILE, read_rows

    names = ["a", "b", "a@seed4"]
    info = {n: json.loads((held["out"] / "runs" / n / "heldout.json").read_text()) for n in names}
    assert [info[n]["states"] for n in names] == ["computed", "kept", "kept"]
    assert len({info[n]["seed"] for n in names}) == 1 and len({tuple(info[n]["ids"]) for n in names}) == 1
    inodes = {(held["out"] / "runs" / n / STATES_FILE).stat().st_ino for n in names}
    assert inodes == {(held["out"] / STATES_FILE).stat().st_ino}
    one, two = (read_rows(held["out"] / "runs" / n)[TAKES - 1] for n in ("a", "a@seed4"))
    assert one["ids"] == two["ids"] and one["rows"] != two["rows"]  # another seed's drafter, the same sequences


def test_configurations_are_compared_paired_with_the_variance_between_seeds(held) -> None:
    """The real runs' per-sequence rows: the paired interval over sequences is narrower than the
    independent one, a's two seeds add the run-to-run variance, and the text says paired and seeds."""
    from tuning.validation.paired import RunRows, SeedVariance, paired_difference
    from tuning.validation.quality import heldout_evidence
    from tuning.validation.summary import heldout_lines

    runs = {n: held["out"] / "runs" / n for n in ("a", "b", "a@seed4")}
    ev = heldout_evidence({"a": [runs["a"], runs["a@seed4"]], "b": [runs["b"]]})
    assert ev["method"] == "paired" and {p["objective"] for p in ev["pairs"]} == {"heldout_tau", "heldout_loss"}
    for p in ev["pairs"]:
        assert p["config"] == "a" and p["against"] == "b" and p["seeds"] == [2, 1] and p["claim"] and p["seed_df"] == 1
        assert p["ci95"][0] <= p["difference"] <= p["ci95"][1]
    loss = next(p for p in ev["pairs"] if p["objective"] == "heldout_loss")  # tau: 1.0 everywhere this early
    assert loss["se"] > loss["se_sequences"] > 0 and 0 < loss["width_ratio"] < 1, loss
    text = "\n".join(heldout_lines(ev))
    assert "paired over" in text and "seeds 2/1" in text and "(first of 2 seeds)" in text
    from dflash.pipeline.heldout import read_rows

    rows = {n: read_rows(d)[TAKES - 1] for n, d in runs.items()}
    a, b = (RunRows(tuple(rows[n]["ids"]), tuple(map(tuple, rows[n]["rows"]))) for n in ("a", "b"))
    shifted = RunRows(a.ids[1:] + a.ids[:1], a.rows)  # the same sequences paired with the wrong rows
    with pytest.raises(ValueError, match="other held-out sequences"):
        paired_difference([shifted], [b], "heldout_tau", SeedVariance(float("nan"), 0))


# --------------------------------------------------------------------------- stopped by SIGTERM (issue #38)
@pytest.mark.slow
def test_sigterm_stops_validate_and_its_held_jobs_and_a_rerun_trains_every_step_once(tmp_path: Path,
                                                                                    run_inputs) -> None:  # noqa: F811
    """SIGTERM to ``dflash validate`` alone (Slurm's ``--signal=B:TERM``) while b's first block trains and
    a's job holds: exit 143, the one line, no traceback, no rank or launcher left; the claim table
    holds nothing running (b's block was given back), and the same command again finishes the
    validation with every step of each configuration trained once."""
    import os
    import signal
    import sqlite3
    import subprocess
    import sys
    import time

    from dflash.cli import main
    from tests.conftest import left_in_session

    cfg = write_cfg(tmp_path / "cfg.toml", run_inputs, log_every=1000, checkpoint_every=1000, eval_prompts=1,
                    eval_new_tokens=8)
    sel = tmp_path / "sel.json"
    sel.write_text(json.dumps({"configs": ENTRIES}))
    val = tmp_path / "val"
    argv = ["validate", "--config", str(cfg), "--selection", str(sel), "--takes", "8", "--block-takes", "4",
            "--out", str(val)]
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen([sys.executable, "-m", "dflash", *argv], cwd=root, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 300
        while proc.poll() is None and time.monotonic() < deadline and \
                len(list(read_records(val / "runs" / "b", "take"))) < 1:
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 143 and err.splitlines()[-1] == "dflash validate: terminated", err
    assert "Traceback" not in err
    assert not left_in_session(proc.pid, 30), "a held job outlived its terminated driver"
    with sqlite3.connect(val / "validation.db") as con:  # one job in the table: its namespace is the only one
        rows = {name: {"status": status, "worker": worker}
                for name, status, worker in con.execute("select name, status, worker from dflash_validation")}
    assert "running" not in {r["status"] for r in rows.values()}, rows
    # b's first block was given back; on a quick machine it can finish between two looks of this test, and then
    # the block in flight when SIGTERM came (round 2's) was: either way nothing runs and something is pending
    assert rows["a#0"]["status"] == "done" and "pending" in {r["status"] for r in rows.values()}, rows

    assert main(argv) == 0
    payload = json.loads((val / "validation.json").read_text())
    # both rounds, unless the decision was an answer after the first (the early stop skips the second)
    rounds = 1 if payload["stopped"] == "decided" else 2
    assert [(r["block"], r["name"]) for r in payload["block_rows"]] == [(k, n) for k in range(rounds) for n in "ab"]
    for entry in ENTRIES:
        steps = [r["step"] for r in read_records(val / "runs" / entry["name"], "step")]
        assert steps == list(range(4 * rounds)), (entry["name"], steps)  # resumed (a) or started over (b): once
