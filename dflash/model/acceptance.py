"""Real speculative decoding with a DFlash drafter, and its acceptance length tau.

Greedy and lossless: the target alone decides every token, the drafter only proposes.

* **Prefill.** One target forward over the prompt (``output_hidden_states=True``) gives the first
  new token (the target's greedy choice: the first *anchor*) and the captured context states of
  the prompt positions: the outputs of the drafter's ``spec.target_layer_ids``, read as
  ``hidden_states[id + 1]`` and concatenated, exactly what :class:`dflash.model.target.HiddenStateCapture`
  returns in training.
* **Step.** With the anchor at position ``p`` and context states of positions ``0..p-1``, the
  drafter proposes ``B - 1`` tokens (``draft_block(...).argmax(-1)``). One target forward over
  ``[anchor, proposals]`` verifies them: proposal ``k`` is accepted iff proposals ``1..k`` all equal
  the target's greedy predictions; then the target's own prediction after the last accepted token
  (the *bonus*) is appended and becomes the next anchor. A step emits ``accepted + 1`` tokens, so
  the output is token for token the target's own greedy output, whatever the drafter proposes.
* **Context states.** The verification forward's hidden states of the anchor and the accepted
  proposals are appended to the context (the positions that just became part of the sequence);
  the rejected ones are dropped. With the KV cache (default) the target's cache is cropped back to
  the accepted length after each step, so every target forward sees only new tokens. With
  ``use_cache=False`` each step re-runs the target over the whole sequence (quadratic; a simple
  reference path that the tests compare against).

**Measures.** tau = tokens emitted per verification step (accepted proposals + the bonus),
averaged over steps; the first token, which comes from the prefill, belongs to no step. Near
``max_new_tokens`` a step checks only the proposals that could still be emitted, and an accepted
EOS ends the step without a bonus, so the last step of a sequence may emit fewer than ``B`` tokens
even with a perfect drafter. Per block position ``k = 1..B-1``: ``position_accepted[k-1]`` counts
steps whose proposal ``k`` was accepted together with all before it, ``position_attempts[k-1]``
steps where proposal ``k`` was checked (all before it accepted). The *acceptance rate* at ``k`` is
``position_accepted[k-1] / steps`` (non-increasing in ``k`` by construction; the sum over ``k`` is
``tau - 1`` when no step is cut short); the *conditional* rate is
``position_accepted / position_attempts``.
"""

from __future__ import annotations

import inspect
import math
import random
import time
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dflash.core.stats import ratio_bootstrap_ci
from dflash.data.conversations import Conversation, load_conversations, resolve_dataset, say_damaged

EosLike = int | Collection[int] | None

DEFAULT_MAX_PROMPT_TOKENS = 256


# --------------------------------------------------------------------------- results
@dataclass(frozen=True)
class SpecResult:
    """One prompt's speculative generation.

    ``tokens``: the generated tokens (prompt excluded; equal to the target's greedy output).
    ``accepted``: per verification step, how many proposals were accepted (0..B-1).
    ``produced``: per step, tokens emitted (``accepted + 1``, or ``accepted`` when an accepted EOS
    ended the sequence inside the block); ``1 + sum(produced) == len(tokens)`` when a step ran.
    ``position_accepted`` / ``position_attempts``: ``[B-1]`` counts per block position (module
    docstring). Times in seconds: ``prefill_s`` (first target forward), ``draft_s`` (drafter),
    ``verify_s`` (verification forwards), ``elapsed_s`` (the whole call).
    """

    tokens: list[int]
    accepted: list[int]
    produced: list[int]
    block_size: int
    position_accepted: list[int]
    position_attempts: list[int]
    prompt_len: int = 0
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    elapsed_s: float = 0.0

    @property
    def steps(self) -> int:
        """Number of verification steps (target forwards after the prefill)."""
        return len(self.accepted)

    @property
    def tau(self) -> float:
        """Mean tokens emitted per verification step; NaN when no step ran."""
        return sum(self.produced) / len(self.produced) if self.produced else math.nan

    @property
    def acceptance_rates(self) -> list[float]:
        """Per block position: fraction of steps whose proposal there was accepted (with all before)."""
        n = self.steps
        return [a / n if n else math.nan for a in self.position_accepted]

    @property
    def conditional_acceptance_rates(self) -> list[float]:
        """Per block position: accepted / checked (NaN where never checked)."""
        return [a / t if t else math.nan for a, t in zip(self.position_accepted, self.position_attempts)]

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.elapsed_s if self.elapsed_s > 0 else math.nan


