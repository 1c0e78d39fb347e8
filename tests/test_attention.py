"""The draft layers' attention without a dense mask: the flex block mask states the dense mask's rule, and a
drafter that attends through it equals the dense reference in outputs and gradients (float32, CPU).

torch's flex_attention has no backward on the CPU (it refuses inputs that require grad there); the
gradient tests lift that one device guard to run flex's own unfused reference backward, the op the
fused CUDA kernel implements. The drafter never takes that path in training on a CPU
(``[drafter] attention = "auto"`` is dense there, and ``"flex"`` with a CPU device is refused).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dflash.core.config import DrafterConfig
from dflash.core.errors import ConfigError
from dflash.model import attention
from dflash.model.attention import block_attention_mask, dflash_mask_mod, flex_available, resolve_backend
from dflash.model.drafter import DFlashDrafter, DrafterSpec
from dflash.model.target import HiddenStateCapture
from tests.tiny_models import tiny_llama, tiny_qwen3

pytestmark = [pytest.mark.skipif(not flex_available(), reason="this torch has no flex_attention"),
              pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")]

VOCAB = 256
LAYER_IDS = (1, 2)
MASK_ID = 4
BLOCK = 8
# float32 on the CPU: the two paths sum the same terms in another order (measured: outputs and gradients
# within 5e-7 relative); a leak of one context position moves outputs by ~1e-2 (the mutated-mask test).
RTOL, ATOL = 1e-5, 1e-6

# Ragged cases: (anchors [b, A], context_valid lengths per row, seq_len). Overlapping anchors (closer than a
# block), an anchor at 0 (sees no context), padding anchors (position 0, as sample_anchors pads), right padding.
CASES = [
    (torch.tensor([[3, 5, 6, 20]]), [28], 28),
    (torch.tensor([[2, 9, 17], [0, 4, 0], [5, 0, 0]]), [30, 13, 21], 30),
    (torch.tensor([[1, 2, 3, 4, 5, 6]]), [12], 16),
]


def _valid(lengths: list[int], seq_len: int) -> torch.Tensor:
    return torch.arange(seq_len)[None, :] < torch.tensor(lengths)[:, None]


@pytest.mark.parametrize("anchors,lengths,seq_len", CASES)
def test_the_flex_mask_mod_states_the_dense_mask_pair_by_pair(anchors, lengths, seq_len):
    from torch.nn.attention.flex_attention import create_mask

    valid = _valid(lengths, seq_len)
    b, a = anchors.shape
    want = block_attention_mask(anchors, seq_len, BLOCK, valid)
    got = create_mask(dflash_mask_mod(anchors, seq_len, BLOCK, valid), b, None, a * BLOCK, seq_len + a * BLOCK,
                      device="cpu")
    assert torch.equal(got, want)
    honest = dflash_mask_mod(anchors, seq_len, BLOCK, valid)

    def sees_its_anchor(b, h, q_idx, kv_idx):  # the one-position leak the rule exists to prevent
        return honest(b, h, q_idx, kv_idx) | (kv_idx == anchors[b, (q_idx // BLOCK).clamp(max=a - 1)])
    leaky = create_mask(sees_its_anchor, b, None, a * BLOCK, seq_len + a * BLOCK, device="cpu")
    assert not torch.equal(leaky, want)


def test_the_block_masks_tiles_cover_every_attended_pair_and_full_tiles_are_full():
    """What the fused kernel reads: a tile it skips holds no attended pair, a tile it treats as full (no
    mask_mod call) holds no masked pair. Checked at tile 8 so one mask has skipped, partial and full tiles."""
    from torch.nn.attention.flex_attention import create_block_mask

    anchors, lengths, seq_len = torch.tensor([[2, 9, 17], [0, 4, 0], [5, 0, 0]]), [30, 13, 21], 30
    valid = _valid(lengths, seq_len)
    b, a = anchors.shape
    tile = 8
    bm = create_block_mask(dflash_mask_mod(anchors, seq_len, BLOCK, valid), B=b, H=None, Q_LEN=a * BLOCK,
                           KV_LEN=seq_len + a * BLOCK, device="cpu", BLOCK_SIZE=tile)
    dense = block_attention_mask(anchors, seq_len, BLOCK, valid)[:, 0]
    pad = (-dense.shape[-1]) % tile
    tiles = torch.nn.functional.pad(dense, (0, pad)).unflatten(1, (-1, tile)).unflatten(3, (-1, tile))
    any_pair, all_pairs = tiles.any(4).any(2), tiles.all(4).all(2)  # [b, q tiles, kv tiles]
    read = bm.to_dense()[:, 0].bool()  # partial or full tiles: the ones the kernel visits
    full = torch.zeros_like(read)
    for r in range(b):
        for qt in range(read.shape[1]):
            n = int(bm.full_kv_num_blocks[r, 0, qt])
            full[r, qt, bm.full_kv_indices[r, 0, qt, :n]] = True
    assert torch.equal(read, any_pair)
    assert not (full & ~all_pairs[:, :, : full.shape[2]]).any()
    assert full.any() and (read & ~full).any() and (~read).any()  # all three kinds occur


# --------------------------------------------------------------------------- drafters
def _pair(family: str) -> tuple[torch.nn.Module, DFlashDrafter, DFlashDrafter]:
    target = tiny_llama(seed=2, vocab_size=VOCAB) if family == "llama" else tiny_qwen3(seed=2, vocab_size=VOCAB)
    spec = DrafterSpec.from_target_config(target.config, target_layer_ids=LAYER_IDS, mask_token_id=MASK_ID,
                                          drafter=DrafterConfig(layers=2, block_size=BLOCK, anchors=5,
                                                                attention="dense"))
    torch.manual_seed(7)
    dense = DFlashDrafter.from_target(target, spec, dtype=torch.float32)
    flex = DFlashDrafter.from_target(target, dataclasses.replace(spec, attention="flex"), dtype=torch.float32)
    flex.load_state_dict(dense.state_dict())
    return target, dense, flex


def _batch(target: torch.nn.Module, lengths: list[int]) -> tuple[torch.Tensor, ...]:
    """Right-padded random tokens, their captured states, a loss mask from position 3 on."""
    g = torch.Generator().manual_seed(11)
    s = max(lengths)
    ids = torch.randint(5, VOCAB, (len(lengths), s), generator=g)
    am = _valid(lengths, s).long()
    ids[am == 0] = 0
    lm = am.bool() & (torch.arange(s) >= 3)
    return ids, am, lm, HiddenStateCapture(target, LAYER_IDS)(ids, am)


@pytest.fixture
def flex_backward_on_cpu(monkeypatch):
    """Lift flex_attention's one CPU guard (no backward there) so its reference backward runs."""
    import torch.nn.attention.flex_attention as fa

    monkeypatch.setattr(fa, "_validate_device", lambda *args: None)


