"""Checkpoints fail closed: a manifest of sizes and sha256 written last, verified before anything is loaded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dflash.pipeline.checkpoint import CheckpointError, checkpoint_dirs, latest_verified, load_state, write_checkpoint
from dflash.pipeline.ledger import Ledger, read_ledger, truncate_ledger


def ledger_steps(run: Path) -> set[int]:
    return {s for s, _ in read_ledger(run)}


@pytest.fixture
def run(tmp_path: Path) -> Path:
    ledger = Ledger(tmp_path)
    for step in range(8):
        ledger.commit(step, [f"i{step}"])
    ledger.close()
    for step in (1, 3, 7):
        write_checkpoint(tmp_path, {"w": torch.full((4,), float(step))}, {"step": step, "ledger_step": step})
    return tmp_path


def test_only_the_newest_two_are_kept_and_the_newest_loads(run: Path) -> None:
    assert [d.name for d in checkpoint_dirs(run)] == ["step-00000003", "step-00000007"]
    d, meta = latest_verified(run, ledger_steps(run))
    assert meta["step"] == 7 and torch.equal(load_state(d)["w"], torch.full((4,), 7.0))
    manifest = json.loads((d / "manifest.json").read_text())
    assert {f["path"] for f in manifest["files"]} == {"state.pt", "meta.json"} and manifest["ledger_step"] == 7


@pytest.mark.parametrize("damage", ["garble", "truncate", "empty", "delete", "edit_meta", "meta_not_json",
                                    "manifest_missing", "manifest_garbled"])
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one_saying_so(run: Path, damage: str) -> None:
    newest = checkpoint_dirs(run)[-1]
    state, meta, manifest = newest / "state.pt", newest / "meta.json", newest / "manifest.json"
    if damage == "garble":
        data = bytearray(state.read_bytes())
        data[len(data) // 2: len(data) // 2 + 64] = bytes(64)
        state.write_bytes(bytes(data))
    elif damage == "truncate":
        state.write_bytes(state.read_bytes()[:100])
    elif damage == "empty":
        state.write_bytes(b"")
    elif damage == "delete":
        state.unlink()
    elif damage == "edit_meta":
        meta.write_text(meta.read_text().replace('"step": 7', '"step": 15'))
    elif damage == "meta_not_json":
        meta.write_text("{not json")
    elif damage == "manifest_missing":
        manifest.unlink()
    else:
        manifest.write_text("[1, 2")
    said: list[str] = []
    d, got = latest_verified(run, ledger_steps(run), warn=said.append)
    assert got["step"] == 3 and d.name == "step-00000003"
    assert len(said) == 1 and "falling back to the previous verified checkpoint step-00000003" in said[0]
    assert str(newest) in said[0]  # names the damaged file's checkpoint


def test_when_no_checkpoint_verifies_resume_is_refused_in_one_line_naming_the_file(run: Path) -> None:
    for d in checkpoint_dirs(run):
        (d / "state.pt").write_bytes(b"\0" * 2000)
    with pytest.raises(CheckpointError) as err:
        latest_verified(run, ledger_steps(run))
    line = str(err.value)
    assert "\n" not in line and "step-00000007/state.pt" in line and ("sha256" in line or "bytes" in line)


def test_a_checkpoint_without_its_ledger_step_is_not_valid(run: Path) -> None:
    truncate_ledger(run, 5)  # the ledger lost steps 6-7 (e.g. a replaced file)
    said: list[str] = []
    _, meta = latest_verified(run, ledger_steps(run), warn=said.append)
    assert meta["step"] == 3 and "ledger step 7 is not in the run's ledger" in said[0]


def test_a_torn_ledger_line_is_not_a_commit(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path)
    ledger.commit(0, ["a", "b"])
    ledger.close()
    with open(tmp_path / "ledger.jsonl", "a") as f:
        f.write('{"step": 1, "item_ids": ["c"')
    assert read_ledger(tmp_path) == [(0, ["a", "b"])]
    with pytest.raises(RuntimeError, match="committed twice"):
        Ledger(tmp_path).commit(0, ["x"])


def test_the_learning_rate_schedule_resumes_stretches_or_opens_a_new_phase() -> None:
    from dflash.core.config import TrainConfig
    from dflash.pipeline.optim import LrSchedule

    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
    first = LrSchedule(opt, TrainConfig(lr=1e-3, max_steps=8, warmup_ratio=0.25, schedule="cosine"))
    lrs = [first.at(s, 0.0) for s in range(8)]
    assert lrs[0] == pytest.approx(1e-3 / 2) and max(lrs) == pytest.approx(1e-3) and lrs[-1] < 1e-4
    state = first.state_dict()

    same = LrSchedule(opt, TrainConfig(lr=1e-3, max_steps=8, warmup_ratio=0.25))
    assert same.load_state_dict(state, step=4, elapsed_s=3.0, train=TrainConfig(max_steps=8)) is None
    assert same.at(4, 3.0) == pytest.approx(lrs[4])  # a resume continues the schedule exactly

    stretched = LrSchedule(opt, TrainConfig(lr=1e-3, max_steps=8))
    assert stretched.load_state_dict(state, step=4, elapsed_s=3.0, train=TrainConfig(max_steps=16)) is None
    assert stretched.schedule.total_steps == 16 and stretched.schedule.start_step == 0

    extended = LrSchedule(opt, TrainConfig(lr=1e-3, max_steps=8))
    phase = extended.load_state_dict(state, step=8, elapsed_s=6.0, train=TrainConfig(max_steps=12))
    assert phase is not None and phase["start_step"] == 8 and phase["total_steps"] == 12
    new = [extended.at(s, 6.0) for s in range(8, 12)]
    assert new[0] < new[1] and new[-1] < new[1]  # a re-warm-up, then its own decay
