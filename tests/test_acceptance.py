"""Speculative decoding with a DFlash drafter: lossless output, acceptance length, held-out prompts.

Tiny random Llamas in float64 (target and drafter), so near-ties in the target's logits cannot flip
between a one-token greedy step and a block verification. An "oracle" drafter (a real
:class:`DFlashDrafter` whose ``draft_block`` returns one-hot logits of the target's true greedy
continuation, optionally wrong at chosen slots) pins the bookkeeping down exactly.
"""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch

from dflash.core.config import DrafterConfig
from dflash.data.conversations import Conversation
from dflash.model.acceptance import (
    SpecResult,
    default_eos_ids,
    evaluate_acceptance,
    greedy_generate,
    heldout_prompts,
    render_prompt,
    select_heldout,
    speculative_generate,
)
from dflash.model.drafter import DFlashDrafter, DrafterSpec
from dflash.model.target import HiddenStateCapture, LoadedTarget
from tests.tiny_models import tiny_llama

VOCAB = 512
LAYER_IDS = (1, 3)
MASK_ID = 4
DT = torch.float64


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def target():
    # init_std 0.3: varied greedy continuations (at 0.02 a tied tiny Llama repeats one token forever)
    return tiny_llama(seed=0, dtype=DT, vocab_size=VOCAB, init_std=0.3)


def make_spec(target, block_size: int) -> DrafterSpec:
    return DrafterSpec.from_target_config(target.config, target_layer_ids=LAYER_IDS, mask_token_id=MASK_ID,
                                          drafter=DrafterConfig(layers=1, block_size=block_size))


def untrained(target, block_size: int, seed: int = 1) -> DFlashDrafter:
    torch.manual_seed(seed)
    return DFlashDrafter.from_target(target, make_spec(target, block_size), dtype=DT)


def prompts(n: int, length: int = 12, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, VOCAB, (length + 3 * i,), generator=g) for i in range(n)]


class OracleDrafter(DFlashDrafter):
    """Proposes the target's greedy continuation ``sequence`` (prompt + reference tokens); slot ``k``
    of the block at ``position`` is made wrong when ``wrong(position, k)``. Checks on every call that
    the context covers exactly the positions before the anchor and, with ``capture``, that it equals
    the target's captured states of the true sequence."""

    def setup(self, sequence: list[int], wrong=None, capture: HiddenStateCapture | None = None) -> OracleDrafter:
        self.sequence = list(sequence)
        self.wrong = wrong or (lambda position, k: False)
        self.capture = capture
        self.calls = 0
        return self

    def draft_block(self, context_states, anchor_token, position=None):
        self.calls += 1
        b, c, _ = context_states.shape
        assert b == 1 and c == position, (c, position)
        assert int(anchor_token) == self.sequence[position]
        if self.capture is not None:
            full = self.capture(torch.tensor(self.sequence[:position])[None])
            torch.testing.assert_close(context_states, full, rtol=1e-9, atol=1e-9)
        bs, v = self.spec.block_size, self.spec.vocab_size
        out = torch.zeros(1, bs - 1, v, dtype=self.dtype)
        for k in range(1, bs):
            p = position + k
            tok = self.sequence[p] if p < len(self.sequence) else self.spec.mask_token_id
            if self.wrong(position, k):
                tok = (tok + 1) % v
            out[0, k - 1, tok] = 1.0
        return out


def oracle(target, block_size: int, prompt: torch.Tensor, n_tokens: int, **kw) -> OracleDrafter:
    ref = greedy_generate(target, prompt, n_tokens)
    torch.manual_seed(0)
    d = OracleDrafter.from_target(target, make_spec(target, block_size), dtype=DT)
    return d.setup(prompt.tolist() + ref, **kw)


def non_increasing(xs) -> bool:
    return all(x >= y for x, y in itertools.pairwise(xs))


def check_invariants(res: SpecResult, block_size: int) -> None:
    assert len(res.produced) == len(res.accepted) == res.steps
    if res.steps:
        assert 1 + sum(res.produced) == len(res.tokens)
    assert all(0 <= a <= block_size - 1 for a in res.accepted)
    assert all(1 <= p <= block_size for p in res.produced)
    assert len(res.position_accepted) == len(res.position_attempts) == block_size - 1
    for k in range(block_size - 1):
        assert res.position_accepted[k] == sum(a > k for a in res.accepted)
        assert res.position_accepted[k] <= res.position_attempts[k] <= res.steps
    rates = res.acceptance_rates
    assert all(0.0 <= r <= 1.0 for r in rates)
    assert non_increasing(rates)


