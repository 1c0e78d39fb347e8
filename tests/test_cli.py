"""The ``dflash`` command: one-line errors with exit status 2, not-built verbs, lazy imports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import dflash
from dflash.cli import VERBS, main
from dflash.cli import command as cli

QUEUE_VERBS = ("simulate", "sweep", "train", "tune-live")
NO_CONFIG = ("gpu-check",)  # writes its own run configs: any --config is refused (tests/test_gpu_check.py)
# Verbs still waiting for their issue; each entry disappears when its verb lands.

# A valid invocation of each verb (relative paths inside the `workdir` fixture).
BASE = {
    "simulate": [],
    "sweep": [],
    "train": [],
    "tune-live": ["run", "--gate", "threshold"],
    "eval": ["--drafter", "drafter"],
    "calibrate": ["--run", "run"],
    "validate": ["--selection", "sel.json"],
    "report": ["run"],
    "regenerate": ["--out", "data.jsonl"],
    "lengths": [],
    "demo": [],
    "export": ["--drafter", "exrun", "--out", "exported"],
    "gpu-check": ["--cpu"],
}

CONFIGS = {
    "malformed.toml": "[queue\nmin_ready = \n",
    "unknown_key.toml": "[queue]\nmin_redy = 3\n",
    "unknown_section.toml": "[queu]\nmin_ready = 3\n",
    "unsorted.toml": "[workload]\nmax_len = 2048\nbucket_bounds = [256, 128, 2048]\n",
    "bad_value.toml": "[queue]\nmin_ready = 0\n",
    "bad_seed.toml": "seed = -2\n",
    "bad_type.toml": "[cluster]\nn_target = \"four\"\n",
    "bad_link.toml": "[cluster]\nnetwork_link = \"nic800\"\n",
    "bad_rate.toml": "[timing]\ntransfer_inter_s_per_byte = -1e-9\n",

    "bad_margin.toml": "[decision]\nmargin_mix_efficiency = 0\n",
    "bad_level.toml": "[decision]\nlevel = 1.0\n",
    "bad_refute.toml": "[decision]\nz_refute = -1\n",
}

# (extra args, names the error line must contain)
COMMON_CASES = [
    (["--seed", "-1"], ["seed", "--seed"]),
    (["--seed", "abc"], ["seed", "--seed"]),
    (["--seed", "1.5"], ["seed", "--seed"]),
    (["--seed"], ["--seed"]),
    (["--config", "missing.toml"], ["--config", "missing.toml"]),
    (["--config", "malformed.toml"], ["--config", "malformed"]),
    (["--config", "unknown_key.toml"], ["queue.min_redy"]),
    (["--config", "unknown_section.toml"], ["[queu]"]),
    (["--config", "unsorted.toml"], ["workload.bucket_bounds"]),
    (["--config", "bad_value.toml"], ["queue.min_ready"]),
    (["--config", "bad_seed.toml"], ["seed"]),
    (["--config", "bad_type.toml"], ["cluster.n_target"]),
    (["--bogus-flag", "3"], ["--bogus-flag"]),
]
QUEUE_CASES = [
    (["--hs-min-ready", "0"], ["queue.min_ready", "--hs-min-ready"]),
    (["--hs-min-ready", "-3"], ["queue.min_ready", "--hs-min-ready"]),
    (["--hs-min-ready", "2.5"], ["queue.min_ready", "--hs-min-ready"]),
    (["--hs-min-ready", "abc"], ["queue.min_ready", "--hs-min-ready"]),
    (["--hs-min-ready", "100", "--hs-max-depth", "50"], ["queue.min_ready", "--hs-min-ready"]),
    (["--hs-max-depth", "0"], ["queue.max_depth", "--hs-max-depth"]),
    (["--hs-max-bytes", "0"], ["queue.max_bytes", "--hs-max-bytes"]),
    (["--hs-max-bytes", "1e9"], ["queue.max_bytes", "--hs-max-bytes"]),
    (["--items-per-take", "0"], ["queue.items_per_take", "--items-per-take"]),
    (["--policy", "nope"], ["queue.policy", "--policy", "random_item"]),
    (["--gate", "nope"], ["queue.gate", "--gate", "hysteresis"]),
    (["--config", "bad_value.toml"], ["queue.min_ready", "--hs-min-ready"]),
]
VERB_CASES = {
    "simulate": [
        (["--n-target", "0"], ["cluster.n_target", "--n-target"]),
        (["--n-drafter", "-1"], ["cluster.n_drafter", "--n-drafter"]),
        (["--sim-seconds", "0"], ["--sim-seconds"]),
        (["--sim-seconds", "abc"], ["--sim-seconds"]),
        (["--calibration", "missing.json"], ["--calibration"]),
        (["--json", "run"], ["--json"]),
        (["--config", "bad_link.toml"], ["cluster.network_link", "nic200, nic400"]),
        (["--config", "bad_rate.toml"], ["timing.transfer_inter_s_per_byte", ">= 0"]),
    ],
    "sweep": [
        (["--out", "sel.json/o"], ["--out", "sel.json"]),
        (["--storage", "sel.json/s.journal"], ["--storage"]),
        (["--storage", "sqlite:///sel.json"], ["--storage", "SQLite"]),
        (["--storage", "run"], ["--storage"]),
        (["--trials", "0"], ["--trials"]),
        (["--trials", "abc"], ["--trials"]),
        (["--workers", "0"], ["--workers"]),
        (["--storage", ""], ["--storage"]),
        (["--out", "sel.json"], ["--out"]),
        (["--calibration", "missing.json"], ["--calibration"]),
    ],
    "train": [
        (["--wandb", "bogus"], ["--wandb", "offline"]),
        (["--max-steps", "0"], ["train.max_steps", "--max-steps"]),
        (["--max-minutes", "0"], ["train.max_minutes", "--max-minutes"]),
        (["--max-minutes", "soon"], ["train.max_minutes", "--max-minutes"]),
        (["--quality-every", "0"], ["train.quality_every", "--quality-every"]),
        (["--target-devices", "gpu0"], ["--target-devices", "retired"]),
        (["--drafter-devices", "cuda:0,"], ["--drafter-devices", "retired"]),
        (["--target", ""], ["target.model", "--target"]),
        (["--resume", "missing_dir"], ["--resume"]),
    ],
    "eval": [
        (["--prompts", "0"], ["--prompts"]),
        (["--bench", "gsm9k"], ["--bench", "humaneval"]),
        (["--max-new-tokens", "0"], ["--max-new-tokens"]),
        (["--drafter", "missing_dir"], ["--drafter"]),
    ],
    "calibrate": [
        (["--run", "missing_dir"], ["--run"]),
        (["--out", "run"], ["--out"]),
    ],
    "validate": [
        (["--takes", "0"], ["--takes"]),
        (["--config", "bad_margin.toml"], ["decision.margin_mix_efficiency", "> 0"]),
        (["--config", "bad_level.toml"], ["decision.level", "< 1"]),
        (["--config", "bad_refute.toml"], ["decision.z_refute", "> 0"]),
        (["--top-k", "0"], ["sweep.top_k", "--top-k"]),
        (["--study", "s"], ["--selection", "--study"]),
        (["--calibration", "missing.json"], ["--calibration"]),
    ],
    "report": [
        (["missing_dir"], ["INPUT"]),
        (["--out", "sel.json"], ["--out"]),
    ],
    "gpu-check": [
        (["--minutes", "0"], ["--minutes"]),
        (["--arch", "70b"], ["--arch"]),
        (["--time-limit", "-5"], ["--time-limit"]),
        (["--json", "sel.json/x"], ["--json"]),
    ],
    "export": [
        (["--out", "sel.json"], ["--out"]),
        (["--out", "sel.json/x"], ["--out", "not a directory"]),
        (["--format", "onnx"], ["--format"]),
    ],
}
# Invocations that replace the base: a missing required input.
MISSING_CASES = [
    ("tune-live", ["--gate", "threshold"], ["RUN_DIR"]),
    ("tune-live", ["run"], ["--hs-min-ready", "--gate"]),
    ("tune-live", ["missing_dir", "--gate", "threshold"], ["RUN_DIR"]),
    ("eval", [], ["--drafter"]),
    ("calibrate", [], ["--run"]),
    ("validate", [], ["--selection", "--study"]),
    ("validate", ["--selection", "sel.json", "--storage", "bogus://x"], ["--storage"]),
    ("validate", ["--selection", "missing.json"], ["--selection"]),
    ("report", [], ["INPUT"]),
]


def _cases() -> list:
    out = []
    for verb in VERBS:
        common = COMMON_CASES if verb not in NO_CONFIG else [c for c in COMMON_CASES if "--config" not in c[0]]
        cases = common + (QUEUE_CASES if verb in QUEUE_VERBS else []) + VERB_CASES.get(verb, [])
        out += [pytest.param(verb, BASE[verb] + extra, names, id=f"{verb}:{' '.join(extra)}")
                for extra, names in cases]
    out += [pytest.param(verb, argv, names, id=f"{verb}(missing):{' '.join(argv)}")
            for verb, argv, names in MISSING_CASES]
    return out


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.json").write_text("{}")  # tune-live judges flags against the run's config
    (tmp_path / "drafter").mkdir()
    (tmp_path / "exrun" / "drafter").mkdir(parents=True)
    (tmp_path / "exrun" / "drafter" / "drafter_config.json").write_text('{"spec": {}}')  # passes the lookup's checks
    (tmp_path / "exrun" / "drafter" / "drafter.safetensors").write_bytes(b"")
    (tmp_path / "exrun" / "config.json").write_text("{}")
    (tmp_path / "sel.json").write_text("{}")
    for name, text in CONFIGS.items():
        (tmp_path / name).write_text(text)
    return tmp_path


def _tree(root: Path) -> set[Path]:
    return set(root.rglob("*"))


def _one_error_line(err: str, verb: str) -> str:
    assert "Traceback" not in err
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert err.startswith(f"dflash {verb}: error: "), err
    return err


@pytest.mark.parametrize(("verb", "argv", "names"), _cases())
def test_bad_input_is_one_line_exit_2(verb, argv, names, workdir, capsys):
    before = _tree(workdir)
    assert main([verb, *argv]) == 2
    out, err = capsys.readouterr()
    line = _one_error_line(err, verb)
    for name in names:
        assert name in line, (name, line)
    assert out == ""
    assert _tree(workdir) == before  # nothing written


def test_error_line_format_names_key_flag_range_and_value(capsys):
    assert main(["simulate", "--hs-min-ready", "0"]) == 2
    assert capsys.readouterr().err == (
        "dflash simulate: error: queue.min_ready (--hs-min-ready): must be an integer in [1, 90] (got 0)\n")
    assert main(["sweep", "--trials", "0"]) == 2
    assert capsys.readouterr().err == "dflash sweep: error: --trials: must be an integer >= 1 (got 0)\n"
    assert main(["train", "--wandb", "bogus"]) == 2
    assert capsys.readouterr().err == (
        "dflash train: error: --wandb: must be one of offline, online, disabled (got 'bogus')\n")


@pytest.mark.parametrize("argv", [[], ["bogus"], ["--bogus"]])
def test_root_errors_are_one_line(argv, capsys):
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert err.startswith("dflash: error: ") and err.count("\n") == 1, err
    assert out == ""


def test_handler_receives_the_validated_config(workdir, monkeypatch, capsys):
    (workdir / "c.toml").write_text(
        "seed = 4\n[queue]\nmin_ready = 5\nmax_depth = 20\n[cluster]\nn_target = 3\n")
    seen = {}

    def fake(args, cfg):
        seen["cfg"] = cfg
        return 0

    monkeypatch.setitem(cli.HANDLERS, "train", fake)
    assert main(["train", "--config", "c.toml", "--hs-max-depth", "40", "--policy", "fifo", "--max-minutes", "1.5",
                 "--target", "some/dir"]) == 0
    cfg = seen["cfg"]
    assert (cfg.seed, cfg.queue.min_ready, cfg.queue.max_depth, cfg.queue.policy) == (4, 5, 40, "fifo")
    assert cfg.cluster.n_target == 3
    assert cfg.train.max_minutes == 1.5 and cfg.target.model == "some/dir"

    monkeypatch.setitem(cli.HANDLERS, "sweep", fake)
    assert main(["sweep", "--grid", "--seed", "7", "--gate", "hysteresis"]) == 0
    assert (seen["cfg"].sweep.sampler, seen["cfg"].seed, seen["cfg"].queue.gate) == ("grid", 7, "hysteresis")


@pytest.fixture
def tiny_dataset(tmp_path: Path) -> Path:
    """Eight real ShareGPT-format conversations of growing length (tokenised for real)."""
    path = tmp_path / "tiny.jsonl"
    with open(path, "w") as f:
        for i in range(8):
            turns = [{"from": "human", "value": "Tell me about queues. " * (1 + 30 * i)},
                     {"from": "gpt", "value": "Queues hold items in order. " * (1 + 30 * i)}]
            f.write(json.dumps({"id": f"c{i}", "conversations": turns}) + "\n")
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(f'[workload]\ndataset = "{path}"\nmax_len = 2048\n'
                   "bucket_bounds = [128, 256, 512, 1024, 2048]\nseqs_per_item = 2\n"
                   "[sweep]\ntrials = 6\nsim_seconds = 120.0\n")
    return cfg


def test_lengths_tokenises_a_real_dataset_and_prints_bucket_shares(tiny_dataset, capsys):
    from dflash.core.config import load_config
    from dflash.core.sampler import bucket_of
    from dflash.data.lengths import cached_lengths

    assert main(["lengths", "--config", str(tiny_dataset)]) == 0
    out, _ = capsys.readouterr()
    assert "8 sequences" in out
    table = cached_lengths(load_config(tiny_dataset).workload)
    expected = [0] * 5
    for n in table.lengths:
        expected[bucket_of(n, (128, 256, 512, 1024, 2048))] += 1
    rows = [line.split() for line in out.splitlines() if line.startswith("  (")]
    assert [int(r[-1]) for r in rows] == expected
    from dflash.core.sampler import has_anchor

    cfg = load_config(tiny_dataset)
    kept = [0] * 5  # sequences without an anchor position are dropped before items are formed
    for n, p in zip(table.lengths, table.prompt_lengths, strict=True):
        if has_anchor(n, p, cfg.workload.max_len):
            kept[bucket_of(n, (128, 256, 512, 1024, 2048))] += 1
    assert (f"{sum(expected) - sum(kept)} sequences dropped" in out) == (sum(kept) < sum(expected))
    n_items = sum((c + 1) // 2 for c in kept)  # 2 sequences per item, formed inside buckets
    assert f"item mix p (2 seqs per item, {n_items} items per epoch)" in out


@pytest.mark.slow
def test_demo_runs_the_whole_story_on_the_cpu_profile(tmp_path, capsys):
    """The main job with small budgets: a real calibration run, sweep, three real validations, report.
    The sweep searches min_ready <= 16 only: its pick's fill (up to 120 target forwards before the
    first take by default) was most of this test's time, and the story is the same."""
    out = tmp_path / "demo"
    profile = (Path(__file__).resolve().parents[1] / "examples" / "cpu-smollm2.toml").read_text()
    small = tmp_path / "cpu-small-fill.toml"
    small.write_text(profile + '\n[sweep.space]\nmin_ready = {low = 1, high = 16}\n'
                     'max_depth = {low = 10, high = 60, step = 10}\npolicy = ["random_item", "proportional"]\n')
    assert main(["demo", "--config", str(small), "--out", str(out), "--takes", "6", "--cal-steps", "30"]) == 0
    said, _ = capsys.readouterr()
    for k in range(1, 8):
        assert f"== {k}/7 " in said
    assert "baseline 10/30" in said and "handpicked 30/90" in said
    payload = json.loads((out / "validation" / "validation.json").read_text())
    assert sorted(r["name"] for r in payload["configs"]) == ["baseline", "handpicked", "tuned-1"]
    assert (out / "report" / "report.html").is_file() and (out / "report" / "report.md").is_file()
    assert f"dflash train --config {out / 'validation' / 'best.toml'}" in said
    # issue #32: the last two lines answer the question, in the words of the report's first section
    from reports.answer import answer_of

    first, second = answer_of(payload)
    assert said.rstrip().splitlines()[-2:] == [first, second]
    md = (out / "report" / "report.md").read_text()
    assert md[md.index("## Recommendation"):].split("\n\n")[1:3] == [f"**{first}**", second]
    assert "stages (wall, CPU of this process and its finished children): lengths " in said


