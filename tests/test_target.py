"""Target side: capture layer rule, truncated hidden-state capture, conversation loss masks."""

from __future__ import annotations

import time

import pytest
import torch

from dflash.data.conversations import Conversation
from dflash.model.target import (
    HiddenStateCapture,
    assistant_char_spans,
    capture_layer_ids,
    collate,
    encode_conversation,
)
from tests.tiny_models import tiny_llama


@pytest.fixture(scope="module")
def smol_tok():
    from dflash.data.model_source import load_tokenizer

    return load_tokenizer("smollm2")


# --------------------------------------------------------------------------- layer ids
def test_capture_layer_ids_published_values():
    assert capture_layer_ids(30, 5) == [1, 8, 14, 20, 27]  # SmolLM2
    assert capture_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B


def test_capture_layer_ids_rule_and_edges():
    for n_layers in range(4, 65):
        for k in range(2, min(n_layers - 3, 8) + 1):
            ids = capture_layer_ids(n_layers, k)
            assert ids == [round(1 + i * (n_layers - 4) / (k - 1)) for i in range(k)]
            assert ids[0] == 1 and ids[-1] == n_layers - 3
            assert ids == sorted(set(ids))
    assert capture_layer_ids(30, 1) == [15]  # upstream build_target_layer_ids: L // 2
    assert capture_layer_ids(6, 1) == [3]
    with pytest.raises(ValueError):
        capture_layer_ids(6, 4)  # only layers 1..3 are in range
    with pytest.raises(ValueError):
        capture_layer_ids(30, 0)


# --------------------------------------------------------------------------- capture
def _batch(vocab=256, lengths=(20, 13, 7), seed=1):
    g = torch.Generator().manual_seed(seed)
    s = max(lengths)
    ids = torch.randint(3, vocab, (len(lengths), s), generator=g)
    am = torch.zeros(len(lengths), s, dtype=torch.long)
    for r, n in enumerate(lengths):
        am[r, :n] = 1
        ids[r, n:] = 0
    return ids, am


@pytest.mark.parametrize("layer_ids", [[1, 3], [0, 2, 4], [5], [1, 2, 3, 4, 5]])
def test_capture_equals_full_forward_hidden_states(layer_ids):
    model = tiny_llama()
    ids, am = _batch()
    got = HiddenStateCapture(model, layer_ids)(ids, am)
    with torch.no_grad():
        hs = model(input_ids=ids, attention_mask=am, output_hidden_states=True).hidden_states
    # The deepest layer's output of a full forward is post-norm only for the LAST layer (index L);
    # capture ids stop at L-3 in practice, and id 5 of 6 layers is index 6 = the normed one: skip it.
    ref_ids = [i for i in layer_ids if i + 1 < len(hs) - 1]
    d = model.config.hidden_size
    assert got.shape == (ids.shape[0], ids.shape[1], len(layer_ids) * d)
    assert not got.requires_grad and not got.is_inference()  # usable as input to autograd
    for slot, lid in enumerate(layer_ids):
        if lid in ref_ids:
            torch.testing.assert_close(got[..., slot * d:(slot + 1) * d], hs[lid + 1], rtol=0, atol=1e-6)


def test_capture_padding_does_not_change_real_positions():
    model = tiny_llama()
    ids, am = _batch(lengths=(20, 9))
    cap = HiddenStateCapture(model, [1, 3])
    both = cap(ids, am)
    alone = cap(ids[1:2, :9], am[1:2, :9])
    torch.testing.assert_close(both[1, :9], alone[0], rtol=1e-5, atol=1e-5)


def test_capture_runs_no_layer_beyond_the_deepest_and_no_head():
    model = tiny_llama()
    calls: list[str] = []
    handles = [layer.register_forward_hook(lambda *_a, i=i: calls.append(f"layer{i}"))
               for i, layer in enumerate(model.model.layers)]
    handles.append(model.model.norm.register_forward_hook(lambda *_a: calls.append("norm")))
    handles.append(model.lm_head.register_forward_hook(lambda *_a: calls.append("lm_head")))
    try:
        ids, am = _batch()
        cap = HiddenStateCapture(model, [1, 3])
        cap(ids, am)
        assert calls == ["layer0", "layer1", "layer2", "layer3"]
        assert cap.num_layers_run == 4
        # hooks are removed afterwards: a normal forward still runs everything
        calls.clear()
        with torch.no_grad():
            model(input_ids=ids, attention_mask=am)
        assert calls[-2:] == ["norm", "lm_head"] and "layer5" in calls
    finally:
        for h in handles:
            h.remove()
    assert all(len(layer._forward_hooks) == 0 for layer in model.model.layers)


