"""The DFlash drafter: attention mask (no leaks), loss, freezing, data-parallel equivalence, persistence."""

from __future__ import annotations

import math

import pytest
import torch

from dflash.core.config import DrafterConfig
from dflash.model.drafter import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    DFlashDrafter,
    DrafterSpec,
    block_attention_mask,
    default_mask_token_id,
    normalised_loss,
    sample_anchors,
)
from dflash.model.target import HiddenStateCapture
from tests.tiny_models import tiny_llama

VOCAB = 256
LAYER_IDS = (1, 3)
MASK_ID = 4


def make(block_size=8, layers=1, anchors=8, dtype=torch.float64, target_dtype=None, gamma=None, seed=0,
         init_std=0.02):
    target = tiny_llama(seed=seed, dtype=target_dtype or dtype, vocab_size=VOCAB, init_std=init_std)
    cfg = DrafterConfig(layers=layers, block_size=block_size, anchors=anchors, gamma=gamma)
    spec = DrafterSpec.from_target_config(target.config, target_layer_ids=LAYER_IDS, mask_token_id=MASK_ID,
                                          drafter=cfg)
    torch.manual_seed(seed + 1)
    return target, DFlashDrafter.from_target(target, spec, dtype=dtype)


def rand_batch(target, lengths, seed=0, resp_from=4):
    """Right-padded random token batch, its captured states and a loss mask on positions >= resp_from."""
    g = torch.Generator().manual_seed(seed)
    s = max(lengths)
    ids = torch.randint(5, VOCAB, (len(lengths), s), generator=g)
    am = torch.zeros(len(lengths), s, dtype=torch.long)
    lm = torch.zeros(len(lengths), s, dtype=torch.bool)
    for r, n in enumerate(lengths):
        am[r, :n] = 1
        lm[r, resp_from:n] = True
        ids[r, n:] = 0
    ctx = HiddenStateCapture(target, LAYER_IDS)(ids, am)  # straight from the capture, no clone
    return ids, am, lm, ctx


