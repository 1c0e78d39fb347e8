"""Hostile inputs at the CLI edge (issue #20 item 6): each is one line on stderr, exit status 2, no
traceback, and the working tree is exactly as it was (no empty output directory, no 0-byte storage).

Each case builds its hostile world in a fresh directory, snapshots the tree, runs ``dflash`` in
that directory and compares. The checks all run before any simulation, training or tokenising, so
the whole file takes seconds.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Callable
from pathlib import Path

import pytest

from dflash.cli import main

SWEEP_TOML = """
seed = 0
[workload]
lengths = "lognormal"
n_sequences = 500
[timing]
target_noise = "deterministic"
drafter_noise = "deterministic"
[sweep]
seeds_per_trial = 1
sim_seconds = 120
{extra}
"""


def tree(root: Path) -> list[tuple[str, bool, int]]:
    """Every path under ``root`` with its kind and size: equal before and after means nothing changed."""
    return sorted((str(p.relative_to(root)), p.is_dir(), 0 if p.is_dir() else p.stat().st_size)
                  for p in root.rglob("*"))


def a_file(d: Path) -> None:
    (d / "afile").write_text("not a directory\n")


def sweep_cfg(d: Path, extra: str = "") -> None:
    (d / "sweep.toml").write_text(SWEEP_TOML.format(extra=extra))


def damaged_run(d: Path) -> None:
    """A run directory whose config.json was cut short (a drafter in it so eval gets that far)."""
    (d / "run" / "drafter").mkdir(parents=True)
    (d / "run" / "drafter" / "drafter_config.json").write_text('{"spec": {}}')
    (d / "run" / "drafter" / "drafter.safetensors").write_bytes(b"")
    (d / "run" / "checkpoint").mkdir()
    (d / "run" / "checkpoint" / "meta.json").write_text('{"step": 1}')
    (d / "run" / "config.json").write_text('{"workload": {"max_len": 5')


def run_with_config(content: str) -> Callable[[Path], None]:
    def make(d: Path) -> None:
        damaged_run(d)
        (d / "run" / "config.json").write_text(content)

    return make


def drafter_with(name: str, content: str | None) -> Callable[[Path], None]:
    """A run whose drafter directory has ``name`` replaced by ``content`` (None: the file is missing)."""
    def make(d: Path) -> None:
        damaged_run(d)
        (d / "run" / "config.json").write_text("{}")
        f = d / "run" / "drafter" / name
        f.unlink()
        if content is not None:
            f.write_text(content)

    return make


def empty_data(d: Path) -> None:
    (d / "empty.jsonl").write_text("")
    (d / "data.toml").write_text(f'[workload]\ndataset = "{d / "empty.jsonl"}"\n')


def only_damaged_data(d: Path) -> None:
    (d / "bad.jsonl").write_text('{"id": 1, "conversations": [\nnot json at all\n{"from": oops}\n')
    (d / "data.toml").write_text(f'[workload]\ndataset = "{d / "bad.jsonl"}"\n')


def model_dir_without_model(d: Path) -> None:
    (d / "model").mkdir()
    (d / "model" / "README.md").write_text("weights go here\n")
    (d / "model.toml").write_text(f'[target]\nmodel = "{d / "model"}"\n')


def model_dir_without_weights(d: Path) -> None:
    (d / "model").mkdir()
    (d / "model" / "config.json").write_text('{"model_type": "llama"}')


def nothing(d: Path) -> None:
    """No set-up: the hostile part is in the command line alone."""


def not_sqlite(d: Path) -> None:
    (d / "study.db").write_text("this is a text file\n")
    sweep_cfg(d)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def both(*makers: Callable[[Path], None]) -> Callable[[Path], None]:
    def make(d: Path) -> None:
        for m in makers:
            m(d)

    return make


# (id, set-up, argv, words the one error line must contain)
CASES = [
    ("simulate --json under a file", a_file, ["simulate", "--json", "afile/m.json"], ["--json", "afile"]),
    ("simulate --records under a file", a_file, ["simulate", "--records", "afile/rec"], ["--records"]),
    ("simulate --plot under a file", a_file, ["simulate", "--plot", "afile/deep/p.png"], ["--plot"]),
    ("sweep --out under a file", both(a_file, sweep_cfg), ["sweep", "--config", "sweep.toml", "--out", "afile/o"],
     ["--out"]),
    ("sweep --storage journal under a file", both(a_file, sweep_cfg),
     ["sweep", "--config", "sweep.toml", "--out", "o", "--storage", "afile/s.journal"], ["--storage"]),
    ("sweep --storage sqlite under a file", both(a_file, sweep_cfg),
     ["sweep", "--config", "sweep.toml", "--out", "o", "--storage", "sqlite:///afile/s.db"], ["--storage"]),
    ("sweep --storage a directory", sweep_cfg,
     ["sweep", "--config", "sweep.toml", "--out", "o", "--storage", "."], ["--storage"]),
    ("sweep --storage not an SQLite file", not_sqlite,
     ["sweep", "--config", "sweep.toml", "--out", "o", "--storage", "sqlite:///study.db"], ["--storage", "SQLite"]),
    ("sweep --storage unknown scheme", sweep_cfg,
     ["sweep", "--config", "sweep.toml", "--out", "o", "--storage", "mysql://u@h/db"], ["--storage"]),
    ("sweep --storage unreachable PostgreSQL", sweep_cfg,
     ["sweep", "--config", "sweep.toml", "--out", "o", "--storage", f"postgresql://u@127.0.0.1:{closed_port()}/db"],
     ["--storage", "cannot connect"]),
    ("sweep bad space, new storage and out", lambda d: sweep_cfg(d, "space = { min_ready = { low = 5, high = 2 } }"),
     ["sweep", "--config", "sweep.toml", "--out", "o", "--storage", "new/s.journal"], ["sweep.space.min_ready.high"]),
    ("sweep bad space, default out", lambda d: sweep_cfg(d, "space = { colour = [1] }"),
     ["sweep", "--config", "sweep.toml"], ["sweep.space.colour"]),
    ("calibrate --out under a file", both(a_file, damaged_run), ["calibrate", "--run", "run", "--out", "afile/c.json"],
     ["--out"]),
    ("demo --out under a file", a_file, ["demo", "--out", "afile/demo"], ["--out"]),
    ("report --out under a file", both(a_file, damaged_run), ["report", "run", "--out", "afile/r"], ["--out"]),
    ("eval on a run with a cut config.json", damaged_run, ["eval", "--drafter", "run"], ["RUN_DIR", "config.json"]),
    ("eval on a run whose config.json is a list", run_with_config("[1, 2]"), ["eval", "--drafter", "run"],
     ["RUN_DIR", "JSON object"]),
    ("eval on a run whose config.json has a bad value", run_with_config('{"queue": {"min_ready": 0}}'),
     ["eval", "--drafter", "run"], ["RUN_DIR", "queue.min_ready"]),
    ("eval on a drafter whose config is not JSON", drafter_with("drafter_config.json", "{garbage"),
     ["eval", "--drafter", "run"], ["--drafter", "cannot be read as JSON"]),
    ("eval on a drafter whose config has no spec", drafter_with("drafter_config.json", '{"dtype": "float32"}'),
     ["eval", "--drafter", "run/drafter"], ["--drafter", "spec"]),
    ("eval on a drafter without weights", drafter_with("drafter.safetensors", None), ["eval", "--drafter", "run"],
     ["--drafter", "drafter.safetensors"]),
    ("train --resume a run with a cut config.json", damaged_run, ["train", "--resume", "run"], ["RUN_DIR"]),
    ("lengths of an empty data file", empty_data, ["lengths", "--config", "data.toml"],
     ["workload.dataset", "no usable"]),
    ("lengths of a data file of damaged records", only_damaged_data, ["lengths", "--config", "data.toml"],
     ["workload.dataset", "damaged"]),
    ("lengths with a model directory without a model", model_dir_without_model, ["lengths", "--config", "model.toml"],
     ["target.model", "no model"]),
    # An output path that permission bits allow (root, pseudo file systems) but that cannot be written:
    # tried before the simulation runs (dflash.cli.command.try_outputs), not found at the first write.
    ("simulate --json in /proc", nothing, ["simulate", "--sim-seconds", "10", "--json", "/proc/x.json"],
     ["--json", "cannot be written"]),
    # Everything about the target a launcher can check comes before train creates its run directory.
    ("train with a .gguf path that names nothing", nothing,
     ["train", "--target", "/nonexistent/model.gguf", "--max-steps", "2", "--out", "DIR"],
     ["target.model (--target)", "no such file"]),
    ("train with a model directory without weights", model_dir_without_weights,
     ["train", "--target", "model", "--max-steps", "2", "--out", "DIR"], ["target.model (--target)", "weights"]),
]


@pytest.mark.parametrize(("make", "argv", "words"), [pytest.param(m, a, w, id=i) for i, m, a, w in CASES])
def test_hostile_input_is_one_line_exit_2_and_leaves_the_tree_unchanged(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture,
        make: Callable[[Path], None], argv: list[str], words: list[str]) -> None:
    make(tmp_path)
    monkeypatch.chdir(tmp_path)
    before = tree(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for w in words:
        assert w in err, (w, err)
    assert tree(tmp_path) == before


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
@pytest.mark.parametrize("argv", [["simulate", "--json", "ro/m.json"], ["sweep", "--out", "ro/o"],
                                  ["sweep", "--storage", "ro/s.journal"]])
def test_an_unwritable_parent_is_refused_before_any_work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture, argv: list[str]) -> None:
    (tmp_path / "ro").mkdir(mode=0o555)
    monkeypatch.chdir(tmp_path)
    before = tree(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not writable" in err
    assert tree(tmp_path) == before


@pytest.mark.parametrize("storage", ["s.journal", "sqlite:///s.db"])
def test_a_study_with_other_settings_leaves_no_new_output_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture, storage: str) -> None:
    """The refusal comes after the storage is opened: the output directory this start made goes again,
    and the storage is left as it was (no failed create appended to a journal)."""
    sweep_cfg(tmp_path, "space = { min_ready = { low = 1, high = 20 } }")
    monkeypatch.chdir(tmp_path)
    assert main(["sweep", "--config", "sweep.toml", "--trials", "1", "--storage", storage, "--out", "a"]) == 0
    (tmp_path / "sweep.toml").write_text(SWEEP_TOML.format(extra="seeds_per_trial = 2").replace(
        "seeds_per_trial = 1\n", ""))
    capsys.readouterr()
    before = tree(tmp_path)
    assert main(["sweep", "--config", "sweep.toml", "--trials", "2", "--storage", storage, "--out", "b"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--study" in err and "seeds_per_trial" in err
    assert tree(tmp_path) == before


def test_a_hub_id_that_cannot_be_fetched_leaves_no_run_directory(tmp_path: Path) -> None:
    """Offline, an unknown hub id fails in the launching process, before the run directory exists
    (the ranks used to find out, after ``DIR/.ranks`` and ``DIR/config.json`` were written)."""
    import subprocess
    import sys

    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-m", "dflash", "train", "--target", "nosuch-org/nosuch-model",
                          "--max-steps", "2", "--out", "DIR"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and "target.model (--target): cannot load a model" in out.stderr, out.stderr
    assert list(tmp_path.iterdir()) == []


def test_damaged_records_are_counted_and_the_count_printed(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Loading counts them (and says nothing: a rank re-reading the file stays quiet); the command says the
    count in one line (say_damaged)."""
    from dflash.data.conversations import load_conversations, say_damaged

    good = {"id": "a", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}
    p = tmp_path / "d.jsonl"
    p.write_text("\n".join([json.dumps(good), "garbage {", json.dumps({**good, "id": "b"}), '{"id": 3}']) + "\n")
    convs, stats = load_conversations(p, "conversation")
    assert [c.id for c in convs] == ["a", "b"] and stats.broken == 2
    assert capsys.readouterr().err == ""
    say_damaged(p, stats)
    err = capsys.readouterr().err
    assert "2 damaged record(s) skipped" in err and err.count("\n") == 1


@pytest.mark.parametrize(("make", "key"), [(empty_data, "workload.dataset"), (only_damaged_data, "workload.dataset"),
                                           (model_dir_without_model, "target.model")])
def test_training_inputs_are_checked_once_before_any_rank_starts(tmp_path: Path, make: Callable[[Path], None],
                                                                 key: str) -> None:
    """``check_data_inputs`` is what a launcher runs before starting ranks that would each fail."""
    from dflash.core.config import load_config
    from dflash.core.errors import ConfigError
    from dflash.data.preflight import check_data_inputs

    make(tmp_path)
    cfg = load_config(next(tmp_path.glob("*.toml")))
    with pytest.raises(ConfigError) as err:
        check_data_inputs(cfg.workload, cfg.target.model)
    assert err.value.key == key
