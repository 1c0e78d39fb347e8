"""`dflash report` on real inputs: a real short sweep, real simulator records, a real trainer run.

The validation directory is written here in `dflash validate`'s documented layout (validation.json
plus runs/ and sim/ record directories); its runs are simulator records of the selected configs
(same schema as real runs; the "measured" side is another seed), and every number in it comes from
those runs or from the sweep's selection. The report's tables are then checked against those inputs
with the report's documented rounding, and the HTML is loaded in Debian's headless Chromium.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dflash.cli import main
from dflash.core.config import load_config, with_overrides
from dflash.core.records import read_records
from reports.fmt import fmt_metric, fmt_pm, fmt_rel, parse_md_table, queue_text
from simulator.run import simulate
from simulator.workload import make_sampler
from tests.test_resume_and_control import run_inputs, write_cfg  # noqa: F401 - the fixture
from tuning.sweep import SweepArgs, run_sweep
from tuning.validation.evidence import recommend
from tuning.validation.metrics import COMPARED, GOALS, rel_errors, within_goals
from tuning.validation.summary import format_validation

CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
SWEEP_TOML = """
seed = 0
[workload]
lengths = "lognormal"
n_sequences = 3000
order = "length_grouped"
[cluster]
n_target = 4
n_drafter = 4
[metrics]
warmup_s = 60.0
[sweep]
seeds_per_trial = 2
sim_seconds = 600
top_k = 2
memory_budget_gib = 40.0
space = { min_ready = { low = 1, high = 60 }, max_depth = { low = 10, high = 120, step = 10 }, \
policy = ["random_item", "fifo", "proportional"] }
"""
VALIDATED = ("baseline", "handpicked", "tuned-1")
METRICS = ("throughput_tokens_per_s", "samples_per_s", "mix_efficiency", "mix_entropy", "mix_kl", "length_autocorr",
           "max_bucket_streak", "drafter_utilization", "target_utilization", "drafter_gate_wait_frac",
           "producer_blocked_frac", "mean_queue_depth", "peak_queue_bytes")


def section(md: str, title: str) -> str:
    """The Markdown text of one ``## title`` section."""
    start = md.index(f"## {title}")
    end = md.find("\n## ", start + 3)
    return md[start:end if end > 0 else None]


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A main-job-like directory: sweep/, validate/ (runs + sims), calibration.json; and its report."""
    root = tmp_path_factory.mktemp("report")
    demo_dir = root / "dflash-demo"
    (demo_dir).mkdir()
    cfg_path = root / "sweep.toml"
    cfg_path.write_text(SWEEP_TOML)
    cfg = load_config(cfg_path)
    sweep_dir = demo_dir / "sweep"
    res = run_sweep(cfg, SweepArgs(trials=14, storage=str(sweep_dir / "study.journal"), study="s", workers=1,
                                   grid=False, out=sweep_dir, calibration=None), progress=False)
    selection = json.loads((sweep_dir / "selection.json").read_text())
    by_name = {c["name"]: c for c in selection["configs"]}

    cal = {"timing": {k: v for k, v in dataclasses.asdict(cfg.timing).items() if not isinstance(v, tuple)},
           "fit": {"target": {"mape": 0.041, "n": 40}, "drafter": {"mape": 0.087, "n": 40}}}
    cal_path = demo_dir / "calibration.json"
    cal_path.write_text(json.dumps(cal))

    val_dir = demo_dir / "validate"
    configs = []
    for name in VALIDATED:
        sc = by_name[name]
        qcfg = with_overrides(cfg, {f"queue.{k}": v for k, v in sc["queue"].items()})
        simulate(qcfg, make_sampler(qcfg.workload, seed=0), sim_seconds=600, records_dir=val_dir / "sim" / name)
        mcfg = with_overrides(qcfg, {"seed": 100})
        meas = simulate(mcfg, make_sampler(mcfg.workload, seed=100), sim_seconds=600,
                        records_dir=val_dir / "runs" / name).metrics
        measured = {m: meas.get(m) for m in COMPARED} | {"tau": None}  # simulated "measurement": no loss, no tau
        se = {"mix_efficiency": meas["mix_efficiency_se"]}
        pred = {m: sc["predicted"].get(m, {"mean": None, "se": None}) for m in COMPARED}
        configs.append({
            "name": name, "trial": sc["trial"], "params": sc["params"], "queue": sc["queue"],
            "run_dir": f"runs/{name}", "sim_dir": f"sim/{name}", "measured": measured, "measured_se": se,
            "predicted": pred, "rel_error": rel_errors(measured, pred), "within_goal": within_goals(measured, se, pred),
            "steps": next(read_records(val_dir / "runs" / name, "summary"))["steps"], "wall_s": 0.5,
            "loss_roughness_steps": None, "tau_prompts": None,
            "drift": 0.08 * (len(configs) + 1), "drift_detail": {"target": 0.05 * (len(configs) + 1), "drafter": -0.02},
            "throughput_error_drift_corrected": -0.03})
    comparisons = [{"config": "tuned-1", "against": ref, "objective": obj, "difference": diff, "ci95": ci,
                    "resolved": not ci[0] <= 0 <= ci[1]}
                   for ref, obj, diff, ci in (("handpicked", "throughput_tokens_per_s", 41.0, [12.0, 70.0]),
                                              ("handpicked", "mix_efficiency", 0.01, [-0.02, 0.04]),
                                              ("baseline", "throughput_tokens_per_s", 5.0, [-30.0, 40.0]),
                                              ("baseline", "mix_efficiency", -0.01, [-0.05, 0.03]))]
    # The recommendation through the real decision code (tuning.validation.evidence), from per-block values whose
    # differences are open: its words carry the "more takes" figure the CLI and the report both print.
    blocks = {"baseline": {"throughput_tokens_per_s": [1000.0, 1040.0, 990.0, 1030.0],
                           "mix_efficiency": [0.95, 0.97, 0.96, 0.94]},
              "handpicked": {"throughput_tokens_per_s": [900.0, 960.0, 940.0, 920.0],
                             "mix_efficiency": [0.97, 0.98, 0.96, 0.99]},
              "tuned-1": {"throughput_tokens_per_s": [1010.0, 1050.0, 1000.0, 1020.0],
                          "mix_efficiency": [0.96, 0.95, 0.97, 0.96]}}
    rec = recommend(blocks, {"baseline": 3e8, "handpicked": 9e8, "tuned-1": 2e8}, max_looks=5, block_takes=20)
    validation = {"comparisons": comparisons, "rounds": 4, "max_looks": 5, "block_takes": 20, "stopped": "budget",
                  "recommendation": rec.as_json(),
                  "takes": 100, "calibration": str(cal_path), "selection": str(sweep_dir / "selection.json"),
                  "base_config": cfg.to_dict(), "chosen": "tuned-1", "best_toml": "best.toml",
                  "command": f"dflash train --config {val_dir / 'best.toml'}",
                  "devices": {"target": ["cpu"], "drafter": ["cpu"]}, "goals": GOALS, "configs": configs,
                  "failed": [], "claims": None}
    (val_dir / "validation.json").write_text(json.dumps(validation))

    out = root / "out"
    assert main(["report", str(demo_dir), "--out", str(out)]) == 0
    return {"root": root, "demo": demo_dir, "out": out, "md": (out / "report.md").read_text(),
            "html": (out / "report.html").read_text(), "validation": validation, "selection": selection,
            "sweep": res, "cal": cal}


def bucket_use_of(run_dir: Path) -> dict[str, Any]:
    """The one-bucket pathology in a run's take records: longest run of takes from one bucket, and the
    share of takes from the most-taken bucket (what validation.json's ``pathology`` records)."""
    buckets = [int(r["bucket"]) for r in read_records(run_dir, "take")]
    longest = run = 1
    for a, b in itertools.pairwise(buckets):
        run = run + 1 if a == b else 1
        longest = max(longest, run)
    top = max(set(buckets), key=buckets.count)
    return {"longest_streak": longest, "streak_takes": len(buckets), "top_share": buckets.count(top) / len(buckets),
            "top_bucket": f"#{top}"}


@pytest.fixture(scope="module")
def decided(demo: dict, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The demo's directory with a validation that decided (issue #32): validation.json's ``decision`` from
    the real decision code (tuning.validation.decision) on real simulator numbers (three prediction seeds per
    configuration, paired by seed; the "hardware" is each configuration's seed-100 run, one paired round)
    and its ``pathology`` from the runs' take records; and its report."""
    import shutil

    from tuning.validation.decision import DecisionPolicy, decide, pair_evidence

    root = tmp_path_factory.mktemp("decided")
    demo_dir = root / "dflash-demo"
    shutil.copytree(demo["demo"], demo_dir)
    val = json.loads(json.dumps(demo["validation"]))
    cfg = load_config(demo["root"] / "sweep.toml")
    objectives = ("throughput_tokens_per_s", "mix_efficiency")
    sims: dict[str, dict[str, list[float]]] = {}
    for c in val["configs"]:
        qcfg = with_overrides(cfg, {f"queue.{k}": v for k, v in c["queue"].items()})
        runs = [simulate(with_overrides(qcfg, {"seed": 1 + s}), make_sampler(qcfg.workload, seed=1 + s),
                         sim_seconds=300).metrics for s in range(3)]
        sims[c["name"]] = {o: [float(m[o]) for m in runs] for o in objectives}
    hw = {c["name"]: c["measured"] for c in val["configs"]}
    names = [c["name"] for c in val["configs"]]
    evidence = [pair_evidence(a, b, o, sim_candidate=sims[a][o], sim_reference=sims[b][o], hw_candidate=[hw[a][o]],
                              hw_reference=[hw[b][o]],
                              model_block_sd=float(np.std(sims[a][o] + sims[b][o], ddof=1)) or None)
                for i, a in enumerate(names) for b in names[i + 1:] for o in objectives]
    policy = DecisionPolicy(margins={"throughput_tokens_per_s": 0.03, "mix_efficiency": 0.03}, objectives=objectives)
    decision = decide(evidence, {c["name"]: c["measured"]["peak_queue_bytes"] for c in val["configs"]}, policy)
    val["decision"] = decision.as_json()
    val["pathology"] = {n: bucket_use_of(demo_dir / "validate" / "runs" / n) for n in names}
    val["block_takes"], val["block_reason"], val["rounds"] = 64, "one mega_batch of the length-grouped order", 1
    val["chosen"], val["command"] = decision.chosen, f"dflash train --config {demo_dir / 'validate' / 'best.toml'}"
    (demo_dir / "validate" / "validation.json").write_text(json.dumps(val))
    out = root / "out"
    assert main(["report", str(demo_dir), "--out", str(out)]) == 0
    return {"decision": decision, "validation": val, "out": out, "md": (out / "report.md").read_text()}


def test_the_first_section_answers_in_the_decisions_two_sentences_and_lists_every_validated_config(
        decided: dict) -> None:
    """Issue #32 item 5: the report's first words are the two sentences answer_sentences writes from the
    recorded decision (the CLI prints the same), then one table with every validated configuration (the
    tuned one included), each row's differences against the recommendation equal to the decision's."""
    from reports.answer import answer_of
    from tuning.validation.decision import BucketUse, Pathology, answer_sentences, decide_from_json

    d, val, md = decided["decision"], decided["validation"], decided["md"]
    rebuilt = decide_from_json(val["decision"])
    assert (rebuilt.outcome, rebuilt.chosen) == (d.outcome, d.chosen)
    path = Pathology(BucketUse(**val["pathology"]["baseline"]), BucketUse(**val["pathology"][d.chosen]))
    first, second = answer_sentences(d, path, {c["name"]: queue_text(c["queue"]) for c in val["configs"]})
    assert answer_of(val) == (first, second)
    rec = section(md, "Recommendation")
    assert md.index("## Recommendation") < md.index("\n## ", md.index("## Recommendation") + 3)
    body = rec.split("\n\n")
    assert body[1] == f"**{first}**" and body[2] == second  # first thing under the heading
    assert d.chosen in first and ("decided", "equivalent", "undecided").count(d.outcome) == 1
    rows = parse_md_table(rec[rec.index("| config | queue | objective"):])
    named = [r["config"] for r in rows]
    for i, r in enumerate(rows):  # a configuration is named on its first row (one row per objective)
        r["config"] = (r["config"] or rows[i - 1]["config"]).removesuffix(" (recommended)")
    assert named[0] == f"{d.chosen} (recommended)" and rows[1]["config"] == d.chosen
    assert {r["config"] for r in rows} == {c["name"] for c in val["configs"]} and len(rows) == 2 * len(val["configs"])
    assert all(r["Δ decided [interval]"] == "—" for r in rows[:2])
    for c in d.comparisons:
        if d.chosen not in (c.candidate, c.reference):
            continue
        other = c.reference if c.candidate == d.chosen else c.candidate
        sign = 1 if c.candidate == d.chosen else -1
        row = next(r for r in rows if r["config"] == other and r["objective"] == c.objective.replace(
            "throughput_tokens_per_s", "throughput"))
        if c.objective == "mix_efficiency":
            lo, hi = sorted((sign * c.interval[0], sign * c.interval[1]))
            assert row["Δ decided [interval]"] == f"{sign * c.difference:+.3f} [{lo:+.3f}, {hi:+.3f}]"
            assert row["margin"] == f"±{c.margin:.3f}" and row["τ"] == f"{c.tau:.3f}"
        assert row["gap z"].split()[0] == f"{sign * c.gap_z:+.1f}"
        assert row["power"] == ("n/a" if c.power is None else f"{c.power:.0%}")
    for n, u in val["pathology"].items():
        label = n + (" (recommended)" if n == d.chosen else "")
        assert f"- {label}: longest run of takes from one bucket {u['longest_streak']} of {u['streak_takes']}" in rec
    assert f"Outcome: {d.outcome} ({d.note})." in rec and "Blocks of 64 takes" in rec
    # one round: the table says its predicted/measured columns are the first block, its Δ simulated the steady state
    from reports.answer import FIRST_BLOCK_NOTE

    one_round = any(c.evidence.sim_first_diff is not None for c in d.comparisons)
    assert (FIRST_BLOCK_NOTE in rec) is one_round
    assert "Why (measured" not in rec  # one verdict: the decision's, not also the standard-error rule's


def test_the_recommendation_comes_first_and_names_the_choice_and_its_command(demo: dict) -> None:
    md = demo["md"]
    first = section(md, "Recommendation")
    assert md.index("## Recommendation") < md.index("## ", md.index("## Recommendation") + 3)
    assert "Run tuned-1:" in first and demo["validation"]["command"] in first
    assert "Why (measured on the real trainer):\n\n- Against baseline (10/30 random_item threshold): " in first
    assert "\n- Against handpicked (30/90 random_item threshold): " in first
    rows = {r["config"]: r for r in parse_md_table(first)}
    assert list(rows) == ["tuned-1 (chosen)", "baseline", "handpicked"]
    for name, label in (("tuned-1", "tuned-1 (chosen)"), ("baseline", "baseline")):
        vc = next(c for c in demo["validation"]["configs"] if c["name"] == name)
        t = vc["measured"]["throughput_tokens_per_s"]
        assert rows[label]["tokens/s measured"] == fmt_metric("throughput_tokens_per_s", t) == f"{t:,.0f}"
        p = vc["predicted"]["mix_efficiency"]
        assert rows[label]["mix_efficiency predicted"] == f"{p['mean']:.3f} ± {p['se']:.3f}"


def test_simulated_vs_measured_table_equals_the_validation_numbers(demo: dict) -> None:
    rows = parse_md_table(section(demo["md"], "Simulated vs measured"))
    table = {(r["config"], r["metric"]): r for r in rows}
    for vc in demo["validation"]["configs"]:
        for m in METRICS:
            row = table[(vc["name"], m)]
            p = vc["predicted"][m]
            assert row["simulated"] == fmt_pm(m, p["mean"], p["se"])
            assert row["measured"] == fmt_pm(m, vc["measured"][m], vc["measured_se"].get(m))
            assert row["rel. error"] == fmt_rel(vc["rel_error"].get(m))
            assert row["within goal"] == {True: "yes", False: "NO", None: ""}[vc["within_goal"].get(m)]
        mix = table[(vc["name"], "mix_efficiency")]
        assert mix["measured"] == f"{vc['measured']['mix_efficiency']:.3f} ± {vc['measured_se']['mix_efficiency']:.3f}"
        assert mix["rel. error"] == f"{vc['rel_error']['mix_efficiency']:+.1%}"


def test_pareto_front_is_the_feasible_front_and_importances_are_the_selections(demo: dict) -> None:
    front = demo["sweep"]["front"]
    md = section(demo["md"], "Pareto front: throughput vs mix_efficiency")
    rows = parse_md_table(md[md.index("| trial"):])
    assert len(rows) == len(front) > 0
    assert {int(r["trial"]) for r in rows} == {t.number for t in front}
    n_feasible = demo["sweep"]["feasible"]
    assert f"{len(front)} configurations on the feasible Pareto front of 14 complete trials ({n_feasible} feasible)" \
        in md
    tuned1 = next(r for r in rows if r["selected as"] == "tuned-1")
    assert int(tuned1["trial"]) == demo["selection"]["configs"][0]["trial"]
    imps = demo["selection"]["importances"]
    table = {r["knob"]: r for r in parse_md_table(section(demo["md"], "Parameter importances"))}
    for objective, values in imps.items():
        for knob, v in values.items():
            assert table[knob][objective] == f"{v:.3f}"


def test_without_the_study_journal_the_front_comes_from_the_parquet_feasible_column(demo: dict,
                                                                                   tmp_path: Path) -> None:
    """A study kept in PostgreSQL leaves no journal beside selection.json; the report still marks the front."""
    import shutil

    sweep = tmp_path / "sweep"
    shutil.copytree(demo["demo"] / "sweep", sweep)
    (sweep / "study.journal").unlink()
    assert main(["report", str(sweep), "--out", str(tmp_path / "out")]) == 0
    md = section((tmp_path / "out" / "report.md").read_text(), "Pareto front: throughput vs mix_efficiency")
    rows = parse_md_table(md[md.index("| trial"):])
    assert {int(r["trial"]) for r in rows} == {t.number for t in demo["sweep"]["front"]}


def test_figures_calibration_and_metadata(demo: dict) -> None:
    out, md = demo["out"], demo["md"]
    names = re.findall(r"\]\(figures/([a-z_]+)\.png\)", md)
    assert set(names) == {"pareto", "heatmaps", "queue_depth", "bucket_mix"}
    for n in names:
        assert (out / "figures" / f"{n}.png").read_bytes()[:4] == b"\x89PNG"
    assert "> Not available: loss curves" in section(md, "Loss curves")  # simulator records have no losses
    cal = section(md, "Calibration")
    timing = {r["key"]: r["value"] for r in parse_md_table(cal)}
    assert timing["drafter_fixed_s"] == f"{demo['cal']['timing']['drafter_fixed_s']:.6g}"
    assert "| target | 0.041 | 40 |" in cal
    meta = {r["item"]: r["value"] for r in parse_md_table(section(md, "Run metadata"))}
    assert meta["takes per validated config"] == "100" and meta["devices"] == "target cpu; drafter cpu"
    assert meta["validation goals"] == GOALS
    assert meta["dflash-tune"] == __import__("dflash").__version__
    assert str(demo["demo"] / "calibration.json") in meta["calibration used"]
    assert "short runs have wide standard errors" in section(md, "Run metadata").lower()


def test_html_is_self_contained(demo: dict) -> None:
    html = demo["html"]
    assert "<script" not in html.lower()
    assert not re.search(r"""(src|href)\s*=\s*["'](?!data:|#)""", html)
    assert "http://" not in html and "https://" not in html
    assert html.count('<img src="data:image/png;base64,') == 4
    assert not list(demo["out"].glob(".*tmp*")) and not list((demo["out"] / "figures").glob(".*tmp*"))


@pytest.mark.skipif(not CHROMIUM.exists() or not CHROMEDRIVER.exists(),
                    reason="Debian's chromium and chromium-driver are not installed (/usr/bin/chromium, "
                           "/usr/bin/chromedriver; scripts/install_chromium.sh installs them)")
def test_report_renders_in_headless_chromium_with_no_errors(demo: dict, decided: dict, tmp_path: Path) -> None:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = str(CHROMIUM)  # both paths explicit: Selenium Manager never downloads a browser
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                f"--user-data-dir={tmp_path / 'profile'}"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)), options=opts)
    try:
        driver.get((demo["out"] / "report.html").resolve().as_uri())
        assert driver.title.startswith("dflash-tune report")
        images = driver.execute_script(
            "return Array.from(document.images).map(i => [i.complete, i.naturalWidth, i.naturalHeight])")
        assert len(images) == 4 and all(c and w > 0 and h > 0 for c, w, h in images), images
        resources = driver.execute_script(
            "return performance.getEntriesByType('resource').map(e => e.name)")
        assert all(r.startswith("data:") for r in resources), resources
        errors = [e for e in driver.get_log("browser") if e["level"] in ("SEVERE", "ERROR")]
        assert errors == []
        assert "Run tuned-1" in driver.find_element("css selector", "#recommendation").text
        # What users copy (the launch, export and serving commands) is never cut off at the page edge:
        # code blocks wrap, so nothing overflows its box, and the page itself does not scroll sideways.
        for width in (1280, 700):
            driver.set_window_size(width, 900)
            boxes = driver.execute_script(
                "return Array.from(document.querySelectorAll('pre')).map(p => [p.scrollWidth, p.clientWidth, "
                "p.getBoundingClientRect().right, p.textContent.length])")
            assert boxes and any(n > 120 for *_, n in boxes), boxes  # the long serving commands are there
            assert all(sw <= cw + 1 for sw, cw, *_ in boxes), (width, boxes)
            assert driver.execute_script("return document.documentElement.scrollWidth <= window.innerWidth + 1")
            view = driver.execute_script("return window.innerWidth")
            assert all(right <= view + 1 for _, _, right, _ in boxes), (width, boxes)
        # A decided validation (issue #32): at 1280 px the answer is the first thing under the heading, the
        # decision table shows every validated configuration without the page scrolling sideways.
        driver.set_window_size(1280, 1000)
        driver.get((decided["out"] / "report.html").resolve().as_uri())
        first = driver.find_element("css selector", "#recommendation p").text
        assert first.startswith(("Use ", "Undecided")) and decided["decision"].chosen in first
        table = driver.find_element("css selector", "#recommendation table").text
        assert all(c["name"] in table for c in decided["validation"]["configs"])
        assert driver.execute_script("return document.documentElement.scrollWidth <= window.innerWidth + 1")
    finally:
        driver.quit()