# --------------------------------------------------------------------------- spec and pieces
def test_spec_from_target_config_and_json_round_trip():
    target = tiny_llama()
    spec = DrafterSpec.from_target_config(target.config, target_layer_ids=[1, 3], mask_token_id=MASK_ID,
                                          drafter=DrafterConfig(block_size=10))
    assert (spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (64, 4, 2, 16)
    assert spec.vocab_size == VOCAB and spec.gamma == 5.0 and spec.layers == 5 and spec.anchors == 512
    assert spec.target_layer_ids == (1, 3) and spec.num_context_layers == 2
    assert DrafterSpec.from_json(spec.to_json()) == spec
    with pytest.raises(ValueError):
        DrafterSpec.from_target_config(target.config, target_layer_ids=[1], mask_token_id=VOCAB)


def test_rope_matches_the_target_family():
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    target, drafter = make(dtype=torch.float32)
    pos = torch.arange(0, 300, 7)[None]
    cos, sin = LlamaRotaryEmbedding(target.config)(torch.zeros(1, dtype=torch.float32), pos)
    c2, s2 = drafter._cos_sin(pos)
    torch.testing.assert_close(c2, cos)
    torch.testing.assert_close(s2, sin)


def test_default_mask_token_on_smollm2():
    from dflash.data.lengths import load_tokenizer

    tok = load_tokenizer("smollm2")
    mid = default_mask_token_id(tok)
    assert mid == 16 and tok.convert_ids_to_tokens(mid) == "<empty_output>"


def test_block_attention_mask_layout():
    anchors = torch.tensor([[2, 3]])
    m = block_attention_mask(anchors, seq_len=5, block_size=2)[0, 0].int()
    expect = torch.tensor([
        # ctx 0..4      | b0 b0 | b1 b1
        [1, 1, 0, 0, 0, 1, 1, 0, 0],
        [1, 1, 0, 0, 0, 1, 1, 0, 0],
        [1, 1, 1, 0, 0, 0, 0, 1, 1],
        [1, 1, 1, 0, 0, 0, 0, 1, 1],
    ])
    assert torch.equal(m, expect)


# --------------------------------------------------------------------------- anchors
def test_sample_anchors_eligibility_determinism_no_replacement():
    s, bs = 60, 8
    lm = torch.zeros(3, s, dtype=torch.bool)
    lm[0, 10:50] = True  # pairs (p, p + 1) inside the mask: 10..48 -> 39 eligible
    lm[1, 5:20] = True
    lengths = torch.tensor([60, 8, 60])  # row 1 ends at 8: p + 1 < 8 -> 5, 6 (blocks run past the end)
    lm[2, 30] = True  # a lone response token: no pair
    a1, v1 = sample_anchors(lm, bs, 16, torch.Generator().manual_seed(3), lengths)
    a2, v2 = sample_anchors(lm, bs, 16, torch.Generator().manual_seed(3), lengths)
    assert torch.equal(a1, a2) and torch.equal(v1, v2)
    a3, _ = sample_anchors(lm, bs, 16, torch.Generator().manual_seed(4), lengths)
    assert not torch.equal(a1, a3)
    assert a1.shape == (3, 16)
    row0 = a1[0][v1[0]].tolist()
    assert len(row0) == 16 == len(set(row0)) and row0 == sorted(row0)
    assert all(lm[0, p] and lm[0, p + 1] for p in row0)
    assert a1[1][v1[1]].tolist() == [5, 6]
    assert not v1[2].any()
    # fewer eligible than requested: all of them
    a4, v4 = sample_anchors(lm, bs, 100, None, lengths)
    assert a4[0][v4[0]].tolist() == list(range(10, 49))


def upstream_eligible(mask: list[int], length: int) -> list[int]:
    """SpecForge's DFlash anchor rule, stated independently of ours (sgl-project/SpecForge
    specforge/algorithms/common/dflash_family_model.py, ``_sample_anchor_positions``, commit a6b6b02):
    candidates ``p < S - 1`` with ``loss_mask[p] > 0.5`` and ``loss_mask[p + 1] > 0.5``."""
    real = mask[:length]
    return [p for p in range(len(real) - 1) if real[p] > 0.5 and real[p + 1] > 0.5]


# Hand-made masks: a response shorter than the block at the end, a one-token response, gaps of one, a
# response at position 0, a response up to the last token, a mask of zeros, and a row cut by its length.
HAND_MASKS = [
    ([0, 0, 0, 1, 1, 1], 6, [3, 4]),  # 3 response tokens at the end, B = 8: the full-block rule had none
    ([0, 0, 0, 0, 0, 1], 6, []),  # one response token (an empty reply's end-of-turn token)
    ([1, 1, 0, 1, 0, 1, 1, 1, 0, 0], 10, [0, 5, 6]),  # lone tokens (3) are no anchor
    ([0] * 4 + [1] * 12, 16, list(range(4, 15))),  # the last B - 2 positions are anchors too
    ([0] * 6, 6, []),
    ([0, 1, 1, 1, 1, 1, 0, 0], 4, [1, 2]),  # right padding past length 4: p + 1 < 4
]


@pytest.mark.parametrize("mask,length,expect", HAND_MASKS)
def test_the_anchor_rule_is_upstreams_on_hand_made_masks(mask, length, expect):
    """Fails when our eligibility differs from the training reference's on these masks, in either direction."""
    assert upstream_eligible(mask, length) == expect  # the hand count and the reference agree
    lm = torch.tensor([mask], dtype=torch.bool)
    anchors, valid = sample_anchors(lm, 8, 100, torch.Generator().manual_seed(0), torch.tensor([length]))
    assert anchors[0][valid[0]].tolist() == expect


def test_a_partial_last_block_trains_its_response_slots_under_their_weights():
    """An anchor whose block runs past the sequence counts slot k iff a + k is a real response token."""
    target, drafter = make(block_size=8, anchors=8)
    ids, am, lm, ctx = rand_batch(target, [12, 20], resp_from=9)  # row 0: response 9..11 (3 tokens)
    anchors, valid = torch.tensor([[9, 10], [9, 0]]), torch.tensor([[True, True], [True, False]])
    res = drafter.loss(ctx, ids, lm, am, anchors=anchors, anchor_valid=valid)
    w = drafter.spec.slot_weights()
    # row 0: a = 9 counts slots 1, 2 (positions 10, 11), a = 10 slot 1; row 1: a = 9 slots 1..7 (10..16)
    assert res.anchors == 3 and res.tokens == 2 + 1 + 7
    assert res.weight_sum == pytest.approx(float(w[1] + w[2] + w[1] + w[1:].sum()))
    drawn, ok = sample_anchors(lm, 8, 8, torch.Generator().manual_seed(0), am.sum(1))
    assert drawn[0][ok[0]].tolist() == [9, 10]  # both are eligible under the rule the trainer samples with


# --------------------------------------------------------------------------- no mask leak
# Anchors closer than B apart (overlapping blocks), the trap docs/REFERENCE.md warns about.
LEAK_ANCHORS = [3, 6, 9, 10, 22]


@pytest.mark.parametrize("block_size", [8, 16])
def test_no_mask_leak_context_at_or_after_anchor(block_size):
    target, drafter = make(block_size=block_size, layers=2)
    ids, _, _, ctx = rand_batch(target, [40])
    anchors = torch.tensor([LEAK_ANCHORS])
    with torch.no_grad():
        base = drafter.block_logits(ctx, ids, anchors)
        for j, a in enumerate(LEAK_ANCHORS):
            after = ctx.clone()
            after[:, a:] += torch.randn_like(after[:, a:])
            out = drafter.block_logits(after, ids, anchors)
            torch.testing.assert_close(out[0, j], base[0, j], rtol=0, atol=1e-12)
            before = ctx.clone()
            before[:, a - 1] += 1.0
            out = drafter.block_logits(before, ids, anchors)
            assert (out[0, j] - base[0, j]).abs().max() > 1e-6, f"block {j} ignores context before its anchor"
            # a block with a later anchor sees position a too, so it must change
            for j2, a2 in enumerate(LEAK_ANCHORS):
                if a2 > a:
                    assert (out[0, j2] - base[0, j2]).abs().max() > 1e-6


def test_no_mask_leak_gradient_is_zero_at_and_after_anchor():
    target, drafter = make(block_size=8, layers=2)
    ids, _, _, ctx = rand_batch(target, [40])
    anchors = torch.tensor([LEAK_ANCHORS])
    for j, a in enumerate(LEAK_ANCHORS):
        c = ctx.clone().requires_grad_(True)
        drafter.block_logits(c, ids, anchors)[0, j].square().sum().backward()
        g = c.grad[0].abs().sum(-1)
        assert g[a:].max() == 0, f"block {j} (anchor {a}) reads context at or after its anchor"
        assert (g[:a] > 0).all()


def test_no_mask_leak_other_blocks_tokens():
    target, drafter = make(block_size=8, layers=2)
    ids, _, _, ctx = rand_batch(target, [40])
    anchors = torch.tensor([LEAK_ANCHORS])
    with torch.no_grad():
        base = drafter.block_logits(ctx, ids, anchors)
        for j2, a2 in enumerate(LEAK_ANCHORS):
            ids2 = ids.clone()
            ids2[0, a2] = (ids2[0, a2] + 17) % VOCAB  # block j2's anchor token changes
            out = drafter.block_logits(ctx, ids2, anchors)
            for j in range(len(LEAK_ANCHORS)):
                if j == j2:
                    assert (out[0, j] - base[0, j]).abs().max() > 1e-6
                else:
                    torch.testing.assert_close(out[0, j], base[0, j], rtol=0, atol=1e-12)


def test_all_blocks_in_one_forward_equal_each_block_alone():
    """The batched training forward equals inference on a context that ends right before the anchor."""
    target, drafter = make(block_size=8, layers=2)
    ids, _, _, ctx = rand_batch(target, [40])
    anchors = torch.tensor([LEAK_ANCHORS])
    with torch.no_grad():
        batched = drafter.block_logits(ctx, ids, anchors)
        for j, a in enumerate(LEAK_ANCHORS):
            alone = drafter.draft_block(ctx[:, :a], ids[0, a])
            torch.testing.assert_close(alone[0], batched[0, j, 1:], rtol=1e-10, atol=1e-10)
            # a longer context with the position given sees the same
            torch.testing.assert_close(drafter.draft_block(ctx, ids[0, a], a)[0], alone[0],
                                       rtol=1e-10, atol=1e-10)


# --------------------------------------------------------------------------- loss
def test_weighted_loss_matches_hand_computation():
    gamma = 3.0
    target, drafter = make(block_size=6, gamma=gamma)
    ids, am, lm, ctx = rand_batch(target, [30, 24], resp_from=4)
    lm[0, 12] = False  # a target token outside the response is not counted
    anchors = torch.tensor([[4, 9, 27], [5, 10, 0]])  # 27 + 5 runs past the end: slots 3..5 dropped
    valid = torch.tensor([[True, True, True], [True, True, False]])
    res = drafter.loss(ctx, ids, lm, am, anchors=anchors, anchor_valid=valid)
    logits = drafter.block_logits(ctx, ids, anchors, am.bool()).double()
    total, n, wsum = 0.0, 0, 0.0
    for r in range(2):
        for j in range(3):
            if not valid[r, j]:
                continue
            a = int(anchors[r, j])
            for k in range(1, 6):
                p = a + k
                if p >= ids.shape[1] or not lm[r, p]:
                    continue
                w = math.exp(-(k - 1) / gamma)
                logp = torch.log_softmax(logits[r, j, k].detach(), -1)[ids[r, p]]
                total += -w * float(logp)
                n += 1
                wsum += w
    assert res.tokens == n and res.anchors == 5
    assert res.weight_sum == pytest.approx(wsum)
    assert float(res.loss_sum.detach()) == pytest.approx(total, rel=1e-9)
    assert float(res.mean("tokens").detach()) == pytest.approx(total / n, rel=1e-9)
    assert float(res.mean().detach()) == pytest.approx(total / wsum, rel=1e-9)  # the default: upstream's
    assert float(res.mean("weights").detach()) == pytest.approx(total / wsum, rel=1e-9)
    # the published gammas
    assert drafter.spec.slot_weights()[1].item() == 1.0 and drafter.spec.slot_weights()[0].item() == 0.0
    assert DrafterSpec.from_target_config(target.config, target_layer_ids=LAYER_IDS, mask_token_id=MASK_ID,
                                          drafter=DrafterConfig(block_size=16)).gamma == 7.0


def test_loss_without_anchors_is_zero_and_backpropagates():
    target, drafter = make()
    ids, am, lm, ctx = rand_batch(target, [6], resp_from=5)  # one response token: no two consecutive
    res = drafter.loss(ctx, ids, lm, am)
    assert res.tokens == 0 and res.anchors == 0 and float(res.loss_sum.detach()) == 0.0
    normalised_loss(res.loss_sum, 0).backward()
    assert all(p.grad is not None and p.grad.abs().sum() == 0 for p in drafter.trainable_parameters())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [8, 10, 16])