# --------------------------------------------------------------------------- target plumbing
def _eos_set(eos_token_id: EosLike) -> frozenset[int]:
    if eos_token_id is None:
        return frozenset()
    if isinstance(eos_token_id, bool):
        raise TypeError("eos_token_id must be an int, a collection of ints or None")
    if isinstance(eos_token_id, int):
        return frozenset((int(eos_token_id),))
    return frozenset(int(e) for e in eos_token_id)


def _check_prompt(prompt_ids: torch.Tensor | Sequence[int]) -> torch.Tensor:
    ids = torch.as_tensor(prompt_ids, dtype=torch.long)
    if ids.dim() == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.dim() != 1 or ids.numel() == 0:
        raise ValueError(f"prompt_ids must be a non-empty 1-D tensor of token ids, got shape {tuple(ids.shape)}")
    return ids


def _list_or_none(pair: tuple[float, float] | None) -> list[float] | None:
    return None if pair is None else [pair[0], pair[1]]


def _check_max_new(max_new_tokens: int) -> int:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    return max_new_tokens


def _device_of(module: nn.Module) -> torch.device:
    for p in module.parameters():
        return p.device
    return torch.device("cpu")


def _new_cache(model: nn.Module) -> Any:
    from transformers import DynamicCache

    try:
        return DynamicCache(config=model.config)
    except TypeError:  # older transformers: no config argument
        return DynamicCache()