def test_missing_sections_say_not_available_and_do_not_crash(demo: dict, tmp_path: Path) -> None:
    """A sparse validation.json (no selection, no runs, odd keys) and one standalone sim records dir."""
    val = tmp_path / "val"
    val.mkdir()
    (val / "validation.json").write_text(json.dumps({"chosen": "tuned-1", "configs": [
        {"name": "tuned-1", "queue": {"min_ready": 7, "max_depth": 40}, "measured": {"mix_efficiency": None}},
        "not a config", {"run_dir": "runs/none"}]}))
    sim = demo["demo"] / "validate" / "sim" / "baseline"
    out = tmp_path / "out"
    assert main(["report", str(val), str(sim), "--out", str(out)]) == 0
    md = (out / "report.md").read_text()
    assert "Run tuned-1: 7/40" in md and "dflash train --hs-min-ready 7 --hs-max-depth 40" in md
    for title in ("Pareto front: throughput vs mix_efficiency", "Sensitivity", "Parameter importances",
                  "Calibration"):
        assert "> Not available:" in section(md, title), title
    assert "![" in section(md, "Queue depth and bucket mix over time")  # the standalone sim run is drawn
    rows = parse_md_table(section(md, "Simulated vs measured"))
    assert rows == [{"config": "tuned-1", "metric": "mix_efficiency", "simulated": "n/a", "measured": "n/a",
                     "rel. error": "n/a", "|diff|/SE": "n/a"}]