def test_capture_rejects_bad_layer_ids():
    model = tiny_llama()
    with pytest.raises(ValueError):
        HiddenStateCapture(model, [6])
    with pytest.raises(ValueError):
        HiddenStateCapture(model, [])
    with pytest.raises(ValueError):
        HiddenStateCapture(model, [2, 2])


def test_capture_is_confined_to_its_thread():
    """A forward on the same model in another thread is neither cut short nor mixed in."""
    import threading

    model = tiny_llama()
    ids, am = _batch()
    cap = HiddenStateCapture(model, [1, 3])
    ref = cap(ids, am)
    with torch.no_grad():
        ref_logits = model(input_ids=ids, attention_mask=am).logits
    errors: list[BaseException] = []

    def full_forwards():
        try:
            for _ in range(30):
                with torch.no_grad():
                    out = model(input_ids=ids, attention_mask=am).logits
                torch.testing.assert_close(out, ref_logits)
        except BaseException as exc:  # reported below
            errors.append(exc)

    t = threading.Thread(target=full_forwards)
    t.start()
    for _ in range(30):
        torch.testing.assert_close(cap(ids, am), ref)
    t.join()
    assert not errors, errors[0]


def test_load_target_from_a_local_directory(tmp_path, smol_tok):
    from dflash.model.target import load_target

    tiny_llama(vocab_size=len(smol_tok)).save_pretrained(tmp_path / "m")
    smol_tok.save_pretrained(tmp_path / "m")
    lt = load_target(str(tmp_path / "m"), dtype=torch.bfloat16, cache_dir=tmp_path / "cache")
    assert lt.num_layers == 6 and lt.hidden_size == 64 and not lt.cache_hit
    assert lt.model.dtype == torch.bfloat16 and not lt.model.training
    assert not any(p.requires_grad for p in lt.model.parameters())
    assert lt.tokenizer.chat_template == smol_tok.chat_template


# --------------------------------------------------------------------------- loss masks
MSGS = [("user", "Hi there"), ("assistant", "Hello! How can I help?"),
        ("user", "What is 2+2?"), ("assistant", "It is 4.\nAnything else?")]


def test_loss_mask_covers_exactly_the_assistant_responses(smol_tok):
    tok = smol_tok
    ids, mask = encode_conversation(tok, MSGS)
    assert ids.dtype == torch.long and mask.dtype == torch.bool and ids.shape == mask.shape
    # ids equal apply_chat_template's own tokenisation (so lengths agree with dflash.data.lengths)
    msgs = [{"role": r, "content": c} for r, c in MSGS]
    ref = tok.apply_chat_template(msgs, tokenize=True)
    ref = ref["input_ids"] if not isinstance(ref, list) else ref
    assert ids.tolist() == list(ref)
    # the masked tokens, run by run, decode to exactly the responses + end-of-turn
    runs, cur = [], []
    for t, m in zip(ids.tolist(), mask.tolist()):
        if m:
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    assert [tok.decode(r) for r in runs] == ["Hello! How can I help?<|im_end|>",
                                              "It is 4.\nAnything else?<|im_end|>"]
    # and nothing of the system/user turns or the assistant header is masked
    unmasked = tok.decode([t for t, m in zip(ids.tolist(), mask.tolist()) if not m])
    assert "Hi there" in unmasked and "What is 2+2?" in unmasked and "Hello" not in unmasked
    assert unmasked.count("<|im_start|>assistant\n") == 2


def test_loss_mask_conversation_object_system_turn_and_truncation(smol_tok):
    conv = Conversation("c1", (("system", "Be brief."), ("user", "Name a colour."), ("assistant", "Blue.")))
    ids, mask = encode_conversation(smol_tok, conv)
    assert smol_tok.decode(ids[mask].tolist()) == "Blue.<|im_end|>"
    assert "Be brief." in smol_tok.decode(ids.tolist())
    short_ids, short_mask = encode_conversation(smol_tok, conv, max_len=10)
    assert short_ids.tolist() == ids[:10].tolist() and short_mask.tolist() == mask[:10].tolist()
    with pytest.raises(ValueError):
        encode_conversation(smol_tok, conv, max_len=0)


def test_assistant_spans_fallback_when_template_rewrites_history(smol_tok):
    class Rewriting:
        """A template whose rendering of a prefix is not a prefix of the whole conversation."""

        eos_token = "<|im_end|>"

        def apply_chat_template(self, msgs, tokenize=False, add_generation_prompt=False):
            text = "".join(f"[{m['role']}:{len(msgs)}]{m['content']}<|im_end|>" for m in msgs)
            return text + ("[assistant]" if add_generation_prompt else "")

    text, spans = assistant_char_spans(Rewriting(), MSGS)
    assert [text[a:b] for a, b in spans] == ["Hello! How can I help?<|im_end|>",
                                             "It is 4.\nAnything else?<|im_end|>"]