@pytest.mark.parametrize("family", ["llama", pytest.param("qwen3", marks=pytest.mark.slow)])
def test_flex_and_dense_drafters_agree_in_outputs_and_gradients(family, flex_backward_on_cpu):
    """Ragged: sequences of 40, 29 and 12 tokens (padding), up to 5 anchors each, so the short row has 2
    anchors and 3 padding anchors; anchors may overlap. The loss goes through the LM head, so every
    trainable weight gets a gradient through the attention."""
    target, dense, flex = _pair(family)
    ids, am, lm, ctx = _batch(target, [40, 29, 12])
    outs = []
    for d in (dense, flex):
        loss = d.loss(ctx, ids, lm, am, generator=torch.Generator().manual_seed(3))
        loss.loss_sum.backward()
        outs.append((loss, [p.grad for p in d.trainable_parameters()]))
    (a, ga), (b, gb) = outs
    assert a.anchors == b.anchors > 0 and a.tokens == b.tokens > 0
    torch.testing.assert_close(b.loss_sum, a.loss_sum, rtol=RTOL, atol=ATOL)
    for x, y in zip(ga, gb, strict=True):
        assert x is not None and x.abs().max() > 0
        torch.testing.assert_close(y, x, rtol=RTOL, atol=ATOL)


@pytest.mark.slow
def test_a_leaky_flex_mask_is_caught(monkeypatch):
    """The equality above fails when the block mask is wrong: a mask that also shows each block its own
    anchor's context position (the token the block must not see) moves the outputs far outside the tolerance."""
    target, dense, flex = _pair("llama")
    ids, am, _, ctx = _batch(target, [40, 29, 12])
    anchors = torch.tensor([[3, 10, 17], [5, 6, 20], [4, 0, 0]])
    with torch.no_grad():
        want = dense.block_hidden(ctx, ids.gather(1, anchors), anchors, am.bool())
        torch.testing.assert_close(flex.block_hidden(ctx, ids.gather(1, anchors), anchors, am.bool()), want,
                                   rtol=RTOL, atol=ATOL)
        honest = attention.dflash_mask_mod

        def leaky(anchors, seq_len, block_size, context_valid=None):
            rule = honest(anchors, seq_len, block_size, context_valid)

            def mask_mod(b, h, q_idx, kv_idx):
                q_block = (q_idx // block_size).clamp(max=anchors.shape[1] - 1)
                return rule(b, h, q_idx, kv_idx) | (kv_idx == anchors[b, q_block])
            return mask_mod

        monkeypatch.setattr(attention, "dflash_mask_mod", leaky)
        got = flex.block_hidden(ctx, ids.gather(1, anchors), anchors, am.bool())
    assert (got - want).abs().max() > 1e3 * ATOL
    with pytest.raises(AssertionError):
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)


# --------------------------------------------------------------------------- which path
def test_auto_is_flex_on_cuda_and_dense_on_the_cpu():
    assert resolve_backend("auto", torch.device("cpu")) == "dense"
    assert resolve_backend("auto", torch.device("cuda", 0)) == "flex"
    assert resolve_backend("dense", torch.device("cuda", 0)) == "dense"
    assert resolve_backend("flex", torch.device("cpu")) == "flex"
    with pytest.raises(ValueError, match="attention must be one of auto, dense, flex"):
        resolve_backend("flash", torch.device("cpu"))


def test_the_attention_key_is_validated_once_and_flex_on_a_cpu_drafter_is_refused():
    assert DrafterConfig().attention == "auto"
    assert DrafterConfig(attention="flex", devices=("cuda:0",)).attention == "flex"
    with pytest.raises(ConfigError, match=r"drafter\.attention"):
        DrafterConfig(attention="flash")
    with pytest.raises(ConfigError, match="flex needs CUDA drafter devices"):
        DrafterConfig(attention="flex")  # the default device is the CPU
    target = tiny_llama(seed=0, vocab_size=VOCAB)
    spec = DrafterSpec.from_target_config(target.config, target_layer_ids=LAYER_IDS, mask_token_id=MASK_ID,
                                          drafter=DrafterConfig(attention="dense"))
    assert spec.attention == "dense" and DrafterSpec.from_json(spec.to_json()) == spec
    old = {k: v for k, v in spec.to_json().items() if k != "attention"}  # a drafter saved before the key
    assert DrafterSpec.from_json(old).attention == "auto"