def test_a_run_without_takes_gets_no_empty_panel(demo: dict, tmp_path: Path) -> None:
    """A run read for its timings alone (a calibration run; here a simulated run's records without
    take.jsonl) has nothing to draw over time: the queue figures leave it out instead of showing an
    empty "no take records" panel, and a report of simulated runs alone has no measured column."""
    import shutil

    with_takes = demo["demo"] / "validate" / "sim" / "baseline"
    without = tmp_path / "calibration-run"
    shutil.copytree(with_takes, without)
    (without / "take.jsonl").unlink()
    out = tmp_path / "out"
    assert main(["report", str(with_takes), str(without), "--out", str(out)]) == 0
    queue = section((out / "report.md").read_text(), "Queue depth and bucket mix over time")
    drawn = parse_md_table(queue)
    assert [r["directory"] for r in drawn] == [str(with_takes)]
    assert "simulated runs" in queue and "left simulated, right measured" not in queue
    out2 = tmp_path / "out2"
    assert main(["report", str(without), "--out", str(out2)]) == 0
    alone = section((out2 / "report.md").read_text(), "Queue depth and bucket mix over time")
    assert "> Not available: needs take records" in alone and "![" not in alone


@pytest.mark.parametrize("kind", ["text file", "empty dir", "bad selection", "bad validation"])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(kind: str, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture) -> None:
    bad = tmp_path / "in"
    if kind == "text file":
        bad = tmp_path / "notes.txt"
        bad.write_text("hello")
    else:
        bad.mkdir()
        if kind == "bad selection":
            (bad / "selection.json").write_text("{not json")
        elif kind == "bad validation":
            (bad / "validation.json").write_text("[1, 2")
    out = tmp_path / "out"
    assert main(["report", str(bad), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("dflash report: error: INPUT") and "Traceback" not in err
    assert not out.exists()


def test_a_real_trainer_run_gives_loss_curves_and_its_measured_numbers(tmp_path: Path,
                                                                       run_inputs) -> None:  # noqa: F811
    """A short real run (the rank job: tiny random Llama, SmolLM2 tokenizer, a ShareGPT slice) at the
    baseline queue, and `dflash calibrate`'s file fitted to it."""
    from dflash.pipeline.trainer import train

    cfg = with_overrides(load_config(write_cfg(tmp_path / "cfg.toml", run_inputs, max_steps=40, log_every=1000)),
                         {"queue.min_ready": 10, "queue.max_depth": 30})
    run = tmp_path / "run"
    res = train(cfg, run, wait_s=60.0, pg_timeout_s=60.0)
    cal_path = tmp_path / "calibration.json"
    assert main(["calibrate", "--run", str(run), "--out", str(cal_path)]) == 0
    cal = json.loads(cal_path.read_text())
    out = tmp_path / "out"
    assert main(["report", str(run), str(cal_path), "--out", str(out)]) == 0
    md = (out / "report.md").read_text()
    cal_md = section(md, "Calibration")
    assert f"Timing fit: target MAPE {cal['fit']['target']['mape']:.1%} (n {cal['fit']['target']['n']})" in cal_md
    timing = {r["key"]: r["value"] for r in parse_md_table(cal_md)}
    assert timing["drafter_fixed_s"] == f"{cal['timing']['drafter_fixed_s']:.6g}"
    loss = section(md, "Loss curves")
    assert "](figures/loss.png)" in loss and (out / "figures" / "loss.png").stat().st_size > 5000
    row = parse_md_table(loss)[0]
    assert row["config"] == "baseline" and row["steps"] == "40"  # 10/30 with the default policy
    assert row["loss_roughness measured"] == f"{res.metrics['loss_roughness']:.3f}"
    span = res.metrics["loss_roughness_steps"]
    assert row["over"] == f"steps {span[0]}-{span[1]}"
    runs = parse_md_table(section(md, "Queue depth and bucket mix over time")[
        section(md, "Queue depth and bucket mix over time").index("| config"):])
    assert runs[0]["kind"] == "measured" and runs[0]["takes"] == "40"
    meta = {r["item"]: r["value"] for r in parse_md_table(section(md, "Run metadata"))}
    assert meta["devices"] == "target cpu; drafter cpu"


def test_the_cli_summary_and_the_report_print_the_same_recommendation_and_figures(demo: dict) -> None:
    """One home per figure (issue #29): the "more takes" estimate and the recommendation's words are
    computed once (tuning.validation.evidence.recommend) and the CLI summary and report.md both print them; the
    comparisons' differences and intervals come from validation.json in both."""
    val = demo["validation"]
    cli = format_validation(val)
    rec = section(demo["md"], "Recommendation")
    words = val["recommendation"]["words"]
    more = val["recommendation"]["takes_to_resolve"]
    assert isinstance(more, int) and more > 0
    cli_line = next(line for line in cli.splitlines() if line.startswith("recommended: "))
    assert cli_line == f"recommended: {words}"
    assert f"The evidence: {words}" in rec
    figures = [re.findall(r"about ([\d,]+) more takes", text) for text in (cli, rec)]
    assert figures == [[f"{more:,}"], [f"{more:,}"]]
    for c in val["comparisons"]:
        lo, hi = c["ci95"]
        assert f"{c['difference']:+.4g} (95% interval {lo:+.4g} .. {hi:+.4g})" in cli
        assert f"{c['difference']:+.4g}, 95% interval {lo:+.4g} .. {hi:+.4g}" in rec


def test_the_report_says_what_the_evidence_resolved_and_separates_drift(demo: dict) -> None:
    """Each comparison with its interval and verdict, the takes that would settle the rest, and per
    config the a-priori error, the cost drift and the drift-corrected error, in words and numbers."""
    rec = section(demo["md"], "Recommendation")
    more = demo["validation"]["recommendation"]["takes_to_resolve"]
    assert "The evidence: tuned-1: the lowest peak queue memory" in rec
    assert "tuned-1 - handpicked on throughput_tokens_per_s: +41, 95% interval +12 .. +70: resolved" in rec
    assert "tuned-1 - baseline on mix_efficiency: -0.01, 95% interval -0.05 .. +0.03: not resolved" in rec
    assert "after 4 of at most 5 rounds of 20 takes" in rec and f"about {more:,} more takes" in rec
    sim = section(demo["md"], "Simulated vs measured")
    worst = max(demo["validation"]["configs"], key=lambda c: abs(c["drift"]))
    assert f"the largest drift is {worst['name']}'s" in sim
    assert fmt_rel(worst["drift_detail"]["target"]) + " (target)" in sim
    rows = {r["config"]: r for r in parse_md_table(sim[sim.index("Machine drift and model error"):])}
    for c in demo["validation"]["configs"]:
        assert rows[c["name"]]["drift's effect"] == fmt_rel(c["drift"])
        assert rows[c["name"]]["drift-corrected error"] == fmt_rel(c["throughput_error_drift_corrected"])
        assert rows[c["name"]]["a-priori error"] == fmt_rel(c["rel_error"]["throughput_tokens_per_s"])


@pytest.mark.parametrize("one_round", [True, False])
def test_the_decision_tables_caption_says_when_its_columns_are_the_first_block(one_round: bool) -> None:
    """With one round the hardware measured only the first block and Δ simulated is the steady state shifted
    by the simulator's first-block error (bias transfer): the caption says which block each column is."""
    from reports.answer import FIRST_BLOCK_NOTE, decision_table
    from tuning.validation.decision import DecisionPolicy, decide, pair_evidence

    objectives = ("throughput_tokens_per_s", "mix_efficiency")
    steady = {"a": {"throughput_tokens_per_s": [100.0, 101.0, 99.0], "mix_efficiency": [0.95, 0.96, 0.94]},
              "b": {"throughput_tokens_per_s": [100.0, 100.5, 99.5], "mix_efficiency": [0.80, 0.81, 0.79]}}
    first = {n: {o: [v - 0.1 for v in vs] for o, vs in s.items()} for n, s in steady.items()}
    evidence = [pair_evidence("a", "b", o, sim_candidate=steady["a"][o], sim_reference=steady["b"][o],
                              hw_candidate=[first["a"][o][0]], hw_reference=[first["b"][o][0]],
                              **({"sim_first_candidate": first["a"][o], "sim_first_reference": first["b"][o]}
                                 if one_round else {}), model_block_sd=0.02)
                for o in objectives]
    d = decide(evidence, {"a": 2.0, "b": 1.0}, DecisionPolicy(margins={o: 0.05 for o in objectives},
                                                              objectives=objectives))
    data = {"configs": [{"name": n, "queue": {"min_ready": 1, "max_depth": 2}} for n in ("a", "b")]}
    assert (FIRST_BLOCK_NOTE in decision_table(data, d).caption) is one_round
