"""The drafter learns: its first loss is near a uniform guess, the time-budgeted schedule holds then
decays (stub clock), resume continues it, and no optimizer step trains zero anchors."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
import torch

from dflash.core.config import (
    ClusterConfig,
    DflashConfig,
    DrafterConfig,
    QueueConfig,
    TargetConfig,
    TrainConfig,
    WorkloadConfig,
    load_config,
)
from dflash.core.records import read_records
from dflash.data.conversations import Conversation, load_conversations, resolve_dataset
from dflash.data.lengths import load_tokenizer
from dflash.model.target import LoadedTarget
from dflash.pipeline.trainer import Trainer
from tests.tiny_models import tiny_llama

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def target() -> LoadedTarget:
    tok = load_tokenizer("smollm2")
    model = tiny_llama(vocab_size=len(tok), layers=6, init_std=0.2)
    return LoadedTarget(model=model, tokenizer=tok, source="tiny-llama", cache_hit=True, load_s=0.0)


@pytest.fixture(scope="module")
def conversations() -> list:
    convs, _ = load_conversations(resolve_dataset("sharegpt"), "first_exchange", 48)
    return convs


def tiny_cfg(**train) -> DflashConfig:
    return DflashConfig(
        workload=WorkloadConfig(sample="first_exchange", max_len=128, bucket_bounds=(32, 64, 128), seqs_per_item=1,
                                order="length_grouped", mega_batch=8),
        cluster=ClusterConfig(n_target=1, n_drafter=1), queue=QueueConfig(min_ready=2, max_depth=6),
        target=TargetConfig(capture_layers=3), drafter=DrafterConfig(layers=1, block_size=8, anchors=8),
        train=TrainConfig(**{"lr": 1e-3, "log_every": 1000, "checkpoint_every": 5, **train}))


class StubClock:
    """Training time that advances by ``dt`` on every reading: the schedule's time axis without waiting."""

    def __init__(self, dt: float) -> None:
        self.t, self.dt = 0.0, dt

    def __call__(self) -> float:
        self.t += self.dt
        return self.t


def step_lrs(run_dir: Path) -> list[float]:
    return [r["lr"] for r in read_records(run_dir, "step")]


def test_a_time_budget_holds_the_rate_through_the_middle_and_decays_at_the_end(tmp_path, target,
                                                                                 conversations) -> None:
    cfg = tiny_cfg(max_minutes=1.0, warmup_ratio=0.04)  # 60 s of (stub) training time, no step limit
    tr = Trainer(cfg, tmp_path, target=target, conversations=conversations, progress=None)
    tr.clock = StubClock(1.0)
    res = tr.run()
    lrs, peak = step_lrs(tmp_path), cfg.train.lr
    assert res.summary["stopped_by"] == "max_minutes" and len(lrs) >= 15
    middle = lrs[len(lrs) // 4: 3 * len(lrs) // 4]
    assert min(middle) >= 0.8 * peak  # the rate holds through the middle of the budget
    assert lrs[-1] < 0.3 * peak and min(lrs) > 0  # decays at the end, never 0 on a step that runs


def test_resume_mid_decay_continues_the_schedule(tmp_path, target, conversations) -> None:
    """Stopped (SIGTERM) inside the decay, resumed with the same limits: the rate goes on down from where
    it was, on the training time kept in the checkpoint, and ends at the budget."""
    cfg = tiny_cfg(max_minutes=1.0)
    first = Trainer(cfg, tmp_path, target=target, conversations=conversations, progress=None)
    clock = StubClock(1.0)

    def stopping_clock() -> float:  # a SIGTERM at 52 s of the 60 s budget (the decay is the last 12 s)
        t = clock()
        if t >= 52.0:
            first._stop_signal = "signal SIGTERM"
        return t

    first.clock = stopping_clock
    assert first.run().summary["stopped_by"] == "signal SIGTERM"
    before = step_lrs(tmp_path)
    assert before[-1] < 0.8 * cfg.train.lr  # stopped inside the decay
    resumed = Trainer(cfg, tmp_path, target=target, conversations=conversations, progress=None, resume=True)
    resumed.clock = StubClock(1.0)
    assert resumed.elapsed_before_s >= 50.0  # training time came back from the checkpoint
    res = resumed.run()
    after = step_lrs(tmp_path)[len(before):]
    assert res.summary["stopped_by"] == "max_minutes" and after
    assert after[0] <= before[-1] and all(b <= a + 1e-12 for a, b in itertools.pairwise(after))
    assert 0 < after[-1] < 0.3 * cfg.train.lr


def test_response_free_conversations_never_make_a_zero_anchor_step(tmp_path, target, conversations) -> None:
    """Conversations whose response cannot hold an anchor are dropped by the sampler (and counted), so
    every step trains anchors; the books still balance."""
    empty = [Conversation(id=f"noresp-{i}", messages=(("user", c.messages[0][1]), ("assistant", "")))
             for i, c in enumerate(conversations[:12])]
    long_prompt = [Conversation(id=f"long-{i}", messages=(("user", c.messages[0][1] * 20), ("assistant", "ok")))
                   for i, c in enumerate(conversations[12:20])]
    data = conversations[20:] + empty + long_prompt
    tr = Trainer(tiny_cfg(epochs=1), tmp_path, target=target, conversations=data, progress=None)
    assert tr.sampler.dropped_no_anchor >= len(empty) + len(long_prompt)
    res = tr.run()
    s = res.summary
    steps = list(read_records(tmp_path, "step"))
    assert steps and all(r["anchors"] > 0 and math.isfinite(r["loss"]) for r in steps)
    assert s["skipped_no_anchors"] == 0 and s["produced"] == s["trained"] + s["discarded_at_stop"] == s["steps"]


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


def test_a_take_without_anchors_is_skipped_and_counted_not_a_step(tmp_path, target, conversations,
                                                                   monkeypatch) -> None:
    """Should a take still hold no anchor (here: the sampler told not to drop), it is no optimizer step:
    counted as skipped_no_anchors, no step record, the books balance with it."""
    import dflash.pipeline.trainer as trainer_mod
    from dflash.core.sampler import Sampler

    monkeypatch.setattr(trainer_mod, "sampler_for", lambda cfg, lengths, prompts: Sampler(lengths, cfg.workload,
                                                                                           seed=cfg.seed))
    empty = [Conversation(id=f"noresp-{i}", messages=(("user", c.messages[0][1] * 20), ("assistant", "ok")))
             for i, c in enumerate(conversations[:16])]
    res = Trainer(tiny_cfg(epochs=1), tmp_path, target=target, conversations=conversations[16:] + empty,
                  progress=None).run()
    s = res.summary
    steps = list(read_records(tmp_path, "step"))
    assert s["skipped_no_anchors"] >= 1 and all(r["anchors"] > 0 for r in steps)
    assert [r["step"] for r in steps] == list(range(s["steps"]))
    assert s["produced"] == s["trained"] + s["skipped_no_anchors"] + s["discarded_at_stop"]
    assert s["trained"] == s["steps"]  # one item per take, one drafter: every trained item is a step
