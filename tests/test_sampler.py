"""The sampler: formation inside buckets, stable ids, orders, determinism, item mix."""

from __future__ import annotations

import pytest

from dflash.core.config import WorkloadConfig
from dflash.core.errors import ConfigError
from dflash.core.sampler import Sampler, bucket_of, parse_item_id
from tests.conftest import SHAREGPT_BOUNDS, synthetic_lengths

LENGTHS = synthetic_lengths(3000, seed=4)


def wl(**kw) -> WorkloadConfig:
    base = {"max_len": 2048, "bucket_bounds": SHAREGPT_BOUNDS, "seqs_per_item": 4}
    base.update(kw)
    return WorkloadConfig(**base)


@pytest.mark.parametrize(("length", "bucket"), [(1, 0), (128, 0), (129, 1), (2048, 4), (9000, 4)])
def test_bucket_of_uses_upper_bounds_and_clips(length: int, bucket: int) -> None:
    assert bucket_of(length, SHAREGPT_BOUNDS) == bucket


@pytest.mark.parametrize("order", ["random", "length_grouped", "sorted"])
def test_deterministic_under_a_seed(order: str) -> None:
    a = Sampler(LENGTHS, wl(order=order), seed=3).epoch(1)
    b = Sampler(LENGTHS, wl(order=order), seed=3).epoch(1)
    assert a == b
    if order != "sorted":
        other = Sampler(LENGTHS, wl(order=order), seed=4).epoch(1)
        assert [i.item_id for i in a] != [i.item_id for i in other]


def test_epochs_differ_and_each_covers_every_sequence_once() -> None:
    s = Sampler(LENGTHS, wl(), seed=0)
    for e in (0, 1):
        seqs = [i for it in s.epoch(e) for i in it.seq_indices]
        assert sorted(seqs) == list(range(len(LENGTHS)))
    assert s.epoch(0) != s.epoch(1)


def test_items_are_formed_inside_one_bucket_with_true_shapes() -> None:
    s = Sampler(LENGTHS, wl(), seed=0)
    for it in s.epoch(0):
        lens = [s.lengths[i] for i in it.seq_indices]
        assert {bucket_of(n, SHAREGPT_BOUNDS) for n in lens} == {it.bucket}
        assert it.real_tokens == sum(lens) and it.padded_len == max(lens)
        assert 1 <= it.n_seqs <= 4


def test_stable_ids_form_the_same_item_again() -> None:
    s = Sampler(LENGTHS, wl(), seed=9)
    items = list(s.epoch(2))[:50]
    fresh = Sampler(LENGTHS, wl(), seed=9)
    for it in items:
        assert fresh.item(it.item_id) == it
        e, b, _ = parse_item_id(it.item_id)
        assert (e, b) == (2, it.bucket)
    with pytest.raises(ValueError):
        parse_item_id("nope")


def test_iter_items_resumes_from_a_position() -> None:
    s = Sampler(LENGTHS, wl(), seed=1)
    n = s.items_per_epoch()
    it = s.iter_items()
    full = [next(it).item_id for _ in range(n + 10)]
    resumed = s.iter_items(start_epoch=0, start_index=n - 5)
    assert [next(resumed).item_id for _ in range(15)] == full[n - 5:]


def test_length_grouped_sorts_inside_mega_batches_longest_first() -> None:
    s = Sampler(LENGTHS, wl(order="length_grouped", mega_batch=16), seed=0)
    items = s.epoch(0)
    for i in range(0, len(items), 16):
        lens = [it.padded_len for it in items[i:i + 16]]
        assert lens == sorted(lens, reverse=True)


def test_sorted_order_is_ascending_over_the_epoch() -> None:
    lens = [it.padded_len for it in Sampler(LENGTHS, wl(order="sorted"), seed=0).epoch(0)]
    assert lens == sorted(lens)


def test_tokens_per_item_respects_the_padded_budget() -> None:
    s = Sampler(LENGTHS, wl(seqs_per_item=None, tokens_per_item=4096), seed=0)
    for it in s.epoch(0):
        assert it.padded_len * it.n_seqs <= 4096 or it.n_seqs == 1
    short = [it for it in s.epoch(0) if it.bucket == 0]
    assert max(it.n_seqs for it in short) > 4  # short sequences pack more per item


def test_item_mix_is_the_epochs_bucket_distribution() -> None:
    s = Sampler(LENGTHS, wl(seqs_per_item=1), seed=0)
    assert s.item_mix() == pytest.approx(s.sequence_shares())
    assert sum(s.item_mix()) == pytest.approx(1.0)
    assert s.item_mix()[4] > 0.6  # long-bucket heavy, like the packaged ShareGPT