def _cache_kwarg(model: nn.Module) -> str:
    """The forward's KV-cache argument: ``cache`` (transformers >= 5.2x) or ``past_key_values``."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


class _TargetRunner:
    """Target forwards for decoding: prefill, verification of a block, rollback of rejected tokens.

    ``layer_ids``: whose outputs to return as captured states (``hidden_states[id + 1]``), or None
    for none (plain greedy decoding). With ``use_cache`` a ``DynamicCache`` holds the committed
    sequence plus the last block; :meth:`commit` crops the rejected tail. Without it every forward
    runs over the whole sequence.
    """

    def __init__(self, model: nn.Module, layer_ids: Sequence[int] | None, use_cache: bool) -> None:
        self.model = model
        self.layer_ids = tuple(layer_ids) if layer_ids is not None else None
        n_layers = int(getattr(model.config, "num_hidden_layers", 0) or 0)
        if self.layer_ids is not None and n_layers and any(not 0 <= i < n_layers for i in self.layer_ids):
            raise ValueError(f"capture layers {self.layer_ids} out of range for a {n_layers}-layer target")
        self.use_cache = use_cache
        self.device = _device_of(model)
        self._cache_kw = _cache_kwarg(model)
        self._cache: Any = None  # a fresh DynamicCache per prefill
        self._seq = torch.empty(0, dtype=torch.long, device=self.device)  # committed tokens (no-cache path)

    def _forward(self, ids: torch.Tensor, keep_logits: int,
                 keep_states: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits ``[keep_logits, V]`` and captured states ``[keep_states, K*d]`` of the last positions
        of ``ids`` (appended to the cache when there is one)."""
        want_states = self.layer_ids is not None
        kw: dict[str, Any] = {"use_cache": self.use_cache, "output_hidden_states": want_states,
                              "logits_to_keep": keep_logits}
        if self.use_cache:
            kw[self._cache_kw] = self._cache
        out = self.model(input_ids=ids[None], **kw)
        logits = out.logits[0, -keep_logits:]
        states = None
        if want_states:
            hs = out.hidden_states
            states = torch.cat([hs[i + 1][0, -keep_states:] for i in self.layer_ids], dim=-1)
        return logits, states

    def prefill(self, prompt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Last-position logits ``[V]`` and captured states of every prompt position ``[P, K*d]``
        (only the last position goes through the LM head: a full-width head would cost P x V)."""
        prompt = prompt.to(self.device)
        if self.use_cache:
            self._cache = _new_cache(self.model)
        else:
            self._seq = prompt
        logits, states = self._forward(prompt, 1, int(prompt.numel()))
        return logits[-1], states

    def verify(self, block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits ``[n, V]`` and states ``[n, K*d]`` of the ``n`` block tokens appended to the sequence."""
        block = block.to(self.device)
        n = int(block.numel())
        ids = block if self.use_cache else torch.cat([self._seq, block])
        return self._forward(ids, n, n)

    def commit(self, block: torch.Tensor, keep: int) -> None:
        """Keep the first ``keep`` tokens of the last verified ``block``; drop the rest."""
        n = int(block.numel())
        if self.use_cache:
            drop = n - keep
            if drop > 0:
                self._cache.crop(-drop)
        else:
            self._seq = torch.cat([self._seq, block[:keep].to(self.device)])


# --------------------------------------------------------------------------- decoding
@torch.no_grad()
def greedy_generate(target_model: nn.Module, prompt_ids: torch.Tensor | Sequence[int], max_new_tokens: int,
                    eos_token_id: EosLike = None, *, use_cache: bool = True) -> list[int]:
    """The target alone, greedily: up to ``max_new_tokens`` tokens, stopping after an EOS (included).

    The reference that :func:`speculative_generate` must reproduce token for token.
    """
    prompt = _check_prompt(prompt_ids)
    budget = _check_max_new(max_new_tokens)
    eos = _eos_set(eos_token_id)
    if budget == 0:
        return []
    runner = _TargetRunner(target_model, None, use_cache)
    logits, _ = runner.prefill(prompt)
    tokens = [int(logits.argmax())]
    while len(tokens) < budget and tokens[-1] not in eos:
        block = torch.tensor([tokens[-1]], dtype=torch.long)
        logits, _ = runner.verify(block)
        runner.commit(block, 1)
        tokens.append(int(logits[-1].argmax()))
    return tokens


@torch.no_grad()
def speculative_generate(target_model: nn.Module, drafter: Any, prompt_ids: torch.Tensor | Sequence[int],
                         max_new_tokens: int, *, eos_token_id: EosLike = None,
                         use_cache: bool = True) -> SpecResult:
    """Greedy speculative decoding of ``prompt_ids`` (1-D) with a DFlash ``drafter``.

    The drafter proposes ``B - 1`` tokens after each anchor (``B = drafter.spec.block_size``), the
    target verifies them in one forward and keeps the longest agreeing prefix plus its own next
    token (module docstring). Stops after ``max_new_tokens`` tokens or an EOS (``eos_token_id``: an
    id, a collection of ids, or None). ``use_cache``: KV cache (default) or a full forward per step.
    """
    t_start = time.perf_counter()
    prompt = _check_prompt(prompt_ids)
    budget = _check_max_new(max_new_tokens)
    eos = _eos_set(eos_token_id)
    spec = drafter.spec
    bs = int(spec.block_size)
    acc_pos = [0] * (bs - 1)
    att_pos = [0] * (bs - 1)
    accepted: list[int] = []
    produced: list[int] = []
    tokens: list[int] = []
    prefill_s = draft_s = verify_s = 0.0
    p_len = int(prompt.numel())
    if budget == 0:
        return SpecResult(tokens, accepted, produced, bs, acc_pos, att_pos, p_len,
                          elapsed_s=time.perf_counter() - t_start)

    runner = _TargetRunner(target_model, spec.target_layer_ids, use_cache)
    d_dev = _device_of(drafter)
    t0 = time.perf_counter()
    logits, states = runner.prefill(prompt)
    tokens.append(int(logits.argmax()))
    prefill_s = time.perf_counter() - t0
    context = states.to(d_dev)  # captured states of positions 0..pos-1
    pos = p_len  # position of the anchor (the last emitted token)

    while len(tokens) < budget and tokens[-1] not in eos:
        n = min(bs - 1, budget - len(tokens) - 1)  # proposals that could still be emitted
        anchor = tokens[-1]
        t0 = time.perf_counter()
        if n > 0:
            draft = drafter.draft_block(context[None], anchor, pos)  # [1, B-1, V]
            proposals = draft[0, :n].argmax(-1).tolist()
        else:
            proposals = []
        t1 = time.perf_counter()
        block = torch.tensor([anchor, *proposals], dtype=torch.long)
        v_logits, v_states = runner.verify(block)
        target_next = v_logits.argmax(-1).tolist()  # target_next[i]: the target's token after block[i]
        verify_s += time.perf_counter() - t1
        draft_s += t1 - t0

        a = 0
        while a < n and proposals[a] == target_next[a]:
            a += 1
        eos_at = next((j for j in range(a) if proposals[j] in eos), None)
        if eos_at is not None:  # an accepted EOS ends the sequence: no bonus, nothing checked after it
            a = eos_at + 1
            new = proposals[:a]
            checked = a
        else:
            new = [*proposals[:a], target_next[a]]
            checked = min(a + 1, n)
        for k in range(checked):
            att_pos[k] += 1
        for k in range(a):
            acc_pos[k] += 1
        accepted.append(a)
        produced.append(len(new))
        tokens.extend(new)

        # The anchor and the accepted proposals are now part of the sequence: their states join the
        # context and the target keeps them; the rejected tail is dropped.
        runner.commit(block, a + 1)
        if v_states is not None:
            context = torch.cat([context, v_states[: a + 1].to(d_dev)], dim=0)
        pos += a + 1

    return SpecResult(tokens=tokens, accepted=accepted, produced=produced, block_size=bs,
                      position_accepted=acc_pos, position_attempts=att_pos, prompt_len=p_len,
                      prefill_s=prefill_s, draft_s=draft_s, verify_s=verify_s,
                      elapsed_s=time.perf_counter() - t_start)


# --------------------------------------------------------------------------- evaluation
def default_eos_ids(target: Any) -> frozenset[int]:
    """EOS ids of a :class:`~dflash.model.target.LoadedTarget`: its tokenizer's and its generation config's."""
    ids: set[int] = set()
    tok = getattr(target, "tokenizer", None)
    tid = getattr(tok, "eos_token_id", None) if tok is not None else None
    gen = getattr(getattr(target, "model", None), "generation_config", None)
    gid = getattr(gen, "eos_token_id", None) if gen is not None else None
    for v in (tid, gid):
        if v is None:
            continue
        ids |= {int(v)} if isinstance(v, int) else {int(x) for x in v}
    return frozenset(ids)


def _nan_to_none(x: float) -> float | None:
    return None if isinstance(x, float) and math.isnan(x) else x


@dataclass
class _Totals:
    steps: int = 0
    produced: int = 0
    new_tokens: int = 0
    elapsed: float = 0.0
    acc: list[int] = field(default_factory=list)
    att: list[int] = field(default_factory=list)


def evaluate_acceptance(target: Any, drafter: Any, prompts: Iterable[torch.Tensor], max_new_tokens: int = 64, *,
                        eos_token_id: EosLike = None, stop_at_eos: bool = True, use_cache: bool = True,
                        compare_greedy: bool = False) -> dict[str, Any]:
    """Speculative decoding of every prompt; tau and per-position acceptance.

    ``target``: a :class:`~dflash.model.target.LoadedTarget` (or anything with ``.model``; ``.tokenizer``
    is used only for the default EOS). Stops at ``eos_token_id`` (default: the tokenizer's and the
    generation config's EOS) unless ``stop_at_eos`` is False. ``compare_greedy`` also runs the target
    alone on each prompt, checks the outputs agree and reports its speed.

    Returns a JSON-ready dict: ``tau`` (tokens per verification step over all steps of all
    prompts), ``tau_ci95`` ([low, high]: bootstrap over prompts, :mod:`dflash.core.stats`),
    ``tau_per_prompt`` (and the per-prompt ``steps``/``produced`` it is made of),
    ``acceptance_rate_per_position`` (``[B-1]``, accepted with all
    before / steps), ``conditional_acceptance_per_position``, the raw counts, ``steps``,
    ``new_tokens``, ``tokens_per_s`` (generated tokens over wall time, prefill included),
    ``num_prompts``, ``block_size``, ``max_new_tokens``, timing splits, and with ``compare_greedy``:
    ``greedy_tokens_per_s``, ``speedup``, ``matches_greedy`` (prompts whose outputs agree).
    """
    model = target.model if hasattr(target, "model") else target
    if stop_at_eos:
        eos: EosLike = default_eos_ids(target) if eos_token_id is None else eos_token_id
    else:
        eos = None
    bs = int(drafter.spec.block_size)
    tot = _Totals(acc=[0] * (bs - 1), att=[0] * (bs - 1))
    per_prompt: list[float | None] = []
    steps_per_prompt: list[int] = []
    produced_per_prompt: list[int] = []
    prompt_lens: list[int] = []
    prefill = draft = verify = 0.0
    greedy_time = 0.0
    greedy_tokens = 0
    matches = 0
    for prompt in prompts:
        res = speculative_generate(model, drafter, prompt, max_new_tokens, eos_token_id=eos, use_cache=use_cache)
        tot.steps += res.steps
        tot.produced += sum(res.produced)
        tot.new_tokens += len(res.tokens)
        tot.elapsed += res.elapsed_s
        tot.acc = [x + y for x, y in zip(tot.acc, res.position_accepted)]
        tot.att = [x + y for x, y in zip(tot.att, res.position_attempts)]
        prefill += res.prefill_s
        draft += res.draft_s
        verify += res.verify_s
        per_prompt.append(_nan_to_none(res.tau))
        steps_per_prompt.append(res.steps)
        produced_per_prompt.append(sum(res.produced))
        prompt_lens.append(res.prompt_len)
        if compare_greedy:
            t0 = time.perf_counter()
            ref = greedy_generate(model, prompt, max_new_tokens, eos, use_cache=use_cache)
            greedy_time += time.perf_counter() - t0
            greedy_tokens += len(ref)
            matches += int(ref == res.tokens)
    steps = tot.steps
    out: dict[str, Any] = {
        "tau": tot.produced / steps if steps else None,
        "tau_ci95": _list_or_none(ratio_bootstrap_ci(produced_per_prompt, steps_per_prompt)),
        "tau_per_prompt": per_prompt,
        "steps_per_prompt": steps_per_prompt,
        "produced_per_prompt": produced_per_prompt,
        "acceptance_rate_per_position": [a / steps if steps else None for a in tot.acc],
        "conditional_acceptance_per_position": [a / t if t else None for a, t in zip(tot.acc, tot.att)],
        "position_accepted": tot.acc,
        "position_attempts": tot.att,
        "steps": steps,
        "new_tokens": tot.new_tokens,
        "tokens_per_s": tot.new_tokens / tot.elapsed if tot.elapsed > 0 else None,
        "elapsed_s": tot.elapsed,
        "prefill_s": prefill,
        "draft_s": draft,
        "verify_s": verify,
        "num_prompts": len(per_prompt),
        "mean_prompt_tokens": sum(prompt_lens) / len(prompt_lens) if prompt_lens else None,
        "block_size": bs,
        "max_new_tokens": max_new_tokens,
    }
    if compare_greedy:
        g_tps = greedy_tokens / greedy_time if greedy_time > 0 else None
        out["greedy_tokens_per_s"] = g_tps
        out["speedup"] = out["tokens_per_s"] / g_tps if g_tps and out["tokens_per_s"] else None
        out["matches_greedy"] = matches
    return out


# --------------------------------------------------------------------------- held-out prompts
def _prompt_messages(conv: Conversation) -> list[dict[str, str]] | None:
    """The messages before the last assistant reply (the reply is what the target must generate)."""
    msgs = [{"role": r, "content": c} for r, c in conv.messages]
    last = max((i for i, m in enumerate(msgs) if m["role"] == "assistant"), default=-1)
    head = msgs[:last] if last >= 0 else msgs
    if not head or head[-1]["role"] != "user" or not head[-1]["content"].strip():
        return None
    return head


def _encode_prompt(tokenizer: Any, msgs: list[dict[str, str]]) -> list[int]:
    text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def render_prompt(tokenizer: Any, messages: Sequence[dict[str, str]] | Conversation,
                  max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS) -> torch.Tensor:
    """Chat-template rendering with the generation prompt, as 1-D token ids of at most ``max_prompt_tokens``.

    ``messages`` are role/content dicts ending with the user turn (a :class:`Conversation` gives the
    turns before its last assistant reply). Too long a prompt is shortened without touching the
    template's scaffolding: earlier turns are dropped first (a user turn stays first), then the last
    user turn's text is cut at the end (the longest prefix that fits, found by bisection).
    """
    if isinstance(max_prompt_tokens, bool) or not isinstance(max_prompt_tokens, int) or max_prompt_tokens < 1:
        raise ValueError(f"max_prompt_tokens must be an integer >= 1, got {max_prompt_tokens!r}")
    if isinstance(messages, Conversation):
        got = _prompt_messages(messages)
        if got is None:
            raise ValueError(f"conversation {messages.id!r} has no user turn to prompt with")
        msgs = got
    else:
        msgs = [{"role": str(m["role"]), "content": str(m["content"])} for m in messages]
    if not msgs:
        raise ValueError("no messages to render")
    ids = _encode_prompt(tokenizer, msgs)
    while len(ids) > max_prompt_tokens and len(msgs) > 1:
        msgs = msgs[1:]
        while len(msgs) > 1 and msgs[0]["role"] != "user":
            msgs = msgs[1:]
        ids = _encode_prompt(tokenizer, msgs)
    if len(ids) <= max_prompt_tokens:
        return torch.tensor(ids, dtype=torch.long)
    content = msgs[-1]["content"]

    def encode_cut(n_chars: int) -> list[int]:
        return _encode_prompt(tokenizer, [*msgs[:-1], {"role": msgs[-1]["role"], "content": content[:n_chars]}])

    best = encode_cut(0)
    if len(best) > max_prompt_tokens:
        raise ValueError(f"the chat template alone takes {len(best)} tokens, more than max_prompt_tokens="
                         f"{max_prompt_tokens}")
    lo, hi = 0, len(content)  # lo fits, hi does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        cand = encode_cut(mid)
        if len(cand) <= max_prompt_tokens:
            lo, best = mid, cand
        else:
            hi = mid
    return torch.tensor(best, dtype=torch.long)


def select_heldout(conversations: Sequence[Conversation], n: int, seed: int,
                   skip_ids: Collection[str] | None = None) -> list[Conversation]:
    """``n`` conversations chosen by ``seed`` (same inputs, same choice) among those with a user turn
    to prompt with and an id not in ``skip_ids`` (e.g. the ids a training run used)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be an integer >= 0, got {n!r}")
    skip = set(skip_ids or ())
    pool = [c for c in conversations if c.id not in skip and _prompt_messages(c) is not None]
    if n > len(pool):
        raise ValueError(f"only {len(pool)} eligible conversations for {n} held-out prompts")
    return random.Random(seed).sample(pool, n)


def heldout_prompts(tokenizer: Any, n: int, seed: int = 0, sample: str = "first_exchange",
                    skip_ids: Collection[str] | None = None, *, dataset: str | Path = "sharegpt",
                    max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS,
                    max_conversations: int | None = None) -> list[torch.Tensor]:
    """``n`` held-out prompts (1-D token ids) from ``dataset`` (default: the packaged ShareGPT).

    Each is the conversation's turns before its last assistant reply (for ``"first_exchange"``: the
    first user turn), rendered with the chat template and the generation prompt and shortened to
    ``max_prompt_tokens`` (:func:`render_prompt`). The choice is deterministic in ``seed`` and
    skips ``skip_ids`` (conversation ids a training run used).
    """
    path = resolve_dataset(str(dataset))
    convs, stats = load_conversations(path, sample, max_conversations)
    say_damaged(path, stats)
    chosen = select_heldout(convs, n, seed, skip_ids)
    return [render_prompt(tokenizer, c, max_prompt_tokens) for c in chosen]


__all__ = [
    "DEFAULT_MAX_PROMPT_TOKENS", "SpecResult", "default_eos_ids", "evaluate_acceptance", "greedy_generate",
    "heldout_prompts", "render_prompt", "select_heldout", "speculative_generate",
]