def test_collate_right_pads(smol_tok):
    a = encode_conversation(smol_tok, MSGS)
    b = encode_conversation(smol_tok, MSGS[:2])
    ids, am, lm = collate([a, b], pad_id=2)
    assert ids.shape == (2, a[0].numel())
    n = b[0].numel()
    assert am[1].tolist() == [1] * n + [0] * (ids.shape[1] - n)
    assert ids[1, n:].eq(2).all() and not lm[1, n:].any()
    assert lm[0].tolist() == a[1].tolist()


# --------------------------------------------------------------------------- the real target
@pytest.mark.slow
def test_packaged_smollm2_loads_generates_and_caches(tmp_path):
    from dflash.model.target import load_target

    first = load_target("smollm2", cache_dir=tmp_path)
    model, tok = first.model, first.tokenizer
    assert not first.cache_hit
    assert first.num_layers == 30 and first.hidden_size == 576
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=20, do_sample=False)
    answer = tok.decode(out[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer
    # capture on the real model equals its full forward's hidden states
    layer_ids = capture_layer_ids(30, 5)
    got = HiddenStateCapture(model, layer_ids)(prompt["input_ids"], prompt["attention_mask"])
    with torch.no_grad():
        hs = model(**prompt, output_hidden_states=True).hidden_states
    ref = torch.cat([hs[i + 1] for i in layer_ids], dim=-1)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4)

    t0 = time.perf_counter()
    second = load_target("smollm2", cache_dir=tmp_path)
    cached_s = time.perf_counter() - t0
    assert second.cache_hit
    print(f"load: first {first.load_s:.2f} s, cached {cached_s:.2f} s")  # speed is a benchmark's, not an assertion
    for (n1, p1), (n2, p2) in zip(model.state_dict().items(), second.model.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2)


@pytest.mark.parametrize("tie, shard", [(False, "40KB"), (True, None)], ids=["untied-sharded", "tied-one-file"])
def test_a_drafter_rank_reads_only_the_embedding_and_head_from_the_checkpoint(tmp_path, tie, shard):
    """load_target_tables: the two tables equal the whole model's (read from several shards, or one
    file with the head tied to the embedding), and nothing else of the target is in memory."""
    import shutil

    from dflash.gpucheck.assets import build_random_target
    from dflash.model.drafter import DFlashDrafter, DrafterSpec
    from dflash.model.target import TargetTables, load_target_tables
    from tests.tiny_models import tiny_llama

    tok_dir = build_random_target(tmp_path / "tok", "tiny")  # a word-level tokenizer (and a model we replace)
    full = tiny_llama(seed=3, vocab_size=512, tie=tie)
    d = tmp_path / "ckpt"
    full.save_pretrained(d, **({"max_shard_size": shard} if shard else {}))
    for f in tok_dir.iterdir():
        if "token" in f.name or f.name.endswith(".jinja"):
            shutil.copy(f, d / f.name)
    assert (d / "model.safetensors.index.json").is_file() == bool(shard)
    got = load_target_tables(str(d), dtype=torch.float32)
    assert got is not None and isinstance(got.model, TargetTables)
    assert torch.equal(got.model.get_input_embeddings().weight, full.get_input_embeddings().weight)
    assert torch.equal(got.model.get_output_embeddings().weight, full.get_output_embeddings().weight)
    assert (got.model.lm_head.weight is got.model.embed_tokens.weight) == tie
    held = sum(p.numel() for p in got.model.parameters())  # one table when tied
    assert held == (1 if tie else 2) * 512 * 64 < sum(p.numel() for p in full.parameters())
    assert got.num_layers == 6 and got.tokenizer is not None
    spec = DrafterSpec.from_target_config(got.config, target_layer_ids=(1, 3), mask_token_id=7)
    DFlashDrafter.from_target(got.model, spec, dtype=torch.float32)  # the drafter builds on the tables alone


def test_only_the_host_drafter_rank_with_eval_every_holds_the_whole_target():
    from dflash.core.config import config_from_dict
    from dflash.pipeline.rank import needs_whole_target

    on, off = config_from_dict({"train": {"eval_every": 50}}), config_from_dict({})
    assert needs_whole_target(on, is_host_drafter=True)
    assert not needs_whole_target(on, is_host_drafter=False) and not needs_whole_target(off, is_host_drafter=True)