def test_rejects_empty_or_invalid_lengths() -> None:
    with pytest.raises(ValueError):
        Sampler([], wl())
    with pytest.raises(ValueError):
        Sampler([0, 5], wl())


def test_sequences_without_an_eligible_anchor_are_dropped_and_counted() -> None:
    # two consecutive response tokens inside the truncated sequence: p + 1 < min(length, max_len)
    lengths, prompts = [100, 100, 100, 40, 50], [10, 95, 94, 39, 48]
    s = Sampler(lengths, wl(max_len=96, bucket_bounds=(64, 96), seqs_per_item=1), prompt_lengths=prompts,
                block_size=8)
    kept = {k for it in s.epoch(0) for k in it.seq_indices}
    # 94 keeps 94, 95 (a block of 8 runs past the end); 95 is cut to one token by max_len 96, 39 has one
    assert kept == {0, 2, 4} and s.dropped_no_anchor == 2
    assert Sampler(lengths, wl(seqs_per_item=1), prompt_lengths=prompts).dropped_no_anchor == 0  # no block size
    with pytest.raises(ConfigError, match=r"workload\.max_len: no sequence has an anchor"):  # one line, exit 2
        Sampler([20], wl(), prompt_lengths=[19], block_size=8)


def test_the_drop_rule_agrees_with_the_drafters_anchor_rule_on_real_encodings() -> None:
    """has_anchor (lengths and prompt lengths: what the cache and the simulator have) must keep exactly
    the sequences in which sample_anchors finds an anchor (the trainer's encoded loss masks), and the
    simulator's anchor count (simulator.timing.anchors_for) must be the trainer's: exact for a sequence
    cut inside its response, one more where the template closes the turn with an unsupervised token
    after end-of-turn (ChatML's newline), which the count from lengths cannot see."""
    import torch

    from dflash.core.config import DrafterConfig, TimingConfig
    from dflash.core.sampler import has_anchor
    from dflash.data.conversations import load_conversations, resolve_dataset
    from dflash.data.lengths import conversation_token_lengths, load_tokenizer, prompt_token_lengths
    from dflash.model.drafter import sample_anchors
    from dflash.model.target import encode_conversation
    from simulator.timing import anchors_for

    tok = load_tokenizer("smollm2")
    convs, _ = load_conversations(resolve_dataset("sharegpt"), "first_exchange", 300)
    lengths, prompts = conversation_token_lengths(convs, tok), prompt_token_lengths(convs, tok)
    max_len, block = 256, 8
    uncapped = DrafterConfig(block_size=block, anchors=max_len)
    verdicts, extra = [], []
    for conv, n, p in zip(convs, lengths, prompts, strict=True):
        _ids, mask = encode_conversation(tok, conv, max_len)
        _, valid = sample_anchors(mask[None], block, max_len, torch.Generator().manual_seed(0))
        assert bool(valid.any()) == has_anchor(n, min(p, n), max_len), conv.id
        verdicts.append(bool(valid.any()))
        simulated = anchors_for([min(n, max_len)], TimingConfig(), uncapped, [min(p, n)])
        extra.append(simulated - int(valid.sum()))
        if n > max_len and verdicts[-1]:
            assert extra[-1] == 0, conv.id
    assert any(verdicts) and not all(verdicts)  # both kinds occur at this max_len
    assert set(extra) == {0, 1}


@pytest.mark.parametrize("per_bucket", [1, 16, 10_000])
def test_held_out_sequences_are_chosen_per_bucket_by_seed_and_are_in_no_item(per_bucket: int) -> None:
    """The quality metric's held-out set (issue #27): per bucket up to ``per_bucket`` sequences, never
    more than half the bucket; in no item of any epoch; the same for one seed (every configuration of a
    validation), another for another seed; the rest of each epoch still covers every other sequence once."""
    s = Sampler(LENGTHS, wl(), seed=5, heldout_per_bucket=per_bucket)
    sizes = [sum(1 for b in s.seq_bucket if b == k) for k in range(s.n_buckets)]
    assert [len(h) for h in s.heldout] == [min(per_bucket, n // 2) for n in sizes]
    held = {i for h in s.heldout for i in h}
    assert all(s.seq_bucket[i] == k for k, h in enumerate(s.heldout) for i in h)
    for e in (0, 1):
        seqs = [i for it in s.epoch(e) for i in it.seq_indices]
        assert sorted(seqs) == sorted(set(range(len(LENGTHS))) - held)
    assert Sampler(LENGTHS, wl(), seed=5, heldout_per_bucket=per_bucket).heldout == s.heldout
    assert Sampler(LENGTHS, wl(), seed=6, heldout_per_bucket=per_bucket).heldout != s.heldout
    assert Sampler(LENGTHS, wl(), seed=5).heldout == ((),) * s.n_buckets
