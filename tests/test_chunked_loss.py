"""The chunked LM head + cross-entropy equals the unchunked loss, and holds one chunk's logits at a time.

The reference, :func:`benchmarks.loss_memory.unchunked_loss`, is the loss as it was before chunking
(``F.cross_entropy`` over the full ``[rows, vocab]`` logits of every counted row); the benchmark
measures the two side by side.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from benchmarks.loss_memory import unchunked_loss
from dflash.core.config import DrafterConfig, config_from_dict
from dflash.core.errors import ConfigError
from dflash.model.chunked_ce import DEFAULT_CHUNK_ROWS, chunked_linear_cross_entropy
from dflash.model.drafter import DFlashDrafter, DrafterSpec, sample_anchors
from tests.test_drafter import LAYER_IDS, VOCAB, rand_batch  # one random batch for both drafter suites
from tests.tiny_models import tiny_llama

MASK_ID = 4
CHUNKS = [1, 7, 64, DEFAULT_CHUNK_ROWS, 100_000]  # one row, not dividing the rows, default, more than all rows


def make(dtype: torch.dtype, chunk: int, seed: int = 0) -> tuple[torch.nn.Module, DFlashDrafter]:
    target = tiny_llama(seed=seed, dtype=dtype, vocab_size=VOCAB)
    spec = DrafterSpec.from_target_config(target.config, target_layer_ids=LAYER_IDS, mask_token_id=MASK_ID,
                                          drafter=DrafterConfig(layers=2, block_size=8, anchors=12,
                                                                loss_chunk_rows=chunk))
    torch.manual_seed(seed + 1)
    return target, DFlashDrafter.from_target(target, spec, dtype=dtype)


def batch(target, lengths, seed=0):
    """test_drafter's random batch with a hole in the response."""
    ids, am, lm, ctx = rand_batch(target, lengths, seed, resp_from=3)
    lm[0, 10:14] = False  # a hole in the response: those slots are not counted
    return ids, am, lm, ctx


def grads(drafter: DFlashDrafter) -> list[torch.Tensor]:
    out = [p.grad.clone() for p in drafter.trainable_parameters()]
    drafter.zero_grad(set_to_none=True)
    return out


# --------------------------------------------------------------------------- equality
@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
@pytest.mark.parametrize("chunk", CHUNKS)
def test_chunked_drafter_loss_and_gradients_equal_the_unchunked_loss(dtype, tol, chunk):
    target, drafter = make(dtype, chunk)
    ids, am, lm, ctx = batch(target, [40, 29, 33])
    anchors, valid = sample_anchors(lm, 8, 12, torch.Generator().manual_seed(3), am.sum(1))
    ref, ref_correct = unchunked_loss(drafter, ctx, ids, lm, am, anchors, valid)
    ref.backward()
    ref_grads = grads(drafter)
    res = drafter.loss(ctx, ids, lm, am, anchors=anchors, anchor_valid=valid)
    res.loss_sum.backward()
    assert res.tokens > 64  # several chunks for the small chunk sizes
    assert res.loss_sum.dtype == ref.dtype
    assert float(res.loss_sum.detach()) == pytest.approx(float(ref.detach()), rel=tol)
    assert res.correct == ref_correct
    for got, want in zip(grads(drafter), ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=tol * 10, atol=tol * float(want.abs().max()) * 10)


@pytest.mark.parametrize("chunk", [1, 5, 300])
def test_chunked_function_equals_cross_entropy_over_full_logits(chunk):
    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=True).double().requires_grad_(False)
    hidden = torch.randn(37, 16, generator=g, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, 50, (37,), generator=g)
    w = torch.rand(37, generator=g, dtype=torch.float64)
    loss, correct = chunked_linear_cross_entropy(hidden, head, target, w, chunk)
    (3.0 * loss).backward()  # the incoming gradient is not 1: the backward scales by it
    got = hidden.grad.clone()
    hidden.grad = None
    logits = head(hidden)
    ref = (F.cross_entropy(logits, target, reduction="none") * w).sum()
    (3.0 * ref).backward()
    assert float(loss.detach()) == pytest.approx(float(ref.detach()), rel=1e-12)
    assert correct == int((logits.argmax(-1) == target).sum())
    torch.testing.assert_close(got, hidden.grad, rtol=1e-12, atol=1e-14)