def test_shapes_and_dtypes(block_size, dtype):
    target, drafter = make(block_size=block_size, anchors=5, dtype=dtype)
    ids, am, lm, ctx = rand_batch(target, [48, 40], resp_from=2)
    res = drafter.loss(ctx, ids, lm, am, generator=torch.Generator().manual_seed(0))
    assert res.loss_sum.dtype == torch.float32 and torch.isfinite(res.loss_sum)
    assert res.anchors == 10 and 0 < res.tokens <= 10 * (block_size - 1)
    res.mean().backward()
    assert all(p.grad is not None and p.grad.dtype == dtype for p in drafter.trainable_parameters())
    anchors, _ = sample_anchors(lm, block_size, 5, torch.Generator().manual_seed(0), am.sum(1))
    with torch.no_grad():
        hid = drafter.block_hidden(ctx, ids.gather(1, anchors), anchors)
        logits = drafter.block_logits(ctx, ids, anchors)
        draft = drafter.draft_block(ctx[:1, :20], ids[0, 20])
    assert hid.shape == (2, 5, block_size, 64) and hid.dtype == dtype
    assert logits.shape == (2, 5, block_size, VOCAB)
    assert draft.shape == (1, block_size - 1, VOCAB)


def test_bfloat16_target_and_drafter_train_the_qk_norms():
    target, drafter = make(block_size=8, anchors=4, dtype=torch.bfloat16)
    ids, am, lm, ctx = rand_batch(target, [32])
    assert ctx.dtype == torch.bfloat16
    res = drafter.loss(ctx, ids, lm, am, generator=torch.Generator().manual_seed(0))
    res.mean().backward()
    assert torch.isfinite(res.loss_sum)
    assert drafter.layers[0].self_attn.q_norm.weight.grad is not None