@pytest.mark.slow
def test_sigterm_during_the_demos_calibration_run_is_one_line_143_and_stops_its_ranks(tmp_path):
    """``dflash demo`` stopped the way a cluster stops it (SIGTERM, issue #38) during its calibration
    run, whose ranks run under torch's launcher in the demo's own process: exit 143, the one line, no
    traceback, no rank left running, and the run stopped with its ranks' checkpoint."""
    import signal
    import time

    from dflash.core.records import read_records
    from tests.conftest import left_in_session

    out = tmp_path / "demo"
    proc = subprocess.Popen([sys.executable, "-m", "dflash", "demo", "--out", str(out), "--takes", "6",
                             "--cal-steps", "400"], cwd=Path(__file__).resolve().parents[1], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    run = out / "calibration-run"
    try:
        deadline = time.monotonic() + 400
        while proc.poll() is None and time.monotonic() < deadline and not list(read_records(run, "step")):
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        said, err = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 143 and err.splitlines()[-1] == "dflash demo: terminated", err
    assert "Traceback" not in err and "== 3/7 " not in said
    assert not left_in_session(proc.pid, 30), "a calibration rank outlived the terminated demo"
    assert [s["stopped_by"] for s in read_records(run, "summary")] == ["signal SIGTERM"]


def test_version_and_help(capsys):
    assert main(["--version"]) == 0
    assert dflash.__version__ in capsys.readouterr().out
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(verb in out for verb in VERBS)


@pytest.mark.parametrize("verb", list(VERBS))
def test_verb_help_lists_common_options(verb, capsys):
    assert main([verb, "--help"]) == 0
    out = capsys.readouterr().out
    assert "--config" in out and "--seed" in out
    assert ("--hs-min-ready" in out) == (verb in QUEUE_VERBS)


# ------------------------------------------------------------------ a few real processes
def _run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120, cwd=cwd,
                          env=env)


def test_help_and_validation_do_not_import_torch():
    code = textwrap.dedent("""
        import sys
        from dflash.cli import main
        assert main(["--help"]) == 0
        assert main(["simulate", "--help"]) == 0
        assert main(["simulate", "--hs-min-ready", "500", "--n-target", "2"]) == 2
        assert main(["sweep", "--trials", "0"]) == 2
        heavy = [m for m in ("torch", "transformers", "simpy", "optuna", "pandas") if m in sys.modules]
        print("HEAVY", heavy)
    """)
    r = _run("-c", code)
    assert r.returncode == 0, r.stderr
    assert "HEAVY []" in r.stdout


def test_python_m_dflash_bad_input_has_no_traceback(tmp_path):
    r = _run("-m", "dflash", "simulate", "--hs-min-ready", "abc", "--json", "out.json", cwd=tmp_path)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert r.stderr.count("\n") == 1
    assert r.stderr.startswith("dflash simulate: error: queue.min_ready (--hs-min-ready): ")
    assert list(tmp_path.iterdir()) == []


def test_python_m_dflash_version():
    r = _run("-m", "dflash", "--version")
    assert r.returncode == 0 and r.stdout.strip() == f"dflash {dflash.__version__}"