# --------------------------------------------------------------------------- the reference
def test_greedy_generate_matches_transformers_generate(target):
    for p in prompts(2):
        ref = greedy_generate(target, p, 24)
        out = target.generate(p[None], max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert out[0, p.numel():].tolist() == ref
        assert greedy_generate(target, p, 24, use_cache=False) == ref
        assert len(set(ref)) > 5  # a varied continuation, not one repeated token


# --------------------------------------------------------------------------- lossless
@pytest.mark.parametrize("block_size", [2, 4, 8, 16])
def test_untrained_drafter_output_equals_target_greedy(target, block_size):
    drafter = untrained(target, block_size)
    for p in prompts(3):
        ref = greedy_generate(target, p, 40)
        res = speculative_generate(target, drafter, p, 40)
        assert res.tokens == ref
        check_invariants(res, block_size)


def test_full_forward_path_equals_kv_cache_path(target):
    drafter = untrained(target, 4)
    for p in prompts(2):
        a = speculative_generate(target, drafter, p, 30)
        b = speculative_generate(target, drafter, p, 30, use_cache=False)
        assert a.tokens == b.tokens == greedy_generate(target, p, 30)
        assert a.accepted == b.accepted


@pytest.mark.parametrize("block_size", [2, 5, 8])
def test_perfect_drafter_accepts_every_proposal(target, block_size):
    for i, p in enumerate(prompts(2)):
        n = 1 + 5 * block_size  # the prefill token, then five whole blocks
        capture = HiddenStateCapture(target, LAYER_IDS) if i == 0 else None
        d = oracle(target, block_size, p, n, capture=capture)
        res = speculative_generate(target, d, p, n)
        assert res.tokens == greedy_generate(target, p, n)
        assert res.accepted == [block_size - 1] * 5
        assert res.tau == block_size
        assert res.acceptance_rates == [1.0] * (block_size - 1)
        check_invariants(res, block_size)
        # a budget that ends mid-block: only the last step is short
        res = speculative_generate(target, d, p, n - 2)
        assert res.tokens == greedy_generate(target, p, n - 2)
        assert all(x == block_size for x in res.produced[:-1]) and res.produced[-1] <= block_size
        check_invariants(res, block_size)


@pytest.mark.parametrize("good", [0, 1, 3])
def test_drafter_right_up_to_a_slot(target, good):
    bs = 6
    p = prompts(1)[0]
    n = 1 + 6 * (good + 1)
    d = oracle(target, bs, p, n, wrong=lambda position, k: k > good)
    res = speculative_generate(target, d, p, n)
    assert res.tokens == greedy_generate(target, p, n)
    assert res.accepted == [good] * 6 and res.produced == [good + 1] * 6
    assert res.tau == good + 1
    assert res.acceptance_rates == [1.0] * good + [0.0] * (bs - 1 - good)
    assert res.conditional_acceptance_rates[:good] == [1.0] * good
    if good < bs - 1:
        assert res.conditional_acceptance_rates[good] == 0.0
    check_invariants(res, bs)


def test_noisy_drafter_rates_are_monotone_and_bounded(target):
    bs = 8
    ps = prompts(3, seed=3)
    n = 60
    rng = torch.Generator().manual_seed(7)
    table = (torch.rand(4096, bs, generator=rng) < 0.25).tolist()  # wrong with probability 1/4 per slot

    results = []
    for p in ps:
        d = oracle(target, bs, p, n, wrong=lambda position, k: table[position][k])
        res = speculative_generate(target, d, p, n)
        assert res.tokens == greedy_generate(target, p, n)
        check_invariants(res, bs)
        results.append(res)
    rates = [sum(r.position_accepted[k] for r in results) / sum(r.steps for r in results) for k in range(bs - 1)]
    assert 0.5 < rates[0] < 0.95 and rates[-1] < rates[0]
    tau = sum(sum(r.produced) for r in results) / sum(r.steps for r in results)
    assert 1.5 < tau < bs
    assert sum(rates) == pytest.approx(tau - 1)  # no EOS: every step emits accepted + 1


# --------------------------------------------------------------------------- EOS and budgets
def first_occurrences(seq: list[int]) -> list[int]:
    seen: set[int] = set()
    out = []
    for i, t in enumerate(seq):
        if t not in seen:
            out.append(i)
            seen.add(t)
    return out


@pytest.mark.parametrize("where", ["proposal", "bonus"])
def test_eos_stops_generation_inside_or_at_the_end_of_a_block(target, where):
    bs = 4
    p = prompts(1, seed=5)[0]
    free = greedy_generate(target, p, 40)
    # with a perfect drafter, step s emits tokens (s-1)*bs+1 .. s*bs; the last one is the bonus
    idx = next(i for i in first_occurrences(free)
               if i > bs and (i % bs == 0) == (where == "bonus"))
    eos = free[idx]
    ref = greedy_generate(target, p, 40, eos_token_id=eos)
    assert ref == free[: idx + 1]
    d = oracle(target, bs, p, 40)
    res = speculative_generate(target, d, p, 40, eos_token_id=[eos, VOCAB + 7])
    assert res.tokens == ref
    check_invariants(res, bs)
    if where == "proposal":
        assert res.produced[-1] == res.accepted[-1] == idx % bs  # accepted EOS, no bonus after it
    res = speculative_generate(target, untrained(target, bs), p, 40, eos_token_id=eos)
    assert res.tokens == ref


def test_tiny_budgets_and_prompt_shapes(target):
    d = untrained(target, 4)
    p = prompts(1)[0]
    empty = speculative_generate(target, d, p, 0)
    assert empty.tokens == [] and empty.steps == 0 and math.isnan(empty.tau)
    one = speculative_generate(target, d, p, 1)
    assert one.tokens == greedy_generate(target, p, 1) and one.steps == 0
    two = speculative_generate(target, d, p[None], 2)  # [1, n] is accepted too
    assert two.tokens == greedy_generate(target, p, 2) and two.steps == 1 and two.produced == [1]
    assert greedy_generate(target, p, 0) == []
    with pytest.raises(ValueError):
        speculative_generate(target, d, torch.tensor([], dtype=torch.long), 4)
    with pytest.raises(ValueError):
        speculative_generate(target, d, p, -1)


# --------------------------------------------------------------------------- tau
def test_untrained_drafter_scores_tau_close_to_one(target):
    drafter = untrained(target, 8)
    lt = LoadedTarget(model=target, tokenizer=None, source="tiny", cache_hit=False, load_s=0.0)
    out = evaluate_acceptance(lt, drafter, prompts(4, seed=11), max_new_tokens=40, stop_at_eos=False,
                              compare_greedy=True)
    assert out["matches_greedy"] == out["num_prompts"] == 4
    assert 1.0 <= out["tau"] < 1.3
    assert all(1.0 <= t < 1.5 for t in out["tau_per_prompt"])
    rates = out["acceptance_rate_per_position"]
    assert len(rates) == 7 and all(0.0 <= r <= 1.0 for r in rates)
    assert non_increasing(rates)
    assert out["new_tokens"] == 4 * 40 and out["tokens_per_s"] > 0 and out["block_size"] == 8
    assert out["steps"] == out["new_tokens"] - 4 - sum(out["position_accepted"])  # 1 + accepted per step
    assert sum(out["steps_per_prompt"]) == out["steps"]
    assert sum(out["produced_per_prompt"]) / out["steps"] == pytest.approx(out["tau"])
    lo, hi = out["tau_ci95"]
    assert lo <= out["tau"] <= hi and min(out["tau_per_prompt"]) <= lo
    json.dumps(out)  # JSON-ready


def test_evaluate_uses_the_targets_eos_by_default(target):
    lt = LoadedTarget(model=target, tokenizer=None, source="tiny", cache_hit=False, load_s=0.0)
    assert default_eos_ids(lt) == {2}
    p = prompts(1, seed=5)[0]
    free = greedy_generate(target, p, 40)
    eos = free[first_occurrences(free)[3]]
    drafter = untrained(target, 4)
    out = evaluate_acceptance(lt, drafter, [p], max_new_tokens=40, eos_token_id=eos, compare_greedy=True)
    assert out["matches_greedy"] == 1 and out["new_tokens"] == free.index(eos) + 1


# --------------------------------------------------------------------------- held-out prompts
@pytest.fixture(scope="module")
def smol_tok():
    from dflash.data.lengths import load_tokenizer

    return load_tokenizer("smollm2")


def write_dataset(path):
    records = [
        {"id": f"c{i}", "conversations": [{"from": "human", "value": f"Question number {i}?"},
                                          {"from": "gpt", "value": f"Answer {i}."}]}
        for i in range(12)
    ]
    records.append({"id": "long", "conversations": [{"from": "human", "value": "word " * 2000},
                                                    {"from": "gpt", "value": "ok"}]})
    records.append({"id": "empty", "conversations": [{"from": "human", "value": "  "},
                                                     {"from": "gpt", "value": "ok"}]})
    records.append({"id": "gpt-first", "conversations": [{"from": "gpt", "value": "hi"},
                                                         {"from": "human", "value": "x"}]})
    path.write_text("\n".join(json.dumps(r) for r in records), encoding="utf-8")
    return path


def test_heldout_prompts_are_deterministic_skip_ids_and_fit(tmp_path, smol_tok):
    data = write_dataset(tmp_path / "d.jsonl")
    a = heldout_prompts(smol_tok, 5, seed=3, dataset=str(data), max_prompt_tokens=64)
    b = heldout_prompts(smol_tok, 5, seed=3, dataset=str(data), max_prompt_tokens=64)
    assert [x.tolist() for x in a] == [x.tolist() for x in b]
    gen = smol_tok("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    for x in a:
        assert x.dim() == 1 and x.dtype == torch.long and 0 < x.numel() <= 64
        assert x.tolist()[-len(gen):] == gen  # ends with the generation prompt
        assert "<|im_start|>user\n" in smol_tok.decode(x)

    from dflash.data.conversations import load_conversations

    convs, _ = load_conversations(data, "first_exchange")
    assert len(convs) == 14  # gpt-first is skipped by the sample rule
    chosen = select_heldout(convs, 5, 3)
    assert chosen == select_heldout(convs, 5, 3) and "empty" not in {c.id for c in chosen}
    skip = {c.id for c in chosen}
    other = select_heldout(convs, 5, 3, skip_ids=skip)
    assert not skip & {c.id for c in other}
    c = select_heldout(convs, 13, 0)  # every eligible one (13: "empty" has no text)
    assert {x.id for x in c} == {f"c{i}" for i in range(12)} | {"long"}
    with pytest.raises(ValueError):
        select_heldout(convs, 14, 0)

    long = next(x for x in convs if x.id == "long")
    ids = render_prompt(smol_tok, long, 64)
    assert ids.numel() <= 64 and ids.numel() >= 60  # cut to (nearly) the budget
    text = smol_tok.decode(ids)
    assert text.startswith("<|im_start|>system") and text.endswith("<|im_start|>assistant\n")
    short = render_prompt(smol_tok, Conversation("s", (("user", "Hi"), ("assistant", "Hello"))), 64)
    assert smol_tok.decode(short).endswith("user\nHi<|im_end|>\n<|im_start|>assistant\n")
    multi = Conversation("m", (("user", "one " * 100), ("assistant", "a"), ("user", "two"), ("assistant", "b")))
    text = smol_tok.decode(render_prompt(smol_tok, multi, 64))  # earlier turns dropped first
    assert "two<|im_end|>" in text and "one" not in text
    with pytest.raises(ValueError):
        render_prompt(smol_tok, Conversation("s", (("user", "Hi"),)), 5)


# --------------------------------------------------------------------------- the real target
@pytest.mark.slow
def test_smollm2_untrained_drafter_is_lossless_and_tau_near_one(smol_tok):
    from dflash.model.drafter import default_mask_token_id
    from dflash.model.target import capture_layer_ids, load_target

    lt = load_target("smollm2", dtype=torch.float64)  # float64: no near-tie can flip
    spec = DrafterSpec.from_target_config(lt.config, target_layer_ids=capture_layer_ids(lt.num_layers, 5),
                                          mask_token_id=default_mask_token_id(lt.tokenizer),
                                          drafter=DrafterConfig(block_size=8))
    torch.manual_seed(0)
    drafter = DFlashDrafter.from_target(lt.model, spec, dtype=torch.float64)
    ps = heldout_prompts(lt.tokenizer, 3, seed=0)
    assert len(ps) == 3 and all(p.numel() <= 256 for p in ps)
    out = evaluate_acceptance(lt, drafter, ps, max_new_tokens=32, compare_greedy=True)
    assert out["matches_greedy"] == 3, out
    assert 1.0 <= out["tau"] <= 1.5, out
    assert out["steps"] > 0 and out["tokens_per_s"] > 0
    rates = out["acceptance_rate_per_position"]
    assert all(0.0 <= r <= 1.0 for r in rates) and non_increasing(rates)