def test_overfits_a_handful_of_items():
    # init_std 0.2: a tiny target with 0.02 tables has logits ~0.1 and needs hundreds of steps
    target, drafter = make(block_size=8, layers=1, anchors=6, dtype=torch.float32, init_std=0.2)
    ids, am, lm, ctx = rand_batch(target, [40, 36, 32], resp_from=3)
    opt = torch.optim.AdamW(drafter.trainable_parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(80):
        res = drafter.loss(ctx, ids, lm, am, generator=g)  # fresh anchors every step
        loss = res.mean()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.trainable_parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
    first, last = sum(losses[:3]) / 3, sum(losses[-5:]) / 5
    # random tokens: a weighted loss well under the uniform guess (~0.5 * ln 256 = 2.8) is memorisation
    assert last < first / 5 and last < 1.0, (first, last)


def test_frozen_parts_stay_frozen():
    target, drafter = make(dtype=torch.float32)
    embed0 = target.model.embed_tokens.weight.clone()
    head0 = target.lm_head.weight.clone()
    assert drafter.embed_tokens is target.model.embed_tokens and drafter.lm_head is target.lm_head  # shared
    trainable = {id(p) for p in drafter.trainable_parameters()}
    assert id(target.model.embed_tokens.weight) not in trainable and id(target.lm_head.weight) not in trainable
    assert not any(k.startswith(("embed_tokens", "lm_head")) for k in drafter.state_dict())
    assert {n.split(".")[0] for n, _ in drafter.named_parameters()} == {"fc", "hidden_norm", "layers", "norm"}
    ids, am, lm, ctx = rand_batch(target, [40, 30])
    opt = torch.optim.AdamW(drafter.trainable_parameters(), lr=1e-2, weight_decay=0.1)
    fc0 = drafter.fc.weight.clone()
    for _ in range(3):
        res = drafter.loss(ctx, ids, lm, am, generator=torch.Generator().manual_seed(1))
        opt.zero_grad()
        res.mean().backward()
        opt.step()
    assert torch.equal(target.model.embed_tokens.weight, embed0)
    assert torch.equal(target.lm_head.weight, head0)
    assert target.model.embed_tokens.weight.grad is None and target.lm_head.weight.grad is None
    assert not torch.equal(drafter.fc.weight, fc0)


def test_two_workers_equal_one_worker():
    """Gradient sums of two workers, divided by the global weight sum, equal one worker's gradient."""
    target, drafter = make(block_size=8, layers=2, anchors=6)
    lengths = [40, 25, 33, 18]
    ids, am, lm, ctx = rand_batch(target, lengths, resp_from=3)
    anchors, valid = sample_anchors(lm, 8, 6, torch.Generator().manual_seed(5), am.sum(1))

    def grads_of(loss):
        drafter.zero_grad()
        loss.backward()
        return [p.grad.clone() for p in drafter.trainable_parameters()]

    one = drafter.loss(ctx, ids, lm, am, anchors=anchors, anchor_valid=valid)
    g_one = grads_of(one.mean())

    parts, total_tokens, total_weight = [], 0, 0.0
    for rows in ([0, 1], [2, 3]):
        s = max(lengths[r] for r in rows)  # each worker pads only to its own longest sequence
        part = drafter.loss(ctx[rows, :s], ids[rows, :s], lm[rows, :s], am[rows, :s],
                            anchors=anchors[rows], anchor_valid=valid[rows])
        parts.append(grads_of(part.loss_sum))  # token-weighted gradient SUM
        total_tokens += part.tokens
        total_weight += part.weight_sum
    assert total_tokens == one.tokens and total_weight == pytest.approx(one.weight_sum)
    g_two = [(a + b) / total_weight for a, b in zip(*parts)]
    for a, b in zip(g_one, g_two):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


# --------------------------------------------------------------------------- persistence
def test_save_load_round_trip(tmp_path):
    target, drafter = make(block_size=8, layers=2, dtype=torch.float32)
    with torch.no_grad():
        for p in drafter.trainable_parameters():
            p.add_(torch.randn_like(p) * 0.01)  # not the init values
    ids, _, _, ctx = rand_batch(target, [40])
    anchors = torch.tensor([LEAK_ANCHORS])
    out = drafter.save(tmp_path / "ckpt")
    assert (out / WEIGHTS_FILE).is_file() and (out / CONFIG_FILE).is_file()
    assert sorted(p.name for p in out.iterdir()) == sorted([WEIGHTS_FILE, CONFIG_FILE])
    from safetensors.torch import load_file

    saved = load_file(str(out / WEIGHTS_FILE))
    assert set(saved) == set(drafter.state_dict())
    back = DFlashDrafter.load(out, target)
    assert back.spec == drafter.spec and back.dtype == torch.float32
    assert back.embed_tokens is target.model.embed_tokens
    with torch.no_grad():
        torch.testing.assert_close(back.block_logits(ctx, ids, anchors), drafter.block_logits(ctx, ids, anchors),
                                   rtol=0, atol=0)
    half = DFlashDrafter.load(out, target, dtype=torch.bfloat16)
    assert half.dtype == torch.bfloat16


# --------------------------------------------------------------------------- drafters saved before format 2
def _as_format_1(out, qk_norm: bool, attention_bias: bool = False) -> None:
    """Rewrite a saved drafter's spec the way format 1 wrote it (family-dependent layers)."""
    import json

    meta = json.loads((out / CONFIG_FILE).read_text())
    meta["spec"].update(format=1, qk_norm=qk_norm, attention_bias=attention_bias)
    (out / CONFIG_FILE).write_text(json.dumps(meta))


def test_format_1_drafter_with_qwen3_layers_loads_exactly(tmp_path):
    """A format-1 drafter of a Qwen3 target already had Qwen3-style layers: the same tensors, the same
    math, so it loads as it is (an exact conversion)."""
    target, drafter = make(block_size=8, layers=2, dtype=torch.float32)
    out = drafter.save(tmp_path / "old")
    _as_format_1(out, qk_norm=True)
    back = DFlashDrafter.load(out, target)
    ids, _, _, ctx = rand_batch(target, [40])
    anchors = torch.tensor([LEAK_ANCHORS])
    with torch.no_grad():
        assert torch.equal(back.block_logits(ctx, ids, anchors), drafter.block_logits(ctx, ids, anchors))
    assert back.spec == drafter.spec


@pytest.mark.parametrize("qk_norm, bias", [(False, False), (True, True)])
def test_format_1_drafter_with_family_layers_is_refused_with_one_line(tmp_path, qk_norm, bias):
    from dflash.model.drafter import DrafterFormatError

    target, drafter = make(dtype=torch.float32)
    out = drafter.save(tmp_path / "old")
    _as_format_1(out, qk_norm=qk_norm, attention_bias=bias)
    with pytest.raises(DrafterFormatError) as err:
        DFlashDrafter.load(out, target)
    line = err.value.line()
    assert "\n" not in line and "retrain it" in line and str(out) in line


def test_draft_layers_are_qwen3_style_for_a_llama_target():
    _, drafter = make(layers=2)
    names = set(drafter.state_dict())
    for i in range(2):
        assert {f"layers.{i}.self_attn.q_norm.weight", f"layers.{i}.self_attn.k_norm.weight"} <= names
    assert not any(n.endswith(".bias") for n in names)


def test_checkpointed_layers_give_the_same_loss_and_gradients():
    """``[drafter] checkpoint_layers`` recomputes each draft layer in the backward: memory, not math."""
    target, plain = make(layers=2)
    ids, am, lm, ctx = rand_batch(target, [30, 24])
    spec = DrafterSpec(**{**plain.spec.__dict__, "checkpoint_layers": True})
    ck = DFlashDrafter.from_target(target, spec, dtype=torch.float64)
    ck.load_state_dict(plain.state_dict())
    losses, grads = [], []
    for d in (plain, ck):
        out = d.loss(ctx, ids, lm, am, generator=torch.Generator().manual_seed(2))
        out.loss_sum.backward()
        losses.append(float(out.loss_sum.detach()))
        grads.append([p.grad.clone() for p in d.trainable_parameters()])
    assert losses[0] == pytest.approx(losses[1], rel=1e-12)
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert DrafterSpec.from_target_config(target.config, target_layer_ids=LAYER_IDS, mask_token_id=MASK_ID,
                                          drafter=DrafterConfig(checkpoint_layers=True)).checkpoint_layers


def test_fuse_feeds_bf16_states_to_fc_without_a_float32_copy_of_the_item():
    """Under autocast (CPU bf16 here, CUDA's on a GPU) the received bf16 item goes to ``fc`` as it is:
    no float32 copy of the whole ``[b, S, K*d]`` item (issue 33: ~2 GB on the 8B example), and the
    result equals the old float32-then-autocast path. Without autocast the states are cast as before."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Copies(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.f32_item_copies = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.__name__.startswith("_to_copy") and isinstance(out, torch.Tensor) and \
                    out.dtype == torch.float32 and out.shape == states.shape:
                self.f32_item_copies += 1
            return out

    _, drafter = make(dtype=torch.float32)
    states = torch.randn(2, 24, len(LAYER_IDS) * drafter.spec.hidden_size).to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with Copies() as mode:
            got = drafter.fuse(states)
        old = drafter.hidden_norm(drafter.fc(states.to(torch.float32)))
    assert mode.f32_item_copies == 0
    assert torch.equal(got, old)
    with Copies() as mode:  # no autocast: fc's own dtype
        plain = drafter.fuse(states)
    assert mode.f32_item_copies == 1 and plain.dtype == torch.float32