def test_without_grad_the_loss_is_the_same_and_keeps_no_gradient_buffer():
    target, drafter = make(torch.float64, 7)
    ids, am, lm, ctx = batch(target, [40, 29])
    gen = lambda: torch.Generator().manual_seed(5)  # noqa: E731
    with_grad = drafter.loss(ctx, ids, lm, am, generator=gen())
    with torch.no_grad():
        without = drafter.loss(ctx, ids, lm, am, generator=gen())
    assert not without.loss_sum.requires_grad
    assert float(without.loss_sum) == pytest.approx(float(with_grad.loss_sum.detach()), rel=1e-12)


def test_bf16_autocast_chunked_loss_is_the_unchunked_loss_within_bf16_rounding():
    """The GPU path (fp32 master weights under bf16 autocast, a bf16 target head) on the CPU."""
    target = tiny_llama(seed=0, dtype=torch.bfloat16, vocab_size=VOCAB)
    spec = DrafterSpec.from_target_config(target.config, target_layer_ids=LAYER_IDS, mask_token_id=MASK_ID,
                                          drafter=DrafterConfig(layers=1, block_size=8, anchors=12,
                                                                loss_chunk_rows=13))
    torch.manual_seed(1)
    drafter = DFlashDrafter.from_target(target, spec, dtype=torch.float32)
    ids, am, lm, ctx = batch(target, [40, 33])
    anchors, valid = sample_anchors(lm, 8, 12, torch.Generator().manual_seed(3), am.sum(1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref, _ = unchunked_loss(drafter, ctx, ids, lm, am, anchors, valid)
        ref.backward()
        ref_grads = grads(drafter)
        res = drafter.loss(ctx, ids, lm, am, anchors=anchors, anchor_valid=valid)
    res.loss_sum.backward()
    assert res.loss_sum.dtype == torch.float32
    assert float(res.loss_sum.detach()) == pytest.approx(float(ref.detach()), rel=1e-3)
    for got, want in zip(grads(drafter), ref_grads, strict=True):
        assert float((got - want).norm()) <= 0.02 * float(want.norm()) + 1e-6


def test_a_trainable_head_is_refused_rather_than_left_untrained():
    head = torch.nn.Linear(4, 9, bias=False)
    with pytest.raises(ValueError, match="freeze"):
        chunked_linear_cross_entropy(torch.randn(3, 4), head, torch.zeros(3, dtype=torch.long), torch.ones(3))


def test_loss_chunk_rows_is_a_validated_drafter_key():
    assert DrafterConfig().loss_chunk_rows == DEFAULT_CHUNK_ROWS == 512
    assert config_from_dict({"drafter": {"loss_chunk_rows": 64}}).drafter.loss_chunk_rows == 64
    for bad in (0, -3, 1.5, "512", True):
        with pytest.raises(ConfigError, match=r"drafter\.loss_chunk_rows"):
            config_from_dict({"drafter": {"loss_chunk_rows": bad}})


# --------------------------------------------------------------------------- memory
@pytest.mark.slow
def test_one_3072_token_sequence_at_vocab_151936_stays_within_2_5_gb_above_the_model():
    """Issue #25: 512 anchors x block 16 over one 3,072-token sequence and a 151,936-row head held
    13.47 GB above the model unchunked (14.47 GB by this harness); with the default chunk the whole
    loss forward + backward stays within 2.5 GB (peak RSS of a fresh process above its built model)."""
    from benchmarks.loss_memory import ISSUE_CASE, measure

    got = measure("chunked", {**ISSUE_CASE, "chunk": DEFAULT_CHUNK_ROWS})
    # the real case: 512 anchors' 15 slots each, less the slots of partial last blocks past the sequence's end
    # (the training reference's anchor rule lets an anchor sit within a block of the end: issue #36)
    assert 0.99 * 512 * 15 <= got["tokens"] <= 512 * 15
    assert 0.1e9 < got["peak_above_model"] < 2.5e9, f"{got['peak_above_model'] / 1e9:.2f} GB above the model"
