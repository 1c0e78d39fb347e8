"""The frozen target model: loading, hidden-state capture, and tokenising conversations for training.

Three pieces the trainer's target workers need:

* :func:`load_target` loads the target frozen and in eval mode, with its tokenizer. Finding it
  (``smollm2``, a directory, a hub id or a ``.gguf``, converted once and cached) is
  :mod:`dflash.data.model_source`'s job; here it is frozen and placed on its device.
* :class:`HiddenStateCapture` runs the target only up to its deepest captured layer (no later
  layers, no final norm, no LM head: with the published K = 5 layers spread up to L - 3 that skips
  ~10% of the layers and, more importantly, the vocabulary-sized head) and returns the K captured
  states concatenated on the last dimension, ``[batch, seq, K * d]``: the queue item's payload.
* :func:`encode_conversation` renders a conversation with the chat template and marks the
  assistant-response tokens (the loss mask), which is where the drafter's anchors and targets live.

The capture layer rule (:func:`capture_layer_ids`) is upstream DFlash's.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dflash.data.conversations import Conversation
from dflash.data.model_source import load_causal_lm


# --------------------------------------------------------------------------- layer choice
def capture_layer_ids(num_layers: int, k: int) -> list[int]:
    """The K target layers whose outputs the drafter reads: upstream DFlash's rule.

    ``round(1 + i * (L - 4) / (K - 1))`` for i = 0..K-1 with Python's ``round`` (banker's rounding,
    as upstream uses it): K layers spread evenly from layer 1 to layer L - 3. SmolLM2 (30 layers,
    K = 5) -> [1, 8, 14, 20, 27]; Qwen3-8B (36 layers) -> [1, 9, 17, 25, 33].

    K = 1 has no spread (the formula divides by zero); upstream's ``build_target_layer_ids`` takes
    the middle layer ``L // 2`` (SmolLM2 -> 15), and so do we, so a K = 1 drafter reads the layer an
    upstream-trained one does. Layer ``id`` is read as ``hidden_states[id + 1]`` of a transformers forward
    with ``output_hidden_states=True`` (index 0 is the embedding output).
    """
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 4:
        raise ValueError(f"num_layers must be an integer >= 4 (the rule spans layers 1..L-3), got {num_layers!r}")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be an integer >= 1, got {k!r}")
    if k > num_layers - 3:
        raise ValueError(f"k = {k} layers do not fit between layer 1 and layer {num_layers - 3}")
    if k == 1:
        return [num_layers // 2]
    ids = [round(1 + i * (num_layers - 4) / (k - 1)) for i in range(k)]
    if len(set(ids)) != k:  # cannot happen for k <= L - 3, but a repeated layer would be silent waste
        raise ValueError(f"capture layers collide: {ids}")
    return ids


# --------------------------------------------------------------------------- loading
@dataclass(frozen=True)
class LoadedTarget:
    """A frozen target and what came with it.

    ``model``: a ``*ForCausalLM`` in eval mode with every parameter ``requires_grad=False``;
    ``tokenizer``: its tokenizer (chat template included); ``source``: what was loaded (resolved
    path or hub id); ``cache_hit``: whether a cached conversion was used; ``load_s``: wall time.
    """

    model: nn.Module
    tokenizer: Any
    source: str
    cache_hit: bool
    load_s: float

    @property
    def config(self) -> Any:
        return self.model.config

    @property
    def num_layers(self) -> int:
        return int(self.model.config.num_hidden_layers)

    @property
    def hidden_size(self) -> int:
        return int(self.model.config.hidden_size)


def _freeze(model: nn.Module) -> nn.Module:
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def load_target(model: str = "smollm2", device: str | torch.device = "cpu",
                dtype: torch.dtype = torch.float32, cache_dir: str | Path | None = None) -> LoadedTarget:
    """Load the target frozen, in eval mode, on ``device`` in ``dtype``, with its tokenizer.

    ``model``: ``"smollm2"`` (the packaged GGUF), a path to a ``.gguf`` file, a local directory of a
    transformers checkpoint, or a hub id (needs network; never used by the defaults). A GGUF is
    dequantised once and cached as float32 safetensors under ``<cache>/models/<stem>-<hash>`` (the
    hash covers the file's path, size and mtime), because dequantising takes ~15-25 s on two cores
    and a safetensors load takes ~1-3 s. ``dtype`` is applied at load time.
    """
    t0 = time.perf_counter()
    dev = torch.device(device)
    # a GPU rank's weights go straight to its device (device_map), never whole in host memory first
    loaded = load_causal_lm(model, dtype, cache_dir, device_map=str(dev) if dev.type == "cuda" else None)
    net = _freeze(loaded.net.to(device=device, dtype=dtype))
    return LoadedTarget(model=net, tokenizer=loaded.tokenizer, source=loaded.source, cache_hit=loaded.cache_hit,
                        load_s=time.perf_counter() - t0)


class TargetTables(nn.Module):
    """The target pieces a drafter rank uses, and only those: its input embedding and LM head (frozen;
    one table where the target ties them) with the target's config. A drafter takes them through
    ``get_input_embeddings``/``get_output_embeddings`` as from the whole model (``DFlashDrafter.from_target``).
    The final norm is not among them: the drafter has its own."""

    def __init__(self, config: Any, embed: nn.Embedding, head: nn.Linear) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = embed
        self.lm_head = head

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head


def load_target_tables(model: str = "smollm2", dtype: torch.dtype = torch.float32,
                       cache_dir: str | Path | None = None) -> LoadedTarget | None:
    """The target's embedding and LM head read from its checkpoint's safetensors shards (``safe_open``:
    only those tensors are read), with its config and tokenizer; no whole model in memory. Why: every
    drafter rank used to hold the whole target for the run (an 8B target on 8 GPUs: ~128 GB of host
    RAM to start). None where there is no local checkpoint (a hub id, an unwritable cache): the
    caller then loads the whole target."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    from dflash.data.model_source import checkpoint_dir, load_tokenizer

    t0 = time.perf_counter()
    d = checkpoint_dir(model, cache_dir)
    if d is None:
        return None
    config = AutoConfig.from_pretrained(str(d), local_files_only=True)
    with torch.device("meta"):  # the names of the two tables in this family's checkpoint, without weights
        skeleton = AutoModelForCausalLM.from_config(config)
    names: dict[int, list[str]] = {}
    for n, p in skeleton.named_parameters(remove_duplicate=False):  # a tied pair: one tensor, both names
        names.setdefault(id(p), []).append(n)
    embed_names = names[id(skeleton.get_input_embeddings().weight)]
    head_names = names[id(skeleton.get_output_embeddings().weight)]
    index = d / "model.safetensors.index.json"
    files = json.loads(index.read_text())["weight_map"] if index.is_file() else None

    def read(candidates: list[str]) -> torch.Tensor | None:
        for name in candidates:
            path = d / (files.get(name, "") if files is not None else "model.safetensors")
            if path.is_file():
                with safe_open(str(path), framework="pt") as f:
                    if name in f.keys():  # noqa: SIM118 (safe_open has no __contains__)
                        return f.get_tensor(name).to(dtype)
        return None

    embed_w = read(embed_names)
    if embed_w is None:
        raise ValueError(f"{d}: none of {embed_names} in the checkpoint")
    embed = nn.Embedding.from_pretrained(embed_w, freeze=True)
    head_w = None if head_names is embed_names else read(head_names)
    if head_w is None and head_names is not embed_names:
        raise ValueError(f"{d}: none of {head_names} in the checkpoint (an untied LM head)")
    head = nn.Linear(embed_w.shape[1], embed_w.shape[0], bias=False, device="meta")
    head.weight = embed.weight if head_w is None else nn.Parameter(head_w, requires_grad=False)
    tables = _freeze(TargetTables(config, embed, head))
    return LoadedTarget(model=tables, tokenizer=load_tokenizer(model, cache_dir), source=str(d), cache_hit=True,
                        load_s=time.perf_counter() - t0)


# --------------------------------------------------------------------------- capture
class _StopForward(Exception):
    """Raised by the hook on the deepest captured layer: nothing after it needs to run."""


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layer list of a transformers causal LM (``model.model.layers`` for Llama/Qwen)."""
    base = getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(f"{type(model).__name__} has no model.layers ModuleList; cannot capture hidden states")
    return layers


def _base_model(model: nn.Module) -> nn.Module:
    base = getattr(model, "model", None)
    return base if isinstance(base, nn.Module) and hasattr(base, "layers") else model


class HiddenStateCapture:
    """Captured target states for a padded batch, computed only as deep as needed.

    ``__call__(input_ids, attention_mask) -> [batch, seq, K * d]``: the outputs of the decoder layers
    ``layer_ids`` (equal to ``hidden_states[id + 1]`` of a full forward with
    ``output_hidden_states=True``), concatenated on the last dimension in layer order.

    How the forward is cut short: forward hooks on the captured decoder layers record their outputs,
    and the hook on the deepest one raises an internal exception that aborts the base model's
    forward right there. The family's own forward (embedding, masks, RoPE, its per-layer details)
    runs unchanged, so this works for any transformers decoder with ``model.layers`` without
    re-implementing it, and later layers, the final norm and the LM head never run. Hooks are
    registered per call and removed in ``finally``, so the model is untouched between calls (it can
    still ``generate``). The target runs under ``torch.inference_mode``; the returned tensor is an
    ordinary tensor without autograd history (the concatenation happens outside inference mode), so
    it can go straight into the drafter's training forward.

    The hooks act only in the calling thread, so a concurrent ``generate`` or capture on the same
    model object from another thread is neither cut short nor mixed into this result (one model per
    target worker is still the intended use).

    Use right padding: padded positions get states too (they see the real tokens before them) but
    the caller's loss mask is 0 there.
    """

    def __init__(self, model: nn.Module, layer_ids: Sequence[int]) -> None:
        layers = _decoder_layers(model)
        ids = [int(i) for i in layer_ids]
        if not ids:
            raise ValueError("layer_ids must not be empty")
        if any(i < 0 or i >= len(layers) for i in ids):
            raise ValueError(f"layer ids {ids} out of range for {len(layers)} layers")
        if len(set(ids)) != len(ids):
            raise ValueError(f"layer ids repeat: {ids}")
        self.model = model
        self.layer_ids = tuple(ids)
        self._layers = layers
        self._base = _base_model(model)

    @property
    def num_layers_run(self) -> int:
        """How many decoder layers one call runs (the deepest captured id + 1)."""
        return max(self.layer_ids) + 1

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        captured: dict[int, torch.Tensor] = {}
        deepest = max(self.layer_ids)
        me = threading.get_ident()

        def make_hook(idx: int):
            def hook(_module: nn.Module, _args: Any, output: Any) -> None:
                if threading.get_ident() != me:  # another thread's forward on the same model
                    return
                hs = output[0] if isinstance(output, (tuple, list)) else output
                captured[idx] = hs
                if idx == deepest:
                    raise _StopForward

            return hook

        handles = [self._layers[i].register_forward_hook(make_hook(i)) for i in self.layer_ids]
        try:
            with torch.inference_mode(), contextlib.suppress(_StopForward):
                self._base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        finally:
            for h in handles:
                h.remove()
        missing = [i for i in self.layer_ids if i not in captured]
        if missing:
            raise RuntimeError(f"layers {missing} did not run")
        # Concatenated OUTSIDE inference mode: the copy is then an ordinary tensor (no autograd
        # history) that the drafter may feed into autograd; an inference tensor would raise
        # "Inference tensors cannot be saved for backward" at the drafter's fusion Linear.
        return torch.cat([captured[i] for i in self.layer_ids], dim=-1)


# --------------------------------------------------------------------------- tokenising
MessagesLike = Conversation | Sequence[tuple[str, str]] | Sequence[Mapping[str, str]]


def _as_messages(messages: MessagesLike) -> list[dict[str, str]]:
    items = messages.messages if isinstance(messages, Conversation) else messages
    out = []
    for m in items:
        if isinstance(m, Mapping):
            out.append({"role": str(m["role"]), "content": str(m["content"])})
        else:
            role, content = m
            out.append({"role": str(role), "content": str(content)})
    return out


def _render(tokenizer: Any, msgs: list[dict[str, str]], gen_prompt: bool) -> str:
    text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen_prompt)
    if not isinstance(text, str):
        raise TypeError("apply_chat_template(tokenize=False) did not return a string")
    return text


def assistant_char_spans(tokenizer: Any, messages: MessagesLike) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of its assistant responses.

    A response span starts where the template's generation prompt ends (rendering the messages
    before it with ``add_generation_prompt=True`` gives a prefix of the full text) and ends after
    the template's end-of-turn text for that message (rendering the messages up to and including it
    gives a longer prefix), minus trailing whitespace. So it covers the response content and the
    end-of-turn token (SmolLM2: ``<|im_end|>``), which the target generates and the drafter must
    predict; it excludes the newline the template puts after ``<|im_end|>`` (the target never
    generates it: decoding stops at end-of-turn) and the next turn's scaffolding.

    Templates whose rendering of a prefix is not a prefix of the whole (e.g. ones that rewrite
    earlier turns) fall back to locating each response's content in order, extended over an
    immediately following EOS token.
    """
    msgs = _as_messages(messages)
    full = _render(tokenizer, msgs, False)
    spans: list[tuple[int, int]] = []
    ok = True
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        before = _render(tokenizer, msgs[:i], True) if i else None
        through = _render(tokenizer, msgs[: i + 1], False)
        if before is None or not full.startswith(before) or not full.startswith(through) \
                or len(through) < len(before):
            ok = False
            break
        end = len(through.rstrip())
        spans.append((len(before), max(end, len(before))))
    if ok:
        return full, spans
    # fallback: content search
    spans = []
    cursor = 0
    eos = getattr(tokenizer, "eos_token", None)
    for m in msgs:
        if m["role"] != "assistant" or not m["content"]:
            continue
        start = full.find(m["content"], cursor)
        if start < 0:
            raise ValueError("cannot locate an assistant response in the rendered chat template")
        end = start + len(m["content"])
        if eos and full.startswith(eos, end):
            end += len(eos)
        spans.append((start, end))
        cursor = end
    return full, spans


def encode_conversation(tokenizer: Any, messages: MessagesLike,
                        max_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, loss_mask)`` of one conversation, 1-D, truncated to ``max_len`` tokens.

    Token ids equal ``apply_chat_template(messages, tokenize=True)`` (the rendered text encoded
    without extra special tokens), so lengths agree with :mod:`dflash.data.lengths`. ``loss_mask`` (bool)
    is True on assistant-response tokens (see :func:`assistant_char_spans`: content plus the
    end-of-turn token) and False on system/user turns and template scaffolding, including the
    ``<|im_start|>assistant\\n`` header. A token is in a response if its first character is.

    ``messages``: a :class:`~dflash.data.conversations.Conversation`, (role, content) pairs, or role/content dicts.
    """
    text, spans = assistant_char_spans(tokenizer, messages)
    try:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(enc["input_ids"])
        starts = [s for s, _ in enc["offset_mapping"]]
    except (NotImplementedError, ValueError, KeyError, TypeError):
        ids, starts = _encode_by_prefixes(tokenizer, text, spans)
    mask = [False] * len(ids)
    j = 0
    for t, s in enumerate(starts):
        while j < len(spans) and s >= spans[j][1]:
            j += 1
        if j < len(spans) and spans[j][0] <= s < spans[j][1]:
            mask[t] = True
    if max_len is not None:
        if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1:
            raise ValueError(f"max_len must be an integer >= 1, got {max_len!r}")
        ids, mask = ids[:max_len], mask[:max_len]
    return torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.bool)


def _encode_by_prefixes(tokenizer: Any, text: str,
                        spans: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """Slow tokenizers without offsets: token start characters from prefix token counts at span edges."""
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    starts = [0] * len(ids)
    edges = sorted({e for span in spans for e in span})
    counts = [len(tokenizer(text[:e], add_special_tokens=False)["input_ids"]) for e in edges]
    # every token from counts[k] on starts at or after edges[k]
    for e, c in zip(edges, counts):
        for t in range(min(c, len(ids)), len(ids)):
            starts[t] = e
    return ids, starts


def collate(batch: Sequence[tuple[torch.Tensor, torch.Tensor]],
            pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-pad encoded sequences: ``(input_ids, attention_mask, loss_mask)``, each ``[n, max_len]``."""
    if not batch:
        raise ValueError("empty batch")
    n, s = len(batch), max(int(ids.numel()) for ids, _ in batch)
    input_ids = torch.full((n, s), int(pad_id), dtype=torch.long)
    attention_mask = torch.zeros((n, s), dtype=torch.long)
    loss_mask = torch.zeros((n, s), dtype=torch.bool)
    for r, (ids, lm) in enumerate(batch):
        k = int(ids.numel())
        input_ids[r, :k] = ids
        attention_mask[r, :k] = 1
        loss_mask[r, :k] = lm.bool()
    return input_ids, attention_mask, loss_mask
