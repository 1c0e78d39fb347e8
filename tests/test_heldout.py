"""The held-out quality metric (issue #27): the serving walk, and its agreement with real speculative decoding.

The agreement is checked on data the target generated greedily, with a drafter half way through
learning those sequences (tau well above 1 and below the block size), where a wrong shift between
drafted slots and the target's tokens, or a wrong walk, would put the two figures far apart.
"""

from __future__ import annotations

import pytest
import torch

from dflash.core.config import DrafterConfig
from dflash.model.acceptance import evaluate_acceptance, greedy_generate
from dflash.model.drafter import DFlashDrafter, DrafterSpec
from dflash.model.heldout import (
    heldout_fingerprint,
    load_heldout,
    prepare_heldout,
    save_heldout,
    score_heldout,
    serving_walk,
    window_anchors,
)
from dflash.model.target import HiddenStateCapture, LoadedTarget
from tests.tiny_models import tiny_llama

VOCAB, LAYER_IDS, BLOCK, PROMPT, NEW, WINDOW = 256, (1, 3), 8, 6, 33, 24


@pytest.mark.parametrize(("lengths", "walk"), [
    ([1] * 6, (6, 6)),  # nothing accepted: one token per block
    ([8] * 6, (6, 1)),  # the first block would run past the window: cut to its 6 tokens
    ([3, 1, 1, 2, 1, 1], (6, 3)),  # 0 -> 3 -> 5 (cut to 1)
    ([2, 5, 1, 1, 1, 1], (6, 5)),  # 0 -> 2 -> 3 -> 4 -> 5: the long block at 1 is never visited
])
def test_the_serving_walk_visits_only_where_the_blocks_land(lengths: list[int], walk: tuple[int, int]) -> None:
    assert serving_walk(list(range(10, 16)), lengths) == walk


def test_the_walk_stops_at_a_gap_in_the_window() -> None:
    assert serving_walk([10, 11, 14, 15], [1, 2, 1, 1]) == (3, 2)  # 10 -> 11 -> 13: not an anchor
    assert serving_walk([], []) == (0, 0)


@pytest.fixture(scope="module")
def greedy_data():
    """A tiny target, 12 prompts and the target's own greedy continuations (as `dflash regenerate` makes)."""
    target = tiny_llama(seed=0, vocab_size=VOCAB, init_std=0.2)
    g = torch.Generator().manual_seed(1)
    seqs = []
    for _ in range(12):
        p = torch.randint(5, VOCAB, (PROMPT,), generator=g)
        ids = torch.tensor(p.tolist() + greedy_generate(target, p, NEW))
        lm = torch.zeros(len(ids), dtype=torch.bool)
        lm[PROMPT:] = True
        seqs.append((p, ids, lm))
    return target, seqs


def test_held_out_tau_agrees_with_dflash_eval_on_greedy_data(greedy_data, tmp_path) -> None:
    target, seqs = greedy_data
    spec = DrafterSpec.from_target_config(target.config, target_layer_ids=LAYER_IDS, mask_token_id=4,
                                          drafter=DrafterConfig(layers=1, block_size=BLOCK, anchors=32))
    torch.manual_seed(1)
    drafter = DFlashDrafter.from_target(target, spec)
    capture = HiddenStateCapture(target, LAYER_IDS)
    states = prepare_heldout(target, capture, [(i, f"c{i}", i % 2, ids, lm) for i, (_, ids, lm) in enumerate(seqs)],
                             2, "cpu", torch.float32)
    assert all(torch.equal(s.greedy[PROMPT - 1:-1], s.input_ids[PROMPT:]) for s in states.sequences)  # greedy data
    assert [int(window_anchors(s, BLOCK, WINDOW)[0]) for s in states.sequences] == [PROMPT] * 12

    ids = torch.stack([s[1] for s in seqs])
    lm = torch.stack([s[2] for s in seqs])
    with torch.no_grad():
        ctx = capture(ids, torch.ones_like(ids))
    opt = torch.optim.AdamW(drafter.trainable_parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(2)
    for _ in range(40):  # half way to memorising the sequences: tau between 1 and the block size
        loss = drafter.loss(ctx, ids, lm, torch.ones_like(ids), generator=g).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()

    held = score_heldout(drafter, states, anchors=WINDOW)
    served = evaluate_acceptance(LoadedTarget(target, None, "tiny", False, 0.0), drafter, [s[0] for s in seqs],
                                 max_new_tokens=WINDOW + 1, stop_at_eos=False)
    assert 1.5 < served["tau"] < BLOCK - 1
    assert held["tau"] == pytest.approx(served["tau"], abs=0.02), (held, served["tau"])
    lo, hi = held["tau_ci"]
    assert lo <= served["tau"] <= hi and served["tau_ci95"][0] <= held["tau"] <= served["tau_ci95"][1]
    assert held["blocks"] == 12 * WINDOW and [b["sequences"] for b in held["per_bucket"]] == [6, 6]
    assert held["loss_ci"][0] <= held["loss"] <= held["loss_ci"][1]

    fp = heldout_fingerprint(range(12), "tiny", LAYER_IDS)
    save_heldout(tmp_path / "states.pt", states, fp)
    again = load_heldout(tmp_path / "states.pt", fp)
    assert again is not None and score_heldout(drafter, again, anchors=WINDOW) == held
    assert load_heldout(tmp_path / "states.pt", heldout_fingerprint(range(12), "tiny", (1, 2))) is None
