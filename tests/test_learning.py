"""The drafter learns: its first loss is near a uniform guess, the loss falls on a handful of items,
and a time-budgeted schedule holds, decays, and continues across a resume mid-decay: on the rank job
(`dflash train`, one process per rank), the one training loop."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dflash.core.config import load_config
from dflash.core.records import read_records
from dflash.data.conversations import load_conversations, resolve_dataset
from tests.test_resume_and_control import run_inputs, stopped_by_sigterm, write_cfg  # noqa: F401 - the fixture

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "DFLASH_WAIT_S": "60", "OMP_NUM_THREADS": "1"}


def step_lrs(run_dir: Path) -> list[float]:
    return [r["lr"] for r in read_records(run_dir, "step")]


def dflash_train(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "dflash", "train", *args, "--wandb", "disabled"], cwd=ROOT,
                            env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


@pytest.mark.slow
def test_a_time_budget_holds_the_rate_decays_at_the_end_and_a_resume_mid_decay_continues_it(
        tmp_path: Path, run_inputs) -> None:  # noqa: F811
    """A 20 s budget: SIGTERM once the rate decays, then `--resume` with the same limits: the rate goes on
    down from where it was, on the training time kept in the checkpoint, and ends at the budget."""
    cfg = write_cfg(tmp_path / "cfg.toml", run_inputs, max_minutes=1 / 3, warmup_ratio=0.04, log_every=1000)
    peak = load_config(cfg).train.lr
    run = tmp_path / "run"
    proc = dflash_train("--config", str(cfg), "--out", str(run))
    with stopped_by_sigterm(proc):
        deadline = time.time() + 240
        while not (step_lrs(run) if (run / "step.jsonl").exists() else []) or \
                step_lrs(run)[-1] >= 0.8 * peak or len(step_lrs(run)) < 20:
            assert proc.poll() is None and time.time() < deadline, "the run ended before its decay"
            time.sleep(0.05)
    assert next(read_records(run, "summary"))["stopped_by"] == "signal SIGTERM"
    before = step_lrs(run)
    middle = before[len(before) // 4: 3 * len(before) // 4]
    assert min(middle) >= 0.8 * peak  # the rate holds through the middle of the budget
    assert before[-1] < 0.8 * peak  # stopped inside the decay
    resumed = dflash_train("--resume", str(run))
    _, err = resumed.communicate(timeout=240)
    assert resumed.returncode == 0, err
    after = step_lrs(run)[len(before):]
    summary = list(read_records(run, "summary"))[-1]
    assert summary["stopped_by"] == "max_minutes" and after
    assert after[0] <= before[-1] + 1e-12 and all(b <= a + 1e-12 for a, b in itertools.pairwise(after))
    assert 0 < after[-1] < 0.3 * peak  # decays at the end, never 0 on a step that runs


@pytest.mark.slow
def test_loss_falls_when_overfitting_a_handful_of_items(tmp_path: Path, run_inputs) -> None:  # noqa: F811
    from dflash.pipeline.trainer import train

    rows = run_inputs["data"].read_text().splitlines()[:6]
    (tmp_path / "six.jsonl").write_text("\n".join(rows) + "\n")
    cfg = load_config(write_cfg(tmp_path / "cfg.toml", {**run_inputs, "data": tmp_path / "six.jsonl"},
                                max_steps=150, warmup_ratio=0.0, log_every=1000))
    res = train(cfg, tmp_path / "run", wait_s=60.0, pg_timeout_s=60.0)
    losses = [r["loss"] for r in read_records(res.out, "step")]
    first, last = sum(losses[:8]) / 8, sum(losses[-8:]) / 8
    assert last < 0.75 * first, (first, last)


def test_first_step_loss_of_a_fresh_drafter_on_smollm2_is_below_15() -> None:
    """The drafter starts near a uniform guess (ln 49152 = 10.8), not confidently wrong (it was 41-77)."""
    from dflash.model.drafter import DFlashDrafter, DrafterSpec, default_mask_token_id
    from dflash.model.target import HiddenStateCapture, capture_layer_ids, collate, encode_conversation, load_target

    cfg = load_config(ROOT / "examples" / "cpu-smollm2.toml")
    lt = load_target("smollm2", dtype=torch.float32)
    ids = capture_layer_ids(lt.num_layers, cfg.target.capture_layers)
    spec = DrafterSpec.from_target_config(lt.config, target_layer_ids=ids, mask_token_id=default_mask_token_id(
        lt.tokenizer), drafter=cfg.drafter)
    torch.manual_seed(0)
    drafter = DFlashDrafter.from_target(lt.model, spec, device="cpu", dtype=torch.float32)
    convs, _ = load_conversations(resolve_dataset("sharegpt"), "first_exchange", 8)
    input_ids, attention_mask, loss_mask = collate([encode_conversation(lt.tokenizer, c, 256) for c in convs],
                                                   lt.tokenizer.pad_token_id or 0)
    with torch.no_grad():
        ctx = HiddenStateCapture(lt.model, ids)(input_ids, attention_mask)
        out = drafter.loss(ctx, input_ids, loss_mask, attention_mask, generator=torch.Generator().manual_seed(0))
    loss = float(out.mean())  # upstream's normalisation: the weighted mean
    assert out.anchors > 0 and loss < 15.0, loss
